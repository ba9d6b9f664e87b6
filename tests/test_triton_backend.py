"""The Triton backend under Triton's CPU interpreter, against eager torch: hand-built
LoopPrograms (pointwise, persistent and looped reductions, externs, buffers), every op of
the interpreter's op set, plait.jit end to end with kernel counts, and an OpInfo sweep."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
import re

import attrs

import pytest

import plait
import sympy
import torch
from opinfo_sweep import sweep
from plait.backends import available_backends
from plait.backends import triton as triton_backend
from plait.backends.triton import TRITON_DTYPES, TRITON_OPS, supported_ops
from plait.compiler import generated
from plait.errors import BackendError
from plait.graph.types import set_size_hint
from plait.graph.loops import Extern, IndexValue, Kernel, Reduce, Store, loop_vars
from plait.passes import split
from test_cpp_backend import _check, ap, const, load, per_op_program, program
from test_cpu_compiler import loop_ordering

compile_program = functools.partial(generated, "triton")  # a hand-made program, as triton compiles it

F32, I64, BOOL = torch.float32, torch.int64, torch.bool
x0, x1, x2 = loop_vars("x", 3)
r0, r1 = loop_vars("r", 2)


@pytest.fixture(params=["persistent", "looped"])
def rows(request, monkeypatch):
    """Reductions as one tile per row, or looped in chunks of 4 (small rows exercise the
    chunk loop, its ragged last chunk and the cross-lane combine)."""
    if request.param == "looped":
        monkeypatch.setattr(triton_backend, "PERSISTENT_MAX", 0)
        monkeypatch.setattr(triton_backend, "LOOPED_RBLOCK", 4)
        monkeypatch.setattr(triton_backend, "FEW_ROWS", 0)  # chunks of 4 however few the rows
    return request.param


def jitted(fn, *args):
    """fn through plait.jit(backend="triton"), checked against eager; returns the Lowered."""
    jit = plait.jit(fn, backend="triton")
    torch.testing.assert_close(jit(*args), fn(*args), equal_nan=True)
    return jit.lower(*args)


# ---------------------------------------------------------------------------------------
# Hand-built programs
# ---------------------------------------------------------------------------------------
def test_pointwise_chain_with_broadcast_and_transposed_loads():
    x, b = torch.randn(37, 24), torch.randn(37)
    value = ap("add", ap("mul", ap("exp", load("x", x1 * 24 + x0)), load("b", x1)), const(1.0))
    k = Kernel("chain", (24, 37), (), (Store("y", 37 * x0 + x1, value),))
    run = compile_program(program({"x": ((37, 24), F32), "b": ((37,), F32),
                                   "y": ((24, 37), F32)}, ["x", "b"], [k], ["y"]))
    torch.testing.assert_close(run([x, b])[0], (torch.exp(x) * b[:, None] + 1).t())
    assert run.kernels[0].reads == ("x", "b") and run.kernels[0].writes == ("y",)
    # x is read transposed: 2-D tiles, the longer axis (x1, innermost) on program id 0
    assert "xmask = (yindex < 24) & (xindex < 37)" in run.kernels[0].source
    assert "yindex = tl.program_id(1) * YBLOCK" in run.kernels[0].source


def test_2d_tiles_with_64_bit_indices():
    k = Kernel("wide", (24, 37), (), (Store("y", x0 + 24 * x1,
                                            IndexValue(x0 * 5000000000 + x1, I64)),))
    run = compile_program(program({"y": ((37, 24), I64)}, [], [k], ["y"]))
    want = torch.arange(24)[:, None] * 5000000000 + torch.arange(37)
    assert torch.equal(run([])[0], want.t())
    source = run.kernels[0].source
    assert "tl.program_id(0).to(tl.int64)" in source and "tl.program_id(1).to(tl.int64)" in source


def test_where_with_clamped_loads_and_scalar_loads():
    x, s = torch.randn(6), torch.randn(())
    inside = ap("bitwise_and", ap("ge", IndexValue(x0, I64), const(2, I64)),
                ap("lt", IndexValue(x0, I64), const(8, I64)))
    clamped = load("x", sympy.Max(0, sympy.Min(5, x0 - 2)))
    k = Kernel("pad", (10,), (), (Store("y", x0, ap("where", inside, clamped, load("s", 0))),))
    run = compile_program(program({"x": ((6,), F32), "s": ((), F32), "y": ((10,), F32)},
                                  ["x", "s"], [k], ["y"]))
    torch.testing.assert_close(run([x, s])[0], torch.nn.functional.pad(x, (2, 2), value=s))


def test_each_part_of_a_concatenation_is_loaded_only_where_it_is_taken():
    """A concatenation lowers to nested ``where``s over clamped loads: each part's load is
    masked by its branch's conditions, so it reads only its own points (a q/k/v gradient
    with its bias's column sums read all three parts at every point before)."""
    parts = [torch.randn(64, 8) for _ in range(3)]

    def fn(a, b, c):
        y = torch.cat([a * 2, b.exp(), c], 1)
        return y, y.sum(0), torch.nn.functional.pad(a, (1, 1), value=3.0)

    loads = [line.strip() for k in jitted(fn, *parts).kernels
             for line in k.source.splitlines() if "tl.load(" in line]
    assert len(loads) == 4  # the three parts (all in one kernel, with the sums) and the pad's
    assert all(re.search(r"mask=xr?mask & ~?t\d+", line) for line in loads), loads


@pytest.mark.parametrize("expr", [
    sympy.floor((x0 - 5) / 3), sympy.Mod(x0 - 5, 3), sympy.floor(x0 / 4), sympy.Mod(x0, 4),
    sympy.ceiling((x0 - 6) / 4), sympy.Max(x0 - 3, 2 * x0 - 9), (x0 - 4) ** 2,
    sympy.floor(sympy.floor(x0 / 2) / 3) * 3 - x0 * 5000000000])
