"""The only file that touches quax's and JAX's internals.

Written against quax 0.4.6 and jax 0.10.2 (the minimum versions): it reaches into
`quax._trace` for the tracer classes and adds what quax lacks there:

- `jax.checkpoint` (remat): quax has no rule and would materialize; ours re-enters the
  engine inside `jax.checkpoint` over the inner jaxpr.
- `custom_vjp` with an implicit argument: quax raises `NotImplementedError`.
- `custom_jvp` with an implicit argument: quax re-packs the tangents of the array's
  fields as an array of the same class, which is only right when `materialize()` is
  linear in its fields (LoRA's `W + s·B·A` is not). Ours hands the rule the tangent of
  the represented array.

Both custom-derivative rules run the primal function through the engine (handlers, no
materialization) and pull the rule's dense cotangent/tangent back through
`materialize()`, which is what differentiating the represented array means.
"""

import difflib
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.extend.core as jexc
import jax.extend.core.primitives as jprims
import jax.tree_util as jtu
import quax
import quax._trace as qtrace
from jax._src import (
    ad_util,  # ad.Zero: the cotangent a custom_vjp bwd gives for "none"
    core as jcore,
)
from jaxtyping import ArrayLike

_PRIMITIVES: dict[str, jexc.Primitive] = {
    p.name: p
    for p in (getattr(jprims, n) for n in dir(jprims) if n.endswith("_p"))
    if isinstance(p, jexc.Primitive)
}
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
    quax.register(jprims.remat_p)(_remat_rule)
    qtrace._QuaxTrace.process_custom_jvp_call = _process_custom_jvp_call
    qtrace._QuaxTrace.process_custom_vjp_call = _process_custom_vjp_call


def resolve_primitive(p: Any) -> jexc.Primitive:
    """A primitive given as itself or by name; refuse higher-order ones."""
    from .._errors import HandlerRegistrationError

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


def implicit_value(x: Any) -> Any:
    """The implicit array behind an engine tracer, else None."""
    if isinstance(x, qtrace._QuaxTracer) and _is_implicit(x.value):
        return x.value
    return None


# --------------------------------------------------------------------------------------
# jax.checkpoint


def _remat_rule(
    *args: quax.ArrayValue | ArrayLike,
    jaxpr: Any,
    prevent_cse: bool,
    differentiated: bool,
    policy: Any,
) -> Any:
    flat, in_tree = jtu.tree_flatten(args)
    out_trees = []
    fn = jexc.jaxpr_as_fun(jexc.ClosedJaxpr(jaxpr, ()))

    def body(flat_args: list[Any]) -> list[Any]:
        out = quax.quaxify(fn)(*jtu.tree_unflatten(in_tree, flat_args))
        out_flat, out_tree = jtu.tree_flatten(out)
        out_trees.append(out_tree)
        return out_flat

    del differentiated  # set by JAX's own autodiff; jax.checkpoint re-derives it
    out_flat = jax.checkpoint(body, prevent_cse=prevent_cse, policy=policy)(flat)
    return jtu.tree_unflatten(out_trees[-1], out_flat)


# --------------------------------------------------------------------------------------
# custom_jvp / custom_vjp


def _trace_values(trace: Any, tracers: Sequence[Any]) -> list[Any]:
    values = []
    for t in tracers:
        v = trace.to_value(t)
        values.append(v.array if type(v) is qtrace._DenseArrayValue else v)
    return values


def _wrap_outputs(trace: Any, outs: Sequence[Any]) -> list[Any]:
    return [qtrace._QuaxTracer(trace, qtrace._wrap_if_array(o)) for o in outs]


def _dense_outputs(outs: Sequence[Any], what: str) -> list[Any]:
    dense = []
    for o in outs:
        if _is_implicit(o):
            _report(what, type(o), o)
            o = _materialize(o)
        dense.append(o)
    return dense


def _split(value: Any) -> tuple[Any, Any]:
    """Split an implicit array into its differentiable fields and the rest."""
    return eqx.partition(value, eqx.is_inexact_array)


_original_custom_jvp = qtrace._QuaxTrace.process_custom_jvp_call


