"""Choosing the parts of an Equinox model to adapt: predicates over `(path, node)`.

A path is the dotted name transformers would give the module (`layers.3.self_attn.q_proj`):
attribute names, list indices and dict keys joined by dots.
"""

import dataclasses
import difflib
import fnmatch
import inspect
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu

from ._errors import TargetNotFoundError
from ._spans import INDEX_OR_SPAN
from .implicit import is_implicit


@dataclasses.dataclass(frozen=True)
class Predicate:
    """A test of `(path, node)`, combinable with `&`, `|` and `~`."""

    fn: Callable[[str, Any], bool]
    description: str

    def __call__(self, path: str, node: Any) -> bool:
        return bool(self.fn(path, node))

    def __and__(self, other: "Predicate") -> "Predicate":
        return Predicate(lambda p, n: self(p, n) and other(p, n), f"({self} & {other})")

    def __or__(self, other: "Predicate") -> "Predicate":
        return Predicate(lambda p, n: self(p, n) or other(p, n), f"({self} | {other})")

    def __invert__(self) -> "Predicate":
        return Predicate(lambda p, n: not self(p, n), f"~{self}")

    def __str__(self) -> str:
        return self.description


def of_type(*types: type) -> Predicate:
    """Nodes that are instances of any of `types` (e.g. `eqx.nn.Linear`)."""
    names = ", ".join(t.__name__ for t in types)
    return Predicate(lambda p, n: isinstance(n, types), f"of_type({names})")


def named(*names: str) -> Predicate:
    """Nodes whose last path element is one of `names` (e.g. `"q_proj"`)."""
    return Predicate(lambda p, n: p.rsplit(".", 1)[-1] in names, f"named{names}")


def path_glob(pattern: str) -> Predicate:
    """Nodes whose full dotted path matches a shell-style glob (`"*.mlp.*"`)."""
    return Predicate(lambda p, n: fnmatch.fnmatchcase(p, pattern), f"path_glob({pattern!r})")


def path_regex(pattern: str) -> Predicate:
    """Nodes whose full dotted path matches `pattern` entirely (`re.fullmatch`)."""
    compiled = re.compile(pattern)
    return Predicate(lambda p, n: compiled.fullmatch(p) is not None, f"path_regex({pattern!r})")


