"""The files of an adapter saved in HF PEFT's format: what peftx writes (keys, shapes, dtypes,
metadata, `adapter_config.json`) against what PyTorch PEFT writes for the same model and
config; stacked and unrolled models writing the same bytes; and loading that refuses
damaged or mismatched files (with errors naming the culprit) while leaving the model it
was given as it was. Tiny random-init transformers checkpoints, fp32 unless said."""

import json
import os
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import safetensors.numpy
import safetensors.torch
import torch
import transformers
from helpers import example_count
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import peftx
import peftx.models as pm

VOCAB = 97
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
CARD = "README.md"
PREFIX = "base_model.model."
# keys of adapter_config.json that legitimately differ between the two writers
BOOKKEEPING = {"peft_version", "auto_mapping", "base_model_name_or_path"}


def _llama_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


BUILDERS = {
    "llama": lambda: transformers.LlamaForCausalLM(_llama_config()),
    "llama-cls": lambda: transformers.LlamaForSequenceClassification(_llama_config(num_labels=3)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=3, n_head=4)
    ),
}
AUTO = {
    "llama": transformers.AutoModelForCausalLM,
    "llama-cls": transformers.AutoModelForSequenceClassification,
    "gpt2": transformers.AutoModelForCausalLM,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    built = {}

    def get(kind):
        if kind not in built:
            torch.manual_seed(sorted(BUILDERS).index(kind))
            path = tmp_path_factory.mktemp(kind)
            BUILDERS[kind]().eval().save_pretrained(path)
            built[kind] = path
        return built[kind]

    return get


@pytest.fixture(scope="module")
def base(checkpoint):
    built = {}

    def get(kind, layout="stacked"):
        if (kind, layout) not in built:
            built[kind, layout] = pm.from_pretrained(checkpoint(kind), layout=layout)
        return built[kind, layout]

    return get


def randomized(peft_model, seed, adapters=None, scale=0.3):
    """Every trainable leaf of `adapters` drawn at random (IA3 scales around one)."""
    trainable, frozen = peftx.partition(peft_model, adapters)
    flat, treedef = jax.tree_util.tree_flatten_with_path(trainable)
    rng = np.random.default_rng(seed)
    leaves = []
    for path, x in flat:
        noise = scale * rng.standard_normal(x.shape).astype(np.float32)
        if "ia3_l" in jax.tree_util.keystr(path):
            noise = 1.0 + noise
        leaves.append(jnp.asarray(noise, x.dtype))
    return eqx.combine(jax.tree.unflatten(treedef, leaves), frozen)


def layout_of(path):
    """`{key: (shape, dtype)}` of a safetensors file, and its metadata."""
    with safe_open(str(path), "numpy") as f:
        return {
            k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()
        }, f.metadata()


def tree_files(directory, suffixes=None):
    """Every file under `directory` (with `suffixes`, only those), relative paths."""
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and (suffixes is None or p.suffix in suffixes)
    )


@eqx.filter_jit
def _logits(model, ids, mask):
    return model(ids, mask).logits


def batch():
    ids = np.random.RandomState(1).randint(3, VOCAB, (2, 7))
    mask = np.ones_like(ids)
    mask[0, :2] = 0
    return jnp.asarray(np.where(mask == 1, ids, 0)), jnp.asarray(mask)


def array_leaves(tree):
    return [x for x in jax.tree.leaves(tree) if eqx.is_array(x)]


def assert_same_leaves(a, b):
    la, lb = array_leaves(a), array_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------- same files as PEFT

