"""LoHa and LoKr (PEFT's LyCORIS family) against dense formulas written out here and
against PEFT 0.21 in PyTorch on the same weights: logits both ways through PEFT's files,
gradients of every trained tensor (float32, and a bfloat16 base with float32 adapters),
merging, and training's dropouts."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from helpers import close
from safetensors.numpy import load_file
from test_peft_interop import (
    WEIGHTS,
    assert_same,
    assert_same_files,
    batch,
    jax_out,
    randomize_torch_adapters,
    randomized,
    torch_base,
    torch_out,
)

import peftx
from peftx.adapters import (
    AdapterSet,
    LoHaArray,
    LoKrArray,
    factorization,
    loha,
    lokr,
    unmerge,
    with_dropout,
)
from peftx.implicit import strict, use_implicit_args

EPS_BF16 = float(jnp.finfo(jnp.bfloat16).eps)
EPS_F32 = float(jnp.finfo(jnp.float32).eps)


def _randomized(adapter, key, scale=0.5):
    """`adapter` with every trained factor it holds redrawn, none zero."""
    fields = [f for f in type(adapter).peft_keys if getattr(adapter, f) is not None]
    keys = jax.random.split(key, len(fields))
    values = [scale * jax.random.normal(k, getattr(adapter, f).shape) for k, f in zip(keys, fields)]
    return eqx.tree_at(lambda a: [getattr(a, f) for f in fields], adapter, values)


def _dense_loha(a):
    """`(alpha/r) · (w1a @ w1b) ⊙ (w2a @ w2b)` in NumPy."""
    w1 = np.asarray(a.hada_w1_a) @ np.asarray(a.hada_w1_b)
    w2 = np.asarray(a.hada_w2_a) @ np.asarray(a.hada_w2_b)
    return a.alpha / a.r * w1 * w2


def _dense_lokr(a):
    """`(alpha/r) · kron(w1, w2)` in NumPy, each factor whole or `a @ b`."""

    def factor(i):
        whole = getattr(a, f"lokr_w{i}")
        if whole is not None:
            return np.asarray(whole)
        return np.asarray(getattr(a, f"lokr_w{i}_a")) @ np.asarray(getattr(a, f"lokr_w{i}_b"))

    return a.alpha / a.r * np.kron(factor(1), factor(2))


OUT, IN = 24, 32  # factorized (4, 6) and (4, 8)
ADAPTERS = {  # name: (constructor on a weight, dense ΔW, fields it holds)
    "loha": (
        lambda w, k: loha(w, r=3, alpha=5, key=k),
        _dense_loha,
        ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"),
    ),
    "lokr both factored": (
        lambda w, k: lokr(w, r=1, alpha=3, decompose_both=True, key=k),
        _dense_lokr,
        ("lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b"),
    ),
    "lokr whole": (
        lambda w, k: lokr(w, r=8, alpha=3, key=k),
        _dense_lokr,
        ("lokr_w1", "lokr_w2"),
    ),
    "lokr factor 2": (
        lambda w, k: lokr(w, r=2, alpha=3, decompose_factor=2, key=k),
        _dense_lokr,
        ("lokr_w1", "lokr_w2_a", "lokr_w2_b"),
    ),
}
LAYOUTS = {
    "x @ W.T": lambda w, x: x @ w.T,
    "vmap(W @ x)": lambda w, x: jax.vmap(lambda v: w @ v)(x),
    "(x @ W.T) @ W (rows meet x)": lambda w, x: (x @ w.T) @ w,
}


def test_factorization_is_peft_s():
    from peft.tuners.lokr.layer import factorization as peft_factorization

    for dim in (1, 7, 12, 16, 24, 32, 96, 127, 128, 256, 4096, 11008):
        for factor in (-1, 1, 2, 3, 4, 5, 8, 16):
            assert factorization(dim, factor) == peft_factorization(dim, factor), (dim, factor)


@pytest.mark.parametrize(
    "name, layout",
    [
        # the fast tier runs every layout on LoHa and on LoKr with both factors factored,
        # and the other LoKr factorizations on x @ W.T; the whole suite every pair
        pytest.param(
            name,
            layout,
            id=f"{name}-{layout}",
            marks=pytest.mark.variant_sweep
            if name in ("lokr whole", "lokr factor 2") and layout != "x @ W.T"
            else (),
        )
        for name in ADAPTERS
        for layout in LAYOUTS
    ],
)
def test_matches_dense_formula(name, layout, getkey):
    """Values and gradients (every factor and the input) against `x·(W + ΔW)ᵀ` with ΔW
    written out; the factors present are PEFT's for the layout."""
    build, dense, fields = ADAPTERS[name]
    fn = LAYOUTS[layout]
    weight = jax.random.normal(getkey(), (OUT, IN)) / 4
    adapter = _randomized(build(weight, getkey()), getkey())
    assert tuple(f for f in type(adapter).peft_keys if getattr(adapter, f) is not None) == fields
    x = jax.random.normal(getkey(), (5, IN))
    factors = [getattr(adapter, f) for f in fields]

    def with_factors(fs):
        return eqx.tree_at(lambda a: [getattr(a, f) for f in fields], adapter, fs)

    def loss(fs, x, implicit):
        a = with_factors(fs)
        if implicit:
            return jnp.sum(jnp.sin(use_implicit_args(fn)(a, x)))
        return jnp.sum(jnp.sin(fn(weight + a.delta(), x)))

    with strict():
        got = jax.jit(use_implicit_args(fn))(adapter, x)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(factors, x, True)
    want = fn(weight + jnp.asarray(dense(adapter)), x)
    close(got, want, tol=1e-4)
    assert not np.allclose(got, fn(weight, x), atol=1e-2)  # the update matters
    dense_grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(factors, x, False)
    close(grads, dense_grads, tol=1e-4)
    close(adapter.delta(), dense(adapter), tol=1e-5)


