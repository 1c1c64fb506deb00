"""The only file that touches quax's and JAX's internals.

Tested with quax 0.4.6 and jax 0.10.x and 0.11.x (the minimum is jax 0.10.2); importing
peftx with a jax outside that range warns (`UntestedVersionWarning`). The private names
used here are looked up on first use (`_internals`), so a version that lacks one fails
there with an `UnsupportedVersionError` naming it.

peftx traces with its own subclass of quax's trace (`quaxify` below, which
`use_implicit_args` uses). quax itself is not patched: a plain `quax.quaxify` in the same
process behaves as quax alone. The subclass adds what quax lacks:

- `jit`, `scan`, `cond`, `while_loop`: their bodies are re-run under this trace. (quax's
  rules for them re-enter quax's own trace, which would lose the rules below.)
- `jax.checkpoint` (remat): quax has no rule and would materialize; ours re-enters the
  engine inside `jax.checkpoint` over the inner jaxpr.
- `custom_vjp` with an implicit argument: quax raises `NotImplementedError`. Ours runs the
  primal through the handlers, and pulls the dense cotangent the rule returns for an
  implicit argument back onto its fields by differentiating `materialize()`.
- `custom_jvp` with an implicit argument: quax re-packs the tangents of the array's
  fields as an array of the same class, which is only right when `materialize()` is
  linear in its fields (LoRA's `W + s·B·A` is not). Ours hands the rule the tangent of the
  represented array, `jax.jvp(materialize)`: dense, since the rule is arbitrary code
  written for a dense tangent.

Both derivatives go through `materialize()` rather than the array's handlers (e.g. as the
gradient of `⟨cotangent, array⟩`), because a handler may differ from `materialize()` on
purpose (LoRA's dropout acts on the activation of a product), and because under
`jax.grad` JAX transposes the tangent computation, which a handler holding reverse-only
code (a `custom_vjp`) would prevent. They run inside `jax.jit`, so the dense array that
`materialize()` returns (e.g. QLoRA's dequantized base) is dead code that XLA removes, even
when called eagerly: what is computed is the linear map between the fields and the dense
cotangent or tangent, which the rule itself takes or gives weight-sized. For the same
reason of transposition, handlers that a `custom_jvp` rule applies to tangents (e.g.
`w @ dx` with an implicit `w`) must not be `custom_vjp`s.
"""

import difflib
import functools
import importlib
import re
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.extend.core as jexc
import jax.extend.core.primitives as jprims
import jax.numpy as jnp
import jax.tree_util as jtu
import quax
from jax.interpreters import ad, batching, mlir
from jaxtyping import ArrayLike

from .._errors import HandlerRegistrationError, UnsupportedVersionError, UntestedVersionWarning

TESTED_VERSIONS = "jax >=0.10,<0.12 with quax ==0.4.6"
_TESTED_JAX = ((0, 10), (0, 12))  # [first, last) minor versions

# The private names the engine uses, by module; each becomes an attribute of
# `_internals()` without its leading underscore.
_PRIVATE = {
    "quax._trace": (
        "_QuaxTrace",
        "_QuaxTracer",
        "_DenseArrayValue",
        "_wrap_if_array",
        "_wrap_tracer",
        "_unwrap_tracer",
    ),
    "quax._compat": ("is_early_inline", "unpack_scan_args"),
    "jax._src.core": ("TraceTag", "take_current_trace", "set_current_trace"),
    "jax._src.interpreters.batching": ("BatchTracer",),
    "jax._src.ad_util": ("Zero",),  # the cotangent a custom_vjp bwd gives for "none"
}


def check_jax_version() -> None:
    """Warn (`UntestedVersionWarning`) if the installed jax is outside the tested range."""
    found = jax.__version__
    minor = tuple(int(part) for part in re.findall(r"\d+", found)[:2])
    first, last = _TESTED_JAX
    if not first <= minor < last:
        warnings.warn(
            f"peftx is tested with {TESTED_VERSIONS}, but found jax {found}. Its engine "
            "uses JAX internals that change between versions; if something fails, install "
            "a tested jax.",
            UntestedVersionWarning,
            stacklevel=2,
        )


