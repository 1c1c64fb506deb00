"""`assert_no_dense`: read off a traced program that no weight-sized array is built.

Written against jax 0.10.2: the jaxpr is walked with `jax.extend.core` and located with
`jax.extend.source_info_util`, JAX's public API for libraries (no JAX internals).
"""

import dataclasses
import math
import types
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.extend.core as jexc
import jax.tree_util as jtu
from jax.extend import source_info_util

from .._errors import DenseWeightError
from ._core import ImplicitArray, is_implicit

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Offence:
    eqn: Any
    shape: Shape
    dtype: Any
    weight: Shape

    def __str__(self) -> str:
        # Under `use_implicit_args` JAX may keep only library frames for an equation, and
        # then no location.
        where = source_info_util.summarize(self.eqn.source_info)
        phase = "backward" if "transpose(" in str(self.eqn.source_info.name_stack) else "forward"
        return (
            f"`{self.eqn.primitive.name}` makes {self.dtype}{list(self.shape)} "
            f"in the {phase} pass{f' at {where}' if where else ''}, matching weight shape "
            f"{self.weight}"
        )


def assert_no_dense(
    fn: Callable[..., Any],
    /,
    *args: Any,
    weight_shapes: Sequence[Sequence[int]] = (),
    **kwargs: Any,
) -> jexc.ClosedJaxpr:
    """Prove that `fn(*args, **kwargs)` builds no array the size of an adapted weight.

    Traces the call (nothing runs: arguments may be `jax.ShapeDtypeStruct`s; non-array
    leaves are static, as in `eqx.filter_make_jaxpr`) and checks the output of every
    equation, nested ones included (`jit`, `scan`, `cond`, `while_loop`,
    `jax.checkpoint`, custom derivatives), so a `fn` that takes gradients is checked
    forward and backward. Inputs (the frozen weights passed in) are not checked.

    The weights are the implicit arrays in `fn` (if it is a pytree, e.g. a wrapped
    model), `args` and `kwargs`, by shape, and for a stack of layers (every array inside
    shares the leading axes) also by one layer's shape; a half of `eqx.partition` without
    its base weight is skipped. An equation output matches a weight when it has at least
    as many elements and its axes of size > 1 include the weight's (as a multiset). This
    catches `W + s·B·A`, `B·A`, a dequantized, cast, transposed or squared `W`, its
    cotangent, a per-example copy under `vmap`, a stack of rows built by `scan`; it
    passes activations `(batch, seq, d)` unless the batch or sequence length equals a
    weight dimension, so trace with lengths that differ from the weights'. A weight
    flattened to one axis is matched only once reshaped back. Engine materializations
    follow the `materialization_policy` (under `strict()` they raise first).

    **Arguments:**

    - `fn`: the function to check, e.g. a whole train step (forward, `jax.grad`,
        optimizer update), with or without `eqx.filter_jit`.
    - `*args`, `**kwargs`: what `fn` is called with.
    - `weight_shapes`: more weight shapes to look for, each with at least two axes of
        size > 1 (e.g. for a model that `fn` closes over).

    **Returns:**

    The checked `ClosedJaxpr`. Raises `DenseWeightError` naming each offending
    primitive, its output, the weight shape it matches, the pass (forward or backward)
    and the source line when JAX kept it; `ValueError` if there is no weight to look for.

    ```python
    trainable, frozen = peftx.partition(model)
    assert_no_dense(train_step, trainable, frozen, opt_state, x, y)
    ```
    """
    if not callable(fn):
        raise TypeError(f"assert_no_dense checks a function, got {type(fn).__name__} {fn!r}.")
    weights = _explicit_shapes(weight_shapes)
    owner = fn.__self__ if isinstance(fn, types.MethodType) else fn
    for shape in _implicit_shapes((owner, args, kwargs)):
        if shape not in weights:
            weights.append(shape)
    if not weights:
        raise ValueError(
            "assert_no_dense found no weight to look for: no complete implicit array among "
            "the function and its arguments (a trainable half of `eqx.partition` has no "
            "base weight). Pass the frozen half as an argument too, or give the shapes "
            "with `weight_shapes=[(out, in), ...]`."
        )
    jaxpr, _, _ = eqx.filter_make_jaxpr(fn)(*args, **kwargs)
    offences = []
    for eqn, shape, dtype in _built(jaxpr.jaxpr):
        weight = next((w for w in weights if _matches(shape, w)), None)
        if weight is not None:
            offences.append(_Offence(eqn, shape, dtype, weight))
    if offences:
        shown = "\n".join(f"  - {o}" for o in offences[:8])
        more = f"\n  ... and {len(offences) - 8} more" if len(offences) > 8 else ""
        raise DenseWeightError(
            f"{len(offences)} weight-sized array(s) built for weights {weights}:\n"
            f"{shown}{more}\n"
            "Adapters should reach a weight only through products with it: look there for "
            "a `materialize()` call, a handler that densifies, or a missing handler."
        )
    return jaxpr


