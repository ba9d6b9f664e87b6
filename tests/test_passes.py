"""Simplify passes on traced graphs: DCE, CSE, constant folding, and the whole pipeline."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import plait
from plait.graph import Graph
from plait.compiler import GRAPH_STAGES, simplified, snapshot
from plait.passes import algebra, dce, fold_constants


def prim_count(graph: Graph, prim: str) -> int:
    return sum(1 for n in graph.nx.nodes if graph.node(n).prim == prim)


def _traced(fn, *args) -> Graph:
    """The graph as traced, before any pass, its outputs ``fn``'s results as they are (not in
    eager's layouts: NOTE [eager's layouts of results])."""
    jitted = plait.jit(fn)
    jitted.eager_layouts = False
    return jitted.lower(*args).traced_graph


def _run(graph: Graph, *inputs):
    """Run ``graph`` on the reference backend."""
    return plait.backends.get_backend("eager").factory(graph)(list(inputs))


# ---------------------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------------------
def test_simplify_pipeline_matches_eager():
    def f(x):
        c = torch.linspace(0, 1, 8)
        dead = torch.cos(x)  # noqa: F841
        a = torch.exp(x) + torch.exp(x)
        b = (torch.ones_like(c) + c).reshape(1, 8)
        return (a * b).sum(1)

    x = torch.randn(3, 8)
    traced = _traced(f, x)
    g = simplified(traced, snapshot()).validate()
    assert len(g) < len(traced)
    assert prim_count(g, "cos") == 0 and prim_count(g, "exp") == 1
    assert_close(_run(g, x)[0], f(x))
    assert simplified(g, snapshot()).digest == g.digest  # a fixed point


def test_simplify_disabled_by_config():
    def f(x):
        return torch.exp(x) + torch.exp(x)

    x = torch.randn(3)
    with plait.config.patch(simplify=False):
        lowered = plait.jit(f).lower(x)
        assert lowered.graph is lowered.traced_graph
        assert prim_count(lowered.graph, "exp") == 2
        assert_close(plait.jit(f)(x), f(x))
    assert prim_count(plait.jit(f).lower(x).graph, "exp") == 1


@pytest.mark.parametrize("stage", dict((s.name, s) for s in GRAPH_STAGES).values(),
                         ids=lambda s: s.name)
def test_passes_preserve_results(stage):
    def f(x, y):
        c = torch.arange(6.0).reshape(2, 3)
        h = torch.exp(x) + torch.exp(x) + torch.ones_like(c) * c
        unused = h @ y.T  # noqa: F841
        return torch.softmax(h, -1), (h * y).sum()

    x, y = torch.randn(2, 3), torch.randn(2, 3)
    g = stage(_traced(f, x, y), snapshot()).validate()
    got = _run(g, x, y)
    want = f(x, y)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])


# ---------------------------------------------------------------------------------------
# Algebraic identities
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn, removed", [
    (lambda x: x * torch.ones_like(x) + 1, "mul"),
    (lambda x: torch.ones_like(x) * x + 1, "mul"),
    (lambda x: x / torch.ones_like(x) + 1, "div"),
    (lambda x: (x - torch.zeros_like(x)).exp(), "sub"),
    (lambda x: x.t().t().exp(), "transpose"),
    (lambda x: x.reshape(4, 6).reshape(24).exp(), "reshape"),
], ids=["x*1", "1*x", "x/1", "x-0", "transpose-transpose", "reshape-reshape"])
def test_algebra_removes_identities(fn, removed):
    x = torch.randn(6, 4)
    g = dce(algebra(fold_constants(_traced(fn, x))))
    assert prim_count(g, removed) == (1 if removed == "reshape" else 0), g
    assert_close(plait.jit(fn)(x), fn(x))


def test_algebra_keeps_adding_zero():
    """x + 0.0 is not x: -0.0 + 0.0 is +0.0."""
    x = torch.tensor([-0.0, 1.0])
    f = lambda x: x + torch.zeros_like(x)  # noqa: E731
    assert prim_count(algebra(_traced(f, x)), "add") == 1
    assert torch.equal(plait.jit(f)(x).sign(), f(x).sign())


def test_algebra_composes_transposes():
    x = torch.randn(2, 3, 4)
    f = lambda x: x.permute(1, 2, 0).permute(2, 0, 1).permute(0, 2, 1).exp()  # noqa: E731
    g = dce(algebra(_traced(f, x)))
    assert prim_count(g, "transpose") == 1
    assert_close(plait.jit(f)(x), f(x))


def test_dot_general_absorbs_transposed_operands():
    a, b = torch.randn(5, 3), torch.randn(4, 3)
    f = lambda a, b: a @ b.t()  # noqa: E731
    g = dce(algebra(_traced(f, a, b)))
    assert prim_count(g, "transpose") == 0 and prim_count(g, "dot_general") == 1
    assert_close(plait.jit(f)(a, b), f(a, b))


def test_transposed_dot_general_swaps_operands():
    a, b = torch.randn(5, 3), torch.randn(3, 4)
    f = lambda a, b: (a @ b).t().exp()  # noqa: E731
    g = dce(algebra(_traced(f, a, b)))
    assert prim_count(g, "transpose") == 0 and prim_count(g, "dot_general") == 1
    assert_close(plait.jit(f)(a, b), f(a, b))

    def shared(a, b):  # the product is used as it is too: swapping would compute it twice
        c = a @ b
        return c.t().exp(), c
    g = dce(algebra(_traced(shared, a, b)))
    assert prim_count(g, "transpose") == 1 and prim_count(g, "dot_general") == 1
    assert_close(plait.jit(shared)(a, b), shared(a, b))


def test_matmul_gradients_need_no_transposed_copies():
    """The dot_general VJP is itself dot_generals: the weight gradients of a linear layer
    compile with no transpose left in the graph."""
    x, w = torch.randn(8, 5), torch.randn(3, 5)
    f = lambda w, x: torch.nn.functional.linear(x, w).square().sum()  # noqa: E731
    g = plait.make_graph(plait.grad(f))(w, x)
    assert prim_count(g, "transpose") == 0
    assert_close(plait.jit(plait.grad(f))(w, x), torch.func.grad(f)(w, x))


@pytest.mark.parametrize("fn", [
    lambda x, t: torch.nn.functional.cross_entropy(x, t),
    lambda x, t: torch.nn.functional.cross_entropy(x, t, ignore_index=3, reduction="sum"),
    lambda x, t: torch.gather(torch.where(x > 0, x.exp() * 2, -x), 1, t[:, None]),
    lambda x, t: torch.gather(x.softmax(-1).to(torch.float64), 1, t[:, None]),
], ids=["cross_entropy", "ignore_index", "where_exp", "softmax_convert"])
def test_gather_sinks_into_elementwise_operands(fn):
    """NOTE [gather sinking]: the gather reads the input itself; nothing of the operand's
    full size is computed only for it."""
    x, t = torch.randn(8, 50), torch.randint(0, 50, (8,))
    g = plait.make_graph(fn)(x, t)
    gathers = [n for n in g.order if g.node(n).prim == "gather"]
    assert len(gathers) == 1 and g.operands(gathers[0])[0].node in g.inputs
    assert_close(plait.jit(fn)(x, t), fn(x, t))
    assert_close(plait.jit(fn, backend="cpp")(x, t), fn(x, t))


def test_gather_of_every_element_stays():
    x = torch.randn(4, 5)
    index = torch.argsort(torch.randn(4, 5), dim=1)
    f = lambda x, i: torch.gather(x.exp(), 1, i)  # noqa: E731
    g = plait.make_graph(f)(x, index)
    (gather,) = [n for n in g.order if g.node(n).prim == "gather"]
    assert g.node(g.operands(gather)[0].node).prim == "exp"
    assert_close(plait.jit(f)(x, index), f(x, index))
