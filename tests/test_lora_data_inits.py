"""The data-driven LoRA inits (`peftx.initialize_lora`) against PyTorch PEFT 0.21 on the
same tiny Llama and the same batches.

EVA: PEFT's incremental PCA draws a randomized SVD (`torch.svd_lowrank`, `q = 2k`, 4
subspace iterations) at each batch, peftx takes an exact one. With PEFT's PCA made exact
(its own full-SVD path), the ranks, alphas and every `lora_A` are PEFT's within fp32
rounding; with PEFT's randomized one, the ranks and alphas are the same and `lora_A`
within 1e-3 (the draws' error on these inputs, whose spectra decay slowly)."""

import dataclasses
import json
import sys
import types
from unittest import mock

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from helpers import run_script
from peft.tuners.lora.config import CordaConfig as PeftCordaConfig, LoraGAConfig as PeftLoraGAConfig
from peft.tuners.lora.loraga import preprocess_loraga
from peft.utils.incremental_pca import IncrementalPCA as PeftIncrementalPCA
from safetensors.numpy import load_file
from test_peft_interop import (
    BUILDERS,
    CONFIG,
    VOCAB,
    WEIGHTS,
    _randomize_torch_base,
    assert_same,
    jax_out,
    randomized,
    torch_base,
    torch_out,
)

import peftx
import peftx.models as pm

FP32_TOL = 1e-5  # one fp32 SVD per batch of a (tokens × 64) matrix, in two libraries
RANDOMIZED_TOL = 1e-3
# LoRA-GA's singular vectors of two fp32 gradients (torch's and JAX's autodiff, ~1e-6 apart):
# each vector moves by that over its singular value's relative gap to the next
GRADIENT_SVD_TOL = 1e-4
EVA = dict(
    r=4,
    lora_alpha=8,
    target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],  # q and v share inputs
    init_lora_weights="eva",
)


def _batches():
    """Three batches of four rows, some right-padded, some labels -100 (left out)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(3):
        ids = rng.integers(3, VOCAB, (4, 8))
        mask = np.ones_like(ids)
        mask[0, 5:] = mask[2, 6:] = 0
        labels = np.where(mask == 1, ids, -100)
        labels[1, :2] = -100
        out.append(dict(input_ids=np.where(mask == 1, ids, 0), attention_mask=mask, labels=labels))
    return out


@pytest.fixture(scope="module")
def eva(tmp_path_factory):
    """The tiny Llama's directory, and peftx's EVA adapter on it saved to a directory."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    _randomize_torch_base(BUILDERS["llama"]().eval(), seed=7).save_pretrained(path)
    config = peftx.LoraConfig(**EVA, eva_config=dict(tau=0.9))
    start = peftx.get_peft_model(pm.from_pretrained(path), config, key=jax.random.key(0))
    ours = peftx.initialize_lora(start, _batches(), key=jax.random.key(1))
    saved = tmp_path_factory.mktemp("ours")
    ours.save_pretrained(saved)
    return path, ours, saved


def _peft_eva(path, tmp_path, **eva_config):
    eva_config = {"tau": 0.9, **eva_config}
    theirs = peft.get_peft_model(
        torch_base(path, "llama"), peft.LoraConfig(**EVA, eva_config=peft.EvaConfig(**eva_config))
    )
    torch_batches = [{k: torch.tensor(v) for k, v in b.items()} for b in _batches()]
    peft.initialize_lora_eva_weights(theirs, torch_batches, show_progress_bar=False)
    theirs.save_pretrained(tmp_path)
    return tmp_path


def _assert_eva_files_match(ours, theirs, tol):
    a, b = load_file(str(ours / WEIGHTS)), load_file(str(theirs / WEIGHTS))
    assert sorted(a) == sorted(b)
    for k in b:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=tol, err_msg=k)
        if ".lora_B." in k:
            assert not a[k].any()
    ranks = {a[k].shape[0] for k in a if ".lora_A." in k}
    assert len(ranks) > 1  # EVA moved rank between layers
    mine, peft_s = (json.loads((d / CONFIG).read_text()) for d in (ours, theirs))
    for key in ("rank_pattern", "alpha_pattern", "eva_config", "init_lora_weights"):
        assert mine[key] == peft_s[key], key
    assert sorted(mine["target_modules"]) == sorted(peft_s["target_modules"])


