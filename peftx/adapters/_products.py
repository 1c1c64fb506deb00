"""What several adapter kinds share: the low-rank product and its derivatives, dropout,
dtype widening and rescaling, rank checks and the `astype` rule for adapted weights."""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike
from jaxtyping import Array, Key, PRNGKeyArray, UInt32

from ..implicit import primitive_handler
from ._layout import Labels, WeightProduct, weight_dot_handlers

# A stacked adapter's dropout keys: one per layer (a single key when it is not stacked).
LayerKeys = Key[Array, "*layers"] | UInt32[Array, "*layers 2"] | UInt32[Array, "*layers 4"]


def check_rank(r: int, shape: tuple[int, ...], what: str = "a weight") -> None:
    # A rank above min(out, in) is wasteful but valid (PEFT allows it; "cat" combinations
    # of adapters reach it).
    if r < 1:
        raise ValueError(f"LoRA rank r={r} for {what} of shape {shape} must be at least 1.")


def dropout(
    x: Array,
    rate: float,
    key: LayerKeys | None,
    x_labels: Labels = (),
    key_labels: Labels = (),
) -> Array:
    """Inverted dropout: `x` with entries zeroed with probability `rate` and the others
    scaled by `1/(1 - rate)`; `x` itself without a key. A stacked adapter holds one key per
    layer, labelled `key_labels` (its weight's layer axes); each layer's slice of `x`
    (labelled `x_labels`) takes its mask from its own key, as under `lax.scan`."""
    if rate == 0.0 or key is None:
        return x
    key_shape = jax.random.key_data(key).shape[:-1]
    if any(lab not in x_labels for lab in key_labels):
        raise ValueError(
            f"dropout on a stack of adapters (keys of shape {key_shape}) needs the "
            f"input batched along the layers too, but this product's input {tuple(x.shape)} "
            "is shared by all layers. Batch the input along the layers, run the layers with "
            "`jax.lax.scan`, or drop the keys with `without_dropout`."
        )
    axes = tuple(x_labels.index(lab) for lab in key_labels)
    if key_shape != tuple(x.shape[a] for a in axes):
        raise ValueError(
            f"an adapter stacked over layer axes {tuple(x.shape[a] for a in axes)} needs one "
            f"dropout key per layer, got keys of shape {key_shape}; set them with `with_dropout`."
        )
    lead = tuple(range(len(axes)))
    rest = jnp.moveaxis(x, axes, lead).shape[len(axes) :]

    def draw(k: PRNGKeyArray) -> Array:
        return jax.random.bernoulli(k, 1.0 - rate, rest)

    for _ in axes:
        draw = jax.vmap(draw)
    keep = jnp.moveaxis(draw(key), lead, axes)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def branch_dtype(w: Any) -> Any:
    """The dtype an adapter's branch computes in: its `compute_dtype`, else the dtype of
    its parameters (PEFT casts the input to `lora_A`'s dtype)."""
    return w.lora_A.dtype if w.compute_dtype is None else w.compute_dtype


def add_update(base: Array, update: Array) -> Array:
    """`base + update` in the wider of their dtypes, rounded once to `base`'s dtype (as
    PEFT adds a float32 adapter's output to a bfloat16 base output)."""
    wide = wider_dtype(base.dtype, update.dtype)
    return (base.astype(wide) + update.astype(wide)).astype(base.dtype)


def wider_dtype(*dtypes: Any) -> Any:
    """The dtype JAX's standard promotion gives (bfloat16 and float32 make float32), also
    under `jax_numpy_dtype_promotion="strict"`, where such mixing is deliberate here."""
    with jax.numpy_dtype_promotion("standard"):
        return jnp.result_type(*dtypes)


def rescale(x: Array, scale: Array) -> Array:
    """`x ⊙ scale` computed in the wider dtype and rounded to `x`'s (PEFT multiplies a
    bfloat16 activation by a float32 scale in float32)."""
    wide = wider_dtype(x.dtype, scale.dtype)
    return (x.astype(wide) * scale.astype(wide)).astype(x.dtype)


