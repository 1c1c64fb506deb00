"""Per-device memory and step time of a LoRA step under each sharding preset, on 8
simulated CPU devices (`--xla_force_host_platform_device_count=8`), side by side in one
run.

A Llama-style model (`--hidden`, `--layers`; grouped-query attention), LoRA r=8 on every
linear layer, AdamW, a batch of 8 x 128 tokens. For each preset: the bytes each device
holds of the base weights, of the adapters and of the optimizer state (from the arrays'
shards), the compiled step's temporaries (XLA's `memory_analysis()`), and the median
step time; the `fsdp` presets also with gradient checkpointing ("+ remat"), and two with
the LoRA factors and their optimizer state replicated ("factors whole") in place of
following their weight's split. Times on simulated devices share the host's cores: they
say little about real hardware and are labelled so.

    python benchmarks/sharding.py [--hidden 256] [--layers 4] [--steps 5]
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

import peftx
from peftx.models import LlamaConfig, LlamaForCausalLM
from peftx.sharding import make_mesh


def per_device(tree) -> int:
    """The most bytes any one device holds of `tree`'s arrays."""
    held: dict = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    h = args.hidden
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=h,
        intermediate_size=4 * h,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        model_type="llama",
    )
    lora = peftx.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    models = {
        remat: peftx.get_peft_model(
            LlamaForCausalLM(config, key=jax.random.key(0), gradient_checkpointing=remat),
            lora,
            key=jax.random.key(1),
        )
        for remat in (False, True)
    }
    ids = jax.random.randint(jax.random.key(2), (8, 128), 1, config.vocab_size)
    batch = {"input_ids": ids, "attention_mask": jnp.ones_like(ids), "labels": ids}
    optimizer = optax.adamw(1e-4)
    runs = [  # (preset, mesh, gradient checkpointing, LoRA factors replicated)
        ("dp", make_mesh(data=8, fsdp=1), False, False),
        ("fsdp", make_mesh(), False, False),
        ("fsdp", make_mesh(), False, True),
        ("fsdp", make_mesh(), True, False),
        ("tp", make_mesh(fsdp=4, tensor=2), False, False),
        ("tp", make_mesh(fsdp=4, tensor=2), False, True),
        ("fsdp_tp", make_mesh(fsdp=4, tensor=2), False, False),
        ("fsdp_tp", make_mesh(fsdp=4, tensor=2), True, False),
    ]
    rows = []
    for preset, mesh, remat, whole in runs:
        model = models[remat]
        state, frozen = peftx.train.init_state(
            model, optimizer, key=jax.random.key(3), mesh=mesh, rules=preset
        )
        if whole:  # qwix's rule (factors follow their weight) against whole factors
            state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
        step = peftx.train.make_train_step(peftx.train.causal_lm_loss, optimizer, mesh=mesh)
        compiled = step.lower(state, frozen, batch).compile()
        temporaries = compiled.memory_analysis().temp_size_in_bytes
        state, _ = step(state, frozen, batch)  # compile
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            state, metrics = step(state, frozen, batch)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - start)
        rows.append(
            (
                preset + (" + remat" if remat else "") + (", factors whole" if whole else ""),
                dict(mesh.shape),
                per_device(frozen),
                per_device(state.trainable),
                per_device(state.opt_state),
                temporaries,
                statistics.median(times),
            )
        )
    base_ms = rows[0][6]
    print(
        f"Llama-style, hidden {h}, {args.layers} layers, vocab 4096, LoRA r=8 on every linear "
        f"layer, batch 8x128; jax {jax.__version__}, 8 simulated CPU devices (times: CPU "
        "simulation, not real hardware)\n"
    )
    print(
        "| preset | mesh (data, fsdp, tensor) | base MiB/device | adapter KiB/device "
        "| optimizer KiB/device | temporaries MiB/device | step vs dp |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for preset, shape, frozen_b, train_b, opt_b, temp_b, t in rows:
        mesh = f"{shape['data']}, {shape['fsdp']}, {shape['tensor']}"
        print(
            f"| {preset} | {mesh} | {frozen_b / 2**20:.2f} | {train_b / 2**10:.1f} "
            f"| {opt_b / 2**10:.1f} | {temp_b / 2**20:.2f} | {t / base_ms:.2f}x |"
        )


if __name__ == "__main__":
    main()
