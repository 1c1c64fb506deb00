"""Mixed precision as PEFT does it: a bfloat16 base with float32 adapters, checked
against HF PEFT in PyTorch on the same weights and inputs.

PEFT runs the adapter branch in the adapters' dtype (the input cast to `lora_A`'s), adds
its float32 output to the base output and rounds once to the base's dtype; gradients
have the dtype of their parameter. Tolerances: a float32 quantity computed from the same
rounded inputs differs only by float32 summation order; a bfloat16 output by at most the
rounding of each side, `eps_bf16` relative, plus the bfloat16 product's accumulated error,
about `eps_bf16 · sqrt(K)` times the terms' magnitude for a reduction of length `K`.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from helpers import all_eqns

import peftx
from peftx.adapters import (
    AdapterSet,
    DoraArray,
    IA3Array,
    LoraArray,
    NF4Array,
    with_compute_dtype,
)
from peftx.implicit import strict, use_implicit_args

EPS_BF16 = float(jnp.finfo(jnp.bfloat16).eps)
EPS_F32 = float(jnp.finfo(jnp.float32).eps)
IN, OUT, R, ALPHA, TOKENS = 48, 40, 4, 8.0, 6


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


def _bf16_close(got, want, k):
    """Within the rounding of a bfloat16 result of a length-`k` reduction."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = np.max(np.abs(want))
    np.testing.assert_allclose(got, want, rtol=2 * EPS_BF16, atol=EPS_BF16 * math.sqrt(k) * scale)


def _f32_close(got, want, k):
    """Float32 results from identical inputs: summation order only."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32
    scale = np.max(np.abs(want))
    np.testing.assert_allclose(got, want, rtol=0, atol=8 * EPS_F32 * math.sqrt(k) * scale)


class _Torch(torch.nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.proj = torch.nn.Linear(IN, OUT, bias=bias)


def _peft_layer(bias=True, **config):
    """A PEFT-wrapped bfloat16 Linear with float32 adapters (PEFT's default autocast)."""
    from peft import IA3Config, LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = _Torch(bias).to(torch.bfloat16)
    if config.pop("ia3", False):
        cfg = IA3Config(target_modules=["proj"], init_ia3_weights=False, **config)
    else:
        cfg = LoraConfig(
            r=R, lora_alpha=ALPHA, target_modules=["proj"], init_lora_weights=False, **config
        )
    return get_peft_model(base, cfg).base_model.model.proj


def _inputs():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(TOKENS, IN)).astype(np.float32)
    cotangent = rng.normal(size=(TOKENS, OUT)).astype(np.float32)
    return jnp.asarray(x, jnp.bfloat16), cotangent


def _torch_run(layer, x, cotangent):
    x_t = torch.tensor(np.asarray(x, np.float32)).to(torch.bfloat16).requires_grad_()
    y = layer(x_t)
    (y.float() * torch.tensor(cotangent)).sum().backward()
    return y, x_t.grad


def _jax_run(weight, bias, x, cotangent):
    """Output and gradients (w.r.t. the weight's inexact leaves and x) of `x @ Wᵀ + b`."""

    def loss(w, x):
        y = use_implicit_args(lambda w, x: x @ w.T)(w, x) + bias[None]
        return jnp.sum(y.astype(jnp.float32) * cotangent), y

    spec = eqx.tree_at(lambda w: w.weight, jax.tree.map(eqx.is_inexact_array, weight), False)
    diff, static = eqx.partition(weight, spec)  # the base weight stays frozen

    def split_loss(d, x):
        return loss(eqx.combine(d, static), x)

    with strict():
        (_, y), grads = jax.jit(jax.value_and_grad(split_loss, argnums=(0, 1), has_aux=True))(
            diff, x
        )
    return y, grads


def _base(layer):
    w = jnp.asarray(_np(layer.base_layer.weight), jnp.bfloat16)
    b = jnp.asarray(_np(layer.base_layer.bias), jnp.bfloat16)
    return w, b