check_jax_version()


@functools.cache
def _internals() -> Any:
    """The private names in `_PRIVATE`, looked up once, and peftx's trace class."""
    found = {}
    for module, names in _PRIVATE.items():
        for name in names:
            try:
                found[name.lstrip("_")] = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError) as e:
                raise UnsupportedVersionError(
                    f"peftx's engine needs `{module}.{name}`, which this installation lacks "
                    f"(jax {jax.__version__}, quax {quax.__version__}). peftx is tested with "
                    f"{TESTED_VERSIONS}; install versions in that range."
                ) from e
    api = types.SimpleNamespace(**found)
    api.Trace = _trace_class(api.QuaxTrace)
    return api


_PRIMITIVES: dict[str, jexc.Primitive] = {
    p.name: p
    for p in (getattr(jprims, n) for n in dir(jprims) if n.endswith("_p"))
    if isinstance(p, jexc.Primitive)
}


def _traced_primitive(fn: Callable[..., Any], *args: Any) -> jexc.Primitive:
    """The primitive a one-primitive call binds, read off its public jaxpr: for those
    `jax.extend.core.primitives` does not list (jax 0.10.2 lacks `ragged_dot_general`)."""
    return jax.make_jaxpr(fn)(*args).jaxpr.eqns[0].primitive


