"""What the code generators (backends/cpp.py, backends/triton.py) share: printing sympy
index expressions, naming, ordering a kernel's reductions into passes, running externs, the
kernel records compiled programs expose, and the wrapper that runs a program's steps."""
from __future__ import annotations

import gc
import hashlib
import os
import re
import tempfile
import warnings
import weakref
from collections.abc import Callable, Sequence

import attrs
import sympy
import torch

from ..config import config
from ..errors import BackendError, CheckError
from ..graph.loops import Extern, Kernel, LoopProgram, Wait, walk
from ..graph.types import (concrete, evaluated, is_symbolic, numeric, size_bindings,
                          size_values, unbound_symbols)
from ..tracer.collectives import COMM_BUFFER_TYPES


# NOTE [one rounding per op]
# Eager PyTorch rounds every op's result to its dtype; a fused kernel must round where eager
# does, so the code generators forbid the compiler to contract a multiply and a later add
# into one fused multiply-add (cpp: ``-ffp-contract=off``; triton: ``enable_fp_fusion=False``
# at launch). Both compilers contract by default, across what were separate ops: a float32
# ``x * y + z`` then differed from eager in 23% of elements on the CPU, and on an H200, where
# LLVM also narrows bf16 ``(x * w) + b`` to bf16 arithmetic before contracting it,
# ``gelu(x * w + b)`` differed in 20% of its bf16 results. Explicit fmas (libdevice's)
# are unaffected.


class IndexPrinter:
    """Prints an integer sympy index expression (or a condition on indices) in a target
    language over int64 loop variables. Subclasses name the target's syntax; ``floordiv``
    and ``mod`` are the operators that agree with sympy's floor and Mod on non-negative
    operands, the ``*_fn`` helpers handle the general case."""

    language = ""
    floordiv, floordiv_fn, mod_fn = "/", "", ""
    min_fn, max_fn = "", ""
    and_op, or_op, true, false = "&&", "||", "true", "false"

    def __init__(self, names: dict | None = None):
        self.names = names or {}  # loop variable -> another spelling

    def integer(self, n: int) -> str:
        return str(n)

    def __call__(self, e) -> str:
        e = sympy.sympify(e)
        if e.is_Integer:
            return self.integer(int(e))
        if e.is_Float:
            return repr(float(e))
        if e.is_Symbol:
            return self.names.get(e.name, e.name)
        if e is sympy.true or e is sympy.false:
            return self.true if e is sympy.true else self.false
        if isinstance(e, (sympy.Add, sympy.Mul)):
            op = " + " if isinstance(e, sympy.Add) else " * "
            return "(" + op.join(map(self, e.args)) + ")"
        if isinstance(e, sympy.Pow) and e.exp.is_Integer and e.exp > 0:
            return "(" + " * ".join([self(e.base)] * int(e.exp)) + ")"
        if isinstance(e, (sympy.floor, sympy.ceiling)):
            num, den = e.args[0].as_numer_denom()
            if not (den.is_integer and den.is_positive):  # a number or a size
                raise BackendError(f"cannot print index {e}: the divisor is not an integer")
            if isinstance(e, sympy.ceiling):  # ceil(n / d) = -floor(-n / d)
                num = -num
            q = self._binary(num, den, self.floordiv, self.floordiv_fn)
            return f"(-{q})" if isinstance(e, sympy.ceiling) else q
        if isinstance(e, sympy.Mod):
            return self._binary(*e.args, "%", self.mod_fn)
        if isinstance(e, (sympy.Min, sympy.Max)):
            fn = self.min_fn if isinstance(e, sympy.Min) else self.max_fn
            out = self(e.args[0])
            for a in e.args[1:]:
                out = f"{fn}({out}, {self(a)})"
            return out
        if isinstance(e, (sympy.And, sympy.Or)):  # conditions on indices (padding, concat)
            op = f" {self.and_op} " if isinstance(e, sympy.And) else f" {self.or_op} "
            return "(" + op.join(map(self, e.args)) + ")"
        if isinstance(e, sympy.core.relational.Relational):
            num, den = (e.lhs - e.rhs).as_numer_denom()
            if den != 1 and den.is_integer and den.is_positive:  # rational coefficients
                # (r0/16 + x0/1536 < 2; x0/s0 of a symbolic size)
                return f"({self(num)} {e.rel_op} 0)"  # scaled by the positive denominator
            return f"({self(e.lhs)} {e.rel_op} {self(e.rhs)})"
        raise BackendError(f"cannot print index expression {e} ({type(e).__name__}) as "
                           f"{self.language}")

    def _binary(self, a, b, op: str, fn: str) -> str:
        if a.is_nonnegative and b.is_positive:  # the target's operator agrees here
            return f"({self(a)} {op} {self(b)})"
        return f"{fn}({self(a)}, {self(b)})"


