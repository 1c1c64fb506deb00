"""`peftx finetune JOB.toml`: load a model, put an adapter on it, train it on a JSONL/CSV
dataset with checkpoints it resumes from, evaluate before and after, and write the
adapter in PEFT's format."""

import argparse
import json
import os
import shutil
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


class Job:
    """A fine-tune job's TOML, checked, with `--set` overrides applied."""

    def __init__(self, path: Path, overrides: list[str]):
        raw = read_toml(path)
        for item in overrides:
            _override(raw, item)
        self.raw = raw
        self.model: ModelSettings = job_model(raw, path)
        self.data = _settings(raw, "data", DATA_KEYS, path)
        self.train = _settings(raw, "train", TRAIN_KEYS, path)
        self.output = _settings(raw, "output", OUTPUT_KEYS, path)
        for name in ("train", "eval"):
            if self.data[name] is None:
                raise UsageError(f"{path}: [data] needs {name!r}, a .jsonl or .csv file")
            self.data[name] = path.parent / self.data[name]
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
        self.adapter = self._adapter(raw, path)
        out = self.output["dir"] or f"runs/{path.stem}"
        self.out = Path(out)

    def _adapter(self, raw: dict[str, Any], path: Path) -> Any:
        from .._config import _TOML_TABLES

        tables = [t for t in _TOML_TABLES if t in raw]
        if len(tables) != 1:
            raise UsageError(f"{path}: a job needs exactly one adapter table, [lora] or [ia3]")
        table = {"task_type": TASK_TYPES[self.model.task], **raw[tables[0]]}
        try:
            return _TOML_TABLES[tables[0]].from_dict(table, strict=True)
        except (ValueError, TypeError) as e:
            raise UsageError(f"{path}: [{tables[0]}]: {e}") from None

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


def _load_data(job: Job, tokenizer: Any) -> tuple[dict, dict, list[str] | None]:
    from .. import train

    d = job.data
    if job.model.task == "classification":
        columns = [d["text_column"], d["label_column"]]
        rows = train.read_records(d["train"], columns)
        held = train.read_records(d["eval"], columns)
        labels = sorted({str(r[d["label_column"]]) for r in rows})
        unseen = sorted({str(r[d["label_column"]]) for r in held} - set(labels))
        if unseen:
            raise UsageError(f"{d['eval']}: labels {unseen} never appear in {d['train']}")

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

    return encode_lm(d["train"]), encode_lm(d["eval"]), None


def _model(job: Job, labels: list[str] | None) -> Any:
    import jax.numpy as jnp

    from .. import QuantizationConfig, models, quantize_model

    extra = {"num_labels": len(labels)} if labels else {}
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


def _evaluate(eval_step: Any, state: Any, frozen: Any, data: dict, batch_size: int) -> dict:
    from .. import train

    sums: dict[str, float] = {}
    for batch in train.eval_batches(data, batch_size):
        for k, v in eval_step(state.trainable, frozen, batch).items():
            sums[k] = sums.get(k, 0.0) + float(v)
    return train.summarize(sums)


def _describe(metrics: dict[str, float]) -> str:
    return ", ".join(
        f"{k} {v:.2%}" if k == "accuracy" else f"{k} {v:.4g}" for k, v in metrics.items()
    )


def _finetune(job: Job, *, overwrite: bool) -> int:
    import jax
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from .. import get_peft_model, train

    resume = _prepare_output(job, overwrite)
    out, t = job.out, job.train
    tokenizer = AutoTokenizer.from_pretrained(job.model.path, local_files_only=True)
    train_data, eval_data, labels = _load_data(job, tokenizer)
    batch = t["batch_size"] * t["grad_accumulation"]
    per_epoch = train.batches_per_epoch(train_data, batch)
    total = t["steps"] or t["epochs"] * per_epoch
    optimizer, schedule = _optimizer(job, total)
    model_key, train_key = jax.random.split(jax.random.key(t["seed"]))
    peft_model = get_peft_model(_model(job, labels), job.adapter, key=model_key)
    peft_model.print_trainable_parameters()
    state, frozen = train.init_state(peft_model, optimizer, key=train_key)
    loss_fn = train.classification_loss if labels else train.causal_lm_loss
    step_fn = train.make_train_step(loss_fn, optimizer, grad_accumulation=t["grad_accumulation"])
    eval_step = train.make_eval_step(loss_fn)
    evaluate = lambda s: _evaluate(eval_step, s, frozen, eval_data, t["eval_batch_size"])  # noqa: E731
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
        log.write({"step": 0, "split": "eval", **before})
    print(f"before fine-tuning: {_describe(before)}")

    batches = train.train_batches(train_data, batch, seed=t["seed"], start=start)
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
                log.write({"step": n, "split": "eval", **evaluate(state)})
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
    log.write({"step": total, "split": "eval", **after})
    plot(log.path, out / "curves.png")
    print(f"after fine-tuning:  {_describe(after)}")
    return _finish(job, state, frozen, tokenizer, labels, before, after)


def _finish(
    job: Job, state: Any, frozen: Any, tokenizer: Any, labels: Any, before: dict, after: dict
) -> int:
    import equinox as eqx

    from .. import models

    out = job.out
    peft_model = eqx.combine(state.trainable, frozen)
    adapter = out / "adapter"
    peft_model.save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
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
    summary = {"before": before, "after": after, "steps": int(state.step)}
    _write(out / "summary.json", json.dumps(summary, indent=2))
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    print("wrote\n  " + "\n  ".join(written))
    return 0


class Log:
    """`metrics.jsonl`: one JSON object per line, appended as the run goes."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

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
    fig, (ax_loss, ax_extra) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], label="train")
    ax_loss.plot([r["step"] for r in eval_rows], [r["loss"] for r in eval_rows], "o-", label="eval")
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_loss.legend()
    ax_extra.plot([r["step"] for r in eval_rows], [r[extra] for r in eval_rows], "o-")
    ax_extra.set(xlabel="step", ylabel=extra, title=f"eval {extra}")
    fig.tight_layout()
    tmp = temporary_file(png)
    fig.savefig(tmp, dpi=80, format="png")
    plt.close(fig)
    os.replace(tmp, png)
