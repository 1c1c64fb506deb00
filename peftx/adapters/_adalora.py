"""AdaLoRA: an SVD-shaped update `ΔW = B·(A ⊙ E)` whose rank is pruned while training by
zeroing singular values, with PEFT's names and shapes.

The kind whole: `AdaLoraArray`, its handlers, the rank allocator, and `AdaLoraConfig`."""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._config import (
    FINITE,
    FLOAT32_MAX,
    PEFT_ONLY_COMMON,
    PROBABILITY,
    RANK,
    AbstractAdapterConfig,
    AdaptedLayer,
    Range,
    field,
)
from .._kind import AbstractAdapter, AbstractTrainHook
from ._layout import WeightProduct
from ._lora import LORA_HARMLESS, LORA_KEYS, LORA_TARGET_MODULES, PEFT_ONLY_LORA
from ._products import LayerKeys, dropout, low_rank, rescale, update_handlers
from ._set import AdapterSet

# PEFT divides by `ranknum + 1e-5`
_RANKNUM_EPS = 1e-5


class AdaLoraArray(AbstractAdapter):
    """`weight + scaling/(ranknum + 1e-5) · B·(A ⊙ E)` for a `Linear` weight `(out, in)`,
    never formed when multiplied, with HF PEFT's shapes: `lora_A` `(r, in)` (right
    singular vectors), `lora_E` `(r, 1)` (singular values) and `lora_B` `(out, r)` (left
    singular vectors).

    A triplet the rank allocator prunes has its singular value set to zero, as PEFT
    masks it: `lora_A` and `lora_B` keep their size, so layers of one stack keep one
    shape. `ranknum` `(1,)`, frozen, is the rank the layer was created with (`init_r`),
    which PEFT keeps when it resizes a loaded layer, so the scale never changes with the
    pruning.

    A product computes `B·(E ⊙ A·x)` on the factors, in their dtype, and adds it to the
    base product in the wider dtype, rounded to the base's. Dropout (`lora_dropout`)
    applies to the input of `A` when `dropout_key` is set (see `with_dropout`).
    """

    weight: Any
    lora_A: Array
    lora_E: Array
    lora_B: Array
    ranknum: Array
    dropout_key: LayerKeys | None = None
    draws_dropout: ClassVar[bool] = True
    lora_alpha: float = eqx.field(static=True, default=1.0)
    lora_dropout: float = eqx.field(static=True, default=0.0)

    peft_keys: ClassVar[Mapping[str, str]] = {
        "lora_A": "lora_A",
        "lora_B": "lora_B",
        "lora_E": "lora_E",
    }
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {
        "lora_A": (None, 1),
        "lora_E": (None,),
        "lora_B": (0, None),
        "ranknum": (None,),
    }
    rank_axes: ClassVar[Mapping[str, int]] = {"lora_A": 0, "lora_E": 0, "lora_B": 1}

    def __check_init__(self) -> None:
        shape = tuple(self.weight.shape)
        if len(shape) < 2:
            raise ValueError(f"AdaLoRA needs a Linear weight (out, in), got shape {shape}.")
        stack, (out, in_) = shape[:-2], shape[-2:]
        r = self.lora_A.shape[-2] if self.lora_A.ndim >= 2 else -1
        want = {
            "lora_A": (*stack, r, in_),
            "lora_E": (*stack, r, 1),
            "lora_B": (*stack, out, r),
        }
        got = {name: tuple(getattr(self, name).shape) for name in want}
        if got != want:
            raise ValueError(
                f"AdaLoRA factors do not fit weight {shape}: expected lora_A (r, {in_}), "
                f"lora_E (r, 1) and lora_B ({out}, r) with one r, got {got}."
            )
        dtypes = {jnp.dtype(getattr(self, name).dtype) for name in want}
        if len(dtypes) != 1 or not jnp.issubdtype(dtypes.pop(), jnp.floating):
            raise TypeError(
                "AdaLoRA factors must share one floating-point dtype, got "
                f"{ {name: str(getattr(self, name).dtype) for name in want} }."
            )
        if tuple(self.ranknum.shape) != (*stack, 1):
            raise ValueError(
                f"ranknum must have shape {(*stack, 1)} for weight {shape}, got "
                f"{tuple(self.ranknum.shape)}."
            )
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}.")

    @property
    def stack_ndim(self) -> int:
        return len(self.weight.shape) - 2

    @property
    def r(self) -> int:
        return self.lora_A.shape[-2]

    @property
    def scaling(self) -> Array:
        """PEFT's factor on `B·(A ⊙ E)`, `(*stack,)` float32: `lora_alpha` (or the rank,
        for `lora_alpha <= 0`) over `ranknum + 1e-5`."""
        alpha = self.lora_alpha if self.lora_alpha > 0 else float(self.r)
        return alpha / (self.ranknum[..., 0].astype(jnp.float32) + _RANKNUM_EPS)

    def num_parameters(self) -> int:
        """PEFT's count: the factors and the base weight, and `ranknum`, which PEFT keeps
        as a one-element frozen parameter per layer."""
        frozen = 0 if self.ranknum is None else self.ranknum.size
        return super().num_parameters() + frozen

    def delta(self) -> Array:
        """`scaling · B·(A ⊙ E)`, in the adapter's dtype."""
        product = jnp.matmul(self.lora_B, self.lora_A * self.lora_E)
        return product * self.scaling.astype(product.dtype)[..., None, None]

    def merged(self, weight: Array) -> Array:
        return weight + self.delta().astype(weight.dtype)

    def unmerged(self, merged: Array) -> Array:
        """The base weight from which this adapter's dense weight `merged` was built."""
        return merged - self.delta().astype(merged.dtype)


