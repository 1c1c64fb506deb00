"""The adapter bank against one adapter and against `AdapterSet`: train steps over one
batch of the same tokens routed to 1, 8, 64 and 256 distinct adapters; forward and greedy
generation with 32 distinct adapters; loading a slot; compiles over load/delete cycles;
bytes. Every time in a table is a median over calls taken round-robin, so that drifts of
the machine hit all rows alike; ratios are within the run.

On the suite's Llama (`suite.py`'s sizes: hidden 512, 4 layers on CPU; ~1B parameters in
bfloat16 on a GPU), LoRA r=8 on the seven projections, AdamW, `peftx.train`'s step.

A batch is 64 rows of the suite's row length (128 tokens on CPU: each of 64 adapters gets
a row), or `--tokens N` in all (`--tokens 1024`: the suite's CPU batch, in rows of 16).

Run: `python benchmarks/bank.py [--quick | --tiny | --gpu] [--tokens N] [--out FILE]`.
"""

import argparse
import datetime
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from suite import LLAMA_TARGETS, SIZES, llama_config, md_table, mib, ms

import peftx
import peftx.adapters._bank as bank_module
import peftx.models as pm

RANK, ALPHA = 8, 16


class Timed:
    """A function called again and again (a step feeds its state back)."""

    def __init__(self, name: str, call: Callable[[], Any]):
        self.name, self.call, self.times = name, call, []
        jax.block_until_ready(call())  # compiles

    def run(self) -> None:
        t0 = time.perf_counter()
        jax.block_until_ready(self.call())
        self.times.append(time.perf_counter() - t0)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def measure(rows: list[Timed], warmup: int, repeats: int) -> None:
    for _ in range(warmup):
        for r in rows:
            r.run()
    for r in rows:
        r.times.clear()
    for _ in range(repeats):
        for r in rows:
            r.run()


def stepper(model: Any, names: list[str] | None, batch: dict) -> Callable[[], Any]:
    optimizer = optax.adamw(1e-4)
    state, frozen = peftx.train.init_state(model, optimizer, key=jax.random.key(0), adapters=names)
    step = peftx.train.make_train_step(peftx.train.causal_lm_loss, optimizer)
    box = {"state": state}

    def call() -> Any:
        with jax.numpy_dtype_promotion("standard"):
            box["state"], metrics = step(box["state"], frozen, batch)
        return metrics["loss"]

    return call


def optimizer_alone(model: Any, names: list[str] | None) -> Callable[[], Any]:
    """AdamW's update of `model`'s trainable half, with the parameters as gradients."""
    optimizer = optax.adamw(1e-4)
    trainable, _ = peftx.partition(model, names)
    box = {"params": trainable, "state": optimizer.init(trainable)}

    @jax.jit
    def update(params: Any, state: Any) -> Any:
        updates, state = optimizer.update(params, state, params)
        return optax.apply_updates(params, updates), state

    def call() -> Any:
        box["params"], box["state"] = update(box["params"], box["state"])
        return box["params"]

    return call


def lora(r: int = RANK) -> peftx.LoraConfig:
    return peftx.LoraConfig(
        r=r, lora_alpha=ALPHA, target_modules=LLAMA_TARGETS, init_lora_weights=False
    )


def bank_of(base: Any, n: int) -> peftx.PeftBankModel:
    bank = peftx.get_peft_model(
        base, lora(), key=jax.random.key(1), adapter_name="a0", max_adapters=n
    )
    keys = jax.random.split(jax.random.key(2), n)
    for k in range(1, n):
        bank = bank.add_adapter(f"a{k}", lora(), key=keys[k])
    return bank


def adapter_set_of(base: Any, n: int) -> peftx.PeftModel:
    model = peftx.get_peft_model(base, lora(), key=jax.random.key(1), adapter_name="a0")
    keys = jax.random.split(jax.random.key(2), n)
    for k in range(1, n):
        model = model.add_adapter(f"a{k}", lora(), key=keys[k])
    return model


