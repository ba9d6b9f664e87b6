"""The memory passes (passes/memory.py): liveness with in-place aliases, in-place
reuse, memory-aware order, the pool plan, and the cpp wrapper following them (checked at run
time by config.check_memory_plan)."""
from __future__ import annotations

import functools
import itertools

import plait
import pytest
import sympy
import torch
from plait.compiler import generated
from plait.errors import BackendError
from plait.graph import TensorType
from plait.graph.loops import (
    Apply,
    Buffer,
    Extern,
    Kernel,
    Load,
    LoopProgram,
    Reduce,
    Store,
    loop_vars,
)
from plait.passes import memory

compile_program = functools.partial(generated, "cpp")  # a hand-made program, as cpp compiles it

F32 = torch.float32
x0, x1 = loop_vars("x", 2)
r0, = loop_vars("r", 1)


def load(buffer, index):
    return Load(buffer, sympy.sympify(index), F32)


def unary(op, buffer, index):
    return Apply(op, (load(buffer, index),), (), F32)


def pointwise(name, out, src, n, read_index=None, fenced=False):
    """``out[i] = exp(src[read_index or i])`` over ``n`` elements."""
    return Kernel(name, (n,), (), (Store(out, x0, unary("exp", src, read_index or x0)),), fenced)


def total(name, out, src, n):
    return Kernel(name, (), (n,), (Store(out, 0, Reduce("sum", load(src, r0), F32)),))


def program(buffers: dict, inputs, kernels, outputs) -> LoopProgram:
    return LoopProgram({b: Buffer(b, TensorType(tuple(s), F32)) for b, s in buffers.items()},
                       tuple(inputs), {}, tuple(kernels), tuple(outputs))


def checked(compiled, inputs):
    """Run with the runtime plan check; the measured peak is the estimate."""
    with plait.config.patch(check_memory_plan=True):
        out = compiled(inputs)
    assert compiled.measured_peak_bytes == compiled.plan.peak
    return out


# ---------------------------------------------------------------------------------------
# In-place reuse
# ---------------------------------------------------------------------------------------
def test_layer_norm_after_matmul_reuses_the_matmul_output():
    def f(x, w):
        return torch.nn.functional.layer_norm(x @ w, (64,))

    x, w = torch.randn(32, 48), torch.randn(48, 64)
    lowered = plait.jit(f, backend="cpp").lower(x, w)
    prog = lowered.compiled.program
    (mm,) = [k for k in prog.kernels if isinstance(k, Extern)]
    (norm,) = [k for k in prog.kernels if isinstance(k, Kernel)]
    assert lowered.memory["inplace"] == ((norm.writes[0], mm.outputs[0]),)
    assert f"{norm.writes[0]}_ = {mm.outputs[0]}_;" in lowered.compiled.wrapper_source
    with plait.config.patch(cpp_wrapper=False):
        assert "  # in place" in plait.jit(f, backend="cpp").lower(x, w).compiled.wrapper_source
    torch.testing.assert_close(checked(lowered.compiled, [x, w])[0], f(x, w))
    # one 32x64 storage for the matmul and the normalized rows
    assert lowered.stats["peak_bytes"] == (x.numel() + w.numel() + 32 * 64) * 4
    with plait.config.patch(inplace=False):
        assert plait.jit(f, backend="cpp").lower(x, w).stats["peak_bytes"] == \
            (x.numel() + w.numel() + 2 * 32 * 64) * 4


def test_an_activation_of_a_product_over_image_rows_reuses_the_product_output():
    """ConvNeXt's MLP: a product over the rows of an [N, H, W, C] image, whose activation
    reads it through the reshapes back and forth; the index joins again (NOTE [index
    simplification]), so the activation is written in place of the product."""
    def f(x, w1, w2):
        h = torch.nn.functional.gelu(x.permute(0, 2, 3, 1) @ w1)
        return (h @ w2).permute(0, 3, 1, 2) + x

    x, w1, w2 = torch.randn(2, 8, 5, 6), torch.randn(8, 32), torch.randn(32, 8)
    lowered = plait.jit(f, backend="cpp").lower(x, w1, w2)
    prog = lowered.compiled.program
    first, _ = [k for k in prog.kernels if isinstance(k, Extern)]
    gelu = [k for k in prog.kernels if isinstance(k, Kernel) and first.outputs[0] in k.reads]
    assert (gelu[0].writes[0], first.outputs[0]) in lowered.memory["inplace"]
    torch.testing.assert_close(plait.jit(f, backend="cpp")(x, w1, w2), f(x, w1, w2))


