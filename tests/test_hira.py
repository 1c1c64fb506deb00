"""HiRA against a dense formula written out here and against HF PEFT 0.21.2 in PyTorch:
one layer's outputs and gradients (float32, and a bfloat16 base with float32 factors),
PEFT's initialization and merge, files both ways on a tiny Llama (a `rank_pattern` too)
and GPT-2's Conv1D, gradients of every factor, forward mode, the stacked layout, what a
training step builds (HiRA's update has full rank: one adapted weight forward, its
cotangent backward, nothing else weight-sized), and a `[hira]` job PEFT reads."""

import json
import math
from collections import Counter

import equinox as eqx
import jax
import jax.extend.core as jexc
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
    batch,
    jax_out,
    randomize_torch_adapters,
    randomized,
    torch_base,
    torch_out,
)

import peftx
import peftx.models as pm
from peftx.adapters import HiraArray, adapter_set, hira, unmerge, with_dropout
from peftx.implicit import strict, use_implicit_args

OUT, IN, R = 8, 12, 3


def _dense_delta(a, weight):
    """ΔW = W ⊙ (B·A), entry by entry as PEFT's forward builds it."""
    return weight * (a.hira_B @ a.hira_A)


def _with(a, factors):
    return eqx.tree_at(lambda a: (a.hira_A, a.hira_B), a, tuple(factors))


def _random(key, weight=None):
    kw, ka, kb = jax.random.split(key, 3)
    weight = jax.random.normal(kw, (OUT, IN)) if weight is None else weight
    a = hira(weight, r=R, key=ka)
    return _with(
        a, [0.4 * jax.random.normal(k, f.shape) for k, f in zip((ka, kb), (a.hira_A, a.hira_B))]
    )


LAYOUTS = {
    "x @ W.T": lambda w, x: x @ w.T,
    "vmap(W @ x)": lambda w, x: jax.vmap(lambda v: w @ v)(x),
    "(x @ W.T) @ W (rows meet x)": lambda w, x: (x @ w.T) @ w,
}


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(lay, marks=() if lay == "x @ W.T" else pytest.mark.variant_sweep)
        for lay in LAYOUTS
    ],
)
def test_matches_dense_formula(layout, getkey):
    """Values, gradients of both factors and of `x`, and jvp against `x·(W + W ⊙ B·A)ᵀ`
    written out; `merged` is the same formula."""
    a = _random(getkey())
    x = jax.random.normal(getkey(), (5, IN))
    delta = lambda a: _dense_delta(a, a.weight)  # noqa: E731
    assert_matches_dense_formula(a, ("hira_A", "hira_B"), delta, LAYOUTS[layout], x, getkey())


def test_stacked_layers_under_scan_jvp_and_unmerge(getkey):
    """A stack of adapters (`eqx.filter_vmap`) run by `lax.scan`: values and jvp against
    the dense stack; `unmerge` gives the base weight back."""
    weights = jax.random.normal(getkey(), (3, OUT, OUT)) / 2
    layers = eqx.filter_vmap(lambda w, k: _random(k, w))(weights, jax.random.split(getkey(), 3))
    assert layers.hira_A.shape == (3, R, OUT) and layers.hira_B.shape == (3, OUT, R)
    x = jax.random.normal(getkey(), (5, OUT))
    factors = (layers.hira_A, layers.hira_B)

    def forward(layers, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w.T), None), x, layers)[0]

    def dense(b):
        return weights + weights * (b[1] @ b[0])

    tangent = tuple(jax.random.normal(getkey(), f.shape) for f in factors)
    with strict():
        got, d_got = jax.jvp(
            lambda b: use_implicit_args(forward)(_with(layers, b), x), (factors,), (tangent,)
        )
    want, d_want = jax.jvp(lambda b: forward(dense(b), x), (factors,), (tangent,))
    close((got, d_got), (want, d_want), tol=1e-4)
    assert not np.allclose(got, forward(weights, x), atol=1e-2)
    merged = layers.merged(weights)
    close(unmerge(merged, layers).weight, weights, tol=1e-5)


def test_two_active_adapters_add_their_updates(getkey):
    """Two HiRA adapters active on one weight (an `AdapterSet`) add `W ⊙ B_k·A_k` each to
    the base product, as PEFT's forward loops over its active adapters."""
    w = jax.random.normal(getkey(), (OUT, IN))
    a, b = _random(getkey(), w), _random(getkey(), w)
    both = adapter_set(w, {"a": a, "b": b}, ("a", "b"))
    x = jax.random.normal(getkey(), (5, IN))
    with strict():
        got = jax.jit(use_implicit_args(lambda s, x: x @ s.T))(both, x)
    close(got, x @ (w + _dense_delta(a, w) + _dense_delta(b, w)).T, tol=1e-4)


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
    return [layer.hira_A["default"], layer.hira_B["default"]]


