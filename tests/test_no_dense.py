"""`assert_no_dense`: it catches weight-sized arrays, and no adapter builds one, forward or
in a whole train step (LoRA, DoRA, IA3, LoKr, NF4, QLoRA, QDoRA, mixed batches, stacked
layers)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ROOT, all_eqns, section_code

import peftx
from peftx import (
    IA3Config,
    LoKrConfig,
    LoraConfig,
    QuantizationConfig,
    get_peft_model,
    partition,
)
from peftx.adapters import dora, lora, quantize_nf4
from peftx.implicit import (
    DenseWeightError,
    ImplicitArray,
    assert_no_dense,
    materialization_policy,
    materialize,
    primitive_handler,
    strict,
    use_implicit_args,
)

# ---------------------------------------------------------------- the check itself

OUT, IN, BATCH = 64, 32, 3  # no activation axis equals a weight axis


class _Scaled(ImplicitArray):
    """`value * scale`, with a `dot_general` handler that densifies it (the bug the check
    exists for: `strict()` does not see an explicit `materialize()`)."""

    value: jax.Array
    scale: jax.Array

    def aval(self):
        return jax.core.ShapedArray(self.value.shape, self.value.dtype)

    def materialize(self):
        return self.value * self.scale


@primitive_handler("dot_general")
def _densifying_dot(primitive, x: jax.Array, w: _Scaled, **params):
    return primitive.bind(x, materialize(w), **params)


def _lora(dtype=jnp.float32):
    kw, kl = jax.random.split(jax.random.key(0))
    return lora(jax.random.normal(kw, (OUT, IN), dtype), r=2, init="random", key=kl)


def _x():
    return jnp.ones((BATCH, IN))


def _rows(f):
    """`f` applied to each example, as `eqx.nn.Linear` is (the weight on the left)."""
    return lambda w, x: jax.vmap(lambda v: f(w, v))(x)


def _scan_rows(w, x):
    # a weight-sized array stacked one row at a time: each step makes `(in,)`
    _, rows = jax.lax.scan(lambda c, row: (c, row * 2), 0.0, w.weight)
    return x @ rows[0]


DENSE = {  # name: (weight, fn, primitive and shape the error must name)
    "W + s·B·A": (_lora, lambda w, x: x @ materialize(w).T, r"`add` makes float32\[64, 32\]"),
    "B·A": (_lora, lambda w, x: x @ w.delta().T, r"`dot_general` makes float32\[64, 32\]"),
    "W·W": (_lora, lambda w, x: x * jnp.sum(w.weight * w.weight), r"`mul` makes float32\[64, 32"),
    "Wᵀ copy": (_lora, lambda w, x: x @ w.weight.T, r"`transpose` makes float32\[32, 64\]"),
    "bfloat16 base cast to float32": (
        lambda: _lora(jnp.bfloat16),
        _rows(lambda w, v: w.weight.astype(jnp.float32) @ v.astype(jnp.float32)),
        r"`convert_element_type` makes float32\[64, 32\]",
    ),
    "dequantized NF4": (
        lambda: quantize_nf4(jnp.ones((OUT, IN))),
        lambda w, x: x @ w.materialize().T,
        r"`reshape` makes float32\[64, 32\]",
    ),
    "per-example weight under vmap": (
        _lora,
        _rows(lambda w, v: (w.weight * v[0]) @ v),
        r"`mul` makes float32\[3, 64, 32\]",
    ),
    "cotangent of W": (
        _lora,
        lambda w, x: jax.grad(lambda base: jnp.sum(x @ base.T))(w.weight),
        r"`dot_general` makes float32\[64, 32\] in the backward pass",
    ),
    "stacked by scan": (_lora, _scan_rows, r"`scan` makes float32\[64, 32\]"),
    "densifying handler": (
        lambda: _Scaled(jnp.ones((OUT, IN)), jnp.float32(2.0)),
        use_implicit_args(lambda w, x: x @ w.T),
        r"`mul` makes float32\[64, 32\]",
    ),
}


@pytest.mark.parametrize("name", list(DENSE))
def test_catches_weight_sized_arrays(name):
    make, fn, message = DENSE[name]
    with strict(), pytest.raises(DenseWeightError, match=message + r".*matching weight shape"):
        assert_no_dense(fn, make(), _x())


NESTED = {
    "jit": lambda f: jax.jit(f),
    "cond": lambda f: lambda w, x: jax.lax.cond(x[0, 0] > 0, f, lambda w, x: x, w, x),
    "while_loop": lambda f: (
        lambda w, x: jax.lax.while_loop(
            lambda c: c[1] < 2, lambda c: (f(w, c[0]), c[1] + 1), (x, 0)
        )[0]
    ),
    "checkpoint": lambda f: jax.checkpoint(f),
    "grad": lambda f: lambda w, x: jax.grad(lambda x: jnp.sum(f(w, x)))(x),
}


@pytest.mark.parametrize("wrapper", list(NESTED))
def test_looks_inside_nested_jaxprs(wrapper):
    def densified(w, x):
        return x @ w.materialize()[:IN].T[:IN]

    w = _lora()
    with pytest.raises(DenseWeightError, match=r"`add` makes float32\[64, 32\]"):
        assert_no_dense(NESTED[wrapper](densified), w, jnp.ones((IN, IN)))


def test_clean_products_pass_and_the_traced_program_is_returned():
    w = _lora()
    # (batch, out) outputs bigger than the weight pass: they lack the weight's `in` axis
    x = jnp.ones((100, IN))
    jaxpr = assert_no_dense(use_implicit_args(_rows(lambda w, v: w @ v)), w, x)
    assert jaxpr.out_avals[0].shape == (100, OUT)
    assert any(e.primitive.name == "dot_general" for e in all_eqns(jaxpr.jaxpr))
    # the frozen weight itself is an input, not something the function builds
    assert_no_dense(lambda w, x: x @ w.weight, w, jnp.ones((3, OUT)))


def test_error_names_primitive_shape_phase_weight_and_place():
    w = _lora()

    def full_finetune(w, x):  # the gradient of a dense weight is weight-sized
        return jax.grad(lambda base: jnp.sum(jnp.tanh(x @ base.T)))(w.weight)

    with pytest.raises(DenseWeightError) as info:
        assert_no_dense(full_finetune, w, _x())
    message = str(info.value)
    assert "weight-sized array(s) built for weights [(64, 32)]" in message
    assert "`dot_general` makes float32[64, 32] in the backward pass at " in message
    assert "test_no_dense.py" in message and "matching weight shape (64, 32)" in message


def test_silent_fallback_materialization_is_caught():
    w = _Scaled(jnp.ones((OUT, IN)), jnp.float32(2.0))
    with materialization_policy("ignore"), pytest.raises(DenseWeightError, match=r"`mul` makes"):
        assert_no_dense(use_implicit_args(lambda w, x: x @ jnp.sin(w).T), w, _x())


def test_weights_looked_for():
    w = _lora()
    trainable, frozen = eqx.partition(w, lambda a: a is not w.weight and eqx.is_array(a))

    def densify(trainable, x):
        return x @ materialize(eqx.combine(trainable, frozen)).T

    # the trainable half alone has no base weight: nothing to look for
    with pytest.raises(ValueError, match=r"found no weight to look for.*weight_shapes="):
        assert_no_dense(densify, trainable, _x())
    with pytest.raises(DenseWeightError, match=r"`add` makes float32\[64, 32\]"):
        assert_no_dense(densify, trainable, _x(), weight_shapes=[(OUT, IN)])
    with pytest.raises(DenseWeightError, match=r"`add` makes float32\[64, 32\]"):
        assert_no_dense(lambda t, f, x: densify(t, x), trainable, frozen, _x())
    with pytest.raises(ValueError, match=r"weight shape \(64,\) has fewer than two axes"):
        assert_no_dense(densify, trainable, _x(), weight_shapes=[(OUT,)])
    with pytest.raises(TypeError, match=r"LoraArray"):  # not a function
        assert_no_dense(w, _x())


def test_one_layer_of_a_stack_is_a_weight_too():
    layers = eqx.filter_vmap(lambda k: lora(jnp.ones((OUT, IN)), r=2, key=k))(
        jax.random.split(jax.random.key(0), 4)
    )

    def per_layer_dense(layers, x):
        return jax.lax.scan(lambda h, w: (h @ materialize(w)[:IN].T, None), x, layers)[0]

    with pytest.raises(DenseWeightError, match=r"`add` makes float32\[64, 32\].*\(64, 32\)"):
        assert_no_dense(per_layer_dense, layers, jnp.ones((BATCH, IN)))
    assert_no_dense(
        use_implicit_args(
            lambda ls, x: jax.lax.scan(
                lambda h, w: (h + jax.vmap(lambda v: w @ v)(h)[:, :IN], None), x, ls
            )[0]
        ),
        layers,
        jnp.ones((BATCH, IN)),
    )


# ---------------------------------------------------------------- every adapter, abstractly

# Large enough that NF4 products run in chunks (at least two of 2**21 elements each); the
# check only traces, so the size costs nothing. Activations are (3, 5, D).
D, F = 2048, 4096
TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]
LORA = LoraConfig(r=8, target_modules=TARGETS, init_lora_weights=False)
DORA = LoraConfig(r=8, target_modules=TARGETS, init_lora_weights=False, use_dora=True)
IA3 = IA3Config(
    target_modules=["v_proj", "up_proj", "down_proj"], feedforward_modules=["down_proj"]
)
LOKR = LoKrConfig(r=8, target_modules=TARGETS, init_weights=False, decompose_both=True)
NF4 = QuantizationConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True)


class Block(eqx.Module):
    """Attention-like gating and an MLP, for one sequence `(seq, D)`."""

    q_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear

    def __init__(self, key):
        kq, kv, ku, kd = jax.random.split(key, 4)
        self.q_proj = eqx.nn.Linear(D, D, key=kq)
        self.v_proj = eqx.nn.Linear(D, D, key=kv)
        self.up_proj = eqx.nn.Linear(D, F, key=ku)
        self.down_proj = eqx.nn.Linear(F, D, key=kd)

    def __call__(self, h):
        h = h + jax.vmap(self.v_proj)(h) * jnp.tanh(jax.vmap(self.q_proj)(h))
        return h + jax.vmap(self.down_proj)(jax.nn.gelu(jax.vmap(self.up_proj)(h)))


class Net(eqx.Module):
    blocks: list

    def __init__(self, key):
        self.blocks = [Block(k) for k in jax.random.split(key, 2)]

    def __call__(self, h):
        for block in self.blocks:
            h = block(h)
        return h


class Stacked(eqx.Module):
    """Three blocks stacked by `eqx.filter_vmap`, run under `lax.scan`."""

    layers: Block

    def __init__(self, key):
        self.layers = eqx.filter_vmap(Block)(jax.random.split(key, 3))

    def __call__(self, h):
        return jax.lax.scan(lambda h, block: (block(h), None), h, self.layers)[0]


def _nf4_per_layer(model):
    """`model` with every stacked weight an NF4 stack (one quantized weight per layer)."""
    for name in TARGETS:

        def where(m, name=name):
            return getattr(m.layers, name).weight

        model = eqx.tree_at(where, model, eqx.filter_vmap(quantize_nf4)(where(model)))
    return model


def _peft(net, config, quantize=None, second=None):
    def build():
        model = net(jax.random.key(0))
        if quantize is not None:
            model = quantize(model)
        if config is None:
            return model
        peft_model = get_peft_model(model, config, key=jax.random.key(1))
        if second is not None:
            peft_model = peft_model.add_adapter("b", second, key=jax.random.key(2))
        return peft_model

    return eqx.filter_eval_shape(build)  # abstract: shapes and dtypes only


def _quantized(model):
    return peftx.quantize_model(model, NF4)


CASES = {  # name: (abstract model, adapters trained together or None, runs a scan)
    "lora": (lambda: _peft(Net, LORA), None, False),
    "dora": (lambda: _peft(Net, DORA), None, False),
    "ia3": (lambda: _peft(Net, IA3), None, False),
    "nf4 (frozen)": (lambda: _peft(Net, None, _quantized), None, True),  # chunks: lax.map
    "qlora": (lambda: _peft(Net, LORA, _quantized), None, True),
    "qdora": (lambda: _peft(Net, DORA, _quantized), None, True),
    "mixed lora+lora": (lambda: _peft(Net, LORA, second=LORA), ["default", "b"], False),
    "mixed dora+lora": (lambda: _peft(Net, DORA, second=LORA), ["default", "b"], False),
    "mixed ia3+ia3": (lambda: _peft(Net, IA3, second=IA3), ["default", "b"], False),
    "stacked lora": (lambda: _peft(Stacked, LORA), None, True),
    "stacked dora": (lambda: _peft(Stacked, DORA), None, True),
    "stacked ia3": (lambda: _peft(Stacked, IA3), None, True),
    "stacked qlora": (lambda: _peft(Stacked, LORA, _nf4_per_layer), None, True),
    "lokr": (lambda: _peft(Net, LOKR), None, False),
    "stacked lokr": (lambda: _peft(Stacked, LOKR), None, True),
}
X = jax.ShapeDtypeStruct((3, 5, D), jnp.float32)
IDS = jax.ShapeDtypeStruct((3,), jnp.int32)  # one adapter id per sequence


def _forward(model, x, ids):
    if ids is not None:  # a mixed batch: ids under our own vmap (the Equinox way)
        return jax.vmap(lambda x, i: model(x, adapter_names=i))(x, ids)
    if isinstance(model, peftx.PeftModel):
        return jax.vmap(model)(x)
    return use_implicit_args(lambda m, x: jax.vmap(m)(x))(model, x)


@pytest.mark.parametrize("case", list(CASES))
def test_forward_builds_no_weight_sized_array(case):
    build, names, scans = CASES[case]
    with strict():
        jaxpr = assert_no_dense(_forward, build(), X, IDS if names else None)
    prims = {e.primitive.name for e in all_eqns(jaxpr.jaxpr)}
    assert "dot_general" in prims and ("scan" in prims) == scans


@pytest.mark.parametrize("case", [c for c in CASES if c != "nf4 (frozen)"])
def test_train_step_builds_no_weight_sized_array(case):
    build, names, _ = CASES[case]
    trainable, frozen = partition(build(), names)
    optim = optax.adamw(1e-3)
    opt_state = eqx.filter_eval_shape(optim.init, trainable)

    @eqx.filter_jit
    def step(trainable, frozen, opt_state, x, ids):
        def loss(trainable):
            return jnp.mean(_forward(eqx.combine(trainable, frozen), x, ids) ** 2)

        grads = eqx.filter_grad(loss)(trainable)
        updates, opt_state = optim.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state

    with jax.numpy_dtype_promotion("standard"), strict():  # optax mixes in its int count
        jaxpr = assert_no_dense(step, trainable, frozen, opt_state, X, IDS if names else None)
    stacks = [str(e.source_info.name_stack) for e in all_eqns(jaxpr.jaxpr)]
    assert any("transpose(" in s for s in stacks)  # the backward pass was traced and checked


# ---------------------------------------------------------------- what remains, and why


def test_small_nf4_weights_are_dequantized_whole():
    """An NF4 product dequantizes a weight of fewer than two chunks (2**21 elements each)
    whole, on purpose: the dense copy is short-lived and small, and chunking it costs more.
    The check reports it, so run it on weights as large as the real ones."""
    w = quantize_nf4(jnp.ones((OUT, IN)))
    with strict(), pytest.raises(DenseWeightError, match=r"float32\[64, 32\] in the forward"):
        assert_no_dense(use_implicit_args(_rows(lambda w, v: w @ v)), w, _x())


def test_x_times_transposed_lora_builds_no_weight_sized_array():
    assert_no_dense(use_implicit_args(lambda w, x: x @ w.T), _lora(), _x())


# ---------------------------------------------------------------- DoRA's norm


def test_dora_norm_from_kept_base_norm_equals_dense_norm():
    kw, kl = jax.random.split(jax.random.key(3))
    w = jax.random.normal(kw, (OUT, IN))
    for base in (w, quantize_nf4(w)):
        d = dora(lora(base, r=4, init="random", key=kl))
        dense = materialize(base) + d.delta()
        np.testing.assert_allclose(d.weight_sq_norm, jnp.sum(materialize(base) ** 2, -1), rtol=1e-5)
        np.testing.assert_allclose(d.weight_norm(), jnp.linalg.norm(dense, axis=1), rtol=1e-5)
        # the magnitude starts at the norm, so the output is the base model's
        x = jax.random.normal(kl, (BATCH, IN))
        with strict():
            got = use_implicit_args(_rows(lambda w, v: w @ v))(d, x)
        np.testing.assert_allclose(got, x @ dense.T, rtol=1e-4, atol=1e-4)


def test_dora_kept_norm_is_frozen_and_not_a_parameter():
    from peft import LoraConfig as TorchLoraConfig, get_peft_model as torch_get_peft_model
    from test_multi_adapter import BatchedNet, TorchNet

    config = dict(r=4, target_modules=["q_proj", "v_proj"], use_dora=True)
    torch_model = torch_get_peft_model(TorchNet(), TorchLoraConfig(**config))
    ours = get_peft_model(
        BatchedNet(jax.random.key(0)), LoraConfig(**config), key=jax.random.key(1)
    )
    assert ours.get_nb_trainable_parameters() == torch_model.get_nb_trainable_parameters()
    trainable, frozen = partition(ours)
    q = trainable.base_model.q_proj.weight.adapters["default"]
    assert q.weight_sq_norm is None and q.lora_magnitude_vector is not None
    assert frozen.base_model.q_proj.weight.adapters["default"].weight_sq_norm.shape == (8,)


def test_docs_example_runs():
    """The train step of docs/implicit.md's section on `assert_no_dense`, on a LoRA MLP."""
    block = section_code(ROOT / "docs/implicit.md", "## Proving that no dense weight is built")
    mlp = eqx.nn.MLP(IN, IN, OUT, depth=1, key=jax.random.key(0))  # (64, 32), (32, 64)
    model = get_peft_model(
        mlp, LoraConfig(r=2, target_modules=["layers.0", "layers.1"]), key=jax.random.key(1)
    )
    scope = dict(eqx=eqx, jax=jax, jnp=jnp, optax=optax, peftx=peftx, model=model, x=_x())
    with jax.numpy_dtype_promotion("standard"):  # optax mixes in its int count
        exec(compile(block.code, "docs/implicit.md", "exec"), scope)
