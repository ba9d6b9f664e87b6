"""plait benchmarks: tracing, call overhead, the CPU compiler against torch.compile, peak memory.

    .venv/bin/python benchmarks/run.py [--device cpu|cuda] [--repeat N] [--quick] [--cases a,b]
                                       [--memory-only]

See benchmarks/README.md for what each number means.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import unittest.mock
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

import plait  # the repo root is the package; `make setup` installs it editable

# -- (a) a pre-norm transformer block, written with plain torch ops -------------------------
BATCH, SEQ, DIM, HEADS, MLP_RATIO = 2, 64, 128, 4, 4


def transformer_block(x, ln1_w, ln1_b, w_qkv, b_qkv, w_o, b_o, ln2_w, ln2_b, w_1, b_1, w_2,
                      b_2):
    """x: [batch, seq, dim]. Pre-norm multi-head self-attention, then a GELU MLP."""
    b, s, d = x.shape
    hd = d // HEADS
    h = F.layer_norm(x, (d,), ln1_w, ln1_b)
    q, k, v = F.linear(h, w_qkv, b_qkv).chunk(3, dim=-1)          # each [b, s, d]
    q, k, v = (t.reshape(b, s, HEADS, hd).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))     # [b, heads, s, s]
    attn = torch.softmax(scores, dim=-1) @ v                      # [b, heads, s, hd]
    attn = attn.transpose(1, 2).reshape(b, s, d)
    x = x + F.linear(attn, w_o, b_o)
    h = F.layer_norm(x, (d,), ln2_w, ln2_b)
    return x + F.linear(F.gelu(F.linear(h, w_1, b_1)), w_2, b_2)


def block_inputs(device: str) -> tuple:
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    d, hidden = DIM, MLP_RATIO * DIM
    ones, zeros = torch.ones(d, device=device), torch.zeros(d, device=device)
    return (rand(BATCH, SEQ, d),
            ones, zeros,                                           # ln1
            rand(3 * d, d, scale=d ** -0.5), rand(3 * d, scale=0.02),  # qkv projection
            rand(d, d, scale=d ** -0.5), rand(d, scale=0.02),      # output projection
            ones.clone(), zeros.clone(),                           # ln2
            rand(hidden, d, scale=d ** -0.5), rand(hidden, scale=0.02),
            rand(d, hidden, scale=hidden ** -0.5), rand(d, scale=0.02))


# -- (b) a tiny pointwise function: its cost is almost all call overhead -------------------
def tiny(x):
    return torch.sin(x * 2.0 + 1.0)


# -- timing helpers ---------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    """Seconds for one call of fn(), with GC paused (as timeit does)."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0
    finally:
        if gc_was_enabled:
            gc.enable()


def bench_tracing(device: str, repeat: int) -> dict:
    args = block_inputs(device)
    plait.jit(transformer_block).lower(*args)                     # warm-up (imports, caches)
    times, lowered = [], None
    for _ in range(repeat):
        jitted = plait.jit(transformer_block)                     # fresh: nothing cached

        def lower():
            nonlocal lowered
            lowered = jitted.lower(*args)

        times.append(_timed(lower, device))
        assert jitted.trace_count == 1
    # Sanity: what was traced computes what eager does.
    jitted = plait.jit(transformer_block)
    with torch.no_grad():
        torch.testing.assert_close(jitted(*args), transformer_block(*args), rtol=1e-4,
                                   atol=1e-4)
    return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
            "traced_nodes": len(lowered.traced_graph), "nodes": len(lowered.graph),
            "inputs": len(lowered.graph.inputs)}


def _per_call_us(fn, args: tuple, device: str, calls: int, repeat: int) -> float:
    def loop():
        for _ in range(calls):
            fn(*args)

    loop()                                                        # warm-up
    return statistics.median(1e6 * _timed(loop, device) / calls for _ in range(repeat))


def bench_overhead(device: str, repeat: int, calls: int) -> dict:
    x = torch.randn(4, device=device)
    jitted = plait.jit(tiny)
    torch.testing.assert_close(jitted(x), tiny(x))                # compiles (the one trace)
    eager_us = _per_call_us(tiny, (x,), device, calls, repeat)
    jit_us = _per_call_us(jitted, (x,), device, calls, repeat)
    assert jitted.trace_count == 1, "the timed calls should all hit the cache"
    return {"eager_us": eager_us, "jit_us": jit_us, "calls": calls}


