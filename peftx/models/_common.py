"""Pieces every architecture uses: products with a layer's weight, attention with masks,
the KV cache, and model outputs named as transformers names them."""

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ..implicit import ImplicitArray


def check_inputs(input_ids: Any, **same_shape: Any) -> tuple[int, int]:
    """`(batch, seq)` of `input_ids`, which must be an integer array of that shape; each of
    `same_shape` (`attention_mask=...`, `position_ids=...`) must be None or an array of
    the same shape. A `TypeError`/`ValueError` says what was expected."""
    if not isinstance(input_ids, jax.Array | np.ndarray):
        raise TypeError(
            "input_ids must be an integer array of shape (batch, seq), e.g. "
            f"jnp.asarray([[1, 2, 3]]); got a {type(input_ids).__name__}."
        )
    if input_ids.ndim != 2:
        raise ValueError(
            "input_ids must be an integer array of shape (batch, seq); got shape "
            f"{tuple(input_ids.shape)}. For one sequence, add a batch axis: input_ids[None]."
        )
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise TypeError(
            f"input_ids must be integer token ids of shape (batch, seq); got dtype "
            f"{input_ids.dtype}. Convert them with input_ids.astype(jnp.int32)."
        )
    for name, value in same_shape.items():
        if value is None:
            continue
        if not isinstance(value, jax.Array | np.ndarray):
            raise TypeError(
                f"{name} must be None or an array of input_ids' shape "
                f"{tuple(input_ids.shape)}; got a {type(value).__name__}."
            )
        if value.shape != input_ids.shape:
            raise ValueError(
                f"{name} has shape {tuple(value.shape)}; it must match input_ids "
                f"{tuple(input_ids.shape)}."
            )
    return input_ids.shape


def _plain(weight: Any) -> Any:
    """`weight`, which a forward outside `use_implicit_args` cannot use when it is an
    implicit array (a quantized weight, an adapter): a `TypeError` says so."""
    if isinstance(weight, ImplicitArray):
        raise TypeError(
            f"a layer's weight is an implicit array ({type(weight).__name__}: a quantized "
            "weight or an adapter), and the model was called outside `use_implicit_args`. "
            "Call it as `peftx.implicit.use_implicit_args(model)(input_ids)`; a PeftModel "
            "(from `get_peft_model`) does this itself."
        )
    return weight


def normal_linear(
    i: int, o: int, bias: bool, key: PRNGKeyArray, std: float, dtype: Any
) -> eqx.nn.Linear:
    """A fresh `Linear(i, o)` as transformers initializes one: weights normal with `std`,
    bias zero."""
    layer = eqx.nn.Linear(i, o, use_bias=bias, key=key, dtype=dtype)
    layer = eqx.tree_at(lambda m: m.weight, layer, std * jax.random.normal(key, (o, i), dtype))
    if bias:
        layer = eqx.tree_at(lambda m: m.bias, layer, jnp.zeros((o,), dtype))
    return layer


def linear(layer: eqx.nn.Linear, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
    """`layer` applied to the last axis of `x` (`x @ W.T + b`), in one product with the
    tokens major, so adapters see a single `dot_general` whatever the batch shape."""
    y = lax.dot_general(x, _plain(layer.weight), (((x.ndim - 1,), (1,)), ((), ())))
    if layer.bias is not None:
        y = y + layer.bias.astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))
    return y


def tied_logits(
    layer: eqx.nn.Embedding, h: Float[Array, "*batch dim"]
) -> Float[Array, "*batch vocab"]:
    """`h` against the rows of `layer.weight`: an output head tied to the input
    embeddings, in one product with the tokens major, as `linear` does."""
    return lax.dot_general(h, _plain(layer.weight), (((h.ndim - 1,), (1,)), ((), ())))


def lm_logits(
    embeddings: eqx.nn.Embedding, lm_head: eqx.nn.Linear | None, h: Float[Array, "*batch dim"]
) -> Float[Array, "*batch vocab"]:
    """A language model's logits: `lm_head`'s, or with no head (tied), the embeddings'."""
    return tied_logits(embeddings, h) if lm_head is None else linear(lm_head, h)


