"""Each tuner's train step on the benchmark Llama, against LoRA's and against PEFT's own
implementation of the same method in PyTorch, on this machine.

The model is `benchmarks/suite.py`'s Llama (`--size full`: hidden 512, 4 layers,
intermediate 1376, vocab 2048, batch 8x128; float32), every method on the same seven
projections of each block, AdamW, next-token cross-entropy, `eqx.filter_jit`. The methods
use their PEFT defaults except the size: LoRA r=8; OFT blocks of 32; LoHa and LoKr r=8,
alpha=16; VeRA r=256; HiRA r=8; the newer kinds at LoRA r=8's trainable count (SHiRA r=8,
GraLoRA r=8 in 2x2 blocks, MiSS r=16, Lily r=16: its A per layer, two B per projection);
AdaLoRA init_r=12, target_r=8, allocating at every step (PEFT's defaults; its step is
`peftx.train`'s, which runs the allocator and adds the orthogonality penalty, against
PEFT's step with `update_and_allocate`). PyTorch: transformers' `LlamaForCausalLM` with the
same config and PEFT's config of the same method. Reported: median step time over
round-robin calls, the ratio to peftx LoRA and to PEFT's step of the same method,
trainable parameters, and XLA's temporaries for the compiled step.

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
    "hira": ("HiraConfig", dict(r=8)),
    # at LoRA r=8's trainable count (square weights); Lily's B shared by the 4 layers
    "miss": ("MissConfig", dict(r=16)),
    "shira": ("ShiraConfig", dict(r=8)),
    "gralora": ("GraloraConfig", dict(r=8, gralora_k=2)),
    "lily": ("LilyConfig", dict(r=16, stride_A=1, num_B=2)),
    # PEFT's defaults: no warm-up, allocation at every step while the budget shrinks
    "adalora": ("AdaLoraConfig", dict(init_r=12, target_r=8, total_step=1000)),
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
        if name == "adalora":
            ours[name] = train_variant(f"peftx {name}", model, ids)
        else:
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


def train_variant(name: str, model, ids) -> suite.Variant:
    """`peftx.train`'s step (with the adapter's train hook) as a variant."""
    import optax

    optimizer = optax.adamw(1e-4)
    state, frozen = peftx.train.init_state(model, optimizer, key=jax.random.key(3))

    def loss_fn(m, batch, key):
        x = batch["input_ids"]
        return lm_loss(m(x).logits, x), {"count": jax.numpy.ones((), jax.numpy.float32)}

    step = peftx.train.make_train_step(loss_fn, optimizer)

    def run(state, frozen, unused, batch):
        state, metrics = step(state, frozen, batch)
        return state, unused, metrics["loss"]

    return suite.Variant(name, run, (state, frozen, None, {"input_ids": ids}), step=True)


class AdaLoraTorchVariant(TorchVariant):
    """PEFT's AdaLoRA step as its docs write it: the forward through `AdaLoraModel` (which
    adds the orthogonality penalty), then `update_and_allocate` after the optimizer."""

    def __init__(self, *args, **kwargs):
        self.step_count = 0
        super().__init__(*args, **kwargs)

    def call(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(self.model)
        loss.backward()
        self.opt.step()
        self.model.base_model.update_and_allocate(self.step_count)
        self.step_count += 1
        self.sync()
        return loss.detach().item()


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
    if name == "adalora":
        loss = lambda m: m.base_model(input_ids=x, labels=x).loss  # noqa: E731
        return AdaLoraTorchVariant(f"PEFT {name}", model, loss, 0)
    return TorchVariant(f"PEFT {name}", model, lambda m: m(input_ids=x, labels=x).loss, 0)


if __name__ == "__main__":
    main()