KERNEL_NAME = "KERNEL_NAME"  # where a generated kernel's text names the kernel
SIZES = "<sizes>"  # the wrapper's slot holding a call's size symbols' values (by symbol name)
LOOP_VARIABLE = re.compile(r"[xri]\d+")


def kernel_symbols(k: Kernel) -> tuple[sympy.Symbol, ...]:
    """The size symbols a kernel's loops and indices use (NOTE [symbolic sizes]), by name:
    parameters of the generated kernel, after its buffers."""
    exprs = [*k.sizes, *k.reduction_sizes]
    for s in k.stores:
        exprs.append(s.index)
        for e in walk(s.value):
            exprs += [getattr(e, "index", 0), getattr(e, "expr", 0),
                      *(n for _, n in getattr(e, "indirect", ()))]
    symbols = {s for e in exprs if isinstance(e, sympy.Basic) for s in e.free_symbols}
    return tuple(sorted((s for s in symbols if not LOOP_VARIABLE.fullmatch(s.name)),
                        key=str))


def kernel_name(text: str) -> str:
    """A kernel's name, from its text with ``KERNEL_NAME`` where the name goes
    (NOTE [canonical kernels])."""
    return "kernel_" + hashlib.sha256(text.encode()).hexdigest()[:12]


# Binary ops that both target languages write as the same infix operator.
INFIX = {"add": "+", "sub": "-", "mul": "*", "bitwise_and": "&", "bitwise_or": "|",
         "bitwise_xor": "^", "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
# Ops that raise in eager on an integer division by zero (generated kernels set a flag).
INT_DIVISIONS = ("div", "fmod", "remainder")

# NOTE [kernel errors]
# Where eager raises on a value, a generated kernel records the failed check as a code in an
# error flag (cpp: the library's ``plait_error``; triton: a one-element buffer per device)
# and carries on with a safe value: an integer division by zero (DIVISION_BY_ZERO) gives 0,
# an indirect load's position outside [0, size) (INDEX_OUT_OF_RANGE: a gather's index, NOTE
# [loop IR]) reads element 0 of its range. The generated preludes name the codes as
# ``ERROR_<NAME>`` (``with_error_codes``). The launch step of each such kernel reads the flag
# after it and raises ``kernel_error(code)``; where several checks failed, one of them is
# reported. On CUDA the flag is not read: eager does not raise on a division there (a gather
# out of range is a device-side assert), and reading it would wait for the GPU after every
# launch. A gather whose result is only partly used (sliced) is checked only where it is used.
DIVISION_BY_ZERO, INDEX_OUT_OF_RANGE = 1, 2


def with_error_codes(prelude: str) -> str:
    """A generated prelude with its ``ERROR_<NAME>`` placeholders replaced by the codes."""
    return prelude.replace("ERROR_DIVISION_BY_ZERO", str(DIVISION_BY_ZERO)).replace(
        "ERROR_INDEX_OUT_OF_RANGE", str(INDEX_OUT_OF_RANGE))


def kernel_error(code: int) -> CheckError:
    return CheckError({
        DIVISION_BY_ZERO: "ZeroDivisionError: integer division or remainder by zero",
        INDEX_OUT_OF_RANGE: "IndexError: an index is out of range for gather (torch.gather, "
                            "take_along_dim, index_select, x[index])",
    }[code])


# NOTE [trusted cache folder]
# What the cache folders hold is run: libraries are loaded, program entries unpickled (NOTE
# [program cache]). So a folder is used only where no one but the current user (or root) can
# have put anything there: the folder and its cache root must be owned by the user and not
# writable by group or others, and each folder above them owned by the user or root and
# not writable by others unless sticky (/tmp), or another user could swap the folder out.
# Folders plait creates are private (0o700), its files too (mkstemp's 0o600). A folder that
# fails is not read: one warning, and compiled code stays in memory or a temporary folder.
# Build folders and half-written files (``TEMPORARY``*) that a killed process left are
# removed when a process first uses the folder, once older than ``_STALE`` seconds (no
# build takes that long, so none in progress goes).
TEMPORARY = "plait-"
_STALE = 3600
_verdicts: dict[str, str | None] = {}  # folder -> None where it is used, else why not


def cache_folder(kind: str) -> str | None:
    """``<config.cache_dir>/<kind>``, where generated code is kept across processes, or None
    (with one warning per folder) where it cannot be written or is not trusted (NOTE [trusted
    cache folder])."""
    root = os.path.expanduser(config.cache_dir)
    directory = os.path.join(root, kind)
    if directory not in _verdicts:  # checked once per process
        _verdicts[directory] = why = _untrusted(root, directory)
        if why is not None:
            warnings.warn(f"plait does not use its compilation cache: {why}; compiling into "
                          "memory or a temporary folder instead. Set plait.config.cache_dir "
                          "(PLAIT_CACHE_DIR) to a private, writable folder to reuse builds.")
            return None
        _remove_stale(directory)
    if _verdicts[directory] is not None:
        return None
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)  # removed meanwhile?
    except OSError:
        return None
    return directory


