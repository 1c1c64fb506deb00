"""The Gemma family in Equinox, named as transformers names it.

Gemma 2 (`transformers/models/gemma2/modeling_gemma2.py`): the Llama family's attention
with norms before and after both attention and the MLP, RMSNorm scaling by `1 + w`,
GeGLU, attention scaled by `query_pre_attn_scalar`, soft-capped attention and output
logits, sliding windows on alternate layers and embeddings scaled by √hidden.

Gemma 3's text model (`transformers/models/gemma3/modeling_gemma3.py`,
`configuration_gemma3.py`) is Gemma 2 with each head's queries and keys RMS-normalized
(`1 + w`) before the rotary embedding, five sliding layers to each global one by
default, rope parameters of their own on the sliding layers, and no soft-caps by
default; as transformers' modular file builds Gemma 3 on Gemma 2, its classes here are
Gemma 2's with those config fields.
"""

import dataclasses
import json
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
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
    SequenceClassifierOutput,
    activation,
    check_values,
    decoder_positions,
    dot_product_attention,
    embed,
    flag,
    fresh_lm_head,
    fresh_score,
    integer,
    last_token_scores,
    linear,
    lm_logits,
    mapping,
    normal_linear,
    number,
    strings,
    with_num_labels,
    write_cache,
)
from ._llama import ROPE_CHECKS, apply_rope, attention_mask_for, rope_tables
from ._stack import LayerStack, Layout, RematPolicy, checkpoint_policy, make_layers, run_layers


