"""VeRA against HF PEFT in PyTorch on the same tiny Llama, and against dense formulas:
the projections drawn bit for bit as torch draws them, files both ways (with and without
the projections), merging, gradients in fp32 and on a bfloat16 base, no dense update in a
training step, forward mode, and the stacked layout."""

import json
import math
import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from peft.tuners.vera.model import _kaiming_init
from safetensors.numpy import load_file
from test_llama import BF16_U, IDS, MASK, TOL, real_diff, torch_forward

import peftx
import peftx.models as pm
from peftx.adapters import VeraArray, vera_projections
from peftx.implicit import assert_no_dense, strict

TARGETS = ["q_proj", "v_proj", "down_proj"]  # in and out sizes differ: slices matter
R = 4


@pytest.fixture(scope="module")
def checkpoint():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    path = tempfile.mkdtemp()
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _torch_vera(path, dtype=torch.float32, **kwargs):
    """PEFT's VeRA on the checkpoint with random non-zero lambdas."""
    base = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
    config = peft.VeraConfig(r=R, target_modules=TARGETS, init_weights=False, **kwargs)
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vera_lambda" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    return model


def _randomized(model, seed):
    trainable, frozen = peftx.partition(model)
    leaves, tree = jax.tree.flatten(trainable)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [0.5 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return eqx.combine(jax.tree.unflatten(tree, leaves), frozen)


IDS_J, MASK_J = jnp.asarray(IDS), jnp.asarray(MASK)


def _logits(model):
    return np.asarray(eqx.filter_jit(lambda m: m(IDS_J, MASK_J).logits)(model), np.float32)


def _weights(model):
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("seed", [0, 7, 2**32 + 3, 2**63 + 11])
def test_projections_are_torchs_bit_for_bit(seed):
    """vera_A then vera_B from one generator, as PEFT's `_init_vera_A_vera_B` draws them."""
    for r, in_max, out_max in [(R, 48, 32), (3, 5, 7)]:
        gen = torch.Generator().manual_seed(seed)
        want_a = _kaiming_init((r, in_max), generator=gen).numpy()
        want_b = _kaiming_init((out_max, r), generator=gen).numpy()
        got_a, got_b = vera_projections(seed, r, in_max, out_max)
        np.testing.assert_array_equal(got_a, want_a)
        np.testing.assert_array_equal(got_b, want_b)


@pytest.mark.parametrize("save_projection", [True, False])
def test_peft_file_loads_into_peftx_and_back(checkpoint, save_projection, tmp_path):
    """PEFT -> peftx: equal logits; peftx saves PEFT's file again (keys, shapes, dtypes,
    values; `base_model.vera_A`/`vera_B` once, or not at all)."""
    theirs = _torch_vera(checkpoint, save_projection=save_projection, projection_prng_key=5)
    theirs.save_pretrained(tmp_path / "peft")
    base = pm.from_pretrained(checkpoint)
    ours = peftx.PeftModel.from_pretrained(base, tmp_path / "peft")
    want = torch_forward(theirs, IDS, MASK).logits
    assert real_diff(_logits(ours), want, MASK) < TOL
    assert real_diff(_logits(base), want, MASK) > 100 * TOL
    ours.save_pretrained(tmp_path / "again")
    a, b = load_file(tmp_path / "peft" / WEIGHTS), load_file(tmp_path / "again" / WEIGHTS)
    assert sorted(a) == sorted(b)
    assert ("base_model.vera_A" in a) == save_projection
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    config = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    want = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    want["target_modules"] = sorted(want["target_modules"])  # a set to PEFT
    assert {k: v for k, v in config.items() if k != "base_model_name_or_path"} == {
        k: v for k, v in want.items() if k != "base_model_name_or_path"
    }


@pytest.mark.parametrize("layout", ["stacked"])
def test_peftx_adapter_loads_into_peft(checkpoint, layout, tmp_path):
    """peftx -> PEFT with both projection settings, and PEFT's trainable count."""
    base = pm.from_pretrained(checkpoint, layout=layout)
    for save_projection in (True, False):
        config = peftx.VeraConfig(
            r=R, target_modules=TARGETS, save_projection=save_projection, projection_prng_key=9
        )
        ours = _randomized(peftx.get_peft_model(base, config, key=jax.random.key(0)), 1)
        folder = tmp_path / str(save_projection)
        ours.save_pretrained(folder)
        torch_base = transformers.LlamaForCausalLM.from_pretrained(checkpoint).eval()
        theirs = peft.PeftModel.from_pretrained(torch_base, folder)
        assert real_diff(_logits(ours), torch_forward(theirs, IDS, MASK).logits, MASK) < TOL
    count = _torch_vera(checkpoint).get_nb_trainable_parameters()
    assert ours.get_nb_trainable_parameters() == count


def test_merge_and_unmerge(checkpoint):
    base = pm.from_pretrained(checkpoint, layout="unrolled")
    config = peftx.VeraConfig(r=R, target_modules=TARGETS)
    model = _randomized(peftx.get_peft_model(base, config, key=jax.random.key(0)), 2)
    merged = model.merge_and_unload()
    assert real_diff(_logits(merged), _logits(model), MASK) < TOL
    assert real_diff(_logits(merged), _logits(base), MASK) > 100 * TOL
    layer = model.base_model.model.layers[1].mlp.down_proj.weight
    adapter = layer.adapter("default")
    dense = merged.model.layers[1].mlp.down_proj.weight
    np.testing.assert_allclose(adapter.unmerged(dense), layer.weight, atol=1e-6)
    assert not np.allclose(dense, layer.weight, atol=1e-3)


def _grads(model, dtype_weights):
    """Gradients of the lambdas for a loss of the logits, saved under PEFT's names."""
    trainable, frozen = peftx.partition(model)
    proj = jnp.asarray(dtype_weights)

    @eqx.filter_jit
    def grad(t):
        def loss(t):
            logits = eqx.combine(t, frozen)(IDS_J, MASK_J).logits.astype(jnp.float32)
            return jnp.sum(logits * proj * MASK_J[..., None].astype(jnp.float32))

        return jax.grad(loss)(t)

    return eqx.combine(grad(trainable), frozen)


@pytest.mark.parametrize(
    "dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.variant_sweep)]
)
def test_gradients_match_peft(checkpoint, dtype, tmp_path):
    """Every lambda's gradient equals PEFT's for the same loss; on a bfloat16 base the
    lambdas and projections stay float32 on both sides."""
    theirs = _torch_vera(checkpoint, dtype=getattr(torch, dtype))
    theirs.save_pretrained(tmp_path / "peft")
    base = pm.from_pretrained(checkpoint, dtype=getattr(jnp, dtype))
    ours = peftx.PeftModel.from_pretrained(base, tmp_path / "peft", is_trainable=True)
    weights = np.random.RandomState(3).standard_normal((*IDS.shape, 100)).astype(np.float32)
    kwargs = dict(input_ids=torch.tensor(IDS), attention_mask=torch.tensor(MASK))
    kwargs["position_ids"] = torch.tensor(np.maximum(np.cumsum(MASK, -1) - 1, 0))
    logits = theirs(**kwargs).logits.float()
    (logits * torch.tensor(weights) * torch.tensor(MASK)[..., None]).sum().backward()
    want = {
        f"base_model.model.{n.removesuffix('.default')}".replace(".base_model.model.", ".", 1): (
            p.grad.numpy()
        )
        for n, p in theirs.named_parameters()
        if p.requires_grad
    }
    _grads(ours, weights).save_pretrained(tmp_path / "grads")
    got = {k: v for k, v in load_file(tmp_path / "grads" / WEIGHTS).items() if "lambda" in k}
    assert sorted(got) == sorted(want) and len(got) == 2 * len(TARGETS) * 2
    # bf16: activations rounded at every layer; the bound is a few hundred units of
    # bf16's rounding, relative to each gradient's scale
    tol = TOL if dtype == "float32" else 400 * BF16_U
    for k, g in got.items():
        assert g.dtype == np.float32, k
        scale = np.abs(want[k]).max()
        assert scale > 0, k
        np.testing.assert_allclose(g, want[k], atol=tol * scale, rtol=0, err_msg=k)


@pytest.mark.parametrize("layout", ["stacked"])
def test_training_step_builds_no_dense_update_and_jvp(checkpoint, layout):
    """A training step (forward and backward) builds no weight-sized array, and forward
    mode agrees with reverse mode along a random tangent."""
    base = pm.from_pretrained(checkpoint, layout=layout)
    config = peftx.VeraConfig(r=R, target_modules=TARGETS, vera_dropout=0.1)
    model = _randomized(peftx.get_peft_model(base, config, key=jax.random.key(0)), 4)
    trainable, frozen = peftx.partition(model)

    def loss(t, key):
        m = peftx.adapters.with_dropout(eqx.combine(t, frozen), key)
        return jnp.mean(m(IDS_J, MASK_J).logits ** 2)

    def step(t, frozen, key):
        return jax.grad(loss)(t, key)

    key = jax.random.key(1)
    with strict():
        assert_no_dense(step, trainable, frozen, key)
        grads = eqx.filter_jit(step)(trainable, frozen, key)
        tangent = _randomized(model, 5)
        tangent, _ = peftx.partition(tangent)
        _, forward = eqx.filter_jit(lambda t, d: jax.jvp(lambda t: loss(t, key), (t,), (d,)))(
            trainable, tangent
        )
    reverse = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(tangent)))
    np.testing.assert_allclose(forward, reverse, rtol=1e-4)
    # dropout is active: without the keys the gradient differs
    plain = eqx.filter_jit(
        jax.grad(lambda t: jnp.mean(eqx.combine(t, frozen)(IDS_J, MASK_J).logits ** 2))
    )(trainable)
    assert not all(
        np.allclose(a, b, atol=1e-5) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain))
    )