def _untrusted(root: str, directory: str) -> str | None:
    """Why ``directory`` (under ``root``; made where missing) is not to be used, or None."""
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if not os.access(directory, os.W_OK):
            return f"{directory} is not writable"
        if not hasattr(os, "geteuid"):  # no POSIX owners to check
            return None
        me = os.geteuid()
        for folder in (directory, root):
            st = os.stat(folder)
            if st.st_uid != me or st.st_mode & 0o022:
                return (f"{folder} is owned by another user" if st.st_uid != me else
                        f"{folder} is writable by group or others (chmod go-w it)")
        above = os.path.dirname(os.path.abspath(root))
        while True:
            st = os.stat(above)
            if st.st_uid not in (me, 0) or st.st_mode & 0o002 and not st.st_mode & 0o1000:
                return f"{above}, above it, is another user's or writable by anyone"
            if above == os.path.dirname(above):
                return None
            above = os.path.dirname(above)
    except OSError as e:
        return str(e)


def _remove_stale(directory: str) -> None:
    """Build folders and half-written files a killed process left in ``directory``."""
    import shutil
    import time

    old = time.time() - _STALE
    for entry in os.scandir(directory):
        try:
            if not entry.name.startswith(TEMPORARY) or \
                    entry.stat(follow_symlinks=False).st_mtime >= old:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        except OSError:  # removed meanwhile by another process
            pass


def evict_least_used(folder: str, limit: int, keep: str) -> None:
    """Remove the least recently used entries of a cache ``folder`` until those left take
    at most ``limit`` bytes; never ``keep``, the one just written. An entry is the files
    named by one key (``<key>.so``, ``<key>.so.sha256``, ``<key>.cpp``), used when its
    newest file was last modified (a hit marks it so)."""
    entries: dict[str, list] = {}
    for e in os.scandir(folder):
        try:
            if e.name.startswith(TEMPORARY) or not e.is_file(follow_symlinks=False):
                continue
            st = e.stat(follow_symlinks=False)
        except OSError:  # removed meanwhile
            continue
        entry = entries.setdefault(e.name.split(".")[0], [0, 0, []])
        entry[0], entry[1] = max(entry[0], st.st_mtime_ns), entry[1] + st.st_size
        entry[2].append(e.path)
    total = sum(size for _, size, _ in entries.values())
    for name, (_, size, paths) in sorted(entries.items(), key=lambda kv: kv[1][0]):
        if total <= limit:
            return
        if name != keep:
            for path in paths:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            total -= size


@attrs.frozen
class CompiledKernel:
    """One step of a compiled program, for inspection: a generated kernel (C++ or Triton), an
    extern call, or the wait of a collective."""

    name: str
    source: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]


def extern_results(k: Extern, args: list, types: Sequence,
                   sizes: dict | None = None) -> list[torch.Tensor]:
    """Run an extern on its argument tensors: its results, checked against their buffers'
    ``types``, contiguous, and never sharing memory with an argument (a later in-place write
    or a reused slot must not change them). ``sizes``: the size symbols' values, for a
    program with symbolic sizes (NOTE [symbolic sizes])."""
    if sizes is not None:
        k = extern_at(k, sizes)
    result = k.fn(*args, **dict(k.params))
    result = (result,) if isinstance(result, torch.Tensor) else tuple(result)
    if len(result) != len(k.outputs):
        raise BackendError(f"{k.name} ({k.label}) returned {len(result)} tensors, "
                           f"expected {len(k.outputs)}")
    for b, t, want in zip(k.outputs, result, types):
        shape = tuple(want.shape) if sizes is None else concrete(tuple(want.shape), sizes)
        if tuple(t.shape) != shape or t.dtype != want.dtype:
            raise BackendError(f"{k.name} ({k.label}) returned {t.dtype}{list(t.shape)} "
                               f"for {b}, which is {want.dtype}{list(want.shape)}")
    return [own(t.contiguous(), args) for t in result]


