"""LoRA dropout: statistics, PEFT's formulas (LoRA and DoRA, against PEFT in torch with the
same mask), stacked layers under `lax.scan` and `jax.vmap`, mixed-adapter batches, keys.

The masks are observed, not re-drawn: `_dropped` runs a probe adapter with the same key
and rate whose product returns its dropped input, so the references below do not depend
on how the implementation draws its random bits."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import close

import peftx
from peftx import LoraConfig, get_peft_model, partition
from peftx.adapters import DoraArray, LoraArray, dora, lora, with_dropout, without_dropout
from peftx.implicit import strict, use_implicit_args

EPS = float(jnp.finfo(jnp.float32).eps)
FWD_TOL = 64 * EPS  # sums of a few float32 products of order 1
GRAD_TOL = 256 * EPS  # backward products add another such sum


def _rows(w, x):
    """`x @ w.T` one row at a time (`eqx.nn.Linear` under `jax.vmap`)."""
    return jax.vmap(lambda v: w @ v)(x)


def _dropped(adapter, x, fn=_rows):
    """The dropped input `adapter` feeds its factors when `fn(adapter, x)` runs: a probe with
    the same rate and key, `W = 0` and identity factors (scaling 1), so `fn` returns it."""
    d = adapter.shape[-1]
    probe = LoraArray(
        jnp.zeros((d, d)),
        jnp.eye(d),
        jnp.eye(d),
        lora_alpha=d,
        lora_dropout=adapter.lora_dropout,
        dropout_key=adapter.dropout_key,
    )
    with strict():
        return use_implicit_args(fn)(probe, x)


def _kept(adapter, x, fn=_rows):
    return _dropped(adapter, jnp.ones_like(x), fn) != 0


def _random_lora(key, d=6, r=2, p=0.5, **kwargs):
    kw, kl = jax.random.split(key)
    w = jax.random.normal(kw, (d, d)) / 2
    return lora(w, r=r, lora_alpha=4.0, init="random", lora_dropout=p, key=kl, **kwargs)


# ---------------------------------------------------------------- statistics


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_masks_a_fraction_p_and_scales_the_rest(getkey, p):
    w = with_dropout(_random_lora(getkey(), d=32, p=p), getkey())
    x = jax.random.normal(getkey(), (64, 32))
    x_d = _dropped(w, x)
    dropped = np.asarray(x_d == 0)
    n = dropped.size
    # the dropped count is Binomial(n, p): 5 standard deviations
    assert abs(dropped.mean() - p) <= 5 * np.sqrt(p * (1 - p) / n)
    close(x_d[~dropped], (x / (1 - p))[~dropped], tol=2 * EPS)
    # each token has its own mask, not one mask broadcast over tokens
    assert len({row.tobytes() for row in dropped}) > 1
    # the base path is never dropped: without the adapter's product, W·x is all there is
    no_update = eqx.tree_at(lambda a: a.lora_B, w, jnp.zeros_like(w.lora_B))
    with strict():
        np.testing.assert_array_equal(use_implicit_args(_rows)(no_update, x), x @ w.weight.T)


def test_without_dropout_gives_exactly_the_result_without_dropout(getkey):
    w = _random_lora(getkey(), p=0.5)
    no_rate = _random_lora(getkey(), p=0.0)
    x = jax.random.normal(getkey(), (4, 6))
    trained = with_dropout(w, getkey())
    with strict():
        plain = use_implicit_args(_rows)(w, x)
        dropped = use_implicit_args(_rows)(trained, x)
        removed = use_implicit_args(_rows)(without_dropout(trained), x)
        no_rate_plain = use_implicit_args(_rows)(no_rate, x)
        no_rate_keyed = use_implicit_args(_rows)(with_dropout(no_rate, getkey()), x)
    assert without_dropout(trained).dropout_key is None
    np.testing.assert_array_equal(removed, plain)
    close(plain, x @ w.materialize().T, tol=FWD_TOL)
    np.testing.assert_array_equal(no_rate_keyed, no_rate_plain)  # lora_dropout=0: a key is inert
    assert not np.allclose(dropped, plain, atol=1e-3)


# ---------------------------------------------------------------- against PEFT in torch


class _InjectedMask(torch.nn.Module):
    """Stands in for PEFT's `nn.Dropout`: a fixed mask, kept entries scaled by `1/(1-p)`."""

    def __init__(self, keep, p):
        super().__init__()
        self.keep = torch.tensor(np.asarray(keep, np.float32))
        self.p = p

    def forward(self, x):
        return x * self.keep / (1 - self.p)


