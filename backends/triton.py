"""The Triton backend: a LoopProgram becomes one Python module of ``@triton.jit`` kernels,
written to the disk cache and imported, driven by a Python wrapper that allocates buffers on
the inputs' device, launches the kernels and calls the externs.

NOTE [Triton code generation]
Tiling. A pointwise kernel flattens its outer loops (``x0..``) into one program-id axis: each
program handles ``XBLOCK`` consecutive flat points (``xindex = pid * XBLOCK + arange``), the
loop variables are recovered with ``//`` and ``%``, and ``xmask`` guards the ragged last
block. Consecutive points are consecutive along the innermost loop, so the accesses that
follow the loop order are coalesced. 2-D tiles: a pointwise kernel with a *transposed* load
or store, strided along the innermost loop but contiguous (stride +-1, read off the sympy
index) along another loop, gets ``[YBLOCK, XBLOCK]`` tiles on two program-id axes instead
(``_transposed_loop`` picks the loop that most such accesses are contiguous along):
``xindex`` (``[1, XBLOCK]``) walks the innermost loop, ``yindex`` (``[YBLOCK, 1]``) the
other outer loops flattened with the picked loop innermost, ``xmask`` bounds both, and a
pointer whose index misses an axis is broadcast to the tile. Triton lays each load and store
out along its own contiguous axis and converts between the two, so both sides are coalesced:
on an H200 an 8192x8192 float32 transpose moved 3.9 TB/s, about a copy's, 3.6x the flattened
kernel. Tiles are 64x64 (a short side lends its points to the other; within 2% of the best
tuned shape on that H200 for square, batched and 3-D float32 and bf16 transposes), the longer
axis on program-id axis 0 (CUDA allows axis 1 only 65535 programs).

Reductions. A kernel with reduction loops works on ``[XBLOCK, RBLOCK]`` tiles: ``XBLOCK``
outer points per program (``x..`` have shape ``[XBLOCK, 1]``) by ``RBLOCK`` points of the
flattened reduction loops (``r..`` have shape ``[1, RBLOCK]``, recovered like the outer ones).
Its reductions run in dependency-ordered passes (``loops.levels``: softmax's max, then its sum)
and its inner stores in a final pass (those that need no reduction in the first). When the
rows fit in one tile (``R <= PERSISTENT_MAX``) the kernel is *persistent*: no loop, every pass
shares the loaded tile and each Reduce is one ``tl.reduce`` over axis 1. Otherwise, and for a
column sum (``loops.column_wise``: neighbouring outputs per program, however short the rows),
each pass loops over the rows in ``RBLOCK`` chunks,
combining into a per-lane accumulator tile that is reduced across lanes after the loop, and
values that do not depend on ``r..`` are computed once outside the loops. Masked lanes
contribute the reduction's identity (sum 0, prod 1, amax -inf / the lowest integer, ...), so
an empty reduction gives it too. amax/amin propagate NaN; argmax/argmin keep the first
extreme index per lane (chunks arrive in order) and across lanes by a combine that prefers
NaN, then the larger (smaller) value, then the smaller index, as torch. float32 sums
accumulate in float32 (tree-shaped across lanes, which is close to torch's pairwise sums).

Expressions. Every distinct expression node is one local (``tN``), as in cpp. Constants are
typed 0-d tensors (``tl.full([], v, dtype)``) so that Triton's promotion never widens narrow
integer math: operands of an Apply already have their result dtype. Ops whose Triton operator
differs from torch go through small ``@triton.jit`` helpers in ``_PRELUDE`` (NaN-propagating
maximum, Python-signed remainder, truncating integer division, out-of-range shifts, rounding
half to even, negation that keeps the sign of zero, float fmod through libdevice on the GPU,
float-to-narrow-int conversion through int32). Integer division by zero and an indirect
load's position out of range raise in eager: such kernels get an error-flag buffer (NOTE
[kernel errors] in codegen.py), read after the launch where eager raises too.
Index arithmetic is int32 unless the kernel's domain, a buffer it touches or a constant of its
index expressions reaches 2**31; then the program ids, and so every index, are int64. An
indirect load's positions are int64 (checked by ``_position``), and so is its index; the
load is masked by its scope's mask.

NOTE [autotuning]
The launch configuration (points or rows per program, 2-D tile shapes, the chunk length of
looped rows, warps) comes from a heuristic; with ``config.triton_autotune`` each kernel's first
launch on a device instead times the heuristic's configuration and its neighbours
(``candidates``: about 20) on the real arguments and keeps the fastest. Buffers the kernel
writes are copied for the timing runs, so in-place kernels and the program's data are
untouched (the copies cost memory once).
Choices are kept per kernel and device name in ``<module>.tune.json`` beside the generated
module (the module's name is the hash of its source), so a later process launches the tuned
configuration without timing. A candidate that does not compile (too many resources) is
skipped. Tuning changes no generated code, so it is not in the cache key. A kernel of
symbolic sizes is not tuned: it launches the heuristic's blocks at every size.

Symbolic sizes (NOTE [symbolic sizes] in graph/types.py). A kernel's size symbols are
``int`` parameters after its buffers, and its masks, index arithmetic and loop bounds read
them; Triton specializes an int argument on its divisibility by 16 (aligned, vectorized
accesses where the sizes allow), so a kernel compiles at most twice per launch
configuration, and the first call compiles both variants at once. What shapes the code is
chosen at the traced sizes: 2-D tiling, column-wise reductions, int32 or int64 indices
(int64 from ``WIDE_SYMBOLIC`` points, checked against 2**31 per launch). The blocks are
the same at every size (those over a symbolic extent chosen as for a large one:
``_planned``), so no size compiles another variant; only the grid follows each call's
sizes. Rows of a symbolic length are looped, never one persistent tile: a tile would have
to hold the longest row there will be.

Math functions. ``tl.exp``, ``tl.log``, ``tl.sqrt``, ... (``tl.math``) run everywhere;
libdevice functions (tanh, expm1, atan2, pow, ...) exist only when compiling for a GPU: the
interpreter (``TRITON_INTERPRET=1``) has no libdevice, so there lowering is told to leave
those ops out (they become externs). ``triton.language.extra.libdevice`` is the path in
triton 3.6 and in the newest release.
"""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import importlib.util
import json
import logging
import math
import os
import pathlib
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence

import sympy
import torch

from ..config import config, deterministic
from ..errors import BackendError
from ..graph.loops import (
    Apply,
    Constant,
    IndexValue,
    Kernel,
    Load,
    LoopProgram,
    Reduce,
    children,
    column_wise,
    is_inner,
    levels,
    loop_vars,
    reduces,
    walk,
)
from . import codegen, compile_workers, cuda_graphs
from ..graph.types import concrete, is_symbolic, size_hint
from ..tracer.collectives import graphable
from .codegen import (INFIX, INT_DIVISIONS, IndexPrinter, KERNEL_NAME, LOOP_VARIABLE,
                      cache_folder, kernel_error, kernel_symbols, with_error_codes,
                      write_atomically)

_log = logging.getLogger("plait.kernels")

