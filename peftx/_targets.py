"""Which modules a config adapts: PEFT's target rules, its per-architecture defaults, the
output head that `"all-linear"` leaves alone, and the checks on layer indices. `targets`
resolves a config against a model once, into one `AdaptedLayer` record per layer; building
and saving adapters read those records."""

import dataclasses
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import equinox as eqx
import jax

from ._config import AdaptedLayer, AdaptedParameter
from ._errors import TargetNotFoundError, UnsupportedTargetError, caller_level
from ._select import (
    Predicate,
    Selection,
    layer_span,
    of_type,
    peft_targets,
    require_matches,
    select,
    suggest_names,
)
from ._spans import find_span, parse_span
from .adapters import AbstractWeight
from .implicit import ImplicitArray
from .models import ARCHITECTURES, LayerStack, is_transposed, split_stack

ADAPTABLE = (eqx.nn.Linear, eqx.nn.Conv, eqx.nn.Embedding)
"""The layer types adapters are placed on."""

# Output heads by the names transformers gives them (PEFT skips a model's output embedding
# and, for sequence classification, `score`/`classifier`).
HEAD_NAMES = ("lm_head", "embed_out", "score", "classifier", "qa_outputs")

BASE = "__base__"
"""The name that routes an example of a mixed batch to the base model (PEFT's)."""


def model_type_of(model: Any) -> str | None:
    """`model.config.model_type` (attribute or key), as transformers models carry it."""
    config = getattr(model, "config", None)
    if isinstance(config, dict):
        return config.get("model_type")
    return getattr(config, "model_type", None)


def name_or_path_of(model: Any) -> str | None:
    """Where `model` was loaded from (`model.config.name_or_path`, set by
    `peftx.models.from_pretrained`), or None."""
    config = getattr(model, "config", None)
    if isinstance(config, dict):
        return config.get("name_or_path") or config.get("_name_or_path")
    return getattr(config, "name_or_path", None)


def with_model_names(config: Any, model: Any, model_type: str | None) -> Any:
    """`config` with its target names read for `model`'s architecture, as PEFT reads them
    (the config's `with_model_names`, given what `"all-linear"` names on this model)."""
    head = output_head(model)
    linear = select(model).at(of_type(eqx.nn.Linear)).paths()
    names = sorted({p.rsplit(".", 1)[-1] for p in linear if p != head})
    return config.with_model_names(model_type or model_type_of(model), names)


def with_defaults(config: Any, model: Any, model_type: str | None) -> Any:
    """`config` with PEFT's per-architecture `target_modules` when it has none."""
    if config.target_modules is not None:
        return config
    return config.with_model_defaults(model_type or model_type_of(model))


def stored_transposed(model: Any, path: str) -> bool:
    """Whether the checkpoints of `model`'s architecture store the weight of the module at
    `path` transposed: GPT-2's Conv1D, on which PEFT sets `fan_in_fan_out=True`."""
    arch = ARCHITECTURES.get(model_type_of(model) or "")
    return arch is not None and all(is_transposed(arch, f"{q}.weight") for q in layer_paths(path))


@dataclasses.dataclass(frozen=True)
class Targets(Selection):
    """The layers a config adapts (a `Selection` of them, on the model with its stacks
    split), with the config resolved for this model (PEFT's default `target_modules`
    filled in) and one `AdaptedLayer` per selected layer, in the same order."""

    config: Any = None
    layers: tuple[AdaptedLayer, ...] = ()


def output_head(model: Any) -> str | None:
    """The path of the model's output head: a `Linear` named like one (`lm_head`,
    `classifier`, ...), else the last `Linear` if it sits directly on the model, else None."""
    paths = select(model).at(of_type(eqx.nn.Linear)).paths()
    named = [p for p in paths if p.rsplit(".", 1)[-1] in HEAD_NAMES]
    if named:
        return named[-1]
    if paths and "." not in paths[-1]:
        return paths[-1]
    return None


