"""What `encode_causal_lm` and `encode_classification` feed the model, against the
tokenizer's own output: a training row starts with exactly `tokenizer(prompt)["input_ids"]`
(Llama's BOS included; none for GPT-2), then the text's tokens and EOS. Also the checks
that keep a run from training on nothing, on ids the model has no embedding for, on
labels outside the classifier, or on the repr of a list; and `read_records` on files
that are not UTF-8.

The tokenizers are transformers' own classes built offline from a vocabulary written
here: `LlamaTokenizer` (with and without its BOS), `GPT2Tokenizer` and a word-level
`PreTrainedTokenizerFast` with BERT's `[CLS] ... [SEP]` around each text.
"""

import string
import warnings

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
import transformers
from helpers import as_users_run, example_count, unpacked, word_tokenizer

from peftx import train

LETTERS = string.ascii_lowercase


def _llama(bos: bool) -> transformers.PreTrainedTokenizerBase:
    """A Llama tokenizer over single letters (each word: `▁` then its letters)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3}
    vocab |= {c: len(vocab) + i for i, c in enumerate(LETTERS)}
    vocab |= {"▁" + c: len(vocab) + i for i, c in enumerate(LETTERS)}
    return transformers.LlamaTokenizer(vocab=vocab, merges=[], add_bos_token=bos)


def _gpt2() -> transformers.PreTrainedTokenizerBase:
    """A GPT-2 tokenizer over single letters (`Ġ` marks a space): no special tokens added,
    `<|endoftext|>` as EOS."""
    vocab = {"<|endoftext|>": 0, "Ġ": 1}
    vocab |= {c: len(vocab) + i for i, c in enumerate(LETTERS)}
    vocab |= {"Ġ" + c: len(vocab) + i for i, c in enumerate(LETTERS)}
    return transformers.GPT2Tokenizer(vocab=vocab, merges=[])


TOKENIZERS = {
    "llama-bos": _llama(bos=True),
    "llama-no-bos": _llama(bos=False),
    "gpt2": _gpt2(),
}
BERT_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", *LETTERS]


def test_the_tokenizers_differ_as_intended():
    """The arms really differ: only the Llama one with BOS puts a token before the text."""
    bos = TOKENIZERS["llama-bos"]
    assert bos("ab c")["input_ids"][0] == bos.bos_token_id == 1
    assert bos("ab c")["input_ids"][1:] == bos("ab c", add_special_tokens=False)["input_ids"]
    for name in ("llama-no-bos", "gpt2"):
        tok = TOKENIZERS[name]
        assert tok("ab c")["input_ids"] == tok("ab c", add_special_tokens=False)["input_ids"]
        assert tok.eos_token_id is not None


def _expected(tok, text, prompt):
    """The example `(ids, labels)` of the contract, written from the tokenizer's output."""
    body = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    if prompt is None:
        start = tok(text)["input_ids"][: -len(body) + 1 or None]  # whatever precedes the text
    else:
        start = tok(prompt)["input_ids"]
    return start + body, [-100] * len(start) + body


words = st.text(LETTERS, min_size=1, max_size=4)
texts = st.lists(words, min_size=0, max_size=6).map(" ".join)
examples = st.lists(st.tuples(texts, texts), min_size=1, max_size=6)


@pytest.mark.parametrize("name", TOKENIZERS)
@hypothesis.settings(max_examples=example_count(40), deadline=None)
@hypothesis.given(examples=examples, with_prompt=st.booleans(), max_length=st.integers(8, 40))
def test_rows_start_with_the_tokenizers_prompt(name, examples, with_prompt, max_length):
    tok = TOKENIZERS[name]
    prompts = [p for p, _ in examples] if with_prompt else None
    text_list = [t for _, t in examples]
    want = [_expected(tok, t, p if with_prompt else None) for p, t in examples]
    hypothesis.assume(any(len(ids) > 1 and len(ids) <= max_length for ids, _ in want))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rows truncated to no label: tested below
        data = train.encode_causal_lm(tok, text_list, prompts, max_length=max_length)
    width = data["input_ids"].shape[1]
    assert width <= max_length
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for n, (ids, labels) in enumerate(want):
        ids, labels = ids[:width], labels[:width]
        fill = width - len(ids)
        assert data["input_ids"][n].tolist() == ids + [pad] * fill
        assert data["labels"][n].tolist() == labels + [-100] * fill
        assert data["attention_mask"][n].tolist() == [1] * len(ids) + [0] * fill
        if with_prompt:
            start = tok(prompts[n])["input_ids"]
            if len(start) <= width:
                assert data["input_ids"][n, : len(start)].tolist() == start
        if name == "llama-bos":
            assert data["input_ids"][n, 0] == tok.bos_token_id


