"""What LoHa and LoKr share (PEFT's LyCORIS family): `alpha / r` scaling, the rank and
module dropouts of training, PEFT's Kaiming-uniform init, and the `dot_general` handlers
around each kind's own product with its update.

Their config's common fields and rules are `LycorisConfig`."""

import abc
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from .._config import (
    FINITE,
    PEFT_BASE_KEYS,
    PROBABILITY,
    RANK,
    RANKS,
    RANKS_TYPE,
    SCALES,
    SCALES_TYPE,
    AbstractAdapterConfig,
    AdaptedLayer,
    by_pattern,
    field,
)
from .._kind import AbstractAdapter
from ._layout import WeightProduct
from ._lora import LORA_TARGET_MODULES
from ._products import LayerKeys, update_handlers


class AbstractLycoris(AbstractAdapter):
    """An update `ΔW` of a `Linear` weight `(out, in)` (leading axes stack layers), scaled
    by `alpha / r`.

    In training (a `dropout_key` set by `with_dropout`) PEFT's two dropouts apply, drawn
    afresh per layer and per step: `rank_dropout` zeroes each row of `ΔW` (an output
    feature of the update) with that probability, and `module_dropout` drops the whole
    update of the layer with its probability. Without a key (evaluation) neither applies.
    """

    weight: eqx.AbstractVar[Any]
    dropout_key: eqx.AbstractVar[LayerKeys | None]
    draws_dropout: ClassVar[bool] = True
    r: eqx.AbstractVar[int]
    alpha: eqx.AbstractVar[float]
    rank_dropout: eqx.AbstractVar[float]
    module_dropout: eqx.AbstractVar[float]

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    @property
    def stack_ndim(self) -> int:
        """Leading axes added by stacking layers (with `eqx.filter_vmap`)."""
        return len(self.weight.shape) - 2

    @property
    @abc.abstractmethod
    def rescales_rank_dropout(self) -> bool:
        """Whether the kept rows are divided by the fraction kept (PEFT: always for LoHa,
        with `rank_dropout_scale` for LoKr)."""

    @abc.abstractmethod
    def delta(self) -> Array:
        """`ΔW` in the weight's shape, in the adapter's dtype (dense: for merging)."""

    @abc.abstractmethod
    def update(self, p: WeightProduct, x: Array, keep: Array | None) -> Array | None:
        """`(ΔW ⊙ keep)·x` laid out as the product `p` asks, in the adapter's dtype, with
        `keep` (None, or one factor per row of `ΔW`, `(*stack, out)`) scaling the rows; None
        when this layout cannot be followed."""

    def merged(self, weight: Array) -> Array:
        return weight + self.delta().astype(weight.dtype)

    def unmerged(self, merged: Array) -> Array:
        """The base weight from which `merged = W + ΔW` was built."""
        return (merged - self.delta().astype(merged.dtype)).astype(merged.dtype)

    def row_keep(self) -> Array | None:
        """Training's factor on each row of `ΔW`, `(*stack, out)` float32: the rank dropout's
        mask (rescaled where PEFT rescales it) times the module dropout's 0 or 1; None in
        evaluation or without dropout."""
        if self.dropout_key is None or not (self.rank_dropout or self.module_dropout):
            return None
        rows = self.weight.shape[-2]

        def draw(key: PRNGKeyArray) -> Array:
            rank_key, module_key = jax.random.split(key)
            keep = jax.random.bernoulli(rank_key, 1.0 - self.rank_dropout, (rows,))
            keep = keep.astype(jnp.float32)
            if self.rescales_rank_dropout:
                # PEFT divides by the kept fraction; all rows dropped leaves zeros, not NaN
                keep = keep / jnp.maximum(jnp.mean(keep), 1.0 / rows)
            module = jax.random.bernoulli(module_key, 1.0 - self.module_dropout)
            return keep * module.astype(jnp.float32)

        for _ in range(self.stack_ndim):
            draw = jax.vmap(draw)
        return draw(self.dropout_key)


