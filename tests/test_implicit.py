"""The implicit-array mechanism: dispatch, materialization policy, errors, qax scenarios."""

import math
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import close_in_scale, example_count
from hypothesis import given, settings, strategies as st
from implicit_types import LoraMatrix, Scaled, dense_like, random_scaled
from jax.test_util import check_grads

from peftx.adapters import Zeros
from peftx.implicit import (
    HandlerOutputError,
    HandlerRegistrationError,
    ImplicitArray,
    MaterializationError,
    MaterializationWarning,
    default_handler,
    materialization_policy,
    materialize_all,
    primitive_handler,
    strict,
    use_implicit_args,
)


def _lora(key, m=5, n=4, k=2):
    kw, ka, kb = jax.random.split(key, 3)
    return LoraMatrix(
        jax.random.normal(kw, (m, n)), jax.random.normal(ka, (m, k)), jax.random.normal(kb, (n, k))
    )


# ---------------------------------------------------------------- qax README scenarios


def test_user_lora_matrix_dot_general(getkey):
    w = _lora(getkey())
    x = jax.random.normal(getkey(), (3, 5))
    f = jax.jit(use_implicit_args(lambda w, x: x @ w))
    with strict():
        got = f(w, x)
    np.testing.assert_allclose(got, x @ w.materialize(), rtol=1e-5)


def test_user_lora_matrix_gradients(getkey):
    w = _lora(getkey())
    x = jax.random.normal(getkey(), (3, 5))

    def loss(a, b, f):
        return jnp.sum(jnp.tanh(f(LoraMatrix(w.w, a, b), x)))

    with strict():
        ga, gb = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(
            w.a, w.b, use_implicit_args(lambda w, x: x @ w)
        )
    wa, wb = jax.grad(loss, argnums=(0, 1))(w.a, w.b, lambda w, x: x @ w.materialize())
    # each gradient sums terms several times its size (x, w, and tanh' of 3 x 4 outputs)
    close_in_scale((ga, gb), (wa, wb), ulps=256)


def test_nested_lora_over_zeros_never_materializes():
    """qax's nested example: the LoRA handler's products with `Zeros` factors go to the
    `Zeros` handlers, so even the nested arrays are never built."""
    w = jnp.ones((3, 5))
    x = jnp.arange(3, dtype=jnp.float32)
    lora = LoraMatrix(w=w, a=Zeros((3, 6)), b=Zeros((5, 6)))
    with strict():
        got = jax.jit(use_implicit_args(lambda w, x: jnp.sum(x @ w)))(lora, x)
    assert got == jnp.sum(x @ w) == 15.0


def test_nested_materialize_uses_inner_handlers():
    """Materializing a LoRA whose factors are `Zeros` builds only `w`."""
    lora = LoraMatrix(w=jnp.ones((3, 5)), a=Zeros((3, 2)), b=Zeros((5, 2)))
    out = materialize_all({"w": lora, "other": 1.0})
    np.testing.assert_array_equal(out["w"], jnp.ones((3, 5)))
    assert out["other"] == 1.0


# ---------------------------------------------------------------- dot_general, any layout


@st.composite
def dot_general_case(draw):
    n_batch = draw(st.integers(0, 2))
    n_contract = draw(st.integers(0, 2))
    n_lhs_free = draw(st.integers(0, 2))
    n_rhs_free = draw(st.integers(0, 2))
    size = st.integers(1, 4)
    batch = [draw(size) for _ in range(n_batch)]
    contract = [draw(size) for _ in range(n_contract)]
    lhs_axes = [("b", i) for i in range(n_batch)] + [("c", i) for i in range(n_contract)]
    lhs_axes += [("f", draw(size)) for _ in range(n_lhs_free)]
    rhs_axes = [("b", i) for i in range(n_batch)] + [("c", i) for i in range(n_contract)]
    rhs_axes += [("f", draw(size)) for _ in range(n_rhs_free)]
    lhs_axes = draw(st.permutations(lhs_axes))
    rhs_axes = draw(st.permutations(rhs_axes))

    def dim(kind, i):
        return {"b": batch, "c": contract}[kind][i] if kind != "f" else i

    lhs_shape = tuple(dim(k, i) for k, i in lhs_axes)
    rhs_shape = tuple(dim(k, i) for k, i in rhs_axes)

    def pos(axes, kind):
        return tuple(
            sorted((j for j, (k, _) in enumerate(axes) if k == kind), key=lambda j: axes[j][1])
        )

    dims = ((pos(lhs_axes, "c"), pos(rhs_axes, "c")), (pos(lhs_axes, "b"), pos(rhs_axes, "b")))
    implicit_side = draw(st.sampled_from(["lhs", "rhs", "both"]))
    return lhs_shape, rhs_shape, dims, implicit_side


