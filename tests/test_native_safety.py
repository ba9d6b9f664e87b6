"""The native code the cpp backend generates never crashes the process (NOTE [entry checks],
NOTE [sanitized builds]): programs that stress the C++ wrapper's memory handling (outputs that
are inputs, constants or views of them, duplicate outputs, empty tensors, size-1 dims of odd
strides, non-contiguous, offset and expanded inputs, 0-d tensors, in-place updates of inputs
and of their views, donated arguments), hand-written and generated, run through plait.jit
against eager PyTorch: twice (the first call's results must survive the second), then again
after those results were overwritten. Each batch runs in a process of its own,
so a crash fails the test naming the program it ran; under ``config.cpp_sanitize`` an access
out of a buffer stops it too.

Run as a script it is that process: ``python tests/test_native_safety.py --cases [NAME...]
--generated SEED COUNT`` checks those programs, printing one line each.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import plait
from plait.backends import cpp_wrapper

_HERE = os.path.abspath(__file__)


# ---------------------------------------------------------------------------------------
# Running one program against eager
# ---------------------------------------------------------------------------------------
def _same(got, want, what: str) -> None:
    if not isinstance(want, torch.Tensor):
        assert got == want, f"{what}: {got!r} != {want!r}"
        return
    assert isinstance(got, torch.Tensor), f"{what}: {type(got).__name__}, not a tensor"
    assert (got.shape, got.dtype) == (want.shape, want.dtype), \
        f"{what}: {got.dtype}{list(got.shape)}, eager's {want.dtype}{list(want.shape)}"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, equal_nan=True, msg=lambda m:
                               f"{what}: {m}")


def check(make) -> None:
    """``make(generator) -> (fn, args, jit options)`` (equal programs and inputs for equal
    seeds) compiled by the cpp backend and called on fresh inputs, against eager: the results
    of two calls (the first read again after the second), and of a third after all those
    results were overwritten, and the arguments after each call except donated ones. Where
    eager raises, plait must raise too."""
    build = lambda: make(torch.Generator().manual_seed(0))  # noqa: E731
    fn, args, options = build()
    try:
        want = fn(*args)
    except Exception:  # noqa: BLE001 - then plait must refuse too
        want = None
    donated = options.get("donate_argnums", ())
    jitted = plait.jit(build()[0], backend="cpp", **options)
    if want is None:
        try:
            jitted(*build()[1])
        except Exception:  # noqa: BLE001
            return
        raise AssertionError("eager raised and plait did not")
    calls = [(jitted(*inputs), inputs) for inputs in (build()[1], build()[1])]
    for n, (got, inputs) in enumerate(calls):
        _match(got, inputs, want, args, donated, f"call {n}")
    # the results are the caller's: writing into them changes no later call's (as it would
    # where one is memory the program keeps), here as in eager
    for results in (want, *(got for got, _ in calls)):
        _scribble(results)
    inputs, args = build()[1], build()[1]
    _match(jitted(*inputs), inputs, fn(*args), args, donated, "a call after writing results")


def _match(got, inputs, want, args, donated, what: str) -> None:
    structure = pytree.tree_structure(got), pytree.tree_structure(want)
    assert structure[0] == structure[1], f"{what}: results {structure}, eager's second"
    for i, (g, w) in enumerate(zip(pytree.tree_leaves(got), pytree.tree_leaves(want))):
        _same(g, w, f"{what}, result {i}")
    for i, (g, w) in enumerate(zip(inputs, args)):
        if i not in donated:
            _same(g, w, f"{what}, argument {i} after it")


def _scribble(results) -> None:
    for t in pytree.tree_leaves(results):
        try:
            t.fill_(7)
        except RuntimeError:  # a result overlapping itself (expanded) cannot be written
            pass


def _run(programs: list) -> None:
    """Check each ``(name, make)``, printing ``start NAME`` before and one JSON line after
    (``{"name", "error"}``, error None where it passed); a crash leaves the start line last."""
    for name, make in programs:
        print("start", name, flush=True)
        try:
            check(make)
            error = None
        except Exception as e:  # noqa: BLE001 - reported, the next program runs
            error = f"{type(e).__name__}: {e}"
        print(json.dumps({"name": name, "error": error}), flush=True)


def run_isolated(args: list[str], env: dict | None = None, timeout: float = 900) -> None:
    """This file as a script with ``args``, in a process of its own: fails naming each
    program that did not match eager, and the program running when the process died."""
    environment = dict(os.environ, PLAIT_CACHE_DIR=plait.config.cache_dir, **(env or {}))
    proc = subprocess.run([sys.executable, _HERE, *args], capture_output=True, text=True,
                          env=environment, timeout=timeout)
    lines = proc.stdout.splitlines()
    results = [json.loads(line) for line in lines if line.startswith("{")]
    failed = [f"{r['name']}: {r['error']}" for r in results if r["error"]]
    started = [line.split(" ", 1)[1] for line in lines if line.startswith("start ")]
    assert proc.returncode == 0, (
        f"the process died (exit {proc.returncode}) running {started[-1] if started else '?'}"
        f"\n{proc.stderr[-6000:]}")
    assert results and not failed, "\n".join(failed) or proc.stderr[-3000:]
    assert len(results) == len(started)


# ---------------------------------------------------------------------------------------
# Hand-written programs
# ---------------------------------------------------------------------------------------
CASES: dict = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def _odd_strides(fresh, shape, stride_of_ones: int, offset: int) -> torch.Tensor:
    """A tensor of ``shape`` whose size-1 dims have stride ``stride_of_ones``, at ``offset``
    in a storage of ``fresh(n)``'s ``n`` elements."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step if n != 1 else stride_of_ones)
        step *= max(n, 1)
    return fresh([step + offset]).as_strided(shape, tuple(reversed(strides)), offset)


