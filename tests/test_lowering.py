"""Lowering (primitive graph -> LoopProgram), checked through the loop-IR interpreter."""
import pytest
import torch

import plait
from plait.backends.loopeval import run_program
from plait.graph.loops import Extern, Kernel, Load, Reduce, loop_vars, walk
from plait.passes.lowering import lower


def _lowered(fn, *args, passes=()):
    """``fn`` lowered (then through ``passes``), run by the loop-IR interpreter and checked
    against eager; returns the program."""
    program = lower(plait.make_graph(fn)(*args))
    for p in passes:
        program = p(program)
    expected = fn(*args)
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    for actual, want in zip(run_program(program, list(args)), expected):
        torch.testing.assert_close(actual, want)
    return program


def _kinds(program):
    return [type(k).__name__ for k in program.kernels]


def test_pointwise_chain_with_views_is_one_kernel():
    x = torch.randn(4, 5)
    program = _lowered(lambda x: (x.t() * 2 + 1).exp()[1:, ::2].flip(0), x)
    assert _kinds(program) == ["Kernel"]
    (kernel,) = program.kernels
    assert kernel.reads == program.inputs  # views are index rewrites: x is read directly


@pytest.mark.parametrize("fn", [
    lambda x: torch.nn.functional.pad(x, (1, 2, 0, 3), value=-1.0),
    lambda x: torch.cat([x, x * 2, x[:0]], 0).reshape(2, 20),
    lambda x: x.reshape(20)[3:17].reshape(2, 7),
    lambda x: x.unsqueeze(0).expand(3, 4, 5) + torch.arange(5.0),
])
def test_views_and_padding_need_no_copies(fn):
    assert _kinds(_lowered(fn, torch.randn(4, 5))) == ["Kernel"]


@pytest.mark.parametrize("index", [(slice(None), slice(None, None, 2), slice(1, None, 3)),
                                   (slice(2, 3, 5),), (slice(1, 7, 3), slice(2, None))],
                         ids=["two_strided_dims", "one_element", "cropped"])
def test_a_strided_slice_gradient_is_one_kernel_without_tables(index):
    """The gradient of a strided slice spreads the cotangent with pads and a reshape, which
    lowering reads through: one kernel of direct loads (no index table, no indirect load),
    whose results, and second derivatives, are eager's."""
    x = torch.randn(9, 9, 10, dtype=torch.float64)
    ct = torch.randn(x[index].shape, dtype=torch.float64)
    grad = lambda x, ct: plait.vjp(lambda x: x[index].sin(), x)[1](ct)[0]  # noqa: E731
    program = _lowered(grad, x, ct)
    assert _kinds(program) == ["Kernel"]
    assert not any(isinstance(e, Load) and e.indirect
                   for s in program.kernels[0].stores for e in walk(s.value))
    assert not program.constants
    small = x[:6, :5, :7].clone()
    loss = lambda x: x[index].sin().square().sum()  # noqa: E731
    torch.testing.assert_close(plait.hessian(loss)(small), torch.func.hessian(loss)(small))


def test_reductions_inline_their_operand():
    x = torch.randn(6, 7)
    program = _lowered(lambda x: (x * x).sum(1), x)
    (kernel,) = program.kernels
    assert kernel.reduction_sizes == (7,) and isinstance(kernel.stores[0].value, Reduce)
    _lowered(lambda x: (x.argmax(0), x.amin(1), x.prod()), x)


def test_a_value_used_twice_is_stored_once():
    x = torch.randn(3, 8)
    program = _lowered(lambda x: torch.softmax(x, -1), x)
    exp_stores = [k for k in program.kernels if isinstance(k, Kernel) and not k.reduction_sizes
                  and any(getattr(e, "op", None) == "exp" for e in walk(k.stores[0].value))]
    assert len(exp_stores) == 1  # exp(x - max) feeds the sum and the division from a buffer


