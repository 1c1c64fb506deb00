"""Packed rows (several examples in a row, told apart by `position_ids` that restart):
each example sees only its own tokens, as in transformers, whose convention this is
(`masking_utils.find_packed_sequence_indices`: without an attention mask and a cache).

References share no code with peftx: the same examples run one per row by peftx, and the
packed row run by transformers on the same random weights; the resets of
`encode_causal_lm`/`encode_chat` are written out by hand."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import unpacked, word_tokenizer
from test_chat_data import CHATS, MARKED, _by_hand, _tokenizer
from test_gemma import torch_gemma
from test_gpt2 import torch_model as torch_gpt2
from test_llama import TOL, torch_model as torch_llama

import peftx.models as pm
from peftx import train
from peftx.train import IGNORE

VOCAB = 61  # the smallest of the three models' vocabularies
# two packed rows of 16: examples of 5, 7 and 4 tokens, then 9 and 7. Qwen3's and Gemma 2's
# sliding window (4) is shorter than most, so the window counts within an example
LENGTHS = [[5, 7, 4], [9, 7]]
ROW = 16
MODELS = {
    "qwen3": lambda: torch_llama("qwen3"),  # q/k norms, a window on alternate layers
    "gemma2": torch_gemma,  # soft-capped scores, a window on alternate layers
    "gpt2": lambda: torch_gpt2("gpt2"),  # absolute position embeddings
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """`models(name)`: `(torch model, peftx's model of its save_pretrained directory)`,
    each built once."""
    built = {}

    def get(name):
        if name not in built:
            model = MODELS[name]()
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            built[name] = model, pm.from_pretrained(path)
        return built[name]

    return get


def packed_rows(seed=0):
    """The packed ids, their positions (0, 1, ... from each example's start) and each
    example as `(row, start, length)`."""
    ids = np.random.default_rng(seed).integers(1, VOCAB, (len(LENGTHS), ROW)).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in sum(LENGTHS, [])]).reshape(ids.shape)
    spans = [(r, sum(row[:k]), n) for r, row in enumerate(LENGTHS) for k, n in enumerate(row)]
    return ids, positions.astype(np.int32), spans


@eqx.filter_jit
def run(model, ids, mask=None, position_ids=None):
    return model(ids, mask, position_ids).logits


def torch_logits(model, ids, **kwargs):
    kwargs = {k: torch.tensor(v, dtype=torch.long) for k, v in kwargs.items()}
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids, dtype=torch.long), use_cache=False, **kwargs)
    return out.logits.numpy()


@pytest.mark.parametrize(
    "name",
    [
        # Gemma 2's alternate windows: the fast tier packs past Qwen3's, the whole suite both
        pytest.param(n, marks=pytest.mark.variant_sweep) if n == "gemma2" else n
        for n in sorted(MODELS)
    ],
)
def test_packed_rows_equal_the_examples_run_alone_and_transformers(models, name):
    """On each example's tokens, the packed rows give the logits of the examples run one
    per row (right-padded, with a mask), and transformers' for the same packed ids and
    positions; attending across examples (the same positions with a mask of ones, which
    transformers also reads as one sequence) moves the later examples' logits far more."""
    theirs, ours = models(name)
    ids, positions, spans = packed_rows()
    packed = np.asarray(run(ours, jnp.asarray(ids), position_ids=jnp.asarray(positions)))
    alone_ids = np.zeros((len(spans), ROW), np.int32)
    alone_mask = np.zeros((len(spans), ROW), np.int32)
    for n, (r, start, length) in enumerate(spans):
        alone_ids[n, :length] = ids[r, start : start + length]
        alone_mask[n, :length] = 1
    alone = np.asarray(run(ours, jnp.asarray(alone_ids), jnp.asarray(alone_mask)))
    for n, (r, start, length) in enumerate(spans):
        np.testing.assert_allclose(
            packed[r, start : start + length], alone[n, :length], atol=TOL, rtol=0
        )
    reference = torch_logits(theirs, ids, position_ids=positions)
    np.testing.assert_allclose(packed, reference, atol=TOL, rtol=0)

    ones = np.ones_like(ids)
    across = np.asarray(run(ours, jnp.asarray(ids), jnp.asarray(ones), jnp.asarray(positions)))
    np.testing.assert_allclose(
        across, torch_logits(theirs, ids, attention_mask=ones, position_ids=positions), atol=TOL
    )
    later = [(r, start, length) for r, start, length in spans if start > 0]
    moved = min(np.abs(across[r, s : s + n] - packed[r, s : s + n]).max() for r, s, n in later)
    assert moved > 100 * TOL


def test_packed_loss_equals_the_unpacked_loss(models):
    """`causal_lm_loss` (the training loss, through `train.logits`) on
    `encode_causal_lm(..., pack=True)` rows: each example's summed loss and count equal
    those of the same examples one per row. The examples fill the packed rows exactly;
    the text has no prompt, so the first token of each example would be a label if
    packing did not leave it out."""
    words = ["[PAD]", "[UNK]", "</s>", *(f"w{i}" for i in range(40))]
    tok = word_tokenizer(words)
    rng = np.random.default_rng(1)
    # each example is its words and EOS: the lengths of LENGTHS
    texts = [" ".join(rng.choice(words[3:], n - 1)) for n in sum(LENGTHS, [])]
    packed = train.encode_causal_lm(tok, texts, max_length=ROW, pack=True)
    alone = train.encode_causal_lm(tok, texts, max_length=ROW)
    assert packed["input_ids"].shape == (len(LENGTHS), ROW)
    _, model = models("qwen3")
    loss = eqx.filter_jit(train.causal_lm_loss)
    # where packing put each example: (row, start, length) of each run of positions 0, 1, ...
    spans = {}
    for r, positions in enumerate(packed["position_ids"].tolist()):
        for start in [t for t, p in enumerate(positions) if p == 0]:
            length = next((k for k in range(1, ROW - start) if positions[start + k] == 0), None)
            length = length or ROW - start
            ids = packed["input_ids"][r, start : start + length].tolist()
            n = next(n for n in range(len(texts)) if alone["input_ids"][n, :length].tolist() == ids)
            spans[n] = r, start, length
    assert sorted(spans) == list(range(len(texts)))

    def one_example(data, row, start, length):
        """`data` with every label but those of one example's tokens left out."""
        keep = np.zeros_like(data["labels"], bool)
        keep[row, start : start + length] = True
        return {**data, "labels": np.where(keep, data["labels"], IGNORE)}

    for n, (r, start, length) in spans.items():
        total, sums = loss(model, one_example(packed, r, start, length))
        want, want_sums = loss(model, one_example(alone, n, 0, length))
        assert float(sums["count"]) == float(want_sums["count"]) == length - 1
        assert float(total) == pytest.approx(float(want), rel=1e-5, abs=TOL)
    whole = loss(model, packed)[0]
    without_resets = loss(model, {k: v for k, v in packed.items() if k != "position_ids"})[0]
    assert abs(float(whole) - float(without_resets)) > 100 * TOL


def _packed(examples):
    """Each example `(ids, labels)` as packing keeps it: its first token labelled -100,
    since nothing before it is seen to predict it."""
    return sorted((list(ids), [IGNORE, *labels[1:]]) for ids, labels in examples)


def test_encode_causal_lm_keeps_every_example_whole_in_a_row():
    """Examples of 3, 2 and 5 tokens (words, EOS) in rows of 6: none is dropped or split
    (cut into rows of 6, they left 4 tokens out); the 5 has a row, the 3 and the 2 share
    the other, positions restarting at each, each row padded at its end."""
    words = ["[PAD]", "[UNK]", "</s>", "a", "b", "c", "d", "e", "f", "g"]
    tok = word_tokenizer(words)
    texts = ["a b", "c", "d e f g"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing truncated, no example without a label
        data = train.encode_causal_lm(tok, texts, max_length=6, pack=True)
    a, b, c, d, e, f, g, eos = (words.index(w) for w in [*"abcdefg", "</s>"])
    want = [([a, b, eos], [a, b, eos]), ([c, eos], [c, eos]), ([d, e, f, g, eos],) * 2]
    assert sorted(unpacked(data)) == _packed(want)
    assert data["input_ids"].shape == (2, 6)
    assert sorted(data["position_ids"].tolist()) == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 0]]


