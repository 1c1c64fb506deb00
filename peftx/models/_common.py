"""Pieces every architecture uses: products with a layer's weight, attention with masks,
the KV cache, and model outputs named as transformers names them."""

import dataclasses
import json
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray


def linear(layer: eqx.nn.Linear, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
    """`layer` applied to the last axis of `x` (`x @ W.T + b`), in one product with the
    tokens major, so adapters see a single `dot_general` whatever the batch shape."""
    y = lax.dot_general(x, layer.weight, (((x.ndim - 1,), (1,)), ((), ())))
    if layer.bias is not None:
        y = y + layer.bias.astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))
    return y


def tied_logits(
    layer: eqx.nn.Embedding, h: Float[Array, "*batch dim"]
) -> Float[Array, "*batch vocab"]:
    """`h` against the rows of `layer.weight`: an output head tied to the input
    embeddings, in one product with the tokens major, as `linear` does."""
    return lax.dot_general(h, layer.weight, (((h.ndim - 1,), (1,)), ((), ())))


def embed(layer: eqx.nn.Embedding, ids: Int[Array, "*batch"]) -> Float[Array, "*batch dim"]:
    """Rows of `layer.weight` for integer `ids`."""
    return jnp.take(layer.weight, ids, axis=0)


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


def attention_mask(
    query_slots: Int[Array, "batch q"],
    key_valid: Bool[Array, "batch k"],
    *,
    causal: bool,
    window: Int[Array, ""] | int | None = None,
) -> Bool[Array, "batch 1 q k"]:
    """Which keys each query sees: valid keys, and with `causal` only those at or before
    the query's slot (within `window` slots when a sliding window is set)."""
    key_slots = jnp.arange(key_valid.shape[-1], dtype=jnp.int32)
    shape = (key_valid.shape[0], query_slots.shape[-1], key_valid.shape[-1])
    mask = jnp.broadcast_to(key_valid[:, None, :], shape)  # (batch, q, k) even when not causal
    if causal:
        distance = query_slots[:, :, None] - key_slots[None, None, :]
        mask = mask & (distance >= 0)
        if window is not None:
            mask = mask & (distance < window)
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
    dropout_rate: float = 0.0,
    dropout_key: PRNGKeyArray | None = None,
) -> Float[Array, "batch q heads dim"]:
    """Softmax attention (grouped-query when there are fewer key/value heads), softmax in
    float32. A query that sees no key (a padding position) attends uniformly instead of
    giving NaN, as transformers' eager attention does. With a `dropout_key`, the attention
    weights are dropped at `dropout_rate` (training mode)."""
    b, sq, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, sq, kv, h // kv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k).astype(jnp.float32) * scale
    scores = jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1)
    weights = dropout(weights, dropout_rate, dropout_key).astype(v.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", weights, v)
    return out.reshape(b, sq, h, v.shape[-1])


class KVCache(eqx.Module):
    """Keys and values of every layer for the tokens seen so far.

    `key`/`value` are `(layers, batch, max_len, kv_heads, head_dim)`; `valid[b, t]` says
    whether slot `t` holds a real token; `index` is the next slot to write.
    """

    key: Float[Array, "layers batch max_len kv_heads head_dim"]
    value: Float[Array, "layers batch max_len kv_heads head_dim"]
    valid: Bool[Array, "batch max_len"]
    index: Int[Array, ""]

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
    """One layer's cache with `k`, `v` written at slot `index` onward."""
    k = lax.dynamic_update_slice_in_dim(cache_k, k.astype(cache_k.dtype), index, axis=1)
    v = lax.dynamic_update_slice_in_dim(cache_v, v.astype(cache_v.dtype), index, axis=1)
    return k, v


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

    def hf_dict(self) -> dict[str, Any]:
        return json.loads(self.raw)


class BaseModelOutput(eqx.Module):
    """A backbone's output: the last hidden state, each block's output with
    `output_hidden_states=True` (stacked, `(layers, batch, seq, dim)`), and the KV cache."""

    last_hidden_state: Float[Array, "batch seq dim"]
    hidden_states: Float[Array, "layers batch seq dim"] | None = None
    cache: KVCache | None = None
    pooler_output: Float[Array, "batch dim"] | None = None


class CausalLMOutput(eqx.Module):
    logits: Float[Array, "batch seq vocab"]
    hidden_states: Float[Array, "layers batch seq dim"] | None = None
    cache: KVCache | None = None


class SequenceClassifierOutput(eqx.Module):
    logits: Float[Array, "batch labels"]
    hidden_states: Float[Array, "layers batch seq dim"] | None = None


class MaskedLMOutput(eqx.Module):
    logits: Float[Array, "batch seq vocab"]
    hidden_states: Float[Array, "layers batch seq dim"] | None = None


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
