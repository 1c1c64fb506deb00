"""Data for fine-tuning: rows (see `_records.py`) tokenized to fixed shapes, packed for
causal LM, and batched in an order a run can resume from."""

import bisect
import re
import warnings
from collections.abc import Iterator, Sequence
from numbers import Integral
from typing import Any, Literal

import numpy as np

IGNORE = -100  # transformers' label for tokens and rows the loss leaves out


def supervised_tokens(data: dict[str, np.ndarray]) -> int:
    """How many labels the loss learns from: the tokens `causal_lm_loss` predicts (labels
    other than -100 after each row's first position), or the labelled rows of
    classification data."""
    labels = data["labels"]
    return int(np.sum((labels[:, 1:] if labels.ndim == 2 else labels) != IGNORE))


def _padded_length(lengths: Sequence[int], max_length: int) -> int:
    # the longest row rounded up to a multiple of 8, so fewer padded tokens cost compute
    return min(max_length, -(-max(lengths) // 8) * 8)


def _describe(value: Any) -> str:
    if value is None:
        return "null (None)"
    kind = type(value).__name__
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}: {shown}"


def _checked_texts(values: Any, what: str) -> list[str]:
    """`values` as a list of str; a row holding anything else (a chat's list of messages,
    a number, null) is a `TypeError` naming the row (counted from 1) and what it holds."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise TypeError(f"{what} must be a sequence of str (one per row), got {_describe(values)}")
    for n, value in enumerate(values, 1):
        if not isinstance(value, str):
            raise TypeError(f"{what}: row {n} holds {_describe(value)}, not text (a str)")
    return list(values)


def _positive_int(value: Any, name: str, *, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def check_vocab(tokenizer: Any, ids: np.ndarray, vocab_size: int | None) -> None:
    """Every id (padding included) must index the model's embedding table."""
    if vocab_size is None or ids.size == 0:
        return
    top = int(ids.max())
    if top >= vocab_size:
        row = int(np.argwhere(ids == top)[0][0]) + 1
        raise ValueError(
            f"token id {top} (row {row}) is outside the model's vocab_size {vocab_size} (the "
            f"tokenizer has {len(tokenizer)} tokens); use the model's own tokenizer"
        )


def encode_classification(
    tokenizer: Any,
    texts: Sequence[str],
    labels: Sequence[int],
    *,
    max_length: int,
    vocab_size: int | None = None,
    num_labels: int | None = None,
) -> dict[str, np.ndarray]:
    """`input_ids`, `attention_mask` (right-padded to one length, at most `max_length`)
    and `labels` for sentence classification.

    **Arguments:**

    - `tokenizer`: a transformers tokenizer; each text is `tokenizer(text)`, truncated.
    - `texts`: one str per row; anything else (a list, a number, `None`) is a
      `TypeError` naming the row (counted from 1).
    - `labels`: one int class index per row (-100: left out of the loss).
    - `vocab_size`, `num_labels`: the model's sizes; an id `>= vocab_size` or a label
      outside `[0, num_labels)` is a `ValueError` (it would make the loss NaN).
    """
    _positive_int(max_length, "max_length")
    if vocab_size is not None:
        _positive_int(vocab_size, "vocab_size")
    texts = _checked_texts(texts, "texts")
    if isinstance(labels, str | bytes) or not isinstance(labels, Sequence | np.ndarray):
        raise TypeError(f"labels must be a sequence of int (one per row), got {_describe(labels)}")
    if len(labels) != len(texts):
        raise ValueError(f"{len(texts)} texts but {len(labels)} labels; give one label per text")
    if not texts:
        raise ValueError("no rows to encode")
    if num_labels is not None:
        _positive_int(num_labels, "num_labels")
    for n, label in enumerate(labels, 1):
        if isinstance(label, bool | np.bool_) or not isinstance(label, Integral):
            raise TypeError(f"labels: row {n} holds {_describe(label)}, not an int class index")
        if label != IGNORE and (label < 0 or (num_labels is not None and label >= num_labels)):
            valid = f"[0, {num_labels})" if num_labels is not None else "ints >= 0"
            raise ValueError(
                f"label {int(label)} (row {n}) is outside the classifier's labels: they must "
                f"be {valid}" + (f" (num_labels={num_labels})" if num_labels is not None else "")
            )
    ids = [tokenizer(t, truncation=True, max_length=max_length)["input_ids"] for t in texts]
    length = _padded_length([len(i) for i in ids], max_length)
    pad = tokenizer.pad_token_id or 0
    input_ids = np.full((len(ids), length), pad, np.int32)
    mask = np.zeros((len(ids), length), np.int32)
    for n, row in enumerate(ids):
        input_ids[n, : len(row)] = row
        mask[n, : len(row)] = 1
    check_vocab(tokenizer, input_ids, vocab_size)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": np.asarray(labels, np.int32)}


def _prefix(full: list[int], plain: list[int], row: int) -> list[int]:
    """The ids `tokenizer(text)` (`full`) puts in front of the text's own ids (`plain`)."""
    for k in range(len(full) - len(plain), -1, -1):
        if full[k : k + len(plain)] == plain:
            return full[:k]
    raise ValueError(
        f"texts: row {row}: tokenizer(text) does not contain the text's own tokens "
        "(tokenizer(text, add_special_tokens=False)), so its special-token prefix is unknown"
    )


def _starts(
    tokenizer: Any, texts: list[str], bodies: list[list[int]], prompts: list[str] | None
) -> list[list[int]]:
    """Each row's start: `tokenizer(prompt)` with its special tokens, or without a prompt,
    the special tokens `tokenizer(text)` puts in front of the text's own ids (`bodies`)."""
    if prompts is not None:
        return [list(i) for i in tokenizer(prompts)["input_ids"]]
    full = tokenizer(texts)["input_ids"]
    return [_prefix(list(f), b, n) for n, (f, b) in enumerate(zip(full, bodies), 1)]


def encode_causal_lm(
    tokenizer: Any,
    texts: Sequence[str],
    prompts: Sequence[str] | None = None,
    *,
    max_length: int,
    pack: bool = False,
    vocab_size: int | None = None,
) -> dict[str, np.ndarray]:
    """`input_ids`, `attention_mask` and `labels` for causal LM.

    Each example starts as generation will see it: exactly `tokenizer(prompt)["input_ids"]`,
    with the special tokens the tokenizer adds (Llama's BOS; none for GPT-2), labelled
    -100 (the loss leaves it out); then the text's tokens (no special tokens) and the EOS
    token. Without `prompts`, an example starts with the special tokens `tokenizer(text)`
    puts in front of the text.

    Each example is truncated to `max_length`. Without `pack` it is one right-padded
    row. With `pack`, several examples share a row of `max_length` tokens, each whole
    (none is dropped or split across rows; rows are filled best-fit decreasing, TRL's
    `bfd`, and right-padded), and a truncated one is warned about. The data gets
    `position_ids` that restart at 0 at each example (the padding is at 0, masked and
    labelled -100): passed to the model without an attention mask (as
    `peftx.train.logits` does), they keep each example from seeing the others, as
    transformers' packed rows (TRL's `padding_free`) do; and each example's first token
    is labelled -100, since nothing before it is seen to predict it.

    **Arguments:**

    - `texts`, `prompts`: one str per row; anything else (a chat's list of messages, a
      number, `None`) is a `TypeError` naming the row (counted from 1).
    - `vocab_size`: the model's; an id `>= vocab_size` (a tokenizer larger than the
      model) is a `ValueError`.

    **Raises** `ValueError` when no label is left for the loss (prompts that fill
    `max_length`), and warns with the counts when some rows lose all of theirs (see
    `supervised_tokens` for the count of a split).
    """
    _positive_int(max_length, "max_length", least=2)
    if vocab_size is not None:
        _positive_int(vocab_size, "vocab_size")
    texts = _checked_texts(texts, "texts")
    if prompts is not None:
        prompts = _checked_texts(prompts, "prompts")
        if len(prompts) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(prompts)} prompts; give one per text")
    if not texts:
        raise ValueError("no rows to encode")
    eos = tokenizer.eos_token_id
    bodies = [list(b) for b in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    starts = _starts(tokenizer, texts, bodies, prompts)
    rows_ids, rows_labels = [], []
    for start, body in zip(starts, bodies, strict=True):
        body = body + ([eos] if eos is not None else [])
        rows_ids.append(start + body)
        rows_labels.append([IGNORE] * len(start) + body)
    pack_or_pad = _pack if pack else _pad
    data, lost = pack_or_pad(rows_ids, rows_labels, max_length, _pad_id(tokenizer))
    check_vocab(tokenizer, data["input_ids"], vocab_size)
    _check_supervised(data, lost, [len(s) for s in starts], max_length)
    return data


def encode_chat(
    tokenizer: Any,
    conversations: Sequence[Any],
    *,
    max_length: int,
    pack: bool = False,
    vocab_size: int | None = None,
) -> dict[str, np.ndarray]:
    """`input_ids`, `attention_mask` and `labels` for chat data, the loss on the
    assistant's tokens only (TRL's `assistant_only_loss`).

    Each row is a list of messages, `{"role": ..., "content": str}` (OpenAI's and TRL's
    format), rendered with the tokenizer's own chat template (`apply_chat_template`, its
    special tokens included). The assistant's tokens, its end-of-turn tokens and what
    closes its turn included (ChatML's `<|im_end|>` and newline, as TRL's training
    templates mark them; not the role header before), are found from the template's
    `{% generation %}` markers where it has them, else by
    rendering each conversation up to every assistant turn (with the generation prompt)
    and through it: the text between is the turn. `pack` and `vocab_size` are as
    `encode_causal_lm`'s.

    **Raises** `TypeError` for a row that is not a list of such messages, and
    `ValueError` for a tokenizer without a chat template, or a template whose renderings
    of a conversation's beginnings are not beginnings of the whole (the assistant's turns
    cannot be found: set a training template with generation markers, or give
    prompt/completion columns instead).
    """
    _positive_int(max_length, "max_length", least=2)
    if vocab_size is not None:
        _positive_int(vocab_size, "vocab_size")
    if isinstance(conversations, str | bytes) or not isinstance(conversations, Sequence):
        raise TypeError(
            "conversations must be a sequence of chats (lists of messages), got "
            f"{_describe(conversations)}"
        )
    if not conversations:
        raise ValueError("no rows to encode")
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            "the tokenizer has no chat template to render messages with; set one "
            "(tokenizer.chat_template), or give the data as text (text_column, prompt_column)"
        )
    marked = _GENERATION.search(template if isinstance(template, str) else str(template))
    rows_ids, rows_labels = [], []
    for n, messages in enumerate(conversations, 1):
        _check_messages(messages, n)
        if marked:
            out = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids, learned = list(out["input_ids"]), list(out["assistant_masks"])
        else:
            ids, learned = _turns_by_prefixes(tokenizer, messages, n)
        rows_ids.append(ids)
        rows_labels.append([i if m else IGNORE for i, m in zip(ids, learned, strict=True)])
    pack_or_pad = _pack if pack else _pad
    data, lost = pack_or_pad(rows_ids, rows_labels, max_length, _pad_id(tokenizer))
    check_vocab(tokenizer, data["input_ids"], vocab_size)
    starts = [next((k for k, x in enumerate(r) if x != IGNORE), len(r)) for r in rows_labels]
    _check_supervised(data, lost, starts, max_length)
    return data


