"""LoRA and DoRA against dense formulas written out here and against HF PEFT in PyTorch."""

import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import all_eqns, close, example_count
from hypothesis import given, settings, strategies as st

from peftx.adapters import (
    DoraArray,
    LoraArray,
    dora,
    lora,
    unmerge,
    with_dropout,
    without_dropout,
)
from peftx.implicit import Transposed, strict, use_implicit_args

ALPHA = 4.0


def _random_lora(key, shape=(6, 5), r=2, **kwargs):
    kw, kl = jax.random.split(key)
    return lora(
        jax.random.normal(kw, shape), r=r, lora_alpha=ALPHA, init="random", key=kl, **kwargs
    )


# The references below are written out here, not taken from `materialize()`, `delta()` or
# `scaling`, so that the library's arithmetic cannot agree with itself by sharing a bug.


def _dense_lora(weight, a, b, alpha=ALPHA, use_rslora=False):
    """`W + s·B·A`, `s = alpha/r` (`alpha/sqrt(r)` with rsLoRA); leading axes stack layers."""
    r = a.shape[-2]
    s = alpha / math.sqrt(r) if use_rslora else alpha / r
    return weight + s * jnp.matmul(b, a)


def _dense_dora(weight, a, b, m, alpha=ALPHA, use_rslora=False):
    """`m ⊙ V / ‖V‖` per output row, `V = W + s·B·A`; the norm is a constant for
    gradients, as in PEFT."""
    v = _dense_lora(weight, a, b, alpha, use_rslora)
    norm = jax.lax.stop_gradient(jnp.sqrt(jnp.sum(v * v, axis=-1)))
    return v * (m / norm)[..., None]


def _dense_conv_lora(weight, a, b, alpha=ALPHA):
    """`W + (alpha/r)·B·A` for conv kernels: `B` `(out, r, 1, ...)` is a 1x1 conv after `A`."""
    r = a.shape[0]
    return weight + (alpha / r) * jnp.tensordot(b.reshape(b.shape[0], r), a, axes=1)


# ---------------------------------------------------------------- layouts


LAYOUTS = {
    "eqx W @ x": lambda w, x: w @ x[0],
    "vmap(W @ x)": lambda w, x: jax.vmap(lambda v: w @ v)(x),
    "x @ W.T": lambda w, x: x @ w.T,
    "einsum oi,bi->bo": lambda w, x: jnp.einsum("oi,bi->bo", w, x),
    "W @ X.T": lambda w, x: w @ x.T,
    "3-D x": lambda w, x: jnp.einsum("oi,tbi->tbo", w, jnp.stack([x, 2 * x])),
}


