"""The Llama family (Llama, Mistral, Qwen2) against transformers in PyTorch.

Every model is a tiny random transformers model (eager attention, eval mode) whose norms
and biases are randomized too, saved with `save_pretrained` and loaded with
`peftx.models.from_pretrained`, so both sides run the same weights.
"""

import copy
import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from helpers import example_count
from hypothesis import given, settings, strategies as st

import peftx
import peftx.models as pm
from peftx.models import KVCache, LlamaConfig

VOCAB = 97
SEQ = 12
LAYERS = 3
TOL = 1e-4  # fp32 parity on real tokens
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    max_position_embeddings=64,
    pad_token_id=0,
    initializer_range=0.2,  # attention that is far from uniform, logits of order one
    rms_norm_eps=1e-6,
    attn_implementation="eager",
)
DEFAULT_ROPE = dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0))
PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}

# name: the family, its config, and how to switch the arm's feature off on the same
# weights ("plain": config overrides; "zero_biases": set every bias to zero), so a test
# can check the feature changes the output.
CASES = {
    "llama": dict(family="llama", config=dict(num_key_value_heads=4)),
    "llama-llama3": dict(
        family="llama",
        config=dict(
            num_key_value_heads=4,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8,  # < SEQ, so the scaling matters
            ),
        ),
        plain=DEFAULT_ROPE,
    ),
    "llama-linear": dict(
        family="llama",
        config=dict(
            num_key_value_heads=4,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
        ),
        plain=DEFAULT_ROPE,
    ),
    "llama-dynamic": dict(
        family="llama",
        config=dict(
            num_key_value_heads=4,
            max_position_embeddings=8,  # < SEQ: the dynamic branch is taken
            rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
        ),
        plain=DEFAULT_ROPE,
    ),
    "llama-yarn": dict(
        family="llama",
        config=dict(
            num_key_value_heads=4,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
        plain=DEFAULT_ROPE,
    ),
    "llama-bias-head_dim": dict(
        family="llama",
        config=dict(num_key_value_heads=2, head_dim=16, attention_bias=True, mlp_bias=True),
        zero_biases=True,
    ),
    "mistral": dict(
        family="mistral",
        config=dict(num_key_value_heads=2, sliding_window=4),
        plain=dict(sliding_window=None),
    ),
    "qwen2": dict(
        family="qwen2",
        config=dict(num_key_value_heads=2, tie_word_embeddings=True),
        zero_biases=True,
    ),
    "qwen2-sliding": dict(
        family="qwen2",
        config=dict(
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        ),
        plain=dict(layer_types=["full_attention"] * LAYERS),
    ),
    # q/k norms (random weights, so they matter), an explicit head_dim unlike hidden/heads,
    # biases on q, k, v and o, and a window on some layers
    "qwen3": dict(
        family="qwen3",
        config=dict(
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        zero_biases=True,
    ),
}
HEADS = ("Model", "ForCausalLM", "ForSequenceClassification")


def hf_config(name: str, **overrides) -> transformers.PretrainedConfig:
    case = CASES[name]
    cls = getattr(transformers, PREFIX[case["family"]] + "Config")
    return cls(**{**COMMON, **case["config"], "num_labels": 3, **overrides})


def torch_model(name: str, head: str = "ForCausalLM", **overrides) -> torch.nn.Module:
    """A random model whose norm weights and biases are random too (transformers
    initializes them to one and zero, which would hide a missing scale or bias)."""
    config = hf_config(name, **overrides)
    torch.manual_seed(sorted(CASES).index(name))
    model = getattr(transformers, PREFIX[CASES[name]["family"]] + head)(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=generator))
            elif key.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """`checkpoint(name, head)`: `(torch model, its save_pretrained directory)`, built once
    per module."""
    built = {}

    def get(name: str, head: str = "ForCausalLM"):
        if (name, head) not in built:
            model = torch_model(name, head)
            path = tmp_path_factory.mktemp(f"{name}-{head}")
            model.save_pretrained(path)
            built[name, head] = model, path
        return built[name, head]

    return get


