"""HiRA (HF PEFT's `HIRA`): a low-rank matrix multiplied entry by entry with the frozen
weight, so that the update has full rank.

The kind whole: `HiraArray`, its handlers, and `HiraConfig`."""

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from .._config import (
    PEFT_BASE_KEYS,
    PROBABILITY,
    RANK,
    RANKS,
    RANKS_TYPE,
    AbstractAdapterConfig,
    AdaptedLayer,
    field,
)
from .._kind import AbstractAdapter
from ..implicit import materialize
from ._layout import WeightProduct, weight_dot_handlers
from ._lora import LORA_TARGET_MODULES
from ._products import LayerKeys, add_update, cast_base_on_astype, dropout, wider_dtype

HiraInit = bool | Literal["gaussian"] | None


class HiraArray(AbstractAdapter):
    """A `Linear` weight `W (out, in)` plus PEFT's HiRA update, with PEFT's tensors
    `hira_A (r, in)` and `hira_B (out, r)`:

        ΔW = W ⊙ (hira_B · hira_A),

    with no scaling. `B·A` has rank `r` but `W ⊙ B·A` generally full rank, so a product
    with `x` has no low-rank form: spread over the ranks it is `Σ_k b_k ⊙ W·(a_k ⊙ x)`,
    `r` products with `W`. HiRA therefore builds the adapted weight: each product makes
    `W ⊙ (1 + B·A)` once (`out·in·r` multiply-adds and one weight-sized array, in the
    wider of the weight's and the factors' dtypes) and multiplies `x` by it, one product
    in place of the base's. Its gradient needs the cotangent of that weight, `gᵀ·x`, a
    second weight-sized array, from which `hira_A`'s and `hira_B`'s follow by products
    with the factors. PEFT's HiRA builds the same weight in every forward (LoHa and
    MiSS's "bat" build theirs here too).

    With dropout (`hira_dropout` and a `dropout_key`, see `with_dropout`), the update
    sees a dropped-out `x` and the base the plain one, as in PEFT: the base product and
    `drop(x)·(W ⊙ B·A)ᵀ` (in the wider dtype) are computed apart and added.
    """

    weight: Any
    hira_A: Array
    hira_B: Array
    dropout_key: LayerKeys | None = None
    draws_dropout: ClassVar[bool] = True
    hira_dropout: float = eqx.field(static=True, default=0.0)

    peft_keys: ClassVar[Mapping[str, str]] = {"hira_A": "hira_A", "hira_B": "hira_B"}
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {
        "hira_A": (None, 1),
        "hira_B": (0, None),
    }

    def __check_init__(self) -> None:
        shape = tuple(self.weight.shape)
        if len(shape) < 2:
            raise ValueError(f"HiRA needs a Linear weight (out, in), got shape {shape}.")
        stack, (out, in_) = shape[:-2], shape[-2:]
        a, b = tuple(self.hira_A.shape), tuple(self.hira_B.shape)
        r = a[-2] if len(a) == len(stack) + 2 else 0
        if not (r >= 1 and a == (*stack, r, in_) and b == (*stack, out, r)):
            raise ValueError(
                f"hira_A {a} and hira_B {b} do not fit weight {shape}: expected "
                f"{(*stack, 'r', in_)} and {(*stack, out, 'r')}."
            )
        dtypes = {jnp.dtype(self.hira_A.dtype), jnp.dtype(self.hira_B.dtype)}
        if len(dtypes) != 1 or not jnp.issubdtype(dtypes.pop(), jnp.floating):
            raise TypeError(
                "hira_A and hira_B must share one floating-point dtype, got "
                f"{self.hira_A.dtype} and {self.hira_B.dtype}."
            )
        if not 0.0 <= self.hira_dropout < 1.0:
            raise ValueError(f"hira_dropout must be in [0, 1), got {self.hira_dropout}.")

    @property
    def stack_ndim(self) -> int:
        return len(self.weight.shape) - 2

    @property
    def r(self) -> int:
        return self.hira_A.shape[-2]

    def modulation(self, dtype: Any) -> Array:
        """`B·A` in the weight's shape (stack included), computed in `dtype`."""
        return self.hira_B.astype(dtype) @ self.hira_A.astype(dtype)

    def merged(self, weight: Array) -> Array:
        """`W + W ⊙ B·A` in the wider dtype, rounded to the weight's (PEFT's `merge`)."""
        wide = wider_dtype(weight.dtype, self.hira_A.dtype)
        w = weight.astype(wide)
        return (w + w * self.modulation(wide)).astype(weight.dtype)

    def unmerged(self, merged: Array) -> Array:
        """The base weight from which `merged` was built, `W' / (1 + B·A)` (PEFT keeps a
        copy of the base instead; this is exact unless an entry of `B·A` is near -1)."""
        wide = wider_dtype(merged.dtype, self.hira_A.dtype)
        one = jnp.ones((), wide)
        return (merged.astype(wide) / (one + self.modulation(wide))).astype(merged.dtype)