_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")
_MESSAGE = ("role", "content")


def _check_messages(messages: Any, row: int) -> None:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise TypeError(
            f"conversations: row {row} holds {_describe(messages)}, not a list of messages "
            '({"role": ..., "content": ...})'
        )
    for k, m in enumerate(messages, 1):
        if not (isinstance(m, dict) and all(isinstance(m.get(f), str) for f in _MESSAGE)):
            raise TypeError(
                f"conversations: row {row}, message {k} is {_describe(m)}; a message is "
                '{"role": str, "content": str}'
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"conversations: row {row} has no assistant message to learn from")


def _turns_by_prefixes(tokenizer: Any, messages: list[dict], row: int) -> tuple[list, list]:
    """A conversation's ids, and which are the assistant's: each turn is the text between
    the rendering up to it (with the generation prompt) and the rendering through it."""

    def render(upto: list[dict], prompt: bool) -> str:
        return tokenizer.apply_chat_template(upto, tokenize=False, add_generation_prompt=prompt)

    text = render(messages, False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:k], True), render(messages[: k + 1], False)
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError(
                f"conversations: row {row}: the chat template renders the conversation up to "
                f"message {k + 1} as something other than a beginning of the whole, and has "
                "no {% generation %} markers, so the assistant's tokens cannot be told apart; "
                "set a training chat template that has them around each assistant turn (TRL "
                "ships one for Qwen3: trl/chat_templates/qwen3_training.jinja, saved as the "
                "model directory's chat_template.jinja or set as tokenizer.chat_template), or "
                "give the data as prompt/completion columns (prompt_column) instead"
            )
        spans.append((len(before), len(through)))
    out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    learned = [
        any(start < end_span and end > start_span for start_span, end_span in spans)
        for start, end in out["offset_mapping"]
    ]
    return list(out["input_ids"]), learned


