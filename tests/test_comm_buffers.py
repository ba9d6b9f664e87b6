"""Communication buffers and collectives in compiled programs, on the CPU: the comm pools'
plan (passes/memory.py), comm buffers chosen at lowering (a fake comm buffer type stands in
for symmetric memory, which needs GPUs), collectives kept in program order, and their
start/wait split (NOTE [overlap]). Functions with collectives run on a one-rank gloo group in
this process; tests/test_distributed.py runs them on two ranks."""
from __future__ import annotations

import functools

import attrs
import plait
import pytest
import torch
import torch.distributed as dist
from plait.compiler import generated
from plait.graph import TensorType
from plait.graph.loops import (
    Apply,
    Buffer,
    CommKind,
    Extern,
    Kernel,
    Load,
    LoopProgram,
    Store,
    Wait,
    loop_vars,
)
from plait.passes import memory
from plait.tracer import collectives

compile_program = functools.partial(generated, "cpp")  # a hand-made program, as cpp compiles it

F32 = torch.float32
(x0,) = loop_vars("x", 1)
N = 100  # elements: 400 bytes, so a second buffer lands at the next 256-byte boundary


# ---------------------------------------------------------------------------------------
# Programs built by hand
# ---------------------------------------------------------------------------------------
def exp(out, src):
    return Kernel(f"k_{out}", (N,), (), (Store(out, x0, Apply(
        "exp", (Load(src, x0, F32),), (), F32)),))


def coll(out, src, fn=lambda t: t * 2, **kwargs):
    """A collective stand-in (doubles its operand)."""
    return Extern(f"c_{out}", fn, (src,), (out,), (), "coll", collective=True, **kwargs)


def program(kernels, outputs, comm=(), sizes=None) -> LoopProgram:
    """Every buffer kernels name, of ``N`` floats (or ``sizes[name]``); ``comm``: buffer ->
    (type, group)."""
    names = dict.fromkeys(["x", *(b for k in kernels for b in (*k.reads, *k.writes))])
    comm = dict(comm)
    return LoopProgram({b: Buffer(b, TensorType(((sizes or {}).get(b, N),), F32),
                                  CommKind(*comm[b]) if b in comm else None) for b in names},
                       ("x",), {}, tuple(kernels), tuple(outputs))


def _fake_allocate(nbytes, device, group, alloc_id):
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


@pytest.fixture
def fake_types(monkeypatch):
    """Comm buffer types that run anywhere: a plain allocation, the regular all-reduce."""
    def all_reduce(x, group_name):
        return torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_reduce(x, "sum", group_name))

    for name in ("fake", "other"):
        monkeypatch.setitem(collectives.COMM_BUFFER_TYPES, name, collectives.CommBufferType(
            name, lambda group, t: t.nbytes <= 1024, _fake_allocate, all_reduce,
            f"{name}_all_reduce"))
    monkeypatch.delitem(collectives.COMM_BUFFER_TYPES, "symm_mem")


def _pools_program() -> LoopProgram:
    """a and b (fake, g0) live together; c (fake, g0) after both; d (fake, g1); e (other)."""
    both = Kernel("k_ab", (N,), (), (Store("a", x0, Apply("exp", (Load("x", x0, F32),), (), F32)),
                                     Store("b", x0, Apply("neg", (Load("x", x0, F32),), (), F32))))
    kernels = [both, coll("ra", "a"), coll("rb", "b"), exp("c", "ra"), coll("rc", "c"),
               exp("d", "x"), coll("rd", "d"), exp("e", "x"), coll("re", "e")]
    comm = {"a": ("fake", "g0"), "b": ("fake", "g0"), "c": ("fake", "g0"), "d": ("fake", "g1"),
            "e": ("other", "g0")}
    return program(kernels, ["rb", "rc", "rd", "re"], comm)