@pytest.mark.parametrize("adapter", ["lora", "dora"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_and_gradients_match_dense_formula(getkey, adapter, layout):
    """Values and gradients (factors, magnitude, input) against `W + (alpha/r)·B·A`
    (DoRA: its row-normalized form) written out, for a rank-2 adapter on a (6, 5) weight."""
    fn = LAYOUTS[layout]
    w = _random_lora(getkey())
    names = ["lora_A", "lora_B"]
    if adapter == "dora":
        w = dora(w)
        m = w.lora_magnitude_vector * jax.random.uniform(getkey(), (6,), minval=0.5, maxval=1.5)
        w = eqx.tree_at(lambda d: d.lora_magnitude_vector, w, m)
        names.append("lora_magnitude_vector")
    leaves = tuple(getattr(w, n) for n in names)
    x = jax.random.normal(getkey(), (3, 5))

    def rebuilt(leaves):
        return eqx.tree_at(lambda m: tuple(getattr(m, n) for n in names), w, leaves)

    def dense(leaves):
        return (_dense_dora if adapter == "dora" else _dense_lora)(w.weight, *leaves)

    def implicit_loss(leaves, x):
        return jnp.sum(jnp.sin(use_implicit_args(fn)(rebuilt(leaves), x)))

    def dense_loss(leaves, x):
        return jnp.sum(jnp.sin(fn(dense(leaves), x)))

    with strict():
        got = jax.jit(use_implicit_args(fn))(w, x)
        grads = jax.jit(jax.grad(implicit_loss, argnums=(0, 1)))(leaves, x)
    want = fn(dense(leaves), x)
    close(got, want)
    assert not np.allclose(want, fn(w.weight, x), atol=1e-2)  # the adapter contributes
    close(grads, jax.grad(dense_loss, argnums=(0, 1))(leaves, x), tol=1e-4)


@st.composite
def weight_product(draw):
    """A dot_general between a 2-D weight and x, with each weight axis contracted,
    batched or free (not both free), x carrying extra free and batch axes."""
    roles = draw(st.sampled_from([("f", "c"), ("c", "f"), ("c", "c"), ("b", "c"), ("c", "b")]))
    w_shape = (draw(st.integers(2, 5)), draw(st.integers(2, 5)))
    n_extra_batch = draw(st.integers(0, 1))
    n_free = draw(st.integers(0, 2))
    x_axes = [("w", i) for i, role in enumerate(roles) if role != "f"]
    x_axes += [("B", j) for j in range(n_extra_batch)] + [("F", j) for j in range(n_free)]
    x_axes = draw(st.permutations(x_axes))
    extra = [draw(st.integers(1, 3)) for _ in range(n_extra_batch + n_free)]
    x_shape = tuple(
        w_shape[i] if kind == "w" else extra[i if kind == "B" else n_extra_batch + i]
        for kind, i in x_axes
    )
    w_c = tuple(i for i, role in enumerate(roles) if role == "c")
    w_b = tuple(i for i, role in enumerate(roles) if role == "b")
    x_c = tuple(x_axes.index(("w", i)) for i in w_c)
    x_b = tuple(x_axes.index(("w", i)) for i in w_b)
    w_first = draw(st.booleans())
    dims = ((w_c, x_c), (w_b, x_b)) if w_first else ((x_c, w_c), (x_b, w_b))
    return w_shape, x_shape, dims, w_first


@settings(max_examples=example_count(10), deadline=None)
@given(
    case=weight_product(), r=st.integers(2, 4), use_rslora=st.booleans(), seed=st.integers(0, 2**16)
)
def test_lora_dot_general_any_layout(case, r, use_rslora, seed):
    """Any layout, values and gradients (factors and input) against the formula. r >= 2:
    at r=1 a factor read with its axes swapped has the right values."""
    w_shape, x_shape, dims, w_first = case
    k1, k2 = jax.random.split(jax.random.key(seed))
    w = _random_lora(k1, w_shape, r=r, use_rslora=use_rslora)
    x = jax.random.normal(k2, x_shape)

    def fn(w, x):
        return jax.lax.dot_general(w, x, dims) if w_first else jax.lax.dot_general(x, w, dims)

    def implicit_loss(a, b, x):
        adapted = eqx.tree_at(lambda m: (m.lora_A, m.lora_B), w, (a, b))
        return jnp.sum(use_implicit_args(fn)(adapted, x) ** 2)

    def dense_loss(a, b, x):
        return jnp.sum(fn(_dense_lora(w.weight, a, b, use_rslora=use_rslora), x) ** 2)

    # jitted, both sides: one compile each, not one per operation
    with strict():
        got = jax.jit(use_implicit_args(fn))(w, x)
        grads = jax.jit(jax.grad(implicit_loss, argnums=(0, 1, 2)))(w.lora_A, w.lora_B, x)
    dense = jax.jit(lambda a, b, x: fn(_dense_lora(w.weight, a, b, use_rslora=use_rslora), x))
    close(got, dense(w.lora_A, w.lora_B, x), tol=1e-4)
    want = jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2)))(w.lora_A, w.lora_B, x)
    close(grads, want, tol=1e-3)


def test_transpose_stays_a_lora(getkey):
    w = _random_lora(getkey(), r=3)
    x = jax.random.normal(getkey(), (4, 6))
    with strict():
        t = use_implicit_args(lambda w: w.T)(w)
        got = use_implicit_args(lambda w, x: w.T @ x.T)(w, x)  # a product of the transpose
    assert isinstance(t, LoraArray) and t.shape == (5, 6) and t.r == w.r
    # (W + s·B·A)ᵀ = Wᵀ + s·Aᵀ·Bᵀ: the factors exchange roles, each transposed
    np.testing.assert_array_equal(t.lora_A, w.lora_B.T)
    np.testing.assert_array_equal(t.lora_B, w.lora_A.T)
    dense_t = _dense_lora(w.weight, w.lora_A, w.lora_B).T
    # the base is transposed lazily: no weight-sized copy is made
    assert isinstance(t.weight, Transposed) and t.weight.array is w.weight
    close(_dense_lora(w.weight.T, t.lora_A, t.lora_B), dense_t)
    close(got, dense_t @ x.T)


def test_astype_stays_a_lora(getkey):
    w = _random_lora(getkey())
    with strict():
        h = use_implicit_args(lambda w: w.astype(jnp.bfloat16))(w)
    assert isinstance(h, LoraArray) and h.dtype == jnp.bfloat16


def test_frozen_weight_gets_no_gradient_computation(getkey):
    """With W in the frozen partition, the backward pass forms no weight-shaped product."""
    w = _random_lora(getkey(), (64, 48), r=4)
    x = jax.random.normal(getkey(), (32, 48))
    params, static = eqx.partition(w, lambda leaf: leaf is not w.weight and eqx.is_array(leaf))

    def loss_fn(params):
        model = eqx.combine(params, static)
        return jnp.sum(
            jnp.tanh(jax.vmap(lambda v: use_implicit_args(lambda m, v: m @ v)(model, v))(x))
        )

    jaxpr = jax.make_jaxpr(jax.grad(loss_fn))(params)
    shapes = [
        tuple(v.aval.shape)
        for eqn in all_eqns(jaxpr.jaxpr)
        if eqn.primitive.name == "dot_general"
        for v in eqn.outvars
    ]
    assert shapes, "no products traced"
    assert (64, 48) not in shapes and (48, 64) not in shapes