# -- (c) the CPU compiler: plait (cpp backend) against eager and torch.compile ----------------
def loop_order(x):
    """The loop-ordering case: both reductions, z and z_t fuse into one read of x."""
    y = torch.sum(torch.sum(x, dim=-1))
    z = x / 10.0
    z_t = z.t().contiguous().t()
    return y, z, z_t


def softmax(x):
    return torch.softmax(x, dim=-1)


def layer_norm(x, w, b):
    return F.layer_norm(x, x.shape[-1:], w, b)


def gelu_chain(x):
    return F.gelu(x * 2.0 + 1.0) * torch.tanh(x) + x


def mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def mlp_loss(w1, b1, w2, b2, x, y):
    return F.mse_loss(mlp(x, w1, b1, w2, b2), y)


LR = 0.01


def sgd_step_torch(w1, b1, w2, b2, x, y):
    """A training step as eager code writes it: the weights updated in place."""
    grads, loss = torch.func.grad_and_value(mlp_loss, argnums=_PARAMS)(w1, b1, w2, b2, x, y)
    with torch.no_grad():
        for p, g in zip((w1, b1, w2, b2), grads):
            p.sub_(LR * g)
    return w1, b1, w2, b2, loss


def sgd_step_plait(w1, b1, w2, b2, x, y):
    """The same step written functionally; with the weights donated, the new ones are written
    into the old ones' memory."""
    grads, loss = plait.grad_and_value(mlp_loss, argnums=_PARAMS)(w1, b1, w2, b2, x, y)
    return (*[p - LR * g for p, g in zip((w1, b1, w2, b2), grads)], loss)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    torch_fn: Callable      # run eagerly (the reference) and by torch.compile
    plait_fn: Callable      # handed to plait.jit: torch_fn, or its plait-transformed twin
    shapes: dict            # {quick: the input shapes}
    donate: tuple = ()      # plait.jit's donate_argnums (the step overwrites its inputs)

    def inputs(self, quick: bool) -> tuple:
        """The same values at every call: a case that overwrites its inputs gets fresh ones."""
        g = torch.Generator().manual_seed(0)
        return tuple(torch.randn(*s, generator=g) / math.sqrt(s[-1]) for s in self.shapes[quick])

    def jit(self):
        return plait.jit(self.plait_fn, backend="cpp", donate_argnums=self.donate)


def _mlp_shapes(batch, d, hidden):
    return [(batch, d), (hidden, d), (hidden,), (d, hidden), (d,)]


# Training step: parameters first, so argnums (0..3) picks them as in torch.func.
_PARAMS = (0, 1, 2, 3)
CASES = {c.name: c for c in [
    Case("loop_order", loop_order, loop_order, {False: [(2048, 2048)], True: [(64, 48)]}),
    Case("softmax", softmax, softmax, {False: [(4096, 1024)], True: [(64, 32)]}),
    Case("layer_norm", layer_norm, layer_norm,
         {False: [(4096, 1024), (1024,), (1024,)], True: [(64, 32), (32,), (32,)]}),
    Case("gelu_chain", gelu_chain, gelu_chain, {False: [(4096, 1024)], True: [(64, 32)]}),
    Case("mlp", mlp, mlp, {False: _mlp_shapes(256, 512, 2048), True: _mlp_shapes(16, 32, 64)}),
    Case("train_step", torch.func.grad_and_value(mlp_loss, argnums=_PARAMS),
         plait.grad_and_value(mlp_loss, argnums=_PARAMS),
         {False: _mlp_shapes(256, 512, 2048)[1:] + [(256, 512), (256, 512)],
          True: _mlp_shapes(16, 32, 64)[1:] + [(16, 32), (16, 32)]}),
    Case("sgd_step", sgd_step_torch, sgd_step_plait,
         {False: _mlp_shapes(256, 512, 2048)[1:] + [(256, 512), (256, 512)],
          True: _mlp_shapes(16, 32, 64)[1:] + [(16, 32), (16, 32)]}, donate=_PARAMS),
]}


def _check(got, expected, what: str, tol: float = 1e-4) -> None:
    """A fast wrong answer must not pass: every compiled result is checked against eager."""
    try:
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    except AssertionError as e:
        raise AssertionError(f"{what} differs from eager: {e}") from None


