"""Preference tuning: the DPO and ORPO losses over pairs (`encode_preference`), the
reference being the same model with its adapters disabled."""

import math
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, PRNGKeyArray

from .._bank import PeftBankModel
from .._peft_model import PeftModel
from ..implicit import use_implicit_args
from ..models import KVCache, cache_dims
from ._data import IGNORE, PROMPT_KEYS, scored_labels
from ._step import Batch, base_model, model_output

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
REFERENCE_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


def _flat(batch: Batch) -> Batch:
    """A batch of pairs as one of sequences, chosen and rejected of row i at 2i and 2i + 1;
    each row's adapter routes both of its sequences."""
    out = {k: batch[k].reshape(-1, batch[k].shape[-1]) for k in ("input_ids", "attention_mask")}
    if "adapter_ids" in batch:
        rows = batch["input_ids"].shape[:1]
        out["adapter_ids"] = jnp.repeat(jnp.broadcast_to(batch["adapter_ids"], rows), 2)
    return out


def sequence_log_probs(
    logits: Float[Array, "rows seq vocab"], labels: Array
) -> tuple[Float[Array, " rows"], Float[Array, " rows"]]:
    """Each row's summed log-probability of its labelled tokens (position t predicts
    `labels[t + 1]`; -100 is left out), in float32, and how many tokens that sums."""
    per_token, valid = _token_log_probs(logits[:, :-1], labels[:, 1:])
    return jnp.sum(per_token, axis=1), jnp.sum(valid, axis=1).astype(jnp.float32)


def _token_log_probs(logits: Array, targets: Array) -> tuple[Array, Array]:
    """Each position's float32 log-probability of its target (-100: none, giving 0), and
    which positions have one."""
    valid = targets >= 0
    per_token = -optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), jnp.where(valid, targets, 0)
    )
    return jnp.where(valid, per_token, 0.0), valid


def _pairs_of(x: Array) -> tuple[Array, Array]:
    x = x.reshape(-1, 2)
    return x[:, 0], x[:, 1]


def reference_model(model: Any) -> Any:
    """The callable reference of preference tuning: `model` with its adapters disabled
    (`disable_adapters()`), run under `use_implicit_args` so that an NF4 base stays NF4."""
    if not isinstance(model, PeftModel | PeftBankModel):
        raise TypeError(
            "the reference of DPO is the model with its adapters disabled, so the model must "
            f"be a PeftModel or PeftBankModel (got {type(model).__name__}); or precompute the "
            "reference log-probabilities (precompute_ref_log_probs) with the reference model"
        )
    return use_implicit_args(model.disable_adapters())


Forward = Any  # (batch, key, cache) -> the model's output


def _shared(batch: Batch) -> bool:
    """Whether the pairs hold their prompts once (`share_prompts`)."""
    return PROMPT_KEYS[0] in batch


def _check_shared_length(config: Any, total: int) -> None:
    rope = getattr(config, "rope_parameters", None) or {}
    switch = {
        "longrope": rope.get("original_max_position_embeddings"),
        "dynamic": getattr(config, "max_position_embeddings", None),
    }.get(rope.get("rope_type"))
    if switch is not None and total > switch:
        raise ValueError(
            f"a {rope['rope_type']} rope changes its frequencies past {switch} positions for "
            f"the whole sequence, and these prompts + completions reach {total}: a prompt run "
            "once would see other frequencies than its pair; leave the prompts unshared"
        )
    max_positions = cache_dims(config)[3]
    if max_positions is not None and total > max_positions:
        raise ValueError(
            f"prompts + completions of {total} tokens exceed the {max_positions} positions "
            "this model has embeddings for"
        )


def _shared_logits(forward: Forward, config: Any, batch: Batch, key: Any) -> tuple[Array, Array]:
    """The prompts' logits `(rows, prompt, vocab)`, run once with their keys and values
    cached, and the completions' `(2 * rows, completion, vocab)`, chosen and rejected of
    row i at 2i and 2i + 1, each continuing its row's cached prompt."""
    prompt = {"input_ids": batch[PROMPT_KEYS[0]], "attention_mask": batch[PROMPT_KEYS[1]]}
    rows, width = prompt["input_ids"].shape
    if "adapter_ids" in batch:
        prompt["adapter_ids"] = jnp.broadcast_to(batch["adapter_ids"], (rows,))
    total = width + batch["input_ids"].shape[-1]
    _check_shared_length(config, total)
    layers, kv_heads, head_dim, _ = cache_dims(config)
    dtype = jax.eval_shape(lambda: forward(prompt, None, None)).logits.dtype
    cache = KVCache.empty(layers, rows, total, kv_heads, head_dim, dtype)
    prompt_key, completion_key = (None, None) if key is None else jax.random.split(key)
    first = forward(prompt, prompt_key, cache)
    cache = first.cache
    both = KVCache(  # each row's cache twice: for its chosen, then its rejected
        jnp.repeat(cache.key, 2, axis=1),
        jnp.repeat(cache.value, 2, axis=1),
        jnp.repeat(cache.valid, 2, axis=0),
        cache.index,
    )
    return first.logits, forward(_flat(batch), completion_key, both).logits


