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
