"""Tensors that checkpoints on the Hub store under other names than the model's: a
mixture of experts' fused expert weights, which transformers 5 holds as one
`(experts, rows, cols)` tensor and `save_pretrained` writes per expert by default
(Mixtral's `block_sparse_moe.experts.{e}.w1.weight`, ...). Loading reads both layouts;
saving writes the Hub's, as transformers does."""

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import CheckpointError


@dataclass(frozen=True)
class HubKeys:
    """The model's tensor `fused` (a key with `{m}`, the module path) stored as `parts`:
    per-expert keys (`{e}`, the expert) whose rows concatenate, in order, into one
    expert's matrix; or a single key without `{e}`, a plain renaming."""

    fused: str
    parts: tuple[str, ...]

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.parts[0]

    def fused_match(self, key: str) -> str | None:
        """The module path `{m}` if `key` is this fused key, else None."""
        found = re.fullmatch(_pattern(self.fused), key)
        return found.group("m") if found else None

    def part_keys(self, module: str, experts: int) -> Iterator[tuple[int, int, str]]:
        """`(expert, part, key)` of every stored tensor for one module."""
        for e in range(experts if self.per_expert else 1):
            for p, part in enumerate(self.parts):
                yield e, p, part.format(m=module, e=e)


def _pattern(template: str) -> str:
    """A regex for `template`, `{m}` a module path and `{e}` an expert index."""
    out = re.escape(template)
    return out.replace(r"\{m\}", r"(?P<m>.+)").replace(r"\{e\}", r"(?P<e>\d+)")


class HubLayout:
    """A checkpoint reader (`Reader`) that also shows each fused tensor the checkpoint
    holds in parts, under the model's key, and hides the parts: `keys`, `shape`, `dtype`,
    `file` and `read_into` read the parts into their rows of the fused tensor."""

    def __init__(self, reader: Any, hub_keys: tuple[HubKeys, ...]):
        self.reader = reader
        # model key: (the HubKeys, the number of experts, the stored keys)
        self.virtual: dict[str, tuple[HubKeys, int, list[tuple[int, int, str]]]] = {}
        present = reader.keys()
        for hub in hub_keys:
            first = re.compile(_pattern(hub.parts[0]))
            experts: dict[str, set[int]] = {}
            for key in present:
                found = first.fullmatch(key)
                if found:
                    expert = int(found.group("e")) if hub.per_expert else 0
                    experts.setdefault(found.group("m"), set()).add(expert)
            for module, seen in experts.items():
                n = len(seen)
                if seen != set(range(n)):
                    raise CheckpointError(
                        f"the checkpoint holds experts {sorted(seen)} of {module}; expected "
                        f"experts 0 to {max(seen)} (keys like {hub.parts[0]!r})."
                    )
                parts = list(hub.part_keys(module, n))
                missing = [k for _, _, k in parts if k not in present]
                if missing:
                    raise CheckpointError(
                        f"the checkpoint lacks {missing[0]!r} of {module}'s experts "
                        f"({len(missing)} such key(s) missing)."
                    )
                shapes = {reader.shape(k) for _, _, k in parts}
                if len(shapes) != 1 or len(next(iter(shapes))) != 2:
                    raise CheckpointError(
                        f"{module}'s expert tensors ({hub.parts[0]!r}, ...) have shapes "
                        f"{sorted(shapes)}; expected one 2-D shape for all."
                    )
                self.virtual[hub.fused.format(m=module)] = (hub, n, parts)
        self.hidden = {k for _, _, parts in self.virtual.values() for _, _, k in parts}

    def keys(self) -> set[str]:
        return (self.reader.keys() - self.hidden) | set(self.virtual)

    def _first(self, key: str) -> str:
        return self.virtual[key][2][0][2] if key in self.virtual else key

    def file(self, key: str) -> str:
        return self.reader.file(self._first(key))

    def dtype(self, key: str) -> np.dtype:
        return self.reader.dtype(self._first(key))

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self.virtual:
            return self.reader.shape(key)
        hub, experts, parts = self.virtual[key]
        rows, cols = self.reader.shape(parts[0][2])
        fused = (rows * len(hub.parts), cols)
        return (experts, *fused) if hub.per_expert else fused

    def read_into(self, key: str, dest: np.ndarray, index: tuple[slice, ...] | None = None) -> None:
        """As `Reader.read_into`; a fused tensor read in part (`index`, a device's share)
        is assembled whole first, then sliced."""
        if key not in self.virtual:
            self.reader.read_into(key, dest, index)
            return
        hub, _, parts = self.virtual[key]
        shape = self.shape(key)
        whole = dest if index is None else np.empty(shape, dest.dtype)
        rows = self.reader.shape(parts[0][2])[0]
        by_expert = whole.reshape((-1, *shape[-2:]))
        for e, p, k in parts:
            self.reader.read_into(k, by_expert[e, p * rows : (p + 1) * rows])
        if index is not None:
            dest[...] = whole[index]


def hub_tensors(
    hub_keys: tuple[HubKeys, ...], key: str, value: np.ndarray
) -> list[tuple[str, np.ndarray]]:
    """The tensors `save_pretrained` writes for the model's tensor `key`: its parts, per
    expert, where the Hub stores it so; else itself."""
    for hub in hub_keys:
        module = hub.fused_match(key)
        if module is None:
            continue
        by_expert = value.reshape((-1, *value.shape[-2:]))
        rows = by_expert.shape[1] // len(hub.parts)
        return [
            (k, by_expert[e, p * rows : (p + 1) * rows])
            for e, p, k in hub.part_keys(module, by_expert.shape[0])
        ]
    return [(key, value)]