def _layer_match(path: str, layers_pattern: str | Sequence[str] | None) -> re.Match | None:
    span = INDEX_OR_SPAN + r"\."
    if not layers_pattern:
        return re.match(r".*?\.[^.]*\." + span, path)
    patterns = [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern
    for pattern in patterns:
        match = re.match(rf"(?:^|.*?\.){pattern}\." + span, path)
        if match is not None:
            return match
    return None


def layer_index(path: str, layers_pattern: str | Sequence[str] | None = None) -> int | None:
    """The layer index of a dotted path as HF PEFT reads it: the first numbered segment
    that follows another segment (or that follows one of `layers_pattern`). None for a
    path inside a stacked segment of several layers (see `layer_span`)."""
    match = _layer_match(path, layers_pattern)
    if match is None or match.group("last") is not None:
        return None
    return int(match.group("idx"))


def layer_span(
    path: str, layers_pattern: str | Sequence[str] | None = None
) -> tuple[int, int] | None:
    """The layers a dotted path belongs to, first and last: `(3, 3)` for transformers'
    `layers.3.…`, `(0, 11)` inside a `peftx.models.LayerStack` segment `layers.0-11.…`."""
    match = _layer_match(path, layers_pattern)
    if match is None:
        return None
    first = int(match.group("idx"))
    last = match.group("last")
    return first, first if last is None else int(last)


def _within(span: tuple[int, int] | None, wanted: set[int]) -> bool:
    return span is not None and all(i in wanted for i in range(span[0], span[1] + 1))


def in_layers(
    layers: int | Iterable[int] | range, layers_pattern: str | Sequence[str] | None = None
) -> Predicate:
    """Nodes inside the given layers (PEFT's `layers_to_transform`/`layers_pattern`); a
    stacked segment is inside when all its layers are."""
    wanted = {layers} if isinstance(layers, int) else set(layers)
    return Predicate(
        lambda p, n: _within(layer_span(p, layers_pattern), wanted),
        f"in_layers({sorted(wanted)})",
    )


def with_shape(*shape: int | None) -> Predicate:
    """Array nodes (or modules with a `weight`) of this shape; `None` matches any size."""

    def test(p: str, n: Any) -> bool:
        got = _array_shape(n)
        return (
            got is not None
            and len(got) == len(shape)
            and all(want is None or want == g for want, g in zip(shape, got))
        )

    return Predicate(test, f"with_shape{shape}")


def with_ndim(ndim: int) -> Predicate:
    """Array nodes (or modules with a `weight`) of `ndim` dimensions."""
    return Predicate(
        lambda p, n: (s := _array_shape(n)) is not None and len(s) == ndim, f"with_ndim({ndim})"
    )


def where(fn: Callable[..., bool], *, with_keypath: bool = False) -> Predicate:
    """Any test: `fn(node)`, or `fn(path, node)` with `with_keypath=True`. A `fn` that
    takes a different number of arguments is a `TypeError` here, not at the first node."""
    name = getattr(fn, "__name__", "fn")
    wanted = ("path", "node") if with_keypath else ("node",)
    if not _takes(fn, len(wanted)):
        hint = "; pass with_keypath=True for fn(path, node)" if not with_keypath else ""
        raise TypeError(
            f"where({name}): fn must take ({', '.join(wanted)}) with "
            f"with_keypath={with_keypath}{hint}"
        )
    if with_keypath:
        return Predicate(fn, f"where({name})")
    return Predicate(lambda p, n: fn(n), f"where({name})")


def _takes(fn: Callable[..., Any], count: int) -> bool:
    """Whether `fn` can be called with `count` positional arguments (True when its
    signature cannot be read, as for some builtins)."""
    try:
        inspect.signature(fn).bind(*range(count))
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def _array_shape(node: Any) -> tuple[int, ...] | None:
    if eqx.is_array(node) or is_implicit(node):
        return tuple(node.shape)
    weight = getattr(node, "weight", None) if isinstance(node, eqx.Module) else None
    return None if weight is None else tuple(weight.shape)


def _segment(key: Any) -> str:
    if isinstance(key, jtu.GetAttrKey):
        return key.name
    if isinstance(key, jtu.SequenceKey):
        return str(key.idx)
    if isinstance(key, jtu.DictKey):
        return str(key.key)
    return str(key).strip(".[]'\"")


def dotted(keypath: Sequence[Any]) -> str:
    """The dotted name of a JAX key path (`model.layers[3].q_proj` → `model.layers.3.q_proj`)."""
    return ".".join(_segment(k) for k in keypath)


def _nodes(model: Any) -> list[tuple[str, tuple, Any]]:
    """Every module and array in `model`, with dotted path and key path, outermost first.
    Implicit arrays count as arrays: their fields are not listed."""
    found: list[tuple[str, tuple, Any]] = []

    def visit(keypath: tuple, node: Any) -> None:
        if keypath:
            found.append((dotted(keypath), keypath, node))
        if is_implicit(node) or eqx.is_array(node) or node is None:
            return
        children, _ = jtu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        if len(children) == 1 and children[0][0] == ():
            return  # a pytree leaf
        for child_path, child in children:
            visit(keypath + tuple(child_path), child)

    visit((), model)
    return found


@dataclasses.dataclass(frozen=True)
class Selection:
    """The nodes of `model` chosen so far. Made by `select(model)`; narrow it with
    `at(...)`/`where(...)`; leave it with `paths()`, `get()`, `apply(fn)`, `set(values)`."""

    model: Any
    matches: tuple[tuple[str, tuple, Any], ...]

    def at(self, predicate: Predicate) -> "Selection":
        """Only the nodes for which `predicate(path, node)` holds."""
        return Selection(self.model, tuple(m for m in self.matches if predicate(m[0], m[2])))

    def at_instances_of(self, *types: type) -> "Selection":
        return self.at(of_type(*types))

    def at_named(self, *names: str) -> "Selection":
        return self.at(named(*names))

    def where(
        self, fn: Callable[..., bool] | Predicate, *, with_keypath: bool = False
    ) -> "Selection":
        """Only the nodes for which `fn(node)` holds, or `fn(path, node)` with
        `with_keypath=True` (penzai's `where`); a `Predicate` is `at(predicate)`."""
        if isinstance(fn, Predicate):
            return self.at(fn)
        return self.at(where(fn, with_keypath=with_keypath))

    def __len__(self) -> int:
        return len(self.matches)

    def paths(self) -> list[str]:
        """The dotted paths of the selected nodes."""
        return [path for path, _, _ in self.matches]

    def get(self) -> list[Any]:
        """The selected nodes."""
        return [node for _, _, node in self.matches]

    def where_fn(self) -> Callable[[Any], list[Any]]:
        """A `where` for `eqx.tree_at`: the selected nodes of a model shaped like this one."""
        keypaths = [keypath for _, keypath, _ in self.matches]
        return lambda model: [node_at(model, keypath) for keypath in keypaths]

    def apply(self, fn: Callable[[Any], Any]) -> Any:
        """A new model with every selected node replaced by `fn(node)`."""
        return self.set([fn(node) for node in self.get()])

    def set(self, values: Sequence[Any]) -> Any:
        """A new model with the selected nodes replaced by `values`, in order."""
        if len(values) != len(self.matches):
            raise ValueError(f"got {len(values)} values for {len(self.matches)} selected nodes.")
        if not self.matches:
            return self.model
        return eqx.tree_at(self.where_fn(), self.model, list(values), is_leaf=lambda x: x is None)

    def table(self) -> str:
        """What is selected, as a table (a string: `print(selection.table())`): path,
        type, shape, parameter count."""
        rows = [("path", "type", "shape", "params")]
        total = 0
        for path, _, node in self.matches:
            shape = _array_shape(node)
            count = sum(x.size for x in jax.tree.leaves(eqx.filter(node, eqx.is_array)))
            total += count
            rows.append((path, type(node).__name__, str(shape or ""), f"{count:,}"))
        rows.append((f"{len(self.matches)} selected", "", "", f"{total:,}"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def node_at(model: Any, keypath: tuple) -> Any:
    """The node of `model` at the JAX key path `keypath`."""
    node = model
    for key in keypath:
        if isinstance(key, jtu.GetAttrKey):
            node = getattr(node, key.name)
        elif isinstance(key, jtu.SequenceKey):
            node = node[key.idx]
        else:
            node = node[key.key]
    return node


def select(model: Any) -> Selection:
    """Every module and array of `model` (at any depth), ready to be narrowed.

    ```python
    sel = select(model).at(of_type(eqx.nn.Linear) & named("q_proj", "v_proj"))
    print(sel.table())
    model = sel.apply(lambda lin: eqx.tree_at(lambda m: m.weight, lin, lora(...)))
    ```
    """
    return Selection(model, tuple(_nodes(model)))


def peft_targets(
    target_modules: str | Sequence[str],
    *,
    exclude_modules: str | Sequence[str] | None = None,
    layers_to_transform: int | Sequence[int] | None = None,
    layers_pattern: str | Sequence[str] | None = None,
) -> Predicate:
    """HF PEFT's `target_modules` rule as a predicate over dotted paths.

    A string is a regex that must match the whole path; a list matches a path equal to an
    entry or ending in `"." + entry`. `exclude_modules` (same rules) wins over the targets.
    `layers_to_transform` keeps only paths whose layer index (see `layer_index`) is listed;
    a stacked segment's path is kept when all its layers are (`peftx.targets` and
    `get_peft_model` first split stacks where the listed layers start and stop).
    """

    def matches(rule: str | Sequence[str], path: str) -> bool:
        if isinstance(rule, str):
            return re.fullmatch(rule, path) is not None
        return path in rule or any(path.endswith(f".{t}") for t in rule)

    def test(path: str, node: Any) -> bool:
        if exclude_modules and matches(exclude_modules, path):
            return False
        if not matches(target_modules, path):
            return False
        if layers_to_transform is None or isinstance(target_modules, str):
            return True
        wanted = (
            {layers_to_transform}
            if isinstance(layers_to_transform, int)
            else set(layers_to_transform)
        )
        return not wanted or _within(layer_span(path, layers_pattern), wanted)

    return Predicate(test, f"peft_targets({target_modules!r})")


def require_matches(
    selection: Selection, predicate: Predicate, wanted: Sequence[str] = ()
) -> Selection:
    """`selection.at(predicate)`, or a `TargetNotFoundError` when nothing matches, listing
    the module names present closest to each of `wanted` (see `suggest_names`)."""
    chosen = selection.at(predicate)
    if len(chosen):
        return chosen
    raise TargetNotFoundError(
        f"{predicate} matches no module of this model. {suggest_names(selection, wanted)} "
        "Check the spelling, or list every module with peftx.select(model).table()."
    )


# A layer index (`layers.3`) or a `LayerStack` segment's span of them (`layers.0-11`).
_INDEX = re.compile(r"\d+(?:-\d+)?")
_LAYERS = (eqx.nn.Linear, eqx.nn.Conv, eqx.nn.Embedding)
_SHOWN = 20


def suggest_names(selection: Selection, wanted: Sequence[str]) -> str:
    """A sentence naming the modules of `selection` a target could use that are close to
    `wanted` (`difflib`): each module's last path component, or its path after the last
    layer index (`self_attn.q_proj`). With none close, the names of the Linear, Conv and
    Embedding layers, which targets usually name. Never a layer index or span."""
    modules = [
        (p, n) for p, _, n in selection.matches if isinstance(n, eqx.Module) and not is_implicit(n)
    ]
    candidates: set[str] = set()
    for path, _ in modules:
        parts = path.split(".")
        after = max((i + 1 for i, s in enumerate(parts) if _INDEX.fullmatch(s)), default=0)
        if parts[after:]:
            candidates.update((parts[-1], ".".join(parts[after:])))
    close = {c for w in wanted for c in difflib.get_close_matches(w, sorted(candidates), n=3)}
    if close:
        return f"Closest module names: {sorted(close)}."
    layers = {p.rsplit(".", 1)[-1] for p, n in modules if isinstance(n, _LAYERS)}
    names = _plain(layers) or _plain(candidates)
    if len(names) > _SHOWN:
        names = [*names[:_SHOWN], f"... {len(names) - _SHOWN} more"]
    return f"No module name is close; the layers are named {names}."


def _plain(names: set[str]) -> list[str]:
    return sorted(n for n in names if "." not in n and not _INDEX.fullmatch(n))
