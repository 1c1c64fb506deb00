"""`peftx finetune JOB.toml`: check the job, load the model and data, train with
`peftx.train.fit`, and write the adapter in PEFT's format with the run's report."""

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from .. import (
    QuantizationConfig,
    get_peft_model,
    initialize_lora,
    models,
    quantize_model,
    train,
)
from .._files import write_text
from ..models import Reader
from ..sharding import batch_parts, wait_for_all, writes_files
from ._common import (
    UsageError,
    copy_base_files,
    hf_config,
    load_tokenizer,
    model_class_for,
)
from ._job import LOG_WRITERS, MAX_COUNT, Adapter, Job
from ._mesh import on_mesh, run_mesh
from ._run_dir import open_run, plan_output
from ._sources import local_paths, read_source


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


def run(args: argparse.Namespace) -> int:
    job = Job(Path(args.config), args.overrides)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32
        return _finetune(job, overwrite=args.overwrite)


def _encoded(where: str, columns: dict[str, str], encode: Callable[[], dict]) -> dict:
    """`encode()`'s data for the rows `where` names; its errors become one line naming
    them and the column (`columns`: the encoder's argument name to the column), its
    warnings too."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            data = encode()
        except (TypeError, ValueError) as e:
            message = str(e)
            for argument, column in columns.items():
                if message.startswith(f"{argument}:"):
                    message = f"column {column!r}" + message.removeprefix(argument)
            raise UsageError(f"{where}: {message}") from None
    for w in caught:
        print(f"peftx: warning: {where}: {w.message}", file=sys.stderr)
    return data


Rows = tuple[str, list[dict[str, Any]]]  # rows, and what messages call them


def _rows(job: Job, adapter: Adapter, columns: list[str]) -> tuple[Rows, Rows]:
    """An adapter's train and eval rows, each named: those of its eval data, or those
    `[data] eval_fraction` draws from its train rows by `[train] seed`."""
    rows = read_source(adapter.train, columns)
    if adapter.eval is not None:
        return (str(adapter.train), rows), (str(adapter.eval), read_source(adapter.eval, columns))
    fraction, seed = job.data["eval_fraction"], job.train["seed"]
    try:
        kept, held = train.split_records(rows, fraction, seed=seed)
    except ValueError as e:
        raise UsageError(f"{adapter.train}: data.{e}") from None
    print(
        f"data.eval_fraction = {fraction} of the {len(rows)} rows of {adapter.train} (drawn "
        f"by train.seed = {seed}): {len(kept)} rows to train on, {len(held)} to evaluate on"
    )
    return (f"{adapter.train} [train rows]", kept), (f"{adapter.train} [eval rows]", held)


def _load_data(job: Job, tokenizer: Any, adapter: Adapter) -> tuple[dict, dict, list[str] | None]:
    d = job.data
    vocab_size = hf_config(job.model.path).get("vocab_size")
    if job.model.task == "classification":
        columns = [d["text_column"], d["label_column"]]
        (train_name, rows), (eval_name, held) = _rows(job, adapter, columns)
        labels = sorted({str(r[d["label_column"]]) for r in rows})
        unseen = sorted({str(r[d["label_column"]]) for r in held} - set(labels))
        if unseen:
            drawn = "" if adapter.eval else " (eval_fraction drew all their rows)"
            raise UsageError(f"{eval_name}: labels {unseen} never appear in {train_name}{drawn}")
        names = {"texts": d["text_column"], "labels": d["label_column"]}

        def encode(where: str, rs: list[dict]) -> dict:
            return _encoded(
                where,
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

        return encode(train_name, rows), encode(eval_name, held), labels
    if job.train["objective"] != "sft":
        data = _preference_data(job, tokenizer, adapter, vocab_size)
        return *data, None
    columns = [d["text_column"]] + ([d["prompt_column"]] if d["prompt_column"] else [])
    names = {"texts": d["text_column"], "prompts": d["prompt_column"]}
    if d["messages_column"]:
        columns, names = [d["messages_column"]], {"conversations": d["messages_column"]}

    def encode_lm(where: str, rs: list[dict]) -> dict:
        rows = dict(max_length=d["max_length"], pack=d["pack"], vocab_size=vocab_size)
        if d["messages_column"]:
            chats = [r[d["messages_column"]] for r in rs]
            data = _encoded(where, names, lambda: train.encode_chat(tokenizer, chats, **rows))
        else:
            texts = [r[d["text_column"]] for r in rs]
            prompts = [r[d["prompt_column"]] for r in rs] if d["prompt_column"] else None
            data = _encoded(
                where, names, lambda: train.encode_causal_lm(tokenizer, texts, prompts, **rows)
            )
        if d["pack"]:
            print(
                f"packed {where}: all {len(rs)} examples, each whole in one row, in "
                f"{len(data['input_ids'])} rows of {d['max_length']} tokens"
            )
        return data

    (train_name, rows), (eval_name, held) = _rows(job, adapter, columns)
    data = encode_lm(train_name, rows), encode_lm(eval_name, held)
    counts = [train.supervised_tokens(x) for x in data]
    print(f"supervised tokens: {counts[0]} in {train_name}, {counts[1]} in {eval_name}")
    return *data, None


def _preference_data(job: Job, tokenizer: Any, adapter: Adapter, vocab_size: Any) -> tuple:
    """An adapter's train and eval preference pairs (`encode_preference`), from the
    `[data]` columns of the prompt and the chosen and rejected completions."""
    d = job.data
    columns = {
        "prompt": d["prompt_column"] or "prompt",
        "chosen": d["chosen_column"],
        "rejected": d["rejected_column"],
    }

    def encode(where: str, records: list[dict]) -> dict:
        rows = [{field: r[column] for field, column in columns.items()} for r in records]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                data = train.encode_preference(
                    tokenizer,
                    rows,
                    max_length=d["max_length"],
                    truncation_mode=d["truncation_mode"],
                    vocab_size=vocab_size,
                )
            except (TypeError, ValueError) as e:
                message = str(e).removeprefix("rows: ")
                for field, column in columns.items():  # the file's own column names
                    message = message.replace(f"{field!r}", f"column {column!r}")
                raise UsageError(f"{where}: {message}") from None
        for w in caught:
            print(f"peftx: warning: {where}: {w.message}", file=sys.stderr)
        return data

    (train_name, rows), (eval_name, held) = _rows(job, adapter, list(columns.values()))
    data = encode(train_name, rows), encode(eval_name, held)
    counts = [len(x["input_ids"]) for x in data]
    print(f"preference pairs: {counts[0]} in {train_name}, {counts[1]} in {eval_name}")
    return data


def _datasets(job: Job, tokenizer: Any) -> tuple[list[tuple[dict, dict]], Any]:
    """Each adapter's (train, eval) data, and the labels (classification: a list, or each
    adapter's by name). Several adapters' rows are padded to one length, so that they mix
    in a batch."""
    loaded = [_load_data(job, tokenizer, a) for a in job.adapters]
    pairs = [(tr, ev) for tr, ev, _ in loaded]
    if not job.multi:
        return pairs, loaded[0][2]
    length = max(d["input_ids"].shape[-1] for pair in pairs for d in pair)
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
    with Reader(path) as reader:
        heads = [k for k in reader.keys() if re.fullmatch(r"(classifier|score)\.weight", k)]
        return reader.shape(heads[0])[0] if heads else None


def _model(job: Job, labels: Any, key: Any, mesh: Any, rules: str | None) -> Any:
    """The base model with every adapter of the job on it (the first one active), read
    straight onto `mesh` when there is one."""
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
    bank = {} if job.bank is None else dataclasses.asdict(job.bank)
    model = get_peft_model(model, first.config, key=key, adapter_name=first.name, **bank)
    for n, a in enumerate(rest, 1):
        try:
            model = model.add_adapter(a.name, a.config, key=jax.random.fold_in(key, n))
        except ValueError as e:
            if job.bank is None:
                raise
            # a bank holds the layers its first adapter targets, which the job check
            # cannot see without the model
            raise UsageError(
                f"{job.path}: [[adapters]][{n + 1}] cannot join the [bank]: {e} (the bank's "
                f"layers are those [[adapters]][1], {first.name!r}, targets)"
            ) from None
    return model


def _loss(job: Job, labels: Any) -> Any:
    """The job's loss function: its objective's, with its table's settings."""
    objective = job.train["objective"]
    if objective == "dpo":
        return functools.partial(train.dpo_loss, **job.loss_settings())
    if objective == "orpo":
        return functools.partial(train.orpo_loss, **job.loss_settings())
    return train.classification_loss if labels else train.causal_lm_loss


