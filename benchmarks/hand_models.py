"""Llama and BERT written by hand in plain Equinox, with a hand-written `LoraLinear`: what
a user writes without peftx. `benchmarks/suite.py` times them against the zoo models.

Every linear layer is token-major (`x @ W.T`), the blocks a Python list (unrolled under
`jit`). `from_peft_llama`/`from_peft_bert` copy the weights and LoRA factors of a
`peftx.get_peft_model` result, so the two give the same loss on the same weights.
"""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

import peftx
import peftx.models as pm


class LoraLinear(eqx.Module):
    """`x @ W.T + b + s · (x @ A.T) @ B.T`; `W` frozen, `lora_A`/`lora_B` trained."""

    weight: Float[Array, "out in"]
    bias: Float[Array, " out"] | None
    lora_A: Float[Array, "r in"]
    lora_B: Float[Array, "out r"]
    scaling: float = eqx.field(static=True)

    def __call__(self, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        return y + self.scaling * ((x @ self.lora_A.T) @ self.lora_B.T)


class Dense(eqx.Module):
    """A linear layer without adapter (the head, the pooler)."""

    weight: Float[Array, "out in"]
    bias: Float[Array, " out"] | None

    def __call__(self, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


def _lora(layer: eqx.nn.Linear) -> LoraLinear:
    s = layer.weight  # an AdapterSet holding the "default" LoraArray
    a = s.adapters["default"]
    # alpha / r from the factors' own shape: after `unstack`, the adapter's `Slot` still
    # has the stacked shape, so its `r` and `scaling` properties read the wrong axis
    return LoraLinear(s.weight, layer.bias, a.lora_A, a.lora_B, a.lora_alpha / a.lora_A.shape[0])


def _rms(x: Array, weight: Array, eps: float) -> Array:
    return weight * (x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps))


def _layer_norm(x: Array, weight: Array, bias: Array, eps: float) -> Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * weight + bias


def _attention(q: Array, k: Array, v: Array, causal: bool) -> Array:
    """Softmax attention over `(batch, seq, heads, dim)`; k/v repeated for grouped queries."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        s = q.shape[1]
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


class LlamaLayer(eqx.Module):
    q: LoraLinear
    k: LoraLinear
    v: LoraLinear
    o: LoraLinear
    gate: LoraLinear
    up: LoraLinear
    down: LoraLinear
    ln1: Array
    ln2: Array


class Llama(eqx.Module):
    embed: Array
    layers: list[LlamaLayer]
    norm: Array
    head: Dense
    config: pm.LlamaConfig = eqx.field(static=True)

    def __call__(self, ids: Int[Array, "batch seq"]) -> Float[Array, "batch seq vocab"]:
        c, (b, s) = self.config, ids.shape
        hd, eps = c.head_dim, c.rms_norm_eps
        inv = 1.0 / (dict(c.rope)["rope_theta"] ** (jnp.arange(0, hd, 2) / hd))
        freqs = jnp.arange(s)[:, None] * inv[None, :]
        emb = jnp.concatenate([freqs, freqs], axis=-1)[None, :, None, :]
        cos, sin = jnp.cos(emb).astype(self.embed.dtype), jnp.sin(emb).astype(self.embed.dtype)

        def rope(x: Array) -> Array:
            rotated = jnp.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], axis=-1)
            return x * cos + rotated * sin

        h = self.embed[ids]
        for layer in self.layers:
            x = _rms(h, layer.ln1, eps)
            q = rope(layer.q(x).reshape(b, s, -1, hd))
            k = rope(layer.k(x).reshape(b, s, -1, hd))
            v = layer.v(x).reshape(b, s, -1, hd)
            h = h + layer.o(_attention(q, k, v, causal=True).reshape(b, s, -1))
            x = _rms(h, layer.ln2, eps)
            h = h + layer.down(jax.nn.silu(layer.gate(x)) * layer.up(x))
        return self.head(_rms(h, self.norm, eps))


def from_peft_llama(peft: peftx.PeftModel) -> Llama:
    """The hand-written Llama on the weights and factors of a LoRA'd zoo `LlamaForCausalLM`."""
    zoo = peft.base_model
    layers = [
        LlamaLayer(
            *(_lora(getattr(blk.self_attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
            *(_lora(getattr(blk.mlp, n)) for n in ("gate_proj", "up_proj", "down_proj")),
            blk.input_layernorm.weight,
            blk.post_attention_layernorm.weight,
        )
        for blk in pm.unstack(zoo.model.layers)
    ]
    return Llama(
        zoo.model.embed_tokens.weight,
        layers,
        zoo.model.norm.weight,
        Dense(zoo.lm_head.weight, None),
        zoo.config,
    )


class BertLayer(eqx.Module):
    q: LoraLinear
    k: LoraLinear
    v: LoraLinear
    o: LoraLinear
    intermediate: LoraLinear
    output: LoraLinear
    ln1: tuple[Array, Array]
    ln2: tuple[Array, Array]


class Bert(eqx.Module):
    word: Array
    position: Array
    token_type: Array
    ln: tuple[Array, Array]
    layers: list[BertLayer]
    pooler: Dense
    classifier: Dense
    config: pm.BertConfig = eqx.field(static=True)

    def __call__(self, ids: Int[Array, "batch seq"]) -> Float[Array, "batch labels"]:
        c, (b, s) = self.config, ids.shape
        eps, hd = c.layer_norm_eps, c.hidden_size // c.num_attention_heads
        h = self.word[ids] + self.token_type[0] + self.position[:s]
        h = _layer_norm(h, *self.ln, eps)
        for layer in self.layers:
            q, k, v = (f(h).reshape(b, s, -1, hd) for f in (layer.q, layer.k, layer.v))
            h = _layer_norm(
                layer.o(_attention(q, k, v, False).reshape(b, s, -1)) + h, *layer.ln1, eps
            )
            x = jax.nn.gelu(layer.intermediate(h), approximate=False)
            h = _layer_norm(layer.output(x) + h, *layer.ln2, eps)
        return self.classifier(jnp.tanh(self.pooler(h[:, 0])))


def from_peft_bert(peft: peftx.PeftModel) -> Bert:
    """The hand-written BERT on the weights and factors of a LoRA'd zoo
    `BertForSequenceClassification` (its trained classifier copy included)."""
    bert = peft.base_model.bert
    e = bert.embeddings
    layers = [
        BertLayer(
            _lora(blk.attention.self.query),
            _lora(blk.attention.self.key),
            _lora(blk.attention.self.value),
            _lora(blk.attention.output.dense),
            _lora(blk.intermediate.dense),
            _lora(blk.output.dense),
            (blk.attention.output.LayerNorm.weight, blk.attention.output.LayerNorm.bias),
            (blk.output.LayerNorm.weight, blk.output.LayerNorm.bias),
        )
        for blk in pm.unstack(bert.encoder.layer)
    ]
    classifier = peft.saved_modules["default"]["classifier"]
    return Bert(
        e.word_embeddings.weight,
        e.position_embeddings.weight,
        e.token_type_embeddings.weight,
        (e.LayerNorm.weight, e.LayerNorm.bias),
        layers,
        Dense(bert.pooler.dense.weight, bert.pooler.dense.bias),
        Dense(classifier.weight, classifier.bias),
        bert.config,
    )


def lora_spec(model: Any) -> Any:
    """Trainable = the LoRA factors and the classifier, for `eqx.partition`."""

    def trainable(path: tuple[Any, ...], leaf: Any) -> bool:
        names = [getattr(p, "name", None) for p in path]
        return eqx.is_array(leaf) and (names[-1] in ("lora_A", "lora_B") or "classifier" in names)

    return jax.tree_util.tree_map_with_path(trainable, model)
