"""SHiRA against dense formulas written out here and against HF PEFT 0.21.2 in PyTorch:
PEFT's random mask bit for bit, one layer's outputs and gradients (float32, and a
bfloat16 base with float32 values), files both ways on a tiny Llama (the index set
included), gradients of every layer's values, merging, no dense update in a training
step, forward mode, the stacked layout, and a `[shira]` job whose adapter PEFT reads."""

import json
from collections import Counter

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from helpers import all_eqns, close
from peft.tuners.shira.mask_functions import random_mask
from safetensors.numpy import load_file
from test_peft_interop import (
    WEIGHTS,
    assert_job_adapter_reads_in_peft,
    assert_layer_matches_peft,
    assert_peft_file_gradients_and_merge,
    assert_same,
    batch,
    jax_out,
    randomize_torch_adapters,
    randomized,
    torch_base,
    torch_out,
)

import peftx
from peftx.adapters import ShiraArray, adapter_set, random_indices, shira, unmerge
from peftx.implicit import assert_no_dense, strict, use_implicit_args

EPS_BF16 = float(jnp.finfo(jnp.bfloat16).eps)
EPS_F32 = float(jnp.finfo(jnp.float32).eps)
OUT, IN = 8, 12


def _dense_delta(a):
    """ΔW written out entry by entry, in jnp (differentiable): one-hot sums."""
    rows, cols = np.asarray(a.shira_indices)
    one_r = jnp.asarray(np.arange(OUT)[:, None] == rows[None], a.shira_weight.dtype)
    one_c = jnp.asarray(np.arange(IN)[:, None] == cols[None], a.shira_weight.dtype)
    return (one_r * a.shira_weight[None]) @ one_c.T


def _random(key, weight=None, r=2, seed=None):
    kw, kv = jax.random.split(key)
    weight = jax.random.normal(kw, (OUT, IN)) / 4 if weight is None else weight
    return shira(weight, r=r, random_seed=seed, init_weights=False, key=kv)


# ---------------------------------------------------------------- the mask


@pytest.mark.parametrize(
    "shape, r, seed",
    [((OUT, IN), 2, None), ((32, 64), 4, 0), ((96, 40), 3, 2**40 + 7), ((17, 5), 1, 123)],
)
def test_random_indices_are_peft_s(shape, r, seed):
    """`random_indices` is PEFT's `random_mask` read back as PEFT reads it (torch.where),
    for a fresh generator's seed (None) and seeds beyond 32 bits."""
    layer = torch.nn.Linear(shape[1], shape[0])
    mask = random_mask(layer, r, random_seed=seed)
    rows, cols = torch.where(mask == 1.0)
    want = torch.stack([rows, cols]).to(torch.int).numpy()
    got = random_indices(*shape, r, seed)
    assert got.dtype == np.int32 and got.shape == (2, r * sum(shape))
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- one layer, dense formula


LAYOUTS = {
    "x @ W.T": lambda w, x: x @ w.T,
    "vmap(W @ x)": lambda w, x: jax.vmap(lambda v: w @ v)(x),
    "(x @ W.T) @ W (rows meet x)": lambda w, x: (x @ w.T) @ w,
}
# k = 2·(8 + 12) = 40 entries against out·in = 96: one token's product gathers and
# scatters (40 ≤ 96), five tokens' builds W + ΔW (200 > 96)
TOKENS = {"gathered": 1, "adapted weight": 5}


def _case(layout, path, dtype):
    marks = ()
    if layout != "x @ W.T":
        marks = pytest.mark.layout_sweep
    elif dtype != "float32":
        marks = pytest.mark.variant_sweep
    return pytest.param(layout, path, dtype, marks=marks, id=f"{layout}-{path}-{dtype}")


