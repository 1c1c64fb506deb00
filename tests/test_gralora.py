"""GraLoRA against a dense formula written out here and against HF PEFT 0.21.2 in PyTorch:
one layer's outputs and gradients (float32, and a bfloat16 base with float32 factors)
with and without the hybrid LoRA part, files both ways on a tiny Llama, gradients of
every factor, merging (PEFT's own merge too), no dense update in a training step,
forward mode, the stacked layout, and a `[gralora]` job whose adapter PEFT reads."""

import json
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from helpers import assert_matches_dense_formula, close
from safetensors.numpy import load_file
from test_peft_interop import (
    BUILDERS,
    WEIGHTS,
    _randomize_torch_base,
    assert_job_adapter_reads_in_peft,
    assert_layer_matches_peft,
    assert_peft_file_gradients_and_merge,
    assert_same,
    assert_same_files,
    assert_step_builds_no_dense_and_jvp,
    batch,
    jax_out,
    randomize_torch_adapters,
    randomized,
    torch_base,
    torch_out,
)

import peftx
import peftx.models as pm
from peftx.adapters import GraloraArray, gralora, unmerge
from peftx.implicit import strict, use_implicit_args

OUT, IN = 8, 12

# name: gralora() arguments; k=2 cuts (8, 12) into (4, 6) blocks, k=4 into (2, 3)
VARIANTS = {
    "plain": dict(r=4, gralora_k=2, alpha=4),  # scaling 1: small values for sin
    "hybrid": dict(r=4, hybrid_r=2, gralora_k=4, alpha=12),
}
FIELDS = ("gralora_A", "gralora_B", "gralora_A_general", "gralora_B_general")


def _held(a):
    return [f for f in FIELDS if getattr(a, f) is not None]


def _dense_delta(a):
    """ΔW written out block by block from PEFT's forward, in jnp (differentiable): block
    `(j, n)` is `(A[n][:, j·s:(j+1)·s] · B[j][n·s:(n+1)·s, :])ᵀ`, plus `B_g·A_g`."""
    k, r = a.gralora_A.shape[0], a.gralora_A.shape[-1]
    s = r // k
    rows = []
    for j in range(k):
        cols = [
            (a.gralora_A[n][:, j * s : (j + 1) * s] @ a.gralora_B[j][n * s : (n + 1) * s]).T
            for n in range(k)
        ]
        rows.append(jnp.concatenate(cols, axis=1))
    d = jnp.concatenate(rows, axis=0)
    if a.gralora_A_general is not None:
        d = d + a.gralora_B_general @ a.gralora_A_general
    return a.scaling * d


def _with(a, values):
    return eqx.tree_at(lambda a: [getattr(a, f) for f in _held(a)], a, list(values))


def _random(variant, key, weight=None):
    kw, kb = jax.random.split(key)
    weight = jax.random.normal(kw, (OUT, IN)) / 4 if weight is None else weight
    a = gralora(weight, **VARIANTS[variant], key=kb)
    keys = jax.random.split(kb, 4)
    return _with(
        a, [0.3 * jax.random.normal(k, getattr(a, f).shape) for k, f in zip(keys, _held(a))]
    )


LAYOUTS = {
    "x @ W.T": lambda w, x: x @ w.T,
    "vmap(W @ x)": lambda w, x: jax.vmap(lambda v: w @ v)(x),
    "(x @ W.T) @ W (rows meet x)": lambda w, x: (x @ w.T) @ w,
}


@pytest.mark.parametrize(
    "variant, layout",
    [
        # the fast tier runs every layout on "hybrid" and x @ W.T on "plain"
        pytest.param(
            v,
            lay,
            id=f"{v}-{lay}",
            marks=pytest.mark.variant_sweep if v != "hybrid" and lay != "x @ W.T" else (),
        )
        for v in VARIANTS
        for lay in LAYOUTS
    ],
)
def test_matches_dense_formula(variant, layout, getkey):
    """Values, gradients of every factor and of `x`, and jvp against `x·(W + ΔW)ᵀ` with
    ΔW written out; `merged` is the same formula."""
    a = _random(variant, getkey())
    x = jax.random.normal(getkey(), (3, IN))
    assert_matches_dense_formula(a, _held(a), _dense_delta, LAYOUTS[layout], x, getkey())


