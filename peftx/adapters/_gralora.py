"""GraLoRA (HF PEFT's `GRALORA`): a weight cut into k×k blocks, each with its own
low-rank update, and an optional plain-LoRA part (`hybrid_r`).

The kind whole: `GraloraArray`, its handlers, and `GraloraConfig`."""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from .._config import (
    FINITE,
    PEFT_BASE_KEYS,
    PROBABILITY,
    RANK,
    AbstractAdapterConfig,
    AdaptedLayer,
    Range,
    field,
)
from .._kind import AbstractAdapter
from ._layout import Labels, WeightProduct, weight_dot_handlers
from ._lora import LORA_TARGET_MODULES, LoraArray, lora_dot, lora_update
from ._products import LayerKeys, add_update, cast_base_on_astype, dropout, wider_dtype


class GraloraArray(AbstractAdapter):
    """A `Linear` weight `(out, in)` plus PEFT's GraLoRA update, with PEFT's tensors.

    The weight is cut into `k × k` blocks of `(out/k, in/k)`. `gralora_A (k, in/k, r)`
    holds one `(in/k, r)` factor per input block `n`, `gralora_B (k, r, out/k)` one
    `(r, out/k)` factor per output block `j`. Each `r` splits into `k` sub-ranks of
    `s = r/k`; block `(j, n)` of the update is, as in PEFT's forward,

        ΔW[j, n] = scaling · (A[n][:, j·s:(j+1)·s] · B[j][n·s:(n+1)·s, :])ᵀ,

    so the update has rank up to `k·r` with as many parameters as a rank-`r` LoRA. With
    `hybrid_r > 0`, `gralora_A_general (hybrid_r, in)` and `gralora_B_general (out,
    hybrid_r)` add a plain LoRA term `scaling · B_g·A_g`; `scaling = alpha / (r +
    hybrid_r)`.

    A product is LoRA's (`as_lora`): the update is a LoRA of rank `k·r + hybrid_r` whose
    factors (`factors`) hold each `A[n]` and `B[j]` on its own block, zeros elsewhere
    (PEFT's sub-rank pairing in the row order), so it takes LoRA's one GEMM with the base
    and never forms the `(out, in)` update; `k` times a rank-`r` LoRA's arithmetic, which
    costs less than cutting `x` into blocks, whose products transpose the activations.
    The update computes in `gralora_A`'s dtype (PEFT casts `x` to it) and is added to the
    base product in the wider dtype, rounded to the base's. Dropout (`gralora_dropout`)
    applies to the input when `dropout_key` is set (see `with_dropout`), drawn apart for
    the hybrid part (then the two parts' products are apart too), as
    PEFT calls its dropout once for each.
    """

    weight: Any
    gralora_A: Array
    gralora_B: Array
    gralora_A_general: Array | None = None
    gralora_B_general: Array | None = None
    dropout_key: LayerKeys | None = None
    draws_dropout: ClassVar[bool] = True
    alpha: float = eqx.field(static=True, default=64.0)
    gralora_dropout: float = eqx.field(static=True, default=0.0)

    peft_keys: ClassVar[Mapping[str, str]] = {
        "gralora_A": "gralora_A",
        "gralora_B": "gralora_B",
        "gralora_A_general": "gralora_A_general.weight",
        "gralora_B_general": "gralora_B_general.weight",
    }
    # the block factors run along pieces of the weight's axes and stay whole; the hybrid
    # factors are LoRA's
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {
        "gralora_A_general": (None, 1),
        "gralora_B_general": (0, None),
    }

    def __check_init__(self) -> None:
        shape = tuple(self.weight.shape)
        if len(shape) < 2:
            raise ValueError(f"GraLoRA needs a Linear weight (out, in), got shape {shape}.")
        stack, (out, in_) = shape[:-2], shape[-2:]
        a, b = tuple(self.gralora_A.shape), tuple(self.gralora_B.shape)
        n = len(stack)
        k, r = (a[n], a[-1]) if len(a) == n + 3 else (0, 0)
        fits = (
            len(a) == n + 3
            and len(b) == n + 3
            and k >= 1
            and r >= 1
            and r % k == 0
            and in_ % k == 0
            and out % k == 0
            and a[n:] == (k, in_ // k, r)
            and b[n:] == (k, r, out // k)
            and a[:n] == stack
            and b[:n] == stack
        )
        if not fits:
            raise ValueError(
                f"gralora_A {a} and gralora_B {b} do not fit weight {shape}: expected "
                f"{(*stack, 'k', f'{in_}/k', 'r')} and {(*stack, 'k', 'r', f'{out}/k')} with k "
                f"dividing {out}, {in_} and r."
            )
        general = (self.gralora_A_general, self.gralora_B_general)
        if (general[0] is None) != (general[1] is None):
            raise ValueError("GraLoRA's hybrid part needs both gralora_A_general and _B_general.")
        if general[0] is not None:
            ga, gb = tuple(general[0].shape), tuple(general[1].shape)
            h = ga[-2] if len(ga) == n + 2 else 0
            if not (h >= 1 and ga == (*stack, h, in_) and gb == (*stack, out, h)):
                raise ValueError(
                    f"gralora_A_general {ga} and gralora_B_general {gb} do not fit weight "
                    f"{shape}: expected {(*stack, 'hybrid_r', in_)} and "
                    f"{(*stack, out, 'hybrid_r')}."
                )
        held = [f for f in (self.gralora_A, self.gralora_B, *general) if f is not None]
        dtypes = {jnp.dtype(f.dtype) for f in held}
        if len(dtypes) != 1 or not jnp.issubdtype(dtypes.pop(), jnp.floating):
            raise TypeError(
                "GraLoRA's factors must share one floating-point dtype, got "
                f"{[str(f.dtype) for f in held]}."
            )
        if not 0.0 <= self.gralora_dropout < 1.0:
            raise ValueError(f"gralora_dropout must be in [0, 1), got {self.gralora_dropout}.")

    @property
    def stack_ndim(self) -> int:
        return len(self.weight.shape) - 2

    @property
    def gralora_k(self) -> int:
        return self.gralora_A.shape[-3]

    @property
    def r(self) -> int:
        return self.gralora_A.shape[-1]

    @property
    def hybrid_r(self) -> int:
        g = self.gralora_A_general
        return 0 if g is None else g.shape[-2]

    @property
    def scaling(self) -> float:
        return self.alpha / (self.r + self.hybrid_r)

    def factors(self) -> tuple[Array, Array]:
        """The update as a LoRA of rank `k·r` (plus `hybrid_r`): `A (…, k·r, in)` holding
        each input block's `A[n]` on its own columns, `B (…, out, k·r)` each output block's
        `B[j]` on its own rows, zeros elsewhere, so that `ΔW = scaling · B·A`; the hybrid
        factors follow. A product with them is two plain products of `k` times a
        rank-`r` LoRA's work: the blocks take no transpose of `x`."""
        k, r = self.gralora_k, self.r
        *stack, out, in_ = self.weight.shape
        eye = jnp.eye(k, dtype=self.gralora_A.dtype)
        ones = (1,) * len(stack)
        # A[n] (in/k, r) at rows n·in/k… and columns n·r…: its rank splits (j, s)
        a = self.gralora_A[..., :, :, None, :] * eye.reshape(*ones, k, 1, k, 1)
        a = jnp.swapaxes(a.reshape(*stack, in_, k * r), -1, -2)
        # B[j]'s rows are (n, s); the row of A's column (n, j, s) is B[j]'s row (n, s)
        b = self.gralora_B.reshape(*stack, k, k, r // k, out // k)
        b = jnp.swapaxes(b, -4, -3)[..., None, :] * eye.reshape(*ones, 1, k, 1, k, 1)
        b = jnp.swapaxes(b.reshape(*stack, k * r, out), -1, -2)
        if self.gralora_A_general is not None:
            a = jnp.concatenate([a, self.gralora_A_general.astype(a.dtype)], axis=-2)
            b = jnp.concatenate([b, self.gralora_B_general.astype(b.dtype)], axis=-1)
        return a, b

    def as_lora(self) -> LoraArray | None:
        """This adapter as the LoRA of rank `k·r + hybrid_r` it equals, whose products
        are LoRA's (one GEMM with the base where the tokens outnumber the weight's rows);
        None when the hybrid part draws its own dropout mask."""
        masks = self.gralora_dropout and self.dropout_key is not None
        if masks and self.gralora_A_general is not None:
            return None
        a, b = self.factors()
        return LoraArray(
            self.weight,
            a,
            b,
            lora_alpha=self.scaling * a.shape[-2],
            lora_dropout=self.gralora_dropout,
            dropout_key=self.dropout_key,
        )

    def delta(self) -> Array:
        """`ΔW` (scaling included) in the weight's shape and the factors' dtype."""
        a, b = self.factors()
        return jnp.asarray(self.scaling, a.dtype) * (b @ a)

    def merged(self, weight: Array) -> Array:
        wide = wider_dtype(weight.dtype, self.gralora_A.dtype)
        return (weight.astype(wide) + self.delta().astype(wide)).astype(weight.dtype)

    def unmerged(self, merged: Array) -> Array:
        """The base weight from which this adapter's dense weight `merged` was built."""
        wide = wider_dtype(merged.dtype, self.gralora_A.dtype)
        return (merged.astype(wide) - self.delta().astype(wide)).astype(merged.dtype)


def _low_rank(p: WeightProduct, x: Array, a: Array, b: Array, stack: Labels) -> Array:
    """`B·A` (`a (…, R, in)`, `b (…, out, R)`) times `x` in the product's output order,
    contracted with whichever weight axis meets `x`."""
    out_l, in_l = p.w[len(stack)], p.w[len(stack) + 1]
    factors = [(a, (*stack, "h", in_l)), (b, (*stack, out_l, "h"))]
    if out_l in p.x:  # xᵀ·ΔW: the output features meet x
        factors.reverse()
    (first, first_labels), (second, second_labels) = factors
    g, g_labels = p.contract(x, p.x, first, first_labels)
    return p.arrange(*p.contract(g, g_labels, second, second_labels))


def _two_masks_update(w: GraloraArray, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    """`ΔW·x` when the hybrid part draws its own dropout mask (PEFT calls its dropout once
    for each part), the blocks' and the hybrid factors' products apart, in the product's
    output order and `gralora_A`'s dtype; None when no weight axis meets `x` alone."""
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    q = dataclasses.replace(p, preferred_element_type=None)
    stack, out_l, in_l = p.w[: w.stack_ndim], p.w[w.stack_ndim], p.w[w.stack_ndim + 1]
    if (in_l in p.x) == (out_l in p.x):
        return None
    dtype = w.gralora_A.dtype
    x = x.astype(dtype)
    both = dropout(jnp.stack([x, x], axis=-1), w.gralora_dropout, w.dropout_key, (*p.x, "2"))
    a, b = w.factors()
    blocks = w.gralora_k * w.r
    y = _low_rank(q, both[..., 0], a[..., :blocks, :], b[..., :blocks], stack)
    y = y + _low_rank(q, both[..., 1], a[..., blocks:, :], b[..., blocks:], stack)
    return jnp.asarray(w.scaling, dtype) * y


def _gralora_dot(w: GraloraArray, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    lora = w.as_lora()
    if lora is not None:
        return lora_dot(lora, x, w_is_lhs, params)
    update = _two_masks_update(w, x, w_is_lhs, params)
    if update is None:
        return NotImplemented
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    return add_update(p.arrange(*p.contract(x, p.x, w.weight, p.w)), update)


def _gralora_update(
    w: GraloraArray, x: Array, w_is_lhs: bool, params: dict[str, Any], base: Array
) -> Any:
    lora = w.as_lora()
    if lora is not None:
        return lora_update(lora, x, w_is_lhs, params, base)
    update = _two_masks_update(w, x, w_is_lhs, params)
    return NotImplemented if update is None else update


weight_dot_handlers(GraloraArray, _gralora_dot, _gralora_update)
cast_base_on_astype(GraloraArray)


def gralora(
    weight: Any,
    *,
    r: int = 32,
    hybrid_r: int = 0,
    alpha: int | float = 64,
    gralora_k: int = 2,
    gralora_dropout: float = 0.0,
    init_weights: bool = True,
    dtype: Any = jnp.float32,
    key: PRNGKeyArray,
) -> GraloraArray:
    """Wrap a `Linear` weight `(out, in)` in a `GraloraArray` initialized as PEFT does.

    **Arguments:**

    - `weight`: the base weight, dense or implicit.
    - `r`: the rank of each block's factors (PEFT's `r`), divisible by `gralora_k`.
    - `hybrid_r`: the rank of the plain-LoRA part (0: none).
    - `alpha`: the scale's numerator, `scaling = alpha / (r + hybrid_r)`.
    - `gralora_k`: the blocks per axis; it divides `out`, `in` and `r`.
    - `gralora_dropout`: as in `peft.GraloraConfig`.
    - `init_weights`: `True`: the `A` factors Kaiming-uniform (PEFT's
      `kaiming_uniform_(a=√5)`: bound `1/√(in/k)` for `gralora_A`, `1/√in` for
      `gralora_A_general`) and the `B` factors zeros, so the output is the base's;
      `False`: the `B` factors Kaiming-uniform too (bound `1/√r`, `1/√hybrid_r`).
    - `dtype`: the factors' dtype.
    - `key`: a JAX PRNG key.
    """
    out, in_ = weight.shape[-2:]
    if r <= 0:
        raise ValueError(f"`r` should be a positive integer value but the value passed is {r}")
    if hybrid_r < 0:
        raise ValueError(
            f"`hybrid_r` should be a non-negative integer value but the value passed is {hybrid_r}"
        )
    if gralora_k <= 0 or r % gralora_k:
        raise ValueError(f"r should be divisible by gralora_k, but got {r} and {gralora_k}")
    for name, n in (("in_features", in_), ("out_features", out)):
        if n % gralora_k:
            raise ValueError(
                f"{name} should be divisible by gralora_k, but got {n} and {gralora_k}"
            )
    k_a, k_b, k_ga, k_gb = jax.random.split(key, 4)

    def uniform(key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int) -> Array:
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=√5): gain·√(3/fan_in)
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    def zeros_or(key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int) -> Array:
        return jnp.zeros(shape, dtype) if init_weights else uniform(key, shape, fan_in)

    k = gralora_k
    a = uniform(k_a, (k, in_ // k, r), in_ // k)
    b = zeros_or(k_b, (k, r, out // k), r)
    ga = gb = None
    if hybrid_r > 0:
        ga = uniform(k_ga, (hybrid_r, in_), in_)
        gb = zeros_or(k_gb, (out, hybrid_r), hybrid_r)
    return GraloraArray(
        weight,
        a,
        b,
        ga,
        gb,
        alpha=float(alpha),
        gralora_dropout=float(gralora_dropout),
    )


# -- the config ------------------------------------------------------------------------------

_GRALORA_KEYS = (
    *PEFT_BASE_KEYS,
    "r",
    "hybrid_r",
    "target_modules",
    "alpha",
    "gralora_dropout",
    "gralora_k",
    "fan_in_fan_out",
    "bias",
    "modules_to_save",
    "init_weights",
    "layers_to_transform",
    "layers_pattern",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GraloraConfig(AbstractAdapterConfig):
    """HF PEFT's `GraloraConfig` (GraLoRA, granular low-rank adaptation): the same field
    names, meanings and defaults. Each adapted `Linear` gets a `GraloraArray`.

    **Arguments:**

    - `r`: the rank of each block's factors (default 32), divisible by `gralora_k`; the
      adapter has as many parameters as a rank-`r` LoRA and rank up to `gralora_k·r`.
    - `hybrid_r`: the rank of a plain-LoRA part beside the blocks (default 0: none).
    - `alpha`: the scale's numerator (default 64), `scaling = alpha / (r + hybrid_r)`.
    - `gralora_dropout`: dropout probability on the input, in `[0, 1)`.
    - `gralora_k`: the blocks per axis (default 2); it divides `r` and every adapted
      layer's input and output features.
    - `init_weights`: `True` (the `B` factors zeros: a no-op at start) or `False` (random,
      for tests).
    - `bias`: which biases train: `"none"`, `"all"` or `"gralora_only"` (of adapted
      layers).
    - `target_modules`, `modules_to_save`, `layers_to_transform`, `layers_pattern`,
      `fan_in_fan_out`: as for `LoraConfig`; Linear layers and GPT-2's Conv1D (PEFT sets
      `fan_in_fan_out` for those). PEFT's `GraloraConfig` has no `exclude_modules`;
      peftx's is written to the file only when set.
    - `task_type`, `base_model_name_or_path`, `revision`, `inference_mode`, `peft_version`:
      PEFT's bookkeeping.

    Mixed-adapter batches are refused, as PEFT has none for GraLoRA.
    """

    peft_type: Literal["GRALORA"] = "GRALORA"
    r: int = field(default=32, range=RANK)
    hybrid_r: int = field(
        default=0, range=Range(lambda v: v >= 0, "`{name}` must be a non-negative integer")
    )
    alpha: int | float = field(default=64, range=FINITE)
    gralora_dropout: int | float = field(default=0.0, range=PROBABILITY, converter=float)
    gralora_k: int = field(default=2, range=RANK)
    init_weights: bool = True
    bias: Literal["none", "all", "gralora_only"] = "none"

    toml_table: ClassVar[str | None] = "gralora"
    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = LORA_TARGET_MODULES
    mixed_batches: ClassVar[bool] = False
    _KEYS: ClassVar[tuple[str, ...] | None] = _GRALORA_KEYS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.r % self.gralora_k:
            raise ValueError(
                f"r should be divisible by gralora_k, but got {self.r} and {self.gralora_k}"
            )

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        try:
            return gralora(
                base,
                r=self.r,
                hybrid_r=self.hybrid_r,
                alpha=self.alpha,
                gralora_k=self.gralora_k,
                gralora_dropout=self.gralora_dropout,
                init_weights=self.init_weights,
                key=key,
            )
        except ValueError as e:
            raise ValueError(f"GraLoRA on {layer.path!r}: {e}") from None

    def unsupported(self, path: str, layer: Any) -> str | None:
        if not isinstance(layer, eqx.nn.Linear):
            return (
                f"GraLoRA adapts Linear layers only; {path!r} is an eqx.nn.{type(layer).__name__}."
            )
        return None
