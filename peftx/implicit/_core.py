"""Implicit arrays: the public API over the quax engine.

An `ImplicitArray` stands for a dense array it never builds. `use_implicit_args(fn)`
runs `fn` with a tracer that sends each JAX primitive touching an implicit array to a
handler registered with `primitive_handler`; when none applies, the implicit inputs are
materialized under the current `materialization_policy`.
"""

import abc
import contextlib
import contextvars
import dataclasses
import functools
import inspect
import itertools
import types
import typing
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import quax
from jaxtyping import Array

from .._errors import (
    HandlerOutputError,
    HandlerRegistrationError,
    MaterializationError,
    MaterializationWarning,
)
from . import _engine

_F = TypeVar("_F", bound=Callable[..., Any])

MaterializationPolicy = Literal["warn_once", "warn", "error", "ignore"]
_POLICIES: tuple[str, ...] = typing.get_args(MaterializationPolicy)
_policy: contextvars.ContextVar[str] = contextvars.ContextVar(
    "peftx_materialization_policy", default="warn_once"
)
_warned: set[tuple[str, type]] = set()


class ImplicitArray(quax.ArrayValue):
    """An array represented by other data, never built unless it must be.

    Subclasses declare their data as fields (arrays or other implicit arrays, array
    leaves first) and their metadata with `eqx.field(static=True)`, and implement
    `materialize()`. Override `aval()` when shape and dtype can be read off the fields
    cheaply; the default traces `materialize()` abstractly to find them.

    Handlers for JAX primitives are registered with `primitive_handler`; they take effect
    inside functions wrapped with `use_implicit_args`.
    """

    @abc.abstractmethod
    def materialize(self) -> Array:
        """Build the dense array this object represents."""

    def aval(self) -> jax.core.ShapedArray:
        """The abstract value (shape and dtype) JAX sees for this array."""
        out = jax.eval_shape(_materialize_nested, self)
        return jax.core.ShapedArray(out.shape, out.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.aval().shape

    @property
    def dtype(self) -> Any:
        return self.aval().dtype

    # quax's hooks. They run only when the engine itself must densify the array, so both
    # are subject to the materialization policy; a user's `materialize()` call is not.
    def materialise(self) -> Array:
        _report_materialization(None, type(self), self)
        return _materialize_nested(self)

    @staticmethod
    def default(primitive: Any, values: Sequence[Any], params: dict[str, Any]) -> Any:
        return _fallback(primitive, values, params)

    def _outside_use_implicit_args(self, *args: Any) -> Any:
        raise TypeError(
            f"a {type(self).__name__} was used in arithmetic outside `use_implicit_args`. "
            "Pass implicit arrays as arguments of the wrapped function (or inside an "
            "`eqx.Module` that is the function), not through a closure: e.g. "
            "`use_implicit_args(model)(x)` or `jax.vmap(use_implicit_args(model))(x)`."
        )

    __matmul__ = __rmatmul__ = __add__ = __radd__ = _outside_use_implicit_args
    __sub__ = __rsub__ = __mul__ = __rmul__ = __neg__ = _outside_use_implicit_args


def use_implicit_args(fn: _F) -> _F:
    """Wrap `fn` so any leaf of its arguments may be an `ImplicitArray`.

    Every primitive that touches an implicit array goes to its handler; without one, the
    implicit inputs are materialized (see `materialization_policy`). The result composes
    with `jax.jit`, `jax.grad`, `jax.vmap`, `jax.lax.scan`, `cond`, `while_loop`,
    `jax.checkpoint` and custom derivatives, inside or outside the wrapper. Implicit
    arrays may also be returned.

    Prefer `jax.jit(use_implicit_args(fn))`: the dispatch then happens once, at trace time.

    **Arguments:**

    - `fn`: any function of pytrees of arrays.

    **Returns:**

    A function with the same signature that accepts implicit arrays.
    """
    if isinstance(fn, types.MethodType):
        # A bound method (e.g. `model.__call__`) hides its object from pytree flattening;
        # expose it so implicit arrays inside the object are seen.
        fn = jtu.Partial(fn.__func__, fn.__self__)
    return _ImplicitFunction(_engine.quaxify(fn))


class _ImplicitFunction(eqx.Module):
    fn: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for x in jtu.tree_leaves((args, kwargs), is_leaf=is_implicit):
            if is_implicit(x):
                _check_complete(x)
                if is_template(x):
                    raise TypeError(
                        f"use_implicit_args got a {type(x).__name__} whose base is a Slot: a "
                        "template that only its enclosing implicit array (e.g. an AdapterSet) "
                        "can use. Pass the enclosing array, or fill the slot first "
                        "(`AdapterSet.adapter(name)`)."
                    )
        return self.fn(*args, **kwargs)


def _check_complete(x: ImplicitArray) -> None:
    try:
        x.aval()
    except (AttributeError, TypeError) as e:
        raise TypeError(
            f"use_implicit_args got a {type(x).__name__} with missing fields, as one half of "
            "`eqx.partition` leaves it. Combine the halves before the implicit arrays are "
            "used: `use_implicit_args(model_fn)(eqx.combine(trainable, frozen), x)` inside "
            "the function you differentiate."
        ) from e


def default_handler(primitive: Any, *args: Any, **params: Any) -> Any:
    """Run `primitive` the ordinary way, on the materialized values of `args`.

    For a handler that wants the primitive's own result on some of its operands, e.g.
    `default_handler(primitive, x, w.weight, **params)`. Any implicit array still among
    `args` is materialized under the materialization policy.
    """
    return _fallback(primitive, args, params)


@contextlib.contextmanager
def materialization_policy(policy: MaterializationPolicy) -> Iterator[None]:
    """Set what happens when an implicit array must be materialized, within a block.

    - `"warn_once"` (the default): a `MaterializationWarning` once per primitive and class.
    - `"warn"`: a warning every time.
    - `"error"`: raise `MaterializationError` (see also `strict()`).
    - `"ignore"`: materialize silently.

    Materialization happens while JAX traces, so the policy applies to functions traced
    inside the block; a cached `jax.jit` trace is not re-examined.
    """
    if policy not in _POLICIES:
        raise ValueError(f"materialization policy must be one of {_POLICIES}, got {policy!r}.")
    token = _policy.set(policy)
    try:
        yield
    finally:
        _policy.reset(token)


def strict() -> contextlib.AbstractContextManager[None]:
    """Within this block, any materialization of an implicit array raises an error.

    Tests use it to prove a code path never builds a dense weight.
    """
    return materialization_policy("error")


def primitive_handler(primitives: Any, *, precedence: int = 0) -> Callable[[_F], _F]:
    """Register a handler for one or more JAX primitives.

    The handler is called as `handler(primitive, *args, **params)` and chosen by the type
    annotations of its positional arguments (implicit-array classes, `jax.Array`, unions;
    unannotated means any). Among the handlers that match, a higher `precedence` wins,
    then the most specific annotations, then the latest registered. For commutative
    primitives (`add`, `mul`, `max`, ...) a handler written for `(implicit, other)` also
    serves `(other, implicit)`. Returning `NotImplemented` passes to the next handler,
    and finally to materialization.

    The primitive's parameters arrive as keyword arguments. A handler without `**params`
    gets only those it names as keyword-only arguments; a parameter it does not name must
    be `None` (it is then dropped), else calling the handler raises
    `HandlerRegistrationError`.

    **Arguments:**

    - `primitives`: a `jax.lax` primitive, its name (`"dot_general"`), or a list of them.
    - `precedence`: ranks this handler above others that match the same arguments.

    **Returns:**

    A decorator that registers the function and returns it unchanged.

    ```python
    @primitive_handler("mul")
    def _(primitive, a: Zeros, b):
        return Zeros(jnp.broadcast_shapes(a.shape, jnp.shape(b)), a.dtype)
    ```
    """
    prims = primitives if isinstance(primitives, list | tuple) else [primitives]
    resolved = [_engine.resolve_primitive(p) for p in prims]

    def register(fn: _F) -> _F:
        handler = _parse_handler(fn, precedence)
        for prim in resolved:
            if prim not in _handlers:
                _handlers[prim] = []
                _engine.route_to(prim, _dispatch)
            _handlers[prim].append(handler)
        return fn

    return register


# --------------------------------------------------------------------------------------
# Dispatch


@dataclasses.dataclass(frozen=True)
class _Handler:
    fn: Callable[..., Any]
    positional: tuple[Any, ...]
    n_required: int
    rest: Any  # annotation of *args, or _NO_REST
    keywords: frozenset[str] | None  # its keyword-only parameters; None if it takes **params
    precedence: int
    order: int

    @property
    def name(self) -> str:
        return f"{self.fn.__module__}.{self.fn.__qualname__}"


_NO_REST = object()
_handlers: dict[Any, list[_Handler]] = {}
_COMMUTATIVE = frozenset({"add", "add_any", "mul", "max", "min", "and", "or", "xor", "eq", "ne"})


def _parse_handler(fn: Callable[..., Any], precedence: int) -> _Handler:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:
        raise HandlerRegistrationError(f"cannot read the signature of handler {fn!r}.") from e
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {p.name: p.annotation for p in params}
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not params or params[0].kind not in kinds:
        raise HandlerRegistrationError(
            f"handler {fn.__qualname__} must take the primitive as its first positional "
            "argument: `def handler(primitive, *args, **params)`."
        )
    positional, n_required, rest = [], 0, _NO_REST
    for p in params[1:]:
        if p.kind in kinds:
            positional.append(_checked_annotation(fn, p.name, hints.get(p.name, Any)))
            n_required += p.default is inspect.Parameter.empty
        elif p.kind is inspect.Parameter.VAR_POSITIONAL:
            rest = _checked_annotation(fn, p.name, hints.get(p.name, Any))
    keywords = None
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        keywords = frozenset(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)
    return _Handler(fn, tuple(positional), n_required, rest, keywords, precedence, next(_order))


_order = itertools.count()


def _checked_annotation(fn: Callable[..., Any], name: str, tp: Any) -> Any:
    members = (
        typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    )
    for member in members:
        if not (member is Any or isinstance(member, type)):
            raise HandlerRegistrationError(
                f"handler {fn.__qualname__}: argument `{name}` is annotated {tp!r}; dispatch "
                "understands classes (an ImplicitArray subclass, jax.Array, ...), unions of "
                "them, or no annotation (any value)."
            )
    return tp


def _match_score(tp: Any, value: Any) -> int | None:
    """How specifically `tp` describes `value`; None if it does not match."""
    if tp is Any or tp is inspect.Parameter.empty:
        return 0
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        scores = [s for t in typing.get_args(tp) if (s := _match_score(t, value)) is not None]
        return max(scores) if scores else None
    if not isinstance(value, tp):
        return None
    return len(tp.__mro__) if issubclass(tp, ImplicitArray) else 1


def _handler_score(handler: _Handler, args: Sequence[Any]) -> int | None:
    if len(args) < handler.n_required:
        return None
    if len(args) > len(handler.positional) and handler.rest is _NO_REST:
        return None
    total = 0
    for i, arg in enumerate(args):
        tp = handler.positional[i] if i < len(handler.positional) else handler.rest
        score = _match_score(tp, arg)
        if score is None:
            return None
        total += score
    return total


def _candidates(primitive: Any, args: tuple[Any, ...]) -> list[tuple[_Handler, tuple[Any, ...]]]:
    orders = [args]
    if primitive.name in _COMMUTATIVE and len(args) == 2 and args[0] is not args[1]:
        orders.append((args[1], args[0]))
    found = []
    for rank, order in enumerate(orders):
        for h in _handlers.get(primitive, ()):
            score = _handler_score(h, order)
            if score is not None:
                found.append(((-rank, h.precedence, score, h.order), h, order))
    found.sort(key=lambda item: item[0], reverse=True)
    return [(h, order) for _, h, order in found]


def _dispatch(primitive: Any, args: tuple[Any, ...], params: dict[str, Any]) -> Any:
    if not any(isinstance(a, ImplicitArray) for a in args):
        return primitive.bind(*args, **params)
    # Constants (NumPy arrays, Python scalars) become JAX arrays, so a handler's
    # `jax.Array` annotation covers every dense operand.
    args = tuple(a if isinstance(a, quax.Value | jax.Array) else jnp.asarray(a) for a in args)
    out_sharding = _explicit_out_sharding(primitive, args, params)
    if out_sharding is not None:
        return jax.sharding.auto_axes(
            lambda *a: _run_handlers(primitive, a, params), out_sharding=out_sharding
        )(*args)
    return _run_handlers(primitive, args, params)


def _explicit_out_sharding(primitive: Any, args: tuple[Any, ...], params: dict[str, Any]) -> Any:
    """On a mesh with `Explicit` axes, the sharding of the primitive's result on the dense
    arrays (None otherwise). Handlers then run with the axes made `Auto`: their internal
    products need no `out_sharding`, and the result is resharded to this."""
    for leaf in jtu.tree_leaves(args):
        mesh = jax.typeof(leaf).sharding.mesh
        if not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types:
            break
    else:
        return None

    def dense(a: Any) -> Any:
        if isinstance(a, ImplicitArray):
            return jax.eval_shape(_materialize_nested, a)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.typeof(a).sharding)

    expected = jax.eval_shape(lambda *xs: primitive.bind(*xs, **params), *[dense(a) for a in args])
    return jtu.tree_map(lambda s: s.sharding, expected)


