"""Phi-3 against transformers in PyTorch (`transformers/models/phi3`).

A tiny random Phi-3 with random norms, grouped-query attention, rotary embeddings on half
of each head's features and a sliding window, in two rope variants: the default, and
LongRoPE whose `original_max_position_embeddings` (8) lies inside the test batch (12
tokens: the long factors) and beyond a shorter one (8 tokens: the short factors). Saved
with `save_pretrained` and loaded with `peftx.models.from_pretrained`, so both sides run
the same weights.
"""

import copy

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from helpers import phi3_longrope
from test_checkpoint import random_model
from test_llama import (
    BF16_U,
    DECODE_IDS,
    DECODE_MASK,
    HEAD,
    IDS,
    MASK,
    PROMPT,
    ROUNDINGS,
    SEQ,
    TOL,
    VOCAB,
    assert_layers_match,
    cached_decode,
    padded_batch,
    read_back,
    real_diff,
    torch_forward,
)

import peftx
import peftx.models as pm
from peftx.adapters import AdapterSet
from peftx.models import Phi3Config
from peftx.sharding._rules import logical_axes

# a further architecture of the zoo: the whole suite runs it, the fast tier runs Llama
pytestmark = pytest.mark.zoo_sweep

LAYERS = 3
ORIGINAL = 8  # original_max_position_embeddings: between the short batch and the long one
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    original_max_position_embeddings=ORIGINAL,
    sliding_window=4,
    pad_token_id=0,
    initializer_range=0.2,
    num_labels=3,
    attn_implementation="eager",
)
# head_dim 8, half of it rotary: two frequencies, each with its own short and long factor
ROPES = {
    "default": dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
    "longrope": phi3_longrope(),
}
# every row's positions stay within ORIGINAL (the longest row is exactly 8: still short)
SHORT_IDS, SHORT_MASK = padded_batch(5, [ORIGINAL, 5, 3, 6], ["right", "left", "right", "left"], 8)


