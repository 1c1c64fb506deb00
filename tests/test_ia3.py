"""IA3 against materialized weights and against HF PEFT in PyTorch."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import close

from peftx.adapters import IA3Array, ia3
from peftx.implicit import strict, use_implicit_args

LAYOUTS = {
    "vmap(W @ x)": lambda w, x: jax.vmap(lambda v: w @ v)(x),
    "x @ W.T": lambda w, x: x @ w.T,
    "W @ X.T": lambda w, x: w @ x.T,
    "x2 @ W (rows meet x)": lambda w, x: (x @ w.T) @ w,
    "einsum": lambda w, x: jnp.einsum("oi,tbi->tob", w, jnp.stack([x, -x])),
}


@pytest.mark.parametrize("feedforward", [False, True])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ia3_matches_materialized(getkey, feedforward, layout):
    fn = LAYOUTS[layout]
    weight = jax.random.normal(getkey(), (6, 5))
    w = ia3(weight, feedforward=feedforward)
    w = eqx.tree_at(lambda a: a.ia3_l, w, w.ia3_l + jax.random.normal(getkey(), w.ia3_l.shape))
    x = jax.random.normal(getkey(), (3, 5))

    def loss(l_vec, implicit):
        a = IA3Array(weight, l_vec)
        out = use_implicit_args(fn)(a, x) if implicit else fn(a.materialize(), x)
        return jnp.sum(jnp.sin(out))

    with strict():
        got = jax.jit(use_implicit_args(fn))(w, x)
        grad = jax.jit(jax.grad(loss), static_argnums=1)(w.ia3_l, True)
        batched = jax.vmap(use_implicit_args(fn), in_axes=(None, 0))(w, jnp.stack([x, 2 * x]))
    close(got, fn(w.materialize(), x))
    close(grad, jax.grad(loss)(w.ia3_l, False), tol=1e-4)
    close(batched, jax.vmap(fn, in_axes=(None, 0))(w.materialize(), jnp.stack([x, 2 * x])))


def test_ones_init_gives_exactly_the_base_output(getkey):
    weight = jax.random.normal(getkey(), (6, 5))
    x = jax.random.normal(getkey(), (4, 5))
    for feedforward in (False, True):
        with strict():
            got = use_implicit_args(lambda w, x: x @ w.T)(ia3(weight, feedforward=feedforward), x)
        np.testing.assert_array_equal(got, x @ weight.T)


def test_scan_over_stacked_ia3_layers(getkey):
    keys = jax.random.split(getkey(), 3)
    layers = eqx.filter_vmap(
        lambda k: IA3Array(jax.random.normal(k, (4, 4)) / 2, jax.random.uniform(k, (4, 1)) + 0.5)
    )(keys)
    x = jax.random.normal(getkey(), (4,))

    def forward(layers, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(w @ h), None), x, layers)[0]

    with strict():
        got = jax.jit(use_implicit_args(forward))(layers, x)
        g = jax.grad(
            lambda lv: jnp.sum(use_implicit_args(forward)(IA3Array(layers.weight, lv), x))
        )(layers.ia3_l)
    dense = eqx.filter_vmap(lambda a: a.materialize())(layers)
    close(got, forward(dense, x))
    want = jax.grad(lambda lv: jnp.sum(forward(layers.weight * lv, x)))(layers.ia3_l)
    close(g, want, tol=1e-4)


def test_bad_ia3_input():
    with pytest.raises(ValueError, match=r"ia3_l must have shape \(6, 1\).*or \(1, 5\)"):
        IA3Array(jnp.ones((6, 5)), jnp.ones((5, 1)))
    with pytest.raises(ValueError, match="2 or more dimensions"):
        IA3Array(jnp.ones(5), jnp.ones((1, 5)))
    with pytest.raises(TypeError, match="ia3_l must be floating-point"):
        IA3Array(jnp.ones((6, 5)), jnp.ones((6, 1), jnp.int32))


@pytest.mark.parametrize("feedforward", [False, True])
def test_matches_peft(feedforward):
    from peft import IA3Config, get_peft_model

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(5, 6, bias=False)

    torch.manual_seed(0)
    cfg = IA3Config(target_modules=["proj"], feedforward_modules=["proj"] if feedforward else [])
    layer = get_peft_model(Model(), cfg).base_model.model.proj
    with torch.no_grad():
        layer.ia3_l["default"].mul_(torch.rand_like(layer.ia3_l["default"]) + 0.5)
    l_vec = jnp.asarray(layer.ia3_l["default"].detach().numpy())
    assert l_vec.shape == ((1, 5) if feedforward else (6, 1))
    w = IA3Array(jnp.asarray(layer.base_layer.weight.detach().numpy()), l_vec)
    x = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)
    out_t = layer(torch.tensor(x))
    out_t.sin().sum().backward()

    def run(l_vec):
        a = IA3Array(w.weight, l_vec)
        return jax.vmap(use_implicit_args(lambda a, v: a @ v), in_axes=(None, 0))(a, x)

    with strict():
        out = run(w.ia3_l)
        g = jax.grad(lambda lv: jnp.sum(jnp.sin(run(lv))))(w.ia3_l)
    close(out, out_t.detach().numpy())
    close(g, layer.ia3_l["default"].grad.numpy(), tol=1e-4)


def test_astype_casts_the_base_and_keeps_the_scale(getkey):
    w = ia3(jax.random.normal(getkey(), (5, 4)))
    w = eqx.tree_at(lambda a: a.ia3_l, w, jax.random.normal(getkey(), (5, 1)))
    x = jax.random.normal(getkey(), (3, 4)).astype(jnp.bfloat16)

    def f(w, x):
        half = w.astype(jnp.bfloat16)
        return x @ half.T

    with strict():
        got = use_implicit_args(f)(w, x)
    want = x @ w.materialize().astype(jnp.bfloat16).T
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        got.astype(jnp.float32), want.astype(jnp.float32), rtol=2e-2, atol=2e-2
    )
