"""`get_peft_model`: adapters placed on an Equinox model by a PEFT config."""

import math
import re
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray

from ._errors import UnsupportedTargetError
from ._select import Predicate, of_type, peft_targets, require_matches, select
from .adapters import (
    DoraArray,
    IA3Array,
    LoraArray,
    dora,
    ia3,
    lora,
    merge,
)
from .implicit import use_implicit_args

_ADAPTERS = (LoraArray, DoraArray, IA3Array)
_TRAINED_FIELDS = {
    LoraArray: ("lora_A", "lora_B"),
    DoraArray: ("lora_A", "lora_B", "lora_magnitude_vector"),
    IA3Array: ("ia3_l",),
}


def _is_adapter(x: Any) -> bool:
    return isinstance(x, _ADAPTERS)


class PeftModel(eqx.Module):
    """A model whose targeted weights are adapters (implicit arrays).

    Calling it runs the wrapped model under `use_implicit_args`, with the base model's
    signature. Methods return new models; nothing is changed in place.
    """

    base_model: Any
    peft_type: str = eqx.field(static=True)
    modules_to_save: tuple[str, ...] = eqx.field(static=True)
    bias: str = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return use_implicit_args(self.base_model)(*args, **kwargs)

    def trainable_spec(self) -> Any:
        """`True` on every leaf that trains, for `eqx.partition`: adapter factors, the
        arrays of `modules_to_save`, and biases as `bias` asks."""

        def adapter_spec(a: Any) -> Any:
            fields = _TRAINED_FIELDS[type(a)]
            flags = jax.tree.map(lambda _: False, a)
            return eqx.tree_at(
                lambda m: [getattr(m, f) for f in fields], flags, [True] * len(fields)
            )

        spec = jax.tree.map(
            lambda a: adapter_spec(a) if _is_adapter(a) else False, self, is_leaf=_is_adapter
        )
        sel = select(self.base_model)
        saved = (
            set(sel.at(peft_targets(list(self.modules_to_save))).paths())
            if self.modules_to_save
            else set()
        )
        layers = sel.at(of_type(eqx.nn.Linear, eqx.nn.Conv))
        biased = {
            p
            for p, n in zip(layers.paths(), layers.get())
            if n.bias is not None
            and (self.bias == "all" or (self.bias == "lora_only" and _is_adapter(n.weight)))
        }
        extra = sel.at(Predicate(lambda p, n: p in saved or p in biased, "trained modules"))
        if not len(extra):
            return spec
        flags = [
            jax.tree.map(eqx.is_inexact_array, n)
            if p in saved
            else eqx.tree_at(
                lambda m: m.bias, jax.tree.map(lambda _: False, n, is_leaf=_is_adapter), True
            )
            for p, n in zip(extra.paths(), extra.get())
        ]
        where = extra.where_fn()
        return eqx.tree_at(lambda s: where(s.base_model), spec, flags)

    def print_trainable_parameters(self) -> None:
        """Print PEFT's line: `trainable params: N || all params: M || trainable%: P`."""
        trainable, total = self.count_parameters()
        print(
            f"trainable params: {trainable:,} || all params: {total:,} || "
            f"trainable%: {100 * trainable / total:.4f}"
        )

    def count_parameters(self) -> tuple[int, int]:
        """(trainable, all) floating-point parameters, adapters included in both."""
        trainable, _ = partition(self)
        return _count(trainable), _count(self)

    def merge_and_unload(self) -> Any:
        """The base model's own class with every adapter merged into a dense weight."""
        return jax.tree.map(
            lambda x: merge(x) if _is_adapter(x) else x, self.base_model, is_leaf=_is_adapter
        )

    def unload(self) -> Any:
        """The base model without adapters (the original weights)."""
        return jax.tree.map(
            lambda x: x.weight if _is_adapter(x) else x, self.base_model, is_leaf=_is_adapter
        )

    def disable_adapters(self) -> Any:
        """A model that runs without the adapters: `unload()`, kept for PEFT users."""
        return self.unload()


def _count(tree: Any) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array)))


def partition(model: PeftModel) -> tuple[Any, Any]:
    """`(trainable, frozen)` halves of a `PeftModel`, for `eqx.combine` inside a loss."""
    return eqx.partition(model, model.trainable_spec())


