"""LoRA initializations computed from the base weight, against PyTorch PEFT 0.21 on the
same weights: OLoRA (QR; the residual replaces the weight), fast PiSSA
(`"pissa_niter_K"`, randomized SVD), orthogonal init (random factors with `B @ A = 0`),
MiCA (the smallest singular vectors, `lora_B` frozen) and LoftQ (an NF4 base and the SVD
of what it lost; PEFT's runs on CUDA only, so its steps are written below with
bitsandbytes' NF4 kernel in torch); adapter files naming them, loaded to the logits PEFT
gives; and PEFT's conversion at saving for the inits that change the base.

OLoRA is deterministic: factors and residual equal PEFT's up to float summation order.
`pissa_niter_K` and `"orthogonal"` draw random numbers (torch's generator in PEFT, the
key in peftx), so what is compared is what the draws do not decide. For `pissa_niter_K`
on a weight with a spectral gap, the randomized SVD's rank-`r` projection is within
`(σ_{r+1}/σ_r)^(2K+1)` of the exact one (Halko et al. 2009, corollary 10.10); the test
weights below have `σ_{r+1}/σ_r < 0.05`, so with `K = 4` both frameworks land on exact
PiSSA's residual and product up to fp32 rounding, and so on each other's."""

import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from safetensors.numpy import load_file
from test_peft_interop import WEIGHTS, assert_peft_file_gradients_and_merge
from test_quantized import torch_dequantize_nf4, torch_quantize_nf4

import peftx
import peftx.models as pm
from peftx.adapters import lora
from peftx.adapters._lora._lora import svd_lowrank

VOCAB = 97
TOL = 1e-4  # logits of order one, fp32 forwards of a few layers (see test_peft_interop)
FACTOR_TOL = 1e-5  # one fp32 decomposition of a matrix of norm ~10, in two libraries
EFFECT = 1e-2
CONFIG = "adapter_config.json"
R, ALPHA = 4, 8


class _One(torch.nn.Module):
    def __init__(self, out, in_):
        super().__init__()
        self.lin = torch.nn.Linear(in_, out, bias=False)

    def forward(self, x):
        return self.lin(x)


def peft_init(weight, init, r=R, alpha=ALPHA, **kwargs):
    """`(base weight, lora_A, lora_B)` after PEFT initializes a LoRA on a Linear `weight`."""
    module = _One(*weight.shape)
    module.lin.weight.data = torch.tensor(weight)
    config = peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=["lin"], init_lora_weights=init, **kwargs
    )
    layer = peft.get_peft_model(module, config).base_model.model.lin
    return tuple(
        t.detach().numpy()
        for t in (
            layer.base_layer.weight,
            layer.lora_A["default"].weight,
            layer.lora_B["default"].weight,
        )
    )


def ours_init(weight, init, r=R, alpha=ALPHA, key=0, **kwargs):
    out = lora(
        jnp.asarray(weight), r=r, lora_alpha=alpha, init=init, key=jax.random.key(key), **kwargs
    )
    return tuple(np.asarray(x) for x in (out.weight, out.lora_A, out.lora_B))


def low_rank_plus_noise(shape, seed, r=R, noise=1e-3):
    """`U diag(s) V^T + noise`: `r` singular values 10..4, the rest below `noise·(√m+√n)`."""
    rng = np.random.default_rng(seed)
    u = np.linalg.qr(rng.standard_normal((shape[0], r)))[0]
    v = np.linalg.qr(rng.standard_normal((shape[1], r)))[0]
    s = np.linspace(10.0, 4.0, r)
    return ((u * s) @ v.T + noise * rng.standard_normal(shape)).astype(np.float32)


def close(a, b, tol=FACTOR_TOL):
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * max(1.0, float(np.abs(b).max())))


SHAPES = [(24, 16), (16, 24)]  # tall and wide (torch's svd_lowrank transposes a wide one)


# ---------------------------------------------------------------- OLoRA


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("use_rslora", [False, True])
def test_olora_factors_and_residual_are_peft_s(shape, use_rslora):
    weight = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    theirs = peft_init(weight, "olora", use_rslora=use_rslora)
    ours = ours_init(weight, "olora", use_rslora=use_rslora)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        close(a, b)
    scaling = ALPHA / (np.sqrt(R) if use_rslora else R)
    close(ours[0] + scaling * ours[2] @ ours[1], weight)
    assert np.abs(ours[0] - weight).max() > EFFECT  # the residual is not the weight