# LoKr: the fast tier runs its stacks under scan against PEFT (test_peftx_to_peft) and
# unmerges it in test_merge_and_unmerge; the whole suite here too
@pytest.mark.parametrize(
    "name", ["loha", pytest.param("lokr both factored", marks=pytest.mark.variant_sweep)]
)
def test_stacked_layers_under_scan_jvp_and_unmerge(name, getkey):
    """A stack of adapters (one per layer, `eqx.filter_vmap`) run by `lax.scan`: values,
    forward-mode derivatives (`jax.jvp` in the factors) against the dense stack; and
    `unmerge` gives back the base weight."""
    build, dense, fields = ADAPTERS[name]
    weights = jax.random.normal(getkey(), (3, OUT, OUT)) / 4
    layers = eqx.filter_vmap(lambda w, k: _randomized(build(w, k), k, 0.3))(
        weights, jax.random.split(getkey(), 3)
    )
    x = jax.random.normal(getkey(), (4, OUT))

    def forward(layers, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w.T), None), x, layers)[0]

    def with_factors(fs):
        return eqx.tree_at(lambda a: [getattr(a, f) for f in fields], layers, fs)

    factors = [getattr(layers, f) for f in fields]
    tangents = [jax.random.normal(getkey(), f.shape) for f in factors]
    with strict():
        got, d_got = jax.jvp(
            lambda fs: use_implicit_args(forward)(with_factors(fs), x), (factors,), (tangents,)
        )
    want, d_want = jax.jvp(
        lambda fs: forward(with_factors(fs).merged(weights), x), (factors,), (tangents,)
    )
    close((got, d_got), (want, d_want), tol=1e-4)
    assert not np.allclose(got, forward(weights, x), atol=1e-2)
    merged = layers.merged(weights)
    close(unmerge(merged, layers).weight, weights, tol=1e-5)


# ---------------------------------------------------------------- one layer against PEFT


class _Torch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(IN, OUT)


class _Proj(eqx.Module):
    proj: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(self.proj)(x)