@pytest.mark.parametrize(
    "variant", ["hybrid", pytest.param("plain", marks=pytest.mark.variant_sweep)]
)
def test_stacked_layers_under_scan_jvp_and_unmerge(variant, getkey):
    """A stack of adapters (`eqx.filter_vmap`) run by `lax.scan`: values and jvp against
    the dense stack; `unmerge` gives the base weight back."""
    weights = jax.random.normal(getkey(), (3, OUT, OUT)) / 4
    kwargs = VARIANTS[variant]

    def one(w, k):
        a = gralora(w, **kwargs, key=k)
        keys = jax.random.split(k, 4)
        return _with(
            a, [0.3 * jax.random.normal(q, getattr(a, f).shape) for q, f in zip(keys, _held(a))]
        )

    layers = eqx.filter_vmap(one)(weights, jax.random.split(getkey(), 3))
    x = jax.random.normal(getkey(), (5, OUT))
    factors = [getattr(layers, f) for f in _held(layers)]

    def forward(layers, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w.T), None), x, layers)[0]

    def dense(b):
        single = [
            _with(gralora(w, **kwargs, key=jax.random.key(0)), [f[i] for f in b])
            for i, w in enumerate(weights)
        ]
        return jnp.stack([w + _dense_delta(a) for a, w in zip(single, weights)])

    tangent = [jax.random.normal(getkey(), f.shape) for f in factors]
    with strict():
        got, d_got = jax.jvp(
            lambda b: use_implicit_args(forward)(_with(layers, b), x), (factors,), (tangent,)
        )
    want, d_want = jax.jvp(lambda b: forward(dense(b), x), (factors,), (tangent,))
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


def _torch_factors(layer):
    """PEFT's factors of `layer` in FIELDS' order (those it holds)."""
    out = [layer.gralora_A["default"], layer.gralora_B["default"]]
    if layer.hybrid_r["default"] > 0:
        out += [
            layer.gralora_A_general["default"].weight,
            layer.gralora_B_general["default"].weight,
        ]
    return out


@pytest.mark.parametrize(
    "variant, dtype",
    [
        # bf16 on one variant in the fast tier, every variant in the whole suite
        (v, d)
        if d == "float32" or v == "hybrid"
        else pytest.param(v, d, marks=pytest.mark.variant_sweep)
        for v in VARIANTS
        for d in ("float32", "bfloat16 base")
    ],
)
def test_layer_matches_peft(variant, dtype):
    """The output and the gradients of every factor and of the input equal PEFT's for the
    same weights and loss; a bfloat16 base keeps float32 factors and float32 gradients."""
    kwargs = dict(VARIANTS[variant])
    torch.manual_seed(0)
    config = peft.GraloraConfig(target_modules=["proj"], **kwargs)
    layer = peft.get_peft_model(_Torch(), config).base_model.model.proj
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in _torch_factors(layer):
            t.copy_(0.3 * torch.randn(t.shape, generator=gen))
    fields = FIELDS if layer.hybrid_r["default"] > 0 else FIELDS[:2]
    ours = peftx.GraloraConfig(target_modules=["proj"], **kwargs)
    assert_layer_matches_peft(layer, ours, fields, (6, IN), dtype, _Proj, grad_terms=6 * IN)


def test_peft_merge_is_peftx_merged():
    """PEFT's own `get_delta_weight` (its scatter and permutation) gives `merged`'s
    weight; PEFT's `unmerge` is `unmerged`."""
    for variant, kwargs in VARIANTS.items():
        torch.manual_seed(0)
        theirs = peft.get_peft_model(
            _Torch(), peft.GraloraConfig(target_modules=["proj"], **kwargs)
        )
        layer = theirs.base_model.model.proj
        with torch.no_grad():
            for t in _torch_factors(layer):
                t.normal_(0, 0.3)
        w = jnp.asarray(layer.base_layer.weight.detach().numpy())
        a = _with(
            gralora(w, **kwargs, key=jax.random.key(0)),
            [jnp.asarray(t.detach().numpy()) for t in _torch_factors(layer)],
        )
        layer.merge()
        close(a.merged(w), layer.base_layer.weight.detach().numpy(), tol=1e-5)
        layer.unmerge()
        close(a.unmerged(a.merged(w)), layer.base_layer.weight.detach().numpy(), tol=1e-5)


