"""Rules: which mesh axes each array of a model is split over.

A zoo model names the logical axes of its weights once, in its architecture
(`("heads", "embed")` for a query projection); a preset maps logical axes to mesh axes,
as MaxText's `logical_axis_rules` and levanter's axis mappings do. A user's own model
gets rules written with the selection DSL: the first predicate that holds for an array's
path gives its `PartitionSpec`."""

import re
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from .._select import Predicate
from .._spans import find_span

LogicalAxes = tuple[str | None, ...]

PRESETS: dict[str, Mapping[str, str]] = {
    "dp": {},
    "fsdp": {"embed": "fsdp"},
    "tp": {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"},
    "fsdp_tp": {"embed": "fsdp", "heads": "tensor", "mlp": "tensor", "vocab": "tensor"},
}
"""Logical axis -> mesh axis, by preset name. `"dp"`: every weight replicated. `"fsdp"`:
each weight split along its model-width (`embed`) axis over `fsdp`. `"tp"`: Megatron's
split, q/k/v/gate/up on their output features (`heads`, `mlp`), o/down on their input
features, the embeddings and LM head on the vocabulary. `"fsdp_tp"`: both."""

Rules = str | Sequence[tuple[Predicate, PartitionSpec]]
"""A preset name (for a zoo model), or `(predicate, spec)` pairs for any model."""


def check_rules(rules: Any, mesh_axes: Sequence[str]) -> None:
    """Raise, naming the rule at fault, for an unknown preset or a spec naming an axis
    the mesh lacks."""
    if isinstance(rules, str):
        if rules not in PRESETS:
            raise ValueError(f"unknown sharding preset {rules!r}; presets: {', '.join(PRESETS)}.")
        return
    if not isinstance(rules, Sequence):
        raise TypeError(
            f"sharding rules must be a preset ({', '.join(PRESETS)}) or a list of "
            f"(peftx.Predicate, PartitionSpec) pairs, got {type(rules).__name__} {rules!r}."
        )
    for k, pair in enumerate(rules):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], Predicate)):
            raise TypeError(
                f"sharding rule {k} must be a (peftx.Predicate, PartitionSpec) pair, got {pair!r}."
            )
        for axis in _axes_of(pair[1]):
            if axis not in mesh_axes:
                raise ValueError(
                    f"sharding rule {k} ({pair[0]}) names mesh axis {axis!r}; the mesh has "
                    f"{', '.join(map(repr, mesh_axes))}."
                )


def _axes_of(spec: PartitionSpec) -> list[str]:
    names: list[str] = []
    for entry in spec:
        if isinstance(entry, str):
            names.append(entry)
        elif isinstance(entry, tuple):
            names.extend(entry)
    return names


def stack_axes(path: str) -> int:
    """Leading layer axes of an array at `path`: one inside a `LayerStack` segment
    (`layers.0-11...`), which stays unsharded."""
    return 1 if find_span(path) is not None else 0


def per_layer_path(path: str) -> str:
    """`path` with a stack segment's span replaced by its first layer (`layers.0-11.x` ->
    `layers.0.x`), the path a per-layer rule is written for."""
    found = find_span(path)
    if found is None:
        return path
    parts, j, (first, _) = found
    return ".".join([*parts[:j], str(first), *parts[j + 1 :]])


def logical_axes(table: Sequence[tuple[str, LogicalAxes]], path: str) -> LogicalAxes | None:
    """The logical axes the architecture's `table` (regexes on the end of a per-layer
    path) gives the array at `path`, or None."""
    for pattern, axes in table:
        if re.fullmatch(rf"(.*\.)?(?:{pattern})", path):
            return axes
    return None


def preset_spec(axes: LogicalAxes, preset: str) -> tuple[str | None, ...]:
    """The mesh axis of each logical axis under `preset`."""
    mapping = PRESETS[preset]
    return tuple(None if a is None else mapping.get(a) for a in axes)


def rule_spec(rules: Sequence[tuple[Predicate, PartitionSpec]], path: str, node: Any) -> Any:
    """The spec of the first rule whose predicate holds for `(path, node)`, or None."""
    for predicate, spec in rules:
        if predicate(path, node):
            return tuple(spec)
    return None
