"""QLoRA on a zoo Llama: an NF4 base (double quantization, bfloat16 compute) under LoRA.

A tiny random bfloat16 `peftx.models.LlamaForCausalLM` is quantized by
`peftx.quantize_model` with transformers' `BitsAndBytesConfig` fields (every `Linear` but
the head becomes an `NF4Array`, bit for bit bitsandbytes' format), then
`peftx.get_peft_model` puts float32 LoRA factors on every linear layer and only those
train. The script prints the bytes of the quantized weights before and after (NF4 with
double quantization: about half a byte per parameter) and checks that the loss falls on
a synthetic next-token task, under `strict()` so that no weight is dequantized whole
outside the NF4 handler.

Run with `python examples/qlora.py`; exits non-zero if a check fails.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import peftx
from peftx.adapters import NF4Array
from peftx.implicit import strict
from peftx.models import LlamaConfig, LlamaForCausalLM


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def main(*, steps: int = 40, batch: int = 16, seq: int = 12, vocab: int = 64) -> int:
    model_key, lora_key = jax.random.split(jax.random.key(0))
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=0.2,  # a random base with logits of some scale
    )
    base = LlamaForCausalLM(config, key=model_key, dtype=jnp.bfloat16)
    quant = peftx.QuantizationConfig(
        load_in_4bit=True, bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype="bfloat16"
    )
    qbase = peftx.quantize_model(base, quant)

    linears = peftx.of_type(eqx.nn.Linear)
    before = [lin.weight for lin in peftx.select(base).at(linears).get()]
    after = [lin.weight for lin in peftx.select(qbase).at(linears).get()]
    quantized = [(b, a) for b, a in zip(before, after) if isinstance(a, NF4Array)]
    params = sum(b.size for b, _ in quantized)
    bf16, nf4 = sum(nbytes(b) for b, _ in quantized), sum(nbytes(a) for _, a in quantized)
    layers = config.num_hidden_layers
    print(f"{len(quantized)} of {len(after)} Linear weights (stacked over {layers} layers) now NF4")
    print(f"{params:,} quantized parameters")
    print(f"bfloat16: {bf16:,} bytes ({bf16 / params:.3f} B/param)")
    print(f"NF4 + double quant: {nf4:,} bytes ({nf4 / params:.3f} B/param)")
    print(f"whole base: {nbytes(base):,} -> {nbytes(qbase):,} bytes")

    lora = peftx.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    model = peftx.get_peft_model(qbase, lora, key=lora_key)
    # (not `print_trainable_parameters()`: its total leaves out the NF4 codes, which are uint8)
    trained = model.get_nb_trainable_parameters()[0]
    print(f"trainable LoRA parameters: {trained:,} (float32) over the frozen NF4 base")

    # the synthetic language: token t is always followed by perm[t]
    rng = np.random.default_rng(0)
    perm = rng.permutation(vocab)
    walks = [np.arange(vocab)]  # walks[t]: the sequence that starts at t
    for _ in range(seq - 1):
        walks.append(perm[walks[-1]])
    walks = np.stack(walks, axis=1)

    def sample() -> jax.Array:  # `batch` walks from random first tokens
        return jnp.asarray(walks[rng.integers(0, vocab, batch)])

    def loss_fn(trainable, frozen, ids):
        logits = eqx.combine(trainable, frozen)(ids).logits[:, :-1].astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    trainable, frozen = peftx.partition(model)
    optim = optax.adamw(1e-2)
    opt_state = optim.init(trainable)

    @eqx.filter_jit
    def step(trainable, opt_state, ids):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(trainable, frozen, ids)
        updates, opt_state = optim.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state, loss

    losses = []
    with strict():
        for i in range(steps):
            trainable, opt_state, loss = step(trainable, opt_state, sample())
            losses.append(float(loss))
            if i % max(1, steps // 4) == 0 or i == steps - 1:
                print(f"step {i:3d}  loss {losses[-1]:.4f}")

    dtypes = {str(x.dtype) for x in jax.tree.leaves(trainable)}
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; trainable dtypes {sorted(dtypes)}")
    ok = losses[-1] < 0.5 * losses[0] and nf4 / params < 0.6 and dtypes == {"float32"}
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