def test_initialization_is_peft(getkey):
    """PEFT's init: `A` factors Kaiming-uniform with bound `1/√fan_in`, `B` factors zeros
    (`init_weights=True`) or Kaiming-uniform (`False`)."""
    w = jnp.zeros((64, 96))
    a = gralora(w, r=8, hybrid_r=4, gralora_k=4, key=getkey())
    assert a.gralora_A.shape == (4, 24, 8) and a.gralora_B.shape == (4, 8, 16)
    assert a.gralora_A_general.shape == (4, 96) and a.gralora_B_general.shape == (64, 4)
    assert not a.gralora_B.any() and not a.gralora_B_general.any()
    for value, fan_in in ((a.gralora_A, 24), (a.gralora_A_general, 96)):
        bound = 1 / math.sqrt(fan_in)
        assert np.abs(value).max() <= bound and np.abs(value).max() > 0.9 * bound
    r = gralora(w, r=8, hybrid_r=4, gralora_k=4, init_weights=False, key=getkey())
    for value, fan_in in ((r.gralora_B, 8), (r.gralora_B_general, 4)):
        bound = 1 / math.sqrt(fan_in)
        assert np.abs(value).max() <= bound and np.abs(value).max() > 0.9 * bound
    assert a.scaling == 64 / 12
    torch.manual_seed(0)
    layer = peft.get_peft_model(
        _Torch(), peft.GraloraConfig(target_modules=["proj"], r=4, hybrid_r=2)
    ).base_model.model.proj
    ours = gralora(jnp.zeros((OUT, IN)), r=4, hybrid_r=2, key=getkey())
    assert [tuple(t.shape) for t in _torch_factors(layer)] == [
        getattr(ours, f).shape for f in FIELDS
    ]
    assert layer.scaling["default"] == ours.scaling


# ---------------------------------------------------------------- whole models, both ways


TARGETS = ["q_proj", "v_proj", "down_proj", "up_proj"]
# k·r (48 for hybrid) matches none of the tiny weights' sizes, as at real sizes: the
# block-diagonal factors (k·r, in) and (out, k·r) must not look weight-sized
CASES = {
    "plain": dict(r=4, gralora_k=2, target_modules=TARGETS),
    "hybrid": dict(r=12, hybrid_r=2, gralora_k=4, alpha=20, target_modules=TARGETS),
}


# peft_to_peftx's test writes PEFT's file back key for key: the fast tier's round trip
@pytest.mark.torch_round_trip
@pytest.mark.parametrize("case", ["hybrid", pytest.param("plain", marks=pytest.mark.variant_sweep)])
def test_peftx_to_peft(case, tiny_llama, tmp_path):
    """A stacked peftx adapter with random factors: PEFT loads the file (its state dict is
    the file) to peftx's logits; peftx's config file is one PEFT reads as a GraloraConfig
    with PEFT's keys; counts are PEFT's."""
    path, base = tiny_llama
    ours = peftx.get_peft_model(base(), peftx.GraloraConfig(**CASES[case]), key=jax.random.key(0))
    ours = randomized(ours, jax.random.key(1))
    ours.save_pretrained(tmp_path)
    theirs = peft.PeftModel.from_pretrained(torch_base(path, "llama"), tmp_path).eval()
    file = load_file(str(tmp_path / WEIGHTS))
    state = peft.utils.get_peft_model_state_dict(theirs)
    assert sorted(file) == sorted(state)
    suffixes = {
        k.rsplit(".self_attn.", 1)[-1].rsplit(".mlp.", 1)[-1].split(".", 1)[1] for k in file
    }
    want = {"gralora_A", "gralora_B"}
    if CASES[case].get("hybrid_r"):
        want |= {"gralora_A_general.weight", "gralora_B_general.weight"}
    assert suffixes == want
    for k, v in state.items():
        assert v.dtype == torch.float32 and file[k].dtype == np.float32, k
        np.testing.assert_array_equal(v.numpy(), file[k], err_msg=k)
    ids, mask = batch("llama")
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, "llama"), mask, reference)
    their_config = peft.GraloraConfig(**CASES[case])
    saved = peft.PeftConfig.from_pretrained(tmp_path)
    assert type(saved) is peft.GraloraConfig
    assert sorted(saved.to_dict()) == sorted(their_config.to_dict())
    assert list(peftx.GraloraConfig(**CASES[case]).to_dict()) == list(their_config.to_dict())
    fresh = peft.get_peft_model(torch_base(path, "llama"), their_config)
    assert ours.get_nb_trainable_parameters() == fresh.get_nb_trainable_parameters()


