"""Runs of several processes (`jax.distributed`): joining one from the environment,
bringing a value spread over processes to the host, and letting one process write."""

import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from ._place import batch_sharding

# Clusters whose launcher JAX's own detection reads (SLURM, Open MPI), by the variable
# that counts the processes they started.
_CLUSTER_SIZES = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def initialize_distributed() -> bool:
    """Join a run of several processes when the environment describes one, with
    `jax.distributed.initialize`; returns whether it did (or had already).

    - `JAX_COORDINATOR_ADDRESS` (`host:port` of process 0), with `JAX_NUM_PROCESSES` and
      `JAX_PROCESS_ID`: those processes.
    - A SLURM or Open MPI launch of more than one process: JAX detects the rest.
    - Otherwise nothing: one process.

    Call it before anything touches a device. On CPU, processes exchange data through
    gloo (`jax_cpu_collectives_implementation`), unless another is set.
    """
    if jax.distributed.is_initialized():
        return True
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    clustered = any(_count(os.environ.get(name, "1")) > 1 for name in _CLUSTER_SIZES)
    if not address and not clustered:
        return False
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if not address:
        jax.distributed.initialize()
        return True
    count, index = (os.environ.get(n) for n in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"))
    if count is None or index is None or not (0 <= _count(index) < _count(count)):
        raise ValueError(
            f"JAX_COORDINATOR_ADDRESS={address} asks for a run of several processes; it needs "
            "JAX_NUM_PROCESSES (how many, at least 1) and JAX_PROCESS_ID (this one's, from 0), "
            f"got {count!r} and {index!r}."
        )
    jax.distributed.initialize(address, _count(count), _count(index))
    return True


def _count(text: str) -> int:
    return int(text) if text.strip().isdigit() else -1


def to_host(x: Any) -> np.ndarray:
    """`x` whole, as a numpy array: an array spread over several processes is gathered
    (a collective: every process calls this, in the same order)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def spread_over_processes(tree: Any) -> bool:
    """Whether any array of `tree` lies partly on other processes' devices."""
    return any(
        isinstance(x, jax.Array) and not x.is_fully_addressable for x in jax.tree.leaves(tree)
    )


def writes_files() -> bool:
    """Whether this process writes what a run of several processes saves (process 0)."""
    return jax.process_index() == 0


def wait_for_writer(name: str, spread: bool) -> None:
    """After a save of arrays spread over processes, every process waits here until
    process 0 has written (`name` tells the barriers apart)."""
    if spread:
        wait_for_all(name)


def agree(code: int) -> int:
    """Process 0's `code`, on every process (a collective); `code` itself in one process."""
    if jax.process_count() == 1:
        return code
    return int(multihost_utils.broadcast_one_to_all(np.int32(code)))


def wait_for_all(name: str) -> None:
    """Every process of a run waits here until all have arrived (`name` tells the
    barriers apart); nothing in one process."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def own_rows(mesh: Any, batch: Any) -> Any:
    """Of a global batch (numpy, the same on every process), the rows this process's
    devices hold, in order: what it passes to a sharded step (`process_rows` makes the
    global batch again). The whole batch in one process."""
    if jax.process_count() == 1:
        return batch
    n = jax.tree.leaves(batch)[0].shape[0]
    held = batch_sharding(mesh).addressable_devices_indices_map((n,)).values()
    spans = sorted({index[0].indices(n)[:2] for index in held})
    take = np.concatenate([np.arange(start, stop) for start, stop in spans])
    return jax.tree.map(lambda x: np.asarray(x)[take], batch)


def process_rows(mesh: Any, batch: Any) -> Any:
    """In a run of several processes, a batch of this process's own rows (numpy) as one
    global array per leaf, split over `data` and `fsdp`; else `batch` as it is."""
    if jax.process_count() == 1:
        return batch
    sharding = batch_sharding(mesh)

    def global_rows(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x  # already global
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree.map(global_rows, batch)