def test_one_pool_per_type_and_group_with_offsets_reused_over_time(fake_types):
    prog = _pools_program()
    plan = memory.plan(prog)
    pools = [(p.type, p.group, p.nbytes, p.offsets) for p in plan.comm_pools]
    assert pools == [("fake", "g0", 512 + 400, {"a": 0, "b": 512, "c": 0}),
                     ("fake", "g1", 400, {"d": 0}), ("other", "g0", 400, {"e": 0})]
    # comm buffers are planned apart: no slot holds one, and each pool is one allocation
    assert not {s for slot in plan.slots for s in slot.storages} & set("abcde")
    assert [(p.first, p.last) for p in plan.comm_pools] == [(0, 4), (5, 6), (7, 8)]
    # the pool is held at its full size while it lives
    assert plan.live[3] == 400 + 912 + 2 * 400  # x, the pool (c in it), ra, rb
    source = compile_program(prog, plan).wrapper_source
    assert "fake_pool0 = fake.allocate(912, device, group_name='g0', alloc_id=" in source
    for line in ("a = fake_pool0[0:400]", "b = fake_pool0[512:912]", "c = fake_pool0[0:400]",
                 "d = fake_pool1[0:400]", "e = other_pool2[0:400]"):
        assert line in source, source
    # released once its last comm buffer is dead, before the call returns
    assert "del c, fake_pool0" in source and "del e, other_pool2" in source
    report = memory.report(prog, plan)["comm_pools"]
    assert [(p["type"], p["group"], p["bytes"], p["comm"]) for p in report] == [
        ("fake", "g0", 912, ("a", "b", "c")), ("fake", "g1", 400, ("d",)),
        ("other", "g0", 400, ("e",))]


def test_a_call_allocates_what_the_plan_says(fake_types):
    prog = _pools_program()
    plan = memory.plan(prog)
    compiled = compile_program(prog, plan)
    x = torch.randn(N)
    with plait.config.patch(check_memory_plan=True):
        rb, rc, rd, re = compiled([x])
    assert compiled.measured_peak_bytes == plan.peak
    torch.testing.assert_close(rb, -x * 2)
    torch.testing.assert_close(rc, (x.exp() * 2).exp() * 2)
    torch.testing.assert_close(rd, x.exp() * 2)
    torch.testing.assert_close(re, x.exp() * 2)


def test_the_alloc_id_is_the_same_for_the_same_program_and_differs_with_the_pool(fake_types):
    ids = [compile_program(p, memory.plan(p)).wrapper_source.split("alloc_id=")[1].split(")")[0]
           for p in (_pools_program(), _pools_program(), program(
               [exp("a", "x"), coll("ra", "a")], ["ra"], {"a": ("fake", "g0")}))]
    assert ids[0] == ids[1] != ids[2]


def test_comm_buffers_are_never_in_place():
    """A comm buffer neither takes over a buffer it reads nor is taken over; the same
    programs without comm buffers do both."""
    kernels = [exp("a", "x"), exp("b", "a"), coll("rb", "b"), exp("c", "rb")]
    assert memory.reuse(program(kernels, ["c"])).aliases == {"b": "a", "c": "rb"}
    assert memory.reuse(program(kernels, ["c"], {"b": ("fake", "g0")})).aliases == {"c": "rb"}
    kernels = [exp("a", "x"), exp("b", "a")]
    assert memory.reuse(program(kernels, ["b"])).aliases == {"b": "a"}
    assert memory.reuse(program(kernels, ["b"], {"a": ("fake", "g0")})).aliases == {}


def test_intermediates_may_use_a_pools_free_ranges(fake_types):
    """t lives between the pool's two comm buffers: in the pool, it costs no bytes."""
    kernels = [exp("a", "x"), coll("ra", "a"), exp("t", "ra"), exp("u", "t"), exp("c", "u"),
               coll("rc", "c")]
    prog = program(kernels, ["rc"], {"a": ("fake", "g0"), "c": ("fake", "g0")})
    apart, shared = memory.plan(prog), memory.plan(prog, comm_reuse=True)
    (pool,) = shared.comm_pools
    assert pool.offsets == {"a": 0, "c": 0, "t": 0} and pool.comm == ("a", "c")
    assert "t" not in apart.comm_of and shared.comm_of["t"] == 0
    assert shared.peak == apart.peak - 400  # during k_u: x, the pool (holding t), u
    compiled = compile_program(prog, shared)
    assert "t = fake_pool0[0:400].view(torch.float32)" in compiled.wrapper_source
    x = torch.rand(N) - 3  # exp of exp of ... stays small
    with plait.config.patch(check_memory_plan=True):
        (rc,) = compiled([x])
    assert compiled.measured_peak_bytes == shared.peak
    torch.testing.assert_close(rc, (x.exp() * 2).exp().exp().exp() * 2)