@pytest.mark.parametrize(
    "layout, path, dtype",
    [
        _case(lay, path, dtype)
        for lay in LAYOUTS
        for path in TOKENS
        for dtype in ("float32", "bfloat16 base")
        if lay == "x @ W.T" or dtype == "float32"
    ],
)
def test_matches_dense_formula(layout, path, dtype, getkey):
    """Both forms of the product (gathered for few tokens, the adapted weight for many):
    values, gradients of `shira_weight` and of `x`, and jvp against `x·(W + ΔW)ᵀ` with ΔW
    written out in float32; `merged` is the same formula. A bfloat16 base (and input)
    keeps float32 values, within bfloat16's rounding of the output. The gathered form's
    gradient builds no weight-sized array."""
    fn = LAYOUTS[layout]
    bf16 = dtype != "float32"
    base_dtype = jnp.bfloat16 if bf16 else jnp.float32
    a = _random(getkey())
    a = eqx.tree_at(lambda a: a.weight, a, a.weight.astype(base_dtype))
    x = jax.random.normal(getkey(), (TOKENS[path], IN)).astype(base_dtype)
    w32 = a.weight.astype(jnp.float32)
    close(a.merged(a.weight), (w32 + _dense_delta(a)).astype(base_dtype), tol=1e-6)

    def output(values, x):
        return use_implicit_args(fn)(eqx.tree_at(lambda a: a.shira_weight, a, values), x)

    def dense_output(values, x):
        delta = _dense_delta(eqx.tree_at(lambda a: a.shira_weight, a, values))
        return fn(w32 + delta, x.astype(jnp.float32))

    def loss(values, x, implicit):
        y = (output if implicit else dense_output)(values, x)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    grad = jax.grad(loss, argnums=(0, 1))
    tangent = jax.random.normal(getkey(), a.shira_weight.shape)
    with strict():
        if path == "gathered":
            assert_no_dense(grad, a.shira_weight, x, True, weight_shapes=[(OUT, IN)])
        got, d_got = jax.jit(lambda v, t: jax.jvp(lambda v: output(v, x), (v,), (t,)))(
            a.shira_weight, tangent
        )
        grads = jax.jit(grad, static_argnums=2)(a.shira_weight, x, True)
    want, d_want = jax.jvp(lambda v: dense_output(v, x), (a.shira_weight,), (tangent,))
    dense = grad(a.shira_weight, x, False)
    assert (got.dtype, grads[0].dtype, grads[1].dtype) == (base_dtype, jnp.float32, base_dtype)
    assert not np.allclose(got, fn(a.weight, x), atol=1e-2)  # the update matters
    # bfloat16: the output rounded once or twice (the gathered form rounds the base
    # product, then the sum); the gradients sum terms of the rounded output
    eps = EPS_BF16 if bf16 else EPS_F32
    for ulps, pairs in [(4, [(got, want), (d_got, d_want)]), (8, zip(grads, dense))]:
        for g, w in pairs:
            w = np.asarray(w, np.float32)
            bound = (ulps if bf16 else 64) * eps * np.abs(w).max()
            np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=0, atol=bound)


