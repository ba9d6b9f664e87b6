"""Compiled programs kept on disk, so that a new process compiles nothing it compiled before.

NOTE [program cache]
A compiled program's runtime (``codegen.Runner``: the wrapper's steps holding the loaded
kernels, the constants, the device) is pickled to ``<cache_dir>/programs/<key>.pkl``. A process
calling a function that an earlier one compiled traces it (the traced graph is the key) and
loads the runner: no simplify, lowering, fusion, memory passes or code generation, and none
of the lazy imports they cost. The key digests the graph as traced (donations marked), the
backend and its config, ``config.cache_key()``, the torch version and plait's own source files
(sizes and modification times: an edited plait never runs what an older one compiled).

An entry is a header line holding the sha256 of the pickle, then the pickle: a damaged or
truncated entry, or one whose library is gone, is a miss, and the program compiled again
replaces it. Writes are atomic, so processes compiling one function at once both succeed.
Only the programs of backends registered with ``keeps_programs`` are looked up, and of those
only runners that pickle are kept: the cpp backend's, whose kernel steps pickle as their
library's path and symbol, with ATen ops by name. A program calling a collective is compiled
in each process, as are the triton backend's (not registered: its launch configurations are
resolved per device); ``config.program_cache`` turns the cache off. Entries are
pickles: the cache folder must be trusted, as Triton's and Inductor's are.
"""
from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
import pickle

import torch

from .codegen import cache_folder, write_atomically

_log = logging.getLogger("plait.cache")


def key(graph, backend, config_key: tuple) -> str:
    """The entry of ``graph`` compiled by ``backend`` under settings ``config_key``
    (``config.cache_key()`` when the compilation began)."""
    parts = (graph.digest, repr(backend.cache_key()), repr(config_key), torch.__version__,
             _plait_source())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:40]


@functools.cache
def _plait_source() -> str:
    """plait's source files (those of the package and its subpackages) by size and time."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folders = [root] + [e.path for e in os.scandir(root)
                        if e.is_dir() and os.path.exists(os.path.join(e.path, "__init__.py"))]
    files = sorted(e.path for f in folders for e in os.scandir(f) if e.name.endswith(".py"))
    return repr([(os.path.relpath(p, root), os.stat(p).st_size, os.stat(p).st_mtime_ns)
                 for p in files])


def _path(key: str) -> str | None:
    folder = cache_folder("programs")
    return None if folder is None else os.path.join(folder, key + ".pkl")


def load(key: str):
    """The runner kept under ``key``, or None."""
    path = _path(key)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            header, payload = f.readline(), f.read()
    except OSError:  # no entry
        return None
    if header != _header(payload):
        _log.debug("program cache: %s is damaged; compiling again", path)
        return None
    try:
        return pickle.loads(payload)
    except Exception as e:  # whatever the entry needs is gone (a library, a function)
        _log.debug("program cache: %s does not load (%s); compiling again", path, e)
        return None


def store(key: str, runner) -> None:
    """Keep ``runner`` under ``key`` if it pickles (NOTE [program cache])."""
    if runner is None or (path := _path(key)) is None:
        return
    buffer = io.BytesIO()
    try:
        _Pickler(buffer).dump(runner)
    except Exception as e:  # a step holding a closure, a collective, a ctypes handle
        _log.debug("program cache: not kept (%s)", e)
        return
    payload = buffer.getvalue()
    try:
        write_atomically(path, _header(payload) + payload)
    except OSError as e:  # a full disk, say: the program runs, it is just not kept
        _log.warning("program cache: could not keep %s (%s)", path, e)


def _header(payload: bytes) -> bytes:
    return b"plait program " + hashlib.sha256(payload).hexdigest().encode() + b"\n"


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):  # not picklable itself: by name
            return _op_by_name, (obj.namespace, obj._opname, obj._overloadname)
        return NotImplemented


def _op_by_name(namespace: str, name: str, overload: str):
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)