def _process_custom_jvp_call(
    self: Any, primitive: Any, fun: Any, jvp: Any, tracers: Sequence[Any], *, symbolic_zeros: bool
) -> list[Any]:
    values = _trace_values(self, tracers)
    if not any(map(_is_implicit, values)):
        return _original_custom_jvp(
            self, primitive, fun, jvp, tracers, symbolic_zeros=symbolic_zeros
        )
    leaves, treedef = jtu.tree_flatten(values)

    @jax.custom_jvp
    def call(*ls: Any) -> list[Any]:
        outs = quax.quaxify(fun.call_wrapped)(*jtu.tree_unflatten(treedef, ls))
        return _dense_outputs(outs, "custom_jvp_call")

    @call.defjvp
    def call_jvp(primals: Any, tangents: Any) -> Any:
        vals = jtu.tree_unflatten(treedef, primals)
        tans = jtu.tree_unflatten(treedef, tangents)
        dense_tans = []
        for v, t in zip(vals, tans):
            if _is_implicit(v):
                diff, static = _split(v)
                t_diff, _ = eqx.partition(t, jtu.tree_map(eqx.is_inexact_array, v))
                _, t = jax.jvp(
                    lambda d, static=static: _materialize(eqx.combine(d, static)),
                    (diff,),
                    (t_diff,),
                )
            dense_tans.append(t)
        outs = quax.quaxify(jvp.call_wrapped)(*vals, *dense_tans)
        outs = _dense_outputs(outs, "custom_jvp_call")
        n = len(outs) // 2
        return outs[:n], outs[n:]

    with jcore.set_current_trace(self.parent_trace):
        outs = call(*leaves)
    return _wrap_outputs(self, outs)


def _process_custom_vjp_call(
    self: Any,
    primitive: Any,
    fun: Any,
    fwd: Any,
    bwd: Any,
    tracers: Sequence[Any],
    *,
    out_trees: Callable,
    symbolic_zeros: bool,
) -> list[Any]:
    values = _trace_values(self, tracers)
    if all(eqx.is_array_like(v) for v in values):
        avals = tuple(jax.typeof(v) for v in values)
        params = dict(subfuns=(fun, fwd, bwd), out_trees=out_trees, symbolic_zeros=symbolic_zeros)
        outs = primitive.bind_with_trace(self.parent_trace, tuple(values), avals, params)
        return _wrap_outputs(self, outs)
    leaves, treedef = jtu.tree_flatten(values)

    @jax.custom_vjp
    def call(*ls: Any) -> list[Any]:
        outs = quax.quaxify(fun.call_wrapped)(*jtu.tree_unflatten(treedef, ls))
        return _dense_outputs(outs, "custom_vjp_call")

    def call_fwd(*ls: Any) -> Any:
        vals = jtu.tree_unflatten(treedef, ls)
        fwd_args = [x for v in vals for x in (v, True)]  # (value, "tangent is nonzero")
        res_and_outs = quax.quaxify(fwd.call_wrapped)(*fwd_args)
        out_tree, _, input_fwds = out_trees()
        n_res = len(res_and_outs) - out_tree.num_leaves
        pruned, outs = res_and_outs[:n_res], res_and_outs[n_res:]
        it = iter(pruned)
        residuals = [vals[i] if i is not None else next(it) for i in input_fwds]
        return _dense_outputs(outs, "custom_vjp_call"), (residuals, ls)

    def call_bwd(saved: Any, cts: Any) -> tuple[Any, ...]:
        residuals, ls = saved
        vals = jtu.tree_unflatten(treedef, ls)
        in_cts = quax.quaxify(bwd.call_wrapped)(*residuals, *cts)
        leaf_cts: list[Any] = []
        for v, ct in zip(vals, in_cts):
            if isinstance(ct, ad_util.Zero) or ct is None:
                leaf_cts.extend([None] * len(jtu.tree_leaves(v)))
                continue
            if _is_implicit(ct):
                ct = ct.materialize()
            if _is_implicit(v):
                diff, static = _split(v)
                _, pull = jax.vjp(
                    lambda d, static=static: _materialize(eqx.combine(d, static)), diff
                )
                (d_ct,) = pull(ct)
                d_leaves = jtu.tree_leaves(d_ct, is_leaf=lambda x: x is None)
                leaf_cts.extend(d_leaves)
            else:
                leaf_cts.append(ct if eqx.is_inexact_array(v) else None)
        return tuple(leaf_cts)

    call.defvjp(call_fwd, call_bwd)
    with jcore.set_current_trace(self.parent_trace):
        outs = call(*leaves)
    return _wrap_outputs(self, outs)
