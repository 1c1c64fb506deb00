"""Several named adapters on one base weight, applied one at a time or mixed per example."""

from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._kind import AbstractWeight
from ..implicit import (
    ImplicitArray,
    Slot,
    materialize,
    primitive_handler,
    use_implicit_args,
)
from ._layout import WeightProduct, weight_dot_handlers, weight_product
from ._products import add_update, taken_rows, wider_dtype


def _is_slot(x: Any) -> bool:
    return isinstance(x, Slot)


def detach(adapter: Any) -> Any:
    """`adapter` with its base weight replaced by a `Slot`, ready for an `AdapterSet`."""
    slot = Slot(tuple(adapter.weight.shape), jnp.dtype(adapter.weight.dtype))
    return eqx.tree_at(lambda a: a.weight, adapter, slot)


class AdapterSet(AbstractWeight):
    """A base `weight` with named `adapters`, of which the `active` ones apply.

    Each adapter (a `LoraArray`, `DoraArray`, `IA3Array`, ...) is stored with a `Slot`
    in place of its weight; `adapter(name)` returns it on the shared base. Active adapters
    add their updates to the base product: `W·x + Σ_k g_k · update_k(x)`, where `g_k` is
    1, or, with a `gate`, column `k` of `gate` (one row per example along the leading axis
    of the activations, or a single row inside `jax.vmap`; `peftx.implicit.gate_rows`
    makes it follow rows that a model reorders). A one-hot gate gives each example its own
    adapter (HF PEFT's mixed-adapter batches); a zero row gives the base.
    Names in `active` that this weight does not carry contribute nothing.

    With one active adapter and no gate, every primitive sees that adapter itself, so its
    handlers (and speed) are unchanged.

    Its `weight` has the axes of the weight it stands for; each adapter's arrays follow
    them as the adapter's class declares (`weight_axes`), and the gate follows none.
    """

    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {"weight": (0, 1)}

    weight: Any
    adapters: dict[str, ImplicitArray]
    gate: Array | None
    active: tuple[str, ...] = eqx.field(static=True)

    def __check_init__(self):
        shape, dtype = tuple(self.weight.shape), jnp.dtype(self.weight.dtype)
        for name, adapter in self.adapters.items():
            slot = adapter.weight
            if not isinstance(slot, Slot) or (slot.shape, slot.dtype) != (shape, dtype):
                raise ValueError(
                    f"adapter {name!r} of an AdapterSet must hold a Slot{(shape, dtype)} "
                    "for the shared base weight (see `detach`), got "
                    f"{type(slot).__name__}."
                )
        if self.gate is not None and self.gate.shape[-1:] != (len(self.active),):
            raise ValueError(
                f"gate has shape {tuple(self.gate.shape)}; its last axis must have one entry "
                f"per active adapter {self.active}."
            )

    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(self.weight.shape, self.weight.dtype)

    def adapter(self, name: str) -> Any:
        """The adapter `name` on the shared base weight."""
        return eqx.tree_at(lambda a: a.weight, self.adapters[name], self.weight, is_leaf=_is_slot)

    def used(self) -> list[tuple[int, str]]:
        """`(gate column, name)` of the active adapters this weight carries."""
        return [(k, n) for k, n in enumerate(self.active) if n in self.adapters]

    def single(self) -> Any | None:
        """What this weight is when it reduces to one array: the base weight when no
        adapter applies, the one active adapter when no gate weighs it; else None."""
        used = self.used()
        if not used:
            return self.weight
        if len(used) == 1 and self.gate is None:
            return self.adapter(used[0][1])
        return None

    def materialize(self) -> Array:
        if self.gate is not None and self.gate.ndim > 1:
            raise ValueError(_batch_gate_message(self, "materializing the weight"))
        w = materialize(self.weight)
        out = w
        for k, name in self.used():
            g = 1.0 if self.gate is None else self.gate[k].astype(w.dtype)
            out = out + g * (materialize(self.adapter(name)) - w)
        return out