def test_stacked_layers_under_scan_jvp_and_unmerge(getkey):
    """A stack of adapters (`eqx.filter_vmap`, each its own index set) run by `lax.scan`:
    values and jvp against the dense stack; one product with the whole stack (the layers
    a batch axis), in both forms (k = 32 entries of 64: one token gathers, five build
    W + ΔW); `unmerge` gives the base weight back."""
    weights = jax.random.normal(getkey(), (3, OUT, OUT)) / 4
    keys = jax.random.split(getkey(), 3)
    layers = eqx.filter_vmap(
        lambda w, k: shira(w, r=2, init_weights=False, key=k),
        in_axes=(0, 0),
    )(weights, keys)
    # a different index set per layer (PEFT's random mask gives one per shape)
    layers = eqx.tree_at(
        lambda a: a.shira_indices,
        layers,
        jnp.stack([random_indices(OUT, OUT, 2, s) for s in (1, 2, 3)]),
    )
    assert layers.shira_indices.shape == (3, 2, 2 * (OUT + OUT))
    x = jax.random.normal(getkey(), (5, OUT))

    def forward(layers, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w.T), None), x, layers)[0]

    def with_values(v):
        return eqx.tree_at(lambda a: a.shira_weight, layers, v)

    def dense(v):
        out = []
        for i, w in enumerate(weights):
            rows, cols = layers.shira_indices[i]
            out.append(w.at[rows, cols].add(v[i]))
        return jnp.stack(out)

    tangent = jax.random.normal(getkey(), layers.shira_weight.shape)
    with strict():
        got, d_got = jax.jvp(
            lambda v: use_implicit_args(forward)(with_values(v), x),
            (layers.shira_weight,),
            (tangent,),
        )
    want, d_want = jax.jvp(lambda v: forward(dense(v), x), (layers.shira_weight,), (tangent,))
    close((got, d_got), (want, d_want), tol=1e-4)
    assert not np.allclose(got, forward(weights, x), atol=1e-2)
    merged = layers.merged(weights)
    close(merged, dense(layers.shira_weight), tol=1e-6)
    close(unmerge(merged, layers).weight, weights, tol=1e-6)
    for tokens in (1, 5):
        h = jax.random.normal(getkey(), (3, tokens, OUT))
        with strict():
            got = use_implicit_args(lambda w, h: jnp.einsum("loi,lti->lto", w, h))(layers, h)
        close(got, jnp.einsum("loi,lti->lto", merged, h), tol=1e-5)


@pytest.mark.parametrize("path", list(TOKENS))
def test_two_active_adapters_add_their_updates(path, getkey):
    """Two SHiRA adapters active on one weight (an `AdapterSet`) add their `ΔW`s to the
    base product in either form, as PEFT's forward loops over its active adapters."""
    w = jax.random.normal(getkey(), (OUT, IN))
    a, b = _random(getkey(), w), _random(getkey(), w, seed=1)
    both = adapter_set(w, {"a": a, "b": b}, ("a", "b"))
    x = jax.random.normal(getkey(), (TOKENS[path], IN))
    with strict():
        got = jax.jit(use_implicit_args(lambda s, x: x @ s.T))(both, x)
    close(got, x @ (w + _dense_delta(a) + _dense_delta(b)).T, tol=1e-5)


# ---------------------------------------------------------------- one layer against PEFT


class _Torch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(IN, OUT)


class _Proj(eqx.Module):
    proj: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(self.proj)(x)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16 base"])
def test_layer_matches_peft(dtype):
    """The output and the gradients of `shira_weight` and of the input equal PEFT's for
    the same weights, index set and loss; a bfloat16 base keeps float32 values and
    float32 gradients."""
    torch.manual_seed(0)
    config = peft.ShiraConfig(target_modules=["proj"], r=2, random_seed=3)
    layer = peft.get_peft_model(_Torch(), config).base_model.model.proj
    values_t = layer.shira_weight["default"]
    with torch.no_grad():
        values_t.copy_(
            0.3 * torch.randn(values_t.shape, generator=torch.Generator().manual_seed(1))
        )
    # bf16: PEFT rounds W + ΔW to bfloat16 before the product, peftx rounds the output, and
    # PEFT's gradient is a bfloat16 product dyᵀ·x gathered where peftx's is a float32 sum
    # of the 6 tokens' products
    ours = peftx.ShiraConfig(target_modules=["proj"], r=2, random_seed=3)
    model = assert_layer_matches_peft(
        layer, ours, ("shira_weight",), (6, IN), dtype, _Proj, grad_terms=6, dx_ulps=4
    )
    adapter = model.base_model.proj.weight.adapters["default"]
    np.testing.assert_array_equal(adapter.shira_indices, layer.shira_indices["default"].numpy())


