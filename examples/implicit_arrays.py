"""Implicit arrays from scratch: symbolic zeros, and a custom adapter with its own handler.

1. `peftx.adapters.Zeros` flows through a function as a symbol: `x @ W + Zeros` is
   `x @ W`, `Zeros * x` is `Zeros`, and nothing zero-filled is ever built.
2. `DiagLowRank`, written here, stands for the square weight `diag(d) + U·Vᵀ`. Its
   `dot_general` handler computes `d ⊙ x + U·(Vᵀ·x)` from the fields. It replaces a hidden
   weight of an ordinary `eqx.nn.MLP` through `eqx.tree_at`, is checked against the dense
   formula, trains by gradients on its fields, and `assert_no_dense` proves that no
   `(width, width)` array is built, forward or backward (while a version that
   materializes the weight is caught).

Run with `python examples/implicit_arrays.py`; exits non-zero if a check fails.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

from peftx.adapters import Zeros
from peftx.implicit import (
    DenseWeightError,
    ImplicitArray,
    assert_no_dense,
    materialize,
    primitive_handler,
    strict,
    use_implicit_args,
)


class DiagLowRank(ImplicitArray):
    """The `(n, n)` matrix `diag(d) + U·Vᵀ`, with `d (n,)`, `U (n, r)`, `V (n, r)`."""

    d: jax.Array
    U: jax.Array
    V: jax.Array

    def __check_init__(self):
        n, r = self.U.shape
        if self.d.shape != (n,) or self.V.shape != (n, r):
            raise ValueError(f"DiagLowRank: d {self.d.shape}, U {self.U.shape}, V {self.V.shape}")

    def aval(self):
        return jax.core.ShapedArray((self.d.shape[0],) * 2, self.d.dtype)

    def materialize(self):
        return jnp.diag(self.d) + self.U @ self.V.T


@primitive_handler("dot_general")
def _diag_low_rank_dot(primitive, w: DiagLowRank, x: jax.Array, *, dimension_numbers, **params):
    """`w @ x` contracting `w`'s columns with any one axis `c` of `x` (as `Linear` and its
    `vmap`ped forms do): `d ⊙ x + U·(Vᵀ·x)`, with `w`'s rows first in the output."""
    (w_contract, x_contract), batch = dimension_numbers
    if w_contract != (1,) or batch != ((), ()):
        return NotImplemented  # another layout: the engine would materialize (an error here)
    (c,) = x_contract
    xc = jnp.moveaxis(x, c, 0)
    diagonal = w.d.reshape((-1,) + (1,) * (xc.ndim - 1)) * xc
    low_rank = lax.dot_general(
        w.U, lax.dot_general(w.V, xc, (((0,), (0,)), ((), ()))), (((1,), (0,)), ((), ()))
    )
    return diagonal + low_rank


def main(*, width: int = 24, rank: int = 3, batch: int = 8) -> int:
    ok = True
    k_w, k_mlp, k_d, k_u, k_v, k_x = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(k_x, (batch, 4))

    # 1. symbolic zeros: a zero bias and a zero gate never become arrays
    @use_implicit_args
    def affine(w, b, gate, x):  # one example at a time, vmapped: no rank promotion
        return jax.vmap(lambda v, g: (v @ w + b, g * v))(x, gate)

    w = jax.random.normal(k_w, (4, 5))
    with strict():  # a fallback materialization would raise
        y, gated = affine(w, Zeros((5,)), Zeros((batch, 4)), x)
    print(f"x @ W + Zeros equals x @ W: {bool(jnp.array_equal(y, x @ w))}")
    print(f"Zeros * x is still symbolic: {type(gated).__name__}{gated.shape}")
    ok &= bool(jnp.array_equal(y, x @ w)) and isinstance(gated, Zeros)

    # 2. the custom adapter in an ordinary Equinox model
    mlp = eqx.nn.MLP(4, 2, width_size=width, depth=2, key=k_mlp)
    weight = DiagLowRank(
        1.0 + 0.1 * jax.random.normal(k_d, (width,)),
        0.3 * jax.random.normal(k_u, (width, rank)),
        0.3 * jax.random.normal(k_v, (width, rank)),
    )
    model = eqx.tree_at(
        lambda m: (m.layers[1].weight, m.layers[1].bias), mlp, (weight, Zeros((width,)))
    )
    dense = eqx.tree_at(
        lambda m: (m.layers[1].weight, m.layers[1].bias),
        mlp,
        (jnp.diag(weight.d) + weight.U @ weight.V.T, jnp.zeros(width)),
    )

    def forward(model, x):
        return jax.vmap(model)(x)

    def loss(model, x):
        return jnp.sum(forward(model, x) ** 2)

    with strict():
        out = eqx.filter_jit(use_implicit_args(forward))(model, x)
        grads = eqx.filter_grad(use_implicit_args(loss))(model, x)
    err = float(jnp.max(jnp.abs(out - forward(dense, x))))
    print(f"max |implicit - dense formula| output: {err:.2e}")
    ok &= err < 1e-5

    dense_grads = jax.grad(
        lambda d, U, V: loss(
            eqx.tree_at(lambda m: m.layers[1].weight, dense, jnp.diag(d) + U @ V.T), x
        ),
        argnums=(0, 1, 2),
    )(weight.d, weight.U, weight.V)
    g = grads.layers[1].weight
    gerr = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip((g.d, g.U, g.V), dense_grads))
    print(f"gradients reach d, U, V (type {type(g).__name__}); max error vs dense: {gerr:.2e}")
    ok &= gerr < 1e-4

    # proof from the program: nothing (width, width)-shaped is built, forward or backward
    assert_no_dense(use_implicit_args(loss), model, x)
    assert_no_dense(eqx.filter_grad(use_implicit_args(loss)), model, x)
    print(f"assert_no_dense: no {width}x{width} array in the forward or the gradient")

    def materializing(model, x):  # a shortcut that builds the weight
        return jax.vmap(lambda v: materialize(model.layers[1].weight) @ v)(x)

    try:
        assert_no_dense(use_implicit_args(materializing), model, jnp.ones((batch, width)))
        caught = False
    except DenseWeightError:
        caught = True
    print(f"assert_no_dense catches a materialized weight: {caught}")
    ok &= caught

    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
