"""MiSS against dense formulas written out here and against HF PEFT 0.21.2 in PyTorch:
one layer's outputs and gradients (float32, and a bfloat16 base with a float32 block) for
each variant, files both ways on a tiny Llama, gradients of every block, merging, no dense
update in a training step (but for "bat", which PEFT builds dense too), forward mode, the
stacked layout, and a `[miss]` job whose adapter PEFT reads."""

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
    WEIGHTS,
    assert_job_adapter_reads_in_peft,
    assert_layer_matches_peft,
    assert_peft_file_gradients_and_merge,
    assert_same,
    assert_step_builds_no_dense_and_jvp,
    batch,
    jax_out,
    randomize_torch_adapters,
    randomized,
    torch_base,
    torch_out,
)

import peftx
from peftx.adapters import MissArray, miss, unmerge
from peftx.implicit import DenseWeightError, assert_no_dense, strict, use_implicit_args

OUT, IN = 8, 12

# name: miss() arguments; "balance" at r=5 shards 12 inputs as 5 + 5 + 2 (padded)
VARIANTS = {
    "balance": dict(r=5),
    "mini": dict(r=5, mini_r=2, init_weights="mini"),
    "bat": dict(r=4, init_weights="bat"),
}


def _dense_delta(a, weight):
    """ΔW written out entry by entry from PEFT's definitions, in jnp (differentiable)."""
    block = a.miss_block
    out, in_ = weight.shape
    if a.variant == "bat":
        r = block.shape[-1]
        rows = []
        for o in range(out // r):
            cols = []
            for i in range(in_ // r):
                w = weight[o * r : (o + 1) * r, i * r : (i + 1) * r]
                cols.append(w @ block[o] + block[o])
            rows.append(jnp.concatenate(cols, axis=1))
        return jnp.concatenate(rows, axis=0)
    r = block.shape[0]
    cols = np.arange(out) % block.shape[1] if a.variant == "mini" else np.arange(out)
    return block[np.arange(in_) % r][:, cols].T  # ΔW[o, j] = block[j mod r, o (mod mini_r)]


def _random(variant, key, weight=None):
    kw, kb = jax.random.split(key)
    weight = jax.random.normal(kw, (OUT, IN)) / 4 if weight is None else weight
    a = miss(weight, **VARIANTS[variant])
    return eqx.tree_at(lambda a: a.miss_block, a, 0.3 * jax.random.normal(kb, a.miss_block.shape))


LAYOUTS = {
    "x @ W.T": lambda w, x: x @ w.T,
    "vmap(W @ x)": lambda w, x: jax.vmap(lambda v: w @ v)(x),
    "(x @ W.T) @ W (rows meet x)": lambda w, x: (x @ w.T) @ w,
}


@pytest.mark.parametrize(
    "variant, layout",
    [
        # the fast tier runs every layout on "balance" and x @ W.T on the others
        pytest.param(
            v,
            lay,
            id=f"{v}-{lay}",
            marks=pytest.mark.variant_sweep if v != "balance" and lay != "x @ W.T" else (),
        )
        for v in VARIANTS
        for lay in LAYOUTS
    ],
)
def test_matches_dense_formula(variant, layout, getkey):
    """Values, gradients of `miss_block` and of `x`, and jvp against `x·(W + ΔW)ᵀ` with ΔW
    written out; `merged` is the same formula."""
    a = _random(variant, getkey())
    x = jax.random.normal(getkey(), (3, IN))
    delta = lambda a: _dense_delta(a, a.weight)  # noqa: E731
    assert_matches_dense_formula(a, ("miss_block",), delta, LAYOUTS[layout], x, getkey())


@pytest.mark.parametrize(
    "variant", ["balance", "bat", pytest.param("mini", marks=pytest.mark.variant_sweep)]
)
def test_stacked_layers_under_scan_jvp_and_unmerge(variant, getkey):
    """A stack of adapters (`eqx.filter_vmap`) run by `lax.scan`: values and jvp against
    the dense stack; `unmerge` gives the base weight back (for "bat", PEFT's solve)."""
    weights = jax.random.normal(getkey(), (3, OUT, OUT)) / 4
    kwargs = dict(VARIANTS[variant], r=4)
    layers = eqx.filter_vmap(
        lambda w, k: eqx.tree_at(
            lambda a: a.miss_block,
            miss(w, **kwargs),
            0.3 * jax.random.normal(k, miss(w, **kwargs).miss_block.shape),
        )
    )(weights, jax.random.split(getkey(), 3))
    x = jax.random.normal(getkey(), (5, OUT))

    def forward(layers, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w.T), None), x, layers)[0]

    def with_block(b):
        return eqx.tree_at(lambda a: a.miss_block, layers, b)

    def dense(b):
        one = [
            eqx.tree_at(lambda a: a.miss_block, miss(w, **kwargs), b[i])
            for i, w in enumerate(weights)
        ]
        return jnp.stack([w + _dense_delta(a, w) for a, w in zip(one, weights)])

    tangent = jax.random.normal(getkey(), layers.miss_block.shape)
    with strict():
        got, d_got = jax.jvp(
            lambda b: use_implicit_args(forward)(with_block(b), x), (layers.miss_block,), (tangent,)
        )
    want, d_want = jax.jvp(lambda b: forward(dense(b), x), (layers.miss_block,), (tangent,))
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