def padded_batch(seed: int, lengths, sides, seq: int = SEQ):
    """Token ids (0 is padding, real tokens are never 0) and the attention mask."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), seq), np.int32)
    mask = np.zeros((len(lengths), seq), np.int32)
    for row, (n, side) in enumerate(zip(lengths, sides)):
        part = slice(seq - n, seq) if side == "left" else slice(0, n)
        ids[row, part] = rng.integers(1, VOCAB, n)
        mask[row, part] = 1
    return ids, mask


# one batch with both pad sides: a full row, left- and right-padded rows; the longest is
# longer than the dynamic case's max_position_embeddings
IDS, MASK = padded_batch(0, [SEQ, 9, 7, 4], ["right", "left", "right", "left"])


def torch_forward(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray, **kwargs):
    """transformers with the positions peftx derives from the mask (counting real
    tokens), as `generate` passes them."""
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        return model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(positions, dtype=torch.long),
            **kwargs,
        )


def real_diff(ours, theirs, mask: np.ndarray) -> float:
    """Max |ours - theirs| over the real tokens of `(batch, seq, ...)` arrays."""
    ours = np.asarray(jnp.asarray(ours, jnp.float32))
    theirs = theirs.detach().float().numpy() if isinstance(theirs, torch.Tensor) else theirs
    keep = mask.astype(bool)
    return float(np.max(np.abs(ours[keep] - theirs[keep])))


def assert_layers_match(ours_hidden, ours_model: pm.LlamaModel, ref_hidden, mask, tol):
    """Each block's output against transformers' `hidden_states[i + 1]`; the last through
    the final norm, as transformers reports it."""
    assert ours_hidden.shape == (LAYERS, *mask.shape, ref_hidden[0].shape[-1])
    assert len(ref_hidden) == LAYERS + 1
    for i in range(LAYERS):
        h = ours_hidden[i] if i < LAYERS - 1 else ours_model.norm(ours_hidden[i])
        diff = real_diff(h, ref_hidden[i + 1], mask)
        assert diff <= tol, f"block {i} of {LAYERS} differs first: max |diff| {diff:.3g}"


@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_causal_lm_matches_transformers(checkpoint, name, layout):
    model, path = checkpoint(name)
    ours = pm.from_pretrained(path, layout=layout)
    assert type(ours) is pm.LlamaForCausalLM
    assert ours.config.model_type == CASES[name]["family"]
    # the layout arms differ: one scanned segment, or a block per layer
    layers = ours.model.layers
    if layout == "stacked":
        assert isinstance(layers, pm.LayerStack) and list(layers.segments) == [f"0-{LAYERS - 1}"]
    else:
        assert isinstance(layers, tuple) and len(layers) == LAYERS
    assert (ours.lm_head is None) == bool(model.config.tie_word_embeddings)
    ref = torch_forward(model, IDS, MASK, output_hidden_states=True)
    out = ours(jnp.asarray(IDS), jnp.asarray(MASK), output_hidden_states=True)
    assert_layers_match(out.hidden_states, ours.model, ref.hidden_states, MASK, TOL)
    assert out.logits.shape == (*IDS.shape, VOCAB)
    assert real_diff(out.logits, ref.logits, MASK) <= TOL


@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
@pytest.mark.parametrize("name", ["qwen2-sliding"])
def test_backbone_matches_transformers(checkpoint, name, layout):
    model, path = checkpoint(name, "Model")
    ours = pm.from_pretrained(path, layout=layout)
    assert type(ours) is pm.LlamaModel
    ref = torch_forward(model, IDS, MASK, output_hidden_states=True)
    out = ours(jnp.asarray(IDS), jnp.asarray(MASK), output_hidden_states=True)
    assert_layers_match(out.hidden_states, ours, ref.hidden_states, MASK, TOL)
    assert real_diff(out.last_hidden_state, ref.last_hidden_state, MASK) <= TOL


@pytest.mark.parametrize(
    "name, layout",
    [
        ("llama-bias-head_dim", "stacked"),
        ("llama-bias-head_dim", "unrolled"),
        # the head is Llama's on every family: the fast tier runs it on Llama
        pytest.param("mistral", "stacked", marks=pytest.mark.variant_sweep),
    ],
)
def test_sequence_classification_matches_transformers(checkpoint, name, layout):
    model, path = checkpoint(name, "ForSequenceClassification")
    ours = pm.from_pretrained(path, layout=layout)
    assert type(ours) is pm.LlamaForSequenceClassification
    assert ours.config.pad_token_id == 0 and ours.config.num_labels == 3
    ref = torch_forward(model, IDS, MASK).logits.numpy()
    out = ours(jnp.asarray(IDS), jnp.asarray(MASK))
    assert out.logits.shape == ref.shape == (len(IDS), 3)
    np.testing.assert_allclose(np.asarray(out.logits), ref, rtol=0, atol=TOL)


ARMS = [n for n in sorted(CASES) if "plain" in CASES[n] or CASES[n].get("zero_biases")]


@pytest.mark.parametrize("name", ARMS)
def test_each_arm_changes_the_output(checkpoint, name):
    """The arm's feature, switched off on the same weights, changes the logits by far more
    than the parity tolerance, so each arm above tests something of its own."""
    model, _ = checkpoint(name)
    case = CASES[name]
    state = model.state_dict()
    if case.get("zero_biases"):
        plain = model
        state = {k: torch.zeros_like(v) if k.endswith(".bias") else v for k, v in state.items()}
        assert any(k.endswith(".bias") for k in state)
    else:
        plain = torch_model(name, **case["plain"])
    plain = copy.deepcopy(plain)
    plain.load_state_dict(state)
    with_feature = torch_forward(model, IDS, MASK).logits
    without = torch_forward(plain, IDS, MASK).logits
    assert real_diff(with_feature.numpy(), without, MASK) > 1000 * TOL


@settings(max_examples=example_count(4), deadline=None, derandomize=True)
@given(
    rows=st.lists(
        st.tuples(st.integers(1, 6), st.sampled_from(["left", "right"])), min_size=2, max_size=3
    )
)
def test_padding_invariance(checkpoint, rows):
    """Each sequence's logits on its real tokens are the same alone as in a padded batch
    (with a sliding window of 4 and GQA, where a miscounted padding slot would show)."""
    ours = pm.from_pretrained(checkpoint("mistral")[1])
    lengths, sides = zip(*rows)
    ids, mask = padded_batch(len(rows), lengths, sides, seq=8)
    batch = _logits(ours, jnp.asarray(ids), jnp.asarray(mask))
    for row in range(len(rows)):
        real = mask[row].astype(bool)
        alone = _logits(ours, jnp.asarray(ids[row, real][None]), None)[0]
        np.testing.assert_allclose(
            np.asarray(batch[row][real]), np.asarray(alone), rtol=0, atol=TOL
        )


_logits = eqx.filter_jit(lambda model, ids, mask: model(ids, mask).logits)


# every row is real after the prompt: right-padded rows would leave holes mid-sequence
DECODE_IDS, DECODE_MASK = padded_batch(3, [SEQ, SEQ - 2, SEQ - 4], ["left"] * 3)
PROMPT = 5


@pytest.mark.parametrize(
    "name, layout",
    [
        # the fast tier decodes past a window on Qwen2's sliding layers (and a stack on
        # Llama), the whole suite on Mistral's and Qwen3's windows too
        pytest.param("mistral", "stacked", marks=pytest.mark.variant_sweep),
        ("qwen2-sliding", "unrolled"),
        ("llama-yarn", "stacked"),
        pytest.param("qwen3", "stacked", marks=pytest.mark.variant_sweep),
    ],
)
def test_kv_cache_steps_match_full_forward(checkpoint, name, layout):
    """A left-padded prompt prefilled into the cache, then one token at a time (positions
    continuing from the cache), gives the full forward's logits at every step, also past
    the sliding window."""
    _, path = checkpoint(name)
    ours = pm.from_pretrained(path, layout=layout)
    ids, mask = DECODE_IDS, DECODE_MASK
    full = _logits(ours, jnp.asarray(ids), jnp.asarray(mask))
    assert real_diff(cached_decode(ours, ids, mask), np.asarray(full), mask) <= TOL


@pytest.mark.parametrize(
    "name", [pytest.param("qwen3", marks=pytest.mark.variant_sweep), "qwen2-sliding"]
)
def test_kv_cache_with_an_index_per_row_matches_each_row_alone(checkpoint, name):
    """Rows prefilled right-padded, then decoded each from its own length (an index per
    row, as a server's continuous batch holds them): every row's logits equal its own
    tokens' full forward, alone and unpadded, also past the sliding window."""
    _, path = checkpoint(name)
    ours = pm.from_pretrained(path)
    c = ours.config
    lengths, steps = [SEQ - 4, 2, 5], 4
    rng = np.random.default_rng(6)
    rows = [rng.integers(1, VOCAB, n + steps) for n in lengths]
    width = max(lengths)
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros_like(ids)
    for r, (row, n) in enumerate(zip(rows, lengths)):
        ids[r, :n], mask[r, :n] = row[:n], 1
    cache = KVCache.empty(LAYERS, len(rows), SEQ, c.num_key_value_heads, c.head_dim, jnp.float32)
    cache = eqx.tree_at(lambda k: k.index, cache, jnp.zeros(len(rows), jnp.int32))
    out = eqx.filter_jit(lambda m, i, k, c: m(i, k, cache=c))(
        ours, jnp.asarray(ids), jnp.asarray(mask), cache
    )
    ends = jnp.asarray(lengths, jnp.int32)
    got = [[out.logits[r, n - 1]] for r, n in enumerate(lengths)]
    cache = eqx.tree_at(lambda k: k.index, out.cache, ends)  # past each row's real tokens
    step = eqx.filter_jit(lambda m, i, cache: m(i, jnp.ones_like(i), cache=cache))
    for t in range(steps):
        token = jnp.asarray([[row[n + t]] for row, n in zip(rows, lengths)], jnp.int32)
        out = step(ours, token, cache)
        cache = out.cache
        for r in range(len(rows)):
            got[r].append(out.logits[r, 0])
    np.testing.assert_array_equal(np.asarray(cache.index), np.asarray(ends) + steps)
    for r, (row, n) in enumerate(zip(rows, lengths)):
        alone = _logits(ours, jnp.asarray(row[None, :]), jnp.ones((1, len(row)), jnp.int32))[0]
        want = alone[n - 1 :]
        assert float(jnp.max(jnp.abs(jnp.stack(got[r]) - want))) <= TOL, r


def cached_decode(ours, ids: np.ndarray, mask: np.ndarray) -> jax.Array:
    """Logits of `ids[:, :PROMPT]` prefilled into an empty cache, then of each later token
    fed alone with the cache, concatenated along the sequence."""
    c = ours.config
    cache = KVCache.empty(LAYERS, len(ids), SEQ, c.num_key_value_heads, c.head_dim, jnp.float32)
    step = eqx.filter_jit(lambda m, i, k, cache: m(i, k, cache=cache))
    out = step(ours, jnp.asarray(ids[:, :PROMPT]), jnp.asarray(mask[:, :PROMPT]), cache)
    steps = [out.logits]
    for t in range(PROMPT, SEQ):
        out = step(ours, jnp.asarray(ids[:, t : t + 1]), jnp.asarray(mask[:, t : t + 1]), out.cache)
        steps.append(out.logits)
    assert int(out.cache.index) == SEQ
    return jnp.concatenate(steps, axis=1)


def test_dynamic_rope_decoding_matches_transformers(checkpoint):
    """With dynamic rope, decoding past max_position_embeddings (8) rotates each new token
    with the frequencies of its own length, the cached keys keeping theirs, so it differs
    from a full forward; it matches transformers' decoding with `past_key_values`."""
    model, path = checkpoint("llama-dynamic")
    ours = pm.from_pretrained(path)
    ids, mask = DECODE_IDS, DECODE_MASK
    positions = torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0))
    tids, tmask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
    with torch.no_grad():
        out = model(
            tids[:, :PROMPT],
            attention_mask=tmask[:, :PROMPT],
            position_ids=positions[:, :PROMPT],
            use_cache=True,
        )
        steps = [out.logits]
        for t in range(PROMPT, SEQ):
            out = model(
                tids[:, t : t + 1],
                attention_mask=tmask[:, : t + 1],
                position_ids=positions[:, t : t + 1],
                past_key_values=out.past_key_values,
                use_cache=True,
            )
            steps.append(out.logits)
    theirs = torch.cat(steps, dim=1)
    assert real_diff(cached_decode(ours, ids, mask), theirs, mask) <= TOL
    full = torch_forward(model, ids, mask).logits
    assert real_diff(full.numpy(), theirs, mask) > 1000 * TOL


