"""`PeftBankModel`: many LoRA adapters on one base, held in slots of a `LoraBank` per
adapted weight. Which adapter sits in which slot is host-side bookkeeping; a jitted
function of the model sees only arrays, so adapters come and go without a recompile."""

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from ._config import AbstractAdapterConfig
from ._errors import UnknownAdapterError, unknown_adapter
from ._select import Predicate, node_at, select
from ._targets import BASE, layer_paths
from .adapters import (
    AbstractLoraBank,
    AdapterSet,
    ExpertLoraArray,
    ExpertLoraBank,
    LoraArray,
    LoraBank,
    LoraConfig,
)
from .implicit import use_implicit_args


@dataclasses.dataclass(frozen=True, eq=False)
class SlotTable:
    """Which adapter holds which slot, with its config, and which one is active.

    Host-side bookkeeping: two tables of banks of one shape compare equal whatever
    adapters they hold, so a function jitted over the model (whose cache key holds the
    static parts of its arguments) is not compiled again when adapters come and go.
    Nothing traced reads the names: they become slot ids before a call."""

    max_adapters: int
    max_rank: int
    # how a one-adapter PeftModel is made on the base (`get_peft_model`) and read from
    # a directory (`PeftModel.from_pretrained`): the PEFT layer above hands them in
    place: Callable[..., Any]
    load: Callable[..., Any]
    entries: tuple[tuple[str, int, LoraConfig], ...] = ()
    active: str | None = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SlotTable) and self._shape == other._shape

    def __hash__(self) -> int:
        return hash(self._shape)

    @property
    def _shape(self) -> tuple[int, int]:
        return (self.max_adapters, self.max_rank)

    def slot(self, name: str) -> int:
        return next(s for n, s, _ in self.entries if n == name)

    def free_slot(self) -> int | None:
        taken = {s for _, s, _ in self.entries}
        return next((s for s in range(self.max_adapters) if s not in taken), None)


_ATTR = jax.tree_util.GetAttrKey


def _is_bank(x: Any) -> bool:
    return isinstance(x, AbstractLoraBank)


