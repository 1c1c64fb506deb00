"""`peftx serve MODEL_DIR [--adapter NAME=PATH ...]`: an OpenAI-compatible HTTP server for
one base and many LoRA adapters in a bank, until SIGINT or SIGTERM (then it drains)."""

import argparse
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import uvicorn

from .. import quantize_model
from .._peft_model import PeftModel
from ..models import cache_dims, from_pretrained
from ..serve import Engine, make_app, wait_for
from ..sharding import placement_line, shard
from ._common import UsageError, load_tokenizer, model_class_for, model_dir
from ._generate import check_finite, compilation_cache, quantization_config
from ._mesh import add_mesh_argument, mesh_from_arguments, on_mesh, run_mesh

DEFAULT_MAX_MODEL_LEN = 2048  # at most: a model with fewer positions caps it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_DIR", help="a causal LM checkpoint directory")
    parser.add_argument(
        "--adapter",
        metavar="NAME=PATH",
        action="append",
        default=[],
        help="a PEFT LoRA adapter to serve as model NAME (repeatable); the first sets the "
        "bank's targets",
    )
    parser.add_argument(
        "--max-adapters", type=int, default=16, help="slots in the adapter bank (default: 16)"
    )
    parser.add_argument(
        "--max-rank",
        type=int,
        help="the largest rank an adapter may have (default: the first adapter's)",
    )
    parser.add_argument(
        "--max-batch", type=int, default=8, help="requests decoded together (default: 8)"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        help=f"tokens per request, prompt and completion (default: the model's positions, at "
        f"most {DEFAULT_MAX_MODEL_LEN})",
    )
    parser.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="default: 8000; 0 picks a free port")
    parser.add_argument(
        "--served-model-name", help="the base's name in requests (default: MODEL_DIR as given)"
    )
    parser.add_argument(
        "--quantize", action="store_true", help="quantize the base's linear weights to NF4"
    )
    parser.add_argument(
        "--quantization",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="a field of BitsAndBytesConfig, as `peftx generate` takes it; implies --quantize",
    )
    add_mesh_argument(parser)


def _adapters(items: list[str]) -> list[tuple[str, Path]]:
    out: list[tuple[str, Path]] = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--adapter {item!r}: expected NAME=PATH")
        if not Path(path).is_dir():
            raise UsageError(f"--adapter {name}: directory {path!r} does not exist")
        if name in {n for n, _ in out}:
            raise UsageError(f"--adapter {name}: given twice")
        out.append((name, Path(path)))
    return out


class _Server(uvicorn.Server):
    """uvicorn's server, whose first SIGINT/SIGTERM drains: new requests get 503, the ones
    in flight finish, then it exits. A second signal exits at once."""

    engine: Engine
    app: Any

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.engine.draining:  # the second signal: uvicorn's exit, without waiting
            super().handle_exit(sig, frame)
            self.force_exit = True
            return
        self.engine.drain()
        threading.Thread(target=self._exit_when_idle, daemon=True).start()

    def _exit_when_idle(self) -> None:
        wait_for(
            lambda: self.engine.in_flight == 0 and self.app.state.open_completions == 0,
            timeout=float("inf"),
        )
        self.should_exit = True


def run(args: argparse.Namespace) -> int:
    path = model_dir(args.model)
    adapters = _adapters(args.adapter)
    for flag, value in (("--max-adapters", args.max_adapters), ("--max-batch", args.max_batch)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if args.max_rank is not None and args.max_rank < 1:
        raise UsageError(f"--max-rank must be at least 1, got {args.max_rank}")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in [0, 65536), got {args.port}")
    quantization = quantization_config(args)
    mesh, rules = run_mesh(mesh_from_arguments(args.mesh))
    name = model_class_for("causal-lm", path)
    tokenizer = load_tokenizer(path)
    served = args.served_model_name or args.model
    if served in {n for n, _ in adapters}:
        raise UsageError(f"--adapter {served}: that is the base model's name")
    sock = _listening(args.host, args.port)  # before the minutes of loading and compiling
    try:
        engine = _engine(args, path, name, tokenizer, adapters, quantization, mesh, rules)
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    app = make_app(engine, served)
    server = _Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=None))
    server.engine, server.app = engine, app
    used, slots = engine.slots
    names = ", ".join(engine.adapters) or "none"
    print(
        f"peftx serve: ready on http://{host}:{port} (model {served!r}; adapters: {names}; "
        f"{used} of {slots} slots; {args.max_batch} rows of {engine.spec.max_model_len} "
        "tokens)",
        flush=True,
    )
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop(timeout=5.0)
    print("peftx serve: stopped", flush=True)
    return 0


def _listening(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def _engine(
    args: argparse.Namespace,
    path: Path,
    name: str,
    tokenizer: Any,
    adapters: list[tuple[str, Path]],
    quantization: Any,
    mesh: Any,
    rules: Any,
) -> Engine:
    """The base (NF4 and on a mesh as asked), its adapters in one bank, and the engine
    over them, compiled."""
    with compilation_cache():
        model = from_pretrained(path, model_class=name, **on_mesh(mesh, rules))
        check_finite(model, f"the model in {path}")
        config = model.config
        positions = cache_dims(config)[3] or config.max_position_embeddings
        length = args.max_model_len or min(positions, DEFAULT_MAX_MODEL_LEN)
        if length > positions or length < 2:
            raise UsageError(
                f"--max-model-len must be in [2, {positions}] (the model's positions), got {length}"
            )
        if quantization is not None:
            model = quantize_model(model, quantization)
            if mesh is not None:
                model = shard(model, mesh, rules)
        for k, (adapter, folder) in enumerate(adapters):
            if k == 0:
                model = PeftModel.from_pretrained(
                    model, folder, adapter, max_adapters=args.max_adapters, max_rank=args.max_rank
                )
            else:
                model = model.load_adapter(folder, adapter)
            check_finite(model, f"the adapter in {folder}")
        if mesh is not None:
            print(placement_line(mesh, rules, model), file=sys.stderr)
        config_eos = config.hf_dict().get("eos_token_id")
        eos = {tokenizer.eos_token_id} - {None}
        eos |= set(config_eos if isinstance(config_eos, list) else [config_eos]) - {None}
        engine = Engine(
            model,
            tokenizer,
            max_batch=args.max_batch,
            max_model_len=length,
            max_adapters=args.max_adapters,
            max_rank=args.max_rank,
            eos_token_ids=tuple(sorted(eos)),
        )
        engine.start()
    return engine
