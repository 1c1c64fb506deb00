"""Placing a model on a mesh: a `PartitionSpec` for every array, base weights by the
rules, adapters and quantized weights by what their classes declare (`weight_axes`)."""

import dataclasses
import warnings
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._select import dotted
from ..adapters import AbstractWeight, NF4Array
from ._mesh import BATCH_AXES
from ._rules import (
    check_rules,
    logical_axes,
    per_layer_path,
    preset_spec,
    rule_spec,
    stack_axes,
)

Entry = str | tuple[str, ...] | None


def _is_weight(x: Any) -> bool:
    return isinstance(x, AbstractWeight)


@dataclasses.dataclass
class _Resolver:
    """The spec of each array: rules for plain arrays and base weights, declarations for
    the arrays of implicit weights; dimensions a mesh axis does not divide stay whole."""

    mesh: Mesh
    rules: Any
    table: Any  # the architecture's logical axes, for a preset
    replicated: list[str] = dataclasses.field(default_factory=list)

    def base(self, path: str, node: Any, ndim: int) -> tuple[Entry, ...]:
        """The mesh axes of the `ndim` own axes (after any layer axes) of the array or
        weight at `path`, before divisibility."""
        own = per_layer_path(path)
        if isinstance(self.rules, str):
            axes = logical_axes(self.table, own)
            entries = () if axes is None else preset_spec(axes, self.rules)
        else:
            entries = rule_spec(self.rules, own, node) or ()
        return (tuple(entries) + (None,) * ndim)[:ndim]

    def fitted(
        self, path: str, shape: tuple[int, ...], entries: tuple[Entry, ...]
    ) -> PartitionSpec:
        """`entries` (one per axis of `shape`) with any axis its mesh axes do not divide
        left whole (and noted, for one warning)."""
        out = []
        for size, entry in zip(shape, entries):
            names, parts = _split(self.mesh, entry)
            if size % parts:
                self.replicated.append(f"{path} (axis of {size} over {'x'.join(names)}={parts})")
                entry = None
            out.append(entry)
        while out and out[-1] is None:
            out.pop()
        return PartitionSpec(*out)

    def array(self, path: str, value: Any) -> PartitionSpec:
        stack = stack_axes(path)
        entries = self.base(path, value, value.ndim - stack)
        return self.fitted(path, value.shape, (None,) * stack + entries)

    def weight(self, path: str, node: AbstractWeight) -> Any:
        stack = stack_axes(path)
        own = self.base(path, node, len(node.shape) - stack)
        return self.follow(path, node, stack, own)

    def follow(self, path: str, node: Any, stack: int, own: tuple[Entry, ...]) -> Any:
        """`node` with each array replaced by its spec: a field listed in its class's
        `weight_axes` takes the spec of the weight axes it follows, others stay whole."""
        if isinstance(node, NF4Array):
            _check_nf4_blocks(path, node, stack, own, self.mesh)
        declared = getattr(type(node), "weight_axes", {})
        new = object.__new__(type(node))
        for field in dataclasses.fields(node):
            value = getattr(node, field.name)
            where = f"{path}.{field.name}"
            if isinstance(value, AbstractWeight):
                value = self.follow(where, value, stack, own)
            elif isinstance(value, dict) and all(map(_is_weight, value.values())):
                value = {k: self.follow(f"{where}.{k}", a, stack, own) for k, a in value.items()}
            elif eqx.is_array(value):
                axes = declared.get(field.name, ())
                entries = [None] * (value.ndim - stack)
                for i, j in enumerate(axes[: len(entries)]):
                    if j is not None and value.shape[stack + i] != 1:
                        entries[i] = _flat_split(own) if _flattens(value, node, stack) else own[j]
                value = self.fitted(where, value.shape, (None,) * stack + tuple(entries))
            object.__setattr__(new, field.name, value)
        return new


def _split(mesh: Mesh, entry: Entry) -> tuple[tuple[str, ...], int]:
    """The mesh axes of one entry of a spec, and how many parts they cut that axis into."""
    names = (entry,) if isinstance(entry, str) else entry or ()
    return names, int(np.prod([mesh.shape[n] for n in names])) if names else 1


def _flattens(value: Any, node: Any, stack: int) -> bool:
    """Whether `value` holds `node`'s weight flattened row-major (NF4's codes and block
    scales): one axis of its own where the weight has several."""
    return value.ndim - stack == 1 and len(node.shape) - stack > 1


def _flat_split(own: tuple[Entry, ...]) -> Entry:
    """The split of a row-major flattening of a weight split as `own`: the mesh axes of
    the weight's first split axis. Its shards then hold whole rows, or whole runs of a
    row, as many values as the weight's own shards, on the same devices."""
    return next((entry for entry in own if entry is not None), None)