CASES = {
    "llama-qv": (
        "llama",
        "LoraConfig",
        dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    ),
    "llama-all-linear": ("llama", "LoraConfig", dict(r=2, target_modules="all-linear")),
    "gpt2-c_attn": ("gpt2", "LoraConfig", dict(r=4, target_modules=["c_attn"])),
    "llama-ia3": (
        "llama",
        "IA3Config",
        dict(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    ),
    "llama-dora": (
        "llama",
        "LoraConfig",
        dict(r=4, target_modules=["q_proj", "v_proj"], use_dora=True),
    ),
    "llama-embedding": (
        "llama",
        "LoraConfig",
        dict(r=4, target_modules=["embed_tokens", "q_proj"]),
    ),
    "llama-seq-cls": (
        "llama-cls",
        "LoraConfig",
        dict(r=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS"),
    ),
    "llama-layers-rank-pattern": (
        "llama",
        "LoraConfig",
        dict(
            r=2,
            target_modules=["q_proj", "v_proj"],
            layers_to_transform=[1, 2],
            rank_pattern={"q_proj": 4},
        ),
    ),
    "gpt2-ia3": (
        "gpt2",
        "IA3Config",
        dict(target_modules=["c_attn", "mlp.c_proj"], feedforward_modules=["mlp.c_proj"]),
    ),
    "gpt2-dora": (
        "gpt2",
        "LoraConfig",
        dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], use_dora=True),
    ),
    # per-layer patterns: the stack splits where the rank changes
    "llama-per-layer-patterns": (
        "llama",
        "LoraConfig",
        dict(
            r=2,
            target_modules=["q_proj", "v_proj"],
            rank_pattern={"model.layers.1.self_attn.q_proj": 4},
            alpha_pattern={"layers.2.self_attn.v_proj": 16},
        ),
    ),
    # 21 full module paths: PEFT condenses them to minimal suffixes, and saves those
    "llama-21-full-paths": (
        "llama",
        "LoraConfig",
        dict(
            r=2,
            target_modules=[
                f"model.layers.{i}.{m}"
                for i in range(3)
                for m in (
                    "self_attn.q_proj",
                    "self_attn.k_proj",
                    "self_attn.v_proj",
                    "self_attn.o_proj",
                    "mlp.gate_proj",
                    "mlp.up_proj",
                    "mlp.down_proj",
                )
            ],
        ),
    ),
}
SECOND = dict(r=2, lora_alpha=2, target_modules=["k_proj", "o_proj", "up_proj"])


def assert_same_adapter_dir(ours, theirs):
    """peftx's files in `ours` are PEFT's in `theirs`: keys, shapes, dtypes, metadata;
    and the configs agree on every key PEFT writes (bookkeeping aside)."""
    our_layout, our_meta = layout_of(ours / WEIGHTS)
    their_layout, their_meta = layout_of(theirs / WEIGHTS)
    assert sorted(our_layout) == sorted(their_layout)
    assert our_layout == their_layout
    assert our_meta == their_meta == {"format": "pt"}
    mine = json.loads((ours / CONFIG).read_text())
    peft_dict = json.loads((theirs / CONFIG).read_text())
    assert sorted(set(mine) - BOOKKEEPING) == sorted(set(peft_dict) - BOOKKEEPING)
    for key, value in peft_dict.items():
        if key in BOOKKEEPING:
            continue
        if key in ("target_modules", "feedforward_modules") and isinstance(value, list):
            # PEFT keeps these as sets: its list order is arbitrary
            assert sorted(mine[key]) == sorted(value), key
        else:
            assert mine[key] == value, key
    assert mine["inference_mode"] is True


@pytest.mark.parametrize(
    "case",
    [
        # GPT-2's DoRA and IA3 files: the fast tier has PEFT read them back tensor for tensor
        # in test_peft_interop, and checks GPT-2's Conv1D config here on gpt2-c_attn
        pytest.param(c, marks=pytest.mark.variant_sweep) if c in ("gpt2-dora", "gpt2-ia3") else c
        for c in sorted(CASES)
    ],
)
def test_same_files_as_peft(case, checkpoint, base, tmp_path):
    kind, cls, kwargs = CASES[case]
    ours = peftx.get_peft_model(base(kind), getattr(peftx, cls)(**kwargs), key=jax.random.key(0))
    ours.save_pretrained(tmp_path / "ours")
    theirs = peft.get_peft_model(
        AUTO[kind].from_pretrained(checkpoint(kind)), getattr(peft, cls)(**kwargs)
    )
    theirs.save_pretrained(tmp_path / "theirs")
    assert_same_adapter_dir(tmp_path / "ours", tmp_path / "theirs")
    files = tree_files(tmp_path / "ours")
    assert files == tree_files(tmp_path / "theirs") == [CARD, CONFIG, WEIGHTS]


