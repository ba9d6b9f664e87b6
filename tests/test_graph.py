"""The graph: immutability, control edges, validation, the printer, stable hashing."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import attrs
import networkx as nx
import pytest
import torch

import plait
from plait.errors import GraphError
from plait.graph import CONTROL, DATA, Graph, GraphBuilder, Node, TensorType, Value
from plait.compiler import simplified, snapshot
from plait.passes import cse, dce, fold_constants
from plait.tracer import get_primitive

F32_4 = TensorType((4,), torch.float32)


def _node(b: GraphBuilder, prim: str, *operands: Value, after=(), **params) -> Value:
    """Add a single-output node typed by its primitive's own rule."""
    out_types = get_primitive(prim).infer(*[b.type_of(v) for v in operands], **params)
    (v,) = b.add_node(prim, operands, params, out_types, after=after)
    return v


def _prim_edges(graph: Graph) -> list[tuple[str, str]]:
    """Control edges as (prim of predecessor, prim of successor), robust to renumbering."""
    return sorted((graph.node(u).prim, graph.node(v).prim) for u, v in graph.control_edges())


def _f_small(x, y):
    return torch.exp(x) * y + 1


# ---------------------------------------------------------------------------------------
# Immutability
# ---------------------------------------------------------------------------------------
@pytest.fixture
def traced():
    return plait.make_graph(_f_small)(torch.randn(4, 8), torch.randn(8))


def test_networkx_graph_is_frozen(traced):
    g = traced.nx
    assert nx.is_frozen(g)
    n0 = next(iter(g.nodes))
    before = traced.as_text()
    with pytest.raises(nx.NetworkXError):
        g.add_node(10_000)
    with pytest.raises(nx.NetworkXError):
        g.add_edge(n0, n0, kind=DATA, operand=0, index=0)
    with pytest.raises(nx.NetworkXError):
        g.remove_node(n0)
    with pytest.raises(nx.NetworkXError):
        g.remove_edge(*next(iter(g.edges())))
    with pytest.raises(nx.NetworkXError):
        g.clear()
    assert traced.as_text() == before


def test_node_payloads_are_frozen(traced):
    n = traced.order[-1]
    node = traced.node(n)
    assert isinstance(node, Node)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        node.prim = "neg"
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        node.out_types = ()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        node.out_types[0].shape = (1,)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        traced.outputs[0].node = 0
    # params are tuples, so a node cannot be changed through them either
    assert isinstance(node.params, tuple)
    hash(node)


def test_graph_inputs_outputs_are_tuples(traced):
    assert isinstance(traced.inputs, tuple)
    assert isinstance(traced.outputs, tuple)
    assert [str(t) for t in traced.input_types] == ["f32[4,8]", "f32[8]"]
    assert [str(t) for t in traced.output_types] == ["f32[4,8]"]


def simplify(graph):
    """The whole simplification: the driver's graph stages."""
    return simplified(graph, snapshot())


@pytest.mark.parametrize("pass_", [dce, cse, fold_constants, simplify])
def test_pass_returns_new_graph_and_leaves_input_unchanged(pass_):
    def f(x):
        unused = torch.sin(x)  # noqa: F841  (dead: dce has work)
        a = torch.exp(x) + torch.exp(x)  # duplicate: cse has work
        # ops on constants only: fold_constants has work
        return a + torch.ones_like(x) * torch.arange(4.0)

    graph = plait.jit(f).lower(torch.randn(4)).traced_graph
    before_text, before_digest = graph.as_text(), graph.digest
    before_nodes = {n: graph.node(n) for n in graph.nx.nodes}
    before_edges = sorted(graph.nx.edges(keys=True, data="kind"))
    out = pass_(graph)
    assert isinstance(out, Graph)
    assert out is not graph
    assert out.as_text() != before_text
    assert graph.as_text() == before_text
    assert graph.digest == before_digest
    assert {n: graph.node(n) for n in graph.nx.nodes} == before_nodes
    assert sorted(graph.nx.edges(keys=True, data="kind")) == before_edges
    out.validate()


# ---------------------------------------------------------------------------------------
# Control edges and validation
# ---------------------------------------------------------------------------------------
def _control_graph() -> Graph:
    b = GraphBuilder()
    x = b.add_input(F32_4)
    a = _node(b, "neg", x)
    e = _node(b, "exp", x, after=[a.node])
    return b.build([e])


def test_control_edge_printed_as_after():
    g = _control_graph()
    text = g.as_text()
    assert "%1: f32[4] = neg(%0)" in text
    assert "%2: f32[4] = exp(%0) after(%1)" in text
    assert g.control_edges() == [(1, 2)]
    assert g.control_preds(2) == (1,)
    # a control edge is not a data dependency
    assert g.operands(2) == (Value(0, 0),)
    assert g.users(1) == ()
    g.validate()