@pytest.mark.parametrize(
    "variant, dtype",
    [
        # bf16 on one variant in the fast tier, every variant in the whole suite
        (v, d)
        if d == "float32" or v == "balance"
        else pytest.param(v, d, marks=pytest.mark.variant_sweep)
        for v in VARIANTS
        for d in ("float32", "bfloat16 base")
    ],
)
def test_layer_matches_peft(variant, dtype):
    """The output and the gradients of `miss_block` and of the input equal PEFT's for the
    same weights and loss; a bfloat16 base keeps a float32 block and float32 gradients."""
    kwargs = dict(VARIANTS[variant])
    torch.manual_seed(0)
    config = peft.MissConfig(target_modules=["proj"], **kwargs)
    layer = peft.get_peft_model(_Torch(), config).base_model.model.proj
    block_t = layer.miss_block["default"]
    with torch.no_grad():
        block_t.copy_(0.3 * torch.randn(block_t.shape, generator=torch.Generator().manual_seed(1)))
    ours = peftx.MissConfig(target_modules=["proj"], **kwargs)
    assert_layer_matches_peft(
        layer, ours, ("miss_block",), (6, IN), dtype, _Proj, grad_terms=6 * IN
    )


# ---------------------------------------------------------------- whole models, both ways


TARGETS = ["q_proj", "v_proj", "down_proj", "up_proj"]
CASES = {  # r=5 divides none of the input sizes: every layer pads its last shard
    "balance": dict(r=5, target_modules=TARGETS),
    "mini": dict(r=4, mini_r=8, init_weights="mini", target_modules=TARGETS),
    "bat": dict(r=4, init_weights="bat", target_modules=TARGETS),
}


