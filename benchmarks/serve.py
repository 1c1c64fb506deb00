"""`peftx serve` driven by the official `openai` client: output tokens per second and
p50/p99 request latency at 1, 8 and 32 concurrent clients, with every request on the base
(on a server with 32 adapters loaded, and on one with none), on one adapter, and spread over
32 adapters. Every request asks for the same number of
tokens (`ignore_eos`), so rows are comparable; each figure is the median over rounds taken
round-robin across the three workloads, so that drifts of the machine hit them alike.

The server runs in a child process, as users run it, on the suite's Llama (`suite.py`'s
sizes: hidden 512, 4 layers on CPU) with LoRA r=8 on the seven projections.

Run: `python benchmarks/serve.py [--quick | --tiny | --gpu] [--out FILE]`.
"""

import argparse
import concurrent.futures
import datetime
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
from suite import LLAMA_TARGETS, SIZES, llama_config, md_table

import peftx
import peftx.models as pm

RANK, ALPHA = 8, 16
ADAPTERS = 32
TARGET = 0.8  # 32 distinct adapters' tokens/s against the base's, at the same concurrency


def write_checkpoint(root: Path, size: tuple, dtype: Any = jnp.float32) -> Path:
    """The suite's Llama with a word-level tokenizer over its vocabulary, and 32 LoRA
    adapters beside it."""
    import tokenizers
    import transformers

    config = llama_config(size)
    model = pm.LlamaForCausalLM(config, key=jax.random.key(0), dtype=dtype)
    pm.save_pretrained(model, root / "base")
    words = ["[PAD]", "[UNK]", "</s>", *(f"w{i}" for i in range(config.vocab_size - 3))]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="</s>"
    ).save_pretrained(root / "base")
    lora = peftx.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=LLAMA_TARGETS, init_lora_weights=False
    )
    for k in range(ADAPTERS):
        peftx.get_peft_model(model, lora, key=jax.random.key(k + 1)).save_pretrained(root / f"a{k}")
    return root / "base"


def start(
    base: Path, root: Path, rows: int, length: int, adapters: int
) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "peftx", "serve", str(base), "--port", "0"]
    argv += ["--max-batch", str(rows), "--max-model-len", str(length)]
    argv += ["--max-adapters", str(ADAPTERS)]
    for k in range(adapters):
        argv += ["--adapter", f"a{k}={root / f'a{k}'}"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    for line in process.stdout:
        found = re.search(r"ready on (http://\S+) ", line)
        if found:
            return process, found.group(1)
    raise SystemExit(f"the server exited with {process.wait()}")


def one_round(
    client: openai.OpenAI, models: list[str], clients: int, requests: int, prompt: str, new: int
) -> tuple[float, list[float]]:
    """`(output tokens per second, each request's latency)` of `requests` requests sent by
    `clients` concurrent clients, request `i` to `models[i % len(models)]`."""

    def call(i: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        out = client.completions.create(
            model=models[i % len(models)],
            prompt=prompt,
            max_tokens=new,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return time.perf_counter() - t0, out.usage.completion_tokens

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(call, range(requests)))
    wall = time.perf_counter() - t0
    return sum(n for _, n in done) / wall, [t for t, _ in done]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true")
    size.add_argument("--tiny", action="store_true")
    size.add_argument("--gpu", action="store_true", help="the suite's GPU Llama, in bfloat16")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    name = "gpu" if args.gpu else "quick" if args.quick else "tiny" if args.tiny else "full"
    llama = SIZES[name]["llama"]
    dtype = jnp.bfloat16 if args.gpu else jnp.float32
    concurrency = [1, 8, 32] if not args.tiny else [1, 4]
    rounds = {"full": 3, "quick": 2, "tiny": 1, "gpu": 3}[name]
    prompt_tokens, new = (32, 64) if not args.tiny else (8, 8)
    rows = max(concurrency)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = write_checkpoint(root, llama, dtype)
        length = prompt_tokens + new + 8
        process, url = start(base, root, rows, length, ADAPTERS)
        plain, plain_url = start(base, root, rows, length, 0)  # the base alone: no bank
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            bare = openai.OpenAI(base_url=plain_url + "/v1", api_key="none", max_retries=0)
            prompt = " ".join(
                f"w{i}" for i in np.random.default_rng(0).integers(0, 500, prompt_tokens)
            )
            workloads = {
                "base, server without adapters": [str(base)],
                "base": [str(base)],
                "one adapter": ["a0"],
                f"{ADAPTERS} adapters": [f"a{k}" for k in range(ADAPTERS)],
            }
            one_round(client, list(workloads["one adapter"]), rows, rows, prompt, new)  # warm
            one_round(bare, [str(base)], rows, rows, prompt, new)
            figures: dict[tuple[int, str], list[tuple[float, list[float]]]] = {}
            for c in concurrency:
                requests = max(4 * c, 8)
                for _ in range(rounds):
                    for label, models in workloads.items():
                        on = bare if label.endswith("without adapters") else client
                        figures.setdefault((c, label), []).append(
                            one_round(on, models, c, requests, prompt, new)
                        )
            health = httpx.get(url + "/health").json()
        finally:
            for p in (process, plain):
                p.terminate()
                p.wait(60)
    table, verdicts = [], []
    for c in concurrency:
        base_tps = statistics.median(t for t, _ in figures[(c, "base")])
        for label in workloads:
            runs = figures[(c, label)]
            tps = statistics.median(t for t, _ in runs)
            latencies = sorted(x for _, lat in runs for x in lat)
            p50 = latencies[len(latencies) // 2]
            p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
            table.append(
                [
                    c,
                    label,
                    f"{tps:.0f}",
                    f"{tps / base_tps:.2f}x",
                    f"{1e3 * p50:.0f}",
                    f"{1e3 * p99:.0f}",
                ]
            )
            if label == f"{ADAPTERS} adapters":
                verdicts.append((c, tps / base_tps))
    c = llama_config(llama)
    out = [
        f"# `peftx serve` (`serve.py`, {datetime.date.today()})",
        "",
        (
            f"{jax.devices()[0].device_kind}, {platform.machine()}; Llama hidden "
            f"{c.hidden_size}, {c.num_hidden_layers} layers, {jnp.dtype(dtype).name}; LoRA "
            f"r={RANK} on the "
            f"seven projections; {rows} decode rows; prompts of {prompt_tokens} tokens, "
            f"{new} new tokens each; the `openai` client, {rounds} round(s) per figure."
        ),
        "",
        md_table(
            ["clients", "requests on", "output tokens/s", "vs base", "p50 ms", "p99 ms"], table
        ),
        "",
        "; ".join(
            f"{n} clients: {ADAPTERS} adapters at {r:.2f}x the base's tokens/s "
            f"(target >= {TARGET}x: {'PASS' if r >= TARGET else 'MISS'})"
            for n, r in verdicts
        )
        + f". Compiles after warm-up: {health['compiles_since_ready']}.",
    ]
    text = "\n".join(out)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