def embed(layer: eqx.nn.Embedding, ids: Int[Array, "*batch"]) -> Float[Array, "*batch dim"]:
    """Rows of `layer.weight` for integer `ids`."""
    return jnp.take(_plain(layer.weight), ids, axis=0)


class LayerNorm(eqx.Module):
    """transformers' LayerNorm (torch's `layer_norm`): over the last axis, computed in
    float32 (at least) and rounded once to the input's dtype, as torch does for half types."""

    weight: Float[Array, " dim"]
    bias: Float[Array, " dim"] | None
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float, *, bias: bool = True, dtype: Any = jnp.float32):
        self.weight = jnp.ones((dim,), dtype)
        self.bias = jnp.zeros((dim,), dtype) if bias else None
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        dtype = x.dtype if jnp.finfo(x.dtype).bits > 32 else jnp.dtype(jnp.float32)
        h = x.astype(dtype)
        mean = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
        y = (h - mean) * lax.rsqrt(var + jnp.asarray(self.eps, dtype))
        row = (1,) * (x.ndim - 1) + (-1,)  # explicit, for rank promotion "raise"
        y = y * self.weight.astype(dtype).reshape(row)
        if self.bias is not None:
            y = y + self.bias.astype(dtype).reshape(row)
        return y.astype(x.dtype)


class RMSNorm(eqx.Module):
    """Llama's RMSNorm: normalized in float32, rounded to the input dtype, then scaled."""

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float, *, dtype: Any = jnp.float32):
        self.weight = jnp.ones((dim,), dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        h = x.astype(jnp.float32)
        h = h * lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + self.eps)
        dtype = jnp.promote_types(self.weight.dtype, x.dtype)
        row = (1,) * (x.ndim - 1) + (-1,)  # explicit, for rank promotion "raise"
        return self.weight.astype(dtype).reshape(row) * h.astype(x.dtype).astype(dtype)


ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "tanh": jnp.tanh,
}


def activation(name: str) -> Any:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; known: {sorted(ACTIVATIONS)}.")
    return ACTIVATIONS[name]


def positions_from_mask(
    attention_mask: Int[Array, "batch seq"] | None, batch: int, seq: int
) -> Int[Array, "batch seq"]:
    """Position ids: `0, 1, ...` over each row's real tokens (as transformers' `generate`
    makes them), so left padding does not shift the positions of the real tokens."""
    if attention_mask is None:
        return jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def packed_segments(
    position_ids: Int[Array, "batch seq"] | None, attention_mask: Any, cache: Any
) -> Int[Array, "batch seq"] | None:
    """Which example of a packed row each token belongs to: a new one starts wherever a
    position is not the one before plus 1 (`0 1 2 0 1` is two examples), and tokens attend
    only within their own. transformers' rule (`find_packed_sequence_indices`): only for
    `position_ids` given with neither an `attention_mask` nor a `cache`; else None, one
    example per row."""
    if position_ids is None or attention_mask is not None or cache is not None:
        return None
    starts = jnp.diff(position_ids, axis=-1) != 1
    first = jnp.zeros((position_ids.shape[0], 1), jnp.int32)
    return jnp.concatenate([first, jnp.cumsum(starts, axis=-1, dtype=jnp.int32)], axis=-1)


class DecoderPositions(NamedTuple):
    """Where a decoder call's tokens go: each token's cache slot, which keys are real
    tokens, the cache slot written first (None without a cache), the positions, and each
    token's example in a packed row (`packed_segments`; None: one example per row)."""

    slots: Int[Array, "batch seq"]
    key_valid: Bool[Array, "batch keys"]
    index: Int[Array, "*rows"] | None
    position_ids: Int[Array, "batch seq"]
    segments: Int[Array, "batch seq"] | None