def target_predicate(config: Any, model: Any) -> Predicate:
    """The modules `config` adapts, as a predicate (PEFT's rules for every target form)."""
    target, exclude = config.target_modules, config.exclude_modules
    if isinstance(target, Predicate):
        chosen = target
    elif target == "all-linear":
        head = output_head(model)
        chosen = of_type(eqx.nn.Linear) & Predicate(lambda p, n: p != head, f"not {head}")
    else:
        # PEFT's own rule applies a name-based `exclude_modules` itself.
        chosen = peft_targets(
            target,
            exclude_modules=None if isinstance(exclude, Predicate) else exclude,
            layers_to_transform=config.layers_to_transform,
            layers_pattern=config.layers_pattern,
        )
        exclude = exclude if isinstance(exclude, Predicate) else None
    if isinstance(exclude, Predicate):
        return chosen & ~exclude
    if exclude:
        return chosen & ~peft_targets(exclude)
    return chosen


def targets(model: Any, config: Any, *, model_type: str | None = None) -> Targets:
    """The layers `get_peft_model(model, config)` would adapt, as a `Selection` that also
    holds the resolved config and one `AdaptedLayer` record per layer (`.layers`): print
    `targets(model, config).table()` for a dry run.

    Inside a `LayerStack`, the rule is applied to each layer's own path (`layers.3.mlp`,
    as transformers names it), and the stack is split where the chosen modules change, so
    `layers_to_transform`, a regex naming layers, or PEFT's expanded list of module paths
    select exactly what they select on the unrolled model. `Selection.model` is the model
    with those splits.

    Raises as `get_peft_model` would: `TargetNotFoundError` when nothing matches (with the
    closest module names), `UnsupportedTargetError` for a module the adapter cannot wrap,
    `ValueError` for layer indices the model does not have; and warns about an entry of a
    `target_modules` list that matches nothing while others match (PEFT ignores it).
    """
    config = with_model_names(with_defaults(config, model, model_type), model, model_type)
    check_layers(config, model)
    parameters = config.expert_targets()
    predicate = target_predicate(config, model)
    if parameters:
        # PEFT wraps a targeted parameter of a plain layer (`gate.weight`, a router) as it
        # wraps the layer: peftx adapts the layer
        by_weight = Predicate(
            lambda p, n: isinstance(n, ADAPTABLE) and names_parameter(parameters, f"{p}.weight"),
            f"layers whose weight is in {list(parameters)}",
        )
        _refuse_targeted_twice(model, predicate, by_weight)
        predicate = predicate | by_weight

    def settings(path: str, node: Any) -> tuple[Any, ...]:
        return (*config.rank_and_alpha(path), config.is_feedforward(path, node))

    # a stack is cut where a layer's settings change, so each segment is adapted alike
    model = split_stacks(model, lambda p, n: settings(p, n) if predicate(p, n) else None)
    target = config.target_modules
    wanted = (
        [target]
        if isinstance(target, str)
        else list(target or ())
        if isinstance(target, tuple)
        else []
    )
    modules = select(model).at(~of_type(jax.Array))
    if parameters and not len(modules.at(per_layer(predicate))):
        return Targets(model, (), config, ())  # only expert stacks, placed by `parameter_targets`
    chosen = require_matches(
        modules, per_layer(predicate), wanted=[w for w in wanted if isinstance(w, str)]
    )
    if isinstance(target, tuple):
        _warn_unmatched(modules, target)
    paths = set(_adaptable(chosen, config))
    chosen = chosen.at(Predicate(lambda p, n: p in paths, "adaptable targets"))
    layers = tuple(
        AdaptedLayer(
            path,
            node,
            *settings(layer_paths(path)[0], node),
            transposed=stored_transposed(model, path),
        )
        for path, node in zip(chosen.paths(), chosen.get())
    )
    return Targets(chosen.model, chosen.matches, config, layers)


