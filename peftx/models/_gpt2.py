"""GPT-2 in Equinox, named as transformers names it.

transformers' GPT-2 keeps its projections in `Conv1D` layers, whose weight is stored
`(in, out)`; here they are `eqx.nn.Linear` with `(out, in)` weights like every other
model in the zoo, and the checkpoint reader transposes them on the way in and out.
"""

import dataclasses
import json
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from .._dtypes import float_dtype
from ._checkpoint import Architecture, register
from ._common import (
    COMMON_CHECKS,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_WIDTH,
    BaseModelOutput,
    CausalLMOutput,
    Check,
    HFConfig,
    KVCache,
    LayerNorm,
    LogicalAxesTable,
    SequenceClassifierOutput,
    activation,
    attention_mask as visible_keys,
    cache_slots,
    check_inputs,
    dot_product_attention,
    embed,
    flag,
    integer,
    last_token_scores,
    linear,
    lm_logits,
    number,
    packed_segments,
    update_columns,
    with_num_labels,
    write_cache,
)
from ._stack import LayerStack, Layout, RematPolicy, checkpoint_policy, make_layers, run_layers


@dataclasses.dataclass(frozen=True)
class GPT2Config(HFConfig):
    """A GPT-2 `config.json`, as the fields the model uses (transformers' names)."""

    # the logical axes of its weights, for `peftx.sharding`'s presets (see `HFConfig`)
    LOGICAL_AXES: ClassVar[LogicalAxesTable] = (
        (r"wte\.weight|lm_head\.weight", ("vocab", "embed")),
        (r"wpe\.weight", (None, "embed")),
        (r"attn\.c_attn\.weight", ("heads", "embed")),
        (r"attn\.c_attn\.bias", ("heads",)),
        (r"attn\.c_proj\.weight", ("embed", "heads")),
        (r"mlp\.c_fc\.weight", ("mlp", "embed")),
        (r"mlp\.c_fc\.bias", ("mlp",)),
        (r"mlp\.c_proj\.weight", ("embed", "mlp")),
        (r"score\.weight", (None, "embed")),
        (r"ln_(1|2|f)\.(weight|bias)|(attn|mlp)\.c_proj\.bias", ("embed",)),
    )

    model_type: str = "gpt2"
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    reorder_and_upcast_attn: bool = False
    tie_word_embeddings: bool = True
    num_labels: int = 2
    pad_token_id: int | None = None
    initializer_range: float = 0.02

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("gpt2",)
    CHECKS: ClassVar[dict[str, Check]] = {
        **COMMON_CHECKS,
        "n_positions": integer(1, MAX_POSITIONS),
        "n_embd": integer(1, MAX_WIDTH),
        "n_layer": integer(1, MAX_LAYERS),
        "n_head": integer(1, MAX_WIDTH),
        "n_inner": integer(1, MAX_WIDTH, null=True),
        "activation_function": Check(lambda v: isinstance(v, str), "a string"),
        "layer_norm_epsilon": number(0),
        "scale_attn_weights": flag(),
        "scale_attn_by_inverse_layer_idx": flag(),
        "reorder_and_upcast_attn": flag(),
        "add_cross_attention": flag(),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPT2Config: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})."
            )
        activation(self.activation_function)  # raises for an unknown name

    @classmethod
    def from_hf_config(cls, config: Any) -> "GPT2Config":
        """From a `config.json` dict or a `transformers.GPT2Config`."""
        d = config if isinstance(config, dict) else config.to_dict()
        cls.check_hf(d)
        model_type = d.get("model_type", "gpt2")
        if model_type not in cls.MODEL_TYPES:
            raise ValueError(f"GPT2Config reads model types {cls.MODEL_TYPES}, got {model_type!r}.")
        if d.get("add_cross_attention"):
            raise ValueError(
                "GPT2Config: add_cross_attention=True (GPT-2 as an encoder-decoder's decoder) "
                "is not supported; peftx's GPT-2 is decoder-only. Use a config with "
                "add_cross_attention=False."
            )
        n_labels = len(d["id2label"]) if d.get("id2label") else d.get("num_labels", 2)
        return cls(
            raw=json.dumps(d, sort_keys=True),
            vocab_size=d.get("vocab_size", 50257),
            n_positions=d.get("n_positions", 1024),
            n_embd=d.get("n_embd", 768),
            n_layer=d.get("n_layer", 12),
            n_head=d.get("n_head", 12),
            n_inner=d.get("n_inner"),
            activation_function=d.get("activation_function", "gelu_new"),
            layer_norm_epsilon=d.get("layer_norm_epsilon", 1e-5),
            scale_attn_weights=bool(d.get("scale_attn_weights", True)),
            scale_attn_by_inverse_layer_idx=bool(d.get("scale_attn_by_inverse_layer_idx", False)),
            reorder_and_upcast_attn=bool(d.get("reorder_and_upcast_attn", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            num_labels=int(n_labels),
            pad_token_id=d.get("pad_token_id"),
            initializer_range=d.get("initializer_range", 0.02),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` dict transformers reads back to this architecture."""
        d = self.hf_dict()
        d.update(
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            n_positions=self.n_positions,
            n_embd=self.n_embd,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_inner=self.n_inner,
            activation_function=self.activation_function,
            layer_norm_epsilon=self.layer_norm_epsilon,
            scale_attn_weights=self.scale_attn_weights,
            scale_attn_by_inverse_layer_idx=self.scale_attn_by_inverse_layer_idx,
            reorder_and_upcast_attn=self.reorder_and_upcast_attn,
            tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.initializer_range,
            pad_token_id=self.pad_token_id,
        )
        stored = len(d["id2label"]) if d.get("id2label") else d.get("num_labels", 2)
        if stored != self.num_labels:
            d.pop("num_labels", None)
            d["id2label"] = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
            d["label2id"] = {f"LABEL_{i}": i for i in range(self.num_labels)}
        return d

    # transformers' `attribute_map` names, which the shared pieces (and `generate`) read
    @property
    def hidden_size(self) -> int:
        return self.n_embd

    @property
    def num_hidden_layers(self) -> int:
        return self.n_layer

    @property
    def num_attention_heads(self) -> int:
        return self.n_head

    @property
    def num_key_value_heads(self) -> int:
        return self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def max_position_embeddings(self) -> int:
        return self.n_positions

    @property
    def inner_size(self) -> int:
        """The MLP's width: `n_inner`, or `4 * n_embd` when unset."""
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    def attention_scales(self) -> list[float]:
        """Each layer's factor on `q·k`: `head_dim ** -0.5` with `scale_attn_weights`,
        divided by `layer + 1` with `scale_attn_by_inverse_layer_idx` (transformers')."""
        base = self.head_dim**-0.5 if self.scale_attn_weights else 1.0
        if not self.scale_attn_by_inverse_layer_idx:
            return [base] * self.n_layer
        return [base / float(i + 1) for i in range(self.n_layer)]


def _linear(
    i: int, o: int, key: PRNGKeyArray, std: float, dtype: Any, *, bias: bool = True
) -> eqx.nn.Linear:
    """A `Linear` initialized as transformers initializes GPT-2's: normal weights with
    standard deviation `std`, zero bias."""
    layer = eqx.nn.Linear(i, o, use_bias=bias, key=key, dtype=dtype)
    layer = eqx.tree_at(lambda m: m.weight, layer, std * jax.random.normal(key, (o, i), dtype))
    if bias:
        layer = eqx.tree_at(lambda m: m.bias, layer, jnp.zeros((o,), dtype))
    return layer


def _projection_std(config: GPT2Config) -> float:
    # GPT-2's scaled init of the residual projections (transformers' `_init_weights`)
    return config.initializer_range / (2 * config.n_layer) ** 0.5


class GPT2Attention(eqx.Module):
    """Fused query/key/value projection `c_attn` and output projection `c_proj`."""

    c_attn: eqx.nn.Linear
    c_proj: eqx.nn.Linear

    def __init__(self, config: GPT2Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        ka, kp = jax.random.split(key)
        d = config.n_embd
        self.c_attn = _linear(d, 3 * d, ka, config.initializer_range, dtype)
        self.c_proj = _linear(d, d, kp, _projection_std(config), dtype)


class GPT2MLP(eqx.Module):
    c_fc: eqx.nn.Linear
    c_proj: eqx.nn.Linear

    def __init__(self, config: GPT2Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kf, kp = jax.random.split(key)
        d, inner = config.n_embd, config.inner_size
        self.c_fc = _linear(d, inner, kf, config.initializer_range, dtype)
        self.c_proj = _linear(inner, d, kp, _projection_std(config), dtype)


class GPT2Block(eqx.Module):
    ln_1: LayerNorm
    attn: GPT2Attention
    ln_2: LayerNorm
    mlp: GPT2MLP

    def __init__(self, config: GPT2Config, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        ka, km = jax.random.split(key)
        d, eps = config.n_embd, config.layer_norm_epsilon
        self.ln_1 = LayerNorm(d, eps, dtype=dtype)
        self.attn = GPT2Attention(config, key=ka, dtype=dtype)
        self.ln_2 = LayerNorm(d, eps, dtype=dtype)
        self.mlp = GPT2MLP(config, key=km, dtype=dtype)


def _positions(
    key_valid: Bool[Array, "batch keys"], slots: Int[Array, "batch seq"]
) -> Int[Array, "batch seq"]:
    """Position ids counting the real tokens before each slot, cached ones included, so
    left padding does not shift positions and a cached step continues where it left off.
    Without a mask and without a cache, `0, 1, ...`."""
    counts = jnp.cumsum(key_valid.astype(jnp.int32), axis=-1) - 1
    return jnp.maximum(jnp.take_along_axis(counts, slots, axis=-1), 0)


class GPT2Model(eqx.Module):
    """The decoder stack: token and position embeddings, blocks `h`, final norm `ln_f`."""

    wte: eqx.nn.Embedding
    wpe: eqx.nn.Embedding
    h: LayerStack | tuple[GPT2Block, ...]
    ln_f: LayerNorm
    config: GPT2Config = eqx.field(static=True)
    gradient_checkpointing: bool = eqx.field(static=True)
    remat_policy: RematPolicy = eqx.field(static=True)

    def __init__(
        self,
        config: GPT2Config,
        *,
        key: PRNGKeyArray,
        layout: Layout = "stacked",
        dtype: Any = jnp.float32,
        gradient_checkpointing: bool = False,
        remat_policy: RematPolicy = None,
    ):
        checkpoint_policy(
            remat_policy
        )  # an unknown name fails here, before any work, not at a call
        dtype = float_dtype(dtype)  # a bad name fails here, listing the valid ones
        kt, kp, kl = jax.random.split(key, 3)
        std, d = config.initializer_range, config.n_embd
        self.wte = eqx.nn.Embedding(
            weight=std * jax.random.normal(kt, (config.vocab_size, d), dtype)
        )
        self.wpe = eqx.nn.Embedding(
            weight=std * jax.random.normal(kp, (config.n_positions, d), dtype)
        )
        self.h = make_layers(GPT2Block, config, layout, kl, dtype)
        self.ln_f = LayerNorm(d, config.layer_norm_epsilon, dtype=dtype)
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
        """Hidden states for `input_ids`.

        `attention_mask` marks real tokens (1) and padding (0), left or right. Without
        `position_ids`, positions count the real tokens (as `generate` does), those in
        the cache included. With a `cache`, the tokens are written at `cache.index` and
        attend to the cached ones; the returned cache has `index` moved past them.
        `position_ids` that restart (`0 1 2 0 1`), given with neither a mask nor a cache,
        pack several examples in a row, each attending only to its own tokens (as in
        transformers: see `packed_segments`).
        """
        c = self.config
        b, s = check_inputs(input_ids, attention_mask=attention_mask, position_ids=position_ids)
        valid = jnp.ones((b, s), bool) if attention_mask is None else attention_mask.astype(bool)
        steps = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if cache is None:
            slots, key_valid, index = steps, valid, None
        else:
            slots = cache_slots(cache.index, b, s)
            key_valid = update_columns(cache.valid, valid, cache.index)
            index = cache.index
        segments = packed_segments(position_ids, attention_mask, cache)
        if position_ids is None:
            position_ids = _positions(key_valid, slots)
        h = embed(self.wte, input_ids) + embed(self.wpe, position_ids)
        mask = visible_keys(slots, key_valid, causal=True, segments=segments)
        scales = jnp.asarray(c.attention_scales(), jnp.float32)
        heads, head_dim = c.n_head, c.head_dim
        act = activation(c.activation_function)
        upcast = c.reorder_and_upcast_attn

        def step(layer: GPT2Block, h: Array, xs: Any) -> tuple[Array, Any]:
            scale, kv = xs
            x = layer.ln_1(h)
            q, k, v = jnp.split(linear(layer.attn.c_attn, x), 3, axis=-1)
            q = q.reshape(b, s, heads, head_dim)
            k = k.reshape(b, s, heads, head_dim)
            v = v.reshape(b, s, heads, head_dim)
            new_kv = None
            if kv is not None:
                k, v = new_kv = write_cache(kv[0], kv[1], k, v, index)
            if upcast:
                # reorder_and_upcast_attn: q·k in float32, as transformers' eager attention
                # computes it (its sdpa/flash paths ignore the flag)
                q, k = q.astype(jnp.float32), k.astype(jnp.float32)
            o = dot_product_attention(q, k, v, mask, scale).reshape(b, s, -1)
            h = h + linear(layer.attn.c_proj, o)
            x = layer.ln_2(h)
            h = h + linear(layer.mlp.c_proj, act(linear(layer.mlp.c_fc, x)))
            return h, (h if output_hidden_states else None, new_kv)

        kv_in = None if cache is None else (cache.key, cache.value)
        h, (hidden, kv_out) = run_layers(
            self.h,
            step,
            h,
            (scales, kv_in),
            gradient_checkpointing=self.gradient_checkpointing,
            remat_policy=self.remat_policy,
        )
        new_cache = None
        if cache is not None:
            new_cache = KVCache(kv_out[0], kv_out[1], key_valid, cache.index + s)
        return BaseModelOutput(self.ln_f(h), hidden, new_cache)


class GPT2LMHeadModel(eqx.Module):
    """`GPT2Model` (`transformer`) with the language-model head, tied to `wte` when the
    config says so (GPT-2's default): then `lm_head` is None."""

    transformer: GPT2Model
    lm_head: eqx.nn.Linear | None

    def __init__(self, config: GPT2Config, *, key: PRNGKeyArray, **kwargs: Any):
        kt, kh = jax.random.split(key)
        self.transformer = GPT2Model(config, key=kt, **kwargs)
        dtype = kwargs.get("dtype", jnp.float32)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _linear(
                config.n_embd, config.vocab_size, kh, config.initializer_range, dtype, bias=False
            )
        )

    @property
    def config(self) -> GPT2Config:
        return self.transformer.config

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"],
        attention_mask: Int[Array, "batch seq"] | None = None,
        position_ids: Int[Array, "batch seq"] | None = None,
        *,
        cache: KVCache | None = None,
        output_hidden_states: bool = False,
    ) -> CausalLMOutput:
        out = self.transformer(
            input_ids,
            attention_mask,
            position_ids,
            cache=cache,
            output_hidden_states=output_hidden_states,
        )
        h = out.last_hidden_state
        logits = lm_logits(self.transformer.wte, self.lm_head, h)
        return CausalLMOutput(logits, out.hidden_states, out.cache)


class GPT2ForSequenceClassification(eqx.Module):
    """`GPT2Model` (`transformer`) with `score`, read at each sequence's last
    non-padding token. `num_labels` overrides the config's, as transformers'
    `from_pretrained(..., num_labels=3)` does."""

    transformer: GPT2Model
    score: eqx.nn.Linear

    def __init__(
        self,
        config: GPT2Config,
        *,
        key: PRNGKeyArray,
        num_labels: int | None = None,
        **kwargs: Any,
    ):
        kt, kh = jax.random.split(key)
        config = with_num_labels(config, num_labels)
        self.transformer = GPT2Model(config, key=kt, **kwargs)
        dtype = kwargs.get("dtype", jnp.float32)
        self.score = _linear(
            config.n_embd, config.num_labels, kh, config.initializer_range, dtype, bias=False
        )

    @property
    def config(self) -> GPT2Config:
        return self.transformer.config

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"],
        attention_mask: Int[Array, "batch seq"] | None = None,
        position_ids: Int[Array, "batch seq"] | None = None,
        *,
        output_hidden_states: bool = False,
    ) -> SequenceClassifierOutput:
        out = self.transformer(
            input_ids, attention_mask, position_ids, output_hidden_states=output_hidden_states
        )
        h = out.last_hidden_state
        pooled = last_token_scores(self.score, h, input_ids, self.config.pad_token_id)
        return SequenceClassifierOutput(pooled, out.hidden_states)


# Conv1D weights, by the model's key template (`{i}` in a stack, the index unrolled)
_CONV1D = (
    r"(transformer\.)?h\.(\{i\}|\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight"
)

register(
    "gpt2",
    Architecture(
        config_class=GPT2Config,
        classes={
            "GPT2Model": GPT2Model,
            "GPT2LMHeadModel": GPT2LMHeadModel,
            "GPT2ForSequenceClassification": GPT2ForSequenceClassification,
        },
        default="GPT2Model",
        prefix="transformer",
        transposed=(_CONV1D,),
        new_heads=(r"score\.weight",),
        # the causal-mask buffers of old checkpoints, and a tied head saved anyway
        ignored=(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)", r"lm_head\.weight"),
    ),
)