def test_a_returned_value_an_extern_reads_reshaped_is_stored_once():
    """Softmax's probabilities, kept for the backward and reshaped for a batched product:
    the product reads the returned buffer as it is."""
    s, v = torch.randn(2, 3, 5, 5), torch.randn(6, 5, 4)

    def attend(s, v):
        p = torch.softmax(s, -1)
        return torch.bmm(p.reshape(6, 5, 5), v), p

    program = _lowered(attend, s, v)
    stores = [st for k in program.kernels if isinstance(k, Kernel) for st in k.stores
              if program.buffers[st.buffer].type.numel == s.numel()]
    assert len(stores) == 1 and stores[0].buffer in program.outputs
    (product,) = [k for k in program.kernels if isinstance(k, Extern)]
    assert product.reads[0] == stores[0].buffer


def test_cheap_values_are_recomputed_not_stored():
    x = torch.randn(3, 4)
    program = _lowered(lambda x: (x.t() + 1, x.t() * 2), x)  # x.t() is only an index rewrite
    assert all(isinstance(k, Kernel) for k in program.kernels) and len(program.kernels) == 2


def test_library_calls_and_unlowerable_primitives_are_externs():
    x = torch.randn(4, 4)
    program = _lowered(lambda x: torch.relu(x @ x.t()).sort(-1).values, x)
    assert [k.label for k in program.kernels if isinstance(k, Extern)] == ["dot_general",
                                                                          "sort"]
    graph = plait.make_graph(lambda x: torch.special.digamma(x.abs() + 1))(x)
    assert not any(isinstance(k, Extern) for k in lower(graph).kernels)
    # a code generator without digamma gets it as an extern
    program = lower(graph, supported_ops={"abs", "add"})
    assert [k.label for k in program.kernels if isinstance(k, Extern)] == ["digamma"]
    torch.testing.assert_close(run_program(program, [x])[0],
                               torch.special.digamma(x.abs() + 1))


def test_empty_values_need_no_kernels():
    x = torch.randn(0, 3)
    program = _lowered(lambda x: (x * 2, x.sum(0), torch.cat([x, x], 0)), x)
    assert all(not isinstance(k, Kernel) or k.reduction_sizes for k in program.kernels)


def test_loads_are_in_bounds_for_padding_and_concatenation():
    x = torch.randn(2, 3)
    program = _lowered(lambda x: torch.nn.functional.pad(torch.cat([x, -x], 1), (2, 2)), x)
    for kernel in program.kernels:
        for store in kernel.stores:
            for node in walk(store.value):
                if isinstance(node, Load):  # every load's index stays inside its buffer
                    size = program.buffers[node.buffer].type.numel
                    x0, x1 = loop_vars("x", 2)
                    grid = [{x0: i, x1: j} for i in range(4) for j in range(10)]
                    assert all(0 <= int(node.index.subs(p)) < size for p in grid)


def test_index_simplification_keeps_every_value_and_undoes_split_positions():
    """NOTE [index simplification]: each rewrite holds at every point of the loops (checked
    by evaluating all of them), and a position split into row and column and joined again
    (a column reduction's loads) becomes affine."""
    import itertools

    import sympy

    from plait.passes.indexing import simplify

    x, r = sympy.symbols("x0 r0", integer=True, nonnegative=True)
    cases = [
        (x + 12 * sympy.Mod(r, 4) + 48 * sympy.floor((x + 12 * r) / 48), {x: 12, r: 16}),
        (sympy.floor((x + 4 * r) / 8), {x: 4, r: 10}),
        (sympy.floor((x + 4 * r) / 8), {x: 5, r: 10}),  # x may carry: stays as it is
        (sympy.floor((x - 4 * r + 40) / 8), {x: 4, r: 10}),
        (3 * sympy.Mod(x + r, 5) + 15 * sympy.floor((x + r) / 5), {x: 7, r: 9}),
        (sympy.floor((6 * x + 2 * r + 1) / 12), {x: 5, r: 3}),
        # a row of [N*H*W, C] split into n, h, w and joined again (ConvNeXt's MLP)
        (r + 3 * sympy.Mod(x, 4) + 12 * sympy.Mod(sympy.floor(x / 4), 5)
         + 60 * sympy.floor(x / 20), {x: 60, r: 3}),
        (sympy.floor(sympy.floor(x / 3) / 4), {x: 40, r: 1}),
    ]
    for expr, ranges in cases:
        got = simplify(expr, ranges)
        for point in itertools.product(*(range(n) for n in ranges.values())):
            at = dict(zip(ranges, point))
            assert got.subs(at) == expr.subs(at), (expr, got, at)
    assert simplify(cases[0][0], cases[0][1]) == x + 12 * r
    assert simplify(cases[1][0], cases[1][1]) == sympy.floor(r / 2)
    assert simplify(cases[4][0], cases[4][1]) == 3 * x + 3 * r
    assert simplify(cases[6][0], cases[6][1]) == 3 * x + r
    assert simplify(cases[7][0], cases[7][1]) == sympy.floor(x / 12)


