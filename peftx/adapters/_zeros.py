"""A symbolic array of zeros: shape and dtype, no data."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from ..implicit import ImplicitArray, primitive_handler


class Zeros(ImplicitArray):
    """An array of zeros that holds no data.

    Inside `use_implicit_args`, `x + Zeros` is `x`, `x * Zeros` and `x @ Zeros` are
    `Zeros`, and shape operations keep it symbolic, so e.g. a model whose biases are
    `Zeros` runs without ever building them.

    **Arguments:**

    - `shape`: the shape of the represented array.
    - `dtype`: its dtype (default `float32`).
    """

    _shape: tuple[int, ...] = eqx.field(static=True)
    _dtype: Any = eqx.field(static=True)

    def __init__(self, shape: tuple[int, ...], dtype: Any = jnp.float32):
        self._shape = tuple(int(d) for d in shape)
        self._dtype = jnp.dtype(dtype)

    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(self._shape, self._dtype)

    def materialize(self) -> Array:
        return jnp.zeros(self._shape, self._dtype)


def _result_like(primitive: Any, args: tuple[Any, ...], params: dict[str, Any]) -> Zeros:
    structs = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in args]
    out = jax.eval_shape(lambda *xs: primitive.bind(*xs, **params), *structs)
    return Zeros(out.shape, out.dtype)


# f(0) == 0 for these, and their output shape follows from the primitive itself.
_ZERO_PRESERVING_UNARY = [
    "neg", "sin", "tan", "tanh", "asin", "atan", "sinh", "asinh", "atanh", "expm1",
    "log1p", "sqrt", "cbrt", "abs", "sign", "erf", "floor", "ceil", "round", "real",
    "imag", "conj", "copy", "stop_gradient", "convert_element_type", "broadcast_in_dim",
    "reshape", "squeeze", "transpose", "rev", "slice", "reduce_sum",
    "reduce_max", "reduce_min", "cumsum", "cummax", "cummin", "reduce_precision",
]  # fmt: skip


@primitive_handler(_ZERO_PRESERVING_UNARY)
def _unary(primitive: Any, x: Zeros, **params: Any) -> Zeros:
    return _result_like(primitive, (x,), params)


@primitive_handler("integer_pow")
def _integer_pow(primitive: Any, x: Zeros, *, y: int) -> Any:
    if y <= 0:
        return NotImplemented  # 0 ** 0 == 1, 0 ** -n == inf
    return x


@primitive_handler(["mul", "dot_general", "and"])
def _annihilate(primitive: Any, x: Zeros, y: Any, **params: Any) -> Zeros:
    return _result_like(primitive, (x, y), params)


def _broadcast(x: Any, like: Zeros) -> Any:
    """`x` at the shape an elementwise op of `x` and `like` produces."""
    shape = jnp.broadcast_shapes(jnp.shape(x), like.shape)
    if isinstance(x, Zeros):
        return Zeros(shape, x.dtype)
    return x if jnp.shape(x) == shape else jnp.broadcast_to(x, shape)


@primitive_handler(["add", "add_any", "or", "xor"])
def _identity(primitive: Any, x: Zeros, y: Any) -> Any:
    return _broadcast(y, x)


@primitive_handler("sub")
def _sub_from_zeros(primitive: Any, x: Zeros, y: Any) -> Any:
    return _broadcast(y if isinstance(y, Zeros) else lax.neg(y), x)


@primitive_handler("sub")
def _sub_zeros(primitive: Any, x: Any, y: Zeros) -> Any:
    return _broadcast(x, y)


@primitive_handler("dot_general")
def _dot_by_zeros(primitive: Any, x: Any, y: Zeros, **params: Any) -> Zeros:
    return _result_like(primitive, (x, y), params)


@primitive_handler("select_n")
def _select(primitive: Any, which: Any, *cases: Any) -> Any:
    if not any(isinstance(c, Zeros) for c in cases):
        return NotImplemented
    if all(isinstance(c, Zeros) for c in cases):
        return cases[0]
    # A filled constant is a broadcast scalar in XLA, not a stored array.
    dense = [lax.full(c.shape, 0, c.dtype) if isinstance(c, Zeros) else c for c in cases]
    return lax.select_n(which, *dense)


@primitive_handler("concatenate")
def _concatenate(primitive: Any, *operands: Zeros, dimension: int) -> Zeros:
    return _result_like(primitive, operands, {"dimension": dimension})