def test_olora_and_pissa_refuse_what_peft_cannot_do():
    with pytest.raises(ValueError, match="r=5 singular vectors"):
        ours_init(np.ones((4, 6), np.float32), "olora", r=5)
    with pytest.raises(TypeError, match="dense 2-D"):
        ours_init(np.ones((4, 6, 3), np.float32), "pissa_niter_2")
    with pytest.raises(ValueError, match="unknown LoRA init 'pissa_niter_x'"):
        ours_init(np.ones((4, 6), np.float32), "pissa_niter_x")


# ---------------------------------------------------------------- fast PiSSA


def test_svd_lowrank_is_torch_s_algorithm(monkeypatch):
    """Given torch's Gaussian sketch, the JAX randomized SVD gives what `torch.svd_lowrank`
    gives (tall and wide); the JAX one is a function of its key."""
    a = np.random.default_rng(1).standard_normal((20, 12)).astype(np.float32)
    key = jax.random.key(3)
    for m in (a, a.T):
        u, s, vh = (np.asarray(x) for x in svd_lowrank(jnp.asarray(m), 5, niter=2, key=key))
        again = svd_lowrank(jnp.asarray(m), 5, niter=2, key=key)
        np.testing.assert_array_equal(u, np.asarray(again[0]))
        assert u.shape == (m.shape[0], 5) and vh.shape == (5, m.shape[1])
        close(u.T @ u, np.eye(5))
        close(vh @ vh.T, np.eye(5))
        # torch draws its sketch with `torch.randn(n, q)`, n the columns of the tall side
        sketch = np.asarray(jax.random.normal(key, (min(m.shape), 5), jnp.float32))
        monkeypatch.setattr(torch, "randn", lambda *args, **kwargs: torch.tensor(sketch))
        tu, ts, tv = torch.svd_lowrank(torch.tensor(m), q=5, niter=2)
        monkeypatch.undo()
        close(s, ts.numpy())
        close((u * s) @ vh, (tu * ts).numpy() @ tv.numpy().T)


@pytest.mark.parametrize("shape", SHAPES)
def test_pissa_niter_is_peft_s_within_the_randomized_svd_s_error(shape):
    """On a weight with a spectral gap, peftx's `pissa_niter_4` and PEFT's agree with exact
    PiSSA (and so with each other) on the residual and the product `B @ A`; residual plus
    update is the weight, and the factors split the singular values evenly (`A A^T =
    B^T B`, diagonal)."""
    weight = low_rank_plus_noise(shape, seed=2)
    exact = peft_init(weight, "pissa")
    theirs = peft_init(weight, "pissa_niter_4")
    ours = ours_init(weight, "pissa_niter_4")
    for w, a, b in (theirs, ours):
        close(w, exact[0])
        close(b @ a, exact[2] @ exact[1])
        close(w + (ALPHA / R) * b @ a, weight)
        close(a @ a.T, b.T @ b)
        close(a @ a.T, np.diag(np.diag(a @ a.T)))
    assert ours[1].shape == theirs[1].shape and ours[2].shape == theirs[2].shape
    # different keys: different draws, the same PiSSA
    other = ours_init(weight, "pissa_niter_4", key=1)
    assert not np.array_equal(other[1], ours[1])
    close(other[0], ours[0])


def test_pissa_niter_draws_from_the_key_on_a_weight_without_a_gap():
    """Without a spectral gap the draws matter, in PEFT as in peftx: residual plus update
    is still the weight, and the key decides the rest."""
    weight = np.random.default_rng(4).standard_normal((24, 16)).astype(np.float32)
    one, again, other = (ours_init(weight, "pissa_niter_1", key=k) for k in (0, 0, 1))
    for x, y in zip(one, again):
        np.testing.assert_array_equal(x, y)
    assert np.abs(one[0] - other[0]).max() > EFFECT
    close(one[0] + (ALPHA / R) * one[2] @ one[1], weight)


# ---------------------------------------------------------------- orthogonal


