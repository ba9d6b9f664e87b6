"""The GPU benchmark: plait's Triton backend against eager and
torch.compile on a CUDA GPU, with each case's floor, cold compile times and peak memory.

    python benchmarks/gpu.py [--quick] [--cases a,b] [--repeat N] [--autotune]
    python benchmarks/run.py --device cuda       # sections (a), (b), then this

Per case: eager, torch.compile (default mode) and plait device times (median of CUDA-event
timings after warm-up, each call launched while the GPU is still busy, so that host work is
hidden as in a training loop), the floor, both compilers' *call* times (one call on an idle
GPU: host work until the first launch included), cold compile seconds of both compilers, and the peak memory one
call allocates (``torch.cuda.max_memory_allocated`` above what was allocated before it) for
eager, torch.compile and plait. The floor of a memory-bound case is the bytes that must move
(every input read once, every result written once) over the measured copy bandwidth; of a
matmul-bound case, its matmul FLOPs over the measured bf16 matmul rate. Every result is
checked against eager before it is timed.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import tempfile
import unittest.mock
from typing import Callable

import torch
import torch.nn.functional as F

import plait
from plait.backends import cuda_graphs
# benchmarks/ is on the path: this script's folder, or run.py's
from run import _check as run_check, _geomean, _reason, _timed

BF16 = torch.bfloat16


def loop_order(x):
    y = torch.sum(torch.sum(x, dim=-1))
    z = x / 10.0
    return y, z, z.t().contiguous().t()


def gelu_bias(x, w, b):
    return F.gelu(x * w + b)


def rms_norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, eps=1e-6)


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v


def mlp(x, w1, w2):
    return F.linear(F.gelu(F.linear(x, w1)), w2)


def mlp_loss(w1, w2, x, y):
    return (mlp(x, w1, w2).float() - y.float()).square().mean()


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    torch_fn: Callable
    plait_fn: Callable
    make: Callable             # quick -> the inputs, on the GPU
    flops: Callable | None = None  # args -> matmul FLOPs (None: memory-bound)


def _randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def _mlp_args(quick):
    m, d, h = (256, 256, 1024) if quick else (8192, 4096, 16384)
    return [_randn(m, d, dtype=BF16), _randn(h, d, dtype=BF16, scale=d ** -0.5),
            _randn(d, h, dtype=BF16, scale=h ** -0.5)]


def _mlp_train_args(quick):
    x, w1, w2 = _mlp_args(quick)
    return [w1, w2, x, _randn(*x.shape, dtype=BF16)]


def _mlp_flops(x, w1, w2) -> int:
    return 2 * x.shape[0] * (w1.numel() + w2.numel())


def _rows(quick):
    return (1024, 512) if quick else (32768, 4096)


CASES = {c.name: c for c in [
    Case("loop_order", loop_order, loop_order,
         lambda q: [_randn(*((512, 512) if q else (8192, 8192)))]),
    Case("softmax", lambda x: torch.softmax(x, -1), lambda x: torch.softmax(x, -1),
         lambda q: [_randn(*_rows(q))]),
    Case("layer_norm", lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
         lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
         lambda q: [_randn(*_rows(q), dtype=BF16), _randn(_rows(q)[1], dtype=BF16),
                    _randn(_rows(q)[1], dtype=BF16)]),
    Case("rms_norm", rms_norm, rms_norm,
         lambda q: [_randn(*_rows(q), dtype=BF16), _randn(_rows(q)[1], dtype=BF16)]),
    Case("gelu_bias", gelu_bias, gelu_bias,
         lambda q: [_randn(*_rows(q), dtype=BF16), _randn(_rows(q)[1], dtype=BF16),
                    _randn(_rows(q)[1], dtype=BF16)]),
    Case("cross_entropy", F.cross_entropy, F.cross_entropy,
         lambda q: [_randn(*((256, 1000) if q else (8192, 50304))),
                    torch.randint(0, 1000 if q else 50304, (256 if q else 8192,),
                                  device="cuda")]),
    Case("attention", attention, attention,
         lambda q: [_randn(*((2, 2, 128, 64) if q else (8, 16, 2048, 64)), dtype=BF16)
                    for _ in range(3)],
         lambda q, k, v: 4 * q.numel() * k.shape[-2]),
    Case("mlp", mlp, mlp, _mlp_args, lambda x, w1, w2: _mlp_flops(x, w1, w2)),
    Case("mlp_train", torch.func.grad(mlp_loss, argnums=(0, 1)),
         plait.grad(mlp_loss, argnums=(0, 1)), _mlp_train_args,
         lambda w1, w2, x, y: 3 * _mlp_flops(x, w1, w2)),  # forward, and two per backward
]}


# About 0.5 ms of GPU spinning (torch.cuda._sleep counts clock cycles): longer than any
# contender's host work before its first launch.
_BUSY_CYCLES = 1_000_000


def _time(fn, args, repeat: int, busy: bool = True) -> float:
    """Median milliseconds of ``fn(*args)`` over CUDA events, after warm-up. ``busy``: the
    device time. The GPU is kept busy while the call's host work (argument checks, cache
    lookup, launches) runs, as a training loop keeps it, so only the GPU's own work counts;
    host work that outlasts the spin counts too, so the measure never undercounts the
    device's. Otherwise the latency of one call on an idle GPU, host work included."""
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if busy:
            torch.cuda._sleep(_BUSY_CYCLES)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _cold_s(fn, args) -> float:
    return _timed(lambda: fn(*args), "cuda")