@pytest.mark.parametrize(
    "dtype", ["float32", pytest.param("bfloat16 base", marks=pytest.mark.variant_sweep)]
)
def test_layer_matches_peft(dtype):
    """The output and the gradients of both factors and of the input equal PEFT's for the
    same weights and loss; a bfloat16 base keeps float32 factors and float32 gradients
    (peftx multiplies by the adapted weight in float32, where PEFT adds a float32 update
    to its bfloat16 base output: the same up to that output's rounding)."""
    torch.manual_seed(0)
    theirs = peft.get_peft_model(_Torch(), peft.HiraConfig(r=R, target_modules=["proj"]))
    layer = theirs.base_model.model.proj
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in _torch_factors(layer):
            t.copy_(0.4 * torch.randn(t.shape, generator=gen))
    ours = peftx.HiraConfig(r=R, target_modules=["proj"])
    fields = ("hira_A", "hira_B")
    assert_layer_matches_peft(
        layer, ours, fields, (6, IN), dtype, _Proj, grad_terms=6 * IN, dx_ulps=4
    )


def test_peft_merge_is_peftx_merged():
    """PEFT's own `merge` (`W + W ⊙ B·A`) gives `merged`'s weight; its `unmerge` (a kept
    copy of the base) is `unmerged` (a division)."""
    torch.manual_seed(0)
    theirs = peft.get_peft_model(_Torch(), peft.HiraConfig(r=R, target_modules=["proj"]))
    layer = theirs.base_model.model.proj
    with torch.no_grad():
        for t in _torch_factors(layer):
            t.normal_(0, 0.4)
    w = jnp.asarray(layer.base_layer.weight.detach().numpy())
    a = _with(
        hira(w, r=R, key=jax.random.key(0)),
        [jnp.asarray(t.detach().numpy()) for t in _torch_factors(layer)],
    )
    layer.merge()
    close(a.merged(w), layer.base_layer.weight.detach().numpy(), tol=1e-6)
    layer.unmerge()
    close(a.unmerged(a.merged(w)), layer.base_layer.weight.detach().numpy(), tol=1e-5)


def test_initialization_is_peft(getkey):
    """PEFT's init: `hira_A (r, in)` Kaiming-uniform with bound `1/√in` (`True`) or normal
    with standard deviation `1/r` (`"gaussian"`), `hira_B (out, r)` zeros; `False`:
    both standard normal. PEFT's own layer has the same shapes and dtypes."""
    w = jnp.zeros((64, 96))
    a = hira(w, r=8, key=getkey())
    assert a.hira_A.shape == (8, 96) and a.hira_B.shape == (64, 8)
    assert a.hira_A.dtype == a.hira_B.dtype == jnp.float32
    assert not a.hira_B.any()
    bound = 1 / math.sqrt(96)
    assert np.abs(a.hira_A).max() <= bound and np.abs(a.hira_A).max() > 0.9 * bound
    g = hira(w, r=8, init_weights="gaussian", key=getkey())
    assert not g.hira_B.any()
    np.testing.assert_allclose(np.std(g.hira_A), 1 / 8, rtol=0.1)
    for init in (False, None):
        n = hira(w, r=8, init_weights=init, key=getkey())
        for f in (n.hira_A, n.hira_B):
            np.testing.assert_allclose(np.std(f), 1.0, rtol=0.1)
    torch.manual_seed(0)
    layer = peft.get_peft_model(
        _Torch(), peft.HiraConfig(r=R, target_modules=["proj"])
    ).base_model.model.proj
    ours = hira(jnp.zeros((OUT, IN)), r=R, key=getkey())
    assert [(tuple(t.shape), str(t.dtype)) for t in _torch_factors(layer)] == [
        (f.shape, f"torch.{f.dtype}") for f in (ours.hira_A, ours.hira_B)
    ]


# ---------------------------------------------------------------- whole models, both ways


TARGETS = ["q_proj", "v_proj", "down_proj", "up_proj"]
PLAIN = dict(r=4, target_modules=TARGETS)


