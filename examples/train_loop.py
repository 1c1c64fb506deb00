"""A hand-written LoRA training loop on a zoo Llama: `get_peft_model`, `partition`, optax.

A tiny random `peftx.models.LlamaForCausalLM` learns a synthetic language: each token is
followed by a fixed random permutation of it. LoRA (`target_modules="all-linear"`) is the
only thing that trains: `peftx.partition` splits its factors from the frozen base, and an
`eqx.filter_jit` step runs AdamW on them. At the end the script checks that the loss fell
and that every base weight is bit-identical to what it was before training.

Run with `python examples/train_loop.py`; exits non-zero if a check fails.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import peftx
from peftx.models import LlamaConfig, LlamaForCausalLM


def main(*, steps: int = 60, batch: int = 16, seq: int = 12, vocab: int = 64) -> int:
    model_key, lora_key = jax.random.split(jax.random.key(0))
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        initializer_range=0.2,  # a random base with logits of some scale
    )
    base = LlamaForCausalLM(config, key=model_key)
    lora = peftx.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    model = peftx.get_peft_model(base, lora, key=lora_key)
    model.print_trainable_parameters()

    # the synthetic language: token t is always followed by perm[t]
    rng = np.random.default_rng(0)
    perm = rng.permutation(vocab)
    walks = [np.arange(vocab)]  # walks[t]: the sequence that starts at t
    for _ in range(seq - 1):
        walks.append(perm[walks[-1]])
    walks = np.stack(walks, axis=1)

    def sample() -> jax.Array:  # `batch` walks from random first tokens
        return jnp.asarray(walks[rng.integers(0, vocab, batch)])

    def loss_fn(trainable: eqx.Module, frozen: eqx.Module, ids: jax.Array) -> jax.Array:
        logits = eqx.combine(trainable, frozen)(ids).logits[:, :-1]
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
    for i in range(steps):
        trainable, opt_state, loss = step(trainable, opt_state, sample())
        losses.append(float(loss))
        if i % max(1, steps // 5) == 0 or i == steps - 1:
            print(f"step {i:3d}  loss {losses[-1]:.4f}")
    trained = eqx.combine(trainable, frozen)

    fell = losses[-1] < 0.5 * losses[0]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} (chance: {float(jnp.log(vocab)):.4f})")
    before, after = (
        jax.tree.leaves(eqx.filter(m.disable_adapters(), eqx.is_array)) for m in (model, trained)
    )
    same = all(jnp.array_equal(a, b) for a, b in zip(before, after, strict=True))
    print(f"base weights bit-identical after training: {same} ({len(before)} arrays)")
    changed = [
        not jnp.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(peftx.partition(model)[0]), jax.tree.leaves(trainable))
    ]
    print(f"adapter arrays changed by training: {sum(changed)} of {len(changed)}")
    ok = fell and same and all(changed)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
