"""Adapters a user can trust (issue 22): the adapter records its base model so that PyTorch
PEFT's `AutoPeftModelForCausalLM` loads it; the loader refuses integer and boolean tensors
and adapters of another model, and a failed load changes nothing; `merge_and_unload` and
`peftx merge` refuse to write non-finite weights. Tiny random-init transformers checkpoints,
fp32; no network."""

import copy
import dataclasses
import json
import re
import shutil

import equinox as eqx
import huggingface_hub
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from helpers import run_cli, tiny_llama_config
from safetensors.numpy import load_file, save_file

import peftx
import peftx.models as pm

VOCAB = 61
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
PREFIX = "base_model.model."
# fp32 forward passes of two layers of width 32 in two frameworks: errors of some hundreds
# of ulps of the logits' scale; an adapter moves the logits by far more than EFFECT
TOL, EFFECT = 1e-4, 1e-2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Directories of a tiny Llama and a tiny GPT-2, saved by transformers."""
    root = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config(VOCAB)).save_pretrained(root / "llama")
    gpt2 = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(root / "gpt2")
    return root


@pytest.fixture(scope="module")
def base_llama(checkpoints):
    return pm.from_pretrained(checkpoints / "llama")


def randomized(peft_model, seed, scale=0.3):
    """Every trainable leaf drawn at random, so that the adapter changes the outputs."""
    trainable, frozen = peftx.partition(peft_model)
    rng = np.random.default_rng(seed)
    trainable = jax.tree.map(
        lambda x: jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype), trainable
    )
    return eqx.combine(trainable, frozen)


def lora(model, seed=1, **kwargs):
    config = peftx.LoraConfig(**{"r": 4, "target_modules": ["q_proj", "v_proj"], **kwargs})
    return randomized(peftx.get_peft_model(model, config, key=jax.random.key(seed)), seed)


IDS = np.random.default_rng(5).integers(3, VOCAB, size=(2, 7))


@eqx.filter_jit
def _logits(model, ids):
    return model(ids).logits


def logits(model):
    return np.asarray(_logits(model, jnp.asarray(IDS, jnp.int32)))


# ---------------------------------------------------------------- where the base came from


def test_auto_peft_model_loads_a_peftx_adapter(checkpoints, tmp_path, monkeypatch):
    """The issue's repro: `adapter_config.json` had `base_model_name_or_path: null`, so
    `AutoPeftModelForCausalLM` tried to download `None/...`. A model loaded with a relative
    path records its absolute directory, so the adapter loads from any directory."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(checkpoints)
    ours = lora(pm.from_pretrained("llama"))
    ours.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / CONFIG).read_text())
    assert saved["base_model_name_or_path"] == str(checkpoints / "llama")

    monkeypatch.chdir(tmp_path)
    theirs = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    with torch.no_grad():
        want = theirs(torch.tensor(IDS)).logits.numpy()
        base = theirs.get_base_model()
        with theirs.disable_adapter():
            unadapted = base(torch.tensor(IDS)).logits.numpy()
    got = logits(ours)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL * scale)
    assert np.abs(want - unadapted).max() > EFFECT, "the adapter changes nothing"


@pytest.mark.command_run
def test_auto_peft_model_loads_what_peftx_finetune_wrote(llama, tmp_path, capsys, monkeypatch):
    """The issue's own words: PEFT's Auto class loads the adapter of a `peftx finetune`
    run (the tiny causal-LM job of `conftest.py`), with peftx's outputs."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "run"
    sets = [f"output.dir={out}", "train.steps=6", "output.merged=false"]
    code, stdout, err = run_cli(capsys, "finetune", llama / "job.toml", *_sets(sets))
    assert code == 0, (stdout, err)
    adapter = out / "adapter"
    config = json.loads((adapter / CONFIG).read_text())
    assert config["base_model_name_or_path"] == str(llama / "base")

    theirs = peft.AutoPeftModelForCausalLM.from_pretrained(adapter).eval()
    ids = np.random.default_rng(0).integers(5, 40, size=(2, 9))
    with torch.no_grad():
        want = theirs(torch.tensor(ids)).logits.numpy()
        with theirs.disable_adapter():
            unadapted = theirs(torch.tensor(ids)).logits.numpy()
    ours = peftx.PeftModel.from_pretrained(pm.from_pretrained(llama / "base"), adapter)
    got = np.asarray(_logits(ours, jnp.asarray(ids, jnp.int32)))
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL * scale)
    assert np.abs(want - unadapted).max() > 10 * TOL * scale, "the adapter changes nothing"


def _sets(items):
    return [a for item in items for a in ("--set", item)]


def test_models_from_two_directories_share_one_structure(checkpoints, tmp_path, base_llama):
    """The path is part of the config but not of its equality: the two models keep one
    tree structure (one jit trace, `eqx.combine` across them); each adapter's config,
    which compares, holds its own base's path, also through a shared jit trace."""
    shutil.copytree(checkpoints / "llama", tmp_path / "copy")
    other = pm.from_pretrained(tmp_path / "copy")
    assert base_llama.config.name_or_path == str(checkpoints / "llama")
    assert other.config.name_or_path == str(tmp_path / "copy")
    assert jax.tree.structure(base_llama) == jax.tree.structure(other)

    identity = eqx.filter_jit(lambda m: m)
    for model, path in ((base_llama, checkpoints / "llama"), (other, tmp_path / "copy")):
        adapted = identity(lora(model))
        assert adapted.peft_config["default"].base_model_name_or_path == str(path)