@pytest.mark.parametrize("save_embedding_layers", [True, False])
@pytest.mark.parametrize("case", ["llama-qv", "llama-embedding"])
def test_save_embedding_layers_as_peft(case, save_embedding_layers, checkpoint, base, tmp_path):
    kind, cls, kwargs = CASES[case]
    ours = peftx.get_peft_model(base(kind), getattr(peftx, cls)(**kwargs), key=jax.random.key(0))
    ours.save_pretrained(tmp_path / "ours", save_embedding_layers=save_embedding_layers)
    theirs = peft.get_peft_model(
        AUTO[kind].from_pretrained(checkpoint(kind)), getattr(peft, cls)(**kwargs)
    )
    theirs.save_pretrained(tmp_path / "theirs", save_embedding_layers=save_embedding_layers)
    assert_same_adapter_dir(tmp_path / "ours", tmp_path / "theirs")
    x = load_file(str(tmp_path / "ours" / WEIGHTS))
    y = load_file(str(tmp_path / "theirs" / WEIGHTS))
    for k in x:
        if "lora" not in k:  # base weights written beside the adapter: the checkpoint's
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


LLAMA_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@settings(
    max_examples=example_count(6),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    r=st.integers(1, 5),
    targets=st.sets(st.sampled_from(LLAMA_LINEAR), min_size=1, max_size=3),
    layers=st.sets(st.integers(0, 2), min_size=1),
    pattern=st.one_of(st.none(), st.tuples(st.sampled_from(LLAMA_LINEAR), st.integers(1, 6))),
    layout=st.sampled_from(["stacked", "unrolled"]),
)
def test_random_configs_same_keys_and_shapes_as_peft(
    r, targets, layers, pattern, layout, checkpoint, base, tmp_path_factory
):
    kwargs = dict(r=r, target_modules=sorted(targets), layers_to_transform=sorted(layers))
    if pattern is not None:
        kwargs["rank_pattern"] = {pattern[0]: pattern[1]}
    tmp = tmp_path_factory.mktemp("random")
    ours = peftx.get_peft_model(
        base("llama", layout), peftx.LoraConfig(**kwargs), key=jax.random.key(0)
    )
    ours.save_pretrained(tmp / "ours")
    theirs = peft.get_peft_model(
        AUTO["llama"].from_pretrained(checkpoint("llama")), peft.LoraConfig(**kwargs)
    )
    theirs.save_pretrained(tmp / "theirs")
    assert_same_adapter_dir(tmp / "ours", tmp / "theirs")


def test_gpt2_conv1d_targets_are_fan_in_fan_out(base, tmp_path):
    ours = peftx.get_peft_model(
        base("gpt2"), peftx.LoraConfig(r=4, target_modules=["c_attn"]), key=jax.random.key(0)
    )
    ours.save_pretrained(tmp_path)
    assert json.loads((tmp_path / CONFIG).read_text())["fan_in_fan_out"] is True


@pytest.mark.parametrize("kind", ["llama", "llama-cls"])
def test_two_adapters_same_files_as_peft(kind, checkpoint, base, tmp_path):
    """Two adapters (for the classifier, each with its own copy of the head)."""
    task = dict(task_type="SEQ_CLS") if kind == "llama-cls" else {}
    first = dict(r=4, target_modules=["q_proj", "v_proj"], **task)
    second = {**SECOND, **task}
    ours = peftx.get_peft_model(base(kind), peftx.LoraConfig(**first), key=jax.random.key(0))
    ours = ours.add_adapter("other", peftx.LoraConfig(**second), key=jax.random.key(1))
    ours.save_pretrained(tmp_path / "ours")
    theirs = peft.get_peft_model(
        AUTO[kind].from_pretrained(checkpoint(kind)), peft.LoraConfig(**first)
    )
    theirs.add_adapter("other", peft.LoraConfig(**second))
    theirs.save_pretrained(tmp_path / "theirs")
    assert tree_files(tmp_path / "ours") == tree_files(tmp_path / "theirs")
    assert_same_adapter_dir(tmp_path / "ours", tmp_path / "theirs")
    assert_same_adapter_dir(tmp_path / "ours" / "other", tmp_path / "theirs" / "other")


def test_selected_adapters(base, tmp_path):
    ours = peftx.get_peft_model(
        base("llama"), peftx.LoraConfig(r=4, target_modules=["q_proj"]), key=jax.random.key(0)
    )
    ours = ours.add_adapter("other", peftx.LoraConfig(**SECOND), key=jax.random.key(1))
    ours.save_pretrained(tmp_path, selected_adapters=["other"])
    assert tree_files(tmp_path) == [CARD, f"other/{CONFIG}", f"other/{WEIGHTS}"]