def routed(batch: dict, ids: jax.Array) -> dict:
    return {**batch, "adapter_ids": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true")
    size.add_argument("--tiny", action="store_true")
    size.add_argument("--gpu", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--grouped", action="store_true", help="also time the products grouped by slot (SGMV)"
    )
    parser.add_argument(
        "--tokens",
        type=int,
        help="tokens a batch (default: 64 rows of the suite's row length; on a GPU, the "
        "suite's batch)",
    )
    args = parser.parse_args()
    name = "gpu" if args.gpu else "quick" if args.quick else "tiny" if args.tiny else "full"
    sizes = SIZES[name]
    dtype = jnp.bfloat16 if args.gpu else jnp.float32
    llama = sizes["llama"]
    if args.gpu:  # the suite's GPU Llama at 8 layers: filling 256 slots stays quick
        llama = (*llama[:2], 8, *llama[3:])
    c = llama_config(llama)
    *_, b, s = llama
    wide, widest = (64, 256) if not args.tiny else (8, 16)  # rows of the two batches
    tokens = args.tokens or (b * s if args.gpu else wide * s)
    counts = [1, 8, wide] if not args.tiny else [1, 4, wide]
    set_counts = ([1, 8, 32] if not args.gpu else [8]) if not args.tiny else [1, 4]
    grouped = args.grouped
    warmup, repeats = sizes["warmup"], sizes["repeats"]
    base = pm.LlamaForCausalLM(c, key=jax.random.key(0), dtype=dtype)

    def batch_of(rows: int) -> dict:
        ids = jax.random.randint(jax.random.key(3), (rows, tokens // rows), 1, c.vocab_size)
        return {"input_ids": ids, "attention_mask": jnp.ones_like(ids), "labels": ids}

    batch, batch_widest = batch_of(wide), batch_of(widest)
    ids = batch["input_ids"]
    rows_n, seq = ids.shape
    out = [
        f"# The adapter bank (`bank.py`, {datetime.date.today()})",
        "",
        (
            f"{jax.devices()[0].device_kind}, {platform.machine()}; Llama hidden "
            f"{c.hidden_size}, {c.num_hidden_layers} layers, {jnp.dtype(dtype).name}; {tokens} "
            f"tokens a batch ({wide} rows x {tokens // wide}, or {widest} x "
            f"{tokens // widest}); LoRA r={RANK} on the seven projections (float32 factors); "
            "AdamW; `peftx.train`'s step."
        ),
        "",
    ]

    def mixed(model: Any, n: int, rows: int) -> tuple[list[str], jax.Array]:
        names = list(model.adapter_names)
        return names, model.adapter_ids([names[i % n] for i in range(rows)])

    def form(products: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
        """The call under a product form (the switch is read when the step is traced)."""
        threshold = 1 if products == "grouped" else None

        def wrap(call: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> Any:
                old = bank_module.GROUPED_FROM_TOKENS[jax.default_backend()]
                bank_module.GROUPED_FROM_TOKENS[jax.default_backend()] = threshold
                try:
                    return call()
                finally:
                    bank_module.GROUPED_FROM_TOKENS[jax.default_backend()] = old

            return run

        return wrap

    # -- train steps --------------------------------------------------------------------
    one = peftx.get_peft_model(base, lora(), key=jax.random.key(1))
    steps = [Timed(f"one adapter (PeftModel), {wide} rows", stepper(one, None, batch))]
    bank = bank_of(base, wide)
    for n in counts:
        names, row_ids = mixed(bank, n, wide)
        for products in ("gathered", "grouped") if grouped and n > 1 else ("gathered",):
            steps.append(
                Timed(
                    f"bank of {wide}, {n} distinct, {products}",
                    form(products)(stepper(bank, names, routed(batch, row_ids))),
                )
            )
    for n in set_counts:
        model = adapter_set_of(base, n)
        names, row_ids = mixed(model, n, wide)
        steps.append(
            Timed(f"AdapterSet of {n}, {n} distinct", stepper(model, names, routed(batch, row_ids)))
        )
    # the optimizer alone: what stepping 64 adapters' factors and moments costs at least
    steps.append(Timed("AdamW update alone: one adapter", optimizer_alone(one, None)))
    steps.append(
        Timed(
            f"AdamW update alone: bank of {wide}", optimizer_alone(bank, list(bank.adapter_names))
        )
    )
    steps.append(Timed(f"one adapter (PeftModel), {widest} rows", stepper(one, None, batch_widest)))
    big = bank_of(base, widest)
    for n in (widest, wide):
        names, row_ids = mixed(big, n, widest)
        steps.append(
            Timed(
                f"bank of {widest}, {n} distinct, {widest} rows",
                stepper(big, names, routed(batch_widest, row_ids)),
            )
        )
    measure(steps, warmup, repeats)
    ref = steps[0].median
    ref_widest = next(t for t in steps if t.name.endswith(f"{widest} rows")).median
    out += [
        "## Train step",
        "",
        md_table(
            ["step", "median ms", "vs one adapter (same rows)"],
            [
                [
                    t.name,
                    ms(t.median),
                    f"{t.median / (ref_widest if t.name.endswith(f'{widest} rows') else ref):.2f}x",
                ]
                for t in steps
            ],
        ),
        "",
    ]
    best = min(t.median for t in steps if t.name.startswith(f"bank of {wide}, {wide} distinct"))
    ratio = best / ref
    by_name = {t.name: t.median for t in steps}
    floor = (
        ref
        + by_name[f"AdamW update alone: bank of {wide}"]
        - by_name["AdamW update alone: one adapter"]
    ) / ref
    out += [
        (
            f"{wide} distinct adapters in a bank of {wide}: {ratio:.2f}x one adapter's step "
            f"(target <= 1.25x: {'PASS' if ratio <= 1.25 else 'MISS'}). One adapter's step "
            f"plus the optimizer's extra work over {wide} adapters alone is {floor:.2f}x: "
            "no form of the products can go below that."
        ),
        "",
    ]

    # -- forward and generation -----------------------------------------------------------
    k = 32 if not args.tiny else 4
    names, row_ids = mixed(bank, k, rows_n)
    forward = jax.jit(lambda m, x, r: m(x, adapter_names=r).logits)
    plain = jax.jit(lambda m, x: m(x).logits)
    prompt_rows = min(rows_n, 32 if not args.tiny else 4)
    prompt = ids[:prompt_rows, : max(seq // 2, 1)]
    gen_names = [names[i % k] for i in range(prompt_rows)]
    new = 16 if not args.tiny else 2
    one_fwd = jax.jit(lambda m, x: m(x).logits)
    infer = [
        Timed("base", lambda: plain(base, ids)),
        Timed("one adapter", lambda: one_fwd(one, ids)),
        Timed(f"bank of {wide}, {k} distinct", lambda: forward(bank, ids, row_ids)),
        Timed("generate: base", lambda: peftx.generate(base, prompt, new)),
        Timed("generate: one adapter", lambda: peftx.generate(one, prompt, new)),
        Timed(
            f"generate: bank of {wide}, {k} distinct",
            lambda: peftx.generate(bank, prompt, new, adapter_names=gen_names),
        ),
    ]
    measure(infer, warmup, repeats)
    by = {t.name: t.median for t in infer}

    def versus(t: Timed, what: str) -> str:
        ref = by[f"generate: {what}" if t.name.startswith("generate") else what]
        return f"{t.median / ref:.2f}x"

    out += [
        "## Forward and greedy generation",
        "",
        md_table(
            ["call", "median ms", "vs one adapter", "vs base"],
            [[t.name, ms(t.median), versus(t, "one adapter"), versus(t, "base")] for t in infer],
        ),
        "",
    ]

    # -- loading a slot, compiles, bytes --------------------------------------------------
    with tempfile.TemporaryDirectory() as tmp:
        single = peftx.get_peft_model(base, lora(), key=jax.random.key(5), adapter_name="x")
        single.save_pretrained(Path(tmp) / "x")
        folder = Path(tmp) / "x" / "x"
        bank = bank.delete_adapter("a3")
        bank.load_adapter(folder, "x")  # the first load compiles the slot setter
        compiles = []

        def listen(event: str, duration: float, **kw: Any) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                compiles.append(kw.get("fun_name"))

        jax.monitoring.register_event_duration_secs_listener(listen)
        loads = []
        for _ in range(100):
            t0 = time.perf_counter()
            loaded = bank.load_adapter(folder, "x")
            jax.block_until_ready(jax.tree.leaves(loaded))
            loads.append(time.perf_counter() - t0)
            bank = loaded.delete_adapter("x")
        jax.monitoring.unregister_event_duration_listener(listen)
    one_bytes = sum(
        x.nbytes for x in jax.tree.leaves(peftx.partition(one)[0]) if hasattr(x, "nbytes")
    )
    bank_bytes = big.bank_bytes()
    out += [
        "## Loading, compiles and bytes",
        "",
        md_table(
            ["figure", "value"],
            [
                [
                    "load one PEFT adapter into a free slot (median of 100)",
                    f"{ms(statistics.median(loads))} ms",
                ],
                ["compiles over 100 load/delete cycles (after the first load)", str(len(compiles))],
                [f"bank of {widest}: bytes", f"{mib(bank_bytes)} MiB"],
                [f"{widest} single adapters: bytes", f"{mib(widest * one_bytes)} MiB"],
            ],
        ),
        "",
    ]
    text = "\n".join(out)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
