"""Quantized weights: per-channel int8, and NF4 in bitsandbytes' exact format (QLoRA).

Both are implicit arrays. Inside `use_implicit_args`, a `dot_general` with one of them
dequantizes and multiplies in the same traced computation (a large weight a chunk of rows
at a time); under `jax.grad` the dense weight is recomputed in the backward pass rather
than kept alive from the forward pass, and no gradient reaches the codes or scales.
"""

import functools
import json
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax.typing import DTypeLike
from jaxtyping import Array, ArrayLike, Float32, Int8, Shaped, UInt8

from .._dtypes import float_dtype
from .._kind import AbstractWeight
from ..implicit import primitive_handler
from ._products import take_rows, taken_rows

# bitsandbytes' NF4 code (`get_4bit_type("nf4")`), indexed by the 4-bit value.
_NF4_CODE = np.array(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],
    dtype=np.float32,
)  # fmt: skip


def _linspace_f32(start: float, stop: float, num: int) -> np.ndarray:
    """`torch.linspace(start, stop, num, dtype=torch.float32)` to the bit.

    Torch takes a float32 step and computes each value with one rounding (a fused
    multiply-add), from `start` in the lower half and from `stop` in the upper half.
    """
    lo, hi = np.float32(start), np.float32(stop)
    step = np.float64((hi - lo) / np.float32(num - 1))
    i = np.arange(num, dtype=np.float64)
    # float64 holds `lo + step * i` exactly here, so the cast is the single rounding.
    values = np.where(
        i < num // 2, np.float64(lo) + step * i, np.float64(hi) - step * (num - 1 - i)
    )
    return values.astype(np.float32)


def _dynamic_map() -> np.ndarray:
    """bitsandbytes' signed dynamic 8-bit map (`create_dynamic_map()`): 256 sorted values."""
    values = [np.float32(0.0), np.float32(1.0)]
    for i in range(7):
        bounds = _linspace_f32(0.1, 1.0, 2**i + 1)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2.0)
        scale = np.float32(10.0 ** (i - 6))
        values += [*(scale * means), *(-scale * means)]
    return np.sort(np.array(values, dtype=np.float32))


_DYNAMIC_CODE = _dynamic_map()
# A value goes to the code above a midpoint only if strictly greater, as in bitsandbytes'
# CUDA kernels (`dQuantizeNF4`); float32 midpoints equal the thresholds written there.
_NF4_MIDPOINTS = (_NF4_CODE[:-1] + _NF4_CODE[1:]) * np.float32(0.5)
_DYNAMIC_MIDPOINTS = (_DYNAMIC_CODE[:-1] + _DYNAMIC_CODE[1:]) * np.float32(0.5)
_NESTED_BLOCKSIZE = 256  # bitsandbytes' fixed block size for double quantization
# Dense chunk size for the chunked matmul: a dense weight much bigger than this, allocated
# afresh on every call, costs more in page faults than dequantizing it does.
_CHUNK_ELEMENTS = 1 << 21


def _float_dtype(weight: Any, fn: str) -> np.dtype:
    dtype = jnp.result_type(weight)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{fn} quantizes floating-point weights (float32, bfloat16, float16), got dtype "
            f"{dtype} of shape {jnp.shape(weight)}."
        )
    if jnp.size(weight) == 0:
        raise ValueError(f"{fn} got an empty weight of shape {jnp.shape(weight)}.")
    return dtype


def _check_blocksize(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 2 or value % 2:
        raise ValueError(
            f"`{name}` must be a positive multiple of 2 (two 4-bit codes share a byte), "
            f"got {value!r}; bitsandbytes uses 64."
        )


def _nbytes(tree: Any) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jtu.tree_leaves(tree))