def test_several_adapters_and_mixed_batch(checkpoint):
    """Two VeRA adapters (each with its own projections, as PEFT keeps them): a mixed
    batch gives each row its own adapter's logits."""
    base = pm.from_pretrained(checkpoint)
    model = peftx.get_peft_model(
        base, peftx.VeraConfig(r=R, target_modules=TARGETS), key=jax.random.key(0)
    )
    model = model.add_adapter(
        "other", peftx.VeraConfig(r=2 * R, target_modules=TARGETS), key=jax.random.key(1)
    )
    model = _randomized(_randomized(model, 6).set_adapter("other"), 7)
    names = ["default", "other", "other", "__base__"]
    mixed = np.asarray(
        eqx.filter_jit(lambda m: m(IDS_J, MASK_J, adapter_names=names).logits)(model)
    )
    alone = {
        "default": _logits(model.set_adapter("default")),
        "other": _logits(model),
        "__base__": _logits(base),
    }
    for row, name in enumerate(names):
        want = alone[name][row : row + 1]
        assert real_diff(mixed[row : row + 1], want, MASK[row : row + 1]) < TOL
    assert real_diff(alone["default"], alone["other"], MASK) > 100 * TOL


def test_bad_input_is_refused():
    w = jnp.ones((6, 5))
    a, b = map(jnp.asarray, vera_projections(0, 3, 4, 6))
    with pytest.raises(ValueError, match="vera_A"):
        VeraArray(w, jnp.zeros(6), jnp.zeros(3), a, b)
    with pytest.raises(ValueError, match="vera_dropout"):
        peftx.VeraConfig(vera_dropout=1.0)
    with pytest.raises((ValueError, TypeError), match="bias"):
        peftx.VeraConfig(bias="lora_only")
    with pytest.raises(ValueError, match="projection_prng_key"):
        peftx.VeraConfig(projection_prng_key=-1)


def test_toml_table(tmp_path):
    file = tmp_path / "job.toml"
    file.write_text('[vera]\nr = 16\ntarget_modules = ["q_proj"]\nsave_projection = false\n')
    config = peftx.from_toml(file)
    assert config == peftx.VeraConfig(r=16, target_modules=("q_proj",), save_projection=False)
    assert math.isclose(config.d_initial, 0.1)


WEIGHTS = "adapter_model.safetensors"
