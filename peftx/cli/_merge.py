"""`peftx merge BASE_DIR ADAPTER_DIR OUT_DIR`: an adapter (peftx's or PEFT's) merged into
its base, saved as a transformers checkpoint with the base's tokenizer, chat template and
generation settings (`BASE_FILES`, as `output.merged` of a fine-tune). The merge is
PEFT's `safe_merge`: a merged weight with NaN or infinity is an error naming the layer,
and nothing is written."""

import argparse
import json
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

from .._config import load_config
from .._peft_io import WEIGHTS_NAME
from .._peft_model import PeftModel
from ..models import from_pretrained, safetensors_header, save_pretrained
from ..sharding import placement_line, writes_files
from ._common import (
    UsageError,
    copy_base_files,
    first_non_finite,
    hf_config,
    model_class_for,
    model_dir,
)
from ._mesh import add_mesh_argument, mesh_from_arguments, on_mesh, run_mesh

PEFT_TASKS = {"CAUSAL_LM": "causal-lm", "SEQ_CLS": "classification"}
# PEFT's key of a classification head saved with the adapter (modules_to_save)
_HEAD_KEY = re.compile(r"base_model\.model\.(.*\.)?(classifier|score)\.weight")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("base", metavar="BASE_DIR", help="the base model's checkpoint directory")
    parser.add_argument(
        "adapter", metavar="ADAPTER_DIR", help="the adapter (adapter_config.json + weights)"
    )
    parser.add_argument("out", metavar="OUT_DIR", help="where to write the merged checkpoint")
    parser.add_argument(
        "--overwrite", action="store_true", help="write into OUT_DIR even if it is not empty"
    )
    add_mesh_argument(parser)


def _head_labels(adapter: Path) -> int | None:
    """The number of classes of the classification head saved with the adapter, if any."""
    file = adapter / WEIGHTS_NAME
    if not file.is_file():
        return None  # PEFT's .bin adapter: the checkpoint's own num_labels is used
    shapes = [t.shape for k, t in safetensors_header(file).items() if _HEAD_KEY.fullmatch(k)]
    return shapes[0][0] if shapes else None


def _with_labels(base: Path, labels: int, scratch: Path) -> Path:
    """A view of checkpoint `base` in `scratch` (links to its files) whose config.json
    says `labels` classes."""
    for f in base.iterdir():
        if f.name != "config.json":
            (scratch / f.name).symlink_to(f.resolve())
    hf = {k: v for k, v in hf_config(base).items() if k not in ("id2label", "label2id")}
    hf["num_labels"] = labels
    (scratch / "config.json").write_text(json.dumps(hf))
    return scratch


def _load_base(
    base: Path, adapter: Path, task_type: str | None, scratch: Path, placed: dict[str, Any]
) -> Any:
    task = PEFT_TASKS.get(task_type)
    name = None if task is None else model_class_for(task, base)
    if task == "classification":
        hf = hf_config(base)
        stored = len(hf["id2label"]) if hf.get("id2label") else hf.get("num_labels", 2)
        labels = _head_labels(adapter)
        if labels is not None and labels != stored:
            base = _with_labels(base, labels, scratch)
        with warnings.catch_warnings():
            # the adapter's own copy of the head replaces a head the base lacks
            warnings.filterwarnings("ignore", message=".*initialized fresh")
            return from_pretrained(base, model_class=name, **placed)
    return from_pretrained(base, model_class=name, **placed)


def run(args: argparse.Namespace) -> int:
    base = model_dir(args.base)
    adapter = Path(args.adapter)
    if not adapter.is_dir():
        raise UsageError(f"adapter directory {str(adapter)!r} does not exist")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUT_DIR {str(out)!r} is a file; name a directory")
    if out.resolve() in (base.resolve(), adapter.resolve()):
        raise UsageError(f"OUT_DIR {str(out)!r} is the base or the adapter directory")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise UsageError(
            f"OUT_DIR {str(out)!r} exists and is not empty; pass --overwrite to write into it"
        )
    config = load_config(adapter)
    mesh, rules = run_mesh(mesh_from_arguments(args.mesh))
    placed = on_mesh(mesh, rules)
    with tempfile.TemporaryDirectory() as scratch:
        model = _load_base(base, adapter, config.task_type, Path(scratch), placed)
        if mesh is not None:
            print(placement_line(mesh, rules, model))
        # each weight merges with its adapter shard by shard, where it lies
        # PEFT's safe_merge: a broken adapter is named, and nothing is written
        merged = PeftModel.from_pretrained(model, adapter).merge_and_unload(safe_merge=True)
        broken = first_non_finite(merged)  # an adapter's own copy of a head, or the base
        if broken is not None:
            raise ValueError(
                f"the merged model's {broken} holds NaN or infinite values; nothing was "
                f"written to {out}"
            )
        save_pretrained(merged, out)
    if not writes_files():  # of several processes, process 0 writes and reports
        return 0
    copied = copy_base_files(base, out)
    print(f"merged {adapter} into {base}: wrote {out}")
    if not copied:
        print(f"(no tokenizer files in {base} to copy)")
    return 0