def torch_phi3(rope: str, head: str = "ForCausalLM", **overrides) -> torch.nn.Module:
    overrides.setdefault("rope_parameters", copy.deepcopy(ROPES[rope]))
    config = transformers.Phi3Config(**{**CONFIG, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, "Phi3" + head)(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """`phi3(rope, head)`: `(torch model, its save_pretrained directory)`, built once."""
    built = {}

    def get(rope: str, head: str = "ForCausalLM"):
        if (rope, head) not in built:
            model = torch_phi3(rope, head)
            path = tmp_path_factory.mktemp(f"phi3-{rope}-{head}")
            model.save_pretrained(path)
            built[rope, head] = model, path
        return built[rope, head]

    return get


def assert_matches(model, ours, ids, mask):
    ref = torch_forward(model, ids, mask, output_hidden_states=True)
    out = ours(jnp.asarray(ids), jnp.asarray(mask), output_hidden_states=True)
    assert_layers_match(out.hidden_states, ours.model, ref.hidden_states, mask, TOL)
    assert real_diff(out.logits, ref.logits, mask) <= TOL


@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_causal_lm_matches_transformers(phi3, rope, layout):
    """On a padded batch, every block and the logits; LongRoPE in both of its regimes."""
    model, path = phi3(rope)
    ours = pm.from_pretrained(path, layout=layout)
    assert type(ours) is pm.Phi3ForCausalLM and ours.config.sliding_window == 4
    assert ours.config.rope_parameters["rope_type"] == rope
    assert_matches(model, ours, IDS, MASK)
    if rope == "longrope":
        assert MASK.sum(-1).max() > ORIGINAL >= SHORT_MASK.sum(-1).max()
        assert_matches(model, ours, SHORT_IDS, SHORT_MASK)


def test_sequence_classification_matches_transformers(phi3):
    model, path = phi3("longrope", "ForSequenceClassification")
    ours = pm.from_pretrained(path)
    assert type(ours) is pm.Phi3ForSequenceClassification
    want = torch_forward(model, IDS, MASK).logits.numpy()
    got = np.asarray(ours(jnp.asarray(IDS), jnp.asarray(MASK)).logits)
    assert got.shape == want.shape == (len(IDS), 3)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def _longrope(**changes):
    return {"rope_parameters": {**ROPES["longrope"], **changes}}


# name: the model, the change on the same weights, the batch that shows it
FEATURES = {
    "partial_rotary_factor": (
        "default",
        {"rope_parameters": {**ROPES["default"], "partial_rotary_factor": 1.0}},
        (IDS, MASK),
    ),
    "sliding_window": ("default", {"sliding_window": None}, (IDS, MASK)),
    # the long batch with the short factors, and the short batch with the long ones
    "long_factor": (
        "longrope",
        _longrope(long_factor=ROPES["longrope"]["short_factor"]),
        (IDS, MASK),
    ),
    "short_factor": (
        "longrope",
        _longrope(short_factor=ROPES["longrope"]["long_factor"]),
        (SHORT_IDS, SHORT_MASK),
    ),
    "attention_factor": ("longrope", _longrope(attention_factor=1.0), (IDS, MASK)),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_each_feature_changes_the_output(phi3, feature):
    """Each of Phi-3's features, changed on the same weights, moves transformers' logits
    far past the parity tolerance: the tests above see every one."""
    rope, change, (ids, mask) = FEATURES[feature]
    model, _ = phi3(rope)
    other = torch_phi3(rope, **change)
    other.load_state_dict(model.state_dict())
    want = torch_forward(model, ids, mask).logits.numpy()
    assert real_diff(want, torch_forward(other, ids, mask).logits, mask) > 1000 * TOL


def test_kv_cache_steps_match_full_forward(phi3):
    """Default rope: a prefilled prompt, then one token at a time, as the full forward."""
    ours = pm.from_pretrained(phi3("default")[1])
    full = ours(jnp.asarray(DECODE_IDS), jnp.asarray(DECODE_MASK)).logits
    got = cached_decode(ours, DECODE_IDS, DECODE_MASK)
    assert real_diff(got, np.asarray(full), DECODE_MASK) <= TOL


def test_longrope_decoding_matches_transformers(phi3):
    """LongRoPE: the steps past ORIGINAL rotate their queries and keys with the long
    factors while the cached keys keep the short ones, so decoding differs from a full
    forward; it matches transformers' decoding with a cache, step for step."""
    model, path = phi3("longrope")
    ours = pm.from_pretrained(path)
    ids, mask = DECODE_IDS, DECODE_MASK
    assert PROMPT <= ORIGINAL < SEQ
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
                cache=out.cache,
                use_cache=True,
            )
            steps.append(out.logits)
    theirs = torch.cat(steps, dim=1)
    assert real_diff(cached_decode(ours, ids, mask), theirs, mask) <= TOL
    full = torch_forward(model, ids, mask).logits
    assert real_diff(full.numpy(), theirs, mask) > 1000 * TOL


def test_bfloat16_matches_transformers(phi3):
    """bf16 weights on both sides stay within test_llama's first-order rounding bound of
    the fp32 logits (the same roundings per block: Phi-3's fused products round once
    each, as the separate ones do)."""
    model, path = phi3("longrope")
    ours16 = pm.from_pretrained(path, dtype=jnp.bfloat16)
    exact = torch_forward(model, IDS, MASK).logits.numpy()
    theirs = torch_forward(copy.deepcopy(model).to(torch.bfloat16), IDS, MASK).logits
    out = ours16(jnp.asarray(IDS), jnp.asarray(MASK)).logits
    assert out.dtype == jnp.bfloat16
    scale = float(np.max(np.abs(exact[MASK.astype(bool)])))
    bound = BF16_U * (ROUNDINGS * LAYERS + HEAD) * scale
    ours_error = real_diff(out, exact, MASK)
    assert ours_error <= bound, (ours_error, bound)
    assert real_diff(out, theirs, MASK) <= 2 * bound
    assert ours_error <= 2 * real_diff(theirs.float().numpy(), exact, MASK)


# configs


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_config_round_trips_through_transformers(rope, tmp_path):
    original = transformers.Phi3Config(**CONFIG, rope_parameters=copy.deepcopy(ROPES[rope]))
    ours = Phi3Config.from_hf_config(original.to_dict())
    assert ours == Phi3Config.from_hf_config(original)
    back = read_back(ours.to_hf_config(), tmp_path)
    assert type(back) is transformers.Phi3Config
    for field in (*CONFIG, "rope_parameters", "tie_word_embeddings", "hidden_act", "rms_norm_eps"):
        if field != "attn_implementation":
            assert getattr(back, field) == getattr(original, field), field
    assert Phi3Config.from_hf_config(back.to_dict()) == ours


def test_old_config_form_is_read_as_transformers_reads_it():
    """A Phi-3 config.json of transformers 4's form (`rope_scaling` with `type`, theta,
    the rotary fraction and the original length beside it; "su" the old name of
    longrope): peftx takes the rope parameters transformers takes."""
    d = transformers.Phi3Config(**CONFIG).to_dict()
    del d["rope_parameters"]
    factors = {k: ROPES["longrope"][k] for k in ("short_factor", "long_factor")}
    d.update(rope_theta=500.0, partial_rotary_factor=0.5)
    for kind in ("longrope", "yarn"):
        d["rope_scaling"] = dict(type=kind, **factors)
        theirs = transformers.Phi3Config(**copy.deepcopy(d)).rope_parameters
        ours = Phi3Config.from_hf_config(copy.deepcopy(d)).rope_parameters
        assert {k: list(v) if isinstance(v, tuple) else v for k, v in ours.items()} == {
            k: v for k, v in theirs.items() if k != "type"
        }
    # the top-level original length wins over one inside the dict, as in transformers
    d["rope_scaling"]["original_max_position_embeddings"] = 16
    assert (
        transformers.Phi3Config(**copy.deepcopy(d)).rope_parameters[
            "original_max_position_embeddings"
        ]
        == ORIGINAL
    )
    assert Phi3Config.from_hf_config(d).rope_parameters["original_max_position_embeddings"] == 8


LONGROPE = ROPES["longrope"]
BAD_ROPES = {
    "type": (dict(rope_type="dynamic", factor=2.0), "type 'dynamic' is not supported.*longrope"),
    "length": (
        dict(LONGROPE, short_factor=[1.0]),
        r"short_factor must list one factor per rotary frequency \(2: .*\), got 1",
    ),
    "missing": (
        {k: v for k, v in LONGROPE.items() if k != "long_factor"},
        "long_factor.*got none",
    ),
    "zero": (
        dict(LONGROPE, long_factor=[1.0, 0.0]),
        r"long_factor must be null or a list of finite numbers > 0; got \[1.0, 0.0\]",
    ),
    "rotary": (dict(rope_type="default", partial_rotary_factor=0.1), "gives 0 rotary features"),
}


@pytest.mark.parametrize("bad", sorted(BAD_ROPES))
def test_bad_rope_raises_naming_it(bad):
    rope, match = BAD_ROPES[bad]
    d = transformers.Phi3Config(**CONFIG).to_dict() | {"rope_parameters": rope}
    with pytest.raises(ValueError, match=match):
        Phi3Config.from_hf_config(d)


@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
def test_saved_model_loads_in_transformers(tmp_path, layout):
    """A Phi-3 made in peftx (random weights, no config.json behind it), saved and read
    back by transformers, computes the same logits; peftx reads back the same arrays."""
    hf = transformers.Phi3Config(**CONFIG, rope_parameters=copy.deepcopy(ROPES["longrope"]))
    config = Phi3Config.from_hf_config(hf)
    model = random_model(pm.Phi3ForCausalLM, config, 1, layout=layout)
    peftx.save_pretrained(model, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs) is transformers.Phi3ForCausalLM
    got = model(jnp.asarray(IDS), jnp.asarray(MASK)).logits
    assert real_diff(got, torch_forward(theirs, IDS, MASK).logits, MASK) <= TOL
    again = peftx.from_pretrained(tmp_path, layout=layout)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_no_default_targets_as_in_peft(phi3):
    """PEFT 0.21 has no default target_modules for phi3: both refuse a config without
    them, and "all-linear" takes the fused projections and leaves lm_head alone."""
    model, path = phi3("default")
    with pytest.raises(ValueError, match="target_modules"):
        peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2))
    ours = pm.from_pretrained(path)
    with pytest.raises(ValueError, match="no LORA default for model type 'phi3'"):
        peftx.get_peft_model(ours, peftx.LoraConfig(r=2), key=jax.random.key(0))
    adapted = peftx.get_peft_model(
        ours, peftx.LoraConfig(r=2, target_modules="all-linear"), key=jax.random.key(0)
    )
    linears = peftx.select(adapted.base_model).at(peftx.of_type(eqx.nn.Linear))
    names = {
        path.rsplit(".", 1)[-1]
        for path, layer in zip(linears.paths(), linears.get(), strict=True)
        if isinstance(layer.weight, AdapterSet)
    }
    assert names == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}  # not lm_head


def test_every_weight_has_logical_axes():
    """The sharding presets place every Phi-3 weight: each array's path has logical axes,
    one per dimension (the fused projections as the separate ones)."""
    config = Phi3Config.from_hf_config(transformers.Phi3Config(**CONFIG))
    model = eqx.filter_eval_shape(
        pm.Phi3ForCausalLM, config, key=jax.random.key(0), layout="unrolled"
    )
    leaves = jax.tree_util.tree_leaves_with_path(model)
    assert len(leaves) == 3 + 6 * LAYERS  # embeddings, final norm, head; 6 per block
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        axes = logical_axes(Phi3Config.LOGICAL_AXES, name)
        assert axes is not None and len(axes) == leaf.ndim, name