def _peak_mib(fn, args, graphs: int = 0) -> float:
    """MiB one call allocates at its peak, above what was allocated before it (the results
    count: the caller keeps them), plus ``graphs``: the bytes the CUDA graphs it replays hold
    (a replay allocates nothing: its memory was set aside when it was captured)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*args)  # noqa: F841  (held until the peak is read)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before + graphs) / 2 ** 20


def _copy_rate() -> float:
    """Device-to-device copy rate, bytes read plus written per millisecond."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    return 2 * a.numel() / _time(lambda: torch.empty_like(a).copy_(a), (), 20)


def _matmul_rate() -> float:
    """bf16 matmul FLOPs per millisecond, on a large square product."""
    a = _randn(8192, 8192, dtype=BF16)
    return 2 * 8192 ** 3 / _time(torch.mm, (a, a), 20)


def _check(got, want, what: str) -> None:
    run_check(got, want, what, tol=2e-2)  # bf16 cases


@contextlib.contextmanager
def _empty_caches():
    """Both compilers' caches empty: plait's disk cache and Triton's kernel cache (plait's
    kernels are compiled by Triton's JIT) in fresh folders, inductor's off."""
    import torch._inductor.config

    with tempfile.TemporaryDirectory(prefix="plait-gpu-") as plait_dir, \
            tempfile.TemporaryDirectory(prefix="inductor-gpu-") as inductor_dir, \
            tempfile.TemporaryDirectory(prefix="triton-gpu-") as triton_dir, \
            unittest.mock.patch.dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir,
                                     TRITON_CACHE_DIR=triton_dir), \
            torch._inductor.config.patch(force_disable_caches=True), \
            plait.config.patch(cache_dir=plait_dir):
        yield


def bench(case: Case, quick: bool, repeat: int, rates: dict, tune: bool = False) -> dict:
    torch.manual_seed(0)
    args = case.make(quick)
    expected = case.torch_fn(*args)
    row = {"eager_ms": _time(case.torch_fn, args, repeat),
           "eager_mib": _peak_mib(case.torch_fn, args)}
    jitted = plait.jit(case.plait_fn, backend="triton")
    graphs = cuda_graphs.held_bytes()
    row["plait_cold_s"] = _cold_s(jitted, args)
    _check(jitted(*args), expected, "plait")
    row["plait_ms"] = _time(jitted, args, repeat)
    row["plait_mib"] = _peak_mib(jitted, args, cuda_graphs.held_bytes() - graphs)
    row["plait_call_ms"] = _time(jitted, args, repeat, busy=False)
    stats = jitted.lower(*args).stats
    row["kernels"] = f"{stats.get('kernels', 0)}+{stats.get('externs', 0)}"
    if tune:  # NOTE [autotuning]: the same kernels, each launched as its fastest candidate
        with plait.config.patch(triton_autotune=True):
            tuned = plait.jit(case.plait_fn, backend="triton")
            row["tune_s"] = _cold_s(tuned, args)
            _check(tuned(*args), expected, "plait (autotuned)")
            row["tuned_ms"] = _time(tuned, args, repeat)
            row["tuned"] = tuned.lower(*args).compiled.tuned_launches
    torch._dynamo.reset()
    compiled = torch.compile(case.torch_fn)
    row["tc_cold_s"] = _cold_s(compiled, args)
    _check(compiled(*args), expected, "torch.compile")
    row["tc_ms"], row["tc_mib"] = _time(compiled, args, repeat), _peak_mib(compiled, args)
    row["tc_call_ms"] = _time(compiled, args, repeat, busy=False)
    if case.flops is None:
        moved = sum(t.nbytes for t in (*args, *torch.utils._pytree.tree_leaves(expected)))
        row["floor_ms"], row["bound"] = moved / rates["copy"], "memory"
    else:
        row["floor_ms"], row["bound"] = case.flops(*args) / rates["matmul"], "matmul"
    return row