class PeftBankModel(eqx.Module):
    """A model whose targeted weights are `LoraBank`s: up to `max_adapters` LoRA
    adapters, each in a slot, every slot's ranks padded to `max_rank`.

    Made by `get_peft_model(..., max_adapters=N)` or `PeftModel.from_pretrained(...,
    max_adapters=N)`. It has `PeftModel`'s interface for LoRA: `add_adapter`,
    `load_adapter` and `delete_adapter` fill and free slots (returning a new model, the
    old one unchanged), `adapter_names=` routes each row of a batch to its adapter, and
    `save_pretrained` writes each adapter as PEFT does. No array changes shape and
    nothing static changes when adapters come and go, so `eqx.filter_jit` compiles once.

    Inside a jitted function, route rows by the ids `adapter_ids(names)` returns (data),
    not by names: a name is looked up on the host.
    """

    base_model: Any
    active_slot: Int[Array, ""]  # `max_adapters` when no adapter is active
    trained_slots: Bool[Array, " slots"]
    table: SlotTable = eqx.field(static=True)

    # -- names ----------------------------------------------------------------------------

    @property
    def peft_config(self) -> dict[str, LoraConfig]:
        return {name: config for name, _, config in self.table.entries}

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.table.entries)

    @property
    def active_adapter(self) -> str | None:
        return self.table.active

    @property
    def active_adapters(self) -> list[str]:
        return [] if self.table.active is None else [self.table.active]

    @property
    def max_adapters(self) -> int:
        return self.table.max_adapters

    @property
    def max_rank(self) -> int:
        return self.table.max_rank

    @property
    def peft_type(self) -> str:
        return "LORA"

    @property
    def saved_modules(self) -> dict[str, dict[str, Any]]:
        return {}

    def adapter_ids(self, adapter_names: Sequence[str]) -> Int[Array, " batch"]:
        """The slot of each name (`"__base__"` is `max_adapters`), as data for a jitted
        call's `adapter_names`."""
        if isinstance(adapter_names, str):
            raise TypeError(f"adapter_names is one name per row, got the string {adapter_names!r}.")
        slots = {name: slot for name, slot, _ in self.table.entries}
        slots[BASE] = self.table.max_adapters
        for name in adapter_names:
            if name not in slots:
                raise self._unknown(name, BASE)
        return jnp.asarray([slots[name] for name in adapter_names], jnp.int32)

    # -- calls ----------------------------------------------------------------------------

    def __call__(
        self,
        *args: Any,
        adapter_names: Sequence[str] | Array | np.ndarray | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the model: every row with the active adapter, or each row with its own
        (`adapter_names`: names, or ids from `adapter_ids`)."""
        return use_implicit_args(self.prepared(adapter_names))(*args, **kwargs)

    def prepared(self, adapter_names: Sequence[str] | Array | np.ndarray | None = None) -> Any:
        """The wrapped model with each bank routed, for your own `use_implicit_args`."""
        if adapter_names is None:
            rows = self.active_slot  # data: the base's id when no adapter is active
        elif isinstance(adapter_names, jax.Array | np.ndarray):
            rows = jnp.asarray(adapter_names)
            if not jnp.issubdtype(rows.dtype, jnp.integer):
                raise TypeError(
                    "adapter_names must be names or integer ids from `adapter_ids`, got an "
                    f"array of dtype {rows.dtype}."
                )
            if rows.ndim != 1:
                raise ValueError(
                    f"adapter_names ids are one per row, shape (batch,); got {rows.shape}."
                )
            if not isinstance(rows, jax.core.Tracer):
                bad = np.asarray(rows)[
                    (np.asarray(rows) < 0) | (np.asarray(rows) > self.max_adapters)
                ]
                if bad.size:
                    raise ValueError(
                        f"adapter id {int(bad[0])} is out of range: ids are slots 0 to "
                        f"{self.max_adapters - 1}, or {self.max_adapters} for the base."
                    )
        else:
            if isinstance(self.active_slot, jax.core.Tracer):
                raise TypeError(
                    "inside a jitted function, route rows by ids (`model.adapter_ids(names)`, "
                    "passed in as an argument), not by names: names are looked up on the "
                    "host, and the compiled function would keep the slots they had."
                )
            rows = self.adapter_ids(adapter_names)
        return jax.tree.map(
            lambda x: x.with_rows(rows) if _is_bank(x) else x,
            self.base_model,
            is_leaf=_is_bank,
        )

    # -- slots ----------------------------------------------------------------------------

    def add_adapter(
        self, adapter_name: str, config: AbstractAdapterConfig, *, key: PRNGKeyArray
    ) -> "PeftBankModel":
        """A model with `adapter_name` placed by `config` in a free slot (the active
        adapter is unchanged)."""
        self._check_new(adapter_name, config)
        one = self.table.place(self.disable_adapters(), config, key=key, adapter_name=adapter_name)
        return self._filled(one, adapter_name)

    def load_adapter(
        self,
        model_id: str | os.PathLike[str],
        adapter_name: str,
        is_trainable: bool = False,
        *,
        model_type: str | None = None,
    ) -> "PeftBankModel":
        """A model with the PEFT adapter in `model_id` in a free slot, read and checked as
        `PeftModel.from_pretrained` reads it."""
        self._check_new(adapter_name, None)
        one = self.table.load(
            self.disable_adapters(), model_id, adapter_name, is_trainable, model_type=model_type
        )
        self._check_new(adapter_name, one.peft_config[adapter_name])
        return self._filled(one, adapter_name)

    def delete_adapter(self, adapter_name: str) -> "PeftBankModel":
        """A model with `adapter_name`'s slot freed (zeros). If it was active, the first
        remaining adapter becomes active (PEFT's rule), or none."""
        slot = self.table.slot(self._known(adapter_name))
        entries = tuple(e for e in self.table.entries if e[0] != adapter_name)
        active = self.table.active
        if active == adapter_name:
            active = entries[0][0] if entries else None
        model = _map_banks(self, lambda b: _cleared(b, slot))
        return self._with_table(
            model, dataclasses.replace(self.table, entries=entries, active=active)
        )

    def set_adapter(self, adapter_name: str) -> "PeftBankModel":
        """A model whose calls without `adapter_names` use `adapter_name`."""
        self._known(adapter_name)
        return self._with_table(self, dataclasses.replace(self.table, active=adapter_name))

    def disable_adapters(self) -> Any:
        """The base model, without any bank."""
        return jax.tree.map(
            lambda x: x.weight if _is_bank(x) else x, self.base_model, is_leaf=_is_bank
        )

    unload = disable_adapters

    def to_peft_model(self, adapter_names: Sequence[str] | None = None) -> Any:
        """A `PeftModel` holding `adapter_names` (default: all) as plain LoRA adapters,
        each of its own rank: what `save_pretrained` writes and `merge_and_unload` merges."""
        names = [self._known(n) for n in (adapter_names or self.adapter_names)]
        if not names:
            raise ValueError("this bank holds no adapter.")
        base = self.disable_adapters()
        model = None
        for name in names:
            config = dataclasses.replace(self.peft_config[name], init_lora_weights=False)
            key = jax.random.key(0)
            if model is None:
                model = self.table.place(base, config, key=key, adapter_name=name)
            else:
                model = model.add_adapter(name, config, key=key)
            model = _with_slot_factors(model, self, name)
        assert model is not None
        active = self.table.active if self.table.active in names else names[0]
        model = model.set_adapter(active)
        return model.with_config(active, self.peft_config[active])

    def save_pretrained(
        self,
        save_directory: str | os.PathLike[str],
        selected_adapters: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        """Each adapter as PEFT saves it (its own rank's columns only): `"default"` in
        `save_directory`, any other in the subfolder of its name, with the model card at
        the top, replaced as a whole (`kwargs`: `PeftModel.save_pretrained`'s)."""
        model = self.to_peft_model(selected_adapters)
        configs = {n: self.peft_config[n] for n in model.adapter_names}
        for name, config in configs.items():
            model = model.with_config(name, config)
        model.save_pretrained(save_directory, **kwargs)

    def merge_and_unload(self, adapter_names: Sequence[str] | None = None, **kwargs: Any) -> Any:
        """The base model with the active adapter (or `adapter_names`) merged in."""
        names = adapter_names or self.active_adapters
        return self.to_peft_model(names).merge_and_unload(names, **kwargs)

    # -- training -------------------------------------------------------------------------

    def trainable_spec(self, adapters: Sequence[str] | None = None) -> Any:
        """`True` on the banks' factors (every slot: the step keeps the slots that do not
        train as they were, see `peftx.train.keep_untrained_slots`)."""
        del adapters
        spec = jax.tree.map(lambda _: False, self)

        def bank_spec(b: Any) -> Any:
            return eqx.tree_at(lambda x: (x.lora_A, x.lora_B), b, (True, True))

        return eqx.tree_at(
            lambda m: m.base_model,
            spec,
            jax.tree.map(
                lambda x: bank_spec(x) if _is_bank(x) else x,
                spec.base_model,
                is_leaf=_is_bank,
            ),
        )

    def with_trained(self, adapters: Sequence[str] | None = None) -> "PeftBankModel":
        """This model with `adapters` (default: the active one) marked as the ones that
        train (`trained_slots`)."""
        names = self.active_adapters if adapters is None else list(adapters)
        mask = np.zeros(self.max_adapters, bool)
        for name in names:
            config = self.peft_config[self._known(name)]
            if config.inference_mode:
                raise ValueError(
                    f"adapter {name!r} was loaded for inference (is_trainable=False, PEFT's "
                    "inference_mode); load it with is_trainable=True to train it."
                )
            mask[self.table.slot(name)] = True
        return eqx.tree_at(lambda m: m.trained_slots, self, jnp.asarray(mask))

    def print_trainable_parameters(self) -> None:
        """PEFT's line, for the active adapter as PEFT counts it (its own rank)."""
        self.to_peft_model(self.active_adapters).print_trainable_parameters()

    def bank_bytes(self) -> int:
        """The bytes the banks' factors and scalings take."""
        banks = [x for x in jax.tree.leaves(self.base_model, is_leaf=_is_bank) if _is_bank(x)]
        return sum(a.nbytes for b in banks for a in (b.lora_A, b.lora_B, b.scaling))

    # -- internals ------------------------------------------------------------------------

    def _with_table(self, model: "PeftBankModel", table: SlotTable) -> "PeftBankModel":
        active = table.max_adapters if table.active is None else table.slot(table.active)
        model = dataclasses.replace(model, table=table)
        return eqx.tree_at(lambda m: m.active_slot, model, jnp.asarray(active, jnp.int32))

    def _known(self, name: str) -> str:
        if name not in self.adapter_names:
            raise self._unknown(name)
        return name

    def _unknown(self, name: Any, *extra: str) -> UnknownAdapterError:
        return unknown_adapter(name, (*self.adapter_names, *extra), "bank")

    def _check_new(self, name: str, config: AbstractAdapterConfig | None) -> None:
        if name == BASE or not name:
            raise ValueError(f"{name!r} cannot name an adapter; {BASE!r} means the base model.")
        if name in self.adapter_names:
            raise ValueError(
                f"an adapter named {name!r} is in the bank already; `delete_adapter` it first "
                "or choose another name."
            )
        if self.table.free_slot() is None:
            raise ValueError(
                f"the bank is full: max_adapters={self.max_adapters} slots hold "
                f"{', '.join(self.adapter_names)}. Delete one, or make the bank with a "
                "larger max_adapters."
            )
        if config is not None:
            check_bank_config(config, self.max_rank)

    def _filled(self, one: Any, name: str) -> "PeftBankModel":
        """This model with `name`'s factors from `one` (a PeftModel with that adapter on
        this model's base) in a free slot."""
        config = one.peft_config[name]
        check_bank_config(config, self.max_rank)
        return self._holding(name, config, _layer_factors(one, name))

    def _holding(self, name: str, config: LoraConfig, factors: dict[str, Any]) -> "PeftBankModel":
        """This model with adapter `name`'s per-layer `factors` in a free slot."""
        slot = self.table.free_slot()
        assert slot is not None
        banks = _banks(self)
        missing = sorted(set(factors) - {p for _, paths, _ in banks for p in paths})
        if missing:
            raise ValueError(
                f"adapter {name!r} adapts {missing[0].removesuffix('.weight')}"
                + (f" and {len(missing) - 1} more layers" if len(missing) > 1 else "")
                + ", which the bank does not hold: a bank holds the layers its first "
                "adapter targets. Make the bank from a config that targets them all."
            )
        model = self
        for keypath, paths, bank in banks:
            filled = _with_slot(bank, slot, [factors.get(p) for p in paths])
            model = eqx.tree_at(lambda m, kp=keypath: node_at(m, kp), model, filled)
        table = dataclasses.replace(
            self.table,
            entries=(*self.table.entries, (name, slot, config)),
            active=self.table.active or name,
        )
        return self._with_table(model, table)


def check_bank_config(config: Any, max_rank: int) -> None:
    """Refuse, in one line, a config a bank cannot hold."""
    if not isinstance(config, LoraConfig):
        raise TypeError(
            "a bank holds LoRA adapters (LoraConfig, rsLoRA or not), on Linear weights and on "
            f"experts; got a {type(config).__name__}."
        )
    unheld = [
        what
        for what, present in (
            ("use_dora=True", config.use_dora),
            (f"bias={config.bias!r}", config.bias != "none"),
            ("modules_to_save", config.modules_to_save),
            (
                f"init_lora_weights={config.init_lora_weights!r}",
                config.changes_base,
            ),
        )
        if present
    ]
    if unheld:
        raise ValueError(
            "a bank holds plain LoRA and rsLoRA, on Linear weights and on experts; this config "
            f"has {', '.join(unheld)}."
        )
    ranks = [config.r, *config.rank_pattern.values()]
    if max(ranks) > max_rank:
        raise ValueError(
            f"adapter rank {max(ranks)} exceeds the bank's max_rank={max_rank}; make the bank "
            "with a larger max_rank."
        )


def _map_banks(tree: Any, fn: Any) -> Any:
    return jax.tree.map(lambda x: fn(x) if _is_bank(x) else x, tree, is_leaf=_is_bank)


def _banks(model: PeftBankModel) -> list[tuple[tuple, list[str], Any]]:
    """`(key path, the per-layer paths along its stack, bank)` of each bank of `model`;
    a bank's path is where it sits (`...q_proj.weight`, `...experts.gate_up_proj`)."""
    found = select(model.base_model).at(Predicate(lambda p, n: _is_bank(n), "banks"))
    return [
        ((_ATTR("base_model"), *keypath), layer_paths(path), bank)
        for path, keypath, bank in found.matches
    ]


Factors = tuple[np.ndarray, np.ndarray, float, float]


def _carrying(model: Any, name: str) -> Any:
    """The `AdapterSet`s of a `PeftModel` that carry adapter `name`."""
    return select(model.base_model).at(
        Predicate(lambda p, n: isinstance(n, AdapterSet) and name in n.adapters, f"{name!r}")
    )


def _layer_factors(one: Any, name: str) -> dict[str, Factors]:
    """`{per-layer path: (A, B, scaling, dropout)}` of adapter `name` of the PeftModel
    `one`, on the host: a linear layer's `A (r, in)` and `B (out, r)`, an expert stack's
    `A (experts, r, in)` and `B (experts, out, r)`."""
    out = {}
    for path, s in zip(*(lambda f: (f.paths(), f.get()))(_carrying(one, name))):
        adapter = s.adapters[name]
        if type(adapter) is LoraArray and not adapter.kernel_ndim:
            a, b, rate = adapter.lora_A, adapter.lora_B, adapter.lora_dropout
        elif type(adapter) is ExpertLoraArray:
            (a, b), rate = adapter.factors(), 0.0
        else:
            raise ValueError(
                f"{path} holds a {type(adapter).__name__}; a bank holds LoRA on Linear "
                "weights and on experts."
            )
        for i, p in enumerate(layer_paths(path)):
            index = (i,) if adapter.stack_ndim else ()
            out[p] = (np.asarray(a[index]), np.asarray(b[index]), adapter.scaling, rate)
    return out


def _with_slot(bank: Any, slot: int, factors: list[Factors | None]) -> Any:
    """`bank` with `slot` holding `(A, B, scaling, dropout)` for each layer of its stack
    (None: zeros, a layer the adapter leaves alone), each padded to the bank's rank."""
    stack = bank.stack_ndim
    a_shape = bank.lora_A.shape[stack + 1 :]
    b_shape = bank.lora_B.shape[stack + 1 :]
    a_rows, b_rows, scales, rates = [], [], [], []
    for f in factors:
        a = np.zeros(a_shape, bank.lora_A.dtype)
        b = np.zeros(b_shape, bank.lora_B.dtype)
        scale = rate = 0.0
        if f is not None:
            fa, fb, scale, rate = f
            r = fa.shape[-2]
            a[..., :r, :] = np.asarray(fa, a.dtype)
            if isinstance(bank, LoraBank):  # B rank-major, (rank, out)
                b[:r] = np.asarray(fb, b.dtype).T
            else:
                b[..., :r] = np.asarray(fb, b.dtype)
        a_rows.append(a)
        b_rows.append(b)
        scales.append(scale)
        rates.append(rate)
    pick = (lambda xs: np.stack(xs)) if stack else (lambda xs: xs[0])
    values = (
        pick(a_rows),
        pick(b_rows),
        np.asarray(scales if stack else scales[0], np.float32),
        np.asarray(rates if stack else rates[0], np.float32),
    )
    return _set_slot(bank, slot, values)


def _cleared(bank: Any, slot: int) -> Any:
    stack = tuple(bank.weight.shape[: bank.stack_ndim])
    a = np.zeros((*stack, *bank.lora_A.shape[bank.stack_ndim + 1 :]), bank.lora_A.dtype)
    b = np.zeros((*stack, *bank.lora_B.shape[bank.stack_ndim + 1 :]), bank.lora_B.dtype)
    zeros = np.zeros(stack, np.float32)
    return _set_slot(bank, slot, (a, b, zeros, zeros))


def _set_slot(bank: Any, slot: int, values: tuple[Any, ...]) -> Any:
    fields = ("lora_A", "lora_B", "scaling", "dropout")
    fields = tuple(f for f in fields if hasattr(bank, f))  # an expert bank has no dropout
    arrays = tuple(getattr(bank, f) for f in fields)
    new = _put_slot(arrays, jnp.int32(slot), values[: len(fields)], bank.stack_ndim)
    return eqx.tree_at(lambda x: tuple(getattr(x, f) for f in fields), bank, new)


@functools.partial(jax.jit, static_argnums=3)
def _put_slot(arrays: tuple[Array, ...], slot: Array, values: tuple[Any, ...], stack: int) -> tuple:
    """Each array with `slot` (the axis after the `stack` axes) set to its value: one
    compiled update per bank shape, whatever the slot."""

    def put(x: Array, value: Array) -> Array:
        moved = jnp.moveaxis(x, stack, 0)
        return jnp.moveaxis(moved.at[slot].set(value.astype(x.dtype)), 0, stack)

    return tuple(put(x, v) for x, v in zip(arrays, values))


def _with_slot_factors(model: Any, bank_model: PeftBankModel, name: str) -> Any:
    """`model` (a PeftModel holding adapter `name` as plain LoRA) with `name`'s factors
    read from its slot of `bank_model`, each layer trimmed to its own rank."""
    slot = bank_model.table.slot(name)
    values = {}
    for _, paths, bank in _banks(bank_model):
        for i, p in enumerate(paths):
            index = (i, slot) if bank.stack_ndim else (slot,)
            values[p] = (bank.lora_A[index], bank.lora_B[index])
    found = _carrying(model, name)
    new = []
    for path, s in zip(found.paths(), found.get()):
        adapter = s.adapters[name]
        expert = type(adapter) is ExpertLoraArray
        r = adapter.r
        a = jnp.stack([values[p][0][..., :r, :] for p in layer_paths(path)])
        if expert:  # PEFT's layouts: A (r·experts, in) expert-major, B (out, r·experts)
            b = jnp.stack([values[p][1][..., :r] for p in layer_paths(path)])
            a = a.reshape(a.shape[0], -1, a.shape[-1])
            b = jnp.moveaxis(b, 1, -1).reshape(b.shape[0], b.shape[2], -1)
        else:  # the bank's B is rank-major, PEFT's (out, rank)
            b = jnp.stack([values[p][1][:r].T for p in layer_paths(path)])
        if not adapter.stack_ndim:
            a, b = a[0], b[0]
        adapter = eqx.tree_at(
            lambda x: (x.lora_A, x.lora_B),
            adapter,
            (a.astype(adapter.lora_A.dtype), b.astype(adapter.lora_B.dtype)),
        )
        new.append(AdapterSet(s.weight, {**s.adapters, name: adapter}, s.gate, s.active))
    return eqx.tree_at(lambda m: found.where_fn()(m.base_model), model, new)


def bank_from(
    model: Any,
    max_adapters: int,
    max_rank: int | None,
    place: Callable[..., Any],
    load: Callable[..., Any],
) -> PeftBankModel:
    """A bank of `max_adapters` slots made from `model`'s one adapter (a `PeftModel`),
    in slot 0; `place` and `load` are `get_peft_model` and `PeftModel.from_pretrained`."""
    if isinstance(max_adapters, bool) or not isinstance(max_adapters, int) or max_adapters < 1:
        raise ValueError(f"max_adapters must be a positive integer, got {max_adapters!r}.")
    (name,) = model.adapter_names
    config = model.peft_config[name]
    ranks = [config.r, *config.rank_pattern.values()]
    if max_rank is None:
        max_rank = max(ranks)
    if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1:
        raise ValueError(f"max_rank must be a positive integer, got {max_rank!r}.")
    check_bank_config(config, max_rank)
    factors = _layer_factors(model, name)

    def banked(s: AdapterSet) -> Any:
        adapter = s.adapters[name]
        *stack, d_out, d_in = s.weight.shape
        a_dtype, b_dtype = adapter.lora_A.dtype, adapter.lora_B.dtype
        if type(adapter) is ExpertLoraArray:
            *stack, experts = stack
            return ExpertLoraBank(
                s.weight,
                jnp.zeros((*stack, max_adapters, experts, max_rank, d_in), a_dtype),
                jnp.zeros((*stack, max_adapters, experts, d_out, max_rank), b_dtype),
                jnp.zeros((*stack, max_adapters), jnp.float32),
                None,
            )
        return LoraBank(
            s.weight,
            jnp.zeros((*stack, max_adapters, max_rank, d_in), a_dtype),
            jnp.zeros((*stack, max_adapters, max_rank, d_out), b_dtype),
            jnp.zeros((*stack, max_adapters), jnp.float32),
            jnp.zeros((*stack, max_adapters), jnp.float32),
            None,
        )

    base = jax.tree.map(
        lambda x: banked(x) if isinstance(x, AdapterSet) else x,
        model.base_model,
        is_leaf=lambda x: isinstance(x, AdapterSet),
    )
    empty = PeftBankModel(
        base,
        jnp.zeros((), jnp.int32),
        jnp.zeros((max_adapters,), bool),
        SlotTable(max_adapters, max_rank, place, load),
    )
    return empty._holding(name, config, factors)
