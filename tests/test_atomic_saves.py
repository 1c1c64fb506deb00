"""Multi-file saves are replaced as a whole: a process killed, or a save failing, at any
write or rename leaves the old files or the new ones, never a mix, and the user's own
files beside them survive. A kill is simulated exactly by copying the directory as it
stands before each file-system call of the save (what a kill there would leave)."""

import contextlib
import errno
import json
import os
import pathlib
import re
import shutil
import stat

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
import safetensors.numpy
from safetensors import SafetensorError

import peftx
import peftx._files as files
from peftx import models
from peftx._errors import DiskFullError

# every call through which a save changes the file system
MUTATORS = [
    (os, "rename"),
    (os, "replace"),
    (os, "link"),
    (os, "unlink"),
    (os, "rmdir"),
    (os, "mkdir"),
    (os, "chmod"),
    (os, "symlink"),
    (shutil, "rmtree"),
    (pathlib.Path, "write_text"),
    (safetensors.numpy, "save_file"),
    (files, "_exchange"),
]


def _state(directory: pathlib.Path) -> dict[str, bytes | None] | None:
    """Every entry under `directory` by relative path: a file's bytes, None for a folder."""
    if not directory.exists():
        return None
    return {
        str(p.relative_to(directory)): None if p.is_dir() else p.read_bytes()
        for p in sorted(directory.rglob("*"))
    }


@contextlib.contextmanager
def _watched(monkeypatch, root: pathlib.Path, *, fail_at: int | None = None):
    """Copy `root` aside before each file-system call (the states a kill could leave), or
    raise `OSError` at call number `fail_at`. Yields the list of copies."""
    copies: list[pathlib.Path] = []
    calls = [0]
    busy = [False]
    snapshots = root.parent / f"{root.name}-kills"
    snapshots.mkdir()
    real_copytree = shutil.copytree

    def wrap(owner, name):
        real = getattr(owner, name)

        def watched(*args, **kwargs):
            if not busy[0]:
                busy[0] = True
                try:
                    calls[0] += 1
                    if fail_at is not None and calls[0] == fail_at:
                        raise OSError(f"injected failure at call {fail_at} ({name})")
                    if fail_at is None:
                        copy = snapshots / str(len(copies))
                        real_copytree(root, copy, symlinks=True)
                        copies.append(copy)
                finally:
                    busy[0] = False
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, watched)

    for owner, name in MUTATORS:
        wrap(owner, name)
    yield copies, calls
    monkeypatch.undo()


def _check_all_kills(
    monkeypatch, tmp_path, target_name, save_old, save_new, *, exchange, through_link=False
):
    """Save old, then new, with a copy of the directory before every call of the second
    save: after the recovery the next save does, each copy holds the old files or the new
    ones at the target, and the user's file. `through_link`: the second save is given a
    symbolic link to the target, which must stay a link to it."""
    root = tmp_path / "root"
    target = root / target_name
    save_old(target)
    (target / "notes.txt").write_text("the user's own")
    old = _state(target)
    named = target
    if through_link:
        named = root / "link"
        named.symlink_to(target_name)
    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    with _watched(monkeypatch, root) as (copies, _):
        save_new(named)
    new = _state(target)
    assert new != old and new["notes.txt"] == b"the user's own"
    assert len(copies) > 5
    seen = set()
    if through_link:  # nothing is left beside the link and its target
        assert sorted(p.name for p in root.iterdir()) == sorted(["link", target_name])
    for copy in copies:
        with monkeypatch.context() as m:
            m.setattr(files, "_alive", lambda pid: False)  # the killed process is gone
            files._recover(copy / target_name)
        state = _state(copy / target_name)
        assert state in (old, new), f"a kill before call {copy.name} leaves a mix"
        seen.add("old" if state == old else "new")
        if through_link:  # the link itself is never replaced, nor written beside
            assert os.readlink(copy / "link") == target_name, copy.name
            assert not any(p.name.startswith(".link") for p in copy.iterdir()), copy.name
    assert seen == {"old", "new"}


