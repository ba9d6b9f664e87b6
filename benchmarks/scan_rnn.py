"""A long recurrence's training step: plait.scan against a Python loop under torch.compile.

    .venv/bin/python benchmarks/scan_rnn.py [--steps 512] [--hidden 256] [--batch 32]
        [--device cpu|cuda] [--json FILE]

The model is an Elman RNN, ``h = tanh(h @ W + x_t @ U + b)``, over ``steps`` inputs, with the
loss the mean square of every step's state; the training step is the loss and the gradients
of W, U and b. plait compiles ``plait.jit(plait.grad_and_value(loss))`` with the recurrence
written as ``plait.scan`` (one node, its body compiled once; the backward is a reverse scan).
torch.compile compiles the same recurrence written as a Python loop, which it unrolls, and
its backward (``torch.autograd.grad`` of the compiled loss). Eager runs the loop. One process,
caches empty (plait's, Triton's and inductor's in a fresh folder), both compilers warmed on a
small function first; every column's time comes from the same timer (the median of repeated
calls after one untimed call, synchronized on CUDA), and every column's gradients are checked
against eager's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str, repeat: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeat`` calls after one untimed call."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(steps: int, hidden: int, batch: int, device: str, repeat: int) -> list[dict]:
    import torch

    import plait

    g = torch.Generator().manual_seed(0)
    params = {"W": torch.randn(hidden, hidden, generator=g) / hidden ** 0.5,
              "U": torch.randn(hidden, hidden, generator=g) / hidden ** 0.5,
              "b": torch.zeros(hidden)}
    params = {k: v.to(device) for k, v in params.items()}
    xs = torch.randn(steps, batch, hidden, generator=g).to(device)
    h0 = torch.zeros(batch, hidden, device=device)

    def loop_loss(p, xs):
        h, total = h0, 0.0
        for x in xs:
            h = torch.tanh(h @ p["W"] + x @ p["U"] + p["b"])
            total = total + h.square().mean()
        return total / steps

    def scan_loss(p, xs):
        def cell(h, x):
            h = torch.tanh(h @ p["W"] + x @ p["U"] + p["b"])
            return h, h.square().mean()

        return plait.scan(cell, h0, xs)[1].mean()

    small = torch.randn(8, 8, device=device)
    plait.jit(lambda x: torch.tanh(x) * 2)(small)
    torch.compile(lambda x: torch.tanh(x) * 3)(small)

    def eager_step():
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        return dict(zip(leaves, torch.autograd.grad(loop_loss(leaves, xs), list(leaves.values()))))

    reference = eager_step()
    compiled_loss = torch.compile(loop_loss)

    def compiled_step():
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        return dict(zip(leaves, torch.autograd.grad(compiled_loss(leaves, xs),
                                                    list(leaves.values()))))

    plait_grad = plait.jit(plait.grad_and_value(scan_loss))

    def plait_step():
        return plait_grad(params, xs)[0]

    rows = []
    for name, step in (("eager", eager_step), ("torch.compile", compiled_step),
                       ("plait", plait_step)):
        start = time.perf_counter()
        grads = step()
        _sync(device)
        first = time.perf_counter() - start
        error = max(((grads[k] - reference[k]).abs().max() /
                     reference[k].abs().max().clamp_min(1e-6)).item() for k in reference)
        rows.append({"compiler": name, "cold_s": first, "step_ms": _timed(step, device, repeat),
                     "grad_error": error, "steps": steps, "hidden": hidden, "batch": batch,
                     "device": device})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        os.environ.update(PLAIT_CACHE_DIR=os.path.join(cache, "plait"),
                          TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                          TRITON_CACHE_DIR=os.path.join(cache, "triton"))
        rows = run(args.steps, args.hidden, args.batch, args.device, args.repeat)
    print(f"RNN training step, {args.steps} steps, hidden {args.hidden}, batch {args.batch}, "
          f"{args.device}")
    print(f"{'':>14} {'cold s':>8} {'step ms':>9} {'grad err':>9}")
    for row in rows:
        print(f"{row['compiler']:>14} {row['cold_s']:>8.2f} {row['step_ms']:>9.2f} "
              f"{row['grad_error']:>9.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
