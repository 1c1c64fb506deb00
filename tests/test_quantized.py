"""Quantized weights: NF4 bit for bit against bitsandbytes' algorithm (re-implemented here
in PyTorch, as its CUDA kernels compute it) and against the real library's CPU backend,
round-trip bounds, the checkpoint format, and the `dot_general` handler against the
materialized weight, in strict mode."""

import json
import math

import bitsandbytes as bnb
import bitsandbytes.functional as bnb_functional
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import close, example_count
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import peftx.adapters._quantized as quantized_module
from peftx.adapters import Int8Array, NF4Array, lora, quantize_int8, quantize_nf4
from peftx.implicit import (
    MaterializationWarning,
    materialization_policy,
    strict,
    use_implicit_args,
)

# bitsandbytes' NF4 code, index 0..15 (ANCHORS.md; `get_4bit_type("nf4")`).
NF4_CODE = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]  # fmt: skip
# The thresholds written in bitsandbytes' CUDA kernel `dQuantizeNF4` (csrc/kernels.cu), in
# increasing order: a value above threshold k gets a code above k.
CUDA_NF4_THRESHOLDS = [
    -0.8480964004993439, -0.6106329262256622, -0.4599952697753906, -0.33967943489551544,
    -0.23460740596055984, -0.13791173323988914, -0.045525018125772476, 0.03979014977812767,
    0.1202552504837513, 0.2035212516784668, 0.2920137718319893, 0.3893125355243683,
    0.5016634166240692, 0.6427869200706482, 0.8614784181118011,
]  # fmt: skip
HALF_GAP = max(b - a for a, b in zip(NF4_CODE, NF4_CODE[1:])) / 2
DTYPES = {
    "float32": (jnp.float32, torch.float32),
    "bfloat16": (jnp.bfloat16, torch.bfloat16),
    "float16": (jnp.float16, torch.float16),
}


materialize = jax.jit(lambda a: a.materialize())  # one compilation per shape, not per op
materialize_as = jax.jit(lambda a, dtype: a.materialize(dtype), static_argnums=1)


def _codes(packed):
    """The 4-bit codes in storage order: high nibble first."""
    packed = np.asarray(packed)
    return np.stack([packed >> 4, packed & 15], axis=-1).reshape(*packed.shape[:-1], -1)


# ---------------------------------------------------------------- a PyTorch reference


