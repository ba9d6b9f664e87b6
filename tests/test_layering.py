"""The import graph of plait's own modules keeps the layering docs/architecture.md describes:
each module imports only modules of its layer or below (function-level imports included),
the passes and the backends stand side by side without importing each other, and no
modules import each other in a cycle."""
from __future__ import annotations

import ast
import os

import networkx as nx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("graph", "tracer", "passes", "backends", "compiler")

# from the bottom; a top-level module not named here is the api layer's
LAYERS = {"errors": 0, "config": 0, "graph": 1, "tracer": 2, "passes": 3, "backends": 3,
          "compiler": 4}
API = 5


def _modules() -> dict[str, str]:
    """Module name (relative to plait: ``tracer.trace``, ``api``, ``""`` for the package)
    -> its file."""
    found = {}
    for folder in ("", *PACKAGES):
        for entry in os.scandir(os.path.join(ROOT, folder)):
            if entry.name.endswith(".py"):
                stem = entry.name[:-3]
                name = folder if stem == "__init__" else ".".join(filter(None, (folder, stem)))
                found[name] = entry.path
    return found


def _imports(name: str, path: str, modules: dict) -> set[str]:
    """The plait modules ``name`` imports anywhere in its file."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:
            if not (node.module or "").startswith("plait"):
                continue
            base = node.module[len("plait."):] if node.module != "plait" else ""
        else:
            parts = package.split(".") if package else []
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        for alias in node.names:
            full = ".".join(filter(None, (base, alias.name)))
            target = full if full in modules else base
            if target in modules and target != name:
                out.add(target)
    return out


def _layer(name: str) -> int:
    return LAYERS.get(name.split(".")[0], API) if name else API


def _graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    graph.add_edges_from((name, target) for name, path in modules.items()
                         for target in _imports(name, path, modules))
    return graph


def test_the_import_graph_is_read():
    graph = _graph()
    assert {"api", "tracer.trace", "passes.autodiff", "backends.cpp", "compiler.pipeline"} \
        <= set(graph)
    assert graph.has_edge("api", "compiler.pipeline")
    assert graph.has_edge("backends.cpp", "backends.toolchain")
    assert graph.has_edge("tracer.primitives", "tracer.trace")  # a function-level import too


def test_no_module_imports_a_layer_above_its_own():
    upward = sorted((a, b) for a, b in _graph().edges if _layer(b) > _layer(a))
    assert upward == []


def test_passes_and_backends_stand_side_by_side():
    graph = _graph()
    across = sorted((a, b) for a, b in graph.edges
                    if {a.split(".")[0], b.split(".")[0]} == {"passes", "backends"})
    assert across == []


def test_no_import_cycles():
    cycles = [sorted(c) for c in nx.strongly_connected_components(_graph()) if len(c) > 1]
    assert cycles == []
