"""Gemma 2 against transformers in PyTorch (`transformers/models/gemma2`).

A tiny random Gemma 2 whose norms are random too (transformers starts Gemma's at zero,
a scale of one, which would hide a missing `1 + w`), with soft-caps low enough to bend
the scores and the logits, `query_pre_attn_scalar` unlike `head_dim`, grouped-query
attention and a window on alternate layers; saved with `save_pretrained` and loaded
with `peftx.models.from_pretrained`, so both sides run the same weights.
"""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from test_checkpoint import random_model
from test_llama import (
    BF16_U,
    DECODE_IDS,
    DECODE_MASK,
    IDS,
    MASK,
    TOL,
    VOCAB,
    assert_layers_match,
    cached_decode,
    read_back,
    real_diff,
    torch_forward,
)

import peftx
import peftx.models as pm
from peftx.models import Gemma2Config

# a further architecture of the zoo: the whole suite runs it, the fast tier runs Llama
pytestmark = pytest.mark.zoo_sweep

LAYERS = 3
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    attn_logit_softcapping=2.0,
    final_logit_softcapping=3.0,
    sliding_window=4,
    max_position_embeddings=64,
    pad_token_id=0,
    initializer_range=0.2,
    num_labels=3,
    attn_implementation="eager",
)


def randomize_norms(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every norm weight random (Gemma's start at zero: a scale of one)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    return model


def torch_gemma(head: str = "ForCausalLM", **overrides) -> torch.nn.Module:
    config = transformers.Gemma2Config(**{**CONFIG, **overrides})
    torch.manual_seed(0)
    return randomize_norms(getattr(transformers, "Gemma2" + head)(config).eval())


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """`gemma(head)`: `(torch model, its save_pretrained directory)`, built once."""
    built = {}

    def get(head: str = "ForCausalLM"):
        if head not in built:
            model = torch_gemma(head)
            path = tmp_path_factory.mktemp(f"gemma2-{head}")
            model.save_pretrained(path)
            built[head] = model, path
        return built[head]

    return get


@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
def test_causal_lm_matches_transformers(gemma, layout):
    model, path = gemma()
    ours = pm.from_pretrained(path, layout=layout)
    assert type(ours) is pm.Gemma2ForCausalLM and ours.lm_head is None  # tied
    assert ours.config.sliding_windows == (4, None, 4)  # every other layer, the first on
    ref = torch_forward(model, IDS, MASK, output_hidden_states=True)
    out = ours(jnp.asarray(IDS), jnp.asarray(MASK), output_hidden_states=True)
    assert_layers_match(out.hidden_states, ours.model, ref.hidden_states, MASK, TOL)
    assert real_diff(out.logits, ref.logits, MASK) <= TOL
    assert float(jnp.abs(out.logits).max()) < CONFIG["final_logit_softcapping"]


def test_sequence_classification_matches_transformers(gemma):
    model, path = gemma("ForSequenceClassification")
    ours = pm.from_pretrained(path)
    assert type(ours) is pm.Gemma2ForSequenceClassification
    with torch.no_grad():
        want = model(
            input_ids=torch.tensor(IDS, dtype=torch.long),
            attention_mask=torch.tensor(MASK, dtype=torch.long),
        ).logits.numpy()
    got = np.asarray(ours(jnp.asarray(IDS), jnp.asarray(MASK)).logits)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize(
    "change",
    [
        dict(attn_logit_softcapping=None),
        dict(final_logit_softcapping=None),
        dict(query_pre_attn_scalar=16),
        dict(layer_types=["full_attention"] * LAYERS),
    ],
    ids=lambda d: next(iter(d)),
)
def test_each_feature_changes_the_output(gemma, change):
    """Each of Gemma 2's features, switched off on the same weights, moves the logits far
    past the parity tolerance: the test above sees every one."""
    model, _ = gemma()
    plain = copy.deepcopy(torch_gemma(**change))
    plain.load_state_dict(model.state_dict())
    want = torch_forward(model, IDS, MASK).logits.numpy()
    assert real_diff(want, torch_forward(plain, IDS, MASK).logits, MASK) > 1000 * TOL


def test_kv_cache_steps_match_full_forward(gemma):
    ours = pm.from_pretrained(gemma()[1])
    full = ours(jnp.asarray(DECODE_IDS), jnp.asarray(DECODE_MASK)).logits
    got = cached_decode(ours, DECODE_IDS, DECODE_MASK)
    assert real_diff(got, np.asarray(full), DECODE_MASK) <= TOL


def test_bfloat16_matches_transformers(gemma):
    """bf16 weights on both sides (the √hidden embedding scale rounded to bf16 as
    transformers rounds it) stay within the first-order rounding bound of test_llama's
    bf16 test, two more norms per layer included, of the fp32 logits."""
    model, path = gemma()
    ours16 = pm.from_pretrained(path, dtype=jnp.bfloat16)
    exact = torch_forward(model, IDS, MASK).logits.numpy()
    theirs = torch_forward(copy.deepcopy(model).to(torch.bfloat16), IDS, MASK).logits
    out = ours16(jnp.asarray(IDS), jnp.asarray(MASK)).logits
    assert out.dtype == jnp.bfloat16
    scale = float(np.max(np.abs(exact[MASK.astype(bool)])))
    bound = BF16_U * ((16 + 7 + 4) * LAYERS + 4 + 2) * scale  # + the two soft-caps
    ours_error = real_diff(out, exact, MASK)
    assert ours_error <= bound, (ours_error, bound)
    assert real_diff(out, theirs, MASK) <= 2 * bound
    assert ours_error <= 2 * real_diff(theirs.float().numpy(), exact, MASK)


def test_config_round_trips_through_transformers(tmp_path):
    original = transformers.Gemma2Config(**CONFIG)
    ours = Gemma2Config.from_hf_config(original.to_dict())
    assert ours == Gemma2Config.from_hf_config(original)
    back = read_back(ours.to_hf_config(), tmp_path)
    assert type(back) is transformers.Gemma2Config
    for field in (*CONFIG, "layer_types", "tie_word_embeddings", "hidden_activation"):
        if field != "attn_implementation":
            assert getattr(back, field) == getattr(original, field), field
    assert Gemma2Config.from_hf_config(back.to_dict()) == ours


@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
def test_saved_model_loads_in_transformers(tmp_path, layout):
    """A Gemma 2 made in peftx (random weights, no config.json behind it), saved and read
    back by transformers, computes the same logits; peftx reads back the same arrays."""
    config = Gemma2Config.from_hf_config(transformers.Gemma2Config(**CONFIG))
    model = random_model(pm.Gemma2ForCausalLM, config, 1, layout=layout)
    peftx.save_pretrained(model, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs) is transformers.Gemma2ForCausalLM
    got = model(jnp.asarray(IDS), jnp.asarray(MASK)).logits
    assert real_diff(got, torch_forward(theirs, IDS, MASK).logits, MASK) <= TOL
    again = peftx.from_pretrained(tmp_path, layout=layout)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
