"""LoRA for embedding tables against the materialized table and against HF PEFT."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import all_eqns, close, example_count
from hypothesis import given, settings, strategies as st

from peftx.adapters import LoraArray, LoraEmbeddingArray, lora_embedding, merge
from peftx.implicit import (
    MaterializationWarning,
    materialization_policy,
    strict,
    use_implicit_args,
)

N, D, R = 11, 7, 3


def _embedding(key, num=N, dim=D, r=R, **kwargs):
    """An `eqx.nn.Embedding` whose table carries a random (nonzero) LoRA."""
    kt, kl = jax.random.split(key)
    table = jax.random.normal(kt, (num, dim))
    adapted = lora_embedding(table, r=r, lora_alpha=5.0, init="random", key=kl, **kwargs)
    return eqx.tree_at(lambda e: e.weight, eqx.nn.Embedding(weight=table), adapted)


def _with_factors(emb, a, b):
    return eqx.tree_at(
        lambda e: (e.weight.lora_embedding_A, e.weight.lora_embedding_B), emb, (a, b)
    )


def _dense(emb):
    return eqx.tree_at(lambda e: e.weight, emb, emb.weight.materialize())


def _check_against_dense(fn, emb, inputs, tol=1e-5):
    """`fn(emb, inputs)` through the handlers (jitted, strict) vs through the dense table:
    values, and gradients with respect to both factors."""
    a, b = emb.weight.lora_embedding_A, emb.weight.lora_embedding_B

    def implicit_loss(a, b, emb, inputs):
        return jnp.sum(jnp.sin(use_implicit_args(fn)(_with_factors(emb, a, b), inputs)))

    def dense_loss(a, b, emb, inputs):
        return jnp.sum(jnp.sin(fn(_dense(_with_factors(emb, a, b)), inputs)))

    with strict():
        got = jax.jit(use_implicit_args(fn))(emb, inputs)
        grads = jax.jit(jax.grad(implicit_loss, argnums=(0, 1)))(a, b, emb, inputs)
    want = fn(_dense(emb), inputs)
    close(got, want, tol)
    close(grads, jax.grad(dense_loss, argnums=(0, 1))(a, b, emb, inputs), 10 * tol)
    # the adapter really contributes, so a handler that dropped it would fail above
    assert not np.allclose(
        want, fn(eqx.tree_at(lambda e: e.weight, emb, emb.weight.weight), inputs)
    )
    return got


# ---------------------------------------------------------------- lookups and products


def _inputs(kind, key):
    if kind == "ids":
        return jax.random.randint(key, (5,), 0, N)
    if kind == "token":
        return jnp.int32(N - 2)
    if kind == "ids 2-D":
        return jax.random.randint(key, (2, 4), 0, N)
    return jax.random.normal(key, (3, D))  # hidden states


LOOKUPS = {
    "vmap(Embedding)": (lambda e, i: jax.vmap(e)(i), "ids"),
    "Embedding(token)": (lambda e, i: e(i), "token"),
    "table[ids] 2-D": (lambda e, i: e.weight[i], "ids 2-D"),
    "take rows": (lambda e, i: jnp.take(e.weight, i, axis=0, mode="clip"), "ids"),
    "row slices under vmap": (
        lambda e, i: jax.vmap(lambda row, j: jax.lax.dynamic_slice(row, (j,), (D,)))(e.weight, i),
        "rows",
    ),
    "x @ table.T": (lambda e, x: x @ e.weight.T, "hidden"),
    "einsum vd,td->tv": (lambda e, x: jnp.einsum("vd,td->tv", e.weight, x), "hidden"),
}


@pytest.mark.parametrize("lookup", list(LOOKUPS))
def test_lookups_and_products_match_materialized(getkey, lookup):
    fn, kind = LOOKUPS[lookup]
    inputs = jnp.zeros((N,), jnp.int32) if kind == "rows" else _inputs(kind, getkey())
    _check_against_dense(fn, _embedding(getkey()), inputs)


def test_token_lookup_vmapped_outside_use_implicit_args(getkey):
    emb = _embedding(getkey())
    ids = jax.random.randint(getkey(), (6,), 0, N)
    with strict():
        got = jax.jit(jax.vmap(use_implicit_args(lambda e, i: e(i)), in_axes=(None, 0)))(emb, ids)
    close(got, emb.weight.materialize()[ids])


def test_out_of_range_ids_are_filled_as_on_the_table(getkey):
    emb = _embedding(getkey())
    ids = jnp.array([1, N, -1, N + 5])

    def fn(e, i):
        return jnp.take(e.weight, i, axis=0, mode="fill", fill_value=2.5)

    with strict():
        got = jax.jit(use_implicit_args(fn))(emb, ids)
    want = fn(_dense(emb), ids)
    close(got, want)
    np.testing.assert_array_equal(got[1], jnp.full((D,), 2.5))


def test_lookups_never_form_the_table(getkey):
    num, dim = 50, 40
    emb = _embedding(getkey(), num=num, dim=dim, r=2)
    ids = jax.random.randint(getkey(), (2, 5), 0, num)
    a, b = emb.weight.lora_embedding_A, emb.weight.lora_embedding_B

    def loss(a, b, emb, ids):
        looked_up = use_implicit_args(lambda e, i: jax.vmap(jax.vmap(e))(i))
        return jnp.sum(jnp.sin(looked_up(_with_factors(emb, a, b), ids)))

    with strict():
        jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(a, b, emb, ids)
    shapes = [tuple(v.aval.shape) for eqn in all_eqns(jaxpr.jaxpr) for v in eqn.outvars]
    assert any(s == (2, 5, dim) for s in shapes), "no lookup traced"
    assert (num, dim) not in shapes and (dim, num) not in shapes


@settings(max_examples=example_count(6), deadline=None)
@given(
    num=st.integers(1, 9),
    dim=st.integers(1, 9),
    n_ids=st.integers(1, 6),
    via_embedding=st.booleans(),
    data=st.data(),
)
def test_gather_any_shape(num, dim, n_ids, via_embedding, data):
    r = data.draw(st.integers(1, min(num, dim)), label="r")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    k1, k2 = jax.random.split(jax.random.key(seed))
    emb = _embedding(k1, num=num, dim=dim, r=r)
    ids = jax.random.randint(k2, (n_ids,), 0, num)

    def fn(e, i):
        return jax.vmap(e)(i) if via_embedding else e.weight[i]

    a, b = emb.weight.lora_embedding_A, emb.weight.lora_embedding_B
    # jitted, both sides: one compile each, not one per operation
    with strict():
        got = jax.jit(use_implicit_args(fn))(emb, ids)
        grads = jax.jit(
            jax.grad(
                lambda a, b: jnp.sum(use_implicit_args(fn)(_with_factors(emb, a, b), ids) ** 2),
                argnums=(0, 1),
            )
        )(a, b)
    close(got, eqx.filter_jit(lambda e: fn(_dense(e), ids))(emb), tol=1e-4)
    want = jax.jit(
        jax.grad(
            lambda a, b: jnp.sum(fn(_dense(_with_factors(emb, a, b)), ids) ** 2), argnums=(0, 1)
        )
    )(a, b)
    close(grads, want, tol=1e-3)


@pytest.mark.parametrize(
    "fn",
    [
        pytest.param(lambda t, i: t[:, i], id="columns"),
        pytest.param(lambda t, i: jax.lax.dynamic_slice(t, (i[0], 1), (2, 3)), id="sub-block"),
    ],
)
def test_partial_slices_fall_back_to_the_dense_table(getkey, fn):
    w = _embedding(getkey()).weight
    ids = jnp.array([0, 2])
    with materialization_policy("warn"), pytest.warns(MaterializationWarning, match="LoraEmb"):
        got = use_implicit_args(fn)(w, ids)
    close(got, fn(w.materialize(), ids))


def test_astype_casts_the_table_only(getkey):
    w = _embedding(getkey()).weight
    with strict():
        h = use_implicit_args(lambda w: w.astype(jnp.bfloat16))(w)
    assert isinstance(h, LoraEmbeddingArray)
    assert h.weight.dtype == jnp.bfloat16 and h.lora_embedding_A.dtype == jnp.float32
    ids = jnp.array([3, 0, 9])
    with strict():
        got = use_implicit_args(lambda t, i: t[i])(h, ids)
    assert got.dtype == jnp.bfloat16
    # Three bfloat16 roundings (the table, the low-rank rows, their sum), each of at most
    # |t| + |d| for table entry t and delta d; and the float32 rank-R product in d.
    u, u32 = (float(jnp.finfo(t).eps) / 2 for t in (jnp.bfloat16, jnp.float32))
    delta = w.scaling * (jnp.abs(w.lora_embedding_B) @ jnp.abs(w.lora_embedding_A)).T
    bound = 2 * u * (jnp.abs(w.weight) + delta) + (R + 1) * u32 * delta
    assert jnp.all(jnp.abs(got.astype(jnp.float32) - w.materialize()[ids]) <= bound[ids])


def test_as_lora_and_merge_give_the_same_table(getkey):
    w = _embedding(getkey(), use_rslora=True).weight
    as_lora = w.as_lora()
    assert isinstance(as_lora, LoraArray) and as_lora.scaling == w.scaling == 5.0 / math.sqrt(R)
    close(as_lora.materialize(), w.materialize())
    close(merge(w), w.materialize())
    close(w.materialize(), w.weight + w.scaling * (w.lora_embedding_B @ w.lora_embedding_A).T)


# ---------------------------------------------------------------- initialization


@pytest.mark.parametrize("init", ["default", "gaussian"])
def test_init_keeps_the_base_output(getkey, init):
    table = jax.random.normal(getkey(), (N, D))
    w = lora_embedding(table, r=R, lora_alpha=16.0, init=init, key=getkey())
    assert not jnp.any(w.lora_embedding_A)
    # lora_embedding_B is standard normal (PEFT's `nn.init.normal_`). Over n draws the
    # sample mean has standard error 1/sqrt(n) and the sample std 1/sqrt(2(n - 1)): allow
    # 5 standard errors (a false alarm about once in 10**6 keys), on a wide table.
    b = lora_embedding(jnp.zeros((N, 512)), r=16, init=init, key=getkey()).lora_embedding_B
    n = b.size
    assert abs(float(jnp.mean(b))) <= 5 / math.sqrt(n)
    assert abs(float(jnp.std(b)) - 1) <= 5 / math.sqrt(2 * (n - 1))
    emb = eqx.tree_at(lambda e: e.weight, eqx.nn.Embedding(weight=table), w)
    ids = jax.random.randint(getkey(), (6,), 0, N)
    x = jax.random.normal(getkey(), (2, D))
    with strict():
        looked_up = use_implicit_args(lambda e, i: jax.vmap(e)(i))(emb, ids)
        head = use_implicit_args(lambda e, x: x @ e.weight.T)(emb, x)
    np.testing.assert_array_equal(looked_up, table[ids])
    # the tied-head product: the base's, to one float32 product's rounding
    base = np.asarray(x, np.float64) @ np.asarray(table, np.float64).T
    bound = 8 * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(table).T)
    assert np.all(np.abs(np.asarray(head, np.float64) - base) <= bound)


def test_random_init_is_nonzero_and_rslora_scales(getkey):
    w = lora_embedding(jnp.ones((N, D)), r=4, lora_alpha=8.0, init="random", key=getkey())
    assert jnp.all(w.lora_embedding_A != 0) and jnp.all(w.lora_embedding_B != 0)
    assert w.scaling == 2.0
    rs = lora_embedding(jnp.ones((N, D)), r=4, lora_alpha=8.0, use_rslora=True, key=getkey())
    assert rs.scaling == 4.0


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"r": 0}, ValueError, r"rank r=0 for an embedding table of shape \(11, 7\) must be at"),
        ({"init": "pissa"}, ValueError, r"'pissa' is not supported for embedding tables"),
        ({"init": "olora"}, ValueError, r"olora"),
    ],
)
def test_bad_lora_embedding_arguments(getkey, kwargs, error, match):
    # runtime type checking (beartype) may reject a bad Literal first, as a TypeError
    with pytest.raises((error, TypeError), match=match):
        lora_embedding(jnp.ones((N, D)), key=getkey(), **{"r": 2, **kwargs})


def test_bad_lora_embedding_arrays():
    table = jnp.ones((N, D))
    with pytest.raises(ValueError, match=r"\(num_embeddings, embedding_dim\), got shape \(11,\)"):
        lora_embedding(jnp.ones(N), key=jax.random.key(0))
    with pytest.raises(
        ValueError, match=r"\(num_embeddings, embedding_dim\), got shape \(2, 3, 4\)"
    ):
        LoraEmbeddingArray(jnp.ones((2, 3, 4)), jnp.ones((1, 2)), jnp.ones((3, 1)), lora_alpha=1)
    expected = r"expected lora_embedding_A \(2, 11\) and lora_embedding_B \(7, 2\) for rank r=2"
    with pytest.raises(ValueError, match=expected + r", got lora_embedding_A \(2, 7\)"):
        # the Linear layout (r, in) by mistake
        LoraEmbeddingArray(table, jnp.ones((2, D)), jnp.ones((N, 2)), lora_alpha=1)
    with pytest.raises(ValueError, match=expected):
        LoraEmbeddingArray(table, jnp.ones((2, N)), jnp.ones((2, D)), lora_alpha=1)
    with pytest.raises(TypeError, match="must share a dtype, got float32 and bfloat16"):
        LoraEmbeddingArray(table, jnp.ones((2, N)), jnp.ones((D, 2), jnp.bfloat16), lora_alpha=1)
    with pytest.raises(TypeError, match="lora_embedding_A must be a floating-point array"):
        LoraEmbeddingArray(table, jnp.ones((2, N), int), jnp.ones((D, 2), int), lora_alpha=1)
    with pytest.raises(TypeError, match="embedding table must be floating-point, got dtype int"):
        LoraEmbeddingArray(jnp.ones((N, D), int), jnp.ones((2, N)), jnp.ones((D, 2)), lora_alpha=1)


# ---------------------------------------------------------------- HF PEFT


class _TorchModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(N, D)

    def forward(self, ids):
        return self.embed(ids)


def _torch(x):
    return np.asarray(x.detach().numpy())


def _peft_embedding(**config):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(_TorchModel(), LoraConfig(target_modules=["embed"], **config))
    return model.base_model.model.embed


@pytest.mark.parametrize("use_rslora", [False, True])
def test_embedding_matches_peft(use_rslora):
    layer = _peft_embedding(r=4, lora_alpha=6, init_lora_weights=False, use_rslora=use_rslora)
    w = LoraEmbeddingArray(
        jnp.asarray(_torch(layer.base_layer.weight)),
        jnp.asarray(_torch(layer.lora_embedding_A["default"])),
        jnp.asarray(_torch(layer.lora_embedding_B["default"])),
        lora_alpha=6,
        use_rslora=use_rslora,
    )
    assert w.scaling == layer.scaling["default"]
    emb = eqx.tree_at(lambda e: e.weight, eqx.nn.Embedding(N, D, key=jax.random.key(0)), w)
    ids = np.random.default_rng(0).integers(0, N, size=(3, 5))
    out_t = layer(torch.tensor(ids))
    out_t.sin().sum().backward()

    def fn(e, i):
        return jax.vmap(jax.vmap(e))(i)

    with strict():
        out = jax.jit(use_implicit_args(fn))(emb, ids)
        grads = jax.grad(lambda e: jnp.sum(jnp.sin(use_implicit_args(fn)(e, ids))))(emb)
    close(out, _torch(out_t))
    close(grads.weight.lora_embedding_A, _torch(layer.lora_embedding_A["default"].grad), 1e-4)
    close(grads.weight.lora_embedding_B, _torch(layer.lora_embedding_B["default"].grad), 1e-4)


@pytest.mark.parametrize("peft_init,init", [(True, "default"), ("gaussian", "gaussian")])
def test_default_init_matches_peft(getkey, peft_init, init):
    layer = _peft_embedding(r=4, lora_alpha=6, init_lora_weights=peft_init)
    a, b = layer.lora_embedding_A["default"], layer.lora_embedding_B["default"]
    assert not torch.any(a) and torch.all(b != 0)
    ids = torch.arange(N)
    assert torch.equal(layer(ids), layer.base_layer(ids))
    # ours has the same shapes and the same structure
    w = lora_embedding(jnp.asarray(_torch(layer.base_layer.weight)), r=4, init=init, key=getkey())
    assert w.lora_embedding_A.shape == tuple(a.shape) and w.lora_embedding_B.shape == tuple(b.shape)
    assert not jnp.any(w.lora_embedding_A) and jnp.all(w.lora_embedding_B != 0)