def _run_handlers(primitive: Any, args: tuple[Any, ...], params: dict[str, Any]) -> Any:
    declined = []
    for handler, call_args in _candidates(primitive, args):
        kwargs = _handler_params(handler, primitive, params)
        out = _call_nested(lambda *a, fn=handler.fn: fn(primitive, *a, **kwargs), *call_args)
        if out is NotImplemented:
            declined.append(handler.name)
            continue
        _check_output(primitive, handler, args, params, out)
        return out
    return _fallback(primitive, args, params, declined)


def _handler_params(handler: _Handler, primitive: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The primitive's parameters that `handler` takes. A handler without `**params` gets
    the ones it names; a parameter it does not name is dropped when `None` (JAX adds
    such parameters over time, e.g. `mul`'s `out_dtype`), and an error otherwise."""
    if handler.keywords is None:
        return params
    for name, value in params.items():
        if name not in handler.keywords and value is not None:
            raise HandlerRegistrationError(
                f"handler {handler.name} for primitive `{primitive.name}` does not take its "
                f"parameter `{name}`, here {value!r}. Add `**params` to the handler's "
                f"signature (or a keyword argument `{name}`)."
            )
    return {k: v for k, v in params.items() if k in handler.keywords}


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, quax.ArrayValue):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


@functools.lru_cache(maxsize=4096)
def _expected_cached(primitive: Any, structs: tuple[Any, ...], params: tuple[Any, ...]) -> Any:
    return _expected(primitive, structs, dict(params))


def _expected(primitive: Any, structs: Sequence[Any], params: dict[str, Any]) -> Any:
    return jax.eval_shape(lambda *xs: primitive.bind(*xs, **params), *structs)


def _check_output(
    primitive: Any, handler: _Handler, args: tuple[Any, ...], params: dict[str, Any], out: Any
) -> None:
    structs = tuple(_struct(a) for a in args)
    try:
        expected = _expected_cached(primitive, structs, tuple(sorted(params.items())))
    except TypeError:  # unhashable params
        expected = _expected(primitive, structs, params)
    if primitive.multiple_results:
        got = [_struct(o) for o in out]
        want = list(expected)
    else:
        got, want = [_struct(out)], [expected]
    if len(got) != len(want) or any(
        g.shape != w.shape or jnp.dtype(g.dtype) != jnp.dtype(w.dtype) for g, w in zip(got, want)
    ):
        fmt = ", ".join
        raise HandlerOutputError(
            f"handler {handler.name} for primitive `{primitive.name}` returned "
            f"[{fmt(_fmt_struct(s) for s in got)}], but the primitive on these inputs gives "
            f"[{fmt(_fmt_struct(s) for s in want)}] (inputs: "
            f"{fmt(_fmt_struct(s) for s in structs)})."
        )


def _fmt_struct(s: Any) -> str:
    return f"{jnp.dtype(s.dtype).name}{list(s.shape)}"


# --------------------------------------------------------------------------------------
# Materialization


def _fallback(
    primitive: Any, values: Sequence[Any], params: dict[str, Any], declined: Sequence[str] = ()
) -> Any:
    arrays = []
    for v in values:
        if isinstance(v, ImplicitArray):
            _report_materialization(primitive.name, type(v), v, declined)
            arrays.append(_materialize_nested(v))
        elif isinstance(v, quax.Value):
            arrays.append(type(v).materialise(v))
        else:
            arrays.append(v)
    return primitive.bind(*arrays, **params)


def _report_materialization(
    primitive_name: str | None, cls: type, value: Any, declined: Sequence[str] = ()
) -> None:
    policy = _policy.get()
    if policy == "ignore":
        return
    what = f"primitive `{primitive_name}`" if primitive_name else "an internal step of the engine"
    why = f"every handler declined ({', '.join(declined)})" if declined else "there is no handler"
    msg = (
        f"{what} needs {cls.__name__} as a dense {_fmt_struct(_struct(value))} array: {why} "
        f"for {cls.__name__} with these operands"
    )
    if policy == "error":
        raise MaterializationError(
            f"{msg}, and materialization is forbidden here (strict mode). Register a handler with "
            f"`peftx.implicit.primitive_handler({primitive_name or '...'!r})` for "
            f"{cls.__name__}, or leave the `strict()` block."
        )
    if policy == "warn_once":
        key = (primitive_name or "", cls)
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(f"{msg}, so it is materialized.", MaterializationWarning, stacklevel=2)


class Slot(eqx.Module):
    """The place of an operand that an enclosing implicit array supplies.

    An implicit array holding a `Slot` is a template, not an array: e.g. the adapters of
    an `AdapterSet` keep a `Slot` where their base weight goes, since the set holds the
    one base they share. Handlers of the enclosing array receive templates as they are
    (never as traced values) and fill the slot before using them.
    """

    shape: tuple[int, ...] = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)