def _completion_log_probs(
    prompt_logits: Array, logits: Array, labels: Array
) -> tuple[Array, Array]:
    """Each completion's summed log-probability of its scored labels `(2 * rows,
    completion)` (its first token predicted by its prompt's last logit), and how many
    it sums."""
    first, first_valid = _token_log_probs(jnp.repeat(prompt_logits[:, -1], 2, axis=0), labels[:, 0])
    rest, rest_valid = _token_log_probs(logits[:, :-1], labels[:, 1:])
    counts = first_valid.astype(jnp.float32) + jnp.sum(rest_valid, axis=1).astype(jnp.float32)
    return first + jnp.sum(rest, axis=1), counts


def _log_probs(forward: Forward, config: Any, batch: Batch, key: Any) -> tuple[Any, Array, Array]:
    """The logits (the prompts' and the completions' for shared prompts), and each
    sequence's summed completion log-probability and its count, chosen and rejected of
    pair i at 2i and 2i + 1."""
    if _shared(batch):
        prompt_logits, logits = _shared_logits(forward, config, batch, key)
        labels = jnp.where(scored_labels(batch), batch["labels"], IGNORE)
        labels = labels.reshape(logits.shape[:2])
        return (prompt_logits, logits), *_completion_log_probs(prompt_logits, logits, labels)
    flat = _flat(batch)
    logits = forward(flat, key, None).logits
    return logits, *sequence_log_probs(logits, batch["labels"].reshape(flat["input_ids"].shape))


def _reference_log_probs(reference: Any, config: Any, batch: Batch) -> tuple[Array, Array]:
    """The batch's reference log-probabilities: stored with it, or those of
    `reference()` (a callable model, made only when needed)."""
    if all(k in batch for k in REFERENCE_KEYS):
        return tuple(batch[k].astype(jnp.float32) for k in REFERENCE_KEYS)

    def forward(b: Batch, key: Any, cache: Any) -> Any:
        return reference()(b["input_ids"], b["attention_mask"], cache=cache)

    _, logps, _ = _log_probs(forward, config, batch, None)
    return _pairs_of(jax.lax.stop_gradient(logps))


def _policy(model: Any, batch: Batch, key: PRNGKeyArray | None) -> tuple[Any, Array, Array]:
    def forward(b: Batch, key: Any, cache: Any) -> Any:
        return model_output(model, b, key, cache=cache)

    return _log_probs(forward, base_model(model).config, batch, key)


def _valid_pairs(batch: Batch) -> Array:
    """Pairs whose chosen sequence has a labelled token (the padding rows of an eval
    batch have none)."""
    return jnp.any(scored_labels(batch)[:, 0], axis=-1)


def _check_choice(value: Any, choices: tuple, name: str) -> None:
    if value not in choices:
        raise ValueError(f"{name} {value!r}: choose one of {', '.join(choices)}")


def _check_beta(beta: Any) -> None:
    if (
        isinstance(beta, bool)
        or not isinstance(beta, int | float)
        or not (math.isfinite(beta) and beta > 0)
    ):
        raise ValueError(f"beta must be a finite number > 0, got {beta!r}")