def _cold_s(fn, args: tuple, expected, what: str) -> float:
    """Seconds of the first call of a fresh compiled fn (compile, then run); the result is
    checked after the clock stops."""
    out = []
    seconds = _timed(lambda: out.append(fn(*args)), "cpu")
    _check(out[0], expected, what)
    return seconds


def _warm_ms(fn, args: tuple, repeat: int, budget_s: float) -> float:
    """Median per-call ms of warm calls, as many per repetition as fill about budget_s."""
    once = min(_timed(lambda: fn(*args), "cpu") for _ in range(2))   # also the warm-up
    return _per_call_us(fn, args, "cpu", max(1, int(budget_s / once)), repeat) / 1e3


def warm_start(case: Case, quick: bool) -> None:
    """Run in a new process by bench_compilers: one call of plait.jit(fn) with the disk cache
    (PLAIT_CACHE_DIR) already populated. Prints JSON: its ms; the ms of a second, fresh
    plait.jit(fn) call (the same work without the process's one-time costs, such as modules
    that torch imports lazily on the first trace); and whether the first call compiled
    anything (a warm start loads its program: NOTE [program cache], lowering never runs)."""
    args = case.inputs(quick)
    _steady_allocator()
    # Results land on heap memory the process already touched, as in the warm calls it is
    # compared with: faulting in fresh pages is any new process's cost, not the warm start's.
    blocks = [torch.ones(2 << 20) for _ in range(32)]  # 32 x 8 MiB, under mmap's threshold
    del blocks

    def first_call_ms() -> float:
        t0 = time.perf_counter()
        case.jit()(*args)
        return 1e3 * (time.perf_counter() - t0)

    ms = first_call_ms()
    compiled = "plait.passes.lowering" in sys.modules
    print(json.dumps({"ms": ms, "again_ms": first_call_ms(), "compiled": compiled}))


def _warm_start_in_new_process(case: Case, quick: bool, cache_dir: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--warm-start", case.name] + \
        (["--quick"] if quick else [])
    proc = subprocess.run(cmd, env={**os.environ, "PLAIT_CACHE_DIR": cache_dir},
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.splitlines()[-1])


def _reason(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:120]


def bench_case(case: Case, quick: bool, repeat: int, budget_s: float) -> dict:
    fresh = functools.partial(case.inputs, quick)  # checked calls get inputs of their own
    args = fresh()
    expected = case.torch_fn(*fresh())
    row = {"eager_ms": _warm_ms(case.torch_fn, args, repeat, budget_s)}

    # plait: cold compile (trace, lower, fuse, generate, g++) into an empty disk cache, then
    # warm calls, then a warm start of a new process from that cache.
    with tempfile.TemporaryDirectory(prefix="plait-bench-") as cache_dir, \
            plait.config.patch(cache_dir=cache_dir):
        jitted = case.jit()
        row["plait_cold_s"] = _cold_s(jitted, fresh(), expected, "plait")
        row["plait_ms"] = _warm_ms(jitted, args, repeat, budget_s)
        row["stats"] = jitted.lower(*args).stats
        row["warm_start"] = _warm_start_in_new_process(case, quick, cache_dir)

    # torch.compile: dynamo forgets what it compiled; the section runs with inductor's caches
    # off (bench_compilers), so every case compiles from scratch.
    torch._dynamo.reset()
    try:
        compiled = torch.compile(case.torch_fn)
        row["tc_cold_s"] = _cold_s(compiled, fresh(), expected, "torch.compile")
        row["tc_ms"] = _warm_ms(compiled, args, repeat, budget_s)
    except Exception as e:  # a torch.compile failure on this machine is reported, not fatal
        row["tc_error"] = _reason(e)
    return row


@contextlib.contextmanager
def _compilers():
    """Both compilers with caches of their own, empty, and already started up."""
    # Imported here: sections (a), (b) and the warm-start process do not need inductor.
    import torch._dynamo
    import torch._inductor.config

    # With caches off, dynamo warns on every compile that profile-guided recompilation is off.
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")

    # Inductor's caches off: a new cache folder alone is not enough, since inductor also keeps
    # generated code in memory. It still writes its build products to a folder: a fresh one,
    # so the user's cache is neither read nor filled.
    with tempfile.TemporaryDirectory(prefix="inductor-bench-") as inductor_dir, \
            unittest.mock.patch.dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir), \
            torch._inductor.config.patch(force_disable_caches=True), \
            tempfile.TemporaryDirectory(prefix="plait-bench-") as warmup_dir, \
            plait.config.patch(cache_dir=warmup_dir):
        # "Both compilers already imported": one untimed compile each of an unrelated function
        # pays their one-time start-up (imports, compiler probing) outside the cold timings.
        x = torch.randn(4)
        torch.compile(tiny)(x)
        plait.jit(tiny, backend="cpp")(x)
        yield


