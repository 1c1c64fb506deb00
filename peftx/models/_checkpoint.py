"""HF checkpoints in and out: `config.json` plus safetensors (one file or shards).

A model's array at dotted path `model.layers.0-11.self_attn.q_proj.weight` is the stack
of transformers' tensors `model.layers.{i}.self_attn.q_proj.weight` for i in 0..11; an
unrolled model's paths are transformers' names as they are. Tensors are read one at a
time (memory-mapped by `safetensors`, no torch), cast, and written into the preallocated
stacked array, so the model is never held twice.
"""

import json
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from .._errors import CheckpointError
from .._select import dotted
from ._stack import LayerStack, Layout, parse_span

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TORCH_NAME = "pytorch_model.bin"


@dataclass(frozen=True)
class Architecture:
    """How one `model_type` maps onto peftx: its config class, its model classes by
    transformers class name, the prefix its backbone has inside head models, tensors that
    are stored transposed (GPT-2's Conv1D), heads a base checkpoint lacks (initialized
    fresh, as transformers does) and checkpoint keys to ignore."""

    config_class: Any
    classes: dict[str, Any]
    default: str
    prefix: str
    transposed: tuple[str, ...] = ()
    new_heads: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()


ARCHITECTURES: dict[str, Architecture] = {}


def register(model_type: str, architecture: Architecture) -> None:
    ARCHITECTURES[model_type] = architecture


def architecture(model_type: str) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise CheckpointError(
            f"model_type {model_type!r} is not supported; peftx loads {sorted(ARCHITECTURES)}."
        )
    return ARCHITECTURES[model_type]


def _read_config(path: Path) -> dict[str, Any]:
    file = path / CONFIG_NAME
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: a checkpoint directory needs config.json.")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    if "model_type" not in config:
        raise CheckpointError(f"{file} has no 'model_type'; cannot tell the architecture.")
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


class _Reader:
    """Tensors of a checkpoint by key, read lazily from safetensors files (or, with
    torch installed, from a `pytorch_model.bin` via `torch.load(weights_only=True)`)."""

    def __init__(self, path: Path):
        self.files: dict[str, Path] = {}
        self._open: dict[Path, Any] = {}
        self._torch: dict[str, Any] | None = None
        index, single = path / INDEX_NAME, path / WEIGHTS_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a safetensors index: {e}") from None
            for key, name in weight_map.items():
                self.files[key] = path / name
            for file in sorted(set(self.files.values())):
                if not file.is_file():
                    raise CheckpointError(f"{index} names shard {file.name}, which is missing.")
        elif single.is_file():
            for key in self._handle(single).keys():
                self.files[key] = single
        elif (path / TORCH_NAME).is_file():
            self._torch = _torch_state_dict(path / TORCH_NAME)
            self.files = {k: path / TORCH_NAME for k in self._torch}
        else:
            raise CheckpointError(
                f"{path} holds no weights: expected {WEIGHTS_NAME}, {INDEX_NAME} or {TORCH_NAME}."
            )

    def _handle(self, file: Path) -> Any:
        if file not in self._open:
            try:
                self._open[file] = safe_open(str(file), framework="numpy")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None
        return self._open[file]

    def keys(self) -> set[str]:
        return set(self.files)

    def shape(self, key: str) -> tuple[int, ...]:
        if self._torch is not None:
            return tuple(self._torch[key].shape)
        return tuple(self._handle(self.files[key]).get_slice(key).get_shape())

    def dtype(self, key: str) -> str:
        if self._torch is not None:
            return str(self._torch[key].dtype).removeprefix("torch.")
        return _SAFE_DTYPES.get(self._handle(self.files[key]).get_slice(key).get_dtype(), "")

    def read(self, key: str) -> np.ndarray:
        if self._torch is not None:
            t = self._torch[key]
            if str(t.dtype) == "torch.bfloat16":
                import ml_dtypes

                return t.view(dtype=__import__("torch").int16).numpy().view(ml_dtypes.bfloat16)
            return t.numpy()
        try:
            if key not in self.files:
                raise KeyError(key)
            handle = self._handle(self.files[key])
            if key not in handle.keys():
                raise CheckpointError(
                    f"the index puts {key!r} in {self.files[key].name}, which lacks it."
                )
            return handle.get_tensor(key)
        except SafetensorError as e:
            raise CheckpointError(f"cannot read {key!r} from {self.files[key]}: {e}") from None