@dataclasses.dataclass(frozen=True)
class Gemma2Config(HFConfig):
    """A Gemma 2 `config.json`, as the fields the model uses.

    `sliding_windows` is each layer's window (None: full attention), from `layer_types`
    (by default every other layer, the first included, slides); `rope` holds the
    `rope_parameters` as sorted pairs (Gemma 2 uses the default rope only).
    """

    # whether each head's queries and keys are RMS-normalized (`q_norm`, `k_norm`)
    QK_NORM: ClassVar[bool] = False
    ROPE_TYPES: ClassVar[tuple[str, ...]] = ("default",)

    LOGICAL_AXES: ClassVar[LogicalAxesTable] = (
        (r"embed_tokens\.weight|lm_head\.weight", ("vocab", "embed")),
        (r"[qkv]_proj\.weight", ("heads", "embed")),
        (r"[qkv]_proj\.bias", ("heads",)),
        (r"o_proj\.weight", ("embed", "heads")),
        (r"(gate|up)_proj\.weight", ("mlp", "embed")),
        (r"down_proj\.weight", ("embed", "mlp")),
        (r"score\.weight", (None, "embed")),
        (r"[qk]_norm\.weight", (None,)),  # over one head's features: kept whole
        (r"(\w*layernorm|norm)\.weight|o_proj\.bias", ("embed",)),
    )

    model_type: str = "gemma2"
    vocab_size: int = 256000
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    query_pre_attn_scalar: int = 256
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0
    rope: tuple[tuple[str, Any], ...] = (("rope_theta", 10000.0), ("rope_type", "default"))
    sliding_windows: tuple[int | None, ...] = ()
    num_labels: int = 2
    pad_token_id: int | None = 0
    initializer_range: float = 0.02

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("gemma2",)
    CHECKS: ClassVar[dict[str, Check]] = {
        **COMMON_CHECKS,
        "hidden_size": integer(1, MAX_WIDTH),
        "intermediate_size": integer(1, MAX_WIDTH),
        "num_hidden_layers": integer(1, MAX_LAYERS),
        "num_attention_heads": integer(1, MAX_WIDTH),
        "num_key_value_heads": integer(1, MAX_WIDTH, null=True),
        "head_dim": integer(1, MAX_WIDTH),
        "hidden_activation": STRING,
        "max_position_embeddings": integer(1, MAX_POSITIONS),
        "rms_norm_eps": number(0),
        "rope_theta": number(0, open_low=True),
        "rope_parameters": mapping(),
        "attention_bias": flag(),
        "query_pre_attn_scalar": integer(1, MAX_WIDTH),
        "attn_logit_softcapping": number(0, open_low=True, null=True),
        "final_logit_softcapping": number(0, open_low=True, null=True),
        "sliding_window": integer(1, MAX_POSITIONS, null=True),
        "layer_types": strings(),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads % kv:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                f"({kv}): each key/value head serves the same number of query heads."
            )
        for rope in (self.rope_parameters, self.sliding_rope_parameters):
            check_values(rope, ROPE_CHECKS, "rope_parameters.")
            kind = rope.get("rope_type", "default")
            if kind not in self.ROPE_TYPES:
                raise ValueError(
                    f"rope type {kind!r} is not supported for {self.model_type}; supported: "
                    f"{self.ROPE_TYPES}."
                )
            if kind == "linear" and rope.get("factor") is None:
                raise ValueError("linear rope needs a 'factor' (positions are divided by it).")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even: RoPE turns pairs.")
        if self.sliding_windows and len(self.sliding_windows) != self.num_hidden_layers:
            raise ValueError(
                f"sliding_windows has {len(self.sliding_windows)} entries for "
                f"num_hidden_layers={self.num_hidden_layers}; give one per layer, or ()."
            )
        activation(self.hidden_activation)

    @classmethod
    def from_hf_config(cls, config: Any) -> "Gemma2Config":
        """From a `config.json` dict or a `transformers` config object."""
        d = config if isinstance(config, dict) else config.to_dict()
        cls.check_hf(d)
        model_type = d.get("model_type", "gemma2")
        if model_type not in cls.MODEL_TYPES:
            raise ValueError(
                f"Gemma2Config reads model types {cls.MODEL_TYPES}, got {model_type!r}."
            )
        rope = dict(d.get("rope_parameters") or {})
        rope.setdefault("rope_theta", d.get("rope_theta", 10000.0))
        rope.setdefault("rope_type", "default")
        types = d.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(d.get("num_hidden_layers", 26))
        ]
        return cls._read(d, types, rope=tuple(sorted(rope.items())))

    @classmethod
    def _read(cls, d: dict[str, Any], layer_types: list[str], **fields: Any) -> "Gemma2Config":
        """`cls` from the checked `config.json` dict `d`, its `layer_types` resolved and
        `fields` (the rope) given; a key `d` lacks takes `cls`'s default."""
        default = {f.name: f.default for f in dataclasses.fields(cls)}

        def get(name: str) -> Any:
            return d.get(name, default[name])

        layers = get("num_hidden_layers")
        if len(layer_types) != layers:
            raise ValueError(
                f"layer_types has {len(layer_types)} entries for num_hidden_layers={layers}; "
                "give one per layer."
            )
        window = d.get("sliding_window", 4096)
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        n_labels = len(d["id2label"]) if d.get("id2label") else d.get("num_labels", 2)
        heads = get("num_attention_heads")
        return cls(
            raw=json.dumps(d, sort_keys=True),
            model_type=get("model_type"),
            vocab_size=get("vocab_size"),
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=get("head_dim"),
            hidden_activation=get("hidden_activation"),
            max_position_embeddings=get("max_position_embeddings"),
            rms_norm_eps=get("rms_norm_eps"),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            attention_bias=bool(get("attention_bias")),
            query_pre_attn_scalar=get("query_pre_attn_scalar"),
            attn_logit_softcapping=_float_or_none(get("attn_logit_softcapping")),
            final_logit_softcapping=_float_or_none(get("final_logit_softcapping")),
            sliding_windows=windows if any(windows) else (),
            num_labels=int(n_labels),
            pad_token_id=get("pad_token_id"),
            initializer_range=get("initializer_range"),
            **fields,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` dict transformers reads back to this architecture."""
        windows = {w for w in self.sliding_windows if w is not None}
        if len(windows) > 1:
            raise ValueError(
                f"sliding_windows {self.sliding_windows} mix window sizes; transformers' "
                "gemma2 config holds one sliding_window."
            )
        d = self.hf_dict()
        d.pop("rope_theta", None)
        d.update(
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_activation=self.hidden_activation,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias,
            query_pre_attn_scalar=self.query_pre_attn_scalar,
            attn_logit_softcapping=self.attn_logit_softcapping,
            final_logit_softcapping=self.final_logit_softcapping,
            rope_parameters=dict(self.rope),
            sliding_window=windows.pop() if windows else None,
            layer_types=[
                "full_attention" if w is None else "sliding_attention"
                for w in self.sliding_windows or (None,) * self.num_hidden_layers
            ],
            pad_token_id=self.pad_token_id,
            initializer_range=self.initializer_range,
        )
        if len(d.get("id2label") or {}) != self.num_labels:
            d["id2label"] = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
            d["label2id"] = {f"LABEL_{i}": i for i in range(self.num_labels)}
        return d

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """The rope parameters of the global (full-attention) layers."""
        return dict(self.rope)

    @property
    def sliding_rope_parameters(self) -> dict[str, Any]:
        """The rope parameters of the sliding-window layers: Gemma 2's are the global ones."""
        return self.rope_parameters


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class Gemma3TextConfig(Gemma2Config):
    """A Gemma 3 text `config.json` (`gemma3_text`), as the fields the model uses; also
    the text part (`text_config`) of a multimodal `gemma3` one.

    Gemma 2's fields, with Gemma 3's defaults, plus `sliding_rope`: the sliding layers'
    `rope_parameters` as sorted pairs (`rope` holds the global layers'). transformers'
    older spellings are read as it reads them: `sliding_window_pattern` (every n-th layer
    global, when there are no `layer_types`), `rope_theta` and `rope_local_base_freq`
    (the global and sliding layers' bases) and `rope_scaling` (the global layers'). Rope
    types `default` and `linear` are supported.
    """

    QK_NORM: ClassVar[bool] = True
    ROPE_TYPES: ClassVar[tuple[str, ...]] = ("default", "linear")

    model_type: str = "gemma3_text"
    vocab_size: int = 262208
    max_position_embeddings: int = 131072
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope: tuple[tuple[str, Any], ...] = (("rope_theta", 1e6), ("rope_type", "default"))
    sliding_rope: tuple[tuple[str, Any], ...] = (("rope_theta", 1e4), ("rope_type", "default"))

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("gemma3_text", "gemma3")
    CHECKS: ClassVar[dict[str, Check]] = {
        **Gemma2Config.CHECKS,
        "rope_scaling": mapping(),
        "rope_local_base_freq": number(0, open_low=True),
        "sliding_window_pattern": integer(1, MAX_LAYERS),
        "use_bidirectional_attention": flag(),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model_type != "gemma3_text":
            raise ValueError(
                f"Gemma3TextConfig's model_type is 'gemma3_text', got {self.model_type!r} (a "
                "multimodal 'gemma3' config.json is read with from_hf_config)."
            )

    @classmethod
    def from_hf_config(cls, config: Any) -> "Gemma3TextConfig":
        """From a `config.json` dict or a `transformers` config object: a `gemma3_text`
        one, or a multimodal `gemma3` one, whose `text_config` it reads (with the
        top-level `tie_word_embeddings`, and no final soft-cap: transformers'
        `Gemma3ForConditionalGeneration` applies none)."""
        d = config if isinstance(config, dict) else config.to_dict()
        model_type = d.get("model_type", "gemma3_text")
        if model_type not in cls.MODEL_TYPES:
            raise ValueError(
                f"Gemma3TextConfig reads model types {cls.MODEL_TYPES}, got {model_type!r}."
            )
        if model_type == "gemma3":
            check_values(d, {"text_config": mapping(), "tie_word_embeddings": flag()})
            d = {
                **(d.get("text_config") or {}),
                "model_type": "gemma3_text",
                "tie_word_embeddings": d.get("tie_word_embeddings", True),
                "final_logit_softcapping": None,
            }
        cls.check_hf(d)
        if d.get("use_bidirectional_attention"):
            raise ValueError(
                "use_bidirectional_attention=True (text tokens attending both ways, as in "
                "EmbeddingGemma) is not supported: peftx's Gemma 3 attends causally. Set it "
                "to false."
            )
        layers = d.get("num_hidden_layers", 26)
        pattern = d.get("sliding_window_pattern", 6)
        types = d.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types has {unknown}; each must be one of {LAYER_TYPES}.")
        rope = dict(d.get("rope_parameters") or {})
        flat = sorted(set(rope) - set(LAYER_TYPES))
        if flat:
            raise ValueError(
                f"rope_parameters has the keys {flat}; gemma3_text's holds one dict per layer "
                f"type, {LAYER_TYPES} (transformers ignores other keys)."
            )
        check_values(rope, dict.fromkeys(LAYER_TYPES, mapping()), "rope_parameters.")
        full = dict(rope.get("full_attention") or {"rope_type": "default"})
        full.update(d.get("rope_scaling") or {})
        full.setdefault("rope_theta", d.get("rope_theta", 1e6))
        sliding = dict(rope.get("sliding_attention") or {"rope_type": "default"})
        sliding.setdefault("rope_theta", d.get("rope_local_base_freq", 1e4))
        for layer_type, p in (("full_attention", full), ("sliding_attention", sliding)):
            check_values(p, ROPE_CHECKS, f"rope_parameters.{layer_type}.")
            p.setdefault("rope_type", p.get("type", "default"))
            legacy = p.pop("type", p["rope_type"])
            if legacy != p["rope_type"]:
                raise ValueError(
                    f"the {layer_type} rope has 'type' {legacy!r} beside 'rope_type' "
                    f"{p['rope_type']!r}; transformers' Gemma3TextConfig runs 'rope_type' and "
                    "ignores the old 'type' key (in rope_scaling too). Write 'rope_type'."
                )
        return cls._read(
            d, types, rope=tuple(sorted(full.items())), sliding_rope=tuple(sorted(sliding.items()))
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` dict transformers reads back to this architecture (always a
        `gemma3_text` one, also for the text part of a multimodal checkpoint)."""
        d = super().to_hf_config()
        d["rope_parameters"] = {
            "full_attention": dict(self.rope),
            "sliding_attention": dict(self.sliding_rope),
        }
        for old in ("rope_scaling", "rope_local_base_freq", "sliding_window_pattern"):
            d.pop(old, None)  # spelled out by rope_parameters and layer_types
        return d

    @property
    def sliding_rope_parameters(self) -> dict[str, Any]:
        return dict(self.sliding_rope)


class Gemma2RMSNorm(eqx.Module):
    """Gemma's RMSNorm: normalized and scaled by `1 + weight` in float32, then rounded to
    the input dtype (Llama's rounds before scaling). The weight starts at zero."""

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float, *, dtype: Any = jnp.float32):
        self.weight = jnp.zeros((dim,), dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        h = x.astype(jnp.float32)
        h = h * lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + self.eps)
        row = (1,) * (x.ndim - 1) + (-1,)  # explicit, for rank promotion "raise"
        return (h * (1.0 + self.weight.astype(jnp.float32).reshape(row))).astype(x.dtype)


class Gemma2Attention(eqx.Module):
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    q_norm: Gemma2RMSNorm | None  # Gemma 3's, over each head's features; None in Gemma 2
    k_norm: Gemma2RMSNorm | None

    def __init__(self, config: Gemma2Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        c, std, bias = config, config.initializer_range, config.attention_bias
        kq, kk, kv, ko = jax.random.split(key, 4)
        d, h, kvh, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = normal_linear(d, h * hd, bias, kq, std, dtype)
        self.k_proj = normal_linear(d, kvh * hd, bias, kk, std, dtype)
        self.v_proj = normal_linear(d, kvh * hd, bias, kv, std, dtype)
        self.o_proj = normal_linear(h * hd, d, bias, ko, std, dtype)
        self.q_norm = self.k_norm = None
        if c.QK_NORM:
            self.q_norm = Gemma2RMSNorm(hd, c.rms_norm_eps, dtype=dtype)
            self.k_norm = Gemma2RMSNorm(hd, c.rms_norm_eps, dtype=dtype)


class Gemma2MLP(eqx.Module):
    gate_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear

    def __init__(self, config: Gemma2Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        c, std = config, config.initializer_range
        kg, ku, kd = jax.random.split(key, 3)
        self.gate_proj = normal_linear(c.hidden_size, c.intermediate_size, False, kg, std, dtype)
        self.up_proj = normal_linear(c.hidden_size, c.intermediate_size, False, ku, std, dtype)
        self.down_proj = normal_linear(c.intermediate_size, c.hidden_size, False, kd, std, dtype)


class Gemma2DecoderLayer(eqx.Module):
    self_attn: Gemma2Attention
    mlp: Gemma2MLP
    input_layernorm: Gemma2RMSNorm
    post_attention_layernorm: Gemma2RMSNorm
    pre_feedforward_layernorm: Gemma2RMSNorm
    post_feedforward_layernorm: Gemma2RMSNorm

    def __init__(self, config: Gemma2Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        ka, km = jax.random.split(key)
        self.self_attn = Gemma2Attention(config, key=ka, dtype=dtype)
        self.mlp = Gemma2MLP(config, key=km, dtype=dtype)

        def norm() -> Gemma2RMSNorm:
            return Gemma2RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()


class Gemma2Model(eqx.Module):
    """The decoder stack: scaled embeddings, blocks, final norm."""

    CONFIG: ClassVar[type[Gemma2Config]] = Gemma2Config

    embed_tokens: eqx.nn.Embedding
    layers: LayerStack | tuple[Gemma2DecoderLayer, ...]
    norm: Gemma2RMSNorm
    config: Gemma2Config = eqx.field(static=True)
    gradient_checkpointing: bool = eqx.field(static=True)
    remat_policy: RematPolicy = eqx.field(static=True)

    def __init__(
        self,
        config: Gemma2Config,
        *,
        key: PRNGKeyArray,
        layout: Layout = "stacked",
        dtype: Any = jnp.float32,
        gradient_checkpointing: bool = False,
        remat_policy: RematPolicy = None,
    ):
        if type(config) is not self.CONFIG:
            raise TypeError(
                f"{type(self).__name__} is built from a {self.CONFIG.__name__}, got a "
                f"{type(config).__name__}; use that config's own model class."
            )
        checkpoint_policy(remat_policy)  # an unknown name fails here, not at a call
        dtype = float_dtype(dtype)
        ke, kl = jax.random.split(key)
        weight = config.initializer_range * jax.random.normal(
            ke, (config.vocab_size, config.hidden_size), dtype
        )
        self.embed_tokens = eqx.nn.Embedding(weight=weight)
        self.layers = make_layers(Gemma2DecoderLayer, config, layout, kl, dtype)
        self.norm = Gemma2RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
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
        """Hidden states for `input_ids`, as `LlamaModel`'s (padding, positions, cache)."""
        c = self.config
        slots, key_valid, index, position_ids, segments = decoder_positions(
            input_ids, attention_mask, position_ids, cache
        )
        b, s = input_ids.shape
        h = embed(self.embed_tokens, input_ids)
        # √hidden rounded to the embeddings' dtype first, as transformers scales them
        h = h * jnp.asarray(c.hidden_size**0.5, jnp.float32).astype(h.dtype)
        global_rope = rope_tables(c, position_ids, h.dtype)
        sliding_rope = global_rope
        if c.sliding_rope_parameters != c.rope_parameters:  # Gemma 3
            sliding_rope = rope_tables(c, position_ids, h.dtype, c.sliding_rope_parameters)
        windows = c.sliding_windows or (None,) * c.num_hidden_layers
        window = jnp.asarray([w or 2**30 for w in windows], jnp.int32)
        slides = jnp.asarray([w is not None for w in windows])
        scale = c.query_pre_attn_scalar**-0.5
        act = activation(c.hidden_activation)
        heads, kv_heads, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim

        def step(layer: Gemma2DecoderLayer, h: Array, xs: Any) -> tuple[Array, Any]:
            win, slide, kv = xs
            mask = attention_mask_for(slots, key_valid, win, segments)
            x = layer.input_layernorm(h)
            attn = layer.self_attn
            q = linear(attn.q_proj, x).reshape(b, s, heads, hd)
            k = linear(attn.k_proj, x).reshape(b, s, kv_heads, hd)
            v = linear(attn.v_proj, x).reshape(b, s, kv_heads, hd)
            if c.QK_NORM:
                q, k = attn.q_norm(q), attn.k_norm(k)
            cos, sin = (jnp.where(slide, on, off) for on, off in zip(sliding_rope, global_rope))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            new_kv = None
            if kv is not None:
                k, v = new_kv = write_cache(kv[0], kv[1], k, v, index)
            o = dot_product_attention(q, k, v, mask, scale, softcap=c.attn_logit_softcapping)
            h = h + layer.post_attention_layernorm(linear(attn.o_proj, o.reshape(b, s, -1)))
            x = layer.pre_feedforward_layernorm(h)
            mlp = layer.mlp
            x = linear(mlp.down_proj, act(linear(mlp.gate_proj, x)) * linear(mlp.up_proj, x))
            h = h + layer.post_feedforward_layernorm(x)
            return h, (h if output_hidden_states else None, new_kv)

        kv_in = None if cache is None else (cache.key, cache.value)
        h, (hidden, kv_out) = run_layers(
            self.layers,
            step,
            h,
            (window, slides, kv_in),
            gradient_checkpointing=self.gradient_checkpointing,
            remat_policy=self.remat_policy,
        )
        new_cache = None
        if cache is not None:
            new_cache = KVCache(kv_out[0], kv_out[1], key_valid, cache.index + s)
        return BaseModelOutput(self.norm(h), hidden, new_cache)


class Gemma2ForCausalLM(eqx.Module):
    """`Gemma2Model` with the language-model head (tied to the embeddings when the config
    says so, as Gemma's are: then `lm_head` is None), its logits soft-capped at
    `final_logit_softcapping`."""

    BACKBONE: ClassVar[type[Gemma2Model]] = Gemma2Model

    model: Gemma2Model
    lm_head: eqx.nn.Linear | None

    def __init__(self, config: Gemma2Config, *, key: PRNGKeyArray, **kwargs: Any):
        km, kh = jax.random.split(key)
        self.model = self.BACKBONE(config, key=km, **kwargs)
        dtype = kwargs.get("dtype", jnp.float32)
        self.lm_head = fresh_lm_head(config, kh, dtype)

    @property
    def config(self) -> Gemma2Config:
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
        h = out.last_hidden_state
        logits = lm_logits(self.model.embed_tokens, self.lm_head, h)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = (cap * jnp.tanh(logits.astype(jnp.float32) / cap)).astype(logits.dtype)
        return CausalLMOutput(logits, out.hidden_states, out.cache)


class Gemma2ForSequenceClassification(eqx.Module):
    """`Gemma2Model` with `score`, read at each sequence's last non-padding token.
    `num_labels` overrides the config's."""

    BACKBONE: ClassVar[type[Gemma2Model]] = Gemma2Model

    model: Gemma2Model
    score: eqx.nn.Linear

    def __init__(
        self,
        config: Gemma2Config,
        *,
        key: PRNGKeyArray,
        num_labels: int | None = None,
        **kwargs: Any,
    ):
        km, kh = jax.random.split(key)
        config = with_num_labels(config, num_labels)
        self.model = self.BACKBONE(config, key=km, **kwargs)
        dtype = kwargs.get("dtype", jnp.float32)
        self.score = fresh_score(config, kh, dtype)

    @property
    def config(self) -> Gemma2Config:
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
    "gemma2",
    Architecture(
        config_class=Gemma2Config,
        classes={
            "Gemma2Model": Gemma2Model,
            "Gemma2ForCausalLM": Gemma2ForCausalLM,
            "Gemma2ForSequenceClassification": Gemma2ForSequenceClassification,
        },
        default="Gemma2Model",
        prefix="model",
        new_heads=(r"score\.weight",),
        ignored=(r".*rotary_emb\.inv_freq", r"lm_head\.weight"),
    ),
)


class Gemma3TextModel(Gemma2Model):
    """Gemma 3's decoder stack: `Gemma2Model` run with a `Gemma3TextConfig` (per-head
    query and key norms, the sliding layers' own rope)."""

    CONFIG: ClassVar[type[Gemma2Config]] = Gemma3TextConfig


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """`Gemma3TextModel` with the language-model head (tied by default), its logits
    soft-capped when `final_logit_softcapping` is set (Gemma 3 sets none).

    Also the text part of a multimodal `Gemma3ForConditionalGeneration` checkpoint, which
    `from_pretrained` reads without the vision tower; `save_pretrained` writes it back as
    a `gemma3_text` checkpoint."""

    BACKBONE: ClassVar[type[Gemma2Model]] = Gemma3TextModel


class Gemma3TextForSequenceClassification(Gemma2ForSequenceClassification):
    """`Gemma3TextModel` with `score`, read at each sequence's last non-padding token."""

    BACKBONE: ClassVar[type[Gemma2Model]] = Gemma3TextModel


register(
    "gemma3_text",
    Architecture(
        config_class=Gemma3TextConfig,
        classes={
            "Gemma3TextModel": Gemma3TextModel,
            "Gemma3ForCausalLM": Gemma3ForCausalLM,
            "Gemma3TextForSequenceClassification": Gemma3TextForSequenceClassification,
        },
        default="Gemma3TextModel",
        prefix="model",
        new_heads=(r"score\.weight",),
        ignored=(r".*rotary_emb\..*inv_freq", r"lm_head\.weight"),
    ),
)
# A multimodal checkpoint (`Gemma3ForConditionalGeneration`): its language model, saved
# under `language_model.`, is read as a `Gemma3ForCausalLM`; the vision tower and the
# projector are left out.
register(
    "gemma3",
    Architecture(
        config_class=Gemma3TextConfig,
        classes={
            "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,
            "Gemma3ForCausalLM": Gemma3ForCausalLM,
        },
        default="Gemma3ForConditionalGeneration",
        prefix="model",
        stored_under="language_model.",
        ignored=(
            r"vision_tower\..*",
            r"multi_modal_projector\..*",
            r"language_model\.lm_head\.weight",
        ),
    ),
)
