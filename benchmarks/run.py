"""plait micro-benchmarks: tracing time of a transformer block, and jit's per-call overhead.

    .venv/bin/python benchmarks/run.py [--device cpu|cuda] [--repeat N]

See benchmarks/README.md for what each number means.
"""
from __future__ import annotations

import argparse
import gc
import math
import platform
import statistics
import sys
import time

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


def _per_call_us(fn, arg, device: str, calls: int, repeat: int) -> float:
    def loop():
        for _ in range(calls):
            fn(arg)

    loop()                                                        # warm-up
    return statistics.median(1e6 * _timed(loop, device) / calls for _ in range(repeat))


def bench_overhead(device: str, repeat: int, calls: int) -> dict:
    x = torch.randn(4, device=device)
    jitted = plait.jit(tiny)
    torch.testing.assert_close(jitted(x), tiny(x))                # compiles (the one trace)
    eager_us = _per_call_us(tiny, x, device, calls, repeat)
    jit_us = _per_call_us(jitted, x, device, calls, repeat)
    assert jitted.trace_count == 1, "the timed calls should all hit the cache"
    return {"eager_us": eager_us, "jit_us": jit_us, "calls": calls}


def print_table(title: str, rows: list[tuple[str, str, str]]) -> None:
    """Rows of (label, number, unit): numbers right-aligned, units after them."""
    print(title)
    w_label = max(len(r[0]) for r in rows)
    w_value = max(len(r[1]) for r in rows)
    for label, value, unit in rows:
        print(f"  {label:<{w_label}}  {value:>{w_value}} {unit}".rstrip())
    print()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu",
                        help="cpu (default) or cuda (when available)")
    parser.add_argument("--repeat", type=int, default=7,
                        help="timed repetitions per measurement; medians are reported "
                             "(default 7)")
    parser.add_argument("--calls", type=int, default=2000,
                        help="calls per timed repetition in the overhead benchmark "
                             "(default 2000)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda was asked for, but torch.cuda.is_available() is False")
    if args.repeat < 1 or args.calls < 1:
        parser.error("--repeat and --calls must be at least 1")

    print(f"plait {plait.__version__}, torch {torch.__version__}, python "
          f"{platform.python_version()}, device {args.device}, backend "
          f"{plait.config.backend}, repeat {args.repeat}, threads "
          f"{torch.get_num_threads()}\n")

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