@pytest.mark.variant_sweep
def test_rank_pattern_is_ignored_as_peft_does(tiny_llama, tmp_path):
    """PEFT 0.21.2's HiRA builds every layer at rank `r` whatever `rank_pattern` says
    (its dispatch reads `config.r`); peftx builds the same shapes, and warns."""
    path, base = tiny_llama
    kwargs = dict(r=4, target_modules=["q_proj"], rank_pattern={"layers.1.self_attn.q_proj": 2})
    theirs = peft.get_peft_model(torch_base(path, "llama"), peft.HiraConfig(**kwargs))
    with pytest.warns(UserWarning, match="rank_pattern .* has no effect: PEFT 0.21.2"):
        config = peftx.HiraConfig(**kwargs)
    ours = peftx.get_peft_model(base(), config, key=jax.random.key(0))
    ours.save_pretrained(tmp_path)
    file = load_file(str(tmp_path / WEIGHTS))
    want = peft.utils.get_peft_model_state_dict(theirs)
    assert {k: v.shape for k, v in file.items()} == {k: tuple(v.shape) for k, v in want.items()}


# peft_to_peftx's test writes PEFT's file back key for key: the fast tier's round trip
@pytest.mark.torch_round_trip
def test_peftx_to_peft(tiny_llama, tmp_path):
    """A stacked peftx adapter with random factors: PEFT loads the file (its state dict is
    the file, float32, PEFT's names and shapes) to peftx's logits; peftx's config file is
    one PEFT reads as a HiraConfig with PEFT's keys; counts are PEFT's."""
    path, base = tiny_llama
    ours = peftx.get_peft_model(base(), peftx.HiraConfig(**PLAIN), key=jax.random.key(0))
    ours = randomized(ours, jax.random.key(1))
    ours.save_pretrained(tmp_path)
    theirs = peft.PeftModel.from_pretrained(torch_base(path, "llama"), tmp_path).eval()
    file = load_file(str(tmp_path / WEIGHTS))
    state = peft.utils.get_peft_model_state_dict(theirs)
    assert sorted(file) == sorted(state)
    assert {k.rsplit(".", 1)[-1] for k in file} == {"hira_A", "hira_B"}
    for k, v in state.items():
        assert v.dtype == torch.float32 and file[k].dtype == np.float32, k
        np.testing.assert_array_equal(v.numpy(), file[k], err_msg=k)
    ids, mask = batch("llama")
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, "llama"), mask, reference)
    their_config = peft.HiraConfig(**PLAIN)
    saved = peft.PeftConfig.from_pretrained(tmp_path)
    assert type(saved) is peft.HiraConfig
    assert sorted(saved.to_dict()) == sorted(their_config.to_dict())
    assert list(peftx.HiraConfig(**PLAIN).to_dict()) == list(their_config.to_dict())
    fresh = peft.get_peft_model(torch_base(path, "llama"), their_config)
    assert ours.get_nb_trainable_parameters() == fresh.get_nb_trainable_parameters()


@pytest.mark.parametrize(
    "layout", ["stacked", pytest.param("unrolled", marks=pytest.mark.variant_sweep)]
)
def test_peft_to_peftx_files_gradients_and_merge(layout, tiny_llama, tmp_path):
    """PEFT's adapter loads with equal logits and is written back exactly; the gradient of
    every factor for one loss is PEFT's; merged logits are the unmerged ones."""
    path, base = tiny_llama
    theirs = randomize_torch_adapters(
        peft.get_peft_model(torch_base(path, "llama"), peft.HiraConfig(**PLAIN)),
        3,
        names=("hira_",),
        count=2 * 3 * len(TARGETS),
    )
    s = assert_peft_file_gradients_and_merge(theirs, path, base(layout), tmp_path, "hira_")
    adapter = s.adapter("default")
    assert isinstance(adapter, HiraArray)
    close(unmerge(adapter.merged(s.weight), adapter).weight, s.weight, tol=1e-5)