# bfloat16. Along a block, the hidden state is rounded to bfloat16 about ROUNDINGS times
# on its way through (input norm 2, q/k projection 1, rope 2, attention weights 1,
# weights·values 1, o_proj 1, residual 1, post norm 2, gate 1, silu 1, ·up 1, down 1,
# residual 1) and each product's weights once more when they are cast from float32.
# To first order each rounding adds a relative error of at most u = 2^-8, and the
# errors add over the depth: |bf16 - exact| <= u · (ROUNDINGS · layers + HEAD) · scale,
# with HEAD the final norm (2), lm_head (1) and the embeddings' own rounding (1).
ROUNDINGS = 16 + 7
HEAD = 4
BF16_U = float(jnp.finfo(jnp.bfloat16).eps) / 2


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        # the fast tier runs bfloat16 on Llama (and on its biases and head_dim), the whole
        # suite on the other families too
        *(pytest.param(n, marks=pytest.mark.variant_sweep) for n in ("mistral", "qwen2", "qwen3")),
        "llama-bias-head_dim",
    ],
)
def test_bfloat16_matches_transformers(checkpoint, name):
    model, path = checkpoint(name)
    ours32 = pm.from_pretrained(path, layout="unrolled")
    ours16 = pm.from_pretrained(path, layout="unrolled", dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(eqx.filter(ours16, eqx.is_array))} == {
        jnp.dtype(jnp.bfloat16)
    }
    torch16 = copy.deepcopy(model).to(torch.bfloat16)
    exact = torch_forward(model, IDS, MASK).logits.numpy()
    theirs = torch_forward(torch16, IDS, MASK).logits
    out = ours16(jnp.asarray(IDS), jnp.asarray(MASK)).logits
    assert out.dtype == jnp.bfloat16
    scale = float(np.max(np.abs(exact[MASK.astype(bool)])))
    bound = BF16_U * (ROUNDINGS * LAYERS + HEAD) * scale
    ours_error = real_diff(out, exact, MASK)
    theirs_error = real_diff(theirs.float().numpy(), exact, MASK)
    assert ours_error <= bound, (ours_error, bound)
    assert real_diff(out, theirs, MASK) <= 2 * bound  # both within `bound` of exact
    # and peftx's bf16 path is not sloppier than transformers' own
    assert ours_error <= 2 * theirs_error, (ours_error, theirs_error)
    # the float32 model in peftx is the exact side of the bound too
    out32 = ours32(jnp.asarray(IDS), jnp.asarray(MASK)).logits
    assert real_diff(out, np.asarray(out32), MASK) <= bound + TOL


