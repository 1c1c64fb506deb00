"""HF checkpoints in and out (`peftx.from_pretrained`, `peftx.save_pretrained`), against
transformers in PyTorch on the same weights: tiny random-init models saved by
transformers' own `save_pretrained` and read back by transformers' own `from_pretrained`."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import torch
import transformers
from helpers import tiny_llama_config
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import peftx
import peftx.models as pm
from peftx import CheckpointError
from peftx.models import _checkpoint

VOCAB = 97


def hf_config(model_type="llama", **overrides):
    """A tiny transformers config of the Llama family."""
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
    }[model_type]
    return cls(**kwargs)


def save_hf(path, model_cls=transformers.LlamaForCausalLM, config=None, seed=0, **kwargs):
    """A random-init transformers model, saved to `path`; returns the model."""
    torch.manual_seed(seed)
    model = model_cls(config or hf_config()).eval()
    model.save_pretrained(path, **kwargs)
    return model


def inputs(seq=7):
    """Two rows of token ids, the first left-padded by two."""
    ids = np.random.RandomState(1).randint(3, VOCAB, (2, seq))
    mask = np.ones_like(ids)
    mask[0, :2] = 0
    return ids, mask


def torch_out(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    field = "last_hidden_state" if hasattr(out, "last_hidden_state") else "logits"
    return getattr(out, field).float().numpy()


def jax_out(model, ids, mask):
    out = model(jnp.asarray(ids), jnp.asarray(mask))
    field = "last_hidden_state" if hasattr(out, "last_hidden_state") else "logits"
    return np.asarray(getattr(out, field), np.float32)


def assert_same(ours, theirs, mask, atol):
    """Outputs equal within `atol`; per-token outputs only at real tokens (at a padding
    position transformers and peftx compute different, unused values)."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape
    if ours.ndim == 3:
        real = np.asarray(mask).astype(bool)
        ours, theirs = ours[real], theirs[real]
    np.testing.assert_allclose(ours, theirs, atol=atol, rtol=0)