def torch_blocks(flat, blocksize):
    """`flat` zero-padded into rows of `blocksize`, and each row's absmax."""
    n = flat.numel()
    blocks = -(-n // blocksize)
    padded = torch.zeros(blocks * blocksize)
    padded[:n] = flat
    x = padded.view(blocks, blocksize)
    return x, x.abs().amax(dim=1)


def torch_quantize_nf4(w, blocksize):
    """bitsandbytes' `quantize_4bit(quant_type="nf4")` as its CUDA kernel computes it."""
    flat = w.reshape(-1).float()
    n = flat.numel()
    x, absmax = torch_blocks(flat, blocksize)
    scaled = x * (1.0 / absmax)[:, None]
    codes = (scaled[..., None] > torch.tensor(CUDA_NF4_THRESHOLDS)).sum(-1).to(torch.uint8)
    codes = codes.reshape(-1)[: 2 * ((n + 1) // 2)]
    return ((codes[0::2] << 4) | codes[1::2]).numpy(), absmax.numpy()


def torch_dequantize_nf4(packed, absmax, blocksize, shape, dtype):
    """bitsandbytes' `dequantize_4bit`: `code[nibble] * absmax[block]` in float32."""
    packed = torch.tensor(np.asarray(packed))
    nibbles = torch.stack([packed >> 4, packed & 15], dim=-1).reshape(-1).long()
    values = torch.tensor(NF4_CODE)[nibbles]
    scale = torch.tensor(np.asarray(absmax)).repeat_interleave(blocksize)
    n = math.prod(shape)
    return (values[:n] * scale[:n]).to(dtype).reshape(shape)


def torch_dynamic_map():
    """bitsandbytes' `create_dynamic_map()` (signed, 7 exponent bits)."""
    data = []
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0, 1.0]
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def torch_quantize_blockwise(a, code, blocksize):
    """bitsandbytes' `quantize_blockwise` as its PyTorch backend computes it: the nearest
    code by `argmin`."""
    n = a.numel()
    x, absmax = torch_blocks(a, blocksize)
    scaled = torch.clamp(x * (1.0 / absmax)[:, None], -1, 1).reshape(-1)[:n]
    codes = torch.argmin((scaled[:, None] - code).abs(), dim=-1).to(torch.uint8)
    return codes.numpy(), absmax.numpy()


# ---------------------------------------------------------------- the NF4 format


def test_nf4_code_table_is_bitsandbytes():
    every_code = jnp.array([0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF], jnp.uint8)
    a = NF4Array(every_code, jnp.ones(1), shape=(16,), dtype=jnp.float32, blocksize=16)
    np.testing.assert_array_equal(a.materialize(), np.array(NF4_CODE, np.float32))
    np.testing.assert_array_equal(
        a.to_bnb_dict()["weight.quant_map"], np.array(NF4_CODE, np.float32)
    )


def test_values_on_a_threshold_go_down_as_in_the_cuda_kernel():
    t = np.array(CUDA_NF4_THRESHOLDS, np.float32)
    above = np.nextafter(t, np.float32(2))
    ones = np.ones_like(t)  # each block of 4 holds its absmax 1.0 first
    w = np.stack([ones, t, above, 0 * t], axis=1)
    codes = _codes(quantize_nf4(jnp.asarray(w), blocksize=4).packed).reshape(15, 4)
    np.testing.assert_array_equal(codes[:, 0], 15)
    np.testing.assert_array_equal(codes[:, 1], np.arange(15))
    np.testing.assert_array_equal(codes[:, 2], np.arange(1, 16))
    np.testing.assert_array_equal(codes[:, 3], 7)


@pytest.mark.parametrize(
    "weight,packed",
    [([1.0, -1.0], [0xF0]), ([-1.0, 1.0], [0x0F]), ([1.0, -1.0, 1.0], [0xF0, 0xF7])],
    ids=["first-high", "second-low", "odd-size-pads-with-code-of-zero"],
)
def test_first_element_in_the_high_nibble(weight, packed):
    a = quantize_nf4(jnp.array(weight))
    np.testing.assert_array_equal(a.packed, np.array(packed, np.uint8))
    np.testing.assert_array_equal(a.materialize(), np.array(weight, np.float32))


@pytest.mark.parametrize(
    "shape,blocksize",
    [((64, 64), 64), ((7,), 2), ((2, 3, 5), 4)],
)
def test_storage_is_half_a_byte_per_value_plus_absmaxes(shape, blocksize):
    n = math.prod(shape)
    a = quantize_nf4(jnp.ones(shape), blocksize=blocksize)
    assert a.packed.dtype == jnp.uint8 and a.packed.shape == (math.ceil(n / 2),)
    assert a.absmax.dtype == jnp.float32 and a.absmax.shape == (math.ceil(n / blocksize),)
    assert a.nbytes == math.ceil(n / 2) + 4 * math.ceil(n / blocksize)
    assert a.shape == shape and a.dtype == jnp.float32
    assert a.to_bnb_dict()["weight"].shape == (math.ceil(n / 2), 1)


@settings(max_examples=example_count(10), deadline=None)
@given(
    shape=st.lists(st.integers(1, 24), min_size=1, max_size=3).map(tuple),
    blocksize=st.sampled_from([2, 4, 6, 16, 64, 256]),
    dtype=st.sampled_from(list(DTYPES)),
    scale=st.sampled_from([1e-3, 1.0, 100.0]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_error_is_within_half_a_code_gap(shape, blocksize, dtype, scale, seed):
    jdtype, _ = DTYPES[dtype]
    w = (scale * np.random.default_rng(seed).standard_normal(shape)).astype(jdtype)
    dense = jax.jit(lambda w: quantize_nf4(w, blocksize=blocksize).materialize())(w)
    assert dense.dtype == jdtype
    got = np.asarray(dense, np.float64).reshape(-1)
    flat = np.asarray(w, np.float64).reshape(-1)
    padded = np.pad(np.abs(flat), (0, -flat.size % blocksize))
    absmax = np.repeat(padded.reshape(-1, blocksize).max(axis=1), blocksize)[: flat.size]
    # Half a gap of the code, scaled, plus the rounding of the result to `dtype`.
    eps = float(jnp.finfo(jdtype).eps)
    bound = absmax * (HALF_GAP + eps) + 1e-7 * scale
    assert np.all(np.abs(got - flat) <= bound)


@pytest.mark.parametrize(
    "shape,blocksize,dtype",
    [
        # (48, 80) in each dtype; the fast tier runs float32's, and bfloat16 and float16 on
        # the two shapes below
        *(
            ((48, 80), 64, dtype)
            if dtype == "float32"
            else pytest.param((48, 80), 64, dtype, marks=pytest.mark.variant_sweep)
            for dtype in DTYPES
        ),
        ((37, 29), 64, "bfloat16"),  # odd size
        ((5, 7), 16, "float16"),
        ((301,), 256, "float32"),
    ],
)
def test_quantize_matches_bitsandbytes_bit_for_bit(shape, blocksize, dtype):
    jdtype, tdtype = DTYPES[dtype]
    w = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(tdtype)
    w.view(-1)[:blocksize] = 0.0  # an all-zero block: 0 * (1 / 0) is NaN, code 0
    want_packed, want_absmax = torch_quantize_nf4(w, blocksize)
    # (the arithmetic runs jitted inside `quantize_nf4`, as it would in a user's jit)
    a = quantize_nf4(jnp.asarray(w.float().numpy()).astype(jdtype), blocksize=blocksize)
    np.testing.assert_array_equal(a.packed, want_packed)
    np.testing.assert_array_equal(a.absmax, want_absmax)
    want = torch_dequantize_nf4(a.packed, a.absmax, blocksize, shape, tdtype)
    np.testing.assert_array_equal(np.asarray(materialize(a), np.float32), want.float().numpy())


def test_double_quant_matches_bitsandbytes():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    a = quantize_nf4(jnp.asarray(w.numpy()), double_quant=True)
    packed, absmax = torch_quantize_nf4(w, 64)
    np.testing.assert_array_equal(a.packed, packed)
    dynamic = torch_dynamic_map()
    np.testing.assert_array_equal(a.to_bnb_dict()["weight.nested_quant_map"], dynamic.numpy())
    # bitsandbytes subtracts `absmax.mean()`; the last bit of a float32 mean depends on the
    # summation order (it differs between bitsandbytes' own CUDA and CPU paths too).
    offset = np.asarray(a.nested_offset)
    np.testing.assert_allclose(offset, torch.from_numpy(absmax).mean().numpy(), rtol=1e-6)
    codes, nested_absmax = torch_quantize_blockwise(torch.from_numpy(absmax - offset), dynamic, 256)
    np.testing.assert_array_equal(a.absmax, codes)
    np.testing.assert_array_equal(a.nested_absmax, nested_absmax)


def test_double_quant_is_close_and_smaller():
    w = jax.random.normal(jax.random.key(0), (512, 256)) * jnp.linspace(0.1, 3.0, 256)[None]
    single, double = quantize_nf4(w), quantize_nf4(w, double_quant=True)
    offset = np.asarray(double.nested_offset)
    nested_scale = np.abs(np.asarray(single.absmax) - offset).max()
    dynamic = torch_dynamic_map().numpy()
    blocks = single.absmax.size
    nested_absmax = np.repeat(np.asarray(double.nested_absmax), 256)[:blocks]
    absmax = dynamic[np.asarray(double.absmax)] * nested_absmax + offset
    # half the widest gap of the dynamic map (next to 1.0) per unit of nested absmax
    gap = np.diff(dynamic).max() / 2
    err = np.abs(absmax - np.asarray(single.absmax)).max()
    assert 0 < err <= gap * nested_scale * (1 + 1e-6)
    n = w.size
    assert single.nbytes == n // 2 + 4 * (n // 64)
    assert double.nbytes == n // 2 + n // 64 + 4 * math.ceil(n / 64 / 256) + 4
    diff = np.abs(np.asarray(double.materialize() - single.materialize())).max()
    assert diff <= gap * nested_scale * (1 + 1e-6)
    np.testing.assert_array_equal(double.packed, single.packed)


# ---------------------------------------------------------------- the real bitsandbytes (CPU)

_CODE32 = np.array(NF4_CODE, np.float32)
_MIDPOINTS32 = (_CODE32[:-1] + _CODE32[1:]) / np.float32(2)
# Values on the code's midpoints and next to them (ties, in a block whose absmax is 1.0),
# and any others; no subnormals: bitsandbytes' CPU path clamps a block's absmax to 1e-38.
_VALUES = st.one_of(
    st.sampled_from(
        [
            1.0,
            -1.0,
            *_MIDPOINTS32,
            *np.nextafter(_MIDPOINTS32, np.float32(2)),
            *np.nextafter(_MIDPOINTS32, np.float32(-2)),
        ]
    ),
    st.floats(-1e4, 1e4, width=32, allow_subnormal=False),
)


def _bnb_checkpoint(packed, quant_state):
    """bitsandbytes' quantized weight as the entries `Linear4bit` saves, in NumPy."""
    entries = {"weight": packed, **quant_state.as_dict(packed=True)}
    return {("" if k == "weight" else "weight.") + k: v.numpy() for k, v in entries.items()}


def _bnb_cpu_dequantizes(shape, blocksize):
    """Whether bitsandbytes 0.50.2's CPU `dequantize_4bit` gives the right weight of `shape`.

    Its quantization is right for every shape, its dequantization not:
    - The AVX-512 branch of `dequantizeBlockwise4bitCpu` (csrc/cpu_ops.cpp), which
      bitsandbytes/backends/cpu/ops.py calls when `shape[-1]` is even, takes the weight as
      rows of `shape[-1]` values and, when `shape[-1]` is a multiple of 16, scales value j of
      row i by `absmax[i * (shape[-1] // blocksize) + j // blocksize]`: right only if every
      row starts a block. A (9, 16) weight in blocks of 128 is scaled by `absmax[0]`
      throughout. (Its NEON branch checks `shape[-1] % blocksize == 0`; the scalar branch,
      used without AVX-512, indexes the flattened weight, as the CUDA kernel does.)
    - `functional.dequantize_4bit` transposes its result when the packed weight has one row
      (functional.py:1075, a shim for an old layout): for 1 or 2 values that is always, and
      `t()` raises for a weight of more than 2 dimensions.
    """
    rows, n = math.prod(shape[:-1]), shape[-1]
    rows_off_blocks = rows > 1 and n % 16 == 0 and n % blocksize != 0
    return not rows_off_blocks and not (len(shape) > 2 and math.prod(shape) <= 2)


def _assert_equal_to_bitsandbytes(w, blocksize):
    """`quantize_nf4(w)` equals bitsandbytes' on CPU, and so does its dequantized weight
    where bitsandbytes' CPU dequantization is right (`_bnb_cpu_dequantizes`)."""
    jdtype, tdtype = DTYPES[jnp.dtype(w.dtype).name]
    packed, state = bnb_functional.quantize_4bit(
        torch.tensor(np.asarray(w, np.float32)).to(tdtype), blocksize=blocksize, quant_type="nf4"
    )
    a = quantize_nf4(w, blocksize=blocksize)
    absmax, their_absmax = np.asarray(a.absmax), state.absmax.numpy()
    codes, theirs = _codes(a.packed), _codes(packed.numpy().reshape(-1))
    zero_block = absmax == 0
    zero = np.repeat(zero_block, blocksize)[: codes.size]
    np.testing.assert_array_equal(absmax[~zero_block], their_absmax[~zero_block])
    np.testing.assert_array_equal(codes[~zero], theirs[~zero])
    # All-zero blocks: peftx writes code 0 as bitsandbytes' CUDA kernel does (0 * 1/0 is
    # NaN there); its CPU path writes code 7 (0.0), with an absmax of 1e-38 in a partial
    # last block. All dequantize to zero.
    assert np.all(codes[zero] == 0) and np.all(theirs[zero] == 7)
    assert np.all(their_absmax[zero_block] <= np.float32(1e-38))
    if not _bnb_cpu_dequantizes(w.shape, blocksize):
        return
    want = bnb_functional.dequantize_4bit(packed, state)
    assert want.dtype == tdtype and a.dtype == jdtype
    # (bitsandbytes returns a 1-D weight as a column)
    np.testing.assert_array_equal(
        np.asarray(materialize(a), np.float32).reshape(-1), want.float().numpy().reshape(-1)
    )


@pytest.mark.parametrize("blocksize", [64, pytest.param(128, marks=pytest.mark.torch_round_trip)])
@settings(max_examples=example_count(6), deadline=None)
@given(data=st.data())
def test_nf4_equals_real_bitsandbytes_bit_for_bit(blocksize, data):
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, max_side=24), label="shape")
    dtype = data.draw(st.sampled_from(list(DTYPES)), label="dtype")
    w = jnp.asarray(data.draw(hnp.arrays(np.float32, shape, elements=_VALUES), label="w"))
    _assert_equal_to_bitsandbytes(w.astype(DTYPES[dtype][0]), blocksize)


def numpy_nf4(w, blocksize):
    """NF4 by its definition: float32 absmax per block of `blocksize` consecutive values of
    the flattened weight (the last block partial), `x * (1 / absmax)` to the nearest code
    (a tie and an all-zero block's NaN to the lower one); the codes, absmaxes and the
    dequantized weight `code * absmax` in float32."""
    flat = np.asarray(w, np.float32).reshape(-1)
    n = flat.size
    starts = range(0, n, blocksize)
    absmax = np.array([np.abs(flat[i : i + blocksize]).max() for i in starts], np.float32)
    scale = np.repeat(absmax, blocksize)[:n]
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = flat * (np.float32(1) / scale)
    codes = np.sum(scaled[:, None] > _MIDPOINTS32[None, :], axis=1)
    return codes, absmax, (_CODE32[codes] * scale).reshape(np.shape(w))


def _ci_case_a():
    """1.0, then 143 times the lowest midpoint of the code (falsified the check in CI)."""
    w = np.full(144, _MIDPOINTS32[0], np.float32)
    w[0] = 1.0
    return w.reshape(9, 16)


def _normal(shape, zeros=0):
    w = np.random.default_rng(math.prod(shape)).standard_normal(shape).astype(np.float32)
    w.reshape(-1)[:zeros] = 0.0
    return w


@pytest.mark.parametrize(
    "w,blocksize,dtype",
    [
        (_ci_case_a(), 128, "float32"),  # bitsandbytes reads the second block as -1.0
        (np.full((1, 1, 1), -0.3, np.float32), 64, "float32"),  # bitsandbytes raises
        (np.array([[[1.0], [-0.5]]], np.float32), 64, "bfloat16"),
        (_normal((12, 16)), 64, "bfloat16"),  # rows shorter than a block
        (_normal((2, 96)), 64, "float16"),  # rows across blocks
        (_normal((3, 2, 40), zeros=64), 64, "float32"),  # an all-zero block, a partial one
    ],
    ids=["ci-9x16", "ci-1x1x1", "1x2x1", "12x16", "2x96", "3x2x40"],
)
def test_nf4_equals_a_numpy_formula(w, blocksize, dtype):
    """NF4's definition, on weights whose dequantization bitsandbytes' CPU path gets wrong
    or fails on (`_bnb_cpu_dequantizes`; the first two falsified the check against it in
    CI) and one with an all-zero and a partial block. Real bitsandbytes checks the codes
    and absmaxes, and the dequantized values of the flattened weight."""
    jdtype = DTYPES[dtype][0]
    w = jnp.asarray(w).astype(jdtype)
    codes, absmax, dense = numpy_nf4(np.asarray(w, np.float32), blocksize)
    a = quantize_nf4(w, blocksize=blocksize)
    np.testing.assert_array_equal(_codes(a.packed)[: w.size], codes)
    np.testing.assert_array_equal(a.absmax, absmax)
    got = materialize(a)
    assert got.dtype == jdtype and got.shape == w.shape
    np.testing.assert_array_equal(got, jnp.asarray(dense).astype(jdtype))
    _assert_equal_to_bitsandbytes(w, blocksize)
    _assert_equal_to_bitsandbytes(w.reshape(-1), blocksize)


def test_nf4_ties_go_down_as_in_real_bitsandbytes():
    """Each midpoint of the code, and its neighbours, in a block whose absmax is 1."""
    up, down = (np.nextafter(_MIDPOINTS32, np.float32(x)) for x in (2, -2))
    block = np.concatenate([[1.0], _MIDPOINTS32, up, down, [-1.0]]).astype(np.float32)
    _assert_equal_to_bitsandbytes(jnp.asarray(block), 64)


@pytest.mark.parametrize("double_quant", [False, True], ids=["single", "double-quant"])
@pytest.mark.parametrize(
    "stored,compute", [("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "float32")]
)
def test_nf4_matmul_equals_bitsandbytes_on_its_own_checkpoint(stored, compute, double_quant):
    """A weight bitsandbytes quantized, read by `from_bnb_dict`, multiplies as
    `bnb.matmul_4bit` does: dequantized straight to the compute dtype, then multiplied."""
    (jcompute, tcompute), k = DTYPES[compute], 256
    w = torch.randn(48, k, generator=torch.Generator().manual_seed(0)).to(DTYPES[stored][1])
    packed, state = bnb_functional.quantize_4bit(
        w, compress_statistics=double_quant, quant_type="nf4"
    )
    a = NF4Array.from_bnb_dict(_bnb_checkpoint(packed, state), dtype=jcompute)
    assert (a.stored_dtype, a.dtype, a.double_quant) == (stored, compute, double_quant)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1)).to(tcompute)
    want = bnb.matmul_4bit(x, packed.t(), quant_state=state).float().numpy()
    with strict():
        got = jax.jit(use_implicit_args(lambda w, x: x @ w.T))(
            a, jnp.asarray(x.float().numpy()).astype(jcompute)
        )
    assert got.dtype == jcompute
    got = np.asarray(got, np.float32)
    sum_abs = np.abs(x.double().numpy()) @ np.abs(np.asarray(materialize(a), np.float64)).T
    # Two float32 sums of k products in different orders: k·eps·Σ|x·w| apart (γ_k each);
    # 2·eps·Σ|x·w| more for a double-quantized absmax rounded once (XLA's multiply-add)
    # where bitsandbytes rounds twice; then half an ulp each for the rounding to `compute`.
    eps32, eps = float(jnp.finfo(jnp.float32).eps), float(jnp.finfo(jcompute).eps)
    bound = (k + 2) * eps32 * sum_abs + eps * np.maximum(np.abs(got), np.abs(want))
    assert np.all(np.abs(got - want) <= bound)


def test_double_quant_against_bitsandbytes_cpu():
    """Double quantization: each block absmax goes to the nearest code of the dynamic map
    in peftx; bitsandbytes' CPU kernel rounds the value to a grid of 65536 points on
    [-1, 1] first (`NF4Array`'s docstring). The codes agree but next to a midpoint."""
    w = torch.randn(1024, 512, generator=torch.Generator().manual_seed(0))
    w = w * torch.linspace(0.1, 3.0, 512)
    a = quantize_nf4(jnp.asarray(w.numpy()), double_quant=True)
    blocks, dynamic = a.absmax.size, torch_dynamic_map().numpy()

    # The rule, on the same input: peftx's `absmax - offset`, 8-bit codes in blocks of 256.
    _, absmax = torch_blocks(w.reshape(-1), 64)
    x = absmax - torch.tensor(np.asarray(a.nested_offset))
    theirs, state2 = bnb_functional.quantize_blockwise(x, blocksize=256)
    np.testing.assert_array_equal(state2.code.numpy(), dynamic)
    np.testing.assert_array_equal(a.nested_absmax, state2.absmax.numpy())
    codes, theirs = np.asarray(a.absmax, np.int64), theirs.numpy().astype(np.int64)
    differ = codes != theirs
    assert differ.mean() <= 0.01, differ.sum()  # measured: 5 of 8192 blocks
    assert np.all(np.abs(codes - theirs)[differ] == 1)
    nested = np.repeat(np.asarray(a.nested_absmax), 256)[:blocks]
    scaled = x.numpy() * (np.float32(1) / nested)
    # The two codes are neighbours, and the value lies within half a grid step (1/65535)
    # of their midpoint: rounded to the grid, it crossed the midpoint. The grid index,
    # below 2**16, takes three float32 roundings: 3·2**-8 of a step, 2**-5 of a half step.
    midpoint = (dynamic[codes] + dynamic[theirs]) / 2
    assert np.all(np.abs(scaled - midpoint)[differ] <= (1 + 2**-5) / 65535)

    # End to end: `quantize_4bit(compress_statistics=True)` and `dequantize_4bit`.
    packed, state = bnb_functional.quantize_4bit(w, compress_statistics=True, quant_type="nf4")
    np.testing.assert_array_equal(a.packed, packed.numpy().reshape(-1))
    eps = float(jnp.finfo(jnp.float32).eps)
    offset, their_offset = float(a.nested_offset), float(state.offset)
    # float32 means of the same values summed in different orders: (n - 1)·u·mean apart
    # each, so n·eps·mean at most.
    assert abs(offset - their_offset) <= blocks * eps * offset
    codes, theirs = np.asarray(a.absmax, np.int64), state.absmax.numpy().astype(np.int64)
    assert (codes != theirs).mean() <= 0.01 and np.all(np.abs(codes - theirs) <= 1)
    their_nested = np.repeat(state.state2.absmax.numpy(), 256)[:blocks]
    # A block's absmax is dynamic[code]·nested + offset; its dequantized values are NF4
    # codes (|c| <= 1) times it. So the blocks differ by at most: the codes' step times
    # the nested absmax, the offsets' difference (twice: the nested absmax, a max of
    # |absmax - offset|, moves with it), and three roundings on each side (product, sum,
    # value): 6·u = 3·eps of the absmax.
    step = np.abs(dynamic[codes] - dynamic[theirs])
    block_absmax = np.abs(dynamic[codes]) * nested + offset
    bound = (
        step * np.maximum(nested, their_nested)
        + 2 * abs(offset - their_offset)
        + 3 * eps * block_absmax
    )
    ours = np.asarray(materialize(a)).reshape(blocks, 64)
    want = bnb_functional.dequantize_4bit(packed, state).numpy().reshape(blocks, 64)
    assert np.all(np.abs(ours - want) <= bound[:, None])


# ---------------------------------------------------------------- checkpoint format


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize(
    "dtype,compute", [("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16")]
)
def test_bnb_dict_layout_and_round_trip(double_quant, dtype, compute):
    """The checkpoint holds the stored weight's dtype, as bitsandbytes' quant state does;
    the compute dtype comes back from `from_bnb_dict(dtype=...)`."""
    w = jax.random.normal(jax.random.key(1), (70, 33)).astype(DTYPES[dtype][0])
    a = quantize_nf4(w, double_quant=double_quant, dtype=compute)
    assert (a.stored_dtype, a.dtype) == (dtype, compute)
    state = a.to_bnb_dict()
    keys = ["weight", "weight.absmax", "weight.quant_map"]
    if double_quant:
        keys += ["weight.nested_absmax", "weight.nested_quant_map"]
    assert list(state) == [*keys, "weight.quant_state.bitsandbytes__nf4"]
    n, blocks = 70 * 33, math.ceil(70 * 33 / 64)
    want = {
        "weight": (np.uint8, (math.ceil(n / 2), 1)),
        "weight.absmax": (np.uint8 if double_quant else np.float32, (blocks,)),
        "weight.quant_map": (np.float32, (16,)),
        "weight.nested_absmax": (np.float32, (math.ceil(blocks / 256),)),
        "weight.nested_quant_map": (np.float32, (256,)),
    }
    for key in keys:
        assert (state[key].dtype, state[key].shape) == want[key], key
    quant_state = state["weight.quant_state.bitsandbytes__nf4"]
    assert quant_state.dtype == np.uint8 and quant_state.ndim == 1
    meta = json.loads(bytes(quant_state).decode("utf-8"))
    want_meta = {"quant_type": "nf4", "blocksize": 64, "dtype": dtype, "shape": [70, 33]}
    if double_quant:
        offset = float(a.nested_offset)
        want_meta |= {"nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": offset}
    assert list(meta.items()) == list(want_meta.items())  # bitsandbytes' key order too
    prefixed = {f"model.layers.0.mlp.down_proj.{k}": v for k, v in state.items()}
    for entries in (state, prefixed):
        loaded = NF4Array.from_bnb_dict(entries, dtype=compute)
        assert jax.tree.structure(loaded) == jax.tree.structure(a)  # with the static fields
        for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(a), strict=True):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(loaded.materialize(), a.materialize())
    # bitsandbytes reads it back to the weight in the stored dtype: bit for bit, but for
    # a double-quantized absmax, which XLA may round once (a multiply-add) where
    # bitsandbytes rounds twice: an ulp of the absmax (eps) plus each product's rounding
    # (u each side) is 2·eps in float32; rounded to bfloat16, one ulp (eps) at most.
    quant_state = bnb_functional.QuantState.from_dict(
        {k.removeprefix("weight."): torch.tensor(v) for k, v in state.items() if k != "weight"},
        device="cpu",
    )
    theirs = bnb_functional.dequantize_4bit(torch.tensor(state["weight"]), quant_state)
    assert theirs.dtype == DTYPES[dtype][1] and theirs.shape == (70, 33)
    ours = np.asarray(materialize_as(a, DTYPES[dtype][0]), np.float32)
    eps32, eps = (float(jnp.finfo(t).eps) for t in (jnp.float32, DTYPES[dtype][0]))
    rtol = max(2 * eps32, eps) if double_quant else 0
    np.testing.assert_allclose(ours, theirs.float().numpy(), rtol=rtol, atol=0)


def test_from_bnb_dict_reads_a_wider_quant_storage():
    a = quantize_nf4(jax.random.normal(jax.random.key(2), (16, 8)))
    state = a.to_bnb_dict()
    state["weight"] = state["weight"].reshape(-1).view(jnp.bfloat16).reshape(-1, 1)
    np.testing.assert_array_equal(NF4Array.from_bnb_dict(state).packed, a.packed)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda s: s.pop("weight.absmax"), "needs the entries"),
        (lambda s: s.update({"weight.quant_map": s["weight.quant_map"][::-1]}), "NF4 code"),
        (lambda s: s.update({"bias": np.zeros(3)}), "accepts"),
        (lambda s: s.update({"other.weight": s["weight"]}), "repeats the entry"),
        (
            lambda s: s.update(
                {
                    "weight.quant_state.bitsandbytes__fp4": s.pop(
                        "weight.quant_state.bitsandbytes__nf4"
                    )
                }
            ),
            "FP4 weights are not supported",
        ),
    ],
    ids=["missing", "wrong-code", "unknown", "two-weights", "fp4"],
)
def test_from_bnb_dict_errors(edit, match):
    state = quantize_nf4(jnp.ones((4, 4))).to_bnb_dict()
    edit(state)
    with pytest.raises(ValueError, match=match):
        NF4Array.from_bnb_dict(state)