def _adalora_update(w: AdaLoraArray, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    """`scaling · B·(E ⊙ A·x_dropped)` in the product's output order; None when neither
    axis of the weight meets `x`."""
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    s = w.stack_ndim
    stack, out_l, in_l = p.w[:s], p.w[s], p.w[s + 1]
    dtype = w.lora_A.dtype
    a_labels, b_labels = (*stack, "r", in_l), (*stack, out_l, "r")
    x_d = dropout(x, w.lora_dropout, w.dropout_key, p.x, stack).astype(dtype)
    e = w.lora_E[..., 0]
    if in_l in p.x:
        delta = low_rank(p, a_labels, b_labels, (*stack, "r"))(x_d, w.lora_A, w.lora_B, e)
    elif out_l in p.x:  # xᵀ·ΔW: B meets x first
        delta = low_rank(p, b_labels, a_labels, (*stack, "r"))(x_d, w.lora_B, w.lora_A, e)
    else:
        return None
    return rescale(delta, p.along(w.scaling, stack, p.out))


update_handlers(AdaLoraArray, _adalora_update)


def adalora(
    weight: Any,
    *,
    init_r: int = 12,
    lora_alpha: float | int = 8,
    lora_dropout: float = 0.0,
    init_lora_weights: bool = True,
    dtype: Any = jnp.float32,
    key: PRNGKeyArray,
) -> AdaLoraArray:
    """Wrap a `Linear` weight `(out, in)` in an `AdaLoraArray` initialized as PEFT does.

    **Arguments:**

    - `weight`: the base weight, dense or implicit.
    - `init_r`: the rank before any pruning (also `ranknum`).
    - `lora_alpha`, `lora_dropout`: as in `peft.AdaLoraConfig`.
    - `init_lora_weights`: `True`: `lora_E` zeros (the output is the base's), `lora_A`
      and `lora_B` normal with standard deviation 0.02; `False`: all three standard
      normal (for tests of a non-identity adapter).
    - `dtype`: the factors' dtype.
    - `key`: a JAX PRNG key.
    """
    if init_r < 1:
        raise ValueError(f"AdaLoRA's init_r={init_r} must be at least 1.")
    out, in_ = weight.shape[-2:]
    a_key, e_key, b_key = jax.random.split(key, 3)
    std = 0.02 if init_lora_weights else 1.0
    lora_A = std * jax.random.normal(a_key, (init_r, in_), dtype)
    lora_B = std * jax.random.normal(b_key, (out, init_r), dtype)
    if init_lora_weights:
        lora_E = jnp.zeros((init_r, 1), dtype)
    else:
        lora_E = jax.random.normal(e_key, (init_r, 1), dtype)
    return AdaLoraArray(
        weight,
        lora_A,
        lora_E,
        lora_B,
        jnp.full((1,), init_r, jnp.float32),
        lora_alpha=float(lora_alpha),
        lora_dropout=float(lora_dropout),
    )


def orthogonality_penalty(adapters: Any) -> Float[Array, ""]:
    """PEFT's orthogonal regularizer of AdaLoRA (added to the loss times
    `orth_reg_weight`): the mean over every `lora_A` and `lora_B` in `adapters` (any
    pytree: a model, a `PeftModel`) of `‖A·Aᵀ - I‖_F` and `‖Bᵀ·B - I‖_F`, each layer of a
    stack counted once. Zero when there are none."""

    def is_adalora(x: Any) -> bool:
        return isinstance(x, AdaLoraArray)

    found = [x for x in jax.tree.leaves(adapters, is_leaf=is_adalora) if is_adalora(x)]
    terms = []
    for w in found:
        a = w.lora_A.astype(jnp.float32)
        b = w.lora_B.astype(jnp.float32)
        gram_a = jnp.matmul(a, jnp.swapaxes(a, -1, -2))
        gram_b = jnp.matmul(jnp.swapaxes(b, -1, -2), b)
        eye = jnp.broadcast_to(jnp.eye(w.r, dtype=jnp.float32), gram_a.shape)
        for gram in (gram_a, gram_b):
            norms = jnp.sqrt(jnp.sum(jnp.square(gram - eye), axis=(-2, -1)))
            terms.append(norms.reshape(-1))
    if not terms:
        return jnp.zeros((), jnp.float32)
    every = jnp.concatenate(terms)
    return jnp.sum(every) / every.size


_FACTORS = ("lora_A", "lora_E", "lora_B")


def _layers(tree: Any, name: str) -> list[AdaLoraArray]:
    """The AdaLoRA arrays of adapter `name` in `tree` (a model, its trainable half or its
    gradients), in tree order."""

    def is_set(x: Any) -> bool:
        return isinstance(x, AdapterSet)

    sets = [s for s in jax.tree.leaves(tree, is_leaf=is_set) if is_set(s)]
    found = [s.adapters.get(name) for s in sets]
    return [w for w in found if isinstance(w, AdaLoraArray)]


def budget_schedule(
    init_budget: int, target_budget: int, tinit: int, tfinal: int, total_step: int
) -> list[int]:
    """PEFT's rank budget at each step `tinit < step < total_step - tfinal` (the cubic
    decrease from `init_budget` to `target_budget`), computed in Python floats as PEFT
    does, so that each step's budget is PEFT's to the integer."""
    span = total_step - tfinal - tinit
    budgets = []
    for step in range(tinit + 1, total_step - tfinal):
        mul = 1 - (step - tinit) / span
        budgets.append(int((init_budget - target_budget) * (mul**3) + target_budget))
    return budgets


class RankAllocator(AbstractTrainHook):
    """AdaLoRA's importance-based rank allocator (PEFT's `RankAllocator` with
    `AdaLoraModel.update_and_allocate`), run by `peftx.train`'s step after each optimizer
    update, jitted.

    Until `total_step - tfinal`, each factor entry's sensitivity `|w·∂L/∂w|` is smoothed
    (`beta1`) along with its uncertainty (`beta2`). A triplet's importance is its singular
    value's score plus the mean score of its row of `lora_A` and its column of `lora_B`.
    After `tinit` steps, every `deltaT` steps, the triplets below the budget of the
    cubic schedule have their singular values zeroed; at `total_step - tfinal` the
    budget reaches `target_r` per layer, and from then on those ranks stay pruned.
    `kept` is the last allocation (PEFT's `rank_pattern`), one bool per rank of each
    layer (each layer of a stack counted on its own, as PEFT counts them).

    The orthogonality penalty `orth_reg_weight · orthogonality_penalty` is added to the
    loss (`penalty`), as PEFT's forward adds it.
    """

    adapter_name: str = eqx.field(static=True)
    tinit: int = eqx.field(static=True)
    tfinal: int = eqx.field(static=True)
    total_step: int = eqx.field(static=True)
    deltaT: int = eqx.field(static=True)
    beta1: float = eqx.field(static=True)
    beta2: float = eqx.field(static=True)
    orth_reg_weight: float = eqx.field(static=True)
    init_budget: int = eqx.field(static=True)
    target_budget: int = eqx.field(static=True)
    budgets: Int[Array, " steps"]
    sensitivity: tuple[dict[str, Array], ...]
    uncertainty: tuple[dict[str, Array], ...]
    kept: tuple[Bool[Array, "*stack r"], ...]
    allocated: Bool[Array, ""]

    @classmethod
    def start(cls, config: Any, adapter_name: str, trainable: Any) -> "RankAllocator":
        """The allocator of the run about to train adapter `adapter_name` (with
        `config`, an `AdaLoraConfig`) in `trainable`: nothing smoothed, every rank kept."""
        config.check_trainable()
        layers = _layers(trainable, adapter_name)
        if not layers:
            raise ValueError(f"adapter {adapter_name!r} has no AdaLoRA layers to allocate.")
        rows = sum(int(np.prod(w.lora_E.shape[:-2])) for w in layers)
        init_budget = sum(int(np.prod(w.lora_E.shape[:-1])) for w in layers)
        target_budget = config.target_r * rows
        budgets = budget_schedule(
            init_budget, target_budget, config.tinit, config.tfinal, config.total_step
        )

        def zeros(w: AdaLoraArray) -> dict[str, Array]:
            return {f: jnp.zeros_like(getattr(w, f), jnp.float32) for f in _FACTORS}

        return cls(
            adapter_name=adapter_name,
            tinit=config.tinit,
            tfinal=config.tfinal,
            total_step=config.total_step,
            deltaT=config.deltaT,
            beta1=float(config.beta1),
            beta2=float(config.beta2),
            orth_reg_weight=float(config.orth_reg_weight),
            init_budget=init_budget,
            target_budget=target_budget,
            budgets=jnp.asarray(budgets or [target_budget], jnp.int32),
            sensitivity=tuple(zeros(w) for w in layers),
            uncertainty=tuple(zeros(w) for w in layers),
            kept=tuple(jnp.ones(w.lora_E.shape[:-1], bool) for w in layers),
            allocated=jnp.zeros((), bool),
        )

    def penalty(self, trainable: Any) -> Float[Array, ""]:
        return self.orth_reg_weight * orthogonality_penalty(_layers(trainable, self.adapter_name))

    def update(self, trainable: Any, grads: Any, step: Array) -> tuple[Any, "RankAllocator"]:
        layers = _layers(trainable, self.adapter_name)
        layer_grads = _layers(grads, self.adapter_name)
        final = self.total_step - self.tfinal
        smoothing = step < final
        sensitivity, uncertainty = [], []
        for w, g, s_old, u_old in zip(
            layers, layer_grads, self.sensitivity, self.uncertainty, strict=True
        ):
            s_new, u_new = {}, {}
            for f in _FACTORS:
                ipt = jnp.abs(getattr(w, f) * getattr(g, f)).astype(jnp.float32)
                s = self.beta1 * s_old[f] + (1 - self.beta1) * ipt
                u = self.beta2 * u_old[f] + (1 - self.beta2) * jnp.abs(ipt - s)
                s_new[f] = jnp.where(smoothing, s, s_old[f])
                u_new[f] = jnp.where(smoothing, u, u_old[f])
            sensitivity.append(s_new)
            uncertainty.append(u_new)

        shrinking = (step > self.tinit) & (step < final)
        index = jnp.clip(step - self.tinit - 1, 0, self.budgets.shape[0] - 1)
        budget = jnp.where(step == final, self.target_budget, self.budgets[index])
        allocate = (shrinking & (step % self.deltaT == 0)) | (step == final)

        scores = []
        for s, u in zip(sensitivity, uncertainty, strict=True):
            score = {f: s[f] * u[f] for f in _FACTORS}
            rows_a = jnp.mean(score["lora_A"], axis=-1)  # (*stack, r)
            cols_b = jnp.mean(score["lora_B"], axis=-2)
            scores.append(score["lora_E"][..., 0] + (rows_a + cols_b))
        every = jnp.sort(jnp.concatenate([x.reshape(-1) for x in scores]))
        pruned = self.init_budget - budget
        threshold = jnp.where(pruned > 0, every[jnp.maximum(pruned - 1, 0)], -jnp.inf)
        kept = tuple(
            jnp.where(allocate, score > threshold, old)
            for score, old in zip(scores, self.kept, strict=True)
        )
        masking = allocate | (step > final)
        new_e = [
            jnp.where(masking & ~k[..., None], jnp.zeros_like(w.lora_E), w.lora_E)
            for w, k in zip(layers, kept, strict=True)
        ]
        trainable = eqx.tree_at(
            lambda t: [w.lora_E for w in _layers(t, self.adapter_name)], trainable, new_e
        )
        hook = eqx.tree_at(
            lambda h: (h.sensitivity, h.uncertainty, h.kept, h.allocated),
            self,
            (tuple(sensitivity), tuple(uncertainty), kept, self.allocated | allocate),
        )
        return trainable, hook

    def config_changes(self, layer_paths: Sequence[str]) -> dict[str, Any]:
        """`rank_pattern`, PEFT's: each layer's `<path>.lora_E` and its kept ranks, once
        the allocator has pruned (otherwise nothing)."""
        if not bool(self.allocated):
            return {}
        rows = [row for k in self.kept for row in np.asarray(k).reshape(-1, k.shape[-1])]
        if len(rows) != len(layer_paths):
            raise ValueError(
                f"adapter {self.adapter_name!r} has {len(layer_paths)} AdaLoRA layers, its "
                f"allocator {len(rows)}: the model is not the one it was made for."
            )
        return {
            "rank_pattern": {
                f"{path}.lora_E": [bool(b) for b in row]
                for path, row in zip(layer_paths, rows, strict=True)
            }
        }


# -- the config ------------------------------------------------------------------------------

_ADALORA_KEYS = (
    *LORA_KEYS[: LORA_KEYS.index("ensure_weight_tying") + 1],
    "target_r",
    "init_r",
    "tinit",
    "tfinal",
    "deltaT",
    "beta1",
    "beta2",
    "orth_reg_weight",
    "total_step",
)

_STEPS = Range(lambda v: v >= 0, "`{name}` must be a number of steps >= 0")
_BETA = Range(lambda v: 0 < v < 1, "`{name}` must be in (0, 1)")


# PEFT's AdaLoRA defaults are LoRA's, but all attention and MLP layers of these
_ADALORA_TARGETS: dict[str, tuple[str, ...]] = {
    "t5": ("q", "k", "v", "o", "wi", "wo"),
    "bart": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
    "opt": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
    "roberta": ("query", "key", "value", "dense"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaLoraConfig(AbstractAdapterConfig):
    """HF PEFT's `AdaLoraConfig`: the same field names, meanings and defaults.

    Each targeted Linear gets an `AdaLoraArray`, `W + lora_alpha/init_r · B·(A ⊙ E)` with
    `lora_A` `(init_r, in)`, `lora_E` `(init_r, 1)` and `lora_B` `(out, init_r)`. While
    training, a rank allocator zeroes the singular values (`lora_E`) of the least important
    triplets until `target_r` ranks per layer are left on average; PEFT's file then holds
    only the kept ranks, listed in `rank_pattern`.

    **Arguments:**

    - `init_r`: every layer's rank before pruning (PEFT ignores `r`, as peftx does).
    - `target_r`: the average rank per layer left once the budget has shrunk.
    - `tinit`, `tfinal`, `total_step`: the schedule: `tinit` steps without pruning, the
      budget then shrinking cubically until `total_step - tfinal`, and the last `tfinal`
      steps at the final ranks. `total_step` is required.
    - `deltaT`: prune every `deltaT` steps while the budget shrinks.
    - `beta1`, `beta2`: the moving averages of each weight's sensitivity `|w·∂L/∂w|` and
      of its uncertainty.
    - `orth_reg_weight`: the weight of the orthogonality penalty on `lora_A` and `lora_B`
      added to the loss (`orthogonality_penalty`).
    - `rank_pattern`: the allocator's result, from each layer's `lora_E` path to one bool
      per rank (kept or pruned); None before any pruning.
    - `lora_alpha`: the scale is `lora_alpha / init_r` (`init_r / init_r` for
      `lora_alpha <= 0`).
    - `lora_dropout`, `bias`, `target_modules`, `exclude_modules`, `fan_in_fan_out`,
      `modules_to_save`, `layers_to_transform`, `layers_pattern` and PEFT's bookkeeping:
      as for `LoraConfig`; Linear layers only.
    - `init_lora_weights`: `True` (`lora_E` zeros: a no-op at start; `lora_A`, `lora_B`
      normal with std 0.02) or `False` (all standard normal, for tests).
    Mixed-adapter batches are refused, as PEFT's AdaLoRA layers have none.
    """

    peft_type: Literal["ADALORA"] = "ADALORA"
    lora_alpha: int | float = field(default=8, range=FINITE)
    lora_dropout: int | float = field(default=0.0, range=PROBABILITY, converter=float)
    bias: Literal["none", "all", "lora_only"] = "none"
    init_lora_weights: bool = True
    # one bool per rank: how many is checked against `init_r` in `__post_init__`
    rank_pattern: dict[str, list[bool] | tuple[bool, ...]] | None = field(
        default=None, means="None or a dict from lora_E paths to lists of bools (one per rank)"
    )
    target_r: int = field(default=8, range=RANK)
    init_r: int = field(default=12, range=RANK)
    tinit: int = field(default=0, range=_STEPS)
    tfinal: int = field(default=0, range=_STEPS)
    deltaT: int = field(
        default=1, range=Range(lambda v: v >= 1, "`deltaT` must be a number of steps >= 1")
    )
    beta1: int | float = field(default=0.85, range=_BETA)
    beta2: int | float = field(default=0.85, range=_BETA)
    orth_reg_weight: int | float = field(
        default=0.5,
        range=Range(
            lambda v: 0 <= v <= FLOAT32_MAX, "`orth_reg_weight` must be a finite number >= 0"
        ),
    )
    total_step: int | None = None

    toml_table: ClassVar[str | None] = "adalora"
    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = {
        **LORA_TARGET_MODULES,
        **_ADALORA_TARGETS,
    }
    mixed_batches: ClassVar[bool] = False
    _KEYS: ClassVar[tuple[str, ...] | None] = _ADALORA_KEYS
    _PEFT_ONLY: ClassVar[dict[str, Any]] = {
        **PEFT_ONLY_COMMON,
        **PEFT_ONLY_LORA,
        "r": 8,
        "use_rslora": False,
        "alpha_pattern": {},
        "use_dora": False,
        "loftq_config": {},
        "target_parameters": None,
    }
    # LoraConfig's fields that AdaLoRA's layers never read (PEFT warns of `r`)
    _HARMLESS: ClassVar[frozenset[str]] = LORA_HARMLESS | {
        "r",
        "use_rslora",
        "alpha_pattern",
        "loftq_config",
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.total_step is None or self.total_step <= 0:
            raise ValueError(
                f"AdaLoRA needs `total_step`, the number of training steps (> 0), to schedule "
                f"its rank budget; got {self.total_step!r}."
            )
        if self.tinit >= self.total_step - self.tfinal:
            raise ValueError(
                f"AdaLoRA's schedule leaves no steps to prune in: tinit={self.tinit} must be "
                f"below total_step - tfinal = {self.total_step - self.tfinal}. Decrease "
                "`tinit` or `tfinal`, or increase `total_step`."
            )
        wrong = {k: len(v) for k, v in (self.rank_pattern or {}).items() if len(v) != self.init_r}
        if wrong:
            raise ValueError(
                f"`rank_pattern` must hold init_r={self.init_r} bools per layer; got "
                f"{wrong} (lengths)."
            )

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        if layer.transposed:
            raise ValueError(
                f"{layer.path!r} is a GPT-2 Conv1D layer, which peftx's AdaLoRA does not adapt "
                "yet; exclude it (exclude_modules) or use LoRA."
            )
        return adalora(
            base,
            init_r=self.init_r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            init_lora_weights=self.init_lora_weights,
            key=key,
        )

    def unsupported(self, path: str, layer: Any) -> str | None:
        if not isinstance(layer, eqx.nn.Linear):
            return (
                f"AdaLoRA in peftx adapts Linear layers only; {path!r} is an "
                f"eqx.nn.{type(layer).__name__}."
            )
        return None

    def check_trainable(self) -> None:
        if self.target_r > self.init_r:  # PEFT fails at its first allocation instead
            raise ValueError(
                f"AdaLoRA prunes ranks: target_r={self.target_r} must not exceed "
                f"init_r={self.init_r} to train."
            )

    def train_hook(self, adapter_name: str, trainable: Any) -> RankAllocator:
        return RankAllocator.start(self, adapter_name, trainable)

    def kept_ranks(self, path: str) -> tuple[int, ...] | None:
        """The ranks `rank_pattern` keeps for the layer at `path` (keyed
        `<path>.lora_E`, as PEFT writes it); None where it names none."""
        mask = (self.rank_pattern or {}).get(f"{path}.lora_E")
        return None if mask is None else tuple(i for i, kept in enumerate(mask) if kept)
