"""Fine-tune a frozen MLP with LoRA, never building a dense weight.

Each `Linear` weight of a "pretrained" MLP becomes `LoraWeight`, an implicit array for
`W + scaling * lora_B @ lora_A`, and only `lora_A` and `lora_B` are trained. Training runs
under `peftx.implicit.strict()`, so materializing a weight would raise.

Run with `make demo` (settings in `configs/lora_mlp.toml`); exits non-zero if the loss does
not halve or a check fails.
"""

# ruff: noqa: F722  (jaxtyping shape strings such as "out in" are not Python expressions)

import pathlib
import sys
import tomllib
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, PRNGKeyArray

import peftx


class LoraWeight(peftx.implicit.ImplicitArray):
    """`W + scaling * lora_B @ lora_A`, in Equinox's `(out, in)` layout.

    **Arguments:**

    - `W`: the frozen weight, shape `(out, in)`.
    - `lora_A`: shape `(r, in)`.
    - `lora_B`: shape `(out, r)`.
    - `lora_alpha`: the LoRA alpha; `scaling = lora_alpha / r`.
    """

    W: Float[Array, "out in"]
    lora_A: Float[Array, "r in"]
    lora_B: Float[Array, "out r"]
    lora_alpha: float = eqx.field(static=True)

    def __check_init__(self):
        (out, in_), (r, in_a), (out_b, r_b) = self.W.shape, self.lora_A.shape, self.lora_B.shape
        if in_a != in_ or out_b != out or r_b != r:
            raise ValueError(
                f"LoRA factors do not fit W {self.W.shape}: lora_A {self.lora_A.shape} must "
                f"be (r, {in_}) and lora_B {self.lora_B.shape} must be ({out}, r)."
            )

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.lora_A.shape[0]

    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(self.W.shape, self.W.dtype)

    def materialize(self) -> Array:
        return self.W + self.scaling * (self.lora_B @ self.lora_A)


@peftx.implicit.primitive_handler("dot_general")
def _lora_matmul(
    primitive: Any, w: LoraWeight, x: jax.Array, *, dimension_numbers: Any, **params: Any
) -> Any:
    # `Linear` computes `weight @ x`; under `jax.vmap` the batch axis of `x` moves, but the
    # weight still contracts its `in` axis with one axis of `x` and has no batch dims.
    (w_contract, x_contract), (w_batch, x_batch) = dimension_numbers
    if tuple(w_contract) != (1,) or w_batch or x_batch:
        return NotImplemented
    dims = (((1,), tuple(x_contract)), ((), ()))
    # `(out|r, *free axes of x)`: the factors keep the weight's output layout.
    dense = jax.lax.dot_general(w.W, x, dims, **params)
    ax = jax.lax.dot_general(w.lora_A, x, dims, **params)
    bax = jax.lax.dot_general(w.lora_B, ax, (((1,), (0,)), ((), ())), **params)
    return dense + w.scaling * bax


def lora_weight(
    weight: Float[Array, "out in"], *, r: int, alpha: float, key: PRNGKeyArray
) -> LoraWeight:
    """Wrap `weight` with fresh factors: `lora_A` uniform as in HF PEFT, `lora_B` zero."""
    out, in_ = weight.shape
    bound = 1 / in_**0.5
    lora_A = jax.random.uniform(key, (r, in_), weight.dtype, -bound, bound)
    return LoraWeight(weight, lora_A, jnp.zeros((out, r), weight.dtype), alpha)


def add_lora(mlp: eqx.nn.MLP, *, r: int, alpha: float, key: PRNGKeyArray) -> eqx.nn.MLP:
    """Return a new MLP whose every `Linear` weight is a `LoraWeight`."""
    keys = jax.random.split(key, len(mlp.layers))
    weights = [
        lora_weight(layer.weight, r=r, alpha=alpha, key=k) for layer, k in zip(mlp.layers, keys)
    ]
    return eqx.tree_at(lambda m: [layer.weight for layer in m.layers], mlp, weights)


def lora_filter_spec(model: eqx.nn.MLP) -> Any:
    """`True` on the `lora_A` and `lora_B` leaves only: what `eqx.partition` trains."""

    def factors(m: eqx.nn.MLP) -> list[Any]:
        return [f for layer in m.layers for f in (layer.weight.lora_A, layer.weight.lora_B)]

    spec = jax.tree.map(lambda _: False, model)
    return eqx.tree_at(factors, spec, replace=[True] * len(factors(spec)))


def mse(model: eqx.nn.MLP, x: Float[Array, "n in"], y: Float[Array, "n out"]) -> Array:
    pred = jax.vmap(peftx.implicit.use_implicit_args(model))(x)
    return jnp.mean((pred - y) ** 2)


CONFIG = pathlib.Path(__file__).parents[1] / "configs" / "lora_mlp.toml"


def main(config: pathlib.Path = CONFIG, **overrides: Any) -> int:
    cfg = {**tomllib.loads(config.read_text()), **overrides}
    steps, log_every = cfg["steps"], cfg["log_every"]
    pretrained_key, target_key, lora_key, data_key = jax.random.split(jax.random.key(0), 4)
    pretrained = eqx.nn.MLP(16, 1, width_size=64, depth=3, key=pretrained_key)
    target = eqx.nn.MLP(16, 1, width_size=64, depth=3, key=target_key)
    x = jax.random.normal(data_key, (512, 16))
    y = jax.vmap(target)(x)

    model = add_lora(pretrained, r=cfg["r"], alpha=cfg["lora_alpha"], key=lora_key)
    trainable, frozen = eqx.partition(model, lora_filter_spec(model))
    optim = optax.adam(cfg["learning_rate"])
    opt_state = optim.init(trainable)

    @eqx.filter_jit
    def step(trainable, opt_state):
        loss, grads = eqx.filter_value_and_grad(lambda t: mse(eqx.combine(t, frozen), x, y))(
            trainable
        )
        updates, opt_state = optim.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state, loss

    losses = []
    with peftx.implicit.strict():
        for i in range(steps + 1):
            trainable, opt_state, loss = step(trainable, opt_state)
            losses.append(float(loss))
            if i % log_every == 0:
                print(f"step {i:4d}  loss {losses[-1]:.6f}")
    model = eqx.combine(trainable, frozen)

    ok = True
    fell = losses[0] / losses[-1]
    print(f"loss fell {fell:.1f}x ({losses[0]:.6f} -> {losses[-1]:.6f})")
    ok &= fell >= 2

    base = [(layer.weight, layer.bias) for layer in pretrained.layers]
    tuned = [(layer.weight.W, layer.bias) for layer in model.layers]
    frozen_ok = all(jnp.array_equal(a, b) for pair in zip(base, tuned) for a, b in zip(*pair))
    print(f"frozen base weights and biases bit-identical: {frozen_ok}")
    ok &= frozen_ok

    is_lora = lambda w: isinstance(w, LoraWeight)  # noqa: E731
    merged = jax.tree.map(lambda w: w.materialize() if is_lora(w) else w, model, is_leaf=is_lora)
    with peftx.implicit.strict():
        lora_out = jax.vmap(peftx.implicit.use_implicit_args(model))(x)
    diff = float(jnp.max(jnp.abs(lora_out - jax.vmap(merged)(x))))
    print(f"max |LoRA output - merged (W + s B A) output|: {diff:.2e}")
    ok &= diff <= 1e-5

    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