_SAFE_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


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
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad pickle
        raise CheckpointError(
            f"{file} could not be read with torch.load(weights_only=True): {e}"
        ) from None


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
        parts = path.split(".")
        span = None
        for j, part in enumerate(parts):
            if (s := parse_span(part)) is not None:
                span = s
                parts[j] = "{i}"
                break
        leaves.append(_Leaf(path, tuple(leaf.shape), leaf.dtype, ".".join(parts), span))
    return leaves, treedef


def _is_transposed(arch: Architecture, template: str) -> bool:
    return any(re.fullmatch(p, template) for p in arch.transposed)


def _key_mapper(arch: Architecture, expected: set[str], present: set[str]) -> Callable:
    """Map the model's keys to the checkpoint's: a head model's checkpoint has the
    backbone under `arch.prefix`, a bare backbone's checkpoint has it at the top."""
    prefix = arch.prefix + "."
    model_prefixed = any(k.startswith(prefix) for k in expected)
    ckpt_prefixed = any(k.startswith(prefix) for k in present)
    if model_prefixed and not ckpt_prefixed:
        return lambda k: k.removeprefix(prefix)
    if ckpt_prefixed and not model_prefixed:
        return lambda k: prefix + k
    return lambda k: k


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
    - `model_kwargs`: passed to the model, e.g. `gradient_checkpointing=True`.

    A head the checkpoint lacks (a classifier on a bare encoder) is initialized fresh,
    with a warning naming it. Every other missing tensor, a shape that differs, an
    unreadable file or an unknown `model_type` raises `CheckpointError`.
    """
    path = Path(path)
    hf = _read_config(path)
    arch = architecture(hf["model_type"])
    cls = _pick_class(arch, hf, model_class)
    config = arch.config_class.from_hf_config(hf)
    reader = _Reader(path)
    present = reader.keys()
    if dtype is None:
        stored = [reader.dtype(k) for k in sorted(present)]
        floats = [d for d in stored if d.startswith(("float", "bfloat"))]
        dtype = max(set(floats), key=floats.count) if floats else "float32"
    dtype = jnp.dtype(dtype)
    key = jax.random.PRNGKey(0)

    def build(k: Any) -> Any:
        return cls(config, key=k, layout=layout, dtype=dtype, **model_kwargs)

    skeleton = eqx.filter_eval_shape(build, key)
    arrays, static = eqx.partition(skeleton, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    leaves, treedef = _leaves(arrays)
    expected = {k for leaf in leaves for k in _expected_keys(leaf)}
    to_ckpt = _key_mapper(arch, expected, present)
    used: set[str] = set()
    missing: list[str] = []
    fresh: list[str] = []
    for leaf in leaves:
        for k in _expected_keys(leaf):
            ck = to_ckpt(k)
            if ck in present:
                used.add(ck)
            elif any(re.fullmatch(p, k) for p in arch.new_heads):
                fresh.append(k)
            else:
                missing.append(ck)
    unexpected = sorted(k for k in present - used if not _ignored(arch, k))
    if missing:
        raise CheckpointError(
            f"{path} lacks {len(missing)} tensor(s) {cls.__name__} needs: "
            f"{_listing(missing)}. Is it a {hf['model_type']} checkpoint of this size?"
        )
    if unexpected:
        message = (
            f"{path} has {len(unexpected)} tensor(s) {cls.__name__} has no place for: "
            f"{_listing(unexpected)}."
        )
        if strict:
            raise CheckpointError(message + " Pass strict=False to ignore them.")
        warnings.warn(message, stacklevel=2)
    new = [n for n, leaf in enumerate(leaves) if to_ckpt(next(_expected_keys(leaf))) not in present]
    fresh_values: dict[int, jax.Array] = {}
    if new:
        warnings.warn(
            f"{path} has no weights for {_listing(sorted(set(fresh)))}; they are initialized "
            "fresh (train them, e.g. with modules_to_save).",
            stacklevel=2,
        )

        def initial(k: Any) -> list[jax.Array]:
            # only the new heads leave the jit, so XLA never builds the rest
            built = jax.tree.leaves(eqx.filter(build(k), eqx.is_array))
            return [built[n] for n in new]

        fresh_values = dict(zip(new, jax.jit(initial)(key)))
    values = []
    for n, leaf in enumerate(leaves):
        if n in fresh_values:
            values.append(fresh_values[n])
        else:
            keys = list(_expected_keys(leaf))
            values.append(_load_leaf(reader, leaf, keys, to_ckpt, arch, dtype))
    return eqx.combine(jax.tree.unflatten(treedef, values), static)


def _ignored(arch: Architecture, key: str) -> bool:
    return any(re.fullmatch(p, key) for p in arch.ignored)


def _listing(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _load_leaf(
    reader: _Reader,
    leaf: _Leaf,
    keys: list[str],
    to_ckpt: Callable,
    arch: Architecture,
    dtype: Any,
) -> jax.Array:
    row_shape = leaf.shape[1:] if leaf.span is not None else leaf.shape
    transposed = _is_transposed(arch, leaf.template)
    want_dtype = leaf.dtype if not jnp.issubdtype(leaf.dtype, jnp.floating) else dtype
    buffer = np.empty((len(keys), *row_shape), dtype=want_dtype)
    for row, k in enumerate(keys):
        ck = to_ckpt(k)
        stored = reader.shape(ck)
        want = tuple(reversed(row_shape)) if transposed else row_shape
        if stored != want:
            raise CheckpointError(
                f"{ck!r} in {reader.files[ck].name} has shape {stored}; "
                f"{leaf.path} expects {want}{' (stored transposed)' if transposed else ''}."
            )
        tensor = reader.read(ck)
        buffer[row] = tensor.T if transposed else tensor
        del tensor
    array = jax.device_put(buffer if leaf.span is not None else buffer[0])
    del buffer
    return array


def save_pretrained(
    model: Any, path: str | os.PathLike, *, max_shard_size: int | str = "5GB"
) -> None:
    """Write `model` as a transformers checkpoint: `config.json` and safetensors (sharded
    under `model.safetensors.index.json` past `max_shard_size`), with `{"format": "pt"}`
    metadata; each file is written to a temporary name and renamed.

    A `PeftModel` must be merged first (`merge_and_unload()`), or its adapters saved on
    their own.
    """
    from .._peft_model import PeftModel

    if isinstance(model, PeftModel):
        raise TypeError(
            "save_pretrained takes a zoo model; a PeftModel carries adapters. Merge them "
            "(`peft_model.merge_and_unload()`) to save a full model."
        )
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_hf_config"):
        raise TypeError(f"save_pretrained takes a peftx.models model, got {type(model).__name__}.")
    arch = architecture(config.model_type)
    name = next(n for n, c in arch.classes.items() if c is type(model))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    limit = _size(max_shard_size)

    arrays = eqx.filter(model, eqx.is_array)
    leaves, _ = _leaves(arrays)
    values = jax.tree.leaves(arrays)
    from ..implicit import is_implicit

    if any(is_implicit(x) for x in jax.tree.leaves(model, is_leaf=is_implicit)):
        raise TypeError(
            "the model holds implicit arrays (adapters or quantized weights); merge or "
            "dequantize them before save_pretrained."
        )
    shards: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    for leaf, value in zip(leaves, values):
        transposed = _is_transposed(arch, leaf.template)
        host = np.asarray(value)
        rows = (
            [(leaf.template, host)]
            if leaf.span is None
            else [(leaf.template.format(i=leaf.span[0] + j), host[j]) for j in range(host.shape[0])]
        )
        for k, t in rows:
            t = np.ascontiguousarray(t.T if transposed else t)
            if sizes[-1] and sizes[-1] + t.nbytes > limit:
                shards.append({})
                sizes.append(0)
            shards[-1][k] = t
            sizes[-1] += t.nbytes
    hf = config.to_hf_config()
    hf["architectures"] = [name]
    hf["dtype"] = str(np.dtype(values[0].dtype)) if values else "float32"
    _atomic_write_text(path / CONFIG_NAME, json.dumps(hf, indent=2, sort_keys=True) + "\n")
    if len(shards) == 1:
        _atomic_safetensors(shards[0], path / WEIGHTS_NAME)
        return
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for shard, fname in zip(shards, names):
        _atomic_safetensors(shard, path / fname)
    index = {
        "metadata": {"total_size": sum(sizes)},
        "weight_map": {k: fname for shard, fname in zip(shards, names) for k in sorted(shard)},
    }
    _atomic_write_text(path / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")


def _size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B)\s*", size.upper())
    if match is None:
        raise ValueError(f"max_shard_size {size!r} is not a size like '5GB' or '500MiB'.")
    return int(float(match.group(1)) * units[match.group(2)])


def _atomic_write_text(target: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _atomic_safetensors(tensors: dict[str, np.ndarray], target: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def is_stacked(model: Any) -> bool:
    """Whether `model` holds any `LayerStack`."""
    return any(
        isinstance(x, LayerStack)
        for x in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, LayerStack))
    )