@pytest.mark.parametrize("use_dora", [False, True])
def test_bf16_base_fp32_lora_matches_peft(use_dora):
    layer = _peft_layer(use_dora=use_dora)
    a = layer.lora_A["default"].weight
    assert a.dtype == torch.float32  # PEFT keeps adapters in float32 on a bfloat16 base
    weight, bias = _base(layer)
    a_j = jnp.asarray(_np(a))
    b_j = jnp.asarray(_np(layer.lora_B["default"].weight))
    if use_dora:
        with torch.no_grad():
            layer.lora_magnitude_vector["default"].weight.mul_(1.25)
        m = jnp.asarray(_np(layer.lora_magnitude_vector["default"].weight))
        w = DoraArray(weight, a_j, b_j, m, lora_alpha=ALPHA)
    else:
        w = LoraArray(weight, a_j, b_j, lora_alpha=ALPHA)
    x, cotangent = _inputs()
    y_t, gx_t = _torch_run(layer, x, cotangent)
    y, (grads, gx) = _jax_run(w, bias, x, cotangent)

    assert y.dtype == jnp.bfloat16 and gx.dtype == jnp.bfloat16
    _bf16_close(y, _np(y_t), IN)
    _bf16_close(gx, _np(gx_t), OUT)
    assert grads.lora_A.dtype == grads.lora_B.dtype == jnp.float32
    _f32_close(grads.lora_A, _np(a.grad), TOKENS * OUT)
    _f32_close(grads.lora_B, _np(layer.lora_B["default"].weight.grad), TOKENS * IN)
    if use_dora:
        g_m = grads.lora_magnitude_vector
        assert g_m.dtype == jnp.float32
        # the magnitude's gradient meets the bfloat16 base output (rounded on both sides)
        _bf16_close(g_m, _np(layer.lora_magnitude_vector["default"].weight.grad), TOKENS)


@pytest.mark.parametrize("feedforward", [False, True])
def test_bf16_base_fp32_ia3_matches_peft(feedforward):
    # without a bias: PEFT scales an output-scaled layer's bias too, which peftx does in
    # `PeftModel.prepared()` (tested in test_ia3.py), not in the weight's product
    layer = _peft_layer(ia3=True, bias=False, feedforward_modules=["proj"] if feedforward else [])
    l_t = layer.ia3_l["default"]
    assert l_t.dtype == torch.float32
    with torch.no_grad():
        l_t.copy_(torch.tensor(np.random.default_rng(2).uniform(0.5, 1.5, l_t.shape)))
    weight = jnp.asarray(_np(layer.base_layer.weight), jnp.bfloat16)
    w = IA3Array(weight, jnp.asarray(_np(l_t)))
    x, cotangent = _inputs()
    y_t, gx_t = _torch_run(layer, x, cotangent)
    y, (grads, gx) = _jax_run(w, jnp.zeros((OUT,), jnp.bfloat16), x, cotangent)
    assert y.dtype == jnp.bfloat16 and gx.dtype == jnp.bfloat16
    assert grads.ia3_l.dtype == jnp.float32
    _bf16_close(y, _np(y_t), IN)
    _bf16_close(gx, _np(gx_t), OUT)
    _bf16_close(grads.ia3_l, _np(l_t.grad), TOKENS * (OUT if feedforward else 1))


class _MLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, dtype, *, use_bias=True, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(IN, OUT, use_bias=use_bias, dtype=dtype, key=k1)
        self.down = eqx.nn.Linear(OUT, IN, use_bias=use_bias, dtype=dtype, key=k2)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def _loss(model, x):
    y = jax.vmap(model)(x)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def _step(peft_model):
    trainable, frozen = peftx.partition(peft_model)
    optim = optax.adam(1e-3)

    @eqx.filter_jit
    def step(trainable, opt_state, x):
        def loss(t):
            return use_implicit_args(_loss)(eqx.combine(t, frozen), x)

        value, grads = eqx.filter_value_and_grad(loss)(trainable)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes its int step count in
            updates, opt_state = optim.update(grads, opt_state, trainable)
        return value, grads, eqx.apply_updates(trainable, updates), opt_state

    return step, trainable, optim.init(eqx.filter(trainable, eqx.is_inexact_array))


def _config():
    return peftx.LoraConfig(
        r=R, lora_alpha=ALPHA, target_modules=["up", "down"], init_lora_weights=False
    )


def _dots(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]


def _factors(tree):
    return [
        x
        for x in jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, LoraArray))
        if isinstance(x, LoraArray)
    ]


def test_bf16_base_trains_fp32_adapters_with_fp32_optimizer_state(getkey):
    model = _MLP(jnp.bfloat16, key=getkey())
    peft_model = peftx.get_peft_model(model, _config(), key=getkey())
    step, trainable, opt_state = _step(peft_model)
    x = jax.random.normal(getkey(), (TOKENS, IN), jnp.bfloat16)
    with strict():
        _, grads, trainable, opt_state = step(trainable, opt_state, x)
    for leaf in jax.tree.leaves((grads, trainable, opt_state)):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32
    # the reviewer's symptom: float32 operands never accumulate into bfloat16
    for eqn in _dots(lambda t, x: step(t, opt_state, x), trainable, x):
        operand_dtypes = {v.aval.dtype for v in eqn.invars}
        if operand_dtypes == {jnp.dtype(jnp.float32)}:
            assert eqn.params["preferred_element_type"] in (None, jnp.float32), eqn