LAYER_CONFIGS = {
    "loha": ("LoHaConfig", dict(r=3, alpha=5)),
    "lokr both factored": ("LoKrConfig", dict(r=1, alpha=3, decompose_both=True)),
    "lokr whole": ("LoKrConfig", dict(r=8, alpha=3)),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16 base"])
@pytest.mark.parametrize("name", list(LAYER_CONFIGS))
def test_layer_gradients_match_peft(name, dtype):
    """The output and the gradient of every trained tensor and of the input equal PEFT's
    for the same weights and loss; with a bfloat16 base, the float32 factors get float32
    gradients, as in PEFT."""
    cls, kwargs = LAYER_CONFIGS[name]
    torch.manual_seed(0)
    theirs = peft.get_peft_model(
        _Torch(), getattr(peft, cls)(target_modules=["proj"], init_weights=False, **kwargs)
    )
    layer = theirs.base_model.model.proj
    bf16 = dtype != "float32"
    if bf16:
        layer.base_layer.to(torch.bfloat16)
    params = {n.split(".")[0]: p for n, p in layer.named_parameters() if ".default" in n}
    assert all(p.dtype == torch.float32 for p in params.values())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, IN)).astype(np.float32)
    cot = rng.standard_normal((6, OUT)).astype(np.float32)
    x_t = torch.tensor(x, dtype=torch.bfloat16 if bf16 else torch.float32, requires_grad=True)
    out_t = layer(x_t)
    (out_t.float() * torch.tensor(cot)).sum().backward()

    linear = eqx.nn.Linear(IN, OUT, key=jax.random.key(0))
    base_dtype = jnp.bfloat16 if bf16 else jnp.float32
    linear = eqx.tree_at(
        lambda m: (m.weight, m.bias),
        linear,
        tuple(
            jnp.asarray(t.detach().float().numpy()).astype(base_dtype)
            for t in (layer.base_layer.weight, layer.base_layer.bias)
        ),
    )
    config = getattr(peftx, cls)(target_modules=["proj"], **kwargs)
    model = peftx.get_peft_model(_Proj(linear), config, key=jax.random.key(1))
    fields = list(params)

    def adapter_of(m):
        return m.base_model.proj.weight.adapters["default"]

    assert [
        f for f in type(adapter_of(model)).peft_keys if getattr(adapter_of(model), f) is not None
    ] == fields

    def run(factors, x):
        m = eqx.tree_at(lambda m: [getattr(adapter_of(m), f) for f in fields], model, factors)
        return m(x)

    factors = [jnp.asarray(params[f].detach().numpy()) for f in fields]
    x_j = jnp.asarray(x).astype(base_dtype)
    with strict():
        out, vjp = jax.vjp(run, factors, x_j)
        grads, dx = vjp(jnp.asarray(cot).astype(out.dtype))
    assert out.dtype == base_dtype and dx.dtype == base_dtype
    want = out_t.detach().float().numpy()
    scale = np.abs(want).max()
    tol = (4 * EPS_BF16 if bf16 else 1e-5) * scale
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=0, atol=tol)
    for f, g in zip(fields, grads):
        assert g.dtype == jnp.float32
        ref = params[f].grad.numpy()
        # float32 sums over the same (rounded) inputs: summation order only
        atol = 8 * EPS_F32 * math.sqrt(6 * max(IN, OUT)) * np.abs(ref).max()
        np.testing.assert_allclose(np.asarray(g), ref, rtol=0, atol=atol, err_msg=f)
    ref_dx = x_t.grad.float().numpy()
    dx_tol = (2 * EPS_BF16 if bf16 else 1e-5) * np.abs(ref_dx).max()
    np.testing.assert_allclose(np.asarray(dx, np.float32), ref_dx, rtol=0, atol=dx_tol)


# ---------------------------------------------------------------- whole models, both ways


CASES = {
    "loha": (
        "LoHaConfig",
        dict(
            r=2,
            alpha=4,
            target_modules=["q_proj", "v_proj", "up_proj"],
            rank_pattern={"up_proj": 4},
            alpha_pattern={"v_proj": 3},
        ),
    ),
    "lokr": (
        "LoKrConfig",
        dict(r=1, alpha=2, decompose_both=True, target_modules=["q_proj", "k_proj", "down_proj"]),
    ),
    "lokr-all-linear": (
        "LoKrConfig",
        dict(r=8, alpha=4, decompose_factor=2, target_modules="all-linear"),
    ),
}