def _randn(g):
    return lambda shape: torch.randn(shape, generator=g)


@case
def views_of_a_non_contiguous_input(g):
    x = torch.randn(6, 5, generator=g).t()[:, 1:]
    return (lambda x: (x.t(), x[:, ::2], x.reshape(-1), x.unsqueeze(0).expand(3, 5, 5),
                       x.diagonal(), x[2], x[1:1])), (x,), {}


@case
def captured_constants_and_their_views(g):
    c, k = torch.randn(4, 3, generator=g), torch.tensor(2.5)
    return (lambda x: (c, c.t(), c[1], x + c, k, x * k, c[:, :0])), \
        (torch.randn(4, 3, generator=g),), {}


@case
def inputs_and_duplicates_returned(g):
    def f(x, w):
        y = (x * 2).sin()
        return x, w, x, y, y, y.view(-1), (y, [y.t(), y]), x.sum(), x.sum(), x + w
    return f, (torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)), {}


@case
def empty_tensors(g):
    return (lambda a, b: (a * 2, a.sum(0), b.sum(1), torch.cat([a, a]), a.t(), b.amax(0),
                          b.mean(1), torch.cat([b, torch.ones(3, 2)], 1), a.reshape(3, 0))), \
        (torch.randn(0, 3, generator=g), torch.randn(3, 0, generator=g)), {}


@case
def size_one_dims_with_odd_strides(g):
    x, y = _odd_strides(_randn(g), (3, 1, 4), 7, 2), _odd_strides(_randn(g), (1, 1, 4), 11, 1)
    return (lambda x, y: (x + y, x.sum(1), (x * y).transpose(0, 2), y, y.squeeze(), x[:, 0])), \
        (x, y), {}


@case
def offset_and_stepped_inputs(g):
    x = torch.randn(7, 9, generator=g)[2:, 1::3]
    y = torch.randn(30, generator=g)[5:20].view(3, 5).t()
    return (lambda x, y: (x @ y.t(), x.cumsum(1), x.t() * 2, y.amax(1))), (x, y), {}


@case
def expanded_inputs(g):
    x = torch.randn(3, generator=g).expand(4, 3)
    y = torch.randn(1, 1, generator=g).expand(4, 3)
    return (lambda x, y: (x * y, x.sum(0), x.cumsum(1), x, y.t(), x[1:])), (x, y), {}