def test_index_printer(expr):
    k = Kernel("idx", (12,), (), (Store("y", x0, IndexValue(expr, I64)),))
    run = compile_program(program({"y": ((12,), I64)}, [], [k], ["y"]))
    assert run([])[0].tolist() == [int(expr.subs(x0, i)) for i in range(12)]
    assert ("tl.program_id(0).to(tl.int64)" in run.kernels[0].source) == (
        "5000000000" in str(expr))  # 64-bit indices only where needed


def test_iota_of_floats_and_constants():
    k = Kernel("iota", (5,), (), (
        Store("f", x0, IndexValue(sympy.Float(0.5) + x0 * sympy.Float(0.1), torch.float64)),
        Store("i", x0, ap("add", IndexValue(x0, I64), const(-(1 << 63), I64))),
        Store("c", x0, const(float("-inf")))))
    run = compile_program(program({"f": ((5,), torch.float64), "i": ((5,), I64),
                                   "c": ((5,), F32)}, [], [k], ["f", "i", "c"]))
    f, i, c = run([])
    torch.testing.assert_close(f, torch.arange(5, dtype=torch.float64) * 0.1 + 0.5)
    assert i.tolist() == [-(1 << 63) + n for n in range(5)]
    assert c.tolist() == [float("-inf")] * 5


def test_softmax_row_kernel_with_epilogue(rows):
    """amax, then sum(exp(x - max)) (a later pass using the first), logsumexp stored per
    row and the normalized output as an inner store: one kernel."""
    x = torch.randn(5, 3, 7)
    row = load("x", 21 * x0 + 7 * r0 + r1)
    m = Reduce("amax", row, F32)
    e = ap("exp", ap("sub", row, m))
    s = Reduce("sum", e, F32)
    k = Kernel("softmax", (5,), (3, 7), (
        Store("y", 21 * x0 + 7 * r0 + r1, ap("div", e, s)),
        Store("lse", x0, ap("add", ap("log", s), m))))
    run = compile_program(program({"x": ((5, 3, 7), F32), "y": ((5, 3, 7), F32),
                                   "lse": ((5,), F32)}, ["x"], [k], ["y", "lse"]))
    y, lse = run([x])
    torch.testing.assert_close(y, torch.softmax(x.reshape(5, 21), 1).reshape(5, 3, 7))
    torch.testing.assert_close(lse, torch.logsumexp(x.reshape(5, 21), 1))
    assert ("for roff in range" in run.kernels[0].source) == (rows == "looped")


def test_full_reduction_and_moments(rows):
    x = torch.randn(30, 11, dtype=torch.float64)
    v = load("x", 11 * r0 + r1, torch.float64)
    n = const(330.0, torch.float64)
    mean = ap("div", Reduce("sum", v, torch.float64), n)
    var = ap("div", Reduce("sum", ap("mul", ap("sub", v, mean), ap("sub", v, mean)),
                           torch.float64), n)
    k = Kernel("k", (), (30, 11), (Store("mean", 0, mean), Store("var", 0, var),
                                   Store("p", 0, Reduce("prod", ap("exp", ap("mul", v, const(
                                       1e-3, torch.float64))), torch.float64))))
    bufs = {"x": ((30, 11), torch.float64), **{b: ((), torch.float64) for b in ("mean", "var", "p")}}
    mean, var, p = compile_program(program(bufs, ["x"], [k], ["mean", "var", "p"]))([x])
    torch.testing.assert_close(mean, x.mean())
    torch.testing.assert_close(var, x.var(unbiased=False))
    torch.testing.assert_close(p, torch.exp(x * 1e-3).prod())


@pytest.mark.parametrize("op", ["argmax", "argmin", "amax", "amin"])
def test_arg_and_extreme_reductions_ties_nan_inf(op, rows):
    nan, inf = float("nan"), float("inf")
    data = [[1, 3, 3, 2, 3, 0], [nan, 5, nan, 1, 9, 9], [-inf] * 6, [inf] * 6,
            [2, 1, 1, 2, -1, -1], [0, -0.0, 0, 7, nan, 7], [0, 1, 2, 3, 9, 9]]
    x = torch.tensor(data).reshape(7, 2, 3)
    out_dtype = I64 if op.startswith("arg") else F32
    k = Kernel("k", (7,), (2, 3), (Store("y", x0, Reduce(
        op, load("x", 6 * x0 + 3 * r0 + r1), out_dtype)),))
    run = compile_program(program({"x": ((7, 2, 3), F32), "y": ((7,), out_dtype)},
                                  ["x"], [k], ["y"]))
    torch.testing.assert_close(run([x])[0], getattr(torch, op)(x.reshape(7, 6), 1),
                               equal_nan=True)


def test_integer_and_bool_reductions(rows):
    x = torch.tensor([[5, -3, 5, 120, 9], [100, 100, -128, 7, 100]], dtype=torch.int8)
    b = x > 6
    kernel = Kernel("k", (2,), (5,), (
        Store("i", x0, Reduce("argmax", load("x", 5 * x0 + r0, torch.int8), I64)),
        Store("s", x0, Reduce("sum", load("x", 5 * x0 + r0, torch.int8), torch.int8)),
        Store("n", x0, Reduce("sum", ap("convert", load("b", 5 * x0 + r0, BOOL), dtype=I64), I64)),
        Store("any", x0, Reduce("amax", load("b", 5 * x0 + r0, BOOL), BOOL))))
    run = compile_program(program({"x": ((2, 5), torch.int8), "b": ((2, 5), BOOL),
                                   "i": ((2,), I64), "s": ((2,), torch.int8),
                                   "n": ((2,), I64), "any": ((2,), BOOL)},
                                  ["x", "b"], [kernel], ["i", "s", "n", "any"]))
    i, s, n, any_ = run([x, b])
    assert i.tolist() == x.argmax(1).tolist()
    assert s.tolist() == x.sum(1, dtype=torch.int8).tolist()
    assert n.tolist() == b.sum(1).tolist() and any_.tolist() == b.any(1).tolist()


