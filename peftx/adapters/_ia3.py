"""IA3: a learned rescaling of a weight's output or input features.

The kind whole: `IA3Array`, its handlers, and `IA3Config`."""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from .._config import (
    PEFT_BASE_KEYS,
    RULE,
    AbstractAdapterConfig,
    AdaptedLayer,
    ModuleRule,
    field,
)
from .._kind import AbstractAdapter
from .._select import Predicate, peft_targets
from ..implicit import Transposed, primitive_handler
from ._layout import WeightProduct, weight_dot_handlers
from ._products import cast_base_on_astype, rescale, wider_dtype


class IA3Array(AbstractAdapter):
    """`weight ⊙ ia3_l` for a `Linear` weight `(out, in)`, with HF PEFT's shapes.

    `ia3_l` is `(out, 1)` to scale the output features (attention keys and values) or
    `(1, in)` to scale the input features (feed-forward down projections). Products are
    computed as a rescale of `x @ W` or of `x`, never by forming `W ⊙ l`.
    """

    weight: Any
    ia3_l: Array

    peft_keys: ClassVar[Mapping[str, str]] = {"ia3_l": "ia3_l"}
    # its axis of length 1 follows nothing
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {"ia3_l": (0, 1)}

    def __check_init__(self):
        shape = tuple(self.weight.shape)
        if len(shape) < 2:
            raise ValueError(f"IA3 needs a weight of 2 or more dimensions, got shape {shape}.")
        out, in_ = shape[-2:]
        stack = shape[:-2]
        if tuple(self.ia3_l.shape) not in ((*stack, out, 1), (*stack, 1, in_)):
            raise ValueError(
                f"ia3_l must have shape {(out, 1)} (scale outputs) or {(1, in_)} (scale "
                f"inputs) for a weight of shape {shape}, got {tuple(self.ia3_l.shape)}."
            )
        if not jnp.issubdtype(self.ia3_l.dtype, jnp.floating):
            raise TypeError(f"ia3_l must be floating-point, got dtype {self.ia3_l.dtype}.")

    @property
    def is_feedforward(self) -> bool:
        """Whether the input features are scaled (PEFT's `feedforward_modules`)."""
        return self.ia3_l.shape[-1] != 1

    def bias_scale(self) -> Array | None:
        return None if self.is_feedforward else self.ia3_l[..., 0]

    @classmethod
    def weighted(
        cls, present: Sequence[tuple[AbstractAdapter, float]], combination_type: str, config: Any
    ) -> "IA3Array":
        """The weighted sum of the scales (PEFT's `"linear"`)."""
        first = present[0][0]
        ia3_l = sum(w * a.ia3_l for a, w in present)
        return IA3Array(first.weight, ia3_l.astype(first.ia3_l.dtype))

    def merged(self, weight: Array) -> Array:
        return weight * self.ia3_l.astype(weight.dtype)


def ia3(
    weight: Any,
    *,
    feedforward: bool = False,
    dtype: Any = jnp.float32,
    key: PRNGKeyArray | None = None,
) -> IA3Array:
    """Wrap `weight` in an `IA3Array` initialized to ones, so the output is unchanged; with
    a `key`, to standard normal values instead (PEFT's `init_ia3_weights=False`).

    **Arguments:**

    - `weight`: a `Linear` weight `(out, in)`, dense or implicit.
    - `feedforward`: scale the input features (`(1, in)`) instead of the outputs
      (`(out, 1)`), as PEFT does for `feedforward_modules`.
    - `dtype`: dtype of `ia3_l`.
    - `key`: draws a random `ia3_l` (for tests of a non-identity adapter, as in PEFT).
    """
    out, in_ = weight.shape[-2:]
    shape = (1, in_) if feedforward else (out, 1)
    if key is None:
        return IA3Array(weight, jnp.ones(shape, dtype))
    return IA3Array(weight, jax.random.normal(key, shape, dtype))