def test_bf16_factors_written_in_bf16(base, tmp_path):
    ours = randomized(
        peftx.get_peft_model(
            base("llama"), peftx.LoraConfig(r=4, target_modules=["q_proj"]), key=jax.random.key(0)
        ),
        seed=1,
    )
    trainable, frozen = peftx.partition(ours)
    trainable = jax.tree.map(lambda x: x.astype(jnp.bfloat16), trainable)
    ours = eqx.combine(trainable, frozen)
    ours.save_pretrained(tmp_path)
    tensors, _ = layout_of(tmp_path / WEIGHTS)
    assert len(tensors) == 2 * 3
    assert {dtype for _, dtype in tensors.values()} == {"BF16"}
    # the bits are ours: layer 1's lora_A is the second slice of the stacked factor
    with safe_open(str(tmp_path / WEIGHTS), "pt") as f:
        saved = f.get_tensor(PREFIX + "model.layers.1.self_attn.q_proj.lora_A.weight")
    stacked = [
        x
        for p, x in jax.tree_util.tree_flatten_with_path(trainable)[0]
        if "lora_A" in jax.tree_util.keystr(p)
    ]
    assert len(stacked) == 1 and stacked[0].shape == (3, 4, 32)
    np.testing.assert_array_equal(
        saved.view(torch.int16).numpy(), np.asarray(stacked[0][1]).view(np.int16)
    )


# ---------------------------------------------------------------- stacked == unrolled


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(r=4, target_modules=["q_proj", "v_proj"]),
        dict(
            r=2,
            target_modules=["q_proj", "down_proj"],
            layers_to_transform=[1, 2],
            rank_pattern={"q_proj": 4},
        ),
    ],
    ids=["whole-stack", "split-stack"],
)
def test_stacked_and_unrolled_write_the_same_bytes(kwargs, base, tmp_path):
    config = peftx.LoraConfig(**kwargs)
    stacked = randomized(peftx.get_peft_model(base("llama"), config, key=jax.random.key(0)), seed=2)
    stacked.save_pretrained(tmp_path / "stacked")
    unrolled = peftx.PeftModel.from_pretrained(base("llama", "unrolled"), tmp_path / "stacked")
    unrolled.save_pretrained(tmp_path / "unrolled")
    for name in (WEIGHTS, CONFIG):
        assert (tmp_path / "stacked" / name).read_bytes() == (
            tmp_path / "unrolled" / name
        ).read_bytes()
    # and back: a fresh stacked model loading the unrolled files writes them again
    again = peftx.PeftModel.from_pretrained(base("llama"), tmp_path / "unrolled")
    again.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / WEIGHTS).read_bytes() == (
        tmp_path / "stacked" / WEIGHTS
    ).read_bytes()
    ids, mask = batch()
    np.testing.assert_allclose(
        np.asarray(_logits(unrolled, ids, mask)), np.asarray(_logits(stacked, ids, mask)), atol=1e-5
    )


# ---------------------------------------------------------------- is_trainable


@pytest.fixture(scope="module")
def saved(base, tmp_path_factory):
    """A Llama LoRA (q_proj, v_proj) with random factors, saved; and the model."""
    path = tmp_path_factory.mktemp("adapter")
    model = randomized(
        peftx.get_peft_model(
            base("llama"),
            peftx.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
            key=jax.random.key(0),
        ),
        seed=3,
    )
    model.save_pretrained(path)
    return path, model


def test_loaded_equals_saved(saved, base):
    path, model = saved
    loaded = peftx.PeftModel.from_pretrained(base("llama"), path)
    assert loaded.adapter_names == ("default",)
    # the adapter's arrays are the saved model's, leaf for leaf
    assert_same_leaves(loaded, model)


def test_not_trainable_by_default(saved, base):
    path, _ = saved
    loaded = peftx.PeftModel.from_pretrained(base("llama"), path)
    assert loaded.peft_config["default"].inference_mode is True
    trainable, _ = peftx.partition(loaded)
    assert array_leaves(trainable) == []


def test_is_trainable(saved, base):
    path, model = saved
    loaded = peftx.PeftModel.from_pretrained(base("llama"), path, is_trainable=True)
    trainable, frozen = peftx.partition(loaded)
    want, _ = peftx.partition(model)
    assert len(array_leaves(trainable)) == len(array_leaves(want)) > 0
    assert_same_leaves(trainable, want)
    ids, mask = batch()

    def loss(t):
        return jnp.sum(jnp.square(eqx.combine(t, frozen)(ids, mask).logits))

    grads = jax.grad(loss)(trainable)
    assert all(float(jnp.abs(g).max()) > 0 for g in array_leaves(grads))