# configs

ARCHITECTURE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
    "use_sliding_window",
    "layer_types",
    "pad_token_id",
    "num_labels",
)


def architecture(config: transformers.PretrainedConfig) -> dict:
    fields = {f: getattr(config, f, None) for f in ARCHITECTURE_FIELDS}
    # Qwen2's config has no head_dim unless one is written; its attention falls back to this
    fields["head_dim"] = fields["head_dim"] or config.hidden_size // config.num_attention_heads
    return fields


def read_back(d: dict, tmp_path) -> transformers.PretrainedConfig:
    """`d` written as config.json and read by transformers, as a checkpoint would be."""
    (tmp_path / "config.json").write_text(json.dumps(d))
    return transformers.AutoConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_round_trips_through_transformers(name, tmp_path):
    original = hf_config(name)
    ours = LlamaConfig.from_hf_config(original.to_dict())
    assert ours == LlamaConfig.from_hf_config(original)  # dict or config object
    back = read_back(ours.to_hf_config(), tmp_path)
    assert type(back) is type(original)
    assert architecture(back) == architecture(original)
    assert LlamaConfig.from_hf_config(back.to_dict()) == ours


def test_qwen2_windows_from_max_window_layers():
    """A Qwen2 config.json without layer_types (older checkpoints): the layers from
    max_window_layers on slide, as transformers decides."""
    d = hf_config("qwen2", use_sliding_window=True, sliding_window=4).to_dict()
    d.pop("layer_types")
    d["max_window_layers"] = 1
    theirs = transformers.Qwen2Config(**d)
    assert theirs.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert LlamaConfig.from_hf_config(d).sliding_windows == (None, 4, 4)
    assert LlamaConfig.from_hf_config(d | {"use_sliding_window": False}).sliding_windows == ()


