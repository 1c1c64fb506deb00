"""Fine-tune LoRA on a GPT-2 checkpoint, merge it, and load the result in PyTorch.

A tiny random GPT-2 is written as a HF checkpoint (`peftx.save_pretrained`) and read back
with `peftx.from_pretrained`, as a real one would be. LoRA on `c_attn`, `c_proj` and
`c_fc` (GPT-2's Conv1D layers) trains for a few steps. Then:

1. `merge_and_unload()` gives a plain `GPT2LMHeadModel`, saved with
   `peftx.save_pretrained`; transformers' `AutoModelForCausalLM` loads it in PyTorch and
   its logits equal those of peftx's unmerged adapted model;
2. the adapter alone is saved in HF PEFT's format (`PeftModel.save_pretrained`) and
   PyTorch PEFT loads it on the original checkpoint, with the same logits.

Without torch installed, the PyTorch part is skipped (and said so).

Run with `python examples/merge_export.py`; exits non-zero if a check fails.
"""

import importlib.util
import pathlib
import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import peftx
from peftx.models import GPT2Config, GPT2LMHeadModel


def main(*, steps: int = 20, batch: int = 8, seq: int = 12, vocab: int = 64) -> int:
    with tempfile.TemporaryDirectory(prefix="peftx-merge-export-") as tmp:
        return run(pathlib.Path(tmp), steps=steps, batch=batch, seq=seq, vocab=vocab)


def run(tmp: pathlib.Path, *, steps: int, batch: int, seq: int, vocab: int) -> int:
    model_key, lora_key = jax.random.split(jax.random.key(0))
    config = GPT2Config(
        vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2, n_head=4, initializer_range=0.2
    )
    peftx.save_pretrained(GPT2LMHeadModel(config, key=model_key), tmp / "base")
    base = peftx.from_pretrained(tmp / "base", model_class="GPT2LMHeadModel")

    lora = peftx.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"])
    model = peftx.get_peft_model(base, lora, key=lora_key)
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
    for _ in range(steps):
        trainable, opt_state, loss = step(trainable, opt_state, sample())
        losses.append(float(loss))
    model = eqx.combine(trainable, frozen)
    print(f"fine-tuned {steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    ok = losses[-1] < losses[0]

    ids = sample()
    adapted = np.asarray(model(ids).logits)  # the unmerged adapter, through its handlers
    merged = model.merge_and_unload()
    peftx.save_pretrained(merged, tmp / "merged")
    model.save_pretrained(tmp / "adapter")
    print(f"{type(merged).__name__} saved with peftx.save_pretrained, adapter in PEFT's format")
    change = float(np.max(np.abs(np.asarray(base(ids).logits) - adapted)))
    print(f"max |adapted - base| logits: {change:.2e} (what the fine-tune changed)")
    # float32 sums of up to 128 terms in another order: tens of ulps of the logits' scale
    tol = 64 * np.finfo(np.float32).eps * float(np.max(np.abs(adapted)))
    ok &= change > 1e3 * tol
    err = float(np.max(np.abs(np.asarray(merged(ids).logits) - adapted)))
    print(f"max |merged - unmerged| logits in JAX: {err:.2e} (tolerance {tol:.2e})")
    ok &= err <= tol

    if importlib.util.find_spec("torch") is None:
        print("torch is not installed: skipping the PyTorch checks")
    else:
        import peft
        import torch
        import transformers

        torch_ids = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        with torch.no_grad():
            theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp / "merged").eval()
            err = float(np.max(np.abs(theirs(torch_ids).logits.numpy() - adapted)))
            print(f"max |transformers(merged) - peftx(unmerged)| logits: {err:.2e}")
            ok &= err <= tol
            torch_base = transformers.AutoModelForCausalLM.from_pretrained(tmp / "base")
            theirs = peft.PeftModel.from_pretrained(torch_base, tmp / "adapter").eval()
            err = float(np.max(np.abs(theirs(torch_ids).logits.numpy() - adapted)))
            print(f"max |PyTorch PEFT(adapter) - peftx(unmerged)| logits: {err:.2e}")
            ok &= err <= tol

    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
