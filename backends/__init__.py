"""Backends make a compiled graph runnable; they are registered by name.

A backend either interprets a graph, ``factory(graph) -> run(inputs) -> outputs`` (eager, or
one of a user's), or generates code for the loop program the driver scheduled for it
(``target``: what its code generator accepts, NOTE [pipeline] in compiler/pipeline.py):
``factory(program, plan, stages, bodies) -> run`` records its own stages in ``stages`` and
compiles a control-flow body with ``bodies(graph)``. A backend may bring a config object; its
``repr`` joins the compilation cache key, as do the values of the global settings its code
generator reads (``reads``). A backend whose callables may have a picklable ``runner`` (the
callable's runtime alone) registers with ``keeps_programs``: the program cache keeps those on
disk (NOTE [program cache]); one that runs programs of symbolic sizes (NOTE [symbolic sizes]
in graph/types.py) with ``symbolic_sizes``, and a jit then compiles a dimension that varies
once for all its sizes. Nothing here imports the passes: backends only generate code.
"""
from __future__ import annotations

from typing import Any, Callable

import attrs

from ..config import config as global_config
from ..errors import BackendError
from . import cpp, eager, loopeval, triton
from .codegen import Target


@attrs.frozen
class Backend:
    name: str
    factory: Callable
    config: Any = None
    keeps_programs: bool = False
    target: Callable[[], Target] | None = None  # a code generator's (None: interprets graphs)
    reads: tuple[str, ...] = ()  # the global settings its code generation reads
    symbolic_sizes: bool = False  # runs programs whose sizes are symbolic

    def cache_key(self) -> tuple:
        return (self.name, repr(self.config), tuple(getattr(global_config, r) for r in self.reads))


_BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, factory: Callable, config: Any = None, *,
                     keeps_programs: bool = False, target: Callable[[], Target] | None = None,
                     reads: tuple[str, ...] = (), symbolic_sizes: bool = False) -> None:
    """Register (or replace) the backend ``name``."""
    _BACKENDS[name] = Backend(name, factory, config, keeps_programs, target, tuple(reads),
                              symbolic_sizes)


def get_backend(name: str) -> Backend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise BackendError(f"unknown backend {name!r}; registered backends: "
                           f"{sorted(_BACKENDS)} (or \"auto\"). Add one with "
                           "plait.backends.register_backend(name, factory).") from None


def resolve_backend(name: str, tensors) -> str:
    """``name``, or for ``"auto"`` (the default) the backend for where the tensors are:
    fused Triton kernels on CUDA, fused C++ kernels on the CPU, eager anywhere else."""
    if name != "auto":
        return name
    devices = {t.device.type for t in tensors}
    return "cpp" if devices <= {"cpu"} else "triton" if devices == {"cuda"} else "eager"


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


register_backend("eager", eager.compile_graph, symbolic_sizes=True)
register_backend("cpp", cpp.CompiledProgram, keeps_programs=True, target=cpp.target,
                 reads=cpp.READS, symbolic_sizes=True)
register_backend("loops", loopeval.Interpreted, target=loopeval.target)  # the reference
register_backend("triton", triton.generate, target=triton.target, reads=triton.READS,
                 symbolic_sizes=True)

__all__ = ["Backend", "Target", "available_backends", "get_backend", "register_backend",
           "resolve_backend"]
