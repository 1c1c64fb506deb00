"""A job's data sources: `[data] train` and `eval` (and each `[[adapters]]` entry's) name a
file (`.jsonl`, `.csv`, `.parquet`), a directory `datasets.Dataset.save_to_disk` wrote, or
a `datasets` spec, an inline table of `datasets.load_dataset`'s arguments read from local
files and the local cache only."""

import dataclasses
import glob
import json
from pathlib import Path
from typing import Any

from .. import train
from ._common import UsageError, unknown_key

# a spec's keys: `datasets.load_dataset`'s arguments (`dataset` is its `path`)
SPEC_KEYS = ("dataset", "data_files", "split", "name", "data_dir")
SPEC_EXAMPLE = '{dataset = "json", data_files = "train.jsonl", split = "train"}'
SOURCES = (
    "a .jsonl, .csv or .parquet file, a directory datasets.Dataset.save_to_disk wrote, or a "
    f"datasets spec such as {SPEC_EXAMPLE}"
)


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """A source given as `datasets.load_dataset`'s arguments, with its local paths
    absolute: `dataset` when it is a local directory, else `data_files`."""

    dataset: str
    split: str
    data_files: str | tuple[str, ...] | None = None
    name: str | None = None
    data_dir: str | None = None

    def __str__(self) -> str:
        """The spec as a TOML inline table (JSON's strings and arrays are TOML's)."""
        items = [(k, getattr(self, k)) for k in SPEC_KEYS]
        shown = [
            f"{k} = {json.dumps(list(v) if isinstance(v, tuple) else v)}"
            for k, v in items
            if v is not None
        ]
        return "{" + ", ".join(shown) + "}"

    def load(self) -> Any:
        """The `datasets.Dataset`, from local files and the local cache only."""
        files = self.data_files
        return train.load_local_dataset(
            self.dataset,
            split=self.split,
            data_files=list(files) if isinstance(files, tuple) else files,
            name=self.name,
            data_dir=self.data_dir,
        )

    def local_paths(self) -> list[Path]:
        """What it reads from disk: its directory, or the files its `data_files` match
        (a Hub dataset in the cache: none found here)."""
        if Path(self.dataset).is_absolute():
            return [Path(self.dataset)]
        patterns = (self.data_files,) if isinstance(self.data_files, str) else self.data_files
        return [Path(f) for p in patterns or () for f in sorted(glob.glob(p, recursive=True))]


Source = Path | DatasetSpec


def local_paths(source: Source) -> list[Path]:
    """The files and directories `source` reads."""
    return [source] if isinstance(source, Path) else source.local_paths()


def with_base(spec: dict[str, Any], base: Path) -> dict[str, Any]:
    """A spec table with its relative paths taken from `base` (the job file's directory,
    or the current one for `--set`): `dataset` when it names a local directory (whose
    `data_files` are then its own, as in `datasets`), else `data_files`. Values of the
    wrong type are left for `data_source` to refuse."""
    spec = dict(spec)
    dataset, files = spec.get("dataset"), spec.get("data_files")
    if isinstance(dataset, str) and (base / dataset).is_dir():
        spec["dataset"] = str((base / dataset).absolute())
    elif isinstance(files, str):
        spec["data_files"] = str(base / files)
    elif isinstance(files, list):
        spec["data_files"] = [str(base / f) if isinstance(f, str) else f for f in files]
    return spec


def data_source(value: Any, name: str, path: Path) -> Source:
    """The source that `name` (`data.train`, ...) of the job file `path` gives: a file or
    directory name, or a spec table, relative paths taken from the file's directory."""
    if isinstance(value, str):
        return path.parent / value
    if not isinstance(value, dict):
        raise UsageError(f"{path}: {name} must be {SOURCES}; got {value!r}")
    for key in value:
        if key not in SPEC_KEYS:
            raise unknown_key(f"{name} of {path}", key, SPEC_KEYS)
    for key in ("dataset", "split"):
        if key not in value:
            raise UsageError(f"{path}: {name} needs {key!r}, e.g. {SPEC_EXAMPLE}")
    for key in ("dataset", "split", "name", "data_dir"):
        if key in value and not isinstance(value[key], str):
            raise UsageError(f"{path}: {name}.{key} must be a string, got {value[key]!r}")
    files = value.get("data_files")
    if files is not None and not (
        isinstance(files, str)
        or (isinstance(files, list) and files and all(isinstance(f, str) for f in files))
    ):
        raise UsageError(
            f"{path}: {name}.data_files must be a file name (or glob pattern) or a list of "
            f"them, got {files!r}"
        )
    spec = with_base(value, path.parent)
    files = spec.get("data_files")
    return DatasetSpec(
        spec["dataset"],
        spec["split"],
        tuple(files) if isinstance(files, list) else files,
        spec.get("name"),
        spec.get("data_dir"),
    )


def read_source(source: Source, columns: list[str]) -> list[dict[str, Any]]:
    """The rows of `source`, each with `columns` (`peftx.train.read_records`; a spec's
    dataset loaded offline by `peftx.train.load_local_dataset`)."""
    try:
        if isinstance(source, Path):
            return train.read_records(source, columns)
        dataset = source.load()
        try:
            return train.read_records(dataset, columns)
        except ValueError as e:  # a column it lacks: named with the spec
            raise ValueError(f"{source}: {e}") from None
    except ModuleNotFoundError as e:  # the package a source needs: its line says which
        raise UsageError(str(e)) from None