def _linear_loss(getkey, tokens, d_in, d_out, r):
    """`(loss(params, x), params, x)`: a `Linear`-style `x @ Wᵀ` through a LoRA weight
    whose base is frozen (left out of `params`)."""
    w = _random_lora(getkey(), (d_out, d_in), r=r)
    x = jax.random.normal(getkey(), (tokens, d_in))
    params, static = eqx.partition(w, lambda leaf: leaf is not w.weight and eqx.is_array(leaf))

    def loss_fn(params, x):
        return jnp.sum(
            jnp.tanh(use_implicit_args(lambda m, x: x @ m.T)(eqx.combine(params, static), x))
        )

    return loss_fn, params, x


def test_training_step_multiplies_activations_once_per_direction(getkey):
    """A float32 `Linear` adapter costs one activation-sized product forward
    (`[x, s·A·x]·[W, B]ᵀ`) and one backward (`g·[W, B]`): no rank-r product writes a
    `(tokens, out)` or `(tokens, in)` array besides the one that folds `g·B` back through
    `A`. Values and gradients are checked against the formula elsewhere."""
    tokens, d_in, d_out, r = 64, 48, 40, 4
    loss_fn, params, x = _linear_loss(getkey, tokens, d_in, d_out, r)

    def big_products(fn, *args):
        """The activation-sized products XLA runs (after removing dead code)."""
        hlo = jax.jit(fn).lower(*args).compile().as_text()
        shapes = [
            tuple(map(int, s.split(",")))
            for s in re.findall(r"= f32\[([\d,]+)\]\{[\d,]*\} dot\(", hlo)
        ]
        return sorted(s for s in shapes if s[0] == tokens and s[-1] > r + 1)

    assert big_products(loss_fn, params, x) == [(tokens, d_out)]
    assert big_products(jax.grad(loss_fn, argnums=(0, 1)), params, x) == sorted(
        [
            (tokens, d_in),  # s·(g·B)·A, into the input's gradient
            (tokens, d_in + r),  # g·[W, B]
            (tokens, d_out),
        ]
    )


@pytest.mark.parametrize("tokens", [64, 8], ids=["one GEMM", "separate branch"])
def test_factor_gradients_are_written_rank_major(getkey, tokens):
    """The factors' gradients, products over the tokens, write their `(r, ·)` result with
    `r` as the major axis (then transposed, weight-sized and cheap): on CPU the `(·, r)`
    layout XLA would otherwise pick for `B`'s gradient runs 2-4x slower."""
    d_in, d_out, r = 48, 40, 4
    loss_fn, params, x = _linear_loss(getkey, tokens, d_in, d_out, r)
    hlo = jax.jit(jax.grad(loss_fn)).lower(params, x).compile().as_text()
    products = re.findall(r"= f32\[(\d+),(\d+)\]\{(\d),(\d)\} dot\(", hlo)
    gradients = [
        ((int(a), int(b)), int(major))
        for a, b, _, major in products
        if tokens not in (int(a), int(b)) and r in (int(a), int(b))
    ]
    assert sorted(shape for shape, _ in gradients) == [(r, d_in), (d_out, r)]
    for shape, major in gradients:
        assert shape[major] == r, f"{shape} written with axis {major} major"


