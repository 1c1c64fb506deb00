"""Adapter configurations in HF PEFT's format: `LoraConfig`, `IA3Config`, `adapter_config.json`.

Field names, meanings and defaults are PEFT's (checked against PEFT 0.21.2), so an
`adapter_config.json` written here loads in `peft.LoraConfig.from_pretrained` and one written by
PEFT loads here. Configs are frozen and hashable (usable as static fields of an `eqx.Module`);
list-valued fields are stored as tuples.

A config class is one adapter kind's entry point: it is registered by its `peft_type` (and
its TOML table), it builds the adapter for each layer `peftx.targets` resolves (`build`), and
it says how PEFT writes it after placing it (`as_saved`). Resolving a config against a model
(PEFT's per-architecture defaults when `target_modules` is `None`, expanding `"all-linear"`)
is `peftx.targets`' job.
"""

import dataclasses
import difflib
import enum
import json
import os
import pathlib
import re
import types
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from ._files import read_json, read_toml, write_text
from ._select import Predicate, peft_targets
from ._targets import (
    IA3_FEEDFORWARD_MODULES,
    IA3_TARGET_MODULES,
    LORA_TARGET_MODULES,
    AdaptedLayer,
    AdaptedParameter,
)
from .adapters import (
    AbstractAdapter,
    AbstractTrainHook,
    IA3Array,
    RankAllocator,
    adalora,
    dora,
    expert_lora,
    ia3,
    loha,
    lokr,
    lora,
    lora_embedding,
    oft,
    vera,
    vera_projections,
)

CONFIG_NAME = "adapter_config.json"

TaskType = Literal[
    "SEQ_CLS", "SEQ_2_SEQ_LM", "CAUSAL_LM", "TOKEN_CLS", "QUESTION_ANS", "FEATURE_EXTRACTION"
]

# One of PEFT's module-name rules: a regex string (full match on the dotted path), a list
# of names (exact or dotted-suffix match), or, in peftx only, a `Predicate`.
ModuleRule = str | list[str] | tuple[str, ...] | Predicate | None
RULE = "None, a regex string, a list of module names, or a peftx Predicate"

