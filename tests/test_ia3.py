"""IA3 against dense formulas written out here and against HF PEFT in PyTorch."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import close

import peftx
from peftx.adapters import IA3Array, ia3
from peftx.implicit import strict, use_implicit_args


def _dense_ia3(weight, l_vec, feedforward):
    """`W ⊙ l` written out (not `materialize()`): `l` scales W's rows (outputs), or its
    columns (inputs) for feed-forward layers; leading axes stack layers."""
    l_vec = l_vec.reshape(*l_vec.shape[:-2], -1)
    return weight * (l_vec[..., None, :] if feedforward else l_vec[..., :, None])


LAYOUTS = {
    "vmap(W @ x)": lambda w, x: jax.vmap(lambda v: w @ v)(x),
    "x @ W.T": lambda w, x: x @ w.T,
    "W @ X.T": lambda w, x: w @ x.T,
    "x2 @ W (rows meet x)": lambda w, x: (x @ w.T) @ w,
    "einsum": lambda w, x: jnp.einsum("oi,tbi->tob", w, jnp.stack([x, -x])),
}


@pytest.mark.parametrize("feedforward", [False, True])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ia3_matches_dense_formula(getkey, feedforward, layout):
    """Values, gradients (scale and input) and a vmapped batch against `W ⊙ l`."""
    fn = LAYOUTS[layout]
    weight = jax.random.normal(getkey(), (6, 5))
    w = ia3(weight, feedforward=feedforward)
    w = eqx.tree_at(lambda a: a.ia3_l, w, w.ia3_l + jax.random.normal(getkey(), w.ia3_l.shape))
    x = jax.random.normal(getkey(), (3, 5))
    xs = jnp.stack([x, 2 * x])

    def loss(l_vec, x, implicit):
        if implicit:
            out = use_implicit_args(fn)(IA3Array(weight, l_vec), x)
        else:
            out = fn(_dense_ia3(weight, l_vec, feedforward), x)
        return jnp.sum(jnp.sin(out))

    with strict():
        got = jax.jit(use_implicit_args(fn))(w, x)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(w.ia3_l, x, True)
        batched = jax.vmap(use_implicit_args(fn), in_axes=(None, 0))(w, xs)
    dense = _dense_ia3(weight, w.ia3_l, feedforward)
    close(got, fn(dense, x))
    assert not np.allclose(got, fn(weight, x), atol=1e-2)  # the scale matters
    close(grads, jax.grad(loss, argnums=(0, 1))(w.ia3_l, x, False), tol=1e-4)
    close(batched, jax.vmap(fn, in_axes=(None, 0))(dense, xs))


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

    def implicit_loss(lv, x):
        return jnp.sum(use_implicit_args(forward)(IA3Array(layers.weight, lv), x))

    def dense_loss(lv, x):
        return jnp.sum(forward(_dense_ia3(layers.weight, lv, feedforward=False), x))

    with strict():
        got = jax.jit(use_implicit_args(forward))(layers, x)
        grads = jax.grad(implicit_loss, argnums=(0, 1))(layers.ia3_l, x)
    close(got, forward(_dense_ia3(layers.weight, layers.ia3_l, feedforward=False), x))
    close(grads, jax.grad(dense_loss, argnums=(0, 1))(layers.ia3_l, x), tol=1e-4)


def test_bad_ia3_input():
    with pytest.raises(ValueError, match=r"ia3_l must have shape \(6, 1\).*or \(1, 5\)"):
        IA3Array(jnp.ones((6, 5)), jnp.ones((5, 1)))
    with pytest.raises(ValueError, match="2 or more dimensions"):
        IA3Array(jnp.ones(5), jnp.ones((1, 5)))
    with pytest.raises(TypeError, match="ia3_l must be floating-point"):
        IA3Array(jnp.ones((6, 5)), jnp.ones((6, 1), jnp.int32))


class _Proj(eqx.Module):
    proj: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(self.proj)(x)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("feedforward", [False, True])
def test_matches_peft(feedforward, bias):
    """`peftx.get_peft_model` on the same weights as PEFT: outputs and gradients (scale and
    input). With a bias, PEFT scales the whole output of an output-side layer, bias
    included, and only the input of a feed-forward one."""
    from peft import IA3Config, get_peft_model

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(5, 6, bias=bias)

    torch.manual_seed(0)
    cfg = IA3Config(target_modules=["proj"], feedforward_modules=["proj"] if feedforward else [])
    layer = get_peft_model(Model(), cfg).base_model.model.proj
    with torch.no_grad():
        layer.ia3_l["default"].mul_(torch.rand_like(layer.ia3_l["default"]) + 0.5)
    l_vec = jnp.asarray(layer.ia3_l["default"].detach().numpy())
    assert l_vec.shape == ((1, 5) if feedforward else (6, 1))
    x = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)
    x_t = torch.tensor(x, requires_grad=True)
    out_t = layer(x_t)
    out_t.sin().sum().backward()

    linear = eqx.nn.Linear(5, 6, use_bias=bias, key=jax.random.key(0))
    linear = eqx.tree_at(
        lambda m: m.weight, linear, jnp.asarray(layer.base_layer.weight.detach().numpy())
    )
    if bias:
        linear = eqx.tree_at(
            lambda m: m.bias, linear, jnp.asarray(layer.base_layer.bias.detach().numpy())
        )
    cfg = peftx.IA3Config(
        target_modules=["proj"], feedforward_modules=["proj"] if feedforward else []
    )
    model = peftx.get_peft_model(_Proj(linear), cfg, key=jax.random.key(1))

    def scale_of(m):
        return m.base_model.proj.weight.adapters["default"].ia3_l

    def run(l_vec, x):
        return eqx.tree_at(scale_of, model, l_vec)(x)

    with strict():
        out = run(l_vec, x)
        grads = jax.grad(lambda *a: jnp.sum(jnp.sin(run(*a))), argnums=(0, 1))(l_vec, x)
    close(out, out_t.detach().numpy())
    close(grads, (layer.ia3_l["default"].grad.numpy(), x_t.grad.numpy()), tol=1e-4)


# feed-forward on a bfloat16 weight: the fast tier checks it against PEFT in
# test_mixed_precision (test_bf16_base_fp32_ia3_matches_peft), the whole suite here too
@pytest.mark.parametrize(
    "feedforward", [False, pytest.param(True, marks=pytest.mark.variant_sweep)]
)
def test_bf16_matches_dense_formula(getkey, feedforward):
    """A bfloat16 weight with a bfloat16 scale against `W ⊙ l` in float32 on the same
    values: outputs and vector-Jacobian products (scale and input)."""
    out, in_, tokens = 48, 64, 8

    def f32(tree):
        return jax.tree.map(lambda t: t.astype(jnp.float32), tree)

    def bf16(shape, std, mean=0.0):
        return (mean + std * jax.random.normal(getkey(), shape)).astype(jnp.bfloat16)

    weight, x = bf16((out, in_), in_**-0.5), bf16((tokens, in_), 1.0)
    l_vec = bf16((1, in_) if feedforward else (out, 1), 0.5, mean=1.0)
    cotangent = bf16((tokens, out), 1.0)
    with strict():
        got, vjp = jax.vjp(
            lambda lv, x: use_implicit_args(lambda w, x: x @ w.T)(IA3Array(weight, lv), x),
            l_vec,
            x,
        )
        grads = vjp(cotangent)
    want, dense_vjp = jax.vjp(
        lambda lv, x: x @ _dense_ia3(f32(weight), lv, feedforward).T, f32(l_vec), f32(x)
    )
    for g, w in zip((got, *grads), (want, *dense_vjp(f32(cotangent))), strict=True):
        assert g.dtype == jnp.bfloat16
        w = np.asarray(w)
        # a K-term sum of size-m terms is ~sqrt(K)·m (its rms), up to 4x that, rounded ~3
        # times (l·x or W·x, the product, the rescale) at u = 2**-8: atol = 12·u·sqrt(K)·m
        atol = 12 * 2.0**-8 * np.sqrt(np.mean(w**2))
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=0, atol=atol)
    base = f32(x) @ f32(weight).T
    assert np.sqrt(np.mean((want - base) ** 2)) > 0.2  # the scale is far above rounding


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


class _MLP(eqx.Module):
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up_proj = eqx.nn.Linear(48, 256, key=k1)
        self.down_proj = eqx.nn.Linear(256, 48, key=k2)


def test_init_ia3_weights_false_draws_standard_normal_scales(getkey):
    """The fix: `init_ia3_weights=False` was accepted, saved and never read (the scales
    always started at ones); PEFT draws them from `torch.randn`, a standard normal."""
    targets = dict(target_modules=["up_proj", "down_proj"], feedforward_modules=["down_proj"])
    ones = peftx.get_peft_model(_MLP(getkey()), peftx.IA3Config(**targets), key=getkey())
    drawn = peftx.get_peft_model(
        _MLP(getkey()), peftx.IA3Config(init_ia3_weights=False, **targets), key=getkey()
    )
    for model in (ones, drawn):
        assert model.base_model.up_proj.weight.adapters["default"].ia3_l.shape == (256, 1)
        assert model.base_model.down_proj.weight.adapters["default"].ia3_l.shape == (
            1,
            256,
        )  # feed-forward
    assert all(
        bool((a.weight.adapters["default"].ia3_l == 1).all())
        for a in (ones.base_model.up_proj, ones.base_model.down_proj)
    )
    up, down = (
        np.asarray(m.weight.adapters["default"].ia3_l).ravel()
        for m in (drawn.base_model.up_proj, drawn.base_model.down_proj)
    )
    assert not np.array_equal(up, down)  # each layer its own draw
    values = np.concatenate([up, down])  # 512 draws: mean 0 and std 1 within 5 standard errors
    assert abs(values.mean()) < 5 / np.sqrt(512) and abs(values.std() - 1) < 5 / np.sqrt(2 * 512)
    # the reference: PEFT's own layer with the same flag
    import peft

    torch_model = torch.nn.Sequential()
    torch_model.add_module("up_proj", torch.nn.Linear(48, 256))
    config = peft.IA3Config(
        init_ia3_weights=False, target_modules=["up_proj"], feedforward_modules=[]
    )
    torch.manual_seed(0)
    scales = peft.get_peft_model(torch_model, config).base_model.model.up_proj.ia3_l["default"]
    assert tuple(scales.shape) == (256, 1) and not bool((scales == 1).all())