def test_eva_is_peft_s_with_an_exact_pca(eva, tmp_path, monkeypatch):
    """PEFT's EVA with its PCA's exact SVD: the same file (ranks, alphas, `lora_A`, zero
    `lora_B`) and config; the model's logits are the base model's, and once trained
    (random factors) PEFT reads the file to peftx's logits."""
    path, ours, saved = eva
    monkeypatch.setattr(
        PeftIncrementalPCA, "_svd_fn_lowrank", PeftIncrementalPCA._svd_fn_full, raising=True
    )
    _assert_eva_files_match(saved, _peft_eva(path, tmp_path / "peft"), FP32_TOL)
    batch = _batches()[0]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), reference, mask)
    trained = randomized(ours, jax.random.key(2))
    trained.save_pretrained(tmp_path / "trained")
    back = peft.PeftModel.from_pretrained(torch_base(path, "llama"), tmp_path / "trained")
    assert_same(
        jax_out(trained, ids, mask), torch_out(back.eval(), ids, mask, "llama"), mask, reference
    )


MESH_SCRIPT = """
import os, pathlib, sys, tempfile

flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.getcwd())  # the tests' directory: its modules build the same model
import jax
import numpy as np
import torch
from test_lora_data_inits import EVA, _batches
from test_peft_interop import BUILDERS, _randomize_torch_base

import peftx
import peftx.models as pm
from peftx.sharding import make_mesh, shard

torch.manual_seed(0)
path = pathlib.Path(tempfile.mkdtemp())
_randomize_torch_base(BUILDERS["llama"]().eval(), seed=7).save_pretrained(path)
config = peftx.LoraConfig(**EVA, eva_config=dict(tau=0.9))
start = peftx.get_peft_model(pm.from_pretrained(path), config, key=jax.random.key(0))
one = peftx.initialize_lora(start, _batches(), key=jax.random.key(1))
meshes = {"dp": make_mesh(data=8, fsdp=1), "fsdp": make_mesh(), "tp": make_mesh(2, 1, 4)}
for rules, mesh in meshes.items():
    with jax.set_mesh(mesh):
        eight = peftx.initialize_lora(shard(start, mesh, rules), _batches(), key=jax.random.key(1))
    assert eight.peft_config == one.peft_config, rules  # the same ranks and alphas
    for a, b in zip(*(jax.tree.leaves(peftx.partition(m)[0]) for m in (one, eight)), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-5, err_msg=rules)
print("OK")
"""


@pytest.mark.simulated_devices
def test_eva_on_eight_devices_equals_one_devices(tmp_path):
    """EVA through `initialize_lora` on a model sharded over 8 simulated devices (data,
    FSDP and tensor parallel): each layer's inputs reach the PCA whole, so the ranks and
    every factor are the one-device run's (fp32 rounding of the sharded products)."""
    run_script(tmp_path / "eva_mesh.py", MESH_SCRIPT)


@pytest.mark.variant_sweep
def test_eva_whitened_divides_each_component_once_by_its_root_singular_value(
    eva, tmp_path, monkeypatch
):
    """`whiten=True` divides each component by the square root of its singular value, as
    PEFT's EVA says, against PEFT's own (its PCA made exact, as above). Where layers share
    one input (here q_proj and v_proj), PEFT divides the components twice: it whitens in
    place a slice of the PCA's components that each layer on that input takes, so its
    `lora_A` there is the single whitening's squared ratio to the plain one."""
    path, _, plain_dir = eva
    monkeypatch.setattr(
        PeftIncrementalPCA, "_svd_fn_lowrank", PeftIncrementalPCA._svd_fn_full, raising=True
    )
    config = peftx.LoraConfig(**EVA, eva_config=dict(tau=0.9, whiten=True))
    start = peftx.get_peft_model(pm.from_pretrained(path), config, key=jax.random.key(0))
    ours_dir = tmp_path / "ours"
    peftx.initialize_lora(start, _batches(), key=jax.random.key(1)).save_pretrained(ours_dir)
    theirs_dir = _peft_eva(path, tmp_path / "peft", whiten=True)
    ours, theirs, plain = (load_file(str(d / WEIGHTS)) for d in (ours_dir, theirs_dir, plain_dir))
    assert sorted(ours) == sorted(theirs)
    shared_input = (".q_proj.", ".v_proj.")
    for k in (k for k in theirs if ".lora_A." in k):
        if not any(s in k for s in shared_input):
            np.testing.assert_allclose(ours[k], theirs[k], rtol=0, atol=FP32_TOL, err_msg=k)
            continue
        # one factor per component: ours = plain · f, PEFT's = plain · f²
        f = np.sum(ours[k] * plain[k], axis=1) / np.sum(plain[k] ** 2, axis=1)
        assert not np.allclose(f, 1.0, rtol=1e-2), k  # whitening changed the factor
        np.testing.assert_allclose(ours[k], plain[k] * f[:, None], atol=FP32_TOL, err_msg=k)
        np.testing.assert_allclose(theirs[k], plain[k] * (f**2)[:, None], atol=FP32_TOL, err_msg=k)


