"""Data for fine-tuning: records from JSONL or CSV, tokenized to fixed shapes, packed
for causal LM, and batched in an order a run can resume from."""

import csv
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

IGNORE = -100  # transformers' label for tokens and rows the loss leaves out


def read_records(path: str | Path, columns: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of a `.jsonl` (one JSON object per line) or `.csv` (with a header) file,
    each checked to have `columns`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(rows[-1], dict):
                raise ValueError(f"{path}:{n}: expected a JSON object, got {line[:40]!r}")
    elif path.suffix == ".csv":
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        raise ValueError(f"data file {str(path)!r}: expected a .jsonl or .csv file")
    if not rows:
        raise ValueError(f"data file {str(path)!r} has no rows")
    for n, row in enumerate(rows, 1):
        missing = [c for c in columns if c not in row]
        if missing:
            raise ValueError(
                f"{path}: row {n} has no column {missing[0]!r}; its columns are {sorted(row)}"
            )
    return rows


def _padded_length(lengths: Sequence[int], max_length: int) -> int:
    # the longest row rounded up to a multiple of 8, so fewer padded tokens cost compute
    return min(max_length, -(-max(lengths) // 8) * 8)


def encode_classification(
    tokenizer: Any, texts: Sequence[str], labels: Sequence[int], *, max_length: int
) -> dict[str, np.ndarray]:
    """`input_ids`, `attention_mask` (right-padded to one length, at most `max_length`)
    and `labels` for sentence classification."""
    ids = [tokenizer(t, truncation=True, max_length=max_length)["input_ids"] for t in texts]
    length = _padded_length([len(i) for i in ids], max_length)
    pad = tokenizer.pad_token_id or 0
    input_ids = np.full((len(ids), length), pad, np.int32)
    mask = np.zeros((len(ids), length), np.int32)
    for n, row in enumerate(ids):
        input_ids[n, : len(row)] = row
        mask[n, : len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": np.asarray(labels, np.int32)}


def encode_causal_lm(
    tokenizer: Any,
    texts: Sequence[str],
    prompts: Sequence[str] | None = None,
    *,
    max_length: int,
    pack: bool = False,
) -> dict[str, np.ndarray]:
    """`input_ids`, `attention_mask` and `labels` for causal LM: each example is its
    prompt (labels -100: the loss leaves it out) then its text and the EOS token.

    With `pack`, examples are concatenated and cut into rows of exactly `max_length`
    tokens (the last partial row is dropped), so no compute goes to padding; else each
    example is one right-padded row, truncated to `max_length`.
    """
    eos = tokenizer.eos_token_id
    rows_ids, rows_labels = [], []
    for n, text in enumerate(texts):
        prompt = tokenizer(prompts[n], add_special_tokens=False)["input_ids"] if prompts else []
        body = tokenizer(text, add_special_tokens=False)["input_ids"]
        body = body + ([eos] if eos is not None else [])
        rows_ids.append(prompt + body)
        rows_labels.append([IGNORE] * len(prompt) + body)
    if pack:
        flat_ids = np.concatenate([np.asarray(r, np.int32) for r in rows_ids])
        flat_labels = np.concatenate([np.asarray(r, np.int32) for r in rows_labels])
        rows = len(flat_ids) // max_length
        if rows == 0:
            raise ValueError(
                f"the data has {len(flat_ids)} tokens, fewer than one packed row of "
                f"max_length={max_length}"
            )
        shape = (rows, max_length)
        return {
            "input_ids": flat_ids[: rows * max_length].reshape(shape),
            "attention_mask": np.ones(shape, np.int32),
            "labels": flat_labels[: rows * max_length].reshape(shape),
        }
    length = _padded_length([len(r) for r in rows_ids], max_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    input_ids = np.full((len(rows_ids), length), pad, np.int32)
    mask = np.zeros((len(rows_ids), length), np.int32)
    labels = np.full((len(rows_ids), length), IGNORE, np.int32)
    for n, (row, lab) in enumerate(zip(rows_ids, rows_labels, strict=True)):
        row, lab = row[:length], lab[:length]
        input_ids[n, : len(row)], mask[n, : len(row)], labels[n, : len(lab)] = row, 1, lab
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def batches_per_epoch(data: dict[str, np.ndarray], batch_size: int) -> int:
    rows = len(next(iter(data.values())))
    if rows < batch_size:
        raise ValueError(f"the data has {rows} rows, fewer than one batch of {batch_size}")
    return rows // batch_size


def train_batches(
    data: dict[str, np.ndarray], batch_size: int, *, seed: int, start: int = 0
) -> Iterator[dict[str, np.ndarray]]:
    """Batches number `start`, `start + 1`, ... without end: each epoch is a fresh
    permutation drawn from `(seed, epoch)`, and its last partial batch is dropped, so
    batch `n` is the same whether a run starts at 0 or resumes at `n`."""
    per_epoch = batches_per_epoch(data, batch_size)
    rows = len(next(iter(data.values())))
    n = start
    while True:
        epoch, index = divmod(n, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(rows)
        take = order[index * batch_size : (index + 1) * batch_size]
        yield {k: v[take] for k, v in data.items()}
        n += 1


def mixed_batches(
    datasets: Sequence[dict[str, np.ndarray]],
    batch_size: int,
    *,
    seed: int,
    start: int = 0,
    micro_batches: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
    """`train_batches` of several datasets (rows of one length: see `pad_to`) at once:
    each batch holds `batch_size / len(datasets)` rows of each, drawn in each dataset's
    own resumable order, and `source`, each row's dataset index. With `micro_batches`
    (gradient accumulation), each of that many equal parts of the batch mixes them
    equally too."""
    k = len(datasets)
    if batch_size % (k * micro_batches):
        raise ValueError(
            f"a batch of {batch_size} rows does not split into {micro_batches} micro-batches "
            f"with equal rows of {k} datasets"
        )
    share = batch_size // k
    streams = [train_batches(d, share, seed=seed, start=start) for d in datasets]
    source = np.tile(np.repeat(np.arange(k, dtype=np.int32), share // micro_batches), micro_batches)

    def interleave(parts: list[np.ndarray]) -> np.ndarray:
        split = [p.reshape(micro_batches, share // micro_batches, *p.shape[1:]) for p in parts]
        return np.stack(split, axis=1).reshape(batch_size, *parts[0].shape[1:])

    while True:
        parts = [next(s) for s in streams]
        yield {key: interleave([p[key] for p in parts]) for key in parts[0]} | {"source": source}


def pad_to(data: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
    """`data` (from `encode_causal_lm` or `encode_classification`) with its rows
    right-padded to `length` tokens, the padding masked and labelled -100 (left out of
    the loss)."""
    short = length - data["input_ids"].shape[1]
    if short < 0:
        raise ValueError(f"rows of {data['input_ids'].shape[1]} tokens exceed length {length}")
    fill = {"input_ids": 0, "attention_mask": 0, "labels": IGNORE}
    return {
        k: np.pad(v, ((0, 0), (0, short)), constant_values=fill[k]) if v.ndim == 2 else v
        for k, v in data.items()
    }


def eval_batches(data: dict[str, np.ndarray], batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    """Every row once, in order; the last batch is padded to `batch_size` with rows
    whose labels are -100, so the loss and accuracy leave them out."""
    rows = len(next(iter(data.values())))
    for start in range(0, rows, batch_size):
        batch = {k: v[start : start + batch_size] for k, v in data.items()}
        short = batch_size - len(batch["labels"])
        if short:
            batch = {
                k: np.concatenate([v, np.repeat(v[-1:], short, axis=0)]) for k, v in batch.items()
            }
            batch["labels"][-short:] = IGNORE
        yield batch