def _check_all_failures(monkeypatch, tmp_path, target_name, save_old, save_new, calls):
    """A save that raises at any one of its calls leaves the old files or the new ones
    (some failures, such as a hard link refused, are handled by the save itself)."""
    raised = 0
    for k in range(1, calls + 1):
        root = tmp_path / f"fail{k}"
        target = root / target_name
        save_old(target)
        (target / "notes.txt").write_text("the user's own")
        old = _state(target)
        with _watched(monkeypatch, root, fail_at=k):
            try:
                save_new(target)
            except OSError as e:
                assert "injected failure" in str(e)
                raised += 1
        assert _state(target) in (old, _state_after(tmp_path, save_new, target_name)), k
    assert raised > calls // 2


_AFTER: dict = {}


def _state_after(tmp_path, save_new, target_name):
    if "new" not in _AFTER:
        clean = tmp_path / "clean" / target_name
        save_new(clean)
        _AFTER["new"] = _state(clean)
    return {**_AFTER["new"], "notes.txt": b"the user's own"}


@pytest.fixture(scope="module")
def llama_model(llama):
    return models.from_pretrained(llama / "base")


def _model_saves(model):
    # the new save has fewer, larger shards: the old shard files must not survive it
    old = lambda d: models.save_pretrained(model, d, max_shard_size=6_000)  # noqa: E731
    params, static = eqx.partition(model, eqx.is_inexact_array)
    doubled = eqx.combine(jax.tree.map(lambda x: 2 * x, params), static)
    new = lambda d: models.save_pretrained(doubled, d, max_shard_size=40_000)  # noqa: E731
    return old, new


def _adapter_saves(model):
    def peft(alpha):
        config = peftx.LoraConfig(r=2, lora_alpha=alpha, target_modules=["q_proj", "v_proj"])
        m = peftx.get_peft_model(model, config, key=jax.random.key(alpha))
        return m.add_adapter("other", config, key=jax.random.key(alpha + 1))

    old, new = peft(4), peft(16)
    return (lambda d: old.save_pretrained(d)), (lambda d: new.save_pretrained(d))


SAVES = pytest.mark.parametrize(
    "exchange, through_link",
    [(True, False), (False, False), (True, True), (False, True)],
    ids=["renameat2", "two-renames", "renameat2-link", "two-renames-link"],
)


@SAVES
def test_sharded_checkpoint_killed_anywhere(
    monkeypatch, tmp_path, llama_model, exchange, through_link
):
    """`through_link`: the repro of `peftx merge --overwrite` onto a linked OUT_DIR, which
    put the new checkpoint in the link's place and failed in `rmtree` on the link."""
    old, new = _model_saves(llama_model)
    _check_all_kills(
        monkeypatch, tmp_path, "ckpt", old, new, exchange=exchange, through_link=through_link
    )
    ckpt = tmp_path / "root" / "ckpt"
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert sorted(p.name for p in ckpt.glob("model-*")) == sorted(set(index["weight_map"].values()))


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_adapter_save_killed_anywhere(monkeypatch, tmp_path, llama_model, exchange):
    old, new = _adapter_saves(llama_model)
    _check_all_kills(monkeypatch, tmp_path, "adapter", old, new, exchange=exchange)


def test_failing_saves_leave_old_or_new(monkeypatch, tmp_path, llama_model):
    for name, (old, new) in {
        "ckpt": _model_saves(llama_model),
        "adapter": _adapter_saves(llama_model),
    }.items():
        _AFTER.clear()
        root = tmp_path / name
        root.mkdir()
        # count the calls of one save, then fail each in turn
        probe = root / "probe"
        old(probe / name)
        with _watched(monkeypatch, probe, fail_at=10**9) as (_, calls):
            new(probe / name)
        _check_all_failures(monkeypatch, root, name, old, new, calls[0])