def _relative_bound(dtype, roundings, additions):
    """The error bound, relative to the sum of the terms' magnitudes, of a result whose
    terms each take `roundings` roundings to `dtype` and `additions` float32 additions
    (XLA sums 16-bit dots in float32): `(1 + γ_r)(1 + γ'_a) - 1`, or none (inf) once
    `roundings·u >= 1`."""
    u, u32 = float(jnp.finfo(dtype).eps) / 2, float(jnp.finfo(jnp.float32).eps) / 2
    if roundings * u >= 1:
        return math.inf
    gamma, gamma32 = roundings * u / (1 - roundings * u), additions * u32 / (1 - additions * u32)
    return (1 + gamma) * (1 + gamma32) - 1


def _magnitude(x):
    """`x` with each leaf replaced by its absolute value in float32."""
    return jax.tree.map(lambda leaf: jnp.abs(leaf).astype(jnp.float32), x)


@settings(max_examples=example_count(8), deadline=None)
@given(
    case=dot_general_case(),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]),
    seed=st.integers(0, 2**16),
)
def test_dot_general_random_dimension_numbers(case, dtype, seed):
    lhs_shape, rhs_shape, dims, side = case
    k1, k2 = jax.random.split(jax.random.key(seed))
    lhs, rhs = random_scaled(k1, lhs_shape, dtype), random_scaled(k2, rhs_shape, dtype)
    lhs = lhs if side in ("lhs", "both") else lhs.materialize()
    rhs = rhs if side in ("rhs", "both") else rhs.materialize()

    def dot(a, b):
        return jax.lax.dot_general(a, b, dims)

    def implicit(a, b):
        # gradients w.r.t. every field of the implicit operands, against the dense product
        loss = lambda a, b: jnp.sum(use_implicit_args(dot)(a, b) ** 2)  # noqa: E731
        return use_implicit_args(dot)(a, b), jax.grad(loss, argnums=(0, 1))(a, b)

    def dense(a, b):
        def dense_loss(a, b):
            return jnp.sum(dot(dense_like(a), dense_like(b)) ** 2)

        dense_grad = jax.grad(dense_loss, argnums=(0, 1))
        magnitudes = _magnitude(a), _magnitude(b)
        return (
            dot(dense_like(a), dense_like(b)),
            dense_grad(a, b),
            dot(*map(dense_like, magnitudes)),
            dense_grad(*magnitudes),
        )

    # one program each side (six separate jits compiled six programs per example)
    with strict():
        got, grads = jax.jit(implicit)(lhs, rhs)
    want, want_grads, magnitude, magnitudes = jax.jit(dense)(lhs, rhs)
    assert got.dtype == want.dtype == dtype
    # Each side: a term of the product takes at most 4 roundings to `dtype` (the scaled
    # factors or the two scalings, the product, the output) and k float32 additions.
    k = math.prod(lhs_shape[i] for i in dims[0][0])
    error = jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))
    assert jnp.all(error <= 2 * _relative_bound(dtype, 4, k) * magnitude)

    # The gradients are polynomials in the leaves: each term takes at most 9 roundings to
    # `dtype` (forward, square, backward products and scalings) and the float32 additions
    # of the reductions on the way (k, the output, an operand); the sum of the terms'
    # magnitudes is the gradient at the leaves' magnitudes. A scale's gradient sums a
    # whole array, which XLA on CPU does in the array's dtype when it has several axes
    # (a bfloat16 sum of 16x16x16 values stalls at 256): a rounding per term.
    additions = k + want.size + math.prod(lhs_shape) + math.prod(rhs_shape)
    leaves = zip(*map(jax.tree.leaves, (grads, want_grads, magnitudes)), strict=True)
    for g, w, m in leaves:
        roundings = 9 + (additions if g.ndim == 0 else 0)
        bound = 2 * _relative_bound(dtype, roundings, additions)
        assert jnp.all(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)) <= bound * m)