def _explicit_shapes(shapes: Sequence[Sequence[int]]) -> list[Shape]:
    out = []
    for shape in shapes:
        try:
            shape = tuple(int(d) for d in shape)
        except TypeError:
            raise TypeError(
                f"weight_shapes takes shapes (tuples of ints), got {shape!r}."
            ) from None
        if sum(d > 1 for d in shape) < 2:
            raise ValueError(
                f"weight shape {shape} has fewer than two axes of size > 1: it would match "
                "activations too. Give matrix (or kernel) shapes such as (out, in)."
            )
        out.append(shape)
    return out


def _implicit_shapes(tree: Any) -> Iterator[Shape]:
    for x in jtu.tree_leaves(tree, is_leaf=is_implicit):
        if not isinstance(x, ImplicitArray):
            continue
        try:
            shape = tuple(x.shape)
        except (AttributeError, TypeError):  # a half of `eqx.partition`
            continue
        if sum(d > 1 for d in shape) >= 2:
            yield shape
            yield from _layer_shapes(x, shape)


def _layer_shapes(x: ImplicitArray, shape: Shape) -> Iterator[Shape]:
    """The shapes of one layer of a stack: `shape` without each run of leading axes that
    every array inside `x` shares (as `eqx.filter_vmap` over its construction gives)."""
    leaves = [
        tuple(leaf.shape)
        for leaf in jtu.tree_leaves(x)
        if eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)
    ]
    k = 0
    while leaves and len(shape) - k > 2 and all(s[: k + 1] == shape[: k + 1] for s in leaves):
        k += 1
        if sum(d > 1 for d in shape[k:]) >= 2:
            yield shape[k:]


def _built(jaxpr: jexc.Jaxpr) -> Iterator[tuple[Any, Shape, Any]]:
    """`(equation, shape, dtype)` of each array an equation of `jaxpr` (or of a jaxpr
    nested in it) makes; an output that a higher-order equation passes out unchanged from
    a body is left to the body's equation."""
    for eqn in jaxpr.eqns:
        bodies = list(jexc.jaxprs_in_params(eqn.params))
        for body in bodies:
            yield from _built(body)
        passed = [b.outvars for b in bodies if len(b.outvars) == len(eqn.outvars)]
        for i, var in enumerate(eqn.outvars):
            aval = var.aval
            if not isinstance(aval, jax.core.ShapedArray):
                continue
            if any(_shape_of(outs[i]) == aval.shape for outs in passed):
                continue
            yield eqn, tuple(aval.shape), aval.dtype


def _shape_of(var: Any) -> Shape | None:
    aval = var.aval
    return tuple(aval.shape) if isinstance(aval, jax.core.ShapedArray) else None


def _matches(shape: Shape, weight: Shape) -> bool:
    if math.prod(shape) < math.prod(weight):
        return False
    need = Counter(d for d in weight if d > 1)
    have = Counter(d for d in shape if d > 1)
    return not need - have