def test_load_adapter_is_trainable(saved, base):
    path, _ = saved
    loaded = peftx.PeftModel.from_pretrained(base("llama"), path)
    both = loaded.load_adapter(path, "second", is_trainable=True)
    assert both.adapter_names == ("default", "second")
    assert loaded.adapter_names == ("default",)  # functional: the input is unchanged
    assert len(array_leaves(peftx.partition(both, ["second"])[0])) > 0
    # an adapter loaded for inference refuses to train
    with pytest.raises(ValueError, match="is_trainable"):
        peftx.partition(both.load_adapter(path, "third"), ["third"])


def test_subfolder_is_read(saved, base, tmp_path):
    path, model = saved
    shutil.copytree(path, tmp_path / "other")
    loaded = peftx.PeftModel.from_pretrained(base("llama"), tmp_path, adapter_name="other")
    assert loaded.adapter_names == ("other",)
    both = peftx.PeftModel.from_pretrained(base("llama"), path).load_adapter(tmp_path, "other")
    assert both.adapter_names == ("default", "other")
    ids, mask = batch()
    want = np.asarray(_logits(model, ids, mask))
    np.testing.assert_array_equal(np.asarray(_logits(loaded, ids, mask)), want)
    np.testing.assert_array_equal(np.asarray(_logits(both.set_adapter("other"), ids, mask)), want)


# ---------------------------------------------------------------- faults


def _broken(saved, tmp_path, edit):
    """A copy of the saved adapter whose tensors `edit` changed (re-saved with
    safetensors, PEFT's metadata kept)."""
    path, _ = saved
    target = tmp_path / "broken"
    shutil.copytree(path, target)
    tensors = load_file(str(target / WEIGHTS))
    save_file(edit(tensors), str(target / WEIGHTS), metadata={"format": "pt"})
    return target


Q1 = PREFIX + "model.layers.1.self_attn.q_proj"


def _expect_load_error(base, directory, match, error=peftx.CheckpointError):
    """Loading fails with `error` matching `match`, and the model given (and a PeftModel's
    adapters) come out as they went in."""
    model = base("llama")
    ids, mask = batch()
    before = np.asarray(_logits(model, ids, mask))
    leaves = [np.array(x) for x in array_leaves(model)]
    with pytest.raises(error, match=match) as info:
        peftx.PeftModel.from_pretrained(model, directory)
    for x, y in zip(array_leaves(model), leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)
    np.testing.assert_array_equal(np.asarray(_logits(model, ids, mask)), before)

    other = peftx.get_peft_model(
        model, peftx.LoraConfig(r=2, target_modules=["k_proj"]), key=jax.random.key(9)
    )
    snapshot = [np.array(x) for x in array_leaves(other)]
    with pytest.raises(error, match=match):
        other.load_adapter(directory, "new")
    assert other.adapter_names == ("default",)
    for x, y in zip(array_leaves(other), snapshot, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    return str(info.value)


def test_missing_key(saved, base, tmp_path):
    def drop(t):
        del t[Q1 + ".lora_B.weight"]
        return t

    message = _expect_load_error(
        base, _broken(saved, tmp_path, drop), r"layers\.1\.self_attn\.q_proj"
    )
    assert "lora_B" in message


def test_unexpected_key(saved, base, tmp_path):
    def add(t):
        t[PREFIX + "model.layers.1.self_attn.k_proj.lora_A.weight"] = np.ones((4, 32), np.float32)
        return t

    _expect_load_error(base, _broken(saved, tmp_path, add), r"layers\.1\.self_attn\.k_proj")


def test_wrong_shape(saved, base, tmp_path):
    def reshape(t):
        t[Q1 + ".lora_A.weight"] = np.ones((4, 31), np.float32)
        return t

    message = _expect_load_error(
        base, _broken(saved, tmp_path, reshape), r"layers\.1\.self_attn\.q_proj"
    )
    assert "(4, 31)" in message and "(4, 32)" in message


def test_wrong_rank_in_config(saved, base, tmp_path):
    """The config says r=2, the file holds rank-4 factors: a shape error, not a silent crop."""
    path, _ = saved
    target = tmp_path / "r2"
    shutil.copytree(path, target)
    config = json.loads((target / CONFIG).read_text())
    config["r"] = 2
    (target / CONFIG).write_text(json.dumps(config))
    message = _expect_load_error(base, target, r"self_attn\.(q|v)_proj")
    assert "(2, 32)" in message and "(4, 32)" in message


def test_keys_without_prefix(saved, base, tmp_path):
    def strip(t):
        return {k.removeprefix(PREFIX): v for k, v in t.items()}

    _expect_load_error(base, _broken(saved, tmp_path, strip), r"self_attn\.(q|v)_proj")


def _damaged(saved, tmp_path, damage):
    path, _ = saved
    target = tmp_path / "damaged"
    shutil.copytree(path, target)
    data = (target / WEIGHTS).read_bytes()
    (target / WEIGHTS).write_bytes(damage(data))
    return target


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: b"\x93NUMPY garbage" * 20,
        lambda data: data[: len(data) // 2],
        lambda data: b"",
        lambda data: data[:8],  # the header length alone
    ],
    ids=["garbage", "truncated", "empty", "header-length-only"],
)
def test_damaged_file(saved, base, tmp_path, damage):
    _expect_load_error(base, _damaged(saved, tmp_path, damage), WEIGHTS)