def test_new_weights_never_meet_an_old_config(monkeypatch, tmp_path, llama_model):
    """The repro: a kill between the renames of adapter_config.json and the weights left
    new weights with the old lora_alpha, which loaded silently."""
    old, new = _adapter_saves(llama_model)
    root = tmp_path / "root"
    old(root / "adapter")
    with _watched(monkeypatch, root) as (copies, _):
        new(root / "adapter")
    for copy in copies:
        folder = copy / "adapter"
        config = peftx.load_config(folder)
        weights = safetensors.numpy.load_file(str(folder / "adapter_model.safetensors"))
        ref = tmp_path / ("ref16" if config.lora_alpha == 16 else "ref4")
        if not ref.exists():
            (new if config.lora_alpha == 16 else old)(ref)
        want = safetensors.numpy.load_file(str(ref / "adapter_model.safetensors"))
        assert sorted(weights) == sorted(want)
        for k in want:
            np.testing.assert_array_equal(weights[k], want[k])


def test_modes_follow_the_umask(tmp_path, llama_model):
    old, _ = _adapter_saves(llama_model)
    previous = os.umask(0o027)
    try:
        models.save_pretrained(llama_model, tmp_path / "ckpt")
        old(tmp_path / "adapter")
        tmp = files.temporary_file(tmp_path / "x")
    finally:
        os.umask(previous)
    for d in (tmp_path / "ckpt", tmp_path / "adapter", tmp_path / "adapter" / "other"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o750, d
        for f in d.iterdir():
            if f.is_file():
                assert stat.S_IMODE(f.stat().st_mode) == 0o640, f
    assert stat.S_IMODE(os.stat(tmp).st_mode) == 0o640


def test_replacing_keeps_the_modes_of_the_directory(tmp_path, llama_model):
    target = tmp_path / "ckpt"
    models.save_pretrained(llama_model, target)
    target.chmod(0o700)
    models.save_pretrained(llama_model, target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o700


def test_leftovers_of_dead_processes_are_tidied(tmp_path):
    target = tmp_path / "adapter"
    target.mkdir()
    dead = 2**22 + 12345  # above the default pid_max: no such process
    stale_new = tmp_path / f".adapter.peftx-new-{dead}-abc"
    stale_new.mkdir()
    (stale_new / "adapter_model.safetensors").write_bytes(b"half")
    live = tmp_path / f".adapter.peftx-new-{os.getpid()}-def"  # a save still going on
    live.mkdir()
    mine = tmp_path / ".adapter.notes"  # not peftx's
    mine.write_text("keep")
    tmp = files.temporary_file(target / "adapter_config.json")
    with files.replaced_directory(target, size=2) as new:
        (new / "adapter_config.json").write_text("{}")
    assert not stale_new.exists() and live.is_dir() and mine.read_text() == "keep"
    assert files.remove_leftovers(target) == [pathlib.Path(tmp)]
    assert not pathlib.Path(tmp).exists()


def _fake_run(directory: pathlib.Path, seed: int) -> None:
    """What a finished `peftx finetune` run leaves (file contents by seed)."""
    from peftx.cli._run_dir import MARKER

    (directory / "adapter").mkdir(parents=True)
    for name in ("adapter/adapter_model.safetensors", "adapter/adapter_config.json",
                 "job.json", "summary.json", "metrics.jsonl", MARKER):  # fmt: skip
        (directory / name).write_text(f"{name} of run {seed}")
    if seed == 0:
        (directory / "merged").mkdir()  # the old run merged; the new one does not
        (directory / "merged" / "model.safetensors").write_text("merged 0")


@SAVES
def test_a_replacement_run_is_swapped_in_whole(monkeypatch, tmp_path, exchange, through_link):
    """`through_link`: the repro of `--overwrite` with `output.dir` a link to a finished
    run, which swapped the link itself and left it as the staging directory of the next
    run, which cleared the run it led to."""
    from peftx.cli._run_dir import Run, staging_dir

    out = tmp_path / "root" / "run"

    def save_old(target):
        _fake_run(target, 0)

    def save_new(output_dir):
        target = files.followed(output_dir)  # as `peftx finetune` takes output.dir
        staging = staging_dir(target)
        _fake_run(staging, 1)
        Run(target, staging, resume=False).commit()

    _check_all_kills(
        monkeypatch, tmp_path, "run", save_old, save_new,
        exchange=exchange, through_link=through_link,
    )  # fmt: skip
    assert not (out / "merged").exists()  # the old run's, replaced as a whole
    assert (out / "summary.json").read_text() == "summary.json of run 1"


def test_a_checkpoint_of_the_same_step_is_replaced_whole(monkeypatch, tmp_path, llama_model):
    from peftx import train

    def state_of(alpha):
        config = peftx.LoraConfig(r=2, lora_alpha=alpha, target_modules=["q_proj"])
        model = peftx.get_peft_model(llama_model, config, key=jax.random.key(alpha))
        return train.init_state(model, optax.sgd(0.1), key=jax.random.key(0))

    old, new = state_of(4), state_of(16)

    def save(state_and_frozen):
        return lambda d: train.save_checkpoint(d.parent, *state_and_frozen, info={"batches": 0})

    _check_all_kills(
        monkeypatch, tmp_path, "checkpoint-00000000", save(old), save(new), exchange=True
    )


def _data_bytes(directory: pathlib.Path) -> int:
    """The bytes of the tensors in the safetensors files under `directory` (each file less
    its 8-byte length and JSON header)."""
    total = 0
    for f in directory.rglob("*.safetensors"):
        header = int.from_bytes(f.read_bytes()[:8], "little")
        total += f.stat().st_size - 8 - header
    return total


def _full_safetensors(real):
    def save_file(tensors, filename, metadata=None):
        if "train_state" in str(filename):  # as the Rust writer reports ENOSPC
            raise SafetensorError(
                'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                'space left on device" })'
            )
        return real(tensors, filename, metadata=metadata)

    return save_file


def _full_json(real):
    def write_text(self, *args, **kwargs):
        if self.name == "train_state.json":  # Python's write: an errno and no path
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *args, **kwargs)

    return write_text


@pytest.mark.parametrize("writer", ["safetensors", "json"])
def test_a_full_disk_names_the_checkpoint_and_keeps_the_last(
    monkeypatch, tmp_path, llama_model, writer
):
    """The repro: a full disk at a checkpoint was a `SafetensorError` traceback, or
    `[Errno 28]` naming no path. Now one line naming the checkpoint and the bytes it
    needs; the checkpoints before it stay, and nothing is left of the failed one."""
    from peftx import train

    config = peftx.LoraConfig(r=2, target_modules=["q_proj"])
    model = peftx.get_peft_model(llama_model, config, key=jax.random.key(0))
    state, frozen = train.init_state(model, optax.adam(0.1), key=jax.random.key(1))
    first = train.save_checkpoint(tmp_path, state, frozen, info={"batches": 0})
    kept = _state(first)
    later = eqx.tree_at(lambda s: s.step, state, state.step + 1)
    owner, name, fault = {
        "safetensors": (safetensors.numpy, "save_file", _full_safetensors),
        "json": (pathlib.Path, "write_text", _full_json),
    }[writer]
    monkeypatch.setattr(owner, name, fault(getattr(owner, name)))
    failed = tmp_path / "checkpoint-00000001"
    says = re.escape(
        f"no space left on the device to write {str(failed)!r}: it needs about "
        f"{_data_bytes(first):,} bytes and "
    )
    with pytest.raises(DiskFullError, match=says + r"[0-9,]+ bytes are free there; free") as e:
        train.save_checkpoint(tmp_path, later, frozen, info={"batches": 1})
    assert e.value.errno == errno.ENOSPC and "\n" not in str(e.value)
    assert train.checkpoints(tmp_path) == [first] and _state(first) == kept
    assert sorted(tmp_path.iterdir()) == [first]
