"""Lily (HF PEFT's `LILY`): low-rank factors shared across layers, `lily_A` by blocks of
`stride_A` consecutive layers and `num_B` factors `lily_B` by all layers of a target,
mixed per batch by a router of each layer.

The kind whole: `LilyArray`, its handlers, and `LilyConfig`."""

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
    MAX_RANK,
    PEFT_BASE_KEYS,
    RANK,
    AbstractAdapterConfig,
    AdaptedLayer,
    Range,
    field,
)
from .._kind import AbstractAdapter
from ._layout import WeightProduct, weight_dot_handlers
from ._lora import LORA_TARGET_MODULES, LoraArray, lora_dot, lora_update
from ._products import cast_base_on_astype


class LilyArray(AbstractAdapter):
    """A `Linear` weight `(out, in)` plus PEFT's Lily update, with PEFT's tensors:
    `lily_A (r, in)`, `lily_B (num_B·r, out)` and `lily_router (num_B, r)`.

    For tokens `x (…, in)`: `h = x·Aᵀ (…, r)`, the router's probabilities
    `p = mean_tokens softmax(h·Rᵀ) (num_B,)`, averaged over every token of the product
    (PEFT averages over the whole batch, padding included), and the update
    `scaling · h·Σ_e p_e·B_e` with `B_e (r, out)` the `e`-th block of rows of `lily_B`.
    It depends on the batch, so there is no dense weight (`merged` refuses, as PEFT's
    merge does); a product never builds one: `O(tokens·r·(in + out))` extra work, as
    LoRA's product with the mixed `B` (one GEMM with the base).

    In a stack of layers (a `LayerStack` segment, weight `(L, out, in)`) the arrays are
    stored shared, each once, so each trains as one parameter with one gradient:
    `lily_A (⌈L/stride_A⌉, r, in)`, one row per block of `stride_A` consecutive layers;
    `lily_B (1, num_B·r, out)`, one row for all; `lily_router (L, num_B, r)`, per layer.
    `for_layers` spreads them to one row per layer inside the traced step (a gather: the
    rows' gradients sum into the shared ones), as `lax.scan` slices them; `shared` says
    which form this is. The update computes in the factors' dtype (PEFT casts `x` to
    it) and is added to the base product in the wider dtype, rounded to the base's.
    """

    weight: Any
    lily_A: Array
    lily_B: Array
    lily_router: Array
    scaling: float = eqx.field(static=True, default=1.0)
    stride_A: int = eqx.field(static=True, default=1)
    shared: bool = eqx.field(static=True, default=False)

    peft_keys: ClassVar[Mapping[str, str]] = {
        "lily_A": "lily_A.weight",
        "lily_B": "lily_B.weight",
        "lily_router": "lily_router.weight",
    }
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {
        "lily_A": (None, 1),
        "lily_B": (None, 0),
        "lily_router": (None, None),
    }

    def __check_init__(self) -> None:
        shape = tuple(self.weight.shape)
        if len(shape) not in (2, 3):
            raise ValueError(
                f"Lily needs a Linear weight (out, in) or a stack of them (L, out, in), got "
                f"shape {shape}."
            )
        stack, (out, in_) = shape[:-2], shape[-2:]
        a, b, router = (tuple(t.shape) for t in (self.lily_A, self.lily_B, self.lily_router))
        r = a[-2] if len(a) >= 2 else 0
        num_b = router[-2] if len(router) >= 2 else 0
        rows_a, rows_b = stack, stack
        if stack and self.shared:
            rows_a, rows_b = (-(-stack[0] // self.stride_A),), (1,)
        want = {
            "lily_A": (*rows_a, r, in_),
            "lily_B": (*rows_b, num_b * r, out),
            "lily_router": (*stack, num_b, r),
        }
        got = {"lily_A": a, "lily_B": b, "lily_router": router}
        if r < 1 or num_b < 2 or got != want:
            raise ValueError(
                f"Lily factors lily_A {a}, lily_B {b}, lily_router {router} do not fit weight "
                f"{shape}: expected {want} (r >= 1, num_B >= 2)."
            )
        for name in ("lily_A", "lily_B", "lily_router"):
            if not jnp.issubdtype(getattr(self, name).dtype, jnp.floating):
                raise TypeError(
                    f"{name} must be floating-point, got dtype {getattr(self, name).dtype}."
                )
        if self.stride_A < 1:
            raise ValueError(f"stride_A must be at least 1, got {self.stride_A}.")

    @property
    def stack_ndim(self) -> int:
        return len(self.weight.shape) - 2

    @property
    def num_B(self) -> int:
        return self.lily_router.shape[-2]

    def layer_rows(self, field: str) -> tuple[int, ...] | None:
        if not (self.stack_ndim and self.shared) or field == "lily_router":
            return None
        layers = range(self.weight.shape[0])
        return tuple(i // self.stride_A if field == "lily_A" else 0 for i in layers)

    def for_layers(self) -> "LilyArray":
        if not (self.stack_ndim and self.shared):
            return self
        n = self.weight.shape[0]
        a = self.lily_A[jnp.arange(n) // self.stride_A]
        b = jnp.broadcast_to(self.lily_B, (n, *self.lily_B.shape[1:]))
        return dataclasses.replace(self, lily_A=a, lily_B=b, shared=False)

    def merged(self, weight: Array) -> Array:
        raise ValueError(
            "Lily has no dense weight: its router averages over the tokens of each batch, so "
            "its update depends on the batch (PEFT cannot merge Lily either). Keep the "
            "adapter unmerged."
        )


def _as_lora(w: LilyArray, x: Array, p: WeightProduct) -> LoraArray | None:
    """The update for the tokens `x` as the LoRA it is: `lily_A`, and as `lora_B (out, r)`
    the router's mix `Σ_e p_e·B_e` with `p = mean_tokens softmax((x·Aᵀ)·Rᵀ)`, at Lily's
    scaling; its product is then LoRA's (one GEMM with the base where the tokens
    outnumber the weight's rows). None unless the weight's input features meet `x`
    (`x·Wᵀ`)."""
    q = dataclasses.replace(p, preferred_element_type=None)
    s = w.stack_ndim
    stack, out_l, in_l = p.w[:s], p.w[s], p.w[s + 1]
    if in_l not in p.x or out_l in p.x:
        return None
    w = w.for_layers()
    h, h_labels = q.contract(x.astype(w.lily_A.dtype), p.x, w.lily_A, (*stack, "r", in_l))
    logits, labels = q.contract(h, h_labels, w.lily_router, (*stack, "e", "r"))
    probs = jax.nn.softmax(logits, axis=labels.index("e"))
    tokens = tuple(i for i, lab in enumerate(labels) if lab not in stack and lab != "e")
    probs = jnp.mean(probs, axis=tokens)
    probs_labels = tuple(lab for lab in labels if lab in stack or lab == "e")
    blocks = w.lily_B.reshape(*w.lily_B.shape[:-2], w.num_B, -1, w.lily_B.shape[-1])
    mixed, m_labels = q.contract(probs, probs_labels, blocks, (*stack, "e", "r", out_l))
    mixed = jnp.transpose(mixed, [m_labels.index(lab) for lab in (*stack, out_l, "r")])
    r = w.lily_A.shape[-2]
    return LoraArray(w.weight, w.lily_A, mixed, lora_alpha=w.scaling * r)


def _lily_dot(w: LilyArray, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    lora = _as_lora(w, x, WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params))
    return NotImplemented if lora is None else lora_dot(lora, x, w_is_lhs, params)


def _lily_update(
    w: LilyArray, x: Array, w_is_lhs: bool, params: dict[str, Any], base: Array
) -> Any:
    lora = _as_lora(w, x, WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params))
    return NotImplemented if lora is None else lora_update(lora, x, w_is_lhs, params, base)


weight_dot_handlers(LilyArray, _lily_dot, _lily_update)
cast_base_on_astype(LilyArray)


def _kaiming_uniform(key: PRNGKeyArray, shape: tuple[int, ...], dtype: Any) -> Array:
    """PEFT's `kaiming_uniform_(a=√5)` on torch `Linear` weights: bound `1/√fan_in`, the
    fan-in the last axis."""
    bound = 1.0 / math.sqrt(shape[-1])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def lily(
    weight: Any,
    *,
    r: int = 32,
    num_B: int = 2,
    stride_A: int = 1,
    scaling: float = 1.0,
    init_weights: bool = True,
    dtype: Any = jnp.float32,
    key: PRNGKeyArray,
) -> LilyArray:
    """Wrap a `Linear` weight `(out, in)`, or a stack of them `(L, out, in)` whose layers
    share the factors (stored shared, see `LilyArray`), in a `LilyArray` initialized as
    PEFT does.

    **Arguments:**

    - `weight`: the base weight, dense or implicit.
    - `r`, `num_B`, `stride_A`, `scaling`: as in `peft.LilyConfig`.
    - `init_weights`: `True`: `lily_A` and `lily_router` Kaiming-uniform (bound
      `1/√fan_in`), `lily_B` zeros (the output is the base's); `False`: `lily_B`
      Kaiming-uniform too.
    - `dtype`: the factors' dtype.
    - `key`: a JAX PRNG key.
    """
    *stack, out, in_ = weight.shape
    if r < 1:
        raise ValueError(f"`r` should be a positive integer value but the value passed is {r}")
    if num_B < 2:
        raise ValueError(f"`num_B` must be at least 2 for the router to be trained, got {num_B}.")
    rows_a, rows_b = (-(-stack[0] // stride_A),) if stack else (), (1,) if stack else ()
    ka, kb, kr = jax.random.split(key, 3)
    a = _kaiming_uniform(ka, (*rows_a, r, in_), dtype)
    b_shape = (*rows_b, num_B * r, out)
    b = jnp.zeros(b_shape, dtype) if init_weights else _kaiming_uniform(kb, b_shape, dtype)
    router = _kaiming_uniform(kr, (*stack, num_B, r), dtype)
    return LilyArray(
        weight, a, b, router, scaling=float(scaling), stride_A=stride_A, shared=bool(stack)
    )


# -- the config ------------------------------------------------------------------------------

_LILY_KEYS = (
    *PEFT_BASE_KEYS,
    "r",
    "stride_A",
    "num_B",
    "scaling",
    "target_modules",
    "exclude_modules",
    "modules_to_save",
    "layers_to_transform",
    "layers_pattern",
    "init_weights",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LilyConfig(AbstractAdapterConfig):
    """HF PEFT's `LilyConfig` (Lily, low-rank interconnected adaptation across layers): the
    same field names, meanings and defaults. Each adapted `Linear` gets a `LilyArray`.

    **Arguments:**

    - `r`: the rank of `lily_A (r, in)` and of each of the `num_B` blocks of `lily_B`.
    - `stride_A`: how many consecutive layers of a target share one `lily_A` (at least 1).
    - `num_B`: how many `(r, out)` factors `lily_B` holds, shared by every layer of a
      target and mixed by each layer's `lily_router` (at least 2).
    - `scaling`: the update's multiplier (not `alpha / r`).
    - `init_weights`: `True`: `lily_B` zeros (a no-op at start); `False`: random, for tests.
    - `target_modules`, `exclude_modules`, `modules_to_save`, `layers_to_transform`,
      `layers_pattern`: as for `LoraConfig`; Linear layers only.
    - `task_type`, `base_model_name_or_path`, `revision`, `inference_mode`, `peft_version`:
      PEFT's bookkeeping.

    Sharing: PEFT groups the adapted layers by target name and weight shape, in model
    order; `lily_A` is shared by each block of `stride_A` of them, `lily_B` by all. peftx
    holds each shared factor once, in a stacked model (`layout="stacked"`) whose layers of
    a target form one `LayerStack` segment: the factor is one array along the segment's
    layer axis (see `LilyArray`). Where a group's layers are separate modules (the
    unrolled layout, or a stack split by `layers_to_transform`), sharing would need
    copies tied in every step, so the config refuses them. Mixed-adapter batches are
    refused, as PEFT has none for Lily, and merging is refused (no dense weight).
    """

    peft_type: Literal["LILY"] = "LILY"
    r: int = field(default=32, range=RANK)
    stride_A: int = field(default=1, range=RANK)
    num_B: int = field(
        default=2,
        range=Range(
            lambda v: 2 <= v <= MAX_RANK,
            f"`{{name}}` must be at least 2 for the router to be trained (at most {MAX_RANK})",
        ),
    )
    scaling: int | float = field(default=1.0, range=FINITE, converter=float)
    init_weights: bool = True

    toml_table: ClassVar[str | None] = "lily"
    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = LORA_TARGET_MODULES
    mixed_batches: ClassVar[bool] = False
    _KEYS: ClassVar[tuple[str, ...] | None] = _LILY_KEYS

    def planned(self, layers: tuple[AdaptedLayer, ...]) -> tuple[AdaptedLayer, ...]:
        """The layers, once each group PEFT shares factors within (a target name and a
        weight shape) is checked to be one module: one layer, or one stack segment."""
        groups: dict[tuple[str, tuple[int, ...]], list[str]] = {}
        for t in layers:
            shape = tuple(t.layer.weight.shape[-2:])
            groups.setdefault((self._shared_by(t.path), shape), []).append(t.path)
        for paths in groups.values():
            if len(paths) > 1:
                raise ValueError(
                    f"Lily shares lily_A and lily_B across the layers {paths}, which are "
                    "separate modules here; load the model with layout='stacked' and adapt "
                    "each target in every layer (no layers_to_transform)."
                )
        return layers

    def _shared_by(self, path: str) -> str:
        """PEFT's name of the group a layer's factors are shared in: the regex
        `target_modules`, or the last of its target names the path ends with."""
        target = self.target_modules
        if isinstance(target, str):
            return target
        names = [n for n in target if path.endswith(n)] if isinstance(target, tuple) else []
        return names[-1] if names else path.rsplit(".", 1)[-1]

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        if layer.transposed:
            raise ValueError(
                f"{layer.path!r} is a GPT-2 Conv1D layer, which PEFT's Lily does not adapt "
                "(torch.nn.Linear only); exclude it (exclude_modules) or use LoRA."
            )
        return lily(
            base,
            r=self.r,
            num_B=self.num_B,
            stride_A=self.stride_A,
            scaling=self.scaling,
            init_weights=self.init_weights,
            key=key,
        )

    def build_stacked(
        self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray, stack: int
    ) -> AbstractAdapter:
        if stack != 1:
            raise ValueError(
                f"Lily shares its factors along one layer axis; {layer.path!r} has {stack}."
            )
        return self.build(base, layer, key=key)

    def unsupported(self, path: str, layer: Any) -> str | None:
        if not isinstance(layer, eqx.nn.Linear):
            return f"Lily adapts Linear layers only; {path!r} is an eqx.nn.{type(layer).__name__}."
        return None
