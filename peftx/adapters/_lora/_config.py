"""LoRA's config: HF PEFT's `LoraConfig`, its PEFT key order, its default targets, and the
adapter it builds on each layer (`LoraArray`, `DoraArray`, `LoraEmbeddingArray`, or
`ExpertLoraArray` on an expert stack)."""

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import equinox as eqx
from jaxtyping import PRNGKeyArray

from ..._config import (
    FINITE,
    MAX_RANK,
    PEFT_BASE_KEYS,
    PEFT_ONLY_COMMON,
    PROBABILITY,
    RANK,
    RANKS,
    RANKS_TYPE,
    SCALES,
    SCALES_TYPE,
    AbstractAdapterConfig,
    AdaptedLayer,
    AdaptedParameter,
    Range,
    by_pattern,
    field,
)
from ..._kind import AbstractAdapter
from ..._select import Predicate
from ._corda import CordaConfig
from ._dora import dora
from ._embedding import lora_embedding
from ._eva import EvaConfig
from ._experts import expert_lora
from ._lora import lora, pissa_niter
from ._lora_ga import LoraGAConfig

# PEFT 0.21's defaults for `target_modules=None` (`peft.utils.constants`), for the
# architectures peftx users load; tests compare them with PEFT's own tables.
LORA_TARGET_MODULES: dict[str, tuple[str, ...]] = {
    "bart": ("q_proj", "v_proj"),
    "bert": ("query", "value"),
    "bloom": ("query_key_value",),
    "electra": ("query", "value"),
    "falcon": ("query_key_value",),
    "gemma": ("q_proj", "v_proj"),
    "gemma2": ("q_proj", "v_proj"),
    "gemma3_text": ("q_proj", "v_proj"),
    "gpt2": ("c_attn",),
    "gpt_neox": ("query_key_value",),
    "gptj": ("q_proj", "v_proj"),
    "llama": ("q_proj", "v_proj"),
    "mistral": ("q_proj", "v_proj"),
    "mixtral": ("q_proj", "v_proj"),
    "opt": ("q_proj", "v_proj"),
    "phi": ("q_proj", "v_proj", "fc1", "fc2"),
    "qwen2": ("q_proj", "v_proj"),
    "qwen3": ("q_proj", "v_proj"),
    "roberta": ("query", "value"),
    "t5": ("q", "v"),
    "xlm-roberta": ("query", "value"),
}

# PEFT 0.21 reads the LoRA target names of transformers 4's mixtures of experts, whose
# experts and router were Linear layers, as transformers 5's fused expert stacks
# (`peft.utils.transformers_weight_conversion`): each old name becomes a
# `target_parameters` entry, and the two halves fused into `gate_up_proj` one entry of
# twice the rank and alpha. `"all-linear"` means every old name too.
_MOE_TARGETS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "mixtral": (
        {"gate": "gate.weight", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
        ("w1", "w3"),
    ),
    "qwen3_moe": (
        {
            "gate": "gate.weight",
            "gate_proj": "gate_up_proj",
            "up_proj": "gate_up_proj",
            "down_proj": "down_proj",
        },
        ("gate_proj", "up_proj"),
    ),
}


# Keys of PEFT 0.21.2's `LoraConfig` that peftx does not model, with PEFT's defaults.
PEFT_ONLY_LORA: dict[str, Any] = {
    "megatron_config": None,
    "megatron_core": "megatron.core",
    "trainable_token_indices": None,
    # eva_config, corda_config and lora_ga_config are LoraConfig fields; AdaLoRA reads this table
    "eva_config": None,
    "corda_config": None,
    "lora_ga_config": None,
    "velora_config": None,
    "alora_invocation_tokens": None,
    "use_qalora": False,
    "qalora_group_size": 16,
    "monteclora_config": None,
    "layer_replication": None,
    "lora_bias": False,
    "use_bdlora": None,
    "arrow_config": None,
    "kasa_config": None,
    "ensure_weight_tying": False,
}
LORA_KEYS = (
    *PEFT_BASE_KEYS,
    "r",
    "target_modules",
    "exclude_modules",
    "lora_alpha",
    "lora_dropout",
    "fan_in_fan_out",
    "bias",
    "use_rslora",
    "modules_to_save",
    "init_lora_weights",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "megatron_config",
    "megatron_core",
    "trainable_token_indices",
    "loftq_config",
    "eva_config",
    "corda_config",
    "lora_ga_config",
    "use_dora",
    "velora_config",
    "alora_invocation_tokens",
    "use_qalora",
    "qalora_group_size",
    "monteclora_config",
    "layer_replication",
    "lora_bias",
    "target_parameters",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
    "ensure_weight_tying",
)

