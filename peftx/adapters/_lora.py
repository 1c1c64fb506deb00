"""LoRA and DoRA: `W + s·B·A` as implicit arrays, with HF PEFT's names, shapes and inits."""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike
from jaxtyping import Array, Key, PRNGKeyArray, UInt32

from .._dtypes import float_dtype
from ..implicit import (
    ImplicitArray,
    Transposed,
    dense_base,
    materialize,
    outer_vmap_size,
    primitive_handler,
    use_implicit_args,
)
from ._layout import Labels, WeightProduct, weight_dot_handlers

LoraInit = Literal["default", "gaussian", "pissa", "random"]

# A stacked adapter's dropout keys: one per layer (a single key when it is not stacked).
_LayerKeys = Key[Array, "*layers"] | UInt32[Array, "*layers 2"] | UInt32[Array, "*layers 4"]


class _AbstractLowRank(ImplicitArray):
    """The fields and arithmetic shared by `LoraArray` and `DoraArray`."""

    weight: Any
    lora_A: Array
    lora_B: Array
    dropout_key: _LayerKeys | None
    lora_alpha: float = eqx.field(static=True)
    use_rslora: bool = eqx.field(static=True)
    lora_dropout: float = eqx.field(static=True)
    kernel_ndim: int = eqx.field(static=True)
    compute_dtype: Any = eqx.field(static=True)

    @property
    def r(self) -> int:
        return self.lora_A.shape[self.stack_ndim]

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @property
    def stack_ndim(self) -> int:
        """Leading axes added by stacking layers (with `eqx.filter_vmap`)."""
        return len(self.weight.shape) - 2 - self.kernel_ndim

    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(self.weight.shape, self.weight.dtype)

    def delta(self) -> Array:
        """`scaling · lora_B @ lora_A` in the weight's shape, in the adapters' dtype."""
        return self.scaling * _product(self.lora_B, self.lora_A, self.stack_ndim)


def _init_low_rank(
    self: _AbstractLowRank,
    weight: Any,
    lora_A: Array,
    lora_B: Array,
    lora_alpha: float | int,
    use_rslora: bool,
    lora_dropout: float | int,
    dropout_key: _LayerKeys | None,
    compute_dtype: Any,
) -> None:
    _check_factors(weight, lora_A, lora_B, lora_dropout)
    self.weight = weight
    self.lora_A = lora_A
    self.lora_B = lora_B
    self.dropout_key = dropout_key
    self.lora_alpha = float(lora_alpha)
    self.use_rslora = bool(use_rslora)
    self.lora_dropout = float(lora_dropout)
    self.kernel_ndim = len(weight.shape) - 2
    self.compute_dtype = _checked_compute_dtype(compute_dtype)


class LoraArray(_AbstractLowRank):
    """`weight + scaling · lora_B @ lora_A`, never formed when multiplied.

    The layout is Equinox's (and PyTorch's): a `Linear` weight is `(out, in)`, with
    `lora_A` `(r, in)` and `lora_B` `(out, r)`; a `Conv` weight is `(out, in, *kernel)`, with
    `lora_A` `(r, in, *kernel)` (a convolution like the layer's) and `lora_B`
    `(out, r, 1, ...)` (a 1x1 convolution), as in HF PEFT. `scaling` is
    `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`.

    `weight` may itself be implicit (an `NF4Array` for QLoRA). Arrays stacked by
    `eqx.filter_vmap` (one per layer) work under `jax.lax.scan` and `jax.vmap`.

    Dropout (`lora_dropout > 0`) applies to the input of `lora_A` and only when
    `dropout_key` is set, see `with_dropout`.

    Mixed precision follows PEFT: the base product keeps its own dtype and precision; the
    adapter branch casts the input to `compute_dtype` (default: the factors' dtype), and
    its output is added to the base output in the wider dtype and rounded once to the
    base's. Gradients have the dtype of the parameter they belong to. E.g. a bfloat16
    base with float32 factors trains float32 factors (and float32 optimizer state);
    `with_compute_dtype(model, jnp.bfloat16)` runs their branch in bfloat16.
    """

    def __init__(
        self,
        weight: Any,
        lora_A: Array,
        lora_B: Array,
        *,
        lora_alpha: float | int,
        use_rslora: bool = False,
        lora_dropout: float | int = 0.0,
        dropout_key: _LayerKeys | None = None,
        compute_dtype: Any = None,
    ):
        _init_low_rank(
            self,
            weight,
            lora_A,
            lora_B,
            lora_alpha,
            use_rslora,
            lora_dropout,
            dropout_key,
            compute_dtype,
        )

    def materialize(self) -> Array:
        w = materialize(self.weight)
        return w + self.delta().astype(w.dtype)