@case
def zero_dim_inputs_and_results(g):
    s, i = torch.randn((), generator=g), torch.tensor(3)
    return (lambda x, s, i: (x * s, s * 2, x.sum(), s, (s + 1).exp(), i * 2, i, x.amax(),
                             (x > s).sum(), x.argmax())), \
        (torch.randn(2, 3, generator=g), s, i), {}


@case
def in_place_updates_of_inputs(g):
    def f(x, y, s):
        x.add_(y)
        y[:, 0] = 0
        s += 1
        return x, x * 2, y.sum(), s
    return f, (torch.randn(3, 4, generator=g), torch.randn(4, 3, generator=g).t(),
               torch.randn((), generator=g)), {}


@case
def in_place_updates_through_views(g):
    def f(x):
        v = x.t()
        x[1:].sin_()
        v[0].zero_()
        return v, x.clone(), x[:, 0]
    return f, (torch.randn(4, 3, generator=g)[:, ::1],), {}


@case
def donated_arguments(g):
    def sgd(w, grad, m):
        m.mul_(0.9).add_(grad)
        return w - 0.1 * m, (w * grad).sum()
    return sgd, (torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g),
                 torch.randn(5, 4, generator=g)), {"donate_argnums": (0, 1)}


@case
def arguments_sharing_memory(g):
    base = torch.randn(5, 4, generator=g)
    return (lambda a, b, c: (a + b.sum(0), c * a[1:], b)), (base, base[1:], base[:-1]), {}


@case
def integers_booleans_and_indices(g):
    i = torch.randint(-5, 5, (3, 4), generator=g, dtype=torch.int32)
    idx = torch.randint(0, 4, (3, 2), generator=g)
    return (lambda i, x, idx: (i * 3, i.sum(), x > 0, torch.where(x > 0, x, 0.0), i.amax(0),
                               x.argmax(1), x.gather(1, idx), x[idx[:, 0]], ~(i > 0))), \
        (i, torch.randn(3, 4, generator=g), idx), {}


@case
def natively_run_externs_on_strided_operands(g):
    """Convolutions, attention and scatters through the runtime (once built: ``--runtime``)."""
    def f(x, w, q, k, v, table, idx, a, s):
        return (F.conv2d(x, w, padding=1), F.conv2d(x, w, stride=2).relu().sum(),
                F.scaled_dot_product_attention(q, k, v), a.scatter(0, idx[:, :3], s),
                torch.func.grad(lambda t: F.embedding(idx, t).pow(2).sum())(table))
    return f, (torch.randn(2, 3, 8, 8, generator=g).to(memory_format=torch.channels_last),
               torch.randn(4, 3, 3, 3, generator=g),
               torch.randn(2, 5, 4, 8, generator=g).transpose(1, 2),
               torch.randn(2, 4, 6, 8, generator=g),
               torch.randn(2, 6, 4, 8, generator=g).transpose(1, 2),
               torch.randn(5, 3, generator=g), torch.tensor([[0, 2, 2, 4], [1, 0, 4, 3]]),
               torch.randn(5, 3, generator=g), torch.randn(2, 3, generator=g)), {}


@case
def a_loop_over_rows(g):
    def f(c, xs):
        return plait.scan(lambda c, x: (c * 0.5 + x, c.sum()), c, xs)
    return f, (torch.randn(3, generator=g), torch.randn(5, 3, generator=g).t().t()), {}


# ---------------------------------------------------------------------------------------
# Generated programs
# ---------------------------------------------------------------------------------------
# A generated program is data (JSON, printed where it fails), made from a seed: inputs
# (shape, dtype, layout) and a chain of ops over the values so far, each chosen by the shapes
# the generator tracks so that eager runs it; its outputs are some of the values, inputs and
# views among them. In-place ops write inputs and views of them (never one that overlaps
# itself, or from a value overlapping it: eager refuses those).
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64,
           "int32": torch.int32}
_LAYOUTS = ("contiguous", "transposed", "stepped", "expanded", "odd", "offset")
_UNARY = {"f": ("sin", "tanh", "neg", "abs", "relu", "exp_neg", "add1"),
          "i": ("neg", "abs", "add1", "mul3")}
