"""A fine-tuning run's output directory: marked as peftx's, locked while a run writes it,
and replaced only by a run that has succeeded, keeping every file peftx did not write."""

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from .._files import file_mode, remove_leftovers, swap_in, write_text
from ..sharding import agree, writes_files
from ._common import UsageError
from ._sources import Source, local_paths

MARKER = ".peftx-run"
LOCK = ".peftx-lock"
JOB = "job.json"
SUMMARY = "summary.json"
# every entry a run writes; anything else in a run directory is the user's and is kept
RUN_ENTRIES = frozenset(
    {MARKER, LOCK, JOB, SUMMARY, "metrics.jsonl", "curves.png", "labels.json"}
    | {"adapter", "merged", "checkpoints", "tensorboard", "wandb"}
)
Plan = Literal["new", "resume", "replace"]
# the job's record of its data (`data_record`): a run resumes only on the same bytes
DATA_FILES = "data_files"
# where a run computes, not what: its checkpoints restore onto any mesh and device count
PLACEMENT = "mesh"
# where a run reports its metrics, not what it computes: a run resumes with other [log] keys
LOGGING = "log"


def data_record(sources: list[Source]) -> dict[str, Any]:
    """Each data source's record, for `job.json`: a file's size and SHA-256 (None for a
    file that cannot be read: reading the data reports it); a directory's, or a spec's
    (its directory, or the files its `data_files` match), `files`: each file's, by path."""
    record: dict[str, Any] = {}
    for source in sources:
        if isinstance(source, Path) and not source.is_dir():
            record[str(source)] = _file_record(source)
        else:
            files = sorted({f for p in local_paths(source) for f in _files(p)})
            record[str(source)] = {"files": {str(f): _file_record(f) for f in files}}
    return record


def _file_record(path: Path) -> dict[str, Any] | None:
    try:
        with path.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
            return {"bytes": os.fstat(f.fileno()).st_size, "sha256": digest}
    except OSError:
        return None


def _files(path: Path) -> list[Path]:
    """`path`, or the files in the directory `path` and those below it."""
    if not path.is_dir():
        return [path]
    return [f for f in path.rglob("*") if f.is_file()]


def staging_dir(out: Path) -> Path:
    """Where a run that replaces the one in `out` is written until it succeeds."""
    return out.parent / f".{out.name}.peftx-next"


def is_run_dir(path: Path) -> bool:
    return (path / MARKER).is_file()


def plan_output(
    out: Path, job: dict[str, Any], *, overwrite: bool, protected: list[tuple[str, Path]]
) -> Plan:
    """What a run of `job` (its `job.json`) does with `out`: start there (`"new"`), go on
    from its checkpoints (`"resume"`), or run beside it and replace it when done
    (`"replace"`). Reads only; a directory that is not peftx's, or that a run may not
    replace, is a `UsageError`. `protected` (the model directory, the data files and
    directories, each with what it is) may not be `out` or lie inside it, nor may `out`
    lie inside a data directory."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"output.dir {str(out)!r} is a file; name a directory")
    real = out.resolve()
    for what, path in protected:
        other = path.resolve()
        # a run inside a data directory would be read, and recorded, as part of its data
        inside = what == "data directory" and other in real.parents
        if other == real or real in other.parents or inside:
            relation = "is" if other == real else "lies inside" if inside else "contains"
            raise UsageError(
                f"output.dir {str(out)!r} {relation} the {what} {str(path)!r}; a run's output "
                "goes in a directory of its own, e.g. runs/NAME"
            )
    if not out.exists() or all(e.name == LOCK for e in out.iterdir()):
        return "new"
    if not is_run_dir(out):
        raise UsageError(
            f"output.dir {str(out)!r} is not empty and is not a peftx run directory (it has "
            f"no {MARKER}); peftx writes only into a new or empty directory, or one of its "
            "own runs: pick another output.dir"
        )
    if (out / SUMMARY).exists():
        if not overwrite:
            raise UsageError(
                f"{out} holds a finished run; pass --overwrite to replace it, or set output.dir"
            )
        return "replace"
    if not (out / JOB).exists() or not (out / "checkpoints").is_dir():
        return "new"  # killed before its first checkpoint: nothing to go on from
    mismatch = _mismatch(_read_job(out), job)
    if mismatch is not None:
        if not overwrite:
            raise UsageError(
                f"{out} holds checkpoints of {mismatch}; pass --overwrite to start over, or set "
                "output.dir"
            )
        return "replace"
    return "replace" if overwrite else "resume"


def _mismatch(recorded: Any, job: dict[str, Any]) -> str | None:
    """What keeps the run of `recorded` (a `job.json`) from going on as `job`, or None:
    the job (on any mesh, with any `[log]`) and its data files must be the same."""

    def computed(j: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in j.items() if k not in (PLACEMENT, LOGGING, DATA_FILES)}

    if not isinstance(recorded, dict) or computed(recorded) != computed(job):
        return "a different job"
    then = recorded.get(DATA_FILES)
    if not isinstance(then, dict):
        return "a different job"
    for source, now in job[DATA_FILES].items():
        old = then.get(source)
        if now is not None and now != old:
            return _changed(source, old, now)
    return None


def _changed(source: str, old: Any, now: dict[str, Any]) -> str:
    """How data `source` differs from when a run recorded it (`old`; `now`: its record
    today), for "holds checkpoints of ...": the file, or the first file of a directory's
    or spec's, that changed."""
    if "files" not in now:
        was = _describe(old) if isinstance(old, dict) else "a file not read"
        return (
            f"a run on data file {source!r} as it was then ({was}); it has changed since "
            f"({_describe(now)}): put it back to resume"
        )
    before = old.get("files") if isinstance(old, dict) else None
    before = before if isinstance(before, dict) else {}
    files = before.keys() | now["files"]
    changed = sorted(f for f in files if before.get(f) != now["files"].get(f))
    if not changed:
        return f"a run on data {source!r} when it was a file: put it back to resume"
    name = changed[0]
    return (
        f"a run on data {source!r} as it was then; its file {name!r} has changed since "
        f"({_state(before, name)} then, {_state(now['files'], name)} now): put it back to "
        "resume"
    )


