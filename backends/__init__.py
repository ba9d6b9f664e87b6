"""Backends turn a graph into a callable; they are registered by name.

A backend factory takes a ``Graph`` and returns ``run(inputs: list[Tensor]) -> list[Tensor]``;
one that also takes ``stages`` gets the compilation's ``passes.pipeline.Stages`` to record
its stages and their seconds in (what ``Lowered.stages`` and ``Lowered.timings`` show).
A backend may bring a config object; its ``repr`` joins the compilation cache key, so changing
it never serves code compiled under other settings. A backend whose callables may have a
picklable ``runner`` (the callable's runtime alone) registers with ``keeps_programs``: the
program cache keeps those on disk (NOTE [program cache]).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import attrs

from ..errors import BackendError
from . import cpp, eager, loopeval, triton


@attrs.frozen
class Backend:
    name: str
    factory: Callable
    config: Any = None
    keeps_programs: bool = False

    @property
    def staged(self) -> bool:
        """Does the factory take ``stages`` (NOTE [pipeline]) to record its stages in?"""
        return "stages" in inspect.signature(self.factory).parameters

    def cache_key(self) -> tuple:
        return (self.name, repr(self.config))


_BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, factory: Callable, config: Any = None, *,
                     keeps_programs: bool = False) -> None:
    """Register (or replace) the backend ``name``."""
    _BACKENDS[name] = Backend(name, factory, config, keeps_programs)


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


_BODIES: dict = {}  # (body digest, backend, settings) -> its compiled program


def compiled_body(graph, backend: str):
    """A control-flow body (or branch) as a program of its own on ``backend``: simplified and
    compiled once per body, backend and settings (NOTE [control-flow primitives], NOTE [native
    loops])."""
    from ..config import config
    from ..passes.simplify import simplify

    key = (graph.digest, backend, config.cache_key())
    if key not in _BODIES:
        _BODIES[key] = get_backend(backend).factory(simplify(graph))
    return _BODIES[key]


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


register_backend("eager", eager.compile_graph)
register_backend("cpp", cpp.compile_graph, keeps_programs=True)
register_backend("loops", loopeval.compile_graph)  # the reference for lowering and fusion
register_backend("triton", triton.compile_graph)

__all__ = ["Backend", "available_backends", "compiled_body", "get_backend", "register_backend",
           "resolve_backend"]