@pytest.mark.parametrize(
    "fields",
    [
        dict(model_type="llama", qkv_bias=True, o_proj_bias=True, mlp_bias=True, head_dim=16),
        dict(model_type="mistral", sliding_windows=(4, 4, 4), num_key_value_heads=2),
        dict(model_type="mistral"),
        dict(model_type="qwen2", qkv_bias=True, sliding_windows=(None, 4, 4)),
        dict(model_type="qwen2", qkv_bias=True, tie_word_embeddings=True, num_labels=5),
        dict(model_type="qwen3", qk_norm=True, qkv_bias=True, o_proj_bias=True, head_dim=16),
        dict(model_type="qwen3", qk_norm=True, sliding_windows=(4, None, 4)),
    ],
)
def test_config_built_from_fields_is_written_for_transformers(fields, tmp_path):
    """A config made in peftx (no config.json behind it) is written so that transformers
    builds the same model: windows, biases and labels included."""
    size = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, head_dim=8)
    size.update(num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4)
    ours = LlamaConfig(**{**size, **fields})
    back = read_back(ours.to_hf_config(), tmp_path)
    assert back.model_type == ours.model_type
    assert LlamaConfig.from_hf_config(back) == ours
    # transformers' model has the same parameter shapes as peftx's
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(back)
    mine = eqx.filter_eval_shape(
        pm.LlamaForCausalLM, ours, key=jax.random.key(0), layout="unrolled"
    )
    shapes = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    if ours.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    leaves = jax.tree.leaves_with_path(mine)
    dotted = jax.tree_util.keystr
    assert {dotted(p, simple=True, separator="."): x.shape for p, x in leaves} == shapes


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(model_type="llama", sliding_windows=(4, 4, 4)), "sliding window"),
        (dict(model_type="llama", qkv_bias=True), "qkv_bias != o_proj_bias"),
        (dict(model_type="mistral", mlp_bias=True), "Mistral has none"),
        (dict(model_type="mistral", sliding_windows=(None, 4, 4)), "some layers only"),
        (dict(model_type="qwen2"), r"Qwen2 has \(True, False, False\)"),
        (dict(model_type="qwen2", qkv_bias=True, sliding_windows=(2, 4, 4)), "one sliding_window"),
        (dict(model_type="qwen3"), "qk_norm=False"),
        (dict(model_type="llama", qk_norm=True), "qk_norm=True"),
        (dict(model_type="qwen3", qk_norm=True, qkv_bias=True), "attention_bias on q, k, v and o"),
    ],
)
def test_config_transformers_cannot_express_raises(fields, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(num_hidden_layers=LAYERS, **fields).to_hf_config()


def test_old_rope_scaling_form_is_read(checkpoint, tmp_path):
    """A config.json with transformers 4's `rope_scaling` and `rope_theta` (no
    `rope_parameters`) loads to the same model as the new form."""
    model, path = checkpoint("llama-linear")
    d = json.loads((path / "config.json").read_text())
    rope = d.pop("rope_parameters")
    d["rope_theta"] = rope.pop("rope_theta")
    d["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    assert LlamaConfig.from_hf_config(d) == LlamaConfig.from_hf_config(model.config)
    theirs = transformers.LlamaConfig(**d).rope_parameters
    ours = LlamaConfig.from_hf_config(d).rope_parameters
    assert ours == {k: v for k, v in theirs.items() if k != "type"}
    for file in path.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(d))
    out = pm.from_pretrained(tmp_path, layout="unrolled")(jnp.asarray(IDS), jnp.asarray(MASK))
    assert real_diff(out.logits, torch_forward(model, IDS, MASK).logits, MASK) <= TOL


@pytest.mark.parametrize(
    "rope",
    [
        {},
        {"rope_theta": 5e5},
        {"rope_parameters": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 500.0},
        {"rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_theta": 500.0},
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
        {
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "rope_parameters": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10.0},
        },
    ],
)
def test_rope_parameters_read_as_transformers_reads_them(rope):
    """However a config.json spells its rope (transformers 4 or 5, theta inside or beside
    the dict, defaults), peftx takes the parameters transformers takes."""
    d = {k: v for k, v in hf_config("llama").to_dict().items() if k != "rope_parameters"}
    d.update(copy.deepcopy(rope))
    ours = LlamaConfig.from_hf_config(copy.deepcopy(d)).rope_parameters
    theirs = transformers.LlamaConfig(**copy.deepcopy(d)).rope_parameters
    assert ours == {k: v for k, v in theirs.items() if k != "type"}