def _refuse_targeted_twice(model: Any, by_module: Predicate, by_weight: Predicate) -> None:
    """Raise, as PEFT's `get_peft_model` does, when a layer is named both by
    `target_modules` and (its weight) by `target_parameters`."""
    modules = select(model).at(~of_type(jax.Array))
    for path, node in zip(modules.paths(), modules.get()):
        for layer in layer_paths(path):
            if by_module(layer, node) and by_weight(layer, node):
                raise ValueError(
                    f"{layer} is targeted twice: by target_modules and, as "
                    f"'{layer}.weight', by target_parameters (PEFT refuses this too); name "
                    "it in one of them."
                )


def names_parameter(entries: Sequence[str], path: str) -> bool:
    """PEFT's rule for `target_parameters`: the parameter's dotted path equals an entry or
    ends in `"." + entry`."""
    return any(path == t or path.endswith("." + t) for t in entries)


def expert_fields(module: Any) -> list[str]:
    """The fields of `module` that hold expert stacks: weights of three or more axes (an
    `AdapterSet` over one counts) in a module that is not a Linear, Conv or Embedding, in
    definition order (PEFT nests its wrappers in this order)."""
    if not isinstance(module, eqx.Module) or isinstance(module, (*ADAPTABLE, ImplicitArray)):
        return []
    return [
        f.name
        for f in dataclasses.fields(module)
        if isinstance(getattr(module, f.name, None), jax.Array | AbstractWeight)
        and len(getattr(module, f.name).shape) >= 3
    ]


def parameter_targets(model: Any, config: Any) -> tuple[Any, tuple[AdaptedParameter, ...]]:
    """The expert stacks `config.expert_targets()` names, and `model` with its stacks split
    where the adapted stacks change (none without them). Raises
    `TargetNotFoundError` when the entries match nothing, as PEFT raises."""
    wanted = config.expert_targets()
    if not wanted:
        return model, ()

    def chosen(path: str, module: Any) -> tuple[tuple[str, Any], ...]:
        return tuple(
            (name, config.rank_and_alpha(f"{path}.{name}"))
            for name in expert_fields(module)
            if names_parameter(wanted, f"{path}.{name}")
        )

    model = split_stacks(model, lambda p, n: chosen(p, n) or None)
    owners = select(model).at(~of_type(jax.Array))
    found = []
    for path, module in zip(owners.paths(), owners.get()):
        per_layer_choice = {chosen(q, module) for q in layer_paths(path)}
        (choice,) = per_layer_choice  # a stack is split where the choice changes
        found += [AdaptedParameter(path, name, *settings) for name, settings in choice]
    linear_weights = [
        f"{p}.weight" for p, n in zip(owners.paths(), owners.get()) if isinstance(n, ADAPTABLE)
    ]
    stray = [
        t
        for t in wanted
        if not any(
            names_parameter([t], f"{q}.{p.name}") for p in found for q in layer_paths(p.path)
        )
        and not any(names_parameter([t], q) for w in linear_weights for q in layer_paths(w))
    ]
    if stray:
        fields = sorted(
            {f"{p}.{n}" for p, m in zip(owners.paths(), owners.get()) for n in expert_fields(m)}
        )
        raise TargetNotFoundError(
            f"target_parameters entries {stray} match no expert stack or layer weight of "
            f"this model; its expert stacks are {fields or 'none'} (an entry matches a "
            "parameter's path or its end after a dot, e.g. 'mlp.experts.gate_up_proj')."
        )
    return model, tuple(found)


def _warn_unmatched(modules: Selection, target: tuple[str, ...]) -> None:
    """Warn about each entry of a `target_modules` list that names no module while others
    do: PEFT ignores it silently, so a typo (`"q_porj"`) would go unnoticed."""
    paths = {q for p in modules.paths() for q in layer_paths(p)}
    for entry in target:
        if not any(p == entry or p.endswith("." + entry) for p in paths):
            warnings.warn(
                f"target_modules entry {entry!r} matches no module of this model, so it "
                f"adapts nothing (the other entries do). {suggest_names(modules, [entry])}",
                UserWarning,
                stacklevel=caller_level(),
            )


