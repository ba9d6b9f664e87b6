"""Cold compile time of a whole model's training step: plait against torch.compile, by depth.

    .venv/bin/python benchmarks/compile_time.py [--blocks 1,2,4,8,12] [--dim 128]
        [--device cpu|cuda] [--no-torch-compile] [--json FILE]

The step is a GPT's loss and the gradients of every parameter (benchmarks/models.py): plait
compiles ``plait.jit(plait.grad_and_value(gpt_loss))``; torch.compile compiles ``gpt_loss``
and its backward (``torch.autograd.grad`` of the compiled loss, AOTAutograd's joint graph).
Each depth runs in a fresh process in which both compilers are imported and warmed on a small
function first, with empty caches of their own, so each column is a cold compile of that
model alone; every column's grads are checked against eager's. plait's seconds per stage
(``Lowered.timings``: trace, simplify passes, lowering, fusion, index simplification, memory
passes, code generation, native compilation, and on a GPU compiling the kernels for the
device) are summed over the stages of each kind.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
STAGE_KINDS = {"trace": ("traced",),
               "simplify": ("erase_markers", "dce", "fold_constants", "fuse_attention", "algebra",
                            "cse"),
               "lower": ("inline", "lower"), "fuse": ("fuse",), "index": ("index", "reindex"),
               "memory": ("reuse", "reorder", "overlap", "plan"),
               "codegen": ("codegen", "wrapper"), "native": ("native",), "device": ("device",)}


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _max_error(grads: dict, reference: dict) -> float:
    return max(((g.float() - reference[k].float()).abs().max() /
                reference[k].float().abs().max().clamp_min(1e-6)).item()
               for k, g in grads.items())


def one(blocks: int, dim: int, device: str, torch_compile: bool) -> dict:
    """Both compilers on one depth, in this (fresh) process."""
    import torch

    sys.path.insert(0, HERE)
    import plait
    from models import gpt_batch, gpt_loss, gpt_params

    heads = max(1, dim // 64)
    vocab, batch, seq = (50304, 8, 1024) if device == "cuda" else (512, 4, 64)
    params = gpt_params(blocks, dim, vocab, seq, device=device)
    tokens, targets = gpt_batch(batch, seq, vocab, device=device)
    small = torch.randn(8, 8, device=device)
    plait.jit(lambda x: torch.softmax(x, -1) * 2)(small)           # both imported and warm
    torch.compile(lambda x: torch.softmax(x, -1) * 3)(small)

    reference = dict(zip(params, torch.autograd.grad(
        gpt_loss({k: v.requires_grad_() for k, v in params.items()}, tokens, targets, heads),
        list(params.values()))))
    params = {k: v.detach() for k, v in params.items()}

    step = plait.jit(plait.grad_and_value(gpt_loss), static_argnums=3)
    start = time.perf_counter()
    grads, _ = step(params, tokens, targets, heads)
    _sync(device)
    plait_s = time.perf_counter() - start
    (compiled,) = step._cache.values()
    timings = compiled.lowered.timings
    stages = {kind: sum(s for n, s in timings.items() if n.split(".")[0] in names)
              for kind, names in STAGE_KINDS.items()}
    row = {"blocks": blocks, "dim": dim, "device": device, "plait_s": plait_s,
           "plait_stages": stages, "plait_error": _max_error(grads, reference),
           "kernels": len(compiled.lowered.kernels),
           "distinct_kernels": len({w.name for w in
                                    getattr(compiled.lowered.compiled, "writers", {}).values()})}
    if torch_compile:
        loss_fn = torch.compile(gpt_loss)
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        start = time.perf_counter()
        tc_grads = torch.autograd.grad(loss_fn(leaves, tokens, targets, heads),
                                       list(leaves.values()))
        _sync(device)
        row["torch_compile_s"] = time.perf_counter() - start
        row["torch_compile_error"] = _max_error(dict(zip(leaves, tc_grads)), reference)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="1,2,4,8,12")
    parser.add_argument("--dim", type=int, default=None, help="default 128 (cpu), 768 (cuda)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--no-torch-compile", action="store_true")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    dim = args.dim or (768 if args.device == "cuda" else 128)
    if args.one is not None:
        print(json.dumps(one(args.one, dim, args.device, not args.no_torch_compile)))
        return
    rows = []
    header = (f"{'blocks':>6} {'plait s':>8} {'t.compile s':>11} {'ratio':>6} {'kernels':>9} "
              f"{'grad err':>9}  plait stages (s)")
    print(f"cold compile of a GPT training step, d={dim}, {args.device}\n{header}")
    for blocks in map(int, args.blocks.split(",")):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, PLAIT_CACHE_DIR=os.path.join(cache, "plait"),
                       TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            command = [sys.executable, __file__, "--one", str(blocks), "--dim", str(dim),
                       "--device", args.device] + ["--no-torch-compile"] * args.no_torch_compile
            out = subprocess.run(command, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{blocks:>6} failed:\n{out.stderr[-3000:]}")
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        tc = row.get("torch_compile_s")
        stages = " ".join(f"{k} {v:.2f}" for k, v in row["plait_stages"].items() if v)
        error = max(row["plait_error"], row.get("torch_compile_error", 0.0))
        print(f"{blocks:>6} {row['plait_s']:>8.2f} {tc or float('nan'):>11.2f} "
              f"{(row['plait_s'] / tc) if tc else float('nan'):>6.3f} "
              f"{row['distinct_kernels']:>4}/{row['kernels']:<4} {error:>9.1e}  {stages}",
              flush=True)
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        print(f"plait grows {last['plait_s'] / first['plait_s']:.1f}x from {first['blocks']} to "
              f"{last['blocks']} blocks" + (
                  f"; torch.compile {last['torch_compile_s'] / first['torch_compile_s']:.1f}x"
                  if "torch_compile_s" in last else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