def test_missing_directory(base, tmp_path):
    _expect_load_error(base, tmp_path / "nowhere", "", FileNotFoundError)


def test_missing_config(saved, base, tmp_path):
    path, _ = saved
    (tmp_path / "w").mkdir()
    shutil.copy(path / WEIGHTS, tmp_path / "w" / WEIGHTS)
    _expect_load_error(base, tmp_path / "w", CONFIG, FileNotFoundError)


def test_missing_weights(saved, base, tmp_path):
    path, _ = saved
    (tmp_path / "c").mkdir()
    shutil.copy(path / CONFIG, tmp_path / "c" / CONFIG)
    with pytest.raises((FileNotFoundError, peftx.CheckpointError), match=WEIGHTS):
        peftx.PeftModel.from_pretrained(base("llama"), tmp_path / "c")


def test_unknown_config_key_warns_and_loads(saved, base, tmp_path):
    path, model = saved
    target = tmp_path / "future"
    shutil.copytree(path, target)
    config = json.loads((target / CONFIG).read_text())
    config["some_future_option"] = 3
    (target / CONFIG).write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="some_future_option"):
        loaded = peftx.PeftModel.from_pretrained(base("llama"), target)
    ids, mask = batch()
    np.testing.assert_array_equal(
        np.asarray(_logits(loaded, ids, mask)), np.asarray(_logits(model, ids, mask))
    )


def test_adapter_of_another_architecture(base, tmp_path):
    """A GPT-2 adapter (c_attn) on a Llama: refused as not belonging (not as a typo),
    naming its modules; see also test_adapter_trust.py."""
    gpt2 = peftx.get_peft_model(
        base("gpt2"), peftx.LoraConfig(r=4, target_modules=["c_attn"]), key=jax.random.key(0)
    )
    gpt2.save_pretrained(tmp_path / "gpt2")
    message = _expect_load_error(base, tmp_path / "gpt2", r"does not belong to this model")
    assert "'transformer.h.0.attn.c_attn'" in message and "spelling" not in message


def test_adapter_saved_under_another_name(saved, base, tmp_path):
    """A single adapter not named "default" goes to its subfolder (PEFT's layout) and is
    found there by name."""
    path, model = saved
    named = peftx.PeftModel.from_pretrained(base("llama"), path, adapter_name="mine")
    assert named.adapter_names == ("mine",)
    named.save_pretrained(tmp_path)
    assert tree_files(tmp_path) == [CARD, f"mine/{CONFIG}", f"mine/{WEIGHTS}"]
    for f in (CONFIG, WEIGHTS):
        assert (tmp_path / "mine" / f).read_bytes() == (path / f).read_bytes()
    again = peftx.PeftModel.from_pretrained(base("llama"), tmp_path, adapter_name="mine")
    ids, mask = batch()
    np.testing.assert_array_equal(
        np.asarray(_logits(again, ids, mask)), np.asarray(_logits(model, ids, mask))
    )
    with pytest.raises(FileNotFoundError):
        peftx.PeftModel.from_pretrained(base("llama"), tmp_path)  # no "default" there


