"""The C++ backend on hand-built LoopPrograms, against eager torch: code generation,
reductions, externs, buffer lifetimes, the disk cache, and every op of CPP_OPS; and the
wrapper both code generators share, for each."""
from __future__ import annotations

import functools
import os
import re
import subprocess
import warnings
import weakref

import plait
import pytest
import sympy
import torch
from plait.backends import available_backends, cpp, cpp_wrapper, toolchain
from plait.backends.cpp import CPP_DTYPES, CPP_OPS
from plait.compiler import generated
from plait.errors import BackendError, CheckError
from plait.graph import TensorType
from plait.graph.loops import (
    Apply,
    Buffer,
    Constant,
    Extern,
    IndexValue,
    Kernel,
    Load,
    LoopProgram,
    Reduce,
    Store,
    loop_vars,
)
from plait.tracer.primitives import BINARY, COMPARISONS, UNARY, UNARY_PREDICATES
from plait.tracer.registry import get_primitive

F32, I64, BOOL = torch.float32, torch.int64, torch.bool
compile_program = functools.partial(generated, "cpp")  # a hand-made program, as cpp compiles it
x0, x1, x2 = loop_vars("x", 3)
r0, r1 = loop_vars("r", 2)


def load(buffer, index, dtype=F32):
    return Load(buffer, sympy.sympify(index), dtype)


def ap(op, *args, dtype=None, **params):
    return Apply(op, args, tuple(sorted(params.items())), dtype or args[-1].dtype)


def const(value, dtype=F32):
    return Constant(value, dtype)


def program(buffers: dict, inputs, kernels, outputs, constants=None) -> LoopProgram:
    """``buffers``: name -> (shape, dtype)."""
    return LoopProgram({n: Buffer(n, TensorType(tuple(s), d)) for n, (s, d) in buffers.items()},
                       tuple(inputs), constants or {}, tuple(kernels), tuple(outputs))


