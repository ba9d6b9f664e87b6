"""The immutable primitive graph and the builder that makes one.

NOTE [graph representation]
A graph is a frozen ``networkx.MultiDiGraph`` whose nodes are integer ids carrying a ``Node``
payload (attribute ``"node"``). A *data edge* ``u -> v`` has ``kind="data"``, ``operand=i``
(which operand of ``v``) and ``index=j`` (which output of ``u``); a multigraph because one value
may feed several operands of one node. A *control edge* has ``kind="control"``: ``u`` must run
before ``v`` though no data flows. Graph inputs are ``input`` nodes, captured tensors are
``constant`` nodes, so every operand is an edge. The ``Graph`` wrapper adds what networkx does
not know: the ordered inputs and outputs, and caches (operands, topological order) that are safe
because nothing can change after construction.
"""
from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable, Iterable, Mapping, Sequence

import attrs
import networkx as nx

from ..errors import GraphError
from .types import CONTROL, DATA, Node, Provenance, TensorType, Value

# primitive name -> its shape and dtype rule (or None), which ``Graph.validate`` checks nodes
# against: the tracer's primitive table (tracer/primitives.py) registers each primitive here,
# so the IR knows the rules by name without importing the layer above it.
TYPE_RULES: dict[str, Callable | None] = {}