@pytest.mark.variant_sweep
def test_gpt2_conv1d_both_ways(tmp_path):
    """GPT-2's Conv1D layers (stored `(in, out)`, PEFT's `fan_in_fan_out`): PEFT's adapter
    loads with equal logits and is written back exactly; peftx's own, saved, is one PEFT
    reads to peftx's logits, with `fan_in_fan_out` set."""
    torch.manual_seed(0)
    model = _randomize_torch_base(BUILDERS["gpt2"]().eval(), seed=7)
    path = tmp_path / "gpt2"
    model.save_pretrained(path)
    config = dict(r=4, target_modules=["c_attn", "c_proj", "c_fc"])
    theirs = randomize_torch_adapters(
        peft.get_peft_model(
            torch_base(path, "gpt2"), peft.HiraConfig(**config, fan_in_fan_out=True)
        ),
        5,
        names=("hira_",),
        count=2 * 4 * 3,  # 2 factors of c_attn, attn.c_proj, c_fc, mlp.c_proj in 3 layers
    )
    theirs.save_pretrained(tmp_path / "peft")
    base = pm.from_pretrained(path)
    ours = peftx.PeftModel.from_pretrained(base, tmp_path / "peft")
    ids, mask = batch("gpt2")
    reference = torch_out(torch_base(path, "gpt2"), ids, mask, "gpt2")
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, "gpt2"), mask, reference)
    ours.save_pretrained(tmp_path / "again")
    assert_same_files(tmp_path / "peft", tmp_path / "again")

    mine = peftx.get_peft_model(base, peftx.HiraConfig(**config), key=jax.random.key(0))
    mine = randomized(mine, jax.random.key(1))
    mine.save_pretrained(tmp_path / "mine")
    assert json.loads((tmp_path / "mine" / "adapter_config.json").read_text())["fan_in_fan_out"]
    read = peft.PeftModel.from_pretrained(torch_base(path, "gpt2"), tmp_path / "mine").eval()
    assert_same(jax_out(mine, ids, mask), torch_out(read, ids, mask, "gpt2"), mask, reference)


# ---------------------------------------------------------------- training


def _weight_sized(jaxpr, shapes):
    """The primitive of every equation output of `jaxpr` (nested ones included) whose
    shape is one of `shapes` or one of them transposed."""
    wanted = {s for shape in shapes for s in (shape, shape[::-1])}
    found = []
    for eqn in jaxpr.eqns:
        for body in jexc.jaxprs_in_params(eqn.params):
            found += _weight_sized(body, shapes)
        found += [
            eqn.primitive.name
            for var in eqn.outvars
            if tuple(getattr(var.aval, "shape", ())) in wanted
        ]
    return found


def test_training_step_builds_one_adapted_weight_and_its_cotangent(tiny_llama):
    """HiRA's update has full rank, so a training step builds weight-sized arrays, and
    for each adapted weight exactly these: `B·A` (one product), the adapted weight
    `W ⊙ (1 + B·A)` (elementwise, one fusion to XLA), and backward the adapted weight's
    cotangent `gᵀ·x` (one product) and `W ⊙ gᵀ·x`, from which the factors' gradients
    follow by products with the factors. The stack's `jax.checkpoint` saves `B·A` (a
    `reduce_precision` marks the residual; at this size, `16·r > min(out, in)`, the
    stack's policy keeps such products) and recomputes the adapted weight backward. No
    copy, cast or transpose of `W`, nothing else. Forward mode agrees with reverse mode."""
    _, base = tiny_llama
    model = randomized(
        peftx.get_peft_model(base(), peftx.HiraConfig(**PLAIN), key=jax.random.key(0)),
        jax.random.key(4),
    )
    trainable, frozen = peftx.partition(model)
    ids = jnp.ones((3, 7), jnp.int32)

    def loss(t):
        return jnp.mean(eqx.combine(t, frozen)(ids).logits ** 2)

    def step(t, frozen):
        return jax.grad(loss)(t)

    # the four targets have four distinct shapes; the stack is one scan body
    shapes = [(32, 32), (16, 32), (32, 64), (64, 32)]
    jaxpr, _, _ = eqx.filter_make_jaxpr(step)(trainable, frozen)
    per_weight = {
        "dot_general": 2,  # B·A; gᵀ·x
        "reduce_precision": 1,  # B·A saved for the backward
        "add": 2,  # 1 + B·A, forward and recomputed
        "mul": 3,  # W ⊙ (1 + B·A), forward and recomputed; W ⊙ gᵀ·x
    }
    want = Counter({k: v * len(shapes) for k, v in per_weight.items()})
    assert Counter(_weight_sized(jaxpr.jaxpr, shapes)) == want

    with strict():
        grads = eqx.filter_jit(step)(trainable, frozen)
        tangent, _ = peftx.partition(randomized(model, jax.random.key(5)))
        _, forward = eqx.filter_jit(lambda t, d: jax.jvp(loss, (t,), (d,)))(trainable, tangent)
    leaves = zip(jax.tree.leaves(grads), jax.tree.leaves(tangent))
    reverse = sum(jnp.vdot(g, d) for g, d in leaves)
    np.testing.assert_allclose(forward, reverse, rtol=1e-4)