@pytest.mark.variant_sweep
def test_eva_on_preference_pairs_reads_both_sequences_of_each(eva):
    """Pairs `(rows, 2, length)` (a DPO job's `[init]` batches) are read as their chosen
    and rejected sequences, each a row: the same adapter as those rows given as sequences
    (the form checked against PEFT above). Pairs with their prompts shared are refused."""
    path, _, _ = eva
    flat = _batches()
    pairs = [
        {k: np.stack([a[k], b[k]], axis=1) for k in a} for a, b in zip(flat, flat[1:] + flat[:1])
    ]
    as_rows = [{k: v.reshape(-1, v.shape[-1]) for k, v in p.items()} for p in pairs]
    config = peftx.LoraConfig(**EVA, eva_config=dict(tau=0.9))
    start = peftx.get_peft_model(pm.from_pretrained(path), config, key=jax.random.key(0))
    got, want = (peftx.initialize_lora(start, b, key=jax.random.key(1)) for b in (pairs, as_rows))
    assert got.peft_config == want.peft_config
    for a, b in zip(*(jax.tree.leaves(peftx.partition(m)[0]) for m in (got, want)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    shared = peftx.train.share_prompts(pairs[0])
    with pytest.raises(ValueError, match="before share_prompts"):
        peftx.initialize_lora(start, [shared], key=jax.random.key(1))


@pytest.mark.variant_sweep
def test_eva_is_peft_s_within_its_randomized_svd(eva, tmp_path):
    path, _, saved = eva
    _assert_eva_files_match(saved, _peft_eva(path, tmp_path), RANDOMIZED_TOL)


def test_initialize_lora_refuses_bad_input(eva):
    path, ours, _ = eva
    base = pm.from_pretrained(path)
    plain = peftx.get_peft_model(base, peftx.LoraConfig(r=4), key=jax.random.key(0))
    with pytest.raises(
        ValueError, match="init_lora_weights in \\['eva', 'corda', 'lora_ga'\\]; adapter 'default'"
    ):
        peftx.initialize_lora(plain, _batches(), key=jax.random.key(0))
    start = peftx.get_peft_model(base, peftx.LoraConfig(**EVA), key=jax.random.key(0))
    with pytest.raises(ValueError, match="at least one batch"):
        peftx.initialize_lora(start, [], key=jax.random.key(0))
    embed = start.base_model.model.embed_tokens.weight
    broken = eqx.tree_at(
        lambda m: m.base_model.model.embed_tokens.weight, start, embed.at[5:].set(jnp.nan)
    )
    with pytest.raises(ValueError, match="inputs of model.layers.0.self_attn.q_proj hold NaN"):
        peftx.initialize_lora(broken, _batches(), key=jax.random.key(0))
    cached = peftx.LoraConfig(**EVA, corda_config=dict(cache_file="c.pt"))
    cached = peftx.get_peft_model(
        base, dataclasses.replace(cached, init_lora_weights="corda"), key=jax.random.key(0)
    )
    with pytest.raises(ValueError, match="cache_file and covariance_file are PEFT's torch files"):
        peftx.initialize_lora(cached, _batches(), key=jax.random.key(0))
    # (the type checker of the test run refuses it first, with a TypeError naming the field)
    with pytest.raises((ValueError, TypeError), match="corda_method"):
        peftx.LoraConfig(init_lora_weights="corda", corda_config=dict(corda_method="x"))
    with pytest.raises(ValueError, match="`rho` must be >= 1.0"):
        peftx.LoraConfig(init_lora_weights="eva", eva_config=dict(rho=0.5))
    with pytest.raises(ValueError, match="unknown keys \\['rh'\\]"):
        peftx.LoraConfig(init_lora_weights="eva", eva_config=dict(rh=2.0))
    with pytest.raises(ValueError, match="round\\(r \\* rho\\) = 40 components"):
        peftx.initialize_lora(
            peftx.get_peft_model(base, peftx.LoraConfig(**{**EVA, "r": 20}), key=jax.random.key(0)),
            _batches(),
            key=jax.random.key(0),
        )


# ---------------------------------------------------------------- CorDA

CORDA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def _peft_corda(path, method):
    """PEFT's CorDA on the same samples: each row of each batch, its real tokens alone
    (PEFT's hook reads one sample per forward)."""
    base = torch_base(path, "llama")
    config = peft.LoraConfig(
        **CORDA, init_lora_weights="corda", corda_config=PeftCordaConfig(corda_method=method)
    )

    def run_model():
        for b in _batches():
            for ids, mask in zip(b["input_ids"], b["attention_mask"]):
                base(input_ids=torch.tensor(ids[mask == 1][None]))

    # PEFT's corda module takes `dataclass` from attrs, not installed here: the standard
    # library's does the same for its one record class
    with mock.patch.dict(
        sys.modules, {"attr": types.SimpleNamespace(dataclass=dataclasses.dataclass)}
    ):
        from peft.tuners.lora.corda import preprocess_corda

    preprocess_corda(base, config, run_model=run_model)
    return peft.get_peft_model(base, config)


@pytest.fixture(scope="module")
def corda(eva):
    path = eva[0]
    config = peftx.LoraConfig(**CORDA, init_lora_weights="corda")
    start = peftx.get_peft_model(pm.from_pretrained(path), config, key=jax.random.key(0))
    return path, peftx.initialize_lora(start, _batches(), key=jax.random.key(1))


@pytest.mark.parametrize("method", ["ipm", pytest.param("kpm", marks=pytest.mark.variant_sweep)])
def test_corda_factors_and_residual_are_peft_s(method, corda, tmp_path):
    """Each layer's `lora_A`, `lora_B` (up to the sign of each singular pair) and residual
    base weight are PEFT's within fp32 rounding (the covariance of the same samples, one
    damped inverse and one SVD); the model's logits are the base model's."""
    path, ours = corda
    if method != "ipm":
        config = peftx.LoraConfig(
            **CORDA, init_lora_weights="corda", corda_config=dict(corda_method=method)
        )
        start = peftx.get_peft_model(pm.from_pretrained(path), config, key=jax.random.key(0))
        ours = peftx.initialize_lora(start, _batches(), key=jax.random.key(1))
    theirs = _peft_corda(path, method)
    state = {k: v.detach().numpy() for k, v in theirs.state_dict().items()}
    ours.save_pretrained(tmp_path)
    file = load_file(str(tmp_path / WEIGHTS))
    for key_a in (k for k in file if ".lora_A." in k):
        key_b = key_a.replace(".lora_A.", ".lora_B.")
        a, b = file[key_a], file[key_b]
        want_a, want_b = (state[k.replace(".weight", ".default.weight")] for k in (key_a, key_b))
        # each singular pair's sign is the SVD routine's choice (LAPACK's, torch's)
        sign = np.sign(np.sum(a * want_a, axis=1))
        for got, want in ((a * sign[:, None], want_a), (b * sign[None, :], want_b)):
            scale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(got, want, rtol=0, atol=FP32_TOL * scale, err_msg=key_a)
    residual = dict(zip(ours.layer_paths("default"), _residuals(ours)))
    for name, weight in residual.items():
        want = state[f"base_model.model.{name}.base_layer.weight"]
        np.testing.assert_allclose(weight, want, rtol=0, atol=FP32_TOL, err_msg=name)
    batch = _batches()[0]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), reference, mask)
    assert np.abs(jax_out(ours.disable_adapters(), ids, mask) - reference).max() > 1e-2