def _is_slot(x: Any) -> bool:
    return isinstance(x, Slot)


def is_template(x: Any) -> bool:
    """Whether `x` is an implicit array with a `Slot` among its own fields (not those of
    implicit arrays inside it)."""
    if not isinstance(x, ImplicitArray):
        return False
    inner = jtu.tree_leaves(x, is_leaf=lambda n: n is not x and isinstance(n, Slot | ImplicitArray))
    return any(map(_is_slot, inner))


class _Opaque:
    """Carries a template through the engine's `quaxify` untouched (it is no pytree)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def _materialize_nested(x: ImplicitArray) -> Array:
    return _call_nested(type(x).materialize, x)


def _call_nested(fn: Callable[..., Any], *args: Any) -> Any:
    """Call `fn(*args)`; implicit arrays nested inside implicit `args` are dispatched too.

    The top-level implicit arrays reach `fn` as themselves (so it can read their fields);
    any implicit array among their fields becomes a traced value, so the primitives `fn`
    applies to it go to that array's own handlers.
    """
    groups, treedefs, nested = [], [], False
    for a in args:
        if isinstance(a, ImplicitArray):
            leaves, treedef = jtu.tree_flatten(
                a, is_leaf=lambda x, a=a: x is not a and isinstance(x, quax.Value)
            )
            leaves = [_Opaque(leaf) if is_template(leaf) else leaf for leaf in leaves]
            nested = nested or any(isinstance(leaf, quax.Value) for leaf in leaves)
            groups.append(leaves)
            treedefs.append(treedef)
        else:
            groups.append(a)
            treedefs.append(None)
    if not nested:
        return fn(*args)

    def _unbox(leaf: Any) -> Any:
        return leaf.value if isinstance(leaf, _Opaque) else leaf

    def rebuilt(*gs: Any) -> Any:
        return fn(
            *(
                g if t is None else jtu.tree_unflatten(t, [_unbox(leaf) for leaf in g])
                for g, t in zip(gs, treedefs)
            )
        )

    return _engine.quaxify(rebuilt)(*groups)


def materialize(x: Any) -> Array:
    """The dense array `x` stands for; `x` itself if it is already dense.

    For `materialize()` methods and handlers whose fields may hold implicit arrays (which
    they see as traced values): `materialize(self.weight)` densifies a quantized base
    weight on purpose, without the materialization policy getting involved.
    """
    if isinstance(x, ImplicitArray):
        return _materialize_nested(x)
    inner = _engine.implicit_value(x)
    return x if inner is None else _materialize_nested(inner)


def gate_rows(w: Any, rows: Array) -> Any:
    """`w`, for a product whose input row `i` (along its leading axes, `rows`' shape) is
    row `rows[i]` of the activations a model was called with. The identity on dense
    arrays; an implicit array's handler (`primitive_handler("gate_rows")`) may use it: an
    `AdapterSet`'s per-example gate follows the rows. For models that reorder rows before
    a product (a mixture of experts sorting tokens by expert)."""
    return _engine.gate_rows_p.bind(w, rows)


@primitive_handler("gate_rows")
def _rows_of_any(primitive: Any, w: ImplicitArray, rows: Array) -> Any:
    return w


def is_implicit(x: Any) -> bool:
    """Whether `x` is an `ImplicitArray` (a convenient `is_leaf` for tree functions)."""
    return isinstance(x, ImplicitArray)


def materialize_all(tree: Any) -> Any:
    """Replace every `ImplicitArray` in a pytree by its dense array."""
    return jtu.tree_map(
        lambda x: _materialize_nested(x) if is_implicit(x) else x,
        tree,
        is_leaf=is_implicit,
    )


_engine.install(ImplicitArray, _report_materialization, _materialize_nested)