def test_a_gather_repeated_by_a_broadcast_is_stored_once():
    """A position bias looked up from a table (an embedding of relative positions) and
    broadcast over the batch into each attention's softmax is gathered once into a buffer
    of its own, not at every point of every pass of the softmax."""
    def fn(scores, table, buckets):
        bias = torch.nn.functional.embedding(buckets, table).permute(2, 0, 1)
        return torch.softmax(scores + bias, -1)

    scores, table = torch.randn(2, 4, 8, 8), torch.randn(16, 4)
    buckets = torch.randint(0, 16, (8, 8))
    program = _lowered(fn, scores, table, buckets)
    gathering = [k for k in program.kernels if isinstance(k, Kernel) and any(
        isinstance(e, Load) and e.indirect for s in k.stores for e in walk(s.value))]
    assert len(gathering) == 1 and not gathering[0].reduction_sizes
    assert [program.buffers[s.buffer].type.shape for s in gathering[0].stores] == [(4, 8, 8)]


def test_cos_and_sin_repeated_by_a_broadcast_are_computed_once():
    """Rotary embeddings' cos and sin of [T, D] angles, broadcast over the batch and heads
    of q and k: each is computed once into a buffer of its own, not at every point of both
    rotations; the results are eager's."""
    def fn(q, k, angles):
        cos, sin = angles.cos(), angles.sin()
        return q * cos + q.flip(-1) * sin, k * cos - k.flip(-1) * sin

    q, k, angles = torch.randn(2, 4, 8, 6), torch.randn(2, 4, 8, 6), torch.randn(8, 6)
    program = _lowered(fn, q, k, angles)
    trig = [(e.op, program.buffers[s.buffer].type.shape) for k in program.kernels
            if isinstance(k, Kernel) for s in k.stores for e in walk(s.value)
            if getattr(e, "op", None) in ("cos", "sin")]
    assert sorted(trig) == [("cos", (8, 6)), ("sin", (8, 6))]
    for got, want in zip(plait.jit(fn)(q, k, angles), fn(q, k, angles)):
        torch.testing.assert_close(got, want)


def test_a_value_a_product_reads_reshaped_and_others_use_is_computed_once():
    """An embedding's layer norm, reshaped for the first products and added back after the
    attention: stored once in its own shape, the product reading a view of it and the
    other user loading it, rather than each computing it again."""
    def fn(x, w):
        h = (x * 2).exp()
        return (h.reshape(16, 4) @ w).reshape(2, 8, 4) + h

    program = _lowered(fn, torch.randn(2, 8, 4), torch.randn(4, 4))
    exps = [e for k in program.kernels if isinstance(k, Kernel) for s in k.stores
            for e in walk(s.value) if getattr(e, "op", None) == "exp"]
    assert len(exps) == 1
    (product,) = [k for k in program.kernels if isinstance(k, Extern)]
    assert program.buffers[product.inputs[0]].type.shape == (2, 8, 4)  # a view of h's buffer
