"""Each tuner's train step on the benchmark Llama, against LoRA's and against PEFT's own
implementation of the same method in PyTorch, on this machine.

The model is `benchmarks/suite.py`'s Llama (`--size full`: hidden 512, 4 layers,
intermediate 1376, vocab 2048, batch 8x128; float32), every method on the same seven
projections of each block, AdamW, next-token cross-entropy, `eqx.filter_jit`. The methods
use their PEFT defaults except the size: LoRA r=8; OFT blocks of 32; LoHa and LoKr r=8,
alpha=16; VeRA r=256. PyTorch: transformers' `LlamaForCausalLM` with the same config and
PEFT's config of the same method. Reported: median step time over round-robin calls,
the ratio to peftx LoRA and to PEFT's step of the same method, trainable parameters, and
XLA's temporaries for the compiled step.

Run: `python benchmarks/tuners_step.py [--size full|quick|tiny] [--methods lora oft ...]`.
"""

import argparse

import jax
import suite
from suite import LLAMA_TARGETS, SIZES, TorchVariant, lm_loss, md_table, measure, mib, ms

import peftx
import peftx.models as pm

METHODS = {
    "lora": ("LoraConfig", dict(r=8, lora_alpha=16)),
    "oft": ("OFTConfig", dict(oft_block_size=32, r=0)),
    "loha": ("LoHaConfig", dict(r=8, alpha=16)),
    "lokr": ("LoKrConfig", dict(r=8, alpha=16)),
    "vera": ("VeraConfig", dict(r=256)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="full", choices=["full", "quick", "tiny"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--no-torch", action="store_true", help="skip PEFT's steps")
    args = parser.parse_args()
    sizes = SIZES[args.size]
    c = suite.llama_config(sizes["llama"])
    *_, b, s = sizes["llama"]
    ids = jax.random.randint(jax.random.key(1), (b, s), 0, c.vocab_size)
    base = pm.LlamaForCausalLM(c, key=jax.random.key(0))

    def loss(model, x):
        return lm_loss(model(x).logits, x)

    ours, theirs = {}, {}
    for name in args.methods:
        cls, fields = METHODS[name]
        config = getattr(peftx, cls)(target_modules=LLAMA_TARGETS, **fields)
        model = peftx.get_peft_model(base, config, key=jax.random.key(2))
        ours[name] = suite.step_variant(
            f"peftx {name}", model, model.trainable_spec(), loss, ids, implicit=name != "loha"
        )
        ours[name].n_trainable = model.get_nb_trainable_parameters()[0]
        if not args.no_torch:
            theirs[name] = torch_variant(name, c, ids)
    variants = list(ours.values()) + list(theirs.values())
    measure(variants, sizes["warmup"], sizes["repeats"])
    lora = ours.get("lora")
    rows = []
    for name, v in ours.items():
        t = theirs.get(name)
        rows.append(
            [
                name,
                ms(v.median),
                f"{v.median / lora.median:.2f}x" if lora else "",
                ms(t.median) if t else "",
                f"{v.median / t.median:.2f}x" if t else "",
                f"{v.n_trainable:,}",
                mib(v.memory.temp_size_in_bytes),
            ]
        )
    print(
        f"Llama hidden {c.hidden_size}, {c.num_hidden_layers} layers, batch {b}x{s}, float32, "
        f"AdamW; medians of {sizes['repeats']} round-robin calls; JAX {jax.__version__} on "
        f"{jax.default_backend()}.\n"
    )
    header = ["method", "peftx ms", "vs peftx LoRA", "PEFT ms", "peftx / PEFT", "trainable"]
    print(md_table([*header, "XLA temp MiB"], rows))


def torch_variant(name: str, config: pm.LlamaConfig, ids) -> TorchVariant:
    import numpy as np
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoConfig.for_model(**config.to_hf_config())
    cls, fields = METHODS[name]
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM(hf),
        getattr(peft, cls)(target_modules=LLAMA_TARGETS, **fields),
    ).train()
    x = torch.as_tensor(np.asarray(ids, np.int64))
    return TorchVariant(f"PEFT {name}", model, lambda m: m(input_ids=x, labels=x).loss, 0)


if __name__ == "__main__":
    main()
