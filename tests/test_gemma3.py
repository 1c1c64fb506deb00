"""Gemma 3's text model against transformers in PyTorch (`transformers/models/gemma3`).

A tiny random Gemma 3 whose norms are random too (transformers starts Gemma's at zero,
a scale of one, which would hide a missing `1 + w`), the q/k norms included, with a
window on the first and last layers, the global layer's rope scaled linearly by 8 and
the sliding layers' rope on a base of its own, `query_pre_attn_scalar` unlike
`head_dim`, and grouped-query attention; saved with `save_pretrained` and loaded with
`peftx.models.from_pretrained`, so both sides run the same weights.
"""

import copy

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from test_checkpoint import random_model
from test_gemma import randomize_norms
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
from peftx.models import Gemma3TextConfig

# a further architecture of the zoo: the whole suite runs it, the fast tier runs Llama
pytestmark = pytest.mark.zoo_sweep

LAYERS = 3
ROPE = {
    "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=10000.0),
    "sliding_attention": dict(rope_type="default", rope_theta=100.0),
}
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=4,
    sliding_window_pattern=3,  # layers 0 and 1 slide, layer 2 is global
    rope_parameters=ROPE,
    max_position_embeddings=64,
    pad_token_id=0,
    initializer_range=0.2,
    num_labels=3,
    attn_implementation="eager",
)


def torch_gemma3(head: str = "ForCausalLM", **overrides) -> torch.nn.Module:
    config = transformers.Gemma3TextConfig(**{**CONFIG, **overrides})
    torch.manual_seed(0)
    name = "Gemma3" + ("" if head == "ForCausalLM" else "Text") + head
    return randomize_norms(getattr(transformers, name)(config).eval())


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """`gemma3(head)`: `(torch model, its save_pretrained directory)`, built once."""
    built = {}

    def get(head: str = "ForCausalLM"):
        if head not in built:
            model = torch_gemma3(head)
            path = tmp_path_factory.mktemp(f"gemma3-{head}")
            model.save_pretrained(path)
            built[head] = model, path
        return built[head]

    return get


@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
def test_causal_lm_matches_transformers(gemma3, layout):
    model, path = gemma3()
    ours = pm.from_pretrained(path, layout=layout)
    assert type(ours) is pm.Gemma3ForCausalLM and ours.lm_head is None  # tied
    assert type(ours.model) is pm.Gemma3TextModel
    assert ours.config.sliding_windows == (4, 4, None)
    ref = torch_forward(model, IDS, MASK, output_hidden_states=True)
    out = ours(jnp.asarray(IDS), jnp.asarray(MASK), output_hidden_states=True)
    assert_layers_match(out.hidden_states, ours.model, ref.hidden_states, MASK, TOL)
    assert real_diff(out.logits, ref.logits, MASK) <= TOL


def test_sequence_classification_matches_transformers(gemma3):
    model, path = gemma3("ForSequenceClassification")
    ours = pm.from_pretrained(path)
    assert type(ours) is pm.Gemma3TextForSequenceClassification
    with torch.no_grad():
        want = model(
            input_ids=torch.tensor(IDS, dtype=torch.long),
            attention_mask=torch.tensor(MASK, dtype=torch.long),
        ).logits.numpy()
    got = np.asarray(ours(jnp.asarray(IDS), jnp.asarray(MASK)).logits)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)


def _zero_qk_norms(state: dict) -> dict:
    return {k: v * 0 if "q_norm" in k or "k_norm" in k else v for k, v in state.items()}


@pytest.mark.parametrize(
    "change",
    [
        dict(q_k_norm_weights=0),
        dict(rope_parameters={**ROPE, "sliding_attention": ROPE["full_attention"]}),
        dict(rope_parameters={**ROPE, "full_attention": dict(rope_type="default", rope_theta=1e4)}),
        dict(sliding_window_pattern=2),  # layer 1 global, layer 2 sliding
    ],
    ids=["qk_norm", "sliding_rope", "linear_factor", "layer_pattern"],
)
def test_each_feature_changes_the_output(gemma3, change):
    """Each of Gemma 3's features, switched off on the same weights, moves the logits far
    past the parity tolerance: the test above sees every one. (The q/k norms cannot be
    removed; their weights, zeroed, still normalize but no longer scale.)"""
    model, _ = gemma3()
    state = model.state_dict()
    if "q_k_norm_weights" in change:
        plain, state = torch_gemma3(), _zero_qk_norms(state)
    else:
        plain = torch_gemma3(**change)
    plain.load_state_dict(state)
    want = torch_forward(model, IDS, MASK).logits.numpy()
    assert real_diff(want, torch_forward(plain, IDS, MASK).logits, MASK) > 1000 * TOL


def test_kv_cache_steps_match_full_forward(gemma3):
    """Past the window of 4, and with the global layer's scaled rope."""
    ours = pm.from_pretrained(gemma3()[1])
    full = ours(jnp.asarray(DECODE_IDS), jnp.asarray(DECODE_MASK)).logits
    got = cached_decode(ours, DECODE_IDS, DECODE_MASK)
    assert real_diff(got, np.asarray(full), DECODE_MASK) <= TOL


