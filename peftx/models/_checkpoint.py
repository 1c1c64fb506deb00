"""HF checkpoints in and out: `config.json` plus safetensors (one file or shards).

A model's array at dotted path `model.layers.0-11.self_attn.q_proj.weight` is the stack
of transformers' tensors `model.layers.{i}.self_attn.q_proj.weight` for i in 0..11; an
unrolled model's paths are transformers' names as they are. Every key, shape and dtype
is checked before anything is allocated; then each array is allocated once, in the
target dtype, and the tensors are read into it one at a time with plain file reads (no
memory map, no torch), cast on the way in small chunks, so the model is never held
twice.
"""

import json
import math
import os
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import ml_dtypes
import numpy as np
import safetensors.numpy
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import SafetensorError, safe_open

from .._dtypes import float_dtype
from .._errors import CheckpointError, ConfigFileError, listing
from .._files import read_json, replaced_directory
from .._select import dotted
from .._spans import find_span
from ..implicit import is_implicit
from ..sharding import (
    Rules,
    partition_specs,
    spread_over_processes,
    to_host,
    wait_for_writer,
    writes_files,
)
from ._hub_keys import HubKeys, HubLayout, hub_tensors
from ._stack import Layout

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TORCH_NAME = "pytorch_model.bin"


@dataclass(frozen=True)
class Architecture:
    """How one `model_type` maps onto peftx: its config class, its model classes by
    transformers class name, the prefix its backbone has inside head models, tensors that
    are stored transposed (GPT-2's Conv1D), heads a base checkpoint lacks (initialized
    fresh, as transformers does), checkpoint keys to ignore (as the checkpoint names
    them), a prefix before every key the model reads (`stored_under`: a multimodal
    checkpoint's `"language_model."`, whose other tensors `ignored` names), and tensors
    the Hub stores under other names (`hub_keys`: read in either layout, written in the
    Hub's)."""

    config_class: Any
    classes: dict[str, Any]
    default: str
    prefix: str
    transposed: tuple[str, ...] = ()
    new_heads: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    stored_under: str = ""
    hub_keys: tuple[HubKeys, ...] = ()


ARCHITECTURES: dict[str, Architecture] = {}


def register(model_type: str, architecture: Architecture) -> None:
    ARCHITECTURES[model_type] = architecture


def architecture(model_type: str) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise CheckpointError(
            f"model_type {model_type!r} is not supported; peftx loads {sorted(ARCHITECTURES)}."
        )
    return ARCHITECTURES[model_type]


def read_config(path: Path) -> dict[str, Any]:
    """`config.json` of the checkpoint directory `path`. For a supported `model_type`, the
    architecture's config class checks every value it reads (types and ranges) before
    anything is built from it; any problem is a `CheckpointError` naming the file and key."""
    file = path / CONFIG_NAME
    if not file.exists():
        raise CheckpointError(f"{file} is missing: a checkpoint directory needs config.json.")
    try:
        config = read_json(file)
    except ConfigFileError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(config, dict):
        shown = json.dumps(config)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise CheckpointError(
            f'{file} holds {shown}, not a JSON object such as {{"model_type": "llama", ...}}.'
        )
    if "model_type" not in config:
        raise CheckpointError(f"{file} has no 'model_type'; cannot tell the architecture.")
    model_type = config["model_type"]
    if not isinstance(model_type, str):
        raise CheckpointError(
            f'{file}: model_type must be a string such as "llama"; got {json.dumps(model_type)}.'
        )
    if model_type in ARCHITECTURES:
        try:
            ARCHITECTURES[model_type].config_class.from_hf_config(config)
        except ValueError as e:
            raise CheckpointError(f"{file}: {e}") from None
    return config


