"""Adapters on disk in HF PEFT's format: `adapter_config.json` beside
`adapter_model.safetensors`, keyed `base_model.model.<module path>.<PEFT tensor name>`, so a
file moves between peftx and PyTorch PEFT in both directions."""

import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
import safetensors.numpy

from ._config import CONFIG_NAME, load_config
from ._errors import CheckpointError, TargetNotFoundError, listing
from ._files import replaced_directory
from ._model_card import CARD_NAME, Sections, card_text, writes_card
from ._select import Predicate, Selection, dotted, node_at, select
from ._targets import (
    expert_fields,
    layer_paths,
    model_type_of,
    name_or_path_of,
    stored_transposed,
)
from .adapters import AbstractAdapter, AdapterSet
from .models import (
    ARCHITECTURES,
    Architecture,
    is_transposed,
    key_mapper,
    read_tensors,
)
from .sharding import spread_over_processes, to_host, wait_for_writer, writes_files

WEIGHTS_NAME = "adapter_model.safetensors"
TORCH_WEIGHTS_NAME = "adapter_model.bin"
PREFIX = "base_model.model."

# PEFT's `EMBEDDING_LAYER_NAMES`: naming one of these in `target_modules` makes PEFT save the
# base weight of the adapted input and output embeddings beside the adapter.
_EMBEDDING_TARGETS = ("embed_tokens", "lm_head")
# The input and output embeddings of the zoo's architectures (transformers'
# `get_input_embeddings()` and `get_output_embeddings()`).
_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings", "lm_head")
# PEFT condenses a list of this many target names or more to the shortest suffixes that
# select the same modules (`MIN_TARGET_MODULES_FOR_OPTIMIZATION`).
_CONDENSE_FROM = 20


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One array of the adapter and the file keys of its layers: one key, or for a
    `LayerStack` segment one per layer, along the array's leading axis."""

    keys: tuple[str, ...]
    keypath: tuple  # where the array lies in the PeftModel
    value: Any
    stacked: bool
    transposed: bool  # stored transposed in the file (GPT-2's Conv1D)
    # PEFT's embedding weights (`save_embedding_layers`), None for the adapter's own
    # tensors. When `target_modules` names `embed_tokens` or `lm_head`, the base weight of
    # an adapted embedding is "targeted" (written unless False) and other embeddings are
    # "unadapted" (never written). Otherwise every input and output embedding is
    # "untargeted" (written when True, as for a resized vocabulary). All are read when
    # present, and replace the base model's weights, as in PEFT.
    embedding: str | None = None
    # an array every layer of the adapter holds alike (`shared_keys`), saved once under
    # `base_model.` rather than under each layer's module path
    shared: bool = False
    # the axis of a field whose file holds only the ranks its config keeps (AdaLoRA's
    # `rank_pattern`), and those ranks for each key (None: all of them)
    rank_axis: int | None = None
    kept: tuple[tuple[int, ...] | None, ...] = ()
    # the row of a stacked array each key holds, where layers share rows (Lily's
    # `layer_rows`); None: one row per key
    rows: tuple[int, ...] | None = None

    def file_key(self, key: str) -> str:
        return ("base_model." if self.shared else PREFIX) + key

    @property
    def layer_shape(self) -> tuple[int, ...]:
        shape = tuple(self.value.shape)
        return shape[1:] if self.stacked else shape

    def kept_of(self, i: int) -> tuple[int, ...] | None:
        """The ranks the file holds for the `i`-th key (None: all)."""
        return self.kept[i] if self.rank_axis is not None else None

    def file_shape(self, i: int) -> tuple[int, ...]:
        """The shape the file stores for the `i`-th key, before any transpose."""
        shape = list(self.layer_shape)
        kept = self.kept_of(i)
        if kept is not None:
            shape[self.rank_axis] = len(kept)
        return tuple(shape)

    def to_file(self, i: int, row: np.ndarray) -> np.ndarray:
        kept = self.kept_of(i)
        return row if kept is None else np.take(row, kept, axis=self.rank_axis)

    def from_file(self, i: int, row: np.ndarray) -> np.ndarray:
        """The layer's array from the file's, its pruned ranks zeros (as PEFT's masked
        ranks are)."""
        kept = self.kept_of(i)
        if kept is None:
            return row
        full = np.zeros(self.layer_shape, row.dtype)
        index: list[Any] = [slice(None)] * row.ndim
        index[self.rank_axis] = list(kept)
        full[tuple(index)] = row
        return full