def test_no_reuse_of_a_buffer_read_at_another_index():
    bufs = {"x": (4, 4), "a": (4, 4), "b": (4, 4)}
    transposed = Kernel("k1", (4, 4), (), (Store("b", 4 * x0 + x1, unary("exp", "a", 4 * x1 + x0)),))
    aligned = Kernel("k1", (4, 4), (), (Store("b", 4 * x0 + x1, unary("exp", "a", 4 * x0 + x1)),))
    first = Kernel("k0", (4, 4), (), (Store("a", 4 * x0 + x1, unary("neg", "x", 4 * x0 + x1)),))
    assert memory.reuse(program(bufs, ["x"], [first, transposed], ["b"])).aliases == {}
    assert memory.reuse(program(bufs, ["x"], [first, aligned], ["b"])).aliases == {"b": "a"}


def test_no_reuse_while_a_later_kernel_reads_the_input_or_of_kept_buffers():
    bufs = {"x": (8,), "a": (8,), "b": (8,), "c": (8,)}
    kernels = [pointwise("k0", "a", "x", 8), pointwise("k1", "b", "a", 8),
               pointwise("k2", "c", "a", 8)]
    # k2 reads a later but needs nothing of k1: it moves before k1, which then takes a over
    reused = memory.reuse(program(bufs, ["x"], kernels, ["b", "c"]))
    assert reused.aliases == {"b": "a"}
    assert [k.name for k in reused.kernels] == ["k0", "k2", "k1"]
    # a later reader that needs k1's result stays after it: k1 may not take a over, k2 may
    k2 = Kernel("k2", (8,), (), (Store("c", x0, Apply("add", (load("a", x0), load("b", x0)),
                                                          (), F32)),))
    reused = memory.reuse(program(bufs, ["x"], [*kernels[:2], k2], ["b", "c"]))
    assert reused.aliases == {"c": "a"} and [k.name for k in reused.kernels] == ["k0", "k1", "k2"]
    # nor does a reader move across a fenced kernel
    fenced = [kernels[0], kernels[1], pointwise("k3", "d", "x", 8, fenced=True), kernels[2]]
    reused = memory.reuse(program({**bufs, "d": (8,)}, ["x"], fenced, ["b", "c", "d"]))
    assert reused.aliases == {"c": "a"}
    # inputs and outputs are never taken over
    assert memory.reuse(program(bufs, ["x"], kernels[:1], ["a"])).aliases == {}
    assert memory.reuse(program(bufs, ["x"], kernels[:3], ["a", "b", "c"])).aliases == {}


def test_no_reuse_when_a_later_store_of_the_pass_reads_the_buffer():
    bufs = {"x": (8,), "a": (8,), "b": (8,), "c": (8,)}
    both = Kernel("k1", (8,), (), (Store("b", x0, unary("neg", "x", x0)),
                                   Store("c", x0, unary("exp", "a", x0))))
    kernels = [pointwise("k0", "a", "x", 8), both]
    assert memory.reuse(program(bufs, ["x"], kernels, ["b", "c"])).aliases == {"c": "a"}


