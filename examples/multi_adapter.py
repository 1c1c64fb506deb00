"""Several LoRA adapters on one zoo Llama, trained together and served in one mixed batch.

Two adapters learn two synthetic languages: after token t, "shift" says t + 1 and "perm"
says perm[t]. Each training batch mixes both (`adapter_names` per example, as integer ids
from `adapter_ids`, so the jitted step takes them as data), and `peftx.partition(model,
["shift", "perm"])` trains both adapters in the same step. Then one batch is served with a
different adapter per row, `"__base__"` (the model without adapters) included, and each
row is checked against that adapter run alone (`set_adapter`) and the base run alone.

Run with `python examples/multi_adapter.py`; exits non-zero if a check fails.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import peftx
from peftx.models import LlamaConfig, LlamaForCausalLM


def main(*, steps: int = 60, batch: int = 16, seq: int = 10, vocab: int = 48) -> int:
    model_key, k_shift, k_perm = jax.random.split(jax.random.key(0), 3)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        initializer_range=0.2,
    )
    base = LlamaForCausalLM(config, key=model_key)
    lora = peftx.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    model = peftx.get_peft_model(base, lora, key=k_shift, adapter_name="shift")
    model = model.add_adapter("perm", lora, key=k_perm)

    rng = np.random.default_rng(0)
    rules = {"shift": (np.arange(vocab) + 1) % vocab, "perm": rng.permutation(vocab)}
    walks = {}  # walks[name][t]: the sequence of that language that starts at t
    for name, rule in rules.items():
        walk = [np.arange(vocab)]
        for _ in range(seq - 1):
            walk.append(rule[walk[-1]])
        walks[name] = np.stack(walk, axis=1)

    def sample(name: str, n: int) -> jax.Array:
        return jnp.asarray(walks[name][rng.integers(0, vocab, n)])

    names = ["shift", "perm"] * (batch // 2)  # the mixed batch: every other row each
    adapter_ids = model.adapter_ids(names)

    def loss_fn(trainable, frozen, ids, adapter_ids):
        logits = eqx.combine(trainable, frozen)(ids, adapter_names=adapter_ids).logits[:, :-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    trainable, frozen = peftx.partition(model, ["shift", "perm"])
    optim = optax.adamw(1e-2)
    opt_state = optim.init(trainable)

    @eqx.filter_jit
    def step(trainable, opt_state, ids, adapter_ids):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(trainable, frozen, ids, adapter_ids)
        updates, opt_state = optim.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state, loss

    def mixed_batch() -> jax.Array:  # rows alternate between the two languages
        rows = jnp.stack([sample("shift", batch // 2), sample("perm", batch // 2)], axis=1)
        return rows.reshape(batch, seq)

    for i in range(steps):
        trainable, opt_state, loss = step(trainable, opt_state, mixed_batch(), adapter_ids)
        if i % max(1, steps // 4) == 0 or i == steps - 1:
            print(f"step {i:3d}  mixed-batch loss {float(loss):.4f}")
    model = eqx.combine(trainable, frozen)

    logits = eqx.filter_jit(lambda model, ids, **kwargs: model(ids, **kwargs).logits)

    # each adapter predicts its own language, and not the other's
    ok = True
    test = {name: sample(name, 8) for name in rules}
    for name in rules:
        for lang, ids in test.items():
            pred = jnp.argmax(logits(model.set_adapter(name), ids)[:, :-1], axis=-1)
            acc = float(jnp.mean(pred == ids[:, 1:]))
            print(f"adapter {name!r:8} on {lang!r:8} text: next-token accuracy {acc:.2f}")
            ok &= acc > 0.6 if lang == name else acc < 0.2

    # serving: one batch, one adapter per row, the base model included
    serve = ["perm", peftx.BASE, "shift", "perm"]
    ids = jnp.concatenate(
        [test["perm"][:1], test["shift"][:1], test["shift"][1:2], test["perm"][1:2]]
    )
    mixed = logits(model, ids, adapter_names=model.adapter_ids(serve))
    alone = [
        logits(base if name == peftx.BASE else model.set_adapter(name), ids[i : i + 1])[0]
        for i, name in enumerate(serve)
    ]
    err = float(jnp.max(jnp.abs(mixed - jnp.stack(alone))))
    print(f"served {serve}: max |mixed batch - each alone| = {err:.2e}")
    ok &= err < 1e-5 * float(np.max(np.abs(np.asarray(mixed)))) + 1e-6

    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