def random_model(cls, config, seed, **kwargs):
    """A `cls` model with every floating leaf drawn at random (norm scales around 1), so
    a tensor saved under the wrong name or transposed cannot go unnoticed. (Drawn with
    numpy into the model's shapes: eager jax.random per leaf compiles many tiny programs.)"""
    skeleton = eqx.filter_eval_shape(lambda k: cls(config, key=k, **kwargs), jax.random.PRNGKey(0))
    rng = np.random.default_rng(seed)
    flat, treedef = jax.tree_util.tree_flatten_with_path(skeleton)
    leaves = []
    for path, x in flat:
        if not isinstance(x, jax.ShapeDtypeStruct):
            leaves.append(x)
            continue
        noise = 0.1 * rng.standard_normal(x.shape, dtype=np.float32)
        value = 1.0 + noise if "norm" in jax.tree_util.keystr(path) else noise
        leaves.append(jnp.asarray(value.astype(x.dtype)))
    return jax.tree.unflatten(treedef, leaves)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A LlamaForCausalLM in one model.safetensors, and the torch model."""
    path = tmp_path_factory.mktemp("llama")
    return path, save_hf(path)


# --- loading --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
@pytest.mark.parametrize("shards", [False, True])
def test_loads_like_transformers(tmp_path, layout, shards):
    torch_model = save_hf(tmp_path, **({"max_shard_size": "20KB"} if shards else {}))
    files = sorted(os.listdir(tmp_path))
    weights = [f for f in files if f.endswith(".safetensors")]
    if shards:
        assert "model.safetensors.index.json" in files and len(weights) > 3
    else:
        assert weights == ["model.safetensors"]
    model = peftx.from_pretrained(tmp_path, layout=layout)
    assert type(model) is pm.LlamaForCausalLM
    assert isinstance(model.model.layers, pm.LayerStack) == (layout == "stacked")
    ids, mask = inputs()
    assert_same(jax_out(model, ids, mask), torch_out(torch_model, ids, mask), mask, atol=1e-4)


@pytest.mark.parametrize(
    "model_class, hf_class",
    [
        ("LlamaModel", transformers.AutoModel),
        (pm.LlamaModel, transformers.AutoModel),
        (pm.LlamaForCausalLM, transformers.AutoModelForCausalLM),
    ],
)
def test_model_class(checkpoint, model_class, hf_class):
    """A backbone read from a causal-LM checkpoint (its tensors under `model.`)."""
    path, _ = checkpoint
    model = peftx.from_pretrained(path, model_class=model_class)
    want = pm.LlamaModel if model_class != pm.LlamaForCausalLM else pm.LlamaForCausalLM
    assert type(model) is want
    ids, mask = inputs()
    reference = hf_class.from_pretrained(path).eval()
    assert_same(jax_out(model, ids, mask), torch_out(reference, ids, mask), mask, atol=1e-4)


def test_sequence_classification(tmp_path):
    config = hf_config(num_labels=3, pad_token_id=0)
    torch_model = save_hf(tmp_path, transformers.LlamaForSequenceClassification, config)
    model = peftx.from_pretrained(tmp_path)
    assert type(model) is pm.LlamaForSequenceClassification
    ids, mask = inputs()
    ids[0, :2] = 0  # left padding, so the classifier reads each row's last real token
    assert_same(jax_out(model, ids, mask), torch_out(torch_model, ids, mask), mask, atol=1e-4)


def test_fresh_head_warns_and_backbone_loads(checkpoint):
    path, torch_model = checkpoint
    with pytest.warns(UserWarning, match=r"no weights for 'score\.weight'.*initialized fresh"):
        model = peftx.from_pretrained(path, model_class="LlamaForSequenceClassification")
    backbone = transformers.AutoModel.from_pretrained(path).eval()
    ids, mask = inputs()
    assert_same(jax_out(model.model, ids, mask), torch_out(backbone, ids, mask), mask, atol=1e-4)


def test_bf16_file(tmp_path):
    """A bfloat16 checkpoint loads as bfloat16 bit for bit, and into float32 exactly."""
    torch.manual_seed(0)
    torch_model = transformers.LlamaForCausalLM(hf_config()).eval().to(torch.bfloat16)
    torch_model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "numpy") as f:
        assert f.get_slice("lm_head.weight").get_dtype() == "BF16"
    want = torch_model.model.layers[1].self_attn.k_proj.weight.detach().float().numpy()
    for dtype, expected in [(None, jnp.bfloat16), (jnp.float32, jnp.float32)]:
        model = peftx.from_pretrained(tmp_path, dtype=dtype)
        leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
        assert {x.dtype for x in leaves} == {jnp.dtype(expected)}
        got = model.model.layers["0-2"].self_attn.k_proj.weight[1]
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)


@pytest.mark.parametrize("chunk", [_checkpoint._CHUNK, 100])
def test_fp32_file_into_bf16(checkpoint, monkeypatch, chunk):
    """Casting on the way in rounds as torch does, whether a tensor is cast whole or in
    chunks of a few rows (`_CHUNK`, patched small)."""
    monkeypatch.setattr(_checkpoint, "_CHUNK", chunk)
    path, torch_model = checkpoint
    model = peftx.from_pretrained(path, dtype=jnp.bfloat16, layout="unrolled")
    pairs = [
        (model.lm_head.weight, torch_model.lm_head.weight),
        (
            model.model.layers[2].mlp.down_proj.weight,
            torch_model.model.layers[2].mlp.down_proj.weight,
        ),
        (model.model.norm.weight, torch_model.model.norm.weight),
    ]
    for ours, theirs in pairs:
        assert ours.dtype == jnp.bfloat16
        want = theirs.detach().to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(np.asarray(ours, np.float32), want)


def test_torch_bin(tmp_path, checkpoint):
    """A `pytorch_model.bin` (transformers 5 writes safetensors only, so `torch.save` of
    the state dict, as older transformers wrote it) loads through
    `torch.load(weights_only=True)`."""
    _, torch_model = checkpoint
    torch_model.config.save_pretrained(tmp_path)
    torch.save(torch_model.state_dict(), tmp_path / "pytorch_model.bin")
    ids, mask = inputs()
    for dtype in (None, jnp.bfloat16):
        model = peftx.from_pretrained(tmp_path, dtype=dtype)
        want = torch_out(torch_model.to(torch.bfloat16 if dtype else torch.float32), ids, mask)
        atol = 1e-4 if dtype is None else 0.5  # bf16: only checks the load, not compute
        assert_same(jax_out(model, ids, mask), want, mask, atol=atol)
    torch_model.float()
    w = peftx.from_pretrained(tmp_path, dtype=jnp.bfloat16).model.layers["0-2"]
    np.testing.assert_array_equal(
        np.asarray(w.mlp.up_proj.weight[2], np.float32),
        torch_model.model.layers[2].mlp.up_proj.weight.detach().bfloat16().float().numpy(),
    )


class _Payload:
    """Unpickling this runs code: it writes `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('the pickle ran')",))


def test_malicious_pickle_refused(tmp_path, checkpoint):
    _, torch_model = checkpoint
    torch_model.config.save_pretrained(tmp_path)
    marker = tmp_path / "marker"
    state = dict(torch_model.state_dict())
    state["model.norm.weight"] = _Payload(marker)
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin could not be read with "):
        peftx.from_pretrained(tmp_path)
    assert not marker.exists()
    # the payload is real: an unrestricted unpickler runs it
    torch.load(tmp_path / "pytorch_model.bin", weights_only=False)
    assert marker.read_text() == "the pickle ran"


_PEAK = """
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp
import peftx

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

jnp.zeros(4).block_until_ready()
Path("/proc/self/clear_refs").write_text("5")  # the peak so far := what is resident now
base = status("VmHWM")
model = peftx.from_pretrained(sys.argv[1], dtype=sys.argv[2])
arrays = [x for x in jax.tree.leaves(model) if isinstance(x, jax.Array)]
jax.block_until_ready(arrays)
print(json.dumps({"peak": status("VmHWM") - base, "model": sum(x.nbytes for x in arrays)}))
"""


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory):
    """A ~60MB float32 Llama checkpoint, random weights written with safetensors."""
    path = tmp_path_factory.mktemp("large")
    config = hf_config(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    skeleton = eqx.filter_eval_shape(
        lambda k: pm.LlamaForCausalLM(
            pm.LlamaConfig.from_hf_config(config), key=k, layout="unrolled"
        ),
        jax.random.PRNGKey(0),
    )
    rng = np.random.default_rng(0)
    tensors = {
        peftx.dotted(p): rng.standard_normal(x.shape, dtype=np.float32)
        for p, x in jax.tree_util.tree_flatten_with_path(skeleton)[0]
        if isinstance(x, jax.ShapeDtypeStruct)
    }
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _load_in_fresh_process(path, dtype):
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(path), dtype],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peak_memory(checkpoint, large_checkpoint, dtype):
    """Loading (in a fresh process) never holds much more than the model: the file is not
    memory-mapped (its pages would count as resident), a stack is not built from
    per-layer copies, and a bfloat16 load of a float32 file casts in small chunks.

    The peak is taken above what loading the tiny checkpoint costs (tracing the model's
    shapes, JAX's own first transfers: a few MB whatever the size), so the bound is on
    what grows with the model."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("this kernel does not let a process reset its peak RSS")
    fixed = _load_in_fresh_process(checkpoint[0], dtype)
    result = _load_in_fresh_process(large_checkpoint, dtype)
    stored = sum(x.nbytes for x in load_file(large_checkpoint / "model.safetensors").values())
    size = stored // (1 if dtype == "float32" else 2)
    assert result["model"] == size > 25e6
    assert fixed["peak"] < 16e6, fixed
    assert result["peak"] - fixed["peak"] < 1.3 * size, (result, fixed)


def test_arrays_adopt_their_buffers(checkpoint, monkeypatch):
    """Each array is allocated once and handed to JAX without a copy (on CPU), which
    is what keeps the peak at the model's size."""
    if jax.default_backend() != "cpu":
        pytest.skip("on an accelerator device_put copies to the device by design")
    path, _ = checkpoint
    buffers = []
    real = _checkpoint._empty

    def recording(shape, dtype):
        buffers.append(real(shape, dtype))
        return buffers[-1]

    monkeypatch.setattr(_checkpoint, "_empty", recording)
    model = peftx.from_pretrained(path)
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    assert len(buffers) == len(leaves)
    assert sum(b.nbytes for b in buffers) == sum(x.nbytes for x in leaves)
    addresses = {b.ctypes.data for b in buffers}
    assert {x.unsafe_buffer_pointer() for x in leaves} == addresses


# --- errors ---------------------------------------------------------------------------


def _edit(path, edit):
    """Rewrite `path/model.safetensors` with `edit(tensors)` applied."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _drop(key):
    return lambda t: t.pop(key)


def _add(key, value):
    return lambda t: t.__setitem__(key, value)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            _drop("model.layers.1.mlp.up_proj.weight"),
            (
                r"lacks 1 tensor\(s\) LlamaForCausalLM needs: 'model\.layers\.1\.mlp\.up_proj"
                r"\.weight'\. Is it a llama checkpoint"
            ),
        ),
        (
            _drop("lm_head.weight"),
            r"lacks 1 tensor\(s\) LlamaForCausalLM needs: 'lm_head\.weight'",
        ),
        (
            _add("model.layers.0.self_attn.rotary.weight", np.ones(3, np.float32)),
            (
                r"has 1 tensor\(s\) LlamaForCausalLM has no place for: "
                r"'model\.layers\.0\.self_attn\.rotary\.weight'\. .*strict=False"
            ),
        ),
        (
            _add("model.layers.2.self_attn.k_proj.weight", np.ones((32, 32), np.float32)),
            (
                r"'model\.layers\.2\.self_attn\.k_proj\.weight' in model\.safetensors has shape "
                r"\(32, 32\); LlamaForCausalLM's model\.layers\.0-2\.self_attn\.k_proj\.weight "
                r"expects \(16, 32\)"
            ),
        ),
        (
            _add("model.norm.weight", np.ones(32, np.int32)),
            (
                r"'model\.norm\.weight' in model\.safetensors is stored as int32; "
                r"model\.norm\.weight expects a floating tensor"
            ),
        ),
    ],
    ids=["missing", "missing-head", "unexpected", "shape", "dtype"],
)
def test_bad_tensors(tmp_path, checkpoint, monkeypatch, edit, match):
    """Each is raised before any of the model's arrays is allocated."""
    path, torch_model = checkpoint
    torch_model.save_pretrained(tmp_path)
    _edit(tmp_path, edit)
    allocated = []
    monkeypatch.setattr(_checkpoint, "_empty", lambda *a: allocated.append(a))
    with pytest.raises(CheckpointError, match=match):
        peftx.from_pretrained(tmp_path)
    assert allocated == []


def test_unexpected_key_warns_when_not_strict(tmp_path, checkpoint):
    path, torch_model = checkpoint
    torch_model.save_pretrained(tmp_path)
    _edit(tmp_path, _add("model.extra.weight", np.ones(3, np.float32)))
    with pytest.warns(UserWarning, match=r"no place for: 'model\.extra\.weight'"):
        model = peftx.from_pretrained(tmp_path, strict=False)
    ids, mask = inputs()
    assert_same(jax_out(model, ids, mask), torch_out(torch_model, ids, mask), mask, atol=1e-4)


def test_tied_head_in_file_is_ignored_for_a_backbone(checkpoint):
    """`lm_head.weight` is expected by the causal LM, ignored by the bare backbone."""
    path, _ = checkpoint
    with safe_open(str(path / "model.safetensors"), "numpy") as f:
        assert "lm_head.weight" in f.keys()
    assert type(peftx.from_pretrained(path, model_class="LlamaModel")) is pm.LlamaModel


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda b: os.urandom(len(b)), r"model\.safetensors is not a readable safetensors file"),
        (lambda b: b[: len(b) - 1000], r"model\.safetensors is not a readable safetensors file"),
        (lambda b: b[:5], r"model\.safetensors is not a readable safetensors file"),
    ],
    ids=["garbage", "truncated", "no-header"],
)
def test_corrupt_file(tmp_path, checkpoint, monkeypatch, damage, match):
    path, torch_model = checkpoint
    torch_model.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    file.write_bytes(damage(file.read_bytes()))
    allocated = []
    monkeypatch.setattr(_checkpoint, "_empty", lambda *a: allocated.append(a))
    with pytest.raises(CheckpointError, match=match):
        peftx.from_pretrained(tmp_path)
    assert allocated == []


def test_file_shrinking_during_a_load(tmp_path, checkpoint, monkeypatch):
    """A file cut short after its header was validated fails on the read that runs out
    (safe_open is patched out here: it would refuse the truncated file up front)."""
    path, torch_model = checkpoint
    torch_model.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    monkeypatch.setattr(_checkpoint, "safe_open", lambda *a, **k: contextlib.nullcontext())
    with pytest.raises(CheckpointError, match=r"model\.safetensors ended while reading '"):
        peftx.from_pretrained(tmp_path)


def test_index_errors(tmp_path, checkpoint):
    _, torch_model = checkpoint
    torch_model.save_pretrained(tmp_path, max_shard_size="20KB")
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = index["weight_map"]["model.layers.1.mlp.gate_proj.weight"]
    other = index["weight_map"]["model.embed_tokens.weight"]
    assert shard != other
    # an index that puts a tensor in the wrong shard
    index["weight_map"]["model.layers.1.mlp.gate_proj.weight"] = other
    index_file.write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=rf"puts 'model\.layers\.1\.mlp\.gate_proj\.weight' in {other}"
    ):
        peftx.from_pretrained(tmp_path)
    index["weight_map"]["model.layers.1.mlp.gate_proj.weight"] = shard
    index_file.write_text(json.dumps(index))
    # a missing shard
    (tmp_path / shard).unlink()
    with pytest.raises(CheckpointError, match=rf"names shard {shard} \(for .*\), which is missing"):
        peftx.from_pretrained(tmp_path)
    # a shard outside the directory
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError,
        match=r"puts 'model\.norm\.weight' in '\.\./elsewhere\.safetensors', which is not the "
        r"name of a file beside the index",
    ):
        peftx.from_pretrained(tmp_path)
    # not an index at all
    index_file.write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=r"index\.json is not a safetensors index"):
        peftx.from_pretrained(tmp_path)


def test_config_errors(tmp_path, checkpoint):
    path, torch_model = checkpoint
    torch_model.save_pretrained(tmp_path)
    config = tmp_path / "config.json"
    good = config.read_text()
    config.unlink()
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        peftx.from_pretrained(tmp_path)
    config.write_text(good[:-10])
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        peftx.from_pretrained(tmp_path)
    config.write_text(json.dumps({**json.loads(good), "model_type": "mamba"}))
    with pytest.raises(CheckpointError, match=r"model_type 'mamba' is not supported; .*'llama'"):
        peftx.from_pretrained(tmp_path)
    config.write_text(good)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"holds no weights: expected model\.safetensors"):
        peftx.from_pretrained(tmp_path)


def test_wrong_model_class(checkpoint):
    path, _ = checkpoint
    with pytest.raises(
        CheckpointError,
        match=r"model_class 'BertForMaskedLM' is not a llama class; choose one of "
        r"\['LlamaForCausalLM', 'LlamaForSequenceClassification', 'LlamaModel'\]",
    ):
        peftx.from_pretrained(path, model_class="BertForMaskedLM")
    with pytest.raises(CheckpointError, match=r"model_class Linear does not read 'llama'"):
        peftx.from_pretrained(path, model_class=eqx.nn.Linear)


# --- saving ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model_type, cls, hf_class, overrides",
    [
        ("llama", pm.LlamaForCausalLM, transformers.AutoModelForCausalLM, {}),
        ("llama", pm.LlamaModel, transformers.AutoModel, {}),
        (
            "llama",
            pm.LlamaForSequenceClassification,
            transformers.AutoModelForSequenceClassification,
            {"num_labels": 3, "pad_token_id": 0},
        ),
        ("mistral", pm.LlamaForCausalLM, transformers.AutoModelForCausalLM, {"sliding_window": 4}),
        ("qwen2", pm.LlamaForCausalLM, transformers.AutoModelForCausalLM, {}),
    ],
    ids=["llama-lm", "llama-backbone", "llama-classifier", "mistral-window", "qwen2-tied"],
)
@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
def test_saved_model_loads_in_transformers(tmp_path, model_type, cls, hf_class, overrides, layout):
    """A peftx model with random weights (not loaded from transformers), saved and read
    back by transformers' Auto classes, computes the same outputs."""
    if model_type == "qwen2":
        overrides = {"tie_word_embeddings": True}
    config = pm.LlamaConfig.from_hf_config(hf_config(model_type, **overrides))
    model = random_model(cls, config, 1, layout=layout)
    peftx.save_pretrained(model, tmp_path)
    theirs = hf_class.from_pretrained(tmp_path).eval()
    assert (
        type(theirs).__name__
        == json.loads((tmp_path / "config.json").read_text())["architectures"][0]
    )
    ids, mask = inputs()
    if model_type == "mistral":
        ids, mask = inputs(12)  # longer than the window
    assert_same(jax_out(model, ids, mask), torch_out(theirs, ids, mask), mask, atol=1e-4)
    again = peftx.from_pretrained(tmp_path, layout=layout)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sharded_save(tmp_path):
    config = pm.LlamaConfig.from_hf_config(hf_config())
    model = random_model(pm.LlamaForCausalLM, config, 2)
    limit = 20_000
    peftx.save_pretrained(model, tmp_path, max_shard_size=limit)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors")) == shards
    assert not (tmp_path / "model.safetensors").exists()
    total = 0
    for shard in shards:
        with safe_open(str(tmp_path / shard), "numpy") as f:
            assert f.metadata() == {"format": "pt"}
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]
            assert all(index["weight_map"][k] == shard for k in f.keys())
        assert sum(sizes) <= limit or len(sizes) == 1  # a tensor over the limit goes alone
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids, mask = inputs()
    assert_same(jax_out(model, ids, mask), torch_out(theirs, ids, mask), mask, atol=1e-4)
    # saving again unsharded leaves one checkpoint, not the old shards beside it
    peftx.save_pretrained(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    with safe_open(str(tmp_path / "model.safetensors"), "numpy") as f:
        assert f.metadata() == {"format": "pt"}


def test_failed_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    small = pm.LlamaConfig.from_hf_config(hf_config())
    previous = random_model(pm.LlamaForCausalLM, small, 3)
    peftx.save_pretrained(previous, tmp_path, max_shard_size="20KB")
    before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    assert len(before) > 4

    real = _checkpoint.safetensors.numpy.save_file
    calls = []

    def crash_on_second_shard(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            with open(filename, "wb") as f:
                f.write(b"half a shard")
            raise OSError("disk full")
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(_checkpoint.safetensors.numpy, "save_file", crash_on_second_shard)
    bigger = pm.LlamaConfig.from_hf_config(hf_config(hidden_size=48, num_attention_heads=6))
    model = random_model(pm.LlamaForCausalLM, bigger, 4)
    with pytest.raises(OSError, match="disk full"):
        peftx.save_pretrained(model, tmp_path, max_shard_size="20KB")
    assert len(calls) == 2
    after = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    assert after == before  # no temporary file left, nothing replaced
    monkeypatch.undo()
    loaded = peftx.from_pretrained(tmp_path)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(previous), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_save(tmp_path):
    config = pm.LlamaConfig.from_hf_config(hf_config())
    model = random_model(pm.LlamaForCausalLM, config, 5, dtype=jnp.bfloat16)
    peftx.save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "model.safetensors"), "numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert theirs.dtype == torch.bfloat16
    ours = np.asarray(model.model.layers["0-2"].mlp.gate_proj.weight[1])
    theirs_w = theirs.model.layers[1].mlp.gate_proj.weight.detach()
    np.testing.assert_array_equal(ours.view(np.int16), theirs_w.view(torch.int16).numpy())
    again = peftx.from_pretrained(tmp_path)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model), strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a).view(np.int16), np.asarray(b).view(np.int16))


def test_save_refuses_adapters(tmp_path, checkpoint):
    path, _ = checkpoint
    peft = peftx.get_peft_model(
        peftx.from_pretrained(path),
        peftx.LoraConfig(r=2, target_modules=["q_proj"]),
        key=jax.random.PRNGKey(0),
    )
    with pytest.raises(TypeError, match=r"merge_and_unload"):
        peftx.save_pretrained(peft, tmp_path)
    assert not os.listdir(tmp_path)


# --- LoRA, merged, saved --------------------------------------------------------------


@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
def test_merged_lora_saves_for_transformers(tmp_path, checkpoint, layout):
    path, _ = checkpoint
    peft = peftx.get_peft_model(
        peftx.from_pretrained(path, layout=layout),
        peftx.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
        key=jax.random.PRNGKey(0),
    )
    ids, mask = inputs()
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    before = np.asarray(peft(ids, mask).logits)

    # one training step, so lora_B is no longer zero
    trainable, frozen = peftx.partition(peft)
    optimizer = optax.sgd(10.0)
    state = optimizer.init(trainable)

    def loss(t):
        logits = eqx.combine(t, frozen)(ids, mask).logits
        targets = jnp.roll(ids, -1, axis=1)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    grads = eqx.filter_grad(loss)(trainable)
    updates, _ = optimizer.update(grads, state)
    peft = eqx.combine(eqx.apply_updates(trainable, updates), frozen)
    b = [x for p, x in jax.tree.leaves_with_path(peft) if "lora_B" in jax.tree_util.keystr(p)]
    assert b and all(np.abs(np.asarray(x)).max() > 0 for x in b)
    tuned = np.asarray(peft(ids, mask).logits)
    assert np.abs(tuned - before).max() > 1e-3

    merged = peft.merge_and_unload()
    assert type(merged) is pm.LlamaForCausalLM
    peftx.save_pretrained(merged, tmp_path / "out")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert_same(torch_out(theirs, np.asarray(ids), np.asarray(mask)), tuned, mask, atol=1e-4)


# --- tied embeddings and the config ---------------------------------------------------


@pytest.mark.parametrize("head_in_file", [False, True])
def test_tied_embeddings(tmp_path, head_in_file):
    """Qwen2 with `tie_word_embeddings`: the model has no lm_head; a checkpoint may or may
    not carry `lm_head.weight` (a copy of the embeddings), and ours does not."""
    torch_model = save_hf(
        tmp_path / "in", transformers.Qwen2ForCausalLM, hf_config("qwen2", tie_word_embeddings=True)
    )
    with safe_open(str(tmp_path / "in" / "model.safetensors"), "numpy") as f:
        written_by_transformers = "lm_head.weight" in f.keys()
    if head_in_file != written_by_transformers:
        embed = torch_model.model.embed_tokens.weight.detach().numpy()
        _edit(
            tmp_path / "in",
            _add("lm_head.weight", embed) if head_in_file else _drop("lm_head.weight"),
        )
    model = peftx.from_pretrained(tmp_path / "in")
    assert model.lm_head is None
    ids, mask = inputs()
    assert_same(jax_out(model, ids, mask), torch_out(torch_model, ids, mask), mask, atol=1e-4)
    peftx.save_pretrained(model, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "numpy") as f:
        assert "lm_head.weight" not in f.keys()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()
    assert_same(torch_out(theirs, ids, mask), torch_out(torch_model, ids, mask), mask, atol=1e-6)


def test_config_round_trip(tmp_path):
    """Every field of transformers' config.json survives a load and save, rope scaling,
    special token ids and fields peftx does not use included."""
    config = hf_config(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        bos_token_id=5,
        eos_token_id=[6, 7],
        pad_token_id=0,
        attention_dropout=0.0,
    )
    torch_model = save_hf(tmp_path / "in", config=config)
    peftx.save_pretrained(peftx.from_pretrained(tmp_path / "in"), tmp_path / "out")
    original = json.loads((tmp_path / "in" / "config.json").read_text())
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert original["rope_parameters"]["rope_type"] == "llama3"
    assert {k: saved.get(k) for k in original if k != "transformers_version"} == {
        k: v for k, v in original.items() if k != "transformers_version"
    }
    reloaded = transformers.AutoConfig.from_pretrained(tmp_path / "out").to_dict()
    expected = transformers.AutoConfig.from_pretrained(tmp_path / "in").to_dict()
    assert reloaded.pop("_name_or_path") != expected.pop("_name_or_path")
    assert reloaded == expected
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids, mask = inputs()
    assert_same(torch_out(theirs, ids, mask), torch_out(torch_model, ids, mask), mask, atol=0)


def test_config_made_in_peftx_saves_for_transformers(tmp_path):
    """A config built in peftx (no config.json behind it) writes the fields transformers
    needs: the label count, the pad id, the rope parameters."""
    config = pm.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_labels=3,
        pad_token_id=0,
        rope=(("rope_theta", 500.0), ("rope_type", "default")),
    )
    model = random_model(pm.LlamaForSequenceClassification, config, 6)
    peftx.save_pretrained(model, tmp_path)
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    ids, mask = inputs()
    ids[0, :2] = 0
    assert_same(jax_out(model, ids, mask), torch_out(theirs, ids, mask), mask, atol=1e-4)


def test_bf16_cast_matches_ml_dtypes_rounding():
    """The cast the loader relies on (numpy assignment into an ml_dtypes bfloat16 array)
    rounds to nearest even, as torch's `.to(torch.bfloat16)` does."""
    x = np.random.RandomState(0).standard_normal(10_000).astype(np.float32)
    x[:4] = [1.00390625, 1.01171875, -1.00390625, 3.4e38]  # ties, and near the top
    out = np.empty(x.shape, ml_dtypes.bfloat16)
    out[...] = x
    want = torch.from_numpy(x).bfloat16().view(torch.int16).numpy()
    np.testing.assert_array_equal(out.view(np.int16), want)


@pytest.mark.parametrize(
    "name",
    [
        # the fast tier runs num_labels on GPT-2, and Llama's fresh head in
        # test_fresh_head_warns_and_backbone_loads; the whole suite this case too
        pytest.param("LlamaForSequenceClassification", marks=pytest.mark.variant_sweep),
        "GPT2ForSequenceClassification",
    ],
)
def test_num_labels_puts_a_fresh_head_on_a_causal_lm_checkpoint(tmp_path, name):

    if name.startswith("Llama"):
        config = tiny_llama_config(64)
        lm = transformers.LlamaForCausalLM
    else:
        config = transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, pad_token_id=0
        )
        lm = transformers.GPT2LMHeadModel
    torch.manual_seed(0)
    lm(config).save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="initialized fresh"):
        ours = peftx.models.from_pretrained(tmp_path, model_class=name, num_labels=3)
    assert ours.config.num_labels == 3
    ids, mask = np.array([[5, 6, 7, 0], [9, 8, 0, 0]]), np.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    logits = np.asarray(ours(jnp.asarray(ids), jnp.asarray(mask)).logits)
    theirs = getattr(transformers, name).from_pretrained(tmp_path, num_labels=3)
    theirs.score.weight.data = torch.tensor(np.asarray(ours.score.weight))
    with torch.no_grad():
        ref = theirs(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    assert logits.shape == (2, 3)
    np.testing.assert_allclose(logits, ref, atol=64 * np.finfo(np.float32).eps * np.abs(ref).max())
