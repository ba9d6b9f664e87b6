"""Compiled programs kept on disk, so that a new process compiles nothing it compiled before.

NOTE [program cache]
A compiled program's runtime (``codegen.Runner``: the wrapper's steps holding the loaded
kernels, the constants, the device) is pickled to ``<cache_dir>/programs/<key>.pkl``. A process
calling a function that an earlier one compiled traces it (the traced graph is the key) and
loads the runner: no simplify, lowering, fusion, memory passes or code generation, and none
of the lazy imports they cost. The key digests the graph as traced (donations marked), the
backend and its config, the settings the compilation read (NOTE [pipeline]), the torch version and plait's own source files
(sizes and modification times: an edited plait never runs what an older one compiled).

An entry is a header line, its full key, the sha256 of its pickle, then the pickle. Anything
else under a key's name is a miss, compiled again and replaced, never an error: an entry of
another key (copied or renamed over this one, which would run another program), a damaged
or truncated one, a pickle that does not load, or one whose library is gone or does not
load. Writes are atomic, so processes compiling one function at once both succeed. A hit
marks the entry used (its modification time), and past ``config.program_cache_bytes`` the
least recently used entries go. Only the programs of backends registered with
``keeps_programs`` are looked up, and of those only runners that pickle are kept: the cpp
backend's, whose kernel steps pickle as their library's path and symbol, with ATen ops by
name. A program calling a collective is compiled in each process, as are the triton
backend's (not registered: its launch configurations are resolved per device);
``config.program_cache`` turns the cache off.

NOTE [unpickling the cache]
Unpickling runs code the pickle names, so an entry is only read where no one else could
have written it: the folder passes NOTE [trusted cache folder] (owned by the user, not
writable by group or others, nor replaceable through a folder above it), and the entry
itself, opened without following a link, is a regular file owned by the user and writable
by no one else. Another user's entry is not unpickled, whatever its header says. An HMAC of
each entry under a secret key would add nothing against other users: the key would have to
live where the entries do, under the same permissions, and whoever can write there as the
user can run code as the user anyway (and the libraries the entries name are loaded, which
no signature of the pickle covers). What it would catch is a cache folder copied in from
elsewhere; a user who copies one (a CI cache restored from another branch) trusts it, as
Triton's and Inductor's caches are trusted. A restricted unpickler would not help either:
the classes an entry needs (kernel steps, libraries by path) load native code by design.
"""
from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
import pickle
import stat

import torch

from ..config import config
from .codegen import cache_folder, evict_least_used, write_atomically

_log = logging.getLogger("plait.cache")
_MAGIC = b"plait program 2\n"


def key(graph, backend, config_key: tuple) -> str:
    """The entry of ``graph`` compiled by ``backend`` under settings ``config_key``
    (``compiler.settings_key`` when the compilation began)."""
    parts = (graph.digest, repr(backend.cache_key()), repr(config_key), torch.__version__,
             _plait_source())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


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
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:  # no entry (or a link: not followed)
        return None
    with os.fdopen(fd, "rb") as f:
        if not _private(os.fstat(fd)):
            _log.warning("program cache: %s is not the user's own private file; not read", path)
            return None
        magic, kept_key, digest, payload = f.readline(), f.readline(), f.readline(), f.read()
    if magic != _MAGIC or kept_key != key.encode() + b"\n" or \
            digest != hashlib.sha256(payload).hexdigest().encode() + b"\n":
        _log.debug("program cache: %s is damaged or another key's; compiling again", path)
        return None
    try:
        runner = pickle.loads(payload)
    except Exception as e:  # whatever the entry needs is gone (a library, a function)
        _log.debug("program cache: %s does not load (%s); compiling again", path, e)
        return None
    try:
        os.utime(path)  # used now (NOTE [program cache]: the least recently used go first)
    except OSError:
        pass
    return runner


def _private(st: os.stat_result) -> bool:
    """A regular file of the user's that no one else may write (NOTE [unpickling the cache])."""
    return stat.S_ISREG(st.st_mode) and not st.st_mode & 0o022 and (
        not hasattr(os, "geteuid") or st.st_uid == os.geteuid())


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
    entry = b"".join([_MAGIC, key.encode(), b"\n",
                      hashlib.sha256(payload).hexdigest().encode(), b"\n", payload])
    try:
        write_atomically(path, entry)
    except OSError as e:  # a full disk, say: the program runs, it is just not kept
        _log.warning("program cache: could not keep %s (%s)", path, e)
        return
    evict_least_used(os.path.dirname(path), config.program_cache_bytes, keep=key)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):  # not picklable itself: by name
            return _op_by_name, (obj.namespace, obj._opname, obj._overloadname)
        return NotImplemented


def _op_by_name(namespace: str, name: str, overload: str):
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)