def _pick_class(arch: Architecture, config: dict, model_class: Any) -> Any:
    if model_class is None:
        names = [n for n in config.get("architectures") or () if n in arch.classes]
        return arch.classes[names[0] if names else arch.default]
    if isinstance(model_class, str):
        if model_class not in arch.classes:
            raise CheckpointError(
                f"model_class {model_class!r} is not a {config['model_type']} class; choose "
                f"one of {sorted(arch.classes)}."
            )
        return arch.classes[model_class]
    if model_class not in arch.classes.values():
        raise CheckpointError(
            f"model_class {model_class.__name__} does not read {config['model_type']!r} "
            f"checkpoints; choose one of {sorted(arch.classes)}."
        )
    return model_class


# safetensors' dtype names; numpy (with ml_dtypes) has each of them
_SAFE_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}

# A tensor whose dtype changes on the way is read and cast this many bytes at a time,
# so a bfloat16 load of a float32 file never holds a float32 copy of a whole tensor.
_CHUNK = 2**20


@dataclass(frozen=True)
class _Tensor:
    """Where one safetensors tensor lies: its file, dtype, shape and byte range."""

    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def safetensors_header(file: Path) -> dict[str, _Tensor]:
    """The tensors of one safetensors file, by key. `safe_open` validates the file (header
    size, JSON, byte ranges covering the data exactly, so a truncated file fails here);
    the byte ranges are then read from the header ourselves."""
    try:
        with safe_open(str(file), framework="numpy"):
            pass
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    tensors = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info["dtype"] not in _SAFE_DTYPES:
            raise CheckpointError(
                f"{key!r} in {file} is stored as {info['dtype']}, which peftx does not "
                f"read; readable dtypes: {sorted(_SAFE_DTYPES)}."
            )
        start, end = info["data_offsets"]
        dtype = np.dtype(_SAFE_DTYPES[info["dtype"]]).newbyteorder("<")
        tensors[key] = _Tensor(file, dtype, tuple(info["shape"]), 8 + size + start, end - start)
    return tensors


# transformers' "legacy" renaming, applied to every checkpoint it loads: old BERT
# checkpoints (bert-base-uncased's model.safetensors among them) name LayerNorm's
# parameters gamma and beta.
_LEGACY_NAMES = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}