def low_rank(
    p: WeightProduct, first_labels: Labels, second_labels: Labels, scale_labels: Labels
) -> Any:
    """`f(x, first, second, scale) = second·(scale ⊙ first·x)` in `p.out` order, in the
    operands' dtype (the adapter branch's compute dtype; the base product's
    `preferred_element_type` is not inherited). `scale` (labelled `scale_labels`, a
    subset of the intermediate's labels: `()` for LoRA's scaling, `("r",)` or
    `(batch, "r")` for gated mixtures) multiplies the small `(tokens, r)` intermediate.

    A `custom_jvp` whose tangent rule is written token-major, so forward mode (`jvp`,
    `jacfwd`, `linearize`, `hessian`) works and reverse mode is JAX's transpose of that
    rule. Each product keeps the small `(tokens, r)` arrays and the factors on the left
    of the activation-sized ones, so that the transposed products take the cotangent and
    `x` in their token-major layout; terms whose tangent is a symbolic zero (a frozen
    input, the constant scaling) are never built.
    """
    q = dataclasses.replace(p, preferred_element_type=None)
    t_labels = _result_labels(q, q.x, first_labels)

    def into(target: Labels, a: Array, la: Labels, b: Array, lb: Labels) -> Array:
        r = dataclasses.replace(q, out=target)
        return r.arrange(*r.contract(a, la, b, lb))

    def scaled(t: Array, scale: ArrayLike) -> Array:
        # a constant scale may arrive as a NumPy literal (e.g. inside `lax.scan`)
        return t * q.along(jnp.asarray(scale, t.dtype), scale_labels, t_labels)

    def out_of(t: Array, second: Array) -> Array:
        return q.arrange(*q.contract(t, t_labels, second, second_labels))

    @jax.custom_jvp
    def low_rank(x: Array, first: Array, second: Array, scale: ArrayLike) -> Array:
        return out_of(scaled(into(t_labels, x, q.x, first, first_labels), scale), second)

    def low_rank_jvp(primals: tuple, tangents: tuple) -> tuple[Array, Array]:
        x, first, second, scale = primals
        dx, dfirst, dsecond, dscale = (None if _is_zero(t) else t for t in tangents)
        u = into(t_labels, x, q.x, first, first_labels)
        t = scaled(u, scale)
        out = out_of(t, second)
        du = _total(
            dx is not None and into(t_labels, dx, q.x, first, first_labels),
            dfirst is not None and into(t_labels, x, q.x, dfirst, first_labels),
        )
        dt = _total(du is not None and scaled(du, scale), dscale is not None and scaled(u, dscale))
        rest = None if dt is None else out_of(dt, second)
        if dsecond is None:
            d_out = rest
        elif rest is None:
            d_out = out_of(t, dsecond)
        else:
            d_out = plus_second_term(t, dsecond, rest)
        return out, jnp.zeros_like(out) if d_out is None else d_out

    def plus_second_term(t: Array, dsecond: Array, rest: Array) -> Array:
        return _plus_linear_term(
            lambda d: out_of(t, d),
            lambda g: _factor_gradient(
                dataclasses.replace(q, out=second_labels), t, t_labels, g, q.out
            ),
            dsecond,
            rest,
        )

    low_rank.defjvp(low_rank_jvp, symbolic_zeros=True)
    return low_rank


def _plus_linear_term(
    term: Callable[[Array], Array], transposed: Callable[[Array], Array], d: Array, rest: Array
) -> Array:
    """`rest + term(d)` for a linear `term(d) = t·dᵀ`, whose transpose is `transposed(g)
    = tᵀ·g`, with `t` on the left.

    JAX transposes a product with the cotangent `g` on the left, which for this term means
    contracting `g` over the tokens, its major axes: on CPU, XLA copies `g` transposed
    (activation-sized) for every adapted product. Written as the invertible linear map
    `S(d, y) = (d, y + term(d))` through `custom_linear_solve`, the transpose is ours,
    `Sᵀ(p, q) = (p + transposed(q), q)`. `S`'s inverse is the `matvec`, so the solve's own
    derivative rules (for forward mode over this tangent, e.g. Hessians) are exact.
    """

    def matvec(b: tuple[Array, Array]) -> tuple[Array, Array]:
        d, y = b
        return d, y - term(d)

    def solve(_: Any, b: tuple[Array, Array]) -> tuple[Array, Array]:
        d, y = b
        return d, y + term(d)

    def transpose_solve(_: Any, c: tuple[Array, Array]) -> tuple[Array, Array]:
        p, q = c
        return p + transposed(q), q

    return lax.custom_linear_solve(matvec, (d, rest), solve, transpose_solve)[1]