@pytest.mark.parametrize("op,identity", [("sum", 0.0), ("prod", 1.0)])
def test_empty_reduction(op, identity, rows):
    k = Kernel("k", (3,), (0,), (Store("y", x0, Reduce(op, load("x", x0 * 0 + r0), F32)),))
    run = compile_program(program({"x": ((3, 0), F32), "y": ((3,), F32)}, ["x"], [k], ["y"]))
    assert run([torch.empty(3, 0)])[0].tolist() == [identity] * 3


def test_extern_in_the_middle_and_buffers_freed():
    x, w = torch.randn(5, 4), torch.randn(4, 3)
    kernels = [
        Kernel("k0", (5, 4), (), (Store("a", 4 * x0 + x1, ap("mul", load("x", 4 * x0 + x1), const(2.0))),)),
        Extern("mm", lambda a, b: a @ b, ("a", "w"), ("c",), (), "torch.mm"),
        Kernel("k2", (5, 3), (), (Store("y", 3 * x0 + x1, ap("maximum", load("c", 3 * x0 + x1), const(0.0))),)),
    ]
    bufs = {"x": ((5, 4), F32), "w": ((4, 3), F32), "a": ((5, 4), F32), "c": ((5, 3), F32),
            "y": ((5, 3), F32)}
    run = compile_program(program(bufs, ["x", "w"], kernels, ["y"]))
    torch.testing.assert_close(run([x, w])[0], torch.relu((x * 2) @ w))
    assert run.kernels[1].source == "c, = torch.mm(a, w)"
    assert "    del a, w\n" in run.wrapper_source
    first = f"{run.writers[0].name}[(1,)](x, a"
    assert run.wrapper_source.index("a = torch.empty") < run.wrapper_source.index(first)


def test_source_is_a_cached_file_and_registered(tmp_path):
    k = Kernel("k", (4,), (), (Store("y", x0, ap("add", load("x", x0), const(0.125))),))
    with plait.config.patch(cache_dir=str(tmp_path)):
        run = compile_program(program({"x": ((4,), F32), "y": ((4,), F32)}, ["x"], [k], ["y"]))
    (name,) = os.listdir(tmp_path / "triton")
    assert (tmp_path / "triton" / name).read_text() == run.triton_source
    assert run.kernels[0].source in run.source and "def run(x):" in run.source
    assert "triton" in available_backends()


# ---------------------------------------------------------------------------------------
# Every op against torch, on tricky values
# ---------------------------------------------------------------------------------------
INTERPRETED_OPS = sorted(supported_ops() - {"where", "convert"})
DTYPES = sorted(TRITON_DTYPES, key=str)


def _conversion_values(v, dtype, to):
    if dtype.is_floating_point:  # fractions and values in range of the narrow integers
        v = torch.cat([v, torch.tensor([-129.0, 300.0, -3.7, 3.7], dtype=dtype)])
        v = v[(v.abs() < 1e9) | v.isnan()]
        if not to.is_floating_point and to != BOOL:
            v = v.nan_to_num(0.0)  # NaN to an integer is undefined behaviour
    return v


@pytest.fixture(scope="module")
def all_ops(tmp_path_factory):
    """op -> [(kernel name, result, eager's result)] over every interpreted op and dtype."""
    prog, feeds, cases = per_op_program(INTERPRETED_OPS, DTYPES, _conversion_values)
    with plait.config.patch(cache_dir=str(tmp_path_factory.mktemp("ops"))):
        run = compile_program(prog)
    results = dict(zip(prog.outputs, run(feeds)))
    return {op: [(name, results[name], want) for name, want in c] for op, c in cases.items()}


@pytest.mark.parametrize("op", INTERPRETED_OPS + ["where", "convert"])
def test_op_against_torch(op, all_ops):
    assert op in all_ops, f"{op} is never tested"
    for name, got, want in all_ops[op]:
        if want.dtype in (torch.bfloat16, torch.float16):
            # computed in float32 and rounded once, as eager; the interpreter rounds float32
            # to half precision toward zero (a GPU to nearest), so allow that one unit
            eps = torch.finfo(want.dtype).eps
            torch.testing.assert_close(got, want, rtol=eps, atol=0, equal_nan=True,
                                       msg=lambda m, name=name: f"{name}: {m}")
            continue
        _check(got, want, name, signed_zeros=op not in ("maximum", "minimum", "fmax", "fmin"))


def test_gpu_only_ops_name_libdevice_functions():
    """The interpreter has no libdevice: check that the names exist for the GPU build."""
    from triton.language.extra.cuda import libdevice

    for op in set(TRITON_OPS) - supported_ops():
        fn = TRITON_OPS[op].split("(")[0]
        assert fn == "_pow" or hasattr(libdevice, fn.removeprefix("libdevice.")), op


# ---------------------------------------------------------------------------------------
# plait.jit end to end
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [
    lambda x: (x.t() * 2 + 1).exp().t().contiguous() - x,
    lambda x: torch.nn.functional.pad(x[1:, ::2], (1, 2, 0, 3), value=0.5) * 3,
    lambda x: torch.cat([x, x.flip(0) * 2], 1).sigmoid(),
    lambda x: x[:, None, :] + x[:, :, None].sum(1, keepdim=True) * x[:1, None, :],
], ids=["transpose", "slice-pad", "concat-flip", "broadcast"])
def test_pointwise_chains_with_views(fn):
    jitted(fn, torch.randn(9, 7))


def test_argmax_with_nan_and_ties(rows):
    x = torch.tensor([[1.0, 3, 3, 2], [float("nan"), 1, float("nan"), 5], [4, 4, 4, 4]])
    jitted(lambda x: (x.argmax(1), x.argmin(0), x.amax(1), x.max(0)), x)


def test_integer_ops():
    a = torch.tensor([[7, -7, 100, -128], [3, 0, -1, 5]], dtype=torch.int32)
    b = torch.tensor([[2, 3, -3, 7], [-2, 5, 4, 1]], dtype=torch.int32)
    jitted(lambda a, b: (a // b, a % b, torch.fmod(a, b), a << (b & 7), a >> (b & 3),
                         (a ^ b).to(torch.int8) * 3, torch.div(a, b, rounding_mode="trunc"),
                         a.sum(1), (a > b).sum(0)), a, b)


