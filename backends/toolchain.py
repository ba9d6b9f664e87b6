"""The C++ toolchain: the C type of each dtype, and building and loading shared libraries.

NOTE [C++ build cache]
The library's file name is a hash of the source, the compiler command and the compiler
binary's identity (path, size, mtime), under ``<config.cache_dir>/cpp``. A hit is loaded
without running anything; one that fails to load or lacks a kernel symbol is rebuilt. A
library is loaded only if its length and sha256 are those written beside it when it was
built (``<name>.so.sha256``): a truncated library can pass the loader's checks and fault
(SIGBUS) when a page past its end is touched, killing the process. Builds happen in a private temporary folder and are moved in with ``os.replace``,
so concurrent builds of one program both succeed and readers never see a partial file. An
unwritable cache folder warns once and builds in a temporary folder instead. ``-march=native``
code is keyed by the flags, not the CPU: a cache folder shared by different machines needs
flags without it. A hit marks the library used (its modification time), and past
``config.cpp_cache_bytes`` the least recently used go (a loaded library stays mapped). The
program calling the library is kept too, by its traced graph (NOTE [program cache]): a new
process loads both and compiles nothing.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence

import torch

from ..config import config
from ..errors import BackendError
from .codegen import cache_folder, evict_least_used

CTYPES = {torch.float32: "float", torch.float64: "double", torch.int64: "int64_t",
           torch.int32: "int32_t", torch.int16: "int16_t", torch.int8: "int8_t",
           torch.uint8: "uint8_t", torch.bool: "bool"}
CPP_DTYPES = frozenset(CTYPES)


def ctype(dtype: torch.dtype) -> str:
    try:
        return CTYPES[dtype]
    except KeyError:
        raise BackendError(f"the cpp backend has no C type for {dtype}; lowering should have "
                           f"made this an extern. Use backend='eager' for this "
                           f"function.") from None



def _compiler() -> str:
    path = shutil.which(config.cpp_compiler)
    if path is None:
        raise BackendError(
            f"the cpp backend needs a C++ compiler and {config.cpp_compiler!r} was not found "
            "on PATH. Install one (e.g. `apt-get install g++`), point "
            "plait.config.cpp_compiler (PLAIT_CPP_COMPILER) at one, or use backend='eager'.")
    return path


class Library:
    """A built shared library loaded through ctypes. It pickles as its path and symbols and
    loads again where unpickled (NOTE [program cache]); loading raises ``BackendError`` where
    the file is gone or lacks a symbol (corrupt, truncated)."""

    def __init__(self, path: str, symbols: Sequence[str]):
        self.path, self.symbols = path, tuple(symbols)
        try:
            with open(path + ".sha256") as f:
                if f.read() != _fingerprint(path):
                    raise OSError("its length or digest is not the one written when it was "
                                  "built (damaged or truncated)")
            self.cdll = ctypes.CDLL(path)
            for s in self.symbols:
                getattr(self.cdll, s)
        except (OSError, AttributeError) as e:
            raise BackendError(f"the library {path} does not load: {e}") from None

    def __reduce__(self):
        return Library, (self.path, self.symbols)


def _fingerprint(path: str) -> str:
    """A library file's length and sha256 (NOTE [C++ build cache])."""
    with open(path, "rb") as f:
        data = f.read()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}"


def _load(path: str, symbols: Sequence[str]) -> Library | None:
    try:
        return Library(path, symbols)
    except BackendError:
        return None


# NOTE [sanitized builds]
# ``config.cpp_sanitize`` (PLAIT_CPP_SANITIZE) builds every library (the kernels, the C++
# wrapper, its memory and runtime) with SANITIZE_FLAGS: an access out of a buffer, a use after
# free or undefined behaviour in generated code is reported where it happens, with its stack,
# and stops the process. The flags are part of the compiler command, so of a library's file
# name, and the setting is one the cpp backend ``reads``, so in the caches' keys: sanitized
# and plain builds never mix. Python is not built with ASan, whose runtime must be the first
# library loaded: run the interpreter with ``LD_PRELOAD=$(g++ -print-file-name=libasan.so)``
# and ``ASAN_OPTIONS=detect_leaks=0`` (the interpreter frees little at exit), and
# ``UBSAN_OPTIONS=halt_on_error=1`` to stop at the first undefined behaviour too. Loading a
# sanitized library without the preload would end the process (ASan's own check), so a build
# refuses there (BackendError). tests/test_native_safety.py runs its programs so.
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-omit-frame-pointer")


@functools.cache
def _asan_loaded() -> bool:
    return hasattr(ctypes.CDLL(None), "__asan_init")


def build(source: str, symbols: Sequence[str], flags: Sequence[str] = (),
          only_cached: bool = False) -> Library | None:
    """The shared library of ``source`` (which defines ``symbols``), from the disk cache or
    built with the configured compiler and ``flags`` after the configured ones (NOTE [C++
    build cache]); None where ``only_cached`` and the cache lacks it."""
    compiler = _compiler()
    if config.cpp_sanitize and not _asan_loaded():  # NOTE [sanitized builds]
        raise BackendError(
            "config.cpp_sanitize (PLAIT_CPP_SANITIZE) builds libraries with AddressSanitizer, "
            "whose runtime this Python process did not load first. Run it with LD_PRELOAD="
            "$(g++ -print-file-name=libasan.so) and ASAN_OPTIONS=detect_leaks=0, or turn "
            "the setting off.")
    # NOTE [one rounding per op] (codegen.py); before the configured flags, which may say otherwise
    command = [compiler, "-ffp-contract=off", *shlex.split(config.cpp_flags), *flags,
               *(SANITIZE_FLAGS if config.cpp_sanitize else ()), "-shared", "-fPIC"]
    st = os.stat(compiler)
    key = hashlib.sha256("\0".join([source, *command, str(st.st_size),
                                    str(st.st_mtime_ns)]).encode()).hexdigest()[:40]
    cache = cache_folder("cpp")
    if cache is not None:
        target = os.path.join(cache, key + ".so")
        if os.path.exists(target) and (lib := _load(target, symbols)) is not None:
            try:
                os.utime(target)  # used now: the last to be evicted
            except OSError:
                pass
            return lib
    if only_cached:
        return None
    work = tempfile.mkdtemp(prefix="plait-", dir=cache)
    try:
        src, out = os.path.join(work, key + ".cpp"), os.path.join(work, key + ".so")
        with open(src, "w") as f:
            f.write(source)
        # the source before the flags: libraries named in them (-lmvec) resolve its symbols
        proc = subprocess.run([command[0], src, *command[1:], "-o", out], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise BackendError(f"the C++ compiler failed ({shlex.join(command)}):\n"
                               f"{proc.stderr[-4000:]}")
        with open(out + ".sha256", "w") as f:
            f.write(_fingerprint(out))
        if cache is None:
            target = out  # loaded before the folder goes: the mapping outlives the file
        else:
            os.replace(src, os.path.join(cache, key + ".cpp"))  # kept for reading
            os.replace(out, target)
            os.replace(out + ".sha256", target + ".sha256")  # after it: a reader between
            evict_least_used(cache, config.cpp_cache_bytes, keep=key)  # the two sees none
        return Library(target, symbols)
    finally:
        shutil.rmtree(work, ignore_errors=True)