def test_peft_merge_is_peftx_merged():
    """PEFT's own `merge` (its sparse ΔW added to the weight) gives `merged`'s weight,
    and `unmerge` the base back."""
    torch.manual_seed(0)
    theirs = peft.get_peft_model(_Torch(), peft.ShiraConfig(target_modules=["proj"], r=2))
    layer = theirs.base_model.model.proj
    with torch.no_grad():
        layer.shira_weight["default"].normal_(0, 0.3)
    w = jnp.asarray(layer.base_layer.weight.detach().numpy())
    a = ShiraArray(
        w,
        jnp.asarray(layer.shira_weight["default"].detach().numpy()),
        jnp.asarray(layer.shira_indices["default"].numpy()),
    )
    layer.merge()
    close(a.merged(w), layer.base_layer.weight.detach().numpy(), tol=1e-6)
    layer.unmerge()
    close(a.unmerged(a.merged(w)), layer.base_layer.weight.detach().numpy(), tol=1e-6)


# ---------------------------------------------------------------- whole models, both ways


TARGETS = ["q_proj", "v_proj", "down_proj", "up_proj"]
CASE = dict(r=2, random_seed=5, target_modules=TARGETS)


# peft_to_peftx's test writes PEFT's file back key for key: the fast tier's round trip
@pytest.mark.torch_round_trip
@pytest.mark.parametrize(
    "seed", [5, pytest.param(None, marks=pytest.mark.variant_sweep, id="seed-None")]
)
def test_peftx_to_peft(seed, tiny_llama, tmp_path):
    """A stacked peftx adapter with random values: PEFT loads the file (its state dict is
    the file, index sets included, equal to those PEFT draws itself) to peftx's logits;
    peftx's config file is one PEFT reads as a ShiraConfig with PEFT's keys; counts are
    PEFT's."""
    path, base = tiny_llama
    case = dict(CASE, random_seed=seed)
    ours = peftx.get_peft_model(base(), peftx.ShiraConfig(**case), key=jax.random.key(0))
    ours = randomized(ours, jax.random.key(1))
    ours.save_pretrained(tmp_path)
    theirs = peft.PeftModel.from_pretrained(torch_base(path, "llama"), tmp_path).eval()
    file = load_file(str(tmp_path / WEIGHTS))
    state = peft.utils.get_peft_model_state_dict(theirs)
    assert sorted(file) == sorted(state)
    assert {k.rsplit(".", 1)[-1] for k in file} == {"shira_weight", "shira_indices"}
    their_config = peft.ShiraConfig(**case)
    fresh = peft.get_peft_model(torch_base(path, "llama"), their_config)
    drawn = peft.utils.get_peft_model_state_dict(fresh)
    for k, v in state.items():
        assert v.dtype == (torch.int32 if k.endswith("indices") else torch.float32), k
        np.testing.assert_array_equal(v.numpy(), file[k], err_msg=k)
        if k.endswith("shira_indices"):  # the mask PEFT draws itself
            np.testing.assert_array_equal(drawn[k].numpy(), file[k], err_msg=k)
    ids, mask = batch("llama")
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask, "llama"), mask, reference)
    saved = peft.PeftConfig.from_pretrained(tmp_path)
    assert type(saved) is peft.ShiraConfig
    assert sorted(saved.to_dict()) == sorted(their_config.to_dict())
    assert list(peftx.ShiraConfig(**case).to_dict()) == list(their_config.to_dict())
    assert ours.get_nb_trainable_parameters() == fresh.get_nb_trainable_parameters()