def test_eight_chats_of_23_tokens_are_all_kept_in_rows_of_64():
    """The new user's case: 8 chats of 23 tokens, packed in rows of 64, were 34 of 56
    supervised tokens (one chat never trained, one cut from its user turn). Every chat
    is kept whole, two to a row, learning what it learns unpacked."""
    chats = [
        [
            {"role": "user", "content": " ".join(f"w{(n + k) % 20}" for k in range(9))},
            {"role": "assistant", "content": " ".join(f"w{(3 * n + k) % 20}" for k in range(10))},
        ]
        for n in range(8)
    ]
    assert {len(_by_hand(c)[0]) for c in chats} == {23}
    data = train.encode_chat(_tokenizer(MARKED), chats, max_length=64, pack=True)
    assert data["input_ids"].shape == (4, 64)
    assert sorted(unpacked(data)) == _packed(_by_hand(c) for c in chats)
    unpacked_rows = train.encode_chat(_tokenizer(MARKED), chats, max_length=64)
    assert train.supervised_tokens(data) == train.supervised_tokens(unpacked_rows) == 8 * 11


def test_packing_truncates_a_long_example_as_unpacked_rows_do():
    """An example longer than `max_length` is cut to it (and warned about), as an unpacked
    row is, never continued in another row."""
    words = ["[PAD]", "[UNK]", "</s>", "a", "b", "c", "d", "e", "f", "g"]
    tok = word_tokenizer(words)
    texts = ["a b c d e f", "g"]
    with pytest.warns(UserWarning, match=r"1 of 2 examples are longer than max_length=4 .*rows 1"):
        data = train.encode_causal_lm(tok, texts, max_length=4, pack=True)
    unpacked_rows = train.encode_causal_lm(tok, texts, max_length=4)
    long = unpacked_rows["input_ids"][0].tolist()
    g, eos = words.index("g"), words.index("</s>")
    assert sorted(unpacked(data)) == _packed([(long, long), ([g, eos], [g, eos])])