def _residuals(model):
    chosen = peftx.select(model.base_model).at(
        peftx.where(lambda n: isinstance(getattr(n, "weight", None), peftx.adapters.AdapterSet))
    )
    out = []
    for layer in chosen.get():
        w = np.asarray(layer.weight.weight)
        out += list(w.reshape(-1, *w.shape[-2:]))
    return out


@pytest.mark.parametrize(
    "init", ["corda", pytest.param("lora_ga", marks=pytest.mark.variant_sweep)]
)
def test_converted_file_applies_to_the_original_base(init, corda, lora_ga, tmp_path):
    """CorDA's and LoRA-GA's adapters (on a residual base), trained (random factors) and
    saved with PEFT's conversion against their initial state: the plain LoRA file on the
    original base gives the trained model's logits, in peftx and in PEFT."""
    path, ours = corda if init == "corda" else (lora_ga[0], lora_ga[1]("ArB2r, stable"))
    name = "default"
    initial = ours.with_config(
        name, dataclasses.replace(ours.peft_config[name], init_lora_weights=True)
    )
    initial.save_pretrained(tmp_path / "initial")
    trained = randomized(ours, jax.random.key(3))
    trained.save_pretrained(
        tmp_path / "converted", path_initial_model_for_weight_conversion=tmp_path / "initial"
    )
    batch = _batches()[1]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    want = jax_out(trained, ids, mask)
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    theirs = peft.PeftModel.from_pretrained(torch_base(path, "llama"), tmp_path / "converted")
    assert_same(torch_out(theirs.eval(), ids, mask, "llama"), want, mask, reference)
    back = peftx.PeftModel.from_pretrained(pm.from_pretrained(path), tmp_path / "converted")
    assert_same(jax_out(back, ids, mask), want, mask)