# ---------------------------------------------------------------- handlers


def _quantized(kind, w):
    return {
        "nf4": lambda: quantize_nf4(w),
        "nf4-double-quant": lambda: quantize_nf4(w, double_quant=True),
        "nf4-blocksize-6": lambda: quantize_nf4(w, blocksize=6),
        "int8": lambda: quantize_int8(w),
    }[kind]()


KINDS = ["nf4", "nf4-double-quant", "nf4-blocksize-6", "int8"]
LAYOUTS = {
    "eqx W @ x": lambda w, x: w @ x[0],
    "vmap(W @ x)": lambda w, x: jax.vmap(lambda v: w @ v)(x),
    "x @ W.T": lambda w, x: x @ w.T,
    "3-D x": lambda w, x: jnp.einsum("oi,tbi->tbo", w, jnp.stack([x, 2 * x])),
    "contract the out axis": lambda w, x: jnp.tanh(x @ w.T) @ w,
}


@pytest.fixture
def chunking(request, monkeypatch):
    """Chunked: a chunk size so small that the weights here are dequantized a few rows at
    a time, with rows left over. Whole: the default, which leaves them in one piece."""
    if request.param == "chunked":
        monkeypatch.setattr(quantized_module, "_CHUNK_ELEMENTS", 40)
    return request.param


