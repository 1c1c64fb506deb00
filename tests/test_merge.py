"""QLoRA (LoRA over NF4) and merging adapters into dense or re-quantized weights."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import close
from test_quantized import HALF_GAP, torch_dynamic_map

from peftx.adapters import (
    IA3Array,
    Int8Array,
    LoraArray,
    NF4Array,
    dora,
    lora,
    merge,
    quantize_int8,
    quantize_nf4,
)
from peftx.implicit import strict, use_implicit_args


def _qlora(key, shape=(16, 128), double_quant=True):
    kw, kl = jax.random.split(key)
    base = quantize_nf4(jax.random.normal(kw, shape), double_quant=double_quant)
    return lora(base, r=4, lora_alpha=8.0, init="random", key=kl)


def test_qlora_forward_and_gradients_equal_dense_lora_on_the_dequantized_weight(getkey):
    w = _qlora(getkey())
    dense_base = w.weight.materialize()
    x = jax.random.normal(getkey(), (5, 128))

    def loss(a, b, base):
        adapted = LoraArray(base, a, b, lora_alpha=w.lora_alpha)
        out = jax.vmap(use_implicit_args(lambda m, v: m @ v), in_axes=(None, 0))(adapted, x)
        return jnp.sum(jnp.sin(out))

    with strict():
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
            w.lora_A, w.lora_B, w.weight
        )
    want_value, want_grads = jax.value_and_grad(loss, argnums=(0, 1))(
        w.lora_A, w.lora_B, dense_base
    )
    close(value, want_value, tol=1e-4)
    close(grads, want_grads, tol=1e-4)


def test_qlora_trains_only_the_adapters(getkey):
    """Codes and scales sit in the frozen partition: gradients reach only A and B."""
    w = _qlora(getkey())
    x = jax.random.normal(getkey(), (5, 128))
    trainable, frozen = eqx.partition(
        w,
        eqx.tree_at(lambda m: (m.lora_A, m.lora_B), jax.tree.map(lambda _: False, w), (True, True)),
    )

    def loss(trainable):
        model = eqx.combine(trainable, frozen)
        return jnp.sum(use_implicit_args(lambda m: x @ m.T)(model) ** 2)

    with strict():
        grads = jax.grad(loss)(trainable)
    assert [g.shape for g in jax.tree.leaves(grads)] == [(4, 128), (16, 4)]
    assert isinstance(frozen.weight, NF4Array)


@pytest.mark.parametrize("kind", ["lora", "dora", "ia3", "qlora"])
def test_merged_forward_equals_unmerged(getkey, kind):
    weight = jax.random.normal(getkey(), (16, 128))
    if kind == "ia3":
        adapted = IA3Array(weight, jax.random.uniform(getkey(), (16, 1)) + 0.5)
    else:
        base = quantize_nf4(weight) if kind == "qlora" else weight
        adapted = lora(base, r=4, lora_alpha=8.0, init="random", key=getkey())
        adapted = dora(adapted) if kind == "dora" else adapted
    x = jax.random.normal(getkey(), (5, 128))
    with strict():
        unmerged = use_implicit_args(lambda m: x @ m.T)(adapted)
    merged = merge(adapted)
    assert isinstance(merged, jax.Array) and merged.shape == weight.shape
    close(x @ merged.T, unmerged, tol=1e-4)


def test_merge_into_a_quantized_base(getkey):
    w = _qlora(getkey())
    merged = np.asarray(w.materialize())
    dense = merge(w, dtype=jnp.bfloat16)
    assert dense.dtype == jnp.bfloat16
    # the float32 merged weight rounded once: half a bfloat16 ulp
    u = float(jnp.finfo(jnp.bfloat16).eps) / 2
    np.testing.assert_allclose(np.asarray(dense, np.float32), merged, rtol=u, atol=0)
    with pytest.warns(UserWarning, match="re-quantized to NF4Array"):
        again = merge(w, requantize=True)
    assert isinstance(again, NF4Array) and again.double_quant and again.blocksize == 64
    error = np.abs(np.asarray(again.materialize()) - merged).reshape(-1, 64)
    absmax = np.abs(merged).reshape(-1, 64).max(axis=1)
    nested_absmax = float(again.nested_absmax[0])  # 32 blocks: one nested block
    # NF4 rounds value/absmax to the nearest code: half the widest gap of the code times
    # the block's absmax. Double quantization stores that absmax to within half the widest
    # gap of the dynamic map times the nested absmax. Then float32 roundings: eps of the
    # nested absmax (the scaled absmax, its dequantization), 2·eps of the absmax (the
    # dequantized absmax and value).
    eps = float(jnp.finfo(jnp.float32).eps)
    dynamic_half_gap = np.diff(torch_dynamic_map().numpy()).max() / 2
    bound = (HALF_GAP + 2 * eps) * absmax + (dynamic_half_gap + eps) * nested_absmax
    assert 0 < error.max() and np.all(error <= bound[:, None])

    w8 = lora(quantize_int8(jax.random.normal(getkey(), (8, 8))), r=2, init="random", key=getkey())
    with pytest.warns(UserWarning, match="Int8Array"):
        assert isinstance(merge(w8, requantize=True), Int8Array)


def test_merge_errors(getkey):
    w = lora(jnp.ones((8, 8)), r=2, init="random", key=getkey())
    with pytest.raises(ValueError, match="needs an adapter whose base weight is an NF4Array"):
        merge(w, requantize=True)
    broken = eqx.tree_at(lambda m: m.lora_B, w, w.lora_B.at[0, 0].set(jnp.nan))
    with pytest.raises(ValueError, match="NaN or infinite"):
        merge(broken, safe=True)
    assert jnp.isnan(merge(broken)).any()
