"""`dot_general` seen from a weight's side, with named axes.

Adapters rewrite `dot_general(W, x)` (or `dot_general(x, W)`) into several products of
`x` with their factors. Giving every axis a label turns each rewrite into "contract
these operands, keep the labels the original output has", whatever the dimension
numbers were: plain `W @ x`, `x @ W.T`, vmapped or einsum-made forms, or stacked weights
with batch axes.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from ..implicit import primitive_handler

Labels = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class WeightProduct:
    """The labels of one `dot_general` between a weight `W` and a dense `x`."""

    w: Labels
    x: Labels
    out: Labels
    precision: Any
    preferred_element_type: Any

    @classmethod
    def parse(
        cls, w_ndim: int, x_ndim: int, w_is_lhs: bool, params: dict[str, Any]
    ) -> "WeightProduct":
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        (wc, xc), (wb, xb) = ((lc, rc), (lb, rb)) if w_is_lhs else ((rc, lc), (rb, lb))
        x_labels = [f"x{i}" for i in range(x_ndim)]
        w_labels = [f"w{i}" for i in range(w_ndim)]
        for w_axis, x_axis in zip((*wc, *wb), (*xc, *xb)):
            w_labels[w_axis] = x_labels[x_axis]
        batch = [x_labels[i] for i in xb]
        w_free = [lab for i, lab in enumerate(w_labels) if i not in wc and i not in wb]
        x_free = [lab for i, lab in enumerate(x_labels) if i not in xc and i not in xb]
        out = batch + (w_free + x_free if w_is_lhs else x_free + w_free)
        return cls(
            tuple(w_labels),
            tuple(x_labels),
            tuple(out),
            params.get("precision"),
            params.get("preferred_element_type"),
        )

    def contract(self, a: Array, la: Labels, b: Array, lb: Labels) -> tuple[Array, Labels]:
        """`dot_general(a, b)`: shared labels in the output are batch axes, other shared
        labels are summed; the result's labels follow `dot_general`'s output order."""
        shared = [lab for lab in la if lab in lb]
        batch = [lab for lab in shared if lab in self.out]
        summed = [lab for lab in shared if lab not in self.out]
        dims = (
            (tuple(la.index(s) for s in summed), tuple(lb.index(s) for s in summed)),
            (tuple(la.index(s) for s in batch), tuple(lb.index(s) for s in batch)),
        )
        out = lax.dot_general(
            a, b, dims, precision=self.precision, preferred_element_type=self.preferred_element_type
        )
        labels = (
            *batch,
            *(lab for lab in la if lab not in shared),
            *(lab for lab in lb if lab not in shared),
        )
        return out, labels

    def arrange(self, y: Array, labels: Labels) -> Array:
        """`y` with its axes in the order of the original product's output."""
        if labels == self.out:
            return y
        return jnp.transpose(y, [labels.index(lab) for lab in self.out])

    @staticmethod
    def along(vec: Array, vec_labels: Labels, target: Labels) -> Array:
        """`vec` (labelled `vec_labels`) shaped to broadcast against an array labelled
        `target`."""
        order = sorted(range(len(vec_labels)), key=lambda i: target.index(vec_labels[i]))
        shape = [1] * len(target)
        for i in order:
            shape[target.index(vec_labels[i])] = vec.shape[i]
        return jnp.transpose(vec, order).reshape(shape)


Product = Callable[[Any, Array, bool, dict], Any]
Update = Callable[[Any, Array, bool, dict, Array], Any]
Mixed = Callable[[list[Any], Array, Array, bool, dict, Array], Any]


class WeightHandlers(NamedTuple):
    """What `weight_dot_handlers` registered for a class."""

    product: Product
    update: Update | None
    mixed: Mixed | None


_PRODUCTS: dict[type, WeightHandlers] = {}


def weight_dot_handlers(
    cls: type, product: Product, update: Update | None = None, mixed: Mixed | None = None
) -> None:
    """Register `product(w, x, w_is_lhs, params)` as the `dot_general` handler for a `cls`
    weight on either side of a dense `x`.

    `update(w, x, w_is_lhs, params, base)`, given the base weight's own product `base`,
    returns what the adapter adds to it (`product == base + update`); an `AdapterSet`
    uses it to apply several adapters, each weighted per example, over one base product.
    `mixed(ws, gate, x, w_is_lhs, params, base)` is the same for several `cls` adapters
    `ws` at once, `Σ_k gate_k · update_k`, fused (`gate` is `(n,)` or `(batch, n)`, one
    column per adapter); it returns `NotImplemented` when it cannot, and the set then
    adds the updates one by one.
    """

    def lhs(primitive: Any, w: cls, x: jax.Array, **params: Any) -> Any:  # type: ignore[valid-type]
        return product(w, x, True, params)

    def rhs(primitive: Any, x: jax.Array, w: cls, **params: Any) -> Any:  # type: ignore[valid-type]
        return product(w, x, False, params)

    for side, fn in (("lhs", lhs), ("rhs", rhs)):
        fn.__qualname__ = f"{product.__qualname__}[{cls.__name__} {side}]"
        fn.__module__ = product.__module__
        primitive_handler("dot_general")(fn)
    _PRODUCTS[cls] = WeightHandlers(product, update, mixed)


def weight_product(cls: type) -> WeightHandlers | None:
    """The handlers registered for `cls` by `weight_dot_handlers`, if any."""
    return _PRODUCTS.get(cls)
