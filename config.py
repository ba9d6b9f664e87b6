"""Every knob of plait in one place.

Each field can be set from the environment as ``PLAIT_<NAME>`` (read once, at import) and
changed for a block of code with ``plait.config.patch(name=value)``, which also works as a
decorator. Knobs that change generated code join the compilation cache key (NOTE [pipeline]:
those the compiler's stages, tracing and a backend name).
"""
from __future__ import annotations

import contextlib
import logging
import os

import attrs
import torch


def _env(name: str, default, convert):
    raw = os.environ.get("PLAIT_" + name.upper())
    return default if raw is None else convert(raw)


def _to_bool(raw: str) -> bool:
    return raw.strip().lower() not in ("", "0", "false", "no", "off")


DEVICE_CHOICES = {"all": ("cuda", "cpu"), "cuda": ("cuda",), "none": ()}


def device_kinds(setting: str, value: str) -> tuple[str, ...]:
    """The device types a setting that names devices (``channels_last``, ``pad_products``,
    ``attention_layout``) picks with ``value``."""
    if value not in DEVICE_CHOICES:
        from .errors import PlaitError
        raise PlaitError(f"config.{setting}={value!r}: expected one of "
                         f"{', '.join(DEVICE_CHOICES)}")
    return DEVICE_CHOICES[value]


LOG_CHANNELS = ("graph", "fusion", "cache", "kernels", "compile")
_log_handler = logging.StreamHandler()
_log_handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
# Like logging.lastResort, but at every level: print only where the application configured
# no handler of its own, so a record never shows twice.
_log_handler.addFilter(lambda record: not logging.root.handlers)


def _set_log(config, attribute, value: str) -> str:
    """Apply the ``log`` knob: the named channels log at debug level, to the application's
    handlers, or to stderr where it has none."""
    channels = {c.strip() for c in value.split(",")} - {""}
    if channels - set(LOG_CHANNELS):
        from .errors import PlaitError

        raise PlaitError(f"unknown log channel(s) {sorted(channels - set(LOG_CHANNELS))} in "
                         f"PLAIT_LOG / config.log; known: {', '.join(LOG_CHANNELS)}")
    for channel in LOG_CHANNELS:
        level = logging.DEBUG if channel in channels else logging.NOTSET
        logging.getLogger(f"plait.{channel}").setLevel(level)
    root = logging.getLogger("plait")
    if channels:
        root.addHandler(_log_handler)  # a no-op when already there
    else:
        root.removeHandler(_log_handler)
    return value