def kaiming_uniform(key: PRNGKeyArray, shape: tuple[int, int], dtype: Any) -> Array:
    """PyTorch's `kaiming_uniform_(a=sqrt(5))` of a `(rows, cols)` parameter, PEFT's init
    of LyCORIS factors: uniform in `±1/sqrt(cols)`."""
    bound = 1.0 / math.sqrt(shape[1])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def check_common(r: int, rank_dropout: float, module_dropout: float, weight: Any) -> None:
    shape = tuple(weight.shape)
    if len(shape) < 2:
        raise ValueError(f"LoHa/LoKr adapt Linear weights (out, in), got shape {shape}.")
    if r < 1:
        raise ValueError(f"the rank r={r} must be at least 1.")
    for name, rate in (("rank_dropout", rank_dropout), ("module_dropout", module_dropout)):
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"{name} must be a probability in [0, 1), got {rate}.")


def _update(w: AbstractLycoris, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    return w.update(p, x, w.row_keep())


def register(cls: type) -> None:
    """The `dot_general` handlers (`W·x + ΔW·x`, the base product in its own dtype and
    precision, the update in the adapter's dtype, summed in the wider one and rounded to
    the base's, as PEFT adds them) and the `astype` rule of a LyCORIS kind."""
    update_handlers(cls, _update)


# -- the config ------------------------------------------------------------------------------

# The keys PEFT's `LoHaConfig` and `LoKrConfig` share, in its order: the first ones, then
# each kind's own, then the last ones.
LYCORIS_KEYS = (
    *PEFT_BASE_KEYS,
    "rank_pattern",
    "alpha_pattern",
    "r",
    "alpha",
    "rank_dropout",
    "module_dropout",
    "use_effective_conv2d",
)
LYCORIS_TAIL = (
    "target_modules",
    "exclude_modules",
    "init_weights",
    "layers_to_transform",
    "layers_pattern",
    "modules_to_save",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LycorisConfig(AbstractAdapterConfig):
    """The fields and rules PEFT's `LoHaConfig` and `LoKrConfig` share (`LycorisConfig`)."""

    r: int = field(default=8, range=RANK)
    alpha: int | float = field(default=8, range=FINITE)
    rank_dropout: int | float = field(default=0.0, range=PROBABILITY, converter=float)
    module_dropout: int | float = field(default=0.0, range=PROBABILITY, converter=float)
    use_effective_conv2d: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict, range=RANKS, means=RANKS_TYPE)
    alpha_pattern: dict[str, int | float] = field(
        default_factory=dict, range=SCALES, means=SCALES_TYPE
    )

    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = LORA_TARGET_MODULES
    mixed_batches: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.use_effective_conv2d:
            raise ValueError(
                f"`use_effective_conv2d=True` decomposes Conv kernels; peftx's {self.peft_type} "
                "adapts Linear layers only, where PEFT ignores it. Set use_effective_conv2d=False."
            )

    def rank_and_alpha(self, path: str) -> tuple[int, int | float]:
        """PEFT's `rank_pattern`/`alpha_pattern` for the module at `path`, else `r`/`alpha`."""
        return (
            by_pattern(self.rank_pattern, path, self.r),
            by_pattern(self.alpha_pattern, path, self.alpha),
        )

    def unsupported(self, path: str, layer: Any) -> str | None:
        if not isinstance(layer, eqx.nn.Linear):
            return (
                f"{self.peft_type} in peftx adapts Linear layers only; {path!r} is an "
                f"eqx.nn.{type(layer).__name__}."
            )
        return None

    def checked_layer(self, layer: AdaptedLayer) -> None:
        if layer.transposed:
            raise ValueError(
                f"{layer.path!r} is a GPT-2 Conv1D layer, which PEFT's {self.peft_type} does not "
                "adapt (it has no fan_in_fan_out); exclude it (exclude_modules) or use LoRA."
            )
