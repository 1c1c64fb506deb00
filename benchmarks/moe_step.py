"""A mixture of experts' train step with grouped expert products, against the same step
running every expert on every token (the dense all-experts computation), on one
Mixtral-shaped model.

Both variants run the zoo's `LlamaForCausalLM` with `num_experts > 0` (Mixtral's block:
softmax router, top-k, renormalized). `grouped` is peftx's path
(`peftx.models._moe.sparse_moe`: (token, expert) pairs sorted by expert, each expert
multiplying its own rows: `lax.ragged_dot` on GPU/TPU, expert-blocked batched products
on CPU); `dense` swaps in a block that multiplies every token by every expert and weights
the results by the routing weights (zero outside the top k), which is what a model
without grouped products does. Two kinds of step: full fine-tuning, and LoRA (r=8 on the
attention projections and the router). Reported: the median step time over `--steps`
steps taken round-robin, and XLA's figures for the compiled step (`memory_analysis()`):
temporaries, and temporaries plus arguments plus outputs minus aliases as the peak
estimate. Ratios are to `dense` of the same kind.

Run: `python benchmarks/moe_step.py [--experts 8] [--top-k 2] [--steps 5]`.
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import peftx
import peftx.models as pm
import peftx.models._llama as llama
from peftx.models._common import linear
from peftx.models._moe import route, sparse_moe


def dense_moe(block, x, top_k, normalize, act):
    """Every expert on every token, weighted by the routing weights."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    logits = linear(block.gate, x2)
    weights, chosen = route(logits, top_k, normalize)
    experts = block.experts.gate_up_proj.shape[0]
    full = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(chosen, experts))
    gate, up = jnp.split(jnp.einsum("th,eoh->teo", x2, block.experts.gate_up_proj), 2, -1)
    y = jnp.einsum("tei,ehi->teh", act(gate) * up, block.experts.down_proj)
    out = jnp.einsum("teh,te->th", y, full.astype(y.dtype))
    return out.reshape(shape).astype(x.dtype), logits


def build(args) -> pm.LlamaForCausalLM:
    config = pm.LlamaConfig(
        model_type="mixtral",
        vocab_size=2048,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(args.hidden // 128, 1),
        head_dim=64,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=4096,
    )
    return pm.LlamaForCausalLM(config, key=jax.random.PRNGKey(0))


def make_step(model, lora: bool, moe):
    if lora:
        config = peftx.LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate"]
        )
        model = peftx.get_peft_model(model, config, key=jax.random.PRNGKey(1))
        trainable, frozen = peftx.partition(model)
    else:
        trainable, frozen = eqx.partition(model, eqx.is_inexact_array)
    optimizer = optax.adamw(1e-4)
    state = optimizer.init(trainable)

    def step(frozen, trainable, state, ids):
        llama.sparse_moe = moe  # read when the step is traced

        def loss(t):
            out = eqx.combine(t, frozen)(ids[:, :-1])
            ce = optax.softmax_cross_entropy_with_integer_labels(
                out.logits.astype(jnp.float32), ids[:, 1:]
            ).mean()
            return ce + 0.01 * out.aux_loss

        value, grads = jax.value_and_grad(loss)(trainable)
        updates, state = optimizer.update(grads, state, trainable)
        return value, eqx.apply_updates(trainable, updates), state

    return jax.jit(step, donate_argnums=(1, 2)), frozen, trainable, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    ids = jax.random.randint(jax.random.PRNGKey(2), (args.batch, args.seq + 1), 0, 2048)
    variants = {}
    for kind in ("full fine-tuning", "LoRA"):
        for name, moe in (("grouped", sparse_moe), ("dense", dense_moe)):
            step, frozen, trainable, state = make_step(build(args), kind == "LoRA", moe)
            compiled = step.lower(frozen, trainable, state, ids).compile()
            memory = compiled.memory_analysis()
            loss, trainable, state = compiled(frozen, trainable, state, ids)
            variants[kind, name] = dict(
                run=compiled,
                args=[frozen, trainable, state],
                times=[],
                loss=float(loss),
                temp=memory.temp_size_in_bytes,
                peak=memory.temp_size_in_bytes
                + memory.argument_size_in_bytes
                + memory.output_size_in_bytes
                - memory.alias_size_in_bytes,
            )
    llama.sparse_moe = sparse_moe
    for _ in range(args.steps):
        for v in variants.values():
            frozen, trainable, state = v["args"]
            start = time.perf_counter()
            loss, trainable, state = v["run"](frozen, trainable, state, ids)
            jax.block_until_ready(loss)
            v["times"].append(time.perf_counter() - start)
            v["args"] = [frozen, trainable, state]
    print(
        f"Mixtral-shaped LlamaForCausalLM: hidden {args.hidden}, {args.layers} layers, "
        f"{args.experts} experts (top {args.top_k}) of {args.hidden * 2} features, batch "
        f"{args.batch}x{args.seq}, float32, AdamW; JAX {jax.__version__} on "
        f"{jax.default_backend()}; medians of {args.steps} round-robin steps.\n"
    )
    print(
        "| step | experts | median ms | vs dense | XLA temp MiB | vs dense | peak MiB "
        "| vs dense | first loss |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (kind, name), v in variants.items():
        base = variants[kind, "dense"]
        ms, base_ms = statistics.median(v["times"]) * 1e3, statistics.median(base["times"]) * 1e3
        print(
            f"| {kind} | {name} | {ms:.1f} | {ms / base_ms:.2f}x | {v['temp'] / 2**20:.1f} | "
            f"{v['temp'] / base['temp']:.2f}x | {v['peak'] / 2**20:.1f} | "
            f"{v['peak'] / base['peak']:.2f}x | {v['loss']:.6f} |"
        )


if __name__ == "__main__":
    main()