def test_dot_general_check_grads(getkey):
    x = jax.random.normal(getkey(), (3, 4))

    def f(value, scale, y):
        return use_implicit_args(lambda w, y: jnp.tanh(y @ w))(Scaled(value, scale), y)

    with strict():
        check_grads(f, (jax.random.normal(getkey(), (4, 2)), jnp.float32(1.3), x), order=1)


# ---------------------------------------------------------------- dispatch rules


class _Base(ImplicitArray):
    value: jax.Array

    def aval(self):
        return jax.core.ShapedArray(self.value.shape, self.value.dtype)

    def materialize(self):
        return self.value


class _Child(_Base):
    pass


@primitive_handler("neg")
def _neg_base(primitive, x: _Base):
    return jnp.full(x.shape, 1.0, x.dtype)


@primitive_handler("neg")
def _neg_child(primitive, x: _Child):
    return jnp.full(x.shape, 2.0, x.dtype)


@primitive_handler(["sin", "cos"])
def _declines(primitive, x: _Child, **params):
    return NotImplemented


@primitive_handler(["sin", "cos"])
def _base_trig(primitive, x: _Base, **params):
    return jnp.full(x.shape, 3.0 if primitive.name == "sin" else 4.0, x.dtype)


def test_most_specific_handler_wins():
    v = jnp.zeros(2)
    with strict():
        assert use_implicit_args(jnp.negative)(_Base(v))[0] == 1.0
        assert use_implicit_args(jnp.negative)(_Child(v))[0] == 2.0


def test_not_implemented_falls_through_and_one_handler_serves_several_primitives():
    v = jnp.zeros(2)
    with strict():
        assert use_implicit_args(jnp.sin)(_Child(v))[0] == 3.0
        assert use_implicit_args(jnp.cos)(_Child(v))[0] == 4.0


def test_primitive_handler_returns_the_function():
    def handler(primitive, x: _Base, **params):
        return NotImplemented

    assert primitive_handler("tan")(handler) is handler


def test_default_handler_runs_the_primitive_on_dense_values(getkey):
    w = _lora(getkey())
    x = jax.random.normal(getkey(), (3, 5))
    out = default_handler(
        jax.lax.dot_general_p,
        x,
        w.w,
        dimension_numbers=(((1,), (0,)), ((), ())),
        precision=None,
        preferred_element_type=jnp.float32,
        out_sharding=None,
    )
    np.testing.assert_allclose(out, x @ w.w, rtol=1e-6)


# ---------------------------------------------------------------- materialization policy


class _Unhandled(_Base):
    """No handler of its own beyond `_Base`'s."""


