"""MiSS (HF PEFT's `MISS`): one trained block shared by every shard of a weight.

The kind whole: `MissArray`, its handlers, and `MissConfig`."""

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, PRNGKeyArray

from .._config import (
    PEFT_BASE_KEYS,
    PROBABILITY,
    RANK,
    AbstractAdapterConfig,
    AdaptedLayer,
    field,
)
from .._kind import AbstractAdapter
from ..implicit import materialize
from ._layout import WeightProduct, weight_dot_handlers
from ._lora import LORA_TARGET_MODULES, LoraArray, lora_dot, lora_update
from ._products import LayerKeys, cast_base_on_astype, wider_dtype

MissVariant = Literal["balance", "bat", "mini"]


class MissArray(AbstractAdapter):
    """A `Linear` weight `(out, in)` plus PEFT's MiSS update, with PEFT's `miss_block`.

    - `"balance"` (PEFT's default, `init_weights=True` or `False`): `miss_block (r, out)`.
      The input features are cut into shards of `r` (the last one zero-padded, as PEFT
      pads `x`), and every shard shares the block: `ΔW[o, j] = miss_block[j mod r, o]`.
      A product is LoRA's (`as_lora`): `x`'s shards summed by a constant `(r, in)`
      factor, then the block: `O(tokens·r·(in + out))` extra work, no weight-sized array,
      and LoRA's one GEMM with the base.
    - `"mini"` (`init_weights="mini"`): `miss_block (r, mini_r)`, repeated along the
      output features too, `ΔW[o, j] = miss_block[j mod r, o mod mini_r]`; its product
      is LoRA's with the block tiled to `(out, r)`.
    - `"bat"` (`init_weights="bat"`): `miss_block (out/r, r, r)`, one `(r, r)` block per
      shard of `r` output rows, and an update that reads the weight:
      `ΔW_{o,i} = W_{o,i}·B_o + B_o` for each `(r, r)` block of `W`. It has no product
      with `x` that is cheaper than the weight's own: like PEFT, each product builds the
      adapted weight (`O(out·in·r)` flops and weight-sized arrays, forward and backward),
      so it is not clean under `assert_no_dense`.

    The update computes in `miss_block`'s dtype (PEFT casts the input to it) and is added
    to the base product in the wider dtype, rounded to the base's. Dropout
    (`miss_dropout`) applies to the input of the shard sum when `dropout_key` is set (see
    `with_dropout`); PEFT's `"bat"` forward applies none.
    """

    weight: Any
    miss_block: Array
    dropout_key: LayerKeys | None = None
    draws_dropout: ClassVar[bool] = True
    variant: MissVariant = eqx.field(static=True, default="balance")
    miss_dropout: float = eqx.field(static=True, default=0.0)

    peft_keys: ClassVar[Mapping[str, str]] = {"miss_block": "miss_block"}
    # the block's axes are shards of the weight's, not the weight's own: they follow none
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {"miss_block": ()}

    def __check_init__(self) -> None:
        shape = tuple(self.weight.shape)
        if len(shape) < 2:
            raise ValueError(f"MiSS needs a Linear weight (out, in), got shape {shape}.")
        stack, (out, in_) = shape[:-2], shape[-2:]
        got = tuple(self.miss_block.shape)
        own = got[len(stack) :]
        if self.variant == "bat":
            r = own[-1] if own else 0
            fits = len(own) == 3 and r >= 1 and out % r == 0 and in_ % r == 0
            want = f"(out/r, r, r) = ({out}/r, r, r) with r dividing {out} and {in_}"
            fits = fits and own == (out // r, r, r)
        elif self.variant == "mini":
            fits = len(own) == 2 and 1 <= own[0] <= in_ and own[1] >= 1 and out % own[1] == 0
            want = f"(r, mini_r) with r <= {in_} and mini_r dividing {out}"
        elif self.variant == "balance":
            fits = len(own) == 2 and 1 <= own[0] <= in_ and own[1] == out
            want = f"(r, out) = (r, {out}) with 1 <= r <= {in_}"
        else:
            raise ValueError(
                f"MiSS variant must be 'balance', 'bat' or 'mini', got {self.variant!r}."
            )
        if not fits or got[: len(stack)] != stack:
            raise ValueError(
                f"miss_block of shape {got} does not fit weight {shape} in MiSS's "
                f"{self.variant!r} variant: expected {(*stack, '…')} then {want}."
            )
        if not jnp.issubdtype(self.miss_block.dtype, jnp.floating):
            raise TypeError(
                f"miss_block must be floating-point, got dtype {self.miss_block.dtype}."
            )
        if not 0.0 <= self.miss_dropout < 1.0:
            raise ValueError(f"miss_dropout must be in [0, 1), got {self.miss_dropout}.")

    @property
    def stack_ndim(self) -> int:
        return len(self.weight.shape) - 2

    @property
    def r(self) -> int:
        """The shard size along the input features (PEFT's `r`)."""
        return self.miss_block.shape[-1 if self.variant == "bat" else -2]

    def delta(self, weight: Array | None = None) -> Array:
        """`ΔW` in the weight's shape and the wider of the weight's and the block's dtypes;
        `"bat"` reads the dense base `weight`."""
        block = self.miss_block
        *stack, out, in_ = self.weight.shape
        if self.variant == "bat":
            if weight is None:
                raise ValueError("MiSS's 'bat' update reads the base weight; pass it.")
            wide = wider_dtype(weight.dtype, block.dtype)
            r = self.r
            w = weight.astype(wide).reshape(*stack, out // r, r, in_ // r, r)
            b = block.astype(wide)
            d = jnp.einsum("...oaib,...obc->...oaic", w, b) + b[..., :, :, None, :]
            return d.reshape(*stack, out, in_)
        if self.variant == "mini":
            block = _tiled(block, block.ndim - 1, out)
        # ΔWᵀ (in, out): the block repeated down the input features, the padding cut off
        return jnp.swapaxes(_tiled(block, block.ndim - 2, in_), -1, -2)

    def as_lora(self) -> LoraArray | None:
        """The `"balance"` or `"mini"` update as the LoRA it equals, whose products are
        LoRA's (one GEMM with the base where the tokens outnumber the weight's rows):
        `lora_A (r, in)` the constant that sums the shards (`A[j mod r, j] = 1`),
        `lora_B (out, r)` the block (tiled along the output features for `"mini"`),
        scaling 1. None for `"bat"`."""
        if self.variant == "bat":
            return None
        *stack, out, in_ = self.weight.shape
        block = self.miss_block
        if self.variant == "mini":
            block = _tiled(block, block.ndim - 1, out)
        r = self.r
        shards = jnp.arange(in_)[None, :] % r == jnp.arange(r)[:, None]
        return LoraArray(
            self.weight,
            jnp.broadcast_to(shards.astype(block.dtype), (*stack, r, in_)),
            jnp.swapaxes(block, -1, -2),
            lora_alpha=r,
            lora_dropout=self.miss_dropout,
            dropout_key=self.dropout_key,
        )

    def merged(self, weight: Array) -> Array:
        wide = wider_dtype(weight.dtype, self.miss_block.dtype)
        return (weight.astype(wide) + self.delta(weight)).astype(weight.dtype)

    def unmerged(self, merged: Array) -> Array:
        """The base weight from which this adapter's dense weight `merged` was built
        (PEFT's `unmerge`: `"bat"` solves `W' = W·(I + B_o) + B_o` block by block)."""
        wide = wider_dtype(merged.dtype, self.miss_block.dtype)
        if self.variant != "bat":
            return (merged.astype(wide) - self.delta()).astype(merged.dtype)
        *stack, out, in_ = merged.shape
        r = self.r
        b = self.miss_block.astype(wide)
        m = merged.astype(wide).reshape(*stack, out // r, r, in_ // r, r)
        m = m - b[..., :, :, None, :]
        # (W'_{o,i} - B_o)·(I + B_o)⁻¹, as rows: solve (I + B_o)ᵀ·Xᵀ = (W'_{o,i} - B_o)ᵀ
        eye = jnp.broadcast_to(jnp.eye(r, dtype=wide), b.shape)
        rows = jnp.swapaxes(m, -3, -2)  # (*stack, O, I, r_a, r_b)
        lhs = jnp.broadcast_to(jnp.swapaxes(eye + b, -1, -2)[..., :, None, :, :], rows.shape)
        solved = jnp.linalg.solve(lhs, jnp.swapaxes(rows, -1, -2))
        w = jnp.swapaxes(jnp.swapaxes(solved, -1, -2), -3, -2)
        return w.reshape(merged.shape).astype(merged.dtype)


def _tiled(a: Array, axis: int, n: int) -> Array:
    """`a` repeated along `axis` (as torch's `repeat`) and cut to length `n` there."""
    reps = -(-n // a.shape[axis])
    tiled = jnp.tile(a, [reps if i == axis else 1 for i in range(a.ndim)])
    return lax.slice_in_dim(tiled, 0, n, axis=axis)


def _bat_weight(w: MissArray) -> Array:
    """`"bat"`'s adapted weight `W + ΔW(W)` in the wider dtype (built per product, as
    PEFT builds it in every forward)."""
    base = materialize(w.weight)
    wide = wider_dtype(base.dtype, w.miss_block.dtype)
    return base.astype(wide) + w.delta(base)


def _miss_dot(w: MissArray, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    if w.variant != "bat":
        return lora_dot(w.as_lora(), x, w_is_lhs, params)
    # PEFT: F.linear(x cast to the adapted weight's dtype, W + ΔW), rounded to x's
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    adapted = _bat_weight(w)
    q = dataclasses.replace(p, preferred_element_type=None)
    y = q.arrange(*q.contract(x.astype(adapted.dtype), q.x, adapted, q.w))
    return y.astype(p.preferred_element_type or wider_dtype(x.dtype, w.weight.dtype))


def _miss_update(
    w: MissArray, x: Array, w_is_lhs: bool, params: dict[str, Any], base: Array
) -> Any:
    if w.variant == "bat":
        raise ValueError(
            "MiSS's 'bat' adapters apply one at a time: PEFT builds each active one's "
            "weight from the one before, so an AdapterSet cannot add a 'bat' adapter's "
            "update to others. Activate a single adapter (set_adapter)."
        )
    return lora_update(w.as_lora(), x, w_is_lhs, params, base)


weight_dot_handlers(MissArray, _miss_dot, _miss_update)
cast_base_on_astype(MissArray)


def miss(
    weight: Any,
    *,
    r: int = 64,
    mini_r: int = 1,
    init_weights: bool | Literal["bat", "mini"] = True,
    miss_dropout: float = 0.0,
    dtype: Any = jnp.float32,
    key: PRNGKeyArray | None = None,
) -> MissArray:
    """Wrap a `Linear` weight `(out, in)` in a `MissArray` initialized as PEFT does.

    **Arguments:**

    - `weight`: the base weight, dense or implicit.
    - `r`: the shard size along the input features, `1 <= r <= in` (PEFT's `r`).
    - `mini_r`: with `init_weights="mini"`, the block's width along the output features,
      dividing `out`.
    - `init_weights`: `True`: `"balance"`, `miss_block (r, out)` zeros (the output is the
      base's); `False`: the same, Kaiming-uniform (PEFT's `kaiming_uniform_(a=√5)`,
      bound `1/√out`; needs `key`); `"bat"`: `(out/r, r, r)` zeros, `r` dividing `out`
      and `in`; `"mini"`: `(r, mini_r)` zeros.
    - `miss_dropout`: as in `peft.MissConfig`.
    - `dtype`: `miss_block`'s dtype.
    - `key`: a JAX PRNG key, used by `init_weights=False` only.
    """
    out, in_ = weight.shape[-2:]
    if r <= 0:
        raise ValueError(f"`r` should be a positive integer value but the value passed is {r}")
    if r > in_:
        raise ValueError(f"`r` ({r}) must be less than or equal to in_features ({in_})")
    if init_weights == "bat":
        if in_ % r or out % r:
            raise ValueError(
                f"MiSS's 'bat' needs the weight ({out}, {in_}) fully divisible into [r, r] = "
                f"[{r}, {r}] blocks; choose r dividing both."
            )
        block, variant = jnp.zeros((out // r, r, r), dtype), "bat"
    elif init_weights == "mini":
        if mini_r < 1 or out % mini_r:
            raise ValueError(
                f"MiSS's 'mini' repeats the block along the output features: mini_r "
                f"({mini_r}) must divide out_features ({out})."
            )
        block, variant = jnp.zeros((r, mini_r), dtype), "mini"
    elif init_weights:
        block, variant = jnp.zeros((r, out), dtype), "balance"
    else:
        if key is None:
            raise ValueError("MiSS with init_weights=False draws miss_block: pass a `key`.")
        bound = 1.0 / math.sqrt(out)
        block = jax.random.uniform(key, (r, out), dtype, -bound, bound)
        variant = "balance"
    return MissArray(weight, block, variant=variant, miss_dropout=float(miss_dropout))


# -- the config ------------------------------------------------------------------------------

_MISS_KEYS = (
    *PEFT_BASE_KEYS,
    "r",
    "miss_dropout",
    "mini_r",
    "target_modules",
    "exclude_modules",
    "init_weights",
    "layers_to_transform",
    "layers_pattern",
    "bias",
    "modules_to_save",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MissConfig(AbstractAdapterConfig):
    """HF PEFT's `MissConfig` (MiSS, "matrix shard sharing"): the same field names,
    meanings and defaults. Each adapted `Linear` gets a `MissArray`.

    **Arguments:**

    - `r`: the shard size along each layer's input features (default 64; at most the
      layer's input features). PEFT's block `miss_block (r, out)` is shared by every shard.
    - `miss_dropout`: dropout probability on the MiSS input, in `[0, 1)`.
    - `mini_r`: with `init_weights="mini"`, the block's width along the output features
      (`miss_block (r, mini_r)`, repeated); it must divide every adapted layer's output
      features. Unused otherwise, as in PEFT.
    - `init_weights`: `True` (MiSS "balance", zeros: a no-op at start), `False` (the same,
      Kaiming-uniform, for tests), `"bat"` (`miss_block (out/r, r, r)`, an update that
      multiplies the weight: built dense in every product, as PEFT does) or `"mini"`.
    - `bias`: which biases train: `"none"`, `"all"` or `"MiSS_only"` (of adapted layers).
    - `target_modules`, `exclude_modules`, `modules_to_save`, `layers_to_transform`,
      `layers_pattern`: as for `LoraConfig`; Linear layers only (not GPT-2's Conv1D, which
      PEFT's MiSS does not adapt). PEFT's `MissConfig` has no `fan_in_fan_out`.
    - `task_type`, `base_model_name_or_path`, `revision`, `inference_mode`, `peft_version`:
      PEFT's bookkeeping.

    Mixed-adapter batches are refused, as PEFT has none for MiSS.
    """

    peft_type: Literal["MISS"] = "MISS"
    r: int = field(default=64, range=RANK)
    miss_dropout: int | float = field(default=0.0, range=PROBABILITY, converter=float)
    mini_r: int = field(default=1, range=RANK)
    init_weights: bool | Literal["bat", "mini"] = True
    bias: Literal["none", "all", "MiSS_only"] = "none"

    toml_table: ClassVar[str | None] = "miss"
    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = LORA_TARGET_MODULES
    mixed_batches: ClassVar[bool] = False
    _KEYS: ClassVar[tuple[str, ...] | None] = _MISS_KEYS

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        if layer.transposed:
            raise ValueError(
                f"{layer.path!r} is a GPT-2 Conv1D layer, which PEFT's MiSS does not adapt "
                "(torch.nn.Linear only); exclude it (exclude_modules) or use LoRA."
            )
        if self.init_weights == "bat" and self.miss_dropout:
            warnings.warn(
                f"miss_dropout={self.miss_dropout} has no effect with init_weights='bat': "
                "PEFT's 'bat' forward applies no dropout, and peftx computes what PEFT does.",
                UserWarning,
                stacklevel=2,
            )
        try:
            return miss(
                base,
                r=self.r,
                mini_r=self.mini_r,
                init_weights=self.init_weights,
                miss_dropout=self.miss_dropout,
                key=key,
            )
        except ValueError as e:
            raise ValueError(f"MiSS on {layer.path!r}: {e}") from None

    def unsupported(self, path: str, layer: Any) -> str | None:
        if not isinstance(layer, eqx.nn.Linear):
            return f"MiSS adapts Linear layers only; {path!r} is an eqx.nn.{type(layer).__name__}."
        return None