@pytest.mark.parametrize("shape", SHAPES)
def test_orthogonal_init_has_peft_s_properties(shape):
    """PEFT's orthogonal init leaves the base as it is and builds `A` and `B` from
    complementary rows of a random orthogonal matrix: `B @ A = 0`, each of rank `r/2`, the
    column space of `A` orthogonal to the row space of `B` and together all of `R^r`; the
    entries' scale is PEFT's (std about `1/(10√2)`)."""
    rng = np.random.default_rng(5)
    weight = rng.standard_normal(shape).astype(np.float32)
    big = rng.standard_normal((256, 192)).astype(np.float32)
    theirs = peft_init(weight, "orthogonal")
    ours = ours_init(weight, "orthogonal")
    for w, a, b in (theirs, ours):
        np.testing.assert_array_equal(w, weight)
        assert a.shape == (R, shape[1]) and b.shape == (shape[0], R)
        assert np.abs(b @ a).max() < 1e-6
        assert np.linalg.matrix_rank(a) == R // 2 == np.linalg.matrix_rank(b)
        col, row = a @ a.T, b.T @ b
        assert np.abs(col @ row).max() < 1e-6
        assert np.linalg.matrix_rank(col + row) == R
    for _, a, b in (peft_init(big, "orthogonal", r=8), ours_init(big, "orthogonal", r=8)):
        for x in (a, b):
            assert 0.06 < x.std() < 0.085
    again = ours_init(weight, "orthogonal")
    np.testing.assert_array_equal(again[1], ours[1])
    assert not np.array_equal(ours_init(weight, "orthogonal", key=1)[1], ours[1])
    with pytest.raises(ValueError, match="rank to be even"):
        ours_init(weight, "orthogonal", r=3)


def test_orthogonal_factors_round_to_a_bfloat16_base_as_peft_s_do():
    weight = np.ones((8, 6), np.float32)
    out = lora(jnp.asarray(weight, jnp.bfloat16), r=2, init="orthogonal", key=jax.random.key(0))
    assert out.lora_A.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(out.lora_A), np.asarray(out.lora_A.astype(jnp.bfloat16).astype(jnp.float32))
    )


# ---------------------------------------------------------------- configs


def test_config_takes_peft_s_init_names():
    for init in (
        "olora",
        "orthogonal",
        "pissa_niter_4",
        "pissa_niter_0",
        "pissa",
        "mica",
        "eva",
        "corda",
        "lora_ga",
    ):
        config = peftx.LoraConfig(init_lora_weights=init)
        assert config.init_lora_weights == init
    assert peftx.LoraConfig(init_lora_weights="olora").changes_base
    assert peftx.LoraConfig(init_lora_weights="pissa_niter_16").changes_base
    assert not peftx.LoraConfig(init_lora_weights="orthogonal").changes_base
    assert not peftx.LoraConfig(init_lora_weights="gaussian").changes_base
    assert not peftx.LoraConfig(init_lora_weights="mica").changes_base
    for init in ("pissa_niter_", "OLoRA", 1):
        with pytest.raises((ValueError, TypeError), match="init_lora_weights"):
            peftx.LoraConfig(init_lora_weights=init)
    with pytest.raises(ValueError, match="init from the weight"):
        peftx.LoraConfig(init_lora_weights="olora", target_parameters=["experts.down_proj"])


# ---------------------------------------------------------------- files


def _llama_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama whose q_proj and v_proj weights have a spectral gap at rank 4 (for
    `pissa_niter_K`: see the module's docstring), the rest random."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config()).eval()
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if name.endswith(("q_proj.weight", "v_proj.weight")):
                p.copy_(torch.tensor(low_rank_plus_noise(p.shape, seed=10 + i)) / 10)
            elif "norm" not in name:
                p.copy_(0.2 * torch.randn(p.shape))
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return path


def batch():
    ids = np.random.RandomState(1).randint(3, VOCAB, (2, 8))
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    return np.where(mask == 1, ids, 0), mask


def torch_out(model, ids, mask):
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        )
    return out.logits.float().numpy()


def jax_out(model, ids, mask):
    return np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)).logits, np.float32)


