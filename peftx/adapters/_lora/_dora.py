"""DoRA: LoRA's update with a learned magnitude per output row, as an implicit array."""

from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from ...implicit import materialize, use_implicit_args
from .._layout import WeightProduct, weight_dot_handlers
from .._products import LayerKeys, add_update, rescale
from ._lora import AbstractLowRank, LoraArray, init_low_rank, lora_dot, lora_terms


class DoraArray(AbstractLowRank):
    """DoRA: `m ⊙ (W + s·B·A) / ‖W + s·B·A‖`, the norm taken per output row.

    As in HF PEFT (and the DoRA paper, §4.3) the norm is treated as a constant for
    gradients. No weight-sized array is formed for it: `‖W_i‖²` of the frozen base is
    computed once, by the constructor, and kept as `weight_sq_norm` (float32, `(out,)`,
    not a parameter: `partition` freezes it and parameter counts leave it out); the rest
    comes from `W·Aᵀ` `(out, r)`, through the base's own product (an NF4 base dequantizes
    in chunks), and `A·Aᵀ` `(r, r)`. `lora_magnitude_vector` has shape `(out,)`.

    `weight_sq_norm` describes the `weight` given to the constructor: build a new
    `DoraArray` for another base rather than swapping `weight` with `eqx.tree_at`.
    `materialize()` takes the norm of the dense weight it builds.
    """

    lora_magnitude_vector: Array
    weight_sq_norm: Array

    peft_keys: ClassVar[Mapping[str, str]] = {
        **LoraArray.peft_keys,
        "lora_magnitude_vector": "lora_magnitude_vector",
    }
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {
        **LoraArray.weight_axes,
        "lora_magnitude_vector": (0,),
        "weight_sq_norm": (0,),
    }

    def __init__(
        self,
        weight: Any,
        lora_A: Array,
        lora_B: Array,
        lora_magnitude_vector: Array,
        *,
        lora_alpha: float | int,
        use_rslora: bool = False,
        lora_dropout: float | int = 0.0,
        dropout_key: LayerKeys | None = None,
        compute_dtype: Any = None,
    ):
        init_low_rank(
            self,
            weight,
            lora_A,
            lora_B,
            lora_alpha,
            use_rslora,
            lora_dropout,
            dropout_key,
            compute_dtype,
        )
        if len(weight.shape) != 2:
            raise ValueError(
                f"DoRA supports Linear weights (out, in) only, got shape {tuple(weight.shape)}."
            )
        if tuple(lora_magnitude_vector.shape) != (weight.shape[0],):
            raise ValueError(
                f"lora_magnitude_vector must have shape ({weight.shape[0]},), one entry per "
                f"output feature, got {tuple(lora_magnitude_vector.shape)}."
            )
        self.lora_magnitude_vector = lora_magnitude_vector
        self.weight_sq_norm = _row_sq_norms(weight)

    def weight_norm(self) -> Array:
        """`‖W + s·B·A‖` per output row, without forming the weight-sized sum."""
        return _dora_norm(self)

    def merged(self, weight: Array) -> Array:
        dense = weight.astype(jnp.float32) + self.delta().astype(jnp.float32)
        norm = lax.stop_gradient(jnp.sqrt(jnp.sum(dense * dense, -1)))
        scale = (self.lora_magnitude_vector.astype(jnp.float32) / norm)[..., None]
        return (dense * scale).astype(weight.dtype)

    def unmerged(self, merged: Array) -> Array:
        merged = merged * (self.weight_norm() / self.lora_magnitude_vector)[..., None]
        base = merged - self.delta().astype(merged.dtype)
        return base.astype(merged.dtype)