def decoder_positions(
    input_ids: Any, attention_mask: Any, position_ids: Any, cache: "KVCache | None"
) -> DecoderPositions:
    """A decoder call's `DecoderPositions`, its inputs checked. Without `position_ids`,
    positions count the real tokens (as `generate` does); with a `cache`, the tokens are
    written at `cache.index` and their positions continue the count of real tokens there.
    `position_ids` that restart without a mask or cache pack several examples in a row."""
    b, s = check_inputs(input_ids, attention_mask=attention_mask, position_ids=position_ids)
    valid = jnp.ones((b, s), bool) if attention_mask is None else attention_mask.astype(bool)
    if cache is None:
        slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        segments = packed_segments(position_ids, attention_mask, cache)
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask, b, s)
        return DecoderPositions(slots, valid, None, position_ids, segments)
    slots = cache_slots(cache.index, b, s)
    key_valid = update_columns(cache.valid, valid, cache.index)
    if position_ids is None:
        every = positions_from_mask(key_valid.astype(jnp.int32), b, key_valid.shape[1])
        position_ids = slice_columns(every, cache.index, s)
    return DecoderPositions(slots, key_valid, cache.index, position_ids, None)


def cache_slots(index: Int[Array, "*rows"], batch: int, seq: int) -> Int[Array, "batch seq"]:
    """The cache slots `seq` new tokens of each row take from `index` on (one index for
    every row, or one per row)."""
    index = jnp.asarray(index)
    steps = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    return steps + (index if index.ndim == 0 else index[:, None])


def update_columns(x: Array, update: Array, index: Int[Array, "*rows"]) -> Array:
    """`x (batch, columns, ...)` with `update (batch, seq, ...)` written from column
    `index` on: the same column for every row, or each row's own."""
    if jnp.ndim(index) == 0:
        return lax.dynamic_update_slice_in_dim(x, update, index, 1)
    return jax.vmap(lambda r, u, i: lax.dynamic_update_slice_in_dim(r, u, i, 0))(x, update, index)


def slice_columns(x: Array, index: Int[Array, "*rows"], size: int) -> Array:
    """`size` columns of `x (batch, columns, ...)` from `index` on (one or one per row)."""
    if jnp.ndim(index) == 0:
        return lax.dynamic_slice_in_dim(x, index, size, 1)
    return jax.vmap(lambda r, i: lax.dynamic_slice_in_dim(r, i, size, 0))(x, index)


def attention_mask(
    query_slots: Int[Array, "batch q"],
    key_valid: Bool[Array, "batch k"],
    *,
    causal: bool,
    window: Int[Array, ""] | int | None = None,
    segments: Int[Array, "batch q"] | None = None,
) -> Bool[Array, "batch 1 q k"]:
    """Which keys each query sees: valid keys, and with `causal` only those at or before
    the query's slot (within `window` slots when a sliding window is set); with `segments`
    (no cache: as many keys as queries), only keys of the query's own example."""
    key_slots = jnp.arange(key_valid.shape[-1], dtype=jnp.int32)
    shape = (key_valid.shape[0], query_slots.shape[-1], key_valid.shape[-1])
    mask = jnp.broadcast_to(key_valid[:, None, :], shape)  # (batch, q, k) even when not causal
    if causal:
        distance = query_slots[:, :, None] - key_slots[None, None, :]
        mask = mask & (distance >= 0)
        if window is not None:
            mask = mask & (distance < window)
    if segments is not None:
        mask = mask & (segments[:, :, None] == segments[:, None, :])
    return mask[:, None, :, :]