def _cases(*groups):
    """pytest params `(kind, layout, chunking)` from `(kinds, layouts, chunkings)` groups."""
    return [
        pytest.param(k, lay, c, id=f"{c}-{k}-{lay}")
        for kinds, layouts, chunkings in groups
        for c in chunkings
        for k in kinds
        for lay in layouts
    ]


# The chunked path depends on the layout (where the weight's rows land in the output) and
# on the storage (NF4 blocks that straddle chunks, int8 rows, double quantization); the
# whole path only on the storage.
DOT_CASES = _cases(
    (["nf4-blocksize-6"], list(LAYOUTS), ["chunked"]),
    (["int8"], ["x @ W.T", "3-D x"], ["chunked"]),
    (["nf4", "nf4-double-quant"], ["vmap(W @ x)"], ["chunked"]),
    (["nf4", "nf4-double-quant", "int8"], ["x @ W.T"], ["whole"]),
)


@pytest.mark.parametrize("kind,layout,chunking", DOT_CASES, indirect=["chunking"])
def test_dot_general_matches_materialized(getkey, kind, layout, chunking):
    fn = LAYOUTS[layout]
    a = _quantized(kind, jax.random.normal(getkey(), (13, 16)))
    x = jax.random.normal(getkey(), (3, 16))

    def loss(x, w, f):
        return jnp.sum(jnp.sin(f(w, x)))

    implicit = use_implicit_args(fn)

    @jax.jit  # one compilation for the handler and the dense reference
    def run(a, x):
        dense = a.materialize()
        got = implicit(a, x), jax.grad(loss)(x, a, implicit)
        return got, (fn(dense, x), jax.grad(loss)(x, dense, fn))

    with strict():
        (got, grad), (want, want_grad) = run(a, x)
    close(got, want)
    close(grad, want_grad, tol=1e-4)


