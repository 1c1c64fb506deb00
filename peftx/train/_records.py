"""Rows to fine-tune on, from where they are kept: JSONL, CSV and Parquet files, a
`datasets.Dataset` (or a directory `save_to_disk` wrote), and `datasets` specs loaded
from local files and the local cache only. `datasets` and `pyarrow` are imported only
for the sources that need them."""

import contextlib
import csv
import importlib
import io
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

FILE_SUFFIXES = (".jsonl", ".csv", ".parquet")
# what `datasets.Dataset.save_to_disk` writes beside the Arrow files (a DatasetDict: the
# second, with a directory per split)
SAVED_DATASET, SAVED_DATASET_DICT = "state.json", "dataset_dict.json"


def _require(module: str, package: str, what: str) -> ModuleType:
    """`module`, imported; a `ModuleNotFoundError` naming what needs it and the install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ModuleNotFoundError(
            f"{what} needs the {package} package: pip install {package} (or pip install "
            "'peftx[data]')"
        ) from None


def read_records(source: Any, columns: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of `source`, each a dict checked to have `columns`.

    **Arguments:**

    - `source`: a path (`str` or `Path`) to a `.jsonl` (one JSON object per line) or
      `.csv` (with a header) file, UTF-8 (a byte-order mark is allowed); a `.parquet`
      file (read with `pyarrow`); or a directory `datasets.Dataset.save_to_disk` wrote.
      Or a `datasets.Dataset` (one split: see `load_local_dataset`).
    - `columns`: the columns every row must have.

    **Raises** `FileNotFoundError` for a path that is not there, `ValueError` naming the
    file (the row, for JSONL and CSV) and the column for a missing column, and
    `ModuleNotFoundError` naming the package to install (`datasets`, `pyarrow`) for a
    source that needs one.
    """
    datasets = sys.modules.get("datasets")  # a Dataset's module is imported already
    if datasets is not None and isinstance(source, datasets.Dataset):
        return _table_rows(source.column_names, source.to_list, columns, "the dataset")
    if datasets is not None and isinstance(source, datasets.DatasetDict):
        raise TypeError(
            f"the datasets.DatasetDict holds the splits {list(source)}: pass one, e.g. "
            f"source[{next(iter(source), 'train')!r}]"
        )
    if not isinstance(source, str | os.PathLike):
        raise TypeError(
            "source must be a path (str or Path) or a datasets.Dataset, got an object of "
            f"type {type(source).__name__}"
        )
    path = Path(source)
    if path.is_dir():
        return _saved_rows(path, columns)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    if path.suffix not in FILE_SUFFIXES:
        raise ValueError(
            f"data file {str(path)!r}: expected a .jsonl, .csv or .parquet file, or a "
            "directory datasets.Dataset.save_to_disk wrote"
        )
    if path.suffix == ".parquet":
        where = f"data file {str(path)!r}"
        parquet = _require("pyarrow.parquet", "pyarrow", where)
        try:
            table = parquet.read_table(path)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise ValueError(f"{where} is not a readable Parquet file: {e}") from None
        return _table_rows(table.column_names, table.to_pylist, columns, where)
    return _text_rows(path, columns)


def _text_rows(path: Path, columns: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of a `.jsonl` or `.csv` file, each checked to have `columns`."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ValueError(
            f"data file {str(path)!r} is not UTF-8 text (byte 0x{raw[e.start]:02x} on line "
            f"{line}); save it as UTF-8"
        ) from None
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(rows[-1], dict):
                raise ValueError(f"{path}:{n}: expected a JSON object, got {line[:40]!r}")
    else:
        rows = list(csv.DictReader(io.StringIO(text, newline="")))
    if not rows:
        raise ValueError(f"data file {str(path)!r} has no rows")
    for n, row in enumerate(rows, 1):
        missing = [c for c in columns if c not in row]
        if missing:
            raise ValueError(
                f"{path}: row {n} has no column {missing[0]!r}; its columns are {sorted(row)}"
            )
    return rows


def _table_rows(
    names: list[str], read: Callable[[], list[dict]], columns: Sequence[str], what: str
) -> list[dict[str, Any]]:
    """The rows `read()` gives of a table whose every row has the columns `names` (a
    `pyarrow.Table`, a `datasets.Dataset`), checked first to hold `columns`; `what`
    names the table."""
    missing = [c for c in columns if c not in names]
    if missing:
        raise ValueError(f"{what} has no column {missing[0]!r}; its columns are {sorted(names)}")
    rows = read()
    if not rows:
        raise ValueError(f"{what} has no rows")
    return rows


