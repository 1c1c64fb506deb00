"""The model card, `README.md`, that a save of adapters writes beside them, as PyTorch PEFT's
`save_pretrained` does: YAML front matter that the Hub reads (`library_name: peft`,
`base_model`, `tags`, `pipeline_tag`) over the base model, each adapter's method and config,
the sections a caller adds (a run's data and metrics) and the library versions.

One card, at the top of the save's directory (PEFT writes none in an adapter's subfolder). A
`README.md` there that peftx did not write (one without a line starting `MARK`) is the
user's: it is kept as it is and no card is written, where PEFT would rewrite its metadata.
"""

import dataclasses
import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
from huggingface_hub import ModelCardData

from ._config import CONFIG_CLASSES, CONFIG_NAME, PEFT_BASE_KEYS
from ._errors import caller_level
from ._version import __version__

CARD_NAME = "README.md"
MARK = "<!-- peftx model card"
MARKER = f"{MARK}: each save rewrites this file; delete this line to keep your edits -->"

ABOUT = (
    "Saved by peftx (parameter-efficient fine-tuning in JAX and Equinox) in PyTorch PEFT's "
    "format: `peft.PeftModel.from_pretrained(base_model, folder)` loads it, and so does "
    "`peftx.PeftModel.from_pretrained`."
)
# The Hub's pipeline for each PEFT task type (PEFT itself names one for CAUSAL_LM only).
PIPELINES = {
    "CAUSAL_LM": "text-generation",
    "SEQ_CLS": "text-classification",
    "TOKEN_CLS": "token-classification",
    "SEQ_2_SEQ_LM": "text2text-generation",
    "QUESTION_ANS": "question-answering",
    "FEATURE_EXTRACTION": "feature-extraction",
}

Sections = Mapping[str, Mapping[str, Any]]


def writes_card(directory: Path) -> bool:
    """Whether a save into `directory` writes its card: there is no `README.md` there, or
    peftx wrote it. Another is kept, with a warning saying so."""
    path = directory / CARD_NAME
    if not path.exists() and not path.is_symlink():
        return True
    if path.is_file() and not path.is_symlink():
        try:
            if any(line.startswith(MARK) for line in path.read_text("utf-8").splitlines()):
                return True
        except (OSError, UnicodeDecodeError):
            pass
    warnings.warn(
        f"{str(path)!r} is not a model card peftx wrote (it has no line starting {MARK!r}), "
        "so it is kept as it is and no card is written; delete or rename it to get one.",
        stacklevel=caller_level(),
    )
    return False


def card_text(configs: Mapping[str, Mapping[str, Any]], sections: Sections | None) -> str:
    """The card of the adapters whose saved configs (`adapter_config.json`) `configs` holds
    by adapter name, with the caller's `sections` (a heading each, over a table of its
    entries, nested mappings flattened) before the versions."""
    bases = sorted({c["base_model_name_or_path"] for c in configs.values()} - {None})
    methods = list(dict.fromkeys(c["peft_type"] for c in configs.values()))
    tasks = {c.get("task_type") for c in configs.values()}
    data = ModelCardData(
        library_name="peft",
        base_model=bases[0] if len(bases) == 1 else bases or None,
        tags=sorted(
            {"peftx", "jax", *(m.lower() for m in methods)}
            | {f"base_model:adapter:{b}" for b in bases}
        ),
        pipeline_tag=PIPELINES.get(tasks.pop()) if len(tasks) == 1 else None,
    )
    base = ", ".join(f"`{b}`" for b in bases) or "a base model"
    kind = f"{' and '.join(methods)} adapter{'s' if len(configs) > 1 else ''}"
    lines = [
        MARKER,
        "",
        f"# {kind} for {base}",
        "",
        ABOUT,
        "",
        "## Base model",
        "",
        *(f"- `{b}`" for b in bases or ["not named in the config"]),
        "",
        "## Adapters",
    ]
    for name, config in configs.items():
        lines += ["", *_adapter(name, config)]
    for title, entries in (sections or {}).items():
        lines += ["", f"## {title}", "", "| | |", "| --- | --- |"]
        lines += [f"| {key} | {_cell(value)} |" for key, value in _flat(entries)]
    versions = sorted({c.get("peft_version") for c in configs.values()} - {None})
    lines += [
        "",
        "## Training procedure",
        "",
        "### Framework versions",
        "",
        f"- peftx {__version__}",
        f"- JAX {jax.__version__}",
        f"- Equinox {eqx.__version__}",
        *(f"- PEFT {v}" for v in versions),
    ]
    # as `ModelCard` writes it (whose module would load the Hub's client on `import peftx`)
    return f"---\n{data.to_yaml()}\n---\n" + "\n".join(lines) + "\n"


def _adapter(name: str, config: Mapping[str, Any]) -> list[str]:
    """An adapter's part of the card: where it lies, its method, the settings that differ
    from PEFT's defaults, and its whole config, folded."""
    where = "this folder" if name == "default" else f"`{name}/`"
    cls = CONFIG_CLASSES[config["peft_type"]]
    settings = [
        f"- `{f.name}`: `{json.dumps(config[f.name])}`"
        for f in dataclasses.fields(cls)
        if f.name in config
        and f.name not in PEFT_BASE_KEYS
        and not _is_default(config[f.name], _default(f))
    ]
    return [
        f"### `{name}`: {config['peft_type']}, in {where}",
        "",
        "Settings other than PEFT's defaults:" if settings else "PEFT's default settings.",
        "",
        *settings,
        *([""] if settings else []),
        f"<details><summary>{CONFIG_NAME}</summary>",
        "",
        "```json",
        json.dumps(config, indent=2, sort_keys=True),
        "```",
        "",
        "</details>",
    ]


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _is_default(value: Any, default: Any) -> bool:
    # as saved (lists for tuples); PEFT writes None, {}, [] and False alike for "not used"
    return value == json.loads(json.dumps(default)) or (not value and not default)


def _flat(entries: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """`(key, value)` rows of `entries`, a nested mapping's keys joined by " / "."""
    rows = []
    for key, value in entries.items():
        if isinstance(value, Mapping):
            rows += _flat(value, f"{prefix}{key} / ")
        else:
            rows.append((f"{prefix}{key}", value))
    return rows


def _cell(value: Any) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else f"`{value}`"
    return text.replace("|", "\\|")