def _checked_compute_dtype(dtype: Any) -> Any:
    return None if dtype is None else float_dtype(dtype, "compute_dtype")


def _check_factors(weight: Any, lora_A: Any, lora_B: Any, lora_dropout: float) -> None:
    shape = tuple(weight.shape)
    if len(shape) < 2:
        raise ValueError(f"LoRA needs a weight of 2 or more dimensions, got shape {shape}.")
    out, in_, kernel = shape[0], shape[1], shape[2:]
    r = lora_A.shape[0]
    want_a, want_b = (r, in_, *kernel), (out, r, *(1,) * len(kernel))
    if tuple(lora_A.shape) != want_a or tuple(lora_B.shape) != want_b:
        raise ValueError(
            f"LoRA factors do not fit weight {shape}: expected lora_A {want_a} and lora_B "
            f"{want_b} for rank r={r}, got lora_A {tuple(lora_A.shape)} and lora_B "
            f"{tuple(lora_B.shape)}."
        )
    _check_rank(r, shape)
    for name, factor in (("lora_A", lora_A), ("lora_B", lora_B)):
        if not jnp.issubdtype(factor.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating-point array, got dtype {factor.dtype}.")
    if lora_A.dtype != lora_B.dtype:
        raise TypeError(
            f"lora_A and lora_B must share a dtype, got {lora_A.dtype} and {lora_B.dtype}."
        )
    if not 0.0 <= lora_dropout < 1.0:
        raise ValueError(f"lora_dropout must be in [0, 1), got {lora_dropout}.")


def _check_rank(r: int, shape: tuple[int, ...], what: str = "a weight") -> None:
    # A rank above min(out, in) is wasteful but valid (PEFT allows it; "cat" combinations
    # of adapters reach it).
    if r < 1:
        raise ValueError(f"LoRA rank r={r} for {what} of shape {shape} must be at least 1.")


def _product(b: Array, a: Array, stack_ndim: int) -> Array:
    """`b @ a` for factors shaped like a weight (conv kernels flattened and restored)."""
    s = stack_ndim
    r = a.shape[s]
    flat_b = b.reshape(*b.shape[: s + 1], r)
    flat_a = a.reshape(*a.shape[: s + 1], -1)
    out = jnp.matmul(flat_b, flat_a)
    return out.reshape(*b.shape[: s + 1], *a.shape[s + 1 :])


def _dropout(
    x: Array,
    rate: float,
    key: _LayerKeys | None,
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


# --------------------------------------------------------------------------------------
# Products


def _lora_terms(
    w: _AbstractLowRank,
    x: Array,
    w_is_lhs: bool,
    params: dict[str, Any],
    base: Array | None = None,
) -> tuple[Array, Array, Array] | None:
    """`(W·x, W·x_dropped, scaling·(B·A)·x_dropped)`. The first two are the original
    product (its dtype and precision); the third is the adapter branch, in its compute
    dtype (see `with_compute_dtype`), computed token-major (`x` on the left) and without
    forming `B·A`. None when the layout is not one a low-rank product can follow. `base`
    is `W·x` when the caller has it already."""
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    order = _factor_order(w, p)
    if order is None:
        return None
    if base is None:
        base = p.arrange(*p.contract(x, p.x, w.weight, p.w))
    x_d = _dropout(x, w.lora_dropout, w.dropout_key, p.x, p.w[: w.stack_ndim])
    base_d = base if x_d is x else p.arrange(*p.contract(x_d, p.x, w.weight, p.w))
    dtype = branch_dtype(w)
    first, second = order(w.lora_A.astype(dtype), w.lora_B.astype(dtype))
    scale = jnp.asarray(w.scaling, dtype)
    delta = _low_rank(p, *order(*_factor_labels(w, p)), ())(x_d.astype(dtype), first, second, scale)
    return base, base_d, delta


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


def _factor_labels(w: _AbstractLowRank, p: WeightProduct) -> tuple[Labels, Labels]:
    s = w.stack_ndim
    stack, out_l, in_l = p.w[:s], p.w[s], p.w[s + 1]
    return (*stack, "r", in_l), (*stack, out_l, "r")


def _factor_order(w: _AbstractLowRank, p: WeightProduct) -> Any:
    """Orders `(A, B)`-like pairs as `(first, second)`: the factor that meets `x` first.
    None when neither axis of W meets `x` (an outer product)."""
    s = w.stack_ndim
    out_l, in_l = p.w[s], p.w[s + 1]
    if in_l in p.x:
        return lambda a, b: (a, b)
    if out_l in p.x:
        return lambda a, b: (b, a)
    return None


def _mixed_lora_update(
    ws: list[Any],
    gate: Array,
    x: Array,
    w_is_lhs: bool,
    params: dict[str, Any],
    base: Array,
) -> Any:
    """`Σ_k gate_k · scaling_k · B_k·A_k·x` as one low-rank product of rank `Σ r_k`: the
    factors concatenated along `r`, the gate and scalings applied to the small `(tokens,
    Σ r)` intermediate. `gate` is `(n,)` (one row) or `(batch, n)` (rows along `x`'s leading
    axis). The result is in the adapters' compute dtype. Plain LoRA without active dropout
    only; otherwise `NotImplemented`."""
    if (
        any(
            type(w) is not LoraArray
            or w.kernel_ndim
            or (w.lora_dropout and w.dropout_key is not None)
            for w in ws
        )
        or len({(w.stack_ndim, branch_dtype(w)) for w in ws}) != 1
    ):
        return NotImplemented
    w0 = ws[0]
    p = WeightProduct.parse(len(w0.shape), x.ndim, w_is_lhs, params)
    order = _factor_order(w0, p)
    if order is None:
        return NotImplemented
    s, dtype = w0.stack_ndim, branch_dtype(w0)
    a = jnp.concatenate([w.lora_A.astype(dtype) for w in ws], axis=s)
    b = jnp.concatenate([w.lora_B.astype(dtype) for w in ws], axis=s + 1)
    # one column of the gate per adapter, repeated over its rank, times its scaling
    repeat = jnp.asarray([k for k, w in enumerate(ws) for _ in range(w.r)])
    scalings = jnp.asarray([w.scaling for w in ws for _ in range(w.r)], dtype)
    scale = jnp.take(gate.astype(dtype), repeat, axis=-1) * scalings.reshape(
        (1,) * (gate.ndim - 1) + (-1,)
    )
    scale_labels = ("r",) if gate.ndim == 1 else (p.x[0], "r")
    first, second = order(a, b)
    return _low_rank(p, *order(*_factor_labels(w0, p)), scale_labels)(
        x.astype(dtype), first, second, scale
    )


def _low_rank(
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


def _lora_dot(w: _AbstractLowRank, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    if w.kernel_ndim:
        return NotImplemented
    fused = _fused_lora_dot(w, x, w_is_lhs, params)
    if fused is not None:
        return fused
    terms = _lora_terms(w, x, w_is_lhs, params)
    if terms is None:
        return NotImplemented
    base, _, delta = terms
    return add_update(base, delta)


def _fused_lora_dot(
    w: _AbstractLowRank, x: Array, w_is_lhs: bool, params: dict[str, Any]
) -> Array | None:
    """`W·x + scaling·B·A·x_dropped` as one product: `[x, t]·[W, second]` concatenated
    along the axis that `x` meets, where `t = scaling·first·x_dropped` and `first`,
    `second` are `A`, `B` in the order they meet `x`. For an unstacked LoRA matrix whose
    base is dense (or a lazy transpose of a dense one), with one dtype throughout, and at
    least as many tokens as the met axis is long, counting the examples of an outer
    `jax.vmap` that does not map `W` (one copy of `W` then serves them all); else None.

    One GEMM instead of the base GEMM plus a rank-`r` product as large as the output and
    their sum; reverse mode gets `g·second` from the same GEMM as `g·W`; and a remat policy
    that saves matmul outputs (`dots_saveable`) saves the layer's output once, not its two
    terms. The price is a copy of `W` per call, which only pays off when the activations
    are at least as large as the weight: with few tokens (decoding) the separate branch is
    used. The `r` extra columns may change the GEMM's summation order: the base's part
    equals `W·x` to rounding, not bit for bit."""
    base = dense_base(w.weight)
    if type(w) is not LoraArray or w.stack_ndim or base is None:
        return None
    weight, perm = base
    dtype = branch_dtype(w)
    if len({x.dtype, weight.dtype, w.lora_A.dtype, w.lora_B.dtype, dtype}) != 1:
        return None
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    order = _factor_order(w, p)
    if order is None or p.preferred_element_type not in (None, x.dtype):
        return None
    meet = 1 if p.w[1] in p.x else 0
    if p.w[meet] in p.out or p.w[1 - meet] in p.x:  # a batch axis, not a contracted one
        return None
    tokens = x.size // x.shape[p.x.index(p.w[meet])]
    if tokens * outer_vmap_size(x) // outer_vmap_size(weight) < w.shape[meet]:
        return None
    x = jnp.asarray(x)
    x_d = _dropout(x, w.lora_dropout, w.dropout_key, p.x, ())
    first, second = order(w.lora_A, w.lora_B)
    if perm == (1, 0):  # W's own frame: its labels, met axis and factors transposed back
        p, meet, first, second = dataclasses.replace(p, w=p.w[::-1]), 1 - meet, first.T, second.T
    scale = jnp.asarray(w.scaling, dtype)
    return _fused_low_rank(p, meet)(x, x_d, weight, first, second, scale)


def _fused_low_rank(p: WeightProduct, meet: int) -> Any:
    """`f(x, x_d, W, first, second, scale)` for `_fused_lora_dot`, where `x` meets axis
    `meet` of `W`. `second` is laid out like `W` with `r` in place of that axis (`B` when
    `x` meets `W`'s input axis, `A` when its output axis), so it extends `W` along it."""
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


def _lora_update(
    w: _AbstractLowRank, x: Array, w_is_lhs: bool, params: dict[str, Any], base: Array
) -> Any:
    if w.kernel_ndim:
        return NotImplemented
    terms = _lora_terms(w, x, w_is_lhs, params, base)
    return NotImplemented if terms is None else terms[2]


weight_dot_handlers(LoraArray, _lora_dot, _lora_update)


@primitive_handler("conv_general_dilated")
def _lora_conv(primitive: Any, x: jax.Array, w: LoraArray, **params: Any) -> Any:
    if not w.kernel_ndim or w.stack_ndim or params["feature_group_count"] != 1:
        return NotImplemented
    if params["batch_group_count"] != 1:
        return NotImplemented
    base = primitive.bind(x, w.weight, **params)
    adapter_params = {**params, "preferred_element_type": None}
    dtype = branch_dtype(w)
    x_d = _dropout(x, w.lora_dropout, w.dropout_key).astype(dtype)
    t = primitive.bind(x_d, w.lora_A.astype(dtype), **adapter_params)
    _, rhs_spec, out_spec = params["dimension_numbers"]
    n = w.kernel_ndim
    pointwise = {
        **adapter_params,
        "window_strides": (1,) * n,
        "padding": ((0, 0),) * n,
        "lhs_dilation": (1,) * n,
        "rhs_dilation": (1,) * n,
        "dimension_numbers": lax.ConvDimensionNumbers(out_spec, rhs_spec, out_spec),
    }
    delta = primitive.bind(t, w.lora_B.astype(dtype), **pointwise)
    return add_update(base, jnp.asarray(w.scaling, dtype) * delta)


@primitive_handler("transpose")
def _lora_transpose(primitive: Any, w: LoraArray, *, permutation: tuple[int, ...]) -> Any:
    s = w.stack_ndim
    if w.kernel_ndim or tuple(permutation) != (*range(s), s + 1, s):
        return NotImplemented
    # (W + s·B·A)ᵀ = Wᵀ + s·Aᵀ·Bᵀ: again a LoRA, with the factors' roles exchanged; the
    # base is transposed lazily, so no weight-sized copy of it is made.
    return eqx.tree_at(
        lambda m: (m.weight, m.lora_A, m.lora_B),
        w,
        (
            Transposed(w.weight, tuple(permutation)),
            jnp.swapaxes(w.lora_B, -1, -2),
            jnp.swapaxes(w.lora_A, -1, -2),
        ),
    )


def cast_base_on_astype(cls: type) -> None:
    """Register `astype` to a floating dtype for adapters of class `cls`: the base weight
    is cast and the adapter's own parameters keep their dtype (PEFT keeps them float32)."""

    def astype(primitive: Any, w: cls, **params: Any) -> Any:  # type: ignore[valid-type]
        if not jnp.issubdtype(params["new_dtype"], jnp.floating):
            return NotImplemented
        return eqx.tree_at(lambda m: m.weight, w, primitive.bind(w.weight, **params))

    astype.__qualname__ = f"astype[{cls.__name__}]"
    primitive_handler("convert_element_type")(astype)


cast_base_on_astype(_AbstractLowRank)


# --------------------------------------------------------------------------------------
# Construction


def lora(
    weight: Any,
    *,
    r: int = 8,
    lora_alpha: float | int = 8.0,
    init: LoraInit = "default",
    use_rslora: bool = False,
    lora_dropout: float | int = 0.0,
    dtype: Any = jnp.float32,
    key: PRNGKeyArray,
) -> LoraArray:
    """Wrap `weight` in a `LoraArray` with fresh factors, initialized as HF PEFT does.

    **Arguments:**

    - `weight`: a `Linear` weight `(out, in)` or `Conv` weight `(out, in, *kernel)`; dense
      or implicit (e.g. `NF4Array` for QLoRA).
    - `r`, `lora_alpha`, `use_rslora`, `lora_dropout`: as in `peft.LoraConfig`.
    - `init`: PEFT's `init_lora_weights`. `"default"` (`True`): `lora_A` Kaiming-uniform,
      `lora_B` zeros, so the output equals the base model's. `"gaussian"`: `lora_A` normal
      with std `1/r`, `lora_B` zeros. `"pissa"`: the top-`r` singular triplets of `W` go
      into the factors and `W` is replaced by the residual (same output as the base).
      `"random"` (`False`): both factors random, for tests.
    - `dtype`: the factors' dtype (PEFT keeps adapters in float32).
    - `key`: a JAX PRNG key.

    **Returns:**

    A `LoraArray`.
    """
    shape = tuple(weight.shape)
    if len(shape) < 2:
        raise ValueError(f"LoRA needs a weight of 2 or more dimensions, got shape {shape}.")
    _check_rank(r, shape)
    out, in_, kernel = shape[0], shape[1], shape[2:]
    a_shape, b_shape = (r, in_, *kernel), (out, r, *(1,) * len(kernel))
    a_key, b_key = jax.random.split(key)
    # Kaiming-uniform with a=sqrt(5), PyTorch's default for Linear/Conv weights.
    a_bound = 1.0 / math.sqrt(in_ * math.prod(kernel))
    if init == "pissa":
        weight, lora_A, lora_B = _pissa(weight, r, lora_alpha, use_rslora, dtype)
    elif init in ("default", "gaussian", "random"):
        if init == "gaussian":
            lora_A = jax.random.normal(a_key, a_shape, dtype) / r
        else:
            lora_A = jax.random.uniform(a_key, a_shape, dtype, -a_bound, a_bound)
        if init == "random":
            b_bound = 1.0 / math.sqrt(r)
            lora_B = jax.random.uniform(b_key, b_shape, dtype, -b_bound, b_bound)
        else:
            lora_B = jnp.zeros(b_shape, dtype)
    else:
        raise ValueError(
            f"unknown LoRA init {init!r}; expected one of 'default', 'gaussian', 'pissa', 'random'."
        )
    return LoraArray(
        weight,
        lora_A,
        lora_B,
        lora_alpha=lora_alpha,
        use_rslora=use_rslora,
        lora_dropout=lora_dropout,
    )


def _pissa(
    weight: Any, r: int, lora_alpha: float | int, use_rslora: bool, dtype: Any
) -> tuple[Array, Array, Array]:
    if isinstance(weight, ImplicitArray) or weight.ndim != 2:
        raise TypeError(
            "PiSSA initialization needs a dense 2-D floating-point weight; quantize the "
            f"residual afterwards. Got {type(weight).__name__} of shape {tuple(weight.shape)}."
        )
    if not jnp.issubdtype(weight.dtype, jnp.floating):
        raise TypeError(f"PiSSA needs a floating-point weight, got dtype {weight.dtype}.")
    if r > min(weight.shape):
        raise ValueError(
            f"PiSSA takes r={r} singular vectors of a weight of shape {tuple(weight.shape)}, "
            f"which has only {min(weight.shape)}; use r <= {min(weight.shape)}."
        )
    scaling = lora_alpha / (math.sqrt(r) if use_rslora else r)
    u, s, vh = jnp.linalg.svd(weight.astype(jnp.float32), full_matrices=False)
    root = jnp.sqrt(s[:r] / scaling)
    lora_A = root[:, None] * vh[:r]
    lora_B = u[:, :r] * root[None, :]
    residual = weight.astype(jnp.float32) - scaling * lora_B @ lora_A
    return residual.astype(weight.dtype), lora_A.astype(dtype), lora_B.astype(dtype)


def with_dropout(tree: Any, key: PRNGKeyArray) -> Any:
    """Give every adapter in `tree` a fresh dropout key (training mode).

    Call it inside the jitted loss with a new key each step. It reaches the adapters of
    an `AdapterSet` (so of a `PeftModel`) too. An adapter stacked over layers (with
    `eqx.filter_vmap`) gets one key per layer, so `jax.lax.scan` or `jax.vmap` over the
    stack gives each layer its own mask. Under `jax.vmap` over examples, the adapters see
    one example at a time and share the mask unless the keys are batched too; see the
    README.
    """
    adapters = [x for x in jax.tree.leaves(tree, is_leaf=_has_dropout) if _has_dropout(x)]
    keys = list(jax.random.split(key, max(len(adapters), 1)))

    def keyed(x: _AbstractLowRank) -> _AbstractLowRank:
        # a stack of layers gets a key per layer: `lax.scan` and `jax.vmap` slice one each
        return _set_key(x, jax.random.split(keys.pop(), x.weight.shape[: x.stack_ndim]))

    return jax.tree.map(lambda x: keyed(x) if _has_dropout(x) else x, tree, is_leaf=_has_dropout)


def without_dropout(tree: Any) -> Any:
    """Remove every adapter's dropout key (inference mode)."""
    return jax.tree.map(
        lambda x: _set_key(x, None) if _has_dropout(x) else x, tree, is_leaf=_has_dropout
    )


def with_compute_dtype(tree: Any, dtype: Any) -> Any:
    """Run the branch of every LoRA/DoRA adapter in `tree` in `dtype` (None: in the
    factors' own dtype, the default).

    The common mixed-precision recipe: a bfloat16 base, float32 factors (and so float32
    gradients and optimizer state), and `with_compute_dtype(model, jnp.bfloat16)` for
    bfloat16 matrix products in the adapter branch; the gradients are still float32.
    """
    dtype = _checked_compute_dtype(dtype)
    return jax.tree.map(
        lambda x: _with_static(x, compute_dtype=dtype) if _has_dropout(x) else x,
        tree,
        is_leaf=_has_dropout,
    )


def _with_static(module: eqx.Module, **changes: Any) -> Any:
    """A copy of `module` with static fields changed (`eqx.tree_at` reaches only leaves)."""
    new = object.__new__(type(module))
    for field in dataclasses.fields(module):
        object.__setattr__(new, field.name, changes.get(field.name, getattr(module, field.name)))
    return new


def _has_dropout(x: Any) -> bool:
    return isinstance(x, _AbstractLowRank)


def _set_key(x: _AbstractLowRank, key: _LayerKeys | None) -> _AbstractLowRank:
    return eqx.tree_at(lambda m: m.dropout_key, x, key, is_leaf=lambda n: n is None)


def unmerge(merged: Array, adapter: _AbstractLowRank) -> _AbstractLowRank:
    """The adapter on the base weight recovered from `merged = W + s·B·A` (LoRA) or from
    its DoRA counterpart."""
    if isinstance(adapter, DoraArray):
        merged = merged * (adapter.weight_norm() / adapter.lora_magnitude_vector)[..., None]
    base = merged - adapter.delta().astype(merged.dtype)
    return eqx.tree_at(lambda m: m.weight, adapter, base.astype(merged.dtype))


# --------------------------------------------------------------------------------------
# DoRA


class DoraArray(_AbstractLowRank):
    """DoRA: `m ⊙ (W + s·B·A) / ‖W + s·B·A‖`, the norm taken per output row.

    As in HF PEFT (and the DoRA paper, §4.3) the norm is treated as a constant for
    gradients. No weight-sized array is formed for it: `‖W_i‖²` of the frozen base is
    computed once, by the constructor, and kept as `weight_sq_norm` (float32, `(out,)`,
    not a parameter: `partition` freezes it and parameter counts leave it out); the rest
    comes from `W·Aᵀ` `(out, r)`, through the base's own product (an NF4 base dequantizes
    in chunks), and `A·Aᵀ` `(r, r)`. `lora_magnitude_vector` has shape `(out,)`.

    `weight_sq_norm` describes the `weight` given to the constructor: build a new
    `DoraArray` for another base rather than swapping `weight` with `eqx.tree_at`.
    `materialize()` takes the norm of the dense weight it builds.
    """

    lora_magnitude_vector: Array
    weight_sq_norm: Array

    def __init__(
        self,
        weight: Any,
        lora_A: Array,
        lora_B: Array,
        lora_magnitude_vector: Array,
        *,
        lora_alpha: float | int,
        use_rslora: bool = False,
        lora_dropout: float | int = 0.0,
        dropout_key: _LayerKeys | None = None,
        compute_dtype: Any = None,
    ):
        _init_low_rank(
            self,
            weight,
            lora_A,
            lora_B,
            lora_alpha,
            use_rslora,
            lora_dropout,
            dropout_key,
            compute_dtype,
        )
        if len(weight.shape) != 2:
            raise ValueError(
                f"DoRA supports Linear weights (out, in) only, got shape {tuple(weight.shape)}."
            )
        if tuple(lora_magnitude_vector.shape) != (weight.shape[0],):
            raise ValueError(
                f"lora_magnitude_vector must have shape ({weight.shape[0]},), one entry per "
                f"output feature, got {tuple(lora_magnitude_vector.shape)}."
            )
        self.lora_magnitude_vector = lora_magnitude_vector
        self.weight_sq_norm = _row_sq_norms(weight)

    def weight_norm(self) -> Array:
        """`‖W + s·B·A‖` per output row, without forming the weight-sized sum."""
        return _dora_norm(self)

    def materialize(self) -> Array:
        w = materialize(self.weight)
        dense = w.astype(jnp.float32) + self.delta().astype(jnp.float32)
        norm = lax.stop_gradient(jnp.sqrt(jnp.sum(dense * dense, -1)))
        scale = (self.lora_magnitude_vector.astype(jnp.float32) / norm)[..., None]
        return (dense * scale).astype(w.dtype)


def _row_sq_norms(weight: Any) -> Array:
    """`‖W_i‖²` of each output row of a dense or implicit weight, in float32; an implicit
    one is materialized (this runs once, when a `DoraArray` is built)."""
    w = materialize(weight)
    n = w.ndim
    rows = tuple(range(n - 1))
    # a batched product: the squares are never formed as an array of their own
    sq = lax.dot_general(
        w,
        w,
        (((n - 1,), (n - 1,)), (rows, rows)),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return lax.stop_gradient(sq)


def _dora_scale(w: DoraArray) -> Array:
    """`m / ‖W + s·B·A‖` per output row, in float32 (whatever the magnitude's dtype)."""
    return w.lora_magnitude_vector.astype(jnp.float32) / _dora_norm(w)


def _dora_norm(w: DoraArray) -> Array:
    """`‖W + s·B·A‖` per output row, in float32 and detached from gradients, from the kept
    `‖W_i‖²`, `W·Aᵀ` `(out, r)` and `A·Aᵀ` `(r, r)`."""
    s = w.stack_ndim
    a = lax.stop_gradient(w.lora_A).astype(jnp.float32)
    b = lax.stop_gradient(w.lora_B).astype(jnp.float32)
    stack = tuple(range(s))
    dims = (((s + 1,), (s + 1,)), (stack, stack))

    def base_times(weight: Any, a: Array) -> Array:
        return lax.dot_general(weight, a, dims, preferred_element_type=jnp.float32)

    # W·Aᵀ through the base's own product handler (e.g. NF4's, chunked), whether the base
    # is an implicit array here (`dora()`) or a traced one (inside a handler)
    wa = use_implicit_args(base_times)(w.weight, a)
    aa = jnp.matmul(a, jnp.swapaxes(a, -1, -2))
    c = w.scaling
    # ‖W + c·B·A‖² = ‖W‖² + 2c·⟨W·Aᵀ, B⟩ + c²·⟨B·(A·Aᵀ), B⟩, row by row
    sq = w.weight_sq_norm + 2 * c * jnp.sum(wa * b, -1) + c * c * jnp.sum((b @ aa) * b, -1)
    return lax.stop_gradient(jnp.sqrt(jnp.maximum(sq, 0.0)))


def dora(lora_array: LoraArray) -> DoraArray:
    """DoRA from a LoRA: the magnitude starts at the row norms, so the output is unchanged."""
    x = lora_array
    d = DoraArray(
        x.weight,
        x.lora_A,
        x.lora_B,
        jnp.ones(x.weight.shape[:1], x.lora_A.dtype),
        lora_alpha=x.lora_alpha,
        use_rslora=x.use_rslora,
        lora_dropout=x.lora_dropout,
        dropout_key=x.dropout_key,
        compute_dtype=x.compute_dtype,
    )
    magnitude = _dora_norm(d).astype(x.lora_A.dtype)
    return eqx.tree_at(lambda m: m.lora_magnitude_vector, d, magnitude)


def _dora_dot(w: DoraArray, x: Array, w_is_lhs: bool, params: dict[str, Any]) -> Any:
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    stack, out_l = p.w[: w.stack_ndim], p.w[w.stack_ndim]
    if out_l in p.x:  # W's rows meet x: (diag(m/‖·‖)·V)·x == V·(m/‖·‖ ⊙ x)
        scale = _dora_scale(w)
        x = _rescale(x, p.along(scale, (*stack, out_l), p.x))
        return _lora_dot(w, x, w_is_lhs, params)
    base = p.arrange(*p.contract(x, p.x, w.weight, p.w))
    update = _dora_update(w, x, w_is_lhs, params, base)
    return update if update is NotImplemented else add_update(base, update)


def _dora_update(
    w: DoraArray, x: Array, w_is_lhs: bool, params: dict[str, Any], base: Array
) -> Any:
    p = WeightProduct.parse(len(w.shape), x.ndim, w_is_lhs, params)
    stack, out_l = p.w[: w.stack_ndim], p.w[w.stack_ndim]
    terms = _lora_terms(w, x, w_is_lhs, params, base)
    if out_l in p.x or terms is None:
        return NotImplemented
    _, base_d, delta = terms
    scale = _dora_scale(w).astype(delta.dtype)
    scale = p.along(scale, (*stack, out_l), p.out)
    # PEFT's form: base(x) + (m/‖·‖ - 1)·base(dropout(x)) + m/‖·‖ · s·B·A·dropout(x),
    # the update in the adapter's compute dtype
    return (scale - 1) * base_d.astype(delta.dtype) + scale * delta


def _rescale(x: Array, scale: Array) -> Array:
    """`x ⊙ scale` computed in the wider dtype and rounded to `x`'s (PEFT multiplies a
    bfloat16 activation by a float32 scale in float32)."""
    wide = wider_dtype(x.dtype, scale.dtype)
    return (x.astype(wide) * scale.astype(wide)).astype(x.dtype)


weight_dot_handlers(DoraArray, _dora_dot, _dora_update)