# bfloat16: the fast tier takes the one-GEMM product in test_fused_product_any_layout and
# the separate branch in test_bf16_linear_matches_dense_formula, the whole suite here too
@pytest.mark.parametrize(
    "dtype",
    [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.variant_sweep)],
    ids=["float32", "bfloat16"],
)
@pytest.mark.parametrize("batch", [8, 2], ids=["one GEMM", "separate branch"])
def test_outer_vmap_counts_the_batch_for_the_one_gemm_product(getkey, batch, dtype):
    """The idiomatic Equinox model takes one example and is `vmap`ped over the batch
    outside `use_implicit_args`: the handler sees one example's 4 tokens, but one copy of
    `[W, B]` serves the whole batch, so the one-GEMM product is taken once the batch's
    tokens reach the met axis (16). Values and gradients against the dense formula in
    float32, to the dtype's rounding."""
    tokens, d_in, d_out, r = 4, 16, 12, 2
    w = _random_lora(getkey(), (d_out, d_in), r=r)
    w = jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, w)
    x = jax.random.normal(getkey(), (batch, tokens, d_in), dtype)

    def implicit(x, a, b):
        adapted = eqx.tree_at(lambda m: (m.lora_A, m.lora_B), w, (a, b))
        return jax.vmap(lambda v: use_implicit_args(lambda m, v: v @ m.T)(adapted, v))(x)

    def dense(x, a, b):
        x, weight, a, b = [t.astype(jnp.float32) for t in (x, w.weight, a, b)]
        return x @ (weight + (ALPHA / r) * b @ a).T

    def loss(f):
        return lambda *args: jnp.sum(jnp.sin(f(*args).astype(jnp.float32)))

    args = (x, w.lora_A, w.lora_B)
    jaxpr = jax.make_jaxpr(jax.grad(loss(implicit), argnums=(0, 1, 2)))(*args)
    extended = [
        eqn
        for eqn in all_eqns(jaxpr.jaxpr)
        if eqn.primitive.name == "dot_general"
        and any(getattr(v.aval, "shape", None) == (d_out, d_in + r) for v in eqn.invars)
    ]
    assert bool(extended) == (batch * tokens >= d_in)
    eps = float(jnp.finfo(dtype).eps)
    got, want = jax.jit(implicit)(*args), dense(*args)
    assert got.dtype == dtype
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=8 * eps * scale * d_in)
    grads = jax.grad(loss(implicit), argnums=(0, 1, 2))(*args)
    want_grads = jax.grad(loss(dense), argnums=(0, 1, 2))(*args)
    for g, h in zip(grads, want_grads):
        assert g.dtype == dtype
        bound = 16 * eps * float(jnp.max(jnp.abs(h))) * batch * tokens
        np.testing.assert_allclose(g.astype(jnp.float32), h, atol=bound)


FUSED_FORMS = {
    "x @ W.T": (lambda w, x: x @ w.T, "ti"),
    "W @ x.T": (lambda w, x: w @ x.T, "ti"),
    "batched einsum": (lambda w, x: jnp.einsum("bti,oi->bto", x, w), "bti"),
    "x @ W (meets W's output axis)": (lambda w, x: x @ w, "to"),
    "x @ W.T.T.T": (lambda w, x: x @ w.T.T.T, "ti"),
    "x @ (W.T) (a lazy transpose meeting its output axis)": (lambda w, x: x @ w.T.T, "to"),
}


FUSED_VARIANTS = {
    "float32": (jnp.float32, False),
    "float32 with dropout": (jnp.float32, True),
    "bfloat16": (jnp.bfloat16, False),
}
# every form in float32; the fast tier runs dropout on the two layouts its mask is drawn in
# (x as it is, and transposed) and bfloat16 on x @ W.T, the whole suite every form
FUSED_FAST = {
    "float32": set(FUSED_FORMS),
    "float32 with dropout": {"x @ W.T", "W @ x.T"},
    "bfloat16": {"x @ W.T"},
}


@pytest.mark.parametrize(
    "dtype, dropout, form",
    [
        pytest.param(
            *FUSED_VARIANTS[variant],
            form,
            id=f"{variant}-{form}",
            marks=() if form in FUSED_FAST[variant] else pytest.mark.variant_sweep,
        )
        for variant in FUSED_VARIANTS
        for form in FUSED_FORMS
    ],
)
def test_fused_product_any_layout(form, dtype, dropout, getkey):
    """The one-GEMM product (taken when there are at least as many tokens as the met axis
    is long), for the layouts users write, with and without dropout: values and gradients
    of x, W, A and B against the dense formula in float32, to the dtype's rounding."""
    fn, x_axes = FUSED_FORMS[form]
    d_out, d_in, r, tokens = 6, 5, 3, 16
    sizes = {"b": 2, "t": tokens, "i": d_in, "o": d_out}
    w = _random_lora(getkey(), (d_out, d_in), r=r, lora_dropout=0.5 if dropout else 0.0)
    w = jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, w)
    x = jax.random.normal(getkey(), tuple(sizes[a] for a in x_axes), dtype)
    if dropout:
        w = with_dropout(w, getkey())
        # the mask is drawn in the layout of the operand the product sees
        transposed = form == "W @ x.T"
        keep = jax.random.bernoulli(w.dropout_key, 0.5, x.T.shape if transposed else x.shape)
        keep = keep.T if transposed else keep

    def implicit(x, weight, a, b):
        adapted = eqx.tree_at(lambda m: (m.weight, m.lora_A, m.lora_B), w, (weight, a, b))
        return use_implicit_args(fn)(adapted, x)

    def dense(x, weight, a, b):
        x, weight, a, b = [t.astype(jnp.float32) for t in (x, weight, a, b)]
        x_d = jnp.where(keep, x / 0.5, 0.0) if dropout else x
        return fn(weight, x) + fn(w.scaling * b @ a, x_d)

    args = (x, w.weight, w.lora_A, w.lora_B)
    eps = float(jnp.finfo(dtype).eps)

    def with_grads(f):  # one program for the values and the gradients (not op by op)
        grad = jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2, 3))
        return jax.jit(lambda *a: (f(*a), grad(*a)))

    with strict():
        got, grads = with_grads(implicit)(*args)
    want, want_grads = with_grads(dense)(*args)
    assert got.dtype == dtype and got.shape == want.shape
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=8 * eps * scale * d_in)
    for g, h in zip(grads, want_grads):
        assert g.dtype == dtype
        bound = 16 * eps * float(jnp.max(jnp.abs(h))) * tokens
        np.testing.assert_allclose(g.astype(jnp.float32), h, atol=bound)


