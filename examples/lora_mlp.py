"""Fine-tune a frozen MLP with LoRA (or QLoRA), never building a dense weight.

Each hidden `Linear` weight of a "pretrained" MLP becomes a `peftx.adapters.LoraArray`, an
implicit array for `W + scaling * lora_B @ lora_A` (with `quantize = true` in the config,
`W` is first quantized to NF4: QLoRA). Only `lora_A` and `lora_B` train, with LoRA dropout.
Training runs under `peftx.implicit.strict()`, so materializing a weight would raise.

Run with `make demo` (settings in `configs/lora_mlp.toml`); exits non-zero if the loss does
not halve or a check fails.
"""

import pathlib
import sys
import tomllib
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from peftx.adapters import LoraArray, lora, merge, quantize_nf4, with_dropout
from peftx.implicit import strict, use_implicit_args

CONFIG = pathlib.Path(__file__).parents[1] / "configs" / "lora_mlp.toml"


def add_lora(mlp: eqx.nn.MLP, cfg: dict[str, Any], *, key: jax.Array) -> eqx.nn.MLP:
    """A new MLP whose hidden `Linear` weights are adapted with LoRA (the 1-output head,
    of rank 1, is left frozen, as PEFT's "all-linear" leaves the output head)."""
    hidden = mlp.layers[:-1]
    keys = jax.random.split(key, len(hidden))

    def adapt(weight: jax.Array, k: jax.Array) -> LoraArray:
        base = quantize_nf4(weight) if cfg["quantize"] else weight
        return lora(
            base, r=cfg["r"], lora_alpha=cfg["lora_alpha"], lora_dropout=cfg["lora_dropout"], key=k
        )

    weights = [adapt(layer.weight, k) for layer, k in zip(hidden, keys)]
    return eqx.tree_at(lambda m: [layer.weight for layer in m.layers[:-1]], mlp, weights)


def is_lora(x: Any) -> bool:
    return isinstance(x, LoraArray)


def trainable_spec(model: eqx.nn.MLP) -> Any:
    """`True` exactly on the `lora_A` and `lora_B` leaves: what `eqx.partition` trains."""
    spec = jax.tree.map(lambda _: False, model)
    return jax.tree.map(
        lambda w: eqx.tree_at(lambda m: (m.lora_A, m.lora_B), w, (True, True)) if is_lora(w) else w,
        spec,
        is_leaf=is_lora,
    )


def main(config: pathlib.Path = CONFIG, **overrides: Any) -> int:
    cfg = {**tomllib.loads(config.read_text()), **overrides}
    pretrained_key, target_key, lora_key, data_key, dropout_key = jax.random.split(
        jax.random.key(0), 5
    )
    pretrained = eqx.nn.MLP(16, 1, width_size=64, depth=3, key=pretrained_key)
    target = eqx.nn.MLP(16, 1, width_size=64, depth=3, key=target_key)
    x = jax.random.normal(data_key, (512, 16))
    y = jax.vmap(target)(x)

    model = add_lora(pretrained, cfg, key=lora_key)
    trainable, frozen = eqx.partition(model, trainable_spec(model))
    optim = optax.adam(cfg["learning_rate"])
    opt_state = optim.init(trainable)

    def loss_fn(trainable: Any, key: jax.Array) -> jax.Array:
        model = with_dropout(eqx.combine(trainable, frozen), key)
        pred = use_implicit_args(lambda m, x: jax.vmap(m)(x))(model, x)
        return jnp.mean((pred - y) ** 2)

    @eqx.filter_jit
    def step(trainable: Any, opt_state: Any, key: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = eqx.filter_value_and_grad(loss_fn)(trainable, key)
        updates, opt_state = optim.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state, loss

    losses = []
    with strict():
        for i, key in enumerate(jax.random.split(dropout_key, cfg["steps"] + 1)):
            trainable, opt_state, loss = step(trainable, opt_state, key)
            losses.append(float(loss))
            if i % cfg["log_every"] == 0:
                print(f"step {i:4d}  loss {losses[-1]:.6f}")
    model = eqx.combine(trainable, frozen)

    ok = True
    fell = losses[0] / losses[-1]
    print(f"loss fell {fell:.1f}x ({losses[0]:.6f} -> {losses[-1]:.6f})")
    ok &= fell >= 2

    def base(m: eqx.nn.MLP) -> list[Any]:
        weights = [w.weight if is_lora(w) else w for w in (layer.weight for layer in m.layers)]
        return jax.tree.leaves([weights, [layer.bias for layer in m.layers]])

    initial = add_lora(pretrained, cfg, key=lora_key)
    frozen_ok = all(jnp.array_equal(a, b) for a, b in zip(base(initial), base(model)))
    print(f"frozen base weights and biases bit-identical: {frozen_ok}")
    ok &= frozen_ok

    merged = jax.tree.map(lambda w: merge(w) if is_lora(w) else w, model, is_leaf=is_lora)
    with strict():
        lora_out = use_implicit_args(lambda m, x: jax.vmap(m)(x))(model, x)
    diff = float(jnp.max(jnp.abs(lora_out - jax.vmap(merged)(x))))
    print(f"max |LoRA output - merged (W + s B A) output|: {diff:.2e}")
    ok &= diff <= 1e-4

    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
