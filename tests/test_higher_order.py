"""Higher-order primitives with implicit arguments, against the materialized computation.

Every implicit run is in strict mode: a silent materialization fails the test.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import close
from implicit_types import Scaled, dense_like, random_scaled

from peftx.implicit import strict, use_implicit_args


def _check(fn, w, x):
    """`fn(w, x)` with `w` implicit equals it with `w` dense: value, gradient w.r.t. the
    fields of `w` and `x` with jit inside and outside grad and use_implicit_args; and under
    vmap over `x`."""

    def loss(w, x):
        return jnp.sum(jnp.sin(fn(w, x)))

    def dense_loss(w, x):
        return loss(dense_like(w), x)

    with strict():
        got = jax.jit(use_implicit_args(fn))(w, x)
        grads = [
            jax.jit(jax.grad(use_implicit_args(loss), argnums=(0, 1)))(w, x),
            jax.grad(jax.jit(use_implicit_args(loss)), argnums=(0, 1))(w, x),
            jax.grad(use_implicit_args(jax.jit(loss)), argnums=(0, 1))(w, x),
        ]
        batched = jax.vmap(use_implicit_args(fn), in_axes=(None, 0))(w, jnp.stack([x, 2 * x]))
    close(got, fn(dense_like(w), x))
    want = jax.grad(dense_loss, argnums=(0, 1))(w, x)
    for g in grads:
        close(g, want)
    close(batched, jax.vmap(fn, in_axes=(None, 0))(dense_like(w), jnp.stack([x, 2 * x])))


@pytest.fixture
def wx(getkey):
    return random_scaled(getkey(), (4, 3)), jax.random.normal(getkey(), (3,))


def test_inner_jit(wx):
    _check(lambda w, x: jax.jit(lambda w, x: jnp.tanh(w @ x))(w, x), *wx)


def test_custom_jvp(wx):
    @jax.custom_jvp
    def matvec(w, x):
        return w @ x

    @matvec.defjvp
    def _(primals, tangents):
        (w, x), (dw, dx) = primals, tangents
        return matvec(w, x), dw @ x + w @ dx

    _check(lambda w, x: jnp.tanh(matvec(w, x)), *wx)


def test_custom_jvp_rule_sees_the_tangent_of_the_represented_array(getkey):
    """The product `value * scale` is not linear in (value, scale) jointly; a rule fed
    the fields' tangents as if they were an array of the same class would be wrong."""

    @jax.custom_jvp
    def total(w):
        return jnp.sum(w)

    total.defjvp(lambda p, t: (total(p[0]), jnp.sum(t[0])))
    w = random_scaled(getkey(), (3, 2))
    with strict():
        g = jax.grad(use_implicit_args(total))(w)
    want = jax.grad(lambda w: jnp.sum(w.materialize()))(w)
    close(g, want)


def _matvec_with_custom_vjp(grad_scale):
    """`w @ x` whose backward rule returns `grad_scale` times the true cotangents."""

    @jax.custom_vjp
    def matvec(w, x):
        return w @ x

    def fwd(w, x):
        return w @ x, (w, x)

    def bwd(res, g):
        w, x = res
        return grad_scale * jnp.outer(g, x), grad_scale * (g @ w)

    matvec.defvjp(fwd, bwd)
    return matvec


def test_custom_vjp(wx):
    matvec = _matvec_with_custom_vjp(1.0)
    _check(lambda w, x: jnp.tanh(matvec(w, x)), *wx)


def test_custom_vjp_rule_is_used_not_bypassed(wx):
    """A backward rule that halves the true gradient must be the one that runs."""
    matvec = _matvec_with_custom_vjp(0.5)
    w, x = wx
    with strict():
        g = jax.grad(
            use_implicit_args(lambda w, x: jnp.sum(jnp.sin(matvec(w, x)))), argnums=(0, 1)
        )(w, x)
    want = jax.grad(lambda w, x: 0.5 * jnp.sum(jnp.sin(dense_like(w) @ x)), argnums=(0, 1))(w, x)
    close(g, want)


def test_checkpoint(wx):
    _check(lambda w, x: jax.checkpoint(lambda w, x: jnp.tanh(w @ x))(w, x), *wx)


def test_checkpoint_with_policy(wx):
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    _check(lambda w, x: jax.checkpoint(lambda w, x: jnp.tanh(w @ x), policy=policy)(w, x), *wx)


def test_cond(wx):
    def fn(w, x):
        return jax.lax.cond(jnp.sum(x) > 0, lambda: w @ x, lambda: -(w @ x) * 2)

    _check(fn, *wx)
    w, x = wx
    _check(fn, w, -x)


