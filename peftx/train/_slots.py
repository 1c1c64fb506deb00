"""Training the slots of an adapter bank together: each adapter's gradient is the mean
over its own rows, and a slot whose rows are absent from a batch is left exactly as it
was, factors and optimizer state alike."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ..adapters import AbstractLoraBank
from ._data import scored_labels


def _is_bank(x: Any) -> bool:
    return isinstance(x, AbstractLoraBank)


def _factors(bank: Any, a: Any, b: Any) -> Any:
    """`bank` with factors `a` and `b` (a pytree node of gradients or optimizer state
    may hold None where the model holds its other fields)."""
    return eqx.tree_at(lambda x: (x.lora_A, x.lora_B), bank, (a, b), is_leaf=lambda x: x is None)


def _along_slots(per_slot: Array, factor: Array, bank: Any) -> Array:
    """`per_slot` `(slots,)` shaped to broadcast along a bank factor's slot axis."""
    after = -bank.slot_axes["lora_A"] - 1
    return per_slot.reshape((1,) * (factor.ndim - after - 1) + (-1,) + (1,) * after)


def _slot_fields(bank: Any) -> list[tuple[str, int]]:
    """The per-slot fields a bank node holds (a node of gradients or optimizer state holds
    None where the model holds its frozen fields), with their slot axes."""
    return [(f, axis) for f, axis in bank.slot_axes.items() if getattr(bank, f) is not None]


def take_slots(tree: Any, groups: Int[Array, " groups"], slots: int) -> Any:
    """`tree` (a bank model, its gradients or optimizer state) with every bank cut down to
    the slots `groups` lists, in order; an entry `slots` or above stands for no adapter
    and gets zeros. A step over a batch then touches at most one slot per row, whatever
    the bank's size."""
    valid = groups < slots
    index = jnp.minimum(groups, slots - 1)

    def take(bank: Any) -> Any:
        if not _is_bank(bank):
            return bank
        fields = _slot_fields(bank)
        taken = []
        for f, axis in fields:
            x = getattr(bank, f)
            y = jnp.take(x, index, axis=axis)
            keep = valid.reshape((-1,) + (1,) * (-axis - 1))
            taken.append(jnp.where(keep, y, jnp.zeros((), y.dtype)))
        return eqx.tree_at(lambda b: [getattr(b, f) for f, _ in fields], bank, taken)

    return jax.tree.map(take, tree, is_leaf=_is_bank)


def put_slots(
    tree: Any, groups: Int[Array, " groups"], taken: Any, write: Bool[Array, " groups"]
) -> Any:
    """`tree` with the slots `groups` lists set from `taken` (what `take_slots` cut out,
    updated) where `write` holds; every other slot is left exactly as it was."""

    def put(full: Any, part: Any) -> Any:
        if not _is_bank(full):
            return part
        fields = _slot_fields(full)
        new = []
        for f, axis in fields:
            x, y = getattr(full, f), getattr(part, f)
            slots = x.shape[axis]
            index = jnp.where(write, groups, slots)  # past the end: dropped
            moved = jnp.moveaxis(x, axis, 0)
            moved = moved.at[index].set(jnp.moveaxis(y, axis, 0), mode="drop")
            new.append(jnp.moveaxis(moved, 0, axis))
        return eqx.tree_at(lambda b: [getattr(b, f) for f, _ in fields], full, new)

    return jax.tree.map(put, tree, taken, is_leaf=_is_bank)


def row_counts(batch: dict[str, Array]) -> Float[Array, " batch"]:
    """The supervised targets of each row, as `causal_lm_loss` (labels `(batch, seq)`,
    shifted by one), `classification_loss` (labels `(batch,)`) and the preference losses
    (labels `(batch, 2, seq)`: one per pair with a labelled chosen token) count them."""
    labels = batch["labels"]
    if labels.ndim == 3:
        return jnp.any(scored_labels(batch)[:, 0], axis=-1).astype(jnp.float32)
    valid = labels[:, 1:] >= 0 if labels.ndim == 2 else labels >= 0
    return valid.reshape(valid.shape[0], -1).sum(axis=1).astype(jnp.float32)


def slot_counts(
    adapter_ids: Int[Array, " batch"] | Int[Array, ""], counts: Float[Array, " batch"], slots: int
) -> Float[Array, " slots"]:
    """The supervised targets each slot's rows hold (`adapter_ids`: one slot per row, or
    one for all; `slots` and above are the base, counted nowhere)."""
    ids = jnp.broadcast_to(adapter_ids, counts.shape)
    return jax.ops.segment_sum(counts, ids, num_segments=slots)


def per_slot_mean(grads: Any, counts: Float[Array, " slots"]) -> Any:
    """`grads` with each bank's factor gradients divided, slot by slot, by that slot's
    count (at least 1): each adapter's gradient of the mean loss over its own rows."""

    def scale(g: Any) -> Any:
        if not _is_bank(g):
            return g
        div = jnp.maximum(counts, 1.0)
        return _factors(
            g,
            (g.lora_A / _along_slots(div, g.lora_A, g)).astype(g.lora_A.dtype),
            (g.lora_B / _along_slots(div, g.lora_B, g)).astype(g.lora_B.dtype),
        )

    return jax.tree.map(scale, grads, is_leaf=_is_bank)


def keep_untrained_slots(new: Any, old: Any, trained: Bool[Array, " slots"]) -> Any:
    """`new` (parameters after an optimizer update, or the optimizer's new state), with
    every bank slot not in `trained` taken from `old`: bit for bit as before the step,
    AdamW's moment decay and weight decay included.

    In your own optax loop:

    ```python
    trained = frozen.trained_slots & (peftx.train.slot_counts(ids, counts, n) > 0)
    params = peftx.train.keep_untrained_slots(new_params, params, trained)
    opt_state = peftx.train.keep_untrained_slots(new_opt_state, opt_state, trained)
    ```
    """

    def keep(n: Any, o: Any) -> Any:
        if not _is_bank(n):
            return n
        a = (
            n.lora_A
            if n.lora_A is None
            else jnp.where(_along_slots(trained, n.lora_A, n), n.lora_A, o.lora_A)
        )
        b = (
            n.lora_B
            if n.lora_B is None
            else jnp.where(_along_slots(trained, n.lora_B, n), n.lora_B, o.lora_B)
        )
        return _factors(n, a, b)

    return jax.tree.map(keep, new, old, is_leaf=_is_bank)