def _targets(config: Any, model: Any) -> Predicate:
    target, exclude = config.target_modules, config.exclude_modules
    if target is None:
        raise ValueError(
            "target_modules is None; PEFT's per-architecture defaults need a transformers "
            "model type. Name the modules, e.g. target_modules=['q_proj', 'v_proj'], or "
            "use 'all-linear'."
        )
    if isinstance(target, Predicate):
        chosen = target
    elif target == "all-linear":
        head = _output_head(model)
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


def _output_head(model: Any) -> str | None:
    linears = select(model).at(of_type(eqx.nn.Linear)).paths()
    return linears[-1] if linears else None


def get_peft_model(
    model: Any, config: Any, *, key: PRNGKeyArray, adapter_name: str = "default"
) -> PeftModel:
    """Place the adapters a PEFT config describes on an Equinox model.

    **Arguments:**

    - `model`: any Equinox model (targets are found by dotted path, e.g.
      `layers.3.self_attn.q_proj`, see `peftx.select`).
    - `config`: a `LoraConfig` or `IA3Config`.
    - `key`: PRNG key for the adapters' initialization.
    - `adapter_name`: only `"default"` for now.

    **Returns:**

    A `PeftModel`; train it with `partition(peft_model)` and optax.
    """
    if adapter_name != "default":
        raise NotImplementedError("only the 'default' adapter is supported so far.")
    peft_type = config.peft_type
    target = config.target_modules
    wanted = [target] if isinstance(target, str) else list(target or ())
    chosen = require_matches(
        select(model).at(~of_type(jax.Array)),
        _targets(config, model),
        wanted=[w for w in wanted if isinstance(w, str)],
    )
    modules = []
    for path, node in zip(chosen.paths(), chosen.get()):
        if not isinstance(node, eqx.nn.Linear | eqx.nn.Conv):
            if len(select(node).at(of_type(eqx.nn.Linear, eqx.nn.Conv))):
                continue  # a container whose name matched; its layers are matched on their own
            raise UnsupportedTargetError(
                f"target {path!r} is a {type(node).__name__}; {peft_type} adapts "
                "eqx.nn.Linear and eqx.nn.Conv layers."
            )
        if peft_type == "IA3" and isinstance(node, eqx.nn.Conv):
            raise UnsupportedTargetError(f"IA3 adapts Linear layers only; {path!r} is a Conv.")
        modules.append((path, node))
    if not modules:
        raise UnsupportedTargetError(
            f"the targets {target} matched only containers, no Linear or Conv layer."
        )
    keys = jax.random.split(key, len(modules))
    adapted = [
        eqx.tree_at(lambda m: m.weight, node, _adapt(config, path, node, k))
        for (path, node), k in zip(modules, keys)
    ]
    paths = [p for p, _ in modules]
    where = chosen.at(Predicate(lambda p, n: p in paths, "targets")).where_fn()
    return PeftModel(
        eqx.tree_at(where, model, adapted),
        peft_type,
        tuple(config.modules_to_save or ()),
        getattr(config, "bias", "none"),
    )


def _adapt(config: Any, path: str, layer: Any, key: PRNGKeyArray) -> Any:
    if config.peft_type == "IA3":
        ff = config.feedforward_modules or []
        is_ff = bool(peft_targets(ff)(path, layer)) if ff else False
        return ia3(layer.weight, feedforward=is_ff)
    r = _pattern(config.rank_pattern, path, config.r)
    alpha = _pattern(config.alpha_pattern, path, config.lora_alpha)
    init = {True: "default", False: "random"}.get(
        config.init_lora_weights, config.init_lora_weights
    )
    if config.use_dora and isinstance(layer, eqx.nn.Conv):
        raise UnsupportedTargetError(f"DoRA adapts Linear layers only; {path!r} is a Conv.")
    adapter = lora(
        layer.weight,
        r=r,
        lora_alpha=alpha,
        init=init,
        use_rslora=config.use_rslora,
        lora_dropout=config.lora_dropout,
        key=key,
    )
    return dora(adapter) if config.use_dora else adapter


def _pattern(patterns: dict | None, path: str, default: Any) -> Any:
    """PEFT's `rank_pattern`/`alpha_pattern`: the first key that matches the path's end."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", path):
            return value
    return default