def assert_same(ours, theirs, mask, reference=None):
    real = np.asarray(mask).astype(bool)
    ours, theirs = np.asarray(ours)[real], np.asarray(theirs)[real]
    scale = max(1.0, float(np.abs(theirs).max()))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=TOL * scale)
    if reference is not None:
        assert np.abs(theirs - np.asarray(reference)[real]).max() > EFFECT


def randomize_torch_adapters(model, seed, scale=0.3):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    return model


def randomized(peft_model, seed, scale=0.3):
    trainable, frozen = peftx.partition(peft_model)
    leaves, treedef = jax.tree.flatten(trainable)
    rng = np.random.default_rng(seed)
    leaves = [jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype) for x in leaves]
    return eqx.combine(jax.tree.unflatten(treedef, leaves), frozen)


INITS = [
    "olora",
    *(pytest.param(i, marks=pytest.mark.variant_sweep) for i in ("pissa_niter_4", "orthogonal")),
]
TARGETS = dict(r=R, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"])


@pytest.mark.parametrize("init", INITS)
def test_a_peft_file_naming_the_init_loads_to_peft_s_logits(init, checkpoint, tmp_path):
    """PEFT's file (saved without conversion, its config naming the init) loads into
    peftx to the logits PEFT gives on loading it: the residual re-derived for OLoRA and
    fast PiSSA, the base as it is for orthogonal; and peftx's own adapter with that init
    starts at the base model's logits, its residual PEFT's, and loads in PEFT alike."""
    ids, mask = batch()
    torch_base = lambda: transformers.LlamaForCausalLM.from_pretrained(checkpoint).eval()  # noqa: E731
    reference = torch_out(torch_base(), ids, mask)
    theirs = peft.get_peft_model(torch_base(), peft.LoraConfig(**TARGETS, init_lora_weights=init))
    with theirs.disable_adapter():
        their_residual = torch_out(theirs.eval(), ids, mask)
    assert_same(torch_out(theirs, ids, mask), reference, mask)
    randomize_torch_adapters(theirs, seed=5).save_pretrained(tmp_path / "peft")
    saved = json.loads((tmp_path / "peft" / CONFIG).read_text())
    assert saved["init_lora_weights"] == init
    again = peft.PeftModel.from_pretrained(torch_base(), tmp_path / "peft").eval()
    their_logits = torch_out(again, ids, mask)

    base = pm.from_pretrained(checkpoint)
    loaded = peftx.PeftModel.from_pretrained(base, tmp_path / "peft")
    assert loaded.peft_config["default"].init_lora_weights == init
    assert_same(jax_out(loaded, ids, mask), their_logits, mask, reference)

    ours = peftx.get_peft_model(
        base, peftx.LoraConfig(**TARGETS, init_lora_weights=init), key=jax.random.key(0)
    )
    assert_same(jax_out(ours, ids, mask), reference, mask)
    if init == "orthogonal":
        assert_same(jax_out(ours.disable_adapters(), ids, mask), reference, mask)
    else:
        residual = jax_out(ours.disable_adapters(), ids, mask)
        assert_same(residual, their_residual, mask, reference)
    ours = randomized(ours, seed=6)
    ours.save_pretrained(tmp_path / "ours")
    back = peft.PeftModel.from_pretrained(torch_base(), tmp_path / "ours").eval()
    assert_same(jax_out(ours, ids, mask), torch_out(back, ids, mask), mask, reference)


@pytest.mark.parametrize(
    "init",
    ["corda", *(pytest.param(i, marks=pytest.mark.variant_sweep) for i in ("eva", "lora_ga"))],
)
def test_a_file_naming_a_data_driven_init_loads_as_peft_reads_it(init, checkpoint, tmp_path):
    """PEFT reads an `"eva"` or `"lora_ga"` file as a plain LoRA on the base given; a
    `"corda"` file it cannot load on CPU (it would need `preprocess_corda`'s data), and
    peftx reads its tensors as a plain LoRA with one warning saying so."""
    ids, mask = batch()
    torch_base = lambda: transformers.LlamaForCausalLM.from_pretrained(checkpoint).eval()  # noqa: E731
    reference = torch_out(torch_base(), ids, mask)
    theirs = peft.get_peft_model(torch_base(), peft.LoraConfig(**TARGETS))
    theirs = randomize_torch_adapters(theirs, seed=5).eval()
    plain = torch_out(theirs, ids, mask)
    theirs.save_pretrained(tmp_path)
    config = json.loads((tmp_path / CONFIG).read_text())
    (tmp_path / CONFIG).write_text(json.dumps({**config, "init_lora_weights": init}))
    base = pm.from_pretrained(checkpoint)
    if init == "corda":
        with pytest.raises(ValueError, match="corda"):
            peft.PeftModel.from_pretrained(torch_base(), tmp_path)
        with pytest.warns(UserWarning, match=r"init_lora_weights='corda'.*preprocess_corda"):
            loaded = peftx.PeftModel.from_pretrained(base, tmp_path)
        want = plain
    else:
        want = torch_out(peft.PeftModel.from_pretrained(torch_base(), tmp_path).eval(), ids, mask)
        loaded = peftx.PeftModel.from_pretrained(base, tmp_path)
    assert_same(want, plain, mask, reference)
    assert_same(jax_out(loaded, ids, mask), want, mask, reference)


# ---------------------------------------------------------------- MiCA


def aligned(ours_b, theirs_b):
    """`ours_b`'s columns with the signs of `theirs_b`'s: a singular vector's sign is
    arbitrary, and torch's and JAX's SVDs may pick either."""
    signs = np.sign(np.sum(ours_b * theirs_b, axis=0))
    assert np.all(signs != 0)
    return ours_b * signs[None, :], signs


@pytest.mark.parametrize("shape", SHAPES)
def test_mica_factors_are_peft_s(shape):
    """`lora_B` is the left singular vectors of the `r` smallest singular values (up to
    each one's sign, which SVD leaves open), `lora_A` zeros, the base unchanged; on a
    bfloat16 base the factors are rounded to it, as PEFT stores them."""
    weight = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    theirs = peft_init(weight, "mica")
    ours = ours_init(weight, "mica")
    np.testing.assert_array_equal(ours[0], weight)
    np.testing.assert_array_equal(ours[1], theirs[1])
    assert not ours[1].any() and ours[1].shape == (R, shape[1])
    close(aligned(ours[2], theirs[2])[0], theirs[2])
    u = np.linalg.svd(weight.astype(np.float64), full_matrices=False)[0]
    close(np.abs(u[:, -R:].T @ ours[2]), np.eye(R))  # the smallest, not the largest
    bf16 = lora(jnp.asarray(weight, jnp.bfloat16), r=R, init="mica", key=jax.random.key(0))
    b = np.asarray(bf16.lora_B)
    assert b.dtype == np.float32
    np.testing.assert_array_equal(b, np.asarray(bf16.lora_B.astype(jnp.bfloat16), np.float32))
    with pytest.raises(ValueError, match="MiCA takes r=5 singular vectors"):
        ours_init(np.ones((4, 6), np.float32), "mica", r=5)


FROZEN_MICA = ("lora_B.weight", "lora_embedding_B")


def trained_keys(model, directory):
    """The file keys of the tensors `partition` trains."""
    trainable, frozen = peftx.partition(model)
    marked = eqx.combine(jax.tree.map(lambda x: jnp.full_like(x, 7.0), trainable), frozen)
    marked.save_pretrained(directory)
    return {k for k, v in load_file(str(directory / WEIGHTS)).items() if np.all(v == 7.0)}


def test_mica_trains_lora_A_only_with_peft_s_gradients_and_files(checkpoint, tmp_path):
    """PEFT freezes MiCA's `lora_B` (`lora_embedding_B` on an embedding table): peftx
    trains the same tensors (a PEFT file loaded for training, and a fresh adapter), counts
    PEFT's trainable parameters, and gives PEFT's gradient of each `A` for one loss; the
    table's factors are PEFT's; PEFT's file loads to its logits and is written back
    exactly, peftx's loads in PEFT to peftx's logits."""
    targets = [*TARGETS["target_modules"], "embed_tokens"]
    config = dict(r=R, lora_alpha=ALPHA, target_modules=targets, init_lora_weights="mica")
    torch_base = lambda: transformers.LlamaForCausalLM.from_pretrained(checkpoint).eval()  # noqa: E731
    theirs = peft.get_peft_model(torch_base(), peft.LoraConfig(**config))
    their_trained = {
        k.replace(".default", "") for k, p in theirs.named_parameters() if p.requires_grad
    }
    assert their_trained and all(k.endswith(("lora_A.weight", "_A")) for k in their_trained)
    assert any("lora_embedding_A" in k for k in their_trained)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for k, p in theirs.named_parameters():
            if p.requires_grad:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    base = pm.from_pretrained(checkpoint)
    assert_peft_file_gradients_and_merge(
        theirs, checkpoint, base, tmp_path, "_A", frozen=(*FROZEN_MICA, "base_layer.weight")
    )
    loaded = peftx.PeftModel.from_pretrained(base, tmp_path / "peft", is_trainable=True)
    assert trained_keys(loaded, tmp_path / "loaded") == their_trained

    ours = peftx.get_peft_model(base, peftx.LoraConfig(**config), key=jax.random.key(0))
    fresh = peft.get_peft_model(torch_base(), peft.LoraConfig(**config))
    assert ours.get_nb_trainable_parameters() == fresh.get_nb_trainable_parameters()
    ours.save_pretrained(tmp_path / "fresh")
    table = "base_model.model.model.embed_tokens.lora_embedding_"
    mine = load_file(str(tmp_path / "fresh" / WEIGHTS))
    state = {k: v.numpy() for k, v in peft.utils.get_peft_model_state_dict(fresh).items()}
    np.testing.assert_array_equal(mine[table + "A"], state[table + "A"])
    close(aligned(mine[table + "B"], state[table + "B"])[0], state[table + "B"], tol=1e-4)
    assert trained_keys(ours, tmp_path / "marked") == their_trained
    ids, mask = batch()
    reference = torch_out(torch_base(), ids, mask)
    assert_same(jax_out(ours, ids, mask), reference, mask)
    ours = randomized(ours, seed=9)
    ours.save_pretrained(tmp_path / "ours")
    back = peft.PeftModel.from_pretrained(torch_base(), tmp_path / "ours").eval()
    assert_same(jax_out(ours, ids, mask), torch_out(back, ids, mask), mask, reference)
    with pytest.raises(ValueError, match="'mica' cannot be combined with use_dora"):
        peftx.LoraConfig(**config, use_dora=True)


# ---------------------------------------------------------------- LoftQ


def reference_loftq(weight, num_bits, reduced_rank, num_iter=1):
    """PEFT 0.21's `loftq_init` step for step, with bitsandbytes' CUDA NF4 kernel as
    tests/test_quantized.py writes it in torch in place of `bnb.nn.Params4bit(...)
    .to("cuda")` (PEFT's LoftQ runs on CUDA only): `(dequantized base in the weight's
    dtype, lora_A, lora_B)`."""
    assert num_bits == 4
    w = weight.detach().to(torch.float32)
    res = w.clone()
    for i in range(num_iter):
        packed, absmax = torch_quantize_nf4(res, 64)
        dequantized = torch_dequantize_nf4(packed, absmax, 64, tuple(w.shape), torch.float32)
        res = w - dequantized
        u, s, vh = torch.linalg.svd(res, full_matrices=False)
        lora_B = u @ torch.sqrt(torch.diag(s)[:, :reduced_rank])
        lora_A = torch.sqrt(torch.diag(s)[:reduced_rank, :]) @ vh
        if i + 1 == num_iter:
            break
        res = w - lora_B @ lora_A
    return dequantized.to(weight.dtype), lora_A, lora_B


@pytest.mark.parametrize(
    "shape, iters, dtype",
    [
        ((24, 16), 1, jnp.float32),
        ((16, 24), 3, jnp.float32),
        pytest.param((24, 16), 2, jnp.bfloat16, marks=pytest.mark.variant_sweep),
    ],
)
def test_loftq_base_and_factors_are_peft_s(shape, iters, dtype):
    """The NF4 base (bitsandbytes' codes, an `NF4Array`) and the factors (up to each
    singular pair's sign) equal PEFT's `loftq_init`'s, for one round and several, on a
    float32 and a bfloat16 weight; and the rounds bring `base + B @ A` closer to `W`."""
    weight = np.random.default_rng(11).standard_normal(shape).astype(np.float32)
    w = jnp.asarray(weight, dtype)
    theirs = reference_loftq(torch.tensor(np.asarray(w.astype(jnp.float32))), 4, R, iters)
    theirs = [t.float().numpy() for t in theirs]
    ours = lora(w, r=R, lora_alpha=ALPHA, init="loftq", loftq_iter=iters, key=jax.random.key(0))
    assert isinstance(ours.weight, peftx.adapters.NF4Array) and ours.weight.dtype == dtype
    base = np.asarray(ours.weight.materialize(), np.float32)
    # the codes are bitsandbytes'; after a round, an absmax may differ by float order
    close(base, theirs[0].astype(np.asarray(w).dtype).astype(np.float32))
    lora_B, signs = aligned(np.asarray(ours.lora_B), theirs[2])
    close(lora_B, theirs[2])
    close(np.asarray(ours.lora_A) * signs[:, None], theirs[1])
    assert ours.lora_A.dtype == jnp.float32
    error = np.linalg.norm(base + np.asarray(ours.lora_B @ ours.lora_A) - weight)
    assert error < np.linalg.norm(base - weight)


def test_loftq_config_and_refusals():
    config = peftx.LoraConfig(init_lora_weights="loftq", loftq_config={"loftq_bits": 4})
    assert config.loftq_config == {"loftq_bits": 4, "loftq_iter": 1}  # whole, as PEFT reads it
    assert peftx.LoraConfig.from_dict(config.to_dict()) == config and hash(config)
    with pytest.raises(ValueError, match="loftq_bits=8: peftx's LoftQ quantizes to NF4"):
        lora(jnp.ones((8, 6)), r=2, init="loftq", loftq_bits=8, key=jax.random.key(0))
    with pytest.raises(TypeError, match="LoftQ initialization needs a dense 2-D"):
        lora(jnp.ones((8, 6, 3)), r=2, init="loftq", key=jax.random.key(0))
    nf4 = peftx.adapters.quantize_nf4(jnp.ones((8, 6)))
    with pytest.raises(TypeError, match="load the model unquantized.*NF4Array of shape"):
        lora(nf4, r=2, init="loftq", key=jax.random.key(0))
    with pytest.raises(ValueError, match="init_lora_weights='loftq' and loftq_config go together"):
        peftx.LoraConfig(init_lora_weights="loftq")
    with pytest.raises(ValueError, match="init_lora_weights='loftq' and loftq_config go together"):
        peftx.LoraConfig(loftq_config={"loftq_bits": 4})
    with pytest.raises(ValueError, match=r"loftq_config holds \['bits'\]"):
        peftx.LoraConfig(init_lora_weights="loftq", loftq_config={"bits": 4})


def test_loftq_model_is_peft_s_and_its_file_reads_as_plain_lora(checkpoint, tmp_path, monkeypatch):
    """peftx's LoftQ Llama (NF4 bases of the residuals) gives the logits of PEFT's (its
    layers' LoftQ run by the reference above, on CPU); a file naming "loftq", PEFT's or
    peftx's, is read with one warning as a plain LoRA on the base LoftQ left, to the
    trained model's logits; and PEFT's conversion at saving is refused."""
    monkeypatch.setattr(peft.tuners.lora.layer, "loftq_init", reference_loftq)
    loftq_config = {"loftq_bits": 4, "loftq_iter": 1}
    loftq = dict(**TARGETS, init_lora_weights="loftq", loftq_config=loftq_config)
    ids, mask = batch()
    torch_base = lambda: transformers.LlamaForCausalLM.from_pretrained(checkpoint).eval()  # noqa: E731
    reference = torch_out(torch_base(), ids, mask)
    theirs = peft.get_peft_model(torch_base(), peft.LoraConfig(**loftq)).eval()
    base = pm.from_pretrained(checkpoint)
    ours = peftx.get_peft_model(base, peftx.LoraConfig(**loftq), key=jax.random.key(0))
    assert_same(jax_out(ours, ids, mask), torch_out(theirs, ids, mask), mask, reference)
    is_nf4 = lambda x: isinstance(x, peftx.adapters.NF4Array)  # noqa: E731
    assert sum(map(is_nf4, jax.tree.leaves(ours, is_leaf=is_nf4))) == 2  # q_proj, v_proj stacks

    randomize_torch_adapters(theirs, seed=12).save_pretrained(tmp_path / "peft")
    their_trained = torch_out(theirs, ids, mask)
    theirs.unload().save_pretrained(tmp_path / "peft_base")  # its dequantized NF4 residuals
    ours = randomized(ours, seed=13)
    ours.save_pretrained(tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / CONFIG).read_text())["loftq_config"] == loftq_config
    for file, on, logits in (
        ("peft", pm.from_pretrained(tmp_path / "peft_base"), their_trained),
        ("ours", ours.unload(), jax_out(ours, ids, mask)),
    ):
        with pytest.warns(UserWarning, match="init_lora_weights='loftq'.* as a plain LoRA") as got:
            loaded = peftx.PeftModel.from_pretrained(on, tmp_path / file)
        assert sum("'loftq'" in str(w.message) for w in got) == 1
        assert_same(jax_out(loaded, ids, mask), logits, mask, reference)
    with pytest.raises(ValueError, match="initialized by LoftQ.*cannot be converted"):
        ours.save_pretrained(
            tmp_path / "refused", path_initial_model_for_weight_conversion=tmp_path / "ours"
        )


