"""Runs of several processes (`jax.distributed`): joining one from the environment,
watching that none is lost, bringing a value spread over processes to the host, and
letting one process write."""

import atexit
import contextlib
import os
import select
import socket
import sys
import threading
from typing import Any, NoReturn

import jax
import numpy as np
from jax.experimental import multihost_utils

from ._place import batch_sharding

# Clusters whose launcher JAX's own detection reads (SLURM, Open MPI), by the variable
# that counts the processes they started.
_CLUSTER_SIZES = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")

JOIN_TIMEOUT = "PEFTX_JOIN_TIMEOUT"
"""The variable that sets how long a process waits for the others to join, in seconds."""
DEFAULT_JOIN_TIMEOUT = 300.0  # JAX's own `initialization_timeout`
# JAX gives up joining (a C++ abort with a stack) this long after peftx has (one line)
_JAX_GRACE = 60
# What a collective's error says when the process at the other end is gone (gloo, NCCL)
_LOST_PEER = ("connection reset by peer", "connection closed by peer", "broken pipe")
_RESUME = "run the command again on every process (a fine-tune resumes from its last checkpoint)"
_ADDRESS_BYTES = 256  # process 0's watch address, as broadcast to the others


def initialize_distributed() -> bool:
    """Join a run of several processes when the environment describes one, with
    `jax.distributed.initialize`; returns whether it did (or had already).

    - `JAX_COORDINATOR_ADDRESS` (`host:port` of process 0), with `JAX_NUM_PROCESSES` and
      `JAX_PROCESS_ID`: those processes.
    - A SLURM or Open MPI launch of more than one process: JAX detects the rest.
    - Otherwise nothing: one process.

    Call it before anything touches a device. On CPU, processes exchange data through
    gloo (`jax_cpu_collectives_implementation`), unless another is set.

    It prints at once (stderr) that it waits for the others, and waits up to
    `PEFTX_JOIN_TIMEOUT` seconds (default 300); then the process exits with status 1 and
    one line naming the coordinator's address (JAX's own timeout aborts with a C++ stack).
    Once joined, each process holds a socket to process 0; when a process ends without
    finishing (killed, crashed), every other one exits at once with status 1 and one
    line naming it, instead of waiting for JAX's heartbeat (100 s) to abort it.
    """
    if jax.distributed.is_initialized():
        return True
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    clustered = any(_count(os.environ.get(name, "1")) > 1 for name in _CLUSTER_SIZES)
    if not address and not clustered:
        return False
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeout = _join_timeout()
    if not address:
        _join("the processes of this SLURM or Open MPI launch", timeout)
        _watch_processes(socket.gethostname(), timeout)
        return True
    count, index = (os.environ.get(n) for n in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"))
    if count is None or index is None or not (0 <= _count(index) < _count(count)):
        raise ValueError(
            f"JAX_COORDINATOR_ADDRESS={address} asks for a run of several processes; it needs "
            "JAX_NUM_PROCESSES (how many, at least 1) and JAX_PROCESS_ID (this one's, from 0), "
            f"got {count!r} and {index!r}."
        )
    whom = f"{count} processes at {address} (this is process {index})"
    _join(whom, timeout, address, _count(count), _count(index))
    _watch_processes(address.rpartition(":")[0], timeout)
    return True


def _join_timeout() -> float:
    text = os.environ.get(JOIN_TIMEOUT, str(DEFAULT_JOIN_TIMEOUT))
    try:
        timeout = float(text)
    except ValueError:
        timeout = -1.0
    if not 0 < timeout < 2**31:
        raise ValueError(f"{JOIN_TIMEOUT}={text!r} must be a number of seconds above 0.")
    return timeout


def _join(whom: str, timeout: float, *arguments: Any) -> None:
    """`jax.distributed.initialize(*arguments)`, saying so at once, and giving up with one
    line after `timeout` seconds (JAX's own limit is later: it aborts with a stack)."""
    print(f"peftx: waiting for {whom}, up to {timeout:g} s ({JOIN_TIMEOUT})", file=sys.stderr)
    sys.stderr.flush()
    message = (
        f"gave up after {timeout:g} s ({JOIN_TIMEOUT}) waiting for {whom}: start each "
        "with the same JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES and its own JAX_PROCESS_ID"
    )
    timer = threading.Timer(timeout, exit_run, (message,))
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(*arguments, initialization_timeout=int(timeout) + _JAX_GRACE)
    finally:
        timer.cancel()


def exit_run(message: str, *, new_line: bool = False) -> NoReturn:
    """Print `peftx: error: message` (on a new line with `new_line`: a progress bar may be
    open) and end this process at once with status 1, past `jax.distributed`'s shutdown
    (which waits for every process, then aborts with a C++ stack when one is gone)."""
    print("\n" * new_line + f"peftx: error: {message}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _watch_processes(host: str, timeout: float) -> None:
    """Connect every process to process 0 (listening on `host`) and watch the sockets from
    a thread: a process that ends says `bye` first (at exit); a socket that closes without
    it is a process lost, which process 0 tells the others before all of them exit."""
    index, count = jax.process_index(), jax.process_count()
    if count < 2:
        return
    listener = socket.create_server(("", 0)) if index == 0 else None
    text = f"{host}:{listener.getsockname()[1]}" if listener else ""
    sent = np.frombuffer(text.encode().ljust(_ADDRESS_BYTES, b"\0"), np.uint8)
    where = bytes(np.asarray(multihost_utils.broadcast_one_to_all(sent))).rstrip(b"\0")
    peers: dict[int, socket.socket] = {}
    if listener is None:
        host, _, port = where.decode().rpartition(":")
        peers[0] = socket.create_connection((host, int(port)), timeout=timeout)
        peers[0].sendall(f"{index}\n".encode())
    else:
        listener.settimeout(timeout)
        for _ in range(count - 1):
            conn, _ = listener.accept()
            peers[int(conn.recv(16).split()[0])] = conn
        listener.close()
    for conn in peers.values():
        conn.settimeout(None)
    finishing = threading.Event()

    def finish() -> None:
        finishing.set()
        for conn in peers.values():
            with contextlib.suppress(OSError):
                conn.sendall(b"bye\n")

    atexit.register(finish)
    threading.Thread(target=_watch, args=(peers, finishing), daemon=True).start()


def _watch(peers: dict[int, socket.socket], finishing: threading.Event) -> None:
    index, count = jax.process_index(), jax.process_count()
    while peers:
        ready, _, _ = select.select(list(peers.values()), [], [])
        for k, conn in list(peers.items()):
            if conn not in ready:
                continue
            try:
                message = conn.recv(64)
            except OSError:
                message = b""
            if message.startswith(b"bye"):
                del peers[k]
                continue
            if finishing.is_set():
                return
            lost = int(message.split()[1]) if message.startswith(b"lost") else k
            for other in peers.values():
                with contextlib.suppress(OSError):
                    other.sendall(f"lost {lost}\n".encode())
            exit_run(
                f"process {index} of {count} lost process {lost}, which ended without "
                f"finishing; {_RESUME}",
                new_line=True,
            )


def lost_process(error: BaseException) -> str | None:
    """When `error` is a collective that failed because another process of the run is gone,
    the line that says so (naming it when the run has two processes); else None."""
    text = str(error)
    if not jax.distributed.is_initialized() or jax.process_count() < 2:
        return None
    if not isinstance(error, jax.errors.JaxRuntimeError):
        return None
    if not any(sign in text.lower() for sign in _LOST_PEER):
        return None
    index, count = jax.process_index(), jax.process_count()
    others = [i for i in range(count) if i != index]
    lost = f"process {others[0]}" if count == 2 else f"one of processes {others}"
    detail = " ".join(text.split())
    return f"process {index} of {count} lost {lost} ({detail}); {_RESUME}"


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
