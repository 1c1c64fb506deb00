"""LoRA and DoRA against materialized weights and against HF PEFT in PyTorch."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import all_eqns, close
from hypothesis import given, settings, strategies as st

from peftx.adapters import (
    DoraArray,
    LoraArray,
    dora,
    lora,
    unmerge,
    with_dropout,
    without_dropout,
)
from peftx.implicit import strict, use_implicit_args


def _random_lora(key, shape=(6, 5), r=2, **kwargs):
    kw, kl = jax.random.split(key)
    return lora(jax.random.normal(kw, shape), r=r, lora_alpha=4.0, init="random", key=kl, **kwargs)


# ---------------------------------------------------------------- layouts


LAYOUTS = {
    "eqx W @ x": lambda w, x: w @ x[0],
    "vmap(W @ x)": lambda w, x: jax.vmap(lambda v: w @ v)(x),
    "x @ W.T": lambda w, x: x @ w.T,
    "einsum oi,bi->bo": lambda w, x: jnp.einsum("oi,bi->bo", w, x),
    "W @ X.T": lambda w, x: w @ x.T,
    "3-D x": lambda w, x: jnp.einsum("oi,tbi->tbo", w, jnp.stack([x, 2 * x])),
}


@pytest.mark.parametrize("adapter", ["lora", "dora"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_and_gradients_match_materialized(getkey, adapter, layout):
    fn = LAYOUTS[layout]
    w = _random_lora(getkey())
    if adapter == "dora":
        w = dora(w)
        w = eqx.tree_at(lambda d: d.lora_magnitude_vector, w, w.lora_magnitude_vector * 1.5)
    x = jax.random.normal(getkey(), (3, 5))
    params, static = eqx.partition(w, lambda leaf: leaf is not w.weight and eqx.is_array(leaf))

    def loss(params, x, f):
        return jnp.sum(jnp.sin(f(eqx.combine(params, static), x)))

    def implicit_loss(params, x, f):
        return jnp.sum(jnp.sin(use_implicit_args(f)(eqx.combine(params, static), x)))

    def dense(w, x):
        return fn(w.materialize(), x)

    if adapter == "dora":  # PEFT detaches the norm: compare with that dense formula

        def dense(w, x):  # noqa: F811
            v = w.weight + w.delta()
            norm = jax.lax.stop_gradient(jnp.linalg.norm(v, axis=1))
            return fn(v * (w.lora_magnitude_vector / norm)[:, None], x)

    with strict():
        got = jax.jit(use_implicit_args(fn))(w, x)
        grads = jax.jit(jax.grad(implicit_loss, argnums=(0, 1)), static_argnums=2)(params, x, fn)
    close(got, fn(w.materialize(), x))
    close(grads, jax.grad(loss, argnums=(0, 1))(params, x, dense), tol=1e-4)


@st.composite
def weight_product(draw):
    """A dot_general between a 2-D weight and x, with each weight axis contracted,
    batched or free (not both free), x carrying extra free and batch axes."""
    roles = draw(st.sampled_from([("f", "c"), ("c", "f"), ("c", "c"), ("b", "c"), ("c", "b")]))
    w_shape = (draw(st.integers(2, 5)), draw(st.integers(2, 5)))
    n_extra_batch = draw(st.integers(0, 1))
    n_free = draw(st.integers(0, 2))
    x_axes = [("w", i) for i, role in enumerate(roles) if role != "f"]
    x_axes += [("B", j) for j in range(n_extra_batch)] + [("F", j) for j in range(n_free)]
    x_axes = draw(st.permutations(x_axes))
    extra = [draw(st.integers(1, 3)) for _ in range(n_extra_batch + n_free)]
    x_shape = tuple(
        w_shape[i] if kind == "w" else extra[i if kind == "B" else n_extra_batch + i]
        for kind, i in x_axes
    )
    w_c = tuple(i for i, role in enumerate(roles) if role == "c")
    w_b = tuple(i for i, role in enumerate(roles) if role == "b")
    x_c = tuple(x_axes.index(("w", i)) for i in w_c)
    x_b = tuple(x_axes.index(("w", i)) for i in w_b)
    w_first = draw(st.booleans())
    dims = ((w_c, x_c), (w_b, x_b)) if w_first else ((x_c, w_c), (x_b, w_b))
    return w_shape, x_shape, dims, w_first


@settings(max_examples=25, deadline=None)
@given(case=weight_product(), seed=st.integers(0, 2**16))
def test_lora_dot_general_any_layout(case, seed):
    w_shape, x_shape, dims, w_first = case
    k1, k2 = jax.random.split(jax.random.key(seed))
    w = _random_lora(k1, w_shape, r=1)
    x = jax.random.normal(k2, x_shape)

    def fn(w, x):
        return jax.lax.dot_general(w, x, dims) if w_first else jax.lax.dot_general(x, w, dims)

    with strict():
        got = jax.jit(use_implicit_args(fn))(w, x)
        ga, gb = jax.grad(
            lambda a, b: jnp.sum(
                use_implicit_args(fn)(eqx.tree_at(lambda m: (m.lora_A, m.lora_B), w, (a, b)), x)
                ** 2
            ),
            argnums=(0, 1),
        )(w.lora_A, w.lora_B)
    close(got, fn(w.materialize(), x), tol=1e-4)
    want = jax.grad(
        lambda a, b: jnp.sum(
            fn(eqx.tree_at(lambda m: (m.lora_A, m.lora_B), w, (a, b)).materialize(), x) ** 2
        ),
        argnums=(0, 1),
    )(w.lora_A, w.lora_B)
    close((ga, gb), want, tol=1e-3)


def test_transpose_stays_a_lora(getkey):
    w = _random_lora(getkey())
    with strict():
        t = use_implicit_args(lambda w: w.T)(w)
    assert isinstance(t, LoraArray) and t.shape == (5, 6) and t.r == w.r
    close(t.materialize(), w.materialize().T)


def test_astype_stays_a_lora(getkey):
    w = _random_lora(getkey())
    with strict():
        h = use_implicit_args(lambda w: w.astype(jnp.bfloat16))(w)
    assert isinstance(h, LoraArray) and h.dtype == jnp.bfloat16


def test_frozen_weight_gets_no_gradient_computation(getkey):
    """With W in the frozen partition, the backward pass forms no weight-shaped product."""
    w = _random_lora(getkey(), (64, 48), r=4)
    x = jax.random.normal(getkey(), (32, 48))
    params, static = eqx.partition(w, lambda leaf: leaf is not w.weight and eqx.is_array(leaf))

    def loss_fn(params):
        model = eqx.combine(params, static)
        return jnp.sum(
            jnp.tanh(jax.vmap(lambda v: use_implicit_args(lambda m, v: m @ v)(model, v))(x))
        )

    jaxpr = jax.make_jaxpr(jax.grad(loss_fn))(params)
    shapes = [
        tuple(v.aval.shape)
        for eqn in all_eqns(jaxpr.jaxpr)
        if eqn.primitive.name == "dot_general"
        for v in eqn.outvars
    ]
    assert shapes, "no products traced"
    assert (64, 48) not in shapes and (48, 64) not in shapes


# ---------------------------------------------------------------- initialization


def test_default_init_gives_exactly_the_base_output(getkey):
    weight = jax.random.normal(getkey(), (6, 5))
    w = lora(weight, r=3, lora_alpha=16.0, key=getkey())
    x = jax.random.normal(getkey(), (4, 5))
    with strict():
        got = jax.vmap(use_implicit_args(lambda w, v: w @ v), in_axes=(None, 0))(w, x)
    np.testing.assert_array_equal(got, jax.vmap(lambda v: weight @ v)(x))
    bound = 1 / math.sqrt(5)
    assert jnp.all(jnp.abs(w.lora_A) <= bound) and jnp.std(w.lora_A) > bound / 3
    assert not jnp.any(w.lora_B)


def test_gaussian_init(getkey):
    w = lora(jnp.zeros((300, 400)), r=4, init="gaussian", key=getkey())
    np.testing.assert_allclose(jnp.std(w.lora_A), 1 / 4, rtol=0.05)
    assert not jnp.any(w.lora_B)


def test_pissa_init_keeps_the_output_and_takes_the_top_singular_directions(getkey):
    weight = jax.random.normal(getkey(), (8, 6))
    w = lora(weight, r=2, lora_alpha=4.0, init="pissa", key=getkey())
    close(w.materialize(), weight)
    s = jnp.linalg.svd(weight, compute_uv=False)
    top = jnp.linalg.svd(w.delta(), compute_uv=False)[:2]
    close(top, s[:2], tol=1e-4)
    residual_s = jnp.linalg.svd(w.weight, compute_uv=False)
    close(residual_s[:4], s[2:6], tol=1e-4)


def test_rslora_scaling(getkey):
    w = lora(jnp.ones((8, 8)), r=4, lora_alpha=8.0, use_rslora=True, key=getkey())
    assert w.scaling == 8.0 / 2.0
    assert lora(jnp.ones((8, 8)), r=4, lora_alpha=8.0, key=getkey()).scaling == 2.0


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"r": 0}, ValueError, r"rank r=0 for a weight of shape \(6, 5\) must be at least 1"),
        ({"r": 6, "init": "pissa"}, ValueError, r"PiSSA takes r=6 .* has only 5; use r <= 5"),
        ({"init": "olora"}, ValueError, r"olora"),
        ({"lora_dropout": 1.0}, ValueError, r"lora_dropout must be in \[0, 1\)"),
    ],
)
def test_bad_lora_arguments(getkey, kwargs, error, match):
    # runtime type checking (beartype) may reject a bad Literal first, as a TypeError
    with pytest.raises((error, TypeError), match=match):
        lora(jnp.ones((6, 5)), key=getkey(), **{"r": 2, **kwargs})


def test_bad_lora_arrays():
    with pytest.raises(ValueError, match=r"weight of 2 or more dimensions, got shape \(5,\)"):
        lora(jnp.ones(5), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"expected lora_A \(2, 5\) and lora_B \(6, 2\)"):
        LoraArray(jnp.ones((6, 5)), jnp.ones((2, 4)), jnp.ones((6, 2)), lora_alpha=1.0)
    with pytest.raises(TypeError, match="must share a dtype"):
        LoraArray(
            jnp.ones((6, 5)), jnp.ones((2, 5)), jnp.ones((6, 2), jnp.bfloat16), lora_alpha=1.0
        )
    with pytest.raises(TypeError, match="lora_A must be a floating-point array"):
        LoraArray(jnp.ones((6, 5)), jnp.ones((2, 5), int), jnp.ones((6, 2), int), lora_alpha=1.0)
    with pytest.raises(TypeError, match="PiSSA"):
        lora(jnp.ones((6, 5), jnp.int32), r=2, init="pissa", key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"lora_magnitude_vector must have shape \(6,\)"):
        DoraArray(jnp.ones((6, 5)), jnp.ones((2, 5)), jnp.ones((6, 2)), jnp.ones(5), lora_alpha=1.0)


# ---------------------------------------------------------------- dropout


def test_dropout_masks_the_adapter_input_only(getkey):
    w = _random_lora(getkey(), lora_dropout=0.5)
    x = jax.random.normal(getkey(), (4, 5))
    key = getkey()
    trained = with_dropout(w, key)

    def fn(w, x):
        return x @ w.T

    with strict():
        got = use_implicit_args(fn)(trained, x)
        no_key = use_implicit_args(fn)(without_dropout(trained), x)
    keep = jax.random.bernoulli(trained.dropout_key, 0.5, x.shape)
    x_d = jnp.where(keep, x / 0.5, 0.0)
    want = x @ w.weight.T + w.scaling * (x_d @ w.lora_A.T) @ w.lora_B.T
    close(got, want)
    close(no_key, fn(w.materialize(), x))
    assert not np.allclose(got, no_key)


def test_with_dropout_gives_each_adapter_its_own_key(getkey):
    model = [_random_lora(getkey(), lora_dropout=0.1) for _ in range(3)]
    keys = [m.dropout_key for m in with_dropout(model, getkey())]
    data = {tuple(np.asarray(jax.random.key_data(k))) for k in keys}
    assert len(data) == 3


# ---------------------------------------------------------------- models


def _stacked_lora_layers(key, n=4, d=6, r=2, use_dora=False):
    def make(k):
        kw, kl = jax.random.split(k)
        w = lora(jax.random.normal(kw, (d, d)) / 2, r=r, lora_alpha=4.0, init="random", key=kl)
        return dora(w) if use_dora else w

    return eqx.filter_vmap(make)(jax.random.split(key, n))


@pytest.mark.parametrize("use_dora", [False, True])
def test_scan_over_stacked_lora_layers(getkey, use_dora):
    layers = _stacked_lora_layers(getkey(), use_dora=use_dora)
    x = jax.random.normal(getkey(), (3, 6))
    params, static = eqx.partition(layers, lambda a: a is not layers.weight and eqx.is_array(a))

    def forward(layers, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w.T), None), x, layers)[0]

    def loss(params, implicit):
        model = eqx.combine(params, static)
        out = use_implicit_args(forward)(model, x) if implicit else forward(model, x)
        return jnp.sum(out**2)

    dense_layers = eqx.filter_vmap(lambda w: w.materialize())(layers)
    with strict():
        got = jax.jit(use_implicit_args(forward))(layers, x)
        grads = jax.jit(jax.grad(loss), static_argnums=1)(params, True)

    def dense_loss(params):
        model = eqx.combine(params, static)
        return jnp.sum(forward(eqx.filter_vmap(lambda w: w.materialize())(model), x) ** 2)

    close(got, forward(dense_layers, x))
    close(grads, jax.grad(dense_loss)(params), tol=1e-4)


def test_vmap_over_stacked_loras_inside_use_implicit_args(getkey):
    """A vmapped stack reaches the handler with a batch axis on the weight."""
    layers = _stacked_lora_layers(getkey())
    x = jax.random.normal(getkey(), (4, 6))
    with strict():
        got = use_implicit_args(lambda w, x: jax.vmap(lambda w, v: w @ v)(w, x))(layers, x)
    dense = eqx.filter_vmap(lambda w: w.materialize())(layers)
    close(got, jnp.einsum("loi,li->lo", dense, x))


@pytest.mark.parametrize("conv", ["Conv1d", "Conv2d"])
def test_conv_lora(getkey, conv):
    dims = 1 if conv == "Conv1d" else 2
    layer = getattr(eqx.nn, conv)(3, 4, 3, stride=2, padding=1, key=getkey())
    w = lora(layer.weight, r=2, lora_alpha=4.0, init="random", key=getkey())
    assert w.lora_A.shape == (2, 3, *(3,) * dims) and w.lora_B.shape == (4, 2, *(1,) * dims)
    adapted = eqx.tree_at(lambda m: m.weight, layer, w)
    x = jax.random.normal(getkey(), (3, *(9,) * dims))
    merged = eqx.tree_at(lambda m: m.weight, layer, w.materialize())
    with strict():
        got = eqx.filter_jit(use_implicit_args(adapted))(x)
        g = jax.grad(
            lambda a: jnp.sum(
                use_implicit_args(eqx.tree_at(lambda m: m.weight.lora_A, adapted, a))(x) ** 2
            )
        )(w.lora_A)
    close(got, merged(x), tol=1e-4)
    want = jax.grad(
        lambda a: jnp.sum(
            eqx.tree_at(
                lambda m: m.weight, layer, eqx.tree_at(lambda m: m.lora_A, w, a).materialize()
            )(x)
            ** 2
        )
    )(w.lora_A)
    close(g, want, tol=1e-3)


# ---------------------------------------------------------------- merge


def test_merge_and_unmerge(getkey):
    w = _random_lora(getkey())
    merged = w.materialize()
    close(merged, w.weight + w.scaling * w.lora_B @ w.lora_A)
    close(unmerge(merged, w).weight, w.weight)
    d = dora(w)
    d = eqx.tree_at(lambda m: m.lora_magnitude_vector, d, d.lora_magnitude_vector * 2)
    close(unmerge(d.materialize(), d).weight, w.weight, tol=1e-4)


# ---------------------------------------------------------------- against HF PEFT


class _TorchModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(5, 6, bias=False)
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False)


def _torch(x):
    return np.asarray(x.detach().numpy())


@pytest.mark.parametrize("use_dora", [False, True])
@pytest.mark.parametrize("use_rslora", [False, True])
def test_linear_matches_peft(use_dora, use_rslora):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LoraConfig(
        r=2, lora_alpha=5, target_modules=["proj"], init_lora_weights=False,
        use_dora=use_dora, use_rslora=use_rslora,
    )  # fmt: skip
    model = get_peft_model(_TorchModel(), cfg)
    layer = model.base_model.model.proj
    weight = jnp.asarray(_torch(layer.base_layer.weight))
    a = jnp.asarray(_torch(layer.lora_A["default"].weight))
    b = jnp.asarray(_torch(layer.lora_B["default"].weight))
    w = LoraArray(weight, a, b, lora_alpha=5, use_rslora=use_rslora)
    if use_dora:
        m = jnp.asarray(_torch(layer.lora_magnitude_vector["default"].weight)) * 1.3
        with torch.no_grad():
            layer.lora_magnitude_vector["default"].weight.mul_(1.3)
        w = DoraArray(weight, a, b, m, lora_alpha=5, use_rslora=use_rslora)
    x_np = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)
    x_t = torch.tensor(x_np)
    out_t = layer(x_t)
    out_t.sin().sum().backward()
    with strict():
        out = jax.vmap(use_implicit_args(lambda w, v: w @ v), in_axes=(None, 0))(w, x_np)
        grads = jax.grad(
            lambda w: jnp.sum(
                jnp.sin(jax.vmap(use_implicit_args(lambda w, v: w @ v), in_axes=(None, 0))(w, x_np))
            )
        )(w)
    close(out, _torch(out_t), tol=1e-5)
    close(grads.lora_A, _torch(layer.lora_A["default"].weight.grad), tol=1e-4)
    close(grads.lora_B, _torch(layer.lora_B["default"].weight.grad), tol=1e-4)
    if use_dora:
        close(
            grads.lora_magnitude_vector,
            _torch(layer.lora_magnitude_vector["default"].weight.grad),
            tol=1e-4,
        )


def test_conv2d_matches_peft():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(
        _TorchModel(),
        LoraConfig(r=2, lora_alpha=3, target_modules=["conv"], init_lora_weights=False),
    )
    layer = model.base_model.model.conv
    w = LoraArray(
        jnp.asarray(_torch(layer.base_layer.weight)),
        jnp.asarray(_torch(layer.lora_A["default"].weight)),
        jnp.asarray(_torch(layer.lora_B["default"].weight)),
        lora_alpha=3,
    )
    conv = eqx.tree_at(
        lambda m: m.weight,
        eqx.nn.Conv2d(3, 4, 3, padding=1, use_bias=False, key=jax.random.key(0)),
        w,
    )
    x_np = np.random.default_rng(1).normal(size=(3, 7, 7)).astype(np.float32)
    with strict():
        out = use_implicit_args(conv)(x_np)
    close(out, _torch(layer(torch.tensor(x_np)[None]))[0], tol=1e-5)


def test_forward_mode_through_a_lora_product_is_refused(getkey):
    """The explicit backward (token-major, see `_low_rank`) is a `custom_vjp`, so forward
    mode is not available through LoRA products; reverse mode and its nesting are."""
    w = _random_lora(getkey())
    x = jax.random.normal(getkey(), (5,))
    f = use_implicit_args(lambda w, x: jnp.tanh(w @ x))
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda x: f(w, x), (x,), (jnp.ones(5),))
    hess = jax.hessian(lambda x: jnp.sum(f(w, x)))(x)
    want = jax.hessian(lambda x: jnp.sum(jnp.tanh(w.materialize() @ x)))(x)
    close(hess, want, tol=1e-4)