# ---------------------------------------------------------------------------------------
# Collectives keep their order; the start/wait split
# ---------------------------------------------------------------------------------------
def test_the_memory_order_keeps_what_a_collective_overlaps():
    """Measured before the overlap, running b2 right after b0 (its producer, 4x bigger)
    lowers the peak and moves no collective; after the overlap it would leave only b4
    between the start of c_b3 and its wait (b1, which b4 reads too, cannot move up to start
    it earlier). reorder measures each order after the pass that follows it."""
    split = {"split": (lambda t: t * 2, lambda t: t)}
    given = program([exp("b0", "x"), exp("b1", "x"), exp("b2", "b0"),
                     coll("b3", "b1", **split), exp("b4", "b1")], ["b2", "b3", "b4"],
                    sizes={"b0": 4 * N})
    names = lambda p: [k.name for k in p.kernels]  # noqa: E731
    unaware = memory.reorder(given)
    assert names(unaware) == ["k_b0", "k_b2", "k_b1", "k_b4", "c_b3"]
    assert names(memory.overlap(unaware))[-3:] == ["c_b3", "k_b4", "wait_c_b3"]
    aware = memory.reorder(given, overlapped=True)
    assert names(memory.overlap(aware)) == ["k_b1", "c_b3", "k_b0", "k_b2", "k_b4",
                                            "wait_c_b3"]


def test_the_kernel_computing_only_a_collectives_operand_moves_up_to_start_it():
    """b1 feeds the collective alone (a bucket's gradients joined): the overlap moves it up
    to just after what it reads, and the collective starts there, before b0 and b2."""
    split = {"split": (lambda t: t * 2, lambda t: t)}
    late = program([exp("b0", "x"), exp("b2", "b0"), exp("b1", "x"),
                    coll("b3", "b1", **split)], ["b2", "b3"])
    assert [k.name for k in memory.overlap(late).kernels] == [
        "k_b1", "c_b3", "k_b0", "k_b2", "wait_c_b3"]
    # one that writes into a buffer it took over stays: what it jumps could read that buffer
    taking = attrs.evolve(late, aliases={"b1": "x"})
    assert [k.name for k in memory.overlap(taking).kernels][:3] == ["k_b0", "k_b2", "k_b1"]


def test_collectives_keep_program_order():
    """Started first, c0's big result would rather come last: the memory-aware order would
    swap two independent collectives, but never does."""
    kernels = [coll("r0", "x", lambda t: torch.cat([t, t])), exp("a", "x"), coll("r1", "a")]
    collective = program(kernels, ["r0", "r1"], sizes={"r0": 2 * N})
    assert [k.name for k in memory.reorder(collective).kernels] == ["c_r0", "k_a", "c_r1"]
    plain = program([Extern(k.name, k.fn, k.inputs, k.outputs, (), "coll")
                     if isinstance(k, Extern) else k for k in kernels], ["r0", "r1"],
                    sizes={"r0": 2 * N})
    assert [k.name for k in memory.reorder(plain).kernels] == ["k_a", "c_r1", "c_r0"]
    # a start moves up to the collective before it (its data would allow more), never past it
    split = {"split": (lambda t: t * 2, lambda t: t)}
    kernels = [exp("a", "x"), coll("r0", "a", **split), exp("b", "x"), coll("r1", "x", **split)]
    order = [k.name for k in memory.overlap(program(kernels, ["b", "r0", "r1"])).kernels]
    assert order == ["k_a", "c_r0", "c_r1", "k_b", "wait_c_r0", "wait_c_r1"]


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group in this process (every collective is the identity on it)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def _overlapped(x, w):
    a = plait.distributed.all_reduce(x * 2)
    h = torch.sin(w @ w).sum()  # independent of a: runs while it communicates
    return a + 1, h


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_a_collective_starts_early_and_is_waited_for_late(group, backend):
    x, w = torch.randn(4, 6), torch.randn(8, 8)
    lowered = plait.jit(_overlapped, backend=backend).lower(x, w)
    kernels = lowered.compiled.program.kernels
    (start,) = [i for i, k in enumerate(kernels) if isinstance(k, Extern) and k.collective]
    (wait,) = [i for i, k in enumerate(kernels) if isinstance(k, Wait)]
    between = kernels[start + 1:wait]
    assert any(isinstance(k, Kernel) and "sin" in lowered.compiled.program.describe(k)[0]
               for k in between), lowered.compiled.wrapper_source
    assert not any(set(kernels[start].outputs) & set(k.reads) for k in between)
    source = lowered.compiled.wrapper_source
    assert source.index("= all_reduce(") < source.index("dot_general(") < \
        source.index("= wait_all_reduce(")
    # (Triton's interpreter keeps a launch's arguments alive: the plan check is cpp's)
    with plait.config.patch(check_memory_plan=backend == "cpp"):
        got = lowered.compiled([x, w])
    torch.testing.assert_close(got, list(_overlapped(x, w)))
    with plait.config.patch(overlap=False):
        kernels = plait.jit(_overlapped, backend=backend).lower(x, w).compiled.program.kernels
    assert not any(isinstance(k, Wait) for k in kernels)


