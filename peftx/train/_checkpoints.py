"""Training checkpoints: the adapter in PEFT's format plus what resuming needs, written
to a temporary directory and renamed into place."""

import json
import os
import shutil
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import safetensors.numpy
from safetensors import SafetensorError

from .._errors import CheckpointError
from .._files import remove_leftovers, replaced_directory
from ..sharding import spread_over_processes, to_host, wait_for_writer, writes_files
from ._step import TrainState, trained_model

STATE_FILE = "train_state.safetensors"
INFO_FILE = "train_state.json"
BEST_FILE = "best_trainable.safetensors"  # the best adapter so far (`fit(keep_best=...)`)
_PREFIX = "checkpoint-"


def _named(tree: Any) -> dict[str, jax.Array | np.ndarray]:
    """The arrays of `tree`, named by their path in it."""
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def _arrays(state: TrainState) -> dict[str, jax.Array | np.ndarray]:
    """The arrays of `state`, named by their path in it."""
    key = jax.random.key_data(state.key)
    return _named((state.trainable, state.opt_state, state.step, key, state.hooks))


def save_checkpoint(
    directory: str | os.PathLike,
    state: TrainState,
    frozen: Any,
    *,
    info: dict[str, Any] | None = None,
    keep: int | None = 2,
    best: Any = None,
) -> Path:
    """Write `directory/checkpoint-<step>/`: the adapter (`PeftModel.save_pretrained`, so
    PEFT loads any checkpoint) and the training state (optimizer state, step, PRNG key
    and the exact trainable leaves, in safetensors; `info` such as the data position in
    JSON). The files go to a new directory swapped into place when complete, so a run
    killed mid-write leaves the previous checkpoints intact. The `keep` newest
    checkpoints are kept (None: all). `best`, a trainable tree of `state.trainable`'s
    structure (the best adapter so far), is saved beside it (`restore_best`)."""
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be at least 1 (or None: keep all), got {keep}")
    directory = Path(directory)
    step = int(to_host(state.step))
    final = directory / f"{_PREFIX}{step:08d}"
    # every process takes part in gathering what is spread over processes; process 0
    # writes, and the others wait for it
    spread = spread_over_processes(state)
    trainable = jax.tree.map(to_host, state.trainable)  # gathered once, saved twice
    with_host = eqx.tree_at(lambda s: s.trainable, state, trainable)
    host = {name: to_host(x) for name, x in _arrays(with_host).items()}
    best_host = None if best is None else {k: to_host(x) for k, x in _named(best).items()}
    if writes_files():
        directory.mkdir(parents=True, exist_ok=True)
        remove_leftovers(directory)  # of a run killed while saving
        adapter = jax.tree.leaves(eqx.filter(trainable, eqx.is_array))
        size = sum(x.nbytes for x in [*host.values(), *adapter])  # the state, then the adapter
        with replaced_directory(final, size=size) as tmp:
            trained_model(with_host, frozen).save_pretrained(tmp)
            safetensors.numpy.save_file(host, str(tmp / STATE_FILE))
            if best_host is not None:
                safetensors.numpy.save_file(best_host, str(tmp / BEST_FILE))
            record = {"step": step, "processes": jax.process_count(), **(info or {})}
            (tmp / INFO_FILE).write_text(json.dumps(record, indent=2))
        if keep is not None:
            for old in checkpoints(directory)[:-keep]:
                shutil.rmtree(old)
    wait_for_writer(f"peftx save_checkpoint {final}", spread)
    return final


def checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The complete checkpoints in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [
        p
        for p in directory.iterdir()
        if p.name.startswith(_PREFIX) and p.name.removeprefix(_PREFIX).isdigit() and p.is_dir()
    ]
    complete = [p for p in found if (p / INFO_FILE).is_file()]
    return sorted(complete, key=lambda p: int(p.name.removeprefix(_PREFIX)))


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `directory`, or None."""
    found = checkpoints(directory)
    return found[-1] if found else None


def restore_checkpoint(path: str | os.PathLike, like: TrainState) -> tuple[TrainState, dict]:
    """The `TrainState` saved at `path`, and its `info`. `like` (e.g. from `init_state`
    with the same model and optimizer) gives the structure; every array is checked
    against it, so a checkpoint of another model or optimizer raises `CheckpointError`.
    Each array takes the placement of its counterpart in `like`, so a checkpoint taken on
    one mesh restores onto another (or onto one device); one written by a different number
    of processes is refused."""
    path = Path(path)
    try:
        saved = safetensors.numpy.load_file(str(path / STATE_FILE))
        info = json.loads((path / INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, SafetensorError) as e:
        raise CheckpointError(f"cannot read the training checkpoint {path}: {e}") from None
    if not isinstance(info, dict) or not _is_count(info.get("step")):
        raise CheckpointError(
            f"{path / INFO_FILE} is damaged: it needs 'step', a count of steps, got "
            f"{info.get('step') if isinstance(info, dict) else info!r}"
        )
    processes = info.pop("processes", 1)
    if processes != jax.process_count():
        raise CheckpointError(
            f"{path} was written by {processes} process(es); this run has "
            f"{jax.process_count()}. Resume with {processes}, or start from its adapter "
            "(PeftModel.from_pretrained) instead."
        )
    expected = _arrays(like)
    if set(saved) != set(expected):
        odd = sorted(set(saved) ^ set(expected))
        raise CheckpointError(
            f"{path} was written for another model or optimizer: {len(odd)} arrays differ, "
            f"e.g. {odd[0]}"
        )
    for name, want in expected.items():
        if saved[name].shape != want.shape or saved[name].dtype != want.dtype:
            raise CheckpointError(
                f"{path}: {name} is {saved[name].dtype}{list(saved[name].shape)}, the run "
                f"expects {want.dtype}{list(want.shape)}"
            )
    tree = (like.trainable, like.opt_state, like.step, jax.random.key_data(like.key), like.hooks)
    arrays, static = eqx.partition(tree, eqx.is_array)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(arrays)]
    like_leaves = jax.tree.leaves(arrays)
    leaves = [jax.device_put(saved[p], x.sharding) for p, x in zip(paths, like_leaves)]
    trainable, opt_state, step, key_data, hooks = eqx.combine(
        jax.tree.unflatten(jax.tree.structure(arrays), leaves), static
    )
    key = jax.random.wrap_key_data(key_data, impl=jax.random.key_impl(like.key))
    if int(step) != info["step"]:
        raise CheckpointError(
            f"{path} is damaged: {INFO_FILE} says step {info['step']}, {STATE_FILE} "
            f"holds step {int(step)}"
        )
    return TrainState(trainable, opt_state, step, key, hooks), info


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def restore_best(path: str | os.PathLike, like: Any) -> Any:
    """The best trainable tree saved with the checkpoint at `path` (`save_checkpoint(...,
    best=...)`), each array placed as its counterpart in `like` (the run's trainable
    tree); `CheckpointError` if it is missing or of another structure."""
    path = Path(path)
    try:
        saved = safetensors.numpy.load_file(str(path / BEST_FILE))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"cannot read the best adapter of {path}: {e}") from None
    arrays, static = eqx.partition(like, eqx.is_array)
    named = jax.tree_util.tree_leaves_with_path(arrays)
    if set(saved) != {jax.tree_util.keystr(p) for p, _ in named}:
        raise CheckpointError(f"{path / BEST_FILE} was written for another adapter")
    leaves = []
    for p, x in named:
        value = saved[jax.tree_util.keystr(p)]
        if value.shape != x.shape or value.dtype != x.dtype:
            raise CheckpointError(f"{path / BEST_FILE}: {jax.tree_util.keystr(p)} differs")
        leaves.append(jax.device_put(value, x.sharding))
    return eqx.combine(jax.tree.unflatten(jax.tree.structure(arrays), leaves), static)
