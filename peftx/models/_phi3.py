"""Phi-3 in Equinox, named as transformers names it (`transformers/models/phi3/
modeling_phi3.py`): the Llama block with the query, key and value projections fused into
`qkv_proj` and the gate and up projections into `gate_up_proj`, rotary embeddings on the
first `partial_rotary_factor` of each head's features, LongRoPE (short factors within
`original_max_position_embeddings`, long ones beyond) and one sliding window on every
layer."""

import dataclasses
import json
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._dtypes import float_dtype
from ._checkpoint import Architecture, register
from ._common import (
    COMMON_CHECKS,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_WIDTH,
    STRING,
    BaseModelOutput,
    CausalLMOutput,
    Check,
    HFConfig,
    KVCache,
    LogicalAxesTable,
    RMSNorm,
    SequenceClassifierOutput,
    activation,
    check_values,
    decoder_positions,
    dot_product_attention,
    embed,
    fresh_lm_head,
    fresh_score,
    integer,
    last_token_scores,
    linear,
    lm_logits,
    mapping,
    normal_linear,
    number,
    with_num_labels,
    write_cache,
)
from ._llama import ROPE_CHECKS, apply_rope, attention_mask_for, rope_tables
from ._stack import LayerStack, Layout, RematPolicy, checkpoint_policy, make_layers, run_layers

ROPE_TYPES = ("default", "longrope")