def _assert_torch_holds(theirs, directory):
    """PEFT's state dict of the adapter is the file, key for key and value for value."""
    file = load_file(str(directory / WEIGHTS))
    state = peft.utils.get_peft_model_state_dict(theirs)
    assert sorted(file) == sorted(state)
    for k, v in state.items():
        np.testing.assert_array_equal(v.detach().float().numpy(), file[k], err_msg=k)
        assert np.abs(file[k]).max() > 0, k


@pytest.mark.parametrize(
    "case",
    [
        # lokr-all-linear's file is checked against PEFT's in
        # test_peft_to_peftx_files_and_counts: the fast tier loads LoKr into PEFT once
        pytest.param(c, marks=pytest.mark.variant_sweep) if c == "lokr-all-linear" else c
        for c in CASES
    ],
)
def test_peftx_to_peft(case, tiny_llama, tmp_path):
    path, base = tiny_llama
    cls, kwargs = CASES[case]
    ours = peftx.get_peft_model(base(), getattr(peftx, cls)(**kwargs), key=jax.random.key(0))
    ours = randomized(ours, jax.random.key(1))
    ours.save_pretrained(tmp_path)
    theirs = peft.PeftModel.from_pretrained(torch_base(path, "llama"), tmp_path).eval()
    _assert_torch_holds(theirs, tmp_path)
    ids, mask = batch("llama")
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, "llama"), mask, reference)


@pytest.mark.parametrize("case, layout", [(c, "stacked") for c in CASES] + [("lokr", "unrolled")])
def test_peft_to_peftx_files_and_counts(case, layout, tiny_llama, tmp_path):
    """PEFT's adapter loads with equal logits; peftx's own adapter for the same config has
    the keys, shapes and dtypes of PEFT's file and PEFT's parameter counts; peftx writes
    PEFT's tensors back exactly."""
    path, base = tiny_llama
    cls, kwargs = CASES[case]
    their_config = getattr(peft, cls)(init_weights=False, **kwargs)
    theirs = peft.get_peft_model(torch_base(path, "llama"), their_config)
    theirs = randomize_torch_adapters(theirs, 3, names=("hada_", "lokr_"))
    theirs.eval().save_pretrained(tmp_path / "peft")
    ours = peftx.PeftModel.from_pretrained(base(layout), tmp_path / "peft")
    ids, mask = batch("llama")
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, "llama"), mask, reference)
    ours.save_pretrained(tmp_path / "again")
    assert_same_files(tmp_path / "peft", tmp_path / "again")

    fresh = peftx.get_peft_model(base(layout), getattr(peftx, cls)(**kwargs), key=jax.random.key(0))
    fresh.save_pretrained(tmp_path / "fresh")
    mine, peft_file = (
        load_file(str(tmp_path / "fresh" / WEIGHTS)),
        load_file(str(tmp_path / "peft" / WEIGHTS)),
    )
    assert {k: (v.shape, v.dtype) for k, v in mine.items()} == {
        k: (v.shape, v.dtype) for k, v in peft_file.items()
    }
    assert fresh.get_nb_trainable_parameters() == theirs.get_nb_trainable_parameters()
    saved = peft.PeftConfig.from_pretrained(tmp_path / "fresh")
    assert type(saved) is getattr(peft, cls)
    assert sorted(saved.to_dict()) == sorted(their_config.to_dict())


@pytest.mark.parametrize("case", ["loha", "lokr"])
def test_merge_and_unmerge(case, tiny_llama):
    _, base = tiny_llama
    cls, kwargs = CASES[case]
    ours = randomized(
        peftx.get_peft_model(base(), getattr(peftx, cls)(**kwargs), key=jax.random.key(0)),
        jax.random.key(1),
    )
    ids, mask = batch("llama")
    unmerged = jax_out(ours, ids, mask)
    merged = ours.merge_and_unload()
    assert_same(jax_out(merged, ids, mask), unmerged, mask, jax_out(base(), ids, mask))
    s = next(
        x
        for x in jax.tree.leaves(ours, is_leaf=lambda x: isinstance(x, AdapterSet))
        if isinstance(x, AdapterSet)
    )
    adapter = s.adapter("default")
    close(unmerge(adapter.merged(s.weight), adapter).weight, s.weight, tol=1e-6)


