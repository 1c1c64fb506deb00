"""Forward-mode and higher-order derivatives through adapted products, against dense
formulas written here (`jvp`, `jacfwd`, `linearize`, `hessian`, `check_grads` to order
2 in both modes). The LoRA product's reverse mode is a hand-written transpose (see
`_low_rank`); these tests check that it is also the exact transpose of its forward mode.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import close, close_in_scale
from jax.test_util import check_grads

from peftx.adapters import AdapterSet, DoraArray, LoraArray, adapter_set
from peftx.implicit import strict, use_implicit_args

OUT, IN, R, ALPHA = 5, 4, 3, 6.0


def _factors(key, stack=()):
    kw, ka, kb, km, kx = jax.random.split(key, 5)
    w = jax.random.normal(kw, (*stack, OUT, IN))
    a = jax.random.normal(ka, (*stack, R, IN))
    b = jax.random.normal(kb, (*stack, OUT, R))
    m = jax.random.uniform(km, (*stack, OUT), minval=0.5, maxval=1.5)
    x = jax.random.normal(kx, (2, 3, IN))
    return w, a, b, m, x


def _dense(w, a, b):
    return w + (ALPHA / R) * b @ a


def _dora_dense(w, a, b, m):
    v = _dense(w, a, b)
    # the norm is a constant for gradients (PEFT, DoRA paper §4.3)
    norm = jax.lax.stop_gradient(jnp.sqrt(jnp.sum(v * v, axis=-1, keepdims=True)))
    return m[..., None] * v / norm


def _lora_fn(w):
    def f(a, b, x):
        arr = LoraArray(w, a, b, lora_alpha=ALPHA)
        return jnp.sum(jnp.tanh(use_implicit_args(lambda arr, x: x @ arr.T)(arr, x)) ** 2)

    def ref(a, b, x):
        return jnp.sum(jnp.tanh(x @ _dense(w, a, b).T) ** 2)

    return f, ref


def test_jvp_jacfwd_linearize_hessian_match_the_dense_formula(getkey):
    w, a, b, _, x = _factors(getkey())
    f, ref = _lora_fn(w)
    tangents = tuple(jax.random.normal(getkey(), v.shape) for v in (a, b, x))

    # each transformation jitted, of f and of the reference alike: a compile each, not one
    # per operation
    def jvp(fn):
        return jax.jit(lambda a, b, x, t: jax.jvp(fn, (a, b, x), t))

    def linearized(fn):
        def both(a, b, x, t):
            y, f_lin = jax.linearize(fn, a, b, x)
            return y, f_lin(*t)

        return jax.jit(both)

    def hvp(fn):
        return jax.jit(lambda a, b, x, t: jax.jvp(jax.grad(fn, argnums=(0, 1)), (a, b, x), t)[1])

    with strict():
        y, dy = jvp(f)(a, b, x, tangents)
        jac = jax.jit(jax.jacfwd(f, argnums=(0, 1, 2)))(a, b, x)
        y_lin, dy_lin = linearized(f)(a, b, x, tangents)
        hess = jax.jit(jax.hessian(f, argnums=(0, 1)))(a, b, x)
        f_hvp = hvp(f)(a, b, x, tangents)
    y_ref, dy_ref = jvp(ref)(a, b, x, tangents)
    close((y, dy, y_lin, dy_lin), (y_ref, dy_ref, y_ref, dy_ref))
    close(jac, jax.jit(jax.jacfwd(ref, argnums=(0, 1, 2)))(a, b, x))
    # second derivatives sum terms that cancel: bounded relative to each block's scale
    close_in_scale(hess, jax.jit(jax.hessian(ref, argnums=(0, 1)))(a, b, x), ulps=512)
    close_in_scale(f_hvp, hvp(ref)(a, b, x, tangents), ulps=512)


@pytest.mark.parametrize("frozen", ["none", "a", "b", "x"])
def test_check_grads_to_second_order_in_both_modes(getkey, frozen):
    """`check_grads` compares each mode with numerical differences; freezing one input
    exercises the rule's symbolic-zero branches."""
    w, a, b, _, x = _factors(getkey())
    f, _ = _lora_fn(w)
    args = {"a": a, "b": b, "x": x}
    kept = {k: v for k, v in args.items() if k != frozen}

    def g(*vs):  # check_grads perturbs with NumPy arrays
        return f(**{**args, **dict(zip(kept, map(jnp.asarray, vs)))})

    # float32 central differences at eps=1e-3: the second order's projections agree to a
    # few parts in a thousand (0.22% seen for one compiler's rounding); a wrong rule is off
    # by far more
    with strict():
        check_grads(
            g, tuple(kept.values()), order=2, modes=("fwd", "rev"), eps=1e-3, atol=5e-3, rtol=5e-3
        )


def test_forward_mode_through_dora_and_a_soft_gated_mixture(getkey):
    w, a, b, m, x = _factors(getkey())
    _, a2, b2, _, _ = _factors(getkey())
    gate = jnp.asarray([0.3, 0.7])
    tangent_gate = jnp.asarray([1.0, -2.0])

    def mix(gate, a, x):
        d = DoraArray(w, a, b, m, lora_alpha=ALPHA)
        s = adapter_set(w, {"one": d, "two": LoraArray(w, a2, b2, lora_alpha=ALPHA)})
        s = AdapterSet(s.weight, s.adapters, gate, ("one", "two"))
        return use_implicit_args(lambda s, x: x @ s.T)(s, x)

    def mix_ref(gate, a, x):
        one = _dora_dense(w, a, b, m) - w
        two = _dense(w, a2, b2) - w
        return x @ (w + gate[0] * one + gate[1] * two).T

    primals = (gate, a, x)
    tangents = (
        tangent_gate,
        jax.random.normal(getkey(), a.shape),
        jax.random.normal(getkey(), x.shape),
    )
    with strict():
        got = jax.jvp(mix, primals, tangents)
    close(got, jax.jvp(mix_ref, primals, tangents), tol=1e-4)


def test_jvp_under_scan_over_stacked_layers(getkey):
    w, a, b, _, x = _factors(getkey(), stack=(3,))
    w, b = w[:, :IN], b[:, :IN]  # square layers, to chain

    def run(a, b, x):
        layers = eqx.filter_vmap(lambda *f: LoraArray(*f, lora_alpha=ALPHA))(w, a, b)

        def body(h, layer):
            return jnp.tanh(h @ layer.T), None

        return jax.lax.scan(use_implicit_args(body), x, layers)[0]

    def run_ref(a, b, x):
        def body(h, wab):
            return jnp.tanh(h @ _dense(*wab).T), None

        return jax.lax.scan(body, x, (w, a, b))[0]

    tangents = tuple(jax.random.normal(getkey(), v.shape) for v in (a, b, x))
    with strict():
        got = jax.jit(lambda *p: jax.jvp(run, p, tangents))(a, b, x)
    close(got, jax.jvp(run_ref, (a, b, x), tangents), tol=1e-5)
