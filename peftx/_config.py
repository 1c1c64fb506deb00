"""What every adapter config shares: PEFT's base fields, the checks read from each field's
annotation, the registry of kinds, and `adapter_config.json` and TOML files.

Field names, meanings and defaults are PEFT's (checked against PEFT 0.21.2), so an
`adapter_config.json` written here loads in `peft.LoraConfig.from_pretrained` and one written by
PEFT loads here. Configs are frozen and hashable (usable as static fields of an `eqx.Module`);
list-valued fields are stored as tuples.

A config class is one adapter kind's entry point, defined in the kind's module beside its
array class (`peftx/adapters/_ia3.py`; LoRA's in `peftx/adapters/_lora/`) and registered by
its `peft_type` (and its TOML table) when that module is imported. It builds the adapter
for each layer `peftx.targets` resolves (`build`) and says how PEFT writes it after placing
it (`as_saved`). Resolving a config against a model (PEFT's per-architecture defaults when
`target_modules` is `None`, expanding `"all-linear"`) is is `peftx.targets`' job.
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
import jax
from jaxtyping import PRNGKeyArray

from ._files import read_json, read_toml, write_text
from ._kind import AbstractAdapter, AbstractTrainHook
from ._select import Predicate

CONFIG_NAME = "adapter_config.json"

TaskType = Literal[
    "SEQ_CLS", "SEQ_2_SEQ_LM", "CAUSAL_LM", "TOKEN_CLS", "QUESTION_ANS", "FEATURE_EXTRACTION"
]

# One of PEFT's module-name rules: a regex string (full match on the dotted path), a list
# of names (exact or dotted-suffix match), or, in peftx only, a `Predicate`.
ModuleRule = str | list[str] | tuple[str, ...] | Predicate | None
RULE = "None, a regex string, a list of module names, or a peftx Predicate"

# Keys that PEFT 0.21.2 writes for every kind but peftx does not model, with PEFT's default
# values (a kind adds its own in `_PEFT_ONLY`).
PEFT_ONLY_COMMON: dict[str, Any] = {"auto_mapping": None}
# Keys PEFT never saves (PEFT itself drops them on load).
_NEVER_SAVED = frozenset({"runtime_config"})
# Keys dropped without a warning whatever their value: `auto_mapping` names the torch class
# for PEFT's `AutoPeftModel` and is in most files PEFT writes.
_SILENT = frozenset({"auto_mapping"})

# The order in which PEFT 0.21.2's `to_dict` lists its keys (`asdict` field order).
PEFT_BASE_KEYS = (
    "task_type",
    "peft_type",
    "auto_mapping",
    "peft_version",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
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
    if dataclasses.is_dataclass(value):  # a sub-config (LoRA's `eva_config`)
        return _jsonable(dataclasses.asdict(value))
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


def by_pattern(patterns: Mapping[str, Any], path: str, default: Any) -> Any:
    """PEFT's `get_pattern_key`: the value of the first pattern matching the end of `path`
    (a whole dotted segment onwards), else `default`."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", path):
            return value
    return default


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# -- what a config builds from ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AdaptedLayer:
    """One layer a config adapts, resolved once by `peftx.targets`; a config's `build`
    makes its adapter from this record, and saving reads it back.

    - `path`: the layer's dotted path; in a `LayerStack`, a segment's (`layers.0-3.mlp`),
      whose layers share everything below.
    - `layer`: the module (`eqx.nn.Linear`, `Conv` or `Embedding`).
    - `rank`, `alpha`: the config's rank and alpha for it (`rank_and_alpha`: its patterns
      applied; None for kinds without them).
    - `feedforward`: the config's `is_feedforward` for it (IA3 scales its input features).
    - `transposed`: its checkpoints store the weight `(in, out)` (GPT-2's Conv1D); ours
      is `(out, in)` all the same.
    - `shared`: what the config's `planned` gives every layer it adapts alike (VeRA's
      projections), else None.
    """

    path: str
    layer: Any
    rank: int | None
    alpha: int | float | None
    feedforward: bool
    transposed: bool
    shared: Any = None