def test_float64_and_bool_inputs():
    x = torch.randn(5, 6, dtype=torch.float64)
    jitted(lambda x, m: torch.where(m, x.exp(), -x).cumsum(1).mean(0), x, x > 0)


# A representative OpInfo subset: elementwise, reductions, views, softmax and norms,
# indexing (gathers are externs between kernels).
SWEEP_OPS = {
    "abs", "add", "sub", "mul", "div", "neg", "exp", "log", "sqrt", "rsqrt", "sin", "cos",
    "sigmoid", "erf", "floor", "ceil", "trunc", "round", "sign", "remainder", "fmod",
    "maximum", "minimum", "clamp", "where", "eq", "lt", "isnan", "logical_and", "bitwise_xor",
    "nan_to_num", "lerp", "addcmul", "sum", "mean", "prod", "amax", "amin", "argmax", "argmin",
    "var", "std", "logsumexp", "softmax", "log_softmax", "nn.functional.layer_norm",
    "nn.functional.rms_norm", "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu",
    "transpose", "permute", "expand", "flip", "narrow", "cat", "stack",
    "nn.functional.pad", "index_select", "gather", "take_along_dim", "matmul",
}


@pytest.mark.slow  # 20 s in the interpreter
def test_opinfo_sweep_has_no_wrong_answers():
    result = sweep("jit", SWEEP_OPS, backend="triton")
    print("\ntriton: " + result.summary())
    assert set(result.outcomes.values()) <= {"match", "plait_error"}, result.summary()
    assert len(result.ops) >= 55 and result.count("match") >= 0.95 * result.total, \
        result.summary()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fn", [
    lambda x, w, b: torch.nn.functional.gelu(x * w + b),
    lambda x, w, b: torch.nn.functional.layer_norm(x, (32,), w, b),
    lambda x, w, b: torch.nn.functional.rms_norm(x, (32,), w, eps=1e-6) + b,
    lambda x, w, b: torch.softmax(x * w, -1).amax(0) - b,
], ids=["gelu_bias", "layer_norm", "rms_norm", "softmax_amax"])
def test_half_precision_is_one_kernel_computed_in_float32(fn, dtype):
    """bf16/fp16 loads and stores in the kernel, the math in float32 (as eager's kernels), so
    a half-precision model needs no extern and no conversion pass."""
    x, w, b = torch.randn(64, 32).to(dtype), torch.randn(32).to(dtype), torch.randn(32).to(dtype)
    jitted = plait.jit(fn, backend="triton")
    got, want = jitted(x, w, b), fn(x, w, b)
    assert got.dtype == dtype
    # the interpreter rounds float32 to half toward zero, a GPU to nearest: each rounded
    # intermediate may be a unit apart, which near a cancellation is a unit of its magnitude
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, rtol=2 * eps, atol=4 * eps * want.abs().max().item())
    stats = jitted.lower(x, w, b).stats
    assert stats["externs"] == 0 and stats["kernels"] <= 2


@pytest.mark.parametrize("fn, passes", [
    (lambda x: torch.softmax(x, -1), 2),  # max and sum together, then the stores
    (lambda x: torch.log_softmax(x, -1), 2),
    (lambda x: torch.exp(x - x.amax(-1, keepdim=True)).sum(-1), 1),
], ids=["softmax", "log_softmax", "sum_exp"])
def test_online_softmax_reads_long_rows_once_before_storing(fn, passes, monkeypatch):
    """NOTE [online softmax]: rows too long for one tile take the max and the sum of
    exponentials in one pass, with eager's results on rows of -inf, NaN and +inf too."""
    monkeypatch.setattr(triton_backend, "PERSISTENT_MAX", 0)
    monkeypatch.setattr(triton_backend, "LOOPED_RBLOCK", 4)
    monkeypatch.setattr(triton_backend, "FEW_ROWS", 0)  # chunks of 4 however few the rows
    x = torch.randn(6, 37)
    x[1], x[2, 3], x[3, 5], x[4, :10] = float("-inf"), float("nan"), float("inf"), float("-inf")
    assert jitted(fn, x).kernels[0].source.count("for roff") == passes


@pytest.mark.slow  # 7 s in the interpreter
def test_long_column_reductions_take_neighbouring_columns_together(monkeypatch):
    """Rows reduced along a strided axis (a column sum) launch several outputs per program,
    so each chunk's loads coalesce; contiguous rows one (loops.column_wise)."""
    monkeypatch.setattr(triton_backend, "PERSISTENT_MAX", 0)
    x = torch.randn(37, 8)
    columns = jitted(lambda x: x.sum(0), x).source
    rows = jitted(lambda x: x.sum(1), x).source
    assert "XBLOCK=8," in columns  # all 8 columns in one program
    assert f"XBLOCK={triton_backend.LOOPED_XBLOCK}," in rows
    # gradients of a split's parts, concatenated and summed over rows (a bias gradient):
    # indices with clamps, contiguous along the columns of each part
    concat = jitted(lambda a, b: torch.cat([a, b * 2], 1).sum(0), x, x).source
    assert "XBLOCK=16," in concat
    # whatever their dtype (a bool mask, bfloat16), and in chunks of rows even where they fit
    # one tile (outputs enough to fill a GPU: not FEW_ROWS; jitted checks each against eager)
    monkeypatch.setattr(triton_backend, "PERSISTENT_MAX", 4096)
    wide, mask = torch.randn(300, 256), torch.rand(300, 256) > 0.5
    for source in (jitted(lambda x, m: torch.where(m, x, 0.0).sum(0), wide, mask).source,
                   jitted(lambda x: x.sum(0), wide.bfloat16()).source,
                   jitted(lambda x: x.sum(0), wide).source):
        assert (f"XBLOCK={triton_backend.COLUMNS_XBLOCK}, "
                f"RBLOCK={triton_backend.COLUMNS_RBLOCK}," in source)
        assert "for roff in range" in source
    # and COLUMNS_STORING_XBLOCK where the kernel also stores each point (a gradient, summed
    # for a bias's)
    fn = lambda x: (x.exp() * 2, (x.exp() * 2).sum(0))  # noqa: E731
    stored = plait.jit(fn, backend="triton")
    torch.testing.assert_close(stored(wide), fn(wide), rtol=1e-5, atol=1e-4)  # 300-row sums
    assert len(stored.lower(wide).kernels) == 1
    assert f"XBLOCK={triton_backend.COLUMNS_STORING_XBLOCK}," in stored.lower(wide).source