class Graph:
    """An immutable dataflow graph of primitives with ordered inputs and outputs."""

    __slots__ = ("_g", "_inputs", "_outputs", "_known", "__dict__")

    def __init__(self, g: nx.MultiDiGraph, inputs: Sequence[int], outputs: Sequence[Value],
                 wiring: tuple[dict, dict] | None = None):
        self._g = nx.freeze(g)
        self._inputs = tuple(inputs)
        self._outputs = tuple(outputs)
        self._known = wiring  # (operands, control preds) per node, as the builder recorded

    # -- structure -------------------------------------------------------------------------
    @property
    def nx(self) -> nx.MultiDiGraph:
        """The underlying (frozen) networkx graph."""
        return self._g

    @property
    def inputs(self) -> tuple[int, ...]:
        return self._inputs

    @property
    def outputs(self) -> tuple[Value, ...]:
        return self._outputs

    def node(self, n: int) -> Node:
        return self._g.nodes[n]["node"]

    def type_of(self, value: Value) -> TensorType:
        return self.node(value.node).out_types[value.index]

    @property
    def input_types(self) -> tuple[TensorType, ...]:
        return tuple(self.node(n).out_types[0] for n in self._inputs)

    @property
    def output_types(self) -> tuple[TensorType, ...]:
        return tuple(self.type_of(v) for v in self._outputs)

    @functools.cached_property
    def _wiring(self) -> tuple[dict, dict, dict]:
        """Operands, control predecessors and data users of every node: the builder's record,
        or one sweep over the edges (networkx's per-node edge views cost more than the passes
        that ask)."""
        if self._known is not None:
            operands, preds = self._known
        else:
            slots: dict[int, dict[int, Value]] = {n: {} for n in self._g.nodes}
            preds = {n: set() for n in self._g.nodes}
            for u, v, data in self._g.edges(data=True):
                if data["kind"] == DATA:
                    slots[v][data["operand"]] = Value(u, data["index"])
                else:
                    preds[v].add(u)
            operands = {n: tuple(s[i] for i in range(len(s))) for n, s in slots.items()}
        users: dict[int, set[int]] = {n: set() for n in operands}
        for n, values in operands.items():
            for v in values:
                users[v.node].add(n)
        return (operands, {n: tuple(sorted(p)) for n, p in preds.items()},
                {n: tuple(sorted(u)) for n, u in users.items()})

    def operands(self, n: int) -> tuple[Value, ...]:
        return self._wiring[0][n]

    def control_preds(self, n: int) -> tuple[int, ...]:
        return self._wiring[1][n]

    def control_edges(self) -> list[tuple[int, int]]:
        return sorted({(u, v) for u, v, k in self._g.edges(data="kind") if k == CONTROL})

    def users(self, n: int) -> tuple[int, ...]:
        return self._wiring[2][n]

    @functools.cached_property
    def order(self) -> tuple[int, ...]:
        """A deterministic topological order (ties broken by creation order): the ids in
        ascending order where every edge runs from a smaller id to a larger (a builder adds a
        node after its operands, so nearly always), else networkx's lexicographical sort."""
        ids = tuple(sorted(self._g.nodes))
        if all(u < v for u, v in self._g.edges()):
            return ids
        return tuple(nx.lexicographical_topological_sort(self._g))

    def __len__(self) -> int:
        return self._g.number_of_nodes()

    # -- checks, text, hash ----------------------------------------------------------------
    def validate(self) -> "Graph":
        """Check acyclicity, operand wiring and types; return self or raise GraphError."""
        if not nx.is_directed_acyclic_graph(self._g):
            raise GraphError(f"graph has a cycle: {nx.find_cycle(self._g)}")
        for n in self._g.nodes:
            node = self.node(n)
            if node.prim not in TYPE_RULES:
                raise GraphError(f"unknown primitive {node.prim!r}")
            infer = TYPE_RULES[node.prim]
            operands = self.operands(n)
            for v in operands:
                if v.index >= len(self.node(v.node).out_types):
                    raise GraphError(f"node %{n} ({node.prim}) reads output {v.index} of "
                                     f"%{v.node}, which has {len(self.node(v.node).out_types)}")
            if infer is not None:
                expected = infer(*[self.type_of(v) for v in operands], **node.kwargs)
                if tuple(expected) != node.out_types:
                    raise GraphError(f"node %{n} ({node.prim}) is typed "
                                     f"{[str(t) for t in node.out_types]} but its rule gives "
                                     f"{[str(t) for t in expected]}")
        for v in self._outputs:
            if v.node not in self._g or v.index >= len(self.node(v.node).out_types):
                raise GraphError(f"graph output {v} is not a value of the graph")
        return self

    def as_text(self, provenance: bool = True) -> str:
        from .printer import graph_to_text

        return graph_to_text(self, provenance=provenance)

    def __str__(self) -> str:
        return self.as_text()

    def draw(self, path, groups: Mapping[int, str] | None = None, engine: str = "auto"):
        """Write an SVG drawing to ``path``; ``groups`` (node -> name) draws clusters.
        See NOTE [drawing] in ``graph/draw.py``."""
        from .draw import draw

        return draw(self, path, groups, engine)

    def to_dot(self, groups: Mapping[int, str] | None = None) -> str:
        """The graph as Graphviz DOT text."""
        from .draw import to_dot

        return to_dot(self, groups)

    def donating(self, positions) -> "Graph":
        """This graph with the inputs at ``positions`` marked donated (``add_input``)."""
        return self._marking({i: {"donated": True} for i in positions})

    def updating(self, positions: Sequence[int], first_output: int) -> "Graph":
        """This graph with the input at ``positions[j]`` marked as updated by output
        ``first_output + j`` (``add_input``)."""
        return self._marking({i: {"updated_by": first_output + j}
                              for j, i in enumerate(positions)})

    def _marking(self, marks: dict[int, dict]) -> "Graph":
        if not marks:
            return self
        g = self._g.copy()
        for i, mark in marks.items():
            node = self.node(self._inputs[i])
            g.nodes[self._inputs[i]]["node"] = attrs.evolve(
                node, params=Node.make_params(node.kwargs | mark))
        return Graph(g, self._inputs, self._outputs)

    def __repr__(self) -> str:
        return f"<plait.Graph: {len(self)} nodes, {len(self._inputs)} inputs, " \
               f"{len(self._outputs)} outputs>"

    @functools.cached_property
    def digest(self) -> str:
        """Stable across processes: the canonical text (types with devices, constants by
        content digest, no provenance)."""
        from .printer import graph_to_text

        return hashlib.sha256(graph_to_text(self, canonical=True).encode()).hexdigest()

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Graph) and self.digest == other.digest