def _arch(model: Any) -> Architecture | None:
    return ARCHITECTURES.get(model_type_of(model) or "")


def _adapted(peft_model: Any, name: str) -> Selection:
    """The layers carrying adapter `name`, selected on the whole PeftModel."""
    return select(peft_model).at(
        Predicate(
            lambda p, n: (
                p.startswith("base_model.")
                and isinstance(getattr(n, "weight", None), AdapterSet)
                and name in n.weight.adapters
            ),
            f"layers with adapter {name!r}",
        )
    )


def adapted_layer_paths(peft_model: Any, name: str) -> list[str]:
    """The module path of each layer carrying adapter `name` (a stack's layers one by
    one), as PEFT's keys name them, in tree order."""
    return [
        q
        for p in _adapted(peft_model, name).paths()
        for q in layer_paths(p.removeprefix("base_model."))
    ]


def _tensors(peft_model: Any, name: str) -> list[_Tensor]:
    """Every array that adapter `name` saves, with its PEFT keys (without `PREFIX`) and
    its key path in `peft_model`."""
    arch = _arch(peft_model.base_model)
    config = peft_model.peft_config[name]
    out: list[_Tensor] = []

    def add(
        owner: tuple,
        suffix: str,
        below: tuple,
        value: Any,
        embedding: str | None = None,
        flip: bool | None = None,
        shared: bool = False,
        rank_axis: int | None = None,
        rows: tuple[int, ...] | None = None,
    ) -> None:
        """The tensor at key path `owner + below` of the PeftModel, saved under the module
        path `owner` names (`suffix` after it; a `shared` one has the key `suffix` for
        every layer); `flip` says whether the file stores it transposed (by default, as
        the architecture's checkpoints store a base layer's weight); along `rank_axis`,
        the file holds the ranks the config keeps."""
        path = _module_path(owner)
        paths = layer_paths(path)
        keys = tuple(suffix if shared else f"{p}.{suffix}" for p in paths)
        if flip is None:
            flip = arch is not None and is_transposed(arch, keys[0])
        kept = tuple(config.kept_ranks(p) for p in paths) if rank_axis is not None else ()
        out.append(
            _Tensor(
                keys,
                owner + below,
                value,
                paths != [path],
                flip,
                embedding,
                shared,
                rank_axis,
                kept,
                rows,
            )
        )

    embedding_targeted = _embedding_targeted(config, peft_model)
    adapted = _adapted(peft_model, name).matches
    for _, owner, layer in adapted:
        adapter = layer.weight.adapters[name]
        kind = type(adapter)
        in_set = (_ATTR("weight"), _ATTR("adapters"), jtu.DictKey(name))
        for field, key in kind.peft_keys.items():
            if getattr(adapter, field) is None:  # a part this adapter's layout lacks
                continue
            add(
                owner,
                key,
                in_set + (_ATTR(field),),
                getattr(adapter, field),
                flip=field in kind.file_transposed,
                rank_axis=kind.rank_axes.get(field),
                rows=adapter.layer_rows(field),
            )
        for field, key in kind.index_keys.items():
            add(owner, key, in_set + (_ATTR(field),), getattr(adapter, field), flip=False)
        for field, key in kind.shared_keys.items() if config.saves_shared else ():
            add(owner, key, in_set + (_ATTR(field),), getattr(adapter, field), shared=True)
        if getattr(layer, "bias", None) is not None and config.bias != "none":
            add(owner, "base_layer.bias", (_ATTR("bias"),), layer.bias)
        if _module_path(owner).rsplit(".", 1)[-1] in _EMBEDDINGS:
            add(
                owner,
                "base_layer.weight",
                (_ATTR("weight"), _ATTR("weight")),
                layer.weight.weight,
                embedding="targeted" if embedding_targeted else "untargeted",
            )
    for _, owner, node in _adapted_stacks(peft_model, name).matches:
        fields = [f for f in expert_fields(node) if _carries(getattr(node, f), name)]
        for depth, field in enumerate(fields):
            # PEFT nests one wrapper per parameter, the first innermost
            nesting = "base_layer." * (len(fields) - 1 - depth)
            adapter = getattr(node, field).adapters[name]
            for attr, key in type(adapter).peft_keys.items():
                add(
                    owner,
                    nesting + key,
                    (_ATTR(field), _ATTR("adapters"), jtu.DictKey(name), _ATTR(attr)),
                    getattr(adapter, attr),
                    flip=False,
                )
    saved = peft_model.saved_modules.get(name, {})
    embeddings = select(peft_model).at(
        Predicate(
            lambda p, n: (
                p.startswith("base_model.")
                and p.rsplit(".", 1)[-1] in _EMBEDDINGS
                and p.removeprefix("base_model.") not in saved
                and isinstance(getattr(n, "weight", None), jax.Array)
            ),
            "embeddings",
        )
    )
    for _, owner, node in embeddings.matches:
        add(
            owner,
            "weight",
            (_ATTR("weight"),),
            node.weight,
            embedding="unadapted" if embedding_targeted else "untargeted",
        )
    if config.bias == "all":
        layer_owners = {owner for _, owner, _ in adapted}
        biased = select(peft_model).at(
            Predicate(
                lambda p, n: (
                    p.startswith("base_model.") and isinstance(getattr(n, "bias", None), jax.Array)
                ),
                "biases",
            )
        )
        for _, owner, node in biased.matches:
            if owner in layer_owners:
                continue
            module = _module_path(owner)
            if module not in saved:
                add(owner, "bias", (_ATTR("bias"),), node.bias)
                continue
            # PEFT's `ModulesToSaveWrapper` holds the original and the copy, both listed
            add(owner, "original_module.bias", (_ATTR("bias"),), node.bias)
            copy = _saved_path(name, module)
            add(copy, "modules_to_save.bias", (_ATTR("bias"),), saved[module].bias)
    for module, copy in saved.items():
        for below, leaf in jtu.tree_flatten_with_path(copy)[0]:
            if eqx.is_inexact_array(leaf):
                add(_saved_path(name, module), dotted(below), tuple(below), leaf)
    return out


