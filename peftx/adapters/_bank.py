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
from ..implicit import materialize, primitive_handler
from ._layout import WeightProduct, weight_dot_handlers
from ._lora._experts import GROUPED as _GROUPED
from ._products import LayerKeys, add_update, cast_base_on_astype, take_rows, taken_rows


class AbstractLoraBank(AbstractWeight):
    """LoRA slots stacked on one base weight (`weight_ndim` axes, after any stack axes),
    each row of a batch routed to a slot by `rows`: what `LoraBank` and `ExpertLoraBank`
    share, and what training reads (`slot_axes`: each per-slot field's slot axis, counted
    from its last axis)."""

    weight: eqx.AbstractVar[Any]
    lora_A: eqx.AbstractVar[Array]
    rows: eqx.AbstractVar[Array | None]
    weight_ndim: eqx.AbstractClassVar[int]
    slot_axes: eqx.AbstractClassVar[Mapping[str, int]]

    @property
    def stack_ndim(self) -> int:
        return len(self.weight.shape) - self.weight_ndim

    @property
    def slots(self) -> int:
        return self.lora_A.shape[self.stack_ndim]

    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(self.weight.shape, self.weight.dtype)

    def with_rows(self, rows: Array | None) -> "AbstractLoraBank":
        """This bank with `rows` (one slot per row, or one for all) repeated along the
        stack axes, so that each layer's slice holds them whole."""
        if rows is not None:
            stack = tuple(self.weight.shape[: self.stack_ndim])
            rows = jnp.broadcast_to(jnp.asarray(rows, jnp.int32), (*stack, *jnp.shape(rows)))
        return eqx.tree_at(lambda b: b.rows, self, rows, is_leaf=lambda x: x is None)


class LoraBank(AbstractLoraBank):
    """`W + scaling[s] · B[s] @ A[s]` for the slot `s` each row of the input uses.

    - `weight`: the base weight `(*stack, out, in)` (dense or implicit);
    - `lora_A`: `(*stack, slots, max_rank, in)`, `lora_B`: `(*stack, slots, max_rank, out)`
      (rank-major, PEFT's `lora_B` transposed: the per-row products over `out` then run
      on contiguous rows): an adapter of rank `r < max_rank` fills the first `r` ranks,
      the rest stay zero;
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
    weight_ndim: ClassVar[int] = 2
    slot_axes: ClassVar[Mapping[str, int]] = {
        "lora_A": -3,
        "lora_B": -3,
        "scaling": -1,
        "dropout": -1,
    }

    # the base is the weight; the slot axis is the bank's own (replicated); A's input
    # axis and B's output axis follow the weight's, as LoRA's factors do
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {
        "weight": (0, 1),
        "lora_A": (None, None, 1),
        "lora_B": (None, None, 0),
        "scaling": (None,),
        "dropout": (None,),
        "rows": (None,),
    }

    @property
    def max_rank(self) -> int:
        return self.lora_A.shape[self.stack_ndim + 1]

    def slot_delta(self, slot: int) -> Array:
        """`scaling · B @ A` of one slot, in the weight's shape (for merging one adapter)."""
        index = (slice(None),) * self.stack_ndim + (slot,)
        a, b = self.lora_A[index], self.lora_B[index]
        scale = self.scaling[index][..., None, None]
        return scale * jnp.matmul(jnp.swapaxes(b, -1, -2), a)

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
        b = jnp.einsum("...s,...sro->...or", one, self.lora_B)
        scale = jnp.einsum("...s,...s->...", one, self.scaling)[..., None, None]
        return (w + (scale * jnp.matmul(b, a)).astype(w.dtype)).astype(w.dtype)


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
        key = bank.dropout_key

        def drop(x: Array) -> Array:
            mask = jax.random.bernoulli(key, jnp.broadcast_to(keep, x.shape))
            return jnp.where(mask, x / keep.astype(dtype), jnp.zeros((), dtype))

        # rates are data, so a batch whose slots all have none skips the random bits
        x = jax.lax.cond(jnp.any(rate > 0), drop, lambda x: x, x)
    if row_labels and _grouped(x, p.x.index(in_label)):
        return add_update(base, _grouped_update(bank, x, p, scale))
    t, t_labels = p.contract(x, p.x, a, (*row_labels, "rank", in_label))
    t = t * p.along(scale.astype(dtype), row_labels, t_labels) if row_labels else t * scale
    u, u_labels = p.contract(t.astype(dtype), t_labels, b, (*row_labels, "rank", out_label))
    return add_update(base, p.arrange(u, u_labels))