def _mib(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.3f}"


def run(cases: list[str], quick: bool, repeat: int, tune: bool = False) -> dict:
    import torch._dynamo  # noqa: F401  (imported before anything is timed)

    rates = {"copy": _copy_rate(), "matmul": _matmul_rate()}
    print(f"(c) GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}; copy {rates['copy'] / 1e9:.2f} TB/s (read + "
          f"write), bf16 matmul {rates['matmul'] / 1e9:.0f} TFLOP/s; "
          f"{'quick' if quick else 'full'} shapes, median of {repeat}")
    results = {}
    with _empty_caches():
        # Cold compile is per function, in a process where both compilers have already run:
        # one-time costs (CUDA context, Triton's and inductor's first imports) stay out of it.
        warm_up = _randn(64, 64)
        plait.jit(lambda x: x.exp() + 1, backend="triton")(warm_up)
        torch.compile(lambda x: x.exp() + 1)(warm_up)
        # the fused-attention library kernel both compilers call for `attention` loads on
        # its first use: a one-time cost of the process, not of whichever compiles first
        F.scaled_dot_product_attention(*[_randn(1, 1, 128, 64, dtype=BF16)] * 3)
        for name in cases:
            try:
                results[name] = bench(CASES[name], quick, repeat, rates, tune)
            except Exception as e:  # reported, not fatal: the table shows what ran
                results[name] = {"error": _reason(e)}
    header = ("case", "bound", "eager ms", "tc ms", "plait ms", "floor ms", "plait/floor",
              "tc/floor", "plait vs tc", "tc call ms", "plait call ms", "tc cold s",
              "plait cold s", "eager MiB", "tc MiB", "plait MiB", "kernels+externs")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | error: {r['error']} |")
            continue
        print(f"| {name} | {r['bound']} | {r['eager_ms']:.3f} | {r['tc_ms']:.3f} | "
              f"{r['plait_ms']:.3f} | {r['floor_ms']:.3f} | {r['plait_ms'] / r['floor_ms']:.2f} | "
              f"{r['tc_ms'] / r['floor_ms']:.2f} | {r['tc_ms'] / r['plait_ms']:.2f}x | "
              f"{r['tc_call_ms']:.3f} | {r['plait_call_ms']:.3f} | {r['tc_cold_s']:.2f} | {r['plait_cold_s']:.2f} | {_mib(r['eager_mib'])} | "
              f"{_mib(r['tc_mib'])} | {_mib(r['plait_mib'])} | {r['kernels']} |")
    done = [r for r in results.values() if "error" not in r]
    if tune:
        print("\n| case | plait ms | autotuned ms | tuned vs tc | tuning s | launches chosen |\n"
              "|---|--:|--:|--:|--:|---|")
        for name, r in results.items():
            if "error" not in r:
                chosen = "; ".join(f"{k.split()[0]}: " + " ".join(
                    f"{n[0] if n.endswith('BLOCK') else 'w'}{v}" for n, v in c.items()
                    if n.endswith("BLOCK") or n == "num_warps")
                    for k, c in sorted(r["tuned"].items()))
                print(f"| {name} | {r['plait_ms']:.3f} | {r['tuned_ms']:.3f} | "
                      f"{r['tc_ms'] / r['tuned_ms']:.2f}x | {r['tune_s']:.1f} | {chosen} |")
    print(f"\n  geometric mean, plait speedup over torch.compile: "
          f"{_geomean(r['tc_ms'] / r['plait_ms'] for r in done):.2f}x")
    print(f"  geometric mean, cold compile plait / torch.compile: "
          f"{_geomean(r['plait_cold_s'] / r['tc_cold_s'] for r in done):.3f} (target <= 0.333)")
    print(f"  peak memory at or below torch.compile: "
          f"{sum(r['plait_mib'] <= r['tc_mib'] for r in done)} of {len(done)}")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, 5 repetitions")
    parser.add_argument("--repeat", type=int, help="timed repetitions (default 30)")
    parser.add_argument("--autotune", action="store_true",
                        help="also time plait with config.triton_autotune (NOTE [autotuning])")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of {', '.join(CASES)}")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the CPU tests run the Triton backend under "
                     "TRITON_INTERPRET=1 instead)")
    cases = [c for c in opts.cases.split(",") if c]
    if set(cases) - set(CASES):
        parser.error(f"unknown case(s) {sorted(set(cases) - set(CASES))}")
    run(cases, opts.quick, opts.repeat or (5 if opts.quick else 30), opts.autotune)
    return 0


if __name__ == "__main__":
    sys.exit(main())