def extern_at(k: Extern, sizes: dict) -> Extern:
    """``k`` with its params (and its Impl's views of its operands) at ``sizes``, the size
    symbols' values (NOTE [symbolic sizes])."""
    fn = k.fn
    if is_symbolic(getattr(fn, "views", ())):
        fn = attrs.evolve(fn, views=concrete(fn.views, sizes))
    return attrs.evolve(k, fn=fn, params=tuple((n, concrete(v, sizes)) for n, v in k.params))


def own(t: torch.Tensor, inputs: list) -> torch.Tensor:
    """An extern's result as a buffer of its own: a copy where torch returned (a view of) an
    input, whose memory a later kernel may write in place or a pool slot may hand on."""
    ptr = t.untyped_storage().data_ptr()
    shared = t.numel() and any(x.untyped_storage().data_ptr() == ptr for x in inputs)
    return t.clone() if shared else t


def extern_text(k: Extern | Wait) -> str:
    outs = ", ".join(k.outputs)
    if isinstance(k, Wait):
        return f"{outs} = wait_{k.label}({outs})"
    params = "".join(f", {n}={v!r}" for n, v in k.params)
    return f"{outs}{',' if len(k.outputs) == 1 else ''} = {k.label}({', '.join(k.inputs)}{params})"


# ---------------------------------------------------------------------------------------
# The wrapper: the Python side of a compiled program
# ---------------------------------------------------------------------------------------
# NOTE [entry checks]
# Generated kernels trust their pointers: a pointer to no memory, or an input list one
# shorter or longer than the program's (which shifts every input and constant after it), is
# a segmentation fault or a silent wrong answer. Every call therefore checks, before any
# kernel runs, that it got the program's count of inputs and that each input with elements
# has memory (a tracer that escaped its trace into a module's attributes has the right
# shape, dtype and device and no storage: its address is 0). Shapes, dtypes and devices
# are the caller's to match (``Jitted`` keys its compilations by them): comparing them here
# would cost a microsecond an input on every call.
def entry_pointers(inputs: Sequence[torch.Tensor], count: int,
                   unread: frozenset = frozenset()) -> list[int]:
    """The addresses of a program's ``inputs``, which must be ``count`` tensors, each with
    memory where it has elements and the program reads it (NOTE [entry checks]: a module's
    parameters made meta by ``make_functional`` are inputs no kernel reads); else
    ``BackendError``."""
    if len(inputs) != count:
        raise BackendError(f"the compiled program takes {count} input tensors and was "
                           f"given {len(inputs)}; call it with the inputs of the graph it "
                           f"was compiled from, in order")
    try:
        pointers = list(map(torch.Tensor.data_ptr, inputs))
    except RuntimeError:  # a tensor subclass with no storage at all
        pointers = [_address(t) for t in inputs]
    if 0 in pointers:
        for j, (t, p) in enumerate(zip(inputs, pointers)):
            if not p and t.numel() and j not in unread:
                raise BackendError(
                    f"input {j} of the compiled program ({t.dtype}{list(t.shape)}, "
                    f"{type(t).__name__}) has no memory: a tensor without storage, such as a "
                    "plait tracer that escaped a finished trace (stored in a module or a "
                    "global while a function was traced) or a meta tensor. Pass tensors "
                    "with data.")
    return pointers


def _address(t: torch.Tensor) -> int:
    try:
        return t.data_ptr()
    except RuntimeError:
        return 0


@attrs.frozen
class _Empty:
    """``env[dest] = torch.empty(shape, dtype)``: a buffer's own storage, or a pool slot.
    A symbolic shape is evaluated at the call's sizes, ``env[sizes]``."""

    dest: int
    shape: tuple
    dtype: torch.dtype
    sizes: int | None = None

    def __call__(self, env, device):
        shape = self.shape if self.sizes is None else concrete(self.shape, env[self.sizes])
        return torch.empty(shape, dtype=self.dtype, device=device)

    def text(self, names) -> str:
        return f"{names[self.dest]} = torch.empty({self.shape}, dtype={self.dtype}, device=device)"


@attrs.frozen
class _CommPool:
    """``env[dest]`` = a comm pool: the comm buffer type's allocation, the same on every rank
    in every call (``alloc_id``: a digest of the program and the pool)."""

    dest: int
    type: str
    group: str
    nbytes: int
    alloc_id: int

    def __call__(self, env, device):
        return COMM_BUFFER_TYPES[self.type].allocate(self.nbytes, device, self.group,
                                                     self.alloc_id)

    def text(self, names) -> str:
        return f"{names[self.dest]} = {self.type}.allocate({self.nbytes}, device, " \
               f"group_name={self.group!r}, alloc_id={self.alloc_id:#x})"