def test_add_control_edge_equals_after():
    b = GraphBuilder()
    x = b.add_input(F32_4)
    a = _node(b, "neg", x)
    e = _node(b, "exp", x)
    b.add_control_edge(a.node, e.node)
    g = b.build([e])
    assert g.as_text() == _control_graph().as_text()
    assert g.digest == _control_graph().digest
    kinds = [k for _, _, k in g.nx.edges(data="kind")]
    assert sorted(kinds) == sorted([DATA, DATA, CONTROL])


def test_control_edge_changes_digest():
    b = GraphBuilder()
    x = b.add_input(F32_4)
    _node(b, "neg", x)
    e = _node(b, "exp", x)
    without = b.build([e])
    assert without.digest != _control_graph().digest


def test_validate_passes_on_good_graph():
    b = GraphBuilder()
    x = b.add_input(F32_4)
    y = b.add_input(F32_4)
    s = _node(b, "add", x, y)
    m = _node(b, "mul", s, x, after=[s.node])
    r = _node(b, "sum", m, dims=(0,))
    g = b.build([r, m])
    assert g.validate() is g


def test_validate_rejects_cycle_through_control_edge():
    b = GraphBuilder()
    x = b.add_input(F32_4)
    a = _node(b, "neg", x)
    e = _node(b, "exp", a)       # data edge a -> e
    b.add_control_edge(e.node, a.node)  # control edge e -> a closes a cycle
    g = b.build([e])
    with pytest.raises(GraphError, match="cycle"):
        g.validate()


def test_validate_rejects_wrong_out_types():
    b = GraphBuilder()
    x = b.add_input(F32_4)
    (bad,) = b.add_node("neg", [x], {}, [TensorType((3,), torch.float32)])
    with pytest.raises(GraphError, match="neg"):
        b.build([bad]).validate()
    b = GraphBuilder()
    x = b.add_input(F32_4)
    (bad,) = b.add_node("exp", [x], {}, [TensorType((4,), torch.float64)])
    with pytest.raises(GraphError):
        b.build([bad]).validate()


def test_validate_rejects_bad_output_value():
    b = GraphBuilder()
    x = b.add_input(F32_4)
    e = _node(b, "exp", x)
    with pytest.raises(GraphError):
        b.build([Value(e.node, 1)]).validate()


def test_validate_rejects_operand_mismatch():
    b = GraphBuilder()
    x = b.add_input(F32_4)
    y = b.add_input(TensorType((5,), torch.float32))
    (bad,) = b.add_node("add", [x, y], {}, [F32_4])
    with pytest.raises(plait.PlaitError):
        b.build([bad]).validate()


def _rich_control_graph() -> Graph:
    """x -> sin (dead), neg, neg (duplicate), exp(x) after the duplicate neg,
    exp(constant) after neg (would be foldable without its control edge), output."""
    b = GraphBuilder()
    x = b.add_input(F32_4)
    _node(b, "sin", x)                                  # dead
    a = _node(b, "neg", x)
    a2 = _node(b, "neg", x)                             # duplicate of a
    e = _node(b, "exp", x, after=[a2.node])
    c = _node(b, "constant", value=plait.graph.Constant(torch.arange(4.0)))
    ec = _node(b, "exp", c, after=[a.node])             # constant operand, but ordered
    out = _node(b, "add", e, ec)
    return b.build([out])


@pytest.mark.parametrize("pass_", [dce, cse, fold_constants, simplify])
def test_passes_keep_control_edges(pass_):
    g = _control_graph()
    out = pass_(g).validate()
    # the neg node has no data users, but is kept for its control edge
    assert _prim_edges(out) == [("neg", "exp")]
    assert "after(%1)" in out.as_text()

    rich = _rich_control_graph().validate()
    out = pass_(rich).validate()
    edges = _prim_edges(out)
    assert len(edges) == 2
    assert all(u == "neg" for u, _ in edges)
    assert all(v == "exp" for _, v in edges)
    # every control edge joins nodes of the result graph
    for u, v in out.control_edges():
        assert u in out.nx and v in out.nx
    # the exp of a constant has a control predecessor: it must not be folded away
    assert any(out.node(n).prim == "exp" and out.node(out.operands(n)[0].node).prim == "constant"
               for n in out.nx.nodes)


def test_cse_does_not_merge_nodes_with_different_control_preds():
    b = GraphBuilder()
    x = b.add_input(F32_4)
    a = _node(b, "neg", x)
    e1 = _node(b, "exp", x, after=[a.node])
    e2 = _node(b, "exp", x)
    out = _node(b, "add", e1, e2)
    g = b.build([out])
    merged = cse(g).validate()
    assert sum(1 for n in merged.nx.nodes if merged.node(n).prim == "exp") == 2
    assert _prim_edges(merged) == [("neg", "exp")]
    assert simplify(g).validate().as_text().count("= exp(") == 2