def _times(p: WeightProduct, x: Array, w: Array) -> Array:
    """The product `p` of `x` with the dense `w`, in their dtype."""
    q = dataclasses.replace(p, preferred_element_type=None)
    return q.arrange(*q.contract(x, q.x, w, q.w))


def _update(w: HiraArray, x: Array, p: WeightProduct) -> Array:
    """`drop(x)·(W ⊙ B·A)ᵀ` in the product's output order and the wider of the
    weight's and factors' dtypes (PEFT casts `x` to `hira_A`'s dtype)."""
    base = materialize(w.weight)
    wide = wider_dtype(base.dtype, w.hira_A.dtype)
    x_d = dropout(x.astype(wide), w.hira_dropout, w.dropout_key, p.x, p.w[: w.stack_ndim])
    return _times(p, x_d, base.astype(wide) * w.modulation(wide))


def _hira_dot(w: HiraArray, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    if w.hira_dropout and w.dropout_key is not None:
        return add_update(p.arrange(*p.contract(x, p.x, w.weight, p.w)), _update(w, x, p))
    # one product with the adapted weight W ⊙ (1 + B·A), in the wider dtype
    base = materialize(w.weight)
    wide = wider_dtype(base.dtype, w.hira_A.dtype)
    adapted = base.astype(wide) * (jnp.ones((), wide) + w.modulation(wide))
    y = _times(p, x.astype(wide), adapted)
    return y.astype(p.preferred_element_type or wider_dtype(x.dtype, w.weight.dtype))


def _hira_alone(w: HiraArray, x: Array, w_is_lhs: bool, params: dict[str, Any], base: Array) -> Any:
    return _update(w, x, WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params))


weight_dot_handlers(HiraArray, _hira_dot, _hira_alone)
cast_base_on_astype(HiraArray)


def hira(
    weight: Any,
    *,
    r: int = 32,
    hira_dropout: float = 0.0,
    init_weights: HiraInit = True,
    dtype: Any = jnp.float32,
    key: PRNGKeyArray,
) -> HiraArray:
    """Wrap a `Linear` weight `(out, in)` in a `HiraArray` initialized as PEFT does.

    **Arguments:**

    - `weight`: the base weight, dense or implicit.
    - `r`: the rank of `B·A`.
    - `hira_dropout`: as in `peft.HiraConfig`.
    - `init_weights`: `True`: `hira_A` Kaiming-uniform (PEFT's `kaiming_uniform_(a=√5)`,
      bound `1/√in`) and `hira_B` zeros, so the output is the base's; `"gaussian"`:
      `hira_A` normal with standard deviation `1/r`, `hira_B` zeros; `False` (or `None`):
      both standard normal (PEFT's `torch.randn`, for tests).
    - `dtype`: the factors' dtype.
    - `key`: a JAX PRNG key.
    """
    out, in_ = weight.shape[-2:]
    if r <= 0:
        raise ValueError(f"`r` should be a positive integer value but the value passed is {r}")
    k_a, k_b = jax.random.split(key)
    if not init_weights:
        a = jax.random.normal(k_a, (r, in_), dtype)
        b = jax.random.normal(k_b, (out, r), dtype)
    else:
        if init_weights is True:
            bound = 1.0 / math.sqrt(in_)  # kaiming_uniform_(a=√5): gain·√(3/fan_in)
            a = jax.random.uniform(k_a, (r, in_), dtype, -bound, bound)
        elif init_weights == "gaussian":
            a = jax.random.normal(k_a, (r, in_), dtype) / r
        else:
            raise ValueError(
                f"HiRA's init_weights must be True, False, None or 'gaussian', got "
                f"{init_weights!r}."
            )
        b = jnp.zeros((out, r), dtype)
    return HiraArray(weight, a, b, hira_dropout=float(hira_dropout))


