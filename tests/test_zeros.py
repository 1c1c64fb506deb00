"""Symbolic zeros: every handler against the same op on dense zeros, in strict mode."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import example_count
from hypothesis import given, settings, strategies as st
from jax import lax

from peftx.adapters import Zeros
from peftx.implicit import strict, use_implicit_args

X = jnp.arange(12.0).reshape(3, 4) / 7.0
V = jnp.arange(4.0) - 1.5

# (name, fn(z, x) where z is the zeros operand and x a dense (3, 4) operand, shape of z)
CASES = [
    ("add", lambda z, x: z + x, (3, 4)),
    ("add_rhs", lambda z, x: x + z, (3, 4)),
    ("add_broadcast", lambda z, x: x + z, (1, 4)),
    ("sub", lambda z, x: z - x, (3, 4)),
    ("sub_rhs", lambda z, x: x - z, (3, 4)),
    ("mul", lambda z, x: z * x + x, (3, 4)),
    ("neg", lambda z, x: -z + x, (3, 4)),
    ("dot_general_lhs", lambda z, x: lax.dot_general(z, x, (((1,), (1,)), ((), ()))) + 1.0, (2, 4)),
    ("dot_general_rhs", lambda z, x: x @ z + 1.0, (4, 5)),
    ("broadcast_in_dim", lambda z, x: lax.broadcast_in_dim(z, (3, 4), (1,)) + x, (4,)),
    ("reshape", lambda z, x: z.reshape(3, 4) + x, (12,)),
    ("transpose", lambda z, x: z.T + x, (4, 3)),
    ("convert_element_type", lambda z, x: z.astype(jnp.float32) + x, (3, 4)),
    ("reduce_sum", lambda z, x: z.sum(axis=0) + x, (5, 3, 4)),
    ("select_n_one_zero", lambda z, x: lax.select_n(x > 0.5, z, x), (3, 4)),
    ("select_n_all_zero", lambda z, x: lax.select_n(x > 0.5, z, z) + x, (3, 4)),
    ("squeeze_slice", lambda z, x: z[0, 1:] + x, (2, 4, 4)),
    ("integer_pow", lambda z, x: z**2 + x, (3, 4)),
    ("concatenate", lambda z, x: jnp.concatenate([z, z], axis=1) + x, (3, 2)),
]
IDS = [c[0] for c in CASES]


def _both(fn, shape, dtype=jnp.float32):
    z = Zeros(shape, dtype)
    return use_implicit_args(fn), z, jnp.zeros(shape, dtype)


@pytest.mark.parametrize("name,fn,shape", CASES, ids=IDS)
def test_zeros_matches_dense_under_jit(name, fn, shape):
    implicit, z, dense = _both(fn, shape)
    with strict():
        got = jax.jit(implicit)(z, X)
    np.testing.assert_allclose(got, fn(dense, X), rtol=1e-6)


@pytest.mark.parametrize("name,fn,shape", CASES, ids=IDS)
def test_zeros_gradients_match_dense(name, fn, shape):
    implicit, z, dense = _both(fn, shape)

    def loss(f, zz):
        return lambda x: jnp.sum(jnp.sin(f(zz, x)))

    with strict():
        got = jax.jit(jax.grad(loss(implicit, z)))(X)
    np.testing.assert_allclose(got, jax.grad(loss(fn, dense))(X), rtol=1e-6)


@pytest.mark.parametrize("name,fn,shape", CASES, ids=IDS)
def test_zeros_under_vmap(name, fn, shape):
    implicit, z, dense = _both(fn, shape)
    xs = jnp.stack([X, 2 * X, -X])
    with strict():
        got = jax.vmap(implicit, in_axes=(None, 0))(z, xs)
        got_inside = use_implicit_args(jax.vmap(fn, in_axes=(None, 0)))(z, xs)
    want = jax.vmap(fn, in_axes=(None, 0))(dense, xs)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_inside, want, rtol=1e-6)


def test_zeros_stay_symbolic():
    """qax's README: `(1 + x) * y` with both zeros is still a symbolic zero."""

    @jax.jit
    @use_implicit_args
    def g(x, y):
        return (1 + x) * y

    z = Zeros((2, 3))
    with strict():
        out = g(z, z)
    assert isinstance(out, Zeros)
    assert out.shape == (2, 3) and out.dtype == jnp.float32


def test_zero_biases_in_an_equinox_model(getkey):
    """A model whose biases are symbolic zeros runs without building them."""
    mlp = eqx.nn.MLP(4, 3, 8, 2, key=getkey())
    zero_bias = eqx.tree_at(
        lambda m: [layer.bias for layer in m.layers],
        mlp,
        replace_fn=lambda b: Zeros(b.shape, b.dtype),
    )
    dense_bias = eqx.tree_at(
        lambda m: [layer.bias for layer in m.layers], mlp, replace_fn=jnp.zeros_like
    )
    x = jax.random.normal(getkey(), (5, 4))
    with strict():
        got = jax.jit(jax.vmap(use_implicit_args(zero_bias.__call__)))(x)
    want = jax.vmap(dense_bias)(x)
    # jitted against eager: float32 rounding of differently fused sums, relative to the
    # output's scale (an entry near zero has no relative precision of its own)
    atol = 8 * np.finfo(np.float32).eps * np.max(np.abs(want))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=atol)


def test_integer_pow_zero_exponent_falls_back():
    """0 ** 0 == 1: the handler declines and the value is materialized, correctly."""
    with pytest.warns(UserWarning, match="integer_pow"):
        out = use_implicit_args(lambda z: z**0)(Zeros((2,)))
    np.testing.assert_array_equal(out, jnp.ones(2))


@settings(max_examples=example_count(12), deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple),
    dtype=st.sampled_from([jnp.float32, jnp.float16, jnp.bfloat16, jnp.int32]),
    op=st.sampled_from(["add", "radd", "sub", "rsub", "mul", "where", "sum", "transpose"]),
    seed=st.integers(0, 2**16),
)
def test_zeros_any_shape_and_dtype(shape, dtype, op, seed):
    x = (10 * jax.random.normal(jax.random.key(seed), shape)).astype(dtype)
    fns = {
        "add": lambda z, x: z + x,
        "radd": lambda z, x: x + z,
        "sub": lambda z, x: z - x,
        "rsub": lambda z, x: x - z,
        "mul": lambda z, x: z * x + x,
        "where": lambda z, x: jnp.where(x > 0, z, x),
        "sum": lambda z, x: (
            z.sum(axis=tuple(range(0, len(shape), 2))) + x.sum(axis=tuple(range(0, len(shape), 2)))
        ),
        "transpose": lambda z, x: z.T + x.T,
    }
    fn = fns[op]
    with strict():
        got = jax.jit(use_implicit_args(fn))(Zeros(shape, dtype), x)
    want = fn(jnp.zeros(shape, dtype), x)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