# ---------------------------------------------------------------------------------------
# Comm buffers chosen at lowering
# ---------------------------------------------------------------------------------------
def _comm_buffers(lowered) -> list[str]:
    program = lowered.compiled.program
    return [b for b, buf in program.buffers.items() if buf.comm is not None]


def test_a_computed_operand_becomes_a_comm_buffer_and_is_copied_out(group, fake_types):
    def f(x):
        y = x * 2
        return plait.distributed.all_reduce(y), y, plait.distributed.all_reduce(x)

    x = torch.randn(4, 6)
    lowered = plait.jit(f, backend="cpp").lower(x)
    program = lowered.compiled.program
    (comm,) = _comm_buffers(lowered)
    assert program.buffers[comm].comm == CommKind("fake", group)
    assert comm not in program.outputs  # y is returned: a copy of its own
    externs = [k.label for k in program.kernels if isinstance(k, Extern)]
    assert externs == ["fake_all_reduce", "all_reduce"]  # x is an argument: not ours to place
    (pool,) = lowered.memory["comm_pools"]
    assert pool["comm"] == (comm,) and pool["bytes"] == 96
    with plait.config.patch(check_memory_plan=True):
        got = lowered.compiled([x])
    torch.testing.assert_close(got, list(f(x)))
    torch.testing.assert_close(plait.jit(f, backend="triton")(x), f(x))


def test_only_small_sum_all_reduces_of_our_values_take_the_comm_path(group, fake_types):
    pd = plait.distributed
    cases = {  # function of x (4x6 floats, 96 bytes) -> comm buffers
        "sum": (lambda x: pd.all_reduce(x + 1), 1),
        "reduced": (lambda x: pd.all_reduce(x.sum(0)), 1),
        "argument": (lambda x: pd.all_reduce(x), 0),
        "copied argument": (lambda x: pd.all_reduce(x.t().reshape(24)), 1),
        "avg": (lambda x: pd.all_reduce(x + 1, op="avg"), 0),
        "max": (lambda x: pd.all_reduce(x + 1, op="max"), 0),
        "too large": (lambda x: pd.all_reduce(x.repeat(20, 1)), 0),
        "gather": (lambda x: pd.all_gather(x + 1), 0),
    }
    x = torch.randn(4, 6)
    for name, (fn, count) in cases.items():
        lowered = plait.jit(fn, backend="cpp").lower(x)
        assert len(_comm_buffers(lowered)) == count, name
        torch.testing.assert_close(lowered.compiled([x])[0], fn(x))


def test_symmetric_memory_falls_back_on_the_cpu(group):
    """Enabled for the group, symmetric memory is still never chosen for CPU tensors."""
    from torch.distributed import _symmetric_memory

    plait.distributed.enable_symmetric_memory(group)
    assert _symmetric_memory.is_symm_mem_enabled_for_group(group)
    x = torch.randn(4, 6)
    lowered = plait.jit(lambda x: plait.distributed.all_reduce(x * 2), backend="cpp").lower(x)
    assert _comm_buffers(lowered) == [] and lowered.memory["comm_pools"] == ()
    assert [k.label for k in lowered.compiled.program.kernels if isinstance(k, Extern)] == \
        ["all_reduce"]
    torch.testing.assert_close(lowered.compiled([x])[0], x * 2)


def test_collective_dims_move_by_views(group):
    """A collective along another dim runs along dim 0 between two kernels (its copies); of a
    dtype kernels cannot store (float16 in cpp), the impl moves it, in one step."""
    def f(x):
        return plait.distributed.all_gather(x.exp(), dim=1)

    x = torch.randn(4, 6)
    for dtype, dim, shape, split in ((F32, 0, (6, 4), True), (torch.float16, 1, (4, 6), False)):
        lowered = plait.jit(f, backend="cpp").lower(x.to(dtype))
        program = lowered.compiled.program
        (extern,) = [k for k in program.kernels if isinstance(k, Extern) and k.collective]
        assert dict(extern.params)["dim"] == dim
        assert program.buffers[extern.inputs[0]].type.shape == shape
        assert any(isinstance(k, Wait) for k in program.kernels) == split
        torch.testing.assert_close(lowered.compiled([x.to(dtype)])[0], x.to(dtype).exp())