@pytest.mark.slow  # 8 s in the interpreter
def test_few_long_rows_take_the_biggest_chunks_and_more_warps(monkeypatch):
    """Fewer long rows than fill a GPU with programs (a mean over every row's loss): each
    program keeps more loads in flight; many rows keep the default chunks. (Rows that split
    do not get here: NOTE [split reductions].)"""
    monkeypatch.setattr(triton_backend, "PERSISTENT_MAX", 0)
    monkeypatch.setattr(split, "SPLIT_OUTPUTS", 0)
    few = jitted(lambda x: x.sum(1), torch.randn(3, 5000)).source
    many = jitted(lambda x: x.sum(1), torch.randn(triton_backend.FEW_ROWS, 50)).source
    assert (f"RBLOCK={triton_backend.TILE_MAX}, num_warps={triton_backend.FEW_ROWS_WARPS},"
            in few)
    assert f"RBLOCK={triton_backend.LOOPED_RBLOCK}, num_warps=4," in many


def test_kernel_globals_equal_themselves():
    """Triton (compiled, not interpreted) refuses to launch a kernel whose globals no longer
    equal what it was compiled with, by ==: a NaN constexpr global would fail every launch."""
    import triton.language as tl

    module = triton_backend.load_module(triton_backend.prelude())
    constants = {n: v for n, v in vars(module).items() if isinstance(v, tl.constexpr)}
    assert constants and all(v == v for v in constants.values())


def test_row_stores_that_need_no_reduction_share_its_pass(monkeypatch):
    """Long rows: the loop-ordering example's x / 10 is stored in the pass that sums x, so x
    is read once."""
    monkeypatch.setattr(triton_backend, "PERSISTENT_MAX", 0)
    monkeypatch.setattr(triton_backend, "LOOPED_RBLOCK", 4)
    monkeypatch.setattr(triton_backend, "FEW_ROWS", 0)  # chunks of 4 however few the rows

    def f(x):
        return x.sum(-1), x / 10, (x / 10).t().contiguous().t()

    source = jitted(f, torch.randn(5, 37)).kernels[0].source
    assert source.count("for roff") == 1 and source.count("tl.load") == 1


# ---------------------------------------------------------------------------------------
# 2-D tiles for transposed loads and stores (NOTE [Triton code generation])
# ---------------------------------------------------------------------------------------
@pytest.fixture(params=[64, 8])
def tile_edge(request, monkeypatch):
    """The default 64x64 tiles (one program covers a 37x45 input), or 8x8 ones (several
    programs along each axis, the last ones ragged)."""
    monkeypatch.setattr(triton_backend, "TILE_EDGE", request.param)
    return request.param


def _tiled(kernel) -> bool:
    return "tl.program_id(1)" in kernel.source and "YBLOCK" in kernel.source


@pytest.mark.parametrize("fn, shapes, tiled", [
    (lambda x: x.t().contiguous(), [(37, 45)], 1),
    (lambda x: x.t().contiguous(), [(45, 37)], 1),
    (lambda x, y: x.t() + y, [(37, 45), (45, 37)], 1),
    (lambda x, b, c, s: (x.t() * b + c[:, None] - s).contiguous(), [(37, 45), (37,), (45,), ()], 1),
    (lambda x: (x.flip(0).t() + 1).contiguous(), [(37, 45)], 1),
    (lambda x: (x.exp(), x.exp().t().contiguous()), [(37, 45)], 1),
    (lambda x: (x.permute(2, 1, 0) * 2 + 1).contiguous(), [(9, 4, 11)], 1),
    (lambda x: x.transpose(1, 2).contiguous(), [(3, 37, 45)], 1),
    (loop_ordering, [(37, 45)], 0),
    (lambda x: x * 2 + 1, [(37, 45)], 0),
    (lambda x, c: x + c[:, None], [(37, 45), (37,)], 0),
], ids=["copy", "copy_wide", "t_plus", "broadcasts", "flip", "transposed_store", "permute_3d",
        "batched", "loop_order", "contiguous", "broadcast_only"])
def test_transposed_pointwise_kernels_are_2d_tiled(fn, shapes, tiled, tile_edge):
    lowered = jitted(fn, *[torch.randn(s) for s in shapes])
    assert sum(map(_tiled, lowered.kernels)) == tiled
    assert all(_tiled(k) or "YBLOCK" not in k.source for k in lowered.kernels)


def test_2d_tile_indices_and_launch():
    """The tile walks the innermost loop on x and the loop the load is contiguous along on y
    (after the other outer loops): permute(2, 1, 0) reads x0 contiguously."""
    lowered = jitted(lambda x: x.permute(2, 1, 0).contiguous(), torch.randn(40, 3, 70))
    source = lowered.kernels[0].source
    for line in ["yindex = tl.program_id(0) * YBLOCK + tl.arange(0, YBLOCK)[:, None]",
                 "xindex = tl.program_id(1) * XBLOCK + tl.arange(0, XBLOCK)[None, :]",
                 "xmask = (yindex < 210) & (xindex < 40)", "x1 = (yindex // 70)",
                 "x0 = yindex % 70", "x2 = xindex"]:
        assert f"    {line}\n" in source
    assert "[(4, 1)](in0, buf1, YBLOCK=64, XBLOCK=64, num_warps=8, enable_fp_fusion=False)" in lowered.source


# ---------------------------------------------------------------------------------------
# Autotuning (NOTE [autotuning])
# ---------------------------------------------------------------------------------------
def _layer_norm_of_matmul(a, b):
    return torch.nn.functional.layer_norm(torch.relu(a @ b) * 2, (b.shape[1],))


