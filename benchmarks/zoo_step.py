"""The LoRA train step on each newer architecture of the zoo, against full fine-tuning of
the same model and against PyTorch PEFT on transformers' own model, on this machine.

For each architecture (`--archs`, default all of them): transformers builds a model of one
benchmark size (hidden 256, 4 layers, vocab 2048, float32) with random weights,
`save_pretrained` writes it, and `peftx.models.from_pretrained` loads it. Four steps of
next-token cross-entropy with AdamW on the same random batch (`--batch` x `--seq`):
peftx LoRA (r=8, alpha=16 on the attention and MLP projections, the experts of a mixture
left frozen), peftx full fine-tuning, PyTorch PEFT LoRA with the same targets, and PyTorch
full fine-tuning. Medians of `--repeats` round-robin calls after a warm-up; ratios are
to the same framework's full fine-tuning, and peftx LoRA to PyTorch PEFT LoRA.

Run: `python benchmarks/zoo_step.py [--archs qwen3 gemma2] [--repeats 5]`.
"""

import argparse
import tempfile

import equinox as eqx
import jax
import numpy as np
import torch
import transformers
from suite import ALPHA, RANK, TorchVariant, lm_loss, md_table, measure, ms, step_variant

import peftx
import peftx.models as pm

COMMON = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    attn_implementation="eager",
)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ARCHS = {
    "qwen3": (lambda: transformers.Qwen3Config(**COMMON, head_dim=64), ATTENTION + MLP),
    "gemma2": (lambda: transformers.Gemma2Config(**COMMON, head_dim=64), ATTENTION + MLP),
    "gemma3_text": (
        lambda: transformers.Gemma3TextConfig(**COMMON, head_dim=64),
        ATTENTION + MLP,
    ),
    "phi3": (
        lambda: transformers.Phi3Config(**COMMON, pad_token_id=0),
        ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    ),
    "mixtral": (
        lambda: transformers.MixtralConfig(
            **{**COMMON, "intermediate_size": 512}, num_local_experts=8, num_experts_per_tok=2
        ),
        ATTENTION,
    ),
    "qwen3_moe": (
        lambda: transformers.Qwen3MoeConfig(
            **COMMON, head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256
        ),
        ATTENTION,
    ),
}


def variants(name: str, batch: np.ndarray) -> list:
    import peft

    make_config, targets = ARCHS[name]
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(make_config())
    with tempfile.TemporaryDirectory() as path:
        theirs.save_pretrained(path)
        ours = pm.from_pretrained(path)

    def loss(model, ids):
        return lm_loss(model(ids).logits, ids)

    config = peftx.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets)
    lora_model = peftx.get_peft_model(ours, config, key=jax.random.PRNGKey(1))
    ids = jax.numpy.asarray(batch)
    lora = step_variant("peftx LoRA", lora_model, lora_model.trainable_spec(), loss, ids)
    full = step_variant("peftx full fine-tuning", ours, eqx.is_inexact_array, loss, ids)
    torch_ids = torch.as_tensor(batch, dtype=torch.long)

    def torch_loss(m):
        return m(input_ids=torch_ids, labels=torch_ids).loss

    peft_config = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0, init_lora_weights=False
    )
    return [
        lora,
        full,
        TorchVariant("PyTorch PEFT LoRA", peft.get_peft_model(theirs, peft_config), torch_loss, 0),
        TorchVariant(
            "PyTorch full fine-tuning",
            transformers.AutoModelForCausalLM.from_config(make_config()).train(),
            torch_loss,
            0,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    batch = np.random.default_rng(0).integers(1, 2048, (args.batch, args.seq))
    rows = []
    for name in args.archs:
        vs = variants(name, batch)
        measure(vs, warmup=1, repeats=args.repeats)
        lora, full, torch_lora, torch_full = (v.median for v in vs)
        rows.append(
            [
                name,
                ms(lora),
                ms(full),
                f"{lora / full:.2f}x",
                ms(torch_lora),
                ms(torch_full),
                f"{torch_lora / torch_full:.2f}x",
                f"{lora / torch_lora:.2f}x",
            ]
        )
    header = [
        "architecture",
        "peftx LoRA ms",
        "peftx full FT ms",
        "LoRA / full",
        "PEFT LoRA ms",
        "torch full FT ms",
        "PEFT / full",
        "peftx / PEFT",
    ]
    print(
        f"batch {args.batch}x{args.seq}, hidden 256, 4 layers, vocab 2048, float32, AdamW; "
        f"LoRA r={RANK}, alpha={ALPHA}; medians of {args.repeats} round-robin calls; JAX "
        f"{jax.__version__} on {jax.default_backend()}, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads.\n"
    )
    print(md_table(header, rows))


if __name__ == "__main__":
    main()