def test_materialization_warns_once_naming_primitive_and_class():
    x = _Unhandled(jnp.arange(3.0))
    with pytest.warns(
        MaterializationWarning,
        match=r"primitive `exp` needs _Unhandled as a dense float32\[3\] array: there is no "
        "handler",
    ):
        out = use_implicit_args(jnp.exp)(x)
    np.testing.assert_allclose(out, jnp.exp(jnp.arange(3.0)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        use_implicit_args(jnp.exp)(x)  # same (primitive, class): silent
    with pytest.warns(MaterializationWarning, match="primitive `exp`"):
        with materialization_policy("warn"):
            use_implicit_args(jnp.exp)(x)


def test_strict_mode_raises_and_names_the_fix():
    x = _Unhandled(jnp.arange(3.0))
    with (
        strict(),
        pytest.raises(
            MaterializationError, match=r"`log1p`.*_Unhandled.*primitive_handler\('log1p'\)"
        ),
    ):
        use_implicit_args(jnp.log1p)(x)
    with materialization_policy("ignore"), warnings.catch_warnings():
        warnings.simplefilter("error")
        use_implicit_args(jnp.log1p)(x)


def test_unknown_policy_is_rejected():
    # ValueError from the check itself; TypeError first when runtime type checking is on
    with pytest.raises((ValueError, TypeError), match="warn_once"):
        with materialization_policy("sometimes"):
            pass


# ---------------------------------------------------------------- handler errors


class _BadShape(_Base):
    pass


@primitive_handler("dot_general")
def _wrong_shape(primitive, x, w: _BadShape, **params):
    return jnp.zeros((7, 7), jnp.float32)


def test_handler_with_wrong_shape_is_reported():
    w = _BadShape(jnp.ones((4, 2)))
    msg = (
        r"_wrong_shape for primitive `dot_general` returned \[float32\[7, 7\]\].*"
        r"gives \[float32\[3, 2\]\]"
    )
    with pytest.raises(HandlerOutputError, match=msg):
        use_implicit_args(lambda w, x: x @ w)(w, jnp.ones((3, 4)))


class _BadDtype(_Base):
    pass


@primitive_handler("dot_general")
def _wrong_dtype(primitive, x, w: _BadDtype, **params):
    return default_handler(primitive, x, w.value, **params).astype(jnp.float16)


def test_handler_with_wrong_dtype_is_reported():
    w = _BadDtype(jnp.ones((4, 2)))
    with pytest.raises(
        HandlerOutputError, match=r"returned \[float16\[3, 2\]\].*\[float32\[3, 2\]\]"
    ):
        use_implicit_args(lambda w, x: x @ w)(w, jnp.ones((3, 4)))


class _NoAval(ImplicitArray):
    """Shape and dtype only through `materialize()`."""

    row: jax.Array
    n: int = eqx.field(static=True)

    def materialize(self):
        return jnp.tile(self.row, (self.n, 1))


@primitive_handler("reduce_sum")
def _no_aval_sum(primitive, x: _NoAval, *, axes, **params):
    if tuple(axes) != (0,):
        return NotImplemented
    return x.row * x.n


def test_default_aval_traces_materialize():
    x = _NoAval(jnp.arange(3.0), 4)
    assert (x.shape, x.dtype, x.ndim) == ((4, 3), jnp.float32, 2)
    with strict():
        got = jax.jit(use_implicit_args(lambda x: x.sum(axis=0)))(x)
        batched = jax.vmap(use_implicit_args(lambda x: x.sum(axis=0)))(
            _NoAval(jnp.stack([jnp.arange(3.0), jnp.ones(3)]), 4)
        )
    np.testing.assert_allclose(got, jnp.arange(3.0) * 4)
    np.testing.assert_allclose(batched, jnp.stack([jnp.arange(3.0), jnp.ones(3)]) * 4)


def _string_annotated(primitive, x: "NotAClass"):  # noqa: F821  (a name that does not resolve)
    return x


def test_registration_errors():
    with pytest.raises(
        HandlerRegistrationError, match=r"no JAX primitive is named 'dot_genral'.*dot_general"
    ):
        primitive_handler("dot_genral")
    with pytest.raises(HandlerRegistrationError, match="higher-order primitive"):
        primitive_handler("scan")
    with pytest.raises(HandlerRegistrationError, match="primitive as its first positional"):
        primitive_handler("exp")(lambda *, x: x)
    with pytest.raises(HandlerRegistrationError, match="expected a JAX primitive"):
        primitive_handler(3)
    with pytest.raises(HandlerRegistrationError, match=r"argument `x` is annotated 'NotAClass'"):
        primitive_handler("exp")(_string_annotated)


class _Summed(_Base):
    """`reduce_sum` (parameters `axes`, `out_sharding=None`) goes to handlers below."""


@primitive_handler("reduce_sum")
def _sum_naming_axes(primitive, x: _Summed, *, axes):
    # only `axes` arrives; `out_sharding=None` is dropped
    return jnp.sum(x.value, axis=axes) + 1


class _SummedNoParams(_Base):
    pass


@primitive_handler("reduce_sum")
def _sum_without_params(primitive, x: _SummedNoParams):
    return jnp.sum(x.value)


def test_handler_gets_the_parameters_it_names():
    with strict():
        got = use_implicit_args(lambda x: jnp.sum(x, axis=1))(_Summed(jnp.ones((2, 3))))
    np.testing.assert_allclose(got, [4.0, 4.0])


def test_undeclared_parameter_that_matters_is_an_error():
    x = _SummedNoParams(jnp.ones((2, 3)))
    with pytest.raises(
        HandlerRegistrationError,
        match=r"handler .*_sum_without_params for primitive `reduce_sum` does not take its "
        r"parameter `axes`, here \(1,\)\. Add `\*\*params`",
    ):
        use_implicit_args(lambda x: jnp.sum(x, axis=1))(x)


# ---------------------------------------------------------------- composition


def test_wrapping_orders_agree(getkey):
    w = _lora(getkey())
    x = jax.random.normal(getkey(), (3, 5))

    def f(w, x):
        return jnp.tanh(x @ w)

    with strict():
        outer = jax.jit(use_implicit_args(f))(w, x)
        inner = use_implicit_args(jax.jit(f))(w, x)
        eqx_inner = use_implicit_args(eqx.filter_jit(f))(w, x)
    want = f(w.materialize(), x)
    for got in (outer, inner, eqx_inner):
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_implicit_array_returned_from_jit(getkey):
    s = random_scaled(getkey(), (2, 3))
    out = jax.jit(use_implicit_args(lambda s: jax.jit(lambda s: s)(s)))(s)
    assert isinstance(out, Scaled)
    np.testing.assert_allclose(out.materialize(), s.materialize())


def test_bound_method_sees_implicit_fields(getkey):
    linear = eqx.nn.Linear(3, 2, key=getkey())
    lora = eqx.tree_at(lambda m: m.bias, linear, Zeros((2,)))
    x = jnp.ones(3)
    with strict():
        got = use_implicit_args(lora.__call__)(x)
    np.testing.assert_allclose(got, linear.weight @ x, rtol=1e-6)


def test_declining_handlers_are_named_in_the_message():
    x = _Child(jnp.zeros(2))

    @primitive_handler("exp2")
    def _never(primitive, x: _Child, **params):
        return NotImplemented

    with (
        strict(),
        pytest.raises(MaterializationError, match=r"every handler declined \(.*_never\)"),
    ):
        use_implicit_args(jnp.exp2)(x)


def test_implicit_array_in_a_closure_gets_a_clear_error(getkey):
    w = _lora(getkey())
    with pytest.raises(TypeError, match="outside `use_implicit_args`.*as arguments"):
        use_implicit_args(lambda x: x @ w)(jnp.ones((2, 5)))


@settings(max_examples=example_count(15), deadline=None)
@given(case=dot_general_case(), data=st.data(), seed=st.integers(0, 2**16))
def test_products_with_a_transposed_implicit_array(case, data, seed):
    """`transpose` of an implicit array without a handler of its own stays lazy
    (`Transposed`), and products with it go to the array's own handler."""
    lhs_shape, rhs_shape, dims, _ = case
    perm = tuple(data.draw(st.permutations(range(len(lhs_shape)))))
    base_shape = [0] * len(lhs_shape)
    for i, p in enumerate(perm):
        base_shape[p] = lhs_shape[i]
    k1, k2 = jax.random.split(jax.random.key(seed))
    base, rhs = random_scaled(k1, tuple(base_shape)), jax.random.normal(k2, rhs_shape)

    def fn(a, b):
        return jax.lax.dot_general(jnp.transpose(a, perm), b, dims)

    with strict():
        got = jax.jit(use_implicit_args(fn))(base, rhs)
        flipped = use_implicit_args(lambda a: jnp.transpose(jnp.transpose(a, perm), perm))(base)
    np.testing.assert_allclose(got, fn(base.materialize(), rhs), rtol=1e-4, atol=1e-4)
    twice = jnp.transpose(jnp.transpose(base.materialize(), perm), perm)
    np.testing.assert_allclose(dense_like(flipped), twice, rtol=1e-6)
