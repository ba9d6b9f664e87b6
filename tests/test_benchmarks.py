"""benchmarks/run.py runs to completion and prints both sections (no timing assertions)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python() -> str:
    venv_python = os.path.join(ROOT, ".venv", "bin", "python")
    return venv_python if os.path.exists(venv_python) else sys.executable


def test_benchmark_script_runs():
    proc = subprocess.run([_python(), os.path.join(ROOT, "benchmarks", "run.py"), "--repeat",
                           "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    out = proc.stdout
    assert "(a) tracing a transformer block" in out, out
    assert "nodes, simplified graph" in out, out
    assert "(b) cached-call overhead" in out, out
    assert "plait.jit call (cache hit)" in out, out