def count_builds(monkeypatch) -> list:
    """The compiler's runs from now on; the C++ runtime, built once per process (NOTE [C++
    wrapper]), is built first."""
    cpp_wrapper.memory(), cpp_wrapper.runtime()
    calls = []
    real = subprocess.run

    def run(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(toolchain.subprocess, "run", run)
    return calls


# ---------------------------------------------------------------------------------------
# Pointwise kernels and indexing
# ---------------------------------------------------------------------------------------
def test_pointwise_chain_with_broadcast_load():
    x, b = torch.randn(4, 8), torch.randn(8)
    value = ap("add", ap("mul", ap("exp", load("x", 8 * x0 + x1)), load("b", x0 * 0 + x1)),
               const(1.0))
    k = Kernel("chain", (4, 8), (), (Store("y", 8 * x0 + x1, value),))
    run = compile_program(program({"x": ((4, 8), F32), "b": ((8,), F32), "y": ((4, 8), F32)},
                                  ["x", "b"], [k], ["y"]))
    torch.testing.assert_close(run([x, b])[0], torch.exp(x) * b + 1)
    assert "#pragma omp" not in run.kernels[0].source  # too small for a thread team
    assert run.kernels[0].reads == ("x", "b") and run.kernels[0].writes == ("y",)


def test_every_pass_over_the_rows_counts_toward_a_thread_team():
    """A softmax sweeps its rows three times (max, sum, stores): at [16, 32, 32] that is
    enough work for a thread team where one sum over the same points is not."""
    x = torch.randn(16, 32, 32)
    for fn, parallel in ((lambda x: torch.softmax(x, -1), True), (lambda x: x.sum(-1), False)):
        jitted = plait.jit(fn, backend="cpp")
        torch.testing.assert_close(jitted(x), fn(x))
        assert ("#pragma omp parallel" in jitted.lower(x).source) == parallel


def test_transposed_load_and_parallel_collapse():
    x = torch.randn(64, 32, 24)
    k = Kernel("perm", (24, 64, 32), (),
               (Store("y", x0 * 2048 + x1 * 32 + x2, ap("neg", load("x", x1 * 768 + x2 * 24 + x0))),))
    run = compile_program(program({"x": ((64, 32, 24), F32), "y": ((24, 64, 32), F32)},
                                  ["x"], [k], ["y"]))
    torch.testing.assert_close(run([x])[0], -x.permute(2, 0, 1), rtol=0, atol=0)
    assert "#pragma omp parallel for collapse(2)" in run.kernels[0].source


def test_where_with_clamped_loads():
    """Padding as lowering writes it: the discarded branch reads a clamped index."""
    x = torch.randn(6)
    inside = ap("bitwise_and", ap("ge", IndexValue(x0, I64), const(2, I64)),
                ap("lt", IndexValue(x0, I64), const(8, I64)))
    clamped = load("x", sympy.Max(0, sympy.Min(5, x0 - 2)))
    k = Kernel("pad", (10,), (), (Store("y", x0, ap("where", inside, clamped, const(-1.0))),))
    run = compile_program(program({"x": ((6,), F32), "y": ((10,), F32)}, ["x"], [k], ["y"]))
    torch.testing.assert_close(run([x])[0], torch.nn.functional.pad(x, (2, 2), value=-1.0))


@pytest.mark.parametrize("expr", [
    sympy.floor((x0 - 5) / 3), sympy.Mod(x0 - 5, 3), sympy.floor(x0 / 4), sympy.Mod(x0, 4),
    sympy.ceiling((x0 - 6) / 4), sympy.Max(x0 - 3, 2 * x0 - 9), (x0 - 4) ** 2,
    sympy.floor(sympy.floor(x0 / 2) / 3) * 3 - x0 * 5000000000])
def test_index_printer(expr):
    k = Kernel("idx", (12,), (), (Store("y", x0, IndexValue(expr, I64)),))
    run = compile_program(program({"y": ((12,), I64)}, [], [k], ["y"]))
    assert run([])[0].tolist() == [int(expr.subs(x0, i)) for i in range(12)]


def test_iota_of_floats_and_integer_constants():
    k = Kernel("iota", (5,), (), (
        Store("f", x0, IndexValue(sympy.Float(0.5) + x0 * sympy.Float(0.25), F32)),
        Store("i", x0, ap("add", IndexValue(x0, I64), const(-(1 << 63), I64))),))
    run = compile_program(program({"f": ((5,), F32), "i": ((5,), I64)}, [], [k], ["f", "i"]))
    f, i = run([])
    torch.testing.assert_close(f, torch.arange(5) * 0.25 + 0.5)
    assert i.tolist() == [-(1 << 63) + n for n in range(5)]


# ---------------------------------------------------------------------------------------
# Reductions
# ---------------------------------------------------------------------------------------
def test_softmax_with_multi_output_epilogue():
    """amax; then sum(exp(x - max)) stored with an epilogue (logsumexp) in the same kernel;
    then the normalization."""
    x = torch.randn(16, 100)
    row = load("x", 100 * x0 + r0)
    m = load("m", x0)
    s = Reduce("sum", ap("exp", ap("sub", row, m)), F32)
    kernels = [
        Kernel("kmax", (16,), (100,), (Store("m", x0, Reduce("amax", row, F32)),)),
        Kernel("ksum", (16,), (100,), (Store("s", x0, s),
                                       Store("lse", x0, ap("add", ap("log", s), m)))),
        Kernel("kdiv", (16, 100), (), (Store("y", 100 * x0 + x1, ap("div", ap("exp", ap(
            "sub", load("x", 100 * x0 + x1), m)), load("s", x0))),)),
    ]
    bufs = {"x": ((16, 100), F32), "m": ((16,), F32), "s": ((16,), F32),
            "lse": ((16,), F32), "y": ((16, 100), F32)}
    run = compile_program(program(bufs, ["x"], kernels, ["y", "lse"]))
    y, lse = run([x])
    torch.testing.assert_close(y, torch.softmax(x, 1))
    torch.testing.assert_close(lse, torch.logsumexp(x, 1))
    assert re.search(r"#pragma omp simd reduction\(\+:acc\d+\)", run.kernels[1].source)


def test_two_reductions_in_one_kernel_with_epilogue():
    """Mean and variance over the same rows in one pass (two Reduce nodes, one loop)."""
    x = torch.randn(8, 3, 50, dtype=torch.float64)
    v = load("x", 150 * x0 + 50 * r0 + r1, torch.float64)
    s1, s2 = Reduce("sum", v, torch.float64), Reduce("sum", ap("mul", v, v), torch.float64)
    n = const(150.0, torch.float64)
    mean = ap("div", s1, n)
    k = Kernel("moments", (8,), (3, 50), (
        Store("mean", x0, mean), Store("var", x0, ap("sub", ap("div", s2, n), ap("mul", mean, mean)))))
    run = compile_program(program({"x": ((8, 3, 50), torch.float64), "mean": ((8,), torch.float64),
                                   "var": ((8,), torch.float64)}, ["x"], [k], ["mean", "var"]))
    mean, var = run([x])
    torch.testing.assert_close(mean, x.mean((1, 2)))
    torch.testing.assert_close(var, x.var((1, 2), unbiased=False))


@pytest.mark.parametrize("op", ["argmax", "argmin", "amax", "amin"])
def test_arg_and_extreme_reductions_ties_nan_inf(op):
    nan, inf = float("nan"), float("inf")
    rows = [[1, 3, 3, 2, 3, 0], [nan, 5, nan, 1, 9, 9], [-inf] * 6, [inf] * 6,
            [2, 1, 1, 2, -1, -1], [0, -0.0, 0, 7, nan, 7]]
    x = torch.tensor(rows).reshape(6, 2, 3)
    k = Kernel("k", (6,), (2, 3), (Store("y", x0, Reduce(
        op, load("x", 6 * x0 + 3 * r0 + r1), I64 if op.startswith("arg") else F32)),))
    out_dtype = I64 if op.startswith("arg") else F32
    run = compile_program(program({"x": ((6, 2, 3), F32), "y": ((6,), out_dtype)},
                                  ["x"], [k], ["y"]))
    torch.testing.assert_close(run([x])[0], getattr(torch, op)(x.reshape(6, 6), 1),
                               equal_nan=True)


def test_integer_argmax_and_sum_wraps():
    x = torch.tensor([[5, -3, 5, 120], [100, 100, -128, 7]], dtype=torch.int8)
    kernel = Kernel("k", (2,), (4,), (
        Store("i", x0, Reduce("argmax", load("x", 4 * x0 + r0, torch.int8), I64)),
        Store("s", x0, Reduce("sum", load("x", 4 * x0 + r0, torch.int8), torch.int8))))
    run = compile_program(program({"x": ((2, 4), torch.int8), "i": ((2,), I64),
                                   "s": ((2,), torch.int8)}, ["x"], [kernel], ["i", "s"]))
    i, s = run([x])
    assert i.tolist() == x.argmax(1).tolist()
    assert s.tolist() == x.sum(1, dtype=torch.int8).tolist()


@pytest.mark.parametrize("op,identity", [("sum", 0.0), ("prod", 1.0)])
def test_empty_reduction(op, identity):
    k = Kernel("k", (3,), (0,), (Store("y", x0, Reduce(op, load("x", x0 * 0 + r0), F32)),))
    run = compile_program(program({"x": ((3, 0), F32), "y": ((3,), F32)}, ["x"], [k], ["y"]))
    assert run([torch.empty(3, 0)])[0].tolist() == [identity] * 3


def test_full_reduction_runs_the_reduction_loop_in_parallel():
    x = torch.randn(300, 1000)
    v = load("x", 1000 * r0 + r1)
    k = Kernel("k", (), (300, 1000), (Store("s", 0, Reduce("sum", v, F32)),
                                      Store("p", 0, Reduce("prod", ap("exp", ap("mul", v, const(1e-3))), F32))))
    run = compile_program(program({"x": ((300, 1000), F32), "s": ((), F32), "p": ((), F32)},
                                  ["x"], [k], ["s", "p"]))
    s, p = run([x])
    torch.testing.assert_close(s, x.sum(), rtol=1e-4, atol=1e-3)
    # a float32 product of 300k factors: eager's own rounding differs from the exact one by
    # 3e-4 on some vector widths, so the reference is the product in float64
    exact = torch.exp(x.double() * 1e-3).prod().float()
    torch.testing.assert_close(p, exact, rtol=1e-4, atol=1e-5)
    assert "#pragma omp parallel for reduction(+:acc0) reduction(*:acc1)" in run.kernels[0].source


# ---------------------------------------------------------------------------------------
# Externs, buffers, outputs
# ---------------------------------------------------------------------------------------
def test_extern_in_the_middle():
    x, w = torch.randn(5, 4), torch.randn(4, 3)
    kernels = [
        Kernel("k0", (5, 4), (), (Store("a", 4 * x0 + x1, ap("mul", load("x", 4 * x0 + x1), const(2.0))),)),
        Extern("mm", lambda a, b, *, transpose: (a @ b).t().contiguous().t() if transpose else a @ b,
               ("a", "w"), ("c",), (("transpose", True),), "torch.mm"),
        Kernel("k2", (5, 3), (), (Store("y", 3 * x0 + x1, ap("maximum", load("c", 3 * x0 + x1), const(0.0))),)),
    ]
    bufs = {"x": ((5, 4), F32), "w": ((4, 3), F32), "a": ((5, 4), F32), "c": ((5, 3), F32),
            "y": ((5, 3), F32)}
    run = compile_program(program(bufs, ["x", "w"], kernels, ["y"]))
    torch.testing.assert_close(run([x, w])[0], torch.relu((x * 2) @ w))
    assert run.kernels[1].source == "c, = torch.mm(a, w, transpose=True)"
    assert "c, = torch.mm(a, w, transpose=True)" in run.source


@pytest.mark.parametrize("native", [False, True], ids=["python_wrapper", "cpp_wrapper"])
def test_buffers_are_freed_after_their_last_use(native):
    seen = {}

    def keep_ref(t):
        seen["a"] = weakref.ref(t)
        return t + 1

    def check_dead(t):
        seen["a_dead_later"] = seen["a"]() is None
        return t * 1

    kernels = [
        Kernel("k0", (4,), (), (Store("a", x0, ap("neg", load("x", x0))),)),
        Extern("e1", keep_ref, ("a",), ("b",), (), "keep_ref"),
        Kernel("k2", (4,), (), (Store("c", x0, ap("exp", load("b", x0))),)),
        Extern("e3", check_dead, ("c",), ("d",), (), "check_dead"),
    ]
    bufs = {n: ((4,), F32) for n in "xabcd"}
    with plait.config.patch(cpp_wrapper=native):
        run = compile_program(program(bufs, ["x"], kernels, ["d"]))
    x = torch.randn(4)
    torch.testing.assert_close(run([x])[0], torch.exp(-x + 1))
    source, first = run.wrapper_source, f"{run.writers[0].name}(x, a)"
    if native:  # a is allocated for k0 and freed after e1, its last reader
        assert source.index(f"// 0: {first}") < source.index("a_ = alloc(16)") < \
            source.index("(x_, a_);")
        assert source.index("// 1: b, = keep_ref(a)") < source.index("release(a_); a_ = nu") \
            < source.index("// 2: ")
        return
    assert seen["a_dead_later"]
    assert "    del a\n" in source
    assert source.index("a = torch.empty") < source.index(first)


# Behaviour of the wrapper both code generators share (backends/codegen.py), for each.
WRAPPED = pytest.mark.parametrize("compile_program", [
    compile_program, functools.partial(generated, "triton")], ids=["cpp", "triton"])


@WRAPPED
def test_outputs_repeat_or_name_inputs_and_unwritten_empty_buffers(compile_program):
    x = torch.randn(3)
    k = Kernel("k", (3,), (), (Store("y", x0, ap("sin", load("x", x0))),))
    run = compile_program(program({"x": ((3,), F32), "y": ((3,), F32), "e": ((0, 2), F32)},
                                  ["x"], [k], ["x", "y", "y", "e"]))
    a, y1, y2, e = run([x])
    assert a is x and y1 is y2 and e.shape == (0, 2)
    torch.testing.assert_close(y1, x.sin())


def test_constants_and_noncontiguous_inputs():
    c = torch.arange(6.0).reshape(2, 3)
    k = Kernel("k", (2, 3), (), (Store("y", 3 * x0 + x1, ap("add", load("x", 3 * x0 + x1), load("c", 3 * x0 + x1))),))
    run = compile_program(program({"x": ((2, 3), F32), "c": ((2, 3), F32), "y": ((2, 3), F32)},
                                  ["x"], [k], ["y"], constants={"c": c}))
    x = torch.randn(3, 2).t()
    torch.testing.assert_close(run([x])[0], x + c)


@WRAPPED
def test_integer_division_by_zero_raises_like_eager(compile_program):
    k = Kernel("k", (3,), (), (Store("y", x0, ap("div", load("a", x0, I64), load("b", x0, I64))),))
    run = compile_program(program({"a": ((3,), I64), "b": ((3,), I64), "y": ((3,), I64)},
                                  ["a", "b"], [k], ["y"]))
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        torch.ops.prims.div(torch.tensor([1, 2, 3]), torch.tensor([1, 0, 1]))
    with pytest.raises(CheckError, match="ZeroDivisionError"):
        run([torch.tensor([1, 2, 3]), torch.tensor([1, 0, 1])])
    assert run([torch.tensor([7, -7, 9]), torch.tensor([2, 2, -1])])[0].tolist() == [3, -3, -9]


def test_a_kernel_over_an_unsupported_dtype_is_refused():
    k = Kernel("k", (3,), (), (Store("y", x0, ap("neg", load("x", x0, torch.float16))),))
    with pytest.raises(BackendError, match="torch.float16.*eager"):
        compile_program(program({"x": ((3,), torch.float16), "y": ((3,), torch.float16)},
                                ["x"], [k], ["y"]))


def test_registered():
    assert "cpp" in available_backends()


# ---------------------------------------------------------------------------------------
# Building and the disk cache
# ---------------------------------------------------------------------------------------
def _unique_program(tag: float) -> LoopProgram:
    k = Kernel("k", (4,), (), (Store("y", x0, ap("add", load("x", x0), const(tag))),))
    return program({"x": ((4,), F32), "y": ((4,), F32)}, ["x"], [k], ["y"])


def test_disk_cache_reuses_the_library(tmp_path, monkeypatch):
    calls = count_builds(monkeypatch)
    with plait.config.patch(cache_dir=str(tmp_path)):
        first = compile_program(_unique_program(0.25))
        second = compile_program(_unique_program(0.25))
    assert len(calls) == 1
    assert sorted(os.path.splitext(f)[1] for f in os.listdir(tmp_path / "cpp")) == [
        ".cpp", ".sha256", ".so"]
    x = torch.randn(4)
    torch.testing.assert_close(second([x])[0], first([x])[0])


def test_many_kernels_build_a_library_per_core_in_parallel(tmp_path, monkeypatch):
    """CompiledProgram.load: distinct kernels split among libraries built at once; every
    kernel call finds its own library, also in a runner loaded from the program cache."""
    import pickle

    monkeypatch.setattr(cpp, "KERNELS_PER_LIBRARY", 1)
    monkeypatch.setattr(cpp.os, "cpu_count", lambda: 3)
    calls = count_builds(monkeypatch)
    kernels = [Kernel(f"k{i}", (4,), (), (Store(f"y{i}", x0, ap("add", load("x", x0),
                                                                 const(i + 0.5))),))
               for i in range(4)]
    bufs = {"x": ((4,), F32)} | {f"y{i}": ((4,), F32) for i in range(4)}
    with plait.config.patch(cache_dir=str(tmp_path)):
        compiled = compile_program(program(bufs, ["x"], kernels, [f"y{i}" for i in range(4)]))
    assert len(calls) == 3 and len(set(compiled._library_of.values())) == 3
    x = torch.randn(4)
    for run in (compiled, pickle.loads(pickle.dumps(compiled.runner))):
        for i, y in enumerate(run([x])):
            torch.testing.assert_close(y, x + (i + 0.5))


_TRUNCATED = """
import torch, plait
print(plait.jit(lambda x: (x * 3.5).exp(), backend="cpp")(torch.ones(3)).tolist())
"""


@pytest.mark.slow  # builds its library twice in processes of their own
def test_a_truncated_library_is_rebuilt_not_loaded(tmp_path):
    """A library cut short past its ELF header loads and then faults (SIGBUS) when a page
    past its end is touched: its length and digest are checked first, by the library cache
    and by a program the program cache loads. In processes of their own: a fault kills one."""
    import sys

    env = dict(os.environ, PLAIT_CACHE_DIR=str(tmp_path))
    run = lambda: subprocess.run([sys.executable, "-c", _TRUNCATED], env=env,  # noqa: E731
                                 capture_output=True, text=True, timeout=300)
    want = (torch.ones(3) * 3.5).exp().tolist()
    assert eval(run().stdout) == want
    for program_cache in ("1", "0"):
        env["PLAIT_PROGRAM_CACHE"] = program_cache
        (library,) = [f for f in (tmp_path / "cpp").iterdir() if f.suffix == ".so" and not
                      f.with_suffix(".cpp").read_text().startswith("// for torch")]  # the
        # program's, not the C++ wrapper's memory functions
        os.truncate(library, 8192)
        proc = run()
        assert proc.returncode == 0, proc.stderr
        assert eval(proc.stdout) == want


def test_a_corrupt_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    calls = count_builds(monkeypatch)
    good, bad = tmp_path / "good", tmp_path / "bad"
    with plait.config.patch(cache_dir=str(good)):
        compile_program(_unique_program(0.5))
    (name,) = [f for f in os.listdir(good / "cpp") if f.endswith(".so")]
    (bad / "cpp").mkdir(parents=True)
    (bad / "cpp" / name).write_bytes(b"\x7fELF truncated")
    with plait.config.patch(cache_dir=str(bad)):
        run = compile_program(_unique_program(0.5))
    assert len(calls) == 2
    assert (bad / "cpp" / name).stat().st_size > 100
    torch.testing.assert_close(run([torch.zeros(4)])[0], torch.full((4,), 0.5))


def test_an_unwritable_cache_warns_once_and_compiles(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with plait.config.patch(cache_dir=str(tmp_path / "file" / "cache")):
        with pytest.warns(UserWarning, match="does not use its compilation cache"):
            run = compile_program(_unique_program(0.75))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile_program(_unique_program(0.75))
    torch.testing.assert_close(run([torch.zeros(4)])[0], torch.full((4,), 0.75))


def test_missing_compiler_says_how_to_get_one():
    with plait.config.patch(cpp_compiler="no-such-compiler-plait"):
        with pytest.raises(BackendError, match=r"apt-get install g\+\+.*backend='eager'"):
            compile_program(_unique_program(1.0))


def test_compiler_flags_join_the_cache_key():
    key = plait.backends.get_backend("cpp").cache_key()
    with plait.config.patch(cpp_flags="-O2 -fopenmp -fwrapv -std=c++17"):
        assert plait.backends.get_backend("cpp").cache_key() != key


# ---------------------------------------------------------------------------------------
# Every op against torch, on tricky values
# ---------------------------------------------------------------------------------------
def _values(dtype: torch.dtype) -> torch.Tensor:
    if dtype == BOOL:
        return torch.tensor([False, True])
    if dtype.is_floating_point:
        return torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -1.0,
                             0.5, -0.5, 2.5, -2.5, 3.0, -7.0, 1e-3, 0.1, 88.0, 100.0, 1e30,
                             -1e30], dtype=dtype)
    info = torch.iinfo(dtype)
    small = [0, 1, 2, 3, 5, 7, 8, 63, 64, 70, 100]
    if info.min < 0:
        small += [-1, -2, -3, -7, -100]
    return torch.tensor(small + [info.min, info.max], dtype=torch.int64).to(dtype)


