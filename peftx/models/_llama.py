"""The Llama family (Llama, Mistral, Qwen2, Qwen3, and the mixtures of experts built on
them, Mixtral and Qwen3-MoE) in Equinox, named as transformers names it
(`transformers/models/{llama,mistral,qwen2,qwen3,mixtral,qwen3_moe}/modeling_*.py`)."""

import dataclasses
import json
import math
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
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
    attention_mask,
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
    positive_numbers,
    strings,
    with_num_labels,
    write_cache,
)
from ._hub_keys import HubKeys
from ._moe import SparseMoeBlock, load_balancing_loss, sparse_moe
from ._stack import LayerStack, Layout, RematPolicy, checkpoint_policy, make_layers, run_layers

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# the rope parameters (`rope_parameters`, or transformers 4's `rope_scaling`)
ROPE_CHECKS: dict[str, Check] = {
    "rope_theta": number(0, open_low=True),
    "rope_type": STRING,
    "type": STRING,
    "factor": number(0, open_low=True, null=True),
    "low_freq_factor": number(0, open_low=True),
    "high_freq_factor": number(0, open_low=True),
    "original_max_position_embeddings": integer(1, MAX_POSITIONS),
    "partial_rotary_factor": number(0, 1, open_low=True),
    "attention_factor": number(null=True),
    "beta_fast": number(0, open_low=True, null=True),
    "beta_slow": number(0, open_low=True, null=True),
    "mscale": number(null=True),
    "mscale_all_dim": number(null=True),
    "truncate": flag(),
    "short_factor": positive_numbers(),
    "long_factor": positive_numbers(),
}
# the parameters each rope type reads without a default
ROPE_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig(HFConfig):
    """A Llama, Mistral, Qwen2 or Qwen3 `config.json`, as the fields the model uses.

    transformers' `attention_bias` is `qkv_bias` and `o_proj_bias` here (Qwen2 has the
    first only); `rope` holds the `rope_parameters` as sorted pairs; `sliding_windows` is
    each layer's window (None: full attention), or `()` when no layer has one; `qk_norm`:
    each head's queries and keys are RMS-normalized before the rotary embedding (Qwen3's
    `q_norm` and `k_norm`).

    With `num_experts > 0` (Mixtral, Qwen3-MoE) each block's MLP is a `SparseMoeBlock`:
    `num_experts_per_tok` experts of `moe_intermediate_size` features per token, their
    weights renormalized with `norm_topk_prob`; `router_aux_loss_coef` weighs the
    load-balancing loss that `peftx.train` adds to a causal LM's loss.
    """

    # the logical axes of its weights, for `peftx.sharding`'s presets (see `HFConfig`)
    LOGICAL_AXES: ClassVar[LogicalAxesTable] = (
        (r"embed_tokens\.weight|lm_head\.weight", ("vocab", "embed")),
        (r"[qkv]_proj\.weight", ("heads", "embed")),
        (r"[qkv]_proj\.bias", ("heads",)),
        (r"o_proj\.weight", ("embed", "heads")),
        (r"(gate|up)_proj\.weight", ("mlp", "embed")),
        (r"(gate|up)_proj\.bias", ("mlp",)),
        (r"down_proj\.weight", ("embed", "mlp")),
        (r"score\.weight", (None, "embed")),
        (r"[qk]_norm\.weight", (None,)),  # over one head's features: kept whole
        (
            r"(input_layernorm|post_attention_layernorm|norm)\.weight|o_proj\.bias",
            ("embed",),
        ),
        (r"down_proj\.bias", ("embed",)),
        (r"experts\.gate_up_proj", (None, "mlp", "embed")),
        (r"experts\.down_proj", (None, "embed", "mlp")),
        (r"mlp\.gate\.weight", (None, "embed")),
    )

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int | None = None  # None: hidden_size // num_attention_heads, as transformers
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    rope: tuple[tuple[str, Any], ...] = (("rope_theta", 10000.0), ("rope_type", "default"))
    sliding_windows: tuple[int | None, ...] = ()
    qk_norm: bool = False
    num_experts: int = 0  # 0: a dense MLP in every block
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None  # None: intermediate_size
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001
    num_labels: int = 2
    pad_token_id: int | None = None
    initializer_range: float = 0.02

    MODEL_TYPES: ClassVar[tuple[str, ...]] = (
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "mixtral",
        "qwen3_moe",
    )
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
        "rms_norm_eps": number(0),
        "rope_theta": number(0, open_low=True),
        "rope_scaling": mapping(),
        "rope_parameters": mapping(),
        "attention_bias": flag(),
        "mlp_bias": flag(),
        "sliding_window": integer(0, MAX_POSITIONS, null=True),
        "use_sliding_window": flag(),
        "max_window_layers": integer(0, MAX_POSITIONS),
        "layer_types": strings(),
        "num_experts": integer(0, MAX_WIDTH, null=True),
        "num_local_experts": integer(1, MAX_WIDTH),
        "num_experts_per_tok": integer(1, MAX_WIDTH),
        "moe_intermediate_size": integer(1, MAX_WIDTH, null=True),
        "norm_topk_prob": flag(),
        "router_aux_loss_coef": number(0),
        "router_jitter_noise": Check(lambda v: v == 0, "0 (peftx does not jitter the router)"),
        "decoder_sparse_step": integer(1, 1),
        "mlp_only_layers": Check(lambda v: not v, "empty: every block's MLP is sparse"),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.moe_intermediate_size is None:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be from 1 to the "
                f"number of experts ({self.num_experts})."
            )
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        # named as the config has it: head_dim itself, or the two sizes it comes from
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
        rotary = int(self.head_dim * rope.get("partial_rotary_factor", 1.0))
        if rotary < 2 or rotary % 2:
            raise ValueError(
                f"{head_dim} times partial_rotary_factor gives {rotary} rotary features; "
                "rotary embeddings turn pairs of features, so it must be even and at least 2 "
                "(set head_dim, or change the sizes)."
            )
        if self.sliding_windows and len(self.sliding_windows) != self.num_hidden_layers:
            raise ValueError(
                f"sliding_windows has {len(self.sliding_windows)} entries for "
                f"num_hidden_layers={self.num_hidden_layers}; give one per layer, or ()."
            )
        activation(self.hidden_act)  # an unknown name fails here, not at the first call

    @classmethod
    def from_hf_config(cls, config: Any) -> "LlamaConfig":
        """From a `config.json` dict or a `transformers` config object."""
        d = config if isinstance(config, dict) else config.to_dict()
        cls.check_hf(d)  # types and ranges first: nothing below loops over a bad count
        model_type = d.get("model_type", "llama")
        if model_type not in cls.MODEL_TYPES:
            raise ValueError(
                f"LlamaConfig reads model types {cls.MODEL_TYPES}, got {model_type!r}."
            )
        heads = d.get("num_attention_heads", 32)
        layers = d.get("num_hidden_layers", 32)
        # transformers' precedence: `rope_scaling` (transformers 4) over `rope_parameters`,
        # and a top-level `rope_theta` where the dict has none
        source = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
        rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
        check_values(rope, ROPE_CHECKS, f"{source}.")
        rope.setdefault("rope_theta", d.get("rope_theta", 10000.0))
        legacy = rope.pop("type", None)  # transformers 4's name, kept by transformers 5
        rope.setdefault("rope_type", legacy or "default")
        if rope["rope_type"] not in ROPE_TYPES:
            raise ValueError(
                f"rope type {rope['rope_type']!r} is not supported; supported: {ROPE_TYPES}."
            )
        _check_rope_needs(rope, source)
        if d.get("layer_types") is not None and len(d["layer_types"]) != layers:
            raise ValueError(
                f"layer_types has {len(d['layer_types'])} entries for "
                f"num_hidden_layers={layers}; give one per layer."
            )
        head_dim = d.get("head_dim") or None  # None: hidden_size // heads
        if model_type == "qwen3_moe":  # one window on every layer, when used
            windows = (d.get("sliding_window") if d.get("use_sliding_window") else None,) * layers
        elif model_type in ("qwen2", "qwen3"):
            window = d.get("sliding_window") if d.get("use_sliding_window") else None
            types = d.get("layer_types") or [
                "sliding_attention" if window and i >= d.get("max_window_layers", 28) else "full"
                for i in range(layers)
            ]
            windows = tuple(window if t == "sliding_attention" else None for t in types)
        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False  # as transformers' Qwen2 builds it
        elif model_type in ("qwen3", "qwen3_moe"):
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
            mlp_bias = False
            head_dim = d.get("head_dim", 128)  # transformers' Qwen3Config default
        elif model_type in ("mistral", "mixtral"):
            windows = (d.get("sliding_window"),) * layers
            qkv_bias = o_bias = mlp_bias = False  # transformers' Mistral has no biases
        else:
            windows = ()
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
            mlp_bias = bool(d.get("mlp_bias", False))
        n_labels = len(d["id2label"]) if d.get("id2label") else d.get("num_labels", 2)
        return cls(
            raw=json.dumps(d, sort_keys=True),
            model_type=model_type,
            vocab_size=d.get("vocab_size", 32000),
            hidden_size=d.get("hidden_size", 4096),
            intermediate_size=d.get("intermediate_size", 11008),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            hidden_act=d.get("hidden_act", "silu"),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=mlp_bias,
            rope=tuple(sorted(rope.items())),
            sliding_windows=tuple(w or None for w in windows) if any(windows) else (),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            **_experts(d, model_type),
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
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_parameters=dict(self.rope),
        )
        d.pop("rope_scaling", None)
        d.pop("rope_theta", None)
        d.update(pad_token_id=self.pad_token_id, initializer_range=self.initializer_range)
        if len(d.get("id2label") or {}) != self.num_labels:
            d["id2label"] = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
            d["label2id"] = {f"LABEL_{i}": i for i in range(self.num_labels)}
        biases = (self.qkv_bias, self.o_proj_bias, self.mlp_bias)
        windows = {w for w in self.sliding_windows if w is not None}
        if len(windows) > 1:
            raise ValueError(
                f"sliding_windows {self.sliding_windows} mix window sizes; transformers' "
                f"{self.model_type} config holds one sliding_window."
            )
        window = windows.pop() if windows else None
        if self.qk_norm != (self.model_type in ("qwen3", "qwen3_moe")):
            self._unwritable(
                f"qk_norm={self.qk_norm}", "Qwen3 normalizes queries and keys; the others do not"
            )
        if self.model_type == "llama":
            if window is not None:
                self._unwritable("a sliding window", "use model_type 'mistral' or 'qwen2'")
            if self.qkv_bias != self.o_proj_bias:
                self._unwritable("qkv_bias != o_proj_bias", "attention_bias sets both")
            d.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        elif self.model_type in ("mistral", "mixtral"):
            if any(biases):
                self._unwritable("biases", "transformers' Mistral has none")
            if window is not None and None in self.sliding_windows:
                self._unwritable("a window on some layers only", "use model_type 'qwen2'")
            d.update(sliding_window=window)
        else:
            if self.model_type == "qwen2" and biases != (True, False, False):
                self._unwritable(
                    f"(qkv_bias, o_proj_bias, mlp_bias) = {biases}",
                    "transformers' Qwen2 has (True, False, False)",
                )
            qwen3 = self.model_type in ("qwen3", "qwen3_moe")
            if qwen3 and (self.qkv_bias != self.o_proj_bias or self.mlp_bias):
                self._unwritable(
                    f"(qkv_bias, o_proj_bias, mlp_bias) = {biases}",
                    "transformers' Qwen3 has attention_bias on q, k, v and o, none on the MLP",
                )
            if qwen3:
                d.update(attention_bias=self.qkv_bias)
            partial = window is not None and None in self.sliding_windows
            if self.model_type == "qwen3_moe" and partial:
                self._unwritable("a window on some layers only", "Qwen3-MoE's is on all or none")
            d.update(
                use_sliding_window=window is not None,
                sliding_window=window,
                layer_types=[
                    "full_attention" if w is None else "sliding_attention"
                    for w in self.sliding_windows or (None,) * self.num_hidden_layers
                ],
            )
        if (self.num_experts > 0) != (self.model_type in ("mixtral", "qwen3_moe")):
            self._unwritable(
                f"num_experts={self.num_experts}", "only Mixtral and Qwen3-MoE have experts"
            )
        if self.model_type == "mixtral":
            if self.moe_intermediate_size != self.intermediate_size or not self.norm_topk_prob:
                self._unwritable(
                    "experts unlike Mixtral's",
                    "Mixtral's experts have intermediate_size features and renormalized weights",
                )
            d.update(num_local_experts=self.num_experts)
        elif self.model_type == "qwen3_moe":
            d.update(
                num_experts=self.num_experts,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
            d.pop("layer_types", None)
        if self.num_experts:
            d.update(
                num_experts_per_tok=self.num_experts_per_tok,
                router_aux_loss_coef=self.router_aux_loss_coef,
            )
        return d

    def _unwritable(self, what: str, why: str) -> None:
        raise ValueError(
            f"this {self.model_type} config has {what}, which transformers cannot express "
            f"({why}); to_hf_config would describe a different model."
        )

    @property
    def rope_parameters(self) -> dict[str, Any]:
        return dict(self.rope)


def _experts(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields of `LlamaConfig` from a Mixtral or Qwen3-MoE
    `config.json` dict (none for the dense types)."""
    # transformers 5 writes either name for either type (an attribute map aliases them)
    experts = d.get("num_local_experts") or d.get("num_experts")
    if model_type == "mixtral":
        experts, inter, normalize = experts or 8, None, True
    elif model_type == "qwen3_moe":
        experts = experts or 128
        inter = d.get("moe_intermediate_size", 768)
        normalize = bool(d.get("norm_topk_prob", False))
    else:
        return {}
    return dict(
        num_experts=experts,
        num_experts_per_tok=d.get("num_experts_per_tok", 2 if model_type == "mixtral" else 8),
        moe_intermediate_size=inter,
        norm_topk_prob=normalize,
        router_aux_loss_coef=d.get("router_aux_loss_coef", 0.001),
    )


def _check_rope_needs(rope: dict[str, Any], source: str) -> None:
    """The parameters `rope["rope_type"]` reads are present, and usable together."""
    kind = rope["rope_type"]
    missing = [k for k in ROPE_REQUIRED.get(kind, ()) if rope.get(k) is None]
    if kind == "yarn" and rope.get("factor") is None:
        missing += [] if "original_max_position_embeddings" in rope else ["factor"]
    if missing:
        raise ValueError(f"{source} of rope type {kind!r} needs {', '.join(missing)}.")
    if kind == "llama3" and rope["low_freq_factor"] == rope["high_freq_factor"]:
        raise ValueError(
            f"{source}.low_freq_factor and high_freq_factor must differ (llama3 rope divides "
            f"by their difference); both are {rope['low_freq_factor']}."
        )


def rope_frequencies(
    config: HFConfig,
    seq_len: Int[Array, ""] | None = None,
    parameters: dict[str, Any] | None = None,
) -> tuple[Float[Array, " half"], float]:
    """`(inv_freq, attention_scaling)` for the config's rope type, as transformers computes
    them (in float32). `seq_len` (traced) matters only to `dynamic` and `longrope`.
    `config`: this family's, or another with `rope_parameters`, `head_dim` and
    `max_position_embeddings` (Gemma's, Phi-3's). `parameters` replace
    `config.rope_parameters` (Gemma 3's sliding layers have rope parameters of their own)."""
    p = config.rope_parameters if parameters is None else parameters
    kind, base, dim = p["rope_type"], float(p["rope_theta"]), config.head_dim
    dim = int(dim * p.get("partial_rotary_factor", 1.0))
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    powers = np.float32(base) ** exponents
    inv_freq = 1.0 / powers
    scaling = 1.0
    if kind == "linear":
        inv_freq = inv_freq / np.float32(p["factor"])
    elif kind == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    elif kind == "yarn":
        inv_freq, scaling = _yarn(p, dim, base, config.max_position_embeddings)
    elif kind == "longrope":
        inv_freq = 1.0 / (np.asarray(p["short_factor"], np.float32) * powers)
        scaling = _longrope_scaling(p, config.max_position_embeddings)
    inv = jnp.asarray(inv_freq, jnp.float32)
    if kind == "longrope" and seq_len is not None:
        # one set for the whole call: the long factors once any position is past the
        # original length (transformers' `longrope_frequency_update`)
        long = 1.0 / (np.asarray(p["long_factor"], np.float32) * powers)
        original = p["original_max_position_embeddings"]
        inv = jnp.where(seq_len > original, jnp.asarray(long, jnp.float32), inv)
    if kind == "dynamic" and seq_len is not None:
        max_pos = config.max_position_embeddings
        factor = p["factor"]
        length = jnp.maximum(seq_len, max_pos).astype(jnp.float32)
        new_base = base * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        exps = jnp.asarray(exponents)
        inv = jnp.where(seq_len > max_pos, 1.0 / (new_base**exps), inv)
    return inv, scaling


def _longrope_scaling(p: dict, max_pos: int) -> float:
    """LongRoPE's scale of cos and sin, the same for short and long factors: the given
    `attention_factor`, else `sqrt(1 + ln(factor) / ln(original))` for a `factor`
    (default: how far `max_position_embeddings` extends the original length) above 1."""
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / original
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn(p: dict, dim: int, base: float, max_pos: int) -> tuple[np.ndarray, float]:
    factor = float(p.get("factor") or max_pos / p["original_max_position_embeddings"])
    original = p.get("original_max_position_embeddings", max_pos)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = (
            mscale(factor, float(m)) / mscale(factor, float(m_all))
            if m and m_all
            else mscale(factor)
        )
    # config.json may hold integers; the annotations here are checked at run time in tests
    fast, slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp.astype(np.float32)
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32), float(attention)


def apply_rope(
    x: Float[Array, "batch seq heads dim"], cos: Array, sin: Array
) -> Float[Array, "batch seq heads dim"]:
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x.dtype)


def rope_tables(
    config: HFConfig,
    position_ids: Int[Array, "batch seq"],
    dtype: Any,
    parameters: dict[str, Any] | None = None,
) -> tuple[Array, Array]:
    """`(cos, sin)` at `position_ids`, `(batch, seq, 1, rotary)`, from `parameters` (by
    default the config's rope parameters)."""
    inv_freq, scaling = rope_frequencies(config, jnp.max(position_ids) + 1, parameters)
    freqs = position_ids[..., None].astype(jnp.float32) * inv_freq[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos = (jnp.cos(emb) * scaling).astype(dtype)[:, :, None, :]
    sin = (jnp.sin(emb) * scaling).astype(dtype)[:, :, None, :]
    return cos, sin


class LlamaAttention(eqx.Module):
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    q_norm: RMSNorm | None  # Qwen3's, over each head's features; None elsewhere
    k_norm: RMSNorm | None

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        c, std = config, config.initializer_range
        kq, kk, kv, ko = jax.random.split(key, 4)
        d, h, kvh, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = normal_linear(d, h * hd, c.qkv_bias, kq, std, dtype)
        self.k_proj = normal_linear(d, kvh * hd, c.qkv_bias, kk, std, dtype)
        self.v_proj = normal_linear(d, kvh * hd, c.qkv_bias, kv, std, dtype)
        self.o_proj = normal_linear(h * hd, d, c.o_proj_bias, ko, std, dtype)
        norm = (lambda: RMSNorm(hd, c.rms_norm_eps, dtype=dtype)) if c.qk_norm else lambda: None
        self.q_norm, self.k_norm = norm(), norm()


class LlamaMLP(eqx.Module):
    gate_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        c, std, bias = config, config.initializer_range, config.mlp_bias
        kg, ku, kd = jax.random.split(key, 3)
        self.gate_proj = normal_linear(c.hidden_size, c.intermediate_size, bias, kg, std, dtype)
        self.up_proj = normal_linear(c.hidden_size, c.intermediate_size, bias, ku, std, dtype)
        self.down_proj = normal_linear(c.intermediate_size, c.hidden_size, bias, kd, std, dtype)


class LlamaDecoderLayer(eqx.Module):
    self_attn: LlamaAttention
    mlp: LlamaMLP | SparseMoeBlock
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray, dtype: Any = jnp.float32):
        ka, km = jax.random.split(key)
        self.self_attn = LlamaAttention(config, key=ka, dtype=dtype)
        if config.num_experts:
            self.mlp = SparseMoeBlock(config, key=km, dtype=dtype)
        else:
            self.mlp = LlamaMLP(config, key=km, dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype
        )


class LlamaModel(eqx.Module):
    """The decoder stack: embeddings, blocks, final norm."""

    embed_tokens: eqx.nn.Embedding
    layers: LayerStack | tuple[LlamaDecoderLayer, ...]
    norm: RMSNorm
    config: LlamaConfig = eqx.field(static=True)
    gradient_checkpointing: bool = eqx.field(static=True)
    remat_policy: RematPolicy = eqx.field(static=True)

    def __init__(
        self,
        config: LlamaConfig,
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
        ke, kl = jax.random.split(key)
        weight = config.initializer_range * jax.random.normal(
            ke, (config.vocab_size, config.hidden_size), dtype
        )
        self.embed_tokens = eqx.nn.Embedding(weight=weight)
        self.layers = make_layers(LlamaDecoderLayer, config, layout, kl, dtype)
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
        """Hidden states for `input_ids`.

        `attention_mask` marks real tokens (1) and padding (0), left or right. Without
        `position_ids`, positions count the real tokens (as `generate` does). With a
        `cache`, the tokens are written at `cache.index` and attend to the cached ones, and
        their default positions continue the count of the real tokens in the cache.
        `position_ids` that restart (`0 1 2 0 1`), given with neither a mask nor a cache,
        pack several examples in a row, each attending only to its own tokens (as in
        transformers: see `packed_segments`). A mixture of experts also returns each
        layer's `router_logits`.
        """
        c = self.config
        slots, key_valid, index, position_ids, segments = decoder_positions(
            input_ids, attention_mask, position_ids, cache
        )
        b, s = input_ids.shape
        h = embed(self.embed_tokens, input_ids)
        cos, sin = rope_tables(c, position_ids, h.dtype)
        windows = c.sliding_windows or (None,) * c.num_hidden_layers
        window = jnp.asarray([w or 2**30 for w in windows], jnp.int32)
        scale = c.head_dim**-0.5
        act = activation(c.hidden_act)

        def step(layer: LlamaDecoderLayer, h: Array, xs: Any) -> tuple[Array, Any]:
            win, kv = xs
            mask = attention_mask_for(slots, key_valid, win, segments)
            x = layer.input_layernorm(h)
            attn = layer.self_attn
            q = linear(attn.q_proj, x).reshape(b, s, c.num_attention_heads, c.head_dim)
            k = linear(attn.k_proj, x).reshape(b, s, c.num_key_value_heads, c.head_dim)
            v = linear(attn.v_proj, x).reshape(b, s, c.num_key_value_heads, c.head_dim)
            if c.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if kv is not None:
                k, v = write_cache(kv[0], kv[1], k, v, index)
                new_kv = (k, v)
            else:
                new_kv = None
            o = dot_product_attention(q, k, v, mask, scale).reshape(b, s, -1)
            h = h + linear(attn.o_proj, o)
            x = layer.post_attention_layernorm(h)
            mlp, router_logits = layer.mlp, None
            if c.num_experts:
                x, router_logits = sparse_moe(mlp, x, c.num_experts_per_tok, c.norm_topk_prob, act)
            else:
                x = linear(mlp.down_proj, act(linear(mlp.gate_proj, x)) * linear(mlp.up_proj, x))
            h = h + x
            return h, (h if output_hidden_states else None, new_kv, router_logits)

        kv_in = None if cache is None else (cache.key, cache.value)
        h, (hidden, kv_out, router_logits) = run_layers(
            self.layers,
            step,
            h,
            (window, kv_in),
            gradient_checkpointing=self.gradient_checkpointing,
            remat_policy=self.remat_policy,
        )
        new_cache = None
        if cache is not None:
            new_cache = KVCache(kv_out[0], kv_out[1], key_valid, cache.index + s)
        return BaseModelOutput(self.norm(h), hidden, new_cache, router_logits=router_logits)


def attention_mask_for(
    slots: Array, key_valid: Array, window: Array, segments: Array | None
) -> Array:
    return attention_mask(slots, key_valid, causal=True, window=window, segments=segments)


class LlamaForCausalLM(eqx.Module):
    """`LlamaModel` with the language-model head (tied to the embeddings when the config
    says so: then `lm_head` is None)."""

    model: LlamaModel
    lm_head: eqx.nn.Linear | None

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray, **kwargs: Any):
        km, kh = jax.random.split(key)
        self.model = LlamaModel(config, key=km, **kwargs)
        dtype = kwargs.get("dtype", jnp.float32)
        self.lm_head = fresh_lm_head(config, kh, dtype)

    @property
    def config(self) -> LlamaConfig:
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
        aux_loss = None
        if out.router_logits is not None:
            c = self.config
            aux_loss = load_balancing_loss(out.router_logits, c.num_experts_per_tok, attention_mask)
        return CausalLMOutput(logits, out.hidden_states, out.cache, out.router_logits, aux_loss)


class LlamaForSequenceClassification(eqx.Module):
    """`LlamaModel` with `score`, read at each sequence's last non-padding token.
    `num_labels` overrides the config's, as transformers' `from_pretrained(...,
    num_labels=3)` does."""

    model: LlamaModel
    score: eqx.nn.Linear

    def __init__(
        self,
        config: LlamaConfig,
        *,
        key: PRNGKeyArray,
        num_labels: int | None = None,
        **kwargs: Any,
    ):
        km, kh = jax.random.split(key)
        config = with_num_labels(config, num_labels)
        self.model = LlamaModel(config, key=km, **kwargs)
        dtype = kwargs.get("dtype", jnp.float32)
        self.score = fresh_score(config, kh, dtype)

    @property
    def config(self) -> LlamaConfig:
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


# the experts as transformers' save_pretrained writes them by default (the Hub's layout)
_HUB_KEYS = {
    "mixtral": (
        HubKeys(
            "{m}.mlp.experts.gate_up_proj",
            (
                "{m}.block_sparse_moe.experts.{e}.w1.weight",
                "{m}.block_sparse_moe.experts.{e}.w3.weight",
            ),
        ),
        HubKeys("{m}.mlp.experts.down_proj", ("{m}.block_sparse_moe.experts.{e}.w2.weight",)),
        HubKeys("{m}.mlp.gate.weight", ("{m}.block_sparse_moe.gate.weight",)),
    ),
    "qwen3_moe": (
        HubKeys(
            "{m}.mlp.experts.gate_up_proj",
            ("{m}.mlp.experts.{e}.gate_proj.weight", "{m}.mlp.experts.{e}.up_proj.weight"),
        ),
        HubKeys("{m}.mlp.experts.down_proj", ("{m}.mlp.experts.{e}.down_proj.weight",)),
    ),
}

for _model_type in LlamaConfig.MODEL_TYPES:
    _prefix = {
        "llama": "Llama",
        "mistral": "Mistral",
        "qwen2": "Qwen2",
        "qwen3": "Qwen3",
        "mixtral": "Mixtral",
        "qwen3_moe": "Qwen3Moe",
    }[_model_type]
    register(
        _model_type,
        Architecture(
            config_class=LlamaConfig,
            classes={
                f"{_prefix}Model": LlamaModel,
                f"{_prefix}ForCausalLM": LlamaForCausalLM,
                f"{_prefix}ForSequenceClassification": LlamaForSequenceClassification,
            },
            default=f"{_prefix}Model",
            prefix="model",
            new_heads=(r"score\.weight",),
            ignored=(r".*rotary_emb\.inv_freq", r"lm_head\.weight"),
            hub_keys=_HUB_KEYS.get(_model_type, ()),
        ),
    )
