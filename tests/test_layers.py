"""The layers in the folders are the layers in the imports: dependencies only point down."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ("gateway", "platforms", "agent_cache", "tests")

# Which of our packages each layer may import (itself included). Everything else is third-party
# or the standard library, limited separately below.
ALLOWED = {
    "agent_cache": {"agent_cache"},
    "gateway.core": {"gateway.core", "agent_cache"},
    "gateway.agents": {"gateway.agents", "gateway.core"},
    "gateway.store": {"gateway.store", "gateway.core", "agent_cache"},
    "gateway.cluster": {"gateway.cluster", "gateway.core", "agent_cache"},
    "platforms": {"platforms", "gateway.core"},
    "gateway.ops": {"gateway", "platforms", "agent_cache"},
}
# The session core does no I/O of its own: no network clients, no web framework.
CORE_FORBIDDEN = ("redis", "aiohttp", "telegram", "discord", "sqlite3")


def _layer(module: str) -> str | None:
    return max((layer for layer in ALLOWED if module == layer or module.startswith(layer + ".")),
               key=len, default=None)


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


def _modules() -> list[tuple[str, Path]]:
    out = []
    for package in ("gateway", "platforms", "agent_cache"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out.append((".".join(p for p in parts if p != "__init__"), path))
    return out


def test_every_module_belongs_to_a_layer() -> None:
    orphans = [m for m, _ in _modules() if _layer(m) is None and m not in ("gateway", "gateway.__main__")]
    assert orphans == []


def test_dependencies_only_point_down() -> None:
    wrong = []
    for module, path in _modules():
        layer = _layer(module)
        if layer is None:
            continue
        for imported in _imports(path):
            if imported.split(".")[0] not in OURS:
                continue
            if not any(imported == a or imported.startswith(a + ".") for a in ALLOWED[layer]):
                wrong.append(f"{module} imports {imported}")
    assert wrong == []


def test_the_core_does_no_io_of_its_own() -> None:
    wrong = [f"{m} imports {i}" for m, path in _modules() if _layer(m) == "gateway.core"
             for i in _imports(path) if i.split(".")[0] in CORE_FORBIDDEN]
    assert wrong == []


def _targets(module: str, path: Path, ours: set[str]) -> set[str]:
    """The modules of ours that `module` imports anywhere in it: at the top, in a function, or
    under `if TYPE_CHECKING:` (a cycle hidden there is still two modules that need each other).
    `from x import y` is an import of `x.y` when that is a module, else of `x`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package `level - 1` steps up
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in ours else base for a in node.names}
    return found & ours


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module, and modules that import themselves
    (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while (w := stack.pop()) != v:
                component.add(w)
            component.add(v)
            if len(component) > 1 or v in graph[v]:
                cycles.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_module_imports_itself_back() -> None:
    """No import cycle among our modules, not even one that only type checking sees: two modules
    that need each other are one module in two files (a narrow `Protocol` on the importer's side
    breaks such a pair)."""
    modules = dict(_modules())
    graph = {m: _targets(m, path, set(modules)) for m, path in modules.items()}
    assert [sorted(c) for c in _cycles(graph)] == []


def test_the_cycle_check_sees_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _cycles({"a": {"a"}, "b": set()}) == [{"a"}]
    assert _cycles({"a": {"b"}, "b": set()}) == []