# peft_to_peftx's test writes PEFT's file back key for key: the fast tier's round trip
@pytest.mark.torch_round_trip
@pytest.mark.parametrize(
    "case",
    ["balance", *(pytest.param(c, marks=pytest.mark.variant_sweep) for c in ("mini", "bat"))],
)
def test_peftx_to_peft(case, tiny_llama, tmp_path):
    """A stacked peftx adapter with random blocks: PEFT loads the file (its state dict is
    the file) to peftx's logits; peftx's config file is one PEFT reads as a MissConfig
    with PEFT's keys; counts are PEFT's."""
    path, base = tiny_llama
    ours = peftx.get_peft_model(base(), peftx.MissConfig(**CASES[case]), key=jax.random.key(0))
    ours = randomized(ours, jax.random.key(1))
    ours.save_pretrained(tmp_path)
    theirs = peft.PeftModel.from_pretrained(torch_base(path, "llama"), tmp_path).eval()
    file = load_file(str(tmp_path / WEIGHTS))
    state = peft.utils.get_peft_model_state_dict(theirs)
    assert sorted(file) == sorted(state) and all(k.endswith(".miss_block") for k in file)
    for k, v in state.items():
        np.testing.assert_array_equal(v.numpy(), file[k], err_msg=k)
    ids, mask = batch("llama")
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, "llama"), mask, reference)
    their_config = peft.MissConfig(**CASES[case])
    saved = peft.PeftConfig.from_pretrained(tmp_path)
    assert type(saved) is peft.MissConfig
    assert sorted(saved.to_dict()) == sorted(their_config.to_dict())
    assert list(peftx.MissConfig(**CASES[case]).to_dict()) == list(their_config.to_dict())
    fresh = peft.get_peft_model(torch_base(path, "llama"), their_config)
    assert ours.get_nb_trainable_parameters() == fresh.get_nb_trainable_parameters()


@pytest.mark.parametrize(
    "case, layout",
    [
        ("balance", "stacked"),
        ("balance", "unrolled"),
        pytest.param("bat", "stacked", marks=pytest.mark.variant_sweep),
        # mini takes balance's path with a tiled result (its layer test runs in the fast tier)
        pytest.param("mini", "stacked", marks=pytest.mark.variant_sweep),
    ],
)
def test_peft_to_peftx_files_gradients_and_merge(case, layout, tiny_llama, tmp_path):
    """PEFT's adapter loads with equal logits and is written back exactly; the gradient of
    every block for one loss is PEFT's; merged logits are the unmerged ones."""
    path, base = tiny_llama
    theirs = randomize_torch_adapters(
        peft.get_peft_model(torch_base(path, "llama"), peft.MissConfig(**CASES[case])),
        3,
        names=("miss_block",),
        count=3 * len(TARGETS),
    )
    s = assert_peft_file_gradients_and_merge(theirs, path, base(layout), tmp_path, "miss_block")
    adapter = s.adapter("default")
    close(unmerge(adapter.merged(s.weight), adapter).weight, s.weight, tol=1e-5)


def test_peft_merge_is_peftx_merged():
    """PEFT's own `merge` (a full weight for balance/mini, `W + ΔW(W)` for bat) gives
    `merged`'s weight, padding included."""
    for variant, kwargs in VARIANTS.items():
        torch.manual_seed(0)
        theirs = peft.get_peft_model(_Torch(), peft.MissConfig(target_modules=["proj"], **kwargs))
        layer = theirs.base_model.model.proj
        with torch.no_grad():
            layer.miss_block["default"].normal_(0, 0.3)
        w = jnp.asarray(layer.base_layer.weight.detach().numpy())
        a = eqx.tree_at(
            lambda a: a.miss_block,
            miss(w, **kwargs),
            jnp.asarray(layer.miss_block["default"].detach().numpy()),
        )
        layer.merge()
        close(a.merged(w), layer.base_layer.weight.detach().numpy(), tol=1e-6)
        layer.unmerge()
        close(a.unmerged(a.merged(w)), layer.base_layer.weight.detach().numpy(), tol=1e-5)


# ---------------------------------------------------------------- training


@pytest.mark.parametrize("case", ["balance", pytest.param("mini", marks=pytest.mark.variant_sweep)])
def test_training_step_builds_no_dense_update_and_jvp(case, tiny_llama):
    """A training step (forward and backward, dropout on) of the stacked model builds no
    weight-sized array; forward mode agrees with reverse mode."""
    _, base = tiny_llama
    config = peftx.MissConfig(**CASES[case], miss_dropout=0.1)
    model = peftx.get_peft_model(base(), config, key=jax.random.key(0))
    assert_step_builds_no_dense_and_jvp(randomized(model, jax.random.key(4)), dropout=True)