_BINARY = ("add", "sub", "mul", "maximum", "minimum", "where_gt")


def _input(g, shape: list, dtype, layout: str) -> torch.Tensor:
    def fresh(s):
        if dtype.is_floating_point:
            return torch.randn(s, generator=g, dtype=dtype)
        return torch.randint(-5, 6, s, generator=g, dtype=dtype)
    if layout == "transposed" and len(shape) >= 2:
        return fresh(shape[::-1]).permute(*reversed(range(len(shape))))
    if layout == "stepped" and shape:
        return fresh(shape[:-1] + [shape[-1] * 2])[..., ::2]
    if layout == "expanded" and 1 in shape:
        return fresh(shape).expand(*[3 if n == 1 else n for n in shape])
    if layout == "odd":
        return _odd_strides(fresh, shape, 13, 3)
    if layout == "offset":
        n = 1
        for d in shape:
            n *= d
        return fresh([n + 5])[5:].view(shape)
    return fresh(shape)


def _shape_of(x_shape: list, layout: str) -> list:
    return [3 if n == 1 else n for n in x_shape] if layout == "expanded" and 1 in x_shape \
        else x_shape


def _broadcast(a: list, b: list) -> list | None:
    out = []
    for m, n in zip([1] * (len(b) - len(a)) + a, [1] * (len(a) - len(b)) + b):
        if m != n and 1 not in (m, n):
            return None
        out.append(n if m == 1 else m)
    return out


def generate(seed: int) -> dict:
    """A random program over inputs of stressing layouts, as JSON-able data."""
    rng = random.Random(seed)
    dtype = rng.choice(["float32", "float32", "float32", "float64", "int64", "int32"])
    sizes = [0, 1, 1, 2, 3, 4, 5] if rng.random() < 0.15 else [1, 1, 2, 3, 4, 5]
    base = [rng.choice(sizes) for _ in range(rng.randint(0, 3))]
    inputs, values = [], []  # values: [shape, kind, input it is a view of, may be written]
    for _ in range(rng.randint(1, 3)):
        shape = [n if rng.random() < 0.7 else 1 for n in base][rng.randint(0, len(base)):] \
            if rng.random() < 0.5 else list(base)
        layout = rng.choice(_LAYOUTS)
        if layout == "expanded" and shape and 1 not in shape:
            shape[rng.randrange(len(shape))] = 1
        inputs.append({"shape": shape, "layout": layout})
        real = _shape_of(shape, layout)
        kind = "f" if "float" in dtype else "i"
        values.append([real, kind, len(inputs) - 1, layout != "expanded" or 1 not in shape])
    ops = []
    for _ in range(rng.randint(1, 8)):
        j = rng.randrange(len(values))
        shape, kind, view_of, writable = values[j]
        choice = rng.random()
        new = None
        if choice < 0.25 and kind != "b":
            ops.append(["unary", rng.choice(_UNARY[kind]), j])
            new = [shape, kind, None, True]
        elif choice < 0.45:
            partners = [k for k, v in enumerate(values) if v[1] == kind
                        and _broadcast(shape, v[0]) is not None]
            k = rng.choice(partners)
            op = rng.choice(_BINARY) if kind != "b" else rng.choice(("and", "or"))
            ops.append(["binary", op, j, k])
            new = [_broadcast(shape, values[k][0]), kind, None, True]
        elif choice < 0.52 and kind != "b":
            ops.append(["gt0", None, j])
            new = [shape, "b", None, True]
        elif choice < 0.57 and kind == "b":
            partners = [k for k, v in enumerate(values) if v[1] != "b"
                        and _broadcast(shape, v[0]) is not None]
            k = rng.choice(partners) if partners else None
            if k is None:
                continue
            ops.append(["where", None, j, k])
            new = [_broadcast(shape, values[k][0]), values[k][1], None, True]
        elif choice < 0.67 and shape:
            d = rng.randrange(len(shape))
            op = rng.choice(["sum", "amax", "mean", "cumsum", "sum_all"])
            if op == "amax" and shape[d] == 0 or op == "mean" and kind != "f" or \
                    kind == "b" and op in ("amax", "mean"):
                op = "sum"
            keep = rng.random() < 0.3
            ops.append(["reduce", op, j, d, keep])
            out_kind = "i" if kind == "b" else kind
            new = [[] if op == "sum_all" else shape if op == "cumsum" else
                   shape[:d] + [1] * keep + shape[d + 1:], out_kind, None, True]
        elif choice < 0.85 and shape:
            d = rng.randrange(len(shape))
            views = ["slice", "unsqueeze", "flip", "narrow"] + ["transpose"] * (len(shape) > 1) \
                + ["select"] * (shape[d] > 0) + ["squeeze", "expand"] * (shape[d] == 1)
            op = rng.choice(views)
            e = rng.randrange(len(shape))
            start = rng.randint(0, max(shape[d] - 1, 0))
            step = rng.randint(1, 2)
            ops.append(["view", op, j, d, e, start, step])
            s = list(shape)
            if op == "slice":
                s[d] = len(range(start, s[d], step))
            elif op == "unsqueeze":
                s.insert(d, 1)
            elif op == "transpose":
                s[d], s[e] = s[e], s[d]
            elif op == "select":
                s.pop(d)
            elif op == "squeeze":
                s.pop(d)
            elif op == "expand":
                s[d] = 3
            elif op == "narrow":
                s[d] = s[d] - start
            new = [s, kind, view_of if op != "flip" else None, writable and op != "expand"]
        elif choice < 0.9:
            partners = [k for k, v in enumerate(values) if v[1] == kind and v[0] == shape]
            d = rng.randrange(len(shape)) if shape else None
            if d is None:
                continue
            k = rng.choice(partners)
            ops.append(["cat", None, j, k, d])
            s = list(shape)
            s[d] *= 2
            new = [s, kind, None, True]
        elif kind != "b" and view_of is not None and writable:
            # in place: the value (an input, or a view of one) adds another of a shape
            # broadcasting to its own, or is scaled
            partners = [k for k, v in enumerate(values) if v[1] == kind
                        and _broadcast(shape, v[0]) == shape and v[2] != view_of]
            k = rng.choice(partners) if partners and rng.random() < 0.7 else None
            ops.append(["inplace", "add_" if k is not None else "mul2_", j, k])
            new = [shape, kind, view_of, writable]
        if new is not None:
            values.append(new)
    outputs = [rng.randrange(len(values)) for _ in range(rng.randint(1, 4))]
    return {"seed": seed, "dtype": dtype, "inputs": inputs, "ops": ops, "outputs": outputs}