def test_cse_merges_nodes_with_same_control_preds():
    b = GraphBuilder()
    x = b.add_input(F32_4)
    a = _node(b, "neg", x)
    e1 = _node(b, "exp", x, after=[a.node])
    e2 = _node(b, "exp", x, after=[a.node])
    out = _node(b, "add", e1, e2)
    merged = cse(b.build([out])).validate()
    assert sum(1 for n in merged.nx.nodes if merged.node(n).prim == "exp") == 1
    assert _prim_edges(merged) == [("neg", "exp")]


def _zero_output_pred_graph(dead_first: bool = False) -> Graph:
    """An effectful node with no result (a runtime check) that must run before an exp."""
    b = GraphBuilder()
    x = b.add_input(F32_4)
    if dead_first:
        _node(b, "sin", x)
    assert b.add_node("opaque", [x], {"op": torch.ops.aten._assert_async.default,
                                      "template": ((), ()), "out_types": ()}, ()) == []
    check = b._next_id - 1  # add_node returns no Value for a node without outputs
    e = _node(b, "exp", x, after=[check])
    return b.build([e])


def test_control_edge_from_zero_output_node_printed_canonically():
    g = _zero_output_pred_graph().validate()
    assert [(g.node(u).prim, g.node(v).prim) for u, v in g.control_edges()] == [
        ("opaque", "exp")]
    text = g.as_text(provenance=False)
    assert "after(" in text
    # the printer renumbers values; a raw node id would make the text depend on creation
    assert "#" not in text, text


@pytest.mark.parametrize("pass_", [dce, cse, fold_constants, simplify])
def test_passes_keep_control_edge_from_zero_output_node(pass_):
    for g in (_zero_output_pred_graph(), _zero_output_pred_graph(dead_first=True)):
        out = pass_(g).validate()
        assert _prim_edges(out) == [("opaque", "exp")]
        assert all(n is not None for n in out.nx.nodes)


# ---------------------------------------------------------------------------------------
# Printer
# ---------------------------------------------------------------------------------------
def _printer_fn(x, w):
    h = torch.exp(x)
    return torch.sum(h * w, dim=1)


def test_printer_text():
    x, w = torch.randn(4, 8), torch.randn(8)
    text = plait.make_graph(_printer_fn)(x, w).as_text()
    lines = text.splitlines()
    assert lines[0].startswith("graph(")
    assert "%0: f32[4,8]" in lines[0] and "%1: f32[8]" in lines[0]
    assert lines[-1] == "}"
    assert lines[-2].strip().startswith("return (") and lines[-2].strip().endswith(")")
    for prim in ("exp", "broadcast_in_dim", "mul", "sum"):
        assert f"= {prim}" in text, prim
    assert "f32[4]" in text  # the result type


def test_printer_provenance_names_aten_op_and_user_line():
    x, w = torch.randn(4, 8), torch.randn(8)
    text = plait.make_graph(_printer_fn)(x, w).as_text()
    _, first = inspect.getsourcelines(_printer_fn)
    exp_line, sum_line = first + 1, first + 2
    exp_stmt = next(line for line in text.splitlines() if "= exp(" in line)
    assert "aten.exp" in exp_stmt
    assert f"test_graph.py:{exp_line}" in exp_stmt
    sum_stmt = next(line for line in text.splitlines() if "= sum[" in line)
    assert "aten.sum" in sum_stmt
    assert f"test_graph.py:{sum_line}" in sum_stmt
    mul_stmt = next(line for line in text.splitlines() if "= mul(" in line)
    assert "aten.mul" in mul_stmt and f"test_graph.py:{sum_line}" in mul_stmt


def test_printer_without_provenance():
    x, w = torch.randn(4, 8), torch.randn(8)
    g = plait.make_graph(_printer_fn)(x, w)
    plain = g.as_text(provenance=False)
    assert "#" not in plain and "test_graph.py" not in plain and "aten." not in plain
    # the same statements, comments stripped
    stripped = [line.split("  # ")[0] for line in g.as_text().splitlines()]
    assert stripped == plain.splitlines()


def test_provenance_config_off():
    with plait.config.patch(provenance=False):
        text = plait.make_graph(_printer_fn)(torch.randn(4, 8), torch.randn(8)).as_text()
    assert "test_graph.py" not in text
    assert "aten.exp" in text


# ---------------------------------------------------------------------------------------
# Stable hashing
# ---------------------------------------------------------------------------------------
def _hash_fn(x):
    return torch.softmax(x * 3.0, dim=-1).cumsum(0)