def test_modules_to_save_train_when_loaded_trainable(base, tmp_path):
    ours = randomized(
        peftx.get_peft_model(
            base("llama-cls"),
            peftx.LoraConfig(r=2, target_modules=["q_proj"], task_type="SEQ_CLS"),
            key=jax.random.key(0),
        ),
        seed=5,
    )
    ours.save_pretrained(tmp_path)
    assert PREFIX + "score.weight" in load_file(str(tmp_path / WEIGHTS))
    loaded = peftx.PeftModel.from_pretrained(base("llama-cls"), tmp_path, is_trainable=True)
    assert_same_leaves(peftx.partition(loaded)[0], peftx.partition(ours)[0])
    score = loaded.saved_modules["default"]["score"]
    np.testing.assert_array_equal(
        np.asarray(score.weight), np.asarray(ours.saved_modules["default"]["score"].weight)
    )
    assert not np.array_equal(np.asarray(score.weight), np.asarray(base("llama-cls").score.weight))
    frozen = peftx.PeftModel.from_pretrained(base("llama-cls"), tmp_path)
    assert array_leaves(peftx.partition(frozen)[0]) == []


@pytest.mark.parametrize(
    "text, match",
    [
        ("{", CONFIG),
        ("[]", CONFIG),
        (json.dumps({"peft_type": "BOFT", "r": 4}), "BOFT"),
        (json.dumps({"peft_type": "LORA", "r": "four", "target_modules": ["q_proj"]}), "r"),
    ],
    ids=["invalid-json", "not-an-object", "unknown-peft-type", "bad-value"],
)
def test_bad_config(saved, base, tmp_path, text, match):
    path, _ = saved
    target = tmp_path / "bad"
    shutil.copytree(path, target)
    (target / CONFIG).write_text(text)
    _expect_load_error(base, target, match, (ValueError, TypeError))


def test_file_without_metadata_loads(saved, base, tmp_path):
    """PEFT reads safetensors files without the `format` metadata; so does peftx."""
    path, model = saved
    target = _broken(saved, tmp_path, lambda t: t)
    save_file(load_file(str(path / WEIGHTS)), str(target / WEIGHTS))
    assert layout_of(target / WEIGHTS)[1] is None
    loaded = peftx.PeftModel.from_pretrained(base("llama"), target)
    assert_same_leaves(loaded, model)