def _row_sq_norms(weight: Any) -> Array:
    """`‖W_i‖²` of each output row of a dense or implicit weight, in float32; an implicit
    one is materialized (this runs once, when a `DoraArray` is built)."""
    w = materialize(weight)
    n = w.ndim
    rows = tuple(range(n - 1))
    # a batched product: the squares are never formed as an array of their own
    sq = lax.dot_general(
        w,
        w,
        (((n - 1,), (n - 1,)), (rows, rows)),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return lax.stop_gradient(sq)


def _dora_scale(w: DoraArray) -> Array:
    """`m / ‖W + s·B·A‖` per output row, in float32 (whatever the magnitude's dtype)."""
    return w.lora_magnitude_vector.astype(jnp.float32) / _dora_norm(w)


def _dora_norm(w: DoraArray) -> Array:
    """`‖W + s·B·A‖` per output row, in float32 and detached from gradients, from the kept
    `‖W_i‖²`, `W·Aᵀ` `(out, r)` and `A·Aᵀ` `(r, r)`."""
    s = w.stack_ndim
    a = lax.stop_gradient(w.lora_A).astype(jnp.float32)
    b = lax.stop_gradient(w.lora_B).astype(jnp.float32)
    stack = tuple(range(s))
    dims = (((s + 1,), (s + 1,)), (stack, stack))

    def base_times(weight: Any, a: Array) -> Array:
        return lax.dot_general(weight, a, dims, preferred_element_type=jnp.float32)

    # W·Aᵀ through the base's own product handler (e.g. NF4's, chunked), whether the base
    # is an implicit array here (`dora()`) or a traced one (inside a handler)
    wa = use_implicit_args(base_times)(w.weight, a)
    aa = jnp.matmul(a, jnp.swapaxes(a, -1, -2))
    c = w.scaling
    # ‖W + c·B·A‖² = ‖W‖² + 2c·⟨W·Aᵀ, B⟩ + c²·⟨B·(A·Aᵀ), B⟩, row by row
    sq = w.weight_sq_norm + 2 * c * jnp.sum(wa * b, -1) + c * c * jnp.sum((b @ aa) * b, -1)
    return lax.stop_gradient(jnp.sqrt(jnp.maximum(sq, 0.0)))


def dora(lora_array: LoraArray) -> DoraArray:
    """DoRA from a LoRA: the magnitude starts at the row norms, so the output is unchanged."""
    x = lora_array
    d = DoraArray(
        x.weight,
        x.lora_A,
        x.lora_B,
        jnp.ones(x.weight.shape[:1], x.lora_A.dtype),
        lora_alpha=x.lora_alpha,
        use_rslora=x.use_rslora,
        lora_dropout=x.lora_dropout,
        dropout_key=x.dropout_key,
        compute_dtype=x.compute_dtype,
    )
    magnitude = _dora_norm(d).astype(x.lora_A.dtype)
    return eqx.tree_at(lambda m: m.lora_magnitude_vector, d, magnitude)


def _dora_dot(w: DoraArray, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    stack, out_l = p.w[: w.stack_ndim], p.w[w.stack_ndim]
    if out_l in p.x:  # W's rows meet x: (diag(m/‖·‖)·V)·x == V·(m/‖·‖ ⊙ x)
        scale = _dora_scale(w)
        x = rescale(x, p.along(scale, (*stack, out_l), p.x))
        return lora_dot(w, x, w_is_lhs, params)
    base = p.arrange(*p.contract(x, p.x, w.weight, p.w))
    update = _dora_update(w, x, w_is_lhs, params, base)
    return update if update is NotImplemented else add_update(base, update)


def _dora_update(
    w: DoraArray, x: Array, w_is_lhs: bool, params: dict[str, Any], base: Array
) -> Any:
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    stack, out_l = p.w[: w.stack_ndim], p.w[w.stack_ndim]
    terms = lora_terms(w, x, w_is_lhs, params, base)
    if out_l in p.x or terms is None:
        return NotImplemented
    _, base_d, delta = terms
    scale = _dora_scale(w).astype(delta.dtype)
    scale = p.along(scale, (*stack, out_l), p.out)
    # PEFT's form: base(x) + (m/‖·‖ - 1)·base(dropout(x)) + m/‖·‖ · s·B·A·dropout(x),
    # the update in the adapter's compute dtype
    return (scale - 1) * base_d.astype(delta.dtype) + scale * delta


weight_dot_handlers(DoraArray, _dora_dot, _dora_update)