def _check_nf4_blocks(
    path: str, node: NF4Array, stack: int, own: tuple[Entry, ...], mesh: Mesh
) -> None:
    """Raise unless each shard of the flattened codes holds whole quantization blocks."""
    _, parts = _split(mesh, _flat_split(own))
    size = int(np.prod(node.shape[stack:]))
    if parts == 1 or size % parts:
        return  # not split (a dimension not divided stays whole)
    values = size // parts
    blocks = [("blocksize", node.blocksize, values)]
    if node.nested_absmax is not None:
        blocks.append(("nested_blocksize", node.nested_blocksize, values // node.blocksize))
    for name, block, count in blocks:
        if count % block:
            raise ValueError(
                f"the NF4 weight {path} would be split into {parts} shards of {count} "
                f"{'values' if name == 'blocksize' else 'block scales'}, which cuts its "
                f"quantization blocks ({name}={block}): a block would straddle two shards. "
                f"Shard it over fewer devices, or quantize it with a {name} that divides "
                f"{count}."
            )


def partition_specs(model: Any, mesh: Mesh, rules: Any) -> Any:
    """A `PartitionSpec` for every array of `model` (a pytree of the model's shape, None
    where it holds no array), by `rules` (see `shard`)."""
    check_rules(rules, mesh.axis_names)
    base = getattr(model, "base_model", model)
    table = None
    if isinstance(rules, str):
        # a zoo model's config class names its weights' logical axes
        table = getattr(getattr(base, "config", None), "LOGICAL_AXES", ())
        if not table and rules != "dp":
            raise ValueError(
                f"the preset {rules!r} needs a model whose architecture names its weights' "
                f"logical axes (the peftx zoo's); this {type(base).__name__} has none. Give "
                "rules instead: [(peftx.path_glob('*.up_proj.weight'), PartitionSpec(None, "
                "'fsdp')), ...]."
            )
    resolver = _Resolver(mesh, rules, table)

    def spec(keypath: Any, leaf: Any) -> Any:
        path = _module_path(dotted(keypath))
        if isinstance(leaf, AbstractWeight):
            return resolver.weight(path, leaf)
        if eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            return resolver.array(path, leaf)  # an array, or one to be loaded
        return leaf

    specs = jax.tree_util.tree_map_with_path(spec, model, is_leaf=_is_weight)
    if resolver.replicated:
        warnings.warn(
            "these dimensions are not divided by their mesh axes and stay whole (replicated "
            f"along them): {'; '.join(resolver.replicated)}.",
            UserWarning,
            stacklevel=3,
        )
    return eqx.filter(specs, lambda x: isinstance(x, PartitionSpec), is_leaf=_is_spec)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _module_path(path: str) -> str:
    """The path rules are written for: a `PeftModel`'s arrays by their base model's paths,
    and a `modules_to_save` copy by its original's."""
    if path.startswith("base_model."):
        return path.removeprefix("base_model.")
    if path.startswith("saved_modules."):
        return path.removeprefix("saved_modules.").partition(".")[2]
    return path


def shard(model: Any, mesh: Mesh, rules: Any = "fsdp") -> Any:
    """`model` (any Equinox model, or a `PeftModel`) with its arrays placed on `mesh`.

    **Arguments:**

    - `model`: the model.
    - `mesh`: from `make_mesh`.
    - `rules`: a preset, `"dp"`, `"fsdp"`, `"tp"` or `"fsdp_tp"` (a zoo model), or
      `(predicate, PartitionSpec)` pairs: the first predicate that holds for an array's
      path (as `peftx.select` names it, a stacked layer's by its first layer) gives its
      spec, without the layer axis of a `LayerStack`, which stays unsharded. Arrays no
      rule names are replicated.

    Adapters follow their base weight as their classes declare (`weight_axes`): LoRA's
    `lora_A` takes the spec of the weight's input axis, `lora_B` of its output axis, the
    rank axis is whole; DoRA's magnitude and IA3's vector take the spec of the axis they
    scale; NF4 codes and block scales, and int8 codes and scales, follow the rows they
    stand for. A dimension its mesh axes do not divide stays whole, named in one warning;
    an NF4 weight whose blocks would straddle two shards is refused.
    """
    specs = partition_specs(model, mesh, rules)
    arrays, static = eqx.partition(model, eqx.is_array)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)
    return eqx.combine(jax.device_put(arrays, shardings), static)


def placed_like(adapter: Any, weight: Any, stack: int) -> Any:
    """`adapter` (built for `weight`, with `stack` leading layer axes) with its arrays
    placed as they follow `weight`'s placement, as its class declares; as it is when
    `weight` is not split over a mesh. So an adapter added to, or loaded onto, a sharded
    model lands where `shard` would put it."""
    sharding = getattr(weight, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return adapter
    spec = (*sharding.spec, *(None,) * (weight.ndim - len(sharding.spec)))
    resolver = _Resolver(sharding.mesh, [], None)
    specs = resolver.follow("adapter", adapter, stack, tuple(spec[stack:]))
    arrays, static = eqx.partition(adapter, eqx.is_array)
    specs = eqx.filter(specs, _is_spec, is_leaf=_is_spec)
    shardings = jax.tree.map(lambda s: NamedSharding(sharding.mesh, s), specs, is_leaf=_is_spec)
    return eqx.combine(jax.device_put(arrays, shardings), static)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding of a batch: its leading axis split over `data` and `fsdp`."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def placement_line(mesh: Mesh, rules: Any, parameters: Any, optimizer_state: Any = None) -> str:
    """The line a run prints at start: the mesh, and the bytes of `parameters` (and
    `optimizer_state`) held by its first device, against the whole."""
    device = mesh.devices.flat[0]
    sizes = ", ".join(f"{k}={v}" for k, v in mesh.shape.items())
    parts = [f"mesh {sizes} ({mesh.devices.size} {device.platform} devices), rules {rules}"]
    for name, tree in (("parameters", parameters), ("optimizer state", optimizer_state)):
        if tree is None:
            continue
        arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
        total = sum(x.nbytes for x in arrays)
        shards = [s for x in arrays for s in x.addressable_shards if s.device == device]
        held = sum(s.data.nbytes for s in shards)
        parts.append(f"{name} {_mib(held)} of {_mib(total)} per device")
    return "; ".join(parts)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