def _arity(op: str) -> int:
    return 1 if op in UNARY or op in UNARY_PREDICATES else 2


_DIVISIONS = ("div", "fmod", "remainder")


def _operands(op: str, dtype: torch.dtype):
    v = _values(dtype)
    a, b = v.repeat_interleave(len(v)), v.repeat(len(v))
    if op in _DIVISIONS and not dtype.is_floating_point and dtype != BOOL:
        # division by zero raises (tested above); eager itself traps on INT_MIN / -1
        b = torch.where((b == 0) | ((a == torch.iinfo(dtype).min) & (b == -1)), 1, b).to(dtype)
    return (a, b)[:_arity(op)]


def _reference(op: str, dtype: torch.dtype):
    """Eager's result, or None where the primitive does not take this dtype."""
    args = _operands(op, dtype)
    want = BOOL if op in UNARY_PREDICATES or op in COMPARISONS else dtype
    try:
        out = get_primitive(op).impl(*args)
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    return out if out.dtype == want else None


ELEMENTWISE_OPS = sorted(set(CPP_OPS) - {"where", "convert"})
DTYPES = sorted(CPP_DTYPES, key=str)


def per_op_program(ops, dtypes, conversion_values):
    """One program, one kernel per (op, dtype) that eager defines, per ``where`` and per
    conversion (of ``conversion_values(values, from, to)``): the program, its feeds, and
    op -> [(kernel name, eager's result)]. Shared by every code generator's tests."""
    bufs, inputs, feeds, kernels, cases = {}, [], [], [], {}

    def operand(t):
        name = f"in{len(inputs)}"
        bufs[name] = ((t.numel(),), t.dtype)
        inputs.append(name)
        feeds.append(t)
        return load(name, x0, t.dtype)

    def add(op, name, value, want):
        kernels.append(Kernel(name, (want.numel(),), (), (Store(name, x0, value),)))
        bufs[name] = ((want.numel(),), want.dtype)
        cases.setdefault(op, []).append((name, want))

    for dtype in dtypes:
        dt = str(dtype).removeprefix("torch.")
        for op in ops:
            want = _reference(op, dtype)
            if want is not None:
                args = [operand(t) for t in _operands(op, dtype)]
                add(op, f"{op}_{dt}", ap(op, *args, dtype=want.dtype), want)
        v = _values(dtype)
        pred = torch.arange(len(v)) % 3 == 0
        add("where", f"where_{dt}", ap("where", operand(pred), operand(v), operand(v.flip(0))),
            torch.where(pred, v, v.flip(0)))
        for to in dtypes:
            src = conversion_values(v, dtype, to)
            add("convert", f"convert_{dt}_{str(to).removeprefix('torch.')}",
                Apply("convert", (operand(src),), (("dtype", to),), to), src.to(to))
    outputs = [k.name for k in kernels]
    return program(bufs, inputs, kernels, outputs), feeds, cases


