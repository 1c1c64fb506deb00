"""The device mesh: JAX's own `Mesh`, with peftx's three axis names."""

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "tensor")
"""The mesh axes: `data` (batch only), `fsdp` (batch and weights), `tensor` (Megatron)."""

BATCH_AXES = ("data", "fsdp")
"""The mesh axes a batch is split over, always."""


def make_mesh(
    data: int = 1, fsdp: int = -1, tensor: int = 1, *, devices: Sequence[Any] | None = None
) -> Mesh:
    """A `jax.sharding.Mesh` with axes `("data", "fsdp", "tensor")` of these sizes.

    One size may be `-1`: the devices left over by the others. The default puts every
    device on `fsdp`: a LoRA job's base weights are frozen, so sharding them costs one
    all-gather per layer and saves the most memory, and the batch is split over `fsdp`
    as well, so each device still computes its own share.

    **Arguments:**

    - `data`, `fsdp`, `tensor`: the axis sizes (positive, or one `-1`).
    - `devices`: the devices to lay out (default `jax.devices()`, all processes').
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ValueError(f"mesh size {name}={size!r} must be a positive integer or -1.")
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"only one mesh size may be -1 (the rest of the devices); got {free}.")
    known = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if len(devices) % known:
            raise ValueError(
                f"the mesh sizes {_described(sizes)} leave {len(devices)} / {known} devices "
                f"for {free[0]}, which is not a whole number; there are {len(devices)} devices."
            )
        sizes[free[0]] = len(devices) // known
    total = math.prod(sizes.values())
    if total != len(devices):
        raise ValueError(
            f"the mesh sizes {_described(sizes)} make {total} devices, but there are "
            f"{len(devices)}; make their product {len(devices)} (or set one to -1)."
        )
    # Auto axes: XLA propagates shardings from the arguments' placement (GSPMD)
    shape = tuple(sizes[a] for a in AXES)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def _described(sizes: dict[str, int]) -> str:
    return ", ".join(f"{name}={size}" for name, size in sizes.items())


def batch_parts(mesh: Mesh) -> int:
    """How many parts a batch is split into on `mesh`: the product of its batch axes."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.axis_names)