_TL_DTYPES = {torch.float32: "tl.float32", torch.float64: "tl.float64",
              torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16",
              torch.int64: "tl.int64", torch.int32: "tl.int32", torch.int16: "tl.int16",
              torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1"}
TRITON_DTYPES = frozenset(_TL_DTYPES)
_HALF = (torch.bfloat16, torch.float16)

# op -> Triton expression: {0}, {1}, {2} are the operands' locals, {T} the result's tl dtype.
_CORE_OPS: dict[str, str] = {
    **{op: f"tl.{op}({{0}})" for op in "exp exp2 log log2 sin cos sqrt rsqrt erf abs".split()},
    **{op: f"({{0}} {sym} {{1}})" for op, sym in INFIX.items()},
    **{op: f"_{op}({{0}})" for op in "ceil floor trunc round sign isfinite signbit".split()},
    **{op: f"_{op}({{0}}, {{1}})" for op in ("div fmod remainder maximum minimum fmax fmin "
                                             "shift_left shift_right_arithmetic").split()},
    "neg": "_neg({0})",
    "bitwise_not": "(~{0})",
    "reciprocal": "(1.0 / {0})",
    "where": "tl.where({0}, {1}, {2})",
    "convert": "_convert({0}, {T})",
}
# GPU only: the interpreter has no libdevice.
_LIBDEVICE_OPS: dict[str, str] = {
    **{op: f"libdevice.{op}({{0}})" for op in ("acos acosh asin asinh atan atanh cbrt cosh "
                                               "erfc expm1 lgamma log10 log1p sinh tan "
                                               "tanh").split()},
    **{op: f"libdevice.{op}({{0}}, {{1}})" for op in ("atan2", "hypot", "nextafter")},
    "pow": "_pow({0}, {1})",
}
TRITON_OPS: dict[str, str] = {**_CORE_OPS, **_LIBDEVICE_OPS}
# Left out (lowering makes them externs): gcd, digamma, erf_inv, erfcx, ndtri, the Bessel
# and other special functions, igamma/igammac, zeta.

# Triton's 1-bit integers wrap; torch's bool arithmetic saturates.
_BOOL_OPS = {"add": "({0} | {1})", "mul": "({0} & {1})"}
PERSISTENT_MAX = 4096   # rows up to this many points are reduced in one tile
PERSISTENT_TILE = 1024  # ... of this many points, several rows where they are short (on an
                        # H200, ViT-B's step 159.7 -> 159.0 ms against 4096: its softmax rows
                        # of 197 and layer norms of 768; GPT-2, Llama, ConvNeXt alike)
LOOPED_RBLOCK = 512     # the chunk of longer rows
ONLINE_CHUNKS = 4       # chunks per step of a loop with an online softmax (_update_online)
LOOPED_XBLOCK = 1       # longer rows per program (on an H200, cross-entropy's 50304-long rows
                        # 0.454 ms, against 0.486 at 1024 x 2)
COLUMNS_XBLOCK = 32     # outputs per program of a reduction along a strided axis (a column
COLUMNS_RBLOCK = 64     # sum), and its chunk of rows: neighbouring columns make each chunk's
                        # loads coalesce (on an H200, [12608, 3072] f32 52 us, against 72 at
                        # [8, 512]; [200704, 256] bf16 42 against 49; 954 at one column)
COLUMNS_STORING_XBLOCK = 64  # the same where it also stores each point (a GELU's gradient and
COLUMNS_STORING_RBLOCK = 32  # its bias's, [12608, 3072] f32 on an H200: 125 us, against 144 at
                        # [16, 256] and 155 at [8, 512])
TILE_MAX = 4096         # XBLOCK * RBLOCK of a reduction tile
FEW_ROWS = 128          # fewer long rows than this: FEW_ROWS_WARPS warps reduce each
FEW_ROWS_WARPS = 32
POINTWISE_XBLOCK = 1024
WORKERS_FROM = 8        # kernels to compile at least for worker processes to pay (NOTE
                        # [compile workers]): a worker's first job costs 0.4-0.7 s
TILE_EDGE = 64          # a 2-D tile is TILE_EDGE x TILE_EDGE points (TILE_EDGE**2 if one side
                        # is short)
WIDE_SYMBOLIC = 2 ** 27  # a symbolic kernel this large at its traced sizes indexes with int64
                        # (one 16x larger at a call would reach 2**31: checked per launch)
LAUNCHES_KEPT = 256     # a symbolic kernel's grids kept, by sizes
PLANNED_EXTENT = 1 << 20  # a symbolic extent, for choosing block sizes

_PRELUDE = '''"""plait Triton kernels: elementwise semantics follow eager PyTorch (see
backends/triton.py)."""
import triton
import triton.language as tl
from triton.language.extra import libdevice

# (no NaN global: Triton checks at each launch that a kernel's globals still equal what it was
# compiled with, and NaN equals nothing; NaN is written _INF - _INF)
_INF = tl.constexpr(float("inf"))
_NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _maximum(a, b):  # NaN-propagating, as torch.maximum
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def _minimum(a, b):
    return tl.where((a < b) | (a != a), a, b)


@triton.jit
def _fmax(a, b):  # NaN-ignoring
    return tl.where((a > b) | (b != b), a, b)


@triton.jit
def _fmin(a, b):
    return tl.where((a < b) | (b != b), a, b)


@triton.jit
def _sum(a, b):
    return a + b


@triton.jit
def _prod(a, b):
    return a * b


@triton.jit
def _argmax(a, ai, b, bi):  # NaN beats every number; ties go to the first index
    take = (b > a) | ((b != b) & (a == a)) | (((a == b) | ((a != a) & (b != b))) & (bi < ai))
    return tl.where(take, b, a), tl.where(take, bi, ai)


@triton.jit
def _argmin(a, ai, b, bi):
    take = (b < a) | ((b != b) & (a == a)) | (((a == b) | ((a != a) & (b != b))) & (bi < ai))
    return tl.where(take, b, a), tl.where(take, bi, ai)


@triton.jit
def _safe_divisor(b):  # integer division by zero is reported, never executed
    if b.dtype.is_floating():
        r = b
    else:
        r = b + (b == 0).to(b.dtype)
    return r


@triton.jit
def _check_divisor(err, b, mask):
    bad = ((b + tl.zeros(mask.shape, b.dtype)) == 0) & mask  # b may be 0-d (see load)
    tl.store(err + tl.zeros_like(bad.to(tl.int32)), ERROR_DIVISION_BY_ZERO, mask=bad)


@triton.jit
def _position(err, p, n, mask):  # an indirect load's position: outside [0, n) reported, 0
    p = p.to(tl.int64) + tl.zeros(mask.shape, tl.int64)  # p may be 0-d
    ok = (p >= 0) & (p < n)
    tl.store(err + tl.zeros_like(ok.to(tl.int32)), ERROR_INDEX_OUT_OF_RANGE, mask=mask & ~ok)
    return tl.where(ok, p, 0)


@triton.jit
def _div(a, b):  # true division of floats, truncating division of integers
    if a.dtype.is_floating():
        r = a / b
    else:
        r = a // _safe_divisor(b)
    return r


@triton.jit
def _fmod(a, b):  # the sign of a
    if a.dtype.is_floating():
        r = FLOAT_FMOD
    else:
        r = a % _safe_divisor(b)  # Triton's integer % is C's
    return r


@triton.jit
def _remainder(a, b):  # the sign of b, as Python's %
    r = _fmod(a, b)
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def _neg(a):  # 0 - x on the GPU would lose the sign of a negated zero
    if a.dtype.is_floating():
        r = a * -1.0
    else:
        r = -a
    return r


@triton.jit
def _shift_left(a, b):  # by a negative amount or the width or more: 0
    bits: tl.constexpr = a.dtype.primitive_bitwidth
    return tl.where((b < 0) | (b >= bits), tl.zeros_like(a), a << b)


@triton.jit
def _shift_right_arithmetic(a, b):  # out of range: the sign
    bits: tl.constexpr = a.dtype.primitive_bitwidth
    out = (b < 0) | (b >= bits)
    if a.dtype.is_int_signed():
        r = a >> tl.where(out, bits - 1, b)
    else:
        r = tl.where(out, tl.zeros_like(a), a >> b)
    return r


@triton.jit
def _floor(a):  # rounding an integer is the identity
    if a.dtype.is_floating():
        r = tl.floor(a)
    else:
        r = a
    return r


@triton.jit
def _ceil(a):  # exact, signed zeros and integer wrap-around included
    return -_floor(-a)


@triton.jit
def _trunc(a):
    return tl.where(a < 0, _ceil(a), _floor(a))


@triton.jit
def _round(a):  # half to even, as torch.round; the sign of a zero result is a's
    if a.dtype.is_floating():
        f = tl.floor(a)
        d = a - f
        odd = f - 2.0 * tl.floor(f * 0.5) != 0
        r = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)
        r = tl.where(r == 0, a * 0.0, r)
    else:
        r = a
    return r


@triton.jit
def _sign(a):  # NaN -> 0
    if a.dtype == tl.int1:
        r = a
    else:
        r = (a > 0).to(a.dtype) - (a < 0).to(a.dtype)
    return r


@triton.jit
def _isfinite(a):
    if a.dtype.is_floating():
        r = (a == a) & (tl.abs(a) != _INF)
    else:
        r = a == a
    return r


@triton.jit
def _signbit(a):
    if a.dtype == tl.float64:
        r = a.to(tl.int64, bitcast=True) < 0
    elif a.dtype == tl.float32:
        r = a.to(tl.int32, bitcast=True) < 0
    else:
        r = a < 0
    return r


@triton.jit
def _pow(a, b):  # GPU only (libdevice); integers by repeated squaring
    if a.dtype.is_floating():
        r = libdevice.pow(a, b)
    else:
        bits: tl.constexpr = a.dtype.primitive_bitwidth
        one = tl.zeros_like(a) + 1
        r = one
        base = a
        e = b
        for i in tl.static_range(bits):
            r = tl.where((e & 1) != 0, r * base, r)
            base = base * base
            e = e >> 1
        if a.dtype.is_int_signed():  # negative exponents: 1 for 1, +-1 for -1, else 0
            neg = tl.where(a == 1, one, tl.where(a == -1, one - 2 * (b & 1), one - 1))
            r = tl.where(b < 0, neg, r)
    return r


@triton.jit
def _convert(a, dtype: tl.constexpr):
    if dtype == tl.int1:
        r = a != 0
    elif a.dtype.is_floating() and dtype.is_int() and dtype.primitive_bitwidth < 32:
        r = a.to(tl.int32).to(dtype)  # through int32, as torch's scalar cast
    else:
        r = _narrow(a, dtype)
    return r


@triton.jit
def _narrow(a, dtype: tl.constexpr):  # rounds to nearest even, as eager
    NARROW_BODY
    return r


@triton.jit
def _floordiv(a, b):  # index arithmetic on possibly negative values, as sympy's floor
    q = a // b
    return tl.where(((a % b) != 0) & ((a < 0) != (b < 0)), q - 1, q)


@triton.jit
def _mod(a, b):  # the divisor's sign, as sympy's Mod
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
'''


def interpreting() -> bool:
    """Does Triton run kernels in its CPU interpreter (``TRITON_INTERPRET=1``)?"""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def prelude() -> str:
    """The helpers: a float ``%`` compiled for the GPU is not C's fmod on every value (inf,
    large quotients), libdevice's is; the interpreter has only ``%`` (numpy's fmod)."""
    return with_error_codes(_PRELUDE).replace(
        "FLOAT_FMOD", "a % b" if interpreting() else "libdevice.fmod(a, b)").replace(
        "    NARROW_BODY\n", _INTERPRETED_NARROW if interpreting() else "    r = a.to(dtype)\n")


# The interpreter's own float32 -> bfloat16 cast truncates: round the bits to nearest even
# (through float32: double rounding from there is exact for bfloat16), keeping NaN a NaN.
_INTERPRETED_NARROW = """\
    if dtype == tl.bfloat16:
        bits = a.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = tl.where(a != a, bits | 0x400000, bits + 0x7FFF + ((bits >> 16) & 1))
        r = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        r = a.to(dtype)
"""


def _cast(code: str, dtype: torch.dtype) -> str:
    """``code`` converted to ``dtype``; to half precision through ``_narrow``."""
    return f"_narrow({code}, {_tl(dtype)})" if dtype in _HALF else f"{code}.to({_tl(dtype)})"


def supported_ops() -> frozenset:
    """The ops lowering may leave in kernels: libdevice ones only when compiling for a GPU."""
    return frozenset(_CORE_OPS if interpreting() else TRITON_OPS)


def _tl(dtype: torch.dtype) -> str:
    try:
        return _TL_DTYPES[dtype]
    except KeyError:
        raise BackendError(f"the triton backend has no Triton type for {dtype}; lowering "
                           "should have made this an extern. Use backend='eager' for this "
                           "function.") from None


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _planned(n) -> int:
    """An extent as block sizes are chosen for it: a symbolic one as a large one, so that a
    kernel compiles once for all sizes (NOTE [symbolic sizes])."""
    return PLANNED_EXTENT if is_symbolic(n) else n


def _at_least_one(n):
    """A loop's extent, 1 for an empty one (a symbolic size is at least 2)."""
    return n if is_symbolic(n) else max(1, n)


# ---------------------------------------------------------------------------------------
# Printing expressions
# ---------------------------------------------------------------------------------------
class _TritonIndex(IndexPrinter):
    language = "Triton"
    floordiv, floordiv_fn, mod_fn = "//", "_floordiv", "_mod"
    min_fn, max_fn = "tl.minimum", "tl.maximum"
    and_op, or_op, true, false = "&", "|", "True", "False"


def _index(e, names: dict | None = None) -> str:
    """An index expression (or condition) as Triton; ``names`` respells loop variables."""
    return _TritonIndex(names)(e)


def _literal(value, dtype: torch.dtype) -> str:
    """A typed 0-d constant (a bare Python number would be promoted by Triton's rules)."""
    if dtype.is_floating_point:
        value = float(value)
        v = "_INF - _INF" if math.isnan(value) else ("_INF" if value > 0 else "_NEG_INF") \
            if math.isinf(value) else repr(value)
    else:
        v = repr(bool(value)) if dtype == torch.bool else str(int(value))
    return f"tl.full([], {v}, {_tl(dtype)})"


def _symbols(e) -> set[str]:
    """The loop variables ``e`` uses (not the size symbols, NOTE [symbolic sizes])."""
    return {s.name for s in sympy.sympify(e).free_symbols if LOOP_VARIABLE.fullmatch(s.name)}


def _stride(e, v: sympy.Symbol) -> int | None:
    """The constant step of the expanded index ``e`` along the loop variable ``v``; None
    where it has none (``v`` under a floor or Mod)."""
    step = e.coeff(v, 1)
    return int(step) if step.is_Integer and v not in (e - step * v).free_symbols else None


def _transposed_loop(kernel: Kernel) -> int | None:
    """NOTE [Triton code generation], 2-D tiles: the outer loop along which most of a
    pointwise kernel's transposed accesses (strided along the innermost loop) are contiguous,
    the innermost of the ties; None if it has none."""
    sizes = tuple(map(size_hint, kernel.sizes))
    if kernel.reduction_sizes or len(sizes) < 2 or sizes[-1] < 2:
        return None
    xs = loop_vars("x", len(sizes))
    nodes = walk(*(s.value for s in kernel.stores))
    counts: dict[int, int] = {}
    for index in [s.index for s in kernel.stores] + [  # an indirect load has no known stride
            e.index for e in nodes if isinstance(e, Load) and not e.indirect]:
        e = sympy.expand(index)
        if _stride(e, xs[-1]) not in (None, 0, 1, -1):
            for d, (v, n) in enumerate(zip(xs[:-1], sizes)):
                if n > 1 and _stride(e, v) in (1, -1):  # -1: a flip, coalesced as well
                    counts[d] = counts.get(d, 0) + 1
    return max(counts, key=lambda d: (counts[d], d)) if counts else None


def _identity(op: str, dtype: torch.dtype) -> str:
    """The value a masked lane contributes to a reduction."""
    if op in ("sum", "prod"):
        return "0" if op == "sum" else "1"
    low = op in ("amax", "argmax")
    if dtype.is_floating_point:
        return "_NEG_INF" if low else "_INF"
    info = torch.iinfo(dtype)
    return str(info.min if low else info.max)


def _online_pairs(passes: list) -> dict:
    """NOTE [online softmax]: a looped row reduction that takes the max of a body B and,
    in the next pass, sums exp(B - max) (softmax's and logsumexp's denominators) reads the
    row once instead of twice: the sum is kept rescaled to the running max. Max -> sum."""
    pairs = {}
    for level, after in zip(passes, passes[1:]):
        for top in level:
            for total in after:
                e = total.body
                if top.op == "amax" and total.op == "sum" and top.body.dtype.is_floating_point \
                        and isinstance(e, Apply) and e.op == "exp" \
                        and isinstance(e.args[0], Apply) and e.args[0].op == "sub" \
                        and e.args[0].args == (top.body, top) and top not in pairs \
                        and total.dtype == _acc_dtype(top) == e.dtype:
                    pairs[top] = total
    return pairs


def _branch_conditions(roots: list, nodes: list) -> dict:
    """NOTE [loads masked by their branch]. A concatenation or a pad lowers to ``where``s that
    pick one of several clamped loads at each point, so every part would be read at every
    point. A node whose only use leads (through nodes each with one user) into one branch of
    ``where(c, a, b)`` is needed only where ``c`` (``a``) or ``~c`` (``b``) holds: this
    maps it to those ``(c, taken)`` pairs, and its loads are masked by them too (reading 0
    elsewhere, which the ``where`` drops). A reduction's body and an integer division's
    operands (checked for zero divisors over the whole scope) are always needed. ``nodes``:
    every node under the ``roots`` (the stored values), operands first (``loops.walk``)."""
    users: dict = {}
    for e in nodes:
        for c in set(children(e)):
            users.setdefault(c, []).append(e)
    conditions, roots = {}, set(roots)
    for e in reversed(nodes):  # users before their operands
        if e in roots or len(users.get(e, ())) != 1:
            conditions[e] = ()
            continue
        (user,) = users[e]
        if isinstance(user, Reduce) or (isinstance(user, Apply) and user.op in INT_DIVISIONS
                                        and not user.dtype.is_floating_point):
            conditions[e] = ()
        elif isinstance(user, Apply) and user.op == "where" and user.args.count(e) == 1 \
                and user.args[0] != e:
            conditions[e] = conditions[user] + ((user.args[0], user.args[1] == e),)
        else:
            conditions[e] = conditions[user]
    return conditions


def _acc_dtype(red: Reduce) -> torch.dtype:
    """The accumulator's dtype: the body's, but a bool body is counted in the result's dtype
    (sum, prod) or compared as int8, and a half-precision one in float32."""
    if red.body.dtype in _HALF:
        return torch.float32
    if red.body.dtype != torch.bool:
        return red.body.dtype
    return red.dtype if red.op in ("sum", "prod") else torch.int8


class _Scope:
    """Emits expression nodes as locals, each distinct node once, operands first. A scope
    inside the reduction loops defers what does not depend on ``r..`` to its ``parent``
    (computed once, before the loops)."""

    def __init__(self, writer: _KernelWriter, lines: list[str], indent: str, mask: str,
                 parent: _Scope | None = None):
        self.writer, self.lines, self.indent, self.mask = writer, lines, indent, mask
        self.parent, self.names = parent, {}

    def lookup(self, e):
        scope = self
        while scope is not None:
            if e in scope.names:
                return scope.names[e]
            scope = scope.parent
        return None

    def value(self, e) -> str:
        if (name := self.lookup(e)) is not None:
            return name
        if self.parent is not None and not self.writer.uses_rows(e):
            return self.parent.value(e)
        if isinstance(e, Reduce):
            raise BackendError(f"kernel {self.writer.kernel.name}: a {e.op} reduction inside "
                               "another reduction or in a kernel without reduction loops")
        args = [self.value(c) for c in children(e)]
        if isinstance(e, Load):
            code = self.writer.load(e, [self.position(a, n) for a, (_, n) in
                                        zip(args, e.indirect)], self.mask, self.branch(e))
        elif isinstance(e, Constant):
            code = _literal(e.value, e.dtype)
        elif isinstance(e, IndexValue):
            code = self.writer.index_value(e)
        elif isinstance(e, Apply):
            if e.op not in TRITON_OPS:
                raise BackendError(f"the triton backend has no Triton form of {e.op!r}; "
                                   "lowering should have made it an extern")
            form = _BOOL_OPS.get(e.op) if e.dtype == torch.bool else None
            # half precision is computed in float32 (exact for the operands) and rounded
            # once, as eager's kernels do
            args = [f"{a}.to(tl.float32)" if c.dtype in _HALF else a
                    for a, c in zip(args, children(e))]
            result = "tl.float32" if e.dtype in _HALF else _tl(e.dtype)
            code = (form or TRITON_OPS[e.op]).format(*args, T=result)
            if e.dtype in _HALF:
                code = _cast(code, e.dtype)
            if e.op in INT_DIVISIONS and not e.dtype.is_floating_point:
                self.writer.checks_error = True
                self.emit(f"_check_divisor(err, {args[1]}, {self.mask})")
        else:
            raise BackendError(f"unknown loop IR node {e!r}")
        name = self.names[e] = self.writer.local("t")
        self.emit(f"{name} = {code}")
        return name

    def branch(self, e: Load) -> list[str]:
        """The conditions of the ``where`` branches that alone need ``e`` (NOTE [loads masked
        by their branch]), as far as this scope sees them: a condition computed in an inner
        scope does not mask a load hoisted out of it."""
        names = [(self.lookup(c), taken) for c, taken in self.writer.branches.get(e, ())]
        return [n if taken else f"~{n}" for n, taken in names if n is not None]

    def position(self, p: str, n: int) -> str:
        """An indirect load's position, checked into range (NOTE [kernel errors])."""
        self.writer.checks_error = True
        name = self.writer.local("t")
        self.emit(f"{name} = _position(err, {p}, {_index(n)}, {self.mask})")
        return name

    def emit(self, line: str) -> None:
        self.lines.append(self.indent + line)


def _options(blocks: dict, warps: int) -> dict:
    """A launch's keywords: block sizes, warps, and no FMA contraction (NOTE [one rounding
    per op] in codegen.py)."""
    return {**blocks, "num_warps": warps, "enable_fp_fusion": False}


class _KernelWriter:
    """One ``@triton.jit`` function for a Kernel, and how to launch it."""

    def __init__(self, kernel: Kernel, buffer_types: dict, aliases: dict | None = None):
        self.kernel, self.name, self.types = kernel, KERNEL_NAME, buffer_types
        self.aliases = aliases or {}  # in-place reuse: buffer -> the buffer it takes over
        self.count, self.checks_error = 0, False
        self.buffers = tuple(dict.fromkeys(kernel.reads + kernel.writes))  # parameter order
        self.params = {b: f"ptr{n}" for n, b in enumerate(self.buffers)}
        self._rows: dict = {}
        k = kernel
        # NOTE [symbolic sizes]: the size symbols the kernel's loops and indices use are int
        # parameters after its buffers (Triton specializes each on divisibility by 16); its
        # structure (tiling, persistent rows, index width) and blocks are chosen once, its
        # grid at each launch
        self.symbols = kernel_symbols(kernel)
        self.numel = math.prod(k.sizes)
        self.rnumel = math.prod(k.reduction_sizes)
        self.row_kernel = bool(k.reduction_sizes)
        values = [s.value for s in k.stores]
        nodes = walk(*values)
        self.branches = _branch_conditions(values, nodes)
        indices = [s.index for s in k.stores] + [e.index for e in nodes if isinstance(e, Load)] \
            + [e.expr for e in nodes if isinstance(e, IndexValue)]
        # the symbolic extents a launch checks against int32 index arithmetic
        self._checked = tuple(e for e in [self.numel * self.rnumel] + [
            buffer_types[b].numel for b in self.buffers] if is_symbolic(e))
        # (a buffer's size may hold symbols the kernel's loops do not)
        self._key_symbols = tuple(sorted({*self.symbols, *(
            s for e in self._checked for s in e.free_symbols)}, key=str))
        biggest = max([size_hint(self.numel) * max(1, size_hint(self.rnumel))]
                      + [buffer_types[b].numel_hint for b in self.buffers]
                      + [abs(int(a)) for ix in indices
                         for a in sympy.sympify(ix).atoms(sympy.Integer)])
        # int64 index arithmetic; a symbolic kernel's int32 arithmetic is checked per launch
        self.wide = biggest >= (WIDE_SYMBOLIC if self.symbols else 2 ** 31)
        # the extents of the grid's blocks, in order; the block sizes (the kernel's constexpr
        # parameters, in order) follow from them
        self.tiled = None if self.row_kernel else _transposed_loop(k)
        self.columns = self.persistent = False
        self.extents = {"XBLOCK": self.numel}
        if self.tiled is not None:  # 2-D tiles: y the other outer loops, tiled loop last
            self.yloops = [i for i in range(len(k.sizes) - 1) if i != self.tiled] + [self.tiled]
            self.extents = {"YBLOCK": self.numel // k.sizes[-1], "XBLOCK": k.sizes[-1]}
            # the longer axis walks program-id axis 0: CUDA allows axis 1 only 65535 programs
            self.y_first = size_hint(self.extents["YBLOCK"]) >= size_hint(k.sizes[-1])
        elif self.row_kernel:
            # a column sum keeps COLUMNS_XBLOCK neighbouring columns per tile however long or
            # short its rows, looping over them in chunks: a persistent tile has too few (a
            # [4, 1024] tile of a split bias gradient ran 5x slower on an H100 than [8, 512]
            # chunks; a [8, 512] tile of a split's 394 rows, 155 us on an H200, [64, 32] 125).
            # Rows of a symbolic length are looped: a tile holds a row at every length
            self.columns = column_wise(k, mixed=True)
            self.persistent = not self.columns and not is_symbolic(self.rnumel) \
                and self.rnumel <= PERSISTENT_MAX
        self.blocks = self._blocks({b: _planned(n) for b, n in self.extents.items()},
                                   _planned(self.rnumel))
        self._launches: dict = {}  # a symbolic kernel's sizes -> its grid and options

    def _blocks(self, extents: dict, rnumel: int) -> dict:
        """The heuristic block sizes at the grid's ``extents`` and the rows' length."""
        if self.tiled is not None:
            ny, nx = extents["YBLOCK"], extents["XBLOCK"]
            y = min(_pow2(ny), TILE_EDGE)
            x = min(_pow2(nx), TILE_EDGE ** 2 // y)  # a short side lends its points
            return {"YBLOCK": min(_pow2(ny), TILE_EDGE ** 2 // x), "XBLOCK": x}
        numel = extents["XBLOCK"]
        if not self.row_kernel:
            return {"XBLOCK": min(_pow2(numel), POINTWISE_XBLOCK), "RBLOCK": 1}
        if self.persistent:
            rblock = _pow2(rnumel)
            rows = max(1, PERSISTENT_TILE // rblock)
        elif self.columns:
            rows, rblock = (COLUMNS_STORING_XBLOCK, COLUMNS_STORING_RBLOCK) \
                if any(is_inner(s) for s in self.kernel.stores) \
                else (COLUMNS_XBLOCK, COLUMNS_RBLOCK)
            rblock = min(TILE_MAX // rows if self._few_rows(numel) else rblock, _pow2(rnumel))
        else:
            rows = LOOPED_XBLOCK
            rblock = min(TILE_MAX // rows, _pow2(rnumel)) if self._few_rows(numel) \
                else LOOPED_RBLOCK
        return {"XBLOCK": min(_pow2(numel), rows), "RBLOCK": rblock}

    def _few_rows(self, numel: int) -> bool:
        """Long rows too few to fill a GPU with programs (the mean of cross-entropy's
        losses: one row of 8192): each program waits on its loads step by step, so it takes
        the biggest chunks and FEW_ROWS_WARPS warps to keep more loads in flight (13 us
        after cross-entropy's main kernel on an H200, 34 at the default)."""
        return self.row_kernel and not self.persistent and numel < FEW_ROWS

    def local(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count - 1}"

    def uses_rows(self, e) -> bool:
        """Does the node's value vary along the reduction loops (not looking inside
        reductions, which are bound before anything uses them)?"""
        if e not in self._rows:
            if isinstance(e, Load):
                own = _symbols(e.index)
            elif isinstance(e, IndexValue):
                own = _symbols(e.expr)
            else:
                own = set()
            self._rows[e] = any(s.startswith("r") for s in own) or (
                not isinstance(e, Reduce) and any(self.uses_rows(c) for c in children(e)))
        return self._rows[e]

    # -- pieces of code ----------------------------------------------------------------------
    def _mask(self, symbols: set) -> str | None:
        x, r = any(s.startswith("x") for s in symbols), any(s.startswith("r") for s in symbols)
        return "xrmask" if x and r else "xmask" if x else "rmask" if r else None

    def _shape(self, inner: bool) -> str:
        if self.tiled is not None:
            return "[YBLOCK, XBLOCK]"
        if not self.row_kernel:
            return "[XBLOCK]"
        return "[XBLOCK, RBLOCK]" if inner else "[XBLOCK, 1]"

    def load(self, e: Load, positions: list[str], scope_mask: str, branch: list[str]) -> str:
        """``positions``: the locals of an indirect load's checked positions (int64 tiles
        of the ``scope_mask``'s shape, which masks the load); ``branch``: the conditions
        under which alone its value is used."""
        names = {f"i{k}": p for k, p in enumerate(positions)}
        mask = scope_mask if positions else self._mask(_symbols(e.index))
        ptr = f"{self.params[e.buffer]} + {_index(e.index, names)}"
        if positions and not _symbols(e.index) & set(names):  # none used (a dim of size 1):
            ptr += f" + tl.zeros_like({positions[0]})"  # still a tile, as the positions are
        if mask is None:  # one element for all lanes, in bounds. Loaded as a tile all the
            # same, not 0-d: the interpreter mistypes a 0-d comparison result (its handle
            # keeps the operands' dtype) once it is broadcast.
            ptr += f" + tl.zeros({self._shape(False)}, tl.int32)"
        mask = " & ".join(([mask] if mask else []) + branch)
        # (a 2-D tile's xmask spans the tile: tl.load broadcasts a narrower pointer to it)
        return f"tl.load({ptr}, mask={mask}, other=0)" if mask else f"tl.load({ptr})"

    def index_value(self, e: IndexValue) -> str:
        if not _symbols(e.expr):
            value = e.expr
            if is_symbolic(value):  # a size: a 0-d tensor of it, as a literal is
                return f"(tl.zeros([], tl.int64) + {_index(value)}).to({_tl(e.dtype)})"
            return _literal(float(value) if e.dtype.is_floating_point else
                            bool(value) if e.dtype == torch.bool else int(value), e.dtype)
        names = ({s: f"{s}.to({_tl(e.dtype)})" for s in _symbols(e.expr)}
                 if e.dtype.is_floating_point else None)  # iota of floats in their precision
        return f"({_index(e.expr, names)}).to({_tl(e.dtype)})"

    def store(self, scope: _Scope, s) -> None:
        inner = is_inner(s)
        symbols = _symbols(s.index)
        if self.tiled is not None:  # x.. are [YBLOCK, 1] there, the innermost [1, XBLOCK]
            spans = f"x{len(self.kernel.sizes) - 1}" in symbols and len(symbols) > 1
        else:
            spans = {v[0] for v in symbols} == {"x"} | ({"r"} if inner and self.row_kernel
                                                       else set())
        ptr = f"{self.params[s.buffer]} + {_index(s.index)}"
        if not spans:  # broadcast the pointer to the tile
            ptr += f" + tl.zeros({self._shape(inner)}, tl.int32)"
        mask = "xrmask" if inner else "xmask"
        scope.emit(f"tl.store({ptr}, {scope.value(s.value)}, mask={mask})")

    def _split(self, flat: str, loops: dict, lines, indent) -> None:
        """Loop variables (name -> size) from a flat index, row-major over them."""
        sizes = list(loops.values())
        for i, name in enumerate(loops):
            inner = math.prod(sizes[i + 1:])
            v = f"({flat} // {_index(inner)})" if inner != 1 else flat
            v = f"{v} % {_index(sizes[i])}" if i else v
            lines.append(f"{indent}{name} = {v}")

    def _outer_index(self, lines, ind) -> None:
        """The outer loop variables of the program's points, and their mask ``xmask``."""
        k = self.kernel
        pids = [f"tl.program_id({a})" + (".to(tl.int64)" if self.wide else "") for a in (0, 1)]
        if self.tiled is None:
            arange = "tl.arange(0, XBLOCK)" + ("[:, None]" if self.row_kernel else "")
            lines += [f"{ind}xindex = {pids[0]} * XBLOCK + {arange}",
                      f"{ind}xmask = xindex < {_index(_at_least_one(self.numel))}"]
            self._split("xindex", {f"x{i}": n for i, n in enumerate(k.sizes)}, lines, ind)
            return
        py, px = pids if self.y_first else pids[::-1]
        lines += [f"{ind}yindex = {py} * YBLOCK + tl.arange(0, YBLOCK)[:, None]",
                  f"{ind}xindex = {px} * XBLOCK + tl.arange(0, XBLOCK)[None, :]",
                  f"{ind}xmask = (yindex < {_index(self.extents['YBLOCK'])}) & "
                  f"(xindex < {_index(self.extents['XBLOCK'])})"]
        self._split("yindex", {f"x{i}": k.sizes[i] for i in self.yloops}, lines, ind)
        lines.append(f"{ind}x{len(k.sizes) - 1} = xindex")

    # -- the function ----------------------------------------------------------------------
    def source(self) -> str:
        k = self.kernel
        for s in k.stores:
            if s.value.dtype != self.types[s.buffer].dtype:
                raise BackendError(f"kernel {k.name} stores a {s.value.dtype} value into "
                                   f"{s.buffer} of {self.types[s.buffer].dtype}")
        lines: list[str] = []
        ind = "    "
        self._outer_index(lines, ind)
        top = _Scope(self, lines, ind, "xmask")
        if self.row_kernel:
            self._rows_body(top, lines, ind)
        for s in k.stores:
            if not is_inner(s):
                self.store(top, s)
        params = [self.params[b] for b in self.buffers] + ["err"] * self.checks_error + [
            s.name for s in self.symbols]
        blocks = ", ".join(f"{b}: tl.constexpr" for b in self.blocks)
        head = f"@triton.jit\ndef {self.name}({', '.join(params)}, {blocks}):"
        return "\n".join([head, *lines])

    def _rindex(self, base: str, lines, indent) -> None:
        arange = "tl.arange(0, RBLOCK)" + (".to(tl.int64)" if self.wide else "")
        lines += [f"{indent}rindex = {base}{arange}[None, :]",
                  f"{indent}rmask = rindex < {_index(self.rnumel)}",
                  f"{indent}xrmask = xmask & rmask"]
        self._split("rindex", {f"r{i}": n for i, n in enumerate(self.kernel.reduction_sizes)},
                    lines, indent)

    def _rows_body(self, top: _Scope, lines, ind) -> None:
        k = self.kernel
        passes = levels(*(s.value for s in k.stores))
        inner = [s for s in k.stores if is_inner(s)]
        if self.persistent:  # one tile: every pass shares its loads
            self._rindex("", lines, ind)
            rows = _Scope(self, lines, ind, "xrmask", parent=top)
            for level in passes:
                for red in level:
                    top.names[red] = self._reduce_tile(rows, red)
            for s in inner:
                self.store(rows, s)
            return
        online = _online_pairs(passes)
        early = self._early_stores(inner, passes, online)
        inner = [s for s in inner if s not in early]
        for level in passes:
            level = [red for red in level if red not in online.values()]
            if not level:  # all of it summed online in the pass before
                continue
            accs = [self._accumulate(top, red, lines, ind) for red in level]
            sums = {red: self._accumulate(top, online[red], lines, ind)
                    for red in level if red in online}
            body: list[str] = []
            chunks: dict = {red: [] for red in sums}  # each chunk's masked values
            for rows in self._loop(top, body, ind, ONLINE_CHUNKS if sums else 1):
                for red, acc in zip(level, accs):
                    if red in sums:
                        chunks[red].append(self._masked_value(rows, red))
                    else:
                        self._update(rows, red, acc)
                for s in early:
                    self.store(rows, s)
            for red, acc in zip(level, accs):
                if red in sums:
                    self._update_online(rows, acc, sums[red], chunks[red])
            early = []
            lines += body
            for red, acc in zip(level, accs):
                if red in sums:
                    top.names[red], top.names[online[red]] = self._finish_online(
                        top, red, online[red], acc, sums[red])
                else:
                    top.names[red] = self._finish(top, red, acc)
        inner = early + inner  # early: still there if no pass ran
        if inner:
            body = []
            (rows,) = self._loop(top, body, ind)
            for s in inner:
                self.store(rows, s)
            lines += body

    def _early_stores(self, inner: list, passes: list, online: dict) -> list:
        """Row stores that need no reduction are written in the first pass, not a last one,
        unless one writes in place over memory a later pass reads: in-place reuse lets a
        store take over a buffer that its own pass reads at the store's index only (NOTE
        [memory passes]), and the first pass is not the last one."""
        def storage(b):
            while b in self.aliases:
                b = self.aliases[b]
            return b

        later = [red for level in passes[1:] for red in level if red not in online.values()]
        early = [s for s in inner if not reduces(s.value)]
        while True:
            rest = [s.value for s in inner if s not in early]
            read = {storage(e.buffer) for e in walk(*later, *rest) if isinstance(e, Load)}
            kept = [s for s in early if storage(s.buffer) not in read]
            if kept == early:
                return early
            early = kept

    def _loop(self, top: _Scope, body: list, ind: str, chunks: int = 1) -> Iterator[_Scope]:
        """The loop over the rows, ``chunks`` chunks of RBLOCK points a step: a scope per
        chunk, its ``rindex`` (and masks) bound as the caller reaches it."""
        step = "RBLOCK" if chunks == 1 else f"{chunks} * RBLOCK"
        body.append(f"{ind}for roff in range(0, {_index(self.rnumel)}, {step}):")
        for j in range(chunks):
            self._rindex(f"roff + {j} * RBLOCK + " if j else "roff + ", body, ind + "    ")
            yield _Scope(self, body, ind + "    ", "xrmask", parent=top)

    def _masked_body(self, rows: _Scope, red: Reduce, fill: str) -> str:
        v = rows.value(red.body)
        t = _acc_dtype(red)
        if t != red.body.dtype:
            v = f"{v}.to({_tl(t)})"
        return f"tl.where(xrmask, {v}, {fill})"

    def _reduce_tile(self, rows: _Scope, red: Reduce) -> str:
        """A persistent reduction: the whole row in one tile."""
        init = _identity(red.op, _acc_dtype(red))
        v = self._masked_body(rows, red, init)
        name = self.local("red")
        if red.op.startswith("arg"):
            rows.emit(f"_, {name} = tl.reduce(({v}, rindex + tl.zeros([XBLOCK, RBLOCK], "
                      f"tl.int32)), 1, _{red.op})")
        else:
            rows.emit(f"{name} = tl.reduce({v}, 1, _{self._combine(red)})")
        rows.emit(f"{name} = {_cast(f'{name}[:, None]', red.dtype)}")
        return name

    @staticmethod
    def _combine(red: Reduce) -> str:
        return {"sum": "sum", "prod": "prod", "amax": "maximum", "amin": "minimum"}[red.op]

    def _accumulate(self, top: _Scope, red: Reduce, lines, ind) -> str:
        if red.op not in ("sum", "prod", "amax", "amin", "argmax", "argmin"):
            raise BackendError(f"kernel {self.kernel.name}: unknown reduction {red.op!r}")
        acc = self.local("acc")
        t = _acc_dtype(red)
        lines.append(f"{ind}{acc} = tl.full([XBLOCK, RBLOCK], {_identity(red.op, t)}, {_tl(t)})")
        if red.op.startswith("arg"):
            index_t = "tl.int64" if self.wide else "tl.int32"
            lines.append(f"{ind}{acc}_index = tl.zeros([XBLOCK, RBLOCK], {index_t})")
        return acc

    def _update(self, rows: _Scope, red: Reduce, acc: str) -> None:
        if red.op.startswith("arg"):
            v = self._masked_body(rows, red, acc)
            rows.emit(f"{acc}, {acc}_index = _{red.op}({acc}, {acc}_index, {v}, "
                      f"tl.where(xrmask, rindex, {acc}_index))")
        else:
            v = self._masked_body(rows, red, _identity(red.op, _acc_dtype(red)))
            rows.emit(f"{acc} = _{self._combine(red)}({acc}, {v})")

    def _masked_value(self, rows: _Scope, top: Reduce) -> str:
        """The max's operand in this chunk, -inf where masked, bound to a local (the next
        chunk rebinds the masks)."""
        v = self.local("v")
        rows.emit(f"{v} = {self._masked_body(rows, top, '_NEG_INF')}")
        return v

    def _update_online(self, rows: _Scope, acc: str, total: str, values: list[str]) -> None:
        """NOTE [online softmax]: the running max and the sum of exp(v - max) rescaled to
        it, in one pass. Each lane takes ONLINE_CHUNKS values a step, so the rescaling exp
        is paid once per ONLINE_CHUNKS elements, not per element: two exps per element made
        cross-entropy's 50304-long rows 8% slower on an H200 (428 us, 395 with one). A lane
        whose max is still -inf subtracts 0 instead (its sum stays 0, where -inf - -inf
        would make it NaN): one select per step, not one per exp."""
        new, shift = self.local("m"), self.local("m")
        rows.emit(f"{new} = {functools.reduce(lambda a, v: f'_maximum({a}, {v})', values, acc)}")
        rows.emit(f"{shift} = tl.where({new} == _NEG_INF, 0.0, {new})")
        terms = " + ".join(f"tl.exp({v} - {shift})" for v in values)
        rows.emit(f"{total} = {total} * tl.exp({acc} - {shift}) + {terms}")
        rows.emit(f"{acc} = {new}")

    def _finish_online(self, top: _Scope, red: Reduce, total_red: Reduce, acc: str,
                       total: str) -> tuple[str, str]:
        m, s = self.local("red"), self.local("red")
        top.emit(f"{m} = tl.reduce({acc}, 1, _maximum)[:, None]")
        # a lane whose max is -inf has a sum of 0 (_update_online): 0 * exp(-inf - m) is 0
        top.emit(f"{s} = tl.sum({total} * tl.exp({acc} - {m}), 1)[:, None]")
        # a row of -inf only: eager's exp(-inf - -inf) is NaN
        top.emit(f"{s} = {_cast(f'tl.where({m} == _NEG_INF, {m} - {m}, {s})', total_red.dtype)}")
        top.emit(f"{m} = {_cast(m, red.dtype)}")
        return m, s

    def _finish(self, top: _Scope, red: Reduce, acc: str) -> str:
        name = self.local("red")
        if red.op.startswith("arg"):
            top.emit(f"_, {name} = tl.reduce(({acc}, {acc}_index), 1, _{red.op})")
        else:
            top.emit(f"{name} = tl.reduce({acc}, 1, _{self._combine(red)})")
        top.emit(f"{name} = {_cast(f'{name}[:, None]', red.dtype)}")
        return name

    # -- launching -------------------------------------------------------------------------
    def launch_options(self) -> dict:
        """The heuristic launch configuration."""
        warps = FEW_ROWS_WARPS if self._few_rows(_planned(self.numel)) else \
            8 if math.prod(self.blocks.values()) >= 2048 else 4
        return _options(self.blocks, warps)

    def grid(self, options: dict, extents: dict | None = None) -> tuple[int, ...]:
        """The grid at the extents of a call (the traced sizes' where not given)."""
        extents = extents or {b: size_hint(n) for b, n in self.extents.items()}
        counts = tuple(-(-n // options[b]) for b, n in extents.items())
        return counts if self.tiled is None or self.y_first else counts[::-1]

    def at(self, sizes: dict) -> tuple[tuple, dict, list]:
        """A symbolic kernel's grid, launch options and size arguments at a call's ``sizes``
        (NOTE [symbolic sizes]), checked against int32 index arithmetic. Its blocks are
        the same at every size: one compiled kernel (per divisibility) serves them all."""
        key = tuple(sizes[s] for s in self._key_symbols)
        found = self._launches.get(key)
        if found is None:
            values = dict(zip(self._key_symbols, key))
            if not self.wide and any(concrete(e, values) >= 2 ** 31 for e in self._checked):
                raise BackendError(
                    f"kernel {self.kernel.name} indexes with int32 arithmetic (its sizes at "
                    f"the trace were far below 2**31 points), and a call's sizes {values} "
                    "reach 2**31: compile with plait.jit(..., dynamic=False) for sizes this "
                    "large")
            options = self.launch_options()
            grid = self.grid(options, {b: concrete(n, values) for b, n in self.extents.items()})
            if grid[1:] and max(grid[1:]) > 65535:
                raise BackendError(f"kernel {self.kernel.name}: grid {grid} at sizes {values} "
                                   "exceeds CUDA's 65535 programs on axis 1; compile with "
                                   "plait.jit(..., dynamic=False) for sizes this large")
            if len(self._launches) >= LAUNCHES_KEPT:
                self._launches.clear()
            found = self._launches[key] = grid, options, [values[s] for s in self.symbols]
        return found

    def candidates(self) -> list[dict]:
        """The launch configurations autotuning times (NOTE [autotuning]): the heuristic's
        first, then other tile shapes (points per program, rows per program and chunk
        lengths of looped rows) and warps. A persistent kernel keeps its RBLOCK: its row
        must fit one tile."""
        if self.tiled is not None:
            shapes = [(y, x) for y in (16, 32, 64, 128) for x in (16, 32, 64, 128)
                      if 1024 <= y * x <= 4096]
            warps = (4, 8)
        elif not self.row_kernel:
            shapes, warps = [(x, 1) for x in (256, 512, 1024, 2048, 4096)], (4, 8)
        elif self.persistent:
            rblock = self.blocks["RBLOCK"]
            shapes = [(x, rblock) for x in (1, 2, 4, 8, 16) if x * rblock <= 4 * TILE_MAX]
            warps = (2, 4, 8, 16)
        elif self.columns:  # neighbouring columns by chunks of rows
            shapes = [(x, r) for x in (8, 16, 32, 64, 128) for r in (16, 32, 64, 128, 256, 512)
                      if 512 <= x * r <= 2 * TILE_MAX]
            warps = (4, 8)
        else:
            shapes = [(x, r) for r in (512, 1024, 2048, 4096) for x in (1, 2, 4)
                      if x * r <= 2 * TILE_MAX]
            warps = (4, 8, 16)
        found = [self.launch_options()]
        for shape in shapes:
            for w in warps:
                option = _options({b: min(n, _pow2(_planned(self.extents[b])))
                                   if b in self.extents
                                   else n for b, n in zip(self.blocks, shape)}, w)
                if option not in found:
                    found.append(option)
        return found


# ---------------------------------------------------------------------------------------
# Loading the generated module
# ---------------------------------------------------------------------------------------
@functools.cache
def _scratch_folder() -> str:
    """Where modules go when the cache folder cannot be written: Triton reads a kernel's
    source from its file, so it must be a real one."""
    return tempfile.mkdtemp(prefix="plait-triton-")


def load_module(source: str):
    """Import ``source`` from ``<cache_dir>/triton/<hash>.py`` (Triton reads kernels' source
    through ``inspect``, so they must live in real files); equal sources share the file."""
    key = hashlib.sha256(source.encode()).hexdigest()[:40]
    name = f"plait_triton_{key}"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(cache_folder("triton") or _scratch_folder(), key + ".py")
    if not (os.path.exists(path) and pathlib.Path(path).read_text() == source):
        write_atomically(path, source.encode())
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


_collecting = threading.local()  # ``seen``: the specializations a thread's warmups ask for
_hook_lock = threading.Lock()

# NOTE [loading launchers]
# Triton builds a C launcher module per kernel signature at a kernel's first launch and loads
# it under one module name for every signature. The kernels a program warms up in threads
# loaded theirs at once and, with other processes filling the same Triton cache (suite
# slices, data-parallel ranks), a kernel now and then got another signature's launcher:
# "function takes exactly 20 arguments (21 given)" at its launch (3 processes compiling
# ghostnet at once, measured on an H200 with Triton 3.6: 3 of 9 runs). Handles are made one
# at a time (12 of 12 passed, and the first call was no slower); compiles stay parallel.
_LAUNCHERS = threading.Lock()


def _specialization(kernel, args: list, options: dict) -> str | None:
    """Triton's serialized specialization of ``kernel`` launched on ``args`` with ``options``
    (what a worker compiles it from, NOTE [compile workers]), taken from its cache hook, which
    skips the compile; None where the kernel is compiled already or Triton gives none."""
    import triton

    _install_specialization_hook(triton.knobs.runtime)
    _collecting.seen = seen = []
    try:
        kernel.warmup(*args, grid=(1,), **options)
    finally:
        _collecting.seen = None
    return seen[0] if seen else None


def _install_specialization_hook(runtime) -> None:
    """Triton's ``jit_cache_hook`` is one per process. The hook plait installs once (chaining
    the one it finds) records and skips a compile only in a thread that collects
    specializations: swapped in and out per call instead, two threads compiling at once
    could leave one's hook installed, and Triton would then skip that thread's later
    compiles and their launches without a word."""
    with _hook_lock:
        if getattr(runtime.jit_cache_hook, "plait", False):
            return
        previous = runtime.jit_cache_hook

        def record_and_skip(**kwargs):
            seen = getattr(_collecting, "seen", None)
            if seen is None:
                return previous(**kwargs) if previous else None
            seen.append(kwargs["compile"].get("specialization_data"))
            return True

        record_and_skip.plait = True
        runtime.jit_cache_hook = record_and_skip


# ---------------------------------------------------------------------------------------
# Autotuning
# ---------------------------------------------------------------------------------------
def time_launch(launch, device: torch.device) -> float:
    """Seconds per call of ``launch``: CUDA-event timing (Triton's ``do_bench``, median) on
    a GPU, the best of three wall-clock runs elsewhere (the interpreter: only for tests)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(launch, warmup=5, rep=25, return_mode="median") / 1e3
    launch()  # compile first
    times = []
    for _ in range(3):
        start = time.perf_counter()
        launch()
        times.append(time.perf_counter() - start)
    return min(times)


def _read_tuning(path: str) -> dict:
    """A module's tuned launch options; a missing or damaged file is an empty one."""
    try:
        with open(path) as f:
            found = json.load(f)
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):
        return {}


# ---------------------------------------------------------------------------------------
# The compiled program
# ---------------------------------------------------------------------------------------
class CompiledProgram(codegen.CompiledProgram):
    """A LoopProgram as one module of ``@triton.jit`` kernels and the shared wrapper
    (backends/codegen.py, NOTE [wrapper memory]), which allocates on the inputs' device."""

    def __init__(self, program: LoopProgram, plan, stages, bodies=None):
        self._types = {b: buf.type for b, buf in program.buffers.items()}
        self._on_device: dict = {}  # device -> constants there
        self._error_flags: dict = {}  # device -> the flag checking kernels set
        super().__init__(program, plan, stages, bodies)
        # NOTE [CUDA graphs]: not a program with comm pools (their memory is handed back
        # after each call) or collectives a graph cannot hold
        self._graphed = None if self.plan.comm_pools or any(
            getattr(k, "collective", False) and not graphable(dict(k.params)["group_name"])
            for k in program.kernels) else cuda_graphs.Graphed(
                self._run, lambda d: [t for _, t in self._on_device[d]],
                sized=any(is_symbolic(b.type) for b in program.buffers.values()))

    def replays_after(self, before) -> None:
        """This program runs after ``before`` and never beside it (a backward after its
        forward): its CUDA graphs capture into ``before``'s memory (NOTE [CUDA graphs])."""
        if self._graphed is not None and getattr(before, "_graphed", None) is not None:
            self._graphed.replays_after(before._graphed)

    def write(self, kernel: Kernel):
        w = _KernelWriter(kernel, self._types, self.program.aliases)
        return w, w.source()

    def load(self, texts: list[str]) -> str:
        self.triton_source = "\n\n\n".join([prelude(), *texts]) + "\n"
        self._module = load_module(self.triton_source)
        self._tuning_path = self._module.__file__[:-len(".py")] + ".tune.json"
        self._tuning = None  # kernel on device -> launch options, read at the first tuning
        return self.triton_source

    def launch(self, i: int, k: Kernel, slot: dict):
        w = self.writers[i]
        fn, args = getattr(self._module, w.name), tuple(slot[b] for b in w.buffers)
        written = tuple(b in k.writes for b in w.buffers)
        sizes = slot.get(codegen.SIZES) if w.symbols else None
        if sizes is not None:  # NOTE [symbolic sizes]: the grid at each call's sizes
            extents = ", ".join(map(_index, w.extents.values()))
            params = (*w.buffers, *["err"] * w.checks_error, *map(str, w.symbols))
            text = f"{w.name}[grid({extents})]({', '.join(params)})"

            def run(env, device):
                tensors = [env[s] for s in args]
                if w.checks_error:  # NOTE [kernel errors]
                    tensors.append(self._error_flag(device))
                grid, options, values = w.at(env[sizes])
                fn[grid](*tensors, *values, **options)
                self._raise_error(w, tensors, device)

            return run, text
        options = w.launch_options()
        grid = w.grid(options)
        opts = ", ".join(f"{n}={v}" for n, v in options.items())
        text = f"{w.name}[{grid}]({', '.join(w.buffers)}{', err' * w.checks_error}, {opts})"
        tuned: dict = {}  # device -> (grid, options), found at the first tuned launch there

        def run(env, device):
            tensors = [env[s] for s in args]
            if w.checks_error:  # NOTE [kernel errors]
                tensors.append(self._error_flag(device))
            if not config.triton_autotune or w.row_kernel and deterministic():
                fn[grid](*tensors, **options)  # NOTE [deterministic programs]
            else:
                if device not in tuned:
                    best = self._tuned(w, fn, tensors, written, device)
                    tuned[device] = w.grid(best), best
                tuned_grid, tuned_options = tuned[device]
                fn[tuned_grid](*tensors, **tuned_options)
            self._raise_error(w, tensors, device)

        return (run if w.numel != 0 else lambda env, device: None), text

    @staticmethod
    def _raise_error(w, tensors: list, device) -> None:
        """NOTE [kernel errors]: on the CPU (the interpreter) a launch's error is raised at
        once; on a GPU the wrapper reads the flag after the program."""
        if w.checks_error and device.type == "cpu" and (code := tensors[-1].item()):
            tensors[-1].zero_()
            raise kernel_error(code)

    @staticmethod
    def listing(wrapper_source: str) -> str:
        return '\n\n"""Python wrapper:\n' + wrapper_source + '\n"""\n'

    def _device(self, inputs) -> torch.device:
        if inputs:
            device = inputs[0].device
        else:
            device = torch.device("cpu" if interpreting() else "cuda")
        if device.type == "cpu" and not interpreting():
            raise BackendError("the triton backend runs on GPU tensors (or on CPU tensors "
                               "under TRITON_INTERPRET=1); use backend='cpp' on the CPU")
        return device

    def _error_flag(self, device: torch.device) -> torch.Tensor:
        """The error flag of this device's launches (NOTE [kernel errors])."""
        if device not in self._error_flags:
            self._error_flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return self._error_flags[device]

    @property
    def tuned_launches(self) -> dict:
        """"<kernel> on <device>" -> its autotuned launch options (NOTE [autotuning])."""
        return dict(self._tuning if self._tuning is not None else
                    _read_tuning(self._tuning_path))

    def _tuned(self, w, fn, tensors: list, written: tuple[bool, ...], device) -> dict:
        """NOTE [autotuning]: the fastest of ``w.candidates()`` for this kernel on this
        device, timed on the first launch (on copies of the buffers it writes, so the
        program's data is untouched) and kept in ``<module>.tune.json`` beside the kernels."""
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "interpreter"
        key = f"{w.name} on {where}"
        if self._tuning is None:
            self._tuning = _read_tuning(self._tuning_path)
        if key not in self._tuning:
            copies = {id(t): t.clone() for t, out in zip(tensors, written) if out}
            args = [copies.get(id(t), t) for t in tensors]
            timings = {}
            for option in w.candidates():
                try:
                    timings[json.dumps(option)] = time_launch(
                        lambda: fn[w.grid(option)](*args, **option), device)
                except Exception as e:  # a candidate that does not compile (resources)
                    if option == w.launch_options():
                        raise
                    _log.debug("autotuning %s: %s failed: %s", w.name, option, e)
            best = min(timings, key=timings.get)
            self._tuning[key] = json.loads(best)
            _log.debug("autotuned %s: %s, %.4f ms (heuristic %s, %.4f ms)", key, best,
                       timings[best] * 1e3, w.launch_options(),
                       timings[json.dumps(w.launch_options())] * 1e3)
            write_atomically(self._tuning_path, json.dumps(self._tuning, indent=1,
                                                           sort_keys=True).encode())
        # over the heuristic's: a file an older plait wrote may lack a keyword
        return w.launch_options() | self._tuning[key]

    def _compile_kernels(self, device: torch.device) -> None:
        """Compile every kernel for ``device`` at once instead of one by one at first launch:
        each first in a worker process (NOTE [compile workers]), then here in threads, where
        Triton's disk cache then holds it. Each kernel is also loaded and its launcher built
        (Triton compiles a C launcher per kernel signature at the first launch: 0.3 s each, a
        4-block GPT step's first call spent 4 s on them one by one). Stand-in arguments are
        fresh allocations, aligned as the buffers are, so the launches find these compiled
        variants."""
        writers = list({w.name: w for w in self.writers.values() if w.numel != 0}.values())
        if len(writers) < 2 or interpreting():
            return
        # (writer, stand-in arguments): a symbolic kernel twice, its sizes at the trace and
        # with their divisibility by 16 flipped, the two variants Triton specializes it into
        variants = []
        for w in writers:
            buffers = [torch.empty(1, dtype=self._types[b].dtype, device=device)
                       for b in w.buffers] + [self._error_flag(device)] * w.checks_error
            hints = [size_hint(s) for s in w.symbols]
            variants.append((w, buffers + hints))
            if w.symbols:
                variants.append((w, buffers + [n + 1 if n % 16 == 0 else -(-n // 16) * 16
                                               for n in hints]))
        workers = compile_workers.pool(config.compile_workers) \
            if config.compile_workers and len(variants) >= WORKERS_FROM else None
        jobs = {}
        if workers is not None:
            import triton

            with torch.cuda.device(device):
                target = triton.runtime.driver.active.get_current_target()
                for j, (w, stand_ins) in enumerate(variants):
                    if data := _specialization(getattr(self._module, w.name), stand_ins,
                                               w.launch_options()):
                        jobs[j] = {
                            "path": self._module.__file__, "module": self._module.__name__,
                            "kernel": w.name, "specialization": data, "target": {
                                "backend": target.backend, "arch": target.arch,
                                "warp_size": target.warp_size}}

        def warm_up(j):
            w, stand_ins = variants[j]
            if j in in_workers:
                in_workers[j].result()  # then found in Triton's disk cache
            options = w.launch_options()
            with torch.cuda.device(device):
                compiled = getattr(self._module, w.name).warmup(
                    *stand_ins, grid=w.grid(options), **options)
                with _LAUNCHERS:  # NOTE [loading launchers]
                    getattr(compiled, "_init_handles", lambda: None)()

        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(jobs),
                                                              config.compile_workers))) as remote:
            in_workers = {j: remote.submit(workers.compile, job) for j, job in jobs.items()}
            with concurrent.futures.ThreadPoolExecutor(min(len(variants), 8)) as local:
                list(local.map(warm_up, range(len(variants))))

    def _run(self, inputs: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        return self._wrapper(inputs, device, self._on_device[device])

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        device = self._device(inputs)
        if device not in self._on_device:
            self.stages.run("device", self._compile_kernels, device, keep=False)
            self._on_device[device] = [(s, t.to(device)) for s, t in self._constants]
        if self._graphed is None or device.type != "cuda":
            return self._run(inputs, device)
        return self._graphed(inputs, device)


generate = CompiledProgram
READS = ()  # the settings its code reads (``triton_autotune``, ``compile_workers``) change
#             how fast it runs, not what


def target() -> codegen.Target:
    """What the ``triton`` backend's code generator accepts (NOTE [pipeline]); its compile
    workers start now, while lowering runs."""
    if config.compile_workers and not interpreting() and torch.cuda.is_available():
        compile_workers.pool(config.compile_workers)
    return codegen.Target(supported_ops(), TRITON_DTYPES, split_reductions=True)