STORAGE_CASES = [
    pytest.param(kind, chunking, id=f"{chunking}-{kind}")
    for kind, chunking in [("nf4", "whole"), ("nf4-double-quant", "chunked"), ("int8", "chunked")]
]


@pytest.mark.parametrize("kind,chunking", STORAGE_CASES, indirect=["chunking"])
def test_vmap_and_scan_over_stacked_quantized_weights(getkey, kind, chunking):
    dense_stack = jax.random.normal(getkey(), (4, 16, 16)) / 4
    stack = jax.vmap(lambda w: _quantized(kind, w))(dense_stack)
    assert stack.shape == (4, 16, 16)
    dense = materialize(stack)
    x = jax.random.normal(getkey(), (16,))

    def scanned(ws, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(w @ h), None), x, ws)[0]

    def loss(x, ws, f):
        return jnp.sum(f(ws, x))

    implicit = use_implicit_args(scanned)

    @jax.jit  # one compilation for the handlers and the dense reference
    def run(stack, dense, x):
        mapped = jax.vmap(use_implicit_args(lambda w, x: w @ x), in_axes=(0, None))(stack, x)
        got = implicit(stack, x), jax.grad(loss)(x, stack, implicit), mapped
        return got, (scanned(dense, x), jax.grad(loss)(x, dense, scanned), dense @ x)

    with strict():
        got, want = run(stack, dense, x)
    close(got, want)
    np.testing.assert_array_equal(materialize(jax.tree.map(lambda leaf: leaf[2], stack)), dense[2])


