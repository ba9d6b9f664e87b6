"""Replay a graph into the current trace: the one interpreter every transform is built on.

A transform is a graph -> graph pass that replays its input graph into a fresh trace while
emitting extra (or different) nodes; calling a transformed function inside ``jit`` or another
transform replays (inlines) the transformed graph into the enclosing trace.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ..graph import Graph, TensorType, Value
from .trace import Trace, bind, current_trace, tracing


def replay(graph: Graph, inputs: Sequence[Any],
           visit: Callable[[int, list], list] | None = None) -> dict[Value, Any]:
    """Bind every node of ``graph`` on ``inputs`` (tracers of the current trace).

    Returns the environment: graph value -> tracer. ``visit(n, operands)``, if given, replaces
    the default binding of node ``n`` (it returns the node's output tracers).
    """
    env: dict[Value, Any] = {}
    trace = current_trace()
    builder = trace.builder
    made: dict[int, int] = {}  # graph node -> the node replaying it (for control edges)
    for n in graph.order:
        node = graph.node(n)
        if node.prim == "input":
            env[Value(n, 0)] = inputs[node.kwargs["index"]]
            continue
        operands = [env[v] for v in graph.operands(n)]
        with trace.provenance_of(node.provenance):  # the user's op and line, kept
            if visit is not None:
                outs = visit(n, operands)
            else:
                outs = bind(node.prim, *operands, **node.kwargs)
                outs = list(outs) if isinstance(outs, tuple) else [outs]
        made[n] = builder.last_node
        for p in graph.control_preds(n):  # keep the graph's ordering constraints
            if p in made and made[p] != made[n]:
                builder.add_control_edge(made[p], made[n])
        for i, out in enumerate(outs):
            env[Value(n, i)] = out
    return env


def inline(graph: Graph, inputs: Sequence[Any]) -> list:
    """The outputs of ``graph`` applied to ``inputs``, as tracers of the current trace."""
    env = replay(graph, inputs)
    return [env[v] for v in graph.outputs]


def graph_of(fn: Callable, types: Sequence[TensorType]) -> Graph:
    """The graph of ``fn`` (torch calls or ``bind`` on tracers, returning a sequence of
    them) applied to fresh inputs of ``types``: a rule's body, given everything it reads."""
    trace = Trace()
    with tracing(trace):
        outs = fn(*[trace.new_input(t) for t in types])
        return trace.builder.build([trace.value_of(x) for x in outs])
