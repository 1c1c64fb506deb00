"""`peftx inspect MODEL_DIR [CONFIG.toml]`: a checkpoint's architecture and, given a config,
what each adapter would adapt, counted without reading a weight."""

import argparse
import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._config import table_names
from .._kind import count_parameters, trained_fields
from .._peft_model import get_peft_model
from .._select import Predicate, select
from ..adapters import AdapterSet
from ..models import Reader, architecture
from ._common import (
    TASKS,
    UsageError,
    adapter_config,
    adapter_tables,
    hf_config,
    model_class_for,
    model_dir,
    read_toml,
)
from ._finetune import Job

PEFT_TASKS = {"SEQ_CLS": "classification", "CAUSAL_LM": "causal-lm"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL_DIR",
        help="a transformers checkpoint directory, 'all-MiniLM-L6-v2', or a job's TOML "
        "(then the model is its [model] path)",
    )
    parser.add_argument(
        "config",
        nargs="?",
        metavar="CONFIG.toml",
        help=f"a fine-tune job, or a TOML with only an adapter table: {table_names()}",
    )
    parser.add_argument(
        "--num-labels",
        type=int,
        help="classes of a classification head (default: the checkpoint's, else 2)",
    )


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What to build: the checkpoint, the peftx class name, dtype, layout, and the
    adapters, `(name, LoraConfig or IA3Config)` pairs (none without a config); `named`
    (an `[[adapters]]` job) prints each one under its name."""

    path: Path
    class_name: str
    dtype: str
    layout: str
    adapters: tuple[tuple[str, Any], ...] = ()
    named: bool = False
    batch: tuple[int, int] | None = None  # a job's (batch_size, grad_accumulation)


def _plan(args: argparse.Namespace) -> _Plan:
    toml = args.config
    if toml is None and args.model.endswith(".toml"):
        toml, model = args.model, None
    else:
        model = args.model
    path = None if model is None else model_dir(model)
    if toml is None:
        return _Plan(path, _default_class(path), "float32", "stacked")
    tables = read_toml(toml)
    if set(tables) <= set(adapter_tables()):  # a bare adapter config: else a fine-tune job
        if path is None:
            raise UsageError(
                f"{toml} holds only an adapter table; name the model: "
                f"peftx inspect MODEL_DIR {toml}"
            )
        config = adapter_config(toml)
        task = PEFT_TASKS.get(config.task_type)
        name = _default_class(path) if task is None else model_class_for(task, path)
        return _Plan(path, name, "float32", "stacked", (("default", config),))
    # MODEL_DIR, when given, in place of the job's model.path (as `--set model.path=...`)
    job = Job(Path(toml), [] if path is None else [f"model.path={json.dumps(str(path))}"])
    m = job.model
    adapters = tuple((a.name, a.config) for a in job.adapters)
    batch = job.train["batch_size"], job.train["grad_accumulation"]
    name = model_class_for(m.task, m.path)
    return _Plan(m.path, name, m.dtype, m.layout, adapters, job.multi, batch)


def _default_class(path: Path) -> str:
    hf = hf_config(path)
    arch = architecture(hf["model_type"])
    names = [n for n in hf.get("architectures") or () if n in arch.classes]
    return names[0] if names else arch.default


def _num_labels(args: argparse.Namespace, hf: dict[str, Any]) -> int:
    if args.num_labels is not None:
        if args.num_labels < 1:
            raise UsageError(f"--num-labels must be at least 1, got {args.num_labels}")
        return args.num_labels
    return len(hf["id2label"]) if hf.get("id2label") else int(hf.get("num_labels", 2))


def _stored_dtypes(path: Path) -> str:
    """The dtypes of the checkpoint's tensors, most common first (headers only)."""
    with Reader(path) as reader:
        counts = Counter(str(reader.dtype(k)) for k in reader.keys())
    return ", ".join(f"{d} ({n} tensors)" for d, n in counts.most_common())


def _trained_count(adapter: Any) -> int:
    """The parameters `adapter` trains (not its base weight, nor frozen state such as
    AdaLoRA's `ranknum`)."""
    return count_parameters([getattr(adapter, f) for f in trained_fields(adapter)])