def bench_compilers(cases: list[Case], quick: bool, repeat: int) -> dict:
    budget_s = 0.01 if quick else 0.1
    with _compilers():
        return {c.name: bench_case(c, quick, repeat, budget_s) for c in cases}


def _geomean(xs) -> float:
    xs = list(xs)
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


def _print_rows(header: tuple, rows: list[tuple]) -> None:
    """A markdown-style table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, tuple("-" * w for w in widths), *rows):
        print("  | " + " | ".join(f"{v:<{w}}" if i == 0 else f"{v:>{w}}"
                                  for i, (v, w) in enumerate(zip(row, widths))) + " |")


def _start_up_ms(r: dict) -> float:
    """What a warm start costs beyond running the function: its first call's ms less a warm
    call's."""
    return r["warm_start"]["ms"] - r["plait_ms"]


def print_compilers(results: dict, quick: bool, repeat: int) -> None:
    header = ("case", "eager ms", "torch.compile ms", "plait ms", "speedup vs tc",
              "tc cold s", "plait cold s", "cold ratio", "warm start ms", "start-up ms",
              "(again) ms", "kernels+externs")
    rows, notes = [], []
    for name, r in results.items():
        tc = "tc_ms" in r
        if not tc:
            notes.append(f"{name}: torch.compile n/a ({r['tc_error']})")
        if r["warm_start"]["compiled"]:
            notes.append(f"{name}: the warm start compiled: the program cache missed")
        rows.append((name, f"{r['eager_ms']:.3f}", f"{r['tc_ms']:.3f}" if tc else "n/a",
                     f"{r['plait_ms']:.3f}",
                     f"{r['tc_ms'] / r['plait_ms']:.2f}x" if tc else "n/a",
                     f"{r['tc_cold_s']:.2f}" if tc else "n/a", f"{r['plait_cold_s']:.2f}",
                     f"{r['plait_cold_s'] / r['tc_cold_s']:.3f}" if tc else "n/a",
                     f"{r['warm_start']['ms']:.1f}", f"{_start_up_ms(r):.1f}",
                     f"{r['warm_start']['again_ms']:.1f}",
                     f"{r['stats']['kernels']}+{r['stats']['externs']}"))
    print(f"(c) CPU compiler: plait.jit(backend='cpp') vs torch.compile "
          f"({'quick shapes' if quick else 'full shapes'}; warm times: median of {repeat} "
          f"repetitions, per call)")
    _print_rows(header, rows)
    both = [r for r in results.values() if "tc_ms" in r]
    if both:
        print(f"\n  geometric mean, speedup of plait over torch.compile (warm): "
              f"{_geomean(r['tc_ms'] / r['plait_ms'] for r in both):.2f}x   (target >= 1)")
        print(f"  geometric mean, cold compile plait / torch.compile:         "
              f"{_geomean(r['plait_cold_s'] / r['tc_cold_s'] for r in both):.3f}    "
              f"(target <= 0.333)")
    print(f"  slowest warm start: {max(r['warm_start']['ms'] for r in results.values()):.1f} ms "
          f"first call, of which start-up (beyond a warm call): "
          f"{max(map(_start_up_ms, results.values())):.1f} ms   (target < 50 ms per function)")
    for note in notes:
        print(f"  note: {note}")
    print()