def _batch_gate_message(s: AdapterSet, what: str) -> str:
    return (
        f"a batch-wide adapter gate (shape {tuple(s.gate.shape)}) routes examples along the "
        f"leading axis of a matrix product's input; {what} has no such axis. Call the model "
        "under your own `jax.vmap` with one adapter id per example (`adapter_ids`), or use "
        "one adapter at a time."
    )


def adapter_set(
    weight: Any, adapters: Mapping[str, Any], active: tuple[str, ...] = ()
) -> AdapterSet:
    """An `AdapterSet` over `weight` from adapters built on it (e.g. by `lora(weight)`)."""
    return AdapterSet(weight, {n: detach(a) for n, a in adapters.items()}, None, active)


@primitive_handler("gate_rows")
def _gate_rows(primitive: Any, s: AdapterSet, rows: Array) -> Any:
    """A per-example gate taken at `rows`: row `i` of the product's input is row
    `rows[i]` of the activations (`peftx.implicit.gate_rows`)."""
    if s.gate is None or s.gate.ndim < 2:
        return s
    # tree_at, not the constructor: inside a scan over stacked layers the slots keep the
    # whole stack's shape
    return eqx.tree_at(lambda t: t.gate, s, jnp.take(s.gate, rows, axis=0))


def _set_dot(s: AdapterSet, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    single = s.single()
    if single is not None:
        return _bind_dot(single, x, w_is_lhs, params)
    p = WeightProduct.parse(len(s.shape), x.ndim, w_is_lhs, params)
    gate = _checked_gate(s, p, x)
    base = p.arrange(*p.contract(x, p.x, s.weight, p.w))
    used = s.used()
    adapters = [s.adapter(name) for _, name in used]
    columns = jnp.take(gate, jnp.asarray([k for k, _ in used]), axis=-1)
    kinds = {type(a) for a in adapters}
    fused = weight_product(kinds.pop()) if len(kinds) == 1 else None
    if fused is not None and fused.mixed is not None:
        mixed = fused.mixed(adapters, columns, x, w_is_lhs, params, base)
        if mixed is not NotImplemented:
            return add_update(base, mixed)
    updates = []
    for (k, _), adapter in zip(used, adapters):
        registered = weight_product(type(adapter))
        update = None if registered is None else registered.update
        if update is None:
            return NotImplemented
        u = update(adapter, x, w_is_lhs, params, base)
        if u is NotImplemented:
            return NotImplemented
        g = gate[k] if gate.ndim == 1 else p.along(gate[..., k], p.x[: gate.ndim - 1], p.out)
        updates.append(g.astype(u.dtype) * u)
    wide = wider_dtype(*(u.dtype for u in updates))
    return add_update(base, sum((u.astype(wide) for u in updates[1:]), updates[0].astype(wide)))


def _checked_gate(s: AdapterSet, p: WeightProduct, x: Array) -> Array:
    """The gate (ones when there is none), checked to route along `x`'s leading axes."""
    if s.gate is None:
        return jnp.ones((len(s.active),), jnp.float32)
    if s.gate.ndim == 1:
        return s.gate
    lead = s.gate.ndim - 1
    kept = all(label in p.out for label in p.x[:lead])
    if not kept or x.shape[:lead] != s.gate.shape[:lead]:
        raise ValueError(
            f"a per-example adapter gate of shape {tuple(s.gate.shape)} routes along the "
            f"leading axis of the activations, but this product's input has shape "
            f"{tuple(x.shape)} (leading axis {'kept' if kept else 'contracted'})."
            " If the model loops over examples itself (e.g. `jax.vmap` inside), call it "
            "under your own `jax.vmap` with one adapter id per example instead."
        )
    return s.gate


def _bind_dot(w: Any, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    registered = weight_product(type(w))
    if registered is not None:
        return registered.product(w, x, w_is_lhs, params)
    operands = (w, x) if w_is_lhs else (x, w)
    return use_implicit_args(lambda a, b: jax.lax.dot_general_p.bind(a, b, **params))(*operands)


weight_dot_handlers(AdapterSet, _set_dot)

# Any other primitive meets the set as the one array it reduces to, when it does.
_REDUCIBLE = (
    "conv_general_dilated",
    "ragged_dot_general",
    "gather",
    "dynamic_slice",
    "transpose",
    "convert_element_type",
    "reshape",
    "squeeze",
    "broadcast_in_dim",
    "slice",
    "mul",
    "add",
    "sub",
    "neg",
)
# Primitives linear in the weight: with one gate row, `f(W + Σ g_k Δ_k)` is
# `f(W) + Σ g_k (f(W + Δ_k) - f(W))`, each term through the adapter's own handlers.
_LINEAR_IN_WEIGHT = frozenset(
    {"conv_general_dilated", "ragged_dot_general", "gather", "dynamic_slice"}
)


def _reduced(primitive: Any, args: tuple[Any, ...], params: dict[str, Any]) -> Any:
    def bind(*a: Any) -> Any:
        return use_implicit_args(lambda *a: primitive.bind(*a, **params))(*a)

    reduced = [a.single() if isinstance(a, AdapterSet) else a for a in args]
    if not any(r is None for r in reduced):
        return bind(*reduced)
    sets = [i for i, a in enumerate(args) if isinstance(a, AdapterSet)]
    if primitive.name not in _LINEAR_IN_WEIGHT or len(sets) != 1:
        return NotImplemented
    (i,) = sets
    s = args[i]
    if s.gate is None:
        return NotImplemented
    if s.gate.ndim != 1:
        return _rows_gated(primitive, bind, args, i, params)

    def with_weight(w: Any) -> list[Any]:
        return [*args[:i], w, *args[i + 1 :]]

    base = bind(*with_weight(s.weight))
    out = base
    for k, name in s.used():
        out = out + s.gate[k].astype(base.dtype) * (bind(*with_weight(s.adapter(name))) - base)
    return out


def _rows_gated(
    primitive: Any, bind: Any, args: tuple[Any, ...], i: int, params: dict[str, Any]
) -> Any:
    """A primitive on a set whose gate routes rows of activations: whole matrices taken
    from a stack (experts, `jnp.take(w, idx, axis=0)`) keep the gate; a grouped product
    adds each row's updates to the base product."""
    s = args[i]
    used = s.used()
    if primitive.name == "gather" and i == 0 and len(s.shape) > 2:
        if not taken_rows(s.shape, args[1], params):
            raise ValueError(_batch_gate_message(s, "this `gather`"))
        weight = bind(s.weight, *args[1:])
        taken = {name: detach(bind(s.adapter(name), *args[1:])) for _, name in used}
        return AdapterSet(weight, taken, s.gate, s.active)
    if primitive.name == "ragged_dot_general" and i == 1:
        x, _, group_sizes = args
        if s.gate.shape[:-1] != x.shape[:1]:
            raise ValueError(_batch_gate_message(s, "this grouped product's input"))
        base = bind(x, s.weight, group_sizes)
        updates = []
        for k, name in used:
            u = s.adapter(name).grouped_update(primitive, x, group_sizes, params)
            if u is NotImplemented:
                return NotImplemented
            updates.append(s.gate[:, k, None].astype(u.dtype) * u)
        if not updates:
            return base
        return add_update(base, sum(updates[1:], updates[0]))
    raise ValueError(_batch_gate_message(s, f"`{primitive.name}`"))


@primitive_handler(list(_REDUCIBLE))
def _reduce_first(primitive: Any, s: AdapterSet, *rest: Any, **params: Any) -> Any:
    return _reduced(primitive, (s, *rest), params)


@primitive_handler(list(_REDUCIBLE))
def _reduce_second(primitive: Any, x: Any, s: AdapterSet, *rest: Any, **params: Any) -> Any:
    return _reduced(primitive, (x, s, *rest), params)
