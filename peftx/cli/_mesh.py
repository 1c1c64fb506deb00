"""Where a command runs: a job's `[mesh]` table (or `--mesh KEY=VALUE` options), and the
mesh it makes."""

import argparse
import dataclasses
from typing import Any

import jax

from ..sharding import PRESETS, initialize_distributed, make_mesh
from ._common import UsageError, option_value, unknown_key

MESH_KEYS = {"data": 1, "fsdp": -1, "tensor": 1, "rules": "fsdp"}
"""The `[mesh]` table's keys and defaults: every device on `fsdp`, weights split by the
`"fsdp"` preset. A LoRA job's base weights are frozen and hold nearly all its memory;
FSDP splits them over every device at the cost of one all-gather per layer, and splits
the batch over the same devices, so each one computes its own share. Tensor parallelism
moves activations between devices in every layer, which pays only when one layer's
weights do not fit a device."""


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    """The sizes of the mesh axes (one may be -1: the rest of the devices) and the rules
    (a preset of `peftx.sharding.PRESETS`)."""

    data: int
    fsdp: int
    tensor: int
    rules: str


def mesh_settings(table: Any, where: str) -> MeshSettings | None:
    """The `[mesh]` table `table` (None: not given), checked; `where` names it in errors."""
    if table is None:
        return None
    if not isinstance(table, dict):
        raise UsageError(f"{where}: 'mesh' must be a table ([mesh]), got {table!r}")
    for key in table:
        if key not in MESH_KEYS:
            raise unknown_key(f"[mesh] of {where}", key, MESH_KEYS)
    settings = {**MESH_KEYS, **table}
    for key in ("data", "fsdp", "tensor"):
        value = settings[key]
        if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
            raise UsageError(
                f"{where}: mesh.{key} must be a positive integer, or -1 (the rest of the "
                f"devices), got {value!r}"
            )
    if settings["rules"] not in PRESETS:
        raise UsageError(
            f"{where}: mesh.rules = {settings['rules']!r} is not a preset; choose one of "
            f"{', '.join(PRESETS)}"
        )
    return MeshSettings(**settings)


def add_mesh_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mesh",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="a key of a fine-tune job's [mesh] table: data, fsdp or tensor (sizes, one may "
        "be -1) or rules (dp, fsdp, tp, fsdp_tp), e.g. --mesh tensor=2 --mesh rules=tp "
        "(repeatable; default: every device on fsdp)",
    )


def mesh_from_arguments(items: list[str]) -> MeshSettings | None:
    """The settings `--mesh KEY=VALUE` options give, or None for none."""
    table: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep:
            raise UsageError(f"--mesh {item!r}: expected KEY=VALUE, e.g. fsdp=8")
        value = option_value(text)
        table[key.strip()] = value
    return mesh_settings(table, "--mesh") if items else None


def run_mesh(settings: MeshSettings | None) -> tuple[Any, str | None]:
    """`(mesh, rules)` a command runs with: the settings' mesh, or with none given, every
    visible device on `fsdp`; `(None, None)` (the plain one-device path) when none are
    given and there is one device. A run of several processes that the environment
    describes is joined first (`peftx.sharding.initialize_distributed`)."""
    try:
        initialize_distributed()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if settings is None:
        if jax.device_count() == 1:
            return None, None
        settings = MeshSettings(**MESH_KEYS)
    try:
        mesh = make_mesh(settings.data, settings.fsdp, settings.tensor)
    except ValueError as e:
        raise UsageError(f"[mesh]: {e}") from None
    return mesh, settings.rules


def on_mesh(mesh: Any, rules: str | None) -> dict[str, Any]:
    """`from_pretrained`'s keywords that read a model straight onto `mesh` (none without)."""
    return {} if mesh is None else {"mesh": mesh, "rules": rules}
