"""`get_peft_model` and `PeftModel`: named adapters placed on an Equinox model by PEFT configs."""

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, PRNGKeyArray

from ._bank import PeftBankModel, bank_from
from ._config import AbstractAdapterConfig
from ._errors import UnknownAdapterError, unknown_adapter
from ._kind import count_parameters, trained_fields
from ._peft_io import adapted_layer_paths, load_adapter_into, save_adapters
from ._select import Predicate, dotted, of_type, peft_targets, require_matches, select
from ._targets import (
    ADAPTABLE,
    BASE,
    AdaptedLayer,
    AdaptedParameter,
    layer_paths,
    name_or_path_of,
    parameter_targets,
    targets,
    with_model_names,
)
from .adapters import AbstractAdapter, AdapterSet, detach, merge
from .implicit import use_implicit_args
from .sharding import placed_like

CombinationType = Literal["svd", "linear", "cat"]


def _is_set(x: Any) -> bool:
    return isinstance(x, AdapterSet)


def _is_adapted_layer(x: Any) -> bool:
    return isinstance(x, ADAPTABLE) and isinstance(x.weight, AdapterSet)


def _map_sets(tree: Any, fn: Callable[[AdapterSet], Any]) -> Any:
    return jax.tree.map(lambda x: fn(x) if _is_set(x) else x, tree, is_leaf=_is_set)


def _map_layers(tree: Any, fn: Callable[[Any], Any]) -> Any:
    return jax.tree.map(
        lambda x: fn(x) if _is_adapted_layer(x) else x, tree, is_leaf=_is_adapted_layer
    )