def test_bat_builds_the_weight_as_peft_does(tiny_llama):
    """ "bat" multiplies the weight by the block: `assert_no_dense` names the built weight."""
    _, base = tiny_llama
    model = peftx.get_peft_model(base(), peftx.MissConfig(**CASES["bat"]), key=jax.random.key(0))
    trainable, frozen = peftx.partition(model)
    ids = jnp.ones((3, 7), jnp.int32)

    def step(t, frozen):
        return jax.grad(lambda t: jnp.mean(eqx.combine(t, frozen)(ids).logits ** 2))(t)

    with pytest.raises(DenseWeightError):
        assert_no_dense(step, trainable, frozen)


def test_two_adapters_switch_and_refuse_mixed_batches(tiny_llama):
    _, base = tiny_llama
    model = peftx.get_peft_model(
        base(),
        peftx.MissConfig(r=4, target_modules=["q_proj"], init_weights=False),
        key=jax.random.key(0),
    )
    model = model.add_adapter(
        "b",
        peftx.MissConfig(r=8, target_modules=["q_proj"], init_weights=False),
        key=jax.random.key(1),
    )
    ids, mask = batch("llama")
    assert (
        np.abs(jax_out(model, ids, mask) - jax_out(model.set_adapter("b"), ids, mask)).max() > 1e-3
    )
    with pytest.raises(ValueError, match="within a batch, which PEFT does not do for MISS"):
        model(jnp.asarray(ids), jnp.asarray(mask), adapter_names=["default", "b"])


def test_refusals(tiny_llama):
    _, base = tiny_llama
    w = jnp.ones((OUT, IN))
    with pytest.raises(ValueError, match="must be less than or equal to in_features"):
        miss(w, r=IN + 1)
    with pytest.raises(ValueError, match=r"fully divisible into \[r, r\]"):
        miss(w, r=5, init_weights="bat")
    with pytest.raises(ValueError, match="mini_r .3. must divide out_features"):
        miss(w, r=4, mini_r=3, init_weights="mini")
    with pytest.raises(ValueError, match="miss_block of shape"):
        MissArray(w, jnp.zeros((3, OUT + 1)))
    with pytest.raises(ValueError, match="miss_dropout"):
        peftx.MissConfig(miss_dropout=1.0)
    with pytest.raises((ValueError, TypeError), match="bias"):
        peftx.MissConfig(bias="lora_only")
    with pytest.raises((ValueError, TypeError), match="init_weights"):
        peftx.MissConfig(init_weights="lycoris")
    with pytest.raises(ValueError, match="MiSS on 'model.layers.0-2.self_attn.v_proj'.*r. .64"):
        peftx.get_peft_model(
            base(), peftx.MissConfig(r=64, target_modules=["v_proj"]), key=jax.random.key(0)
        )
    with pytest.warns(UserWarning, match="miss_dropout=0.1 has no effect"):
        peftx.get_peft_model(
            base(), peftx.MissConfig(**CASES["bat"], miss_dropout=0.1), key=jax.random.key(0)
        )


def test_toml_table(tmp_path):
    file = tmp_path / "job.toml"
    file.write_text(
        '[miss]\nr = 16\ninit_weights = "mini"\nmini_r = 4\ntarget_modules = ["q_proj"]\n'
    )
    assert peftx.from_toml(file) == peftx.MissConfig(
        r=16, init_weights="mini", mini_r=4, target_modules=("q_proj",)
    )
    file.write_text("[miss]\nmini = 4\n")
    with pytest.raises(ValueError, match="did you mean 'mini_r'"):
        peftx.from_toml(file)


@pytest.mark.command_run
def test_miss_job_trains_and_writes_what_peft_reads(llama, tmp_path, capsys):
    """A `[miss]` job trains and writes PEFT's adapter, which PEFT reads to peftx's
    logits."""
    table = '[miss]\nr = 4\ntarget_modules = ["q_proj", "v_proj", "down_proj"]'
    assert_job_adapter_reads_in_peft(llama, tmp_path, capsys, table, "MISS")