def _shared_prompts(pairs: list[tuple[dict, dict]], one_shape: bool) -> list:
    """Each dataset's pairs with their prompts held once (`[data] share_prompts`); with
    `one_shape` (several adapters' datasets, whose rows mix in a batch), all of one prompt
    and one completion length."""
    shared = [tuple(train.share_prompts(d) for d in pair) for pair in pairs]
    if not one_shape:
        return shared
    prompt, completion = (
        max(d[key].shape[-1] for pair in shared for d in pair)
        for key in ("prompt_input_ids", "input_ids")
    )
    return [
        tuple(
            train.share_prompts(d, prompt_length=prompt, completion_length=completion) for d in pair
        )
        for pair in pairs
    ]


def _with_reference(job: Job, model: Any, pairs: list[tuple[dict, dict]]) -> list:
    """Each dataset with the reference's log-probabilities (`[dpo]
    precompute_ref_log_probs`): one pass of the base model before training."""
    size = job.train["eval_batch_size"]
    print(f"precomputing the reference log-probabilities (batches of {size})")
    return [
        tuple(train.precompute_ref_log_probs(model, d, batch_size=size) for d in pair)
        for pair in pairs
    ]


def _writers(job: Job, work: Path) -> list[train.MetricWriter]:
    """The writers the job's `[log]` turns on, for its run written in `work`: W&B's and
    MLflow's run named `run_name` (default: output.dir's name) in `project`."""
    log = job.log
    name = log["run_name"] or job.out.name
    make = {
        "tensorboard": lambda: train.TensorBoardWriter(work / "tensorboard"),
        "wandb": lambda: train.WandbWriter(
            work, project=log["project"], name=name, config=job.resolved()
        ),
        "mlflow": lambda: train.MLflowWriter(experiment=log["project"], run_name=name),
    }
    return [make[key]() for key in LOG_WRITERS if log[key]]