@pytest.mark.parametrize(
    "case, layout",
    [
        ("hybrid", "stacked"),
        pytest.param("plain", "stacked", marks=pytest.mark.variant_sweep),
        ("hybrid", "unrolled"),
    ],
)
def test_peft_to_peftx_files_gradients_and_merge(case, layout, tiny_llama, tmp_path):
    """PEFT's adapter loads with equal logits and is written back exactly; the gradient of
    every factor for one loss is PEFT's; merged logits are the unmerged ones."""
    path, base = tiny_llama
    per_layer = 4 if CASES[case].get("hybrid_r") else 2  # the hybrid part's two factors
    theirs = randomize_torch_adapters(
        peft.get_peft_model(torch_base(path, "llama"), peft.GraloraConfig(**CASES[case])),
        3,
        names=("gralora_",),
        count=per_layer * 3 * len(TARGETS),
    )
    s = assert_peft_file_gradients_and_merge(theirs, path, base(layout), tmp_path, "gralora_")
    adapter = s.adapter("default")
    assert isinstance(adapter, GraloraArray)
    close(unmerge(adapter.merged(s.weight), adapter).weight, s.weight, tol=1e-5)


@pytest.mark.variant_sweep  # the layer tests cover fan_in_fan_out; this is the whole model
def test_gpt2_conv1d_both_ways(tmp_path):
    """GPT-2's Conv1D layers (stored `(in, out)`, PEFT's `fan_in_fan_out`): PEFT's adapter
    loads with equal logits and is written back exactly; peftx's own, saved, is one PEFT
    reads to peftx's logits, with `fan_in_fan_out` set."""
    torch.manual_seed(0)
    model = _randomize_torch_base(BUILDERS["gpt2"]().eval(), seed=7)
    path = tmp_path / "gpt2"
    model.save_pretrained(path)
    config = dict(r=4, hybrid_r=2, target_modules=["c_attn", "c_proj", "c_fc"])
    theirs = randomize_torch_adapters(
        peft.get_peft_model(
            torch_base(path, "gpt2"), peft.GraloraConfig(**config, fan_in_fan_out=True)
        ),
        5,
        names=("gralora_",),
        count=4 * 4 * 3,  # 4 factors of c_attn, attn.c_proj, c_fc, mlp.c_proj in 3 layers
    )
    theirs.save_pretrained(tmp_path / "peft")
    base = pm.from_pretrained(path)
    ours = peftx.PeftModel.from_pretrained(base, tmp_path / "peft")
    ids, mask = batch("gpt2")
    reference = torch_out(torch_base(path, "gpt2"), ids, mask, "gpt2")
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, "gpt2"), mask, reference)
    ours.save_pretrained(tmp_path / "again")
    assert_same_files(tmp_path / "peft", tmp_path / "again")

    mine = peftx.get_peft_model(base, peftx.GraloraConfig(**config), key=jax.random.key(0))
    mine = randomized(mine, jax.random.key(1))
    mine.save_pretrained(tmp_path / "mine")
    assert json.loads((tmp_path / "mine" / "adapter_config.json").read_text())["fan_in_fan_out"]
    read = peft.PeftModel.from_pretrained(torch_base(path, "gpt2"), tmp_path / "mine").eval()
    assert_same(jax_out(mine, ids, mask), torch_out(read, ids, mask, "gpt2"), mask, reference)


# ---------------------------------------------------------------- training