# The tokens per row from which a mixed batch's products are grouped by slot (sorted rows,
# two `ragged_dot`s: SGMV) rather than gathered per row (BGMV), by backend; None: never.
# Measured (benchmarks/bank.py): XLA:CPU has no grouped GEMM (its `ragged_dot` multiplies
# every row by every group), and on an H200 with jax 0.11.2 a train step grouping 8192
# tokens into 64 groups asked for 87 GiB, while gathering costs about one adapter's
# forward; so gathering, for every shape, until a grouped GEMM is measured faster.
GROUPED_FROM_TOKENS: dict[str, int | None] = {"cpu": None, "gpu": None, "tpu": None}


def _grouped(x: Array, in_axis: int) -> bool:
    threshold = GROUPED_FROM_TOKENS.get(jax.default_backend())
    tokens_per_row = x.size // (x.shape[0] * x.shape[in_axis])
    return threshold is not None and tokens_per_row >= threshold


def _grouped_update(bank: LoraBank, x: Array, p: WeightProduct, scale: Array) -> Array:
    """The update of a mixed batch, rows sorted by slot: each distinct slot of the batch
    (at most one per row, so the shapes never depend on the slots present) is a group of
    one `ragged_dot` through `A`, then one through `B`; a base row is in no group."""
    out_label, in_label = p.w
    lead = p.x[0]
    rest = [lab for lab in p.x[1:] if lab != in_label]
    xt = jnp.transpose(x, [p.x.index(lab) for lab in (lead, *rest, in_label)])
    n_rows, d_in = xt.shape[0], xt.shape[-1]
    flat = xt.reshape(n_rows, -1, d_in)
    per_row = flat.shape[1]
    slots = bank.slots
    order = jnp.argsort(bank.rows, stable=True)
    sorted_rows = bank.rows[order]
    groups = jnp.unique(bank.rows, size=n_rows, fill_value=slots)  # sorted, base ids last
    sizes = jnp.sum(sorted_rows[None, :] == groups[:, None], axis=1) * per_row
    sizes = jnp.where(groups < slots, sizes, 0).astype(jnp.int32)
    chosen = jnp.minimum(groups, slots - 1)
    a = jnp.take(bank.lora_A, chosen, axis=0)  # (groups, rank, in)
    b = jnp.swapaxes(jnp.take(bank.lora_B, chosen, axis=0), -1, -2)  # (groups, out, rank)
    xs = flat[order].reshape(n_rows * per_row, d_in)
    t = jax.lax.ragged_dot_general(xs, a, sizes, _GROUPED)
    t = t * jnp.repeat(scale[order], per_row)[:, None].astype(t.dtype)
    u = jax.lax.ragged_dot_general(t, b, sizes, _GROUPED).reshape(n_rows, per_row, -1)
    u = u[jnp.argsort(order)].reshape(*xt.shape[:-1], -1)
    return p.arrange(u, (lead, *rest, out_label))


weight_dot_handlers(LoraBank, _bank_dot)


cast_base_on_astype(LoraBank)


class ExpertLoraBank(AbstractLoraBank):
    """A bank of LoRA slots on a stack of experts `W (*stack, experts, out, in)` (PEFT's
    `target_parameters`): `W[e] + scaling[s] · B[s, e] @ A[s, e]` for a row of expert `e`
    routed to slot `s`.

    - `lora_A`: `(*stack, slots, experts, max_rank, in)`, `lora_B`: `(*stack, slots,
      experts, out, max_rank)`;
    - `scaling`, `rows`: as `LoraBank`'s (no dropout: PEFT's `ParamWrapper` draws none).

    A mixture of experts reorders its rows (`peftx.implicit.gate_rows`), takes whole
    experts (`jnp.take`) and multiplies them grouped (`ragged_dot_general`) or batched;
    each row gathers its own slot's factors for its own expert.
    """

    weight: Any
    lora_A: Array
    lora_B: Array
    scaling: Array
    rows: Array | None

    weight_ndim: ClassVar[int] = 3
    slot_axes: ClassVar[Mapping[str, int]] = {"lora_A": -4, "lora_B": -4, "scaling": -1}
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {
        "weight": (0, 1, 2),
        "lora_A": (None, 0, None, 2),
        "lora_B": (None, 0, 1, None),
        "scaling": (None,),
        "rows": (None,),
    }

    def materialize(self) -> Array:
        w = materialize(self.weight)
        if self.rows is None:
            return w
        raise ValueError(
            "an expert bank routing rows to slots has no single dense weight; multiply it "
            "with its rows instead."
        )

    def row_factors(self, experts: Array) -> tuple[Array, Array, Array]:
        """Each row's `(A (…, rank, in), B (…, out, rank), scale (…))` for its slot and
        `experts` (the expert of each row, `rows`' shape); a base row's scale is 0."""
        slots = self.slots
        used = self.rows < slots
        slot = jnp.minimum(self.rows, slots - 1)
        a = self.lora_A[slot, experts]
        b = self.lora_B[slot, experts]
        scale = jnp.where(used, jnp.take(self.scaling, slot, axis=0), 0.0)
        return a, b, scale