# Keys that PEFT 0.21.2 writes but peftx does not model, with PEFT's default values. On load,
# a default value is dropped silently. A non-default value of a key in `_HARMLESS` is ignored
# with a warning (it only matters to PEFT's torch machinery or to initialization, which is
# over once an adapter is saved); any other non-default value is an error, because ignoring it
# would give an adapter that computes something else.
_PEFT_ONLY_COMMON: dict[str, Any] = {"auto_mapping": None}
_PEFT_ONLY_LORA: dict[str, Any] = {
    "megatron_config": None,
    "megatron_core": "megatron.core",
    "trainable_token_indices": None,
    "loftq_config": {},
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
_HARMLESS = frozenset(
    {
        "auto_mapping",
        "megatron_config",
        "megatron_core",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "velora_config",
        "qalora_group_size",
        "ensure_weight_tying",
        # LoraConfig's fields that AdaLoRA's layers never read (PEFT warns of `r`)
        "r",
        "use_rslora",
        "alpha_pattern",
    }
)
# Keys PEFT never saves (PEFT itself drops them on load).
_NEVER_SAVED = frozenset({"runtime_config"})
# Keys dropped without a warning whatever their value: `auto_mapping` names the torch class
# for PEFT's `AutoPeftModel` and is in most files PEFT writes.
_SILENT = frozenset({"auto_mapping"})

# The order in which PEFT 0.21.2's `to_dict` lists its keys (`asdict` field order).
_PEFT_BASE_KEYS = (
    "task_type",
    "peft_type",
    "auto_mapping",
    "peft_version",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
)
_LORA_KEYS = (
    *_PEFT_BASE_KEYS,
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
_IA3_KEYS = (
    *_PEFT_BASE_KEYS,
    "target_modules",
    "exclude_modules",
    "feedforward_modules",
    "fan_in_fan_out",
    "modules_to_save",
    "init_ia3_weights",
)
_OFT_KEYS = (
    *_PEFT_BASE_KEYS,
    "r",
    "oft_block_size",
    "module_dropout",
    "target_modules",
    "fan_in_fan_out",
    "bias",
    "exclude_modules",
    "init_weights",
    "layers_to_transform",
    "layers_pattern",
    "modules_to_save",
    "coft",
    "eps",
    "block_share",
    "use_cayley_neumann",
    "num_cayley_neumann_terms",
)

# The PEFT version whose Cayley-Neumann series `OFTArray` computes, written to a saved
# OFT config that names none (PEFT refuses such a file).
_OFT_SERIES_VERSION = "0.21.2"

_VERA_KEYS = (
    *_PEFT_BASE_KEYS,
    "r",
    "target_modules",
    "projection_prng_key",
    "save_projection",
    "vera_dropout",
    "d_initial",
    "fan_in_fan_out",
    "bias",
    "modules_to_save",
    "init_weights",
    "layers_to_transform",
    "layers_pattern",
)
_ADALORA_KEYS = (
    *_LORA_KEYS[: _LORA_KEYS.index("ensure_weight_tying") + 1],
    "target_r",
    "init_r",
    "tinit",
    "tfinal",
    "deltaT",
    "beta1",
    "beta2",
    "orth_reg_weight",
    "total_step",
)
_LYCORIS_KEYS = (
    *_PEFT_BASE_KEYS,
    "rank_pattern",
    "alpha_pattern",
    "r",
    "alpha",
    "rank_dropout",
    "module_dropout",
    "use_effective_conv2d",
)
_LYCORIS_TAIL = (
    "target_modules",
    "exclude_modules",
    "init_weights",
    "layers_to_transform",
    "layers_pattern",
    "modules_to_save",
)
_LOHA_KEYS = (*_LYCORIS_KEYS, *_LYCORIS_TAIL)
_LOKR_KEYS = (
    *_LYCORIS_KEYS,
    "decompose_both",
    "decompose_factor",
    "rank_dropout_scale",
    *_LYCORIS_TAIL,
)


# -- per-field checks, read from each field's annotation and metadata -----------------------

# The largest rank: an array dimension that JAX indexes with int32.
MAX_RANK = 2**31 - 1
# The largest `lora_alpha`: the scaling multiplies float32 (or bfloat16) arrays, and a larger
# number is infinite there. `abs(v) <= FLOAT32_MAX` is False for NaN and inf too, and compares
# an int of any size exactly (`math.isfinite(10**400)` would raise OverflowError).
FLOAT32_MAX = 3.4028234663852886e38


@dataclasses.dataclass(frozen=True)
class Range:
    """A field's valid values beyond its type: `holds(v)` for each number of the value (each
    item of a list, each value of a dict), and what a valid value is (`{name}`: the field's
    name). NaN fails every comparison, so `holds` says what is allowed (`0 <= v < 1`), never
    what is refused (`v < 0`)."""

    holds: Callable[[Any], bool]
    expected: str

    def at_fault(self, value: Any) -> Any:
        """The part of `value` that fails: the value itself, or a dict's failing entries;
        None when every number holds."""
        if isinstance(value, Mapping):
            return {k: v for k, v in value.items() if not self.holds(v)} or None
        values = value if isinstance(value, list | tuple) else () if value is None else (value,)
        return None if all(map(self.holds, values)) else value


RANK = Range(
    lambda v: 1 <= v <= MAX_RANK, f"`{{name}}` must be a positive integer (at most {MAX_RANK})"
)
FINITE = Range(
    lambda v: abs(v) <= FLOAT32_MAX,
    "`{name}` must be a finite number (within float32's range, ±3.4e38)",
)
PROBABILITY = Range(lambda v: 0 <= v < 1, "`{name}` must be a probability in [0, 1)")
# PEFT's `rank_pattern` and `alpha_pattern`: per-module values keyed by regex
RANKS = Range(RANK.holds, f"`{{name}}` ranks must be positive integers (at most {MAX_RANK})")
RANKS_TYPE = "a dict from module-name patterns to int ranks"
SCALES = Range(
    FINITE.holds, "`{name}` values must be finite numbers (within float32's range, ±3.4e38)"
)
SCALES_TYPE = "a dict from module-name patterns to numbers"


def field(
    *,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
    range: Range | None = None,
    converter: Callable[[Any], Any] | None = None,
    means: str | None = None,
) -> Any:
    """A config field whose annotation is its check, with what the annotation cannot say:
    its `range`, a `converter` applied once the value is checked (`float` for a dropout
    given as `0`), and `means`, the words for its type in a message where the annotation's
    own ("a list of strings") would say less."""
    metadata = {"range": range, "converter": converter, "means": means}
    return dataclasses.field(
        default=default,
        default_factory=default_factory,
        metadata={k: v for k, v in metadata.items() if v is not None},
    )


def _members(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(m for a in typing.get_args(annotation) for m in _members(a))
    return (annotation,)


def _choices(annotation: Any) -> tuple[Any, ...] | None:
    """The values a `Literal` annotation allows (`bool` as True and False, None first), or
    None for an annotation without a `Literal`."""
    members = _members(annotation)
    if not any(typing.get_origin(m) is Literal for m in members):
        return None
    choices = [None] if type(None) in members else []
    for m in members:
        if m is bool:
            choices += [True, False]
        elif typing.get_origin(m) is Literal:
            choices += typing.get_args(m)
        elif m is not type(None):
            raise TypeError(f"a field annotated {annotation} mixes a Literal with {m}.")
    return tuple(choices)


def _accepts(annotation: Any, value: Any) -> bool:
    """Whether `value` has the type `annotation` says (a list stands for a tuple too)."""
    if annotation is Any:
        return True
    if annotation is type(None):
        return value is None
    if annotation in (int, float):  # a bool is no number here; an int is a float
        return isinstance(value, annotation | int) and not isinstance(value, bool)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(a, value) for a in args)
    if origin in (list, tuple):
        return isinstance(value, list | tuple) and all(_accepts(args[0], v) for v in value)
    if origin is dict:
        return isinstance(value, Mapping) and all(
            _accepts(args[0], k) and _accepts(args[1], v) for k, v in value.items()
        )
    return isinstance(value, annotation)


def _one(annotation: Any, plural: bool = False) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin in (list, tuple):
        return f"{'lists' if plural else 'a list'} of {_one(args[0], plural=True)}"
    if origin is dict:
        keys, values = _one(args[0], plural=True), _one(args[1], plural=True)
        return f"{'dicts' if plural else 'a dict'} from {keys} to {values}"
    if origin in (typing.Union, types.UnionType):
        numbers = [a for a in args if not (a is int and float in args)]
        return " or ".join(dict.fromkeys(_one(a, plural) for a in numbers))
    words = {bool: ("a bool", "bools"), int: ("an int", "ints"), str: ("a string", "strings")}
    if annotation is float:
        return "numbers" if plural else "a number"
    if annotation in words:
        return words[annotation][plural]
    return f"{annotation.__name__}s" if plural else f"a {annotation.__name__}"


def _described(annotation: Any) -> str:
    """What an annotation allows, in words: `int | float | None` is "None or a number"."""
    members = _members(annotation)
    if int in members and float in members:
        members = tuple(m for m in members if m is not int)
    words = list(dict.fromkeys(_one(m) for m in members))
    words.sort(key=lambda w: w != "None")
    return " or ".join(words) if len(words) < 3 else f"{', '.join(words[:-1])}, or {words[-1]}"


def _check_field(field: dataclasses.Field, value: Any) -> None:
    """A `TypeError`/`ValueError` naming `field` if `value` is not valid for it alone: its
    annotation's type or `Literal` choices, then its metadata's range."""
    name, choices = field.name, _choices(field.type)
    if choices is not None:
        # Compare types too, so that `1` is not taken for `True`.
        if not any(type(value) is type(c) and value == c for c in choices):
            words = {c.lower(): c for c in choices if isinstance(c, str)}
            close = (
                difflib.get_close_matches(value.lower(), words, n=1)
                if isinstance(value, str)
                else []
            )
            hint = f" Did you mean {words[close[0]]!r}?" if close else ""
            raise ValueError(
                f"`{name}` must be one of {', '.join(map(repr, choices))}; got {value!r}.{hint}"
            )
    elif not _accepts(field.type, value):
        expected = field.metadata.get("means") or _described(field.type)
        raise TypeError(
            f"`{name}` must be {expected}; got {value!r} of type {type(value).__name__}."
        )
    range_ = field.metadata.get("range")
    bad = None if range_ is None else range_.at_fault(value)
    if bad is not None:
        raise ValueError(f"{range_.expected.format(name=name)}; got {_frozen(bad)!r}.")


class _FrozenDict(dict):
    """A dict that cannot change, so that a config holding one can be hashed."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a config's dicts cannot change; use dataclasses.replace.")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse
    __ior__ = _refuse

    def __reduce__(self) -> tuple[Any, ...]:
        return _FrozenDict, (dict(self),)


def _frozen(value: Any) -> Any:
    """`value` with lists as tuples and dicts as frozen dicts (their values likewise)."""
    if isinstance(value, list | tuple):
        return tuple(value)
    if isinstance(value, Mapping):
        return _FrozenDict({k: _frozen(v) for k, v in value.items()})
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _is_default(value: Any, default: Any) -> bool:
    # PEFT writes `None`, `{}`, `[]` and `False` interchangeably for "not used".
    return value == default or (not value and not default)


def _united(rules: list[Any]) -> Any:
    """One module rule matching what any of `rules` matches (all of one form)."""
    if all(isinstance(t, str) for t in rules):
        return "|".join(f"({t})" for t in rules)
    if all(isinstance(t, tuple) for t in rules):
        return tuple(sorted(set().union(*rules)))
    if all(isinstance(t, Predicate) for t in rules):
        united = rules[0]
        for t in rules[1:]:
            united = united | t
        return united
    raise ValueError(
        "the adapters' target_modules mix forms (names, a regex, a predicate); PEFT cannot "
        "combine those either."
    )


def _by_pattern(patterns: Mapping[str, Any], path: str, default: Any) -> Any:
    """PEFT's `get_pattern_key`: the value of the first pattern matching the end of `path`
    (a whole dotted segment onwards), else `default`."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", path):
            return value
    return default


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# -- the configs ----------------------------------------------------------------------------

# Every config class by its `peft_type`, and by the name of its TOML table, as each
# subclass registers itself (`load_config`, `from_toml` and the `peftx` command read them).
CONFIG_CLASSES: dict[str, type["AbstractAdapterConfig"]] = {}
TOML_TABLES: dict[str, type["AbstractAdapterConfig"]] = {}


def table_names(prefix: str = "") -> str:
    """Every registered adapter table, for messages: `[lora], [ia3], ... or [lokr]`
    (`[adapters.lora]`, ... with `prefix="adapters."`)."""
    names = [f"[{prefix}{table}]" for table in TOML_TABLES]
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AbstractAdapterConfig:
    """What every adapter config shares: PEFT's `PeftConfig` fields, the module selection
    fields, and the interface of an adapter kind. Not instantiated itself; annotate with it
    to accept any config.

    A new kind is a frozen, keyword-only dataclass subclass that sets `peft_type`'s
    default (its registered name; `load_config` picks the class by it) and implements
    `build`; it may set `toml_table` and override the hooks below. Its array class
    (an `peftx.adapters.AbstractAdapter`) declares what trains and how it is saved.
    """

    task_type: TaskType | None = None
    peft_type: str
    base_model_name_or_path: str | None = None
    revision: str | None = None
    inference_mode: bool = False
    peft_version: str | None = None
    target_modules: ModuleRule = field(default=None, means=RULE)
    exclude_modules: ModuleRule = field(default=None, means=RULE)
    fan_in_fan_out: bool = False
    modules_to_save: list[str] | tuple[str, ...] | None = None
    layers_to_transform: int | list[int] | tuple[int, ...] | None = field(
        default=None, range=Range(lambda v: v >= 0, "`{name}` must be layer indices >= 0")
    )
    layers_pattern: str | list[str] | tuple[str, ...] | None = None

    toml_table: ClassVar[str | None] = None
    """The name of its table in a TOML file (`[lora]`), if it has one."""
    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    """PEFT's `target_modules` by model type, for `target_modules=None`."""
    condense_targets: ClassVar[bool] = True
    """Whether PEFT condenses a long expanded `target_modules` list to suffixes."""
    peft_selects_layers: ClassVar[bool] = True
    """Whether PEFT's class of this kind has `layers_to_transform`; where it has not, a
    saved config names the chosen layers' modules instead."""

    combination_types: ClassVar[tuple[str, ...]] = ()
    """`add_weighted_adapter`'s ways to combine adapters of this kind, the default first
    (none: they cannot be combined)."""
    mixed_batches: ClassVar[bool] = True
    """Whether adapters of this kind may be mixed within a batch (`adapter_names`), as PEFT
    allows for them."""

    _PEFT_TYPE: ClassVar[str]
    _KEYS: ClassVar[tuple[str, ...] | None] = None  # PEFT's key order (default: fields')
    _PEFT_ONLY: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        peft_type = cls.__dict__.get("peft_type")
        if not isinstance(peft_type, str):
            return  # an intermediate class without a kind of its own
        if cls.build is AbstractAdapterConfig.build:
            raise TypeError(f"{cls.__name__} must implement build(base, layer, *, key).")
        known = CONFIG_CLASSES.get(peft_type)
        if known is not None and _name(known) != _name(cls):
            raise TypeError(
                f"peft_type {peft_type!r} is {_name(known)}'s already; give {_name(cls)} another."
            )
        cls._PEFT_TYPE = peft_type
        CONFIG_CLASSES[peft_type] = cls
        if cls.toml_table is not None:
            TOML_TABLES[cls.toml_table] = cls

    # -- the kind's interface ---------------------------------------------------------------

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        """The adapter this config places on `layer`: an implicit array over `base`, the
        layer's weight (one layer's slice of it in a stack; dense or implicit)."""
        raise NotImplementedError

    def planned(self, layers: tuple[AdaptedLayer, ...]) -> tuple[AdaptedLayer, ...]:
        """The records `build` receives, given every layer this config adapts (as they
        are; VeRA adds the projections all its layers share)."""
        return layers

    @property
    def saves_shared(self) -> bool:
        """Whether the adapter file holds the arrays its layers share (`shared_keys`)."""
        return True

    def rank_and_alpha(self, path: str) -> tuple[int | None, int | float | None]:
        """The rank and alpha of the layer at `path` (a layer's own path): `(None, None)`
        for kinds without them."""
        return None, None

    def is_feedforward(self, path: str, layer: Any) -> bool:
        """Whether the layer at `path` is one of IA3's `feedforward_modules`."""
        return False

    def kept_ranks(self, path: str) -> tuple[int, ...] | None:
        """The ranks of the layer at `path` that its file holds, along the fields'
        `rank_axes` (AdaLoRA's `rank_pattern`); None: all of them."""
        return None

    def unsupported(self, path: str, layer: Any) -> str | None:
        """Why this config cannot adapt `layer` (a Linear, Conv or Embedding) at `path`,
        or None when it can."""
        return None

    def check_trainable(self) -> None:
        """Raise `ValueError` if adapters of this config cannot be trained as it stands
        (a job checks this before it loads a model)."""

    def train_hook(self, adapter_name: str, trainable: Any) -> AbstractTrainHook | None:
        """What training adapter `adapter_name` (found in `trainable`, the trainable half
        of the model) does in each step besides the gradient step (AdaLoRA's rank
        allocator), or None."""
        return None

    def with_model_defaults(self, model_type: str | None) -> "AbstractAdapterConfig":
        """This config with PEFT's default `target_modules` for `model_type`."""
        table = self.default_targets
        if model_type not in table:
            known = ", ".join(sorted(table)) or "none"
            raise ValueError(
                f"target_modules is None and there is no {self.peft_type} default for model "
                f"type {model_type!r} (read from `model.config.model_type` or the `model_type` "
                f"argument). Defaults exist for: {known}. Otherwise name the modules, e.g. "
                "target_modules=['q_proj', 'v_proj'], or use 'all-linear'."
            )
        return dataclasses.replace(self, target_modules=table[model_type])

    def as_saved(self, placed: Sequence[tuple[str, AbstractAdapter]]) -> dict[str, Any]:
        """The fields PEFT writes differently once this config is placed on the layers
        `placed` (each layer's own path and its adapter, sorted by path): `"all-linear"`,
        a predicate, or a layer selection PEFT's class lacks become the adapted modules'
        names; a predicate `exclude_modules` is dropped."""
        changes: dict[str, Any] = {}
        target = self.target_modules
        names_layers = self.layers_to_transform is not None and not self.peft_selects_layers
        if target == "all-linear" or isinstance(target, Predicate) or names_layers:
            changes["target_modules"] = tuple(path for path, _ in placed)
        if names_layers:
            changes.update(layers_to_transform=None, layers_pattern=None)
        if isinstance(self.exclude_modules, Predicate):
            changes["exclude_modules"] = None
        return changes

    def combined(
        self,
        configs: Sequence["AbstractAdapterConfig"],
        names: Sequence[str],
        combination_type: str,
        svd_rank: int | None,
    ) -> "AbstractAdapterConfig":
        """The config of `add_weighted_adapter`'s combination of the adapters `names` with
        `configs` (this config first): PEFT's rule, this config with the targets united."""
        if combination_type not in self.combination_types:
            ways = self.combination_types
            how = "linearly" if ways == ("linear",) else "by " + ", ".join(map(repr, ways))
            raise ValueError(
                f"{self.peft_type} adapters combine {how} only; got combination_type "
                f"{combination_type!r}."
            )
        return dataclasses.replace(
            self, target_modules=_united([c.target_modules for c in configs])
        )

    @property
    def changes_base(self) -> bool:
        """Whether `build` replaces the layer's base weight (PiSSA's residual); the new
        base is then shared by every adapter on the layer, as PEFT changes it in place."""
        return False

    # -- checks and files -------------------------------------------------------------------

    def __post_init__(self) -> None:
        if type(self) is AbstractAdapterConfig:
            raise TypeError("Use LoraConfig or IA3Config; AbstractAdapterConfig is abstract.")
        if self.peft_type != self._PEFT_TYPE:
            raise ValueError(
                f"`peft_type` of a {type(self).__name__} must be {self._PEFT_TYPE!r}; got "
                f"{self.peft_type!r}. Use peftx.load_config to choose the class from `peft_type`."
            )
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check_field(f, value)
            convert = f.metadata.get("converter", _frozen)
            object.__setattr__(self, f.name, convert(_frozen(value)))
        # PEFT's own checks (`LoraConfig.__post_init__`).
        target = self.target_modules
        if isinstance(target, str) and self.layers_to_transform is not None:
            raise ValueError(
                "`layers_to_transform` cannot be used when `target_modules` is a str "
                f"({target!r}): a regex already says which layers. Put the layer numbers into "
                "the regex, or pass `target_modules` as a list of names."
            )
        if isinstance(target, str) and self.layers_pattern is not None:
            raise ValueError(
                "`layers_pattern` cannot be used when `target_modules` is a str "
                f"({target!r}). Pass `target_modules` as a list of names instead."
            )
        if self.layers_pattern and self.layers_to_transform is None:
            raise ValueError(
                f"`layers_pattern` ({self.layers_pattern!r}) is only used together with "
                "`layers_to_transform`; set `layers_to_transform` to the layer indices to adapt, "
                "or drop `layers_pattern`."
            )
        if isinstance(target, Predicate) and (
            self.layers_to_transform is not None or self.layers_pattern is not None
        ):
            raise ValueError(
                "`layers_to_transform`/`layers_pattern` cannot be combined with a Predicate "
                "`target_modules`; compose the predicate with `peftx.in_layers(...)` instead."
            )

    def to_dict(self) -> dict[str, Any]:
        """The config as PEFT writes it into `adapter_config.json`: every key PEFT's
        `to_dict()` has (PEFT-only features at their defaults), lists for tuples.

        Raises `TypeError` if a module rule is a `Predicate`, which has no JSON form.
        """
        for name in (f.name for f in dataclasses.fields(self) if f.type is ModuleRule):
            value = getattr(self, name)
            if isinstance(value, Predicate):
                raise TypeError(
                    f"`{name}` is the predicate {value}, which cannot be written to "
                    f"{CONFIG_NAME}. To save this config, give `{name}` as a list of module "
                    "names or a regex string; or save the list of selected paths, e.g. "
                    f"`dataclasses.replace(config, {name}=peftx.select(model).at(pred).paths())`."
                )
        own = {f.name for f in dataclasses.fields(self)}
        order = self._KEYS or tuple(f.name for f in dataclasses.fields(self))
        out = {
            key: _jsonable(getattr(self, key) if key in own else self._PEFT_ONLY[key])
            for key in order
        }
        # peftx fields PEFT lacks (IA3's layer selection, LoHa's `fan_in_fan_out`) are
        # written only when used.
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for key in sorted(own - set(order)):
            if getattr(self, key) != defaults[key]:
                out[key] = _jsonable(getattr(self, key))
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, strict: bool = False) -> "AbstractAdapterConfig":
        """The config stored in `d` (as read from `adapter_config.json`).

        **Arguments:**

        - `d`: the keys and values of the config, as in `adapter_config.json` (PEFT's own
          `config.to_dict()` works too). `peft_type`, if present, must be this class's
          (`"LORA"` or `"IA3"`); use `load_config` to dispatch on it.
        - `strict`: what to do with keys neither PEFT nor peftx knows. `False` (for files
          written by a newer PEFT): ignore them with a `UserWarning` naming them. `True` (for
          hand-written files): raise `ValueError`, suggesting the closest known key.

        Keys of PEFT features peftx does not implement are accepted at their default value;
        otherwise they are ignored with a warning if they cannot change what the adapter
        computes, or raise `ValueError` if they can.
        """
        # PEFT's in-memory `to_dict()` holds enums and sets; its JSON holds strings and lists.
        values = {
            k: v.value if isinstance(v, enum.Enum) else sorted(v) if isinstance(v, set) else v
            for k, v in d.items()
        }
        peft_type = values.pop("peft_type", cls._PEFT_TYPE)
        if peft_type != cls._PEFT_TYPE:
            raise ValueError(
                f"This is a config of `peft_type` {peft_type!r}, not {cls._PEFT_TYPE!r}, so it "
                f"cannot be loaded as {cls.__name__}. Use peftx.load_config, which chooses the "
                "class from `peft_type`."
            )
        own = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        ignored: list[str] = []
        unknown: list[str] = []
        for key, value in values.items():
            if key in own:
                _check_field(own[key], value)
                kwargs[key] = value
            elif key in cls._PEFT_ONLY:
                if key in _SILENT or _is_default(value, cls._PEFT_ONLY[key]):
                    continue
                if key not in _HARMLESS:
                    raise ValueError(
                        f"`{key}={value!r}` asks for a PEFT feature that peftx does not "
                        f"implement, so this {cls.__name__} cannot be loaded faithfully. Remove "
                        f"`{key}` (or set it to {cls._PEFT_ONLY[key]!r}) to load it without it."
                    )
                ignored.append(key)
            elif key not in _NEVER_SAVED:
                unknown.append(key)
        if ignored:
            warnings.warn(
                f"{cls.__name__}: {sorted(ignored)} are PEFT settings with no effect in peftx; "
                "they are ignored.",
                UserWarning,
                stacklevel=2,
            )
        if unknown and strict:
            known = sorted({*own, "peft_type"})
            hints = {k: difflib.get_close_matches(k, known, n=1) for k in sorted(unknown)}
            described = ", ".join(
                f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items()
            )
            raise ValueError(
                f"Unknown {cls.__name__} keys: {described}. Known keys: {', '.join(known)}."
            )
        if unknown:
            warnings.warn(
                f"{cls.__name__}: ignoring keys this version of peftx does not know: "
                f"{sorted(unknown)}. The config was probably written by a newer PEFT; the "
                "adapter is loaded as if they had their defaults.",
                UserWarning,
                stacklevel=2,
            )
        return cls(**kwargs)

    def save_pretrained(self, directory: str | os.PathLike[str]) -> pathlib.Path:
        """PEFT's name for `save_config(self, directory)`."""
        return save_config(self, directory)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> "AbstractAdapterConfig":
        """PEFT's name for loading this class from a directory holding `adapter_config.json`
        (or from that file itself). A file of another `peft_type` is an error."""
        return cls.from_dict(_read_json(path))


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
      (random B too, for tests), `"gaussian"` (normal A with std `1/r`), `"pissa"`.
    - `layers_to_transform`: only these layer indices (the first numbered path segment, or
      the one after `layers_pattern`). Not allowed with a regex `target_modules`.
    - `layers_pattern`: the name of the layer list (`"layers"`, `"h"`); needs
      `layers_to_transform`.
    - `rank_pattern`, `alpha_pattern`: per-module `r`/`lora_alpha`, keyed by regex.
    - `use_dora`: weight-decomposed LoRA (a learned magnitude vector).
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
    init_lora_weights: bool | Literal["gaussian", "pissa"] = True
    rank_pattern: dict[str, int] = field(default_factory=dict, range=RANKS, means=RANKS_TYPE)
    alpha_pattern: dict[str, int | float] = field(
        default_factory=dict, range=SCALES, means=SCALES_TYPE
    )
    use_dora: bool = False
    target_parameters: list[str] | tuple[str, ...] | None = field(
        default=None,
        means="None or a list of parameter names (e.g. ['mlp.experts.gate_up_proj'])",
    )

    toml_table: ClassVar[str | None] = "lora"
    combination_types: ClassVar[tuple[str, ...]] = ("svd", "linear", "cat")
    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = LORA_TARGET_MODULES
    _KEYS: ClassVar[tuple[str, ...] | None] = _LORA_KEYS
    _PEFT_ONLY: ClassVar[dict[str, Any]] = {**_PEFT_ONLY_COMMON, **_PEFT_ONLY_LORA}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.target_parameters:
            # PEFT's `ParamWrapper` refuses the same
            refused = {
                "lora_dropout": self.lora_dropout != 0.0,
                "use_dora": self.use_dora,
                "fan_in_fan_out": self.fan_in_fan_out,
                "init_lora_weights='pissa'": self.init_lora_weights == "pissa",
            }
            bad = [name for name, on in refused.items() if on]
            if bad:
                raise ValueError(
                    f"target_parameters {list(self.target_parameters)} cannot be combined with "
                    f"{', '.join(bad)}: an expert stack's LoRA has no dropout (its input cannot "
                    "be factored out), no DoRA, no PiSSA and no transposed layout (as in PEFT). "
                    "Set lora_dropout=0, use_dora=False, fan_in_fan_out=False, or drop "
                    "target_parameters."
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

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        init = {True: "default", False: "random"}.get(
            self.init_lora_weights, self.init_lora_weights
        )
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
            key=key,
        )
        return dora(adapter) if self.use_dora else adapter

    def rank_and_alpha(self, path: str) -> tuple[int, int | float]:
        """PEFT's `rank_pattern`/`alpha_pattern` for the module at `path`: the first key
        that matches the path's end, else `r`/`lora_alpha`."""
        return (
            _by_pattern(self.rank_pattern, path, self.r),
            _by_pattern(self.alpha_pattern, path, self.lora_alpha),
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
        return self.init_lora_weights == "pissa"

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class IA3Config(AbstractAdapterConfig):
    """HF PEFT's `IA3Config`: the same field names, meanings and defaults.

    **Arguments:**

    - `target_modules`, `exclude_modules`, `fan_in_fan_out`, `modules_to_save`: as for
      `LoraConfig` (including `"all-linear"`, `None` and `Predicate`).
    - `feedforward_modules`: the targets whose *input* is scaled (`ia3_l` of shape `(1, in)`)
      rather than their output (`(out, 1)`). When it and `target_modules` are both lists, it
      must be a subset of `target_modules` (PEFT's rule).
    - `init_ia3_weights`: start the scaling vectors at ones (a no-op); `False` draws them
      from a standard normal, as PEFT does (for tests of a non-identity adapter).
    - `layers_to_transform`, `layers_pattern`: as for `LoraConfig`. PEFT's `IA3Config` has no
      such fields: they are written to JSON only when set, and PEFT ignores them (with a
      warning) when loading such a file.
    - `task_type`, `base_model_name_or_path`, `revision`, `inference_mode`, `peft_version`:
      PEFT's bookkeeping.
    """

    peft_type: Literal["IA3"] = "IA3"
    feedforward_modules: ModuleRule = field(default=None, means=RULE)
    init_ia3_weights: bool = True

    toml_table: ClassVar[str | None] = "ia3"
    combination_types: ClassVar[tuple[str, ...]] = ("linear",)
    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = IA3_TARGET_MODULES
    # PEFT keeps IA3's `feedforward_modules` a subset of `target_modules`: no condensing
    condense_targets: ClassVar[bool] = False
    peft_selects_layers: ClassVar[bool] = False
    _KEYS: ClassVar[tuple[str, ...] | None] = _IA3_KEYS
    _PEFT_ONLY: ClassVar[dict[str, Any]] = _PEFT_ONLY_COMMON

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        return ia3(base, feedforward=layer.feedforward, key=None if self.init_ia3_weights else key)

    def is_feedforward(self, path: str, layer: Any) -> bool:
        ff = self.feedforward_modules
        return bool(ff) and bool(peft_targets(ff)(path, layer))

    def unsupported(self, path: str, layer: Any) -> str | None:
        if not isinstance(layer, eqx.nn.Linear):
            return f"IA3 adapts Linear layers only; {path!r} is an eqx.nn.{type(layer).__name__}."
        return None

    def with_model_defaults(self, model_type: str | None) -> "IA3Config":
        config = super().with_model_defaults(model_type)
        if self.feedforward_modules is not None:
            return config
        return dataclasses.replace(config, feedforward_modules=IA3_FEEDFORWARD_MODULES[model_type])

    def combined(
        self,
        configs: Sequence[AbstractAdapterConfig],
        names: Sequence[str],
        combination_type: str,
        svd_rank: int | None,
    ) -> "IA3Config":
        config = super().combined(configs, names, combination_type, svd_rank)
        ff = [c.feedforward_modules for c in configs]
        if all(isinstance(f, tuple) for f in ff):
            return dataclasses.replace(config, feedforward_modules=tuple(sorted(set().union(*ff))))
        return config

    def as_saved(self, placed: Sequence[tuple[str, AbstractAdapter]]) -> dict[str, Any]:
        changes = super().as_saved(placed)
        if isinstance(self.feedforward_modules, Predicate) or "layers_to_transform" in changes:
            changes["feedforward_modules"] = tuple(
                path for path, a in placed if isinstance(a, IA3Array) and a.is_feedforward
            )
        return changes

    def __post_init__(self) -> None:
        super().__post_init__()
        ff, target = self.feedforward_modules, self.target_modules
        if isinstance(ff, tuple) and isinstance(target, tuple) and not set(ff) <= set(target):
            raise ValueError(
                "`feedforward_modules` must be a subset of `target_modules`; "
                f"{sorted(set(ff) - set(target))} are not in `target_modules` {list(target)}. "
                "Add them to `target_modules`, or remove them from `feedforward_modules`."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class OFTConfig(AbstractAdapterConfig):
    """HF PEFT's `OFTConfig` (orthogonal fine-tuning): the same field names, meanings and
    defaults. Each adapted `Linear` gets an `OFTArray`: its input features split into
    blocks, each rotated by the Cayley transform of a learned skew-symmetric matrix.

    **Arguments:**

    - `oft_block_size`: the size of each block (default 32); or
    - `r`: the number of blocks per layer. Exactly one of the two is non-zero (PEFT's rule;
      the default is `r=0`). A value that does not divide a layer's input features is
      moved to the nearest one that does, with PEFT's warning.
    - `module_dropout`: PEFT's multiplicative dropout of whole blocks. PEFT 0.21.2 builds
      its dropout layer but never calls it, so the value has no effect there; peftx matches
      that and says so with a warning.
    - `bias`: which biases train: `"none"`, `"all"` or `"oft_only"` (of adapted layers).
    - `init_weights`: `True` starts every rotation at the identity (`oft_R = 0`); `False`
      draws `oft_R` from `N(0, 0.1²)`, as PEFT does (for tests).
    - `coft`, `eps`: constrained OFT: each block's skew matrix is kept within Frobenius
      norm `eps / sqrt(blocks)` of zero.
    - `block_share`: one rotation shared by all blocks of a layer.
    - `use_cayley_neumann`, `num_cayley_neumann_terms`: the Cayley transform by PEFT's
      truncated Neumann series (default, 5 terms) instead of a matrix inverse.
    - `target_modules`, `exclude_modules`, `fan_in_fan_out`, `modules_to_save`,
      `layers_to_transform`, `layers_pattern`, and PEFT's bookkeeping fields: as for
      `LoraConfig`.
    """

    peft_type: Literal["OFT"] = "OFT"
    r: int = field(
        default=0,
        range=Range(
            lambda v: 0 <= v <= MAX_RANK,
            "`r` (OFT's number of blocks per layer, 0 to use oft_block_size) must be an "
            f"integer in [0, {MAX_RANK}]",
        ),
    )
    oft_block_size: int = field(
        default=32,
        range=Range(
            lambda v: 0 <= v <= MAX_RANK,
            f"`oft_block_size` (0 to use r) must be an integer in [0, {MAX_RANK}]",
        ),
    )
    module_dropout: int | float = field(default=0.0, range=PROBABILITY, converter=float)
    bias: Literal["none", "all", "oft_only"] = "none"
    init_weights: bool = True
    coft: bool = False
    eps: int | float = field(
        default=6e-5,
        range=Range(
            lambda v: 0 < v <= FLOAT32_MAX, "`eps` (COFT's radius) must be a positive finite number"
        ),
        converter=float,
    )
    block_share: bool = False
    use_cayley_neumann: bool = True
    num_cayley_neumann_terms: int = field(
        default=5,
        range=Range(
            lambda v: 2 <= v <= 64,
            "`num_cayley_neumann_terms` must be an integer in [2, 64] (fewer than 2 terms "
            "leave every rotation the identity, whatever oft_R holds)",
        ),
    )

    toml_table: ClassVar[str | None] = "oft"
    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = LORA_TARGET_MODULES
    mixed_batches: ClassVar[bool] = False
    _KEYS: ClassVar[tuple[str, ...] | None] = _OFT_KEYS
    _PEFT_ONLY: ClassVar[dict[str, Any]] = _PEFT_ONLY_COMMON

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.r == 0) == (self.oft_block_size == 0):
            raise ValueError(
                f"Set exactly one of `r` ({self.r}) and `oft_block_size` "
                f"({self.oft_block_size}) to a non-zero value (the other to 0): r x "
                "oft_block_size is each layer's number of input features, so one gives the "
                "other. For example OFTConfig(r=0, oft_block_size=32)."
            )

    def block_size(self, in_features: int, path: str) -> int:
        """The block size for a layer with `in_features` inputs, adjusted as PEFT does
        (with its warning) when `oft_block_size` or `r` does not divide them."""
        asked = self.oft_block_size or self.r
        fits = in_features % asked == 0 and asked <= in_features
        value = asked if fits else _nearest_divisor(in_features, asked)
        if not fits:
            name = "oft_block_size" if self.oft_block_size else "r"
            warnings.warn(
                f"Invalid `{name}` ({asked}) for {path} with {in_features} input features! "
                f"Adjusted `{name}` to ({value}).",
                UserWarning,
                stacklevel=3,
            )
        return value if self.oft_block_size else in_features // value

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        if self.module_dropout:
            warnings.warn(
                f"module_dropout={self.module_dropout} has no effect: PEFT 0.21.2 never "
                "applies OFT's multiplicative dropout, and peftx computes what PEFT does.",
                UserWarning,
                stacklevel=2,
            )
        return oft(
            base,
            block_size=self.block_size(base.shape[-1], layer.path),
            coft=self.coft,
            eps=self.eps,
            block_share=self.block_share,
            use_cayley_neumann=self.use_cayley_neumann,
            num_cayley_neumann_terms=self.num_cayley_neumann_terms,
            key=None if self.init_weights else key,
        )

    def as_saved(self, placed: Sequence[tuple[str, AbstractAdapter]]) -> dict[str, Any]:
        changes = super().as_saved(placed)
        if self.use_cayley_neumann and self.peft_version is None:
            # PEFT refuses a Cayley-Neumann adapter without a version (its series changed
            # in 0.18); this one computes PEFT 0.21.2's
            changes["peft_version"] = _OFT_SERIES_VERSION
        return changes

    def unsupported(self, path: str, layer: Any) -> str | None:
        if not isinstance(layer, eqx.nn.Linear):
            return (
                f"OFT in peftx adapts Linear layers only; {path!r} is an "
                f"eqx.nn.{type(layer).__name__}. Exclude it (exclude_modules)."
            )
        return None


def _nearest_divisor(n: int, asked: int) -> int:
    """PEFT's `adjust_oft_parameters`: the divisor of `n` nearest `asked` (the lower one
    on a tie), or `n` when `asked` exceeds it."""
    if asked >= n:
        return n
    higher = asked
    while higher <= n and n % higher:
        higher += 1
    lower = asked
    while lower > 1 and n % lower:
        lower -= 1
    return lower if asked - lower <= higher - asked else higher


@dataclasses.dataclass(frozen=True, kw_only=True)
class VeraConfig(AbstractAdapterConfig):
    """HF PEFT's `VeraConfig`: the same field names, meanings and defaults.

    **Arguments:**

    - `r`: the projections' rank (VeRA's `r` is larger than LoRA's: it trains only `r`
      values per layer besides one per output feature).
    - `projection_prng_key`: the seed of the shared frozen projections `vera_A`
      `(r, in_max)` and `vera_B` `(out_max, r)`, drawn as PEFT draws them (a torch CPU
      generator, Kaiming-uniform), so a file without them loads to the same weights.
    - `save_projection`: write the projections into the adapter file
      (`base_model.vera_A`, `base_model.vera_B`); otherwise they are drawn again from
      `projection_prng_key` on loading.
    - `vera_dropout`: dropout probability on the VeRA input, in `[0, 1)`.
    - `d_initial`: the initial value of every `vera_lambda_d` (`vera_lambda_b` starts at
      zeros: a no-op at start).
    - `init_weights`: `False` starts `vera_lambda_b` at ones and `vera_lambda_d` standard
      normal, as PEFT does (for tests of a non-identity adapter).
    - `bias`: which biases train: `"none"`, `"all"` or `"vera_only"` (of adapted layers).
    - `target_modules`, `exclude_modules`, `fan_in_fan_out`, `modules_to_save`,
      `layers_to_transform`, `layers_pattern`: as for `LoraConfig`; Linear layers only.
      PEFT's `VeraConfig` has no `exclude_modules`: it is written to JSON only when set.
    - `task_type`, `base_model_name_or_path`, `revision`, `inference_mode`, `peft_version`:
      PEFT's bookkeeping.
    """

    peft_type: Literal["VERA"] = "VERA"
    r: int = field(default=256, range=RANK)
    projection_prng_key: int = field(
        default=0,
        range=Range(
            lambda v: 0 <= v < 2**64,
            "`projection_prng_key` seeds torch's generator: an integer in [0, 2**64)",
        ),
    )
    save_projection: bool = True
    vera_dropout: int | float = field(default=0.0, range=PROBABILITY, converter=float)
    d_initial: int | float = field(default=0.1, range=FINITE, converter=float)
    bias: Literal["none", "all", "vera_only"] = "none"
    init_weights: bool = True

    toml_table: ClassVar[str | None] = "vera"
    # PEFT's VeRA defaults are LoRA's, but Phi's attention only
    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = {
        **LORA_TARGET_MODULES,
        "phi": ("q_proj", "v_proj"),
    }
    _KEYS: ClassVar[tuple[str, ...] | None] = _VERA_KEYS
    _PEFT_ONLY: ClassVar[dict[str, Any]] = _PEFT_ONLY_COMMON

    def planned(self, layers: tuple[AdaptedLayer, ...]) -> tuple[AdaptedLayer, ...]:
        """Every layer with the adapter's projections, sized for the largest (PEFT's
        `_find_dim`): one pair of arrays, shared."""
        out_max = max(t.layer.weight.shape[-2] for t in layers)
        in_max = max(t.layer.weight.shape[-1] for t in layers)
        vera_A, vera_B = vera_projections(self.projection_prng_key, self.r, in_max, out_max)
        shared = (jnp.asarray(vera_A), jnp.asarray(vera_B))
        return tuple(dataclasses.replace(t, shared=shared) for t in layers)

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        vera_A, vera_B = layer.shared
        return vera(
            base,
            vera_A,
            vera_B,
            d_initial=self.d_initial,
            vera_dropout=self.vera_dropout,
            key=None if self.init_weights else key,
        )

    def unsupported(self, path: str, layer: Any) -> str | None:
        if not isinstance(layer, eqx.nn.Linear):
            return f"VeRA adapts Linear layers only; {path!r} is an eqx.nn.{type(layer).__name__}."
        return None

    @property
    def saves_shared(self) -> bool:
        return self.save_projection


_STEPS = Range(lambda v: v >= 0, "`{name}` must be a number of steps >= 0")
_BETA = Range(lambda v: 0 < v < 1, "`{name}` must be in (0, 1)")


# PEFT's AdaLoRA defaults are LoRA's, but all attention and MLP layers of these
_ADALORA_TARGETS: dict[str, tuple[str, ...]] = {
    "t5": ("q", "k", "v", "o", "wi", "wo"),
    "bart": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
    "opt": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
    "roberta": ("query", "key", "value", "dense"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaLoraConfig(AbstractAdapterConfig):
    """HF PEFT's `AdaLoraConfig`: the same field names, meanings and defaults.

    Each targeted Linear gets an `AdaLoraArray`, `W + lora_alpha/init_r · B·(A ⊙ E)` with
    `lora_A` `(init_r, in)`, `lora_E` `(init_r, 1)` and `lora_B` `(out, init_r)`. While
    training, a rank allocator zeroes the singular values (`lora_E`) of the least important
    triplets until `target_r` ranks per layer are left on average; PEFT's file then holds
    only the kept ranks, listed in `rank_pattern`.

    **Arguments:**

    - `init_r`: every layer's rank before pruning (PEFT ignores `r`, as peftx does).
    - `target_r`: the average rank per layer left once the budget has shrunk.
    - `tinit`, `tfinal`, `total_step`: the schedule: `tinit` steps without pruning, the
      budget then shrinking cubically until `total_step - tfinal`, and the last `tfinal`
      steps at the final ranks. `total_step` is required.
    - `deltaT`: prune every `deltaT` steps while the budget shrinks.
    - `beta1`, `beta2`: the moving averages of each weight's sensitivity `|w·∂L/∂w|` and
      of its uncertainty.
    - `orth_reg_weight`: the weight of the orthogonality penalty on `lora_A` and `lora_B`
      added to the loss (`orthogonality_penalty`).
    - `rank_pattern`: the allocator's result, from each layer's `lora_E` path to one bool
      per rank (kept or pruned); None before any pruning.
    - `lora_alpha`: the scale is `lora_alpha / init_r` (`init_r / init_r` for
      `lora_alpha <= 0`).
    - `lora_dropout`, `bias`, `target_modules`, `exclude_modules`, `fan_in_fan_out`,
      `modules_to_save`, `layers_to_transform`, `layers_pattern` and PEFT's bookkeeping:
      as for `LoraConfig`; Linear layers only.
    - `init_lora_weights`: `True` (`lora_E` zeros: a no-op at start; `lora_A`, `lora_B`
      normal with std 0.02) or `False` (all standard normal, for tests).
    Mixed-adapter batches are refused, as PEFT's AdaLoRA layers have none.
    """

    peft_type: Literal["ADALORA"] = "ADALORA"
    lora_alpha: int | float = field(default=8, range=FINITE)
    lora_dropout: int | float = field(default=0.0, range=PROBABILITY, converter=float)
    bias: Literal["none", "all", "lora_only"] = "none"
    init_lora_weights: bool = True
    # one bool per rank: how many is checked against `init_r` in `__post_init__`
    rank_pattern: dict[str, list[bool] | tuple[bool, ...]] | None = field(
        default=None, means="None or a dict from lora_E paths to lists of bools (one per rank)"
    )
    target_r: int = field(default=8, range=RANK)
    init_r: int = field(default=12, range=RANK)
    tinit: int = field(default=0, range=_STEPS)
    tfinal: int = field(default=0, range=_STEPS)
    deltaT: int = field(
        default=1, range=Range(lambda v: v >= 1, "`deltaT` must be a number of steps >= 1")
    )
    beta1: int | float = field(default=0.85, range=_BETA)
    beta2: int | float = field(default=0.85, range=_BETA)
    orth_reg_weight: int | float = field(
        default=0.5,
        range=Range(
            lambda v: 0 <= v <= FLOAT32_MAX, "`orth_reg_weight` must be a finite number >= 0"
        ),
    )
    total_step: int | None = None

    toml_table: ClassVar[str | None] = "adalora"
    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = {
        **LORA_TARGET_MODULES,
        **_ADALORA_TARGETS,
    }
    mixed_batches: ClassVar[bool] = False
    _KEYS: ClassVar[tuple[str, ...] | None] = _ADALORA_KEYS
    _PEFT_ONLY: ClassVar[dict[str, Any]] = {
        **_PEFT_ONLY_COMMON,
        **_PEFT_ONLY_LORA,
        "r": 8,
        "use_rslora": False,
        "alpha_pattern": {},
        "use_dora": False,
        "target_parameters": None,
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.total_step is None or self.total_step <= 0:
            raise ValueError(
                f"AdaLoRA needs `total_step`, the number of training steps (> 0), to schedule "
                f"its rank budget; got {self.total_step!r}."
            )
        if self.tinit >= self.total_step - self.tfinal:
            raise ValueError(
                f"AdaLoRA's schedule leaves no steps to prune in: tinit={self.tinit} must be "
                f"below total_step - tfinal = {self.total_step - self.tfinal}. Decrease "
                "`tinit` or `tfinal`, or increase `total_step`."
            )
        wrong = {k: len(v) for k, v in (self.rank_pattern or {}).items() if len(v) != self.init_r}
        if wrong:
            raise ValueError(
                f"`rank_pattern` must hold init_r={self.init_r} bools per layer; got "
                f"{wrong} (lengths)."
            )

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        if layer.transposed:
            raise ValueError(
                f"{layer.path!r} is a GPT-2 Conv1D layer, which peftx's AdaLoRA does not adapt "
                "yet; exclude it (exclude_modules) or use LoRA."
            )
        return adalora(
            base,
            init_r=self.init_r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            init_lora_weights=self.init_lora_weights,
            key=key,
        )

    def unsupported(self, path: str, layer: Any) -> str | None:
        if not isinstance(layer, eqx.nn.Linear):
            return (
                f"AdaLoRA in peftx adapts Linear layers only; {path!r} is an "
                f"eqx.nn.{type(layer).__name__}."
            )
        return None

    def check_trainable(self) -> None:
        if self.target_r > self.init_r:  # PEFT fails at its first allocation instead
            raise ValueError(
                f"AdaLoRA prunes ranks: target_r={self.target_r} must not exceed "
                f"init_r={self.init_r} to train."
            )

    def train_hook(self, adapter_name: str, trainable: Any) -> RankAllocator:
        return RankAllocator.start(self, adapter_name, trainable)

    def kept_ranks(self, path: str) -> tuple[int, ...] | None:
        """The ranks `rank_pattern` keeps for the layer at `path` (keyed
        `<path>.lora_E`, as PEFT writes it); None where it names none."""
        mask = (self.rank_pattern or {}).get(f"{path}.lora_E")
        return None if mask is None else tuple(i for i, kept in enumerate(mask) if kept)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _LycorisConfig(AbstractAdapterConfig):
    """The fields and rules PEFT's `LoHaConfig` and `LoKrConfig` share (`LycorisConfig`)."""

    r: int = field(default=8, range=RANK)
    alpha: int | float = field(default=8, range=FINITE)
    rank_dropout: int | float = field(default=0.0, range=PROBABILITY, converter=float)
    module_dropout: int | float = field(default=0.0, range=PROBABILITY, converter=float)
    use_effective_conv2d: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict, range=RANKS, means=RANKS_TYPE)
    alpha_pattern: dict[str, int | float] = field(
        default_factory=dict, range=SCALES, means=SCALES_TYPE
    )

    default_targets: ClassVar[Mapping[str, tuple[str, ...]]] = LORA_TARGET_MODULES
    mixed_batches: ClassVar[bool] = False
    _PEFT_ONLY: ClassVar[dict[str, Any]] = _PEFT_ONLY_COMMON

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.use_effective_conv2d:
            raise ValueError(
                f"`use_effective_conv2d=True` decomposes Conv kernels; peftx's {self.peft_type} "
                "adapts Linear layers only, where PEFT ignores it. Set use_effective_conv2d=False."
            )

    def rank_and_alpha(self, path: str) -> tuple[int, int | float]:
        """PEFT's `rank_pattern`/`alpha_pattern` for the module at `path`, else `r`/`alpha`."""
        return (
            _by_pattern(self.rank_pattern, path, self.r),
            _by_pattern(self.alpha_pattern, path, self.alpha),
        )

    def unsupported(self, path: str, layer: Any) -> str | None:
        if not isinstance(layer, eqx.nn.Linear):
            return (
                f"{self.peft_type} in peftx adapts Linear layers only; {path!r} is an "
                f"eqx.nn.{type(layer).__name__}."
            )
        return None

    def checked_layer(self, layer: AdaptedLayer) -> None:
        if layer.transposed:
            raise ValueError(
                f"{layer.path!r} is a GPT-2 Conv1D layer, which PEFT's {self.peft_type} does not "
                "adapt (it has no fan_in_fan_out); exclude it (exclude_modules) or use LoRA."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoHaConfig(_LycorisConfig):
    """HF PEFT's `LoHaConfig`: the same field names, meanings and defaults.

    `ΔW = (alpha / r) · (hada_w1_a @ hada_w1_b) ⊙ (hada_w2_a @ hada_w2_b)` on each targeted
    Linear layer (`LoHaArray`); it costs a weight-sized update per layer and step.

    **Arguments:**

    - `r`, `alpha`: the rank of each of the two factors and `scaling = alpha / r`.
    - `rank_dropout`: in training, each row of `ΔW` (an output feature) is dropped with
      this probability and the kept ones divided by the fraction kept.
    - `module_dropout`: in training, the whole update of a layer is skipped with this
      probability.
    - `init_weights`: `True` (`hada_w2_b` zeros: a no-op at start) or `False` (all random).
    - `use_effective_conv2d`: Conv only, so it must stay `False`.
    - `rank_pattern`, `alpha_pattern`: per-module `r`/`alpha`, keyed by regex.
    - `target_modules`, `exclude_modules`, `layers_to_transform`, `layers_pattern`,
      `modules_to_save`, `fan_in_fan_out` and PEFT's bookkeeping: as for `LoraConfig`.
    Mixed-adapter batches are refused, as PEFT has none for LoHa.
    """

    peft_type: Literal["LOHA"] = "LOHA"
    init_weights: bool = True

    toml_table: ClassVar[str | None] = "loha"
    _KEYS: ClassVar[tuple[str, ...] | None] = _LOHA_KEYS

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        self.checked_layer(layer)
        return loha(
            base,
            r=layer.rank,
            alpha=layer.alpha,
            init_weights=self.init_weights,
            rank_dropout=self.rank_dropout,
            module_dropout=self.module_dropout,
            key=key,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoKrConfig(_LycorisConfig):
    """HF PEFT's `LoKrConfig`: the same field names, meanings and defaults.

    `ΔW = (alpha / r) · w1 ⊗ w2` on each targeted Linear layer (`LoKrArray`), applied to
    the activations factor by factor, never formed.

    **Arguments:**

    - `r`, `alpha`: the rank of the factored factors and `scaling = alpha / r`.
    - `decompose_both`: factor `w1` too (`lokr_w1_a @ lokr_w1_b`) when `r` is below half its
      larger side; `w2` is factored whenever `r` is below half its larger side.
    - `decompose_factor`: PEFT's `factorization` of `out` and `in` into the factors' sides:
      -1 splits near the square root, a divisor `f` gives `(f, dim / f)`.
    - `rank_dropout`: in training, each row of `ΔW` is dropped with this probability;
      `rank_dropout_scale` divides the kept rows by the fraction kept.
    - `module_dropout`: in training, a layer's whole update is skipped with this probability.
    - `init_weights`: `True` (`w1` zeros: a no-op at start), `"lycoris"` (`w2` zeros),
      `False` (all random).
    - `use_effective_conv2d`: Conv only, so it must stay `False`.
    - `rank_pattern`, `alpha_pattern` and the rest: as for `LoHaConfig`.
    Mixed-adapter batches are refused, as PEFT has none for LoKr.
    """

    peft_type: Literal["LOKR"] = "LOKR"
    decompose_both: bool = False
    decompose_factor: int = field(
        default=-1,
        range=Range(
            lambda v: v == -1 or v >= 1,
            "`decompose_factor` must be -1 (split near the square root) or a positive integer",
        ),
    )
    rank_dropout_scale: bool = False
    init_weights: bool | Literal["lycoris"] = True

    toml_table: ClassVar[str | None] = "lokr"
    _KEYS: ClassVar[tuple[str, ...] | None] = _LOKR_KEYS

    def build(self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray) -> AbstractAdapter:
        self.checked_layer(layer)
        init = {True: "default", False: "random"}.get(self.init_weights, self.init_weights)
        return lokr(
            base,
            r=layer.rank,
            alpha=layer.alpha,
            decompose_both=self.decompose_both,
            decompose_factor=self.decompose_factor,
            init=init,
            rank_dropout=self.rank_dropout,
            module_dropout=self.module_dropout,
            rank_dropout_scale=self.rank_dropout_scale,
            key=key,
        )


# -- files ----------------------------------------------------------------------------------


def _read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    path = pathlib.Path(path)
    if path.is_dir():
        file = path / CONFIG_NAME
        if not file.is_file():
            found = sorted(p.name for p in path.iterdir())
            raise FileNotFoundError(
                f"No {CONFIG_NAME} in the directory {str(path)!r} (it holds {found}). An "
                "adapter saved under a name other than 'default' is in a subfolder of that name."
            )
    elif path.is_file():
        file = path
    else:
        raise FileNotFoundError(f"No such file or directory: {str(path)!r}.")
    data = read_json(file)
    if not isinstance(data, dict):
        raise ValueError(f"{str(file)!r} holds a {type(data).__name__}, not a JSON object.")
    return data


def _from_mapping(d: Mapping[str, Any], where: str) -> AbstractAdapterConfig:
    if "peft_type" not in d:
        raise ValueError(
            f"{where} has no `peft_type`, so its adapter type is unknown. Add "
            f'`"peft_type": "LORA"` (or one of {list(CONFIG_CLASSES)}), or load it with '
            "LoraConfig.from_dict / IA3Config.from_dict."
        )
    cls = CONFIG_CLASSES.get(d["peft_type"])
    if cls is None:
        raise ValueError(
            f"{where} has `peft_type` {d['peft_type']!r}; peftx supports {list(CONFIG_CLASSES)}."
        )
    return cls.from_dict(d)


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any],
) -> AbstractAdapterConfig:
    """A `LoraConfig` or `IA3Config`, chosen by the `peft_type` key, like PEFT's
    `PeftConfig.from_pretrained`.

    **Arguments:**

    - `source`: a directory holding `adapter_config.json`, a JSON file, a `.toml` file (read
      with `from_toml`), or an already parsed dict.

    **Returns:** the config. Keys unknown to this version are ignored with a `UserWarning`
    (see `AbstractAdapterConfig.from_dict`).
    """
    if isinstance(source, Mapping):
        return _from_mapping(source, "The config")
    if pathlib.Path(source).suffix == ".toml":
        return from_toml(source)
    return _from_mapping(_read_json(source), repr(str(source)))


def save_config(config: AbstractAdapterConfig, directory: str | os.PathLike[str]) -> pathlib.Path:
    """Write `config` to `directory/adapter_config.json` as PEFT's `save_pretrained` does
    (sorted keys, indent 2), creating `directory` if needed.

    The file is written to a temporary file in the same directory (with the umask's mode)
    and moved into place with `os.replace`, so a reader never sees a half-written config,
    and a failed write leaves any previous config untouched.

    **Returns:** the path of the written file.
    """
    directory = pathlib.Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(
            f"{str(directory)!r} is a file; save_config takes the directory to write "
            f"{CONFIG_NAME} into."
        )
    text = json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / CONFIG_NAME
    write_text(target, text)
    return target


def from_toml(path: str | os.PathLike[str]) -> AbstractAdapterConfig:
    """The adapter config in a TOML file's adapter table (`[lora]`, `[ia3]`, ...: any of
    `table_names()`).

    The table holds the same keys as `adapter_config.json` (TOML has no `null`: leave a key
    out for `None`). The table's name chooses the class. Everything else in the file, such as
    top-level keys or a `[train]` table of training settings, is not read here; read it with
    `tomllib` yourself. Since TOML files are written by hand, an unknown key in the table is a
    `ValueError` naming the closest known key, not a warning.

    ```toml
    [lora]
    r = 8
    lora_alpha = 16
    target_modules = ["query", "value"]

    [train]
    learning_rate = 5e-4
    ```
    """
    data = read_toml(path)
    tables = [name for name in TOML_TABLES if name in data]
    if len(tables) != 1:
        raise ValueError(
            f"{str(path)!r} must have exactly one adapter table, {table_names()}; it has "
            f"{['[' + t + ']' for t in tables] or 'none'} (top-level keys/tables: "
            f"{sorted(data)})."
        )
    table = data[tables[0]]
    if not isinstance(table, dict):
        raise TypeError(f"`{tables[0]}` in {str(path)!r} must be a table, got {table!r}.")
    return TOML_TABLES[tables[0]].from_dict(table, strict=True)