def _conversion_values(v, dtype, to):
    if dtype.is_floating_point:  # out of range of the narrow integers, and fractions
        v = torch.cat([v, torch.tensor([-129.0, 300.0, 1e10, -3.7, 3.7], dtype=dtype)])
    return v


@pytest.fixture(scope="module")
def all_ops():
    """op -> [(kernel name, result, eager's result)] over every op and dtype of CPP_OPS."""
    prog, feeds, cases = per_op_program(ELEMENTWISE_OPS, DTYPES, _conversion_values)
    results = dict(zip(prog.outputs, compile_program(prog)(feeds)))
    return {op: [(name, results[name], want) for name, want in c] for op, c in cases.items()}


def _check(got: torch.Tensor, want: torch.Tensor, what: str, signed_zeros: bool):
    if want.dtype.is_floating_point:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, equal_nan=True,
                                   msg=lambda m: f"{what}: {m}")
        if signed_zeros:
            zero = want == 0
            assert torch.equal(got[zero].signbit(), want[zero].signbit()), f"{what}: sign of zero"
    else:
        assert torch.equal(got, want), f"{what}:\n{got}\n!=\n{want}"


@pytest.mark.parametrize("op", ELEMENTWISE_OPS + ["where", "convert"])
def test_op_against_torch(op, all_ops):
    assert op in all_ops, f"{op} is never tested"
    for name, got, want in all_ops[op]:
        # torch's scalar and vector paths disagree on the sign of a zero maximum/minimum
        _check(got, want, name, signed_zeros=op not in ("maximum", "minimum", "fmax", "fmin"))


