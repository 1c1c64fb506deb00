"""Every error peftx raises on purpose, in one place, and where its warnings point."""

import difflib
import os
import sys

import equinox as eqx


class MaterializationError(RuntimeError):
    """An implicit array would be materialized while materialization is forbidden."""


class HandlerOutputError(TypeError):
    """A primitive handler returned a value of the wrong shape or dtype."""


class HandlerRegistrationError(TypeError):
    """A primitive handler cannot be registered, or called, as written."""


class MaterializationWarning(UserWarning):
    """An implicit array was materialized because no handler applied."""


class UntestedVersionWarning(UserWarning):
    """The installed jax is outside the range of versions peftx is tested with."""


class UnsupportedVersionError(RuntimeError):
    """The installed jax or quax lacks an internal that peftx's engine needs."""


class TargetNotFoundError(KeyError):
    """A target selection (e.g. PEFT's `target_modules`) matches no module."""

    def __str__(self) -> str:
        return str(self.args[0])


class UnsupportedTargetError(TypeError):
    """A selected module is of a type the adapter cannot wrap."""


class UnknownAdapterError(KeyError):
    """An adapter name that the model does not have."""

    def __str__(self) -> str:
        return str(self.args[0])


def unknown_adapter(name: object, valid: tuple[str, ...], holder: str) -> UnknownAdapterError:
    """The error for `name` among the `valid` names a `holder` ("model", "bank") has,
    with the closest name as a hint."""
    close = difflib.get_close_matches(str(name), valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    listed = ", ".join(map(repr, valid)) or "none"
    return UnknownAdapterError(f"no adapter named {name!r}; this {holder} has {listed}.{hint}")


class DenseWeightError(AssertionError):
    """A traced program builds an array the size of an adapted weight (`assert_no_dense`)."""


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: a file, key, shape or model type is not as expected."""


class ConfigFileError(ValueError):
    """A config file (TOML or JSON) cannot be read: not a regular file, not UTF-8 text, not
    valid, or nested too deep."""


class DiskFullError(OSError):
    """A save ran out of space (or quota) on its file system; what was there is kept."""

    def __str__(self) -> str:
        return str(self.strerror)


class RunFailed(Exception):
    """A training run that cannot give a usable result (it diverged, collapsed, or learned
    nothing); `peftx finetune` prints it as one line, exits 1, and writes no adapter."""


def listing(keys: list[str], limit: int = 8) -> str:
    """`keys` for a message: the first `limit` quoted, then how many more."""
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def caller_level() -> int:
    """The `stacklevel` of the first frame outside peftx and equinox (whose method
    wrappers add frames), so that a warning points at the user's call."""
    inside = tuple(os.path.dirname(m.__file__) + os.sep for m in (eqx, sys.modules["peftx"]))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level
