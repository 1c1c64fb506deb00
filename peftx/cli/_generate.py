"""`peftx generate MODEL_DIR [--adapter DIR] [--quantize] [--chat] PROMPT`: a causal LM's
continuation of a prompt, fed to the model as exactly `tokenizer(prompt)` (or, with
`--chat`, as the chat template renders it)."""

import argparse
import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache as cc

from .. import QuantizationConfig, quantize_model
from .._peft_model import PeftModel
from ..models import from_pretrained, generate
from ..sharding import placement_line, shard, to_host, writes_files
from ..train import check_vocab
from ._common import (
    UsageError,
    first_non_finite,
    hf_config,
    load_tokenizer,
    model_class_for,
    model_dir,
    option_value,
    unknown_key,
)
from ._mesh import add_mesh_argument, mesh_from_arguments, on_mesh, run_mesh

SEED_LIMIT = 2**32  # jax.random.key keeps 32 bits of a seed without x64
# The prompt is left-padded to a multiple of this many tokens, so that prompts of
# similar lengths share one compiled program (and one entry of the compilation cache).
PROMPT_BUCKET = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_DIR", help="a causal LM checkpoint directory")
    parser.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    parser.add_argument("--adapter", metavar="DIR", help="an adapter to apply (PEFT's format)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user's message: render it with the checkpoint's chat template "
        "and the assistant's turn to follow, as `peftx finetune` renders chats",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=32,
        help="default: 32; at most the model's positions less the prompt's tokens",
    )
    parser.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int, default=0, help="the sampling key's seed")
    parser.add_argument(
        "--quantize",
        action="store_true",
        help="quantize the base's linear weights to NF4 first (QLoRA's load_in_4bit=true), "
        "as `peftx finetune` does with train.quantize = true",
    )
    parser.add_argument(
        "--quantization",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="a field of the job's [quantization] table (BitsAndBytesConfig's names), e.g. "
        "bnb_4bit_use_double_quant=true or load_in_8bit=true; implies --quantize (repeatable)",
    )

    add_mesh_argument(parser)


