"""`peftx finetune JOB.toml`: load a model, put an adapter on it, train it on a JSONL/CSV
dataset with checkpoints it resumes from, evaluate before and after, and write the
adapter in PEFT's format."""

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import re
import shutil
import sys
import time
import tomllib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._files import followed, naming_a_full_disk, temporary_file, write_text
from ._common import (
    BUNDLED_MODEL,
    ModelSettings,
    RunFailed,
    UsageError,
    adapter_tables,
    copy_base_files,
    hf_config,
    job_model,
    load_tokenizer,
    model_class_for,
    read_toml,
    unknown_key,
)
from ._mesh import mesh_settings, on_mesh, placement_line, run_mesh
from ._run_dir import DATA_FILES, Run, data_record, open_run, plan_output

DATA_KEYS = {
    "train": None,
    "eval": None,
    "text_column": "text",
    "label_column": "label",
    "prompt_column": None,
    "messages_column": None,
    "max_length": 128,
    "pack": False,
}
TRAIN_KEYS = {
    "seed": 0,
    "epochs": 1,
    "steps": None,
    "batch_size": 16,
    "eval_batch_size": 64,
    "grad_accumulation": 1,
    "optimizer": "adamw",
    "learning_rate": 1e-3,
    "weight_decay": 0.0,
    "schedule": "linear",
    "warmup_steps": 0,
    "max_grad_norm": 1.0,
    "log_every": 10,
    "eval_every": None,
    "checkpoint_every": None,
    "quantize": False,
}
OUTPUT_KEYS = {"dir": None, "merged": False, "keep_checkpoints": 2}
OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("constant", "linear", "cosine")
PATHS = {("model", "path"), ("data", "train"), ("data", "eval"), ("output", "dir")}
TASK_TYPES = {"classification": "SEQ_CLS", "causal-lm": "CAUSAL_LM"}
# a name is a folder of the output (PEFT saves an adapter in a subfolder of its name)
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the job's TOML file (see configs/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.learning_rate=1e-3 (repeatable)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run in output.dir (only what peftx wrote) once the new one has succeeded",
    )