def _saved_rows(path: Path, columns: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of the `datasets.Dataset` saved in directory `path`."""
    where = f"data directory {str(path)!r}"
    if (path / SAVED_DATASET_DICT).is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / SAVED_DATASET).is_file())
        raise ValueError(
            f"{where} holds a datasets.DatasetDict (splits {', '.join(splits)}); name one "
            f"split's directory, e.g. {str(path / (splits[0] if splits else 'train'))!r}"
        )
    if not (path / SAVED_DATASET).is_file():
        raise ValueError(
            f"{where} is not one datasets.Dataset.save_to_disk wrote (it has no "
            f"{SAVED_DATASET}); name a .jsonl, .csv or .parquet file, or such a directory"
        )
    datasets = _require("datasets", "datasets", where)
    dataset = datasets.load_from_disk(str(path))
    return _table_rows(dataset.column_names, dataset.to_list, columns, where)


@contextlib.contextmanager
def _offline(datasets: ModuleType) -> Iterator[None]:
    """`datasets` and the Hub client offline while the block runs (`HF_HUB_OFFLINE=1`):
    their module flags, which they read from the environment when imported, and the
    environment, for what reads it later."""
    import huggingface_hub.constants as hub

    flags = [(datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE")]
    flags.append((hub, "HF_HUB_OFFLINE"))
    saved = [getattr(module, name) for module, name in flags]
    env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    try:
        for module, name in flags:
            setattr(module, name, True)
        os.environ.update(dict.fromkeys(env, "1"))
        yield
    finally:
        for (module, name), value in zip(flags, saved, strict=True):
            setattr(module, name, value)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def load_local_dataset(
    path: str,
    *,
    split: str,
    data_files: str | Sequence[str] | None = None,
    name: str | None = None,
    data_dir: str | None = None,
) -> Any:
    """`datasets.load_dataset(path, name, data_dir=, data_files=, split=)`, a
    `datasets.Dataset`, from local files and the local `datasets` cache only: the network
    is never used (the Hub is offline while it loads, `HF_HUB_OFFLINE=1`).

    `path` is a builder (`"json"`, `"csv"`, `"parquet"`, ... with `data_files`), a local
    directory, or a Hub dataset (`"owner/name"`) loaded once before, online, into the
    cache. `split` is one split (`"train"`, or a slice, `"train[:90%]"`).

    **Raises** `FileNotFoundError` for a dataset that is not there offline (naming the
    cache), `ValueError` for others of `datasets`' refusals (an unknown split), and
    `ModuleNotFoundError` without the `datasets` package.
    """
    datasets = _require("datasets", "datasets", f"dataset {path!r}")
    if not isinstance(split, str):
        raise TypeError(f"dataset {path!r}: split must be one split's name (a str), got {split!r}")
    where = f"dataset {path!r} (split {split!r})"
    try:
        with _offline(datasets):
            dataset = datasets.load_dataset(
                path, name, data_dir=data_dir, data_files=data_files, split=split
            )
    except ConnectionError:  # the Hub, which offline mode does not ask
        raise FileNotFoundError(
            f"{where} is neither local nor in the datasets cache "
            f"({datasets.config.HF_DATASETS_CACHE}), and peftx loads datasets offline: load "
            "it once online (datasets.load_dataset) to cache it, or give local data_files"
        ) from None
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{where}: {' '.join(str(e).split())}") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: {' '.join(str(e).split())}") from None
    return dataset


def split_records(
    records: Sequence[dict[str, Any]], eval_fraction: float, *, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`(train, eval)`: `round(len(records) * eval_fraction)` of `records`, drawn by
    `seed`, to evaluate on, and the rest to train on, each in the order of `records` (a
    job's `[data] eval_fraction`, drawn by its `[train] seed`).

    **Raises** `ValueError` for a fraction outside (0, 1), or one that leaves a side with
    no row.
    """
    if isinstance(eval_fraction, bool) or not (
        isinstance(eval_fraction, int | float) and 0 < eval_fraction < 1
    ):
        raise ValueError(f"eval_fraction must be a number in (0, 1), got {eval_fraction!r}")
    held = round(len(records) * eval_fraction)
    if not 0 < held < len(records):
        side = "evaluate" if held == 0 else "train"
        raise ValueError(
            f"eval_fraction {eval_fraction} of {len(records)} rows leaves no row to {side} on; "
            "give more rows, another eval_fraction, or eval rows of their own"
        )
    drawn = np.zeros(len(records), bool)
    drawn[np.random.default_rng(seed).permutation(len(records))[:held]] = True
    return (
        [r for r, d in zip(records, drawn, strict=True) if not d],
        [r for r, d in zip(records, drawn, strict=True) if d],
    )