# ---------------------------------------------------------------- conversion at saving


@pytest.mark.parametrize(
    "init", ["olora", pytest.param("pissa_niter_4", marks=pytest.mark.variant_sweep)]
)
def test_conversion_at_saving_gives_the_trained_model_on_the_original_base(
    init, checkpoint, tmp_path
):
    """`path_initial_model_for_weight_conversion` turns a trained adapter whose init
    replaced the base into a plain LoRA of rank `2r` that, on the original base, gives the
    trained model's logits: peftx's and PEFT's, each in peftx and in PEFT."""
    ids, mask = batch()
    torch_base = lambda: transformers.LlamaForCausalLM.from_pretrained(checkpoint).eval()  # noqa: E731
    reference = torch_out(torch_base(), ids, mask)
    config = peftx.LoraConfig(**TARGETS, init_lora_weights=init)
    base = pm.from_pretrained(checkpoint)
    ours = peftx.get_peft_model(base, config, key=jax.random.key(0))
    initial = dataclasses.replace(config, init_lora_weights=True)
    ours.with_config("default", initial).save_pretrained(tmp_path / "ours_init")
    ours = randomized(ours, seed=14)
    ours.save_pretrained(
        tmp_path / "ours_lora", path_initial_model_for_weight_conversion=tmp_path / "ours_init"
    )
    trained = jax_out(ours, ids, mask)
    saved = json.loads((tmp_path / "ours_lora" / CONFIG).read_text())
    assert (saved["init_lora_weights"], saved["r"]) == (True, 2 * R)
    converted = peftx.PeftModel.from_pretrained(base, tmp_path / "ours_lora")
    assert_same(jax_out(converted, ids, mask), trained, mask, reference)
    back = peft.PeftModel.from_pretrained(torch_base(), tmp_path / "ours_lora").eval()
    assert_same(torch_out(back, ids, mask), trained, mask, reference)

    theirs = peft.get_peft_model(torch_base(), peft.LoraConfig(**TARGETS, init_lora_weights=init))
    theirs.peft_config["default"].init_lora_weights = True  # PEFT's recipe for conversion
    theirs.save_pretrained(tmp_path / "peft_init")
    theirs.peft_config["default"].init_lora_weights = init
    theirs = randomize_torch_adapters(theirs.eval(), seed=15)
    theirs.save_pretrained(
        tmp_path / "peft_lora", path_initial_model_for_weight_conversion=tmp_path / "peft_init"
    )
    their_trained = torch_out(theirs, ids, mask)
    converted = peftx.PeftModel.from_pretrained(base, tmp_path / "peft_lora")
    assert_same(jax_out(converted, ids, mask), their_trained, mask, reference)
    back = peft.PeftModel.from_pretrained(torch_base(), tmp_path / "peft_lora").eval()
    assert_same(torch_out(back, ids, mask), their_trained, mask, reference)