def test_aliases_of_one_storage_are_counted_once():
    n = 1024
    bufs = {"x": (n,), "a": (n,), "b": (n,), "c": (n,)}
    chain = program(bufs, ["x"], [pointwise("k0", "a", "x", n), pointwise("k1", "b", "a", n),
                                  pointwise("k2", "c", "b", n)], ["c"])
    reused = memory.reuse(chain)
    assert reused.aliases == {"b": "a", "c": "b"}
    lv = memory.liveness(reused)
    assert {lv.storage[b] for b in "abc"} == {"a"} and lv.span["a"] == (0, 3)
    assert memory.liveness(chain).peak == 3 * n * 4
    assert lv.peak == memory.program_stats(reused)["peak_bytes"] == 2 * n * 4
    compiled = compile_program(reused, memory.plan(reused))
    x = torch.rand(n) - 1
    (c,) = checked(compiled, [x])
    torch.testing.assert_close(c, x.exp().exp().exp(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Memory-aware order
# ---------------------------------------------------------------------------------------
def _branches(fenced: bool) -> LoopProgram:
    """Two big intermediates, each summed; the given order holds both at once."""
    n = 4096
    bufs = {"x": (n,), "a": (n,), "b": (n,), "f": (n,), "sa": (), "sb": ()}
    kernels = [pointwise("ka", "a", "x", n), pointwise("kb", "b", "x", n),
               pointwise("kf", "f", "x", n, fenced=True), total("sum_a", "sa", "a", n),
               total("sum_b", "sb", "b", n)]
    return program(bufs, ["x"], kernels if fenced else kernels[:2] + kernels[3:],
                   ["sa", "sb"] + (["f"] if fenced else []))


def test_memory_aware_order_lowers_the_peak():
    given = _branches(fenced=False)
    ordered = memory.reorder(given)
    assert [k.name for k in ordered.kernels] == ["ka", "sum_a", "kb", "sum_b"]
    assert memory.liveness(ordered).peak == 2 * 4096 * 4 + 8  # x and one branch, two sums
    assert memory.liveness(given).peak == 3 * 4096 * 4 + 4
    x = torch.randn(4096)
    sa, sb = checked(compile_program(ordered, memory.plan(ordered)), [x])
    torch.testing.assert_close(sa, x.exp().sum(), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(sb, x.exp().sum(), rtol=1e-4, atol=1e-3)


def test_a_fenced_kernel_keeps_its_place():
    given = _branches(fenced=True)
    assert memory.reorder(given).kernels == given.kernels


def test_the_jit_reorders_independent_branches():
    def branches(x, w1, w2, v1, v2):
        a, b = x @ w1, x @ w2
        return (a * 2) @ v1, (b * 3) @ v2

    args = [torch.randn(64, 32), torch.randn(32, 512), torch.randn(32, 512),
            torch.randn(512, 8), torch.randn(512, 8)]
    peaks = {}
    for reorder in (False, True):
        with plait.config.patch(inplace=False, reorder=reorder):
            lowered = plait.jit(branches, backend="cpp").lower(*args)
            torch.testing.assert_close(checked(lowered.compiled, args), list(branches(*args)))
            peaks[reorder] = lowered.stats["peak_bytes"]
    # one 64x512 intermediate fewer at once; the first branch's small result lives earlier
    assert peaks[True] == peaks[False] - 64 * 512 * 4 + 64 * 8 * 4


def test_the_index_root_runs_before_the_row_statistics():
    """Two roots: the row statistics (two row-sized results kept to the end) and an index
    (an int64 column an extern frees at once). Starting from the first root keeps all three
    at once; the depth-first walk from the last root runs the index and the extern first, so
    the index is freed before the statistics exist. (Cross-entropy was this case until its
    gather became an indirect load: tests/test_indirect_loads.py.)"""
    def f(logits, target):
        lse = torch.logsumexp(logits, 1)
        return (lse - torch.cumsum(torch.where(target != -100, target, 0), 0)).mean()

    logits, target = torch.randn(512, 100), torch.randint(0, 100, (512,))
    peaks = {}
    for reorder in (False, True):
        with plait.config.patch(reorder=reorder):
            lowered = plait.jit(f, backend="cpp").lower(logits, target)
            torch.testing.assert_close(checked(lowered.compiled, [logits, target])[0],
                                       f(logits, target))
            peaks[reorder] = lowered.stats["peak_bytes"]
    inputs, column, row = logits.nbytes + target.nbytes, 512 * 8, 512 * 4
    assert peaks[False] == inputs + 2 * column + 2 * row  # the index, its cumsum, two stats
    assert peaks[True] == inputs + column + 2 * row + 4  # ... and the loss, index freed before


# ---------------------------------------------------------------------------------------
# Pool plan and the runtime check
# ---------------------------------------------------------------------------------------
def _two_phases(m: int) -> LoopProgram:
    """A 4096-element intermediate summed, then an ``m``-element one summed."""
    n = 4096
    bufs = {"x": (n,), "a": (n,), "s": (), "b": (m,), "t": ()}
    return program(bufs, ["x"], [pointwise("ka", "a", "x", n), total("sa", "s", "a", n),
                                 pointwise("kb", "b", "x", m), total("sb", "t", "b", m)],
                   ["s", "t"])


def test_the_pool_reuses_slots_and_never_raises_the_peak():
    prog = _two_phases(4096)
    plan = memory.plan(prog)
    assert [s.storages for s in plan.slots] == [("a", "b")]
    assert plan.peak == memory.liveness(prog).peak
    compiled = compile_program(prog, plan)
    assert "b_ = pool0;" in compiled.wrapper_source
    with plait.config.patch(cpp_wrapper=False):
        assert "b = pool0[0:16384].view(torch.float32).view((4096,))" in \
            compile_program(prog, plan).wrapper_source
    x = torch.randn(4096)
    _, t = checked(compiled, [x])
    torch.testing.assert_close(t, x.exp().sum(), rtol=1e-4, atol=1e-3)
    # a smaller b in a's slot would raise the peak (sb runs with both sums live): own slots
    smaller = _two_phases(2048)
    assert [s.storages for s in memory.plan(smaller).slots] == [("a",), ("b",)]


def test_the_runtime_check_catches_an_allocation_outliving_the_plan():
    leaked = []
    bufs = {"x": (8,), "a": (8,), "b": (8,), "c": (8,)}
    keep = Extern("keep", lambda t: (leaked.append(t) or t + 1,), ("a",), ("b",), (), "keep")
    prog = program(bufs, ["x"], [pointwise("k0", "a", "x", 8), keep,
                                 pointwise("k2", "c", "b", 8)], ["c"])
    compiled = compile_program(prog, memory.plan(prog))
    compiled([torch.randn(8)])  # unchecked: runs
    with plait.config.patch(check_memory_plan=True), \
            pytest.raises(BackendError, match="after step 1 .* live allocations are"):
        compiled([torch.randn(8)])


# ---------------------------------------------------------------------------------------
# End to end, every switch on and off
# ---------------------------------------------------------------------------------------
def _mlp(x, w1, w2):
    return torch.relu(x @ w1).softmax(-1) @ w2


def _loop_ordering(x):
    y = torch.sum(torch.sum(x, dim=-1))
    z = x / 10.0
    return y, z, z.t().contiguous().t()


CASES = {
    "softmax": (lambda x: torch.softmax(x, -1), lambda: [torch.randn(32, 64)]),
    "layer_norm_after_matmul": (lambda x, w: torch.nn.functional.layer_norm(x @ w, (64,)),
                                lambda: [torch.randn(32, 48), torch.randn(48, 64)]),
    "mlp": (_mlp, lambda: [torch.randn(64, 32), torch.randn(32, 256), torch.randn(256, 16)]),
    "loop_ordering": (_loop_ordering, lambda: [torch.randn(256, 128)]),
}


@pytest.mark.parametrize("switches", list(itertools.product((False, True), repeat=3)),
                         ids=lambda s: "-".join(f"{n}={int(v)}" for n, v in zip(
                             ("inplace", "reorder", "plan"), s)))
@pytest.mark.parametrize("case", list(CASES))
def test_results_match_eager(case, switches):
    fn, make = CASES[case]
    args = make()
    with plait.config.patch(inplace=switches[0], reorder=switches[1],
                            plan_memory=switches[2]):
        lowered = plait.jit(fn, backend="cpp").lower(*args)
        torch.testing.assert_close(plait.jit(fn, backend="cpp")(*args), fn(*args))
        out = checked(lowered.compiled, args)
        # the function's results (NOTE [eager's layouts of results])
        out = [out[x] if isinstance(x, int) else x.leaf(out) for x in lowered.traced.out_leaves]
    expected = fn(*args)
    torch.testing.assert_close(tuple(out) if isinstance(expected, tuple) else out[0], expected)
    report = lowered.memory
    assert report["peak_bytes"] == lowered.stats["peak_bytes"]
    assert set(report["buffers"]) <= set(lowered.compiled.program.buffers)


# ---------------------------------------------------------------------------------------
# Donated arguments
# ---------------------------------------------------------------------------------------
def sgd(w, g):
    return w - 0.1 * g


def test_a_donated_argument_holds_the_result():
    w, g = torch.randn(64, 32), torch.randn(64, 32)
    expected = sgd(w, g)
    kept = plait.jit(sgd, backend="cpp").lower(w, g)
    donated = plait.jit(sgd, backend="cpp", donate_argnums=0)
    lowered = donated.lower(w, g)
    assert lowered.memory["inplace"] == ((lowered.compiled.program.outputs[0], "in0"),)
    assert lowered.stats["peak_bytes"] == kept.stats["peak_bytes"] - w.numel() * 4
    ptr = w.data_ptr()
    with plait.config.patch(check_memory_plan=True):
        out = donated(w, g)
    assert out.data_ptr() == ptr  # written into w's memory: no allocation for the result
    torch.testing.assert_close(out, expected)


def test_arguments_not_donated_are_never_written():
    w, g = torch.randn(64, 32), torch.randn(64, 32)
    before = w.clone(), g.clone()
    out = plait.jit(sgd, backend="cpp", donate_argnums=1)(w, g)  # g donated, w not
    assert torch.equal(w, before[0])
    torch.testing.assert_close(out, sgd(*before))


def test_a_mutated_argument_holds_its_new_value_and_no_other_result():
    def f(w, g):
        w.add_(g)  # its new value is written into w: the result may not take w's memory
        return w * 2

    for donate in ((), 0):
        w, g = torch.randn(16), torch.randn(16)
        w_eager = w.clone()
        expected = f(w_eager, g)
        jitted = plait.jit(f, backend="cpp", donate_argnums=donate)
        lowered = jitted.lower(w.clone(), g)
        program = lowered.compiled.program
        assert lowered.memory["inplace"] == ((program.outputs[1], program.inputs[0]),)
        address = w.data_ptr()
        out = jitted(w, g)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(w, w_eager)
        assert w.data_ptr() == address


@pytest.mark.parametrize("cpp_wrapper", [True, False])
def test_a_mutated_argument_written_in_place_is_read_before_it_changes(cpp_wrapper):
    def f(x, y):
        before = x * 3  # reads the old value; the new one is written into x's memory
        x.mul_(y)
        return before + x, x.sum()

    base = torch.randn(6, 5)
    for x in (base.clone(), base.clone().t()):  # contiguous, and a copy written back
        y = torch.randn(x.shape)
        x_eager = x.clone()
        expected = f(x_eager, y)
        with plait.config.patch(cpp_wrapper=cpp_wrapper):
            got = plait.jit(f, backend="cpp")(x, y)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(x, x_eager)


def test_donation_errors():
    w = torch.randn(8)
    with pytest.raises(plait.errors.TraceError, match="both static and donated"):
        plait.jit(sgd, static_argnums=0, donate_argnums=0)
    with pytest.raises(plait.errors.TraceError, match="donated .* shares memory"):
        plait.jit(sgd, backend="cpp", donate_argnums=0)(w, w[:])


def test_lowering_fences_externs_with_effects():
    """Lowering marks an extern with an effect (a random draw) fenced, so nothing moves
    across it; a matmul is not."""
    from plait.passes.fusion import fuse
    from plait.passes.lowering import lower

    def f(x, w):
        return torch.rand_like(x) + x @ w

    graph = plait.make_graph(f)(torch.randn(4, 4), torch.randn(4, 4))
    externs = {k.label: k.fenced for k in fuse(lower(graph)).kernels if isinstance(k, Extern)}
    assert externs == {"aten.rand.default": True, "dot_general": False}, externs