@attrs.define
class Config:
    # Which backend jit uses when none is given: "auto" picks by the arguments' device (cpp on
    # the CPU, triton on CUDA; backends.resolve_backend).
    backend: str = attrs.field(factory=lambda: _env("backend", "auto", str))
    # Run the simplify passes (DCE, CSE, constant folding) before a backend sees a graph.
    simplify: bool = attrs.field(factory=lambda: _env("simplify", True, _to_bool))
    # Softmax attention written out (softmax(q @ k.T * scale) @ v) runs as one fused attention
    # kernel that never stores the scores (NOTE [attention fusion], passes/attention.py).
    fuse_attention: bool = attrs.field(factory=lambda: _env("fuse_attention", True, _to_bool))
    # Which devices' convolutions run on channels-last values: all, cuda or none (NOTE
    # [channels-last convolutions], passes/layout.py).
    channels_last: str = attrs.field(factory=lambda: _env("channels_last", "all", str))
    # On which devices (all, cuda or none) large 16-bit products have their dims that are not
    # a multiple of 8 padded with zeros, as the library's fast kernels need (NOTE [padded
    # products], passes/padding.py).
    pad_products: str = attrs.field(factory=lambda: _env("pad_products", "cuda", str))
    # On which devices (all, cuda or none) fused attention reads and writes its 4-D operands
    # stored [batch, rows, heads, head dim], as CUDA's kernels do (NOTE [attention in the
    # kernels' layout], passes/attention.py).
    attention_layout: str = attrs.field(factory=lambda: _env("attention_layout", "cuda", str))
    # On which devices (all, cuda or none) a matrix product's bias that only library calls
    # read is added by the product's library call (NOTE [bias epilogues], passes/epilogues.py).
    bias_epilogues: str = attrs.field(factory=lambda: _env("bias_epilogues", "cuda", str))
    # Constant folding evaluates nodes whose result has at most this many elements.
    fold_max_numel: int = attrs.field(factory=lambda: _env("fold_max_numel", 4096, int))
    # ATen ops with no decomposition run as opaque nodes that call torch; False raises instead.
    allow_opaque: bool = attrs.field(factory=lambda: _env("allow_opaque", True, _to_bool))
    # Record the user's source line of every traced op (costs a stack walk per op).
    provenance: bool = attrs.field(factory=lambda: _env("provenance", True, _to_bool))
    # Compiled signatures kept per jitted function before the oldest is evicted.
    cache_size: int = attrs.field(factory=lambda: _env("cache_size", 64, int))
    # A jitted function traced more times than this warns (logger plait.cache) naming the
    # argument whose value keeps changing.
    retrace_warning: int = attrs.field(factory=lambda: _env("retrace_warning", 8, int))
    # Each compilation writes a report folder here (graphs after every pass, index.html).
    # Not in the cache key: it changes no result, so a cache hit writes nothing.
    debug_dir: str | None = attrs.field(factory=lambda: _env("debug_dir", None, str))
    # Comma-separated LOG_CHANNELS that log at debug level (loggers plait.<channel>).
    log: str = attrs.field(factory=lambda: _env("log", "", str), on_setattr=_set_log)
    # Where compiled code is kept across processes (PLAIT_CACHE_DIR).
    cache_dir: str = attrs.field(factory=lambda: _env("cache_dir", os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "plait"), str))
    # A compilation running longer than this many seconds says once on stderr where it is
    # (NOTE [pipeline], compiler/pipeline.py).
    progress_after: float = attrs.field(factory=lambda: _env("progress_after", 5.0, float))
    # Compiled programs are kept there too, so a new process calling a function that another
    # compiled traces it and compiles nothing (NOTE [program cache], backends/program_cache.py).
    program_cache: bool = attrs.field(factory=lambda: _env("program_cache", True, _to_bool))
    # The programs kept there take at most this many bytes: past it, the least recently used
    # go (NOTE [program cache]).
    program_cache_bytes: int = attrs.field(factory=lambda: _env("program_cache_bytes", 1 << 30,
                                                                int))
    # The C++ libraries kept there (<cache_dir>/cpp) take at most this many bytes: past it,
    # the least recently used go (NOTE [C++ build cache], backends/cpp.py).
    cpp_cache_bytes: int = attrs.field(factory=lambda: _env("cpp_cache_bytes", 2 << 30, int))
    # The C++ compiler of the cpp backend, and its flags (-shared -fPIC are always added).
    # -fwrapv: signed integer overflow wraps, as in torch; -fno-math-errno and -lmvec (glibc's
    # vector math) let loops calling exp, sin, ... vectorize.
    cpp_compiler: str = attrs.field(factory=lambda: _env("cpp_compiler", "g++", str))
    cpp_flags: str = attrs.field(factory=lambda: _env(
        "cpp_flags", "-O3 -march=native -fopenmp -fwrapv -fno-math-errno -std=c++17 -lmvec", str))
    # The cpp backend runs a program through a wrapper generated as C++, one native call per
    # program (NOTE [C++ wrapper], backends/cpp_wrapper.py); False steps through it in Python.
    cpp_wrapper: bool = attrs.field(factory=lambda: _env("cpp_wrapper", True, _to_bool))
    # The cpp backend's libraries are built with AddressSanitizer and UndefinedBehaviorSanitizer
    # (``SANITIZE_FLAGS`` in backends/cpp.py): a bad access in generated code is reported
    # where it happens. Python must run with the ASan runtime preloaded (NOTE [sanitized
    # builds]); for testing plait, not for speed.
    cpp_sanitize: bool = attrs.field(factory=lambda: _env("cpp_sanitize", False, _to_bool))

    # The triton backend times a few launch configurations of each kernel at its first launch
    # and keeps the fastest, on disk beside the kernels (NOTE [autotuning], backends/triton.py).
    # Not in the cache key: it changes no generated code, only how kernels are launched.
    triton_autotune: bool = attrs.field(factory=lambda: _env("triton_autotune", False,
                                                             _to_bool))
    # NOTE [deterministic programs]: a compiled program computes bitwise the same results in
    # every run and process, where the kernels torch runs for it do too. Generated code does
    # (no atomics; every kernel's reduction order is fixed by its code and launch
    # configuration, chosen by rule from the shapes), so what varies from run to run is a
    # choice made by timing: autotuning keeps its timing of kernels whose launch
    # configuration changes no result (elementwise ones) and launches every reduction with
    # the rule's configuration. torch's kernels (a scatter-add, an attention's backward)
    # follow ``torch.use_deterministic_algorithms(True)``, which turns this on as well: set
    # that for bitwise-reproducible training (benchmarks/determinism.py checks the suite).
    # Read at each call, like ``triton_autotune``.
    deterministic: bool = attrs.field(factory=lambda: _env("deterministic", False, _to_bool))
    # A compiled program on a CUDA device replays its launches as one CUDA graph from its third
    # call (NOTE [CUDA graphs], backends/cuda_graphs.py). Read at each call.
    cuda_graphs: bool = attrs.field(factory=lambda: _env("cuda_graphs", True, _to_bool))
    # Worker processes that compile Triton kernels for a GPU in parallel (NOTE [compile
    # workers], backends/compile_workers.py); 0 compiles in threads of this process only.
    compile_workers: int = attrs.field(factory=lambda: _env(
        "compile_workers", min(16, os.cpu_count() or 1), int))

    # On a GPU, a long reduction to few outputs runs as partial and final kernels (NOTE [split
    # reductions], passes/split.py).
    split_reductions: bool = attrs.field(factory=lambda: _env("split_reductions", True,
                                                              _to_bool))
    # The memory passes of the compiling backends (passes/memory.py): kernels write into a
    # buffer they read where that is safe; kernels run in the order of least estimated peak;
    # intermediates share the slots of a per-call pool.
    inplace: bool = attrs.field(factory=lambda: _env("inplace", True, _to_bool))
    reorder: bool = attrs.field(factory=lambda: _env("reorder", True, _to_bool))
    plan_memory: bool = attrs.field(factory=lambda: _env("plan_memory", True, _to_bool))
    # Collectives in compiled programs (NOTE [overlap], passes/memory.py): each starts as early
    # and is waited for as late as its data allows, so compute runs while it communicates.
    overlap: bool = attrs.field(factory=lambda: _env("overlap", True, _to_bool))
    # A sum all_reduce of at most this many bytes, over a group with symmetric memory enabled
    # (plait.distributed.enable_symmetric_memory), on CUDA, is computed into a communication
    # buffer and runs as a one-shot all-reduce (NOTE [comm buffers]); 0 turns that off.
    symm_mem_max_bytes: int = attrs.field(factory=lambda: _env("symm_mem_max_bytes", 128 * 1024,
                                                               int))
    # Intermediates may use the free ranges of the communication buffers' pools, where they fit
    # (NOTE [memory passes]: plan).
    comm_pool_reuse: bool = attrs.field(factory=lambda: _env("comm_pool_reuse", False, _to_bool))
    # Test-only: compiled programs check their real allocations and frees against the memory
    # plan on every call (BackendError where they differ). Not in the cache key: checked per call.
    check_memory_plan: bool = attrs.field(factory=lambda: _env("check_memory_plan", False,
                                                               _to_bool))

    def __attrs_post_init__(self):
        _set_log(self, None, self.log)

    @contextlib.contextmanager
    def _patched(self, changes: dict):
        unknown = set(changes) - {f.name for f in attrs.fields(Config)}
        if unknown:
            from .errors import PlaitError

            raise PlaitError(f"unknown config option(s) {sorted(unknown)}; "
                             f"known: {[f.name for f in attrs.fields(Config)]}")
        saved = {name: getattr(self, name) for name in changes}
        for name, value in changes.items():
            setattr(self, name, value)
        try:
            yield self
        finally:
            for name, value in saved.items():
                setattr(self, name, value)

    def patch(self, **changes):
        """Context manager (and decorator) that sets knobs and restores them on exit."""
        return _Patch(self, changes)


class _Patch(contextlib.ContextDecorator):
    def __init__(self, config: Config, changes: dict):
        self._config, self._changes, self._stack = config, changes, []

    def __enter__(self):
        cm = self._config._patched(self._changes)
        self._stack.append(cm)
        return cm.__enter__()

    def __exit__(self, *exc):
        return self._stack.pop().__exit__(*exc)


config = Config()


def deterministic() -> bool:
    """Are programs to compute bitwise-reproducible results (NOTE [deterministic programs])?"""
    return config.deterministic or torch.are_deterministic_algorithms_enabled()