def test_cpp_ops_are_elementwise_primitives():
    for op in CPP_OPS:
        assert get_primitive(op) is not None
    left_out = set(UNARY + BINARY) - set(CPP_OPS)
    assert left_out == {"bessel_i0", "bessel_i0e", "bessel_i1", "bessel_i1e", "bessel_j0",
                        "bessel_j1", "digamma", "erf_inv", "erfcx", "ndtri",
                        "spherical_bessel_j0", "igamma", "igammac", "zeta"}


@pytest.mark.parametrize("fn", [
    lambda x: x.sum(0),
    lambda x: (x * 2).prod(0),
    lambda x: x.amax(0),
    lambda x: x.amin(-2),
    lambda x: torch.softmax(x, 0),
    lambda x: torch.nn.functional.layer_norm(x.t(), (x.shape[0],)),
    lambda x: (x.sum(0), x - x.mean(0)),
], ids=["sum", "prod", "amax", "amin", "softmax", "layer_norm_t", "centered"])
def test_column_reductions_run_points_innermost(fn):
    """NOTE [column-wise reductions]: reductions over a strided dim (here dim 0 of [70, 150],
    150 points: two full chunks of 64 and a ragged one) run their point loop innermost, and
    give eager's results, NaN included."""
    x = torch.randn(70, 150, dtype=torch.float64)
    x[3, 5] = float("nan")
    jitted = plait.jit(fn, backend="cpp")
    torch.testing.assert_close(jitted(x), fn(x), equal_nan=True)
    assert "xb += 64" in jitted.lower(x).kernels[0].source


