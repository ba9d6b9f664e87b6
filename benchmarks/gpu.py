"""The Triton backend on a CUDA GPU: correctness against eager, then time against eager and
torch.compile, and the memory-traffic floor.

    python benchmarks/gpu.py [--quick]

Run on a machine with a GPU (the CPU tests run the backend under TRITON_INTERPRET=1 instead).
Prints a table: per case, eager / torch.compile / plait times (median of CUDA-event timings),
the floor (bytes the compiler must move / measured copy bandwidth) and plait's kernel count.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys

import torch
import torch.nn.functional as F

import plait


def loop_order(x):
    y = torch.sum(torch.sum(x, dim=-1))
    z = x / 10.0
    return y, z, z.t().contiguous().t()


def gelu_chain(x):
    return F.gelu(torch.tanh(x) * 3 - 1).exp()


CASES = {
    "loop_order": (loop_order, lambda n: [torch.randn(n, n)]),
    "softmax": (lambda x: torch.softmax(x, -1), lambda n: [torch.randn(2 * n, n // 2)]),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
                   lambda n: [torch.randn(2 * n, n // 2), torch.randn(n // 2),
                              torch.randn(n // 2)]),
    "gelu_chain": (gelu_chain, lambda n: [torch.randn(2 * n, n // 2)]),
    "logsumexp": (lambda x: torch.logsumexp(x, 1), lambda n: [torch.randn(2 * n, n // 2)]),
}


def _time(fn, args, repeat: int) -> float:
    """Median milliseconds of ``fn(*args)`` over CUDA events, after warm-up."""
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _bandwidth() -> float:
    """Measured device-to-device copy rate, bytes read plus written per millisecond."""
    a = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / _time(lambda: b.copy_(a), (), 20)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--size", type=int, default=2048, help="n: inputs are about n*n")
    opts = parser.parse_args()
    n, repeat = (256, 5) if opts.quick else (opts.size, 50)
    bandwidth = _bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}, n={n}, copy bandwidth {bandwidth / 1e9:.2f} TB/s")
    rows, speedups = [], []
    for name, (fn, make) in CASES.items():
        torch.manual_seed(0)
        args = [a.cuda() for a in make(n)]
        jitted = plait.jit(fn, backend="triton")
        torch.testing.assert_close(jitted(*args), fn(*args), rtol=1e-4, atol=1e-4)
        stats = jitted.lower(*args).stats
        compiled = torch.compile(fn)
        torch.testing.assert_close(compiled(*args), fn(*args), rtol=1e-4, atol=1e-4)
        eager_ms, tc_ms, plait_ms = (_time(f, args, repeat) for f in (fn, compiled, jitted))
        floor_ms = (stats["bytes_read"] + stats["bytes_written"]) / bandwidth
        speedups.append(tc_ms / plait_ms)
        rows.append((name, eager_ms, tc_ms, plait_ms, floor_ms, stats["kernels"]))
    print(f"{'case':12s} {'eager ms':>9s} {'compile ms':>10s} {'plait ms':>9s} {'floor ms':>9s} "
          f"{'kernels':>7s}")
    for name, e, t, p, f, k in rows:
        print(f"{name:12s} {e:9.3f} {t:10.3f} {p:9.3f} {f:9.3f} {k:7d}")
    print(f"geometric mean speedup of plait over torch.compile: "
          f"{math.exp(statistics.mean(map(math.log, speedups))):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
