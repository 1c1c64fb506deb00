"""`peftx finetune CONFIG.toml`: (being written) the fine-tune job a config describes."""

import argparse


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
        "--overwrite", action="store_true", help="replace a finished output directory"
    )


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError("peftx finetune is being written")