class _TorchNet(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = torch.nn.Linear(d, d)


def _np(t):
    return t.detach().numpy()


@pytest.mark.parametrize("use_dora", [False, True])
def test_lora_and_dora_dropout_match_peft_with_the_same_mask(getkey, use_dora):
    from peft import LoraConfig as TorchLoraConfig, get_peft_model as torch_get_peft_model

    d, p = 6, 0.4
    torch.manual_seed(0)
    config = TorchLoraConfig(
        r=2, lora_alpha=5, lora_dropout=p, target_modules=["proj"], init_lora_weights=False,
        use_dora=use_dora,
    )  # fmt: skip
    layer = torch_get_peft_model(_TorchNet(d), config).base_model.model.proj
    weight, bias = (jnp.asarray(_np(t)) for t in (layer.base_layer.weight, layer.base_layer.bias))
    a = jnp.asarray(_np(layer.lora_A["default"].weight))
    b = jnp.asarray(_np(layer.lora_B["default"].weight))
    adapter = LoraArray(weight, a, b, lora_alpha=5, lora_dropout=p)
    if use_dora:
        # m ≠ ‖W + s·B·A‖, so PEFT's `(m/‖·‖ - 1)·W·dropout(x)` term is not zero
        magnitude = layer.lora_magnitude_vector["default"].weight
        with torch.no_grad():
            magnitude.mul_(torch.linspace(0.7, 1.4, d))
        adapter = DoraArray(weight, a, b, jnp.asarray(_np(magnitude)), lora_alpha=5, lora_dropout=p)
    adapter = with_dropout(adapter, getkey())
    x = jax.random.normal(getkey(), (4, d))
    keep = _kept(adapter, x)
    assert 0 < keep.mean() < 1

    layer.lora_dropout["default"] = _InjectedMask(keep, p)
    layer.train()
    x_t = torch.tensor(np.asarray(x), requires_grad=True)
    out_t = layer(x_t)
    out_t.sin().sum().backward()

    fields = ("lora_A", "lora_B", "lora_magnitude_vector")[: 3 if use_dora else 2]
    params = tuple(getattr(adapter, f) for f in fields)
    linear = eqx.tree_at(
        lambda m: (m.weight, m.bias), eqx.nn.Linear(d, d, key=getkey()), (adapter, bias)
    )

    def loss(params, x):
        model = eqx.tree_at(lambda m: [getattr(m.weight, f) for f in fields], linear, params)
        out = use_implicit_args(lambda m, x: jax.vmap(m)(x))(model, x)
        return jnp.sum(jnp.sin(out)), out

    def dense_loss(params, x):
        """PEFT's formulas, with the mask above."""
        a, b = params[:2]
        x_d = jnp.where(keep, x / (1 - p), 0.0)
        s = adapter.scaling
        lora_out = s * (x_d @ a.T) @ b.T
        if not use_dora:
            out = x @ weight.T + bias[None] + lora_out
        else:
            norm = jax.lax.stop_gradient(jnp.linalg.norm(weight + s * b @ a, axis=1))
            g = (params[2] / norm)[None]
            out = x @ weight.T + bias[None] + (g - 1) * (x_d @ weight.T) + g * lora_out
        return jnp.sum(jnp.sin(out)), out

    with strict():
        grads, out = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    dense_grads, dense_out = jax.grad(dense_loss, argnums=(0, 1), has_aux=True)(params, x)
    torch_params = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
    if use_dora:
        torch_params.append(layer.lora_magnitude_vector["default"].weight)
    close(out, _np(out_t), tol=FWD_TOL)
    close(grads, ([_np(t.grad) for t in torch_params], _np(x_t.grad)), tol=GRAD_TOL)
    close(out, dense_out, tol=FWD_TOL)
    close(grads, dense_grads, tol=GRAD_TOL)


# ---------------------------------------------------------------- stacked layers


def _stack(key, n=3, d=6, p=0.5, use_dora=False):
    def make(k):
        w = _random_lora(k, d=d, p=p)
        return dora(w) if use_dora else w

    return eqx.filter_vmap(make)(jax.random.split(key, n))


def _layer(stack, i):
    return jax.tree.map(lambda leaf: leaf[i], stack)


# DoRA's dropout is checked against PEFT in test_lora_and_dora_dropout_match_peft: the
# fast tier scans LoRA's stack, the whole suite DoRA's too
@pytest.mark.parametrize("use_dora", [False, pytest.param(True, marks=pytest.mark.variant_sweep)])
def test_scan_over_stacked_layers_gives_each_layer_its_own_mask(getkey, use_dora):
    layers = with_dropout(_stack(getkey(), use_dora=use_dora), getkey())
    assert layers.dropout_key.shape == (3,)
    x = jax.random.normal(getkey(), (4, 6))
    params, static = eqx.partition(
        layers, lambda a: a is not layers.weight and eqx.is_inexact_array(a)
    )

    def forward(layers, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(_rows(w, h)), h), x, layers)

    def loss(params):
        out, _ = use_implicit_args(forward)(eqx.combine(params, static), x)
        return jnp.sum(out**2)

    with strict():
        out, inputs = jax.jit(use_implicit_args(forward))(layers, x)
        grads = jax.jit(jax.grad(loss))(params)
    # each layer's mask, observed on the input it saw
    keeps = [_kept(_layer(layers, i), inputs[i]) for i in range(3)]
    assert not np.array_equal(keeps[0], keeps[1]) and not np.array_equal(keeps[1], keeps[2])

    def dense_loss(params):
        model = eqx.combine(params, static)
        h = x
        for i, keep in enumerate(keeps):
            w = _layer(model, i)
            x_d = jnp.where(keep, h / 0.5, 0.0)
            update = w.scaling * (x_d @ w.lora_A.T) @ w.lora_B.T
            if not use_dora:
                h = jnp.tanh(h @ w.weight.T + update)
            else:
                norm = jax.lax.stop_gradient(jnp.linalg.norm(w.weight + w.delta(), axis=1))
                g = (w.lora_magnitude_vector / norm)[None]
                h = jnp.tanh(h @ w.weight.T + (g - 1) * (x_d @ w.weight.T) + g * update)
        return jnp.sum(h**2), h

    dense_grads, dense_out = jax.grad(dense_loss, has_aux=True)(params)
    close(out, dense_out, tol=FWD_TOL)
    close(grads, dense_grads, tol=GRAD_TOL)