# -- (d) peak memory of one call: eager, torch.compile and plait on the cases of (c) ----------
def _peak_bytes(fn, args: tuple) -> int:
    """The peak of live bytes that torch's CPU allocator handed out during one call of
    fn(*args), from the profiler's allocation events in time order. Only storages allocated
    during the call count: the inputs (and their frees) do not; the results do, as the caller
    keeps them. One method for all three, since inductor's CPU code and plait's wrapper both
    allocate through torch; memory malloc'ed by generated kernels themselves is not seen."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args)
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:  # the tree nests allocations under the ops that made them
        e = stack.pop()
        stack += e.children
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size))
    ours, live, peak = set(), 0, 0
    for _, ptr, nbytes in sorted(events):
        if nbytes > 0:
            ours.add(ptr)
        elif ptr in ours:
            ours.remove(ptr)
        else:
            continue  # the free of a storage from before the call
        live += nbytes
        peak = max(peak, live)
    return peak


def bench_memory(cases: list[Case], quick: bool) -> dict:
    """Per case, bytes: the measured peak of one warm call of eager, torch.compile and plait
    (_peak_bytes), plait's planned peak (stats["peak_bytes"]) and the peak its wrapper's
    tracker records (config.check_memory_plan), both less the inputs and constants, and the
    results' size."""
    results = {}
    with _compilers():
        for case in cases:
            fresh = functools.partial(case.inputs, quick)  # every call: inputs of its own
            args = fresh()
            inputs = sum(a.untyped_storage().nbytes() for a in args)
            expected = case.torch_fn(*args)
            held_by_caller = {a.untyped_storage().data_ptr() for a in args}
            row = {"results": sum(t.untyped_storage().nbytes()  # new memory, not the inputs
                                  for t in torch.utils._pytree.tree_leaves(expected)
                                  if t.untyped_storage().data_ptr() not in held_by_caller),
                   "eager": _peak_bytes(case.torch_fn, fresh())}
            jitted = case.jit()
            _check(jitted(*fresh()), expected, "plait")  # compiles; the next call is warm
            row["plait"] = _peak_bytes(jitted, fresh())
            compiled = jitted.lower(*args).compiled  # the same program (a disk cache hit)
            with plait.config.patch(check_memory_plan=True):
                compiled(list(fresh()))
            # Both count the inputs and the constants (made at compile time) as live on entry.
            held = inputs + sum(t.untyped_storage().nbytes()
                                for t in compiled.program.constants.values())
            row["tracker"] = compiled.measured_peak_bytes - held
            row["planned"] = compiled.plan.peak - held
            try:
                tc = torch.compile(case.torch_fn)
                _check(tc(*fresh()), expected, "torch.compile")
                row["tc"] = _peak_bytes(tc, fresh())
            except Exception as e:  # reported, not fatal, as in (c)
                row["tc_error"] = _reason(e)
            results[case.name] = row
    return results


def print_memory(results: dict, quick: bool) -> None:
    header = ("case", "results", "eager", "torch.compile", "plait", "plait planned",
              "plait tracker", "plait <= tc")
    rows, notes = [], []
    for name, r in results.items():
        tc = r.get("tc")
        if tc is None:
            notes.append(f"{name}: torch.compile n/a ({r['tc_error']})")
        if r["plait"] != r["tracker"]:  # two independent measurements of the same call
            notes.append(f"{name}: the profiler and plait's tracker disagree on plait's peak")
        rows.append((name, *(f"{r[k] / 1024:,.1f}" for k in ("results", "eager")),
                     "n/a" if tc is None else f"{tc / 1024:,.1f}",
                     *(f"{r[k] / 1024:,.1f}" for k in ("plait", "planned", "tracker")),
                     "n/a" if tc is None else ("yes" if r["plait"] <= tc else "NO")))
    print(f"(d) peak memory of one warm call, KiB allocated during the call (inputs excluded, "
          f"results included; {'quick' if quick else 'full'} shapes)")
    _print_rows(header, rows)
    both = [n for n, r in results.items() if "tc" in r]
    if both:
        at_or_below = [n for n in both if results[n]["plait"] <= results[n]["tc"]]
        print(f"\n  plait at or below torch.compile: {len(at_or_below)} of {len(both)} cases "
              f"(target: all)")
    for name in ("train_step", "sgd_step"):  # the training steps: the target is "lower"
        if name in both:
            r = results[name]
            print(f"  {name}: plait / torch.compile = {r['plait'] / r['tc']:.4f}   "
                  f"(target < 1)")
    for note in notes:
        print(f"  note: {note}")
    print()


def print_table(title: str, rows: list[tuple[str, str, str]]) -> None:
    """Rows of (label, number, unit): numbers right-aligned, units after them."""
    print(title)
    w_label = max(len(r[0]) for r in rows)
    w_value = max(len(r[1]) for r in rows)
    for label, value, unit in rows:
        print(f"  {label:<{w_label}}  {value:>{w_value}} {unit}".rstrip())
    print()