def _factor_gradient(p: WeightProduct, t: Array, lt: Labels, g: Array, lg: Labels) -> Array:
    """A factor's gradient `tᵀ·g`, a product over the tokens, in `p.out`'s order. The
    product's own result has `r` (from `t`) as its major axis and is written so before any
    transpose (this one, or a lazily transposed weight's): left to itself, XLA on CPU
    folds the transpose into the product, which then writes `(out, r)` in a layout that
    runs 2-4x slower than `(r, out)`."""
    y, labels = p.contract(t, lt, g, lg)
    return p.arrange(lax.optimization_barrier(y), labels)


def _is_zero(t: Any) -> bool:
    return isinstance(t, jax.custom_derivatives.SymbolicZero)


def _total(*terms: Any) -> Array | None:
    """The sum of the terms that are arrays (`False` marks an absent term); None if none."""
    present = [t for t in terms if t is not False]
    return None if not present else functools.reduce(jnp.add, present)


def _result_labels(p: WeightProduct, la: Labels, lb: Labels) -> Labels:
    """The labels of `p.contract(a, la, b, lb)`: batch, then `a`'s free, then `b`'s free."""
    shared = [lab for lab in la if lab in lb]
    return (
        *(lab for lab in shared if lab in p.out),
        *(lab for lab in la if lab not in shared),
        *(lab for lab in lb if lab not in shared),
    )


def fused_low_rank(p: WeightProduct, meet: int) -> Any:
    """`f(x, x_d, W, first, second, scale)` for `_fused_lora_dot` (in `_lora/_lora.py`), where `x`
    meets axis `meet` of `W`. `second` is laid out like `W` with `r` in place of that axis
    (`B` when `x` meets `W`'s input axis, `A` when its output axis), so it extends `W` along
    it."""
    meet_l = p.w[meet]
    first_labels = ("r", meet_l) if meet == 1 else (meet_l, "r")
    axis_x = p.x.index(meet_l)

    def rank_part(x_d: Array, first: Array) -> Array:
        """`first·x_d` with `x`'s axes, `r` in place of the met axis."""
        u, labels = p.contract(x_d, p.x, first, first_labels)
        return jnp.transpose(u, [labels.index("r" if lab == meet_l else lab) for lab in p.x])

    def times(xs: Array, ws: Array) -> Array:
        return p.arrange(*p.contract(xs, p.x, ws, p.w))

    def second_cotangent(t: Array, g: Array) -> Array:
        """`tᵀ·g` over the tokens, laid out like `second`."""
        into = dataclasses.replace(p, out=p.w, preferred_element_type=None)
        return _factor_gradient(into, t, p.x, g, p.out)

    def cat(x: Array, t: Array, w: Array, second: Array) -> tuple[Array, Array]:
        return jnp.concatenate([x, t], axis=axis_x), jnp.concatenate([w, second], axis=meet)

    @jax.custom_jvp
    def fused(x: Array, x_d: Array, w: Array, first: Array, second: Array, scale: Array):
        return times(*cat(x, scale * rank_part(x_d, first), w, second))

    def fused_jvp(primals: tuple, tangents: tuple) -> tuple[Array, Array]:
        x, x_d, w, first, second, scale = primals
        dx, dx_d, dw, dfirst, dsecond, dscale = (None if _is_zero(t) else t for t in tangents)
        u = rank_part(x_d, first)
        t = scale * u
        out = times(*cat(x, t, w, second))
        du = _total(
            dx_d is not None and rank_part(dx_d, first),
            dfirst is not None and rank_part(x_d, dfirst),
        )
        dt = _total(du is not None and scale * du, dscale is not None and dscale * u)
        d_out = _total(
            # transposed, one GEMM gives the cotangent's products with W and with second
            dx is not None and dt is not None and times(*cat(dx, dt, w, second)),
            dx is not None and dt is None and times(dx, w),
            dx is None and dt is not None and times(dt, second),
            dw is not None and times(x, dw),
        )
        if dsecond is not None:
            d_out = (
                times(t, dsecond)
                if d_out is None
                else _plus_linear_term(
                    lambda d: times(t, d), lambda g: second_cotangent(t, g), dsecond, d_out
                )
            )
        return out, jnp.zeros_like(out) if d_out is None else d_out

    fused.defjvp(fused_jvp, symbolic_zeros=True)
    return fused


