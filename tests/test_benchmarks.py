"""benchmarks/run.py runs to completion and prints every section (no timing assertions)."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python() -> str:
    venv_python = os.path.join(ROOT, ".venv", "bin", "python")
    return venv_python if os.path.exists(venv_python) else sys.executable


@pytest.mark.slow  # the whole script, its C++ builds and timings included: most of a minute
def test_benchmark_script_runs():
    # --quick: small shapes and 2 repetitions; two cases of (c) and (d) keep it well under 30 s
    # (one plain function, and the training step, which goes through plait.grad_and_value).
    proc = subprocess.run([_python(), os.path.join(ROOT, "benchmarks", "run.py"), "--quick",
                           "--cases", "softmax,train_step"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    out = proc.stdout
    assert "(a) tracing a transformer block" in out, out
    assert "nodes, simplified graph" in out, out
    assert "(b) cached-call overhead" in out, out
    assert "plait.jit call (cache hit)" in out, out
    assert "(c) CPU compiler" in out, out
    assert "(d) peak memory" in out, out
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("  | ")]
    assert rows == ["case", "-" * 10, "softmax", "train_step"] * 2, out
    assert "geometric mean, speedup of plait over torch.compile" in out, out
    assert "plait at or below torch.compile" in out, out
    assert "the program cache missed" not in out, out  # the warm start compiled nothing
    assert "disagree on plait's peak" not in out, out  # profiler and tracker measure alike


def test_peak_bytes_counts_only_the_calls_allocations():
    spec = importlib.util.spec_from_file_location("bench_run",
                                                  os.path.join(ROOT, "benchmarks", "run.py"))
    run = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # for its dataclass
    spec.loader.exec_module(run)
    mib = 1 << 20
    held = [torch.empty(mib // 4)]  # 1 MiB from before the call, freed during it

    def two_temporaries(x):
        a, b = torch.empty(mib), torch.empty(mib)  # 4 MiB each
        out = x.clone()  # 1 MiB, kept by the caller
        del a, b, held[:]
        return out

    assert run._peak_bytes(two_temporaries, (torch.empty(mib // 4),)) == 9 * mib


@pytest.mark.slow  # two torchrun launches of 2 gloo ranks, tiny GPT-2 compiled per column
@pytest.mark.parametrize("wrapper, columns", [("ddp", "eager,plait.jit(DDP),DDP(plait.jit)"),
                                              ("fsdp", "eager,plait")])
def test_data_parallel_benchmark_runs_on_the_cpu(wrapper, columns):
    """benchmarks/ddp.py on 2 gloo ranks (tiny configs): every column trains, with
    gradients matching eager's (float32)."""
    proc = subprocess.run(
        [_python(), "-m", "torch.distributed.run", "--nproc-per-node", "2",
         os.path.join(ROOT, "benchmarks", "ddp.py"), "--wrapper", wrapper, "--columns",
         columns, "--models", "GPT2LMHeadModel", "--dtype", "float32", "--steps", "1",
         "--repeat", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    rows = [dict(f.split("=", 1) for f in line.split(" ") if "=" in f)
            for line in proc.stdout.splitlines() if line.startswith("model=")]
    assert [r["column"] for r in rows] == columns.split(","), proc.stdout
    assert all(float(r["grad_error"]) < 1e-4 for r in rows), proc.stdout