def _steady_allocator() -> str:
    """Tell glibc's malloc to keep freed memory (no unmapping or trimming of large blocks), as
    a long-running process effectively gets: otherwise whether a call's 16 MiB results land on
    fresh, page-faulting memory depends on the order of earlier allocations in the process,
    which swung one case's time by 10x between runs. Applies to eager, torch.compile and
    plait alike."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 1 << 30)
        return "kept (glibc mallopt)" if ok else "default (mallopt refused)"
    except OSError:
        return "default (no glibc)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu",
                        help="cpu (default) or cuda (when available)")
    parser.add_argument("--repeat", type=int,
                        help="timed repetitions per measurement; medians are reported "
                             "(default 7, 2 with --quick)")
    parser.add_argument("--calls", type=int,
                        help="calls per timed repetition in the overhead benchmark "
                             "(default 2000, 200 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes in (c), and fewer repetitions: a smoke test")
    parser.add_argument("--cases",
                        help=f"comma-separated cases of (c), of {', '.join(CASES)} on the CPU "
                             "or of benchmarks/gpu.py's on CUDA (default all; empty for "
                             "none)")
    parser.add_argument("--memory-only", action="store_true",
                        help="run only section (d), peak memory, on the cases of --cases")
    # Internal: the new process whose first call bench_compilers times as the warm start.
    parser.add_argument("--warm-start", choices=list(CASES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warm_start:
        warm_start(CASES[args.warm_start], args.quick)
        return 0
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda was asked for, but torch.cuda.is_available() is False")
    if cuda:  # (c) and (d) on the GPU are benchmarks/gpu.py's, with its own cases
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import gpu
    known = gpu.CASES if cuda else CASES
    cases = list(known) if args.cases is None else [c for c in args.cases.split(",") if c]
    args.repeat = args.repeat or ((5 if cuda else 2) if args.quick else 30 if cuda else 7)
    args.calls = args.calls or (200 if args.quick else 2000)
    if args.repeat < 1 or args.calls < 1:
        parser.error("--repeat and --calls must be at least 1")
    if set(cases) - set(known):
        parser.error(f"unknown case(s) {sorted(set(cases) - set(known))}; known: "
                     f"{', '.join(known)}")

    allocator = _steady_allocator() if args.device == "cpu" else "default"
    print(f"plait {plait.__version__}, torch {torch.__version__}, python "
          f"{platform.python_version()}, device {args.device}, backend "
          f"{plait.config.backend}, repeat {args.repeat}, threads "
          f"{torch.get_num_threads()}, cpus {os.cpu_count()}, freed memory "
          f"{allocator}\n")

    if args.memory_only:
        if args.device != "cpu":
            parser.error("--memory-only measures CPU memory: run it with --device cpu")
        print_memory(bench_memory([CASES[c] for c in cases], args.quick), args.quick)
        return 0

    t = bench_tracing(args.device, args.repeat)
    print_table(f"(a) tracing a transformer block: jit(f).lower(*args), batch {BATCH}, "
                f"seq {SEQ}, dim {DIM}, heads {HEADS}", [
                    ("lower() time, median", f"{t['median_ms']:.1f}", "ms"),
                    ("lower() time, fastest", f"{t['min_ms']:.1f}", "ms"),
                    ("nodes, traced graph", f"{t['traced_nodes']}", "(incl. inputs)"),
                    ("nodes, simplified graph", f"{t['nodes']}", "(incl. inputs)"),
                    ("graph inputs", f"{t['inputs']}", ""),
                ])

    o = bench_overhead(args.device, args.repeat, args.calls)
    print_table(f"(b) cached-call overhead: sin(x * 2 + 1) on a 4-element tensor, "
                f"median of {args.repeat} x {o['calls']} calls", [
                    ("eager call", f"{o['eager_us']:.1f}", "us"),
                    ("plait.jit call (cache hit)", f"{o['jit_us']:.1f}", "us"),
                    ("jit overhead per call", f"{o['jit_us'] - o['eager_us']:+.1f}", "us"),
                    ("jit / eager", f"{o['jit_us'] / o['eager_us']:.1f}", "x"),
                ])

    if cuda and cases:
        gpu.run(cases, args.quick, args.repeat)
    elif cases:
        print_compilers(bench_compilers([CASES[c] for c in cases], args.quick, args.repeat),
                        args.quick, args.repeat)
        print_memory(bench_memory([CASES[c] for c in cases], args.quick), args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
