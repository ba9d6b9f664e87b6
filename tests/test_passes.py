"""Simplify passes on traced graphs: DCE, CSE, constant folding, and the whole pipeline."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import plait
from plait.graph import Graph
from plait.passes import (PASSES, algebra, channels_last, cse, dce, erase_markers,
                          fold_constants, fuse_attention, simplify, unread_input_grads, unread_ys)


def prim_count(graph: Graph, prim: str) -> int:
    return sum(1 for n in graph.nx.nodes if graph.node(n).prim == prim)


def _traced(fn, *args) -> Graph:
    """The graph as traced, before any pass."""
    return plait.jit(fn).lower(*args).traced_graph


def _run(graph: Graph, *inputs):
    """Run ``graph`` on the reference backend."""
    return plait.backends.get_backend("eager").factory(graph)(list(inputs))


def test_registry():
    assert PASSES == {"erase_markers": erase_markers, "dce": dce, "cse": cse,
                      "fold_constants": fold_constants, "algebra": algebra,
                      "fuse_attention": fuse_attention, "channels_last": channels_last,
                      "unread_ys": unread_ys, "unread_input_grads": unread_input_grads}


# ---------------------------------------------------------------------------------------
# DCE
# ---------------------------------------------------------------------------------------
def test_dce_removes_unused_nodes():
    def f(x):
        unused = torch.sin(x) * torch.cos(x)  # noqa: F841
        return x * 2

    x = torch.randn(5)
    traced = _traced(f, x)
    assert prim_count(traced, "sin") == 1 and prim_count(traced, "cos") == 1
    out = dce(traced).validate()
    assert prim_count(out, "sin") == 0 and prim_count(out, "cos") == 0
    assert prim_count(out, "mul") == 1
    assert len(out) < len(traced)
    assert_close(_run(out, x)[0], f(x))
    assert_close(plait.jit(f)(x), f(x))


def test_dce_keeps_inputs_even_if_unused():
    def f(x, y):
        return x + 1

    x, y = torch.randn(3), torch.randn(3)
    out = dce(_traced(f, x, y)).validate()
    assert len(out.inputs) == 2
    assert [str(t) for t in out.input_types] == ["f32[3]", "f32[3]"]
    assert_close(_run(out, x, y)[0], f(x, y))
    assert_close(plait.jit(f)(x, y), f(x, y))


def test_dce_keeps_effectful_random_op():
    def f(x):
        torch.rand_like(x)  # unused, but a random draw is an effect: the RNG advances
        return x + 1

    x = torch.randn(3)
    g = plait.make_graph(f)(x)
    assert prim_count(g, "opaque") == 1
    jf = plait.jit(f)
    jf(x)  # compile outside the seeded region
    torch.manual_seed(1)
    assert_close(jf(x), x + 1)
    after_jit = torch.rand(4)
    torch.manual_seed(1)
    f(x)
    assert_close(after_jit, torch.rand(4))  # the jitted call advanced the RNG as eager does


# ---------------------------------------------------------------------------------------
# CSE
# ---------------------------------------------------------------------------------------
def test_cse_merges_duplicate_subexpressions():
    def f(x):
        return torch.exp(x) + torch.exp(x)

    x = torch.randn(6)
    traced = _traced(f, x)
    assert prim_count(traced, "exp") == 2
    merged = cse(traced).validate()
    assert prim_count(merged, "exp") == 1
    (add,) = [n for n in merged.nx.nodes if merged.node(n).prim == "add"]
    a, b = merged.operands(add)
    assert a == b
    assert_close(_run(merged, x)[0], f(x))
    assert prim_count(plait.make_graph(f)(x), "exp") == 1
    assert_close(plait.jit(f)(x), f(x))


def test_cse_merges_chains_but_not_different_params():
    def f(x):
        a = torch.tanh(torch.exp(x)).sum(0)
        b = torch.tanh(torch.exp(x)).sum(0)
        c = torch.tanh(torch.exp(x)).sum(1)  # different params: not the same value
        return a * b, c

    x = torch.randn(3, 4)
    g = plait.make_graph(f)(x)
    assert prim_count(g, "exp") == 1
    assert prim_count(g, "tanh") == 1
    assert prim_count(g, "sum") == 2
    got = plait.jit(f)(x)
    assert_close(got, f(x))


def test_cse_does_not_merge_different_operands():
    def f(x, y):
        return torch.exp(x) + torch.exp(y)

    x, y = torch.randn(4), torch.randn(4)
    assert prim_count(plait.make_graph(f)(x, y), "exp") == 2
    assert_close(plait.jit(f)(x, y), f(x, y))


def test_cse_does_not_merge_random_draws():
    def f(x):
        return x + torch.rand_like(x), x + torch.rand_like(x)

    x = torch.zeros(3)
    g = plait.make_graph(f)(x)
    assert prim_count(g, "opaque") == 2
    a, b = plait.jit(f)(x)
    assert not torch.equal(a, b)


# ---------------------------------------------------------------------------------------
# Constant folding
# ---------------------------------------------------------------------------------------
def test_tensor_made_inside_becomes_constant():
    c = torch.arange(4.0)

    def f(x):
        return x + torch.arange(4.0) * 2

    x = torch.randn(4)
    g = plait.make_graph(f)(x)
    consts = [g.node(n) for n in g.nx.nodes if g.node(n).prim == "constant"]
    assert len(consts) == 1
    assert_close(consts[0].kwargs["value"].tensor, c * 2)
    assert prim_count(g, "mul") == 0
    assert_close(plait.jit(f)(x), f(x))


def test_fold_constants_folds_ops_on_small_constants():
    c = torch.arange(4.0)

    def f(x):
        return x + torch.ones_like(x) * torch.arange(4.0) * 2

    x = torch.randn(4)
    traced = _traced(f, x)
    assert prim_count(traced, "mul") == 2  # both multiplies see only known operands
    folded = fold_constants(traced).validate()
    assert prim_count(folded, "mul") == 0
    assert prim_count(folded, "add") == 1
    (add,) = [n for n in folded.nx.nodes if folded.node(n).prim == "add"]
    operand = folded.node(folded.operands(add)[1].node)
    assert operand.prim == "constant"
    assert_close(operand.kwargs["value"].tensor, torch.ones(4) * c * 2)
    assert_close(_run(folded, x)[0], f(x))

    final = plait.make_graph(f)(x)
    assert prim_count(final, "mul") == 0 and prim_count(final, "full") == 0
    assert prim_count(final, "constant") == 1
    assert_close(plait.jit(f)(x), f(x))


@pytest.mark.parametrize("value", [2.5, -0.0, float("inf")])
def test_fold_constants_keeps_a_uniform_result_a_fill(value):
    """A folded value whose elements are all the same stays one number (a ``full``)."""
    def f(x):
        return x * (torch.ones_like(x) * value)

    x = torch.randn(3)
    folded = fold_constants(_traced(f, x)).validate()
    fills = [folded.node(n) for n in folded.nx.nodes if folded.node(n).prim == "full"]
    assert prim_count(folded, "constant") == 0
    assert [n.out_types[0].shape for n in fills][-1] == (3,)
    assert str(fills[-1].kwargs["value"]) == str(value)
    assert_close(_run(folded, x)[0], f(x))


def test_fold_constants_keeps_signed_zeros_apart():
    folded = fold_constants(_traced(lambda x: x + torch.tensor([0.0, -0.0]) * 1.0,
                                    torch.randn(2))).validate()
    assert prim_count(folded, "constant") == 1 and prim_count(folded, "full") == 0


def test_fold_constants_respects_fold_max_numel():
    def f(x):
        return x + torch.full_like(x, 2.0) * torch.arange(4.0)

    x = torch.randn(4)
    with plait.config.patch(fold_max_numel=3):
        g = plait.make_graph(f)(x)
        assert prim_count(g, "mul") == 1
        assert_close(plait.jit(f)(x), f(x))
        assert prim_count(fold_constants(_traced(f, x)), "mul") == 1
    with plait.config.patch(fold_max_numel=4):
        assert prim_count(plait.make_graph(f)(x), "mul") == 0


def test_fold_max_numel_joins_cache_key():
    def f(x):
        return x + torch.full_like(x, 2.0) * torch.arange(4.0)

    jf = plait.jit(f)
    x = torch.randn(4)
    assert_close(jf(x), f(x))
    with plait.config.patch(fold_max_numel=0):
        assert_close(jf(x), f(x))
    assert jf.trace_count == 2


def test_fold_leaves_input_dependent_nodes():
    def f(x):
        return torch.exp(x) * 3 + 1

    x = torch.randn(4)
    g = fold_constants(_traced(f, x)).validate()
    assert prim_count(g, "exp") == 1 and prim_count(g, "mul") == 1
    assert_close(_run(g, x)[0], f(x))


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
    g = simplify(traced).validate()
    assert len(g) < len(traced)
    assert prim_count(g, "cos") == 0 and prim_count(g, "exp") == 1
    assert_close(_run(g, x)[0], f(x))
    assert simplify(g).digest == g.digest  # a fixed point


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


@pytest.mark.parametrize("name", sorted(PASSES))
def test_passes_preserve_results(name):
    def f(x, y):
        c = torch.arange(6.0).reshape(2, 3)
        h = torch.exp(x) + torch.exp(x) + torch.ones_like(c) * c
        unused = h @ y.T  # noqa: F841
        return torch.softmax(h, -1), (h * y).sum()

    x, y = torch.randn(2, 3), torch.randn(2, 3)
    g = PASSES[name](_traced(f, x, y)).validate()
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
