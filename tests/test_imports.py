"""The package's imports run one way: no module imports, directly or through others, a
module that imports it back. Imports inside functions count (they only hide a cycle), and a
package counts as its `__init__`, which imports what it re-exports. And no module takes a
private name (`_name`) from another: what several modules share has a public name."""

import ast
from pathlib import Path

import peftx

ROOT = Path(peftx.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Each peftx module's peftx imports, as module names (a package's is its __init__)."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
                # `from . import train`: a submodule; `from .x import y`: the module x
                names = [f"{target}.{a.name}" for a in node.names]
                found |= {n for n in names if n in modules} or {target}
            elif isinstance(node, ast.Import | ast.ImportFrom):
                mods = (
                    [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                )
                found |= {m for m in mods if m and m.startswith("peftx.") and m in modules}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_imports_have_no_cycle():
    graph = _imports()
    assert len(graph) > 30 and graph["peftx._peft_model"]
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                cycle = path[path.index(other) :] + [other]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if other not in state:
                visit(other)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def _private_imports() -> list[tuple[str, str, str]]:
    """`(module, source, name)` for each `from <peftx module> import _name` (inside functions
    too): a private name taken from another module. A private submodule is not a name."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    found = []
    for name, path in sorted(modules.items()):
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{node.module}" if node.module else base
            elif node.module and (node.module == "peftx" or node.module.startswith("peftx.")):
                source = node.module
            else:
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{source}.{alias.name}" not in modules:
                    found.append((name, source, alias.name))
    return found


def test_no_module_imports_another_modules_private_name():
    found = _private_imports()
    assert not found, "private names imported from another module:\n" + "\n".join(
        f"{module}: from {source} import {name}" for module, source, name in found
    )


def test_subpackages_meet_at_their_faces():
    """No module reaches into a subpackage it is not part of: `peftx.cli._generate` may
    import `peftx.train` (its `__init__`, what it exports) but not `peftx.train._data`.
    Modules of one subpackage may import each other's, and any module the top-level
    `peftx._module`s beside `_files.py`."""
    found = []
    for module, imported in sorted(_imports().items()):
        for target in sorted(imported):
            parts = target.split(".")
            private = next((i for i, p in enumerate(parts) if p.startswith("_")), None)
            if private is None:
                continue
            owner = ".".join(parts[:private])  # the package whose private module it is
            if not (module == owner or module.startswith(owner + ".")):
                found.append(f"{module} imports {target} (import it from {owner})")
    assert not found, "private modules of another subpackage imported:\n" + "\n".join(found)
