"""Stacked (`lax.scan`) against unrolled blocks: compile time, step time and the
compiled step's memory, for full fine-tuning and LoRA on the zoo's Llama.

For each depth (`--depths`, default 4 and 16 blocks) and each way of running the blocks:

- `unrolled`: a Python loop over a tuple of blocks (one HLO graph, XLA sees all layers);
- `scan, every residual saved`: `lax.scan` over a `LayerStack`, storing every residual
  the backward pass reads (`remat_policy="everything_saveable"`): a plain scan;
- `scan (default)`: what a `LayerStack` does by default: matmul outputs saved
  (`dots_saveable`), elementwise work recomputed in the backward pass;
- `scan, remat, no batched dots saved`: gradient checkpointing with
  `dots_with_no_batch_dims_saveable` (attention scores recomputed too);
- `scan, remat, nothing saved`: the block recomputed whole in the backward pass;

it reports the time to trace and compile one AdamW training step (next-token
cross-entropy, `jax.jit` donating the parameters and optimizer state), the median
step time over `--steps` steps taken round-robin (so machine drifts hit every variant
alike), and XLA's own memory figures for the compiled step (`memory_analysis()`:
temporaries, and temporaries plus arguments plus outputs minus donated aliases as the
peak estimate). Ratios are to `unrolled` at the
same depth and kind; the step is also given as a ratio to the unrolled full fine-tuning
step (LoRA here is r=8 on every linear layer but the head).

Run: `python benchmarks/scan_layers.py [--depths 4 16] [--steps 5] [--quick]`.
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import peftx
import peftx.models as pm


def build(depth: int, layout: str, hidden: int, remat: str | None) -> pm.LlamaForCausalLM:
    config = pm.LlamaConfig(
        vocab_size=2048,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 32 * 32,
        num_hidden_layers=depth,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1),
        head_dim=64,
        max_position_embeddings=4096,
    )
    return pm.LlamaForCausalLM(
        config,
        key=jax.random.PRNGKey(0),
        layout=layout,
        gradient_checkpointing=remat is not None,
        remat_policy=None if remat in (None, "full") else remat,
    )


def make_step(model, lora: bool):
    if lora:
        model = peftx.get_peft_model(
            model,
            peftx.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
            key=jax.random.PRNGKey(1),
        )
        trainable, frozen = peftx.partition(model)
    else:
        trainable, frozen = eqx.partition(model, eqx.is_inexact_array)
    optimizer = optax.adamw(1e-4)
    state = optimizer.init(trainable)

    def step(frozen, trainable, state, ids):
        def loss(t):
            logits = eqx.combine(t, frozen)(ids[:, :-1]).logits.astype(jnp.float32)
            labels = ids[:, 1:]
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        value, grads = jax.value_and_grad(loss)(trainable)
        with jax.numpy_dtype_promotion("standard"):
            updates, state = optimizer.update(grads, state, trainable)
        return eqx.apply_updates(trainable, updates), state, value

    return jax.jit(step, donate_argnums=(1, 2)), frozen, trainable, state


VARIANTS = {
    "unrolled": ("unrolled", None),
    "scan, every residual saved": ("stacked", "everything_saveable"),
    "scan (default: matmul outputs saved)": ("stacked", None),
    "scan, remat, no batched dots saved": ("stacked", "dots_with_no_batch_dims_saveable"),
    "scan, remat, nothing saved": ("stacked", "full"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps = 2
    ids = jnp.asarray(
        np.random.RandomState(0).randint(0, 2048, (args.batch, args.seq + 1)), jnp.int32
    )
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}; hidden {args.hidden}, "
        f"batch {args.batch}x{args.seq}"
    )
    jax.jit(lambda x: x + 1).lower(ids).compile()  # JAX's one-off start-up, not a variant's
    rows = []
    for depth in args.depths:
        runs = {}
        for kind in ("full FT", "LoRA"):
            for name, (layout, remat) in VARIANTS.items():
                step, frozen, trainable, state = make_step(
                    build(depth, layout, args.hidden, remat), kind == "LoRA"
                )
                start = time.perf_counter()
                compiled = step.lower(frozen, trainable, state, ids).compile()
                compile_s = time.perf_counter() - start
                memory = compiled.memory_analysis()
                trainable, state, _ = step(frozen, trainable, state, ids)  # warm-up
                runs[kind, name] = dict(
                    step=step,
                    args=[frozen, trainable, state],
                    compile=compile_s,
                    temp=memory.temp_size_in_bytes,
                    peak=memory.temp_size_in_bytes
                    + memory.argument_size_in_bytes
                    + memory.output_size_in_bytes
                    - memory.alias_size_in_bytes,
                    times=[],
                )
        # every variant of both kinds round-robin, so LoRA/full ratios share the drifts too
        for _ in range(args.steps):
            for run in runs.values():
                frozen, trainable, state = run["args"]
                start = time.perf_counter()
                trainable, state, loss = run["step"](frozen, trainable, state, ids)
                loss.block_until_ready()
                run["times"].append(time.perf_counter() - start)
                run["args"] = [frozen, trainable, state]
        full = statistics.median(runs["full FT", "unrolled"]["times"])
        for (kind, name), run in runs.items():
            base = runs[kind, "unrolled"]
            t, t0 = statistics.median(run["times"]), statistics.median(base["times"])
            rows.append(
                (
                    depth,
                    kind,
                    name,
                    f"{run['compile']:.1f} s",
                    f"{run['compile'] / base['compile']:.2f}x",
                    f"{t * 1e3:.0f} ms",
                    f"{t / t0:.2f}x",
                    f"{t / full:.2f}x",
                    f"{run['temp'] / 2**20:.0f} MiB",
                    f"{run['peak'] / base['peak']:.2f}x",
                )
            )
        print(f"done: {depth} blocks", flush=True)
    header = (
        "blocks",
        "train",
        "blocks run as",
        "compile",
        "ratio",
        "step",
        "ratio",
        "vs unrolled full FT",
        "temporaries",
        "peak ratio",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


if __name__ == "__main__":
    main()