_PRIMITIVES.setdefault(
    "ragged_dot_general",
    _traced_primitive(
        lambda x, w, sizes: jax.lax.ragged_dot(x, w, sizes),
        jax.ShapeDtypeStruct((2, 2), jnp.float32),
        jax.ShapeDtypeStruct((1, 2, 2), jnp.float32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    ),
)
# Primitives that carry sub-computations: the engine interprets their bodies, so
# handlers for them would bypass that.
_HIGHER_ORDER = frozenset(
    {
        "jit",
        "pjit",
        "scan",
        "cond",
        "while",
        "remat2",
        "checkpoint",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_lin",
        "closed_call",
        "call",
        "shard_map",
        "linear_solve",
    }
)

_implicit_cls: type = object
_report: Callable[..., None] = lambda *a: None  # noqa: E731
_materialize: Callable[[Any], Any] = lambda x: x  # noqa: E731


def install(implicit_cls: type, report: Callable[..., None], materialize: Callable) -> None:
    """Connect the engine to `peftx.implicit`'s array class and policies."""
    global _implicit_cls, _report, _materialize
    _implicit_cls, _report, _materialize = implicit_cls, report, materialize


def resolve_primitive(p: Any) -> jexc.Primitive:
    """A primitive given as itself or by name; refuse higher-order ones."""
    if isinstance(p, str):
        prim = _PRIMITIVES.get(p) or _PRIMITIVES.get(p.removesuffix("_p"))
        if prim is None:
            close = difflib.get_close_matches(p, sorted(_PRIMITIVES), n=5)
            raise HandlerRegistrationError(
                f"no JAX primitive is named {p!r}; closest names: {close}. Pass a name "
                "such as 'dot_general' or the primitive itself (jax.lax.dot_general_p)."
            )
    elif isinstance(p, jexc.Primitive):
        prim = p
    else:
        raise HandlerRegistrationError(
            f"expected a JAX primitive or its name, got {type(p).__name__} {p!r}."
        )
    if prim.name in _HIGHER_ORDER:
        raise HandlerRegistrationError(
            f"`{prim.name}` is a higher-order primitive: peftx interprets its body with the "
            "handlers of the primitives inside it, so it cannot take a handler of its own."
        )
    return prim


def route_to(prim: jexc.Primitive, dispatch: Callable) -> None:
    """Send every use of `prim` that involves an implicit array to `dispatch`."""
    cls = _implicit_cls

    def rule(*args: cls | ArrayLike, **params: Any) -> Any:  # type: ignore[valid-type]
        return dispatch(prim, args, params)

    rule.__name__ = rule.__qualname__ = f"peftx_{prim.name}_rule"
    quax.register(prim, precedence=1)(rule)


def _is_implicit(x: Any) -> bool:
    return isinstance(x, _implicit_cls)


def _is_value(x: Any) -> bool:
    return isinstance(x, quax.Value)


def outer_vmap_size(x: Any) -> int:
    """How many examples the `jax.vmap`s around the current trace map `x` over (1 when
    none does). A handler under an outer `vmap` sees one example's shapes, but XLA runs
    its product once for the whole batch: the idiomatic Equinox model takes one sequence
    and is `vmap`ped over the batch outside `use_implicit_args`."""
    size = 1
    while isinstance(x, _internals().BatchTracer):
        if isinstance(x.batch_dim, int):  # else not mapped at this level
            size *= x.val.shape[x.batch_dim]
        x = x.val
    return size


def implicit_value(x: Any) -> Any:
    """The implicit array behind an engine tracer, else None."""
    if isinstance(x, jax.core.Tracer) and isinstance(x, _internals().QuaxTracer):
        return x.value if _is_implicit(x.value) else None
    return None


# `gate_rows(w, rows)`: `w` itself, recorded in traced programs (a primitive, so that a
# `scan` or `checkpoint` body replayed by the engine still carries it) for a product
# whose input rows are `rows` of the activations. The identity on dense arrays, in
# values, derivatives (jax.interpreters' rules, jax >=0.10) and batching; implicit
# arrays' handlers give it a meaning (an `AdapterSet`'s per-example gate follows the rows).
gate_rows_p = jexc.Primitive("gate_rows")
gate_rows_p.def_impl(lambda w, rows: w)
gate_rows_p.def_abstract_eval(lambda w, rows: w)
mlir.register_lowering(gate_rows_p, mlir.lower_fun(lambda w, rows: w, multiple_results=False))
ad.primitive_jvps[gate_rows_p] = lambda primals, tangents: (gate_rows_p.bind(*primals), tangents[0])
batching.primitive_batchers[gate_rows_p] = lambda args, dims: (args[0], dims[0])
_PRIMITIVES[gate_rows_p.name] = gate_rows_p


# --------------------------------------------------------------------------------------
# The trace


def quaxify(fn: Callable) -> Callable:
    """`quax.quaxify(fn)`, tracing with peftx's trace."""
    return _Quaxified(fn)


class _Quaxified(eqx.Module):
    fn: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tree = (self.fn, args, kwargs)
        if not any(map(_is_value, jtu.tree_leaves(tree, is_leaf=_is_value))):
            return self.fn(*args, **kwargs)
        api = _internals()
        with api.take_current_trace() as parent:
            trace = api.Trace(parent, api.TraceTag())
            fn, args, kwargs = jtu.tree_map(
                functools.partial(api.wrap_tracer, trace), tree, is_leaf=_is_value
            )
            with api.set_current_trace(trace):
                out = fn(*args, **kwargs)
            return jtu.tree_map(functools.partial(api.unwrap_tracer, trace), out)


def _trace_class(base: type) -> type:
    class PeftxTrace(base):  # type: ignore[misc, valid-type]
        """quax's trace, with the rules of the module docstring."""

        __slots__ = ()

        def process_primitive(self, primitive: Any, tracers: Any, params: Any) -> Any:
            rule = _BODY_RULES.get(primitive)
            if rule is not None:
                values = _trace_values(self, tracers)
                if any(map(_is_value, values)):
                    with _internals().set_current_trace(self.parent_trace):
                        outs = rule(*values, **params)
                    return _wrap_outputs(self, outs)
            return super().process_primitive(primitive, tracers, params)

        def process_custom_jvp_call(
            self, primitive: Any, fun: Any, jvp: Any, tracers: Any, *, symbolic_zeros: bool
        ) -> Any:
            values = _trace_values(self, tracers)
            if not any(map(_is_implicit, values)):
                return super().process_custom_jvp_call(
                    primitive, fun, jvp, tracers, symbolic_zeros=symbolic_zeros
                )
            return _custom_jvp_call(self, fun, jvp, values)

        def process_custom_vjp_call(
            self,
            primitive: Any,
            fun: Any,
            fwd: Any,
            bwd: Any,
            tracers: Any,
            *,
            out_trees: Callable,
            symbolic_zeros: bool,
        ) -> Any:
            values = _trace_values(self, tracers)
            if all(map(eqx.is_array_like, values)):
                avals = tuple(jax.typeof(v) for v in values)
                params = dict(
                    subfuns=(fun, fwd, bwd), out_trees=out_trees, symbolic_zeros=symbolic_zeros
                )
                outs = primitive.bind_with_trace(self.parent_trace, tuple(values), avals, params)
                return _wrap_outputs(self, outs)
            return _custom_vjp_call(self, fun, fwd, bwd, values, out_trees)

    return PeftxTrace


def _trace_values(trace: Any, tracers: Sequence[Any]) -> list[Any]:
    dense_cls = _internals().DenseArrayValue
    values = []
    for t in tracers:
        v = trace.to_value(t)
        values.append(v.array if type(v) is dense_cls else v)
    return values


def _wrap_outputs(trace: Any, outs: Sequence[Any]) -> list[Any]:
    api = _internals()
    return [api.QuaxTracer(trace, api.wrap_if_array(o)) for o in outs]


def _dense_outputs(outs: Sequence[Any], what: str) -> list[Any]:
    dense = []
    for o in outs:
        if _is_implicit(o):
            _report(what, type(o), o)
            o = _materialize(o)
        dense.append(o)
    return dense


# --------------------------------------------------------------------------------------
# Higher-order primitives: the same construct, its body re-run under this trace. Each
# gets the primitive's operands as values (implicit arrays as themselves).


def _quaxified_call(fn: Callable, *args: Any) -> Any:
    return quaxify(fn)(*args)


# (jaxpr, operand structure) -> (the jitted body, its output structure), so that an
# eager `use_implicit_args(jax.jit(f))` compiles once. Weak in the jaxpr, which JAX keeps
# as long as it caches the trace of `f`.
_jitted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _jit_rule(*args: Any, jaxpr: Any, inline: Any, **params: Any) -> Any:
    del params  # shardings, donation, name: the body is jitted anew
    if _internals().is_early_inline(inline):
        return quaxify(jexc.jaxpr_as_fun(jaxpr))(*args)
    flat, in_tree = jtu.tree_flatten(args)
    per_tree = _jitted.setdefault(jaxpr, {})
    if in_tree not in per_tree:
        per_tree[in_tree] = _jit_body(weakref.ref(jaxpr), in_tree)
    jitted, out_tree = per_tree[in_tree]
    out_flat = jitted(flat)  # traces the body (setting its output structure) if new
    return jtu.tree_unflatten(out_tree(), out_flat)


def _jit_body(jaxpr_ref: Callable, in_tree: Any) -> tuple[Callable, Callable]:
    out_trees = []

    def body(flat: list[Any]) -> list[Any]:
        out = quaxify(jexc.jaxpr_as_fun(jaxpr_ref()))(*jtu.tree_unflatten(in_tree, flat))
        out_flat, out_tree = jtu.tree_flatten(out)
        out_trees.append(out_tree)
        return out_flat

    return jax.jit(body), lambda: out_trees[-1]


def _scan_rule(*args: Any, **params: Any) -> list[Any]:
    consts, carry, xs = _internals().unpack_scan_args(args, params)
    body = jexc.jaxpr_as_fun(params["jaxpr"])
    n = len(carry)

    def step(c: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        out = quaxify(body)(*consts, *c, *x)
        return list(out[:n]), list(out[n:])

    carry, ys = jax.lax.scan(
        step,
        list(carry),
        list(xs),
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    return [*carry, *ys]


def _cond_rule(index: Any, *args: Any, branches: Sequence[Any], **params: Any) -> Any:
    del params  # recomputed by lax.switch
    fns = [functools.partial(_quaxified_call, jexc.jaxpr_as_fun(b)) for b in branches]
    return jax.lax.switch(index, fns, *args)


def _while_rule(
    *args: Any, cond_nconsts: int, cond_jaxpr: Any, body_nconsts: int, body_jaxpr: Any
) -> Any:
    cond_consts, rest = args[:cond_nconsts], args[cond_nconsts:]
    body_consts, init = rest[:body_nconsts], list(rest[body_nconsts:])
    cond_fn, body_fn = jexc.jaxpr_as_fun(cond_jaxpr), jexc.jaxpr_as_fun(body_jaxpr)

    def cond(c: list[Any]) -> Any:
        return quaxify(cond_fn)(*cond_consts, *c)[0]

    def body(c: list[Any]) -> list[Any]:
        return list(quaxify(body_fn)(*body_consts, *c))

    # A carry that the body turns dense (no handler kept it implicit) starts dense: the
    # loop needs one structure throughout.
    for _ in range(len(init) if any(map(_is_implicit, init)) else 0):
        out = jax.eval_shape(body, init)
        if jtu.tree_structure(out) == jtu.tree_structure(init):
            break
        init = [
            _dense_outputs([c], "while")[0] if not _is_implicit(o) else c for c, o in zip(init, out)
        ]
    return jax.lax.while_loop(cond, body, init)


def _remat_rule(
    *args: Any, jaxpr: Any, prevent_cse: bool, differentiated: bool, policy: Any
) -> Any:
    flat, in_tree = jtu.tree_flatten(args)
    out_trees = []
    fn = jexc.jaxpr_as_fun(jexc.ClosedJaxpr(jaxpr, ()))

    def body(flat_args: list[Any]) -> list[Any]:
        out = quaxify(fn)(*jtu.tree_unflatten(in_tree, flat_args))
        out_flat, out_tree = jtu.tree_flatten(out)
        out_trees.append(out_tree)
        return out_flat

    del differentiated  # set by JAX's own autodiff; jax.checkpoint re-derives it
    out_flat = jax.checkpoint(body, prevent_cse=prevent_cse, policy=policy)(flat)
    return jtu.tree_unflatten(out_trees[-1], out_flat)


_BODY_RULES: dict[jexc.Primitive, Callable[..., Any]] = {
    jprims.jit_p: _jit_rule,
    jprims.scan_p: _scan_rule,
    jprims.cond_p: _cond_rule,
    jprims.while_p: _while_rule,
    jprims.remat_p: _remat_rule,
}


# --------------------------------------------------------------------------------------
# custom_jvp / custom_vjp


def _split(value: Any) -> tuple[Any, Any]:
    """Split an implicit array into its differentiable fields and the rest."""
    return eqx.partition(value, eqx.is_inexact_array)


# Both jitted: the dense array `materialize()` builds is then dead code that XLA removes,
# even when called eagerly; only the tangent, or the cotangent's pullback, is computed.
@eqx.filter_jit
def _tangent(value: Any, tangent: Any) -> Any:
    """The tangent of the array `value` stands for, given the tangents of its fields."""
    diff, static = _split(value)
    t_diff, _ = eqx.partition(tangent, jtu.tree_map(eqx.is_inexact_array, value))
    _, t = jax.jvp(lambda d: _materialize(eqx.combine(d, static)), (diff,), (t_diff,))
    return t


@eqx.filter_jit
def _field_cotangents(value: Any, ct: Any) -> Any:
    diff, static = _split(value)
    _, pull = jax.vjp(lambda d: _materialize(eqx.combine(d, static)), diff)
    return pull(ct.astype(value.dtype))[0]


def _pullback(value: Any, ct: Any) -> list[Any]:
    """The cotangents of `value`'s leaves (None where not differentiable), given the
    cotangent `ct` of the array it stands for."""
    if not jtu.tree_leaves(_split(value)[0]):
        return [None] * len(jtu.tree_leaves(value))
    return jtu.tree_structure(value).flatten_up_to(_field_cotangents(value, ct))


def _custom_jvp_call(trace: Any, fun: Any, jvp: Any, values: list[Any]) -> list[Any]:
    leaves, treedef = jtu.tree_flatten(values)

    @jax.custom_jvp
    def call(*ls: Any) -> list[Any]:
        outs = quaxify(fun.call_wrapped)(*jtu.tree_unflatten(treedef, ls))
        return _dense_outputs(outs, "custom_jvp_call")

    @call.defjvp
    def call_jvp(primals: Any, tangents: Any) -> Any:
        vals = jtu.tree_unflatten(treedef, primals)
        tans = jtu.tree_unflatten(treedef, tangents)
        dense_tans = [_tangent(v, t) if _is_implicit(v) else t for v, t in zip(vals, tans)]
        outs = _dense_outputs(quaxify(jvp.call_wrapped)(*vals, *dense_tans), "custom_jvp_call")
        n = len(outs) // 2
        return outs[:n], outs[n:]

    with _internals().set_current_trace(trace.parent_trace):
        outs = call(*leaves)
    return _wrap_outputs(trace, outs)


def _custom_vjp_call(
    trace: Any, fun: Any, fwd: Any, bwd: Any, values: list[Any], out_trees: Callable
) -> list[Any]:
    leaves, treedef = jtu.tree_flatten(values)

    @jax.custom_vjp
    def call(*ls: Any) -> list[Any]:
        outs = quaxify(fun.call_wrapped)(*jtu.tree_unflatten(treedef, ls))
        return _dense_outputs(outs, "custom_vjp_call")

    def call_fwd(*ls: Any) -> Any:
        vals = jtu.tree_unflatten(treedef, ls)
        fwd_args = [x for v in vals for x in (v, True)]  # (value, "tangent is nonzero")
        res_and_outs = quaxify(fwd.call_wrapped)(*fwd_args)
        out_tree, _, input_fwds = out_trees()
        n_res = len(res_and_outs) - out_tree.num_leaves
        pruned, outs = res_and_outs[:n_res], res_and_outs[n_res:]
        it = iter(pruned)
        residuals = [vals[i] if i is not None else next(it) for i in input_fwds]
        return _dense_outputs(outs, "custom_vjp_call"), (residuals, vals)

    def call_bwd(saved: Any, cts: Any) -> tuple[Any, ...]:
        residuals, vals = saved
        in_cts = quaxify(bwd.call_wrapped)(*residuals, *cts)
        zero = _internals().Zero
        leaf_cts: list[Any] = []
        for v, ct in zip(vals, in_cts):
            if isinstance(ct, zero) or ct is None:
                leaf_cts.extend([None] * len(jtu.tree_leaves(v)))
                continue
            (ct,) = _dense_outputs([ct], "custom_vjp_call")
            if _is_implicit(v):
                leaf_cts.extend(_pullback(v, ct))
            else:
                leaf_cts.append(ct if eqx.is_inexact_array(v) else None)
        return tuple(leaf_cts)

    call.defvjp(call_fwd, call_bwd)
    with _internals().set_current_trace(trace.parent_trace):
        outs = call(*leaves)
    return _wrap_outputs(trace, outs)