def _protected(job: Job) -> list[tuple[str, Path]]:
    """What a run's output may not be or hold: the model and the data (nor may it lie
    inside a data directory)."""
    paths = [p for s in job.sources() for p in local_paths(s)]
    data = [("data directory" if p.is_dir() else "data file", p) for p in paths]
    return [("model directory", job.model.path), *data]


def _finetune(job: Job, *, overwrite: bool) -> int:
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
    share = t["batch_size"] * t["grad_accumulation"] // len(names)  # each adapter's rows
    per_epoch = max(train.batches_per_epoch(tr, share) for tr, _ in pairs)
    total = t["steps"] or t["epochs"] * per_epoch
    if total > MAX_COUNT:
        raise UsageError(f"train.epochs makes {total} steps, more than {MAX_COUNT}")
    job.adapters = [a.for_steps(total, f"{job.path}: adapter {a.name!r}") for a in job.adapters]
    model_key, train_key = jax.random.split(jax.random.key(t["seed"]))
    peft_model = _model(job, labels, model_key, mesh, rules)
    if job.initializes:
        batches = job.init_batches(*pairs[0])
        print(f"initializing the adapter from {len(batches)} {job.init['split']} batches")
        peft_model = initialize_lora(
            peft_model, batches, key=jax.random.fold_in(model_key, 1), loss_fn=_loss(job, labels)
        )
    start = _conversion_start(peft_model) if not (job.multi or job.bank) else None
    if job.data["share_prompts"]:
        pairs = _shared_prompts(pairs, job.multi)
    if job.train["objective"] == "dpo" and job.dpo["precompute_ref_log_probs"]:
        pairs = _with_reference(job, peft_model, pairs)
    if job.multi:
        train_data, eval_data = [tr for tr, _ in pairs], [ev for _, ev in pairs]
    else:
        train_data, eval_data = pairs[0]
    sft_lm = not labels and job.train["objective"] == "sft"
    with open_run(job.out, job.resolved(), overwrite=overwrite, protected=protected) as run:
        for name in names:
            if job.multi:
                print(f"{name}: ", end="")
            peft_model.set_adapter(name).print_trainable_parameters()
        result = train.fit(
            peft_model,
            train_data,
            eval_data,
            steps=total,
            batch_size=t["batch_size"],
            loss_fn=_loss(job, labels),
            adapters=names if job.multi else None,
            seed=t["seed"],
            grad_accumulation=t["grad_accumulation"],
            eval_batch_size=t["eval_batch_size"],
            **job.optimizer_settings(),
            log_every=t["log_every"],
            eval_every=t["eval_every"],
            checkpoint_every=t["checkpoint_every"],
            keep_checkpoints=job.output["keep_checkpoints"],
            **job.best_settings(),
            out=run.work,
            resume=run.resume,
            writers=_writers(job, run.work),
            # the collapse check compares a cross-entropy with the uniform prediction's
            vocab_size=hf_config(job.model.path)["vocab_size"] if sft_lm else None,
            mesh=mesh,
            rules=rules,
            key=train_key,
        )
        written = _finish(job, run.work, result, tokenizer, labels, start)
        if writes_files():
            run.commit()
    wait_for_all(f"peftx finetune {job.out}")  # every process ends with the files in place
    print("wrote\n  " + "\n  ".join(written))