def _pack(
    rows_ids: list[list[int]], rows_labels: list[list[int]], max_length: int, pad: int
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Every example, truncated to `max_length` as an unpacked row is, whole in one row:
    best-fit decreasing (TRL's `bfd` packing), each row right-padded. `position_ids`
    restart at 0 at each example; the padding is at position 0, masked, labelled -100.
    Also, which examples give the loss no label; warns naming those truncated."""
    lengths = [min(len(r), max_length) for r in rows_ids]
    cut = [n for n, r in enumerate(rows_ids) if len(r) > max_length]
    if cut:
        listed = ", ".join(str(n + 1) for n in cut[:10]) + (", ..." if len(cut) > 10 else "")
        warnings.warn(
            f"{len(cut)} of {len(rows_ids)} examples are longer than max_length={max_length} "
            f"and are truncated to it (rows {listed}); packing never splits an example, so "
            "raise max_length to keep them whole",
            stacklevel=3,
        )
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted: the best fit is a bisect
    for n in sorted(range(len(rows_ids)), key=lambda n: -lengths[n]):
        if not lengths[n]:  # no token to place (and no label: warned about below)
            continue
        at = bisect.bisect_left(free, (lengths[n], -1))
        if at == len(free):
            rows.append([n])
            bisect.insort(free, (max_length - lengths[n], len(rows) - 1))
        else:
            room, row = free.pop(at)
            rows[row].append(n)
            bisect.insort(free, (room - lengths[n], row))
    shape = (len(rows), max_length)
    data = {
        "input_ids": np.full(shape, pad, np.int32),
        "attention_mask": np.zeros(shape, np.int32),
        "labels": np.full(shape, IGNORE, np.int32),
        "position_ids": np.zeros(shape, np.int32),
    }
    kept = np.zeros(len(rows_ids), np.int64)
    for r, examples in enumerate(rows):
        at = 0
        for n in sorted(examples):
            k = lengths[n]
            labels = [IGNORE, *rows_labels[n][1:k]]  # nothing seen before predicts the first
            data["input_ids"][r, at : at + k] = rows_ids[n][:k]
            data["attention_mask"][r, at : at + k] = 1
            data["labels"][r, at : at + k] = labels
            data["position_ids"][r, at : at + k] = np.arange(k)
            kept[n] = sum(x != IGNORE for x in labels)
            at += k
    return data, kept == 0


def _pad_id(tokenizer: Any) -> int:
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id or 0


def _pad(
    rows_ids: list[list[int]], rows_labels: list[list[int]], max_length: int, pad: int
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One right-padded row per example, and which rows give the loss no label."""
    length = _padded_length([len(r) for r in rows_ids], max_length)
    input_ids = np.full((len(rows_ids), length), pad, np.int32)
    mask = np.zeros((len(rows_ids), length), np.int32)
    labels = np.full((len(rows_ids), length), IGNORE, np.int32)
    for n, (row, lab) in enumerate(zip(rows_ids, rows_labels, strict=True)):
        row, lab = row[:length], lab[:length]
        input_ids[n, : len(row)], mask[n, : len(row)], labels[n, : len(lab)] = row, 1, lab
    data = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    return data, ~np.any(labels[:, 1:] != IGNORE, axis=1)


def _check_supervised(
    data: dict[str, np.ndarray], lost: np.ndarray, starts: list[int], max_length: int
) -> None:
    """Fail when the loss would see no label; warn, with counts, when some rows see none."""
    total = supervised_tokens(data)
    rows = len(lost)
    if total and not lost.any():
        return
    culprits = np.flatnonzero(lost) if lost.any() else np.arange(rows)
    longest = max(starts[n] for n in culprits)
    if longest >= max_length:  # the prompt fills the row: no label of the text is left
        fix = (
            f"raise max_length (now {max_length}) above {longest}, the longest of these "
            "prompts in tokens (special tokens included), or shorten the prompts"
        )
    else:
        fix = "these rows have no token the loss can predict: their text is empty or too short"
    if not total:
        raise ValueError(
            f"no supervised tokens: none of the {rows} rows keeps a label for the loss "
            f"(a label other than -100) within max_length={max_length}; {fix}"
        )
    listed = ", ".join(str(n + 1) for n in culprits[:10]) + (", ..." if culprits.size > 10 else "")
    warnings.warn(
        f"{culprits.size} of {rows} rows keep no supervised tokens within "
        f"max_length={max_length} (rows {listed}); the loss learns {total} tokens from the "
        f"other {rows - culprits.size}; {fix}",
        stacklevel=3,
    )


def batches_per_epoch(data: dict[str, np.ndarray], batch_size: int) -> int:
    rows = len(next(iter(data.values())))
    if rows < batch_size:
        raise ValueError(f"the data has {rows} rows, fewer than one batch of {batch_size}")
    return rows // batch_size


def train_batches(
    data: dict[str, np.ndarray],
    batch_size: int,
    *,
    seed: int,
    start: int = 0,
    grad_accumulation: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
    """Batches number `start`, `start + 1`, ... without end, each the rows of one step:
    `batch_size` rows per micro-batch, `grad_accumulation` micro-batches (the effective
    batch, `batch_size * grad_accumulation` rows, as TRL's `per_device_train_batch_size`
    and `gradient_accumulation_steps`; pass the same `grad_accumulation` to
    `make_train_step`). Each epoch is a fresh permutation drawn from `(seed, epoch)`,
    and its last partial batch is dropped, so batch `n` is the same whether a run starts
    at 0 or resumes at `n`."""
    _positive_int(grad_accumulation, "grad_accumulation")
    rows_per_step = batch_size * grad_accumulation
    per_epoch = batches_per_epoch(data, rows_per_step)
    rows = len(next(iter(data.values())))
    n = start
    while True:
        epoch, index = divmod(n, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(rows)
        take = order[index * rows_per_step : (index + 1) * rows_per_step]
        yield {k: v[take] for k, v in data.items()}
        n += 1


def mixed_batches(
    datasets: Sequence[dict[str, np.ndarray]],
    batch_size: int,
    *,
    seed: int,
    start: int = 0,
    grad_accumulation: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
    """`train_batches` of several datasets (rows of one length: see `pad_to`) at once,
    `batch_size` and `grad_accumulation` as there: each micro-batch holds
    `batch_size / len(datasets)` rows of each, drawn in each dataset's own resumable
    order, and `source`, each row's dataset index."""
    k = len(datasets)
    _positive_int(grad_accumulation, "grad_accumulation")
    if batch_size % k:
        raise ValueError(
            f"a micro-batch of {batch_size} rows (batch_size) does not split into equal rows "
            f"of {k} datasets"
        )
    share = batch_size // k * grad_accumulation  # each dataset's rows of a step
    streams = [train_batches(d, share, seed=seed, start=start) for d in datasets]
    micro = np.repeat(np.arange(k, dtype=np.int32), batch_size // k)
    source = np.tile(micro, grad_accumulation)

    def interleave(parts: list[np.ndarray]) -> np.ndarray:
        split = [p.reshape(grad_accumulation, batch_size // k, *p.shape[1:]) for p in parts]
        return np.stack(split, axis=1).reshape(batch_size * grad_accumulation, *parts[0].shape[1:])

    while True:
        parts = [next(s) for s in streams]
        yield {key: interleave([p[key] for p in parts]) for key in parts[0]} | {"source": source}


def pad_to(data: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
    """`data` (from `encode_causal_lm`, `encode_chat`, `encode_preference` or
    `encode_classification`) with its sequences right-padded to `length` tokens, the
    padding masked and labelled -100 (left out of the loss); in packed rows each padding
    token is at position 0, an example of its own."""
    short = length - data["input_ids"].shape[-1]
    if short < 0:
        raise ValueError(f"rows of {data['input_ids'].shape[-1]} tokens exceed length {length}")
    fill = {"input_ids": 0, "attention_mask": 0, "labels": IGNORE, "position_ids": 0}

    def padded(k: str, v: np.ndarray) -> np.ndarray:
        if k not in fill or v.ndim < 2:  # classification labels, reference log-probs
            return v
        return np.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, short)], constant_values=fill[k])

    return {k: padded(k, v) for k, v in data.items()}


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


# -- preference pairs (TRL's DPOTrainer format) -----------------------------------------
FIELDS = ("prompt", "chosen", "rejected")
TRUNCATION_MODES = ("keep_start", "keep_end")


def _check_field(row: dict, n: int, field: str, chat: bool) -> Any:
    if field not in row:
        raise ValueError(f"rows: row {n} has no {field!r}; a preference row has {list(FIELDS)}")
    value = row[field]
    if not chat:
        if not isinstance(value, str):
            raise TypeError(
                f"rows: row {n}, {field!r} holds {_describe(value)}; with a text prompt it "
                "must be text (a str)"
            )
        return value
    ok = (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    )
    if not ok:
        raise TypeError(
            f"rows: row {n}, {field!r} holds {_describe(value)}; with a chat prompt it must "
            'be a list of messages {"role": str, "content": str}'
        )
    return value


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _pair_ids(tokenizer: Any, row: dict, n: int) -> tuple[list[int], list[int], int]:
    """prompt+chosen and prompt+rejected ids, and where the completions start: where the
    prompt's own ids and each whole's diverge (TRL's rule)."""
    chat = isinstance(row.get("prompt"), list)
    prompt, chosen, rejected = (_check_field(row, n, f, chat) for f in FIELDS)
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "rows hold chats, and the tokenizer has no chat template to render them "
                "with; set one (tokenizer.chat_template)"
            )

        def ids(messages: list, generation_prompt: bool = False) -> list[int]:
            out = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt
            )
            return list(out["input_ids"])

        prompt_ids = ids(prompt, True)
        with_chosen, with_rejected = ids(prompt + chosen), ids(prompt + rejected)
    else:
        eos = tokenizer.eos_token or ""
        chosen, rejected = (t if t.endswith(eos) else t + eos for t in (chosen, rejected))
        prompt_ids = list(tokenizer(prompt)["input_ids"])
        with_chosen = list(tokenizer(prompt + chosen)["input_ids"])
        with_rejected = list(tokenizer(prompt + rejected)["input_ids"])
    start = min(_common_prefix(prompt_ids, with_chosen), _common_prefix(prompt_ids, with_rejected))
    return with_chosen, with_rejected, start


def encode_preference(
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    *,
    max_length: int,
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start",
    vocab_size: int | None = None,
) -> dict[str, np.ndarray]:
    """Preference pairs for `dpo_loss` and `orpo_loss`, as TRL's `DPOTrainer` tokenizes
    them: `input_ids`, `attention_mask` and `labels`, each of shape `(rows, 2, length)`,
    prompt+chosen at `[:, 0]` and prompt+rejected at `[:, 1]`, right-padded to one length
    (at most `max_length`); the labels are the completion's tokens, the prompt's and the
    padding's -100.

    Each row is TRL's preference format, `{"prompt", "chosen", "rejected"}`:

    - as text: each completion gets the tokenizer's EOS text unless it ends with it, and
      `tokenizer(prompt + completion)` (its special tokens included) is the sequence;
    - as chats (lists of `{"role", "content"}` messages): the prompt rendered with the
      tokenizer's chat template and its generation prompt, each sequence the whole
      conversation `prompt + completion` rendered.

    The completion starts where the prompt's own ids and the sequence's diverge (both
    sequences: the earlier). Each sequence is then cut to `max_length` tokens, keeping its
    start (`truncation_mode="keep_start"`, TRL's default) or its end (`"keep_end"`); with
    `keep_start`, a row whose prompt alone fills `max_length` is dropped, with a warning
    naming it, as TRL drops it.

    **Raises** `ValueError` or `TypeError` naming the row (counted from 1) and the field
    for a missing field or one of the wrong kind, and `ValueError` when no row is left.
    """
    _positive_int(max_length, "max_length", least=2)
    if vocab_size is not None:
        _positive_int(vocab_size, "vocab_size")
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(
            f"truncation_mode {truncation_mode!r}: choose one of {', '.join(TRUNCATION_MODES)}"
        )
    if isinstance(rows, str | bytes | dict) or not isinstance(rows, Sequence):
        raise TypeError(f"rows must be a sequence of preference rows, got {_describe(rows)}")
    if not rows:
        raise ValueError("no rows to encode")
    keep = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
    pairs, dropped = [], []
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise TypeError(f"rows: row {n} holds {_describe(row)}, not a preference row (a dict)")
        with_chosen, with_rejected, start = _pair_ids(tokenizer, row, n)
        if truncation_mode == "keep_start" and start >= max_length:
            dropped.append(n)
            continue
        pair = []
        for ids in (with_chosen, with_rejected):
            labels = [IGNORE] * start + ids[start:]
            pair.append((ids[keep], labels[keep]))
        pairs.append(pair)
    if dropped:
        listed = ", ".join(map(str, dropped[:10])) + (", ..." if len(dropped) > 10 else "")
        message = (
            f"{len(dropped)} of {len(rows)} preference rows have prompts that fill "
            f"max_length={max_length} and are dropped (rows {listed}); raise max_length or "
            'use truncation_mode="keep_end"'
        )
        if not pairs:
            raise ValueError(f"no rows to train on: {message}")
        warnings.warn(message, stacklevel=2)
    length = _padded_length([len(ids) for pair in pairs for ids, _ in pair], max_length)
    shape = (len(pairs), 2, length)
    data = {
        "input_ids": np.full(shape, _pad_id(tokenizer), np.int32),
        "attention_mask": np.zeros(shape, np.int32),
        "labels": np.full(shape, IGNORE, np.int32),
    }
    for r, pair in enumerate(pairs):
        for side, (ids, labels) in enumerate(pair):
            data["input_ids"][r, side, : len(ids)] = ids
            data["attention_mask"][r, side, : len(ids)] = 1
            data["labels"][r, side, : len(labels)] = labels
    check_vocab(tokenizer, data["input_ids"], vocab_size)
    return data


# the keys of pairs whose prompt is held once (`share_prompts`), left-padded
PROMPT_KEYS = ("prompt_input_ids", "prompt_attention_mask")


def share_prompts(
    data: dict[str, np.ndarray],
    *,
    prompt_length: int | None = None,
    completion_length: int | None = None,
) -> dict[str, np.ndarray]:
    """Preference pairs (`encode_preference`) with each pair's prompt held once, so that
    `dpo_loss`, `orpo_loss` and `precompute_ref_log_probs` run it once for both
    completions (its keys and values cached) instead of twice: a step runs
    `rows × (prompt + 2 × completion)` tokens instead of `2 × rows × (prompt +
    completion)`. The log-probabilities are those of the pairs as given.

    The shared part of a pair is the longest start its two sequences have in common,
    unlabelled (the prompt, unless truncation cut the two differently). It goes to
    `prompt_input_ids` and `prompt_attention_mask` `(rows, prompt_length)`, left-padded;
    the rest of each sequence stays in `input_ids`, `attention_mask` and `labels` `(rows,
    2, completion_length)`, right-padded, its first token predicted from the prompt's
    last. The lengths default to the longest of `data` (pass larger ones to give several
    datasets one shape). Other keys (`ref_chosen_logps`, ...) pass unchanged.
    """
    missing = [k for k in ("input_ids", "attention_mask", "labels") if k not in data]
    shapes = {k: np.shape(data[k]) for k in ("input_ids", "attention_mask", "labels") if k in data}
    if missing or len(set(shapes.values())) != 1 or len(shapes["input_ids"]) != 3:
        raise ValueError(
            "share_prompts takes preference pairs from encode_preference: input_ids, "
            "attention_mask and labels of one shape (rows, 2, length); got "
            + (f"no {', '.join(missing)}" if missing else f"shapes {shapes}")
        )
    if any(k in data for k in PROMPT_KEYS):
        raise ValueError("these pairs share their prompts already")
    ids, mask, labels = (np.asarray(data[k]) for k in ("input_ids", "attention_mask", "labels"))
    if ids.shape[1] != 2:
        raise ValueError(f"pairs have 2 sequences each (chosen, rejected), got {ids.shape[1]}")
    real = mask > 0
    same = (ids[:, 0] == ids[:, 1]) & real[:, 0] & real[:, 1]
    same &= (labels[:, 0] == IGNORE) & (labels[:, 1] == IGNORE)
    shared = np.argmin(np.concatenate([same, np.zeros((len(ids), 1), bool)], 1), axis=1)
    lengths = real.sum(-1)
    if np.any(real & (np.arange(ids.shape[-1]) >= lengths[..., None])):
        raise ValueError("share_prompts takes right-padded pairs (each row's tokens first)")
    rest = lengths - shared[:, None]
    prompt = max(int(shared.max()), 1)
    completion = max(int(rest.max()), 1)
    for name, value, least in (
        ("prompt_length", prompt_length, prompt),
        ("completion_length", completion_length, completion),
    ):
        if value is not None:
            _positive_int(value, name)
            if value < least:
                raise ValueError(f"{name} {value} is shorter than these pairs' {least}")
    prompt, completion = prompt_length or prompt, completion_length or completion
    rows = len(ids)
    out = {
        "prompt_input_ids": np.zeros((rows, prompt), np.int32),
        "prompt_attention_mask": np.zeros((rows, prompt), np.int32),
        "input_ids": np.zeros((rows, 2, completion), np.int32),
        "attention_mask": np.zeros((rows, 2, completion), np.int32),
        "labels": np.full((rows, 2, completion), IGNORE, np.int32),
    }
    for r in range(rows):
        s = shared[r]
        out["prompt_input_ids"][r, prompt - s :] = ids[r, 0, :s]
        out["prompt_attention_mask"][r, prompt - s :] = 1
        for side in range(2):
            n = rest[r, side]
            out["input_ids"][r, side, :n] = ids[r, side, s : s + n]
            out["attention_mask"][r, side, :n] = 1
            out["labels"][r, side, :n] = labels[r, side, s : s + n]
    others = {k: v for k, v in data.items() if k not in out}
    return {**others, **out}


def scored_labels(batch: dict[str, Any]) -> Any:
    """Which labels `(rows, 2, length)` of preference pairs a loss scores: those with a
    token before them to predict them (the prompt's last, for the first of a completion
    whose prompt is shared). For numpy and jax arrays alike."""
    labels = batch["labels"]
    first = (np.arange(labels.shape[-1]) == 0)[None, None, :]
    if PROMPT_KEYS[1] in batch:  # the first is scored when the prompt has a last token
        return (labels >= 0) & ~(first & (batch[PROMPT_KEYS[1]][:, -1] == 0)[:, None, None])
    return (labels >= 0) & ~first