def _scale(var, w):
    return w / torch.sqrt(var / 7 + 1e-5)  # per channel: costly, the same at every row


@pytest.mark.parametrize("fn, nest", [
    (lambda x, var, w: x * _scale(var, w), "for (int64_t x0 = 0; x0 < 90"),
    (lambda x, var, w: (x * _scale(var, w)).sum(0), "for (int64_t r0 = 0; r0 < 90"),
    (lambda x, var, w: x.view(9, 10, 150) * _scale(var, w) + w, "for (int64_t x0 = 0; x0 < 9"),
], ids=["pointwise", "column_sums", "pointwise_3d"])
def test_point_invariants_are_computed_once_per_point(fn, nest):
    """NOTE [point invariants]: a value of the innermost point alone (a per-channel scale of
    [rows, channels] data) is computed before the loops that repeat it, into an array, and
    the results are eager's, NaN and infinity included."""
    x, var, w = (torch.randn(90, 150, dtype=torch.float64), torch.rand(150, dtype=torch.float64),
                 torch.randn(150, dtype=torch.float64))
    var[3], w[4] = -1.0, float("inf")  # a NaN scale and an infinite one
    jitted = plait.jit(fn, backend="cpp")
    torch.testing.assert_close(jitted(x, var, w), fn(x, var, w), equal_nan=True)
    (source,) = [k.source for k in jitted.lower(x, var, w).kernels if "std::sqrt" in k.source]
    # once, in the arrays' loop before the nest
    assert source.count("std::sqrt") == 1 and "c0[" in source
    assert source.index("std::sqrt") < source.index(nest)