# -- the config ------------------------------------------------------------------------------

_HIRA_KEYS = (
    *PEFT_BASE_KEYS,
    "r",
    "target_modules",
    "exclude_modules",
    "hira_dropout",
    "fan_in_fan_out",
    "modules_to_save",
    "init_weights",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HiraConfig(AbstractAdapterConfig):
    """HF PEFT's `HiraConfig` (HiRA, Hadamard high-rank adaptation): the same field
    names, meanings and defaults. Each adapted `Linear` gets a `HiraArray`, whose update
    `W ⊙ (B·A)` is built dense in every product, as PEFT builds it (see `HiraArray`).

    **Arguments:**

    - `r`: the rank of `B·A` (default 32).
    - `hira_dropout`: dropout probability on the update's input, in `[0, 1)`.
    - `init_weights`: `True` (`hira_B` zeros: a no-op at start), `"gaussian"` (`hira_A`
      normal with standard deviation `1/r`, `hira_B` zeros) or `False`/`None` (both
      standard normal, for tests).
    - `rank_pattern`: PEFT's field, which PEFT 0.21.2's HiRA never reads (every layer
      gets rank `r`); peftx does the same and warns.
    - `target_modules`, `exclude_modules`, `modules_to_save`, `layers_to_transform`,
      `layers_pattern`, `fan_in_fan_out`: as for `LoraConfig`; Linear layers and GPT-2's
      Conv1D (PEFT sets `fan_in_fan_out` for those). PEFT's Embedding and Conv HiRA layers
      are not built here.
    - `task_type`, `base_model_name_or_path`, `revision`, `inference_mode`, `peft_version`:
      PEFT's bookkeeping.

    PEFT's `HiraConfig` has no `bias`: no bias trains. Mixed-adapter batches are refused,
    as PEFT has none for HiRA.
    """

    peft_type: Literal["HIRA"] = "HIRA"
    r: int = field(default=32, range=RANK)
    hira_dropout: int | float = field(default=0.0, range=PROBABILITY, converter=float)
    init_weights: HiraInit = True
    rank_pattern: dict[str, int] = field(default_factory=dict, range=RANKS, means=RANKS_TYPE)

    toml_table: ClassVar[str | None] = "hira"
    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = LORA_TARGET_MODULES
    mixed_batches: ClassVar[bool] = False
    _KEYS: ClassVar[tuple[str, ...] | None] = _HIRA_KEYS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rank_pattern:
            warnings.warn(
                f"HiRA's rank_pattern {dict(self.rank_pattern)} has no effect: PEFT 0.21.2 "
                "builds every HiRA layer at rank r (its dispatch reads `config.r`), and peftx "
                "builds what PEFT loads. Set r instead.",
                UserWarning,
                stacklevel=3,
            )

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        return hira(
            base,
            r=self.r,
            hira_dropout=self.hira_dropout,
            init_weights=self.init_weights,
            key=key,
        )

    def unsupported(self, path: str, layer: Any) -> str | None:
        if not isinstance(layer, eqx.nn.Linear):
            return f"HiRA adapts Linear layers only; {path!r} is an eqx.nn.{type(layer).__name__}."
        return None