def cache_dir() -> Path:
    """Where `peftx generate` keeps compiled programs: `$XDG_CACHE_HOME/peftx/jax`, by
    default `~/.cache/peftx/jax`."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "peftx" / "jax"


@contextlib.contextmanager
def compilation_cache() -> Iterator[None]:
    """JAX's persistent compilation cache in `cache_dir()`, for every compile however
    short, unless the user set a cache directory of their own (`JAX_COMPILATION_CACHE_DIR`);
    the settings are restored on exit, so an in-process caller keeps its own."""
    if jax.config.jax_compilation_cache_dir:
        yield
        return
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", str(cache_dir()))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)
        cc.reset_cache()


def quantization_config(args: argparse.Namespace) -> Any:
    """The `QuantizationConfig` that `--quantize` and `--quantization` ask for, or None."""
    if not args.quantize and not args.quantization:
        return None
    fields = {f.name: f for f in dataclasses.fields(QuantizationConfig)}
    given: dict[str, Any] = {}
    for item in args.quantization:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise UsageError(
                f"--quantization {item!r}: expected KEY=VALUE, e.g. bnb_4bit_use_double_quant=true"
            )
        if key not in fields:
            raise unknown_key("--quantization", key, fields)
        value = option_value(text)
        if fields[key].type is bool and not isinstance(value, bool):
            raise UsageError(f"--quantization {key}={text}: expected true or false")
        given[key] = value
    table = {"load_in_4bit": not given.get("load_in_8bit", False)} | given
    try:
        return QuantizationConfig(**table)
    except (TypeError, ValueError) as e:
        raise UsageError(f"--quantization: {e}") from None


def _check_sampling(args: argparse.Namespace) -> None:
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise UsageError(f"--temperature must be a finite number > 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top-k must be at least 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:  # NaN fails too
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.seed < SEED_LIMIT:
        raise UsageError(f"--seed must be in [0, 2**32), got {args.seed}")


def _prompt_ids(tokenizer: Any, prompt: str, chat: bool, path: Path) -> list[int]:
    """The prompt as `peftx finetune` trains rows on it: `tokenizer(prompt)`, or with
    `chat`, one user message rendered by the chat template with the generation prompt."""
    if not chat:
        return tokenizer(prompt)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"--chat: the tokenizer in {path} has no chat template")
    message = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run(args: argparse.Namespace) -> int:
    path = model_dir(args.model)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    _check_sampling(args)
    quantization = quantization_config(args)
    mesh, rules = run_mesh(mesh_from_arguments(args.mesh))
    name = model_class_for("causal-lm", path)
    if args.adapter is not None and not Path(args.adapter).is_dir():
        raise UsageError(f"adapter directory {args.adapter!r} does not exist")
    tokenizer = load_tokenizer(path)
    prompt = _prompt_ids(tokenizer, args.prompt, args.chat, path)
    if not prompt:
        raise UsageError("the prompt encodes to no tokens")
    try:  # as `peftx finetune` checks its rows
        check_vocab(tokenizer, np.asarray([prompt]), hf_config(path).get("vocab_size"))
    except ValueError as e:
        raise UsageError(f"the prompt's {e}") from None
    with compilation_cache():
        model = from_pretrained(path, model_class=name, **on_mesh(mesh, rules))
        check_finite(model, f"the model in {path}")
        positions = model.config.max_position_embeddings
        room = positions - len(prompt)
        if room < 1:
            raise UsageError(
                f"the prompt has {len(prompt)} tokens, which leave none of the model's "
                f"{positions} positions (max_position_embeddings) to generate in"
            )
        if args.max_new_tokens > room:
            raise UsageError(
                f"--max-new-tokens {args.max_new_tokens} with a prompt of {len(prompt)} tokens "
                f"exceeds the model's {positions} positions (max_position_embeddings): give "
                f"at most {room}"
            )
        if quantization is not None:
            model = quantize_model(model, quantization)
            if mesh is not None:  # NF4 codes and scales follow the rows they stand for
                model = shard(model, mesh, rules)
        if args.adapter is not None:
            model = PeftModel.from_pretrained(model, args.adapter)
            # the base is finite: what is not is the adapter's
            check_finite(model, f"the adapter in {args.adapter}")
        if mesh is not None:
            print(placement_line(mesh, rules, model), file=sys.stderr)
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        ids, mask = _left_padded(prompt, 0 if pad is None else pad)
        out = generate(
            model,
            ids,
            args.max_new_tokens,
            attention_mask=mask,
            do_sample=args.do_sample,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            key=jax.random.key(args.seed) if args.do_sample else None,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        new = to_host(out)[0, ids.shape[1] :].tolist()
    if writes_files():  # of several processes, one prints
        print(tokenizer.decode(new, skip_special_tokens=True))
    return 0


def check_finite(model: Any, what: str) -> None:
    """`ValueError` naming an array of `model` (`what`) that holds NaN or infinity, as
    `peftx merge` refuses it: every token generated from it would be meaningless."""
    broken = first_non_finite(model)
    if broken is not None:
        raise ValueError(f"{what}: {broken} holds NaN or infinite values; nothing was generated")


def _left_padded(prompt: list[int], pad: int) -> tuple[np.ndarray, np.ndarray]:
    """`(ids, mask)` of one prompt left-padded to a multiple of `PROMPT_BUCKET` tokens: the
    model sees the same real tokens at the same positions (padding is masked out)."""
    width = -(-len(prompt) // PROMPT_BUCKET) * PROMPT_BUCKET
    ids = np.full((1, width), pad, np.int32)
    mask = np.zeros((1, width), np.int32)
    ids[0, width - len(prompt) :] = prompt
    mask[0, width - len(prompt) :] = 1
    return ids, mask