def dpo_loss(
    model: Any,
    batch: Batch,
    key: PRNGKeyArray | None = None,
    *,
    beta: float = 0.1,
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """TRL's DPO loss over a batch of pairs (`encode_preference`, or `share_prompts` to run
    each prompt once), summed over pairs: pass
    it to `make_train_step` or `fit` as `functools.partial(dpo_loss, beta=...)`.

    The log-ratios are the policy's summed completion log-probabilities less the
    reference's. The reference is the same model with its adapters disabled
    (`reference_model`), run without gradient, so no second copy of the weights exists:
    an NF4 base for QLoRA, sharded as the policy on a mesh, the base for every row of a
    bank. With `ref_chosen_logps` and `ref_rejected_logps` in the batch
    (`precompute_ref_log_probs`) no reference forward runs.

    `loss_type`, with `d` = beta times the difference of the two log-ratios:
    `"sigmoid"` (DPO) `-log σ(d)`; `"hinge"` `relu(1 - d)`; `"ipo"` `(δ - 1/(2β))²` with δ
    the difference of the log-ratios each divided by its completion's length;
    `"robust"` `(-(1-ε) log σ(d) + ε log σ(-d)) / (1 - 2ε)`, ε = `label_smoothing`.

    The sums, under TRL's metric names (divide by `count`, the pairs): `rewards/chosen`,
    `rewards/rejected` (beta times each log-ratio), `rewards/accuracies`,
    `rewards/margins`, `logps/chosen`, `logps/rejected`.
    """
    _check_beta(beta)
    _check_choice(loss_type, DPO_LOSS_TYPES, "loss_type")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    _, logps, _ = _policy(model, batch, key)
    chosen, rejected = _pairs_of(logps)
    ref_chosen, ref_rejected = _reference_log_probs(
        lambda: reference_model(model), base_model(model).config, batch
    )
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -jax.nn.log_sigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = jax.nn.relu(1.0 - beta * delta)
    elif loss_type == "ipo":
        lengths = jnp.maximum(jnp.sum(batch["labels"] >= 0, axis=-1), 1).astype(jnp.float32)
        ipo = chosen_ratio / lengths[:, 0] - rejected_ratio / lengths[:, 1]
        losses = (ipo - 1.0 / (2.0 * beta)) ** 2
    else:
        eps = label_smoothing
        clean = -(1.0 - eps) * jax.nn.log_sigmoid(beta * delta)
        flipped = -eps * jax.nn.log_sigmoid(-beta * delta)
        losses = (clean - flipped) / (1.0 - 2.0 * eps)
    valid = _valid_pairs(batch)
    chosen_reward = jax.lax.stop_gradient(beta * chosen_ratio)
    rejected_reward = jax.lax.stop_gradient(beta * rejected_ratio)
    metrics = {
        "rewards/chosen": chosen_reward,
        "rewards/rejected": rejected_reward,
        "rewards/accuracies": (chosen_reward > rejected_reward).astype(jnp.float32),
        "rewards/margins": chosen_reward - rejected_reward,
        "logps/chosen": jax.lax.stop_gradient(chosen),
        "logps/rejected": jax.lax.stop_gradient(rejected),
    }
    return _summed(losses, metrics, valid)


def _summed(
    losses: Array, metrics: dict[str, Array], valid: Array
) -> tuple[Float[Array, ""], dict[str, Array]]:
    sums = {k: jnp.sum(jnp.where(valid, v, 0.0)) for k, v in metrics.items()}
    return jnp.sum(jnp.where(valid, losses, 0.0)), {
        "count": jnp.sum(valid).astype(jnp.float32),
        **sums,
    }


def _log1mexp(x: Array) -> Array:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2."""
    return jnp.where(x < -math.log(2.0), jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def orpo_loss(
    model: Any, batch: Batch, key: PRNGKeyArray | None = None, *, beta: float = 0.1
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """TRL's ORPO loss over a batch of pairs (`encode_preference`, or `share_prompts` to run
    each prompt once), summed over pairs: the
    chosen sequences' negative log-likelihood less `beta` times `log σ` of the log
    odds ratio of the chosen over the rejected completion, its log-probabilities
    averaged over the completion's tokens. No reference model.

    As TRL's `ORPOTrainer`, the likelihood term is the mean over every attended token of
    the chosen sequences (the prompt's included), here scaled to the batch's pairs so
    that the sum over pairs divided by `count` is TRL's loss of the batch.

    The sums (divide by `count`, the pairs): `rewards/chosen`, `rewards/rejected` (beta
    times the average log-probabilities), `rewards/accuracies`, `rewards/margins`,
    `logps/chosen`, `logps/rejected`, `nll_loss`, `log_odds_ratio`, `log_odds_chosen`.
    """
    _check_beta(beta)
    out, logps, counts = _policy(model, batch, key)
    average = logps / jnp.maximum(counts, 1.0)
    chosen, rejected = _pairs_of(average)
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    ratio = jax.nn.log_sigmoid(log_odds)
    valid = _valid_pairs(batch)
    token_logps, tokens = _chosen_likelihood(out, batch, valid)
    pairs = jnp.sum(valid).astype(jnp.float32)
    nll = -token_logps / jnp.maximum(tokens, 1.0)
    total = nll * pairs - beta * jnp.sum(jnp.where(valid, ratio, 0.0))
    chosen_reward, rejected_reward = (jax.lax.stop_gradient(beta * x) for x in (chosen, rejected))
    metrics = {
        "rewards/chosen": chosen_reward,
        "rewards/rejected": rejected_reward,
        "rewards/accuracies": (chosen_reward > rejected_reward).astype(jnp.float32),
        "rewards/margins": chosen_reward - rejected_reward,
        "logps/chosen": jax.lax.stop_gradient(chosen),
        "logps/rejected": jax.lax.stop_gradient(rejected),
        "nll_loss": jnp.broadcast_to(jax.lax.stop_gradient(nll), valid.shape),
        "log_odds_ratio": jax.lax.stop_gradient(ratio),
        "log_odds_chosen": jax.lax.stop_gradient(log_odds),
    }
    _, sums = _summed(ratio, metrics, valid)
    return total, sums


def _chosen_likelihood(logits: Any, batch: Batch, valid: Array) -> tuple[Array, Array]:
    """The summed log-likelihood of the valid pairs' chosen sequences over every attended
    token (the prompt's too), and how many tokens it sums."""

    def attended(ids: Array, mask: Array) -> Array:
        keep = (mask > 0) & valid.reshape((-1,) + (1,) * (ids.ndim - 1))
        return jnp.where(keep, ids, IGNORE)

    chosen = attended(batch["input_ids"][:, 0], batch["attention_mask"][:, 0])
    if not _shared(batch):
        chosen_logits = logits.reshape(*batch["input_ids"].shape, -1)[:, 0]
        logps, tokens = sequence_log_probs(chosen_logits, chosen)
        return jnp.sum(logps), jnp.sum(tokens)
    prompt_logits, logits = logits
    prompt_ids, prompt_mask = batch[PROMPT_KEYS[0]], batch[PROMPT_KEYS[1]]
    # left-padded: a prompt token is predicted where the position before it is a token too
    targets = attended(prompt_ids[:, 1:], prompt_mask[:, 1:] * prompt_mask[:, :-1])
    in_prompt, in_prompt_valid = _token_log_probs(prompt_logits[:, :-1], targets)
    # the completion's first token follows the prompt's last, if the prompt has any
    chosen = chosen.at[:, 0].set(jnp.where(prompt_mask[:, -1] > 0, chosen[:, 0], IGNORE))
    first, first_valid = _token_log_probs(prompt_logits[:, -1], chosen[:, 0])
    rest, rest_valid = _token_log_probs(logits[0::2, :-1], chosen[:, 1:])
    total = jnp.sum(in_prompt) + jnp.sum(first) + jnp.sum(rest)
    tokens = sum(jnp.sum(v) for v in (in_prompt_valid, first_valid, rest_valid))
    return total, tokens.astype(jnp.float32)


@eqx.filter_jit
def _reference_batch(model: Any, batch: Batch) -> tuple[Array, Array]:
    def reference() -> Any:
        if isinstance(model, PeftModel | PeftBankModel):
            return reference_model(model)
        return use_implicit_args(model)

    unstored = {k: v for k, v in batch.items() if k not in REFERENCE_KEYS}
    return _reference_log_probs(reference, base_model(model).config, unstored)


def precompute_ref_log_probs(
    model: Any, data: dict[str, np.ndarray], *, batch_size: int = 8
) -> dict[str, np.ndarray]:
    """`data` (from `encode_preference` or `share_prompts`) with `ref_chosen_logps` and
    `ref_rejected_logps`: the reference's summed completion log-probabilities of each
    pair, computed once (TRL's `precompute_ref_log_probs`), so that `dpo_loss` runs no
    reference forward in a step. The reference is `model` with its adapters disabled
    (`reference_model`), or `model` itself if it has none (a separate reference model of
    your own)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    rows = len(data["input_ids"])
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    for start in range(0, rows, batch_size):
        batch = {k: v[start : start + batch_size] for k, v in data.items()}
        short = batch_size - len(batch["input_ids"])
        if short:  # one compiled shape: the last batch padded with copies of its last row
            batch = {k: np.concatenate([v, np.repeat(v[-1:], short, 0)]) for k, v in batch.items()}
        chosen, rejected = _reference_batch(model, batch)
        keep = batch_size - short
        parts.append((np.asarray(chosen)[:keep], np.asarray(rejected)[:keep]))
    chosen, rejected = (np.concatenate(p).astype(np.float32) for p in zip(*parts, strict=True))
    return {**data, "ref_chosen_logps": chosen, "ref_rejected_logps": rejected}