class GraphBuilder:
    """Mutable construction side of a Graph; ``build`` freezes it."""

    def __init__(self):
        self._g = nx.MultiDiGraph()  # handed to the Graph that ``build`` makes; copied on write
        self._next_id = 0
        self.inputs: list[int] = []
        self._operands: dict[int, tuple[Value, ...]] = {}
        self._preds: dict[int, set[int]] = {}

    @property
    def last_node(self) -> int:
        """Id of the node added last (the handle of a node with no outputs)."""
        return self._next_id - 1

    def add_node(self, prim: str, operands: Sequence[Value], params: dict[str, Any],
                 out_types: Sequence[TensorType], provenance: Provenance = Provenance(),
                 after: Iterable[int] = ()) -> list[Value]:
        n = self._next_id
        self._next_id += 1
        self._writable().add_node(n, node=Node(prim, Node.make_params(params), tuple(out_types), provenance))
        self._operands[n], self._preds[n] = tuple(operands), set()
        for i, v in enumerate(operands):
            self._g.add_edge(v.node, n, kind=DATA, operand=i, index=v.index)
        for u in after:
            self.add_control_edge(u, n)
        return [Value(n, i) for i in range(len(out_types))]

    def add_input(self, type: TensorType, marks: dict | None = None) -> Value:
        """A graph input. ``marks`` (``input_marks``): ``donated=True``, its memory is the
        compiled code's to write results into (``jit(..., donate_argnums=...)``);
        ``updated_by=k``, output ``k`` is its new value, which the caller writes into it after
        the call (a mutated input), so its memory may hold that output and no other."""
        (value,) = self.add_node("input", (), {"index": len(self.inputs)} | (marks or {}),
                                 (type,))
        self.inputs.append(value.node)
        return value

    def add_control_edge(self, before: int, after: int) -> None:
        """``before`` runs before ``after`` (once: an edge already there is not repeated)."""
        if before not in self._preds[after]:
            self._preds[after].add(before)
            self._writable().add_edge(before, after, kind=CONTROL)

    def node(self, n: int) -> Node:
        return self._g.nodes[n]["node"]

    def type_of(self, value: Value) -> TensorType:
        return self.node(value.node).out_types[value.index]

    def operands(self, n: int) -> tuple[Value, ...]:
        return self._operands[n]

    def ordered(self, n: int) -> bool:
        """Has node ``n`` a control edge in?"""
        return bool(self._preds[n])

    def splice(self, graph: Graph, values: dict[Value, Value], nodes: set[int] | None = None,
               after: Sequence[int] = ()) -> dict[Value, Value]:
        """Copy ``graph``'s nodes (those in ``nodes``, when given) into this builder, in
        program order, where ``values`` maps its values that are given (its inputs, or values
        it is cut at) to this builder's; each copy runs after ``after`` and after the copies
        of its control predecessors. Returns ``values`` with the copies' values added."""
        values, made = dict(values), {}
        for n in graph.order:
            node = graph.node(n)
            if node.prim == "input" or nodes is not None and n not in nodes:
                continue
            outs = self.add_node(node.prim, [values[v] for v in graph.operands(n)], node.kwargs,
                                 node.out_types, node.provenance, after=[
                                     *after, *(made[p] for p in graph.control_preds(n)
                                               if p in made)])
            made[n] = self.last_node
            values.update((Value(n, i), out) for i, out in enumerate(outs))
        return values

    def _writable(self) -> nx.MultiDiGraph:
        if nx.is_frozen(self._g):  # built already: the Graph owns this one
            self._g = self._g.copy()
        return self._g

    def build(self, outputs: Sequence[Value]) -> Graph:
        return Graph(self._g, self.inputs, outputs,
                     (dict(self._operands), {n: set(p) for n, p in self._preds.items()}))


def input_marks(node) -> dict:
    """An input node's marks (``add_input``), carried to a rewritten graph's input."""
    return {k: node.kwargs[k] for k in ("donated", "updated_by") if k in node.kwargs}


def extract(graph: Graph, nodes: Iterable[int], inputs: Sequence[Value | TensorType],
            outputs: Sequence[Value]) -> Graph:
    """The subgraph of ``nodes`` (in program order) whose inputs are ``inputs``: each a value
    of ``graph`` (the graph cut there) or a type (an input that nothing reads)."""
    b = GraphBuilder()
    new = [b.add_input(x) if isinstance(x, TensorType) else b.add_input(graph.type_of(x))
           for x in inputs]
    values = b.splice(graph, {x: v for x, v in zip(inputs, new) if isinstance(x, Value)},
                      set(nodes))
    return b.build([values[v] for v in outputs])


def rewrite(graph: Graph, visit: Callable[[GraphBuilder, int, tuple[Value, ...], tuple[int, ...]],
                                          list[Value] | None] | None = None,
            keep: set[int] | None = None) -> Graph:
    """Rebuild ``graph`` node by node in topological order.

    ``visit(builder, n, operands, control_preds)`` (operands and preds already remapped) may
    return the values that replace node ``n`` (None for one nothing reads); returning None
    copies the node. Nodes outside
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
            new = [b.add_input(node.out_types[0], input_marks(node))]
        else:
            new = visit(b, n, operands, preds) if visit else None
            if new is None:
                new = b.add_node(node.prim, operands, node.kwargs, node.out_types,
                                 node.provenance, after=preds)
        for i, v in enumerate(new):
            values[Value(n, i)] = v  # None: a value nothing reads any more
        ids[n] = next((v.node for v in new if v is not None), b.last_node)
    return b.build([values[v] for v in graph.outputs])