def _ia3_dot(w: IA3Array, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    n = len(w.shape) - 2
    stack, scaled = p.w[:n], p.w[n + 1] if w.is_feedforward else p.w[n]
    l_vec = w.ia3_l.reshape(*w.ia3_l.shape[:-2], -1)
    if scaled in p.x:
        # the scaled axis meets x: (W ⊙ l)·x == W·(l ⊙ x)
        x = rescale(x, p.along(l_vec, (*stack, scaled), p.x))
        return p.arrange(*p.contract(x, p.x, w.weight, p.w))
    y = p.arrange(*p.contract(x, p.x, w.weight, p.w))
    return rescale(y, p.along(l_vec, (*stack, scaled), p.out))


def _ia3_update(w: IA3Array, x: Array, w_is_lhs: bool, params: dict[str, Any], base: Array) -> Any:
    # (W ⊙ l)·x - W·x, as a rescale of x (then one more product) or of the base product
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    n = len(w.shape) - 2
    stack, scaled = p.w[:n], p.w[n + 1] if w.is_feedforward else p.w[n]
    l_minus_1 = w.ia3_l.reshape(*w.ia3_l.shape[:-2], -1) - 1
    if scaled in p.x:
        x = rescale(x, p.along(l_minus_1, (*stack, scaled), p.x))
        return p.arrange(*p.contract(x, p.x, w.weight, p.w))
    wide = wider_dtype(base.dtype, l_minus_1.dtype)
    return base.astype(wide) * p.along(l_minus_1.astype(wide), (*stack, scaled), p.out)


weight_dot_handlers(IA3Array, _ia3_dot, _ia3_update)


@primitive_handler("transpose")
def _ia3_transpose(primitive: Any, w: IA3Array, *, permutation: tuple[int, ...]) -> Any:
    n = len(w.shape) - 2
    if tuple(permutation) != (*range(n), n + 1, n):
        return NotImplemented
    # the base is transposed lazily, so no weight-sized copy of it is made
    return IA3Array(Transposed(w.weight, tuple(permutation)), jnp.swapaxes(w.ia3_l, -1, -2))


cast_base_on_astype(IA3Array)


# -- the config ------------------------------------------------------------------------------

IA3_TARGET_MODULES: dict[str, tuple[str, ...]] = {
    "bert": ("key", "value", "output.dense"),
    "gemma2": ("q_proj", "v_proj", "down_proj"),
    "gemma3_text": ("q_proj", "v_proj", "down_proj"),
    "gpt2": ("c_attn", "mlp.c_proj"),
    "gpt_neox": ("query_key_value", "dense_4h_to_h"),
    "llama": ("k_proj", "v_proj", "down_proj"),
    "mistral": ("k_proj", "v_proj", "down_proj"),
    "mixtral": ("k_proj", "v_proj", "w2"),
    "opt": ("q_proj", "k_proj", "fc2"),
    "qwen2": ("q_proj", "v_proj", "down_proj"),
    "qwen3": ("q_proj", "v_proj", "down_proj"),
    "roberta": ("key", "value", "output.dense"),
    "t5": ("k", "v", "wo"),
}
IA3_FEEDFORWARD_MODULES: dict[str, tuple[str, ...]] = {
    "bert": ("output.dense",),
    "gemma2": ("down_proj",),
    "gemma3_text": ("down_proj",),
    "gpt2": ("mlp.c_proj",),
    "gpt_neox": ("dense_4h_to_h",),
    "llama": ("down_proj",),
    "mistral": ("down_proj",),
    "mixtral": ("w2",),
    "opt": ("fc2",),
    "qwen2": ("down_proj",),
    "qwen3": ("down_proj",),
    "roberta": ("output.dense",),
    "t5": ("wo",),
}

_IA3_KEYS = (
    *PEFT_BASE_KEYS,
    "target_modules",
    "exclude_modules",
    "feedforward_modules",
    "fan_in_fan_out",
    "modules_to_save",
    "init_ia3_weights",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class IA3Config(AbstractAdapterConfig):
    """HF PEFT's `IA3Config`: the same field names, meanings and defaults.

    **Arguments:**

    - `target_modules`, `exclude_modules`, `fan_in_fan_out`, `modules_to_save`: as for
      `LoraConfig` (including `"all-linear"`, `None` and `Predicate`).
    - `feedforward_modules`: the targets whose *input* is scaled (`ia3_l` of shape `(1, in)`)
      rather than their output (`(out, 1)`). When it and `target_modules` are both lists, it
      must be a subset of `target_modules` (PEFT's rule).
    - `init_ia3_weights`: start the scaling vectors at ones (a no-op); `False` draws them
      from a standard normal, as PEFT does (for tests of a non-identity adapter).
    - `layers_to_transform`, `layers_pattern`: as for `LoraConfig`. PEFT's `IA3Config` has no
      such fields: they are written to JSON only when set, and PEFT ignores them (with a
      warning) when loading such a file.
    - `task_type`, `base_model_name_or_path`, `revision`, `inference_mode`, `peft_version`:
      PEFT's bookkeeping.
    """

    peft_type: Literal["IA3"] = "IA3"
    feedforward_modules: ModuleRule = field(default=None, means=RULE)
    init_ia3_weights: bool = True

    toml_table: ClassVar[str | None] = "ia3"
    combination_types: ClassVar[tuple[str, ...]] = ("linear",)
    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = IA3_TARGET_MODULES
    # PEFT keeps IA3's `feedforward_modules` a subset of `target_modules`: no condensing
    condense_targets: ClassVar[bool] = False
    peft_selects_layers: ClassVar[bool] = False
    _KEYS: ClassVar[tuple[str, ...] | None] = _IA3_KEYS

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        return ia3(base, feedforward=layer.feedforward, key=None if self.init_ia3_weights else key)

    def is_feedforward(self, path: str, layer: Any) -> bool:
        ff = self.feedforward_modules
        return bool(ff) and bool(peft_targets(ff)(path, layer))

    def unsupported(self, path: str, layer: Any) -> str | None:
        if not isinstance(layer, eqx.nn.Linear):
            return f"IA3 adapts Linear layers only; {path!r} is an eqx.nn.{type(layer).__name__}."
        return None

    def with_model_defaults(self, model_type: str | None) -> "IA3Config":
        config = super().with_model_defaults(model_type)
        if self.feedforward_modules is not None:
            return config
        return dataclasses.replace(config, feedforward_modules=IA3_FEEDFORWARD_MODULES[model_type])

    def combined(
        self,
        configs: Sequence[AbstractAdapterConfig],
        names: Sequence[str],
        combination_type: str,
        svd_rank: int | None,
    ) -> "IA3Config":
        config = super().combined(configs, names, combination_type, svd_rank)
        ff = [c.feedforward_modules for c in configs]
        if all(isinstance(f, tuple) for f in ff):
            return dataclasses.replace(config, feedforward_modules=tuple(sorted(set().union(*ff))))
        return config

    def as_saved(self, placed: Sequence[tuple[str, AbstractAdapter]]) -> dict[str, Any]:
        changes = super().as_saved(placed)
        if isinstance(self.feedforward_modules, Predicate) or "layers_to_transform" in changes:
            changes["feedforward_modules"] = tuple(
                path for path, a in placed if isinstance(a, IA3Array) and a.is_feedforward
            )
        return changes

    def __post_init__(self) -> None:
        super().__post_init__()
        ff, target = self.feedforward_modules, self.target_modules
        if isinstance(ff, tuple) and isinstance(target, tuple) and not set(ff) <= set(target):
            raise ValueError(
                "`feedforward_modules` must be a subset of `target_modules`; "
                f"{sorted(set(ff) - set(target))} are not in `target_modules` {list(target)}. "
                "Add them to `target_modules`, or remove them from `feedforward_modules`."
            )