@pytest.mark.variant_sweep
def test_dropout_acts_on_the_update_only(tiny_llama):
    """With `hira_dropout` and keys, the update sees a dropped-out input and the base the
    plain one (the base product is then separate): logits differ from the keyless ones,
    and with the rate near 0 they are the keyless ones."""
    _, base = tiny_llama
    ids = jnp.ones((2, 5), jnp.int32)
    key = jax.random.key(3)

    def logits(rate, keyed):
        config = peftx.HiraConfig(**PLAIN, hira_dropout=rate)
        m = randomized(peftx.get_peft_model(base(), config, key=jax.random.key(0)), key)
        return eqx.filter_jit(lambda m: (with_dropout(m, key) if keyed else m)(ids).logits)(m)

    plain = logits(0.5, False)
    assert np.abs(logits(0.5, True) - plain).max() > 1e-2
    close(logits(1e-9, True), plain, tol=1e-5)


@pytest.mark.variant_sweep
def test_two_adapters_switch_and_refuse_mixed_batches(tiny_llama):
    _, base = tiny_llama
    model = peftx.get_peft_model(
        base(),
        peftx.HiraConfig(r=4, target_modules=["q_proj"], init_weights=False),
        key=jax.random.key(0),
    )
    model = model.add_adapter(
        "b",
        peftx.HiraConfig(r=2, target_modules=["q_proj"], init_weights="gaussian"),
        key=jax.random.key(1),
    )
    ids, mask = batch("llama")
    assert (
        np.abs(jax_out(model, ids, mask) - jax_out(model.set_adapter("b"), ids, mask)).max() > 1e-3
    )
    with pytest.raises(ValueError, match="within a batch, which PEFT does not do for HIRA"):
        model(jnp.asarray(ids), jnp.asarray(mask), adapter_names=["default", "b"])


def test_refusals(tiny_llama):
    _, base = tiny_llama
    w = jnp.ones((OUT, IN))
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="`r` should be a positive integer value"):
        hira(w, r=0, key=key)
    with pytest.raises((ValueError, TypeError), match="init_weights"):
        hira(w, r=2, init_weights="pissa", key=key)
    with pytest.raises(ValueError, match=r"hira_A \(2, 11\) and hira_B \(8, 2\) do not fit"):
        HiraArray(w, jnp.zeros((2, 11)), jnp.zeros((OUT, 2)))
    with pytest.raises(TypeError, match="share one floating-point dtype"):
        HiraArray(w, jnp.zeros((2, IN)), jnp.zeros((OUT, 2), jnp.bfloat16))
    with pytest.raises(ValueError, match="hira_dropout"):
        peftx.HiraConfig(hira_dropout=1.0)
    with pytest.raises(ValueError, match="rank_pattern"):
        peftx.HiraConfig(rank_pattern={"q_proj": 0})
    with pytest.raises((ValueError, TypeError), match="init_weights"):
        peftx.HiraConfig(init_weights="olora")
    with pytest.raises(peftx.UnsupportedTargetError, match="HiRA adapts Linear layers only"):
        peftx.get_peft_model(
            base(), peftx.HiraConfig(target_modules=["embed_tokens"]), key=jax.random.key(0)
        )


def test_toml_table(tmp_path):
    file = tmp_path / "job.toml"
    file.write_text(
        '[hira]\nr = 16\ninit_weights = "gaussian"\ntarget_modules = ["q_proj"]\n'
        "rank_pattern = {v_proj = 4}\n"
    )
    assert peftx.from_toml(file) == peftx.HiraConfig(
        r=16, init_weights="gaussian", target_modules=("q_proj",), rank_pattern={"v_proj": 4}
    )
    file.write_text("[hira]\ndropout = 0.1\n")
    with pytest.raises(ValueError, match="did you mean 'hira_dropout'"):
        peftx.from_toml(file)


@pytest.mark.command_run
def test_hira_job_trains_and_writes_what_peft_reads(llama, tmp_path, capsys):
    """A `[hira]` job trains and writes PEFT's adapter, which PEFT reads to peftx's
    logits."""
    table = '[hira]\nr = 4\ntarget_modules = ["q_proj", "v_proj", "down_proj"]'
    assert_job_adapter_reads_in_peft(llama, tmp_path, capsys, table, "HIRA")