def survey(plan: _Plan, num_labels: int) -> dict[str, Any]:
    """Counts for `plan`, traced with `eqx.filter_eval_shape` (no weight is read or
    built): the model's parameters, and with a config each adapted module's path, base
    shape and trained adapter parameters, and PEFT's (trainable, all)
    pair."""
    hf = hf_config(plan.path)
    arch = architecture(hf["model_type"])
    cls = arch.classes[plan.class_name]
    config = arch.config_class.from_hf_config(hf)
    if hasattr(config, "num_labels"):
        config = dataclasses.replace(config, num_labels=num_labels)
    dtype = jnp.dtype(plan.dtype)

    def build(key: jax.Array) -> dict[str, Any]:
        model = cls(config, key=key, layout=plan.layout, dtype=dtype)
        leaves = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
        out: dict[str, Any] = {"total": sum(x.size for x in leaves), "adapters": {}}
        if not plan.adapters:
            return out
        (first, first_config), *rest = plan.adapters
        peft_model = get_peft_model(model, first_config, key=key, adapter_name=first)
        for name, adapter in rest:
            peft_model = peft_model.add_adapter(name, adapter, key=key)
        adapted = select(peft_model.base_model).at(
            Predicate(
                lambda p, n: isinstance(getattr(n, "weight", None), AdapterSet), "adapted layers"
            )
        )
        for name, _ in plan.adapters:
            out["adapters"][name] = {
                "rows": [
                    (p, tuple(n.weight.shape), _trained_count(n.weight.adapters[name]))
                    for p, n in zip(adapted.paths(), adapted.get())
                    if name in n.weight.adapters
                ],
                "saved": sorted(peft_model.saved_modules.get(name, {})),
                # PEFT's count with `name` active: its parameters trainable, all in all
                "counts": peft_model.set_adapter(name).get_nb_trainable_parameters(),
            }
        return out

    return eqx.filter_eval_shape(build, jax.random.key(0))


def run(args: argparse.Namespace) -> int:
    plan = _plan(args)
    hf = hf_config(plan.path)
    labels = _num_labels(args, hf) if plan.class_name.endswith(TASKS["classification"]) else None
    found = survey(plan, labels or 2)

    def get(*names: str) -> Any:
        return next((hf[n] for n in names if n in hf), "?")

    heads = get("num_attention_heads", "n_head")
    kv = hf.get("num_key_value_heads")
    info = [
        ("model", str(plan.path)),
        ("model_type", hf["model_type"]),
        ("class", plan.class_name + (f" ({labels} labels)" if labels else "")),
        ("layers", get("num_hidden_layers", "n_layer")),
        ("hidden size", get("hidden_size", "n_embd")),
        ("heads", f"{heads} ({kv} key/value)" if kv and kv != heads else heads),
        ("vocab", get("vocab_size")),
        ("dtype stored", _stored_dtypes(plan.path)),
        ("parameters", f"{found['total']:,}"),
    ]
    if plan.batch is not None:
        size, steps = plan.batch
        micro = f"{size} rows a micro-batch (train.batch_size) x {steps} (grad_accumulation)"
        info.append(("batch", f"{micro} = {size * steps} rows a step (the effective batch)"))
    width = max(len(k) for k, _ in info)
    for k, v in info:
        print(f"{k:<{width}}  {v}")
    for name, adapter in plan.adapters:
        one = found["adapters"][name]
        print()
        if plan.named:
            print(f"adapter {name!r}")
        rows = [(p, "x".join(map(str, s)), f"{n:,}") for p, s, n in one["rows"]]
        header = ("module", "base shape", f"{adapter.peft_type} params")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
        for row in [header, *rows]:
            print(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:>{widths[2]}}")
        if one["saved"]:
            print(f"modules_to_save (trained in full): {', '.join(one['saved'])}")
        trainable, total = one["counts"]
        print(
            f"trainable params: {trainable:,} || all params: {total:,} || "
            f"trainable%: {100 * trainable / total:.4f}"
        )
    return 0
