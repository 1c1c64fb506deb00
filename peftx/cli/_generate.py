"""`peftx generate MODEL_DIR [--adapter DIR] PROMPT`: a causal LM's continuation of a prompt."""

import argparse
from pathlib import Path

import jax
import numpy as np

from ._common import UsageError, model_class_for, model_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_DIR", help="a causal LM checkpoint directory")
    parser.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    parser.add_argument("--adapter", metavar="DIR", help="an adapter to apply (PEFT's format)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="default: 32")
    parser.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int, default=0, help="the sampling key's seed")


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from .._peft_model import PeftModel
    from ..models import from_pretrained, generate

    path = model_dir(args.model)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    name = model_class_for("causal-lm", path)
    if args.adapter is not None and not Path(args.adapter).is_dir():
        raise UsageError(f"adapter directory {args.adapter!r} does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise UsageError(f"no tokenizer could be loaded from {path}: {e}") from None
    model = from_pretrained(path, model_class=name)
    if args.adapter is not None:
        model = PeftModel.from_pretrained(model, args.adapter)
    ids = np.asarray(tokenizer(args.prompt)["input_ids"], np.int32)[None]
    if ids.shape[1] == 0:
        raise UsageError("the prompt encodes to no tokens")
    eos = tokenizer.eos_token_id
    out = generate(
        model,
        ids,
        args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        key=jax.random.key(args.seed) if args.do_sample else None,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
    )
    new = np.asarray(out)[0, ids.shape[1] :].tolist()
    print(tokenizer.decode(new, skip_special_tokens=True))
    return 0
