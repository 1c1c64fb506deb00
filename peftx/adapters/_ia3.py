"""IA3: a learned rescaling of a weight's output or input features."""

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from ..implicit import Transposed, primitive_handler
from ._kind import AbstractAdapter
from ._layout import WeightProduct, weight_dot_handlers
from ._products import cast_base_on_astype, rescale, wider_dtype


class IA3Array(AbstractAdapter):
    """`weight ⊙ ia3_l` for a `Linear` weight `(out, in)`, with HF PEFT's shapes.

    `ia3_l` is `(out, 1)` to scale the output features (attention keys and values) or
    `(1, in)` to scale the input features (feed-forward down projections). Products are
    computed as a rescale of `x @ W` or of `x`, never by forming `W ⊙ l`.
    """

    weight: Any
    ia3_l: Array

    peft_keys: ClassVar[Mapping[str, str]] = {"ia3_l": "ia3_l"}
    # its axis of length 1 follows nothing
    weight_axes: ClassVar[Mapping[str, tuple[int | None, ...]]] = {"ia3_l": (0, 1)}

    def __check_init__(self):
        shape = tuple(self.weight.shape)
        if len(shape) < 2:
            raise ValueError(f"IA3 needs a weight of 2 or more dimensions, got shape {shape}.")
        out, in_ = shape[-2:]
        stack = shape[:-2]
        if tuple(self.ia3_l.shape) not in ((*stack, out, 1), (*stack, 1, in_)):
            raise ValueError(
                f"ia3_l must have shape {(out, 1)} (scale outputs) or {(1, in_)} (scale "
                f"inputs) for a weight of shape {shape}, got {tuple(self.ia3_l.shape)}."
            )
        if not jnp.issubdtype(self.ia3_l.dtype, jnp.floating):
            raise TypeError(f"ia3_l must be floating-point, got dtype {self.ia3_l.dtype}.")

    @property
    def is_feedforward(self) -> bool:
        """Whether the input features are scaled (PEFT's `feedforward_modules`)."""
        return self.ia3_l.shape[-1] != 1

    def bias_scale(self) -> Array | None:
        return None if self.is_feedforward else self.ia3_l[..., 0]

    @classmethod
    def weighted(
        cls, present: Sequence[tuple[AbstractAdapter, float]], combination_type: str, config: Any
    ) -> "IA3Array":
        """The weighted sum of the scales (PEFT's `"linear"`)."""
        first = present[0][0]
        ia3_l = sum(w * a.ia3_l for a, w in present)
        return IA3Array(first.weight, ia3_l.astype(first.ia3_l.dtype))

    def merged(self, weight: Array) -> Array:
        return weight * self.ia3_l.astype(weight.dtype)


def ia3(
    weight: Any,
    *,
    feedforward: bool = False,
    dtype: Any = jnp.float32,
    key: PRNGKeyArray | None = None,
) -> IA3Array:
    """Wrap `weight` in an `IA3Array` initialized to ones, so the output is unchanged; with
    a `key`, to standard normal values instead (PEFT's `init_ia3_weights=False`).

    **Arguments:**

    - `weight`: a `Linear` weight `(out, in)`, dense or implicit.
    - `feedforward`: scale the input features (`(1, in)`) instead of the outputs
      (`(out, 1)`), as PEFT does for `feedforward_modules`.
    - `dtype`: dtype of `ia3_l`.
    - `key`: draws a random `ia3_l` (for tests of a non-identity adapter, as in PEFT).
    """
    out, in_ = weight.shape[-2:]
    shape = (1, in_) if feedforward else (out, 1)
    if key is None:
        return IA3Array(weight, jnp.ones(shape, dtype))
    return IA3Array(weight, jax.random.normal(key, shape, dtype))


def _ia3_dot(w: IA3Array, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    n = len(w.shape) - 2
    stack, scaled = p.w[:n], p.w[n + 1] if w.is_feedforward else p.w[n]
    l_vec = w.ia3_l.reshape(*w.ia3_l.shape[:-2], -1)
    if scaled in p.x:
        # the scaled axis meets x: (W ⊙ l)·x == W·(l ⊙ x)
        x = rescale(x, p.along(l_vec, (*stack, scaled), p.x))
        return p.arrange(*p.contract(x, p.x, w.weight, p.w))
    y = p.arrange(*p.contract(x, p.x, w.weight, p.w))
    return rescale(y, p.along(l_vec, (*stack, scaled), p.out))


def _ia3_update(w: IA3Array, x: Array, w_is_lhs: bool, params: dict[str, Any], base: Array) -> Any:
    # (W ⊙ l)·x - W·x, as a rescale of x (then one more product) or of the base product
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    n = len(w.shape) - 2
    stack, scaled = p.w[:n], p.w[n + 1] if w.is_feedforward else p.w[n]
    l_minus_1 = w.ia3_l.reshape(*w.ia3_l.shape[:-2], -1) - 1
    if scaled in p.x:
        x = rescale(x, p.along(l_minus_1, (*stack, scaled), p.x))
        return p.arrange(*p.contract(x, p.x, w.weight, p.w))
    wide = wider_dtype(base.dtype, l_minus_1.dtype)
    return base.astype(wide) * p.along(l_minus_1.astype(wide), (*stack, scaled), p.out)


weight_dot_handlers(IA3Array, _ia3_dot, _ia3_update)


@primitive_handler("transpose")
def _ia3_transpose(primitive: Any, w: IA3Array, *, permutation: tuple[int, ...]) -> Any:
    n = len(w.shape) - 2
    if tuple(permutation) != (*range(n), n + 1, n):
        return NotImplemented
    # the base is transposed lazily, so no weight-sized copy of it is made
    return IA3Array(Transposed(w.weight, tuple(permutation)), jnp.swapaxes(w.ia3_l, -1, -2))


cast_base_on_astype(IA3Array)