AUTOTUNED = {
    "pointwise": (lambda x: torch.exp(x) * 2 + 1, (torch.randn(33, 17),)),
    "tiled": (lambda x: x.t() * 2, (torch.randn(37, 45),)),
    "persistent_rows": (lambda x: torch.softmax(x, -1), (torch.randn(9, 40),)),
    "looped_rows": (lambda x: torch.log_softmax(x, -1), (torch.randn(2, 4100),)),
    # small integers: every tile's order of summing is exact
    "column_sums": (lambda x: x.sum(0), (torch.randint(-4, 5, (1030, 24)).float(),)),
    "in_place": (_layer_norm_of_matmul, (torch.randn(6, 5), torch.randn(5, 24))),
}


# the interpreter times the long rows' candidates for a minute: those three in the slow tier
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow)
                                  if c in ("looped_rows", "column_sums", "persistent_rows") else c
                                  for c in sorted(AUTOTUNED)])
def test_autotuning_keeps_the_fastest_launch_and_remembers_it(case, tmp_path, monkeypatch):
    """Every candidate launch runs (on copies of the written buffers); the fastest is used,
    written beside the kernels, and read back by a later compilation without timing."""
    fn, args = AUTOTUNED[case]
    clock = iter(range(1000, 0, -1))  # each candidate timed "faster" than the one before

    def fake_time(launch, device):
        launch()
        return next(clock)

    monkeypatch.setattr(triton_backend, "time_launch", fake_time)
    with plait.config.patch(triton_autotune=True, cache_dir=str(tmp_path)):
        jit = plait.jit(fn, backend="triton")
        torch.testing.assert_close(jit(*args), fn(*args))
        compiled = jit.lower(*args).compiled
        assert bool(compiled.program.aliases) == (case == "in_place")
        tuning = json.loads(pathlib.Path(compiled._tuning_path).read_text())
        chosen = {w.name: w.candidates()[-1] for w in compiled.writers.values()}
        assert tuning == {f"{name} on interpreter": c for name, c in chosen.items()}
        assert all(len(w.candidates()) > 4 for w in compiled.writers.values())
        if case == "column_sums":  # tiles of neighbouring columns, by chunks of rows
            assert {(c["XBLOCK"], c["RBLOCK"]) for w in compiled.writers.values()
                    for c in w.candidates()} >= {(32, 16), (32, 128), (16, 256)}

        def no_timing(launch, device):
            raise AssertionError("a tuned kernel was timed again")

        monkeypatch.setattr(triton_backend, "time_launch", no_timing)
        again = plait.jit(lambda *a: fn(*a), backend="triton")
        torch.testing.assert_close(again(*args), fn(*args))
        torch.testing.assert_close(jit(*args), fn(*args))


@pytest.mark.parametrize("how", ["config", "torch"])
def test_deterministic_autotuning_times_only_what_changes_no_result(how, tmp_path,
                                                                   monkeypatch):
    """NOTE [deterministic programs]: a reduction's launch configuration sets the order it
    sums in, so it keeps the rule's; an elementwise kernel is still tuned. Set by
    ``config.deterministic`` or by torch's own switch."""
    timed = []

    def fake_time(launch, device):
        timed.append(launch)
        launch()
        return 1000 - len(timed)  # each candidate "faster" than the one before

    monkeypatch.setattr(triton_backend, "time_launch", fake_time)
    x, y = torch.randn(6, 300), torch.randn(40, 7)  # (apart: not fused into one kernel)
    fn = lambda x, y: (torch.exp(y) * 2, torch.log_softmax(x, -1))  # noqa: E731
    deterministic = plait.config.patch(deterministic=True) if how == "config" else \
        _torch_deterministic()
    with plait.config.patch(triton_autotune=True, cache_dir=str(tmp_path)), deterministic:
        jit = plait.jit(fn, backend="triton")
        for got, want in zip(jit(x, y), fn(x, y)):
            torch.testing.assert_close(got, want)
        compiled = jit.lower(x, y).compiled
        tuned = json.loads(pathlib.Path(compiled._tuning_path).read_text())
        rows = [w.name for w in compiled.writers.values() if w.row_kernel]
        elementwise = [w for w in compiled.writers.values() if not w.row_kernel]
        assert rows and elementwise and not any(f"{n} on interpreter" in tuned for n in rows)
        assert tuned == {f"{w.name} on interpreter": w.candidates()[-1] for w in elementwise}


@contextlib.contextmanager
def _torch_deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def test_autotuning_reads_past_a_damaged_file(tmp_path, monkeypatch):
    monkeypatch.setattr(triton_backend, "time_launch", lambda launch, device: launch() or 1.0)
    x = torch.randn(8, 8)
    with plait.config.patch(triton_autotune=True, cache_dir=str(tmp_path)):
        jit = plait.jit(lambda x: x.cos() + 1, backend="triton")
        path = pathlib.Path(jit.lower(x).compiled._tuning_path)
        path.write_text("{truncated")
        torch.testing.assert_close(jit(x), x.cos() + 1)
        assert json.loads(path.read_text())  # rewritten whole


_DOUBLE = '''import triton
import triton.language as tl


@triton.jit
def double(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)
'''