def _conversion_start(model: Any) -> Any:
    """The adapter as initialized, recorded as `init_lora_weights=True`, when its init
    left a residual base (PiSSA, OLoRA, CorDA, LoRA-GA); else None. The job writes the
    trained adapter converted against it (PEFT's `path_initial_model_for_weight_conversion`):
    a plain LoRA of rank `2r` for the original base, which PEFT cannot rebuild from a
    CorDA or LoRA-GA file."""
    name = model.active_adapter
    config = model.peft_config[name]
    if not config.leaves_residual:
        return None
    return model.with_config(name, dataclasses.replace(config, init_lora_weights=True))


def _finish(
    job: Job,
    work: Path,
    result: train.FitResult,
    tokenizer: Any,
    labels: Any,
    start: Any = None,
) -> list[str]:
    """Write the run's results into `work` (the adapter converted against `start`, its
    initial state, if given); returns what was written, by where it will be once the run
    is committed to `output.dir`."""
    out, peft_model = job.out, result.model
    summary = {"before": result.before, "after": result.after, "steps": result.steps}
    if result.best_step is not None:  # the adapter written is the best evaluation's
        summary["best_step"] = result.best_step
    if result.serving is not None:
        summary["serving"] = result.serving
    writer = writes_files()  # process 0 of several
    # every process: the arrays are gathered (the initial adapter is on process 0's disk)
    with tempfile.TemporaryDirectory(prefix="peftx-initial-adapter-") as initial:
        if start is not None:
            start.save_pretrained(initial)
        peft_model.save_pretrained(
            work / "adapter",
            model_card=_card(job, result),
            path_initial_model_for_weight_conversion=initial if start and writer else None,
        )
    if writer:
        tokenizer.save_pretrained(work / "adapter")
    adapter = out / "adapter"
    if job.multi:  # PEFT's layout: an adapter not named "default" in the subfolder of its name
        where = {a.name: adapter if a.name == "default" else adapter / a.name for a in job.adapters}
        written = [f"adapter {name!r} (PEFT format): {d}" for name, d in where.items()]
    elif start is not None:
        written = [f"adapter (PEFT format, converted for the original base): {adapter}"]
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
    written += [f"{key}: {out / key}" for key in ("tensorboard", "wandb") if job.log[key]]
    if writer:
        write_text(work / "summary.json", json.dumps(summary, indent=2))
        shutil.rmtree(work / "checkpoints", ignore_errors=True)
    return written


def _card(job: Job, result: train.FitResult) -> dict[str, dict[str, Any]]:
    """The run's sections of the adapter's model card: the data files (each adapter's,
    with several) and the eval metrics after training, as `summary.json` has them."""
    fraction = job.data["eval_fraction"]
    files = {
        a.name: {
            "train": str(a.train),
            "eval": str(a.eval) if a.eval is not None else f"{fraction:g} of the train rows",
        }
        for a in job.adapters
    }
    data = files if job.multi else files[job.adapters[0].name]
    when = f"after {result.steps} steps"
    if result.best_step is not None:  # the adapter is the best evaluation's
        when = f"at step {result.best_step} (the best of {result.steps} steps)"
    return {"Data": data, f"Evaluation {when}": result.after}