@pytest.mark.parametrize("kind,chunking", STORAGE_CASES, indirect=["chunking"])
def test_backward_keeps_no_dense_weight(getkey, kind, chunking):
    """Under `jax.vjp` w.r.t. the activations, what is saved for the backward pass is the
    quantized storage, not a dense copy of the weight."""
    a = _quantized(kind, jax.random.normal(getkey(), (64, 48)))
    x = jax.random.normal(getkey(), (5, 48))
    f = jax.jit(use_implicit_args(lambda a, x: jnp.sin(x @ a.T)))
    with strict():
        out, pullback = jax.vjp(lambda x: f(a, x), x)
        (dx,) = jax.jit(pullback)(jnp.ones_like(out))
    saved = [leaf for leaf in jax.tree.leaves(pullback) if hasattr(leaf, "dtype")]
    assert saved
    for leaf in saved:
        is_float = jnp.issubdtype(leaf.dtype, jnp.floating)
        assert not (is_float and leaf.size >= math.prod(a.shape)), leaf.shape
    dense = materialize(a)
    close(dx, jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(x @ dense.T))))(x), tol=1e-4)


@pytest.mark.parametrize("kind", ["nf4", "nf4-double-quant", "int8"])
def test_no_gradient_reaches_codes_or_scales(getkey, kind):
    a = _quantized(kind, jax.random.normal(getkey(), (8, 6)))
    x = jax.random.normal(getkey(), (6,))
    loss = use_implicit_args(lambda a, x: jnp.sum(a @ x))
    with strict():
        grad_a, grad_x = eqx.filter_jit(eqx.filter_grad(lambda ax: loss(*ax)))((a, x))
    float_leaves = jax.tree.leaves(grad_a)
    assert float_leaves  # the float32 scales/absmaxes are differentiable leaves ...
    for leaf in float_leaves:
        np.testing.assert_array_equal(leaf, 0.0)  # ... and get exactly nothing
    close(grad_x, jnp.sum(a.materialize(), axis=0))


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_astype_from_float32_stays_quantized(getkey, kind):
    a = _quantized(kind, jax.random.normal(getkey(), (8, 6)))
    x = jax.random.normal(getkey(), (6,)).astype(jnp.bfloat16)
    with strict():
        got = jax.jit(use_implicit_args(lambda a, x: a.astype(jnp.bfloat16) @ x))(a, x)
    np.testing.assert_array_equal(got, a.materialize().astype(jnp.bfloat16) @ x)


