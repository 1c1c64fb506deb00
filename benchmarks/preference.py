"""Preference tuning's step against supervised fine-tuning's: `peftx.train`'s step with
`dpo_loss` (the reference computed in the step, and precomputed) and `orpo_loss`, against
`causal_lm_loss` on B rows and on 2B rows (the tokens of B pairs), and TRL's DPO step
(PyTorch PEFT, the same sizes) on the same machine. A DPO row is two sequences (chosen and
rejected), so 2x an SFT row is the floor of a step with a precomputed reference; the
target is at most 2.1x. Times are medians over calls taken round-robin; "temp MiB" and
"peak MiB" are XLA's figures for the compiled step (`memory_analysis()`: temporaries, and
temporaries + arguments + outputs - aliases).

On the suite's Llama (`suite.py`'s sizes: hidden 512, 4 layers, batch 8 x 128 tokens on
CPU), LoRA r=8 on the seven projections, AdamW.

On a GPU (`--gpu`): the suite's GPU Llama (hidden 2048, 16 layers, 4 x 2048 tokens) in
bfloat16, without TRL's row.

Run: `python benchmarks/preference.py [--quick | --gpu] [--no-trl] [--repeats N] [--out FILE]`.
"""

import argparse
import datetime
import functools
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from suite import LLAMA_TARGETS, SIZES, llama_config, md_table, mib, ms

import peftx
import peftx.models as pm

RANK, ALPHA = 8, 16


class Timed:
    def __init__(self, name: str, call: Callable[[], Any], memory: Any = None):
        self.name, self.call, self.memory, self.times = name, call, memory, []
        call()  # compiles

    def run(self) -> None:
        t0 = time.perf_counter()
        self.call()
        self.times.append(time.perf_counter() - t0)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def peftx_step(model: Any, loss_fn: Any, batch: dict) -> Timed:
    optimizer = optax.adamw(1e-4)
    state, frozen = peftx.train.init_state(model, optimizer, key=jax.random.key(0))
    step = peftx.train.make_train_step(loss_fn, optimizer)
    batch = jax.tree.map(jax.numpy.asarray, batch)
    with jax.numpy_dtype_promotion("standard"):
        memory = step.lower(state, frozen, batch).lowered.compile().memory_analysis()
    box = {"state": state}

    def call() -> Any:
        with jax.numpy_dtype_promotion("standard"):
            box["state"], metrics = step(box["state"], frozen, batch)
        return jax.block_until_ready(metrics["loss"])

    return call, memory


