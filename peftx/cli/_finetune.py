"""`peftx finetune JOB.toml`: load a model, put an adapter on it, train it on a JSONL/CSV
dataset with checkpoints it resumes from, evaluate before and after, and write the
adapter in PEFT's format."""

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import time
import tomllib
import warnings
from pathlib import Path
from typing import Any

from ..models._checkpoint import temporary_file
from ._common import (
    BUNDLED_MODEL,
    ModelSettings,
    UsageError,
    job_model,
    model_class_for,
    read_toml,
    unknown_key,
)

DATA_KEYS = {
    "train": None,
    "eval": None,
    "text_column": "text",
    "label_column": "label",
    "prompt_column": None,
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
PATHS = {("model", "path"), ("data", "train"), ("data", "eval")}
TASK_TYPES = {"classification": "SEQ_CLS", "causal-lm": "CAUSAL_LM"}
ADAPTER_KEYS = ("name", "train", "eval", "lora", "ia3")
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
        "--overwrite", action="store_true", help="replace a finished output directory"
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


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapter a job trains: its name, config, and its own train and eval files."""

    name: str
    config: Any
    train: Path
    eval: Path


class Job:
    """A fine-tune job's TOML, checked, with `--set` overrides applied: one adapter
    (`[lora]`/`[ia3]`, named "default", data in `[data]`), or several (`[[adapters]]`,
    `multi`) trained and evaluated in mixed batches."""

    def __init__(self, path: Path, overrides: list[str]):
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
        positive = ["batch_size", "eval_batch_size", "grad_accumulation", "epochs", "log_every"]
        optional = ["steps", "eval_every", "checkpoint_every"]
        for table, key in [("data", "max_length"), ("output", "keep_checkpoints")] + [
            ("train", k) for k in positive + optional
        ]:
            value = getattr(self, table)[key]
            if value is None and key in optional:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"{path}: {table}.{key} must be a positive integer, got {value!r}")
        for key in ("learning_rate", "weight_decay", "warmup_steps", "max_grad_norm"):
            value = self.train[key]
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise UsageError(f"{path}: train.{key} must be a number >= 0, got {value!r}")
        self.multi = "adapters" in raw
        self.adapters = self._several(raw, path) if self.multi else [self._single(raw, path)]
        out = self.output["dir"] or f"runs/{path.stem}"
        self.out = Path(out)

    def _config(self, kind: str, table: Any, where: str) -> Any:
        from .._config import _TOML_TABLES

        if not isinstance(table, dict):
            raise UsageError(f"{where}: must be a table, got {table!r}")
        try:
            return _TOML_TABLES[kind].from_dict(
                {"task_type": TASK_TYPES[self.model.task], **table}, strict=True
            )
        except (ValueError, TypeError) as e:
            raise UsageError(f"{where}: {e}") from None

    def _single(self, raw: dict[str, Any], path: Path) -> Adapter:
        from .._config import _TOML_TABLES

        tables = [t for t in _TOML_TABLES if t in raw]
        if len(tables) != 1:
            raise UsageError(
                f"{path}: a job needs exactly one adapter table, [lora] or [ia3] (or "
                "[[adapters]] entries)"
            )
        for name in ("train", "eval"):
            if self.data[name] is None:
                raise UsageError(f"{path}: [data] needs {name!r}, a .jsonl or .csv file")
        config = self._config(tables[0], raw[tables[0]], f"{path}: [{tables[0]}]")
        return Adapter(
            "default", config, path.parent / self.data["train"], path.parent / self.data["eval"]
        )

    def _several(self, raw: dict[str, Any], path: Path) -> list[Adapter]:
        from .. import BASE
        from .._config import _TOML_TABLES

        entries = raw["adapters"]
        given = [t for t in _TOML_TABLES if t in raw]
        if given:
            raise UsageError(
                f"{path}: [{given[0]}] and [[adapters]] are both given; a job has one adapter "
                "table, or [[adapters]] entries each with its own [adapters.lora] or [adapters.ia3]"
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
            for key in entry:
                if key not in ADAPTER_KEYS:
                    raise unknown_key(f"[[adapters]][{n}] of {path}", key, ADAPTER_KEYS)
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
            kinds = [t for t in _TOML_TABLES if t in entry]
            if len(kinds) != 1:
                raise UsageError(
                    f"{where}: needs exactly one of [adapters.lora] or [adapters.ia3], got "
                    f"{len(kinds)}"
                )
            first = [t for t in _TOML_TABLES if t in entries[0]][0]
            if kinds[0] != first:
                raise UsageError(
                    f"{where}: [adapters.{kinds[0]}] cannot join [adapters.{first}] in one model "
                    "(as in PEFT); give every entry the same kind"
                )
            config = self._config(kinds[0], entry[kinds[0]], f"{where}: [adapters.{kinds[0]}]")
            files = (path.parent / entry["train"], path.parent / entry["eval"])
            adapters.append(Adapter(name, config, *files))
        share = self.train["batch_size"] / len(adapters)
        if share != int(share):
            raise UsageError(
                f"{path}: train.batch_size ({self.train['batch_size']}) must be a multiple of "
                f"the number of [[adapters]] ({len(adapters)}), so each batch mixes them evenly"
            )
        return adapters

    def resolved(self) -> dict[str, Any]:
        """The job as it runs, for `job.json` (a resumed run must be the same job)."""
        plain = json.loads(json.dumps(self.raw, default=str))
        plain["model"] = {k: str(v) for k, v in vars(self.model).items()}
        return plain


def run(args: argparse.Namespace) -> int:
    import jax

    job = Job(Path(args.config), args.overrides)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32
        return _finetune(job, overwrite=args.overwrite)


def _prepare_output(job: Job, overwrite: bool) -> bool:
    """Make the output directory ready; True when a run of this job is to be resumed."""
    from ..train import latest_checkpoint

    out, resolved = job.out, job.resolved()
    if out.exists() and not out.is_dir():
        raise UsageError(f"output.dir {str(out)!r} is a file")
    if (out / "summary.json").exists() and not overwrite:
        raise UsageError(
            f"{out} holds a finished run; pass --overwrite to replace it, or set output.dir"
        )
    if overwrite and out.exists():
        shutil.rmtree(out)
    saved = out / "job.json"
    if saved.exists() and latest_checkpoint(out / "checkpoints") is None:
        shutil.rmtree(out)  # a run that failed before its first checkpoint: nothing to keep
    if saved.exists():
        if json.loads(saved.read_text()) != resolved:
            raise UsageError(
                f"{out} holds checkpoints of a different job; pass --overwrite to start over, "
                "or set output.dir"
            )
        return True
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"output.dir {str(out)!r} is not empty; pass --overwrite or pick another")
    out.mkdir(parents=True, exist_ok=True)
    _write(saved, json.dumps(resolved, indent=2))
    return False


def _write(path: Path, text: str) -> None:
    tmp = temporary_file(path)
    Path(tmp).write_text(text)
    os.replace(tmp, path)


def _load_data(job: Job, tokenizer: Any, adapter: Adapter) -> tuple[dict, dict, list[str] | None]:
    from .. import train

    d = job.data
    if job.model.task == "classification":
        columns = [d["text_column"], d["label_column"]]
        rows = train.read_records(adapter.train, columns)
        held = train.read_records(adapter.eval, columns)
        labels = sorted({str(r[d["label_column"]]) for r in rows})
        unseen = sorted({str(r[d["label_column"]]) for r in held} - set(labels))
        if unseen:
            raise UsageError(f"{adapter.eval}: labels {unseen} never appear in {adapter.train}")

        def encode(rs: list[dict]) -> dict:
            return train.encode_classification(
                tokenizer,
                [str(r[d["text_column"]]) for r in rs],
                [labels.index(str(r[d["label_column"]])) for r in rs],
                max_length=d["max_length"],
            )

        return encode(rows), encode(held), labels
    columns = [d["text_column"]] + ([d["prompt_column"]] if d["prompt_column"] else [])

    def encode_lm(file: Path) -> dict:
        rs = train.read_records(file, columns)
        prompts = [str(r[d["prompt_column"]]) for r in rs] if d["prompt_column"] else None
        return train.encode_causal_lm(
            tokenizer,
            [str(r[d["text_column"]]) for r in rs],
            prompts,
            max_length=d["max_length"],
            pack=d["pack"],
        )

    return encode_lm(adapter.train), encode_lm(adapter.eval), None


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


def _model(job: Job, labels: Any, key: Any) -> Any:
    """The base model with every adapter of the job on it (the first one active)."""
    import jax
    import jax.numpy as jnp

    from .. import QuantizationConfig, get_peft_model, models, quantize_model

    first = next(iter(labels.values())) if isinstance(labels, dict) else labels
    extra = {"num_labels": len(first)} if first else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*initialized fresh.*")
        model = models.from_pretrained(
            job.model.path,
            model_class=model_class_for(job.model.task, job.model.path),
            dtype=jnp.bfloat16 if job.model.dtype == "bfloat16" else jnp.float32,
            layout=job.model.layout,
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


def _finetune(job: Job, *, overwrite: bool) -> int:
    import jax
    import numpy as np
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from .. import BASE, train

    resume = _prepare_output(job, overwrite)
    out, t = job.out, job.train
    tokenizer = AutoTokenizer.from_pretrained(job.model.path, local_files_only=True)
    pairs, labels = _datasets(job, tokenizer)
    names = [a.name for a in job.adapters]
    batch = t["batch_size"] * t["grad_accumulation"]
    share = batch // len(names)  # each adapter's rows of a step
    per_epoch = max(train.batches_per_epoch(tr, share) for tr, _ in pairs)
    total = t["steps"] or t["epochs"] * per_epoch
    optimizer, schedule = _optimizer(job, total)
    model_key, train_key = jax.random.split(jax.random.key(t["seed"]))
    peft_model = _model(job, labels, model_key)
    for name in names:
        if job.multi:
            print(f"{name}: ", end="")
        peft_model.set_adapter(name).print_trainable_parameters()
    adapters = names if job.multi else None
    state, frozen = train.init_state(peft_model, optimizer, key=train_key, adapters=adapters)
    loss_fn = train.classification_loss if labels else train.causal_lm_loss
    step_fn = train.make_train_step(loss_fn, optimizer, grad_accumulation=t["grad_accumulation"])
    if job.multi:
        ids = np.asarray(peft_model.adapter_ids(names))
        eval_data = _eval_set(pairs, ids, int(peft_model.adapter_ids([BASE])[0]))
        eval_step = train.make_eval_step(loss_fn, groups=2 * len(names))
    else:
        eval_data, eval_step = pairs[0][1], train.make_eval_step(loss_fn)
    evaluate = lambda s: _evaluate(job, eval_step, s, frozen, eval_data)  # noqa: E731
    log = Log(out / "metrics.jsonl")

    ckpt_dir, start = out / "checkpoints", 0
    last = train.latest_checkpoint(ckpt_dir) if resume else None
    if last is not None:
        state, info = train.restore_checkpoint(last, state)
        start = info["batches"]
        before = info["before"]
        log.truncate(after=start)
        print(f"resuming from {last} (step {start} of {total})")
    else:
        log.truncate(after=0)
        before = evaluate(state)
        log.write(*_eval_records(job, 0, before))
    _report(job, "before fine-tuning:", before)

    seed = t["seed"]
    if job.multi:
        mixed = train.mixed_batches(
            [tr for tr, _ in pairs],
            batch,
            seed=seed,
            start=start,
            micro_batches=t["grad_accumulation"],
        )
        batches = ({**b, "adapter_ids": ids[b.pop("source")]} for b in mixed)
    else:
        batches = train.train_batches(pairs[0][0], batch, seed=seed, start=start)
    every = lambda n, k: bool(k) and n % k == 0  # noqa: E731
    tick, seen = time.perf_counter(), 0
    with tqdm(
        total=total, initial=start, desc="fine-tuning", unit="step", dynamic_ncols=True
    ) as bar:
        for n in range(start + 1, total + 1):
            state, metrics = step_fn(state, frozen, next(batches))
            seen += batch
            bar.update()
            if every(n, t["log_every"]) or n == total:
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
                plot(log.path, out / "curves.png")
            if every(n, t["checkpoint_every"]) and n != total:
                train.save_checkpoint(
                    ckpt_dir,
                    state,
                    frozen,
                    info={"batches": n, "before": before},
                    keep=job.output["keep_checkpoints"],
                )
    after = evaluate(state)
    log.write(*_eval_records(job, total, after))
    plot(log.path, out / "curves.png")
    _report(job, "after fine-tuning: ", after)
    return _finish(job, state, frozen, tokenizer, labels, before, after, pairs)


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
    state: Any,
    frozen: Any,
    tokenizer: Any,
    labels: Any,
    before: dict,
    after: dict,
    pairs: list[tuple[dict, dict]],
) -> int:
    import equinox as eqx

    from .. import models

    out = job.out
    peft_model = eqx.combine(state.trainable, frozen)
    summary = {"before": before, "after": after, "steps": int(state.step)}
    if job.multi:
        check = _serving_check(peft_model, [a.name for a in job.adapters], pairs)
        print(
            f"served {check['rows']} in one batch: max |mixed - each alone| = "
            f"{check['max_abs_diff']:.3g} (tolerance {check['tolerance']:.3g})"
        )
        if not check["max_abs_diff"] <= check["tolerance"]:
            print(
                f"peftx: error: serving check failed: a mixed batch differs from each adapter "
                f"run alone by {check['max_abs_diff']:.3g}, over the tolerance "
                f"{check['tolerance']:.3g}; nothing was saved",
                file=sys.stderr,
            )
            return 1
        summary["serving"] = check
    adapter = out / "adapter"
    peft_model.save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    if job.multi:  # PEFT's layout: an adapter not named "default" in the subfolder of its name
        where = {a.name: adapter if a.name == "default" else adapter / a.name for a in job.adapters}
        written = [f"adapter {name!r} (PEFT format): {d}" for name, d in where.items()]
    else:
        written = [f"adapter (PEFT format): {adapter}"]
    if labels:
        _write(out / "labels.json", json.dumps(labels))
        written.append(f"labels: {out / 'labels.json'}")
    if job.output["merged"]:
        if job.train["quantize"]:
            raise UsageError(
                "output.merged needs a dense base; merge a QLoRA adapter with "
                "`peftx merge BASE_DIR ADAPTER_DIR OUT_DIR`"
            )
        merged = out / "merged"
        models.save_pretrained(peft_model.merge_and_unload(), merged)
        tokenizer.save_pretrained(merged)
        written.append(f"merged model: {merged}")
    written += [f"metrics: {out / 'metrics.jsonl'}", f"curves: {out / 'curves.png'}"]
    _write(out / "summary.json", json.dumps(summary, indent=2))
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    print("wrote\n  " + "\n  ".join(written))
    return 0


class Log:
    """`metrics.jsonl`: one JSON object per line, appended as the run goes."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, *records: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))

    def truncate(self, after: int) -> None:
        """Drop the records past step `after` (a killed run's, after its last checkpoint)."""
        if not self.path.exists():
            return
        kept = [
            line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= after
        ]
        _write(self.path, "".join(line + "\n" for line in kept))


def plot(metrics: Path, png: Path) -> None:
    """The train loss and the eval metrics against the step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics.read_text().splitlines()]
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
    fig.savefig(tmp, dpi=80, format="png")
    plt.close(fig)
    os.replace(tmp, png)