def dropout(
    x: Float[Array, "*shape"], rate: float, key: PRNGKeyArray | None
) -> Float[Array, "*shape"]:
    """Inverted dropout (torch's `nn.Dropout` in training mode): entries zeroed with
    probability `rate`, the others scaled by `1 / (1 - rate)`. `x` itself when `key` is
    None (eval mode) or `rate` is 0."""
    if key is None or rate == 0:
        return x
    if not 0 <= rate < 1:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}.")
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def dot_product_attention(
    q: Float[Array, "batch q heads dim"],
    k: Float[Array, "batch k kv_heads dim"],
    v: Float[Array, "batch k kv_heads dim"],
    mask: Bool[Array, "batch 1 q k"],
    scale: float | Float[Array, ""],
    *,
    softcap: float | None = None,
    dropout_rate: float = 0.0,
    dropout_key: PRNGKeyArray | None = None,
) -> Float[Array, "batch q heads dim"]:
    """Softmax attention (grouped-query when there are fewer key/value heads), softmax in
    float32. A query that sees no key (a padding position) attends uniformly instead of
    giving NaN, as transformers' eager attention does. `softcap` bounds the scores to
    `(-softcap, softcap)` with `softcap·tanh(score / softcap)` (Gemma 2). With a
    `dropout_key`, the attention weights are dropped at `dropout_rate` (training mode)."""
    b, sq, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, sq, kv, h // kv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k).astype(jnp.float32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1)
    weights = dropout(weights, dropout_rate, dropout_key).astype(v.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", weights, v)
    return out.reshape(b, sq, h, v.shape[-1])


class KVCache(eqx.Module):
    """Keys and values of every layer for the tokens seen so far.

    `key`/`value` are `(layers, batch, max_len, kv_heads, head_dim)`; `valid[b, t]` says
    whether slot `t` holds a real token; `index` is the next slot to write: one for every
    row `()`, or each row's own `(batch,)` (rows that started at different times, as a
    server's continuous batch holds them).
    """

    key: Float[Array, "layers batch max_len kv_heads head_dim"]
    value: Float[Array, "layers batch max_len kv_heads head_dim"]
    valid: Bool[Array, "batch max_len"]
    index: Int[Array, ""] | Int[Array, " batch"]

    @classmethod
    def empty(
        cls, layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype: Any
    ) -> "KVCache":
        shape = (layers, batch, max_len, kv_heads, head_dim)
        return cls(
            jnp.zeros(shape, dtype),
            jnp.zeros(shape, dtype),
            jnp.zeros((batch, max_len), bool),
            jnp.zeros((), jnp.int32),
        )


def write_cache(
    cache_k: Array, cache_v: Array, k: Array, v: Array, index: Array
) -> tuple[Array, Array]:
    """One layer's cache with `k`, `v` written at slot `index` onward (one slot for every
    row, or each row's own)."""
    k = update_columns(cache_k, k.astype(cache_k.dtype), index)
    v = update_columns(cache_v, v.astype(cache_v.dtype), index)
    return k, v


# -- what a config.json value must be -------------------------------------------------------

# Bounds far above any released checkpoint (the deepest has 126 layers, the widest layer
# 53248 features, the largest vocabulary about 260k tokens) that keep every loop over layers
# and checkpoint keys short: a larger value is a typo or a hostile file, whose model would
# not fit in memory, and building it would hang.
MAX_LAYERS = 4096
MAX_WIDTH = 2**20
MAX_VOCAB = 2**24
MAX_POSITIONS = 2**31 - 1  # position ids are int32


@dataclasses.dataclass(frozen=True)
class Check:
    """What one config value must be: `test` passes it, `expected` says so in words;
    `bound` is peftx's own upper bound (one of the `MAX_...`), explained when exceeded."""

    test: Callable[[Any], bool]
    expected: str
    bound: int | None = None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    # `math.isfinite` would raise OverflowError for an int beyond float's range
    return isinstance(v, float) and math.isfinite(v) or _is_int(v) and abs(v) < 2**1000


def _or_null(check: Check, null: bool) -> Check:
    if not null:
        return check
    return Check(lambda v: v is None or check.test(v), f"null or {check.expected}", check.bound)


def integer(low: int, high: int, *, null: bool = False) -> Check:
    """An int (not a bool) in `[low, high]`."""
    bound = high if high in (MAX_LAYERS, MAX_WIDTH, MAX_VOCAB) else None
    return _or_null(
        Check(lambda v: _is_int(v) and low <= v <= high, f"an integer from {low} to {high}", bound),
        null,
    )


def number(
    low: int | float | None = None,
    high: int | float | None = None,
    *,
    open_low: bool = False,
    open_high: bool = False,
    null: bool = False,
) -> Check:
    """A finite int or float (not a bool) in the range, its ends included unless open."""

    def test(v: Any) -> bool:
        if not _is_number(v):
            return False
        above = low is None or (v > low if open_low else v >= low)
        return above and (high is None or (v < high if open_high else v <= high))

    if low is None and high is None:
        words = "a finite number"
    elif high is None:
        words = f"a finite number {'>' if open_low else '>='} {low}"
    else:
        words = f"a number in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    return _or_null(Check(test, words), null)


def flag() -> Check:
    """true, false or null (transformers reads null as false)."""
    return Check(lambda v: v is None or isinstance(v, bool), "true, false or null")


def one_of(choices: tuple[str, ...] | list[str], *, null: bool = False) -> Check:
    words = "one of " + ", ".join(json.dumps(c) for c in choices)
    return _or_null(Check(lambda v: isinstance(v, str) and v in choices, words), null)


def mapping(*, null: bool = True) -> Check:
    return _or_null(Check(lambda v: isinstance(v, dict), "an object"), null)


def strings(*, null: bool = True) -> Check:
    return _or_null(
        Check(
            lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
            "a list of strings",
        ),
        null,
    )


def positive_numbers(*, null: bool = True) -> Check:
    """A list of finite numbers > 0 (LongRoPE's per-frequency factors)."""
    return _or_null(
        Check(
            lambda v: isinstance(v, list | tuple) and all(_is_number(x) and x > 0 for x in v),
            "a list of finite numbers > 0",
        ),
        null,
    )


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_values(values: Mapping[str, Any], checks: Mapping[str, Check], prefix: str = "") -> None:
    """A `ValueError` naming the first key of `values` (as `prefix + key`) that fails its
    check; keys without a check are not looked at."""
    for key, check in checks.items():
        if key not in values or check.test(value := values[key]):
            continue
        why = ""
        if check.bound is not None and _is_int(value) and value > check.bound:
            why = " (far above any released model; such a model would not fit in memory)"
        raise ValueError(f"{prefix}{key} must be {check.expected}; got {_shown(value)}{why}.")


# The keys every architecture reads the same way.
STRING = Check(lambda v: isinstance(v, str), "a string")

COMMON_CHECKS: dict[str, Check] = {
    "model_type": STRING,
    "architectures": strings(),
    "vocab_size": integer(1, MAX_VOCAB),
    "num_labels": integer(1, MAX_VOCAB),
    "id2label": mapping(),
    "pad_token_id": integer(-(2**31), 2**31 - 1, null=True),
    # the std of fresh weights: ~0.02 in practice; far larger ones overflow float32
    "initializer_range": number(0, 1000),
    "tie_word_embeddings": flag(),
}


LogicalAxesTable = tuple[tuple[str, tuple[str | None, ...]], ...]
"""`(regex, logical axes)` pairs: see `HFConfig.LOGICAL_AXES`."""


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """Base of the architectures' configs: typed fields plus the full `config.json`
    (`raw`, as JSON text so the config stays hashable) to write back unchanged, and
    `name_or_path`, the directory `from_pretrained` read (transformers'
    `config.name_or_path`; None for a model built in code), which adapters record as
    `base_model_name_or_path`."""

    raw: str = dataclasses.field(default="{}", repr=False, compare=False)
    # Not compared, so models of one architecture loaded from two directories keep one
    # tree structure (they share jit traces and `eqx.combine`). A model that comes out of
    # a shared trace carries the first one's path: `get_peft_model` records it in the
    # adapter's config (which compares) before any training step for that reason.
    name_or_path: str | None = dataclasses.field(default=None, compare=False)

    # what each key of `config.json` (and each field of the same name) must be
    CHECKS: ClassVar[dict[str, Check]] = COMMON_CHECKS
    # The logical axes of the architecture's weights: `(regex, axes)` pairs, the regex
    # matching the end of a layer's own array path (`q_proj\\.weight`), the axes naming
    # each dimension (`("heads", "embed")`), which `peftx.sharding`'s presets map onto a
    # mesh. Arrays no pair names are replicated.
    LOGICAL_AXES: ClassVar[LogicalAxesTable] = ()

    def __post_init__(self) -> None:
        fields = {f.name: f for f in dataclasses.fields(self)}
        check_values({k: getattr(self, k) for k in self.CHECKS if k in fields}, self.CHECKS)
        for name, field in fields.items():
            # JSON writes 0.0 as 0: a float field holds a float, whichever was written
            if field.type in (float, float | None) and _is_int(getattr(self, name)):
                object.__setattr__(self, name, float(getattr(self, name)))

    @classmethod
    def check_hf(cls, d: Mapping[str, Any]) -> None:
        """A `ValueError` naming the first key of the `config.json` dict `d` whose value
        has the wrong type or is out of range; run before anything is built from `d`."""
        check_values(d, cls.CHECKS)

    def hf_dict(self) -> dict[str, Any]:
        return json.loads(self.raw)


class BaseModelOutput(eqx.Module):
    """A backbone's output: the last hidden state, each block's output with
    `output_hidden_states=True` (stacked, `(layers, batch, seq, dim)`), the KV cache, and
    a mixture of experts' router logits (`(layers, batch·seq, experts)`)."""

    last_hidden_state: Float[Array, "batch seq dim"]
    hidden_states: Float[Array, "layers batch seq dim"] | None = None
    cache: KVCache | None = None
    pooler_output: Float[Array, "batch dim"] | None = None
    router_logits: Float[Array, "layers tokens experts"] | None = None


class CausalLMOutput(eqx.Module):
    """A language model's logits, and as transformers' `MoeCausalLMOutputWithPast` has
    them for a mixture of experts, the router logits and the load-balancing `aux_loss`
    (over the real tokens of `attention_mask`)."""

    logits: Float[Array, "batch seq vocab"]
    hidden_states: Float[Array, "layers batch seq dim"] | None = None
    cache: KVCache | None = None
    router_logits: Float[Array, "layers tokens experts"] | None = None
    aux_loss: Float[Array, ""] | None = None


class SequenceClassifierOutput(eqx.Module):
    logits: Float[Array, "batch labels"]
    hidden_states: Float[Array, "layers batch seq dim"] | None = None


class MaskedLMOutput(eqx.Module):
    logits: Float[Array, "batch seq vocab"]
    hidden_states: Float[Array, "layers batch seq dim"] | None = None


def with_num_labels(config: Any, num_labels: int | None) -> Any:
    """`config` with `num_labels` classes, as transformers' `from_pretrained(...,
    num_labels=3)` overrides the config's; the config itself when None or the same."""
    if num_labels is None or num_labels == config.num_labels:
        return config
    return dataclasses.replace(config, num_labels=num_labels)


def fresh_lm_head(config: Any, key: PRNGKeyArray, dtype: Any) -> eqx.nn.Linear | None:
    """A decoder's language-model head initialized as transformers does, or None when the
    config ties it to the input embeddings (`lm_logits` then reads those)."""
    if config.tie_word_embeddings:
        return None
    std = config.initializer_range
    return normal_linear(config.hidden_size, config.vocab_size, False, key, std, dtype)


def fresh_score(config: Any, key: PRNGKeyArray, dtype: Any) -> eqx.nn.Linear:
    """A decoder's sequence-classification head `score`, initialized as transformers does."""
    std = config.initializer_range
    return normal_linear(config.hidden_size, config.num_labels, False, key, std, dtype)


def last_token_scores(
    score: eqx.nn.Linear,
    h: Float[Array, "batch seq dim"],
    input_ids: Int[Array, "batch seq"],
    pad_token_id: int | None,
) -> Float[Array, "batch labels"]:
    """A decoder classifier's logits: `score` read at each sequence's last non-padding
    token (`last_token_index`), as transformers' `...ForSequenceClassification` reads it."""
    logits = linear(score, h)
    last = last_token_index(input_ids, pad_token_id)
    return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]


def last_token_index(
    input_ids: Int[Array, "batch seq"], pad_token_id: int | None
) -> Int[Array, " batch"]:
    """transformers' choice of the token a sequence classifier reads: the rightmost token
    that is not padding (the last token when there is no pad id)."""
    seq = input_ids.shape[-1]
    if pad_token_id is None:
        return jnp.full(input_ids.shape[:1], seq - 1, jnp.int32)
    positions = jnp.arange(seq, dtype=jnp.int32)
    real = (input_ids != pad_token_id).astype(jnp.int32)
    return jnp.argmax(positions[None, :] * real, axis=-1).astype(jnp.int32)