@pytest.mark.parametrize(
    "layout", ["stacked", pytest.param("unrolled", marks=pytest.mark.layout_sweep)]
)
def test_peft_to_peftx_files_gradients_and_merge(layout, tiny_llama, tmp_path):
    """PEFT's adapter loads with equal logits and is written back exactly (the index
    sets taken from the file); the gradient of every layer's values for one loss is
    PEFT's; merged logits are the unmerged ones."""
    path, base = tiny_llama
    theirs = randomize_torch_adapters(
        peft.get_peft_model(torch_base(path, "llama"), peft.ShiraConfig(**CASE)),
        3,
        names=("shira_weight",),
        count=3 * len(TARGETS),
    )
    # an index set of PEFT's own that the config's seed would not draw: read from the file
    q = theirs.base_model.model.model.layers[1].self_attn.q_proj
    q.shira_indices["default"] = torch.from_numpy(random_indices(32, 32, 2, 99))
    s = assert_peft_file_gradients_and_merge(
        theirs, path, base(layout), tmp_path, "shira_weight", frozen=("shira_indices",)
    )
    adapter = s.adapter("default")
    close(unmerge(adapter.merged(s.weight), adapter).weight, s.weight, tol=1e-6)


# ---------------------------------------------------------------- training


def test_training_step_builds_one_adapted_weight_and_its_cotangent(tiny_llama):
    """A training step (3x7 tokens, so that `tokens·k > out·in` for every target) builds,
    for each adapted weight, exactly these weight-sized arrays: `W + ΔW` (a scatter-add
    of the `k` values into the weight, forward and again in the stack's recomputation
    backward), the zeros of that scatter's tangent (read by no equation; XLA drops it),
    and backward the adapted weight's cotangent `gᵀ·x` (one product), whose `k` entries
    are the values' gradient. No copy, cast or transpose of `W`, nothing else. Only the
    values train; forward mode agrees with reverse mode."""
    _, base = tiny_llama
    model = randomized(
        peftx.get_peft_model(base(), peftx.ShiraConfig(**CASE), key=jax.random.key(0)),
        jax.random.key(4),
    )
    trainable, frozen = peftx.partition(model)
    assert all(jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(trainable))
    ids = jnp.ones((3, 7), jnp.int32)

    def loss(t):
        return jnp.mean(eqx.combine(t, frozen)(ids).logits ** 2)

    # q_proj (32, 32), v_proj (16, 32), down_proj (32, 64) and up_proj (64, 32): the
    # last two match each other's shape transposed, so each of those counts twice
    jaxpr, _, _ = eqx.filter_make_jaxpr(jax.grad(loss))(trainable)
    per_weight = {"scatter-add": 2, "broadcast_in_dim": 1, "dot_general": 1}
    for shape, times in [((32, 32), 1), ((16, 32), 1), ((32, 64), 2), ((64, 32), 2)]:
        found = Counter(
            eqn.primitive.name
            for eqn in all_eqns(jaxpr.jaxpr)
            for var in eqn.outvars
            if tuple(getattr(var.aval, "shape", ())) in {shape, shape[::-1]}
        )
        assert found == Counter({k: v * times for k, v in per_weight.items()}), shape

    with strict():
        grads = eqx.filter_jit(jax.grad(loss))(trainable)
        tangent, _ = peftx.partition(randomized(model, jax.random.key(5)))
        _, forward = eqx.filter_jit(lambda t, d: jax.jvp(loss, (t,), (d,)))(trainable, tangent)
    leaves = zip(jax.tree.leaves(grads), jax.tree.leaves(tangent))
    reverse = sum(jnp.vdot(g, d) for g, d in leaves)
    np.testing.assert_allclose(forward, reverse, rtol=1e-4)


def test_decode_step_builds_no_dense_update(tiny_llama):
    """A step on one token (`tokens·k ≤ out·in` for every target: a decoding product)
    gathers and scatters, forward and backward, and builds no weight-sized array."""
    _, base = tiny_llama
    model = peftx.get_peft_model(base(), peftx.ShiraConfig(**CASE), key=jax.random.key(0))
    trainable, frozen = peftx.partition(model)
    ids = jnp.ones((1, 1), jnp.int32)

    def step(t, frozen):
        return jax.grad(lambda t: jnp.mean(eqx.combine(t, frozen)(ids).logits ** 2))(t)

    with strict():
        assert_no_dense(step, trainable, frozen)


