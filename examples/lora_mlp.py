"""Fine-tune a frozen MLP with LoRA (or QLoRA) through peftx's PEFT-style API.

A "pretrained" `eqx.nn.MLP` is adapted by `peftx.get_peft_model` with the `LoraConfig` in
`configs/lora_mlp.toml` (every hidden `Linear`; with `quantize = true` the base weights are
first quantized to NF4 by `peftx.quantize_model`: QLoRA). `peftx.partition` splits the
trainable adapters from the frozen rest for a plain `eqx.filter_jit` + optax loop with LoRA
dropout. Training runs under `peftx.implicit.strict()`, so materializing a weight would
raise. At the end the adapters are merged back into a plain MLP.

Run with `make demo`; exits non-zero if the loss does not halve or a check fails.
"""

import pathlib
import sys
import tomllib
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import peftx
from peftx.adapters import with_dropout
from peftx.implicit import strict

CONFIG = pathlib.Path(__file__).parents[1] / "configs" / "lora_mlp.toml"


def main(config: pathlib.Path = CONFIG, **overrides: Any) -> int:
    train = {**tomllib.loads(config.read_text())["train"], **overrides}
    pretrained_key, target_key, lora_key, data_key, dropout_key = jax.random.split(
        jax.random.key(0), 5
    )
    pretrained = eqx.nn.MLP(16, 1, width_size=64, depth=3, key=pretrained_key)
    target = eqx.nn.MLP(16, 1, width_size=64, depth=3, key=target_key)
    x = jax.random.normal(data_key, (512, 16))
    y = jax.vmap(target)(x)

    base = pretrained
    if train["quantize"]:
        base = peftx.quantize_model(pretrained, peftx.QuantizationConfig.from_toml(config))
    peft_model = peftx.get_peft_model(base, peftx.from_toml(config), key=lora_key)
    peft_model.print_trainable_parameters()
    trainable, frozen = peftx.partition(peft_model)
    optim = optax.adam(train["learning_rate"])
    opt_state = optim.init(trainable)

    def loss_fn(trainable: Any, key: jax.Array) -> jax.Array:
        model = with_dropout(eqx.combine(trainable, frozen), key)
        pred = jax.vmap(model)(x)
        return jnp.mean((pred - y) ** 2)

    @eqx.filter_jit
    def step(trainable: Any, opt_state: Any, key: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = eqx.filter_value_and_grad(loss_fn)(trainable, key)
        updates, opt_state = optim.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state, loss

    losses = []
    with strict():
        for i, key in enumerate(jax.random.split(dropout_key, train["steps"] + 1)):
            trainable, opt_state, loss = step(trainable, opt_state, key)
            losses.append(float(loss))
            if i % train["log_every"] == 0:
                print(f"step {i:4d}  loss {losses[-1]:.6f}")
    trained = eqx.combine(trainable, frozen)

    ok = True
    fell = losses[0] / losses[-1]
    print(f"loss fell {fell:.1f}x ({losses[0]:.6f} -> {losses[-1]:.6f})")
    ok &= fell >= 2

    before, after = (
        jax.tree.leaves(eqx.filter(m.disable_adapters(), eqx.is_array))
        for m in (peft_model, trained)
    )
    frozen_ok = all(jnp.array_equal(a, b) for a, b in zip(before, after, strict=True))
    print(f"frozen base weights and biases bit-identical: {frozen_ok}")
    ok &= frozen_ok

    merged = trained.merge_and_unload()  # a plain eqx.nn.MLP with dense weights
    with strict():
        lora_out = jax.vmap(trained)(x)
    diff = float(jnp.max(jnp.abs(lora_out - jax.vmap(merged)(x))))
    print(f"{type(merged).__name__}: max |adapted output - merged output|: {diff:.2e}")
    ok &= diff <= 1e-4 and type(merged) is eqx.nn.MLP

    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