# ---------------------------------------------------------------- training's dropouts


@pytest.mark.parametrize("kind", ["loha", "lokr", "lokr scaled"])
def test_rank_and_module_dropout(kind, getkey):
    """In training each row of ΔW is kept with probability `1 - rank_dropout` (LoHa, and
    LoKr with `rank_dropout_scale`, divide the kept rows by the fraction kept) and the
    whole update with probability `1 - module_dropout`; without a key, ΔW exactly."""
    out, in_ = 64, 16
    weight = jax.random.normal(getkey(), (out, in_))
    rates = dict(rank_dropout=0.25, module_dropout=0.3)
    if kind == "loha":
        a = loha(weight, r=2, init_weights=False, key=getkey(), **rates)
    else:
        a = lokr(
            weight,
            r=2,
            init="random",
            key=getkey(),
            rank_dropout_scale=kind == "lokr scaled",
            **rates,
        )
    x = jnp.eye(in_)
    delta = np.asarray(a.delta())

    @jax.jit
    def update(a, key=None):
        a = a if key is None else with_dropout(a, key)
        return (use_implicit_args(lambda w, x: x @ w.T)(a, x) - x @ weight.T).T

    close(update(a), delta, tol=1e-5)  # evaluation
    rescaled = kind != "lokr"
    skipped, kept_rows = 0, []
    trials = 100
    for i in range(trials):
        got = np.asarray(update(a, jax.random.key(i)))
        if np.abs(got).max() == 0:
            skipped += 1
            continue
        kept = np.abs(got).max(axis=1) > 0
        factor = out / kept.sum() if rescaled else 1.0
        close(got[kept], factor * delta[kept], tol=1e-4)
        kept_rows.append(kept.mean())
    # binomial counts within 5 standard deviations
    assert abs(skipped - 0.3 * trials) < 5 * math.sqrt(trials * 0.3 * 0.7)
    n = len(kept_rows) * out
    assert abs(np.mean(kept_rows) - 0.75) < 5 * math.sqrt(0.75 * 0.25 / n)


# ---------------------------------------------------------------- what is refused


def test_refusals(tiny_llama):
    _, base = tiny_llama
    with pytest.raises(ValueError, match="use_effective_conv2d"):
        peftx.LoKrConfig(use_effective_conv2d=True)
    with pytest.raises((TypeError, ValueError), match="init_weights"):
        peftx.LoHaConfig(init_weights="lycoris")
    with pytest.raises(ValueError, match="decompose_factor"):
        peftx.LoKrConfig(decompose_factor=0)
    with pytest.raises(ValueError, match="rank_dropout"):
        peftx.LoHaConfig(rank_dropout=1.0)
    conv = eqx.nn.Conv2d(3, 4, 3, key=jax.random.key(0))
    with pytest.raises(peftx.UnsupportedTargetError, match="Linear layers only"):
        peftx.get_peft_model(
            _Holder(conv), peftx.LoHaConfig(target_modules=["layer"]), key=jax.random.key(0)
        )
    two = peftx.get_peft_model(
        base(), peftx.LoKrConfig(target_modules=["q_proj"]), key=jax.random.key(0)
    ).add_adapter("b", peftx.LoKrConfig(target_modules=["q_proj"]), key=jax.random.key(1))
    ids, mask = batch("llama")
    with pytest.raises(ValueError, match="PEFT does not do for LOKR"):
        two(jnp.asarray(ids), jnp.asarray(mask), adapter_names=["default", "b"])
    with pytest.raises(ValueError, match="LoKr factors w1"):
        LoKrArray(jnp.ones((6, 8)), jnp.ones((2, 2)), jnp.ones((3, 3)), r=1, alpha=1)
    with pytest.raises(ValueError, match="LoHa factors do not fit"):
        LoHaArray(jnp.ones((6, 8)), *(jnp.ones((6, 2)),) * 4, alpha=1)


class _Holder(eqx.Module):
    layer: eqx.Module
