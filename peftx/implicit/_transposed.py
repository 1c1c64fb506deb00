"""A lazy transpose of any implicit array, so `x @ w.T` reaches `w`'s own handlers."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from . import _engine
from ._core import ImplicitArray, is_implicit, materialize, primitive_handler


class Transposed(ImplicitArray):
    """`jnp.transpose(array, permutation)` for an implicit `array`, left unevaluated.

    Made by the engine when an implicit array without a `transpose` handler of its own is
    transposed; products with it are rewritten as products with `array`.
    """

    array: Any
    permutation: tuple[int, ...] = eqx.field(static=True)

    def aval(self) -> jax.core.ShapedArray:
        shape = tuple(self.array.shape[i] for i in self.permutation)
        return jax.core.ShapedArray(shape, self.array.dtype)

    def materialize(self) -> Array:
        return jnp.transpose(materialize(self.array), self.permutation)


def dense_base(x: Any) -> tuple[Array, tuple[int, ...]] | None:
    """`(array, permutation)` when `x` is a plain array (`x`, the identity) or a lazy
    `Transposed` of one (`x` is `jnp.transpose(array, permutation)`), also when it
    reaches a handler as a traced field; None for any other implicit array."""
    inner = x if is_implicit(x) else _engine.implicit_value(x)
    if inner is None:
        return x, tuple(range(x.ndim))
    if isinstance(inner, Transposed):
        below = dense_base(inner.array)
        if below is not None:
            array, perm = below
            return array, tuple(perm[i] for i in inner.permutation)
    return None


@primitive_handler("transpose")
def _transpose_any(primitive: Any, x: ImplicitArray, *, permutation: tuple[int, ...]) -> Any:
    return Transposed(x, tuple(permutation))


@primitive_handler("transpose")
def _transpose_again(primitive: Any, x: Transposed, *, permutation: tuple[int, ...]) -> Any:
    composed = tuple(x.permutation[i] for i in permutation)
    if composed == tuple(range(len(composed))):
        return x.array
    return Transposed(x.array, composed)


def _dot(t: Transposed, y: Array, t_is_lhs: bool, params: dict[str, Any]) -> Array:
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    (tc, yc), (tb, yb) = ((lc, rc), (lb, rb)) if t_is_lhs else ((rc, lc), (rb, lb))
    perm = t.permutation
    inner_c, inner_b = tuple(perm[a] for a in tc), tuple(perm[a] for a in tb)
    dims = ((inner_c, yc), (inner_b, yb)) if t_is_lhs else ((yc, inner_c), (yb, inner_b))
    lhs, rhs = (t.array, y) if t_is_lhs else (y, t.array)
    out = lax.dot_general(
        lhs,
        rhs,
        dims,
        precision=params.get("precision"),
        preferred_element_type=params.get("preferred_element_type"),
    )
    # The product lists the array's free axes in its own order; the caller expects them
    # in the transposed order.
    free = [a for a in range(len(perm)) if a not in tc and a not in tb]
    inner_order = sorted(perm[a] for a in free)
    want = [inner_order.index(perm[a]) for a in free]
    n_batch = len(tb)
    n_y_free = y.ndim - len(yc) - len(yb)
    start = n_batch if t_is_lhs else n_batch + n_y_free
    order = list(range(out.ndim))
    order[start : start + len(free)] = [start + i for i in want]
    return out if order == list(range(out.ndim)) else jnp.transpose(out, order)


@primitive_handler("dot_general")
def _transposed_lhs(primitive: Any, t: Transposed, y: jax.Array, **params: Any) -> Array:
    return _dot(t, y, True, params)


@primitive_handler("dot_general")
def _transposed_rhs(primitive: Any, y: jax.Array, t: Transposed, **params: Any) -> Array:
    return _dot(t, y, False, params)