def test_bf16_compute_for_the_adapter_branch(getkey):
    """The recipe: bfloat16 base, float32 factors and optimizer state, bfloat16 adapter
    products; the factors' gradients stay float32 and near the float32-branch ones."""
    model = _MLP(jnp.bfloat16, key=getkey())
    peft_model = peftx.get_peft_model(model, _config(), key=getkey())
    fast = with_compute_dtype(peft_model, jnp.bfloat16)
    assert all(f.compute_dtype == jnp.bfloat16 for f in _factors(fast))
    x = jax.random.normal(getkey(), (TOKENS, IN), jnp.bfloat16)
    results = []
    for m in (peft_model, fast):
        step, trainable, opt_state = _step(m)
        with strict():
            value, grads, _, opt_state = step(trainable, opt_state, x)
        results.append((value, grads))
        floats = [x for x in jax.tree.leaves((grads, opt_state)) if x.dtype != jnp.int32]
        assert floats and all(x.dtype == jnp.float32 for x in floats)
    rank_dots = [
        {v.aval.dtype for v in e.invars}
        for e in _dots(lambda t, x: step(t, opt_state, x), trainable, x)
        if R in (*e.invars[0].aval.shape, *e.invars[1].aval.shape)
    ]
    assert rank_dots and all(d == {jnp.dtype(jnp.bfloat16)} for d in rank_dots), rank_dots
    (v32, g32), (v16, g16) = results
    np.testing.assert_allclose(v16, v32, rtol=4 * EPS_BF16)
    for a, b in zip(jax.tree.leaves(g16), jax.tree.leaves(g32), strict=True):
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(a, b, atol=EPS_BF16 * math.sqrt(TOKENS * OUT) * scale)


def test_qlora_with_bf16_compute_dtype(getkey):
    """QLoRA through `quantize_model` + `get_peft_model` with `bnb_4bit_compute_dtype=
    "bfloat16"`: float32 factor gradients, values against a dense formula on the
    dequantized weight (its codes are checked against bitsandbytes in test_quantized)."""
    model = _MLP(jnp.float32, key=getkey())
    qconfig = peftx.QuantizationConfig(
        load_in_4bit=True, bnb_4bit_compute_dtype="bfloat16", llm_int8_skip_modules=[]
    )
    peft_model = peftx.get_peft_model(peftx.quantize_model(model, qconfig), _config(), key=getkey())
    step, trainable, opt_state = _step(peft_model)
    x = jax.random.normal(getkey(), (TOKENS, IN), jnp.bfloat16)
    with strict():
        value, grads, _, _ = step(trainable, opt_state, x)
    sets = [
        x
        for x in jax.tree.leaves(peft_model, is_leaf=lambda n: isinstance(n, AdapterSet))
        if isinstance(x, AdapterSet)
    ]
    factors = [s.adapter("default") for s in sets]
    assert len(factors) == 2 and all(isinstance(f.weight, NF4Array) for f in factors)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(grads))

    def dense(ab, x):
        (a1, b1), (a2, b2) = ab
        (f1, f2) = factors

        def layer(f, a, b, bias, x):
            w = f.weight.materialize(jnp.bfloat16)
            base = (x @ w.T).astype(jnp.float32)
            delta = (x.astype(jnp.float32) @ a.T) @ b.T * (ALPHA / R)
            # the bias in the compute dtype, as bitsandbytes' Linear4bit casts it
            return (base + delta).astype(jnp.bfloat16) + bias.astype(jnp.bfloat16)[None]

        h = jax.nn.gelu(layer(f1, a1, b1, model.up.bias, x))
        y = layer(f2, a2, b2, model.down.bias, h)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    ab = [(f.lora_A, f.lora_B) for f in factors]
    want_value, want_grads = jax.value_and_grad(dense)(ab, x)
    np.testing.assert_allclose(value, want_value, rtol=4 * EPS_BF16)
    got = [(f.lora_A, f.lora_B) for f in _factors(grads)]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want_grads), strict=True):
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(g, w, atol=EPS_BF16 * math.sqrt(TOKENS * OUT) * scale)