def _state(files: dict[str, Any], name: str) -> str:
    if name not in files:
        return "absent"
    return _describe(files[name]) if isinstance(files[name], dict) else "not read"


def _describe(file: dict[str, Any]) -> str:
    return f"{file['bytes']} bytes, sha256 {file['sha256']}"


def _read_job(run: Path) -> Any:
    try:
        return json.loads((run / JOB).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # damaged: not this job


class Lock:
    """`directory/.peftx-lock`: held with `flock` (so the kernel frees it when its process
    dies), naming its holder's process id while held."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK
        self.fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, file_mode())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UsageError(
                f"{self.path.parent} is in use by another peftx run (process {holder}, as "
                f"{self.path} says); wait for it to end, or set output.dir"
            ) from None
        left = os.pread(fd, 64, 0).decode(errors="replace").strip()
        if left and left != str(os.getpid()):
            print(f"taking over {self.path}, left by process {left}, which is gone")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # an empty lock file: no holder, none died holding it
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


class Run:
    """A run's place on disk while it trains: `work`, the directory it writes (`out` itself,
    or beside it when it replaces a run), and whether it goes on from checkpoints there."""

    def __init__(self, out: Path, work: Path, resume: bool):
        self.out, self.work, self.resume = out, work, resume

    def commit(self) -> None:
        """Put a finished run at `out`: a replacement run is swapped in whole, keeping the
        old directory's files that peftx did not write."""
        if self.work != self.out:
            swap_in(self.work, self.out, drop=lambda entry: entry.name in RUN_ENTRIES)


@contextlib.contextmanager
def open_run(
    out: Path, job: dict[str, Any], *, overwrite: bool, protected: list[tuple[str, Path]]
) -> Iterator[Run]:
    """Lock `out`, decide again under the lock what to do with it (`plan_output`), and make
    the run's directory ready: marked, with its `job.json`, and tidied of what a killed
    run left. The lock is released when the block ends.

    In a run of several processes, process 0 does this and tells the others where the run
    writes and whether it resumes (`out` must be on a file system they all see); they
    never touch `out`."""
    if not writes_files():
        code = agree(0)
        if code < 0:
            raise UsageError(f"process 0 could not open {out}: see its message")
        yield Run(out, staging_dir(out) if code & 2 else out, resume=bool(code & 1))
        return
    with contextlib.ExitStack() as stack:
        try:
            run = stack.enter_context(_open_run(out, job, overwrite=overwrite, protected=protected))
        except BaseException:
            agree(-1)
            raise
        agree(2 * (run.work != out) + run.resume)
        yield run


@contextlib.contextmanager
def _open_run(
    out: Path, job: dict[str, Any], *, overwrite: bool, protected: list[tuple[str, Path]]
) -> Iterator[Run]:
    out.mkdir(parents=True, exist_ok=True)
    locks = [Lock(out)]
    try:
        locks[0].acquire()
        plan = plan_output(out, job, overwrite=overwrite, protected=protected)
        work = out
        if plan == "replace":
            work = staging_dir(out)
            if work.is_symlink() or (work.exists() and not is_run_dir(work)):
                # a link is not a directory a run made: never cleared or written through
                raise UsageError(f"{work} is in the way of the run replacing {out}; move it")
            work.mkdir(exist_ok=True)
            locks.append(Lock(work))
            locks[-1].acquire()
            if _resumable(work, job):
                plan = "resume"
            else:
                _clear(work)
            print(f"writing the new run to {work}; it replaces {out} when it has succeeded")
        elif plan == "new":
            _clear(out)
        remove_leftovers(work)  # of a killed run's writes
        if plan != "resume":
            write_text(work / MARKER, json.dumps({"peftx": "fine-tuning run"}) + "\n")
            write_text(work / JOB, json.dumps(job, indent=2))
        yield Run(out, work, resume=plan == "resume")
    finally:
        for lock in reversed(locks):
            lock.release()


def _resumable(run: Path, job: dict[str, Any]) -> bool:
    """Whether `run` (a replacement run's directory) holds checkpoints of `job` to go on from."""
    unfinished = is_run_dir(run) and not (run / SUMMARY).exists()
    return unfinished and (run / "checkpoints").is_dir() and _mismatch(_read_job(run), job) is None


def _clear(run: Path) -> None:
    """Delete what an earlier run wrote in `run` (only that), to start afresh there."""
    for entry in run.iterdir():
        if entry.name in RUN_ENTRIES - {LOCK}:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
