"""benchmarks/run.py runs to completion and prints every section (no timing assertions)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python() -> str:
    venv_python = os.path.join(ROOT, ".venv", "bin", "python")
    return venv_python if os.path.exists(venv_python) else sys.executable


def test_benchmark_script_runs():
    # --quick: small shapes and 2 repetitions; two cases of (c) keep it well under 30 s (one
    # plain function, and the training step, which goes through plait.grad_and_value).
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
    rows = [line for line in out.splitlines() if line.startswith("  | ")]
    assert [r.split("|")[1].strip() for r in rows[2:]] == ["softmax", "train_step"], out
    assert "geometric mean, speedup of plait over torch.compile" in out, out
    assert "the disk cache missed" not in out, out  # the warm start built nothing