def test_astype_from_bfloat16_is_materialized_correctly(getkey):
    """From a narrower dtype the result would be rounded twice; the handler declines."""
    a = quantize_nf4(jax.random.normal(getkey(), (8, 6)).astype(jnp.bfloat16))
    x = jax.random.normal(getkey(), (6,))
    with materialization_policy("warn"), pytest.warns(MaterializationWarning, match="convert"):
        got = use_implicit_args(lambda a, x: a.astype(jnp.float32) @ x)(a, x)
    np.testing.assert_array_equal(got, a.materialize().astype(jnp.float32) @ x)


def test_qlora_lora_over_an_nf4_weight(getkey):
    base = quantize_nf4(jax.random.normal(getkey(), (12, 10)), double_quant=True)
    w = lora(base, r=2, lora_alpha=4.0, init="random", key=getkey())
    x = jax.random.normal(getkey(), (3, 10))
    params, static = eqx.partition(w, lambda leaf: leaf is w.lora_A or leaf is w.lora_B)

    def loss(params, x, f):
        return jnp.sum(jnp.sin(f(eqx.combine(params, static), x)))

    implicit = use_implicit_args(lambda w, x: x @ w.T)

    def dense(w, x):
        return x @ w.materialize().T

    @jax.jit  # one compilation for the handlers and the dense reference
    def run(params, x):
        w = eqx.combine(params, static)
        got = implicit(w, x), jax.grad(loss)(params, x, implicit)
        return got, (dense(w, x), jax.grad(loss)(params, x, dense))

    with strict():
        got, want = run(params, x)
    close(got, want)