def test_a_given_base_path_is_kept_and_an_unknown_one_stays_null(base_llama, tmp_path):
    named = lora(base_llama, base_model_name_or_path="meta-llama/Llama-3.2-1B")
    named.save_pretrained(tmp_path / "named")
    built = pm.LlamaForCausalLM(
        dataclasses.replace(base_llama.config, name_or_path=None), key=jax.random.key(0)
    )
    lora(built).save_pretrained(tmp_path / "built")
    read = {d: json.loads((tmp_path / d / CONFIG).read_text()) for d in ("named", "built")}
    assert read["named"]["base_model_name_or_path"] == "meta-llama/Llama-3.2-1B"
    assert read["built"]["base_model_name_or_path"] is None


# ---------------------------------------------------------------- refused loads


@pytest.fixture(scope="module")
def saved(base_llama, tmp_path_factory):
    """A Llama LoRA with random factors, saved; and the model."""
    path = tmp_path_factory.mktemp("adapter")
    model = lora(base_llama)
    model.save_pretrained(path)
    return path, model


def _edited(saved, tmp_path, edit_tensors=None, edit_config=None):
    path, _ = saved
    target = tmp_path / "edited"
    shutil.copytree(path, target)
    if edit_tensors is not None:
        tensors = edit_tensors(load_file(str(target / WEIGHTS)))
        save_file(tensors, str(target / WEIGHTS), metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((target / CONFIG).read_text())
        (target / CONFIG).write_text(json.dumps(edit_config(config)))
    return target


Q1_A = PREFIX + "model.layers.1.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_])
def test_integer_and_bool_tensors_are_refused(saved, base_llama, tmp_path, dtype):
    def cast(t):
        t[Q1_A] = (t[Q1_A] > 0).astype(dtype)
        return t

    target = _edited(saved, tmp_path, cast)
    name = np.dtype(dtype).name
    with pytest.raises(peftx.CheckpointError, match=rf"{Q1_A}' as {name};") as info:
        peftx.PeftModel.from_pretrained(base_llama, target)
    assert str(target / WEIGHTS) in str(info.value)


def test_an_adapter_of_another_architecture_does_not_belong(checkpoints, base_llama, tmp_path):
    gpt2 = pm.from_pretrained(checkpoints / "gpt2")
    lora(gpt2, target_modules=["c_attn"]).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(peftx.CheckpointError) as info:
        peftx.PeftModel.from_pretrained(base_llama, tmp_path / "gpt2")
    message = str(info.value)
    assert "does not belong to this model: 2 of the 2 modules it adapts" in message
    assert "'transformer.h.0.attn.c_attn'" in message
    assert f"made for base model '{checkpoints / 'gpt2'}'" in message
    assert f"this model was loaded from '{checkpoints / 'llama'}'" in message
    assert "spelling" not in message


def test_an_adapter_without_a_base_path_says_so(checkpoints, base_llama, tmp_path):
    gpt2 = pm.from_pretrained(checkpoints / "gpt2")
    lora(gpt2, target_modules=["c_attn"]).save_pretrained(tmp_path / "gpt2")
    config = json.loads((tmp_path / "gpt2" / CONFIG).read_text())
    config["base_model_name_or_path"] = None
    (tmp_path / "gpt2" / CONFIG).write_text(json.dumps(config))
    with pytest.raises(peftx.CheckpointError, match="does not name its base model"):
        peftx.PeftModel.from_pretrained(base_llama, tmp_path / "gpt2")


def _rename(t):
    return {k.replace("q_proj", "k_proj"): v for k, v in t.items()}


# Each way a load can fail after the files were found, and what the error names.
FAILURES = {
    "int-tensor": (lambda t: {**t, Q1_A: t[Q1_A].astype(np.int32)}, None, "int32"),
    "bool-tensor": (lambda t: {**t, Q1_A: t[Q1_A] > 0}, None, "bool"),
    "wrong-shape": (lambda t: {**t, Q1_A: np.ones((4, 31), np.float32)}, None, r"\(4, 31\)"),
    "missing-key": (lambda t: {k: v for k, v in t.items() if k != Q1_A}, None, "lora_A"),
    "config-targets-nothing": (
        None,
        lambda c: {**c, "target_modules": ["c_attn"]},
        r"target_modules .*'c_attn'.* match no module",
    ),
    "config-disagrees": (_rename, None, "k_proj"),
    "bad-config-value": (None, lambda c: {**c, "r": -1}, "r"),
}


@pytest.mark.parametrize("case", FAILURES)
def test_a_failed_load_leaves_the_model_untouched(saved, base_llama, tmp_path, case):
    """The model passed, and a PeftModel's adapters, configs (with their dicts and lists)
    and `modules_to_save` copies are as they were: same structure, same array objects."""
    edit_tensors, edit_config, match = FAILURES[case]
    target = _edited(saved, tmp_path, edit_tensors, edit_config)
    base_leaves, base_tree = jax.tree.flatten(base_llama)
    with pytest.raises((peftx.CheckpointError, ValueError), match=match):
        peftx.PeftModel.from_pretrained(base_llama, target)
    assert jax.tree.structure(base_llama) == base_tree
    assert all(x is y for x, y in zip(jax.tree.leaves(base_llama), base_leaves, strict=True))

    model = lora(base_llama, rank_pattern={"v_proj": 2}, modules_to_save=["lm_head"])
    configs = copy.deepcopy(model.configs)
    saved_modules = dict(model.saved_modules)
    leaves, tree = jax.tree.flatten(model)
    with pytest.raises((peftx.CheckpointError, ValueError), match=match):
        model.load_adapter(target, "new")
    assert model.configs == configs
    assert model.peft_config["default"].rank_pattern == {"v_proj": 2}
    assert list(model.peft_config["default"].modules_to_save) == ["lm_head"]
    assert model.saved_modules == saved_modules
    assert model.adapter_names == ("default",) and model.active_adapter == "default"
    assert jax.tree.structure(model) == tree
    assert all(x is y for x, y in zip(jax.tree.leaves(model), leaves, strict=True))


# ---------------------------------------------------------------- merging safely


def _with_nan(peft_model, field_path, index):
    """`peft_model` with one row of the trainable leaf whose key path contains all of
    `field_path` set to NaN."""
    trainable, frozen = peftx.partition(peft_model)
    flat, tree = jax.tree_util.tree_flatten_with_path(trainable)
    hits = [
        i for i, (p, _) in enumerate(flat) if all(s in jax.tree_util.keystr(p) for s in field_path)
    ]
    assert len(hits) == 1
    leaves = [x for _, x in flat]
    leaves[hits[0]] = leaves[hits[0]].at[index].set(jnp.nan)
    return eqx.combine(jax.tree.unflatten(tree, leaves), frozen)


def test_safe_merge_names_the_layer_of_a_stack(base_llama):
    model = _with_nan(lora(base_llama), ("q_proj", "lora_B"), (1, 0, 0))  # layer 1 of the stack
    with pytest.raises(
        ValueError, match=r"adapter 'default' into model\.layers\.1\.self_attn\.q_proj "
    ):
        model.merge_and_unload(safe_merge=True)
    merged = model.merge_and_unload()  # PEFT's default: no check
    assert not all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(merged))


@pytest.fixture(scope="module")
def merge_inputs(checkpoints, base_llama, tmp_path_factory):
    """Adapters of the tiny Llama: a broken LoRA factor, a broken `modules_to_save` copy."""
    root = tmp_path_factory.mktemp("merge")
    _with_nan(lora(base_llama), ("q_proj", "lora_B"), (1, 0, 0)).save_pretrained(root / "factor")
    head = lora(base_llama, modules_to_save=["lm_head"])
    _with_nan(head, ("lm_head",), (0, 0)).save_pretrained(root / "head")
    return root


@pytest.mark.parametrize(
    "adapter, named",
    [("factor", r"model\.layers\.1\.self_attn\.q_proj"), ("head", "lm_head")],
)
def test_merge_command_writes_nothing_non_finite(
    checkpoints, merge_inputs, tmp_path, capsys, adapter, named
):
    out = tmp_path / "merged"
    code, stdout, err = run_cli(capsys, "merge", checkpoints / "llama", merge_inputs / adapter, out)
    assert code == 1 and stdout == "" and err.count("\n") == 1, (stdout, err)
    assert err.startswith("peftx: error: ") and "NaN or infinite" in err
    assert re.search(named, err), err
    assert not out.exists()