def _legacy_renamed(tensors: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in tensors.items():
        for old, new in _LEGACY_NAMES.items():
            if key.endswith(old):
                key = key[: -len(old)] + new
        out[key] = value
    return out


class Reader:
    """The tensors of a checkpoint directory, by key: safetensors (one file, or shards
    under an index) read with plain positioned reads, or a `pytorch_model.bin` read only
    through `torch.load(weights_only=True)`.

    Nothing is memory-mapped: a memory-mapped page that has been read counts in the
    process's resident memory until the file is unmapped, so a loader that maps the file
    holds the checkpoint once more beside the model it builds. A read copies the bytes
    straight into their place in the model's array (through a small buffer when the
    dtype changes), and the file's pages stay in the kernel's page cache.
    """

    def __init__(self, path: Path):
        self.tensors: dict[str, _Tensor] = {}
        self._torch: dict[str, Any] | None = None
        self._files: dict[Path, Any] = {}
        index, single = path / INDEX_NAME, path / WEIGHTS_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                shards = {key: path / name for key, name in weight_map.items()}
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(
                    f"{index} is not a safetensors index (a JSON object with a "
                    f"'weight_map' of tensor name to shard file): {e!r}"
                ) from None
            for key, name in weight_map.items():
                if not isinstance(name, str) or Path(name).name != name or name in ("", ".."):
                    raise CheckpointError(
                        f"{index} puts {key!r} in {name!r}, which is not the name of a file "
                        "beside the index."
                    )
            for file in sorted(set(shards.values())):
                if not file.is_file():
                    named = sorted(k for k, f in shards.items() if f == file)
                    raise CheckpointError(
                        f"{index} names shard {file.name} (for {listing(named, 3)}), "
                        f"which is missing from {path}."
                    )
                header = safetensors_header(file)
                for key in sorted(k for k, f in shards.items() if f == file):
                    if key not in header:
                        raise CheckpointError(
                            f"{index} puts {key!r} in {file.name}, which lacks it."
                        )
                    self.tensors[key] = header[key]
        elif single.is_file():
            self.tensors = safetensors_header(single)
        elif (path / TORCH_NAME).is_file():
            self._torch = _torch_state_dict(path / TORCH_NAME)
        else:
            raise CheckpointError(
                f"{path} holds no weights: expected {WEIGHTS_NAME}, {INDEX_NAME} or {TORCH_NAME}."
            )
        if self._torch is not None:
            self._torch = _legacy_renamed(self._torch)
        else:
            self.tensors = _legacy_renamed(self.tensors)

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._torch = None

    def keys(self) -> set[str]:
        return set(self._torch if self._torch is not None else self.tensors)

    def file(self, key: str) -> str:
        return TORCH_NAME if self._torch is not None else self.tensors[key].file.name

    def shape(self, key: str) -> tuple[int, ...]:
        if self._torch is not None:
            return tuple(self._torch[key].shape)
        return self.tensors[key].shape

    def dtype(self, key: str) -> np.dtype:
        if self._torch is not None:
            return _torch_numpy(self._torch[key]).dtype
        return self.tensors[key].dtype

    def read_into(self, key: str, dest: np.ndarray, index: tuple[slice, ...] | None = None) -> None:
        """Copy tensor `key` into `dest` (its shape; any dtype, any strides), casting; or
        only the part `index` (a slice per axis) picks, reading only the rows it spans. A
        torch state dict lets go of a tensor read whole, so what it holds shrinks as the
        model grows."""
        if self._torch is not None:
            whole = _torch_numpy(self._torch[key] if index else self._torch.pop(key))
            dest[...] = whole[index] if index else whole
            return
        t = self.tensors[key]
        if t.nbytes == 0:
            return
        if t.file not in self._files:
            self._files[t.file] = open(t.file, "rb", buffering=0)  # noqa: SIM115
        f = self._files[t.file]
        if index is None and dest.dtype == t.dtype and dest.flags.c_contiguous:
            _read_exactly(f, t.offset, dest.reshape(-1).view(np.uint8), key)
            return
        if not t.shape:
            tmp = np.empty((), t.dtype)
            _read_exactly(f, t.offset, tmp.reshape(-1).view(np.uint8), key)
            dest[...] = tmp
            return
        rows = range(t.shape[0])[index[0]] if index else range(t.shape[0])
        rest = (slice(None), *index[1:]) if index else ()
        row_bytes = t.nbytes // t.shape[0]
        step = max(1, _CHUNK // max(row_bytes, 1))
        for first in range(rows.start, rows.stop, step):
            last = min(rows.stop, first + step)
            tmp = np.empty((last - first, *t.shape[1:]), t.dtype)
            _read_exactly(f, t.offset + first * row_bytes, tmp.reshape(-1).view(np.uint8), key)
            dest[first - rows.start : last - rows.start] = tmp[rest] if rest else tmp


def _read_exactly(f: Any, offset: int, out: np.ndarray, key: str) -> None:
    view = memoryview(out)
    done = 0
    f.seek(offset)
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise CheckpointError(
                f"{f.name} ended while reading {key!r}: the file changed or was truncated "
                "after its header was read."
            )
        done += n


def _torch_numpy(tensor: Any) -> np.ndarray:
    """A CPU torch tensor as a numpy array, without a copy (bfloat16 as ml_dtypes')."""
    import torch

    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _torch_state_dict(file: Path) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        raise CheckpointError(
            f"{file} is a torch pickle; peftx reads it only through "
            "torch.load(weights_only=True), and torch is not installed. Convert it to "
            "safetensors."
        ) from None
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad pickle
        raise CheckpointError(
            f"{file} could not be read with torch.load(weights_only=True), the only way "
            f"peftx reads a pickle (it refuses any object but tensors and plain "
            f"containers): {e}"
        ) from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CheckpointError(
            f"{file} does not hold a state dict (a dict of tensor name to tensor)."
        )
    return state


@dataclass(frozen=True)
class _Leaf:
    """One array of the model: its dotted path, and for a stack, the span of layers."""

    path: str
    shape: tuple[int, ...]
    dtype: Any
    template: str  # the transformers key, with `{i}` for the layer of a stack
    span: tuple[int, int] | None


def _leaves(skeleton: Any) -> tuple[list[_Leaf], Any]:
    flat, treedef = jtu.tree_flatten_with_path(skeleton)
    leaves = []
    for keypath, leaf in flat:
        path = dotted(keypath)
        found = find_span(path)
        if found is None:
            template, span = path, None
        else:
            parts, j, span = found
            template = ".".join([*parts[:j], "{i}", *parts[j + 1 :]])
        leaves.append(_Leaf(path, tuple(leaf.shape), leaf.dtype, template, span))
    return leaves, treedef


def is_transposed(arch: Architecture, template: str) -> bool:
    return any(re.fullmatch(p, template) for p in arch.transposed)


def key_mapper(arch: Architecture, expected: set[str], present: set[str]) -> Callable:
    """Map the model's keys to the checkpoint's: a head model's checkpoint has the
    backbone under `arch.prefix`, a bare backbone's checkpoint has it at the top; all of
    it under `arch.stored_under`."""
    prefix, under = arch.prefix + ".", arch.stored_under
    model_prefixed = any(k.startswith(prefix) for k in expected)
    ckpt_prefixed = any(k.startswith(under + prefix) for k in present)
    if model_prefixed and not ckpt_prefixed:
        return lambda k: under + k.removeprefix(prefix)
    if ckpt_prefixed and not model_prefixed:
        return lambda k: under + prefix + k
    return lambda k: under + k


def _expected_keys(leaf: _Leaf) -> Iterator[str]:
    if leaf.span is None:
        yield leaf.template
    else:
        for i in range(leaf.span[0], leaf.span[1] + 1):
            yield leaf.template.format(i=i)


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    model_class: Any = None,
    layout: Layout = "stacked",
    strict: bool = True,
    mesh: Mesh | None = None,
    rules: Rules = "fsdp",
    **model_kwargs: Any,
) -> Any:
    """Load a transformers checkpoint directory into the peftx Equinox model for it.

    **Arguments:**

    - `path`: a directory with `config.json` and `model.safetensors` (or shards under
      `model.safetensors.index.json`; or, with torch installed, `pytorch_model.bin`, read
      only with `torch.load(weights_only=True)`).
    - `dtype`: the parameters' dtype (default: the dtype the checkpoint stores).
    - `model_class`: a peftx class or transformers class name (`"LlamaForCausalLM"`);
      default: the config's `architectures`, else the backbone.
    - `layout`: `"stacked"` (blocks run under `lax.scan`) or `"unrolled"`.
    - `strict`: raise on checkpoint tensors the model has no place for (else warn).
    - `mesh`: a `jax.sharding.Mesh` (`peftx.sharding.make_mesh`) to load the model onto;
      default: the default device.
    - `rules`: how the arrays are split over `mesh` (see `peftx.sharding.shard`).
    - `model_kwargs`: passed to the model, e.g. `gradient_checkpointing=True`.

    **Returns:**

    The model, its arrays on the default device, or placed on `mesh` by `rules`: each
    device's slices are read from the files straight into place, so no process holds more
    of a weight than its devices' share (plus one row buffer).

    A head the checkpoint lacks (a classifier on a bare encoder) is initialized fresh,
    with a warning naming it. Every other missing tensor, a shape that differs, an
    unreadable file or an unknown `model_type` raises `CheckpointError`, before any of
    the model's arrays is allocated.

    Each array is allocated once, in the target dtype, and the checkpoint's tensors are
    read into it one at a time (a stacked array row by row), so loading takes little more
    memory than the model itself.
    """
    path = Path(path)
    if dtype is not None:
        dtype = float_dtype(dtype)  # a bad name fails first, listing the valid ones
    hf = read_config(path)
    arch = architecture(hf["model_type"])
    cls = _pick_class(arch, hf, model_class)
    config = arch.config_class.from_hf_config(hf)
    # where the model came from, for the `base_model_name_or_path` of its adapters
    config = replace(config, name_or_path=os.path.abspath(path))
    with Reader(path) as files:
        reader = HubLayout(files, arch.hub_keys) if arch.hub_keys else files
        present = reader.keys()
        if dtype is None:
            floats = [d for d in (reader.dtype(k) for k in sorted(present)) if _is_float(d)]
            dtype = max(set(floats), key=floats.count) if floats else np.float32
        dtype = float_dtype(dtype)
        key = jax.random.PRNGKey(0)

        def build(k: Any) -> Any:
            return cls(config, key=k, layout=layout, dtype=dtype, **model_kwargs)

        skeleton = eqx.filter_eval_shape(build, key)
        arrays, static = eqx.partition(skeleton, lambda x: isinstance(x, jax.ShapeDtypeStruct))
        leaves, treedef = _leaves(arrays)
        shardings = [None] * len(leaves)
        if mesh is not None:
            specs = partition_specs(skeleton, mesh, rules)
            specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
            shardings = [NamedSharding(mesh, spec) for spec in specs]
        expected = {k for leaf in leaves for k in _expected_keys(leaf)}
        to_ckpt = key_mapper(arch, expected, present)
        _check(path, hf, arch, cls, reader, leaves, to_ckpt, strict, dtype)
        new = [
            n for n, leaf in enumerate(leaves) if to_ckpt(next(_expected_keys(leaf))) not in present
        ]
        fresh: dict[int, jax.Array] = {}
        if new:
            names = [leaves[n].path for n in new]
            warnings.warn(
                f"{path} has no weights for {listing(names)}; they are initialized fresh "
                "(train them, e.g. with modules_to_save).",
                stacklevel=2,
            )

            def initial(k: Any) -> list[jax.Array]:
                # only the new heads leave the jit, so XLA never builds the rest
                built = jax.tree.leaves(eqx.filter(build(k), eqx.is_array))
                return [built[n] for n in new]

            placed = {} if mesh is None else {"out_shardings": [shardings[n] for n in new]}
            fresh = dict(zip(new, jax.jit(initial, **placed)(key)))
        values = [
            fresh[n] if n in fresh else _load_leaf(reader, leaf, to_ckpt, arch, dtype, sharding)
            for n, (leaf, sharding) in enumerate(zip(leaves, shardings))
        ]
    return eqx.combine(jax.tree.unflatten(treedef, values), static)


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _check(
    path: Path,
    hf: dict,
    arch: Architecture,
    cls: Any,
    reader: Reader | HubLayout,
    leaves: list[_Leaf],
    to_ckpt: Callable,
    strict: bool,
    dtype: Any,
) -> None:
    """Every key, shape and dtype the model needs, checked before anything is read."""
    present = reader.keys()
    used: set[str] = set()
    missing: list[str] = []
    for leaf in leaves:
        row_shape = leaf.shape[1:] if leaf.span is not None else leaf.shape
        transposed = is_transposed(arch, leaf.template)
        want = tuple(reversed(row_shape)) if transposed else row_shape
        for k in _expected_keys(leaf):
            ck = to_ckpt(k)
            if ck not in present:
                if not any(re.fullmatch(p, k) for p in arch.new_heads):
                    missing.append(ck)
                continue
            used.add(ck)
            stored = reader.shape(ck)
            if stored != want:
                raise CheckpointError(
                    f"{ck!r} in {reader.file(ck)} has shape {stored}; {cls.__name__}'s "
                    f"{leaf.path} expects {want}"
                    f"{' (stored transposed)' if transposed else ''}. Does config.json "
                    "describe these weights?"
                )
            if _is_float(leaf.dtype) and not _is_float(reader.dtype(ck)):
                raise CheckpointError(
                    f"{ck!r} in {reader.file(ck)} is stored as {reader.dtype(ck)}; "
                    f"{leaf.path} expects a floating tensor (loaded as {dtype})."
                )
    if missing:
        layers = _layers_held(leaves, present, to_ckpt)
        if layers is not None:
            raise CheckpointError(
                f"{path / CONFIG_NAME} describes {layers[0]} layers, but the weights hold "
                f"{layers[1]} ({layers[2]!r} is missing). Is config.json this checkpoint's?"
            )
        raise CheckpointError(
            f"{path} lacks {len(missing)} tensor(s) {cls.__name__} needs: "
            f"{listing(missing)}. Is it a {hf['model_type']} checkpoint of this size?"
        )
    unexpected = sorted(k for k in present - used if not _ignored(arch, k))
    if unexpected:
        message = (
            f"{path} has {len(unexpected)} tensor(s) {cls.__name__} has no place for: "
            f"{listing(unexpected)}."
        )
        if strict:
            raise CheckpointError(
                message + " Is model_class right? Pass strict=False to ignore them."
            )
        warnings.warn(message, stacklevel=3)


def _layers_held(
    leaves: list[_Leaf], present: set[str], to_ckpt: Callable
) -> tuple[int, int, str] | None:
    """`(layers config.json describes, layers the weights hold, first missing key)` when
    every stacked tensor is there for the same first layers and for no later one (a
    shorter model, not a gap); else None."""
    counts: dict[tuple[int, int], str] = {}  # (described, held): the first missing key
    for leaf in leaves:
        if leaf.span is not None:
            keys = [
                to_ckpt(leaf.template.format(i=i)) for i in range(leaf.span[0], leaf.span[1] + 1)
            ]
            there = [k in present for k in keys]
            held = there.index(False) if False in there else len(there)
            if any(there[held:]):
                return None
            counts.setdefault((len(keys), held), keys[held] if held < len(keys) else "")
    if len(counts) != 1:
        return None
    (((described, held), key),) = counts.items()
    return (described, held, key) if 0 < held < described else None


def _ignored(arch: Architecture, key: str) -> bool:
    return any(re.fullmatch(p, key) for p in arch.ignored)


# `jax.device_put` on CPU adopts a numpy array's memory without a copy when it starts
# on a 64-byte boundary (else it copies, and the array is briefly held twice).
_ALIGN = 64


def _empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialized array starting on an `_ALIGN`-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _load_leaf(
    reader: Reader | HubLayout,
    leaf: _Leaf,
    to_ckpt: Callable,
    arch: Architecture,
    dtype: Any,
    sharding: NamedSharding | None,
) -> jax.Array:
    """One array of the model, read whole onto the default device, or each device's
    slice by `sharding`."""
    keys = list(_expected_keys(leaf))
    row_shape = leaf.shape[1:] if leaf.span is not None else leaf.shape
    transposed = is_transposed(arch, leaf.template)
    want_dtype = dtype if _is_float(leaf.dtype) else leaf.dtype

    def read(index: tuple[slice, ...] | None) -> np.ndarray:
        if index is not None and leaf.span is None:
            index = (slice(None), *index)
        layers = keys[index[0]] if index else keys
        own = index[1:] if index else None
        shape = row_shape if own is None else [len(range(n)[s]) for n, s in zip(row_shape, own)]
        buffer = _empty((len(layers), *shape), want_dtype)
        for row, k in enumerate(layers):
            if transposed:
                reader.read_into(to_ckpt(k), buffer[row].T, own and own[::-1])
            else:
                reader.read_into(to_ckpt(k), buffer[row], own)
        return buffer if leaf.span is not None else buffer[0]

    if sharding is None:
        return jax.device_put(read(None))
    shards: dict[tuple, np.ndarray] = {}  # devices holding the same slice read it once

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in shards:
            shards[key] = read(index)
        return shards[key]

    return jax.make_array_from_callback(leaf.shape, sharding, shard)


def save_pretrained(
    model: Any, path: str | os.PathLike, *, max_shard_size: int | str = "5GB"
) -> None:
    """Write `model` as a transformers checkpoint: `config.json` and safetensors (sharded
    under `model.safetensors.index.json` past `max_shard_size`), with `{"format": "pt"}`
    metadata.

    **Arguments:**

    - `model`: a `peftx.models` model (a `PeftModel` must be merged first with
      `merge_and_unload()`).
    - `path`: the directory (created if missing).
    - `max_shard_size`: bytes, or a size such as `"5GB"` or `"500MiB"`; a tensor larger
      than this gets a shard of its own.

    The files are written into a new directory beside `path` that replaces it in one
    atomic swap, so a save that fails or is killed at any point leaves `path` as it was
    or as the new checkpoint, never a mix. Other files in `path` (a tokenizer's) are
    kept; weight files of an earlier save are not (as transformers does), so the
    directory holds one checkpoint.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_hf_config"):
        raise TypeError(
            f"save_pretrained takes a peftx.models model, got {type(model).__name__}. A "
            "PeftModel carries adapters: merge them (`peft_model.merge_and_unload()`) to save "
            "a full model."
        )
    if any(is_implicit(x) for x in jax.tree.leaves(model, is_leaf=is_implicit)):
        raise TypeError(
            "the model holds implicit arrays (adapters or quantized weights); merge or "
            "dequantize them before save_pretrained."
        )
    arch = architecture(config.model_type)
    name = next(n for n, c in arch.classes.items() if c is type(model))
    path = Path(path)
    limit = _size(max_shard_size)

    arrays = eqx.filter(model, eqx.is_array)
    spread = spread_over_processes(arrays)
    leaves, _ = _leaves(arrays)
    values = jax.tree.leaves(arrays)
    shards: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    for leaf, value in zip(leaves, values):
        transposed = is_transposed(arch, leaf.template)
        host = to_host(value)  # no copy on CPU
        rows = (
            [(leaf.template, host)]
            if leaf.span is None
            else [(leaf.template.format(i=leaf.span[0] + j), host[j]) for j in range(host.shape[0])]
        )
        rows = [(k, t) for key, value in rows for k, t in hub_tensors(arch.hub_keys, key, value)]
        for k, t in rows:
            t = np.ascontiguousarray(t.T if transposed else t)
            if sizes[-1] and sizes[-1] + t.nbytes > limit:
                shards.append({})
                sizes.append(0)
            shards[-1][k] = t
            sizes[-1] += t.nbytes
    hf = config.to_hf_config()
    hf["architectures"] = [name]
    floats = [str(np.dtype(v.dtype)) for v in values if _is_float(v.dtype)]
    hf["dtype"] = max(set(floats), key=floats.count) if floats else "float32"

    if len(shards) == 1:
        names = [WEIGHTS_NAME]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if writes_files():  # of several processes, process 0
        with replaced_directory(path, drop=_is_weight_file, size=sum(sizes)) as tmp:
            for shard, fname in zip(shards, names):
                safetensors.numpy.save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            if len(shards) > 1:
                index = {
                    "metadata": {"total_size": sum(sizes)},
                    "weight_map": {k: f for shard, f in zip(shards, names) for k in sorted(shard)},
                }
                (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            (tmp / CONFIG_NAME).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")

    wait_for_writer(f"peftx save_pretrained {path}", spread)


_WEIGHT_FILE = re.compile(
    r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|" + re.escape(TORCH_NAME)
)


def _is_weight_file(path: Path) -> bool:
    """A weight file of a transformers checkpoint (an earlier save's, not to be kept)."""
    return _WEIGHT_FILE.fullmatch(path.name) is not None


def _size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B)\s*", size.upper())
    if match is None:
        raise ValueError(f"max_shard_size {size!r} is not a size like '5GB' or '500MiB'.")
    return int(float(match.group(1)) * units[match.group(2)])


def read_tensors(file: Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file as a numpy array (a torch pickle only through
    `torch.load(weights_only=True)`). A corrupt, truncated or empty file is a
    `CheckpointError` naming it."""
    if file.suffix == ".bin":
        return {k: _torch_numpy(v) for k, v in _torch_state_dict(file).items()}
    tensors = safetensors_header(file)
    out = {}
    with open(file, "rb", buffering=0) as f:
        for key, t in tensors.items():
            out[key] = np.empty(t.shape, t.dtype)
            if t.nbytes:
                _read_exactly(f, t.offset, out[key].reshape(-1).view(np.uint8), key)
    return out