# ---------------------------------------------------------------- initialization


def test_default_init_gives_the_base_output(getkey):
    """B = 0: the base output, to the rounding of one float32 product (the adapter's zero
    columns join the base GEMM, whose summation order may differ from `W·x` alone)."""
    weight = jax.random.normal(getkey(), (6, 5))
    w = lora(weight, r=3, lora_alpha=16.0, key=getkey())
    x = jax.random.normal(getkey(), (4, 5))
    with strict():
        got = jax.vmap(use_implicit_args(lambda w, v: w @ v), in_axes=(None, 0))(w, x)
    base = np.asarray(x, np.float64) @ np.asarray(weight, np.float64).T
    bound = 8 * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(weight).T)
    assert np.all(np.abs(np.asarray(got, np.float64) - base) <= bound)
    bound = 1 / math.sqrt(5)
    assert jnp.all(jnp.abs(w.lora_A) <= bound) and jnp.std(w.lora_A) > bound / 3
    assert not jnp.any(w.lora_B)


def test_gaussian_init(getkey):
    w = lora(jnp.zeros((300, 400)), r=4, init="gaussian", key=getkey())
    np.testing.assert_allclose(jnp.std(w.lora_A), 1 / 4, rtol=0.05)
    assert not jnp.any(w.lora_B)


def test_pissa_init_keeps_the_output_and_takes_the_top_singular_directions(getkey):
    weight = jax.random.normal(getkey(), (8, 6))
    w = lora(weight, r=2, lora_alpha=4.0, init="pissa", key=getkey())
    x = jax.random.normal(getkey(), (3, 6))
    close(_dense_lora(w.weight, w.lora_A, w.lora_B, alpha=4.0), weight, tol=1e-4)
    with strict():
        close(use_implicit_args(lambda w, x: x @ w.T)(w, x), x @ weight.T, tol=1e-4)
    s = jnp.linalg.svd(weight, compute_uv=False)
    top = jnp.linalg.svd((4.0 / 2) * w.lora_B @ w.lora_A, compute_uv=False)[:2]
    close(top, s[:2], tol=1e-4)
    residual_s = jnp.linalg.svd(w.weight, compute_uv=False)
    close(residual_s[:4], s[2:6], tol=1e-4)


def test_rslora_scaling(getkey):
    w = lora(jnp.ones((8, 8)), r=4, lora_alpha=8.0, use_rslora=True, key=getkey())
    assert w.scaling == 8.0 / 2.0
    assert lora(jnp.ones((8, 8)), r=4, lora_alpha=8.0, key=getkey()).scaling == 2.0


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"r": 0}, ValueError, r"rank r=0 for a weight of shape \(6, 5\) must be at least 1"),
        ({"r": 6, "init": "pissa"}, ValueError, r"PiSSA takes r=6 .* has only 5; use r <= 5"),
        ({"init": "eva"}, ValueError, r"unknown LoRA init 'eva'"),
        ({"lora_dropout": 1.0}, ValueError, r"lora_dropout must be in \[0, 1\)"),
    ],
)
def test_bad_lora_arguments(getkey, kwargs, error, match):
    # runtime type checking (beartype) may reject a bad Literal first, as a TypeError
    with pytest.raises((error, TypeError), match=match):
        lora(jnp.ones((6, 5)), key=getkey(), **{"r": 2, **kwargs})


def test_bad_lora_arrays():
    with pytest.raises(ValueError, match=r"weight of 2 or more dimensions, got shape \(5,\)"):
        lora(jnp.ones(5), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"expected lora_A \(2, 5\) and lora_B \(6, 2\)"):
        LoraArray(jnp.ones((6, 5)), jnp.ones((2, 4)), jnp.ones((6, 2)), lora_alpha=1.0)
    with pytest.raises(TypeError, match="must share a dtype"):
        LoraArray(
            jnp.ones((6, 5)), jnp.ones((2, 5)), jnp.ones((6, 2), jnp.bfloat16), lora_alpha=1.0
        )
    with pytest.raises(TypeError, match="lora_A must be a floating-point array"):
        LoraArray(jnp.ones((6, 5)), jnp.ones((2, 5), int), jnp.ones((6, 2), int), lora_alpha=1.0)
    with pytest.raises(TypeError, match="PiSSA"):
        lora(jnp.ones((6, 5), jnp.int32), r=2, init="pissa", key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"lora_magnitude_vector must have shape \(6,\)"):
        DoraArray(jnp.ones((6, 5)), jnp.ones((2, 5)), jnp.ones((6, 2)), jnp.ones(5), lora_alpha=1.0)