_UNARY_FNS = {"sin": torch.sin, "tanh": torch.tanh, "neg": torch.neg, "abs": torch.abs,
              "relu": torch.relu, "exp_neg": lambda x: torch.exp(-x.abs()),
              "add1": lambda x: x + 1, "mul3": lambda x: x * 3}
_BINARY_FNS = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "maximum": torch.maximum,
               "minimum": torch.minimum, "where_gt": lambda a, b: torch.where(a > 0, a, b),
               "and": torch.logical_and, "or": torch.logical_or}


def _view(x, op, d, e, start, step):
    return {"slice": lambda: x[(slice(None),) * d + (slice(start, None, step),)],
            "unsqueeze": lambda: x.unsqueeze(d), "flip": lambda: x.flip(d),
            "narrow": lambda: x.narrow(d, start, x.shape[d] - start),
            "transpose": lambda: x.transpose(d, e), "select": lambda: x.select(d, start),
            "squeeze": lambda: x.squeeze(d),
            "expand": lambda: x.expand(*[3 if i == d else -1 for i in range(x.dim())])}[op]()


def program(spec: dict):
    """The ``make`` of a generated program (``check``'s argument)."""
    def fn(*args):
        values = list(args)
        for kind, op, j, *rest in spec["ops"]:
            x = values[j]
            if kind == "unary":
                y = _UNARY_FNS[op](x)
            elif kind == "binary":
                y = _BINARY_FNS[op](x, values[rest[0]])
            elif kind == "gt0":
                y = x > 0
            elif kind == "where":
                y = torch.where(x, values[rest[0]], 0)
            elif kind == "reduce":
                d, keep = rest
                y = {"sum": lambda: x.sum(d, keepdim=keep), "amax": lambda: x.amax(d, keep),
                     "mean": lambda: x.mean(d, keepdim=keep), "cumsum": lambda: x.cumsum(d),
                     "sum_all": lambda: x.sum()}[op]()
            elif kind == "view":
                y = _view(x, op, *rest)
            elif kind == "cat":
                y = torch.cat([x, values[rest[0]]], rest[1])
            else:  # in place
                y = x.add_(values[rest[0]]) if op == "add_" else x.mul_(2)
            values.append(y)
        return tuple(values[k] for k in spec["outputs"])

    def make(g):
        dtype = _DTYPES[spec["dtype"]]
        return fn, tuple(_input(g, i["shape"], dtype, i["layout"]) for i in spec["inputs"]), {}
    return make