def test_compile_workers_fill_tritons_cache_and_survive_failures(tmp_path, monkeypatch):
    """NOTE [compile workers]: a worker compiles a kernel for a GPU target (no GPU needed:
    Triton compiles ahead for sm_90) into Triton's disk cache; a job that fails or a worker
    that died answers False, and the pool goes on; closed, its workers end."""
    from plait.backends import compile_workers

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # workers compile for a GPU
    (tmp_path / "kernels.py").write_text(_DOUBLE)
    job = {"path": str(tmp_path / "kernels.py"), "module": "kernels", "kernel": "double",
           "target": {"backend": "cuda", "arch": 90, "warp_size": 32},
           "specialization": json.dumps({
               "signature": {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
               "constant_keys": [[2]], "constant_vals": [128],
               "attrs_keys": [[0]], "attrs_vals": [[["tt.divisibility", 16]]],
               "options": {"num_warps": 4}})}
    # run through a symlink, as a package often is: its folder still leaves sys.path
    link = tmp_path / "linked"
    link.symlink_to(pathlib.Path(compile_workers.__file__).parent)
    monkeypatch.setattr(compile_workers, "__file__", str(link / "compile_workers.py"))
    pool = compile_workers.Pool(1)
    assert not pool.compile(dict(job, kernel="missing"))
    assert pool.compile(job)
    assert [p.name for p in (tmp_path / "triton").rglob("double.cubin")]
    (worker,) = pool._idle.queue
    worker.kill()
    worker.wait()
    assert not pool.compile(job) and not pool.compile(job)  # no worker left, no hang
    # closed (at exit), the pool's live workers end
    pool = compile_workers.Pool(2)
    workers = list(pool._idle.queue)
    pool.close()
    assert all(w.poll() is not None for w in workers)


# -- split reductions (NOTE [split reductions], passes/split.py) -----------------------------
def _batch_norm_loss(x, g):
    return (torch.nn.functional.batch_norm(x, None, None, training=True) * g).sum()


@pytest.mark.parametrize("name, fn, args, kernels", [
    # a column sum (a bias gradient): one pass, partial and final kernels
    ("column sum", lambda g: g.sum(0), (torch.randn(4096, 24),), 2),
    pytest.param("max", lambda x: x.amax(0), (torch.randn(4096, 3),), 2, marks=pytest.mark.slow),
    ("mean of all", lambda x: x.mean(), (torch.randn(8192),), 2),
    # BatchNorm's statistics of a small input: the variance's pass after the mean's, each
    # split (a large one's take one pass: test_large_batch_statistics_take_one_pass)
    pytest.param("mean and variance", lambda x: torch.var_mean(x, (0, 2, 3)),
                 (torch.randn(64, 4, 8, 8),), 4, marks=pytest.mark.slow),
    # bf16 sums: float32 partials, rounded once
    ("bf16 sum", lambda x: x.sum((0, 1)), (torch.randn(64, 64, 5).bfloat16(),), 2),
    # a gradient and its column sums (a bias's): made and summed in one partial kernel
    pytest.param("values and their column sums",
                 lambda g, x: ((y := g * torch.sigmoid(x)), y.sum(0)),
                 (torch.randn(4096, 24), torch.randn(4096, 24)), 2, marks=pytest.mark.slow),
    # a row kernel: two passes split, then its stores over the rows' points
    pytest.param("softmax of few rows", lambda x: x.softmax(1), (torch.randn(3, 4096),), 5,
                 marks=pytest.mark.slow),
    # BatchNorm's backward: two sums per channel, then the input's gradient from them
    pytest.param("batch norm backward", plait.grad(_batch_norm_loss),
                 (torch.randn(64, 4, 8, 8), torch.randn(64, 4, 8, 8)), None,
                 marks=pytest.mark.slow),  # 10 s in the interpreter
])
def test_long_reductions_to_few_outputs_split(name, fn, args, kernels):
    jitted = plait.jit(fn, backend="triton")
    got, want = jitted(*args), (torch.func.grad(_batch_norm_loss) if name.startswith("batch")
                                else fn)(*args)
    for g, w in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, want))):
        # summed in another order: within the rounding of a 4096-term float32 sum
        torch.testing.assert_close(g, w, **{"rtol": 1e-5, "atol": 1e-4} if w.dtype ==
                                   torch.float32 else {})
    stages = jitted.lower(*args).stages
    before, after = len(stages["reindex"].kernels), len(stages["split"].kernels)
    assert (before, after) == (1, kernels) if kernels else after > before