def trl_step(size: tuple, pairs: dict) -> Callable[[], Any]:
    """TRL's DPO training step (forward, reference forward, backward, AdamW) on PyTorch
    PEFT LoRA with the same sizes and tokens."""
    import datasets
    import peft
    import tokenizers
    import torch
    import transformers
    import trl

    hidden, inter, layers, heads, kv, vocab, _, _ = size
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    words = tokenizers.models.WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]")
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(words),
        pad_token="[PAD]",
        unk_token="[UNK]",
        eos_token="[PAD]",
    )
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"}]  # the trainer's own data: unused
    args = trl.DPOConfig(
        output_dir=tempfile.mkdtemp(),
        report_to=[],
        bf16=False,
        use_cpu=True,
        max_length=None,
        gradient_checkpointing=False,  # TRL's default is on; peftx's step here keeps activations
    )
    lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=LLAMA_TARGETS)
    trainer = trl.DPOTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok,
        peft_config=lora,
    )
    ids = torch.as_tensor(np.concatenate([pairs["input_ids"][:, 0], pairs["input_ids"][:, 1]]))
    mask = torch.as_tensor(np.concatenate([pairs["labels"][:, 0], pairs["labels"][:, 1]]) >= 0)
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": mask.long(),
    }
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4)
    trainer.model.train()

    def call() -> Any:
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    size.add_argument("--gpu", action="store_true", help="the suite's GPU Llama in bfloat16")
    parser.add_argument("--no-trl", action="store_true", help="leave out TRL's step")
    parser.add_argument("--repeats", type=int, help="timed rounds (default: the suite's)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sizes = SIZES["gpu" if args.gpu else "quick" if args.quick else "full"]
    size = sizes["llama"]
    dtype = jnp.bfloat16 if args.gpu else jnp.float32
    batch, seq = size[6], size[7]
    vocab = size[5]
    rng = np.random.default_rng(0)
    prompt = seq // 4  # a quarter of each sequence is the prompt, left out of the loss

    def sft(rows: int) -> dict:
        ids = rng.integers(1, vocab, (rows, seq)).astype(np.int32)
        labels = np.where(np.arange(seq) < prompt, -100, ids).astype(np.int32)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": labels}

    ids = rng.integers(1, vocab, (batch, 2, seq)).astype(np.int32)
    ids[:, 1, :prompt] = ids[:, 0, :prompt]
    labels = np.where(np.arange(seq) < prompt, -100, ids).astype(np.int32)
    pairs = {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": labels}

    llama = pm.LlamaForCausalLM(llama_config(size), key=jax.random.key(0), dtype=dtype)
    config = peftx.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=LLAMA_TARGETS)
    model = peftx.get_peft_model(llama, config, key=jax.random.key(1))
    precomputed = peftx.train.precompute_ref_log_probs(model, pairs, batch_size=batch)
    dpo = functools.partial(peftx.train.dpo_loss, beta=0.1)
    shared = peftx.train.share_prompts(pairs)
    cases = [
        (f"SFT, {batch} rows", peftx.train.causal_lm_loss, sft(batch)),
        (f"SFT, {2 * batch} rows (the pairs' tokens)", peftx.train.causal_lm_loss, sft(2 * batch)),
        (f"DPO, {batch} pairs, reference precomputed", dpo, precomputed),
        (
            f"DPO, {batch} pairs, reference precomputed, prompts shared",
            dpo,
            peftx.train.share_prompts(precomputed),
        ),
        (f"DPO, {batch} pairs, reference in the step", dpo, pairs),
        (f"DPO, {batch} pairs, reference in the step, prompts shared", dpo, shared),
        (f"ORPO, {batch} pairs", peftx.train.orpo_loss, pairs),
        (f"ORPO, {batch} pairs, prompts shared", peftx.train.orpo_loss, shared),
    ]
    rows = [Timed(name, *peftx_step(model, loss, data)) for name, loss, data in cases]
    if not (args.no_trl or args.gpu):  # TRL's row: on this machine's CPU only
        rows.append(Timed(f"TRL DPO (PyTorch PEFT), {batch} pairs", trl_step(size, pairs)))
    for _ in range(sizes["warmup"]):
        for r in rows:
            r.run()
    for r in rows:
        r.times.clear()
    for _ in range(args.repeats or sizes["repeats"]):
        for r in rows:
            r.run()
    sft_time = rows[0].median
    sft_memory = rows[0].memory

    def peak(m: Any) -> float:
        return (
            m.temp_size_in_bytes
            + m.argument_size_in_bytes
            + m.output_size_in_bytes
            - m.alias_size_in_bytes
        )

    table = []
    for r in rows:
        memory = (
            [mib(r.memory.temp_size_in_bytes), mib(peak(r.memory))]
            if r.memory is not None
            else ["", ""]
        )
        ratio = f"{r.median / sft_time:.2f}x"
        peak_ratio = f"{peak(r.memory) / peak(sft_memory):.2f}x" if r.memory is not None else ""
        table.append([r.name, ms(r.median), ratio, *memory, peak_ratio])
    hidden, inter, layers = size[:3]
    text = "\n".join(
        [
            (
                f"### Preference tuning step ({datetime.date.today()}, {platform.node()}, "
                f"{jax.devices()[0].device_kind})"
            ),
            "",
            (
                f"Llama hidden {hidden}, intermediate {inter}, {layers} layers, vocab {vocab}; "
                f"rows of {seq} tokens (a quarter prompt); LoRA r={RANK} on the seven "
                "projections; AdamW."
            ),
            "",
            md_table(
                ["step", "ms", "vs SFT", "temp MiB", "peak MiB", "peak vs SFT"],
                table,
            ),
        ]
    )
    print(text)
    if args.out:
        with args.out.open("a") as f:
            f.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