# ---------------------------------------------------------------- dropout


def test_dropout_masks_the_adapter_input_only(getkey):
    w = _random_lora(getkey(), lora_dropout=0.5)
    x = jax.random.normal(getkey(), (4, 5))
    key = getkey()
    trained = with_dropout(w, key)

    def fn(w, x):
        return x @ w.T

    with strict():
        got = use_implicit_args(fn)(trained, x)
        no_key = use_implicit_args(fn)(without_dropout(trained), x)
    keep = jax.random.bernoulli(trained.dropout_key, 0.5, x.shape)
    x_d = jnp.where(keep, x / 0.5, 0.0)
    want = x @ w.weight.T + (ALPHA / 2) * (x_d @ w.lora_A.T) @ w.lora_B.T
    close(got, want)
    close(no_key, fn(_dense_lora(w.weight, w.lora_A, w.lora_B), x))
    assert not np.allclose(got, no_key)


def test_with_dropout_gives_each_adapter_its_own_key(getkey):
    model = [_random_lora(getkey(), lora_dropout=0.1) for _ in range(3)]
    keys = [m.dropout_key for m in with_dropout(model, getkey())]
    data = {tuple(np.asarray(jax.random.key_data(k))) for k in keys}
    assert len(data) == 3


# ---------------------------------------------------------------- models


def _stacked_lora_layers(key, n=4, d=6, r=2, use_dora=False):
    def make(k):
        kw, kl = jax.random.split(k)
        w = lora(jax.random.normal(kw, (d, d)) / 2, r=r, lora_alpha=4.0, init="random", key=kl)
        return dora(w) if use_dora else w

    return eqx.filter_vmap(make)(jax.random.split(key, n))


# DoRA: the fast tier scans its stack in test_peft_model's test_stacked_layers_under_scan
# and checks its gradients in test_forward_and_gradients_match_dense_formula
@pytest.mark.parametrize("use_dora", [False, pytest.param(True, marks=pytest.mark.variant_sweep)])
def test_scan_over_stacked_lora_layers(getkey, use_dora):
    layers = _stacked_lora_layers(getkey(), use_dora=use_dora)
    names = ["lora_A", "lora_B"]
    if use_dora:  # magnitudes away from the row norms, so DoRA differs from LoRA
        m = layers.lora_magnitude_vector
        m = m * jax.random.uniform(getkey(), m.shape, minval=0.5, maxval=1.5)
        layers = eqx.tree_at(lambda w: w.lora_magnitude_vector, layers, m)
        names.append("lora_magnitude_vector")
    leaves = tuple(getattr(layers, n) for n in names)
    x = jax.random.normal(getkey(), (3, 6))

    def forward(layers, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w.T), None), x, layers)[0]

    def dense(leaves):  # every layer at once: the formulas broadcast over the stack axis
        return (_dense_dora if use_dora else _dense_lora)(layers.weight, *leaves)

    def implicit_loss(leaves, x):
        model = eqx.tree_at(lambda w: tuple(getattr(w, n) for n in names), layers, leaves)
        return jnp.sum(use_implicit_args(forward)(model, x) ** 2)

    def dense_loss(leaves, x):
        return jnp.sum(forward(dense(leaves), x) ** 2)

    with strict():
        got = jax.jit(use_implicit_args(forward))(layers, x)
        grads = jax.jit(jax.grad(implicit_loss, argnums=(0, 1)))(leaves, x)
    close(got, forward(dense(leaves), x))
    close(grads, jax.grad(dense_loss, argnums=(0, 1))(leaves, x), tol=1e-4)


def test_vmap_over_stacked_loras_inside_use_implicit_args(getkey):
    """A vmapped stack reaches the handler with a batch axis on the weight."""
    layers = _stacked_lora_layers(getkey())
    x = jax.random.normal(getkey(), (4, 6))
    with strict():
        got = use_implicit_args(lambda w, x: jax.vmap(lambda w, v: w @ v)(w, x))(layers, x)
    dense = _dense_lora(layers.weight, layers.lora_A, layers.lora_B)
    close(got, jnp.einsum("loi,li->lo", dense, x))


