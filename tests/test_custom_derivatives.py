"""Every adapter type through a `jax.custom_vjp` and a `jax.custom_jvp` function, under
jit, grad, vmap and lax.scan, against the same functions on a dense weight written out
here.

The custom rules are deliberately not the true derivatives (the weight's part is doubled),
so a rule that the engine bypassed would show.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import close
from jax import lax

from peftx.adapters import (
    DoraArray,
    IA3Array,
    LoraArray,
    adapter_set,
    quantize_nf4,
)

# bitsandbytes' tables, checked against bitsandbytes in test_quantized.py
from peftx.adapters._quantized import _DYNAMIC_CODE, _NF4_CODE
from peftx.implicit import strict, use_implicit_args

OUT, IN, R, ALPHA = 4, 6, 2, 3.0
S = ALPHA / R


@jax.custom_vjp
def matvec_vjp(w, x):
    return w @ x


def _fwd(w, x):
    return w @ x, (w, x)


def _bwd(res, ct):
    w, x = res
    return 2.0 * jnp.outer(ct, x), ct @ w


matvec_vjp.defvjp(_fwd, _bwd)


@jax.custom_jvp
def matvec_jvp(w, x):
    return w @ x


@matvec_jvp.defjvp
def _jvp(primals, tangents):
    (w, x), (dw, dx) = primals, tangents
    return matvec_jvp(w, x), 2.0 * (dw @ x) + w @ dx


FUNCTIONS = {"custom_vjp": matvec_vjp, "custom_jvp": matvec_jvp}


# ---------------------------------------------------------------- dense references


def nf4_dense(q):
    """bitsandbytes' dequantization, `code[nibble] · absmax[block]` (absmaxes decoded from
    their 8-bit codes when double-quantized); no gradient reaches the quantization state."""
    sg = lax.stop_gradient
    codes = jnp.stack([q.packed >> 4, q.packed & 15], axis=-1).reshape(-1)
    absmax = sg(q.absmax)
    if q.nested_absmax is not None:
        nested = jnp.repeat(sg(q.nested_absmax), q.nested_blocksize)[: q.absmax.size]
        absmax = jnp.asarray(_DYNAMIC_CODE)[q.absmax] * nested + sg(q.nested_offset)
    values = jnp.asarray(_NF4_CODE)[codes] * jnp.repeat(absmax, q.blocksize)[: codes.size]
    return values[: OUT * IN].reshape(OUT, IN)


def lora_dense(a):
    base = a.weight if isinstance(a.weight, jax.Array) else nf4_dense(a.weight)
    return base + S * a.lora_B @ a.lora_A


def dora_dense(a):
    v = lora_dense(a)
    norm = lax.stop_gradient(jnp.sqrt(jnp.sum(v * v, axis=1)))
    return a.lora_magnitude_vector[:, None] * v / norm[:, None]


def set_dense(s):
    a, b = s.adapters["a"], s.adapters["b"]
    return s.weight + S * a.lora_B @ a.lora_A + (s.weight * b.ia3_l - s.weight)


# ---------------------------------------------------------------- the adapters


def _lora(key, weight, **kwargs):
    ka, kb = jax.random.split(key)
    a = jax.random.normal(ka, (R, IN)) / 2
    b = jax.random.normal(kb, (OUT, R)) / 2
    return LoraArray(weight, a, b, lora_alpha=ALPHA, **kwargs)


def _dora(key, weight):
    k1, k2 = jax.random.split(key)
    lo = _lora(k1, weight)
    m = 1.0 + jax.random.uniform(k2, (OUT,))
    return DoraArray(lo.weight, lo.lora_A, lo.lora_B, m, lora_alpha=ALPHA)


def _ia3(key, weight):
    return IA3Array(weight, 0.5 + jax.random.uniform(key, (OUT, 1)))


def _set(key, weight):
    k1, k2 = jax.random.split(key)
    adapters = {"a": _lora(k1, weight), "b": _ia3(k2, weight)}
    return adapter_set(weight, adapters, active=("a", "b"))


# name -> (build(key, dense weight), dense formula of the built array)
ADAPTERS = {
    "lora": (_lora, lora_dense),
    # a key with rate 0: a leaf where the field is otherwise None, same values
    "lora_dropout_key": (
        lambda k, w: _lora(k, w, lora_dropout=0.0, dropout_key=jax.random.key(7)),
        lora_dense,
    ),
    "dora": (_dora, dora_dense),
    "ia3": (_ia3, lambda a: a.weight * a.ia3_l),
    "nf4": (lambda k, w: quantize_nf4(w, blocksize=4), nf4_dense),
    "nf4_double_quant": (lambda k, w: quantize_nf4(w, blocksize=4, double_quant=True), nf4_dense),
    "qlora": (lambda k, w: _lora(k, quantize_nf4(w, blocksize=4)), lora_dense),
    "adapter_set": (_set, set_dense),
}


def _case(getkey, name):
    build, dense = ADAPTERS[name]
    w = build(getkey(), jax.random.normal(getkey(), (OUT, IN)))
    xs = jax.random.normal(getkey(), (3, 2, IN))  # (steps, batch, in)
    return w, dense, xs


def _objective(f):
    """A loss of `(w, xs)` that scans over `xs`, with `f` vmapped over each batch."""

    def loss(w, xs):
        def step(c, x):
            y = jax.vmap(f, in_axes=(None, 0))(w, c * x)
            return 1.0 + 0.1 * jnp.mean(jnp.sin(y)), y

        c, ys = lax.scan(step, jnp.ones(()), xs)
        return jnp.sum(jnp.tanh(ys) ** 2) + c

    return loss


def _value_and_grad(loss):
    return eqx.filter_jit(eqx.filter_value_and_grad(lambda wx: loss(*wx)))


@pytest.mark.parametrize("kind", FUNCTIONS)
@pytest.mark.parametrize(
    "name",
    [
        # the engine meets a custom rule alike for every type: the fast tier runs LoRA, NF4,
        # LoRA over NF4 and a set (LoRA and IA3); the whole suite DoRA, IA3 and double-quant
        pytest.param(name, marks=pytest.mark.variant_sweep)
        if name in ("dora", "ia3", "nf4_double_quant")
        else name
        for name in ADAPTERS
    ],
)
def test_implicit_argument_equals_dense(getkey, name, kind):
    """jit(grad(use_implicit_args(scan(vmap(f))))): values, gradients for the adapter's
    fields and the inputs."""
    w, dense, xs = _case(getkey, name)
    loss = _objective(FUNCTIONS[kind])
    with strict():
        got = _value_and_grad(use_implicit_args(loss))((w, xs))
    want = _value_and_grad(lambda w, xs: loss(dense(w), xs))((w, xs))
    close(got, want, tol=1e-4)


@pytest.mark.parametrize("kind", FUNCTIONS)
@pytest.mark.parametrize("name", ["lora", "qlora"])
def test_transformations_outside_use_implicit_args(getkey, name, kind):
    """jit(grad(scan(vmap(use_implicit_args(f))))): the custom function meets the engine
    under JAX's own traces."""
    w, dense, xs = _case(getkey, name)
    f = FUNCTIONS[kind]
    with strict():
        got = _value_and_grad(_objective(use_implicit_args(f)))((w, xs))
    want = _value_and_grad(lambda w, xs: _objective(f)(dense(w), xs))((w, xs))
    close(got, want, tol=1e-4)


def test_forward_mode_through_custom_jvp(getkey):
    """`jax.jvp` with a tangent for the LoRA factors and the input."""
    w, dense, xs = _case(getkey, "lora")
    x = xs[0, 0]
    tw = jax.tree.map(lambda a: jax.random.normal(getkey(), a.shape), w)
    tx = jax.random.normal(getkey(), x.shape)
    with strict():
        got = jax.jvp(use_implicit_args(matvec_jvp), (w, x), (tw, tx))
    want = jax.jvp(lambda w, x: matvec_jvp(dense(w), x), (w, x), (tw, tx))
    close(got, want)