class PeftModel(eqx.Module):
    """A model whose targeted weights carry named adapters (`AdapterSet`s of implicit arrays).

    Calling it runs the wrapped model under `use_implicit_args` with the active adapter,
    with the base model's signature plus `adapter_names` for mixed batches. Methods
    return new models; nothing is changed in place.

    `saved_modules[adapter][path]` is that adapter's own trainable copy of a module in
    its config's `modules_to_save` (PEFT's `ModulesToSaveWrapper`); the module in
    `base_model` stays the frozen original.
    """

    base_model: Any
    saved_modules: dict[str, dict[str, Any]]
    configs: tuple[tuple[str, Any], ...] = eqx.field(static=True)
    active_adapter: str = eqx.field(static=True)

    @property
    def peft_config(self) -> dict[str, Any]:
        """The config of each adapter, by name (PEFT's `peft_config`)."""
        return dict(self.configs)

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """Every adapter's name, in the order they were added."""
        return tuple(name for name, _ in self.configs)

    @property
    def active_adapters(self) -> list[str]:
        """PEFT's list form of `active_adapter`."""
        return [self.active_adapter]

    @property
    def peft_type(self) -> str:
        return self.configs[0][1].peft_type

    @property
    def bias(self) -> str:
        return self.configs[0][1].bias

    def __call__(
        self,
        *args: Any,
        adapter_names: Sequence[str] | Array | np.ndarray | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the model; `adapter_names` (one per example, see `prepared`) mixes adapters
        within the batch."""
        return use_implicit_args(self.prepared(adapter_names))(*args, **kwargs)

    def prepared(self, adapter_names: Sequence[str] | Array | np.ndarray | None = None) -> Any:
        """The wrapped model as a call runs it, for use under your own `use_implicit_args`.

        IA3's output scale is applied to biases (as PEFT scales the whole layer output).
        With `adapter_names`, each example of the batch uses its own adapter:

        - a list of names (or `"__base__"` for none), one per example along the leading
          axis of the activations; only the adapters named are computed;
        - or integer ids from `adapter_ids(...)`, which may be traced: a batch of them, or
          one id per call under your own `jax.vmap` (for models that take one example).

        Gradients flow to every adapter used, so several adapters train in one batch.
        """
        if adapter_names is None:
            active, gate, model = (self.active_adapter,), None, self
        else:
            unmixed = sorted({c.peft_type for _, c in self.configs if not c.mixed_batches})
            if unmixed:
                raise ValueError(
                    f"adapter_names mixes adapters within a batch, which PEFT does not do for "
                    f"{', '.join(unmixed)} adapters. Run one adapter at a time (`set_adapter`)."
                )
            active, gate = self._route(adapter_names)
            model = _map_layers(self, lambda layer: _gated(layer, gate, active))
            # what is left: expert stacks (`target_parameters`), experts on axis -3
            model = _map_sets(
                model, lambda s: s if s.gate is not None else _gated_stack(s, gate, active, 3)
            )
        model = _map_sets(model, _for_layers)
        return _map_layers(self._with_saved(model.base_model, active, gate), _scale_bias)

    def _with_saved(self, model: Any, active: tuple[str, ...], gate: Array | None) -> Any:
        """`model` with the `modules_to_save` copies of the `active` adapters in place:
        the copy itself without a gate; with a gate row, the gate-weighted mixture of the
        copies and the original (exactly one of them for a one-hot row)."""
        paths = sorted({p for name in active for p in self.saved_modules.get(name, {})})
        if not paths:
            return model
        if gate is not None and gate.ndim > 1:
            raise ValueError(
                f"modules_to_save {paths} cannot follow a batch-wide adapter gate: a module "
                "is applied to the whole batch. Call the model under your own `jax.vmap` with "
                "one adapter id per example (`adapter_ids`)."
            )
        selection = select(model).at(Predicate(lambda p, n: p in paths, "modules_to_save"))

        def chosen(path: str, original: Any) -> Any:
            copies = [(k, self.saved_modules.get(n, {}).get(path)) for k, n in enumerate(active)]
            copies = [(k, c) for k, c in copies if c is not None]
            if gate is None:
                return copies[0][1]
            arrays, static = eqx.partition(original, eqx.is_inexact_array)
            rest = 1.0 - sum(gate[k] for k, _ in copies)
            mixed = jax.tree.map(lambda a: rest.astype(a.dtype) * a, arrays)
            for k, copy in copies:
                part = eqx.filter(copy, eqx.is_inexact_array)
                mixed = jax.tree.map(lambda m, a, k=k: m + gate[k].astype(a.dtype) * a, mixed, part)
            return eqx.combine(mixed, static)

        return selection.set([chosen(p, n) for p, n in zip(selection.paths(), selection.get())])

    def adapter_ids(self, adapter_names: Sequence[str]) -> Int[Array, " batch"]:
        """Integer ids of adapter names (`"__base__"` is `len(adapter_names)`), for
        `prepared`/`__call__` under `jax.vmap` or inside `jax.jit`."""
        index = {name: i for i, name in enumerate(self.adapter_names)}
        index[BASE] = len(index)
        for name in adapter_names:
            if name not in index:
                raise self._unknown(name, BASE)
        return jnp.asarray([index[name] for name in adapter_names], jnp.int32)

    def _route(
        self, adapter_names: Sequence[str] | Array | np.ndarray
    ) -> tuple[tuple[str, ...], Array]:
        if isinstance(adapter_names, np.ndarray):
            adapter_names = jnp.asarray(adapter_names)
        if isinstance(adapter_names, jax.Array):
            if not jnp.issubdtype(adapter_names.dtype, jnp.integer):
                raise TypeError(
                    "adapter_names must be names or integer ids from `adapter_ids`, got an "
                    f"array of dtype {adapter_names.dtype}."
                )
            n = len(self.adapter_names)
            return self.adapter_names, jax.nn.one_hot(adapter_names, n, dtype=jnp.float32)
        ids = self.adapter_ids(adapter_names)
        used = tuple(n for n in self.adapter_names if n in set(adapter_names))
        columns = jnp.asarray([self.adapter_names.index(n) for n in used], jnp.int32)
        one_hot = jax.nn.one_hot(ids, len(self.adapter_names), dtype=jnp.float32)
        return used, one_hot[:, columns]

    # -- training -----------------------------------------------------------------------

    def trainable_spec(self, adapters: Sequence[str] | None = None) -> Any:
        """`True` on every leaf that trains, for `eqx.partition`: the factors of `adapters`
        (default: the active adapter), the arrays of `modules_to_save`, and biases as
        `bias` asks."""
        names = self._known((self.active_adapter,) if adapters is None else tuple(adapters))
        frozen = [n for n in names if self.peft_config[n].inference_mode]
        if adapters is not None and frozen:
            raise ValueError(
                f"adapter(s) {frozen} were loaded for inference (is_trainable=False, PEFT's "
                "inference_mode); load them with is_trainable=True to train them."
            )
        names = tuple(n for n in names if n not in frozen)

        def set_spec(s: AdapterSet) -> Any:
            flags = jax.tree.map(lambda _: False, s)
            for name in names:
                if name in s.adapters:
                    fields = trained_fields(s.adapters[name])
                    flags = eqx.tree_at(
                        lambda f, name=name: [getattr(f.adapters[name], x) for x in fields],
                        flags,
                        [True] * len(fields),
                    )
            return flags

        spec = jax.tree.map(lambda x: set_spec(x) if _is_set(x) else False, self, is_leaf=_is_set)
        spec = eqx.tree_at(
            lambda m: m.saved_modules,
            spec,
            {
                name: jax.tree.map(eqx.is_inexact_array if name in names else lambda _: False, c)
                for name, c in self.saved_modules.items()
            },
        )
        layers = select(self.base_model).at(of_type(eqx.nn.Linear, eqx.nn.Conv))
        biased = layers.at(
            Predicate(
                lambda p, n: (
                    n.bias is not None
                    and (
                        self.bias == "all"
                        or (
                            # each kind's `<kind>_only` (PEFT's rule)
                            self.bias.endswith("_only")
                            and _is_set(n.weight)
                            and any(name in n.weight.adapters for name in names)
                        )
                    )
                ),
                f"bias={self.bias!r}",
            )
        )
        if not len(biased):
            return spec
        where = biased.where_fn()
        # only the bias leaf: the layer's adapter factors keep their own flags
        return eqx.tree_at(
            lambda s: [layer.bias for layer in where(s.base_model)], spec, [True] * len(biased)
        )

    def print_trainable_parameters(self) -> None:
        """Print PEFT's line: `trainable params: N || all params: M || trainable%: P`."""
        trainable, total = self.get_nb_trainable_parameters()
        print(
            f"trainable params: {trainable:,} || all params: {total:,} || "
            f"trainable%: {100 * trainable / total:.4f}"
        )

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """(trainable, all) floating-point parameters, every adapter included in all
        (PEFT's method of this name)."""
        trainable, _ = partition(self)
        return count_parameters(trainable), count_parameters(self)

    def layer_paths(self, adapter_name: str) -> list[str]:
        """The module path of each layer carrying `adapter_name` (each layer of a stack on
        its own, `model.layers.3.self_attn.q_proj`), in the order of the model's tree."""
        return adapted_layer_paths(self, self._known((adapter_name,))[0])

    def with_config(self, adapter_name: str, config: Any) -> "PeftModel":
        """This model with `config` recorded for `adapter_name` (of the same kind); the
        arrays are unchanged."""
        old = self.peft_config[self._known((adapter_name,))[0]]
        if type(config) is not type(old):
            raise TypeError(
                f"adapter {adapter_name!r} has a {type(old).__name__}; got a "
                f"{type(config).__name__}."
            )
        configs = tuple((n, config if n == adapter_name else c) for n, c in self.configs)
        return dataclasses.replace(self, configs=configs)

    # -- files --------------------------------------------------------------------------

    def save_pretrained(
        self,
        save_directory: str | os.PathLike[str],
        selected_adapters: Sequence[str] | None = None,
        *,
        save_embedding_layers: bool | Literal["auto"] = "auto",
        path_initial_model_for_weight_conversion: str | os.PathLike[str] | None = None,
        model_card: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Write adapters in HF PEFT's format, loadable by `peft.PeftModel.from_pretrained`.

        Each adapter (default: all) gets `adapter_config.json` and
        `adapter_model.safetensors`: `"default"` in `save_directory`, any other in the
        subfolder of its name, as PEFT lays them out. Keys are PEFT's
        (`base_model.model.<module path>.lora_A.weight`, one per layer of a stacked
        model), tensors keep their dtype, and the config is written as PEFT writes it
        after placing the adapter (`"all-linear"` or a predicate expanded to module
        names, `fan_in_fan_out` for GPT-2's Conv1D, `inference_mode: true`).
        `modules_to_save` copies are written under their module's path.

        `save_embedding_layers`: PEFT's rule for the base weight of an adapted input or
        output embedding: `"auto"` writes it when `target_modules` names `embed_tokens` or
        `lm_head`, `True` always, `False` never. Loading reads such weights when present
        (also a resized vocabulary's embedding that PEFT saved) in place of the base
        model's.

        The files are written into a new directory that replaces `save_directory` in
        one atomic swap: a save killed at any point leaves the old adapters or the new
        ones, never new weights beside an old config. Other files there (a tokenizer's)
        are kept. Nothing but JSON, safetensors and the Markdown card is written.

        A model card, `README.md`, goes at the top of `save_directory` (as PEFT writes it;
        none in the subfolders): front matter for the Hub (`library_name: peft`,
        `base_model`, `tags`, the `pipeline_tag` of the config's `task_type`), each
        adapter's method and config, and the versions of peftx, JAX, Equinox and the
        config's `peft_version`. `model_card` adds sections by heading, each a mapping
        shown as a table (nested mappings flattened), e.g. `{"Data": {"train": path},
        "Evaluation": result.after}`. peftx's card (the one with a line starting
        `<!-- peftx model card`) is rewritten by each save; a `README.md` that peftx did
        not write is kept as it is, and no card is written (with a warning).

        `path_initial_model_for_weight_conversion`: PEFT's conversion of a PiSSA (or
        OLoRA) adapter into a plain LoRA on the original base (a LoftQ adapter is refused:
        its base is quantized, so the difference of factors would not restore it): the
        directory of the adapter as it was initialized (saved with
        `init_lora_weights=True`); each adapter is written as
        `ΔW = s·(B·A − B₀·A₀)`, factors `[A; A₀]` and `[B, −B₀]` of rank `2r` at the same
        scaling (`lora_alpha` doubled, or times √2 with `use_rslora`, patterns doubled).
        """
        save_adapters(
            self,
            save_directory,
            selected_adapters,
            save_embedding_layers,
            path_initial_model_for_weight_conversion,
            model_card,
        )

    @classmethod
    def from_pretrained(
        cls,
        model: Any,
        model_id: str | os.PathLike[str],
        adapter_name: str = "default",
        is_trainable: bool = False,
        *,
        model_type: str | None = None,
        max_adapters: int | None = None,
        max_rank: int | None = None,
    ) -> "PeftModel | PeftBankModel":
        """`model` (a plain Equinox model) with the adapter saved in `model_id`, by
        peftx or PyTorch PEFT (a directory holding `adapter_config.json`; if it holds
        none, its subfolder `adapter_name`).

        With `max_adapters`, a `PeftBankModel` of that many slots, the adapter in the
        first; ranks are padded to `max_rank` (default: the adapter's `r`).

        Strict, unlike PEFT: a missing or unexpected key or a wrong shape raises
        `CheckpointError` naming the module and shapes, a corrupt file one naming the
        file, an integer or boolean tensor one naming the key and dtype, and an adapter
        most of whose modules the model lacks one saying it was made for another model
        (its `base_model_name_or_path`). On any error `model` is left as it was.
        `is_trainable=False` (PEFT's default) loads the adapter frozen: `partition`
        trains nothing of it. Config keys peftx does not know are ignored with a warning
        naming them.
        """
        if isinstance(model, PeftModel):
            raise TypeError(
                "model is a PeftModel already; add a saved adapter with "
                "`peft_model.load_adapter(directory, adapter_name)`."
            )
        loaded = load_adapter_into(
            PeftModel(model, {}, (), adapter_name), model_id, adapter_name, is_trainable, model_type
        )
        if max_adapters is None:
            return loaded
        return bank_from(loaded, max_adapters, max_rank, get_peft_model, PeftModel.from_pretrained)

    def load_adapter(
        self,
        model_id: str | os.PathLike[str],
        adapter_name: str,
        is_trainable: bool = False,
        *,
        model_type: str | None = None,
    ) -> "PeftModel":
        """A model with one more adapter, read from `model_id` as `from_pretrained`
        reads it (the active adapter is unchanged). This model is left as it is; on an
        error no adapter is added."""
        return load_adapter_into(self, model_id, adapter_name, is_trainable, model_type)

    # -- several adapters ---------------------------------------------------------------

    def add_adapter(self, adapter_name: str, config: Any, *, key: PRNGKeyArray) -> "PeftModel":
        """A model with one more adapter, placed by `config`; the active one is unchanged."""
        return self._add(adapter_name, config, key, model_type=None)

    def set_adapter(self, adapter_name: str) -> "PeftModel":
        """A model whose active adapter (the one calls use and `partition` trains) is
        `adapter_name`."""
        self._known((adapter_name,))
        model = _map_sets(self, lambda s: AdapterSet(s.weight, s.adapters, None, (adapter_name,)))
        return dataclasses.replace(model, active_adapter=adapter_name)

    def delete_adapter(self, adapter_name: str) -> "PeftModel":
        """A model without `adapter_name`; if it was active, the first remaining adapter
        becomes active (PEFT's rule)."""
        self._known((adapter_name,))
        remaining = tuple((n, c) for n, c in self.configs if n != adapter_name)
        if not remaining:
            raise ValueError(
                f"{adapter_name!r} is the only adapter; a PeftModel keeps at least one. "
                "Use `unload()` for the base model."
            )
        active = self.active_adapter if self.active_adapter != adapter_name else remaining[0][0]

        def drop(s: AdapterSet) -> Any:
            kept = {n: a for n, a in s.adapters.items() if n != adapter_name}
            return AdapterSet(s.weight, kept, None, (active,)) if kept else s.weight

        model = _map_sets(self, drop)
        saved = {n: c for n, c in self.saved_modules.items() if n != adapter_name}
        return dataclasses.replace(
            model, saved_modules=saved, configs=remaining, active_adapter=active
        )

    def add_weighted_adapter(
        self,
        adapters: Sequence[str],
        weights: Sequence[float],
        adapter_name: str,
        combination_type: CombinationType | None = None,
        svd_rank: int | None = None,
    ) -> "PeftModel":
        """A model with a new adapter combining `adapters` with `weights`, as HF PEFT does.

        LoRA: `"linear"` (equal ranks; weighted sums of the factors, a rough approximation),
        `"cat"` (factors stacked: exactly `Σ w_k ΔW_k`, rank `Σ r_k`), `"svd"` (the
        default: the top `svd_rank` singular triplets of `Σ w_k ΔW_k`; default rank the
        largest `r`). IA3: `"linear"` (the default), the weighted sum of the scales. The new
        adapter is not activated.
        """
        self._check_new_name(adapter_name)
        self._known(tuple(adapters))
        if len(adapters) != len(weights) or not adapters:
            raise ValueError(
                f"add_weighted_adapter needs one weight per adapter, got {len(adapters)} "
                f"adapters and {len(weights)} weights."
            )
        configs = [self.peft_config[a] for a in adapters]
        shared = [
            p
            for p in {p for a in adapters for p in self.saved_modules.get(a, {})}
            if sum(p in self.saved_modules.get(a, {}) for a in set(adapters)) > 1
        ]
        if shared:
            raise ValueError(
                f"the adapters {list(adapters)} each have their own copy of {sorted(shared)} "
                "(modules_to_save), which cannot be combined (PEFT's rule)."
            )
        kind = configs[0]
        if not kind.combination_types:
            raise ValueError(f"{kind.peft_type} adapters cannot be combined.")
        if combination_type is None:
            combination_type = kind.combination_types[0]
        combination_type = "linear" if len(adapters) == 1 else combination_type
        config = kind.combined(configs, list(adapters), combination_type, svd_rank)

        def combine(s: AdapterSet) -> AdapterSet:
            present = [(s.adapter(a), w) for a, w in zip(adapters, weights) if a in s.adapters]
            if not present:
                return s
            new = type(present[0][0]).weighted(present, combination_type, config)
            return AdapterSet(s.weight, {**s.adapters, adapter_name: detach(new)}, s.gate, s.active)

        model = _map_sets(self, combine)
        # like PEFT, the new adapter's modules_to_save start again from the originals
        originals = self.disable_adapters()
        saved = {**self.saved_modules, **_saved_copies(originals, config, adapter_name)}
        return dataclasses.replace(
            model, saved_modules=saved, configs=(*self.configs, (adapter_name, config))
        )

    # -- leaving PEFT -------------------------------------------------------------------

    def merge_and_unload(
        self, adapter_names: Sequence[str] | None = None, *, safe_merge: bool = False
    ) -> Any:
        """The base model's own class with adapters merged into dense weights (default:
        the active adapter). Several names are merged one after the other, each onto the
        weight the previous ones left, as PEFT does (so IA3 scales multiply and a DoRA
        norm is taken of the weight it is merged into). The active adapter's
        `modules_to_save` copies take the place of the originals, as in PEFT.

        `safe_merge`: raise `ValueError` naming the layer (and the adapter) if a merged
        weight or bias holds NaN or infinity, as PEFT's `safe_merge` does; it reads the
        values, so call it outside `jax.jit`.
        """
        names = self._known(
            (self.active_adapter,) if adapter_names is None else tuple(adapter_names)
        )

        def merged(path: str, layer: Any) -> Any:
            s = layer.weight
            layer = eqx.tree_at(lambda m: m.weight, layer, s.weight)
            for name in names:
                if name not in s.adapters:
                    continue
                one = AdapterSet(layer.weight, {name: s.adapters[name]}, None, (name,))
                layer = _scale_bias(eqx.tree_at(lambda m: m.weight, layer, one))
                layer = eqx.tree_at(lambda m: m.weight, layer, merge(one))
                if safe_merge:
                    _check_finite(layer, path, name)
            return layer

        merged_model = jax.tree_util.tree_map_with_path(
            lambda keypath, x: merged(dotted(keypath), x) if _is_adapted_layer(x) else x,
            self.base_model,
            is_leaf=_is_adapted_layer,
        )

        def merged_stack(path: str, s: AdapterSet) -> Any:
            # what is left: expert stacks (`target_parameters`), merged the same way
            weight = s.weight
            for name in names:
                if name in s.adapters:
                    weight = merge(AdapterSet(weight, {name: s.adapters[name]}, None, (name,)))
                    if safe_merge and not bool(jnp.all(jnp.isfinite(weight))):
                        raise ValueError(
                            f"merging adapter {name!r} into {path} gives NaN or infinite "
                            "values: the adapter is broken, so nothing was merged."
                        )
            return weight

        merged_model = jax.tree_util.tree_map_with_path(
            lambda keypath, x: merged_stack(dotted(keypath), x) if _is_set(x) else x,
            merged_model,
            is_leaf=_is_set,
        )
        return self._with_saved(merged_model, (self.active_adapter,), None)

    def unload(self) -> Any:
        """The base model without adapter layers, unmerged: the original weights, and the
        active adapter's `modules_to_save` copies in place (PEFT's `unload`)."""
        return self._with_saved(self.disable_adapters(), (self.active_adapter,), None)

    def disable_adapters(self) -> Any:
        """The base model as it was before any adapter: original weights and modules
        (what PEFT's `disable_adapter()` block runs), PiSSA's residual where its init
        replaced a weight, as in PEFT."""
        return _map_sets(self.base_model, lambda s: s.weight)

    # -- internals ----------------------------------------------------------------------

    def _known(self, names: tuple[str, ...]) -> tuple[str, ...]:
        for name in names:
            if name not in self.adapter_names:
                raise self._unknown(name)
        return names

    def _unknown(self, name: Any, *extra: str) -> UnknownAdapterError:
        return unknown_adapter(name, (*self.adapter_names, *extra), "model")

    def _check_new_name(self, name: str) -> None:
        if name in self.adapter_names:
            raise ValueError(
                f"an adapter named {name!r} exists already (adapters: "
                f"{', '.join(map(repr, self.adapter_names))}); choose another name or "
                "`delete_adapter` it first."
            )
        if name == BASE or not name:
            raise ValueError(f"{name!r} cannot name an adapter; {BASE!r} means the base model.")

    def _add(
        self, adapter_name: str, config: Any, key: PRNGKeyArray, model_type: str | None
    ) -> "PeftModel":
        self._check_new_name(adapter_name)
        if self.configs and config.peft_type != self.peft_type:
            raise ValueError(
                f"this model's adapters are {self.peft_type}; a {config.peft_type} adapter "
                "cannot join them (as in PEFT). Start from the base model (`unload()`)."
            )
        config = with_model_names(config, self.base_model, model_type)
        split, parameters = parameter_targets(self.base_model, config)
        found = targets(split, with_classifier(config), model_type=model_type)
        config = found.config
        if config.base_model_name_or_path is None:
            # PEFT's record of the base model, which `AutoPeftModel` loads the adapter on
            path = name_or_path_of(self.base_model)
            config = dataclasses.replace(config, base_model_name_or_path=path)
        if config.fan_in_fan_out and not all(
            t.transposed for t in found.layers if isinstance(t.layer, eqx.nn.Linear)
        ):
            # PEFT's rule for torch.nn.Linear targets, whose weights are (out, in) like
            # ours; GPT-2's Conv1D weights are transposed on loading, so the flag holds
            warnings.warn(
                "fan_in_fan_out=True, but eqx.nn.Linear, Conv and Embedding weights are stored "
                "(out, in); it is ignored (as PEFT ignores it for torch.nn.Linear).",
                UserWarning,
                stacklevel=3,
            )
        keys = jax.random.split(key, len(found.layers) + len(parameters))
        active = self.active_adapter if self.configs else adapter_name
        placed = []
        for target, k in zip(config.planned(found.layers), keys):
            current = target.layer.weight
            base = current.weight if _is_set(current) else current
            built = _stacked(config, target, base, k)
            if config.changes_base:
                base = built.weight
            adapter = detach(built)
            adapter = placed_like(adapter, base, _stack_axes(target.layer, base))
            if _is_set(current):
                s = AdapterSet(base, {**current.adapters, adapter_name: adapter}, None, (active,))
            else:
                s = AdapterSet(base, {adapter_name: adapter}, None, (active,))
            placed.append(eqx.tree_at(lambda m: m.weight, target.layer, s))
        # on the model with its stacks split where the chosen modules change
        model = eqx.tree_at(found.where_fn(), found.model, placed) if placed else found.model
        model = _with_expert_adapters(
            model, config, parameters, keys[len(found.layers) :], adapter_name, active
        )
        return PeftModel(
            model,
            {**self.saved_modules, **_saved_copies(found.model, config, adapter_name)},
            (*self.configs, (adapter_name, config)),
            active,
        )


CLASSIFIER_NAMES = ("classifier", "score")


def with_classifier(config: AbstractAdapterConfig) -> AbstractAdapterConfig:
    """PEFT's rule for `task_type="SEQ_CLS"`: the classification head (`classifier` or
    `score`, whichever the model has) joins `modules_to_save`, so it trains and is saved."""
    if config.task_type != "SEQ_CLS":
        return config
    names = list(config.modules_to_save or ())
    names += [n for n in CLASSIFIER_NAMES if n not in names]
    return dataclasses.replace(config, modules_to_save=names)


def _saved_copies(model: Any, config: Any, adapter_name: str) -> dict[str, dict[str, Any]]:
    """`{adapter_name: {path: module}}` for the modules of `config.modules_to_save`: the
    adapter's own copies, starting as the original modules (PEFT's `ModulesToSaveWrapper`)."""
    if not config.modules_to_save:
        return {}
    names = list(config.modules_to_save)
    chosen = require_matches(
        select(model).at(~of_type(jax.Array)), peft_targets(names), wanted=names
    )
    return {adapter_name: dict(zip(chosen.paths(), chosen.get()))}


def partition(
    model: PeftModel | PeftBankModel, adapters: Sequence[str] | None = None
) -> tuple[Any, Any]:
    """`(trainable, frozen)` halves of a `PeftModel`, for `eqx.combine` inside a loss.

    `adapters` names the adapters that train (default: the active one); name several to
    train them together in mixed batches. A `PeftBankModel`'s halves hold every slot's
    factors, and mark the slots of `adapters` as the ones that train (`trained_slots`):
    `peftx.train.keep_untrained_slots` keeps the others as they were after an update.
    """
    if isinstance(model, PeftBankModel):
        model = model.with_trained(adapters)
    return eqx.partition(model, model.trainable_spec(adapters))


def get_peft_model(
    model: Any,
    config: Any,
    *,
    key: PRNGKeyArray,
    adapter_name: str = "default",
    model_type: str | None = None,
    max_adapters: int | None = None,
    max_rank: int | None = None,
) -> PeftModel | PeftBankModel:
    """Place the adapter a PEFT config describes on an Equinox model.

    **Arguments:**

    - `model`: any Equinox model (targets are found by dotted path, e.g.
      `layers.3.self_attn.q_proj`, see `peftx.select`).
    - `config`: a `LoraConfig` or `IA3Config`. With `target_modules=None`, PEFT's default
      for the architecture applies (`model_type`, or `model.config.model_type`). With
      `base_model_name_or_path=None`, the directory the model was loaded from
      (`model.config.name_or_path`) is recorded there, as PEFT does, so that
      `peft.AutoPeftModelForCausalLM` finds the base of the saved adapter.
    - `key`: PRNG key for the adapter's initialization.
    - `adapter_name`: the adapter's name (more can be added with `add_adapter`).
    - `model_type`: the transformers model type, for default targets.
    - `max_adapters`: make a `PeftBankModel` of this many LoRA slots instead, the adapter
      in the first; more come and go with `add_adapter`, `load_adapter` and
      `delete_adapter` without a recompile.
    - `max_rank`: the bank's rank (default: the adapter's `r`); adapters of lower rank
      are padded with zeros.

    **Returns:**

    A `PeftModel`; train it with `partition(peft_model)` and optax.
    """
    if isinstance(model, PeftModel):
        raise TypeError(
            "model is a PeftModel already; add another adapter with "
            "`peft_model.add_adapter(name, config, key=...)`."
        )
    one = PeftModel(model, {}, (), adapter_name)._add(adapter_name, config, key, model_type)
    if max_adapters is None:
        return one
    return bank_from(one, max_adapters, max_rank, get_peft_model, PeftModel.from_pretrained)


def _with_expert_adapters(
    model: Any,
    config: Any,
    parameters: Sequence[AdaptedParameter],
    keys: Array,
    adapter_name: str,
    active: str,
) -> Any:
    """`model` with adapter `adapter_name` on each expert stack of `parameters` (an
    `AdapterSet` in the stack's field, as a layer's weight gets one)."""
    if not parameters:
        return model
    owners = select(model).at(Predicate(lambda p, n: p in {t.path for t in parameters}, "owners"))
    where = owners.where_fn()
    modules = dict(zip(owners.paths(), owners.get()))
    for target, key in zip(parameters, keys):
        current = getattr(modules[target.path], target.name)
        base = current.weight if _is_set(current) else current
        stack = len(base.shape) - 3

        def build(b: Any, k: PRNGKeyArray, target: AdaptedParameter = target) -> Any:
            return config.build_experts(b, target, key=k)

        for _ in range(stack):
            build = eqx.filter_vmap(build)
        adapter = detach(build(base, jax.random.split(key, base.shape[:stack]) if stack else key))
        adapter = placed_like(adapter, base, stack)
        adapters = (
            {**current.adapters, adapter_name: adapter}
            if _is_set(current)
            else {adapter_name: adapter}
        )
        s = AdapterSet(base, adapters, None, (active,))
        modules[target.path] = eqx.tree_at(
            lambda m, name=target.name: getattr(m, name), modules[target.path], s
        )
    return eqx.tree_at(where, model, [modules[p] for p in owners.paths()])


def _stack_axes(layer: Any, weight: Any) -> int:
    """The leading layer axes of `layer`'s `weight` (layers stacked by `eqx.filter_vmap`)."""
    kernel_ndim = layer.num_spatial_dims if isinstance(layer, eqx.nn.Conv) else 0
    return len(weight.shape) - 2 - kernel_ndim


def _stacked(config: Any, target: AdaptedLayer, base: Any, key: PRNGKeyArray) -> Any:
    """The adapter on `target`: `config.build` on a layer, `config.build_stacked` on a
    stack of layers (made with `eqx.filter_vmap`, their weights with leading axes)."""
    stack = _stack_axes(target.layer, base)
    if stack == 0:
        return config.build(base, target, key=key)
    return config.build_stacked(base, target, key=key, stack=stack)


def _check_finite(layer: Any, path: str, adapter_name: str) -> None:
    """Raise if the merged weight or bias of `layer` (at `path`) holds NaN or infinity,
    naming the first such layer of a stack by its own path."""
    kernel_ndim = layer.num_spatial_dims if isinstance(layer, eqx.nn.Conv) else 0
    paths = layer_paths(path)
    for array in (layer.weight, getattr(layer, "bias", None)):
        if array is None:
            continue
        lead = array.ndim - (2 + kernel_ndim if array is layer.weight else 1)
        finite = np.asarray(jnp.isfinite(array).reshape(*array.shape[:lead], -1).all(-1))
        bad = np.flatnonzero(~finite.reshape(-1))
        if bad.size:
            where = paths[bad[0]] if len(paths) == finite.size else path
            raise ValueError(
                f"merging adapter {adapter_name!r} into {where} gives NaN or infinite values: "
                "the adapter is broken (a diverged training run?), so nothing was merged."
            )


def _gated(layer: Any, gate: Array, active: tuple[str, ...]) -> Any:
    """`layer` with `gate` on its adapters (see `_gated_stack`)."""
    kernel_ndim = layer.num_spatial_dims if isinstance(layer, eqx.nn.Conv) else 0
    s = _gated_stack(layer.weight, gate, active, 2 + kernel_ndim)
    return eqx.tree_at(lambda m: m.weight, layer, s)


def _gated_stack(s: AdapterSet, gate: Array, active: tuple[str, ...], ndim: int) -> AdapterSet:
    """`s` with `gate` on its adapters; a stack of `ndim`-axis weights (leading layer axes,
    scanned by `run_layers`) gets the gate repeated along those axes, so each layer's slice
    holds the whole gate."""
    stacked = s.weight.shape[: len(s.weight.shape) - ndim]
    return AdapterSet(s.weight, s.adapters, jnp.broadcast_to(gate, (*stacked, *gate.shape)), active)


def _for_layers(s: AdapterSet) -> AdapterSet:
    """`s` with each adapter as its stack's layers read it (`for_layers`: arrays that
    layers share spread to one row per layer)."""
    adapters = {
        name: a.for_layers() if isinstance(a, AbstractAdapter) else a
        for name, a in s.adapters.items()
    }
    if all(a is s.adapters[name] for name, a in adapters.items()):
        return s
    return AdapterSet(s.weight, adapters, s.gate, s.active)


def _scale_bias(layer: Any) -> Any:
    """`layer` with its bias scaled as its active adapters ask (`bias_scale`: IA3 on the
    output features, as PEFT scales the whole output of the layer, bias included)."""
    s = layer.weight
    if getattr(layer, "bias", None) is None:
        return layer
    scaled = [(k, scale) for k, n in s.used() if (scale := s.adapters[n].bias_scale()) is not None]
    if not scaled:
        return layer
    if s.gate is not None and s.gate.ndim > 1:
        raise ValueError(
            "IA3 on a layer with a bias cannot route a batch-wide gate: the bias is added "
            "per example. Call the model under your own `jax.vmap` with one adapter id per "
            "example (`adapter_ids`)."
        )
    bias = layer.bias
    factor = jnp.ones(bias.shape, bias.dtype)
    for k, scale in scaled:
        g = 1.0 if s.gate is None else s.gate[k].astype(bias.dtype)
        factor = factor + g * (scale.astype(bias.dtype) - 1)
    return eqx.tree_at(lambda m: m.bias, layer, bias * factor)