@pytest.mark.slow  # 7 s in the interpreter
def test_column_sums_split_into_more_chunks_than_row_sums():
    """A column sum's program takes several neighbouring outputs, so it splits its rows
    into more, shorter chunks (of MIN_COLUMN_CHUNK rows or more) than a row sum to as few
    outputs does (of MIN_CHUNK elements or more)."""
    x = torch.randn(4096, 8)
    for fn, rows, chunks in ((lambda x: x.sum(0), x, 4096 // split.MIN_COLUMN_CHUNK),
                             (lambda x: x.t().sum(1), x, 4096 // split.MIN_COLUMN_CHUNK),
                             (lambda x: x.sum(1), x.t().contiguous(), 4096 // split.MIN_CHUNK)):
        jit = plait.jit(fn, backend="triton")
        # summed in another order: within the rounding of a 4096-term float32 sum
        torch.testing.assert_close(jit(rows), fn(rows), rtol=1e-5, atol=1e-4)
        program = jit.lower(rows).stages["split"]
        (partial,) = [b for b in program.buffers if "partial" in b]
        assert program.buffers[partial].type.shape == (chunks, 8)


@pytest.mark.slow  # 5 s in the interpreter
def test_large_batch_statistics_take_one_pass(monkeypatch):
    """var_mean of an input too large for the cache (made small here by the threshold): the
    shifted sums of x and its square in one kernel, split into partial sums and a final
    per-channel kernel that adds the shift back; exact to float32's rounding though the mean
    is far from zero."""
    monkeypatch.setattr(plait.tracer.aten, "ONE_PASS_VARIANCE_BYTES", 0)
    x = torch.randn(64, 4, 8, 8) * 3 + 100
    jitted = plait.jit(lambda x: torch.var_mean(x, (0, 2, 3), correction=1), backend="triton")
    var, mean = jitted(x)
    want_var, want_mean = torch.var_mean(x.double(), (0, 2, 3), correction=1)
    torch.testing.assert_close(var.double(), want_var, rtol=1e-5, atol=0)
    torch.testing.assert_close(mean.double(), want_mean, rtol=1e-6, atol=0)
    stages = jitted.lower(x).stages
    assert (len(stages["reindex"].kernels), len(stages["split"].kernels)) == (1, 2)


@pytest.mark.parametrize("fn, x", [
    pytest.param(lambda x: x.argmax(0), torch.randn(4096, 3),  # an index, not combinable
                 marks=pytest.mark.slow),  # 7 s in the interpreter
    pytest.param(lambda x: x.sum(1), torch.randn(4096, 4096 // 64),  # outputs enough to fill
                 marks=pytest.mark.slow),  # a GPU (18 s in the interpreter)
    (lambda x: x.sum(0), torch.randn(512, 3)),             # rows too short to pay
])
def test_reductions_that_stay_whole(fn, x):
    jitted = plait.jit(fn, backend="triton")
    # summed in another order: within the rounding of a 4096-term float32 sum
    torch.testing.assert_close(jitted(x), fn(x), rtol=1e-5, atol=1e-4)
    stages = jitted.lower(x).stages
    assert stages["split"] is stages["reindex"]


def test_the_cpu_compiler_does_not_split():
    x = torch.randn(4096, 24)
    stages = plait.jit(lambda g: g.sum(0), backend="cpp").lower(x).stages
    assert stages["split"] is stages["reindex"]


def test_a_row_store_in_place_waits_for_the_passes_that_read_its_memory(monkeypatch):
    """A row store that needs no reduction goes in a looped kernel's first pass, but not
    where it writes in place over a buffer a later pass reads: here y = x * 2 takes over x,
    whose centred squares the second pass sums."""
    monkeypatch.setattr(triton_backend, "PERSISTENT_MAX", 0)
    monkeypatch.setattr(triton_backend, "LOOPED_RBLOCK", 4)
    x = load("x", 9 * x0 + r0)
    mean = ap("div", Reduce("sum", x, F32), const(9.0))
    var = Reduce("sum", ap("mul", ap("sub", x, mean), ap("sub", x, mean)), F32)
    k = Kernel("k", (5,), (9,), (Store("y", 9 * x0 + r0, ap("mul", x, const(2.0))),
                                 Store("v", x0, var)))
    p = program({"a": ((5, 9), F32), "x": ((5, 9), F32), "y": ((5, 9), F32),
                 "v": ((5,), F32)}, ["a"], [Kernel("copy", (45,), (), (Store(
                     "x", x0, ap("add", load("a", x0), const(1.0))),)), k], ["y", "v"])
    p = attrs.evolve(p, aliases={"y": "x"})
    a = torch.randn(5, 9)
    y, v = compile_program(p)([a])
    torch.testing.assert_close(y, (a + 1) * 2)
    torch.testing.assert_close(v, (a + 1).var(1) * 8)


def test_the_specialization_hook_skips_compiles_only_in_threads_that_collect():
    """Triton's cache hook is one per process. plait's, installed once, records and skips a
    compile only in a thread collecting specializations: threads collecting at once each get
    their own, and a thread compiling meanwhile, or any thread afterwards, compiles (a hook
    left behind would skip its kernels' launches silently)."""
    import threading
    import types

    runtime = types.SimpleNamespace(jit_cache_hook=lambda **kw: "theirs")
    triton_backend._install_specialization_hook(runtime)
    hook = runtime.jit_cache_hook
    triton_backend._install_specialization_hook(runtime)
    assert runtime.jit_cache_hook is hook  # installed once, chaining the hook it found
    together, results = threading.Barrier(3), {}

    def collect(name):
        triton_backend._collecting.seen = seen = []
        together.wait()
        results[name] = hook(compile={"specialization_data": name}), seen
        triton_backend._collecting.seen = None
        results[name + " after"] = hook(compile={"specialization_data": name})

    def compile_plainly():
        together.wait()
        results["plain"] = hook(compile={"specialization_data": "plain"})

    threads = [threading.Thread(target=collect, args=(n,)) for n in "ab"]
    threads.append(threading.Thread(target=compile_plainly))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"a": (True, ["a"]), "b": (True, ["b"]), "plain": "theirs",
                       "a after": "theirs", "b after": "theirs"}
    assert hook(compile={"specialization_data": "main"}) == "theirs"


def test_a_kernel_of_symbolic_size_runs_at_every_size_and_checks_its_indices():
    """NOTE [symbolic sizes]: the size is an int argument, the grid follows each call's
    size, and a size whose points reach 2**31 is refused rather than indexed in int32."""
    s = sympy.Symbol("s_kernel", integer=True, positive=True)
    set_size_hint(s, 64)
    value = ap("mul", ap("exp", load("x", 24 * x0 + x1)), const(2.0))
    k = Kernel("scaled", (s, 24), (), (Store("y", 24 * x0 + x1, value),))
    run = compile_program(program({"x": ((s, 24), F32), "y": ((s, 24), F32)}, ["x"], [k],
                                  ["y"]))
    for n in (3, 50, 1000):
        x = torch.randn(n, 24)
        torch.testing.assert_close(run([x])[0], torch.exp(x) * 2)
    source = run.kernels[0].source
    assert "s_kernel, XBLOCK" in source and "xmask = xindex < (24 * s_kernel)" in source
    writer = next(iter(run.writers.values()))
    grid, _, args = writer.at({s: 1000})
    assert args == [1000] and grid == (-(-24000 // writer.blocks["XBLOCK"]),)
    with pytest.raises(BackendError, match="2\\*\\*31"):
        writer.at({s: 2 ** 27})


def test_a_symbolic_kernel_reading_a_buffer_of_more_symbols_than_its_loops():
    """Its int32 check reads the buffer's size, whose symbols its launch is keyed by too."""
    s, t = (sympy.Symbol(n, integer=True, positive=True) for n in ("s_rows", "s_cols"))
    set_size_hint(s, 8), set_size_hint(t, 8)
    k = Kernel("first", (s,), (), (Store("y", x0, ap("neg", load("x", x0))),))
    run = compile_program(program({"x": ((s, t), F32), "y": ((s,), F32)}, ["x"], [k], ["y"]))
    for rows, cols in ((3, 5), (3, 9), (7, 2)):
        x = torch.randn(rows, cols)
        torch.testing.assert_close(run([x])[0], -x.flatten()[:rows])
    writer = next(iter(run.writers.values()))
    assert writer.symbols == (s,) and writer.at({s: 2, t: 2})[2] == [2]
    with pytest.raises(BackendError, match="2\\*\\*31"):
        writer.at({s: 2, t: 2 ** 31})