@pytest.mark.parametrize("name", TOKENIZERS)
@hypothesis.settings(max_examples=example_count(30), deadline=None)
@hypothesis.given(examples=examples, with_prompt=st.booleans(), max_length=st.integers(2, 12))
def test_packed_rows_start_each_example_the_same_way(name, examples, with_prompt, max_length):
    """Packed, every example is kept whole in one row (truncated to `max_length`, as an
    unpacked row is), its positions counting from 0, its first label -100."""
    tok = TOKENIZERS[name]
    prompts = [p for p, _ in examples] if with_prompt else None
    text_list = [t for _, t in examples]
    want = []
    for p, t in examples:
        ids, labels = _expected(tok, t, p if with_prompt else None)
        # packed, nothing before an example predicts its first token
        want.append((ids[:max_length], [-100, *labels[1:max_length]]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            data = train.encode_causal_lm(tok, text_list, prompts, max_length=max_length, pack=True)
        except ValueError as e:  # prompts fill every example: nothing to predict
            assert all(set(labels) == {-100} for _, labels in want)
            assert "no supervised tokens" in str(e)
            return
    assert sorted(unpacked(data)) == sorted(want)
    assert data["input_ids"].shape[1] == max_length
    want_tokens = sum(sum(x != -100 for x in labels) for _, labels in want)
    assert train.supervised_tokens(data) == want_tokens


def test_without_a_prompt_a_row_starts_as_tokenizer_text_does():
    """BERT's `[CLS] text [SEP]`: the row takes the `[CLS]` before the text, not the
    `[SEP]` after it."""
    tok = word_tokenizer(BERT_WORDS, cls_sep=True)
    texts = ["a b c", "d", "e f"]
    data = train.encode_causal_lm(tok, texts, max_length=8)
    cls = BERT_WORDS.index("[CLS]")
    for n, text in enumerate(texts):
        plain = tok(text, add_special_tokens=False)["input_ids"]
        assert tok(text)["input_ids"] == [cls, *plain, BERT_WORDS.index("[SEP]")]
        row = data["input_ids"][n].tolist()
        assert row[: 1 + len(plain)] == [cls, *plain]  # no EOS: the tokenizer has none
        assert data["labels"][n].tolist()[: 1 + len(plain)] == [-100, *plain]


# -- supervised tokens ----------------------------------------------------------------------


def test_prompts_that_fill_max_length_are_an_error():
    """The repro: every response cut by max_length made a run of loss 0 and a zero lora_B."""
    tok = TOKENIZERS["llama-bos"]
    prompts = ["a b c d e f g h", "h g f e d c b a i"]
    with pytest.raises(ValueError, match="no supervised tokens") as info:
        train.encode_causal_lm(tok, ["x y", "z"], prompts, max_length=8)
    message = str(info.value)
    longest = max(len(tok(p)["input_ids"]) for p in prompts)
    assert "none of the 2 rows" in message and "max_length=8" in message
    assert f"raise max_length (now 8) above {longest}, the longest" in message
    assert "\n" not in message
    with warnings.catch_warnings():  # the advice is enough: every row keeps a label
        warnings.simplefilter("error")
        data = train.encode_causal_lm(tok, ["x y", "z"], prompts, max_length=longest + 1)
    assert train.supervised_tokens(data) >= 2


def test_rows_left_without_labels_are_warned_about_with_counts():
    tok = TOKENIZERS["gpt2"]
    prompts = ["a", "a b c d e f g h i", "b", "c d e f g h i j k"]
    texts = ["x y", "z", "w", "v"]
    with pytest.warns(UserWarning) as record:
        data = train.encode_causal_lm(tok, texts, prompts, max_length=8)
    assert len(record) == 1
    message = str(record[0].message)
    # the reference: each row of the contract, cut to the width, counted by hand
    width = data["input_ids"].shape[1]
    kept = [
        sum(label != -100 for label in _expected(tok, t, p)[1][1:width])
        for p, t in zip(prompts, texts, strict=True)
    ]
    assert kept[1] == kept[3] == 0 and kept[0] > 0 and kept[2] > 0
    assert train.supervised_tokens(data) == sum(kept)
    assert "2 of 4 rows keep no supervised tokens within max_length=8 (rows 2, 4)" in message
    assert f"the loss learns {sum(kept)} tokens from the other 2" in message


def test_no_warning_when_every_row_keeps_a_label():
    tok = TOKENIZERS["llama-bos"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = train.encode_causal_lm(tok, ["x y", "z"], ["a", "b c"], max_length=16)
    want = sum(len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in ["x y", "z"])
    assert train.supervised_tokens(data) == want


def test_packing_keeps_the_tail_that_does_not_fill_a_row():
    """Examples that fill no whole row are kept in a padded last row, without a warning."""
    tok = TOKENIZERS["gpt2"]
    texts = ["a b", "c d", "e"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = train.encode_causal_lm(tok, texts, max_length=4, pack=True)
    want = [_expected(tok, t, None)[0] for t in texts]
    assert sorted(ids for ids, _ in unpacked(data)) == sorted(want)
    assert sum(map(len, want)) % 4 and data["attention_mask"][-1, -1] == 0


def test_supervised_tokens_of_classification_counts_labelled_rows():
    tok = word_tokenizer(BERT_WORDS, cls_sep=True)
    data = train.encode_classification(tok, ["a", "b", "c"], [1, -100, 0], max_length=8)
    assert train.supervised_tokens(data) == 2


# -- vocabulary and labels ------------------------------------------------------------------


def test_ids_outside_the_models_vocabulary_are_an_error():
    tok = TOKENIZERS["llama-bos"]
    ids = tok("z y", add_special_tokens=False)["input_ids"]
    top = max(ids)
    train.encode_causal_lm(tok, ["z y"], max_length=8, vocab_size=len(tok))  # fits
    with pytest.raises(ValueError) as info:
        train.encode_causal_lm(tok, ["a", "z y"], max_length=8, vocab_size=top)
    assert str(info.value) == (
        f"token id {top} (row 2) is outside the model's vocab_size {top} (the tokenizer has "
        f"{len(tok)} tokens); use the model's own tokenizer"
    )
    with pytest.raises(ValueError, match="outside the model's vocab_size 10"):
        train.encode_causal_lm(tok, ["z y"], ["a"], max_length=8, pack=True, vocab_size=10)
    bert = word_tokenizer(BERT_WORDS, cls_sep=True)
    with pytest.raises(ValueError, match=f"token id {BERT_WORDS.index('z')} "):
        train.encode_classification(bert, ["a z"], [0], max_length=8, vocab_size=8)


def test_the_padding_id_is_checked_too():
    """Padding is fed to the model (masked), so its id needs an embedding too."""
    tok = TOKENIZERS["gpt2"]
    tok = transformers.GPT2Tokenizer(vocab=dict(tok.get_vocab()), merges=[])
    tok.add_special_tokens({"pad_token": "<pad>"})
    assert tok.pad_token_id == len(tok) - 1
    vocab = len(tok) - 1  # the model never saw the added padding token
    train.encode_causal_lm(tok, ["a b", "a b"], max_length=4, vocab_size=vocab)  # no padding
    with pytest.raises(ValueError, match=f"token id {vocab} .* vocab_size {vocab}"):
        train.encode_causal_lm(tok, ["a b", "a"], max_length=4, vocab_size=vocab)


@pytest.mark.parametrize(
    ("labels", "error", "match"),
    [
        ([0, 3], ValueError, r"label 3 \(row 2\) is outside .* be \[0, 3\) \(num_labels=3\)$"),
        ([-1, 0], ValueError, r"label -1 \(row 1\)"),
        ([0, 1.0], TypeError, r"labels: row 2 holds a float: 1.0, not an int class index"),
        ([True, 0], TypeError, r"labels: row 1 holds a bool: True"),
        ([0, float("nan")], TypeError, r"row 2 holds a float: nan"),
        ([0], ValueError, r"2 texts but 1 labels"),
    ],
)  # fmt: skip
def test_labels_outside_the_classifier_are_an_error(labels, error, match):
    tok = word_tokenizer(BERT_WORDS, cls_sep=True)
    with as_users_run(), pytest.raises(error, match=match):
        train.encode_classification(tok, ["a", "b"], labels, max_length=8, num_labels=3)


def test_labels_in_range_and_ignored_rows_pass():
    tok = word_tokenizer(BERT_WORDS, cls_sep=True)
    with as_users_run():  # a numpy int is an int class index too
        data = train.encode_classification(
            tok, ["a", "b", "c"], [np.int64(2), 0, -100], max_length=8, num_labels=3
        )
    assert data["labels"].tolist() == [2, 0, -100]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, float("nan"), "8"])
def test_sizes_must_be_positive_ints(bad):
    tok = TOKENIZERS["gpt2"]
    bert = word_tokenizer(BERT_WORDS, cls_sep=True)
    with as_users_run():
        with pytest.raises(ValueError, match=r"max_length must be an int >= 2"):
            train.encode_causal_lm(tok, ["a"], max_length=bad)
        with pytest.raises(ValueError, match=r"max_length must be an int >= 1"):
            train.encode_classification(bert, ["a"], [0], max_length=bad)
        with pytest.raises(ValueError, match=r"vocab_size must be an int >= 1"):
            train.encode_causal_lm(tok, ["a b"], max_length=8, vocab_size=bad)
        with pytest.raises(ValueError, match=r"num_labels must be an int >= 1"):
            train.encode_classification(bert, ["a"], [0], max_length=8, num_labels=bad)


def test_a_row_of_one_token_is_not_max_length():
    with pytest.raises(ValueError, match=r"max_length must be an int >= 2, got 1"):
        train.encode_causal_lm(TOKENIZERS["gpt2"], ["a"], max_length=1)


# -- text that is not text ------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize(
    ("value", "holds"),
    [
        (MESSAGES, "a list: [{'role': 'user', 'content': 'hi'}, {..."),
        (None, "null (None)"),
        (3, "an int: 3"),
        ({"text": "a"}, "a dict: {'text': 'a'}"),
        (b"a b", "a bytes: b'a b'"),
    ],
)
def test_text_that_is_not_a_str_is_refused(value, holds):
    """A `messages` column given as text_column trained on `[{'role': ...` before."""
    tok = TOKENIZERS["llama-bos"]
    bert = word_tokenizer(BERT_WORDS, cls_sep=True)
    message = f"texts: row 2 holds {holds}, not text (a str)"
    with as_users_run(), pytest.raises(TypeError) as info:
        train.encode_causal_lm(tok, ["a", value], max_length=8)
    assert str(info.value) == message
    with as_users_run(), pytest.raises(TypeError) as info:
        train.encode_classification(bert, ["a", value], [0, 1], max_length=8)
    assert str(info.value) == message
    with as_users_run(), pytest.raises(TypeError, match=r"^prompts: row 1 holds "):
        train.encode_causal_lm(tok, ["a", "b"], [value, "c"], max_length=8)


def test_texts_must_be_a_sequence_of_rows():
    tok = TOKENIZERS["gpt2"]
    with pytest.raises(
        TypeError, match=r"texts must be a sequence of str \(one per row\), got a str"
    ):
        train.encode_causal_lm(tok, "a b c", max_length=8)
    with pytest.raises(ValueError, match="2 texts but 1 prompts"):
        train.encode_causal_lm(tok, ["a", "b"], ["c"], max_length=8)
    with pytest.raises(ValueError, match="no rows to encode"):
        train.encode_causal_lm(tok, [], max_length=8)


# -- read_records ---------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_file_that_is_not_utf8_names_the_file(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    head = '{"text": "ok"}\n' if suffix == ".jsonl" else "text\nok\n"
    path.write_bytes(head.encode() + "caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError) as info:
        train.read_records(path, ["text"])
    line = 2 if suffix == ".jsonl" else 3
    assert str(info.value) == (
        f"data file {str(path)!r} is not UTF-8 text (byte 0xe9 on line {line}); save it as UTF-8"
    )


def test_a_utf8_byte_order_mark_is_read(tmp_path):
    """Spreadsheets write one; it used to hide the first column's name."""
    (tmp_path / "a.csv").write_bytes("\ufefftext,label\ncafé,1\n".encode())
    assert train.read_records(tmp_path / "a.csv", ["text"]) == [{"text": "café", "label": "1"}]
    (tmp_path / "a.jsonl").write_bytes('\ufeff{"text": "café"}\n'.encode())
    assert train.read_records(tmp_path / "a.jsonl", ["text"]) == [{"text": "café"}]


def test_csv_fields_keep_their_newlines(tmp_path):
    (tmp_path / "a.csv").write_text('text,label\n"two\nlines",1\r\nnext,0\n', newline="")
    rows = train.read_records(tmp_path / "a.csv", ["text", "label"])
    assert rows == [{"text": "two\nlines", "label": "1"}, {"text": "next", "label": "0"}]
