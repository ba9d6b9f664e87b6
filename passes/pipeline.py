"""The compiler's stages after simplification, run from one place, each named and timed.

NOTE [pipeline]
A compiling backend (cpp, triton) hands its simplified graph to ``schedule`` with what its
code generator accepts (ops and dtypes), and gets back the scheduled loop program and its
memory plan. The stages are pure functions, run in this order:

  inline   checkpoint bodies in place (passes/lowering.py; NOTE [checkpoint])
  lower    primitive graph -> loop program (passes/lowering.py)
  index    index expressions simplified with the loops' ranges (passes/indexing.py), so
           that fusion compares loads as the kernels will compute them
  fuse     kernels merged (passes/fusion.py)
  reindex  the same, over the merged kernels' loops
  split    long reductions to few outputs in two kernels (passes/split.py; GPU targets)
  reuse    stores take over dead buffers in place    (passes/memory.py, ``config.inplace``)
  reorder  the kernel order of least peak memory     (``config.reorder``)
  overlap  collectives started early, waited late    (``config.overlap``)
  plan     pool slots and comm pools: a MemoryPlan   (``config.plan_memory``)

A switched-off stage still appears, with its input as its output. ``Stages`` records each
stage's result (every IR prints with ``.as_text()``) and seconds; the backend adds
``codegen`` (writing the kernels and the wrapper) and ``native`` (compiling and loading
them), and ``Lowered.stages`` / ``Lowered.timings`` put the traced graph and the simplify
passes in front. A compilation that runs longer than ``config.progress_after`` seconds says
so once on stderr (the stage, and kernels done of all during code generation): a compiler
that sits silent for a minute looks hung.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import sys
import time
from typing import Any, Callable

from ..config import config

_compile_log = logging.getLogger("plait.compile")


# NOTE [collector paused while compiling]
# Tracing and the passes allocate millions of small objects (nodes, values, index
# expressions) that live until the compilation ends, and Python's cyclic garbage collector
# scans every live object at each full collection: over half the time of a 12-block GPT's
# simplification went to those scans. A compilation runs with the collector paused, as a
# batch job would; its cyclic garbage is collected on the first collection after it.
@contextlib.contextmanager
def collector_paused():
    """Cyclic garbage collection off for the duration (nested: only the outermost restores)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Stages:
    """What one compilation's stages produced (name -> IR) and took (name -> seconds), in the
    order they ran."""

    def __init__(self, name: str = "function"):
        self.name, self.irs, self.seconds = name, {}, {}
        self._start = time.perf_counter()
        self._said = False

    def record(self, name: str, ir: Any, seconds: float) -> None:
        """Stage ``name`` made ``ir`` (None: nothing to show) in ``seconds``; a stage that
        runs again is ``name.2``, ``name.3``, ..."""
        key, n = name, 1
        while key in self.seconds:
            n += 1
            key = f"{name}.{n}"
        self.seconds[key] = seconds
        if ir is not None:
            self.irs[key] = ir

    def run(self, name: str, fn: Callable, *args, keep: bool = True, **kwargs) -> Any:
        """``fn(*args, **kwargs)`` as stage ``name``: timed, and its result kept (``keep``)."""
        self.progress(name)
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        self.record(name, out if keep else None, time.perf_counter() - start)
        return out

    def progress(self, stage: str, done: int | None = None, total: int | None = None) -> None:
        """One line on stderr, once, when the compilation has run past
        ``config.progress_after`` seconds."""
        elapsed = time.perf_counter() - self._start
        if self._said or elapsed < config.progress_after:
            return
        self._said = True
        count = f" ({done} of {total} kernels)" if total is not None else ""
        print(f"plait: compiling {self.name} for {elapsed:.0f} s so far, at {stage}{count}",
              file=sys.stderr, flush=True)

    def log(self) -> None:
        """The seconds per stage, on the ``compile`` log channel."""
        if _compile_log.isEnabledFor(logging.DEBUG):
            total = sum(self.seconds.values())
            _compile_log.debug("%s compiled in %.3f s: %s", self.name, total, ", ".join(
                f"{n} {s:.3f}" for n, s in self.seconds.items()))


def schedule(graph, stages: Stages, *, supported_ops, supported_dtypes, comm_buffers=True,
             split_reductions=False):
    """``graph`` lowered for a code generator, fused, and through the memory passes: the
    loop program and its memory plan (NOTE [pipeline]). ``split_reductions``: for a target
    with many parallel processors (NOTE [split reductions])."""
    # imported here: a program loaded from the disk cache runs without the compiler proper
    from . import fusion, indexing, lowering, memory, split

    graph = stages.run("inline", lowering.inline_checkpoints, graph)
    program = stages.run("lower", lowering.lower, graph, supported_ops=supported_ops,
                         supported_dtypes=supported_dtypes, comm_buffers=comm_buffers)
    program = stages.run("index", indexing.simplify_indices, program)
    program = stages.run("fuse", fusion.fuse, program)
    program = stages.run("reindex", indexing.simplify_indices, program)
    program = stages.run("split", split.split_reductions if split_reductions and
                         config.split_reductions else _same, program)
    program = stages.run("reuse", memory.reuse if config.inplace else _same, program)
    then = memory.overlap if config.overlap else None
    program = stages.run("reorder", memory.reorder if config.reorder else _same, program, then)
    program = stages.run("overlap", then or _same, program)
    plan = stages.run("plan", memory.plan, program, pool=config.plan_memory,
                      comm_reuse=config.comm_pool_reuse)
    return program, plan


def _same(program, *_):
    return program