_ATTR = jtu.GetAttrKey


def _module_path(keypath: tuple) -> str:
    """The module path PEFT's keys use for the node at `keypath` of a PeftModel: its
    dotted path below `base_model`, or for a saved module's copy the path it copies."""
    if keypath[:1] == (_ATTR("saved_modules"),):
        return keypath[2].key
    return dotted(keypath).removeprefix("base_model.")


def _saved_path(name: str, module: str) -> tuple:
    """The key path of adapter `name`'s own copy of `module` (`modules_to_save`)."""
    return (_ATTR("saved_modules"), jtu.DictKey(name), jtu.DictKey(module))


def _carries(x: Any, name: str) -> bool:
    return isinstance(x, AdapterSet) and name in x.adapters


def _adapted_stacks(peft_model: Any, name: str) -> Selection:
    """The modules holding expert stacks that carry adapter `name` (`target_parameters`)."""
    return select(peft_model).at(
        Predicate(
            lambda p, n: (
                p.startswith("base_model.")
                and any(_carries(getattr(n, f), name) for f in expert_fields(n))
            ),
            f"expert stacks with adapter {name!r}",
        )
    )


def _embedding_targeted(config: Any, peft_model: Any) -> bool:
    """PEFT's test for saving the base weights of adapted embeddings
    (`save_embedding_layers="auto"`)."""
    target = config.target_modules
    if isinstance(target, str) and target != "all-linear":
        names = select(peft_model.base_model).paths()
        return any(
            re.fullmatch(target, q)
            for p in names
            if p.rsplit(".", 1)[-1] in _EMBEDDING_TARGETS
            for q in layer_paths(p)
        )
    if isinstance(target, tuple):
        return any(t in _EMBEDDING_TARGETS for t in target)
    return False