def layer_paths(path: str) -> list[str]:
    """The per-layer paths a path stands for: `layers.0-2.mlp` is `layers.0.mlp`,
    `layers.1.mlp` and `layers.2.mlp`; any other path is itself."""
    found = find_span(path)
    if found is None:
        return [path]
    parts, j, (first, last) = found
    return [".".join([*parts[:j], str(i), *parts[j + 1 :]]) for i in range(first, last + 1)]


def per_layer(predicate: Predicate) -> Predicate:
    """`predicate` on each layer a stacked path stands for: true when true for all."""
    return Predicate(
        lambda p, n: all(predicate(q, n) for q in layer_paths(p)), f"per layer: {predicate}"
    )


def _adaptable(chosen: Selection, config: Any) -> list[str]:
    layers = []
    for path, node in zip(chosen.paths(), chosen.get()):
        if not isinstance(node, ADAPTABLE):
            if len(select(node).at(of_type(*ADAPTABLE))):
                continue  # a container whose name matched; its layers are matched on their own
            raise UnsupportedTargetError(
                f"target {path!r} is a {type(node).__name__}; {config.peft_type} adapts "
                "eqx.nn.Linear, eqx.nn.Conv and eqx.nn.Embedding layers."
            )
        reason = config.unsupported(path, node)
        if reason is not None:
            raise UnsupportedTargetError(reason)
        layers.append(path)
    if not layers:
        raise UnsupportedTargetError(
            f"the targets {config.target_modules} matched only containers, no Linear, Conv "
            "or Embedding layer."
        )
    return layers


def split_stacks(model: Any, choice: Callable[[str, Any], Hashable | None]) -> Any:
    """`model` with each `LayerStack` split into segments wherever what `choice` says of
    its modules (None: not adapted; else, say, the rank), tested on each layer's own path,
    changes from one layer to the next, so an adapter lands on whole segments of one
    rank and unchosen layers get none."""

    def split(stack_path: str, stack: LayerStack) -> LayerStack:
        inner = select(stack).at(~of_type(jax.Array))
        chosen: dict[int, set[tuple[str, Hashable]]] = {}
        for rel, node in zip(inner.paths(), inner.get()):
            segment, _, rest = rel.partition(".")
            first, last = parse_span(segment) or (0, -1)
            for i in range(first, last + 1):
                what = choice(f"{stack_path}.{i}.{rest}" if rest else f"{stack_path}.{i}", node)
                if what is not None:
                    chosen.setdefault(i, set()).add((rest, what))
        cuts = [i for i in range(1, len(stack)) if chosen.get(i) != chosen.get(i - 1)]
        return split_stack(stack, cuts) if cuts else stack

    stacks = select(model).at(of_type(LayerStack))
    return stacks.set([split(p, n) for p, n in zip(stacks.paths(), stacks.get())])


def check_layers(config: Any, model: Any) -> None:
    """Raise if `layers_to_transform` names a layer index the model does not have."""
    wanted = config.layers_to_transform
    if wanted is None:
        return
    wanted = {wanted} if isinstance(wanted, int) else set(wanted)
    paths = select(model).paths()
    spans = {s for p in paths if (s := layer_span(p, config.layers_pattern)) is not None}
    present = {i for first, last in spans for i in range(first, last + 1)}
    missing = sorted(wanted - present)
    if missing:
        where = f" after {config.layers_pattern!r}" if config.layers_pattern else ""
        have = f"0..{max(present)}" if present else "none"
        raise ValueError(
            f"layers_to_transform {sorted(wanted)} names layer(s) {missing} that the model does "
            f"not have: its numbered layers{where} are {have}."
        )