@attrs.frozen
class _View:
    """``env[dest]`` as a view of ``env[src]``: ``nbytes`` at ``offset`` of a pool (a slot or
    a comm pool), or (``nbytes`` None) the buffer whose memory it takes over in place."""

    dest: int
    src: int
    shape: tuple
    dtype: torch.dtype
    offset: int = 0
    nbytes: int | None = None
    sizes: int | None = None  # as _Empty's

    def __call__(self, env, device):
        t = env[self.src]
        shape, offset, nbytes = (self.shape, self.offset, self.nbytes) if self.sizes is None \
            else (concrete(v, env[self.sizes]) for v in (self.shape, self.offset, self.nbytes))
        if nbytes is not None:
            t = t[offset:offset + nbytes].view(self.dtype)
        return t.view(shape)

    def text(self, names) -> str:
        if self.nbytes is None:
            return f"{names[self.dest]} = {names[self.src]}.view({self.shape})  # in place"
        return f"{names[self.dest]} = {names[self.src]}[{self.offset}:" \
               f"{self.offset + self.nbytes}].view({self.dtype}).view({self.shape})"


@attrs.frozen
class _Step:
    run: Callable[[list, torch.device], None]  # the step, on the environment
    bind: tuple                                # _Empty | _CommPool | _View, run before it
    free: tuple[int, ...]                      # slots dead after it (buffers and pools)
    adopts: tuple[int, ...] = ()               # slots an extern's results become


# (step index, Kernel, buffer -> environment slot) -> (run(env, device), its wrapper line)
Launcher = Callable[[int, Kernel, dict], tuple[Callable, str]]