def test_row_invariants_are_computed_before_the_row_loops():
    """NOTE [row invariants]: in cross-entropy's gradient, each row's target (and the weight
    it selects) is computed once per row, before the loops over the row's classes, not
    inside them; the gradient is torch.func's."""
    x, target = torch.randn(8, 40), torch.randint(0, 40, (8,))
    target[3] = -100  # ignored

    def loss(x):
        return torch.nn.functional.cross_entropy(x, target)

    jitted = plait.jit(plait.grad(loss), backend="cpp")
    torch.testing.assert_close(jitted(x), torch.func.grad(loss)(x))
    (source,) = [k.source for k in jitted.lower(x).kernels if "std::exp" in k.source]
    before_rows = source[:source.index("for (int64_t r0")]
    assert "const int64_t t" in before_rows  # the target, loaded once per row


@pytest.mark.parametrize("dim", [0, 1], ids=["column_sums", "row_sums"])
def test_stores_that_read_no_reduction_are_made_by_its_pass(dim):
    """A value stored at every point and summed (a GELU's gradient and its bias's), written
    in place over the product it reads: made in the reduction's pass, each erf computed
    once, not again in a pass of its own; eager's results."""
    def fn(g, w, x):
        y = (g @ w) * torch.erf(x)
        return y, y.sum(dim)

    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(40, 8, generator=gen), torch.randn(8, 72, generator=gen),
            torch.randn(40, 72, generator=gen))
    jitted = plait.jit(fn, backend="cpp")
    for got, want in zip(jitted(*args), fn(*args)):
        torch.testing.assert_close(got, want)
    (source,) = [k.source for k in jitted.lower(*args).kernels if "std::erf" in k.source]
    assert source.count("std::erf(") == 1 and source.count("for (int64_t r0") == 1


@pytest.mark.parametrize("fn, exps", [
    (lambda x: torch.softmax(x, -1), 1),
    (lambda x: torch.softmax(x, 0), 1),  # column-wise too
    (lambda x: torch.log_softmax(x, -1), 1),  # its store does not use the exp: nothing kept
    # the kept exp is read back before the softmax store overwrites it
    (lambda x: (torch.softmax(x, -1), torch.exp(x - x.amax(-1, keepdim=True))), 1),
], ids=["softmax", "softmax_dim0", "log_softmax", "two_stores"])
def test_stashed_reduction_bodies(fn, exps):
    """NOTE [stashed reduction bodies]: softmax computes each exp once, keeping it in its
    output between the sum and the division."""
    x = torch.randn(33, 70, dtype=torch.float64)
    x[2, 3] = float("inf")
    jitted = plait.jit(fn, backend="cpp")
    torch.testing.assert_close(jitted(x), fn(x), equal_nan=True)
    assert jitted.lower(x).kernels[0].source.count("std::exp(") == exps