def test_vmap_over_stacked_layers_matches_each_layer_alone(getkey):
    layers = with_dropout(_stack(getkey()), getkey())
    xs = jax.random.normal(getkey(), (3, 4, 6))

    def each(w, x):
        return jax.vmap(_rows)(w, x)

    with strict():
        inside = use_implicit_args(each)(layers, xs)  # the handler sees the whole stack
        outside = jax.vmap(use_implicit_args(_rows))(layers, xs)  # one layer at a time
    for i in range(3):
        w = _layer(layers, i)
        x_d = jnp.where(_kept(w, xs[i]), xs[i] / 0.5, 0.0)
        want = xs[i] @ w.weight.T + w.scaling * (x_d @ w.lora_A.T) @ w.lora_B.T
        close(inside[i], want, tol=FWD_TOL)
        close(outside[i], want, tol=FWD_TOL)
    with pytest.raises(ValueError, match=r"needs the input batched along the layers too"):
        use_implicit_args(lambda w, x: jax.vmap(lambda w: _rows(w, x))(w))(layers, xs[0])


def test_stacked_keys_reach_every_adapter_and_one_key_for_a_stack_is_refused(getkey):
    twice = jax.tree.map(lambda a: jnp.stack([a] * 4), _stack(getkey(), n=2))  # (4, 2) layers
    keyed = with_dropout({"a": twice, "b": _random_lora(getkey())}, getkey())
    assert keyed["a"].dropout_key.shape == (4, 2) and keyed["b"].dropout_key.shape == ()
    data = jax.random.key_data(
        jnp.concatenate([keyed["a"].dropout_key.ravel(), keyed["b"].dropout_key[None]])
    )
    assert len({tuple(k) for k in np.asarray(data)}) == 9
    # a stack holding a single key for all its layers
    one_key = eqx.tree_at(
        lambda w: w.dropout_key, _stack(getkey()), getkey(), is_leaf=lambda n: n is None
    )
    with pytest.raises(
        ValueError, match=r"needs one\s+dropout key per layer, got keys of shape \(\)"
    ):
        use_implicit_args(lambda w, x: jnp.einsum("loi,lbi->lbo", w, x))(
            one_key, jnp.ones((3, 4, 6))
        )


class _Block(eqx.Module):
    proj: eqx.nn.Linear

    def __init__(self, key):
        self.proj = eqx.nn.Linear(4, 4, key=key)