@pytest.mark.parametrize(  # the fast tier runs Conv2d, the whole suite Conv1d too
    "conv", [pytest.param("Conv1d", marks=pytest.mark.variant_sweep), "Conv2d"]
)
def test_conv_lora(getkey, conv):
    """A conv layer with a bias, values and gradients (factors and input) against the
    formula; r=2 differs from in=3 and out=4."""
    dims = 1 if conv == "Conv1d" else 2
    layer = getattr(eqx.nn, conv)(3, 4, 3, stride=2, padding=1, key=getkey())
    assert layer.bias is not None
    w = lora(layer.weight, r=2, lora_alpha=ALPHA, init="random", key=getkey())
    assert w.lora_A.shape == (2, 3, *(3,) * dims) and w.lora_B.shape == (4, 2, *(1,) * dims)
    x = jax.random.normal(getkey(), (3, *(9,) * dims))

    def implicit_loss(a, b, x):
        adapted = eqx.tree_at(
            lambda m: m.weight, layer, LoraArray(w.weight, a, b, lora_alpha=ALPHA)
        )
        return jnp.sum(use_implicit_args(adapted)(x) ** 2)

    def dense_loss(a, b, x):
        return jnp.sum(
            eqx.tree_at(lambda m: m.weight, layer, _dense_conv_lora(w.weight, a, b))(x) ** 2
        )

    with strict():
        got = eqx.filter_jit(use_implicit_args(eqx.tree_at(lambda m: m.weight, layer, w)))(x)
        grads = jax.grad(implicit_loss, argnums=(0, 1, 2))(w.lora_A, w.lora_B, x)
    merged = eqx.tree_at(lambda m: m.weight, layer, _dense_conv_lora(w.weight, w.lora_A, w.lora_B))
    close(got, merged(x), tol=1e-4)
    close(grads, jax.grad(dense_loss, argnums=(0, 1, 2))(w.lora_A, w.lora_B, x), tol=1e-3)


# ---------------------------------------------------------------- bfloat16


def _bf16_close(got, want):
    """`got` (bfloat16) within bfloat16 rounding of `want` (float32), leaf by leaf."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == jnp.bfloat16
        w = np.asarray(w, np.float32)
        # a K-term sum of size-m terms is ~sqrt(K)·m (its rms), up to 4x that, rounded ~4
        # times (A·x, s·B·(A·x), W·x, their sum) at u = 2**-8: atol = 16·u·sqrt(K)·m
        atol = 16 * 2.0**-8 * np.sqrt(np.mean(w**2))
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=0, atol=atol)


@pytest.mark.parametrize(
    "adapter",
    [
        "lora",
        "rslora",
        # the fast tier checks DoRA on a bfloat16 base against PEFT in test_mixed_precision
        # (test_bf16_base_fp32_lora_matches_peft), the whole suite here too
        pytest.param("dora", marks=pytest.mark.variant_sweep),
    ],
)
def test_bf16_linear_matches_dense_formula(getkey, adapter):
    """A bfloat16 `eqx.nn.Linear` (with a bias) carrying bfloat16 factors, against the
    formula in float32 on the same values: outputs and vector-Jacobian products (factors,
    magnitude, input), each within bfloat16 rounding."""
    out, in_, r, alpha, tokens = 48, 64, 4, 6.0, 8
    use_rslora = adapter == "rslora"

    def f32(tree):
        return jax.tree.map(lambda t: t.astype(jnp.float32), tree)

    def normal(shape, std):  # unit-size outputs: W·x, A·x and B·(A·x) are all ~N(0, 1)
        return (std * jax.random.normal(getkey(), shape)).astype(jnp.bfloat16)

    weight, bias = normal((out, in_), in_**-0.5), normal((out,), 1.0)
    leaves = [normal((r, in_), in_**-0.5), normal((out, r), r**-0.5)]
    x, cotangent = normal((tokens, in_), 1.0), normal((tokens, out), 1.0)
    if adapter == "dora":
        v = _dense_lora(f32(weight), *f32(leaves), alpha)
        m = jnp.sqrt(jnp.sum(v * v, -1)) * jax.random.uniform(getkey(), (out,), minval=0.5)
        leaves.append(m.astype(jnp.bfloat16))
    template = eqx.nn.Linear(in_, out, key=getkey(), dtype=jnp.bfloat16)

    def implicit(leaves, x):
        cls = DoraArray if adapter == "dora" else LoraArray
        w = cls(weight, *leaves, lora_alpha=alpha, use_rslora=use_rslora)
        linear = eqx.tree_at(lambda m: (m.weight, m.bias), template, (w, bias))
        return use_implicit_args(lambda m, x: jax.vmap(m)(x))(linear, x)

    def dense(leaves, x):
        formula = _dense_dora if adapter == "dora" else _dense_lora
        return x @ formula(f32(weight), *leaves, alpha, use_rslora).T + f32(bias)[None, :]

    with strict():
        got, vjp = jax.vjp(implicit, leaves, x)
        grads = vjp(cotangent)
    want, dense_vjp = jax.vjp(dense, f32(leaves), f32(x))
    _bf16_close(got, want)
    _bf16_close(grads, dense_vjp(f32(cotangent)))
    base = f32(x) @ f32(weight).T + f32(bias)[None, :]
    assert np.sqrt(np.mean((want - base) ** 2)) > 0.5  # the adapter is far above rounding


# ---------------------------------------------------------------- merge


def test_merge_and_unmerge(getkey):
    w = _random_lora(getkey(), r=3)
    merged = w.materialize()
    close(merged, _dense_lora(w.weight, w.lora_A, w.lora_B))
    close(unmerge(merged, w).weight, w.weight)
    d = dora(w)
    m = d.lora_magnitude_vector * jax.random.uniform(getkey(), (6,), minval=0.5, maxval=1.5)
    d = eqx.tree_at(lambda d: d.lora_magnitude_vector, d, m)
    merged = d.materialize()
    close(merged, _dense_dora(w.weight, w.lora_A, w.lora_B, m), tol=1e-5)
    close(unmerge(merged, d).weight, w.weight, tol=1e-4)


# ---------------------------------------------------------------- against HF PEFT


class _TorchModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(5, 6)
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)


def _torch(x):
    return np.asarray(x.detach().numpy())


@pytest.mark.parametrize("use_dora", [False, True])
@pytest.mark.parametrize("use_rslora", [False, True])
def test_linear_with_bias_matches_peft(use_dora, use_rslora):
    """An `eqx.nn.Linear` with a bias and a rank-3 adapter (r differs from in=5 and out=6):
    outputs and gradients (factors, magnitude, bias, input) equal PEFT's on the same weights."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LoraConfig(
        r=3, lora_alpha=5, target_modules=["proj"], init_lora_weights=False,
        use_dora=use_dora, use_rslora=use_rslora,
    )  # fmt: skip
    layer = get_peft_model(_TorchModel(), cfg).base_model.model.proj
    layer.base_layer.bias.requires_grad_(True)
    trained = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
    if use_dora:
        trained.append(layer.lora_magnitude_vector["default"].weight)
        with torch.no_grad():  # magnitudes away from the row norms, so DoRA differs from LoRA
            trained[-1].mul_(torch.rand_like(trained[-1]) + 0.5)
    trained.append(layer.base_layer.bias)
    x_np = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)
    x_t = torch.tensor(x_np, requires_grad=True)
    out_t = layer(x_t)
    out_t.sin().sum().backward()

    weight = jnp.asarray(_torch(layer.base_layer.weight))
    template = eqx.nn.Linear(5, 6, key=jax.random.key(0))

    def run(leaves, x):
        *factors, bias = leaves
        cls = DoraArray if use_dora else LoraArray
        w = cls(weight, *factors, lora_alpha=5, use_rslora=use_rslora)
        linear = eqx.tree_at(lambda m: (m.weight, m.bias), template, (w, bias))
        return use_implicit_args(lambda m, x: jax.vmap(m)(x))(linear, x)

    leaves = [jnp.asarray(_torch(t)) for t in trained]
    with strict():
        out = run(leaves, x_np)
        grads = jax.grad(lambda *a: jnp.sum(jnp.sin(run(*a))), argnums=(0, 1))(leaves, x_np)
    close(out, _torch(out_t), tol=1e-5)
    close(grads, ([_torch(t.grad) for t in trained], _torch(x_t.grad)), tol=1e-4)