def test_bfloat16_matches_transformers(gemma3):
    """bf16 weights on both sides stay within test_llama's first-order rounding bound,
    with Gemma 2's two more norms per layer and the q/k norms' two roundings."""
    model, path = gemma3()
    ours16 = pm.from_pretrained(path, dtype=jnp.bfloat16)
    exact = torch_forward(model, IDS, MASK).logits.numpy()
    theirs = torch_forward(copy.deepcopy(model).to(torch.bfloat16), IDS, MASK).logits
    out = ours16(jnp.asarray(IDS), jnp.asarray(MASK)).logits
    assert out.dtype == jnp.bfloat16
    scale = float(np.max(np.abs(exact[MASK.astype(bool)])))
    bound = BF16_U * ((16 + 7 + 4 + 2) * LAYERS + 4) * scale
    ours_error = real_diff(out, exact, MASK)
    assert ours_error <= bound, (ours_error, bound)
    assert real_diff(out, theirs, MASK) <= 2 * bound
    assert ours_error <= 2 * real_diff(theirs.float().numpy(), exact, MASK)


def test_config_round_trips_through_transformers(tmp_path):
    original = transformers.Gemma3TextConfig(**CONFIG)
    ours = Gemma3TextConfig.from_hf_config(original.to_dict())
    assert ours == Gemma3TextConfig.from_hf_config(original)
    back = read_back(ours.to_hf_config(), tmp_path)
    assert type(back) is transformers.Gemma3TextConfig
    fields = {*CONFIG, "layer_types", "tie_word_embeddings", "hidden_activation"}
    for field in fields - {"attn_implementation", "sliding_window_pattern"}:
        assert getattr(back, field) == getattr(original, field), field
    assert Gemma3TextConfig.from_hf_config(back.to_dict()) == ours


@pytest.mark.parametrize(
    "legacy",
    [
        dict(),  # transformers' defaults: five sliding layers to each global one
        # the older spellings of the 4B+ checkpoints' config.json
        dict(
            sliding_window_pattern=2,
            rope_theta=5000.0,
            rope_local_base_freq=77.0,
            rope_scaling=dict(rope_type="linear", factor=8.0),
        ),
    ],
    ids=["defaults", "legacy-keys"],
)
def test_config_read_as_transformers_reads_it(legacy):
    d = dict(num_hidden_layers=7, **legacy)
    theirs = transformers.Gemma3TextConfig(**d)
    ours = Gemma3TextConfig.from_hf_config({"model_type": "gemma3_text", **d})
    want = [theirs.sliding_window if t == "sliding_attention" else None for t in theirs.layer_types]
    assert list(ours.sliding_windows) == want
    assert ours.rope_parameters == theirs.rope_parameters["full_attention"]
    assert ours.sliding_rope_parameters == theirs.rope_parameters["sliding_attention"]
    assert ours.attn_logit_softcapping is ours.final_logit_softcapping is None


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True.*causal"),
        (
            dict(rope_parameters={"full_attention": dict(rope_type="yarn", factor=2.0)}),
            r"rope type 'yarn' is not supported for gemma3_text.*'linear'",
        ),
        (dict(rope_parameters=dict(rope_type="linear")), r"keys \['rope_type'\].*per layer type"),
        (
            dict(rope_scaling=dict(type="linear", factor=8.0)),
            r"'type' 'linear' beside 'rope_type' 'default'.*Write 'rope_type'",
        ),
        (
            dict(rope_parameters={"full_attention": dict(rope_type="linear")}),
            "linear rope needs a 'factor'",
        ),
        (dict(layer_types=["local"]), r"layer_types has \['local'\].*full_attention"),
    ],
)
def test_unsupported_config_raises(bad, match):
    with pytest.raises(ValueError, match=match):
        Gemma3TextConfig.from_hf_config({"model_type": "gemma3_text", **bad})


def test_config_is_gemma3_text_only():
    with pytest.raises(ValueError, match="model_type is 'gemma3_text', got 'gemma3'"):
        Gemma3TextConfig(model_type="gemma3")


def test_saved_model_loads_in_transformers(tmp_path):
    """A Gemma 3 made in peftx (random weights, no config.json behind it), saved and read
    back by transformers, computes the same logits."""
    config = Gemma3TextConfig.from_hf_config(transformers.Gemma3TextConfig(**CONFIG))
    model = random_model(pm.Gemma3ForCausalLM, config, 1)
    peftx.save_pretrained(model, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs) is transformers.Gemma3ForCausalLM
    got = model(jnp.asarray(IDS), jnp.asarray(MASK)).logits
    assert real_diff(got, torch_forward(theirs, IDS, MASK).logits, MASK) <= TOL


def test_multimodal_checkpoint_text_part(tmp_path):
    """A `Gemma3ForConditionalGeneration` checkpoint (a tiny vision tower beside the
    language model) loads as a `Gemma3ForCausalLM` whose logits on text equal the
    multimodal model's; saved back, it is a `gemma3_text` checkpoint transformers reads.
    The text config's final soft-cap (3, which bends these logits) is one the multimodal
    model never applies, so neither does the text part."""
    text = {k: v for k, v in CONFIG.items() if k != "attn_implementation"}
    text["final_logit_softcapping"] = 3.0
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
    )
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = randomize_norms(transformers.Gemma3ForConditionalGeneration(config).eval())
    model.save_pretrained(tmp_path / "mm")
    ours = pm.from_pretrained(tmp_path / "mm")
    assert type(ours) is pm.Gemma3ForCausalLM
    assert ours.config.model_type == "gemma3_text"
    assert ours.config.final_logit_softcapping is None
    want = torch_forward(model, IDS, MASK).logits
    got = ours(jnp.asarray(IDS), jnp.asarray(MASK)).logits
    assert real_diff(got, want, MASK) <= TOL
    peftx.save_pretrained(ours, tmp_path / "text")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text").eval()
    assert type(theirs) is transformers.Gemma3ForCausalLM
    assert real_diff(got, torch_forward(theirs, IDS, MASK).logits, MASK) <= TOL