def test_save_into_a_file_path(saved, tmp_path):
    _, model = saved
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        model.save_pretrained(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "x"


def test_from_pretrained_wants_a_plain_model(saved):
    path, model = saved
    with pytest.raises(TypeError, match="load_adapter"):
        peftx.PeftModel.from_pretrained(model, path)


def test_load_adapter_existing_name(saved, base):
    path, _ = saved
    loaded = peftx.PeftModel.from_pretrained(base("llama"), path)
    snapshot = [np.array(x) for x in array_leaves(loaded)]
    with pytest.raises(ValueError, match="default"):
        loaded.load_adapter(path, "default")
    assert loaded.adapter_names == ("default",)
    for x, y in zip(array_leaves(loaded), snapshot, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_wrong_peft_type_for_load_adapter(saved, base, tmp_path):
    """An IA3 adapter cannot join LoRA ones (PEFT's rule), and the model is left alone."""
    ia3 = peftx.get_peft_model(
        base("llama"), peftx.IA3Config(target_modules=["k_proj"]), key=jax.random.key(0)
    )
    ia3.save_pretrained(tmp_path / "ia3")
    path, _ = saved
    loaded = peftx.PeftModel.from_pretrained(base("llama"), path)
    with pytest.raises(ValueError):
        loaded.load_adapter(tmp_path / "ia3", "ia3")
    assert loaded.adapter_names == ("default",)


# ---------------------------------------------------------------- writing


def _save_crashing(monkeypatch, ours, directory, patch):
    import peftx._peft_io as io

    patch(monkeypatch, io)
    with pytest.raises(OSError, match="disk full"):
        ours.save_pretrained(directory)
    monkeypatch.undo()


def _crash_in_save_file(monkeypatch, io):
    real = safetensors.numpy.save_file

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    assert real is not None
    monkeypatch.setattr(safetensors.numpy, "save_file", crash)
    if hasattr(io, "save_file"):
        monkeypatch.setattr(io, "save_file", crash)


def _crash_in_swap(monkeypatch, io):
    """The atomic swap of the new directory for the old one fails."""
    import peftx._files as files

    def crash(a, b):
        raise OSError("disk full")

    monkeypatch.setattr(files, "_exchange", crash)


def _crash_in_second_rename(monkeypatch, io):
    """Without an atomic swap (a file system without `renameat2`), the old directory is
    renamed aside and the second rename, of the new one into place, fails: the directory
    must come back as it was, not be left missing or half new."""
    import peftx._files as files

    real = os.rename
    calls = []

    def crash(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("disk full")
        real(src, dst)

    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    monkeypatch.setattr(os, "rename", crash)


@pytest.mark.parametrize(
    "patch",
    [
        _crash_in_save_file,
        _crash_in_swap,
        _crash_in_second_rename,
    ],
    ids=["save_file", "swap", "second-rename"],
)
def test_failed_save_leaves_earlier_adapter(saved, base, tmp_path, monkeypatch, patch):
    path, model = saved
    shutil.copytree(path, tmp_path / "out")
    before = {f: (tmp_path / "out" / f).read_bytes() for f in tree_files(tmp_path / "out")}
    newer = peftx.get_peft_model(
        base("llama"),
        peftx.LoraConfig(r=2, target_modules=["k_proj", "o_proj"]),
        key=jax.random.key(5),
    )
    newer = newer.add_adapter("other", peftx.LoraConfig(**SECOND), key=jax.random.key(6))
    _save_crashing(monkeypatch, newer, tmp_path / "out", patch)
    after = {f: (tmp_path / "out" / f).read_bytes() for f in tree_files(tmp_path / "out")}
    assert after == before  # nothing replaced, no temporary file left
    loaded = peftx.PeftModel.from_pretrained(base("llama"), tmp_path / "out")
    assert_same_leaves(loaded, model)


def test_save_writes_only_json_safetensors_and_the_card(base, tmp_path):
    ours = peftx.get_peft_model(
        base("llama-cls"),
        peftx.LoraConfig(r=2, target_modules=["q_proj"], task_type="SEQ_CLS"),
        key=jax.random.key(0),
    )
    ours = ours.add_adapter(
        "other",
        peftx.LoraConfig(r=2, target_modules=["v_proj"], task_type="SEQ_CLS"),
        key=jax.random.key(1),
    )
    ours.save_pretrained(tmp_path)
    files = tree_files(tmp_path)
    assert files == sorted([CARD, CONFIG, WEIGHTS, f"other/{CONFIG}", f"other/{WEIGHTS}"])
    for f in files:
        data = (tmp_path / f).read_bytes()
        assert not data.startswith(b"\x80"), f  # no pickle
        assert not data.startswith(b"PK"), f  # no zip (torch.save)
    json.loads((tmp_path / CONFIG).read_text())
    # saving again over it leaves the same files, not copies beside them
    ours.save_pretrained(tmp_path)
    assert tree_files(tmp_path) == files


def test_save_then_load_in_peft_reads_bf16(base, checkpoint, tmp_path):
    """A bf16 file loads in PEFT too (it casts to the model's dtype): the values are the
    bf16 ones."""
    ours = randomized(
        peftx.get_peft_model(
            base("llama"), peftx.LoraConfig(r=4, target_modules=["v_proj"]), key=jax.random.key(0)
        ),
        seed=4,
    )
    trainable, frozen = peftx.partition(ours)
    ours = eqx.combine(jax.tree.map(lambda x: x.astype(jnp.bfloat16), trainable), frozen)
    ours.save_pretrained(tmp_path)
    theirs = peft.PeftModel.from_pretrained(
        AUTO["llama"].from_pretrained(checkpoint("llama")), tmp_path
    )
    state = peft.utils.get_peft_model_state_dict(theirs)
    file = safetensors.torch.load_file(str(tmp_path / WEIGHTS))
    assert sorted(state) == sorted(file)
    for k, v in file.items():
        assert v.dtype == torch.bfloat16
        assert float(v.float().abs().max()) > 0
        np.testing.assert_array_equal(state[k].float().numpy(), v.float().numpy())


@pytest.mark.parametrize("name", ["../escape", "a/b", ".."])
def test_adapter_name_cannot_leave_the_directory(base, tmp_path, name):
    ours = peftx.get_peft_model(
        base("llama"), peftx.LoraConfig(r=2, target_modules=["q_proj"]), key=jax.random.key(0)
    )
    ours = ours.add_adapter(
        name, peftx.LoraConfig(r=2, target_modules=["v_proj"]), key=jax.random.key(1)
    )
    with pytest.raises(ValueError, match="outside"):
        ours.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "escape").exists()
    assert (
        not any((tmp_path / "out").glob("**/*.safetensors"))
        if (tmp_path / "out").exists()
        else True
    )