def _quantize_blockwise(
    flat: Float32[Array, " n"], blocksize: int, midpoints: np.ndarray
) -> tuple[UInt8[Array, " padded"], Float32[Array, " blocks"]]:
    """Absmax blockwise quantization of `flat` onto a sorted code, padded with zeros."""
    n = flat.shape[0]
    blocks = -(-n // blocksize)
    x = jnp.pad(flat, (0, blocks * blocksize - n)).reshape(blocks, blocksize)
    absmax = jnp.max(jnp.abs(x), axis=1)
    # Multiplying by the reciprocal rounds like bitsandbytes does. An all-zero block
    # gives 0 * inf = NaN, which bitsandbytes' kernels send to code 0, as here.
    scaled = x * (1 / absmax)[:, None]
    codes = jnp.searchsorted(jnp.asarray(midpoints), scaled, side="left")
    codes = jnp.where(jnp.isnan(scaled), 0, codes).astype(jnp.uint8)
    return codes.reshape(-1), absmax


def _scale_blocks(
    values: Float32[Array, "*batch length"],
    absmax: Float32[Array, "*batch blocks"],
    blocksize: int,
    n: int,
) -> Float32[Array, "*batch n"]:
    """`values[..., i] * absmax[..., i // blocksize]` for the first `n` values."""
    *batch, length = values.shape
    total = absmax.shape[-1] * blocksize
    values = jnp.pad(values, [(0, 0)] * len(batch) + [(0, total - length)])
    values = values.reshape(*batch, -1, blocksize) * absmax[..., None]
    return values.reshape(*batch, total)[..., :n]


class Int8Array(AbstractWeight):
    """A weight stored as int8 codes with one float32 scale per output channel.

    Represents `codes * scale`, the scale broadcast over the axes after the channel axis
    (axis 0 of a weight, as in Equinox's `(out, in)` layout). Build one with
    `quantize_int8`; a stack of them (e.g. by `eqx.filter_vmap`, for `jax.lax.scan`) has
    the stacking axes in front of both arrays.

    **Arguments:**

    - `codes`: int8 codes, the channel axis first (after any stacking axes).
    - `scale`: float32 scales, of shape `codes.shape[:scale.ndim]`: `(out,)` for one
        weight, `(layers, out)` for a stack.
    - `dtype`: the floating dtype of the represented weight.
    """

    codes: Int8[Array, "..."]
    scale: Float32[Array, "..."]
    _dtype: np.dtype = eqx.field(static=True)

    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {
        "codes": (0, 1),
        "scale": (0,),
    }

    def __init__(
        self,
        codes: Int8[Array, "..."],
        scale: Float32[Array, "..."],
        dtype: DTypeLike = jnp.float32,
    ):
        self.codes = codes
        self.scale = scale
        self._dtype = float_dtype(dtype)

    def __check_init__(self) -> None:
        if self.codes.dtype != jnp.int8 or self.scale.dtype != jnp.float32:
            raise TypeError(
                f"Int8Array needs int8 codes and float32 scales, got codes "
                f"{self.codes.dtype}{list(self.codes.shape)} and scale "
                f"{self.scale.dtype}{list(self.scale.shape)}."
            )
        if self.scale.ndim == 0 or self.codes.shape[: self.scale.ndim] != self.scale.shape:
            raise ValueError(
                f"Int8Array: scale of shape {self.scale.shape} must have one entry per output "
                f"channel, i.e. the leading axes of codes of shape {self.codes.shape}."
            )

    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(self.codes.shape, self._dtype)

    def num_parameters(self) -> int:
        """One per code, as PEFT counts a quantized weight's elements."""
        return 0 if self.codes is None else self.codes.size

    def materialize(self, dtype: DTypeLike | None = None) -> Shaped[Array, "..."]:
        """The dequantized weight, in the represented dtype unless `dtype` is given."""
        scale = lax.stop_gradient(self.scale)
        scale = scale.reshape(scale.shape + (1,) * (self.codes.ndim - scale.ndim))
        return (self.codes.astype(jnp.float32) * scale).astype(
            self._dtype if dtype is None else dtype
        )

    @property
    def nbytes(self) -> int:
        """Bytes of storage: codes and scales."""
        return _nbytes(self)


def quantize_int8(weight: Shaped[ArrayLike, "..."], *, dtype: DTypeLike | None = None) -> Int8Array:
    """Quantize a weight to int8 with one absmax scale per output channel (axis 0).

    The codes are bitsandbytes' LLM.int8 row codes, `round(w * 127 / absmax)`, with the
    absmax over all axes but the first; `scale = absmax / 127`.

    **Arguments:**

    - `weight`: a floating weight with the output channels on axis 0, e.g. `(out, in)`,
        quantized as stored.
    - `dtype`: the dtype the result represents and multiplies in; default the weight's.

    **Returns:**

    An `Int8Array` representing the weight.
    """
    stored = _float_dtype(weight, "quantize_int8")
    dtype = stored if dtype is None else float_dtype(dtype)  # before any work
    if jnp.ndim(weight) == 0:
        raise ValueError("quantize_int8 needs a channel axis (axis 0), got a scalar weight.")
    return Int8Array(*_int8_arrays(jnp.asarray(weight)), dtype)


@jax.jit
def _int8_arrays(weight: Shaped[Array, " out *rest"]) -> tuple[Array, Array]:
    w = weight.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(w), axis=tuple(range(1, w.ndim)))
    # An all-zero channel gets codes 0 and scale 0 instead of 0 * inf = NaN.
    inverse = 127 / jnp.where(absmax > 0, absmax, 1)
    inverse = inverse.reshape(inverse.shape + (1,) * (w.ndim - 1))
    return jnp.round(w * inverse).astype(jnp.int8), absmax / 127


