"""The `peftx` command line (being written)."""

import argparse
import sys

from . import _finetune


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="peftx")
    commands = parser.add_subparsers(dest="command", required=True)
    _finetune.add_arguments(commands.add_parser("finetune"))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return _finetune.run(args)