@pytest.mark.parametrize("rope_type", ["longrope", "proportional", "mrope"])
def test_unsupported_rope_type_raises(rope_type):
    d = hf_config("llama").to_dict()
    d["rope_parameters"] = dict(rope_type=rope_type, rope_theta=10000.0, factor=2.0)
    with pytest.raises(ValueError, match=f"rope type '{rope_type}' is not supported.*llama3"):
        LlamaConfig.from_hf_config(d)
    d.pop("rope_parameters")
    d["rope_scaling"] = dict(type=rope_type, factor=2.0)
    with pytest.raises(ValueError, match=f"'{rope_type}'"):
        LlamaConfig.from_hf_config(d)


def test_unsupported_model_type_raises():
    d = hf_config("llama").to_dict() | {"model_type": "gemma"}
    with pytest.raises(ValueError, match="model types.*'llama'.*got 'gemma'"):
        LlamaConfig.from_hf_config(d)


# gradient checkpointing


def loss_and_grads(model, ids, mask):
    """Next-token cross entropy over real tokens, and its gradient with respect to every
    floating-point array of `model`."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    targets = jnp.asarray(ids[:, 1:])
    weight = jnp.asarray(mask[:, 1:] * mask[:, :-1], jnp.float32)

    def loss(params):
        logits = eqx.combine(params, static)(jnp.asarray(ids), jnp.asarray(mask)).logits
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return -jnp.sum(picked * weight) / jnp.sum(weight)

    traced = jax.jit(jax.value_and_grad(loss)).trace(params)
    return traced.lower().compile()(params), str(traced.jaxpr)


@pytest.mark.parametrize(
    "layout, how, policy",
    [
        ("stacked", "function", "dots_with_no_batch_dims_saveable"),
        ("unrolled", "constructor", None),
    ],
)
def test_gradient_checkpointing_same_loss_and_gradients(checkpoint, layout, how, policy):
    _, path = checkpoint("mistral")
    plain = pm.from_pretrained(path, layout=layout)
    if how == "function":
        remat = pm.gradient_checkpointing(plain, policy=policy)
        assert plain.model.gradient_checkpointing is False  # a new model; the old unchanged
    else:
        remat = pm.from_pretrained(
            path, layout=layout, gradient_checkpointing=True, remat_policy=policy
        )
    assert remat.model.gradient_checkpointing is True
    assert remat.model.remat_policy == policy
    (loss, grads), plain_jaxpr = loss_and_grads(plain, IDS, MASK)
    (remat_loss, remat_grads), remat_jaxpr = loss_and_grads(remat, IDS, MASK)
    # the switch really reaches the trace: every block is rematerialized with the policy
    # (a scan's own differentiation may add a remat of its own; it is never this one)
    policy_fn = None if policy is None else getattr(jax.checkpoint_policies, policy)
    expected = re.sub(r"0x[0-9a-fA-F]+", "0xXXXXXXXXXXXX", f"policy={policy_fn}")
    assert re.findall(r"policy=[^\n]*", remat_jaxpr) == [expected] * (
        1 if layout == "stacked" else LAYERS
    )
    assert expected not in plain_jaxpr
    np.testing.assert_allclose(float(remat_loss), float(loss), rtol=1e-6)
    flat, remat_flat = jax.tree.leaves(grads), jax.tree.leaves(remat_grads)
    assert len(flat) == len(remat_flat) > 0
    eps = float(jnp.finfo(jnp.float32).eps)
    for g, rg in zip(flat, remat_flat, strict=True):
        scale = float(jnp.max(jnp.abs(g)))
        assert scale > 0
        np.testing.assert_allclose(np.asarray(rg), np.asarray(g), rtol=0, atol=64 * eps * scale)


def test_gradient_checkpointing_switch(checkpoint):
    _, path = checkpoint("llama")
    a = pm.from_pretrained(path, model_class="LlamaModel", layout="unrolled")
    b = pm.from_pretrained(path, layout="stacked")
    both = pm.gradient_checkpointing((a, {"lm": b}), policy="dots_saveable")
    assert type(both[0]) is pm.LlamaModel and type(both[1]["lm"]) is pm.LlamaForCausalLM
    for backbone in (both[0], both[1]["lm"].model):
        assert backbone.gradient_checkpointing is True
        assert backbone.remat_policy == "dots_saveable"
    off = pm.gradient_checkpointing(both, enable=False)
    assert off[0].gradient_checkpointing is False and off[0].remat_policy is None
    # arrays are shared, not copied, and switching back gives the original model
    assert off[1]["lm"].model.embed_tokens.weight is b.model.embed_tokens.weight
    assert bool(eqx.tree_equal(off[0], a))
    assert jax.tree.structure(off[1]["lm"]) == jax.tree.structure(b)
    # a PeftModel (adapters on a stacked model) has its backbone switched too
    lora = peftx.LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    peft_model = peftx.get_peft_model(b, lora, key=jax.random.key(1))
    switched = pm.gradient_checkpointing(peft_model, policy="nothing_saveable")
    assert type(switched) is type(peft_model)
    backbones = [
        x
        for x in jax.tree.leaves(switched, is_leaf=lambda x: isinstance(x, pm.LlamaModel))
        if isinstance(x, pm.LlamaModel)
    ]
    assert len(backbones) == 1
    assert backbones[0].gradient_checkpointing is True
    assert backbones[0].remat_policy == "nothing_saveable"


@pytest.mark.parametrize("bad", ["bogus", "save_only_these_names", "dots_savable"])
def test_invalid_remat_policy_raises_naming_valid_ones(checkpoint, bad):
    _, path = checkpoint("llama")
    model = pm.from_pretrained(path, layout="unrolled")
    match = f"remat_policy '{bad}'.*nothing_saveable.*dots_with_no_batch_dims_saveable"
    with pytest.raises(ValueError, match=match):
        pm.gradient_checkpointing(model, policy=bad)
    with pytest.raises(ValueError, match=match):
        pm.from_pretrained(path, gradient_checkpointing=True, remat_policy=bad)
    config = LlamaConfig.from_hf_config(hf_config("llama"))
    with pytest.raises(ValueError, match=match):
        pm.LlamaModel(config, key=jax.random.key(0), remat_policy=bad)
