"""Simplify passes: dead-code elimination, common-subexpression elimination, constant folding.

Each is a pure function Graph -> Graph. They keep every control edge whose ends survive (a
merged node inherits the control edges of the nodes merged into it), and never remove, merge
or fold an effectful node.
"""
from __future__ import annotations

from typing import Callable

import networkx as nx
import torch

from ..config import config
from ..graph import Constant, Graph, GraphBuilder, Value
from ..tracer.primitives import get_primitive, is_effectful


def rewrite(graph: Graph, visit: Callable[[GraphBuilder, int, tuple[Value, ...], tuple[int, ...]],
                                          list[Value] | None] | None = None,
            keep: set[int] | None = None) -> Graph:
    """Rebuild ``graph`` node by node in topological order.

    ``visit(builder, n, operands, control_preds)`` (operands and preds already remapped) may
    return the values that replace node ``n``; returning None copies the node. Nodes outside
    ``keep`` (when given) are dropped; input nodes are always kept.
    """
    b = GraphBuilder()
    values: dict[Value, Value] = {}
    ids: dict[int, int] = {}
    for n in graph.order:
        node = graph.node(n)
        if keep is not None and n not in keep and node.prim != "input":
            continue
        operands = tuple(values[v] for v in graph.operands(n))
        preds = tuple(ids[p] for p in graph.control_preds(n) if p in ids)
        if node.prim == "input":
            new = [b.add_input(node.out_types[0])]
        else:
            new = visit(b, n, operands, preds) if visit else None
            if new is None:
                new = b.add_node(node.prim, operands, node.kwargs, node.out_types,
                                 node.provenance, after=preds)
        for i, v in enumerate(new):
            values[Value(n, i)] = v
        ids[n] = new[0].node if new else b.last_node
    return b.build([values[v] for v in graph.outputs])


def dce(graph: Graph) -> Graph:
    """Drop nodes that no output, effect or control successor needs."""
    roots = {v.node for v in graph.outputs}
    roots |= {n for n in graph.nx.nodes if is_effectful(graph.node(n))}
    live = set(roots)
    for r in roots:
        live |= nx.ancestors(graph.nx, r)
    if len(live | set(graph.inputs)) == len(graph):
        return graph
    return rewrite(graph, keep=live)


def cse(graph: Graph) -> Graph:
    """Merge nodes computing the same primitive with the same params on the same values."""
    seen: dict[tuple, list[Value]] = {}

    def visit(b, n, operands, preds):
        node = graph.node(n)
        if is_effectful(node):
            return None
        key = (node.prim, node.params, operands, preds)
        if key not in seen:
            seen[key] = b.add_node(node.prim, operands, node.kwargs, node.out_types,
                                   node.provenance, after=preds)
        return seen[key]

    return rewrite(graph, visit)


_SOURCES = ("constant", "full", "iota")


def fold_constants(graph: Graph) -> Graph:
    """Evaluate small nodes whose operands are all known at compile time."""
    known: dict[Value, torch.Tensor] = {}  # new-graph value -> its tensor

    def visit(b, n, operands, preds):
        node = graph.node(n)
        small = all(t.numel <= config.fold_max_numel for t in node.out_types)
        if preds or not small or is_effectful(node) or node.prim == "opaque":
            return None
        if node.prim not in _SOURCES and not (operands and all(v in known for v in operands)):
            return None
        if node.prim == "constant":
            out = [node.kwargs["value"].tensor]
        else:
            result = get_primitive(node.prim).impl(*[known[v] for v in operands], **node.kwargs)
            out = list(result) if get_primitive(node.prim).multiple_results else [result]
        if node.prim in _SOURCES:  # keep the cheap generators as they are
            new = b.add_node(node.prim, operands, node.kwargs, node.out_types, node.provenance)
        else:
            new = [b.add_node("constant", (), {"value": Constant(t.contiguous())}, (ty,),
                              node.provenance)[0] for t, ty in zip(out, node.out_types)]
        known.update(zip(new, out))
        return new

    return rewrite(graph, visit)


PASSES: dict[str, Callable[[Graph], Graph]] = {
    "dce": dce, "cse": cse, "fold_constants": fold_constants,
}


PIPELINE = ("dce", "fold_constants", "cse", "dce")


def simplify(graph: Graph, on_pass: Callable[[str, Graph], None] | None = None) -> Graph:
    """The default pipeline: DCE first (less to look at), then fold, CSE, and DCE again.

    ``on_pass(name, graph)`` sees the graph after each pass (the debug report draws them)."""
    for name in PIPELINE:
        graph = PASSES[name](graph)
        if on_pass is not None:
            on_pass(name, graph)
    return graph
