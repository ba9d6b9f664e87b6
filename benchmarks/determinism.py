"""Bitwise reproducibility of the model suite's training step, per column, across processes.

For each model and column, every one of ``--processes`` fresh processes builds the model
(seed 0, dropout off as the suite's accuracy check has it), runs three training steps
(``zero_grad; loss.backward(); step`` of SGD with learning rate 0, so each step computes
the gradients of the same weights; plait replays CUDA graphs from its third call) and
hashes the loss and every gradient of each step. A column is reproducible when every step
of every process hashes alike; the report names the first tensor that differs.

    .venv/bin/python benchmarks/determinism.py [--device cpu|cuda] [--models A,B]
        [--dtype bfloat16] [--columns eager,plait] [--processes 2] [--parallel 4]
        [--torch-deterministic] [--csv FILE]

``--torch-deterministic`` calls ``torch.use_deterministic_algorithms(True)`` in each process
(with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which cuBLAS needs for it), which plait follows
too (NOTE [deterministic programs], config.py).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def digest(t: torch.Tensor) -> str:
    """A hash of ``t``'s bits."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()[:16]


def child(name: str, column: str, device: str, dtype: str) -> list[dict]:
    """Three steps of ``name``'s training under ``column``: each step's hashes."""
    import suite
    from suite_models import SUITE

    spec = SUITE[name]
    torch.manual_seed(0)
    module = spec.build(device == "cpu").to(device).train()
    suite.without_dropout(module)
    generator = torch.Generator().manual_seed(0)
    batch = spec.tiny_batch if device == "cpu" else spec.batch
    inputs = spec.inputs(module, batch, device == "cpu", device, generator)
    step = suite.Step(module, column, "train", dtype, inputs, device)
    steps = []
    for _ in range(3):
        torch.manual_seed(0)
        steps.append({k: digest(v) for k, v in step.outputs(*step()).items()})
    return steps


def _run_child(name, column, args) -> tuple[str, str, list | str]:
    env = dict(os.environ)
    if args.torch_deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    command = [sys.executable, __file__, "--child", name, column, "--device", args.device,
               "--dtype", args.dtype] + (["--torch-deterministic"] * args.torch_deterministic)
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        return name, column, (done.stderr.strip().splitlines() or ["?"])[-1][:200]
    return name, column, json.loads(done.stdout.strip().splitlines()[-1])


def verdict(runs: list) -> str:
    """"reproducible", or where the first difference is, or a process's failure."""
    if failed := [r for r in runs if isinstance(r, str)]:
        return f"fail: {failed[0]}"
    first = runs[0][0]
    for p, steps in enumerate(runs):
        for s, hashes in enumerate(steps):
            if differs := [k for k in first if hashes.get(k) != first[k]]:
                return f"differs: process {p} step {s}: {differs[0]}" + \
                    (f" (+{len(differs) - 1})" if len(differs) > 1 else "")
    return "reproducible"


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--models", default="GPT2LMHeadModel,BertForMaskedLM,timm_resnet50")
    parser.add_argument("--dtype", default=None, help="default float32 on the CPU, else bf16")
    parser.add_argument("--columns", default="eager,plait")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=1, help="processes at once")
    parser.add_argument("--torch-deterministic", action="store_true")
    parser.add_argument("--csv", default=None, help="append the verdicts here")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.torch_deterministic:
        torch.use_deterministic_algorithms(True)
    if args.child:
        print(json.dumps(child(*args.child, args.device, args.dtype)))
        return
    jobs = [(m, c) for m in args.models.split(",") for c in args.columns.split(",")
            for _ in range(args.processes)]
    runs: dict = {}
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        for name, column, result in pool.map(lambda job: _run_child(*job, args), jobs):
            runs.setdefault((name, column), []).append(result)
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    rows = [dict(model=name, column=column, dtype=args.dtype, card=card,
                 torch_deterministic=args.torch_deterministic, verdict=verdict(results))
            for (name, column), results in runs.items()]
    for row in rows:
        print(f"{row['model']:28} {row['column']:14} {row['verdict']}", flush=True)
    if args.csv:
        from suite import append_csv

        append_csv(args.csv, rows)


if __name__ == "__main__":
    main()