# ---------------------------------------------------------------- int8


def test_int8_codes_and_round_trip(getkey):
    w = jax.random.normal(getkey(), (5, 3, 4)).at[2].set(0.0)  # N-D, channel axis 0
    a = quantize_int8(w)
    wn = np.asarray(w)
    absmax = np.abs(wn).reshape(5, -1).max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = np.nan_to_num(np.round(wn * (np.float32(127) / absmax)[:, None, None]))
    np.testing.assert_array_equal(a.codes, want.astype(np.int8))
    np.testing.assert_array_equal(a.scale, absmax / np.float32(127))
    assert a.shape == (5, 3, 4) and a.dtype == jnp.float32 and a.nbytes == 60 + 4 * 5
    err = np.abs(np.asarray(a.materialize()) - wn)
    assert np.all(err <= (absmax / 254 + 1e-6 * absmax)[:, None, None])
    np.testing.assert_array_equal(a.materialize()[2], 0.0)
    half = quantize_int8(w.astype(jnp.float16))
    assert half.dtype == jnp.float16 and half.materialize().dtype == jnp.float16


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: quantize_nf4(jnp.ones((4, 4), jnp.int32)), TypeError, "floating-point"),
        (lambda: quantize_nf4(jnp.ones((4, 4)), blocksize=3), ValueError, "multiple of 2"),
        (lambda: quantize_nf4(jnp.ones((4, 4)), blocksize=0), ValueError, "multiple of 2"),
        (lambda: quantize_nf4(jnp.ones((4, 4)), blocksize=-2), ValueError, "multiple of 2"),
        (lambda: quantize_nf4(jnp.ones((0, 4))), ValueError, "empty weight"),
        (
            lambda: quantize_nf4(jnp.ones((4, 4)), dtype=jnp.int8),
            TypeError,
            "`dtype` must be a floating dtype, got int8",
        ),
        (lambda: quantize_int8(jnp.ones((4, 4)), dtype=jnp.int32), TypeError, "floating dtype"),
        (lambda: quantize_int8(jnp.ones((4, 4), jnp.uint8)), TypeError, "floating-point"),
        (lambda: quantize_int8(jnp.float32(1.0)), ValueError, "channel axis"),
        (
            lambda: NF4Array(jnp.zeros(7, jnp.uint8), jnp.ones(1), shape=(4, 4), dtype="float32"),
            ValueError,
            r"shapes \{'packed': \(8,\), 'absmax': \(1,\)\}",
        ),
        (
            lambda: NF4Array(
                jnp.zeros(8, jnp.uint8), jnp.ones(1, jnp.uint8), shape=(16,), dtype="float32"
            ),
            TypeError,
            "`absmax` must be float32",
        ),
        (
            lambda: NF4Array(
                jnp.zeros(8, jnp.uint8),
                jnp.ones(1, jnp.uint8),
                shape=(16,),
                dtype="float32",
                nested_absmax=jnp.ones(1),
            ),
            ValueError,
            "pass both or neither",
        ),
        (
            lambda: NF4Array(jnp.zeros(8, jnp.uint8), jnp.ones(1), shape=(16,), dtype="int8"),
            TypeError,
            "floating dtype",
        ),
        (lambda: Int8Array(jnp.zeros((4, 3), jnp.int8), jnp.ones(3)), ValueError, "one entry per"),
        (lambda: Int8Array(jnp.zeros((4, 3)), jnp.ones(4)), TypeError, "codes"),
        (
            lambda: jax.vmap(quantize_nf4)(jnp.ones((2, 4, 4))).to_bnb_dict(),
            ValueError,
            "convert each slice",
        ),
    ],
)
def test_bad_input(make, error, match):
    with pytest.raises(error, match=match):
        make()