@pytest.mark.parametrize("case", ["hybrid", pytest.param("plain", marks=pytest.mark.variant_sweep)])
def test_training_step_builds_no_dense_update_and_jvp(case, tiny_llama):
    """A training step (forward and backward, dropout on) of the stacked model builds no
    weight-sized array; forward mode agrees with reverse mode; dropout acts."""
    _, base = tiny_llama
    config = peftx.GraloraConfig(**CASES[case], gralora_dropout=0.1)
    model = peftx.get_peft_model(base(), config, key=jax.random.key(0))
    assert_step_builds_no_dense_and_jvp(randomized(model, jax.random.key(4)), dropout=True)


def test_two_adapters_switch_and_refuse_mixed_batches(tiny_llama):
    _, base = tiny_llama
    model = peftx.get_peft_model(
        base(),
        peftx.GraloraConfig(r=4, target_modules=["q_proj"], init_weights=False),
        key=jax.random.key(0),
    )
    model = model.add_adapter(
        "b",
        peftx.GraloraConfig(r=8, hybrid_r=2, target_modules=["q_proj"], init_weights=False),
        key=jax.random.key(1),
    )
    ids, mask = batch("llama")
    assert (
        np.abs(jax_out(model, ids, mask) - jax_out(model.set_adapter("b"), ids, mask)).max() > 1e-3
    )
    with pytest.raises(ValueError, match="within a batch, which PEFT does not do for GRALORA"):
        model(jnp.asarray(ids), jnp.asarray(mask), adapter_names=["default", "b"])


def test_refusals(tiny_llama):
    _, base = tiny_llama
    w = jnp.ones((OUT, IN))
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="r should be divisible by gralora_k, but got 5 and 2"):
        gralora(w, r=5, key=key)
    with pytest.raises(ValueError, match="out_features should be divisible by gralora_k"):
        gralora(w, r=6, gralora_k=3, key=key)
    with pytest.raises(ValueError, match="`hybrid_r` should be a non-negative"):
        gralora(w, r=4, hybrid_r=-1, key=key)
    with pytest.raises(ValueError, match="gralora_A .* do not fit weight"):
        GraloraArray(w, jnp.zeros((2, 5, 4)), jnp.zeros((2, 4, 4)))
    with pytest.raises(ValueError, match="hybrid part needs both"):
        GraloraArray(w, jnp.zeros((2, 6, 4)), jnp.zeros((2, 4, 4)), jnp.zeros((2, IN)))
    with pytest.raises(ValueError, match="gralora_dropout"):
        peftx.GraloraConfig(gralora_dropout=1.0)
    with pytest.raises(ValueError, match="hybrid_r"):
        peftx.GraloraConfig(hybrid_r=-1)
    with pytest.raises(ValueError, match="r should be divisible by gralora_k"):
        peftx.GraloraConfig(r=6, gralora_k=4)
    with pytest.raises((ValueError, TypeError), match="bias"):
        peftx.GraloraConfig(bias="lora_only")
    # v_proj (16, 32) is not cut in 3
    with pytest.raises(ValueError, match="GraLoRA on 'model.layers.0-2.self_attn.v_proj'.*by"):
        peftx.get_peft_model(
            base(),
            peftx.GraloraConfig(r=6, gralora_k=3, target_modules=["v_proj"]),
            key=jax.random.key(0),
        )


def test_toml_table(tmp_path):
    file = tmp_path / "job.toml"
    file.write_text('[gralora]\nr = 16\nhybrid_r = 4\ngralora_k = 4\ntarget_modules = ["q_proj"]\n')
    assert peftx.from_toml(file) == peftx.GraloraConfig(
        r=16, hybrid_r=4, gralora_k=4, target_modules=("q_proj",)
    )
    file.write_text("[gralora]\nhybrid_rank = 4\n")
    with pytest.raises(ValueError, match="did you mean 'hybrid_r'"):
        peftx.from_toml(file)


@pytest.mark.command_run
def test_gralora_job_trains_and_writes_what_peft_reads(llama, tmp_path, capsys):
    """A `[gralora]` job trains and writes PEFT's adapter, which PEFT reads to peftx's
    logits."""
    table = '[gralora]\nr = 4\nhybrid_r = 2\ntarget_modules = ["q_proj", "v_proj", "down_proj"]'
    assert_job_adapter_reads_in_peft(llama, tmp_path, capsys, table, "GRALORA")
