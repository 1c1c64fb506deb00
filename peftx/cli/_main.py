"""`peftx`: the parser, the dispatch to each subcommand, and the one-line errors."""

import argparse
import sys
import traceback
from typing import NoReturn

from .. import __version__
from .._errors import TargetNotFoundError, UnknownAdapterError
from ..sharding import exit_run, lost_process
from . import _env, _finetune, _generate, _inspect, _merge, _serve
from ._common import RunFailed, UsageError

COMMANDS = {
    "finetune": (_finetune, "fine-tune a model as a TOML job describes"),
    "inspect": (_inspect, "a checkpoint's architecture, and what an adapter config adapts"),
    "merge": (_merge, "merge an adapter into its base and save a transformers checkpoint"),
    "generate": (_generate, "continue a prompt with a causal LM (and an adapter)"),
    "serve": (_serve, "an OpenAI-compatible server for a causal LM and its LoRA adapters"),
    "env": (_env, "versions and devices, for bug reports"),
}

# Errors that are the user's to fix (a file, a key, a value): one line, no traceback.
USER_ERRORS = (OSError, ValueError, TypeError, TargetNotFoundError, UnknownAdapterError, RunFailed)


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose mistakes become `UsageError`s (one line, exit 2)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="peftx", description="Parameter-efficient fine-tuning for JAX.")
    parser.add_argument("--version", action="version", version=f"peftx {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error (anywhere in argv)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, summary) in COMMANDS.items():
        module.add_arguments(commands.add_parser(name, help=summary, description=summary))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `peftx` with `argv` (default: `sys.argv[1:]`); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        args = _parser().parse_args(argv)
        return COMMANDS[args.command][0].run(args)
    except KeyboardInterrupt:
        print("peftx: interrupted", file=sys.stderr)
        return 130
    except UsageError as e:
        return _fail(e, 2, debug)
    except USER_ERRORS as e:
        return _fail(e, 1, debug)
    except RuntimeError as e:  # a collective whose other end is gone: one line, at once
        line = lost_process(e)
        if line is None:
            raise
        if debug:
            traceback.print_exception(e)
        exit_run(line, new_line=True)


def _fail(error: BaseException, code: int, debug: bool) -> int:
    if debug:
        traceback.print_exception(error)
    message = " ".join(str(error).split()) or type(error).__name__
    print(f"peftx: error: {message}", file=sys.stderr)
    return code