@dataclasses.dataclass(frozen=True)
class AdaptedParameter:
    """One stack of expert weights a config's `expert_targets` adapts.

    - `path`: the dotted path of the module holding it (`layers.0-1.mlp.experts` in a
      `LayerStack` segment).
    - `name`: its field in that module (`gate_up_proj`).
    - `rank`, `alpha`: the config's rank and alpha for it, its patterns applied.
    """

    path: str
    name: str
    rank: int
    alpha: int | float


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

    bias: ClassVar[str] = "none"
    """Which biases the adapter trains and saves (PEFT's `bias`): a kind with PEFT's field
    declares it as a field; one without trains none."""

    combination_types: ClassVar[tuple[str, ...]] = ()
    """`add_weighted_adapter`'s ways to combine adapters of this kind, the default first
    (none: they cannot be combined)."""
    mixed_batches: ClassVar[bool] = True
    """Whether adapters of this kind may be mixed within a batch (`adapter_names`), as PEFT
    allows for them."""

    _PEFT_TYPE: ClassVar[str]
    _KEYS: ClassVar[tuple[str, ...] | None] = None  # PEFT's key order (default: fields')
    _PEFT_ONLY: ClassVar[dict[str, Any]] = PEFT_ONLY_COMMON
    """Keys PEFT writes for this kind that peftx does not model, with PEFT's defaults: on
    load, a default value is dropped silently; a non-default one is an error, because
    ignoring it would give an adapter that computes something else, unless the key is in
    `_HARMLESS`."""
    _HARMLESS: ClassVar[frozenset[str]] = frozenset()
    """Those of `_PEFT_ONLY` ignored with a warning when not at their defaults: they only
    matter to PEFT's torch machinery or to initialization, over once an adapter is saved."""

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

    def build_stacked(
        self, base: Any, layer: AdaptedLayer, *, key: PRNGKeyArray, stack: int
    ) -> AbstractAdapter:
        """The adapter on a whole `LayerStack` segment: `base` has `stack` leading layer
        axes. `build` on each layer's slice with a key of its own, unless a kind whose
        layers share arrays (Lily) builds them once here."""
        keys = jax.random.split(key, base.shape[0])
        if stack == 1:
            return eqx.filter_vmap(lambda b, k: self.build(b, layer, key=k))(base, keys)
        return eqx.filter_vmap(lambda b, k: self.build_stacked(b, layer, key=k, stack=stack - 1))(
            base, keys
        )

    def expert_targets(self) -> tuple[str, ...]:
        """The expert stacks this config adapts directly, by parameter name (PEFT's
        `target_parameters`, e.g. `mlp.experts.gate_up_proj`); `build_experts` makes their
        adapters. None for most kinds."""
        return ()

    def build_experts(
        self, base: Any, parameter: AdaptedParameter, *, key: PRNGKeyArray
    ) -> AbstractAdapter:
        """The adapter on one expert stack `base (experts, out, in)` of `expert_targets`."""
        raise TypeError(f"{type(self).__name__} adapts no expert stacks.")

    def with_model_names(
        self, model_type: str | None, linear_names: Sequence[str]
    ) -> "AbstractAdapterConfig":
        """This config with its target names read for the architecture `model_type`, as
        PEFT reads them (LoRA reads transformers 4's expert names as expert stacks);
        `linear_names` are the last names of the model's Linear layers but its output head,
        what `"all-linear"` names. Itself unless a kind says otherwise."""
        return self

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

    def for_reading(self) -> "AbstractAdapterConfig":
        """The config whose adapters a saved file's tensors are read into (the kind's own
        init run first, as PEFT's `from_pretrained` does): this one, unless the kind
        says an init cannot be re-run on loading."""
        return self

    @property
    def changes_base(self) -> bool:
        """Whether `build` replaces the layer's base weight (PiSSA's residual); the new
        base is then shared by every adapter on the layer, as PEFT changes it in place."""
        return False

    @property
    def leaves_residual(self) -> bool:
        """Whether the init replaces the base weights by a residual that PEFT's conversion
        at saving (`path_initial_model_for_weight_conversion`) undoes (PiSSA, OLoRA, CorDA,
        LoRA-GA): `peftx finetune` then writes its adapter converted, for the original
        base."""
        return False

    # -- checks and files -------------------------------------------------------------------

    def __post_init__(self) -> None:
        if type(self) is AbstractAdapterConfig:
            kinds = ", ".join(c.__name__ for c in CONFIG_CLASSES.values())
            raise TypeError(f"Use a kind's config ({kinds}); AbstractAdapterConfig is abstract.")
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
          (`"LORA"` for `LoraConfig`); use `load_config` to dispatch on it.
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
                if key not in cls._HARMLESS:
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
            f"`peft_type` (one of {list(CONFIG_CLASSES)}), or load it with its config class's "
            "from_dict (LoraConfig.from_dict)."
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
    """The config of the kind registered for its `peft_type` key, like PEFT's
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
