"""Worker processes that compile the Triton backend's kernels for a GPU.

NOTE [compile workers]
Triton's compile of one kernel holds the GIL for most of its time (its frontend and the
Python that drives the MLIR passes), so compiling a program's kernels in threads overlaps
little more than ptxas. A pool of worker processes compiles them in parallel instead. A
worker is a plain Python running this file as a script: it imports triton, never torch or
plait, so it starts in a fraction of a second and holds no GPU context; the pool starts when
the first program is compiled for a GPU, so its start overlaps lowering, and stays for the
process (a worker exits when its parent does: it reads jobs from a pipe, and the pipe
closes). Programs of fewer than ``WORKERS_FROM`` kernels compile in the parent only: a
worker's first job costs more than a few kernels do. Idle workers are taken last-in first
out, so a few jobs go to the workers that have compiled before.

A job is what Triton itself needs to compile a kernel without a device: the generated module
(in the disk cache, ``load_module``), the kernel's name, the target, and the specialization
of its launches that Triton's cache hook serializes (the parent takes it from a ``warmup``
whose hook skips the compile). The worker compiles it into Triton's disk cache
(``TRITON_CACHE_DIR``), where the parent's ``warmup`` of the same kernel, right after, finds
it. Workers are only a speed-up: the parent still compiles each kernel itself, so a worker
that fails, dies or is missing costs time, never a result, and the parent reports any error
as it would without workers (a worker's error is logged at debug level on ``plait.kernels``).
This file imports nothing of plait, so the parent side here stays stdlib only too.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import subprocess
import sys
import threading

_log = logging.getLogger("plait.kernels")


class Pool:
    """``size`` worker processes; ``compile(job)`` runs a job on an idle one and returns
    whether it succeeded. Thread-safe: each calling thread takes a worker for its job; a
    worker that died leaves ``None`` in its place."""

    def __init__(self, size: int):
        self._idle: queue.LifoQueue = queue.LifoQueue()
        for _ in range(size):
            self._idle.put(subprocess.Popen(
                [sys.executable, "-u", __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True, bufsize=1))

    def compile(self, job: dict) -> bool:
        worker = self._idle.get()
        if worker is None:
            self._idle.put(None)
            return False
        try:
            worker.stdin.write(json.dumps(job) + "\n")
            reply = json.loads(worker.stdout.readline() or '{"error": "the worker exited"}')
        except (OSError, ValueError) as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        self._idle.put(worker if worker.poll() is None else None)
        if "error" in reply:
            _log.debug("compile worker, %s: %s", job["kernel"], reply["error"])
        return "error" not in reply

    def close(self) -> None:
        """End the idle workers (their pipes close, so they exit; one that does not within five
        seconds is killed): at the parent's exit, so that none is left running, which Python's
        ``subprocess`` warns about."""
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is None:
                continue
            for pipe in (worker.stdin, worker.stdout):
                pipe.close()
            try:
                worker.wait(timeout=5)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()


_pool: Pool | None = None
_lock = threading.Lock()


def pool(size: int) -> Pool:
    """The process's pool, started at the first call (with ``size`` workers)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = Pool(size)
            atexit.register(_pool.close)
        return _pool


def _serve() -> None:
    """The worker's loop: one JSON job per line in, one JSON reply per line out."""
    import importlib.util

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever Triton prints goes where stderr goes, never into the replies
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def untuple(value):  # JSON made the specialization's tuples lists
        return tuple(map(untuple, value)) if isinstance(value, list) else value

    def constant(value):  # as Triton's own ``JITFunction.preload`` reads them back
        if isinstance(value, str) and tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(untuple(value["constexpr"]))
        return untuple(value)

    modules: dict[str, object] = {}
    for line in sys.stdin:
        job = json.loads(line)
        try:
            if job["path"] not in modules:
                spec = importlib.util.spec_from_file_location(job["module"], job["path"])
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                modules[job["path"]] = module
            data = json.loads(job["specialization"])
            source = ASTSource(
                getattr(modules[job["path"]], job["kernel"]),
                {k: untuple(v) for k, v in data["signature"].items()},
                {tuple(k): constant(v) for k, v in zip(data["constant_keys"],
                                                       data["constant_vals"])},
                {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"])})
            triton.compile(source, target=GPUTarget(**job["target"]),
                           options={k: untuple(v) for k, v in data["options"].items()})
            reply = {"ok": True}
        except Exception as e:  # reported to the parent, which compiles the kernel itself
            reply = {"error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    # this file's folder (Python puts it first, symlinks resolved): its triton.py is not triton
    here = os.path.realpath(os.path.dirname(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]
    _serve()
