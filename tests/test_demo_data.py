"""Checks of the shipped demo dataset `configs/data/support_intents/` (no model involved)."""

import collections
import json
import pathlib
import re

import pytest

DATA_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs" / "data" / "support_intents"
LABELS = ("billing", "shipping", "technical", "account")
PER_LABEL = {"train": 180, "test": 40}  # as documented in the data card (README.md)


def _read(split):
    rows = []
    with open(DATA_DIR / f"{split}.jsonl", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise AssertionError(f"{split}.jsonl line {lineno} is not JSON: {e}") from e
    return rows


def _normalize(text):
    return " ".join(text.lower().split())


def _words(text):
    return frozenset(re.findall(r"[a-z0-9']+", text.lower()))


@pytest.mark.parametrize("split", sorted(PER_LABEL))
def test_rows_are_well_formed(split):
    rows = _read(split)
    assert rows, f"{split}.jsonl is empty"
    for i, row in enumerate(rows):
        assert isinstance(row, dict), (split, i, row)
        assert set(row) == {"text", "label"}, (split, i, row)
        assert row["label"] in LABELS, (split, i, row)
        assert isinstance(row["text"], str) and row["text"].strip(), (split, i, row)
        assert row["text"] == row["text"].strip(), (split, i, row)


@pytest.mark.parametrize("split", sorted(PER_LABEL))
def test_counts_are_balanced_and_as_documented(split):
    counts = collections.Counter(row["label"] for row in _read(split))
    assert counts == {label: PER_LABEL[split] for label in LABELS}
    assert sum(counts.values()) == PER_LABEL[split] * len(LABELS)


def test_data_card_states_the_counts():
    card = (DATA_DIR / "README.md").read_text(encoding="utf-8")
    for label in LABELS:
        assert f"`{label}`" in card
    for split, n in PER_LABEL.items():
        assert re.search(rf"\|\s*{split}\s*\|\s*{n}\s*\|\s*{n * len(LABELS)}\s*\|", card), split


@pytest.mark.parametrize("split", sorted(PER_LABEL))
def test_no_duplicates_within_split(split):
    texts = collections.Counter(_normalize(row["text"]) for row in _read(split))
    duplicated = [t for t, n in texts.items() if n > 1]
    assert not duplicated


def test_no_text_in_both_splits():
    train = {_normalize(row["text"]) for row in _read("train")}
    test = {_normalize(row["text"]) for row in _read("test")}
    assert not train & test


def test_no_test_message_is_a_near_duplicate_of_a_train_message():
    train = [(_words(row["text"]), row["text"]) for row in _read("train")]
    near = []
    for row in _read("test"):
        a = _words(row["text"])
        for b, text in train:
            if len(a & b) / len(a | b) >= 0.8:
                near.append((row["text"], text))
    assert not near