def test_two_adapters_switch_and_refuse_mixed_batches(tiny_llama):
    _, base = tiny_llama
    model = peftx.get_peft_model(
        base(),
        peftx.ShiraConfig(r=2, target_modules=["q_proj"], init_weights=False),
        key=jax.random.key(0),
    )
    model = model.add_adapter(
        "b",
        peftx.ShiraConfig(r=4, target_modules=["q_proj"], init_weights=False, random_seed=1),
        key=jax.random.key(1),
    )
    ids, mask = batch("llama")
    assert (
        np.abs(jax_out(model, ids, mask) - jax_out(model.set_adapter("b"), ids, mask)).max() > 1e-3
    )
    with pytest.raises(ValueError, match="within a batch, which PEFT does not do for SHIRA"):
        model(jnp.asarray(ids), jnp.asarray(mask), adapter_names=["default", "b"])


def test_refusals(tiny_llama):
    _, base = tiny_llama
    w = jnp.ones((OUT, IN))
    with pytest.raises(ValueError, match="more shira params .* than the total number"):
        shira(w, r=5)
    with pytest.raises(ValueError, match="should be a positive integer"):
        shira(w, r=0)
    with pytest.raises(ValueError, match="pass a `key`"):
        shira(w, r=1, init_weights=False)
    with pytest.raises(ValueError, match="do not fit weight"):
        ShiraArray(w, jnp.zeros((5,)), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(TypeError, match="shira_indices must be integers"):
        ShiraArray(w, jnp.zeros((4,)), jnp.zeros((2, 4)))
    with pytest.raises((ValueError, TypeError), match="mask_type"):
        peftx.ShiraConfig(mask_type="mine")
    with pytest.raises(ValueError, match="random_seed"):
        peftx.ShiraConfig(random_seed=-1)
    with pytest.raises(ValueError, match="SHiRA on 'model.layers.0-2.self_attn.v_proj'.*rank 16"):
        peftx.get_peft_model(
            base(), peftx.ShiraConfig(r=16, target_modules=["v_proj"]), key=jax.random.key(0)
        )


def test_excluded_modules_are_saved_as_targets(tiny_llama, tmp_path):
    """PEFT's ShiraConfig has no `exclude_modules`: the saved config names the adapted
    modules, and PEFT adapts those only."""
    path, base = tiny_llama
    config = peftx.ShiraConfig(r=2, target_modules=["q_proj", "v_proj"], exclude_modules=["v_proj"])
    ours = peftx.get_peft_model(base(), config, key=jax.random.key(0))
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert "exclude_modules" not in saved
    assert saved["target_modules"] == [f"model.layers.{i}.self_attn.q_proj" for i in range(3)]
    theirs = peft.PeftModel.from_pretrained(torch_base(path, "llama"), tmp_path)
    assert len(peft.utils.get_peft_model_state_dict(theirs)) == 2 * 3


def test_toml_table(tmp_path):
    file = tmp_path / "job.toml"
    file.write_text('[shira]\nr = 16\nrandom_seed = 4\ntarget_modules = ["q_proj"]\n')
    assert peftx.from_toml(file) == peftx.ShiraConfig(
        r=16, random_seed=4, target_modules=("q_proj",)
    )
    file.write_text("[shira]\nrandom_sed = 4\n")
    with pytest.raises(ValueError, match="did you mean 'random_seed'"):
        peftx.from_toml(file)


@pytest.mark.command_run
def test_shira_job_trains_and_writes_what_peft_reads(llama, tmp_path, capsys):
    """A `[shira]` job trains and writes PEFT's adapter, which PEFT reads to peftx's
    logits."""
    table = '[shira]\nr = 2\ntarget_modules = ["q_proj", "v_proj", "down_proj"]'
    assert_job_adapter_reads_in_peft(llama, tmp_path, capsys, table, "SHIRA")
