"""Implicit array types written the way a user would, for testing the engine."""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from peftx.implicit import ImplicitArray, default_handler, primitive_handler


class Scaled(ImplicitArray):
    """`value * scale` for a scalar `scale`: linear in each field, any layout."""

    value: Array
    scale: Array

    def aval(self):
        return jax.core.ShapedArray(self.value.shape, self.value.dtype)

    def materialize(self):
        return self.value * self.scale


def _parts(x):
    return (x.value, x.scale) if isinstance(x, Scaled) else (x, None)


@primitive_handler("dot_general")
def _scaled_dot(primitive, x: Scaled | jax.Array, y: Scaled | jax.Array, **params):
    (xv, xs), (yv, ys) = _parts(x), _parts(y)
    out = default_handler(primitive, xv, yv, **params)
    for scale in (xs, ys):
        out = out if scale is None else out * scale
    return out


@primitive_handler("reduce_sum")
def _scaled_sum(primitive, x: Scaled, **params):
    return primitive.bind(x.value, **params) * x.scale


class LoraMatrix(ImplicitArray):
    """qax's README example: `w + a @ b.T`, with `w` (m, n), `a` (m, k), `b` (n, k)."""

    w: Any
    a: Any
    b: Any

    def __check_init__(self):
        if self.a.shape[1] != self.b.shape[1] or self.w.shape != (self.a.shape[0], self.b.shape[0]):
            raise ValueError(f"bad shapes {self.w.shape}, {self.a.shape}, {self.b.shape}")

    def aval(self):
        return jax.core.ShapedArray(self.w.shape, self.w.dtype)

    def materialize(self):
        return self.w + self.a @ self.b.T


@primitive_handler("dot_general")
def _lora_rhs(primitive, x: jax.Array, w: LoraMatrix, *, dimension_numbers, **params):
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if not (lhs_contract == (x.ndim - 1,) and rhs_contract == (0,) and not lhs_batch):
        return NotImplemented
    return x @ w.w + (x @ w.a) @ w.b.T


def dense_like(x):
    return x.materialize() if isinstance(x, ImplicitArray) else x


def random_scaled(key, shape, dtype=jnp.float32):
    k1, k2 = jax.random.split(key)
    return Scaled(jax.random.normal(k1, shape, dtype), 1.5 + jax.random.uniform(k2, (), dtype))
