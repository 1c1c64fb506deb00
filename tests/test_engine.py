"""The engine's footing: supported versions, missing internals, and leaving quax alone."""

import warnings

import jax
import jax.numpy as jnp
import pytest
import quax
import quax._trace
from helpers import close

from peftx.adapters import Zeros, lora
from peftx.implicit import (
    ImplicitArray,
    UnsupportedVersionError,
    UntestedVersionWarning,
    _engine,
    outer_vmap_size,
    primitive_handler,
    use_implicit_args,
)


@pytest.mark.parametrize("version", ["0.9.2", "0.12.0", "1.0.0"])
def test_untested_jax_warns_naming_both_versions(monkeypatch, version):
    monkeypatch.setattr(jax, "__version__", version)
    with pytest.warns(
        UntestedVersionWarning,
        match=rf"tested with jax >=0\.10,<0\.12 with quax ==0\.4\.6, but found jax {version}",
    ):
        _engine.check_jax_version()


@pytest.mark.parametrize("version", ["0.10.2", "0.11.0", "0.11.4.dev20260101"])
def test_tested_jax_is_silent(monkeypatch, version):
    monkeypatch.setattr(jax, "__version__", version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _engine.check_jax_version()


@pytest.fixture
def fresh_internals():
    """The engine looks its internals up again, before and after the test."""
    _engine._internals.cache_clear()
    yield
    _engine._internals.cache_clear()


def test_missing_internal_fails_at_first_use_naming_it(monkeypatch, fresh_internals):
    monkeypatch.delattr(quax._trace, "_QuaxTracer")
    f = use_implicit_args(lambda z, x: z + x)  # wrapping needs nothing private yet
    with pytest.raises(
        UnsupportedVersionError,
        match=r"needs `quax\._trace\._QuaxTracer`, which this installation lacks \(jax "
        r".*\)\. peftx is tested with jax >=0\.10,<0\.12 with quax ==0\.4\.6",
    ):
        f(Zeros((2,)), jnp.ones(2))


class _Counted(ImplicitArray):
    value: jax.Array

    def aval(self):
        return jax.core.ShapedArray(self.value.shape, self.value.dtype)

    def materialize(self):
        return self.value


_sin_calls = []


@primitive_handler("sin")
def _counted_sin(primitive, x: _Counted, **params):
    _sin_calls.append(x)
    return jnp.sin(x.value)


def test_outer_vmap_size_counts_the_examples_of_every_enclosing_vmap():
    seen = {}

    def record(name):
        def f(x, y):
            seen[name] = (outer_vmap_size(x), outer_vmap_size(y))
            return x

        return f

    x, y = jnp.ones((4, 3, 2)), jnp.ones(2)
    record("none")(x, y)
    jax.vmap(record("one"), in_axes=(0, None))(x, y)
    jax.jit(jax.vmap(jax.vmap(record("two"), in_axes=(0, None)), in_axes=(0, None)))(x, y)
    jax.grad(lambda x: jnp.sum(jax.vmap(record("grad of vmap"), in_axes=(0, None))(x, y)))(x)
    assert seen == {
        "none": (1, 1),
        "one": (4, 1),
        "two": (12, 1),
        "grad of vmap": (4, 1),
    }


def test_eager_inner_jit_traces_its_body_once():
    f = use_implicit_args(jax.jit(jnp.sin))
    close(f(_Counted(jnp.arange(3.0))), jnp.sin(jnp.arange(3.0)))
    close(f(_Counted(jnp.ones(3))), jnp.sin(jnp.ones(3)))
    assert len(_sin_calls) == 1  # the second call ran the compiled body


class _Plain(quax.ArrayValue):
    """An array type of quax's own, known to nothing in peftx."""

    array: jax.Array

    def aval(self):
        return jax.core.ShapedArray(self.array.shape, self.array.dtype)

    def materialise(self):
        return self.array


@jax.custom_vjp
def _matvec(w, x):
    return w @ x


_matvec.defvjp(lambda w, x: (w @ x, (w, x)), lambda res, ct: (jnp.outer(ct, res[1]), ct @ res[0]))


def test_plain_quaxify_keeps_quax_behaviour_for_custom_vjp(getkey):
    """quax has no rule for a `custom_vjp` called with its values, and says so; peftx,
    imported and used here, does not change that."""
    w = jax.random.normal(getkey(), (3, 2))
    x = jax.random.normal(getkey(), (2,))
    adapted = lora(w, r=2, init="random", key=getkey())
    grad = jax.grad(lambda x: jnp.sum(use_implicit_args(_matvec)(adapted, x)))(x)
    dense = w + 8.0 / 2 * adapted.lora_B @ adapted.lora_A  # lora's default lora_alpha is 8
    close(grad, jnp.ones(3) @ dense)
    with pytest.raises(NotImplementedError, match="process_custom_vjp_call"):
        quax.quaxify(_matvec)(_Plain(w), x)