# PEFT's LoRA settings peftx ignores with a warning when not at their defaults: they only
# matter to PEFT's torch machinery or to initialization, which is over once an adapter is
# saved (any other PEFT-only setting changes what the adapter computes: an error).
LORA_HARMLESS = frozenset(
    {
        "megatron_config",
        "megatron_core",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "velora_config",
        "qalora_group_size",
        "ensure_weight_tying",
    }
)


_LORA_INITS = (
    True, False, "gaussian", "pissa", "olora", "orthogonal", "mica", "loftq", "eva", "corda",
    "lora_ga",
)  # fmt: skip
_LORA_INIT_MEANS = (
    "True, False, 'gaussian', 'pissa', 'pissa_niter_K' (K an int), 'olora', 'orthogonal', "
    "'mica', 'loftq', 'eva', 'corda' or 'lora_ga'"
)
_LORA_INIT = Range(
    lambda v: any(type(v) is type(c) and v == c for c in _LORA_INITS) or pissa_niter(v) is not None,
    f"`{{name}}` must be {_LORA_INIT_MEANS}",
)
# PEFT's `LoftQConfig`, as `LoraConfig.loftq_config` holds it (a dict), with its defaults
_LOFTQ_DEFAULTS = {"loftq_bits": 4, "loftq_iter": 1}
_LOFTQ = Range(
    lambda v: type(v) is int and 1 <= v <= 64,
    "`{name}` holds loftq_bits (4, or PEFT's 8) and loftq_iter, positive integers",
)
# Inits PEFT cannot re-run on loading a file on CPU, and why: peftx reads such a file's
# tensors as a plain LoRA, with a warning
_READ_AS_PLAIN = {
    "loftq": "PEFT re-runs LoftQ on loading, with bitsandbytes on CUDA only",
    "corda": "PEFT cannot load it without preprocess_corda's data",
}
_LORA_RANK = Range(
    RANK.holds, f"`r` (the LoRA rank) must be a positive integer (at most {MAX_RANK})"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig(AbstractAdapterConfig):
    """HF PEFT's `LoraConfig`: the same field names, meanings and defaults.

    **Arguments:**

    - `r`: the rank of the update `ΔW = (B @ A) * scaling`.
    - `lora_alpha`: `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`).
    - `target_modules`: which modules to adapt. A string is a regex that must match the whole
      dotted path; a list matches a path equal to an entry or ending in `"." + entry`; the
      string `"all-linear"` means every linear layer except the output head (expanded by the
      model-level API, which then saves the expanded list, as PEFT does); `None` means the
      architecture's default list (also resolved by the model-level API). peftx also accepts
      a `Predicate` (see `peftx.peft_targets`), which cannot be saved to JSON.
    - `exclude_modules`: modules never adapted; same forms as `target_modules`; wins over it.
    - `lora_dropout`: dropout probability on the LoRA input, in `[0, 1)`.
    - `fan_in_fan_out`: the base weight is stored `(in, out)` (GPT-2's `Conv1D`).
    - `bias`: which biases train: `"none"`, `"all"` or `"lora_only"` (of adapted layers).
    - `use_rslora`: rank-stabilized scaling `lora_alpha / sqrt(r)`.
    - `modules_to_save`: modules trained in full and saved alongside the adapter.
    - `init_lora_weights`: `True` (Kaiming-uniform A, zero B: a no-op at start), `False`
      (random B too, for tests), `"gaussian"` (normal A with std `1/r`), `"pissa"` (the
      top-`r` singular triplets of each weight, which is replaced by the residual),
      `"pissa_niter_K"` (the same by randomized SVD with `K` subspace iterations, drawn
      from the key), `"olora"` (the first `r` columns of `W = QR`, the residual replacing
      `W`), `"orthogonal"` (random factors with `B @ A = 0`, from a random orthogonal
      matrix; `r` even; the base is left as it is). These last four are for Linear layers,
      as in PEFT; a file saved with one loads as PEFT loads it (the residual re-derived).
      `"mica"`: `lora_B` the left singular vectors of the `r` smallest singular values,
      frozen (only `lora_A` trains, as in PEFT), `lora_A` zeros; on Linear layers and
      embedding tables, as in PEFT. `"loftq"`: with
      `loftq_config`, the base is quantized to NF4 (an `NF4Array`, QLoRA's format) and the
      factors take the SVD of what quantization lost, alternately (PEFT's `loftq_init`;
      4 bits; as in PEFT the factors ignore `scaling`, so take `lora_alpha = r`). A file
      naming `"loftq"` is read as a plain LoRA on the base given (PEFT re-runs LoftQ on
      CUDA only), with a warning; `path_initial_model_for_weight_conversion` refuses it.
    - `loftq_config`: PEFT's `LoftQConfig` as a dict, `{"loftq_bits": 4, "loftq_iter": 1}`
      (keys left out take these defaults, written out as PEFT needs them); only with
      `init_lora_weights="loftq"`.
      `"eva"`, `"corda"`, `"lora_ga"`: the default init, until `peftx.initialize_lora`
      sets the factors from the layers' inputs (their gradients for LoRA-GA) on a few
      batches (see `eva_config`, `corda_config`, `lora_ga_config`); CorDA and LoRA-GA
      replace the weight by a residual, as PiSSA does.
    - `layers_to_transform`: only these layer indices (the first numbered path segment, or
      the one after `layers_pattern`). Not allowed with a regex `target_modules`.
    - `layers_pattern`: the name of the layer list (`"layers"`, `"h"`); needs
      `layers_to_transform`.
    - `rank_pattern`, `alpha_pattern`: per-module `r`/`lora_alpha`, keyed by regex.
    - `use_dora`: weight-decomposed LoRA (a learned magnitude vector).
    - `eva_config`, `corda_config`, `lora_ga_config`: the settings (`EvaConfig`,
      `CordaConfig`, `LoraGAConfig`) of `init_lora_weights="eva"`, `"corda"`, `"lora_ga"`.
    - `target_parameters`: stacks of expert weights to adapt directly, by parameter name
      (`["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]`: a path equal to an entry or
      ending in `"." + entry`), each expert with its own rank-`r` update
      (`ExpertLoraArray`, PEFT's `ParamWrapper`). With `target_modules=None`, only these
      are adapted (as PEFT 0.21 does, whatever the architecture's default). Needs
      `lora_dropout=0`, no DoRA and no `fan_in_fan_out`, as in PEFT. An entry naming a
      layer's weight (`"gate.weight"`) adapts that layer.
    - `task_type`, `base_model_name_or_path`, `revision`, `inference_mode`, `peft_version`:
      PEFT's bookkeeping, written to and read from `adapter_config.json` as is.

    ```python
    config = peftx.LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"])
    peftx.save_config(config, "out/")      # out/adapter_config.json, loadable by PEFT
    assert peftx.load_config("out/") == config
    ```
    """

    peft_type: Literal["LORA"] = "LORA"
    r: int = field(default=8, range=_LORA_RANK)
    lora_alpha: int | float = field(default=8, range=FINITE)
    lora_dropout: int | float = field(default=0.0, range=PROBABILITY, converter=float)
    bias: Literal["none", "all", "lora_only"] = "none"
    use_rslora: bool = False
    init_lora_weights: bool | str = field(default=True, range=_LORA_INIT, means=_LORA_INIT_MEANS)
    rank_pattern: dict[str, int] = field(default_factory=dict, range=RANKS, means=RANKS_TYPE)
    alpha_pattern: dict[str, int | float] = field(
        default_factory=dict, range=SCALES, means=SCALES_TYPE
    )
    use_dora: bool = False
    loftq_config: dict[str, int] = field(
        default_factory=dict,
        range=_LOFTQ,
        # the defaults filled in, in the frozen dict the config holds (`type(d)`)
        converter=lambda d: type(d)({**_LOFTQ_DEFAULTS, **d}) if d else d,
        means="a dict of PEFT's LoftQConfig fields (loftq_bits, loftq_iter)",
    )
    eva_config: EvaConfig | dict[str, Any] | None = field(
        default=None,
        converter=EvaConfig.of,
        means="None, an EvaConfig or a dict of its fields",
    )
    corda_config: CordaConfig | dict[str, Any] | None = field(
        default=None,
        converter=CordaConfig.of,
        means="None, a CordaConfig or a dict of its fields",
    )
    lora_ga_config: LoraGAConfig | dict[str, Any] | None = field(
        default=None,
        converter=LoraGAConfig.of,
        means="None, a LoraGAConfig or a dict of its fields",
    )
    target_parameters: list[str] | tuple[str, ...] | None = field(
        default=None,
        means="None or a list of parameter names (e.g. ['mlp.experts.gate_up_proj'])",
    )

    toml_table: ClassVar[str | None] = "lora"
    combination_types: ClassVar[tuple[str, ...]] = ("svd", "linear", "cat")
    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = LORA_TARGET_MODULES
    _KEYS: ClassVar[tuple[str, ...] | None] = LORA_KEYS
    _PEFT_ONLY: ClassVar[dict[str, Any]] = {**PEFT_ONLY_COMMON, **PEFT_ONLY_LORA}
    _HARMLESS: ClassVar[frozenset[str]] = LORA_HARMLESS

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = sorted(set(self.loftq_config) - set(_LOFTQ_DEFAULTS))
        if unknown:
            raise ValueError(
                f"loftq_config holds {unknown}; PEFT's LoftQConfig has loftq_bits and loftq_iter."
            )
        if (self.init_lora_weights == "loftq") != bool(self.loftq_config):
            raise ValueError(
                "init_lora_weights='loftq' and loftq_config go together (as PEFT requires): got "
                f"init_lora_weights={self.init_lora_weights!r} and loftq_config="
                f"{dict(self.loftq_config)!r}. Pass loftq_config={{'loftq_bits': 4, "
                "'loftq_iter': 1}} with 'loftq', or neither."
            )
        if self.use_dora and self.init_lora_weights == "mica":
            raise ValueError(
                "init_lora_weights='mica' cannot be combined with use_dora=True (PEFT has no "
                "such variant): MiCA freezes lora_B, DoRA rescales it. Drop one of them."
            )
        if self.target_parameters:
            # PEFT's `ParamWrapper` refuses the same
            refused = {
                "lora_dropout": self.lora_dropout != 0.0,
                "use_dora": self.use_dora,
                "fan_in_fan_out": self.fan_in_fan_out,
                f"init_lora_weights={self.init_lora_weights!r}": self.init_lora_weights
                not in (True, False, "gaussian"),
            }
            bad = [name for name, on in refused.items() if on]
            if bad:
                raise ValueError(
                    f"target_parameters {list(self.target_parameters)} cannot be combined with "
                    f"{', '.join(bad)}: an expert stack's LoRA has no dropout (its input cannot "
                    "be factored out), no DoRA, no init from the weight (PiSSA, OLoRA) and no "
                    "transposed layout (as in PEFT). Set lora_dropout=0, use_dora=False, "
                    "fan_in_fan_out=False, init_lora_weights True, False or 'gaussian', or drop "
                    "target_parameters."
                )

    def expert_targets(self) -> tuple[str, ...]:
        return tuple(self.target_parameters or ())

    def with_model_defaults(self, model_type: str | None) -> "LoraConfig":
        if self.target_parameters:
            # PEFT 0.21 adapts the parameters alone then (and writes `target_modules: []`)
            return dataclasses.replace(self, target_modules=())
        return super().with_model_defaults(model_type)

    def with_model_names(self, model_type: str | None, linear_names: Sequence[str]) -> "LoraConfig":
        """This config with the expert and router names of transformers 4's Mixtral or
        Qwen3-MoE (`w1`/`w3`/`w2`, `gate_proj`/`up_proj`/`down_proj`, `gate`) read as
        `target_parameters`, as PEFT reads them on transformers 5's models (see
        `_MOE_TARGETS`). A regex `target_modules` is left as it is."""
        target = self.target_modules
        if model_type not in _MOE_TARGETS or not target:
            return self
        names, fused = _MOE_TARGETS[model_type]
        if target == "all-linear":
            target = sorted(set(linear_names) | set(names))
        elif isinstance(target, str | Predicate):
            return self
        parameters = list(self.target_parameters or ())
        modules, named = [], set()
        for t in target:
            old = next((o for o in names if t == o or t.endswith("." + o)), None)
            if old is None:
                modules.append(t)
                continue
            named.add(old)
            if names[old] not in parameters:
                parameters.append(names[old])
        halves = named & set(fused)
        if halves and halves != set(fused):
            raise ValueError(
                f"target_modules names {sorted(halves)} but not {sorted(set(fused) - halves)}: "
                f"in transformers 5's {model_type} they are fused into one `gate_up_proj` stack, "
                "adapted whole or not at all (as PEFT requires). Name both, or neither."
            )
        rank, alpha = dict(self.rank_pattern), dict(self.alpha_pattern)
        if halves:
            rank[r".*\.gate_up_proj"] = self.r * len(fused)
            alpha[r".*\.gate_up_proj"] = self.lora_alpha * len(fused)
        return dataclasses.replace(
            self,
            target_modules=modules,
            target_parameters=parameters,
            rank_pattern=rank,
            alpha_pattern=alpha,
        )

    def build_experts(
        self, base: Any, parameter: AdaptedParameter, *, key: PRNGKeyArray
    ) -> AbstractAdapter:
        """The adapter on one expert stack `base (experts, out, in)` of `target_parameters`."""
        init = {True: "default", False: "random"}.get(
            self.init_lora_weights, self.init_lora_weights
        )
        return expert_lora(
            base,
            r=parameter.rank,
            lora_alpha=parameter.alpha,
            init=init,
            use_rslora=self.use_rslora,
            key=key,
        )

    def for_reading(self) -> "LoraConfig":
        """The config whose adapters a file's tensors are read into: this one, or for an
        init PEFT cannot re-run on loading on CPU (`_READ_AS_PLAIN`), a plain LoRA (with
        a warning), so that the file's factors apply to the base as given."""
        if self.init_lora_weights not in _READ_AS_PLAIN:
            return self
        warnings.warn(
            f"the adapter's config says init_lora_weights={self.init_lora_weights!r} "
            f"({_READ_AS_PLAIN[self.init_lora_weights]}); peftx reads its tensors as a plain "
            "LoRA on the base model as given (load the base its init left, e.g. LoftQ's "
            "quantized model or CorDA's residual).",
            UserWarning,
            stacklevel=4,
        )
        return dataclasses.replace(self, init_lora_weights=True, loftq_config={})

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        init = {
            True: "default",
            False: "random",
            "eva": "default",
            "corda": "default",
            "lora_ga": "default",
        }.get(self.init_lora_weights, self.init_lora_weights)
        loftq = self.loftq_config or _LOFTQ_DEFAULTS
        r, alpha = layer.rank, layer.alpha
        if isinstance(layer.layer, eqx.nn.Embedding):
            return lora_embedding(
                base, r=r, lora_alpha=alpha, init=init, use_rslora=self.use_rslora, key=key
            )
        adapter = lora(
            base,
            r=r,
            lora_alpha=alpha,
            init=init,
            use_rslora=self.use_rslora,
            lora_dropout=self.lora_dropout,
            loftq_bits=loftq["loftq_bits"],
            loftq_iter=loftq["loftq_iter"],
            key=key,
        )
        return dora(adapter) if self.use_dora else adapter

    def rank_and_alpha(self, path: str) -> tuple[int, int | float]:
        """PEFT's `rank_pattern`/`alpha_pattern` for the module at `path`: the first key
        that matches the path's end, else `r`/`lora_alpha`."""
        return (
            by_pattern(self.rank_pattern, path, self.r),
            by_pattern(self.alpha_pattern, path, self.lora_alpha),
        )

    def unsupported(self, path: str, layer: Any) -> str | None:
        if self.use_dora and not isinstance(layer, eqx.nn.Linear):
            return (
                f"DoRA (use_dora=True) adapts Linear layers only; {path!r} is an "
                f"eqx.nn.{type(layer).__name__}. Exclude it (exclude_modules) or use plain LoRA."
            )
        return None

    @property
    def changes_base(self) -> bool:
        init = self.init_lora_weights
        return init in ("pissa", "olora", "loftq") or pissa_niter(init) is not None

    @property
    def leaves_residual(self) -> bool:
        init = self.init_lora_weights
        return init in ("pissa", "olora", "corda", "lora_ga") or pissa_niter(init) is not None

    def combined(
        self,
        configs: Sequence[AbstractAdapterConfig],
        names: Sequence[str],
        combination_type: str,
        svd_rank: int | None,
    ) -> "LoraConfig":
        """PEFT's rule: `r = lora_alpha` the new rank (`"linear"`: the common rank, `"cat"`:
        their sum, `"svd"`: `svd_rank`, default the largest), no patterns."""
        config = super().combined(configs, names, combination_type, svd_rank)
        if any(c.use_dora for c in configs):
            raise ValueError("add_weighted_adapter combines LoRA adapters, not DoRA ones.")
        ranks = [max([c.r, *(c.rank_pattern or {}).values()]) for c in configs]
        if combination_type == "linear" and len(set(ranks)) != 1:
            raise ValueError(
                f"combination_type 'linear' needs adapters of one rank, got r={ranks} for "
                f"{list(names)}; use 'cat' or 'svd'."
            )
        rank = {"linear": ranks[0], "cat": sum(ranks), "svd": svd_rank or max(ranks)}[
            combination_type
        ]
        return dataclasses.replace(
            config, r=rank, lora_alpha=rank, rank_pattern={}, alpha_pattern={}
        )