def _generated(seed: int, count: int) -> list:
    return [(json.dumps(generate(s)), program(generate(s))) for s in range(seed, seed + count)]


def test_programs_match_eager_and_never_crash():
    run_isolated(["--cases", "--generated", "0", "2"])


@pytest.mark.slow
def test_many_generated_programs_match_eager_and_never_crash():
    """2000 generated programs, in two processes at once (one per core)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda seed: run_isolated(["--runtime", "--generated", str(seed), "1000"],
                                                timeout=3600), (2, 1002)))


# ---------------------------------------------------------------------------------------
# Under AddressSanitizer
# ---------------------------------------------------------------------------------------
def _sanitized_environment() -> dict:
    libasan = subprocess.run([plait.config.cpp_compiler, "-print-file-name=libasan.so"],
                             capture_output=True, text=True, check=True).stdout.strip()
    return {"PLAIT_CPP_SANITIZE": "1", "LD_PRELOAD": libasan,
            "ASAN_OPTIONS": "detect_leaks=0", "UBSAN_OPTIONS": "halt_on_error=1"}


def test_a_sanitized_build_is_refused_where_the_runtime_was_not_preloaded():
    """Loading a sanitized library there would end the process (ASan's check)."""
    code = ("import pytest, plait\n"
            "from plait.backends import cpp\n"
            "assert plait.config.cpp_sanitize\n"
            "with pytest.raises(plait.errors.BackendError, match='LD_PRELOAD'):\n"
            "    cpp.build('extern \"C\" int f() { return 1; }', ['f'])\n")
    environment = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**environment, "PLAIT_CACHE_DIR": plait.config.cache_dir,
                               "PLAIT_CPP_SANITIZE": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_programs_run_clean_under_address_sanitizer():
    env = _sanitized_environment()
    run_isolated(["--runtime", "--cases", "--generated", "0", "40"], env=env, timeout=3000)


@pytest.mark.slow
def test_the_sanitizer_catches_a_read_past_an_input():
    """The sanitized build does report: a program called with an input too small for it (past
    what entry checks see, which leave shapes to the caller) stops at the read."""
    code = ("import torch, plait\n"
            "f = plait.jit(lambda x: x * 2, backend='cpp')\n"
            "f(torch.ones(64))\n"
            "f.lower(torch.ones(64)).runner([torch.ones(8)])\n")
    environment = dict(os.environ, PLAIT_CACHE_DIR=plait.config.cache_dir,
                       **_sanitized_environment())
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environment, timeout=900)
    report = proc.stderr.split("ERROR: AddressSanitizer: ", 1)[-1]
    assert proc.returncode != 0 and report.startswith("heap-buffer-overflow") and \
        " in kernel_" in report.split("\n\n")[0], proc.stderr[-3000:]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", help="hand-written programs (all without names)")
    parser.add_argument("--generated", nargs=2, type=int, metavar=("SEED", "COUNT"))
    parser.add_argument("--runtime", action="store_true",
                        help="build the C++ wrapper's runtime first, so externs run natively")
    options = parser.parse_args()
    if options.runtime:
        cpp_wrapper.runtime_future().result()
    names = list(CASES) if options.cases == [] else options.cases or []
    _run([(name, CASES[name]) for name in names] +
         (_generated(*options.generated) if options.generated else []))