def update_handlers(cls: type, update: Callable[[Any, Array, bool, dict], Array | None]) -> None:
    """The `dot_general` handlers and `astype` rule of a kind whose product is its base
    weight's own plus what `update(w, x, w_is_lhs, params)` adds (in the product's output
    order; None where no handler applies): `weight_dot_handlers` with the base product
    (its own dtype and precision) and the update summed by `add_update`, the bare update
    for an `AdapterSet`, and `cast_base_on_astype`."""

    def product(w: Any, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
        added = update(w, x, w_is_lhs, params)
        if added is None:
            return NotImplemented
        p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
        return add_update(p.arrange(*p.contract(x, p.x, w.weight, p.w)), added)

    def alone(w: Any, x: Array, w_is_lhs: bool, params: dict[str, Any], base: Array) -> Any:
        added = update(w, x, w_is_lhs, params)
        return NotImplemented if added is None else added

    product.__qualname__, product.__module__ = update.__qualname__, update.__module__
    weight_dot_handlers(cls, product, alone)
    cast_base_on_astype(cls)


def cast_base_on_astype(cls: type) -> None:
    """Register `astype` to a floating dtype for adapters of class `cls`: the base weight
    is cast and the adapter's own parameters keep their dtype (PEFT keeps them float32)."""

    def astype(primitive: Any, w: cls, **params: Any) -> Any:  # type: ignore[valid-type]
        if not jnp.issubdtype(params["new_dtype"], jnp.floating):
            return NotImplemented
        return eqx.tree_at(lambda m: m.weight, w, primitive.bind(w.weight, **params))

    astype.__qualname__ = f"astype[{cls.__name__}]"
    primitive_handler("convert_element_type")(astype)


def taken_rows(shape: tuple[int, ...], indices: Array, params: dict[str, Any]) -> bool:
    """Whether a `gather` from an operand of `shape` takes whole slices along axis 0 with
    one index each, for a list of indices (what `jnp.take(w, idx, axis=0)` emits), so that
    it can be applied to each array a weight is made of (`take_rows`)."""
    dims = params["dimension_numbers"]
    return (
        indices.ndim == 2
        and indices.shape[-1] == 1
        and tuple(dims.offset_dims) == tuple(range(1, len(shape)))
        and tuple(dims.collapsed_slice_dims) == (0,)
        and tuple(dims.start_index_map) == (0,)
        and not dims.operand_batching_dims
        and not dims.start_indices_batching_dims
        and tuple(params["slice_sizes"]) == (1, *shape[1:])
    )


def take_rows(primitive: Any, array: Any, indices: Array, params: dict[str, Any]) -> Any:
    """The `gather` that `taken_rows` recognized, applied to `array` (any number of axes
    after the taken one)."""
    dims = lax.GatherDimensionNumbers(
        offset_dims=tuple(range(1, array.ndim)),
        collapsed_slice_dims=(0,),
        start_index_map=(0,),
    )
    slices = (1, *array.shape[1:])
    # an index out of range fills with the gather's own value (NaN for `jnp.take`) where
    # the dtype has it, with 0 in integer codes
    fill = params["fill_value"] if jnp.issubdtype(array.dtype, jnp.inexact) else 0
    return primitive.bind(
        array,
        indices,
        **{**params, "dimension_numbers": dims, "slice_sizes": slices, "fill_value": fill},
    )