# ---------------------------------------------------------------- LoRA-GA

GA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
GA_CASES = {
    "ArB2r, stable": dict(),
    "ArBr, weight_svd": dict(direction="ArBr", scale="weight_svd"),
    "A2rBr, gd_scale": dict(direction="A2rBr", scale="gd_scale"),
}


def _exact_svd_lowrank(a, q, niter):
    """`torch.svd_lowrank`'s result from an exact SVD (the top `q` triplets)."""
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    return u[:, :q], s[:q], vh[:q].T


def _peft_lora_ga(path, case, monkeypatch):
    """PEFT's LoRA-GA with its randomized SVDs made exact: the gradient of each batch's
    mean loss (transformers' `loss`), accumulated and averaged, as its `train_step` runs."""
    monkeypatch.setattr(torch, "svd_lowrank", _exact_svd_lowrank)
    base = torch_base(path, "llama")
    config = peft.LoraConfig(
        **GA, init_lora_weights="lora_ga", lora_ga_config=PeftLoraGAConfig(**GA_CASES[case])
    )

    def train_step():
        for b in _batches():
            out = base(**{k: torch.tensor(v) for k, v in b.items()})
            out.loss.backward()

    preprocess_loraga(base, config, train_step)
    return peft.get_peft_model(base, config)


@pytest.fixture(scope="module")
def lora_ga(eva):
    path = eva[0]
    models = {}

    def get(case):
        if case not in models:
            config = peftx.LoraConfig(
                **GA, init_lora_weights="lora_ga", lora_ga_config=GA_CASES[case]
            )
            start = peftx.get_peft_model(pm.from_pretrained(path), config, key=jax.random.key(0))
            models[case] = peftx.initialize_lora(start, _batches(), key=jax.random.key(1))
        return models[case]

    return path, get


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.variant_sweep) if i else c for i, c in enumerate(GA_CASES)],
)
def test_lora_ga_factors_and_residual_are_peft_s(case, lora_ga, tmp_path, monkeypatch):
    """Each layer's `lora_A` rows and `lora_B` columns are PEFT's (its SVDs exact) within
    fp32 rounding, up to each singular vector's sign (the SVD routine's choice, which the
    residual follows: each side's residual is its weight less `s·B·A` of its own factors);
    the model's logits are the base model's."""
    path, get = lora_ga
    ours = get(case)
    theirs = _peft_lora_ga(path, case, monkeypatch)
    state = {k: v.detach().numpy() for k, v in theirs.state_dict().items()}
    ours.save_pretrained(tmp_path)
    file = load_file(str(tmp_path / WEIGHTS))
    original = {k: v.detach().numpy() for k, v in torch_base(path, "llama").state_dict().items()}
    residuals = dict(zip(ours.layer_paths("default"), _residuals(ours)))
    scaling = GA["lora_alpha"] / GA["r"]
    for name, residual in residuals.items():
        a, b = (file[f"base_model.model.{name}.lora_{x}.weight"] for x in "AB")
        want_a, want_b = (state[f"base_model.model.{name}.lora_{x}.default.weight"] for x in "AB")
        for got, want in ((a, want_a), (b.T, want_b.T)):
            sign = np.sign(np.sum(got * want, axis=1))[:, None]
            tol = GRADIENT_SVD_TOL * max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(got * sign, want, rtol=0, atol=tol, err_msg=name)
        weight = original[f"{name}.weight"]
        close = dict(rtol=0, atol=FP32_TOL * max(1.0, float(np.abs(weight).max())))
        np.testing.assert_allclose(residual, weight - scaling * b @ a, **close, err_msg=name)
        their_residual = state[f"base_model.model.{name}.base_layer.weight"]
        np.testing.assert_allclose(their_residual, weight - scaling * want_b @ want_a, **close)
        assert np.abs(residual - weight).max() > 2 * close["atol"]  # the base moved
    batch = _batches()[0]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    reference = torch_out(torch_base(path, "llama"), ids, mask, "llama")
    assert_same(jax_out(ours, ids, mask), reference, mask)