def _override(job: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    table, dot, name = key.strip().partition(".")
    if not sep or not dot or not name:
        raise UsageError(f"--set {item!r}: expected TABLE.KEY=VALUE, e.g. train.steps=100")
    if table == "adapters":
        raise UsageError(f"--set {item!r}: [[adapters]] entries are changed in the job file")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word: a string
    if (table, name) in PATHS and isinstance(value, str) and value != BUNDLED_MODEL:
        value = str(Path(value).expanduser().absolute())  # on the command line: from the cwd
    job.setdefault(table, {})[name] = value


def _settings(job: dict[str, Any], table: str, defaults: dict[str, Any], path: Path) -> dict:
    given = job.get(table, {})
    if not isinstance(given, dict):
        raise UsageError(f"{path}: {table!r} must be a table ([{table}])")
    for key in given:
        if key not in defaults:
            raise unknown_key(f"[{table}] of {path}", key, defaults)
    return {**defaults, **given}


# the largest count a job may give: steps and sizes are int32 on the device
MAX_COUNT = 2**31 - 1
COUNTS = [("data", "max_length"), ("output", "keep_checkpoints")] + [
    ("train", k)
    for k in ("batch_size", "eval_batch_size", "grad_accumulation", "epochs", "log_every")
]
OPTIONAL_COUNTS = [("train", k) for k in ("steps", "eval_every", "checkpoint_every")]
FLOAT32_MAX = 3.4028234663852886e38
# (key, smallest allowed, whether the smallest is allowed)
RATES = [("learning_rate", 0.0, False), ("weight_decay", 0.0, True), ("max_grad_norm", 0.0, True)]
FLAGS = [("data", "pack"), ("output", "merged"), ("train", "quantize")]
TEXT = [("data", "text_column"), ("data", "label_column")]


def _check_numbers(job: "Job", path: Path) -> None:
    """Every number, flag and name of `[data]`, `[train]` and `[output]` has the type and
    range it must: counts are integers in 1..2**31-1, rates finite numbers."""

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for table, key in COUNTS + OPTIONAL_COUNTS:
        value = getattr(job, table)[key]
        if value is None and (table, key) in OPTIONAL_COUNTS:
            continue
        if not is_int(value) or value < 1:
            raise UsageError(f"{path}: {table}.{key} must be a positive integer, got {value!r}")
        if value > MAX_COUNT:
            raise UsageError(f"{path}: {table}.{key} must be at most {MAX_COUNT}, got {value}")
    t = job.train
    if not is_int(t["warmup_steps"]) or not 0 <= t["warmup_steps"] <= MAX_COUNT:
        raise UsageError(
            f"{path}: train.warmup_steps must be an integer >= 0, got {t['warmup_steps']!r}"
        )
    if not is_int(t["seed"]) or not 0 <= t["seed"] < 2**32:
        raise UsageError(f"{path}: train.seed must be an integer in 0..2**32-1, got {t['seed']!r}")
    for key, low, inclusive in RATES:
        value = t[key]
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise UsageError(f"{path}: train.{key} must be a number, got {value!r}")
        # the optimizer computes in float32: a larger value is infinite there
        finite = math.isfinite(value) and abs(value) <= FLOAT32_MAX
        if not finite or value < low or (value == low and not inclusive):
            bound = f">= {low:g}" if inclusive else f"> {low:g}"
            raise UsageError(
                f"{path}: train.{key} must be a finite number {bound} (float32: at most "
                f"{FLOAT32_MAX:.4g}), got {value!r}"
            )
        t[key] = float(value)
    for table, key in FLAGS:
        value = getattr(job, table)[key]
        if not isinstance(value, bool):
            raise UsageError(f"{path}: {table}.{key} must be true or false, got {value!r}")
    optional = [("data", "prompt_column"), ("data", "messages_column"), ("output", "dir")]
    for table, key in TEXT + optional:
        value = getattr(job, table)[key]
        if not isinstance(value, str) and not (value is None and (table, key) in optional):
            raise UsageError(f"{path}: {table}.{key} must be a string, got {value!r}")
    if job.data["messages_column"] is not None:
        if job.model.task != "causal-lm":
            raise UsageError(f'{path}: data.messages_column needs model.task = "causal-lm"')
        if job.data["prompt_column"] is not None:
            raise UsageError(
                f"{path}: data.messages_column and data.prompt_column are two formats; "
                "give one (a chat's prompt is its messages before the assistant's turn)"
            )


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapter a job trains: its name, config, and its own train and eval files."""

    name: str
    config: Any
    train: Path
    eval: Path
    # a config whose `total_step` the table left out takes the run's number of steps
    steps_from_run: bool = False

    def for_steps(self, total: int, where: str) -> "Adapter":
        """This adapter with `total_step` set to the run's `total` steps, if it takes it."""
        if not self.steps_from_run:
            return self
        try:
            config = dataclasses.replace(self.config, total_step=total)
        except ValueError as e:
            raise UsageError(f"{where}: {e} (total_step is the run's {total} steps)") from None
        return dataclasses.replace(self, config=config, steps_from_run=False)


class Job:
    """A fine-tune job's TOML, checked, with `--set` overrides applied: one adapter
    (`[lora]`/`[ia3]`, named "default", data in `[data]`), or several (`[[adapters]]`,
    `multi`) trained and evaluated in mixed batches."""

    def __init__(self, path: Path, overrides: list[str]):
        self.path = path
        self._data_record: dict[str, Any] | None = None
        raw = read_toml(path)
        for item in overrides:
            _override(raw, item)
        self.raw = raw
        self.model: ModelSettings = job_model(raw, path)
        self.data = _settings(raw, "data", DATA_KEYS, path)
        self.train = _settings(raw, "train", TRAIN_KEYS, path)
        self.output = _settings(raw, "output", OUTPUT_KEYS, path)
        if self.train["optimizer"] not in OPTIMIZERS:
            raise UsageError(f"{path}: train.optimizer must be one of {', '.join(OPTIMIZERS)}")
        if self.train["schedule"] not in SCHEDULES:
            raise UsageError(f"{path}: train.schedule must be one of {', '.join(SCHEDULES)}")
        _check_numbers(self, path)
        self.mesh = mesh_settings(raw.get("mesh"), str(path))
        self.multi = "adapters" in raw
        self.adapters = self._several(raw, path) if self.multi else [self._single(raw, path)]
        # the file's output.dir is taken from its directory, the default from the current one
        out = self.output["dir"]
        out = path.parent / Path(out).expanduser() if out else Path("runs", path.stem)
        # a link is followed: the run is written beside its target and swapped in there
        self.out = followed(out)

    def _config(self, kind: str, table: Any, where: str) -> tuple[Any, bool]:
        """The config of an adapter table, and whether it takes the run's number of steps
        as its `total_step` (AdaLoRA's schedule, where the table leaves it out; checked
        here with the most steps a run may have, and again once the run's are known)."""
        from .._config import TOML_TABLES

        if not isinstance(table, dict):
            raise UsageError(f"{where}: must be a table, got {table!r}")
        cls = TOML_TABLES[kind]
        from_run = "total_step" in {f.name for f in dataclasses.fields(cls)} and (
            table.get("total_step") is None
        )
        given = {**table, "total_step": MAX_COUNT} if from_run else table
        try:
            config = cls.from_dict({"task_type": TASK_TYPES[self.model.task], **given}, strict=True)
            config.check_trainable()
        except (ValueError, TypeError) as e:
            raise UsageError(f"{where}: {e}") from None
        return config, from_run

    def _single(self, raw: dict[str, Any], path: Path) -> Adapter:
        from .._config import TOML_TABLES, table_names

        tables = [t for t in TOML_TABLES if t in raw]
        if len(tables) != 1:
            raise UsageError(
                f"{path}: a job needs exactly one adapter table, {table_names()} (or "
                "[[adapters]] entries)"
            )
        for name in ("train", "eval"):
            if self.data[name] is None:
                raise UsageError(f"{path}: [data] needs {name!r}, a .jsonl or .csv file")
            if not isinstance(self.data[name], str):
                raise UsageError(
                    f"{path}: data.{name} must be a file name, got {self.data[name]!r}"
                )
        config, from_run = self._config(tables[0], raw[tables[0]], f"{path}: [{tables[0]}]")
        return Adapter(
            "default",
            config,
            path.parent / self.data["train"],
            path.parent / self.data["eval"],
            from_run,
        )

    def _several(self, raw: dict[str, Any], path: Path) -> list[Adapter]:
        from .. import BASE
        from .._config import TOML_TABLES, table_names

        entries = raw["adapters"]
        given = [t for t in TOML_TABLES if t in raw]
        if given:
            raise UsageError(
                f"{path}: [{given[0]}] and [[adapters]] are both given; a job has one adapter "
                "table, or [[adapters]] entries each with its own "
                f"{table_names('adapters.')}"
            )
        if (
            not isinstance(entries, list)
            or not entries
            or not all(isinstance(e, dict) for e in entries)
        ):
            raise UsageError(f"{path}: 'adapters' must be one or more tables, [[adapters]]")
        for key in ("train", "eval"):
            if self.data[key] is not None:
                raise UsageError(
                    f"{path}: data.{key} is set per adapter in a job with [[adapters]]; move it "
                    "into each [[adapters]] entry"
                )
        if self.output["merged"]:
            raise UsageError(f"{path}: output.merged merges one adapter; not with [[adapters]]")
        adapters: list[Adapter] = []
        for n, entry in enumerate(entries, 1):
            where = f"{path}: [[adapters]][{n}]"
            keys = ("name", "train", "eval", *adapter_tables())
            for key in entry:
                if key not in keys:
                    raise unknown_key(f"[[adapters]][{n}] of {path}", key, keys)
            for key in ("name", "train", "eval"):
                if key not in entry:
                    raise UsageError(f"{where}: missing {key!r}")
                if not isinstance(entry[key], str):
                    raise UsageError(f"{where}: {key} must be a string, got {entry[key]!r}")
            name = entry["name"]
            if not ADAPTER_NAME.fullmatch(name) or name == BASE:
                raise UsageError(
                    f"{where}: name {name!r} is not an adapter name: letters, digits, '_', '.' "
                    f"and '-', not starting with '.' or '-', and not {BASE!r} (the base model)"
                )
            taken = [a.name for a in adapters]
            if name in taken:
                raise UsageError(
                    f"{where}: name {name!r} is taken by [[adapters]][{taken.index(name) + 1}]"
                )
            kinds = [t for t in TOML_TABLES if t in entry]
            if len(kinds) != 1:
                raise UsageError(
                    f"{where}: needs exactly one of {table_names('adapters.')}, got {len(kinds)}"
                )
            if not TOML_TABLES[kinds[0]].mixed_batches:
                together = [f"[adapters.{t}]" for t, c in TOML_TABLES.items() if c.mixed_batches]
                raise UsageError(
                    f"{where}: [adapters.{kinds[0]}] cannot be trained in [[adapters]], which "
                    f"mixes its adapters in each batch, as PEFT does not for {kinds[0]} "
                    f"adapters; [[adapters]] trains {', '.join(together)} together; train a "
                    f"{kinds[0]} adapter alone, in a job with a [{kinds[0]}] table"
                )
            first = [t for t in TOML_TABLES if t in entries[0]][0]
            if kinds[0] != first:
                raise UsageError(
                    f"{where}: [adapters.{kinds[0]}] cannot join [adapters.{first}] in one model "
                    "(as in PEFT); give every entry the same kind"
                )
            config, from_run = self._config(
                kinds[0], entry[kinds[0]], f"{where}: [adapters.{kinds[0]}]"
            )
            files = (path.parent / entry["train"], path.parent / entry["eval"])
            adapters.append(Adapter(name, config, *files, from_run))
        share = self.train["batch_size"] / len(adapters)
        if share != int(share):
            raise UsageError(
                f"{path}: train.batch_size ({self.train['batch_size']}) must be a multiple of "
                f"the number of [[adapters]] ({len(adapters)}), so each batch mixes them evenly"
            )
        return adapters

    def resolved(self) -> dict[str, Any]:
        """The job as it runs, with its data files' sizes and hashes, for `job.json` (a
        resumed run must be the same job on the same data)."""
        plain = json.loads(json.dumps(self.raw, default=str))
        plain["model"] = {k: str(v) for k, v in vars(self.model).items()}
        if self._data_record is None:  # hashed once a run
            files = dict.fromkeys(p for a in self.adapters for p in (a.train, a.eval))
            self._data_record = data_record(list(files))
        return {**plain, DATA_FILES: self._data_record}


def run(args: argparse.Namespace) -> int:
    import jax

    job = Job(Path(args.config), args.overrides)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32
        return _finetune(job, overwrite=args.overwrite)


def _encoded(file: Path, columns: dict[str, str], encode: Callable[[], dict]) -> dict:
    """`encode()`'s data for `file`; its errors become one line naming the file and the
    column (`columns`: the encoder's argument name to the column), its warnings too."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            data = encode()
        except (TypeError, ValueError) as e:
            message = str(e)
            for argument, column in columns.items():
                if message.startswith(f"{argument}:"):
                    message = f"column {column!r}" + message.removeprefix(argument)
            raise UsageError(f"{file}: {message}") from None
    for w in caught:
        print(f"peftx: warning: {file}: {w.message}", file=sys.stderr)
    return data


def _load_data(job: Job, tokenizer: Any, adapter: Adapter) -> tuple[dict, dict, list[str] | None]:
    from .. import train

    d = job.data
    vocab_size = hf_config(job.model.path).get("vocab_size")
    if job.model.task == "classification":
        columns = [d["text_column"], d["label_column"]]
        rows = train.read_records(adapter.train, columns)
        held = train.read_records(adapter.eval, columns)
        labels = sorted({str(r[d["label_column"]]) for r in rows})
        unseen = sorted({str(r[d["label_column"]]) for r in held} - set(labels))
        if unseen:
            raise UsageError(f"{adapter.eval}: labels {unseen} never appear in {adapter.train}")
        names = {"texts": d["text_column"], "labels": d["label_column"]}

        def encode(file: Path, rs: list[dict]) -> dict:
            return _encoded(
                file,
                names,
                lambda: train.encode_classification(
                    tokenizer,
                    [r[d["text_column"]] for r in rs],
                    [labels.index(str(r[d["label_column"]])) for r in rs],
                    max_length=d["max_length"],
                    vocab_size=vocab_size,
                    num_labels=len(labels),
                ),
            )

        return encode(adapter.train, rows), encode(adapter.eval, held), labels
    columns = [d["text_column"]] + ([d["prompt_column"]] if d["prompt_column"] else [])
    names = {"texts": d["text_column"], "prompts": d["prompt_column"]}
    if d["messages_column"]:
        columns, names = [d["messages_column"]], {"conversations": d["messages_column"]}

    def encode_lm(file: Path) -> dict:
        rs = train.read_records(file, columns)
        rows = dict(max_length=d["max_length"], pack=d["pack"], vocab_size=vocab_size)
        if d["messages_column"]:
            chats = [r[d["messages_column"]] for r in rs]
            data = _encoded(file, names, lambda: train.encode_chat(tokenizer, chats, **rows))
        else:
            texts = [r[d["text_column"]] for r in rs]
            prompts = [r[d["prompt_column"]] for r in rs] if d["prompt_column"] else None
            data = _encoded(
                file, names, lambda: train.encode_causal_lm(tokenizer, texts, prompts, **rows)
            )
        if d["pack"]:
            print(
                f"packed {file}: all {len(rs)} examples, each whole in one row, in "
                f"{len(data['input_ids'])} rows of {d['max_length']} tokens"
            )
        return data

    data = encode_lm(adapter.train), encode_lm(adapter.eval)
    counts = [train.supervised_tokens(x) for x in data]
    print(f"supervised tokens: {counts[0]} in {adapter.train}, {counts[1]} in {adapter.eval}")
    return *data, None


def _datasets(job: Job, tokenizer: Any) -> tuple[list[tuple[dict, dict]], Any]:
    """Each adapter's (train, eval) data, and the labels (classification: a list, or each
    adapter's by name). Several adapters' rows are padded to one length, so that they mix
    in a batch."""
    from .. import train

    loaded = [_load_data(job, tokenizer, a) for a in job.adapters]
    pairs = [(tr, ev) for tr, ev, _ in loaded]
    if not job.multi:
        return pairs, loaded[0][2]
    length = max(d["input_ids"].shape[1] for pair in pairs for d in pair)
    pairs = [(train.pad_to(tr, length), train.pad_to(ev, length)) for tr, ev in pairs]
    if loaded[0][2] is None:
        return pairs, None
    labels = {a.name: lab for a, (_, _, lab) in zip(job.adapters, loaded, strict=True)}
    first = job.adapters[0]
    for a in job.adapters[1:]:
        if len(labels[a.name]) != len(labels[first.name]):
            raise UsageError(
                f"{a.train} has {len(labels[a.name])} labels, {first.train} "
                f"{len(labels[first.name])}: the adapters share one classification head size"
            )
    return pairs, labels


def _saved_head_classes(path: Path) -> int | None:
    """The classes of the classification head saved in the checkpoint at `path` (the rows
    of its `classifier` or `score` weight; headers only), or None without one."""
    from ..models._checkpoint import Reader

    with Reader(path) as reader:
        heads = [k for k in reader.keys() if re.fullmatch(r"(classifier|score)\.weight", k)]
        return reader.shape(heads[0])[0] if heads else None


def _model(job: Job, labels: Any, key: Any, mesh: Any, rules: str | None) -> Any:
    """The base model with every adapter of the job on it (the first one active), read
    straight onto `mesh` when there is one."""
    import jax
    import jax.numpy as jnp

    from .. import QuantizationConfig, get_peft_model, models, quantize_model

    first = next(iter(labels.values())) if isinstance(labels, dict) else labels
    extra = {"num_labels": len(first)} if first else {}
    saved = _saved_head_classes(job.model.path) if first else None
    if saved is not None and saved != len(first):
        raise UsageError(
            f"{job.adapters[0].train} has {len(first)} labels ({', '.join(first)}), but the "
            f"classifier saved in {job.model.path} has {saved}: give data with {saved} "
            "labels, or fine-tune from its base model (a checkpoint without a classifier)"
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*initialized fresh.*")
        model = models.from_pretrained(
            job.model.path,
            model_class=model_class_for(job.model.task, job.model.path),
            dtype=jnp.bfloat16 if job.model.dtype == "bfloat16" else jnp.float32,
            layout=job.model.layout,
            **on_mesh(mesh, rules),
            **extra,
        )
    if job.train["quantize"]:
        table = job.raw.get("quantization") or {"load_in_4bit": True}
        model = quantize_model(model, QuantizationConfig.from_dict(table))
    first, *rest = job.adapters
    model = get_peft_model(model, first.config, key=key, adapter_name=first.name)
    for n, a in enumerate(rest, 1):
        model = model.add_adapter(a.name, a.config, key=jax.random.fold_in(key, n))
    return model


def _optimizer(job: Job, total_steps: int) -> tuple[Any, Any]:
    import optax

    t = job.train
    lr, warmup = t["learning_rate"], min(t["warmup_steps"], total_steps)
    decay = max(total_steps - warmup, 1)
    tail = {
        "constant": optax.constant_schedule(lr),
        "linear": optax.linear_schedule(lr, 0.0, decay),
        "cosine": optax.cosine_decay_schedule(lr, decay),
    }[t["schedule"]]
    schedule = optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), tail], [warmup])
    update = {
        "adamw": lambda: optax.adamw(schedule, weight_decay=t["weight_decay"]),
        "adam": lambda: optax.adam(schedule),
        "sgd": lambda: optax.sgd(schedule),
    }[t["optimizer"]]()
    clip = optax.clip_by_global_norm(t["max_grad_norm"]) if t["max_grad_norm"] else None
    return (optax.chain(clip, update) if clip else update), schedule


def _eval_set(pairs: list[tuple[dict, dict]], ids: Any, base: int) -> dict:
    """Every adapter's eval rows twice, routed to the adapter (group 2i) and to the base
    (group 2i + 1), as one dataset for `make_eval_step(groups=...)`."""
    import numpy as np

    parts = []
    for i, (_, data) in enumerate(pairs):
        for group, route in ((2 * i, ids[i]), (2 * i + 1, base)):
            rows = len(data["input_ids"])
            extra = {"adapter_ids": np.full(rows, route, np.int32), "group": np.full(rows, group)}
            parts.append({**data, **extra})
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _evaluate(job: Job, eval_step: Any, state: Any, frozen: Any, data: dict) -> dict:
    """The eval metrics; with several adapters, each one's on its own eval data, and the
    base model's on each (`{name: metrics, ..., "__base__": {name: metrics}}`)."""
    from .. import BASE, train

    sums: dict[str, Any] = {}
    for batch in train.eval_batches(data, job.train["eval_batch_size"]):
        for k, v in eval_step(state.trainable, frozen, batch).items():
            sums[k] = sums.get(k, 0.0) + v
    if not job.multi:
        return train.summarize({k: float(v) for k, v in sums.items()})
    pick = lambda g: train.summarize({k: float(v[g]) for k, v in sums.items()})  # noqa: E731
    names = [a.name for a in job.adapters]
    out = {name: pick(2 * i) for i, name in enumerate(names)}
    return {**out, BASE: {name: pick(2 * i + 1) for i, name in enumerate(names)}}


def _eval_records(job: Job, step: int, metrics: dict) -> list[dict]:
    """`metrics.jsonl` records of an evaluation: one, or one per adapter and dataset."""
    from .. import BASE

    if not job.multi:
        return [{"step": step, "split": "eval", **metrics}]
    records = []
    for a in job.adapters:
        for who, m in ((a.name, metrics[a.name]), (BASE, metrics[BASE][a.name])):
            records.append({"step": step, "split": "eval", "adapter": who, "data": a.name, **m})
    return records


def _describe(metrics: dict[str, float]) -> str:
    return ", ".join(
        f"{k} {v:.2%}" if k == "accuracy" else f"{k} {v:.4g}" for k, v in metrics.items()
    )


def _report(job: Job, when: str, metrics: dict) -> None:
    from .. import BASE

    if not job.multi:
        print(f"{when} {_describe(metrics)}")
        return
    print(when.rstrip())
    for a in job.adapters:
        base = _describe(metrics[BASE][a.name])
        print(f"  {a.name}: {_describe(metrics[a.name])} (on its data, {BASE}: {base})")


def _protected(job: Job) -> list[tuple[str, Path]]:
    """What a run's output may not be or hold: the model and the data."""
    files = [("data file", p) for a in job.adapters for p in (a.train, a.eval)]
    return [("model directory", job.model.path), *files]


def _check_finite(n: int, metrics: dict, last_checkpoint: Path | None, lr: float) -> None:
    """`RunFailed` if step `n`'s loss or gradient norm is not finite."""
    if bool(metrics["finite"]):
        return
    loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
    kept = (
        f"the last good checkpoint stays in {last_checkpoint}"
        if last_checkpoint is not None
        else "no checkpoint was saved"
    )
    raise RunFailed(
        f"the run diverged at step {n}: loss {loss}, gradient norm {norm}; lower "
        f"train.learning_rate (now {lr:g}) or set train.max_grad_norm. No adapter was "
        f"written; {kept}"
    )


def _restore(ckpt_dir: Path, state: Any, total: int) -> tuple[Any, dict] | None:
    """The newest checkpoint in `ckpt_dir` that restores, and its info: a damaged one is
    passed over with one line saying so."""
    from .. import train
    from .._errors import CheckpointError

    for ckpt in reversed(train.checkpoints(ckpt_dir)):
        try:
            restored, info = train.restore_checkpoint(ckpt, state)
            batches, before = info.get("batches"), info.get("before")
            if not isinstance(batches, int) or not 1 <= batches <= total:
                raise CheckpointError(f"'batches' is {batches!r}, not a step in 1..{total}")
            if batches != info["step"]:
                raise CheckpointError(f"'batches' is {batches}, 'step' {info['step']}")
            if not isinstance(before, dict):
                raise CheckpointError(f"'before' is {before!r}, not the first evaluation")
            return restored, info
        except CheckpointError as e:
            print(f"checkpoint {ckpt} is damaged, passed over: {' '.join(str(e).split())}")
    return None


def _finetune(job: Job, *, overwrite: bool) -> int:
    from ..sharding._hosts import writes_files

    protected = _protected(job)
    plan_output(job.out, job.resolved(), overwrite=overwrite, protected=protected)
    mesh, rules = run_mesh(job.mesh)
    # of several processes, process 0 reports (errors come from each)
    with contextlib.redirect_stdout(sys.stdout if writes_files() else io.StringIO()):
        _run(job, mesh, rules, overwrite=overwrite, protected=protected)
    return 0


def _run(
    job: Job, mesh: Any, rules: str | None, *, overwrite: bool, protected: list[tuple[str, Path]]
) -> None:
    import jax

    from .. import train
    from ..sharding import batch_parts
    from ..sharding._hosts import wait_for_all, writes_files

    if mesh is not None:
        parts = batch_parts(mesh)
        if job.train["batch_size"] % parts:
            raise UsageError(
                f"train.batch_size ({job.train['batch_size']}) must be a multiple of data x "
                f"fsdp = {parts}, the parts each batch is split into on this mesh"
            )
    # the whole job is checked (model, data, adapters) before the output is touched
    t = job.train
    tokenizer = load_tokenizer(job.model.path)
    pairs, labels = _datasets(job, tokenizer)
    names = [a.name for a in job.adapters]
    batch = t["batch_size"] * t["grad_accumulation"]
    share = batch // len(names)  # each adapter's rows of a step
    per_epoch = max(train.batches_per_epoch(tr, share) for tr, _ in pairs)
    total = t["steps"] or t["epochs"] * per_epoch
    if total > MAX_COUNT:
        raise UsageError(f"train.epochs makes {total} steps, more than {MAX_COUNT}")
    job.adapters = [a.for_steps(total, f"{job.path}: adapter {a.name!r}") for a in job.adapters]
    optimizer, schedule = _optimizer(job, total)
    model_key, train_key = jax.random.split(jax.random.key(t["seed"]))
    peft_model = _model(job, labels, model_key, mesh, rules)
    adapters = names if job.multi else None
    state, frozen = train.init_state(
        peft_model, optimizer, key=train_key, adapters=adapters, mesh=mesh, rules=rules
    )
    if mesh is not None:
        print(placement_line(mesh, rules, (state.trainable, frozen), state.opt_state))
    with open_run(job.out, job.resolved(), overwrite=overwrite, protected=protected) as run:
        for name in names:
            if job.multi:
                print(f"{name}: ", end="")
            peft_model.set_adapter(name).print_trainable_parameters()
        trained = _train(
            job, run, state, frozen, peft_model, pairs, labels, total, (optimizer, schedule), mesh
        )
        written = _finish(job, run.work, *trained, frozen, tokenizer, labels, pairs)
        if writes_files():
            run.commit()
    wait_for_all(f"peftx finetune {job.out}")  # every process ends with the files in place
    print("wrote\n  " + "\n  ".join(written))


def _train(
    job: Job,
    run: Run,
    state: Any,
    frozen: Any,
    peft_model: Any,
    pairs: list[tuple[dict, dict]],
    labels: Any,
    total: int,
    optimizer: tuple[Any, Any],
    mesh: Any,
) -> tuple[Any, dict, dict]:
    """Train `state` for the job's steps in `run.work` (from its checkpoints when it
    resumes), logging and evaluating: the trained state and the metrics before and
    after, or `RunFailed`."""
    import numpy as np
    from tqdm import tqdm

    from .. import BASE, train
    from ..sharding._hosts import own_rows, writes_files

    out, t = run.work, job.train
    names = [a.name for a in job.adapters]
    batch = t["batch_size"] * t["grad_accumulation"]
    optimizer, schedule = optimizer
    initial = state.trainable
    loss_fn = train.classification_loss if labels else train.causal_lm_loss
    step_fn = train.make_train_step(
        loss_fn, optimizer, grad_accumulation=t["grad_accumulation"], mesh=mesh
    )
    if job.multi:
        ids = np.asarray(peft_model.adapter_ids(names))
        eval_data = _eval_set(pairs, ids, int(peft_model.adapter_ids([BASE])[0]))
        eval_step = train.make_eval_step(loss_fn, groups=2 * len(names))
    else:
        eval_data, eval_step = pairs[0][1], train.make_eval_step(loss_fn)
    evaluate = lambda s: _evaluate(job, eval_step, s, frozen, eval_data)  # noqa: E731
    log = Log(out / "metrics.jsonl")
    report = writes_files()  # process 0 of several

    ckpt_dir, start = out / "checkpoints", 0
    restored = _restore(ckpt_dir, state, total) if run.resume else None
    last_ckpt = None
    if restored is not None:
        state, info = restored
        start, before = info["batches"], info["before"]
        last_ckpt = ckpt_dir / f"checkpoint-{start:08d}"
        log.truncate(after=start)
        print(f"resuming from {last_ckpt} (step {start} of {total})")
    else:
        if run.resume and train.checkpoints(ckpt_dir):
            print(f"no checkpoint in {ckpt_dir} restores: starting from step 0")
        log.truncate(after=0)
        before = evaluate(state)
        log.write(*_eval_records(job, 0, before))
    _report(job, "before fine-tuning:", before)

    seed, ga = t["seed"], t["grad_accumulation"]
    if job.multi:
        mixed = train.mixed_batches(
            [tr for tr, _ in pairs], t["batch_size"], seed=seed, start=start, grad_accumulation=ga
        )
        batches = ({**b, "adapter_ids": ids[b.pop("source")]} for b in mixed)
    else:
        batches = train.train_batches(
            pairs[0][0], t["batch_size"], seed=seed, start=start, grad_accumulation=ga
        )
    every = lambda n, k: bool(k) and n % k == 0  # noqa: E731
    check = lambda n, m: _check_finite(n, m, last_ckpt, t["learning_rate"])  # noqa: E731
    tick, seen, pending = time.perf_counter(), 0, None
    with tqdm(
        total=total,
        initial=start,
        desc="fine-tuning",
        unit="step",
        dynamic_ncols=True,
        disable=not report,
    ) as bar:
        for n in range(start + 1, total + 1):
            state, metrics = step_fn(state, frozen, own_rows(mesh, next(batches)))
            if pending is not None:  # a step late, so the device is never left waiting
                check(*pending)
            pending = (n, metrics)
            seen += batch
            bar.update()
            if every(n, t["log_every"]) or n == total:
                check(n, metrics)
                loss = float(metrics["loss"])
                rate = seen / (time.perf_counter() - tick)
                lr = float(schedule(n - 1))
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", ex_s=f"{rate:.0f}")
                log.write(
                    {
                        "step": n,
                        "split": "train",
                        "loss": loss,
                        "learning_rate": lr,
                        "examples_per_s": rate,
                        "grad_norm": float(metrics["grad_norm"]),
                    }
                )
                tick, seen = time.perf_counter(), 0
            if every(n, t["eval_every"]) and n != total:
                log.write(*_eval_records(job, n, evaluate(state)))
                if report:
                    plot(log.path, out / "curves.png")
            if every(n, t["checkpoint_every"]) and n != total:
                check(n, metrics)
                last_ckpt = train.save_checkpoint(
                    ckpt_dir,
                    state,
                    frozen,
                    info={"batches": n, "before": before},
                    keep=job.output["keep_checkpoints"],
                )
    if pending is not None:
        check(*pending)
    _check_trained(initial, state.trainable, total)
    after = evaluate(state)
    log.write(*_eval_records(job, total, after))
    if report:
        plot(log.path, out / "curves.png")
    _report(job, "after fine-tuning: ", after)
    return state, before, after


def _check_trained(initial: Any, trained: Any, steps: int) -> None:
    """`RunFailed` if a trained array is not finite, or none changed in training."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    pairs = list(
        zip(
            jax.tree.leaves(eqx.filter(initial, eqx.is_array)),
            jax.tree.leaves(eqx.filter(trained, eqx.is_array)),
            strict=True,
        )
    )
    if not all(bool(jnp.isfinite(b).all()) for _, b in pairs):
        raise RunFailed("the trained weights are not finite; no adapter was written")
    if all(bool(jnp.array_equal(a, b)) for a, b in pairs):
        raise RunFailed(
            f"{steps} steps changed no trained weight: nothing was learned (is every "
            "gradient zero?); no adapter was written"
        )


def _serving_check(model: Any, names: list[str], pairs: list[tuple[dict, dict]]) -> dict:
    """One batch with a row for each adapter and one for the base (`__base__`), each
    row's logits against that adapter run alone (`set_adapter`) and the base alone."""
    import equinox as eqx
    import jax.numpy as jnp
    import numpy as np

    from .. import BASE, train

    logits = eqx.filter_jit(train.logits)
    serve = [*names, BASE]
    # adapter i gets a row of its eval data; the base the row of the first adapter's
    rows = [pairs[i][1] for i in range(len(names))] + [pairs[0][1]]
    ids = jnp.asarray(np.stack([r["input_ids"][0] for r in rows]))
    mask = jnp.asarray(np.stack([r["attention_mask"][0] for r in rows]))
    mixed = logits(
        model, {"input_ids": ids, "attention_mask": mask, "adapter_ids": model.adapter_ids(serve)}
    )
    alone = jnp.stack(
        [
            logits(
                model.disable_adapters() if name == BASE else model.set_adapter(name),
                {"input_ids": ids[i : i + 1], "attention_mask": mask[i : i + 1]},
            )[0]
            for i, name in enumerate(serve)
        ]
    )
    eps = float(jnp.finfo(mixed.dtype).eps)
    mixed, alone = np.asarray(mixed, np.float32), np.asarray(alone, np.float32)
    tolerance = 64 * eps * max(1.0, float(np.abs(alone).max()))  # as the batch size changes
    return {
        "rows": serve,
        "max_abs_diff": float(np.abs(mixed - alone).max()),
        "tolerance": tolerance,
    }


def _finish(
    job: Job,
    work: Path,
    state: Any,
    before: dict,
    after: dict,
    frozen: Any,
    tokenizer: Any,
    labels: Any,
    pairs: list[tuple[dict, dict]],
) -> list[str]:
    """Write the run's results into `work`; returns what was written, by where it will be
    once the run is committed to `output.dir`."""
    from .. import models, train
    from ..sharding._hosts import writes_files

    out = job.out
    peft_model = train.trained_model(state, frozen)
    summary = {"before": before, "after": after, "steps": int(state.step)}
    for split, metrics in (("before", before), ("after", after)):
        if not _all_finite(metrics):
            raise RunFailed(
                f"the evaluation {split} training is not finite ({metrics}); no adapter was written"
            )
    if not labels:
        _check_learned(job, before, after, hf_config(job.model.path)["vocab_size"])
    if job.multi:
        check = _serving_check(peft_model, [a.name for a in job.adapters], pairs)
        print(
            f"served {check['rows']} in one batch: max |mixed - each alone| = "
            f"{check['max_abs_diff']:.3g} (tolerance {check['tolerance']:.3g})"
        )
        if not check["max_abs_diff"] <= check["tolerance"]:
            raise RunFailed(
                f"serving check failed: a mixed batch differs from each adapter run alone by "
                f"{check['max_abs_diff']:.3g}, over the tolerance {check['tolerance']:.3g}; "
                "nothing was saved"
            )
        summary["serving"] = check
    peft_model.save_pretrained(work / "adapter")  # every process: the arrays are gathered
    writer = writes_files()  # process 0 of several
    if writer:
        tokenizer.save_pretrained(work / "adapter")
    adapter = out / "adapter"
    if job.multi:  # PEFT's layout: an adapter not named "default" in the subfolder of its name
        where = {a.name: adapter if a.name == "default" else adapter / a.name for a in job.adapters}
        written = [f"adapter {name!r} (PEFT format): {d}" for name, d in where.items()]
    else:
        written = [f"adapter (PEFT format): {adapter}"]
    if labels:
        if writer:
            write_text(work / "labels.json", json.dumps(labels))
        written.append(f"labels: {out / 'labels.json'}")
    if job.output["merged"]:
        if job.train["quantize"]:
            raise UsageError(
                "output.merged needs a dense base; merge a QLoRA adapter with "
                "`peftx merge BASE_DIR ADAPTER_DIR OUT_DIR`"
            )
        models.save_pretrained(peft_model.merge_and_unload(safe_merge=True), work / "merged")
        if writer:
            copy_base_files(job.model.path, work / "merged")
        written.append(f"merged model: {out / 'merged'}")
    written += [f"metrics: {out / 'metrics.jsonl'}", f"curves: {out / 'curves.png'}"]
    if writer:
        write_text(work / "summary.json", json.dumps(summary, indent=2))
        shutil.rmtree(work / "checkpoints", ignore_errors=True)
    return written


# how near ln(vocab_size) an eval loss is the uniform prediction's (float rounding)
UNIFORM_TOLERANCE = 1e-4


def _collapsed(before: float, after: float, vocab_size: int) -> bool:
    """Whether a causal LM's eval losses before and after training say the run collapsed:
    the loss after is not below the uniform prediction's, ln(vocab_size), and is worse
    than before or is the uniform prediction's itself (within `UNIFORM_TOLERANCE`)."""
    uniform = math.log(vocab_size)
    margin = UNIFORM_TOLERANCE * uniform
    return after >= uniform - margin and (after > before or after <= uniform + margin)


def _check_learned(job: Job, before: dict, after: dict, vocab_size: int) -> None:
    """`RunFailed` if a causal LM's run collapsed for any of its adapters (`_collapsed`:
    it diverged to uniform output, or worse, without overflowing)."""
    if job.multi:
        losses = [(f"adapter {a.name!r}: ", before[a.name], after[a.name]) for a in job.adapters]
    else:
        losses = [("", before, after)]
    for who, b, a in losses:
        if _collapsed(b["loss"], a["loss"], vocab_size):
            raise RunFailed(
                f"the run collapsed: {who}eval loss {a['loss']:.4g} after training "
                f"({b['loss']:.4g} before) is no better than a uniform prediction over the "
                f"{vocab_size} tokens (ln {vocab_size} = {math.log(vocab_size):.4g}); lower "
                f"train.learning_rate (now {job.train['learning_rate']:g}). No adapter was "
                "written"
            )


def _all_finite(tree: Any) -> bool:
    if isinstance(tree, dict):
        return all(_all_finite(v) for v in tree.values())
    return not isinstance(tree, float) or math.isfinite(tree)


def _finite_or_null(value: Any) -> Any:
    """A record's value as strict JSON allows: a non-finite float becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    return value


class Log:
    """`metrics.jsonl`: one JSON object per line, appended as the run goes (by process 0
    of several)."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, *records: dict[str, Any]) -> None:
        from ..sharding._hosts import writes_files

        if not writes_files():
            return
        lines = "".join(json.dumps(_finite_or_null(r), allow_nan=False) + "\n" for r in records)
        data = lines.encode("utf-8")
        with naming_a_full_disk(self.path, len(data)), self.path.open("ab") as f:
            f.write(data)

    def truncate(self, after: int) -> None:
        """Drop the records past step `after` (a killed run's, after its last checkpoint),
        and any line a kill tore."""
        from ..sharding._hosts import writes_files

        if not writes_files() or not self.path.exists():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                if record["step"] <= after:
                    kept.append(line)
        write_text(self.path, "".join(line + "\n" for line in kept))


def plot(metrics: Path, png: Path) -> None:
    """The train loss and the eval metrics against the step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines()]
    train_rows = [r for r in records if r["split"] == "train"]
    eval_rows = [r for r in records if r["split"] == "eval"]
    extra = "accuracy" if eval_rows and "accuracy" in eval_rows[0] else "perplexity"
    series: dict[str, list[dict]] = {}  # one eval line, or one per adapter and dataset
    for r in eval_rows:
        who, data = r.get("adapter"), r.get("data")
        label = "eval" if who is None else who if who == data else f"{who} on {data}"
        series.setdefault(label, []).append(r)
    fig, (ax_loss, ax_extra) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], label="train")
    for label, rows in series.items():
        steps = [r["step"] for r in rows]
        ax_loss.plot(steps, [r["loss"] for r in rows], "o-", label=label)
        ax_extra.plot(steps, [r[extra] for r in rows], "o-", label=label)
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_loss.legend()
    if len(series) > 1:
        ax_extra.legend()
    ax_extra.set(xlabel="step", ylabel=extra, title=f"eval {extra}")
    fig.tight_layout()
    tmp = temporary_file(png)
    try:
        fig.savefig(tmp, dpi=80, format="png")
        os.replace(tmp, png)
    finally:
        plt.close(fig)
        Path(tmp).unlink(missing_ok=True)
