"""What one compilation's stages made and took: ``Stages`` records each stage's result (every
IR prints with ``.as_text()``) and seconds, in the order they ran, and says once on stderr when
a compilation runs long. The driver (``pipeline.py``) and the code generators it calls record
into one; ``Lowered.stages`` and ``Lowered.timings`` show it.
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
