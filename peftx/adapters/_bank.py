"""A bank of LoRA slots on one base weight: every slot's factors stacked along a slot
axis, each row of a batch routed to its own slot by data, so that adapters come and go
without any shape or static value changing."""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._kind import AbstractWeight
from ..implicit import materialize
from ._layout import WeightProduct, weight_dot_handlers
from ._products import LayerKeys, add_update


class LoraBank(AbstractWeight):
    """`W + scaling[s] · B[s] @ A[s]` for the slot `s` each row of the input uses.

    - `weight`: the base weight `(*stack, out, in)` (dense or implicit);
    - `lora_A`: `(*stack, slots, max_rank, in)`, `lora_B`: `(*stack, slots, out, max_rank)`:
      an adapter of rank `r < max_rank` fills the first `r` ranks, the rest stay zero;
    - `scaling`: `(*stack, slots)` float32, each slot's `lora_alpha / r` (or `/ √r`), zero
      for a free slot;
    - `dropout`: `(*stack, slots)` float32, each slot's `lora_dropout`, drawn on its rows'
      input to `A` in training (when `dropout_key` is set, see `with_dropout`);
    - `rows`: the slot of each row of the batch, `(*stack, batch)` int32 (`slots` means the
      base: nothing is added), or one slot for every row, `(*stack,)`; None adds nothing.

    `*stack` are the leading axes of layers stacked for `lax.scan`, which every field
    shares. A product with per-row slots gathers each row's factors and multiplies them
    batched (BGMV), so its cost follows the rows, not the number of slots, and the
    `(out, in)` update of a slot is never formed.
    """

    weight: Any
    lora_A: Array
    lora_B: Array
    scaling: Array
    dropout: Array
    rows: Array | None
    dropout_key: LayerKeys | None = None
    draws_dropout: ClassVar[bool] = True

    # the base is the weight; the slot axis is the bank's own (replicated); A's input
    # axis and B's output axis follow the weight's, as LoRA's factors do
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {
        "weight": (0, 1),
        "lora_A": (None, None, 1),
        "lora_B": (None, 0, None),
        "scaling": (None,),
        "dropout": (None,),
        "rows": (None,),
    }

    @property
    def stack_ndim(self) -> int:
        return len(self.weight.shape) - 2

    @property
    def slots(self) -> int:
        return self.lora_A.shape[self.stack_ndim]

    @property
    def max_rank(self) -> int:
        return self.lora_A.shape[self.stack_ndim + 1]

    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(self.weight.shape, self.weight.dtype)

    def slot_delta(self, slot: int) -> Array:
        """`scaling · B @ A` of one slot, in the weight's shape (for merging one adapter)."""
        index = (slice(None),) * self.stack_ndim + (slot,)
        a, b = self.lora_A[index], self.lora_B[index]
        scale = self.scaling[index][..., None, None]
        return scale * jnp.matmul(b, a)

    def materialize(self) -> Array:
        w = materialize(self.weight)
        if self.rows is None:
            return w
        if self.rows.ndim != self.stack_ndim:
            raise ValueError(
                "a bank routing each row of a batch to its own slot has no single dense "
                "weight; multiply it with the batch instead."
            )
        one = jax.nn.one_hot(self.rows, self.slots, dtype=jnp.float32)  # base row: zeros
        a = jnp.einsum("...s,...sri->...ri", one, self.lora_A)
        b = jnp.einsum("...s,...sor->...or", one, self.lora_B)
        scale = jnp.einsum("...s,...s->...", one, self.scaling)[..., None, None]
        return (w + (scale * jnp.matmul(b, a)).astype(w.dtype)).astype(w.dtype)

    def with_rows(self, rows: Array | None) -> "LoraBank":
        """This bank with `rows` (one slot per row, or one for all) repeated along the
        stack axes, so that each layer's slice holds them whole."""
        if rows is not None:
            stack = tuple(self.weight.shape[: self.stack_ndim])
            rows = jnp.broadcast_to(jnp.asarray(rows, jnp.int32), (*stack, *jnp.shape(rows)))
        return eqx.tree_at(lambda b: b.rows, self, rows, is_leaf=lambda x: x is None)


def _bank_dot(bank: LoraBank, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    if bank.stack_ndim:
        return NotImplemented
    p = WeightProduct.parse(2, x.ndim, w_is_lhs, params)
    out_label, in_label = p.w
    base = p.arrange(*p.contract(x, p.x, bank.weight, p.w))
    if bank.rows is None:
        return base
    if in_label not in p.x or out_label in p.x:
        return NotImplemented  # the weight contracted along its output axis
    slots = bank.slots
    rows = bank.rows
    used = rows < slots
    slot = jnp.minimum(rows, slots - 1)
    scale = jnp.where(used, jnp.take(bank.scaling, slot, axis=0), 0.0)
    rate = jnp.where(used, jnp.take(bank.dropout, slot, axis=0), 0.0)
    a = jnp.take(bank.lora_A, slot, axis=0)
    b = jnp.take(bank.lora_B, slot, axis=0)
    if rows.ndim == 0:
        row_labels: tuple[str, ...] = ()
    else:
        lead = p.x[0]
        if lead not in p.out or x.shape[0] != rows.shape[0]:
            raise ValueError(
                f"a bank routes rows along the leading axis of a product's input; this "
                f"product's input has shape {tuple(x.shape)}, for {rows.shape[0]} rows "
                f"(leading axis {'kept' if lead in p.out else 'contracted'})."
            )
        row_labels = (lead,)
    dtype = bank.lora_A.dtype
    p = dataclasses.replace(p, preferred_element_type=None)  # the branch in the factors' dtype
    x = x.astype(dtype)
    if bank.dropout_key is not None:  # inverted dropout at each row's own slot's rate
        keep = 1.0 - (p.along(rate, row_labels, p.x) if row_labels else rate)
        mask = jax.random.bernoulli(bank.dropout_key, jnp.broadcast_to(keep, x.shape))
        x = jnp.where(mask, x / keep.astype(dtype), jnp.zeros((), dtype))
    t, t_labels = p.contract(x, p.x, a, (*row_labels, "rank", in_label))
    t = t * p.along(scale.astype(dtype), row_labels, t_labels) if row_labels else t * scale
    u, u_labels = p.contract(t.astype(dtype), t_labels, b, (*row_labels, out_label, "rank"))
    return add_update(base, p.arrange(u, u_labels))


weight_dot_handlers(LoraBank, _bank_dot)