def test_while_with_implicit_constant(wx):
    def fn(w, x):
        def body(carry):
            i, h = carry
            return i + 1, jnp.tanh(w @ h) @ w

        return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]

    w, x = wx
    xs = jnp.stack([x, 2 * x])
    with strict():
        got = jax.jit(use_implicit_args(fn))(w, x)
        batched = jax.vmap(use_implicit_args(fn), in_axes=(None, 0))(w, xs)
        # reverse mode through while_loop is unsupported by JAX itself; forward mode works
        tangent = jax.jvp(lambda x: use_implicit_args(fn)(w, x), (x,), (jnp.ones(3),))[1]
    dense = w.materialize()
    close(got, fn(dense, x))
    close(batched, jax.vmap(fn, in_axes=(None, 0))(dense, xs))
    close(tangent, jax.jvp(lambda x: fn(dense, x), (x,), (jnp.ones(3),))[1])


def test_while_with_implicit_carry(getkey):
    w = random_scaled(getkey(), (3, 3))
    x = jax.random.normal(getkey(), (3,))

    def fn(w, x):
        def body(carry):
            i, w, h = carry
            return i + 1, w, jnp.tanh(w @ h)

        return jax.lax.while_loop(lambda c: c[0] < 4, body, (0, w, x))[2]

    with strict():
        got = jax.jit(use_implicit_args(fn))(w, x)
    close(got, fn(w.materialize(), x))


def test_scan_with_implicit_constant(wx):
    def fn(w, x):
        def step(h, _):
            return jnp.tanh(w @ h)[:3] + h, None

        return jax.lax.scan(step, x, length=3)[0]

    _check(fn, *wx)


def test_scan_over_stacked_implicit_arrays(getkey):
    ws = Scaled(jax.random.normal(getkey(), (5, 3, 3)), jax.random.uniform(getkey(), (5,)) + 0.5)
    x = jax.random.normal(getkey(), (3,))

    def fn(ws, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(w @ h), None), x, ws)[0]

    with strict():
        got = jax.jit(use_implicit_args(fn))(ws, x)
        grads = jax.grad(lambda ws, x: jnp.sum(use_implicit_args(fn)(ws, x)), argnums=(0, 1))(ws, x)

    def ref(value, scale, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(w @ h), None), x, value * scale[:, None, None])[
            0
        ]

    close(got, ref(ws.value, ws.scale, x))
    want = jax.grad(lambda v, s, x: jnp.sum(ref(v, s, x)), argnums=(0, 1, 2))(ws.value, ws.scale, x)
    close((grads[0].value, grads[0].scale, grads[1]), want)


def test_vmap_over_implicit_arrays(getkey):
    ws = Scaled(jax.random.normal(getkey(), (4, 3, 2)), jax.random.uniform(getkey(), (4,)))
    x = jax.random.normal(getkey(), (2,))
    with strict():
        got = jax.vmap(use_implicit_args(lambda w, x: w @ x), in_axes=(0, None))(ws, x)
        got_filter = eqx.filter_vmap(use_implicit_args(lambda w, x: w @ x), in_axes=(0, None))(
            ws, x
        )
    want = jnp.einsum("bij,j->bi", ws.value * ws.scale[:, None, None], x)
    close(got, want)
    close(got_filter, want)


def test_grad_inside_use_implicit_args(wx):
    w, x = wx
    with strict():
        got = use_implicit_args(jax.grad(lambda x, w: jnp.sum(jnp.tanh(w @ x))))(x, w)
    close(got, jax.grad(lambda x: jnp.sum(jnp.tanh(w.materialize() @ x)))(x))


class _Layer(eqx.Module):
    weight: jax.Array | Scaled

    def __call__(self, x):
        return jax.nn.gelu(self.weight @ x)


def test_stacked_mlp_scanned_in_strict_mode(getkey):
    """Four layers built with `eqx.filter_vmap`, run with `jax.lax.scan`, implicit weights."""
    keys = jax.random.split(getkey(), 4)
    dense_layers = eqx.filter_vmap(lambda k: _Layer(jax.random.normal(k, (8, 8)) / 3))(keys)
    scales = jax.random.uniform(getkey(), (4,)) + 0.5
    layers = eqx.tree_at(lambda m: m.weight, dense_layers, replace_fn=lambda w: Scaled(w, scales))
    x = jax.random.normal(getkey(), (8,))

    def forward(layers, x):
        params, static = eqx.partition(layers, eqx.is_array)

        def step(h, p):
            return eqx.combine(p, static)(h), None

        return jax.lax.scan(step, x, params)[0]

    def loss(layers, x):
        return jnp.sum(forward(layers, x) ** 2)

    with strict():
        out = eqx.filter_jit(use_implicit_args(forward))(layers, x)
        grads = eqx.filter_jit(eqx.filter_grad(use_implicit_args(loss)))(layers, x)
    merged = eqx.tree_at(
        lambda m: m.weight, dense_layers, dense_layers.weight * scales[:, None, None]
    )
    close(out, forward(merged, x))

    def ref(value, scale):
        layer_stack = eqx.tree_at(lambda m: m.weight, dense_layers, value * scale[:, None, None])
        return loss(layer_stack, x)

    gv, gs = jax.grad(ref, argnums=(0, 1))(dense_layers.weight, scales)
    close((grads.weight.value, grads.weight.scale), (gv, gs), tol=1e-4)
