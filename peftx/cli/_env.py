"""`peftx env`: the versions and devices a bug report needs."""

import argparse
import importlib.metadata
import importlib.util
import platform
import sys

import jax

PACKAGES = ("peftx", "jax", "jaxlib", "equinox", "quax", "optax", "transformers", "safetensors")
OPTIONAL = ("torch", "peft", "bitsandbytes")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def _version(name: str) -> str:
    if importlib.util.find_spec(name) is None:
        return "not installed"
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "importable, version unknown"


def run(args: argparse.Namespace) -> int:
    rows = [("python", sys.version.split()[0]), ("platform", platform.platform())]
    rows += [(name, _version(name)) for name in (*PACKAGES, *OPTIONAL)]
    rows.append(("jax devices", ", ".join(str(d) for d in jax.devices())))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0