def test_encode_chat_restarts_positions_at_each_conversation():
    """The two chats of test_chat_data (18 and 8 tokens) in rows of 18: each in a row of
    its own, counted from 0, with the chats' own labels (their first tokens are the
    roles' words)."""
    data = train.encode_chat(_tokenizer(MARKED), CHATS, max_length=18, pack=True)
    assert sorted(data["position_ids"].tolist()) == [[*range(8), *[0] * 10], list(range(18))]
    assert sorted(unpacked(data)) == _packed(_by_hand(c) for c in CHATS)


def test_padded_packed_rows_keep_their_examples_apart(models):
    """`pad_to` (several adapters' data in one batch) pads packed rows at their ends; the
    real tokens' logits do not change."""
    _, model = models("gpt2")
    ids, positions, _ = packed_rows()
    data = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "labels": ids,
        "position_ids": positions,
    }
    padded = train.pad_to(data, ROW + 8)
    np.testing.assert_array_equal(padded["position_ids"][:, ROW:], 0)
    got = eqx.filter_jit(train.logits)(model, jax.tree.map(jnp.asarray, padded))
    want = run(model, jnp.asarray(ids), position_ids=jnp.asarray(positions))
    np.testing.assert_allclose(np.asarray(got)[:, :ROW], want, atol=TOL, rtol=0)