def test_get_peft_model_stacked_layers_with_dropout_under_scan(getkey):
    stacked = eqx.filter_vmap(_Block)(jax.random.split(getkey(), 3))
    config = LoraConfig(target_modules=["proj"], r=2, lora_dropout=0.25, init_lora_weights=False)
    model = with_dropout(get_peft_model({"layers": stacked}, config, key=getkey()), getkey())
    adapter = model.base_model["layers"].proj.weight.adapter("default")
    assert adapter.dropout_key.shape == (3,)
    x = jax.random.normal(getkey(), (5, 4))

    def forward(layers, x):
        return jax.lax.scan(lambda h, b: (jnp.tanh(jax.vmap(b.proj)(h)), h), x, layers)

    with strict():
        out, inputs = jax.jit(use_implicit_args(forward))(model.prepared()["layers"], x)
    h = x
    for i in range(3):
        w, bias = _layer(adapter, i), stacked.proj.bias[i]
        x_d = jnp.where(_kept(w, inputs[i]), h / 0.75, 0.0)
        h = jnp.tanh(h @ w.weight.T + bias[None] + w.scaling * (x_d @ w.lora_A.T) @ w.lora_B.T)
    close(out, h, tol=FWD_TOL)


# ---------------------------------------------------------------- several adapters, keys


class _Net(eqx.Module):
    proj: eqx.nn.Linear

    def __init__(self, key):
        self.proj = eqx.nn.Linear(6, 6, key=key)

    def __call__(self, x):
        return x @ self.proj.weight.T + self.proj.bias[None]


def test_mixed_batch_gives_each_example_its_adapters_dropout(getkey):
    config_a = LoraConfig(target_modules=["proj"], r=2, lora_dropout=0.5, init_lora_weights=False)
    config_b = LoraConfig(
        target_modules=["proj"], r=3, lora_alpha=6, lora_dropout=0.25, init_lora_weights=False
    )
    net = _Net(getkey())
    model = get_peft_model(net, config_a, key=getkey(), adapter_name="a")
    model = with_dropout(model.add_adapter("b", config_b, key=getkey()), getkey())
    names = ["a", peftx.BASE, "b", "b", "a"]
    x = jax.random.normal(getkey(), (5, 6))
    trainable, frozen = partition(model, ["a", "b"])

    def loss(trainable, x):
        out = eqx.combine(trainable, frozen)(x, adapter_names=names)
        return jnp.sum(jnp.sin(out)), out

    with strict():
        grads, out = jax.grad(loss, has_aux=True)(trainable, x)
    adapters = {n: model.base_model.proj.weight.adapter(n) for n in ("a", "b")}
    keeps = {n: _kept(w, x, lambda w, x: x @ w.T) for n, w in adapters.items()}
    assert not np.array_equal(keeps["a"], keeps["b"])

    def dense_loss(factors, x):
        rows = []
        for i, name in enumerate(names):
            row = x[i] @ net.proj.weight.T + net.proj.bias
            if name != peftx.BASE:
                w, (a, b) = adapters[name], factors[name]
                x_d = jnp.where(keeps[name][i], x[i] / (1 - w.lora_dropout), 0.0)
                row = row + w.scaling * b @ (a @ x_d)
            rows.append(row)
        out = jnp.stack(rows)
        return jnp.sum(jnp.sin(out)), out

    factors = {n: (w.lora_A, w.lora_B) for n, w in adapters.items()}
    dense_grads, dense_out = jax.grad(dense_loss, has_aux=True)(factors, x)
    close(out, dense_out, tol=FWD_TOL)
    got = grads.base_model.proj.weight.adapters
    close({n: (got[n].lora_A, got[n].lora_B) for n in ("a", "b")}, dense_grads, tol=GRAD_TOL)


def test_dropout_keys_are_never_trained(getkey):
    config = LoraConfig(target_modules=["proj"], r=2, lora_dropout=0.5, init_lora_weights=False)
    model = with_dropout(get_peft_model(_Net(getkey()), config, key=getkey()), getkey())
    trainable, frozen = partition(model)
    template = trainable.base_model.proj.weight.adapters["default"]
    assert template.dropout_key is None and template.lora_A is not None
    assert frozen.base_model.proj.weight.adapters["default"].dropout_key is not None
    x = jax.random.normal(getkey(), (3, 6))
    adapter = model.base_model.proj.weight.adapter("default")
    grads = eqx.filter_grad(lambda w: jnp.sum(use_implicit_args(_rows)(w, x) ** 2))(adapter)
    assert grads.dropout_key is None and grads.lora_A is not None