# -- saving ---------------------------------------------------------------------------------


def save_adapters(
    peft_model: Any,
    directory: str | os.PathLike[str],
    selected_adapters: Sequence[str] | None = None,
    save_embedding_layers: bool | str = "auto",
    initial: str | os.PathLike[str] | None = None,
    card: Sections | None = None,
) -> None:
    """`PeftModel.save_pretrained`; see there (`initial`: its
    `path_initial_model_for_weight_conversion`, `card`: its `model_card`)."""
    if save_embedding_layers not in (True, False, "auto"):
        raise ValueError(
            f"save_embedding_layers must be True, False or 'auto'; got {save_embedding_layers!r}."
        )
    names = peft_model._known(
        peft_model.adapter_names if selected_adapters is None else tuple(selected_adapters)
    )
    directory = pathlib.Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(
            f"{str(directory)!r} is a file; save_pretrained takes a directory to write into."
        )
    # (adapter name, weights, config as saved)
    planned: list[tuple[str, dict[str, np.ndarray], dict[str, Any]]] = []
    spread = False  # whether a saved array lies partly on other processes' devices
    for name in names:
        if name != "default" and (
            name in (".", "..") or any(sep in name for sep in ("/", "\\", os.sep))
        ):
            raise ValueError(
                f"adapter {name!r} would be saved outside {str(directory)!r}: a non-default "
                "adapter goes in a subfolder named after it, so its name cannot be '.', "
                "'..' or hold a path separator. Rename it (add it under another name)."
            )
        tensors = _tensors(peft_model, name)
        arrays = {}
        for t in tensors:
            if t.embedding == "unadapted":
                continue
            if t.embedding == "untargeted" and save_embedding_layers is not True:
                continue
            if t.embedding == "targeted" and save_embedding_layers is False:
                continue
            spread = spread or spread_over_processes(t.value)
            value = to_host(t.value)
            rows = value if t.stacked else [value]
            if t.rows is not None:  # a row shared by several layers, under each one's key
                rows = [value[j] for j in t.rows]
            for i, (key, row) in enumerate(zip(t.keys, rows, strict=True)):
                row = t.to_file(i, np.asarray(row))
                arrays[t.file_key(key)] = np.ascontiguousarray(row.T if t.transposed else row)
        saved = _saved_config(peft_model, name)
        if initial is not None:
            arrays, saved = _converted(arrays, saved, pathlib.Path(initial), name)
        planned.append((name, arrays, saved))
    if writes_files():  # of several processes, process 0
        size = sum(a.nbytes for _, arrays, _ in planned for a in arrays.values())
        configs = {name: saved for name, _, saved in planned}
        card_file = card_text(configs, card) if writes_card(directory) else None
        with replaced_directory(directory, size=size) as tmp:
            for name, arrays, saved in planned:
                folder = tmp if name == "default" else tmp / name
                folder.mkdir(exist_ok=True)
                safetensors.numpy.save_file(
                    arrays, str(folder / WEIGHTS_NAME), metadata={"format": "pt"}
                )
                text = json.dumps(saved, indent=2, sort_keys=True) + "\n"
                (folder / CONFIG_NAME).write_text(text, encoding="utf-8")
            if card_file is not None:  # part of the save, replaced with it
                (tmp / CARD_NAME).write_text(card_file, encoding="utf-8")
    wait_for_writer(f"peftx save_pretrained {directory}", spread)


