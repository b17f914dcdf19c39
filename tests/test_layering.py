"""The import layering: cli -> bench -> the modules below, one way (no cycles).

Reads every module of the package (imports inside functions included, since a lazy
import is still a dependency) and builds the graph among mtpkern modules."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import mtpkern

ROOT = Path(mtpkern.__file__).parent

#: the command line, the benchmarks and the backends: no import cycle may pass through them
LAYERED = ("mtpkern.cli", "mtpkern.bench", "mtpkern.bench_torch", "mtpkern.timing", "mtpkern.progress",
           "mtpkern.synthetic", "mtpkern.argtypes", "mtpkern.errors", "mtpkern.backends")


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = ("mtpkern",) + p.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(pkg[: len(pkg) - node.level + 1]) if node.level else ""
                mod = ".".join(p for p in (base, node.module or "") if p)
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods]
                # "from . import x" of a submodule depends on x (the package is already loading)
                targets = subs if subs and len(subs) == len(node.names) else [mod] + subs
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in mods and t != name}
        graph[name] = deps
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for d in graph[todo.pop()] - seen:
            seen.add(d)
            todo.append(d)
    return seen


def test_bench_and_cli_import_one_way():
    g = _graph()
    assert "mtpkern.bench" in _reachable(g, "mtpkern.cli")
    assert "mtpkern.bench_acceptance" in _reachable(g, "mtpkern.cli")
    for low in ("mtpkern.bench", "mtpkern.bench_acceptance", "mtpkern.bench_torch", "mtpkern.timing",
                "mtpkern.progress", "mtpkern.synthetic", "mtpkern.argtypes"):
        assert "mtpkern.cli" not in _reachable(g, low), low
    for low in ("mtpkern.timing", "mtpkern.progress", "mtpkern.synthetic", "mtpkern.argtypes"):
        assert not {"mtpkern.bench", "mtpkern.bench_torch"} & _reachable(g, low), low


def test_no_import_cycle_anywhere():
    g = _graph()
    for name in g:
        assert name not in _reachable(g, name), f"{name} imports itself through a cycle"


#: the core's layers, bottom up: nothing reaches a layer above its own
CORE = [("mtpkern.checks", "mtpkern.kv"), ("mtpkern.head",),
        ("mtpkern.state", "mtpkern.exact", "mtpkern.draft", "mtpkern.carry", "mtpkern.txn"),
        ("mtpkern.proposer", "mtpkern.target"), ("mtpkern.loop",), ("mtpkern.testing",)]


@pytest.mark.parametrize("level", range(len(CORE) - 1))
def test_the_core_imports_downwards_only(level):
    g = _graph()
    above = {m for layer in CORE[level + 1:] for m in layer}
    for name in CORE[level]:
        reach = _reachable(g, name)
        assert not {m for m in reach if m.startswith(tuple(above))}, f"{name} reaches {sorted(reach & above)}"


@pytest.mark.parametrize("name", sorted(m.name for m in pkgutil.walk_packages(mtpkern.__path__, "mtpkern.")
                                        if m.name not in ("mtpkern.__main__", "mtpkern.bench_torch",
                                                           "mtpkern.integrations._hf_torch")))
def test_every_module_imports(name):
    importlib.import_module(name)