class Wrapper:
    """``run(inputs, device, constants) -> outputs`` of a LoopProgram, and its listing.

    NOTE [wrapper memory]: the wrapper follows a ``MemoryPlan`` (passes/memory.py): inputs and
    constants are bound on entry, extern results when returned (copied where torch returned a
    view of an input: a later kernel may write that memory in place, or a pool slot hand it
    on), pool slots and comm pools before their first user, and every other buffer right
    before the first step using it: as a view of the buffer it takes over in place
    (``program.aliases``), as a view at its offset in a slot or a comm pool, or by an
    allocation of its own (a buffer no kernel writes has no elements). Each name is dropped
    after its last use, so a storage is freed once all its aliases and its pool are dead; a
    comm pool is released before the call returns (its memory persists with the comm type's
    allocator, for the next call). A started collective's results are completed by its Wait
    step (NOTE [overlap]). With ``config.check_memory_plan`` a call records each
    allocation's storage by weak reference and raises ``BackendError`` where the allocations
    alive around a step are not the plan's; ``measured_peak_bytes`` is then the largest sum
    of live storages (inputs and constants included) during one step.
    """

    def __init__(self, program: LoopProgram, plan, launch: Launcher):
        lv, kernels = plan.liveness, program.kernels
        self._step_names = tuple(k.name for k in kernels)
        names = list(program.buffers) + [f"pool{j}" for j in range(len(plan.slots))] + \
            [f"{p.type}_pool{j}" for j, p in enumerate(plan.comm_pools)]
        slot = {b: i for i, b in enumerate(program.buffers)}
        block = {("slot", j): len(slot) + j for j in range(len(plan.slots))} | {
            ("comm", j): len(slot) + len(plan.slots) + j for j in range(len(plan.comm_pools))}
        # NOTE [symbolic sizes]: a call's size symbols' values live in one more slot
        self.bindings = size_bindings(program.buffers[b].type for b in program.inputs)
        if unbound := unbound_symbols(self.bindings, (b.type for b in program.buffers.values())):
            raise BackendError(f"the program's sizes {sorted(map(str, unbound))} are no "
                               "input's dimension: a call cannot read them")
        symbolic = any(map(is_symbolic, (b.type for b in program.buffers.values())))
        sizes = len(names) if symbolic else None
        if symbolic:
            slot[SIZES] = sizes
            names.append("sizes")
        bound = {*program.inputs, *program.constants,
                 *(b for k in kernels if isinstance(k, Extern) for b in k.outputs)}
        keep = set(program.outputs)
        steps, texts = [], []
        for i, k in enumerate(kernels):
            if isinstance(k, Kernel):
                run, text = launch(i, k, slot)
            else:
                run, text = _extern_step(k, program, slot), extern_text(k)
            steps.append(run)
            texts.append(text)
        digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()
        pools = [_CommPool(block[("comm", j)], p.type, p.group, p.nbytes, int(hashlib.sha256(
            f"{digest} {p.type} {p.group} {p.nbytes} {sorted(p.offsets.items())}".encode())
            .hexdigest()[:16], 16)) for j, p in enumerate(plan.comm_pools)]
        self._steps, listing = [], []
        if any(isinstance(k, Extern) for k in kernels):
            listing.append("# an extern's result that shares memory with its inputs is copied")
        for i, k in enumerate(kernels):
            used = tuple(dict.fromkeys((*k.reads, *k.writes)))
            bind: list = [_Empty(block[("slot", j)], (s.nbytes,), torch.uint8, sizes)
                          for j, s in enumerate(plan.slots) if s.first == i]
            bind += [pool for pool, p in zip(pools, plan.comm_pools) if p.first == i]
            for b in used:
                if lv.uses[b][0] != i or b in bound:
                    continue
                t, s = program.buffers[b].type, lv.storage[b]
                shape = tuple(t.shape)
                if b in program.aliases:
                    bind.append(_View(slot[b], slot[program.aliases[b]], shape, t.dtype,
                                      sizes=sizes))
                elif s in plan.slot_of:
                    bind.append(_View(slot[b], block[("slot", plan.slot_of[s])], shape, t.dtype,
                                      0, t.nbytes, sizes))
                elif s in plan.comm_of:
                    j = plan.comm_of[s]
                    bind.append(_View(slot[b], block[("comm", j)], shape, t.dtype,
                                      plan.comm_pools[j].offsets[s], t.nbytes, sizes))
                else:
                    bind.append(_Empty(slot[b], shape, t.dtype, sizes))
            bind = [attrs.evolve(b, sizes=None) if getattr(b, "sizes", None) is not None and
                    not is_symbolic((b.shape, getattr(b, "offset", 0), getattr(b, "nbytes", 0)))
                    else b for b in bind]  # evaluated per call only where symbolic
            free = tuple(slot[b] for b in used if lv.uses[b][1] == i and b not in keep) + \
                tuple(block[("slot", j)] for j, s in enumerate(plan.slots) if s.last == i) + \
                tuple(block[("comm", j)] for j, p in enumerate(plan.comm_pools) if p.last == i)
            listing += [b.text(names) for b in bind]
            listing += ["# " + line for line in program.describe(k)]  # provenance of the call
            listing.append(texts[i])
            if free:
                listing.append("del " + ", ".join(names[s] for s in free))
            adopts = tuple(slot[b] for b in k.outputs) if isinstance(k, Extern) else ()
            self._steps.append(_Step(steps[i], tuple(bind), free, adopts))
        self._names, self.slot = names, slot
        self._blocks = {(block[n] if isinstance(n, tuple) else slot[n]): span
                        for n, span in plan.blocks().items()}
        self._size = len(names)
        self._sizes = sizes
        # a symbolic program's shapes, offsets and extern arguments, evaluated at each call
        # in one compiled function (NOTE [symbolic sizes])
        self._exprs = tuple(dict.fromkeys(v for v in _size_values(self._steps, program)
                                          if is_symbolic(v) and numeric(v))) if symbolic else ()
        self._evaluate = None
        self._inputs = tuple(slot[b] for b in program.inputs)
        self.n_inputs = len(self._inputs)
        self.unread = frozenset(j for j, b in enumerate(program.inputs)
                                if b not in lv.uses and b not in keep)
        self._unbound_outputs = tuple(  # outputs nothing produces: empty buffers
            (slot[b], tuple(program.buffers[b].type.shape), program.buffers[b].type.dtype)
            for b in dict.fromkeys(program.outputs) if b not in bound and b not in lv.uses)
        self._outputs = tuple(slot[b] for b in program.outputs)
        self.measured_peak_bytes = None
        listing += [f"{names[s]} = torch.empty({shape}, dtype={dtype}, device=device)"
                    for s, shape, dtype in self._unbound_outputs]
        listing.append(f"return ({', '.join(program.outputs)}{',' if program.outputs else ''})")
        self.source = "\n".join(
            ["def run(" + ", ".join(program.inputs) + "):"] + ["    " + s for s in listing])

    def __getstate__(self):
        return self.__dict__ | {"_evaluate": None}  # compiled again where it is loaded

    def __call__(self, inputs: Sequence[torch.Tensor], device: torch.device,
                 constants: Sequence[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        inputs = list(map(torch.Tensor.contiguous, inputs))
        entry_pointers(inputs, self.n_inputs, self.unread)
        env: list = [None] * self._size
        for s, t in zip(self._inputs, inputs):
            env[s] = t
        for s, t in constants:
            env[s] = t
        if self._sizes is not None:
            if self._evaluate is None:
                self._evaluate = evaluated(self._exprs)
            env[self._sizes] = self._evaluate(size_values(self.bindings, inputs))
        tracker = _Tracker(self, env) if config.check_memory_plan else None
        for i, step in enumerate(self._steps):
            for b in step.bind:
                env[b.dest] = b(env, device)
                if tracker and not isinstance(b, _View):
                    tracker.allocated(b.dest, env[b.dest])
            step.run(env, device)
            if tracker:
                for s in step.adopts:
                    tracker.allocated(s, env[s])
                tracker.verify(i, during=True)
            for s in step.free:
                env[s] = None
            if tracker:
                tracker.verify(i, during=False)
        for s, shape, dtype in self._unbound_outputs:
            if self._sizes is not None:
                shape = concrete(shape, env[self._sizes])
            env[s] = torch.empty(shape, dtype=dtype, device=device)
        if tracker:
            tracker.finish()
        return [env[s] for s in self._outputs]


def _size_values(steps, program: LoopProgram):
    """The values a symbolic program's steps evaluate at each call: shapes, offsets and byte
    counts of bindings, outputs' shapes, externs' arguments and operand views."""
    for step in steps:
        for b in step.bind:
            yield from (b.shape, getattr(b, "offset", 0), getattr(b, "nbytes", 0))
    for k in program.kernels:
        if isinstance(k, Extern):
            yield from (v for _, v in k.params)
            yield from (getattr(k.fn, "views", ()))
    yield from (b.type.shape for b in program.buffers.values())


@attrs.frozen
class _ExternCall:
    """A step running an extern: its results are adopted as its buffers."""

    extern: Extern
    args: tuple[int, ...]
    outs: tuple[int, ...]
    types: tuple  # of the results
    sizes: int | None = None  # as _Empty's

    def __call__(self, env, device):
        for s, t in zip(self.outs, extern_results(
                self.extern, [env[s] for s in self.args], self.types,
                None if self.sizes is None else env[self.sizes])):
            env[s] = t


@attrs.frozen
class _WaitCall:
    """A step completing a started collective (NOTE [overlap])."""

    wait: Wait
    outs: tuple[int, ...]
    params: dict  # the wait's, as keywords

    def __call__(self, env, device):
        for s in self.outs:
            env[s] = self.wait.fn(env[s], **self.params)


def _extern_step(k: Extern | Wait, program: LoopProgram, slot: dict) -> Callable:
    outs = tuple(slot[b] for b in k.outputs)
    if isinstance(k, Wait):
        return _WaitCall(k, outs, dict(k.params))
    types = tuple(program.buffers[b].type for b in k.outputs)
    symbolic = is_symbolic((k.params, getattr(k.fn, "views", ()), types))
    return _ExternCall(k, tuple(slot[b] for b in k.inputs), outs, types,
                       slot.get(SIZES) if symbolic else None)


class _Tracker:
    """``config.check_memory_plan``: one call's real allocations, against the plan's blocks
    (NOTE [wrapper memory])."""

    def __init__(self, wrapper: Wrapper, env: list):
        self.wrapper, self.refs = wrapper, {}
        self.entry = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                      for t in env if isinstance(t, torch.Tensor)}  # inputs and constants
        wrapper.measured_peak_bytes = sum(self.entry.values())

    def allocated(self, slot: int, t: torch.Tensor) -> None:
        self.refs[slot] = weakref.ref(t.untyped_storage())

    def alive(self) -> dict:
        return {s: r() for s, r in self.refs.items() if r() is not None}

    def verify(self, i: int, during: bool) -> None:
        alive = self.alive()
        want = {s for s, (f, l) in self.wrapper._blocks.items() if f <= i and (
            i <= l if during else i < l)}
        if set(alive) != want:  # what only a reference cycle holds (some torch calls make
            gc.collect()        # them) is garbage, not an allocation the plan missed
            alive = self.alive()
        if set(alive) != want:
            names = self.wrapper._names
            raise BackendError(
                f"memory plan check: {'during' if during else 'after'} step {i} "
                f"({self.wrapper._step_names[i]}) the live allocations are "
                f"{sorted(names[s] for s in alive)}, the plan's {sorted(names[s] for s in want)}")
        if during:
            live = self.entry | {s.data_ptr(): s.nbytes() for s in alive.values()}
            self.wrapper.measured_peak_bytes = max(self.wrapper.measured_peak_bytes,
                                                   sum(live.values()))

    def finish(self) -> None:
        end = len(self.wrapper._steps)
        want = {s for s, (f, _) in self.wrapper._blocks.items() if f < end}
        if set(self.refs) != want:
            names = self.wrapper._names
            raise BackendError(f"memory plan check: the call allocated "
                               f"{sorted(names[s] for s in self.refs)}, the plan "
                               f"{sorted(names[s] for s in want)}")


# ---------------------------------------------------------------------------------------
# A compiled program
# ---------------------------------------------------------------------------------------
@attrs.frozen
class Target:
    """What a code generator accepts, which lowering and the loop passes are told (NOTE
    [pipeline]): the primitives it computes in kernels (others become externs), the dtypes its
    kernels handle, whether it plans communication buffers (NOTE [lowering collectives]), and
    whether long reductions split in two kernels (many parallel processors: NOTE [split
    reductions])."""

    supported_ops: frozenset
    supported_dtypes: frozenset
    comm_buffers: bool = True
    split_reductions: bool = False


class CompiledProgram:
    """A LoopProgram compiled by a code generator, given its memory plan, the ``Stages`` to
    record in (NOTE [pipeline]) and ``bodies(graph)``, which compiles a control-flow body:
    ``run(inputs) -> outputs``, with ``.kernels`` (one CompiledKernel per step), ``.source``
    (the generated code, then the wrapper's listing), ``.wrapper_source`` and ``.plan``. A
    generator subclasses it with ``write(kernel) -> (writer, text)`` (the text names the
    kernel ``KERNEL_NAME`` and its parameters by position; the writer gets ``.name``),
    ``load(texts) -> code`` (builds or imports the distinct kernels' code), ``launch`` (a
    ``Launcher``), ``listing(wrapper source)`` and ``__call__``, and may offer a picklable
    ``runner`` (NOTE [program cache]); None keeps nothing on disk.

    NOTE [canonical kernels]
    A kernel's text depends on its loops and expressions alone: parameters are named by
    position, and the kernel is named after a digest of its text. The kernels a model's
    repeated blocks produce (the same loops over other buffers) are then one text: it is
    written into the program's code once, compiled and loaded once, and every step that runs
    it calls the one function on its own buffers."""

    def __init__(self, program: LoopProgram, plan, stages, bodies: Callable | None = None):
        self.program, self.plan, self.stages, self.bodies = program, plan, stages, bodies
        texts = stages.run("codegen", self._write, program, stages, keep=False)
        code = stages.run("native", self.load, texts, keep=False)
        self._wrapper = stages.run("wrapper", self.wrap, program, plan, keep=False)
        self._constants = tuple((self._wrapper.slot[b], t) for b, t in program.constants.items())
        self.wrapper_source = self._wrapper.source
        self.source = code + self.listing(self.wrapper_source)
        stages.log()

    def wrap(self, program: LoopProgram, plan):
        """The program's wrapper, once its kernels are loaded."""
        return Wrapper(program, plan, self.launch)

    def _write(self, program: LoopProgram, stages) -> list[str]:
        """Each kernel's writer and text; the distinct texts (NOTE [canonical kernels])."""
        self.writers, distinct, self.kernels = {}, {}, []
        for i, k in enumerate(program.kernels):
            stages.progress("codegen", i, len(program.kernels))
            if isinstance(k, Kernel):
                writer, text = self.write(k)
                writer.name = kernel_name(text)
                text = distinct.setdefault(writer.name, text.replace(KERNEL_NAME, writer.name))
                self.writers[i] = writer
            else:
                text = extern_text(k)
            self.kernels.append(CompiledKernel(k.name, text, k.reads, k.writes))
        return list(distinct.values())

    @property
    def measured_peak_bytes(self) -> int | None:
        return self._wrapper.measured_peak_bytes


@attrs.frozen
class Runner:
    """What calling a compiled program needs and nothing more: its wrapper (whose steps hold
    the loaded kernels), its constants and its device; no loop program, and no sympy but a
    symbolic program's size expressions. The program
    cache pickles it where every step pickles (NOTE [program cache])."""

    wrapper: Wrapper
    constants: tuple
    device: torch.device

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.wrapper(inputs, self.device, self.constants)


def write_atomically(path: str, data: bytes) -> None:
    """A concurrent reader sees the old file or the new one, never a partial file."""
    fd, tmp = tempfile.mkstemp(suffix=os.path.splitext(path)[1], prefix=TEMPORARY,
                               dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:  # a full disk, say: no half-written file left behind
        os.unlink(tmp)
        raise