def _converted(
    arrays: dict[str, np.ndarray], config: dict[str, Any], initial: pathlib.Path, name: str
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Adapter `name`'s file and config as PEFT's `path_initial_model_for_weight_conversion`
    writes them: a plain LoRA of rank `2r`, `[A; A₀]` and `[B, −B₀]` with the factors of
    the initial adapter in `initial`, at the same scaling."""
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("modules_to_save"):
        raise ValueError(
            f"path_initial_model_for_weight_conversion converts a LoRA adapter (PiSSA) "
            f"without DoRA or modules_to_save into a plain LoRA; adapter {name!r} is not one."
        )
    if config["use_rslora"] and (config.get("rank_pattern") or config.get("alpha_pattern")):
        raise ValueError(
            "path_initial_model_for_weight_conversion does not support use_rslora with "
            f"rank_pattern or alpha_pattern (as in PEFT); adapter {name!r} has both."
        )
    if config.get("init_lora_weights") == "loftq":
        raise ValueError(
            f"adapter {name!r} was initialized by LoftQ, whose base is the NF4 of W less the "
            "initial factors, not W less them: the difference of the factors would not give the "
            "trained model on the original base, so it cannot be converted (PEFT converts "
            "PiSSA, CorDA, OLoRA and LoRA-GA only). Save it without "
            "path_initial_model_for_weight_conversion and ship the quantized base with it."
        )
    start = load_config(initial)
    if getattr(start, "init_lora_weights", True) is not True:
        raise ValueError(
            f"the initial adapter in {initial} says init_lora_weights="
            f"{start.init_lora_weights!r}; save it with init_lora_weights=True (as PEFT "
            "requires), so that its factors are read as they are."
        )
    factors = read_tensors(initial / WEIGHTS_NAME)
    converted = {}
    for key, value in arrays.items():
        axis = 0 if ".lora_A." in key else 1 if ".lora_B." in key else None
        if axis is None:
            raise ValueError(
                f"path_initial_model_for_weight_conversion writes lora_A and lora_B only (as "
                f"PEFT does); adapter {name!r} also holds {key}, which would be lost."
            )
        first = factors.get(key)
        if first is None or first.shape != value.shape:
            found = "no such tensor" if first is None else f"shape {first.shape}"
            raise CheckpointError(
                f"{initial / WEIGHTS_NAME} has {found} for {key}, which adapter {name!r} "
                f"holds with shape {value.shape}: it is not this adapter's initial state."
            )
        first = first.astype(value.dtype)
        converted[key] = np.concatenate([value, first if axis == 0 else -first], axis=axis)
    factor = 2**0.5 if config["use_rslora"] else 2
    config = {
        **config,
        "init_lora_weights": True,
        "r": 2 * config["r"],
        "lora_alpha": factor * config["lora_alpha"],
        "rank_pattern": {k: 2 * v for k, v in (config.get("rank_pattern") or {}).items()},
        "alpha_pattern": {k: 2 * v for k, v in (config.get("alpha_pattern") or {}).items()},
    }
    return converted, config


def _saved_config(peft_model: Any, name: str) -> dict[str, Any]:
    """The config as PEFT writes it after injecting the adapter: `"all-linear"` (and a
    predicate) expanded to the adapted modules' names, a long list condensed to suffixes,
    `fan_in_fan_out` set for transposed (Conv1D) targets, `inference_mode` true; the
    kind's own changes are its config's (`as_saved`)."""
    config = peft_model.peft_config[name]
    base = peft_model.disable_adapters()
    arch = _arch(base)
    layers = _adapted(peft_model, name)
    placed = sorted(
        (
            (q, layer.weight.adapters[name])
            for p, layer in zip(layers.paths(), layers.get())
            for q in layer_paths(p.removeprefix("base_model."))
        ),
        key=lambda pair: pair[0],
    )
    adapted = [path for path, _ in placed]
    changes: dict[str, Any] = {"inference_mode": True, **config.as_saved(placed)}
    target = changes.get("target_modules", config.target_modules)
    if isinstance(target, tuple) and len(target) >= _CONDENSE_FROM and config.condense_targets:
        others = {q for p in select(base).paths() for q in layer_paths(p) if q not in set(target)}
        others = {o for o in others if not any(o.endswith("." + t) for t in target)}
        changes["target_modules"] = tuple(sorted(_condensed(target, others)))
    if any(stored_transposed(base, p) for p in adapted):
        changes["fan_in_fan_out"] = True
    data = dataclasses.replace(config, **changes).to_dict()
    if isinstance(data.get("target_modules"), list):
        data["target_modules"] = sorted(data["target_modules"])
    if arch is not None and config.task_type is None:
        model_type = model_type_of(base)
        cls = next((n for n, c in arch.classes.items() if c is type(base)), None)
        if cls is not None:
            data["auto_mapping"] = {
                "base_model_class": cls,
                "parent_library": f"transformers.models.{model_type}.modeling_{model_type}",
            }
    return data


def _condensed(targets: Sequence[str], others: set[str]) -> set[str]:
    """The shortest dotted suffixes that match every name of `targets` and no name of
    `others` (PEFT's condensed `target_modules`)."""
    taken = {".".join(o.split(".")[i:]) for o in others for i in range(len(o.split(".")))}
    chosen: set[str] = set()
    for name in sorted(targets, key=lambda t: t.split(".")[::-1]):
        if any(name == c or name.endswith("." + c) for c in chosen):
            continue
        parts = name.split(".")
        for i in range(len(parts) - 1, -1, -1):
            suffix = ".".join(parts[i:])
            if suffix not in taken:
                chosen.add(suffix)
                break
        else:
            chosen.add(name)
    return chosen


# -- loading --------------------------------------------------------------------------------


def load_adapter_into(
    peft_model: Any,
    directory: str | os.PathLike[str],
    adapter_name: str,
    is_trainable: bool,
    model_type: str | None,
) -> Any:
    """`peft_model` (possibly without adapters yet) with the adapter in `directory` added
    as `adapter_name`; see `PeftModel.load_adapter`."""
    peft_model._check_new_name(adapter_name)
    folder = _adapter_folder(pathlib.Path(directory), adapter_name)
    config = load_config(folder).for_reading()
    config = dataclasses.replace(config, inference_mode=not is_trainable)
    file = folder / WEIGHTS_NAME
    if not file.is_file() and (folder / TORCH_WEIGHTS_NAME).is_file():
        file = folder / TORCH_WEIGHTS_NAME
    if not file.is_file():
        found = sorted(p.name for p in folder.iterdir())
        raise CheckpointError(
            f"{folder} has {CONFIG_NAME} but no {WEIGHTS_NAME} (it holds {found})."
        )
    stored = read_tensors(file)
    _check_floating(stored, file)
    base = peft_model.disable_adapters()
    origin = _origin(config, base)
    _check_belongs(stored, base, folder, origin)
    # an init that changes the base (PiSSA) runs, as in PEFT's `from_pretrained`: the
    # file's factors apply to the residual it leaves
    try:
        skeleton = peft_model._add(adapter_name, config, jax.random.key(0), model_type)
    except TargetNotFoundError:
        raise CheckpointError(
            f"{folder / CONFIG_NAME} does not fit this model: its target_modules "
            f"{config.target_modules!r} match no module of this {type(base).__name__}, "
            f"though {file.name} holds weights for modules it has. {origin}"
        ) from None
    tensors = _tensors(skeleton, adapter_name)
    values = _match(tensors, stored, file, _arch(skeleton.base_model), origin)
    loaded = eqx.tree_at(
        lambda m: [node_at(m, t.keypath) for t, _ in values],
        skeleton,
        [v for _, v in values],
    )
    return loaded


def _check_floating(stored: dict[str, np.ndarray], file: pathlib.Path) -> None:
    """Refuse integer and boolean tensors: every adapter weight is floating, and a cast
    would load whatever the file holds (as the model loader refuses them too). Only an
    index set a kind declares (`index_keys`, SHiRA's `shira_indices`) is integer."""
    indices = tuple("." + name for name in _tensor_names(index=True))
    bad = [
        k
        for k, v in stored.items()
        if not jax.numpy.issubdtype(v.dtype, jax.numpy.floating) and not k.endswith(indices)
    ]
    if bad:
        kinds = sorted({str(stored[k].dtype) for k in bad})
        raise CheckpointError(
            f"{file} stores {listing(sorted(bad), 3)} as {', '.join(kinds)}; adapter weights "
            "are floating tensors, and peftx does not cast integers or booleans to them. Was "
            "the file written for an adapter?"
        )


def _origin(config: Any, base: Any) -> str:
    """A sentence on which base model the adapter was made for and where this model
    came from, for errors that say the two do not fit."""
    made = config.base_model_name_or_path
    here = name_or_path_of(base)
    said = (
        f"The adapter was made for base model {made!r}"
        if made
        else "Its adapter_config.json does not name its base model (base_model_name_or_path "
        "is null)"
    )
    return said + (f"; this model was loaded from {here!r}." if here else ".")


def _tensor_names(index: bool = False) -> list[str]:
    """A key's tensor names after its module path, longest first: those every adapter kind
    defined so far declares (`peft_keys` and `index_keys`, a kind defined outside peftx
    too), and the base layer's own weight and bias that PEFT saves beside them; with
    `index`, the `index_keys` names only."""
    names: set[str] = set() if index else {"base_layer.weight", "base_layer.bias"}
    kinds: list[type] = [AbstractAdapter]
    while kinds:
        kind = kinds.pop()
        kinds.extend(kind.__subclasses__())
        for declared in ("index_keys",) if index else ("peft_keys", "index_keys"):
            keys = getattr(kind, declared, None)
            if isinstance(keys, Mapping):
                names |= set(keys.values())
    return sorted(names, key=len, reverse=True)


def _module_of(key: str, names: list[str]) -> str:
    """The module path a key of an adapter file (without `PREFIX`) belongs to, given the
    tensor names that may end it (`_tensor_names()`)."""
    for name in names:
        suffix = "." + name
        if key.endswith(suffix):
            module = key.removesuffix(suffix)
            while module.endswith(".base_layer"):  # PEFT's nested wrappers of parameters
                module = module.removesuffix(".base_layer")
            return module
    # a `modules_to_save` copy's array, or a bias saved with `bias="all"`
    key = key.replace(".original_module.", ".").replace(".modules_to_save.", ".")
    return key.rsplit(".", 1)[0]


def _check_belongs(
    stored: dict[str, np.ndarray], base: Any, folder: pathlib.Path, origin: str
) -> None:
    """Refuse an adapter most of whose modules this model does not have: one made for
    another architecture. (A few stray keys are left to `_match`, which lists them.)"""
    names = _tensor_names()
    modules = {_module_of(k.removeprefix(PREFIX), names) for k in stored if k.startswith(PREFIX)}
    present = {q for p in select(base).paths() for q in layer_paths(p)}
    arch = _arch(base)
    to_file = key_mapper(arch, present, modules) if arch else lambda k: k
    absent = sorted(modules - {to_file(p) for p in present})
    if 2 * len(absent) > len(modules):
        raise CheckpointError(
            f"the adapter in {folder} does not belong to this model: {len(absent)} of the "
            f"{len(modules)} modules it adapts are not in this {type(base).__name__} "
            f"({listing(absent, 4)}). {origin} Load it on the model it was made for."
        )


def _adapter_folder(directory: pathlib.Path, adapter_name: str) -> pathlib.Path:
    if not directory.is_dir():
        raise FileNotFoundError(f"No adapter directory {str(directory)!r}.")
    if (
        not (directory / CONFIG_NAME).is_file()
        and (directory / adapter_name / CONFIG_NAME).is_file()
    ):
        return directory / adapter_name
    return directory


def _match(
    tensors: list[_Tensor],
    stored: dict[str, np.ndarray],
    file: pathlib.Path,
    arch: Architecture | None,
    origin: str,
) -> list[tuple[_Tensor, Any]]:
    """The value of each tensor from the file's arrays, after checking that the file has
    exactly the keys and shapes the adapter needs."""
    unprefixed = {k.removeprefix(PREFIX): k for k in stored if k.startswith(PREFIX)}
    expected = {k for t in tensors if not t.shared for k in t.keys}
    required = {k for t in tensors if t.embedding is None and not t.shared for k in t.keys}
    to_file = key_mapper(arch, expected, set(unprefixed)) if arch else lambda k: k
    present = {to_file(k) for k in expected} & set(unprefixed)
    missing = sorted(PREFIX + k for k in required if to_file(k) not in unprefixed)
    shared = {t.file_key(k) for t in tensors if t.shared for k in t.keys}
    missing += sorted(shared - set(stored))
    unexpected = sorted(set(stored) - {unprefixed[k] for k in present} - shared)
    if missing or unexpected:
        hint = ""
        if stored and not unprefixed:
            hint = (
                f" None of the file's keys starts with {PREFIX!r}, which PEFT puts before "
                "every module path; PyTorch PEFT would load this file with every adapter "
                "weight left at its initial value."
            )
        raise CheckpointError(
            f"{file} does not fit the adapter its config describes: "
            f"missing keys {listing(missing) or 'none'}; unexpected keys "
            f"{listing(unexpected) or 'none'}.{hint}"
        )
    out = []
    # a shared array is placed once for all the layers that hold it
    placed: dict[tuple[str, ...], Any] = {}
    for t in tensors:
        keys = list(t.keys) if t.shared else [to_file(k) for k in t.keys]
        if t.embedding and keys[0] not in unprefixed:
            continue
        if t.shared and tuple(keys) in placed:
            out.append((t, placed[tuple(keys)]))
            continue
        rows = []
        for i, key in enumerate(keys):
            want = t.file_shape(i)
            file_key = t.file_key(key) if t.shared else unprefixed[key]
            value = stored[file_key]
            value = value.T if t.transposed else value
            if tuple(value.shape) != want:
                owner = "adapter" if t.shared else f"module {key.rsplit('.', 1)[0]!r}"
                raise CheckpointError(
                    f"{file_key!r} in {file} has shape {tuple(value.shape)}, but the "
                    f"{owner} of this model needs {want}"
                    f"{' (transposed from the file)' if t.transposed else ''}. Was the "
                    f"adapter made for another model or config? {origin}"
                )
            rows.append(t.from_file(i, value))
        if t.rows is not None:
            rows = _shared_rows(t, keys, rows, file)
        array = np.stack(rows) if t.stacked else rows[0]
        # placed as the skeleton's array is (split over a mesh, for a sharded model)
        value = jax.device_put(array.astype(t.value.dtype), t.value.sharding)
        if t.shared:
            placed[tuple(keys)] = value
        out.append((t, value))
    return out


def _shared_rows(
    t: _Tensor, keys: list[str], rows: list[np.ndarray], file: pathlib.Path
) -> list[np.ndarray]:
    """The rows of a stacked array whose layers share rows (`t.rows`), from the file's
    value under each layer's key (PEFT writes a shared tensor under every layer that
    holds it); refuses a file whose layers disagree on a row they share."""
    first: dict[int, int] = {}
    for i, j in enumerate(t.rows):
        leader = first.setdefault(j, i)
        if not np.array_equal(rows[i], rows[leader]):
            raise CheckpointError(
                f"{file} holds different values under {PREFIX + keys[leader]!r} and "
                f"{PREFIX + keys[i]!r}, which share one tensor; write the same tensor under "
                "both (as PEFT saves it)."
            )
    return [rows[first[j]] for j in sorted(first)]