@primitive_handler("gate_rows")
def _bank_rows(primitive: Any, bank: AbstractLoraBank, rows: Array) -> Any:
    """Rows reordered before a product: each new row takes the slot of the row it was."""
    if bank.rows is None or bank.stack_ndim:
        return bank
    taken = bank.rows if bank.rows.ndim == 0 else jnp.take(bank.rows, rows, axis=0)
    return eqx.tree_at(lambda b: b.rows, bank, jnp.broadcast_to(taken, rows.shape))


@primitive_handler("gather")
def _bank_take_experts(primitive: Any, bank: ExpertLoraBank, indices: Array, **params: Any) -> Any:
    """Whole experts taken along axis 0: the bank over the taken experts."""
    if bank.stack_ndim or not taken_rows(bank.shape, indices, params):
        return NotImplemented

    def take_experts(factor: Array) -> Array:  # the experts axis is the second
        moved = jnp.moveaxis(factor, 1, 0)
        return jnp.moveaxis(take_rows(primitive, moved, indices, params), 0, 1)

    return eqx.tree_at(
        lambda b: (b.weight, b.lora_A, b.lora_B),
        bank,
        (
            take_rows(primitive, bank.weight, indices, params),
            take_experts(bank.lora_A),
            take_experts(bank.lora_B),
        ),
    )


@primitive_handler("ragged_dot_general")
def _bank_grouped(
    primitive: Any,
    x: Array,
    bank: ExpertLoraBank,
    group_sizes: Array,
    *,
    ragged_dot_dimension_numbers: Any,
    **params: Any,
) -> Any:
    """The grouped product (rows of `x` sorted by expert): the base grouped product, and
    each row's own slot's update for its expert, from gathered factors."""
    dims = ragged_dot_dimension_numbers
    if bank.stack_ndim or dims != _GROUPED:
        return NotImplemented
    base = primitive.bind(x, bank.weight, group_sizes, ragged_dot_dimension_numbers=dims, **params)
    if bank.rows is None:
        return base
    m = x.shape[0]
    ends = jnp.cumsum(group_sizes)
    index = jnp.arange(m, dtype=ends.dtype)
    experts = jnp.minimum(jnp.searchsorted(ends, index, side="right"), bank.weight.shape[0] - 1)
    a, b, scale = dataclasses.replace(bank, rows=jnp.broadcast_to(bank.rows, (m,))).row_factors(
        experts
    )
    scale = jnp.where(index < ends[-1], scale, 0.0)  # rows past the groups get nothing
    dtype = bank.lora_A.dtype
    t = jnp.einsum("mi,mri->mr", x.astype(dtype), a)
    u = jnp.einsum("mr,mor->mo", t * scale[:, None].astype(dtype), b)
    return add_update(base, u)


def _expert_bank_dot(bank: ExpertLoraBank, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    """Experts multiplied batched over blocks of rows (`x (blocks, rows, in)` against the
    taken experts `(blocks, out, in)`): each row's own slot's update for its block's expert."""
    if bank.stack_ndim:
        return NotImplemented
    p = WeightProduct.parse(3, x.ndim, w_is_lhs, params)
    expert_l, out_l, in_l = p.w
    base = p.arrange(*p.contract(x, p.x, bank.weight, p.w))
    if bank.rows is None:
        return base
    if x.ndim != 3 or p.x[0] != expert_l or p.x[2] != in_l or expert_l not in p.out:
        return NotImplemented
    blocks, per_block = x.shape[:2]
    rows = jnp.broadcast_to(bank.rows, (blocks, per_block))
    experts = jnp.broadcast_to(jnp.arange(blocks)[:, None], (blocks, per_block))
    a, b, scale = dataclasses.replace(bank, rows=rows).row_factors(experts)
    dtype = bank.lora_A.dtype
    t = jnp.einsum("bni,bnri->bnr", x.astype(dtype), a)
    u = jnp.einsum("bnr,bnor->bno", t * scale[..., None].astype(dtype), b)
    labels = (expert_l, p.x[1], out_l)
    return add_update(base, p.arrange(u, labels))


weight_dot_handlers(ExpertLoraBank, _expert_bank_dot)
cast_base_on_astype(ExpertLoraBank)