@dataclasses.dataclass(frozen=True)
class Phi3Config(HFConfig):
    """A Phi-3 `config.json`, as the fields the model uses.

    `rope` holds the `rope_parameters` as sorted pairs (lists as tuples), without
    `original_max_position_embeddings`: transformers reads that from the top-level field
    of the same name, which `rope_parameters` adds back for `longrope`. `head_dim` is
    `hidden_size // num_attention_heads` unless the config.json names one.
    """

    LOGICAL_AXES: ClassVar[LogicalAxesTable] = (
        (r"embed_tokens\.weight|lm_head\.weight", ("vocab", "embed")),
        (r"qkv_proj\.weight", ("heads", "embed")),
        (r"o_proj\.weight", ("embed", "heads")),
        (r"gate_up_proj\.weight", ("mlp", "embed")),
        (r"down_proj\.weight", ("embed", "mlp")),
        (r"score\.weight", (None, "embed")),
        (r"(input_layernorm|post_attention_layernorm|norm)\.weight", ("embed",)),
    )

    model_type: str = "phi3"
    vocab_size: int = 32064
    hidden_size: int = 3072
    intermediate_size: int = 8192
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope: tuple[tuple[str, Any], ...] = (
        ("partial_rotary_factor", 1.0),
        ("rope_theta", 10000.0),
        ("rope_type", "default"),
    )
    sliding_window: int | None = None
    num_labels: int = 2
    pad_token_id: int | None = 32000
    initializer_range: float = 0.02

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("phi3",)
    CHECKS: ClassVar[dict[str, Check]] = {
        **COMMON_CHECKS,
        "hidden_size": integer(1, MAX_WIDTH),
        "intermediate_size": integer(1, MAX_WIDTH),
        "num_hidden_layers": integer(1, MAX_LAYERS),
        "num_attention_heads": integer(1, MAX_WIDTH),
        "num_key_value_heads": integer(1, MAX_WIDTH, null=True),
        "head_dim": integer(1, MAX_WIDTH, null=True),
        "hidden_act": STRING,
        "max_position_embeddings": integer(1, MAX_POSITIONS),
        # LongRoPE's default scale divides by its logarithm
        "original_max_position_embeddings": integer(2, MAX_POSITIONS),
        "rms_norm_eps": number(0),
        "rope_theta": number(0, open_low=True),
        "partial_rotary_factor": number(0, 1, open_low=True),
        "rope_scaling": mapping(),
        "rope_parameters": mapping(),
        "sliding_window": integer(1, MAX_POSITIONS, null=True),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        head_dim = f"head_dim ({self.head_dim})"
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // heads)
            head_dim = f"hidden_size ({self.hidden_size}) // num_attention_heads ({heads})"
        if heads % kv:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                f"({kv}): each key/value head serves the same number of query heads."
            )
        rope = self.rope_parameters
        check_values(rope, ROPE_CHECKS, "rope_parameters.")
        if rope["rope_type"] not in ROPE_TYPES:
            raise ValueError(
                f"rope type {rope['rope_type']!r} is not supported for phi3; supported: "
                f"{ROPE_TYPES}."
            )
        rotary = int(self.head_dim * rope.get("partial_rotary_factor", 1.0))
        if rotary < 2 or rotary % 2:
            raise ValueError(
                f"{head_dim} times partial_rotary_factor gives {rotary} rotary features; "
                "rotary embeddings turn pairs of features, so it must be even and at least 2."
            )
        if rope["rope_type"] == "longrope":
            for name in ("short_factor", "long_factor"):
                factors = rope.get(name)
                if factors is None or len(factors) != rotary // 2:
                    raise ValueError(
                        f"rope_parameters.{name} must list one factor per rotary frequency "
                        f"({rotary // 2}: half of {rotary} rotary features), got "
                        f"{'none' if factors is None else len(factors)}."
                    )
        activation(self.hidden_act)

    @classmethod
    def from_hf_config(cls, config: Any) -> "Phi3Config":
        """From a `config.json` dict or a `transformers` config object."""
        d = config if isinstance(config, dict) else config.to_dict()
        cls.check_hf(d)
        model_type = d.get("model_type", "phi3")
        if model_type not in cls.MODEL_TYPES:
            raise ValueError(f"Phi3Config reads model types {cls.MODEL_TYPES}, got {model_type!r}.")
        # transformers' `Phi3Config.convert_rope_params_to_dict`: `rope_scaling` over
        # `rope_parameters`, theta and the rotary fraction from beside the dict where it
        # has none, the old names "su" and "yarn" meaning longrope
        source = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
        rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
        check_values(rope, ROPE_CHECKS, f"{source}.")
        rope.setdefault("rope_theta", d.get("rope_theta", 10000.0))
        rope.setdefault("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        legacy = rope.pop("type", None)
        rope.setdefault("rope_type", legacy or "default")
        if rope["rope_type"] in ("su", "yarn"):
            rope["rope_type"] = "longrope"
        rope.pop("original_max_position_embeddings", None)  # the top-level field wins
        rope = {k: tuple(v) if isinstance(v, list) else v for k, v in rope.items()}
        heads = d.get("num_attention_heads", 32)
        n_labels = len(d["id2label"]) if d.get("id2label") else d.get("num_labels", 2)
        return cls(
            raw=json.dumps(d, sort_keys=True),
            model_type=model_type,
            vocab_size=d.get("vocab_size", 32064),
            hidden_size=d.get("hidden_size", 3072),
            intermediate_size=d.get("intermediate_size", 8192),
            num_hidden_layers=d.get("num_hidden_layers", 32),
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or None,
            hidden_act=d.get("hidden_act", "silu"),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            original_max_position_embeddings=d.get("original_max_position_embeddings", 4096),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            rope=tuple(sorted(rope.items())),
            sliding_window=d.get("sliding_window"),
            num_labels=int(n_labels),
            pad_token_id=d.get("pad_token_id", 32000),
            initializer_range=d.get("initializer_range", 0.02),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` dict transformers reads back to this architecture."""
        d = self.hf_dict()
        for old in ("rope_scaling", "rope_theta", "partial_rotary_factor"):
            d.pop(old, None)  # all in rope_parameters now
        rope = {k: list(v) if isinstance(v, tuple) else v for k, v in self.rope_parameters.items()}
        d.update(
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            original_max_position_embeddings=self.original_max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_parameters=rope,
            sliding_window=self.sliding_window,
            pad_token_id=self.pad_token_id,
            initializer_range=self.initializer_range,
        )
        if len(d.get("id2label") or {}) != self.num_labels:
            d["id2label"] = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
            d["label2id"] = {f"LABEL_{i}": i for i in range(self.num_labels)}
        return d

    @property
    def rope_parameters(self) -> dict[str, Any]:
        rope = dict(self.rope)
        if rope.get("rope_type") == "longrope":
            rope["original_max_position_embeddings"] = self.original_max_position_embeddings
        return rope

    @property
    def longrope_switch(self) -> int | None:
        """With LongRoPE, the length past which the long factors replace the short ones
        (`original_max_position_embeddings`); None with the default rope."""
        return self.rope_parameters.get("original_max_position_embeddings")


def apply_partial_rope(
    x: Float[Array, "batch seq heads dim"], cos: Array, sin: Array
) -> Float[Array, "batch seq heads dim"]:
    """`apply_rope` on the first `cos.shape[-1]` features of each head; the others pass
    unchanged, as transformers' phi3 `apply_rotary_pos_emb` does."""
    rotary = cos.shape[-1]
    return jnp.concatenate([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], axis=-1)


class Phi3Attention(eqx.Module):
    qkv_proj: eqx.nn.Linear  # the query, key and value rows, in that order
    o_proj: eqx.nn.Linear

    def __init__(self, config: Phi3Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        c, std = config, config.initializer_range
        kqkv, ko = jax.random.split(key)
        d, h, kvh, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.qkv_proj = normal_linear(d, (h + 2 * kvh) * hd, False, kqkv, std, dtype)
        self.o_proj = normal_linear(h * hd, d, False, ko, std, dtype)


class Phi3MLP(eqx.Module):
    gate_up_proj: eqx.nn.Linear  # the gate rows, then the up rows
    down_proj: eqx.nn.Linear

    def __init__(self, config: Phi3Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        c, std = config, config.initializer_range
        kgu, kd = jax.random.split(key)
        self.gate_up_proj = normal_linear(
            c.hidden_size, 2 * c.intermediate_size, False, kgu, std, dtype
        )
        self.down_proj = normal_linear(c.intermediate_size, c.hidden_size, False, kd, std, dtype)


class Phi3DecoderLayer(eqx.Module):
    self_attn: Phi3Attention
    mlp: Phi3MLP
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def __init__(self, config: Phi3Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        ka, km = jax.random.split(key)
        self.self_attn = Phi3Attention(config, key=ka, dtype=dtype)
        self.mlp = Phi3MLP(config, key=km, dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype
        )


class Phi3Model(eqx.Module):
    """The decoder stack: embeddings, blocks, final norm."""

    embed_tokens: eqx.nn.Embedding
    layers: LayerStack | tuple[Phi3DecoderLayer, ...]
    norm: RMSNorm
    config: Phi3Config = eqx.field(static=True)
    gradient_checkpointing: bool = eqx.field(static=True)
    remat_policy: RematPolicy = eqx.field(static=True)

    def __init__(
        self,
        config: Phi3Config,
        *,
        key: PRNGKeyArray,
        layout: Layout = "stacked",
        dtype: Any = jnp.float32,
        gradient_checkpointing: bool = False,
        remat_policy: RematPolicy = None,
    ):
        checkpoint_policy(remat_policy)  # an unknown name fails here, not at a call
        dtype = float_dtype(dtype)
        ke, kl = jax.random.split(key)
        weight = config.initializer_range * jax.random.normal(
            ke, (config.vocab_size, config.hidden_size), dtype
        )
        self.embed_tokens = eqx.nn.Embedding(weight=weight)
        self.layers = make_layers(Phi3DecoderLayer, config, layout, kl, dtype)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.config = config
        self.gradient_checkpointing = gradient_checkpointing
        self.remat_policy = remat_policy

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"],
        attention_mask: Int[Array, "batch seq"] | None = None,
        position_ids: Int[Array, "batch seq"] | None = None,
        *,
        cache: KVCache | None = None,
        output_hidden_states: bool = False,
    ) -> BaseModelOutput:
        """Hidden states for `input_ids`, as `LlamaModel`'s (padding, positions, cache).

        With LongRoPE, the call's largest position decides between the short and the long
        factors for all its tokens, as in transformers; cached keys keep the factors they
        were rotated with (`generate` recomputes them when the sequence crosses over, as
        transformers' `generate` does).
        """
        c = self.config
        slots, key_valid, index, position_ids, segments = decoder_positions(
            input_ids, attention_mask, position_ids, cache
        )
        b, s = input_ids.shape
        h = embed(self.embed_tokens, input_ids)
        cos, sin = rope_tables(c, position_ids, h.dtype)
        window = jnp.asarray(c.sliding_window or 2**30)
        mask = attention_mask_for(slots, key_valid, window, segments)
        scale = c.head_dim**-0.5
        act = activation(c.hidden_act)
        heads, kv_heads, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim

        def step(layer: Phi3DecoderLayer, h: Array, kv: Any) -> tuple[Array, Any]:
            x = layer.input_layernorm(h)
            attn = layer.self_attn
            q, k, v = jnp.split(
                linear(attn.qkv_proj, x), [heads * hd, (heads + kv_heads) * hd], axis=-1
            )
            q = apply_partial_rope(q.reshape(b, s, heads, hd), cos, sin)
            k = apply_partial_rope(k.reshape(b, s, kv_heads, hd), cos, sin)
            v = v.reshape(b, s, kv_heads, hd)
            new_kv = None
            if kv is not None:
                k, v = new_kv = write_cache(kv[0], kv[1], k, v, index)
            o = dot_product_attention(q, k, v, mask, scale).reshape(b, s, -1)
            h = h + linear(attn.o_proj, o)
            x = layer.post_attention_layernorm(h)
            gate, up = jnp.split(linear(layer.mlp.gate_up_proj, x), 2, axis=-1)
            h = h + linear(layer.mlp.down_proj, up * act(gate))
            return h, (h if output_hidden_states else None, new_kv)

        kv_in = None if cache is None else (cache.key, cache.value)
        h, (hidden, kv_out) = run_layers(
            self.layers,
            step,
            h,
            kv_in,
            gradient_checkpointing=self.gradient_checkpointing,
            remat_policy=self.remat_policy,
        )
        new_cache = None
        if cache is not None:
            new_cache = KVCache(kv_out[0], kv_out[1], key_valid, cache.index + s)
        return BaseModelOutput(self.norm(h), hidden, new_cache)


class Phi3ForCausalLM(eqx.Module):
    """`Phi3Model` with the language-model head (tied to the embeddings when the config
    says so: then `lm_head` is None)."""

    model: Phi3Model
    lm_head: eqx.nn.Linear | None

    def __init__(self, config: Phi3Config, *, key: PRNGKeyArray, **kwargs: Any):
        km, kh = jax.random.split(key)
        self.model = Phi3Model(config, key=km, **kwargs)
        dtype = kwargs.get("dtype", jnp.float32)
        self.lm_head = fresh_lm_head(config, kh, dtype)

    @property
    def config(self) -> Phi3Config:
        return self.model.config

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"],
        attention_mask: Int[Array, "batch seq"] | None = None,
        position_ids: Int[Array, "batch seq"] | None = None,
        *,
        cache: KVCache | None = None,
        output_hidden_states: bool = False,
    ) -> CausalLMOutput:
        out = self.model(
            input_ids,
            attention_mask,
            position_ids,
            cache=cache,
            output_hidden_states=output_hidden_states,
        )
        logits = lm_logits(self.model.embed_tokens, self.lm_head, out.last_hidden_state)
        return CausalLMOutput(logits, out.hidden_states, out.cache)


class Phi3ForSequenceClassification(eqx.Module):
    """`Phi3Model` with `score`, read at each sequence's last non-padding token.
    `num_labels` overrides the config's."""

    model: Phi3Model
    score: eqx.nn.Linear

    def __init__(
        self,
        config: Phi3Config,
        *,
        key: PRNGKeyArray,
        num_labels: int | None = None,
        **kwargs: Any,
    ):
        km, kh = jax.random.split(key)
        config = with_num_labels(config, num_labels)
        self.model = Phi3Model(config, key=km, **kwargs)
        dtype = kwargs.get("dtype", jnp.float32)
        self.score = fresh_score(config, kh, dtype)

    @property
    def config(self) -> Phi3Config:
        return self.model.config

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"],
        attention_mask: Int[Array, "batch seq"] | None = None,
        position_ids: Int[Array, "batch seq"] | None = None,
        *,
        output_hidden_states: bool = False,
    ) -> SequenceClassifierOutput:
        out = self.model(
            input_ids, attention_mask, position_ids, output_hidden_states=output_hidden_states
        )
        h = out.last_hidden_state
        pooled = last_token_scores(self.score, h, input_ids, self.config.pad_token_id)
        return SequenceClassifierOutput(pooled, out.hidden_states)


register(
    "phi3",
    Architecture(
        config_class=Phi3Config,
        classes={
            "Phi3Model": Phi3Model,
            "Phi3ForCausalLM": Phi3ForCausalLM,
            "Phi3ForSequenceClassification": Phi3ForSequenceClassification,
        },
        default="Phi3Model",
        prefix="model",
        new_heads=(r"score\.weight",),
        ignored=(r".*rotary_emb\.inv_freq", r"lm_head\.weight"),
    ),
)
