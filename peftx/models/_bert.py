"""BERT in Equinox, named as transformers names it: `BertModel`, `BertForSequenceClassification`
and `BertForMaskedLM`, so a checkpoint's keys are the model's dotted paths
(`bert.encoder.layer.0-5.attention.self.query` stacked, `...layer.3...` unrolled)."""

import dataclasses
import json
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._dtypes import float_dtype
from ._checkpoint import Architecture, register
from ._common import (
    ACTIVATIONS,
    COMMON_CHECKS,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    MAX_WIDTH,
    BaseModelOutput,
    Check,
    HFConfig,
    LayerNorm,
    LogicalAxesTable,
    MaskedLMOutput,
    SequenceClassifierOutput,
    activation,
    attention_mask,
    check_inputs,
    dot_product_attention,
    dropout,
    embed,
    flag,
    integer,
    linear,
    number,
    tied_logits,
    with_num_labels,
)
from ._stack import LayerStack, Layout, RematPolicy, checkpoint_policy, make_layers, run_layers

POSITION_EMBEDDING_TYPES = ("absolute",)


@dataclasses.dataclass(frozen=True)
class BertConfig(HFConfig):
    """A BERT `config.json`, as the fields the model uses (defaults: bert-base-uncased).

    The dropout rates apply when a model is called with a `key` (training mode).
    """

    # the logical axes of its weights, for `peftx.sharding`'s presets (see `HFConfig`)
    LOGICAL_AXES: ClassVar[LogicalAxesTable] = (
        (r"word_embeddings\.weight", ("vocab", "embed")),
        (r"(position|token_type)_embeddings\.weight", (None, "embed")),
        (r"attention\.self\.(query|key|value)\.weight", ("heads", "embed")),
        (r"attention\.self\.(query|key|value)\.bias", ("heads",)),
        (r"attention\.output\.dense\.weight", ("embed", "heads")),
        (r"intermediate\.dense\.weight", ("mlp", "embed")),
        (r"intermediate\.dense\.bias", ("mlp",)),
        (r"output\.dense\.weight", ("embed", "mlp")),
        (r"(pooler|transform)\.dense\.weight|classifier\.weight", (None, "embed")),
        (r"predictions\.bias", ("vocab",)),
        (r"LayerNorm\.(weight|bias)|output\.dense\.bias", ("embed",)),
    )

    model_type: str = "bert"
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    position_embedding_type: str = "absolute"
    num_labels: int = 2
    pad_token_id: int | None = 0
    initializer_range: float = 0.02
    classifier_dropout: float | None = None
    tie_word_embeddings: bool = True

    CHECKS: ClassVar[dict[str, Check]] = {
        **COMMON_CHECKS,
        "hidden_size": integer(1, MAX_WIDTH),
        "num_hidden_layers": integer(1, MAX_LAYERS),
        "num_attention_heads": integer(1, MAX_WIDTH),
        "intermediate_size": integer(1, MAX_WIDTH),
        "hidden_act": Check(lambda v: isinstance(v, str), "a string"),
        "hidden_dropout_prob": number(0, 1, open_high=True),
        "attention_probs_dropout_prob": number(0, 1, open_high=True),
        "max_position_embeddings": integer(1, MAX_POSITIONS),
        "type_vocab_size": integer(1, MAX_VOCAB),
        "layer_norm_eps": number(0),
        "position_embedding_type": Check(lambda v: v is None or isinstance(v, str), "a string"),
        "classifier_dropout": number(0, 1, open_high=True, null=True),
        "is_decoder": flag(),
        "add_cross_attention": flag(),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model_type != "bert":
            raise ValueError(f"BertConfig reads model type 'bert', got {self.model_type!r}.")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type {self.position_embedding_type!r} is not supported; "
                f"peftx's BERT supports {POSITION_EMBEDDING_TYPES} (as transformers 5 does)."
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                f"{self.num_attention_heads}."
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported; known: {sorted(ACTIVATIONS)}."
            )
        if self.num_labels < 1:
            raise ValueError(f"num_labels must be at least 1, got {self.num_labels}.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_config(cls, config: Any) -> "BertConfig":
        """From a `config.json` dict or a `transformers.BertConfig`."""
        d = config if isinstance(config, dict) else config.to_dict()
        cls.check_hf(d)
        for key in ("is_decoder", "add_cross_attention"):
            if d.get(key):
                raise ValueError(
                    f"the config sets {key}=True; peftx's BERT is the bidirectional encoder "
                    f"only (BertModel, BertForSequenceClassification, BertForMaskedLM)."
                )
        n_labels = len(d["id2label"]) if d.get("id2label") else d.get("num_labels", 2)
        return cls(
            raw=json.dumps(d, sort_keys=True),
            model_type=d.get("model_type", "bert"),
            vocab_size=d.get("vocab_size", 30522),
            hidden_size=d.get("hidden_size", 768),
            num_hidden_layers=d.get("num_hidden_layers", 12),
            num_attention_heads=d.get("num_attention_heads", 12),
            intermediate_size=d.get("intermediate_size", 3072),
            hidden_act=d.get("hidden_act", "gelu"),
            hidden_dropout_prob=d.get("hidden_dropout_prob", 0.1),
            attention_probs_dropout_prob=d.get("attention_probs_dropout_prob", 0.1),
            max_position_embeddings=d.get("max_position_embeddings", 512),
            type_vocab_size=d.get("type_vocab_size", 2),
            layer_norm_eps=d.get("layer_norm_eps", 1e-12),
            position_embedding_type=d.get("position_embedding_type") or "absolute",
            num_labels=int(n_labels),
            pad_token_id=d.get("pad_token_id", 0),
            initializer_range=d.get("initializer_range", 0.02),
            classifier_dropout=d.get("classifier_dropout"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` dict transformers reads back to this architecture."""
        d = self.hf_dict()
        d.update(
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=self.intermediate_size,
            hidden_act=self.hidden_act,
            hidden_dropout_prob=self.hidden_dropout_prob,
            attention_probs_dropout_prob=self.attention_probs_dropout_prob,
            max_position_embeddings=self.max_position_embeddings,
            type_vocab_size=self.type_vocab_size,
            layer_norm_eps=self.layer_norm_eps,
            pad_token_id=self.pad_token_id,
            initializer_range=self.initializer_range,
            classifier_dropout=self.classifier_dropout,
            tie_word_embeddings=self.tie_word_embeddings,
        )
        if "position_embedding_type" in d:
            d["position_embedding_type"] = self.position_embedding_type
        if len(d.get("id2label") or {}) != self.num_labels:
            d.pop("num_labels", None)
            d["id2label"] = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
            d["label2id"] = {f"LABEL_{i}": i for i in range(self.num_labels)}
        return d


def _linear(i: int, o: int, key: PRNGKeyArray, std: float, dtype: Any) -> eqx.nn.Linear:
    """transformers' BERT init: weight ~ N(0, std), bias zero."""
    layer = eqx.nn.Linear(i, o, key=key, dtype=dtype)
    layer = eqx.tree_at(lambda m: m.weight, layer, std * jax.random.normal(key, (o, i), dtype))
    return eqx.tree_at(lambda m: m.bias, layer, jnp.zeros((o,), dtype))


def _embedding(
    n: int, dim: int, key: PRNGKeyArray, std: float, dtype: Any, padding_idx: int | None = None
) -> eqx.nn.Embedding:
    weight = std * jax.random.normal(key, (n, dim), dtype)
    if padding_idx is not None and 0 <= padding_idx < n:
        weight = weight.at[padding_idx].set(0)
    return eqx.nn.Embedding(weight=weight)


class BertEmbeddings(eqx.Module):
    word_embeddings: eqx.nn.Embedding
    position_embeddings: eqx.nn.Embedding
    token_type_embeddings: eqx.nn.Embedding
    LayerNorm: LayerNorm

    def __init__(self, config: BertConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        c, std = config, config.initializer_range
        kw, kp, kt = jax.random.split(key, 3)
        self.word_embeddings = _embedding(
            c.vocab_size, c.hidden_size, kw, std, dtype, c.pad_token_id
        )
        self.position_embeddings = _embedding(
            c.max_position_embeddings, c.hidden_size, kp, std, dtype
        )
        self.token_type_embeddings = _embedding(c.type_vocab_size, c.hidden_size, kt, std, dtype)
        self.LayerNorm = LayerNorm(c.hidden_size, c.layer_norm_eps, dtype=dtype)

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"],
        token_type_ids: Int[Array, "batch seq"],
        position_ids: Int[Array, "batch seq"],
    ) -> Float[Array, "batch seq dim"]:
        # transformers' order of the sums: words + token types, then positions
        h = embed(self.word_embeddings, input_ids) + embed(
            self.token_type_embeddings, token_type_ids
        )
        h = h + embed(self.position_embeddings, position_ids)
        return self.LayerNorm(h)


class BertSelfAttention(eqx.Module):
    query: eqx.nn.Linear
    key: eqx.nn.Linear
    value: eqx.nn.Linear

    def __init__(self, config: BertConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        d, std = config.hidden_size, config.initializer_range
        kq, kk, kv = jax.random.split(key, 3)
        self.query = _linear(d, d, kq, std, dtype)
        self.key = _linear(d, d, kk, std, dtype)
        self.value = _linear(d, d, kv, std, dtype)


class BertSelfOutput(eqx.Module):
    dense: eqx.nn.Linear
    LayerNorm: LayerNorm

    def __init__(self, config: BertConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        d = config.hidden_size
        self.dense = _linear(d, d, key, config.initializer_range, dtype)
        self.LayerNorm = LayerNorm(d, config.layer_norm_eps, dtype=dtype)


class BertAttention(eqx.Module):
    self: BertSelfAttention  # transformers' name: the keys read `attention.self.query`
    output: BertSelfOutput

    def __init__(self, config: BertConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        ks, ko = jax.random.split(key)
        self.self = BertSelfAttention(config, key=ks, dtype=dtype)
        self.output = BertSelfOutput(config, key=ko, dtype=dtype)


class BertIntermediate(eqx.Module):
    dense: eqx.nn.Linear

    def __init__(self, config: BertConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        c = config
        self.dense = _linear(c.hidden_size, c.intermediate_size, key, c.initializer_range, dtype)


class BertOutput(eqx.Module):
    dense: eqx.nn.Linear
    LayerNorm: LayerNorm

    def __init__(self, config: BertConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        c = config
        self.dense = _linear(c.intermediate_size, c.hidden_size, key, c.initializer_range, dtype)
        self.LayerNorm = LayerNorm(c.hidden_size, c.layer_norm_eps, dtype=dtype)


class BertLayer(eqx.Module):
    """One encoder block: self-attention, then the feed-forward, each followed by a
    residual LayerNorm (post-norm)."""

    attention: BertAttention
    intermediate: BertIntermediate
    output: BertOutput

    def __init__(self, config: BertConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        ka, ki, ko = jax.random.split(key, 3)
        self.attention = BertAttention(config, key=ka, dtype=dtype)
        self.intermediate = BertIntermediate(config, key=ki, dtype=dtype)
        self.output = BertOutput(config, key=ko, dtype=dtype)


class BertEncoder(eqx.Module):
    layer: LayerStack | tuple[BertLayer, ...]


class BertPooler(eqx.Module):
    dense: eqx.nn.Linear

    def __init__(self, config: BertConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        d = config.hidden_size
        self.dense = _linear(d, d, key, config.initializer_range, dtype)

    def __call__(self, h: Float[Array, "batch seq dim"]) -> Float[Array, "batch dim"]:
        return jnp.tanh(linear(self.dense, h[:, 0]))


class BertModel(eqx.Module):
    """The encoder: embeddings, `encoder.layer` blocks, and the pooler (`tanh` of a dense
    layer on the first token; None with `add_pooling_layer=False`)."""

    embeddings: BertEmbeddings
    encoder: BertEncoder
    pooler: BertPooler | None
    config: BertConfig = eqx.field(static=True)
    gradient_checkpointing: bool = eqx.field(static=True)
    remat_policy: RematPolicy = eqx.field(static=True)

    def __init__(
        self,
        config: BertConfig,
        *,
        key: PRNGKeyArray,
        layout: Layout = "stacked",
        dtype: Any = jnp.float32,
        add_pooling_layer: bool = True,
        gradient_checkpointing: bool = False,
        remat_policy: RematPolicy = None,
    ):
        checkpoint_policy(remat_policy)  # an unknown policy name fails before the weights are drawn
        dtype = float_dtype(dtype)  # a bad name fails here, listing the valid ones
        ke, kl, kp = jax.random.split(key, 3)
        self.embeddings = BertEmbeddings(config, key=ke, dtype=dtype)
        self.encoder = BertEncoder(make_layers(BertLayer, config, layout, kl, dtype))
        self.pooler = BertPooler(config, key=kp, dtype=dtype) if add_pooling_layer else None
        self.config = config
        self.gradient_checkpointing = gradient_checkpointing
        self.remat_policy = remat_policy

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"],
        attention_mask: Int[Array, "batch seq"] | Bool[Array, "batch seq"] | None = None,
        token_type_ids: Int[Array, "batch seq"] | None = None,
        position_ids: Int[Array, "batch seq"] | None = None,
        *,
        output_hidden_states: bool = False,
        key: PRNGKeyArray | None = None,
    ) -> BaseModelOutput:
        """Hidden states for `input_ids` (transformers' argument order).

        `attention_mask` marks real tokens (1) and padding (0); padding is usually on the
        right. `token_type_ids` default to 0 (segment A). `position_ids` default to
        `0..seq-1` for every row, padding or not, as transformers' BERT does.
        `hidden_states` (with `output_hidden_states`) are each block's output, stacked:
        `hidden_states[i]` is transformers' `hidden_states[i + 1]`.

        Without `key`, the model runs as transformers' does in eval mode. With a `key`,
        dropout as in training mode: `hidden_dropout_prob` on the embeddings and on both
        dense outputs of each block (before their residual LayerNorm),
        `attention_probs_dropout_prob` on the attention weights.
        """
        c = self.config
        b, s = check_inputs(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
        )
        if s > c.max_position_embeddings and position_ids is None:
            raise ValueError(
                f"input_ids has {s} tokens; this BERT embeds at most "
                f"max_position_embeddings={c.max_position_embeddings} positions."
            )
        valid = jnp.ones((b, s), bool) if attention_mask is None else attention_mask.astype(bool)
        if token_type_ids is None:
            token_type_ids = jnp.zeros((b, s), jnp.int32)
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        p = c.hidden_dropout_prob
        if key is None:
            embed_key, layer_keys = None, None
        else:
            embed_key, layers_key = jax.random.split(key)
            layer_keys = jax.random.split(layers_key, c.num_hidden_layers)
        h = dropout(self.embeddings(input_ids, token_type_ids, position_ids), p, embed_key)
        slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        mask = attention_mask_fn(slots, valid)
        heads, head_dim = c.num_attention_heads, c.head_dim
        scale = head_dim**-0.5
        act = _in_float32(activation(c.hidden_act))

        def step(layer: BertLayer, h: Array, layer_key: Any) -> tuple[Array, Any]:
            ka, ko, kf = (None,) * 3 if layer_key is None else jax.random.split(layer_key, 3)
            attn = layer.attention.self
            q = linear(attn.query, h).reshape(b, s, heads, head_dim)
            k = linear(attn.key, h).reshape(b, s, heads, head_dim)
            v = linear(attn.value, h).reshape(b, s, heads, head_dim)
            o = dot_product_attention(
                q, k, v, mask, scale, dropout_rate=c.attention_probs_dropout_prob, dropout_key=ka
            ).reshape(b, s, -1)
            out = layer.attention.output
            h = out.LayerNorm(dropout(linear(out.dense, o), p, ko) + h)
            x = act(linear(layer.intermediate.dense, h))
            h = layer.output.LayerNorm(dropout(linear(layer.output.dense, x), p, kf) + h)
            return h, h if output_hidden_states else None

        h, hidden = run_layers(
            self.encoder.layer,
            step,
            h,
            layer_keys,
            gradient_checkpointing=self.gradient_checkpointing,
            remat_policy=self.remat_policy,
        )
        pooled = None if self.pooler is None else self.pooler(h)
        return BaseModelOutput(h, hidden, pooler_output=pooled)


def _in_float32(fn: Any) -> Any:
    """`fn` computed in float32 and rounded once, as torch computes GELU on half types."""

    def wrapped(x: Array) -> Array:
        if jnp.finfo(x.dtype).bits >= 32:
            return fn(x)
        return fn(x.astype(jnp.float32)).astype(x.dtype)

    return wrapped


def attention_mask_fn(slots: Array, key_valid: Array) -> Array:
    return attention_mask(slots, key_valid, causal=False)


class BertForSequenceClassification(eqx.Module):
    """`BertModel` with `classifier` on the pooled first token (transformers' head).

    `num_labels` overrides the config's, as transformers' `from_pretrained(...,
    num_labels=3)` does: `peftx.models.from_pretrained(path, model_class=
    "BertForSequenceClassification", num_labels=3)` puts a fresh 3-way classifier on an
    encoder checkpoint.
    """

    bert: BertModel
    classifier: eqx.nn.Linear

    def __init__(
        self,
        config: BertConfig,
        *,
        key: PRNGKeyArray,
        num_labels: int | None = None,
        **kwargs: Any,
    ):
        kb, kc = jax.random.split(key)
        if not kwargs.pop("add_pooling_layer", True):
            raise ValueError("BertForSequenceClassification reads the pooler; it needs one.")
        config = with_num_labels(config, num_labels)
        self.bert = BertModel(config, key=kb, **kwargs)
        dtype = kwargs.get("dtype", jnp.float32)
        self.classifier = _linear(
            config.hidden_size, config.num_labels, kc, config.initializer_range, dtype
        )

    @property
    def config(self) -> BertConfig:
        return self.bert.config

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"],
        attention_mask: Int[Array, "batch seq"] | Bool[Array, "batch seq"] | None = None,
        token_type_ids: Int[Array, "batch seq"] | None = None,
        position_ids: Int[Array, "batch seq"] | None = None,
        *,
        output_hidden_states: bool = False,
        key: PRNGKeyArray | None = None,
    ) -> SequenceClassifierOutput:
        """Logits from the pooled first token; with a `key`, dropout as in training mode
        (the backbone's, then `classifier_dropout`, else `hidden_dropout_prob`, on the
        pooled output)."""
        kb, kc = (None, None) if key is None else jax.random.split(key)
        out = self.bert(
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids,
            output_hidden_states=output_hidden_states,
            key=kb,
        )
        c = self.config
        rate = c.hidden_dropout_prob if c.classifier_dropout is None else c.classifier_dropout
        pooled = dropout(out.pooler_output, rate, kc)
        return SequenceClassifierOutput(linear(self.classifier, pooled), out.hidden_states)


class BertPredictionHeadTransform(eqx.Module):
    dense: eqx.nn.Linear
    LayerNorm: LayerNorm

    def __init__(self, config: BertConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        d = config.hidden_size
        self.dense = _linear(d, d, key, config.initializer_range, dtype)
        self.LayerNorm = LayerNorm(d, config.layer_norm_eps, dtype=dtype)


class BertLMPredictionHead(eqx.Module):
    """`transform`, then the decoder: the word embeddings plus the output-only `bias` when
    `tie_word_embeddings` (`decoder` None, as transformers ties `decoder.weight` to the
    embeddings and `decoder.bias` to `bias`), else an own `decoder` with its own bias
    (`bias` is then kept for the checkpoint only, as in transformers' forward)."""

    transform: BertPredictionHeadTransform
    decoder: eqx.nn.Linear | None
    bias: Float[Array, " vocab"]

    def __init__(self, config: BertConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        kt, kd = jax.random.split(key)
        c = config
        self.transform = BertPredictionHeadTransform(c, key=kt, dtype=dtype)
        self.decoder = None
        if not c.tie_word_embeddings:
            self.decoder = _linear(c.hidden_size, c.vocab_size, kd, c.initializer_range, dtype)
        self.bias = jnp.zeros((c.vocab_size,), dtype)


class BertOnlyMLMHead(eqx.Module):
    predictions: BertLMPredictionHead

    def __init__(self, config: BertConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        self.predictions = BertLMPredictionHead(config, key=key, dtype=dtype)


class BertForMaskedLM(eqx.Module):
    """`BertModel` without the pooler, and `cls.predictions`: dense, activation and
    LayerNorm, then logits over the vocabulary through the (tied) word embeddings."""

    bert: BertModel
    cls: BertOnlyMLMHead

    def __init__(self, config: BertConfig, *, key: PRNGKeyArray, **kwargs: Any):
        kb, kc = jax.random.split(key)
        kwargs.setdefault("add_pooling_layer", False)
        self.bert = BertModel(config, key=kb, **kwargs)
        self.cls = BertOnlyMLMHead(config, key=kc, dtype=kwargs.get("dtype", jnp.float32))

    @property
    def config(self) -> BertConfig:
        return self.bert.config

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"],
        attention_mask: Int[Array, "batch seq"] | Bool[Array, "batch seq"] | None = None,
        token_type_ids: Int[Array, "batch seq"] | None = None,
        position_ids: Int[Array, "batch seq"] | None = None,
        *,
        output_hidden_states: bool = False,
        key: PRNGKeyArray | None = None,
    ) -> MaskedLMOutput:
        """Logits over the vocabulary at every position; with a `key`, the backbone's
        dropout as in training mode."""
        out = self.bert(
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids,
            output_hidden_states=output_hidden_states,
            key=key,
        )
        head = self.cls.predictions
        t = head.transform
        act = _in_float32(activation(self.config.hidden_act))
        h = t.LayerNorm(act(linear(t.dense, out.last_hidden_state)))
        if head.decoder is not None:
            return MaskedLMOutput(linear(head.decoder, h), out.hidden_states)
        logits = tied_logits(self.bert.embeddings.word_embeddings, h)
        bias = head.bias.astype(logits.dtype).reshape((1,) * (logits.ndim - 1) + (-1,))
        return MaskedLMOutput(logits + bias, out.hidden_states)


register(
    "bert",
    Architecture(
        config_class=BertConfig,
        classes={
            "BertModel": BertModel,
            "BertForSequenceClassification": BertForSequenceClassification,
            "BertForMaskedLM": BertForMaskedLM,
        },
        default="BertModel",
        prefix="bert",
        # heads a checkpoint may lack; transformers initializes them fresh too
        new_heads=(
            r"classifier\.(weight|bias)",
            r"(bert\.)?pooler\.dense\.(weight|bias)",
            r"cls\.predictions\..*",
        ),
        # buffers, tied copies, and heads of other classes (pre-training's NSP head, a
        # pooler or classifier the loaded class does not have)
        ignored=(
            r"(bert\.)?embeddings\.(position_ids|token_type_ids)",
            r"cls\.predictions\.decoder\.(weight|bias)",
            r"cls\..*",
            r"classifier\.(weight|bias)",
            r"(bert\.)?pooler\.dense\.(weight|bias)",
        ),
    ),
)