def test_digest_equal_for_separate_traces():
    g1 = plait.make_graph(_hash_fn)(torch.randn(4, 8))
    g2 = plait.make_graph(_hash_fn)(torch.randn(4, 8))
    assert g1 is not g2
    assert g1.digest == g2.digest
    assert g1 == g2 and hash(g1) == hash(g2)
    assert len(g1.digest) == 64


def test_digest_ignores_provenance():
    def other_line(x):
        return torch.softmax(x * 3.0, dim=-1).cumsum(0)

    a = plait.make_graph(_hash_fn)(torch.randn(4, 8))
    b = plait.make_graph(other_line)(torch.randn(4, 8))
    assert a.as_text() != b.as_text()
    assert a.digest == b.digest


def test_digest_differs_on_shape_dtype_and_constants():
    base = plait.make_graph(_hash_fn)(torch.randn(4, 8)).digest
    assert plait.make_graph(_hash_fn)(torch.randn(4, 9)).digest != base
    assert plait.make_graph(_hash_fn)(torch.randn(4, 8, dtype=torch.float64)).digest != base

    def scaled(s):
        return lambda x: torch.softmax(x * s, dim=-1).cumsum(0)

    assert plait.make_graph(scaled(3.0))(torch.randn(4, 8)).digest == base
    assert plait.make_graph(scaled(2.0))(torch.randn(4, 8)).digest != base


def test_digest_follows_constant_content():
    def adder(changed):
        def f(x):
            c = torch.arange(float(big))  # made inside: a constant
            if changed:
                c[1234] = -1.0
            return x * c
        return f

    big = 10_000  # above fold_max_numel, so the constant stays a constant
    x = torch.randn(big)
    d1 = plait.make_graph(adder(False))(x).digest
    d2 = plait.make_graph(adder(False))(x).digest
    d3 = plait.make_graph(adder(True))(x).digest
    assert d1 == d2
    assert d1 != d3


def _relabeled(g: Graph, shift: int) -> Graph:
    """The same graph with every node id shifted: only creation ids differ."""
    moved = nx.relabel_nodes(nx.MultiDiGraph(g.nx), {n: n + shift for n in g.nx.nodes})
    return Graph(moved, [n + shift for n in g.inputs],
                 [Value(v.node + shift, v.index) for v in g.outputs])


def test_digest_independent_of_node_ids():
    g = plait.make_graph(_hash_fn)(torch.randn(4, 8))
    moved = _relabeled(g, 1000).validate()
    assert moved.as_text() == g.as_text()
    assert moved.digest == g.digest
    ctrl = _control_graph()
    assert _relabeled(ctrl, 7).digest == ctrl.digest


def test_digest_independent_of_node_ids_with_zero_output_pred():
    g = _zero_output_pred_graph()
    assert _relabeled(g, 1000).digest == g.digest


def _device_free_fn(x, y):
    return torch.tanh(x) * y  # no op here takes a device parameter


def test_digest_differs_on_device():
    cpu = plait.make_graph(_device_free_fn)(torch.randn(4, 8), torch.randn(4, 8))
    meta = plait.make_graph(_device_free_fn)(torch.randn(4, 8, device="meta"),
                                             torch.randn(4, 8, device="meta"))
    assert cpu.input_types[0].device == "cpu" and meta.input_types[0].device == "meta"
    assert cpu.digest != meta.digest
    assert cpu != meta


_DIGEST_SCRIPT = textwrap.dedent("""
    import torch, plait
    c = torch.linspace(-1.0, 1.0, 8)
    def f(x, y):
        h = torch.tanh(x @ y) + c
        return torch.softmax(h, dim=-1).sum(0), h.amax(1)
    x, y = torch.randn(4, 6), torch.randn(6, 8)
    print(plait.make_graph(f)(x, y).digest)
""")


def test_digest_stable_across_processes():
    namespace: dict = {}
    exec(compile(_DIGEST_SCRIPT, "<digest-script>", "exec"), namespace)  # prints; fine
    here = plait.make_graph(namespace["f"])(torch.randn(4, 6), torch.randn(6, 8)).digest
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", _DIGEST_SCRIPT], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == here


def test_a_control_edge_is_added_once():
    """Replaying a graph into a trace that chains effects itself may ask for an edge that is
    already there; the graph keeps each control edge once."""
    b = GraphBuilder()
    (x,) = b.add_node("input", (), {"index": 0}, (TensorType((3,), torch.float32),))
    (y,) = b.add_node("neg", (x,), {}, (TensorType((3,), torch.float32),))
    b.add_control_edge(x.node, y.node)
    b.add_control_edge(x.node, y.node)
    kinds = [d["kind"] for d in b.build([y]).nx.get_edge_data(x.node, y.node).values()]
    assert sorted(kinds) == [CONTROL, DATA]