class NF4Array(AbstractWeight):
    """A weight in bitsandbytes' NF4 format (QLoRA), optionally double-quantized.

    The weight is flattened row-major and cut into blocks of `blocksize` values (the last
    one zero-padded); each block stores its float32 absmax, and each value the index of
    the nearest NF4 code to `value / absmax`, two per byte with the first in the high
    nibble. With double quantization the block absmaxes are themselves stored as 8-bit
    codes of bitsandbytes' dynamic map, in blocks of `nested_blocksize`, around their mean
    `nested_offset`: each `(absmax - nested_offset) / nested_absmax` goes to the nearest
    code of the map (to the lower one on a tie), as bitsandbytes' CUDA kernel and its
    PyTorch backend pick it. bitsandbytes' CPU kernel (0.50, `quantize_cpu_impl`) first
    rounds the value to the nearest of 65536 evenly spaced points of [-1, 1] and takes the
    code nearest that point, so a value within 1/65535 of the midpoint of two codes can go
    to the farther one: about 1 block in 1000 then holds the neighbouring code.
    Leading axes of the arrays before the packed axis are stacking axes (e.g. layers
    stacked for `jax.lax.scan`). Build one with `quantize_nf4` or `NF4Array.from_bnb_dict`.

    **Arguments:**

    - `packed`: uint8, `ceil(n / 2)` bytes for `n` represented values.
    - `absmax`: one float32 per block, or its uint8 code when double-quantized.
    - `shape`, `dtype`: shape and floating dtype of the represented weight; `dtype` is
        the dtype it dequantizes to and multiplies in (bitsandbytes' compute dtype).
    - `blocksize`: values per block (bitsandbytes: 64).
    - `nested_absmax`: float32 absmax of each block of codes in `absmax`, when
        double-quantized.
    - `nested_offset`: the float32 mean subtracted before double quantization.
    - `nested_blocksize`: codes of `absmax` per nested block (bitsandbytes: 256).
    - `stored_dtype`: the dtype of the weight that was quantized (bitsandbytes'
        `quant_state.dtype`); default `dtype`.
    """

    packed: UInt8[Array, "*batch half"]
    absmax: Float32[Array, "*batch blocks"] | UInt8[Array, "*batch blocks"]
    nested_absmax: Float32[Array, "*batch nested_blocks"] | None
    nested_offset: Float32[Array, "*batch"] | None
    blocksize: int = eqx.field(static=True)
    nested_blocksize: int = eqx.field(static=True)
    _shape: tuple[int, ...] = eqx.field(static=True)
    _dtype: np.dtype = eqx.field(static=True)
    _stored_dtype: np.dtype = eqx.field(static=True)

    # flattened row-major, so their one axis splits as the weight's rows do; the nested
    # offset is one scalar per weight
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {
        "packed": (0,),
        "absmax": (0,),
        "nested_absmax": (0,),
    }

    def __init__(
        self,
        packed: UInt8[Array, "*batch half"],
        absmax: Float32[Array, "*batch blocks"] | UInt8[Array, "*batch blocks"],
        *,
        shape: tuple[int, ...],
        dtype: DTypeLike,
        blocksize: int = 64,
        nested_absmax: Float32[Array, "*batch nested_blocks"] | None = None,
        nested_offset: Float32[Array, "*batch"] | None = None,
        nested_blocksize: int = _NESTED_BLOCKSIZE,
        stored_dtype: DTypeLike | None = None,
    ):
        self.packed = packed
        self.absmax = absmax
        self.nested_absmax = nested_absmax
        self.nested_offset = nested_offset
        self.blocksize = blocksize
        self.nested_blocksize = nested_blocksize
        self._shape = tuple(shape)
        self._dtype = float_dtype(dtype)
        self._stored_dtype = (
            self._dtype if stored_dtype is None else float_dtype(stored_dtype, "stored_dtype")
        )

    def __check_init__(self) -> None:
        nested = self.nested_absmax is not None
        if nested != (self.nested_offset is not None):
            raise ValueError(
                "NF4Array: `nested_absmax` and `nested_offset` describe double quantization "
                "together; pass both or neither."
            )
        absmax_dtype = jnp.uint8 if nested else jnp.float32
        dtypes = [("packed", self.packed, jnp.uint8), ("absmax", self.absmax, absmax_dtype)]
        if nested:
            dtypes += [
                ("nested_absmax", self.nested_absmax, jnp.float32),
                ("nested_offset", self.nested_offset, jnp.float32),
            ]
        for name, value, want in dtypes:
            if value.dtype != want:
                raise TypeError(
                    f"NF4Array: `{name}` must be {jnp.dtype(want)}"
                    f"{' (double-quantized)' if name == 'absmax' and nested else ''}, "
                    f"got {value.dtype}{list(value.shape)}."
                )
        _check_blocksize("blocksize", self.blocksize)
        if not isinstance(self.nested_blocksize, int) or self.nested_blocksize < 1:
            raise ValueError(
                f"`nested_blocksize` must be a positive integer, got {self.nested_blocksize!r}."
            )
        n = math.prod(self._shape)
        if n < 1 or self.packed.ndim == 0:
            raise ValueError(
                f"NF4Array needs at least one value and a packed axis, got shape {self._shape} "
                f"and packed of shape {self.packed.shape}."
            )
        batch = self.packed.shape[:-1]
        blocks = -(-n // self.blocksize)
        want = {"packed": (*batch, -(-n // 2)), "absmax": (*batch, blocks)}
        if nested:
            want["nested_absmax"] = (*batch, -(-blocks // self.nested_blocksize))
            want["nested_offset"] = batch
        got = {name: getattr(self, name).shape for name in want}
        if got != want:
            raise ValueError(
                f"NF4Array of shape {self._shape} with blocksize {self.blocksize} needs "
                f"arrays of shapes {want}, got {got}."
            )

    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(self.packed.shape[:-1] + self._shape, self._dtype)

    def num_parameters(self) -> int:
        """Two per packed byte (two 4-bit codes), as PEFT counts a quantized weight's
        elements."""
        return 0 if self.packed is None else 2 * self.packed.size

    def materialize(self, dtype: DTypeLike | None = None) -> Shaped[Array, "..."]:
        """The dequantized weight, in the represented dtype unless `dtype` is given."""
        batch = self.packed.shape[:-1]
        codes = jnp.stack([self.packed >> 4, self.packed & 15], axis=-1).reshape(*batch, -1)
        values = jnp.asarray(_NF4_CODE)[codes]
        n = math.prod(self._shape)
        values = _scale_blocks(values, self._float_absmax(), self.blocksize, n)
        return values.reshape(*batch, *self._shape).astype(self._dtype if dtype is None else dtype)

    def _float_absmax(self) -> Float32[Array, "*batch blocks"]:
        if self.nested_absmax is None:
            return lax.stop_gradient(self.absmax)
        values = jnp.asarray(_DYNAMIC_CODE)[self.absmax]
        nested = lax.stop_gradient(self.nested_absmax)
        absmax = _scale_blocks(values, nested, self.nested_blocksize, self.absmax.shape[-1])
        # bitsandbytes rounds the product before adding the offset; under `jax.jit` XLA may
        # fuse the two into one rounding, so the last bit of some absmaxes can differ.
        return absmax + lax.stop_gradient(self.nested_offset)[..., None]

    @property
    def stored_dtype(self) -> np.dtype:
        """The dtype of the weight that was quantized (bitsandbytes' `quant_state.dtype`)."""
        return self._stored_dtype

    @property
    def double_quant(self) -> bool:
        """Whether the block absmaxes are themselves quantized."""
        return self.nested_absmax is not None

    @property
    def nbytes(self) -> int:
        """Bytes of storage: packed codes, absmaxes and, if double-quantized, their state."""
        return _nbytes(self)

    def to_bnb_dict(self) -> dict[str, np.ndarray]:
        """This weight as the state-dict entries bitsandbytes' `Linear4bit` saves.

        Keys are relative to the module, as in HF checkpoints: `weight` (packed uint8 of
        shape `(ceil(n / 2), 1)`), `weight.absmax`, `weight.quant_map` and, if
        double-quantized, `weight.nested_absmax` and `weight.nested_quant_map`; then
        `weight.quant_state.bitsandbytes__nf4`, the JSON of the remaining state as uint8
        (`quant_type`, `blocksize`, `dtype`, `shape`, and `nested_blocksize`,
        `nested_dtype`, `nested_offset`), byte for byte as bitsandbytes writes it. `dtype`
        is `stored_dtype`: the compute dtype is not part of a bitsandbytes checkpoint.

        **Returns:**

        A dict of NumPy arrays; prefix each key with the module path, e.g.
        `model.layers.0.self_attn.q_proj.`.
        """
        if self.packed.ndim != 1:
            raise ValueError(
                f"to_bnb_dict converts one weight, got a stack of shape {self.shape}; convert "
                "each slice, e.g. `jax.tree.map(lambda x: x[i], array)`."
            )
        state = {
            "weight": np.asarray(self.packed).reshape(-1, 1),
            "weight.absmax": np.asarray(self.absmax),
            "weight.quant_map": _NF4_CODE.copy(),
        }
        meta: dict[str, Any] = {
            "quant_type": "nf4",
            "blocksize": self.blocksize,
            "dtype": self._stored_dtype.name,
            "shape": list(self._shape),
        }
        if self.double_quant:
            state["weight.nested_absmax"] = np.asarray(self.nested_absmax)
            state["weight.nested_quant_map"] = _DYNAMIC_CODE.copy()
            meta |= {
                "nested_blocksize": self.nested_blocksize,
                "nested_dtype": "float32",
                "nested_offset": float(self.nested_offset),
            }
        packed_meta = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
        state["weight.quant_state.bitsandbytes__nf4"] = packed_meta.copy()
        return state

    @classmethod
    def from_bnb_dict(
        cls, state: Mapping[str, ArrayLike], *, dtype: DTypeLike | None = None
    ) -> "NF4Array":
        """Read a weight saved by bitsandbytes' `Linear4bit` (an HF NF4 checkpoint).

        **Arguments:**

        - `state`: the entries of one weight, keyed as `to_bnb_dict` returns them, with
            or without the module prefix (only the last dotted component is read).
        - `dtype`: the compute dtype (`bnb_4bit_compute_dtype`); default the stored one.

        **Returns:**

        The `NF4Array`, bit for bit the stored codes and absmaxes.
        """
        parts: dict[str, np.ndarray] = {}
        for key, value in state.items():
            name = key.rsplit(".", 1)[-1]
            if name in parts:
                raise ValueError(
                    f"from_bnb_dict reads one weight, but {key!r} repeats the entry {name!r}; "
                    "pass only the entries of one module's weight."
                )
            parts[name] = np.asarray(value)
        meta = _read_quant_state(parts)
        allowed = {"weight", "absmax", "quant_map", "nested_absmax", "nested_quant_map"}
        required = {"weight", "absmax", "quant_map"}
        if meta.get("nested_offset") is not None:
            required |= {"nested_absmax", "nested_quant_map"}
        if not required <= parts.keys() <= allowed:
            raise ValueError(
                f"from_bnb_dict needs the entries {sorted(required)} and accepts "
                f"{sorted(allowed)} (plus `quant_state.bitsandbytes__nf4`), got {sorted(parts)}."
            )
        _check_code(parts["quant_map"], _NF4_CODE, "quant_map", "the NF4 code")
        nested_absmax = nested_offset = None
        if "nested_absmax" in parts:
            _check_code(
                parts["nested_quant_map"], _DYNAMIC_CODE, "nested_quant_map", "the dynamic map"
            )
            if meta.get("nested_dtype") != "float32" or "nested_offset" not in meta:
                raise ValueError(
                    "from_bnb_dict: a double-quantized weight needs `nested_offset` and "
                    f"`nested_dtype` 'float32' in its quant state, got {meta}."
                )
            nested_absmax = jnp.asarray(parts["nested_absmax"])
            nested_offset = jnp.asarray(np.float32(meta["nested_offset"]))
        # bitsandbytes may store the packed bytes in a wider `quant_storage` dtype.
        packed = np.ascontiguousarray(parts["weight"]).reshape(-1).view(np.uint8)
        return cls(
            jnp.asarray(packed),
            jnp.asarray(parts["absmax"]),
            shape=tuple(int(d) for d in meta["shape"]),
            dtype=meta["dtype"] if dtype is None else dtype,
            blocksize=int(meta["blocksize"]),
            nested_absmax=nested_absmax,
            nested_offset=nested_offset,
            nested_blocksize=int(meta.get("nested_blocksize", _NESTED_BLOCKSIZE)),
            stored_dtype=meta["dtype"],
        )


def _read_quant_state(parts: dict[str, np.ndarray]) -> dict[str, Any]:
    """Pop and decode the `quant_state.bitsandbytes__<type>` entry of `parts`."""
    kinds = [name for name in parts if name.startswith("bitsandbytes__")]
    if kinds != ["bitsandbytes__nf4"]:
        raise ValueError(
            "from_bnb_dict needs exactly one `quant_state.bitsandbytes__nf4` entry (the packed "
            f"quant state of an NF4 weight), found {kinds}; FP4 weights are not supported."
        )
    meta = json.loads(bytes(parts.pop("bitsandbytes__nf4").astype(np.uint8)).decode("utf-8"))
    dtypes = ("float32", "float16", "bfloat16")
    if meta.get("quant_type") != "nf4" or meta.get("dtype") not in dtypes:
        raise ValueError(
            f"from_bnb_dict reads NF4 weights of dtype {dtypes}, got quant state {meta}."
        )
    return meta


def _check_code(got: np.ndarray, want: np.ndarray, name: str, what: str) -> None:
    # Stored maps may differ from ours in the last bit: bitsandbytes computes its dynamic
    # map with torch.linspace, whose rounding depends on the torch build.
    if got.shape != want.shape or not np.allclose(got, want, rtol=0, atol=1e-6):
        raise ValueError(
            f"from_bnb_dict: `{name}` is not {what} bitsandbytes uses (got {got.size} values, "
            f"first {got.reshape(-1)[:4]}); only bitsandbytes' NF4 format is supported."
        )


def quantize_nf4(
    weight: Shaped[ArrayLike, "..."],
    *,
    blocksize: int = 64,
    double_quant: bool = False,
    dtype: DTypeLike | None = None,
) -> NF4Array:
    """Quantize a weight to NF4 exactly as bitsandbytes' `quantize_4bit` does.

    Codes and absmaxes equal those of bitsandbytes' CUDA kernels: each value is scaled
    by the reciprocal of its block's absmax and goes to the code above a midpoint of the
    NF4 code only when strictly greater than it. With `double_quant`, the absmaxes are
    quantized as in bitsandbytes' `compress_statistics=True`: their mean is subtracted,
    then they are quantized blockwise (blocks of 256) to its signed dynamic 8-bit map.

    **Arguments:**

    - `weight`: a floating weight of any shape (float32, bfloat16 or float16), quantized
        as stored (its dtype is the result's `stored_dtype`).
    - `blocksize`: values per absmax block, a positive multiple of 2 (bitsandbytes: 64).
    - `double_quant`: also quantize the absmaxes (QLoRA's double quantization).
    - `dtype`: the dtype the result represents, dequantizes to and multiplies in
        (bitsandbytes' compute dtype); default the weight's.

    **Returns:**

    An `NF4Array` of the weight's shape.

    ```python
    w = quantize_nf4(linear.weight, double_quant=True)
    linear = eqx.tree_at(lambda l: l.weight, linear, w)
    y = use_implicit_args(linear)(x)
    ```
    """
    stored = _float_dtype(weight, "quantize_nf4")
    dtypes = {"dtype": stored if dtype is None else float_dtype(dtype), "stored_dtype": stored}
    _check_blocksize("blocksize", blocksize)
    w = jnp.asarray(weight)
    packed, absmax = _nf4_arrays(w, blocksize)
    if not double_quant:
        return NF4Array(packed, absmax, shape=w.shape, blocksize=blocksize, **dtypes)
    offset = jnp.mean(absmax)
    nested_codes, nested_absmax = _nested_arrays(absmax, offset)
    return NF4Array(
        packed,
        nested_codes,
        shape=w.shape,
        blocksize=blocksize,
        nested_absmax=nested_absmax,
        nested_offset=offset,
        nested_blocksize=_NESTED_BLOCKSIZE,
        **dtypes,
    )


# Jitted, so that quantizing many weights of one shape compiles once.
@functools.partial(jax.jit, static_argnums=1)
def _nf4_arrays(
    w: Shaped[Array, "..."], blocksize: int
) -> tuple[UInt8[Array, " half"], Float32[Array, " blocks"]]:
    codes, absmax = _quantize_blockwise(
        w.astype(jnp.float32).reshape(-1), blocksize, _NF4_MIDPOINTS
    )
    codes = codes[: 2 * -(-w.size // 2)]
    return (codes[0::2] << 4) | codes[1::2], absmax


# Compiled apart from the mean: fused with it, XLA would subtract the mean's unrounded
# value (a fused multiply-add) rather than the offset that is stored.
@jax.jit
def _nested_arrays(
    absmax: Float32[Array, " blocks"], offset: Float32[Array, ""]
) -> tuple[UInt8[Array, " blocks"], Float32[Array, " nested_blocks"]]:
    codes, nested_absmax = _quantize_blockwise(
        absmax - offset, _NESTED_BLOCKSIZE, _DYNAMIC_MIDPOINTS
    )
    return codes[: absmax.shape[0]], nested_absmax


# --------------------------------------------------------------------------------------
# Handlers

_Quantized = Int8Array | NF4Array


def _dense(x: Any) -> Any:
    return x.materialize() if isinstance(x, _Quantized) else x


def _rows_per_chunk(w: _Quantized) -> int | None:
    """Rows of `w` per chunk of the chunked matmul; None when one piece is better."""
    if isinstance(w, NF4Array) and w.packed.ndim != 1:
        return None
    rows, *rest = w.shape
    row = math.prod(rest)
    if rows < 2 or row == 0:
        return None
    # NF4 chunks must start on a block boundary.
    align = w.blocksize // math.gcd(row, w.blocksize) if isinstance(w, NF4Array) else 1
    per_chunk = max(align, _CHUNK_ELEMENTS // row // align * align)
    return per_chunk if rows // per_chunk >= 2 else None


def _split_rows(w: _Quantized, per_chunk: int) -> tuple[_Quantized, _Quantized | None]:
    """`w` as a stack of chunks of `per_chunk` rows, and the rows left over (or None)."""
    rows, *rest = w.shape
    chunks = rows // per_chunk
    if isinstance(w, Int8Array):
        cut = chunks * per_chunk

        def head(x: Array) -> Array:
            return x[:cut].reshape(chunks, per_chunk, *x.shape[1:])

        tail = Int8Array(w.codes[cut:], w.scale[cut:], w.dtype) if cut < rows else None
        return Int8Array(head(w.codes), head(w.scale), w.dtype), tail
    values = per_chunk * math.prod(rest)
    cut_bytes, cut_blocks = chunks * values // 2, chunks * values // w.blocksize

    def part(packed: Array, absmax: Array, shape: tuple[int, ...]) -> NF4Array:
        return NF4Array(packed, absmax, shape=shape, dtype=w.dtype, blocksize=w.blocksize)

    absmax = w._float_absmax()
    head = part(
        w.packed[:cut_bytes].reshape(chunks, -1),
        absmax[:cut_blocks].reshape(chunks, -1),
        (per_chunk, *rest),
    )
    left = rows - chunks * per_chunk
    tail = part(w.packed[cut_bytes:], absmax[cut_blocks:], (left, *rest)) if left else None
    return head, tail


@primitive_handler("dot_general")
def _dot_general(
    primitive: Any,
    lhs: _Quantized | jax.Array,
    rhs: _Quantized | jax.Array,
    *,
    dimension_numbers: Any,
    **params: Any,
) -> Array:
    # Dequantize inside `jax.checkpoint`: autodiff then saves the codes, not the dense
    # weight, and the backward pass dequantizes again.
    def product(lhs: Any, rhs: Any) -> Array:
        return primitive.bind(
            _dense(lhs), _dense(rhs), dimension_numbers=dimension_numbers, **params
        )

    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if isinstance(lhs, _Quantized) and not isinstance(rhs, _Quantized):
        w, used, out_axis = lhs, (*lhs_contract, *lhs_batch), len(lhs_batch)
    elif isinstance(rhs, _Quantized) and not isinstance(lhs, _Quantized):
        w, used = rhs, (*rhs_contract, *rhs_batch)
        out_axis = lhs.ndim - len(lhs_contract)
    else:
        return jax.checkpoint(product)(lhs, rhs)
    per_chunk = _rows_per_chunk(w) if 0 not in used else None
    if per_chunk is None:
        return jax.checkpoint(product)(lhs, rhs)

    # A large weight is dequantized a chunk of rows at a time (its leading axis is free in
    # this product), so no dense copy of the whole weight is ever allocated.
    def place(part: _Quantized, other: Array) -> tuple[Any, Any]:
        return (part, other) if w is lhs else (other, part)

    other = rhs if w is lhs else lhs
    head, tail = _split_rows(w, per_chunk)
    step = jax.checkpoint(lambda part, other: product(*place(part, other)), prevent_cse=False)
    out = lax.map(lambda part: step(part, other), head)
    out = jnp.moveaxis(out, 0, out_axis)
    out = out.reshape(*out.shape[:out_axis], -1, *out.shape[out_axis + 2 :])
    if tail is None:
        return out
    return jnp.concatenate([out, jax.checkpoint(product)(*place(tail, other))], axis=out_axis)


@primitive_handler("convert_element_type")
def _astype(primitive: Any, x: _Quantized, *, new_dtype: Any, **params: Any) -> Any:
    # Exact only from float32: the dense weight is then the float32 dequantized product
    # itself, rounded once to the new dtype; from a narrower dtype it would round twice.
    if x.dtype != jnp.float32 or not jnp.issubdtype(new_dtype, jnp.floating):
        return NotImplemented
    if params.get("weak_type") or params.get("sharding") is not None:
        return NotImplemented
    if isinstance(x, Int8Array):
        return Int8Array(x.codes, x.scale, new_dtype)
    return NF4Array(
        x.packed,
        x.absmax,
        shape=x._shape,
        dtype=new_dtype,
        blocksize=x.blocksize,
        nested_absmax=x.nested_absmax,
        nested_offset=x.nested_offset,
        nested_blocksize=x.nested_blocksize,
        stored_dtype=x.stored_dtype,
    )


@primitive_handler("ragged_dot_general")
def _grouped(primitive: Any, x: jax.Array, w: _Quantized, group_sizes: jax.Array, **params: Any):
    # a stack of experts: dequantized inside `jax.checkpoint`, as for `dot_general`
    def product(x: Array, w: _Quantized, group_sizes: Array) -> Array:
        return primitive.bind(x, w.materialize(), group_sizes, **params)

    return jax.checkpoint(product)(x, w, group_sizes)


@primitive_handler("gather")
def _take(primitive: Any, w: _Quantized, indices: jax.Array, **params: Any) -> Any:
    """Whole slices along axis 0 (`jnp.take(w, idx, axis=0)`) of a weight quantized slice
    by slice (a stack of experts, each its own weight): the codes and scales of the
    taken slices, nothing dequantized."""
    if not taken_rows(w.shape, indices, params):
        return NotImplemented
    if isinstance(w, Int8Array):
        take = functools.partial(take_rows, primitive, indices=indices, params=params)
        return Int8Array(take(w.codes), take(w.scale), w.dtype)
    if w.packed.ndim < 2 or w.packed.shape[0] != w.shape[0]:
        return NotImplemented
    take = functools.partial(take_rows, primitive, indices=indices, params=params)
    nested = w.double_quant
    return NF4Array(
        take(w.packed),
        take(w.absmax),
        shape=w._shape,
        dtype=w.dtype,
        blocksize=w.blocksize,
        nested_absmax=take(w.nested_absmax) if nested else None,
        nested_offset=take(w.nested_offset[..., None])[..., 0] if nested else None,
        nested_blocksize=w.nested_blocksize,
        stored_dtype=w.stored_dtype,
    )