def test_conv2d_with_bias_matches_peft():
    """Outputs and gradients (factors, input) of a conv with a bias equal PEFT's."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    layer = get_peft_model(
        _TorchModel(),
        LoraConfig(r=2, lora_alpha=3, target_modules=["conv"], init_lora_weights=False),
    ).base_model.model.conv
    trained = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
    x_np = np.random.default_rng(1).normal(size=(3, 7, 7)).astype(np.float32)
    x_t = torch.tensor(x_np[None], requires_grad=True)
    out_t = layer(x_t)[0]
    out_t.sin().sum().backward()

    template = eqx.tree_at(
        lambda m: (m.weight, m.bias),
        eqx.nn.Conv2d(3, 4, 3, padding=1, key=jax.random.key(0)),
        (
            jnp.asarray(_torch(layer.base_layer.weight)),
            jnp.asarray(_torch(layer.base_layer.bias)).reshape(4, 1, 1),  # eqx's bias shape
        ),
    )

    def run(a, b, x):
        w = LoraArray(template.weight, a, b, lora_alpha=3)
        return use_implicit_args(eqx.tree_at(lambda m: m.weight, template, w))(x)

    a, b = (jnp.asarray(_torch(t)) for t in trained)
    with strict():
        out = run(a, b, x_np)
        grads = jax.grad(lambda *a: jnp.sum(jnp.sin(run(*a))), argnums=(0, 1, 2))(a, b, x_np)
    close(out, _torch(out_t), tol=1e-5)
    close(grads, (*(_torch(t.grad) for t in trained), _torch(x_t.grad)[0]), tol=1e-4)
