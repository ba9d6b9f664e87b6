"""The C++ backend: a LoopProgram becomes one C++/OpenMP source, built into a shared library
(cached on disk) and driven from Python through ctypes.

NOTE [C++ code generation]
Each ``Kernel`` is one ``extern "C"`` function whose parameters are its buffers (``const``
where only read). Its outer loops (``x0..``) run under ``#pragma omp parallel for`` (collapsed
over all but the innermost loop of a pointwise kernel, over all outer loops of a reduction)
unless the domain is too small to pay for a thread team; innermost loops are plain counted
loops over contiguous loads, which ``-O3 -march=native`` vectorizes. Every distinct expression
node is one ``const T tN = ...;`` local of its exact C type, so narrow integer math (which C++
promotes to ``int``) is narrowed back at every step, as torch does. Signed overflow wraps
(``-fwrapv`` in the default flags), as torch's does in practice.

A reduction kernel, per outer point, initialises one accumulator per ``Reduce`` node, runs the
reduction loops (``r0..``) evaluating every Reduce body and combining, then evaluates the
stores, whose values may combine several reductions with pointwise math (epilogues). float32
sums and products accumulate in double. Where every reduction is a sum or product, the
innermost reduction loop is ``omp simd`` (and, for a kernel with no outer loops, the outermost
reduction loop is the parallel one).

Elementwise semantics are torch's, through small templated helpers in ``_PRELUDE``: they cover
what C++ operators get wrong (Python-signed ``remainder``, NaN-propagating ``maximum``,
integer ``pow`` with negative exponents, out-of-range shifts, rounding functions on integers,
float-to-narrow-int conversion through int32 as torch's scalar cast compiles, so a vectorized
saturating pack never changes an out-of-range value). Integer division (``div``, ``fmod``,
``remainder``) by zero and an indirect load's position out of range (a gather's index) raise
in eager; a kernel records them in a flag that its launch step turns into ``CheckError`` after
the kernel (NOTE [kernel errors] in codegen.py; the flag is per library, so concurrent calls
of one program share it).

Dtypes: float32/64, int8/16/32/64, uint8 and bool have C types. Lowering is told so
(``supported_dtypes``) and makes anything else (float16, bfloat16, complex) an ``Extern``,
which runs torch on whole buffers; a Kernel that still names another dtype is a lowering bug
and raises ``BackendError``.
The library is built and cached by the toolchain (toolchain.py, NOTE [C++ build cache]).
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import math
import os
from collections.abc import Sequence

import torch

from ..errors import BackendError
from ..graph.loops import (Apply, Constant, IndexValue, Kernel, Load, Reduce, children,
                           column_wise, is_inner, levels, loop_vars, walk)
from ..graph.types import numel_hint
from . import codegen, cpp_wrapper
from .codegen import (INFIX, INT_DIVISIONS, KERNEL_NAME, IndexPrinter, kernel_error,
                      kernel_symbols, with_error_codes)
from .toolchain import CPP_DTYPES, Library, build, ctype

# op -> C++ expression: {0}, {1}, {2} are the operands' locals, {T} the result's C type.
_STD_MATH = ("acos acosh asin asinh atan atanh cbrt cos cosh erf erfc exp exp2 expm1 lgamma "
             "log log10 log1p log2 sin sinh sqrt tan tanh").split()
_UNARY_HELPERS = "abs bitwise_not ceil floor trunc round sign".split()
_BINARY_HELPERS = ("div fmax fmin gcd maximum minimum fmod remainder pow shift_left "
                   "shift_right_arithmetic").split()
CPP_OPS: dict[str, str] = {
    **{op: f"std::{op}({{0}})" for op in _STD_MATH + ["isfinite", "signbit"]},
    **{op: f"std::{op}({{0}}, {{1}})" for op in ("atan2", "hypot", "nextafter")},
    **{op: f"plait_{op}({{0}})" for op in _UNARY_HELPERS},
    **{op: f"plait_{op}({{0}}, {{1}})" for op in _BINARY_HELPERS},
    **{op: f"({{0}} {sym} {{1}})" for op, sym in INFIX.items()},
    "neg": "(-{0})",
    "reciprocal": "({T}(1) / {0})",
    "rsqrt": "({T}(1) / std::sqrt({0}))",
    "where": "({0} ? {1} : {2})",
    "convert": "plait_convert<{T}>({0})",
}
# Left out (lowering makes them externs): functions the C++ standard library lacks or
# computes differently (digamma, polygamma, erf_inv, erfcx, ndtri, the Bessel and other
# special functions, igamma/igammac, zeta).


_PRELUDE = r"""// plait C++ kernels: elementwise semantics follow eager PyTorch (see backends/cpp.py).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>

// glibc's vector math (libmvec, <= 4 ulp): declared SIMD so that loops calling these vectorize
// (glibc's own headers declare them only under -ffast-math; -fno-math-errno lets them apply).
#if defined(__x86_64__) && defined(__GLIBC__) && __GLIBC_PREREQ(2, 35)
#define PLAIT_SIMD_MATH(fn) __attribute__((simd("notinbranch"))) float fn##f(float) noexcept; \
  __attribute__((simd("notinbranch"))) double fn(double) noexcept;
#define PLAIT_SIMD_MATH2(fn) __attribute__((simd("notinbranch"))) float fn##f(float, float) noexcept; \
  __attribute__((simd("notinbranch"))) double fn(double, double) noexcept;
extern "C" {
PLAIT_SIMD_MATH(acos) PLAIT_SIMD_MATH(acosh) PLAIT_SIMD_MATH(asin) PLAIT_SIMD_MATH(asinh)
PLAIT_SIMD_MATH(atan) PLAIT_SIMD_MATH(atanh) PLAIT_SIMD_MATH(cbrt) PLAIT_SIMD_MATH(cos)
PLAIT_SIMD_MATH(cosh) PLAIT_SIMD_MATH(erf) PLAIT_SIMD_MATH(erfc) PLAIT_SIMD_MATH(exp)
PLAIT_SIMD_MATH(exp2) PLAIT_SIMD_MATH(expm1) PLAIT_SIMD_MATH(log) PLAIT_SIMD_MATH(log10)
PLAIT_SIMD_MATH(log1p) PLAIT_SIMD_MATH(log2) PLAIT_SIMD_MATH(sin) PLAIT_SIMD_MATH(sinh)
PLAIT_SIMD_MATH(tan) PLAIT_SIMD_MATH(tanh)
PLAIT_SIMD_MATH2(atan2) PLAIT_SIMD_MATH2(hypot) PLAIT_SIMD_MATH2(pow)
}
#endif

template <class T> constexpr bool plait_is_float = std::is_floating_point_v<T>;
template <class T> inline bool plait_isnan(T a) {
  if constexpr (plait_is_float<T>) return std::isnan(a); else return false;
}
template <class T> inline T plait_lowest() {
  if constexpr (plait_is_float<T>) return -std::numeric_limits<T>::infinity();
  else return std::numeric_limits<T>::lowest();
}
template <class T> inline T plait_highest() {
  if constexpr (plait_is_float<T>) return std::numeric_limits<T>::infinity();
  else return std::numeric_limits<T>::max();
}

template <class T> inline T plait_abs(T a) {
  if constexpr (plait_is_float<T>) return std::fabs(a); else return a < 0 ? T(-a) : a;
}
template <class T> inline T plait_bitwise_not(T a) {
  if constexpr (std::is_same_v<T, bool>) return !a; else return T(~a);
}
// Rounding an integer is the identity (std::ceil would go through double).
#define PLAIT_ROUNDING(name, fn) \
  template <class T> inline T name(T a) { if constexpr (plait_is_float<T>) return fn(a); else return a; }
PLAIT_ROUNDING(plait_ceil, std::ceil)
PLAIT_ROUNDING(plait_floor, std::floor)
PLAIT_ROUNDING(plait_trunc, std::trunc)
PLAIT_ROUNDING(plait_round, std::nearbyint)  // half to even, as torch.round
template <class T> inline T plait_sign(T a) { return T((T(0) < a) - (a < T(0))); }  // NaN -> 0

// maximum/minimum propagate NaN; fmax/fmin ignore it.
template <class T> inline T plait_maximum(T a, T b) { return (a > b || plait_isnan(a)) ? a : b; }
template <class T> inline T plait_minimum(T a, T b) { return (a < b || plait_isnan(a)) ? a : b; }
template <class T> inline T plait_fmax(T a, T b) {
  if constexpr (plait_is_float<T>) return std::fmax(a, b); else return std::max(a, b);
}
template <class T> inline T plait_fmin(T a, T b) {
  if constexpr (plait_is_float<T>) return std::fmin(a, b); else return std::min(a, b);
}

// Checks eager raises for are recorded for the launch step (NOTE [kernel errors] in
// codegen.py): an integer division by zero, an indirect load's position out of range (read at 0).
// x / -1 is a negation (INT_MIN / -1 traps on x86).
static int plait_error = 0;
extern "C" int plait_take_error() { return __atomic_exchange_n(&plait_error, 0, __ATOMIC_RELAXED); }
template <class T> inline bool plait_divisor_ok(T b) {
  if (b != 0) return true;
  __atomic_store_n(&plait_error, ERROR_DIVISION_BY_ZERO, __ATOMIC_RELAXED);
  return false;
}
inline int64_t plait_position(int64_t p, int64_t n) {
  if (p >= 0 && p < n) return p;
  __atomic_store_n(&plait_error, ERROR_INDEX_OUT_OF_RANGE, __ATOMIC_RELAXED);
  return 0;
}
template <class T> inline T plait_div(T a, T b) {  // true division of floats, truncating of integers
  if constexpr (plait_is_float<T>) return a / b;
  else {
    if (!plait_divisor_ok(b)) return 0;
    if constexpr (std::is_signed_v<T>) if (b == T(-1)) return T(-a);
    return T(a / b);
  }
}
template <class T> inline T plait_fmod(T a, T b) {  // the sign of a
  if constexpr (plait_is_float<T>) return std::fmod(a, b);
  else {
    if (!plait_divisor_ok(b)) return 0;
    if constexpr (std::is_signed_v<T>) if (b == T(-1)) return 0;
    return T(a % b);
  }
}
template <class T> inline T plait_remainder(T a, T b) {  // the sign of b, as Python's %
  T r = plait_fmod(a, b);
  return (r != 0 && ((r < 0) != (b < 0))) ? T(r + b) : r;
}
template <class T> inline T plait_gcd(T a, T b) {  // torch's Euclid: gcd(INT_MIN, x) may be < 0
  a = plait_abs(a), b = plait_abs(b);
  while (a != 0) { T c = a; a = T(b % a); b = c; }
  return b;
}
template <class T> inline T plait_pow(T a, T b) {
  if constexpr (plait_is_float<T>) return std::pow(a, b);
  else {
    if constexpr (std::is_signed_v<T>)
      if (b < 0) return a == 1 ? T(1) : a == T(-1) ? T((b & 1) ? -1 : 1) : T(0);
    T r = 1;
    for (; b; b >>= 1, a = T(a * a)) if (b & 1) r = T(r * a);
    return r;
  }
}
// Shifts by a negative amount or by the width or more: 0 to the left, the sign to the right.
template <class T> inline T plait_shift_left(T a, T b) {
  constexpr int bits = sizeof(T) * 8;
  if ((std::is_signed_v<T> && b < 0) || b >= bits) return 0;
  return T(std::make_unsigned_t<T>(a) << b);
}
template <class T> inline T plait_shift_right_arithmetic(T a, T b) {
  constexpr int bits = sizeof(T) * 8;
  if ((std::is_signed_v<T> && b < 0) || b >= bits) return std::is_signed_v<T> ? T(a >> (bits - 1)) : T(0);
  return T(a >> b);
}
template <class To, class From> inline To plait_convert(From a) {
  if constexpr (std::is_same_v<To, bool>) return a != From(0);
  else if constexpr (plait_is_float<From> && std::is_integral_v<To> && sizeof(To) < 4) return To(int32_t(a));
  else return To(a);
}
"""

# NOTE [row invariants]
# In a kernel reducing over rows (not column-wise), the loops over the rows are innermost and
# vectorized; a value that no row changes (a target's index and the weight it selects in a
# cross-entropy's gradient, a per-row reciprocal) is computed once per row, before them.
# GCC hoists such values itself, but not out of a select: a float select on an int64
# comparison of two invariant operands left "control flow in loop", and the whole loop
# (cross-entropy's gradient: its exps) ran scalar. Values taking a reduction's result stay
# in the pass that has it.

# NOTE [point invariants]
# The innermost loop is the vectorized one; where others run outside it, a value of the
# innermost point alone would be computed again at each of their iterations: a BatchNorm's
# per-channel scale, 1 / sqrt(var / n + eps), at every pixel of a channels-last activation,
# or, in a column-wise kernel (NOTE [column-wise reductions]), at every row of its backward's
# column sums. Such values, where they take a costly op, are computed once per point into
# arrays before those loops: for a pointwise kernel once per call (an innermost loop of at
# most _MAX_INVARIANT_POINTS), for a column-wise one once per chunk.
_COSTLY = frozenset(_STD_MATH + ["div", "pow", "reciprocal", "rsqrt", "fmod", "remainder"])
_MAX_INVARIANT_POINTS = 4096
_MAX_INVARIANTS = 16  # arrays on the stack

# reduction op -> (accumulator's initial value, update statement); {T}: the accumulator's type
_REDUCTIONS = {
    "sum": ("0", "{acc} += {v};"),
    "prod": ("1", "{acc} *= {v};"),
    "amax": ("plait_lowest<{T}>()", "{acc} = plait_maximum({acc}, {v});"),
    "amin": ("plait_highest<{T}>()", "{acc} = plait_minimum({acc}, {v});"),
    # the first extreme index; NaN beats every number, as in torch
    "argmax": ("plait_lowest<{T}>()", "if ({v} > {acc} || (plait_isnan({v}) && !plait_isnan("
               "{acc}))) {{ {acc} = {v}; {acc}_index = {r}; }}"),
    "argmin": ("plait_highest<{T}>()", "if ({v} < {acc} || (plait_isnan({v}) && !plait_isnan("
               "{acc}))) {{ {acc} = {v}; {acc}_index = {r}; }}"),
}
_SIMD_REDUCTIONS = {"sum": "+", "prod": "*"}
_PARALLEL_MIN_WORK = 1 << 15  # loop iterations below which a thread team costs more than it saves


def _stored_by_the_reductions(passes: list, inner: list) -> bool:
    """Do the reductions' ``passes`` make the kernel's ``inner`` stores, none of which reads
    a reduction's result (a GELU's gradient stored and summed for its bias's): in the last
    pass, after its updates, rather than in a pass of their own that computes their values
    again? In place too (NOTE [memory passes]): a store's buffer is read at its own index
    alone, before the store, in that pass and in the passes before it."""
    return bool(passes and inner) and not any(
        isinstance(e, Reduce) for s in inner for e in walk(s.value))


# ---------------------------------------------------------------------------------------
# Printing expressions
# ---------------------------------------------------------------------------------------
def _int(n) -> str:
    if not isinstance(n, int):  # a size expression (NOTE [symbolic sizes]): its parameters
        return _index(n)
    if n == -(1 << 63):
        return "(-9223372036854775807LL - 1)"
    return str(n) if -(1 << 31) < n < (1 << 31) else f"{n}LL"


class _CppIndex(IndexPrinter):
    language = "C++"
    floordiv, floordiv_fn, mod_fn = "/", "plait_floordiv", "plait_mod"  # / truncates
    min_fn, max_fn = "std::min<int64_t>", "std::max<int64_t>"

    def integer(self, n: int) -> str:
        return _int(n)


_index = _CppIndex()
_INDEX_HELPERS = r"""
// Index arithmetic on possibly negative values: floor division and a modulo with the
// divisor's sign, as sympy's floor and Mod.
inline int64_t plait_floordiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
inline int64_t plait_mod(int64_t a, int64_t b) {
  int64_t r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
"""


def _literal(value, dtype: torch.dtype) -> str:
    t = ctype(dtype)
    if dtype == torch.bool:
        return "true" if value else "false"
    if dtype.is_floating_point:
        value = float(value)
        if math.isnan(value):
            return f"std::numeric_limits<{t}>::quiet_NaN()"
        if math.isinf(value):
            return f"{'-' if value < 0 else ''}std::numeric_limits<{t}>::infinity()"
        return f"{t}({value.hex()})"  # exact; rounded to float32 as torch rounds constants
    return f"{t}({_int(int(value))})"


class _Scope:
    """Emits expression nodes as C++ locals, each distinct node once, operands first."""

    def __init__(self, kernel: "_KernelWriter", lines: list[str], indent: str, bound: dict):
        self.kernel, self.lines, self.indent, self.names = kernel, lines, indent, dict(bound)

    def value(self, e) -> str:
        if e in self.names:
            return self.names[e]
        if isinstance(e, Reduce):
            raise BackendError(f"kernel {self.kernel.kernel.name}: a {e.op} reduction inside "
                               "another reduction or in a kernel without reduction loops")
        args = [self.value(c) for c in children(e)]
        t = ctype(e.dtype)
        if isinstance(e, Load):
            code = f"{self.kernel.param(e.buffer)}[{self.index(e, args)}]"
        elif isinstance(e, Constant):
            code = _literal(e.value, e.dtype)
        elif isinstance(e, IndexValue):
            code = f"static_cast<{t}>({_index(e.expr)})"
        elif isinstance(e, Apply):
            if e.op not in CPP_OPS:
                raise BackendError(f"the cpp backend has no C++ form of {e.op!r}; lowering "
                                   "should have made it an extern")
            code = CPP_OPS[e.op].format(*args, T=t)
            if e.op in INT_DIVISIONS and not e.dtype.is_floating_point:
                self.kernel.checks_error = True
        else:
            raise BackendError(f"unknown loop IR node {e!r}")
        self.names[e] = name = self.local(t, code)
        return name

    def local(self, t: str, code: str) -> str:
        name = f"t{self.kernel.count}"
        self.kernel.count += 1
        self.lines.append(f"{self.indent}const {t} {name} = {code};")
        return name

    def index(self, e: Load, positions: list[str]) -> str:
        """The load's index, its indirect positions (``i0..``) checked into range (NOTE
        [kernel errors])."""
        if not e.indirect:
            return _index(e.index)
        self.kernel.checks_error = True
        names = {f"i{k}": self.local("int64_t", f"plait_position({p}, {_int(n)})")
                 for k, (p, (_, n)) in enumerate(zip(positions, e.indirect))}
        return _CppIndex(names)(e.index)


class _KernelWriter:
    def __init__(self, kernel: Kernel, aliases: dict | None = None):
        self.kernel, self.name = kernel, KERNEL_NAME
        # buffers of this kernel that share storage (in-place reuse) are not __restrict__
        shared = {(b, t) for b, t in (aliases or {}).items()}
        self.shared = {b for pair in shared for b in pair if set(pair) <= set(
            kernel.reads + kernel.writes)}
        self.count, self.checks_error = 0, False
        self.buffers = tuple(dict.fromkeys(kernel.reads + kernel.writes))  # parameter order
        self.params = {b: f"arg{n}" for n, b in enumerate(self.buffers)}
        self.symbols = kernel_symbols(kernel)  # its size symbols: parameters after the buffers
        self.columns = column_wise(kernel)

    def param(self, buffer: str) -> str:
        return self.params[buffer]

    def source(self, buffer_types: dict) -> str:
        k = self.kernel
        decls = []
        for b in self.buffers:
            written, read = b in k.writes, b in k.reads
            const = "" if written else "const "
            restrict = "" if (written and read) or b in self.shared else " __restrict__"
            decls.append(f"{const}{ctype(buffer_types[b].dtype)}*{restrict} {self.params[b]}")
        decls += [f"const int64_t {s.name}" for s in self.symbols]
        lines = [f'extern "C" void {self.name}({", ".join(decls)}) {{']
        passes = levels(*(s.value for s in k.stores))
        inner = [s for s in k.stores if is_inner(s)]
        made = inner if _stored_by_the_reductions(passes, inner) else []
        # every sweep over the points is work (a softmax's max, sum and stores: three)
        sweeps = max(1, len(passes) + bool(inner and not made))
        work = numel_hint(k.sizes) * max(1, numel_hint(k.reduction_sizes)) * sweeps
        parallel = work >= _PARALLEL_MIN_WORK
        xs = [f"x{i}" for i in range(len(k.sizes))]
        # a pointwise kernel keeps its innermost loop out of the collapse, for vectorization
        n_parallel = len(xs) if k.reduction_sizes or len(xs) < 2 else len(xs) - 1
        indent = "  "
        bound: dict = {}
        if not k.reduction_sizes and numel_hint(k.sizes[:-1]) > 1 and \
                isinstance(k.sizes[-1], int) and k.sizes[-1] <= _MAX_INVARIANT_POINTS:
            bound = self._invariants(lines, indent, set(loop_vars("x", len(xs) - 1)), "0",
                                     _int(k.sizes[-1]), k.sizes[-1])
        for i, (x, n) in enumerate(zip(xs, k.sizes)):
            if i == 0 and parallel and n_parallel:
                collapse = f" collapse({n_parallel})" if n_parallel > 1 else ""
                lines.append(f"{indent}#pragma omp parallel for{collapse}")
            if self.columns and i == len(xs) - 1:  # NOTE [column-wise reductions]
                lines += [f"{indent}for (int64_t xb = 0; xb < {_int(n)}; xb += {_COLUMNS}) {{",
                          f"{indent}  const int64_t xe = std::min<int64_t>(xb + {_COLUMNS}, "
                          f"{_int(n)});"]
            else:
                lines.append(f"{indent}for (int64_t {x} = 0; {x} < {_int(n)}; ++{x}) {{")
            indent += "  "
        for s in k.stores:
            if s.value.dtype != buffer_types[s.buffer].dtype:
                raise BackendError(f"kernel {k.name} stores a {s.value.dtype} value into "
                                   f"{s.buffer} of {buffer_types[s.buffer].dtype}")
        if self.columns:
            bound = self._invariants(lines, indent, set(loop_vars("r", len(
                k.reduction_sizes))), "xb", "xe", _COLUMNS)
        elif k.reduction_sizes:
            bound |= self._row_invariants(lines, indent)
        self.stashes = {} if made else self._stashes(passes, inner)
        for j, level in enumerate(passes):  # each a pass over the rows
            bound |= self._reduction(level, bound, lines, indent, parallel and not xs,
                                     made if j == len(passes) - 1 else [])
        if inner and not made:  # one more pass over the rows, storing per point
            self._row_loop(lines, indent, bound, inner, parallel and not xs)
        outer = [s for s in k.stores if not is_inner(s)]
        body = self._point_loop(lines, indent) if outer else indent
        scope = _Scope(self, lines, body, bound)
        for s in outer:
            lines.append(f"{body}{self.params[s.buffer]}[{_index(s.index)}] = "
                         f"{scope.value(s.value)};")
        if self.columns and outer:
            lines.append(f"{indent}}}")
        for _ in xs:
            indent = indent[:-2]
            lines.append(f"{indent}}}")
        lines.append("}")
        return "\n".join(lines)

    def _row_loop(self, lines, indent, bound, stores, parallel: bool) -> None:
        k = self.kernel
        inner = indent
        rows = _row_vars(k)
        for i, (r, n) in enumerate(zip(rows, k.reduction_sizes)):
            if i == 0 and parallel:
                lines.append(f"{inner}#pragma omp parallel for")
            elif i == len(rows) - 1 and not self.columns:  # points stored independently
                lines.append(f"{inner}#pragma omp simd")
            lines.append(f"{inner}for (int64_t {r} = 0; {r} < {_int(n)}; ++{r}) {{")
            inner += "  "
        inner = self._point_loop(lines, inner)
        scope = _Scope(self, lines, inner, bound)
        for red, s in self.stashes.items():  # read back before any store overwrites them
            scope.names[red.body] = scope.local(ctype(red.body.dtype),
                                                f"{self.params[s.buffer]}[{_index(s.index)}]")
        for s in stores:
            lines.append(f"{inner}{self.params[s.buffer]}[{_index(s.index)}] = "
                         f"{scope.value(s.value)};")
        for _ in range(len(k.reduction_sizes) + bool(self.columns)):
            inner = inner[:-2]
            lines.append(f"{inner}}}")

    def _stashes(self, passes: list, inner: list) -> dict:
        """NOTE [stashed reduction bodies]: a row store whose value uses the body of a
        reduction over the same points (softmax's exp(x - max), summed and then divided) can
        keep that body in its own output during the reduction's pass and read it back in the
        storing pass, instead of computing it again, where the body is costly (a math
        function) and the output buffer is this store's alone: written by no other store,
        read by no load, sharing no memory with the kernel's other buffers. Reduction ->
        the store that stashes its body."""
        k = self.kernel
        loaded = {e.buffer for s in k.stores for e in walk(s.value) if isinstance(e, Load)}
        writes = [s.buffer for s in k.stores]
        stashes: dict = {}
        for s in inner:
            if s.buffer in loaded or s.buffer in self.shared or writes.count(s.buffer) > 1:
                continue
            nodes = set(walk(s.value))
            costly = [red for level in passes for red in level
                      if red.body in nodes and red not in stashes
                      and red.body.dtype == s.value.dtype
                      and any(isinstance(e, Apply) and e.op in _STD_MATH + ["pow"]
                              for e in walk(red.body))]
            if costly:
                stashes[max(costly, key=lambda red: len(walk(red.body)))] = s
        return stashes

    def _row_invariants(self, lines: list, indent: str) -> dict:
        """NOTE [row invariants]: the values of a row kernel's loops over its rows that no
        row changes, none taking a reduction's result, each computed once per row before
        those loops; node -> its local."""
        rows = set(loop_vars("r", len(self.kernel.reduction_sizes)))
        scope = _Scope(self, lines, indent, {})
        return {e: scope.value(e) for e in _invariant_operands(self.kernel, rows)
                if not isinstance(e, Constant)}

    def _invariants(self, lines: list, indent: str, varying: set, first: str, extent: str,
                    size: int) -> dict:
        """NOTE [point invariants]: the costly values that no loop variable in ``varying``
        changes, each computed once per point of the innermost loop (from ``first``, over
        ``extent`` points) into an array of ``size``; node -> its element."""
        k = self.kernel
        costly: dict = {}  # node -> does computing it take a costly op
        for e in walk(*(s.value for s in k.stores)):
            costly[e] = (isinstance(e, Apply) and e.op in _COSTLY) or any(
                costly[c] for c in children(e))
        hoisted = [e for e in _invariant_operands(k, varying) if costly[e]][:_MAX_INVARIANTS]
        if not hoisted:
            return {}
        x = f"x{len(k.sizes) - 1}"
        point = f"{x} - {first}" if first != "0" else x
        names = {e: f"c{self.count + j}" for j, e in enumerate(hoisted)}
        self.count += len(hoisted)
        lines += [f"{indent}{ctype(e.dtype)} {name}[{size}];" for e, name in names.items()]
        lines += [f"{indent}#pragma omp simd",
                  f"{indent}for (int64_t {x} = {first}; {x} < {extent}; ++{x}) {{"]
        scope = _Scope(self, lines, indent + "  ", {})
        lines += [f"{indent}  {name}[{point}] = {scope.value(e)};" for e, name in names.items()]
        lines.append(f"{indent}}}")
        return {e: f"{name}[{point}]" for e, name in names.items()}

    def _point_loop(self, lines: list, indent: str) -> str:
        """In column mode, the loop over the chunk's points, innermost and vectorized."""
        if not self.columns:
            return indent
        x = f"x{len(self.kernel.sizes) - 1}"
        lines += [f"{indent}#pragma omp simd",
                  f"{indent}for (int64_t {x} = xb; {x} < xe; ++{x}) {{"]
        return indent + "  "

    def _reduction(self, reduces: list, bound: dict, lines: list, indent: str,
                   parallel: bool, stores: list) -> dict:
        """Emit the accumulators and one pass of the reduction loops for ``reduces`` (whose
        bodies may use the ``bound`` results of earlier passes), making ``stores`` after its
        updates at each point; return each reduction's result."""
        k = self.kernel
        updates, results = [], {}
        clauses: dict[str, list[str]] = {}
        rs = _row_vars(k)
        flat = " + ".join(f"{r} * {_int(math.prod(k.reduction_sizes[i + 1:]))}"
                          for i, r in enumerate(rs))
        # column mode: one accumulator per point of the chunk, indexed by the point loop
        point = f"[x{len(k.sizes) - 1} - xb]" if self.columns else ""
        array = f"[{_COLUMNS}]" if self.columns else ""
        for i, red in enumerate(reduces):
            if red.op not in _REDUCTIONS:
                raise BackendError(f"kernel {k.name}: unknown reduction {red.op!r}")
            acc, body_t = f"acc{self.count}", ctype(red.body.dtype)
            self.count += 1
            acc_t = "double" if red.body.dtype == torch.float32 and red.op in (
                "sum", "prod") else body_t
            init, update = _REDUCTIONS[red.op]
            lines.append(f"{indent}{acc_t} {acc}[{_COLUMNS}];" if array else
                         f"{indent}{acc_t} {acc} = {init.format(T=acc_t)};")
            if array:
                lines.append(f"{indent}std::fill_n({acc}, {_COLUMNS}, {init.format(T=acc_t)});")
            if red.op.startswith("arg"):
                lines.append(f"{indent}int64_t {acc}_index = 0;")
                results[red] = f"{acc}_index"
            else:
                results[red] = f"static_cast<{ctype(red.dtype)}>({acc}{point})"
            if red.op in ("amax", "amin") and acc_t != "bool":
                # NOTE [vectorized extrema]: a plain max/min (which the compiler vectorizes)
                # and a separate "saw a NaN" flag, instead of a NaN-propagating combine; the
                # flag an int OR-ed (GCC vectorizes no loop reducing a bool with ||: a
                # softmax's max ran scalar, 3.6x slower)
                update = f"{{acc}} = ({{v}} {'>' if red.op == 'amax' else '<'} {{acc}}) " \
                         "? {v} : {acc};"
                clauses.setdefault("max" if red.op == "amax" else "min", []).append(acc)
                if red.body.dtype.is_floating_point:
                    lines.append(f"{indent}int {acc}_nan{array} = {{}};")
                    update += " {nan} |= ({v} != {v});"
                    clauses.setdefault("|", []).append(f"{acc}_nan")
                    results[red] = (f"static_cast<{ctype(red.dtype)}>({acc}_nan{point} ? "
                                    f"std::numeric_limits<{acc_t}>::quiet_NaN() : "
                                    f"{acc}{point})")
            updates.append((red, acc, update))
            if red.op in _SIMD_REDUCTIONS and acc_t != "bool":
                clauses.setdefault(_SIMD_REDUCTIONS[red.op], []).append(acc)
        # simd/parallel reduction clauses only if every accumulator has one
        covered = {a.removesuffix("_nan") for accs in clauses.values() for a in accs}
        clause = " ".join(f"reduction({op}:{', '.join(a)})" for op, a in clauses.items()) \
            if len(covered) == len(reduces) and not self.columns else ""
        inner = indent
        for i, (r, n) in enumerate(zip(rs, k.reduction_sizes)):
            last = i == len(rs) - 1
            if clause and i == 0 and parallel:
                lines.append(f"{inner}#pragma omp parallel for{' simd' if last else ''} {clause}")
            elif clause and last:
                lines.append(f"{inner}#pragma omp simd {clause}")
            lines.append(f"{inner}for (int64_t {r} = 0; {r} < {_int(n)}; ++{r}) {{")
            inner += "  "
        inner = self._point_loop(lines, inner)
        body = _Scope(self, lines, inner, bound)
        for red, acc, update in updates:
            lines.append(inner + update.format(acc=acc + point, nan=f"{acc}_nan{point}",
                                               v=body.value(red.body), r=flat))
            if red in self.stashes:  # NOTE [stashed reduction bodies]
                s = self.stashes[red]
                lines.append(f"{inner}{self.params[s.buffer]}[{_index(s.index)}] = "
                             f"{body.value(red.body)};")
        for s in stores:
            lines.append(f"{inner}{self.params[s.buffer]}[{_index(s.index)}] = "
                         f"{body.value(s.value)};")
        for _ in range(len(rs) + bool(self.columns)):
            inner = inner[:-2]
            lines.append(f"{inner}}}")
        if self.columns:  # the results are read per point, in the later point loops
            return results
        for red, acc, _ in updates:  # each result once, as a local of its own
            lines.append(f"{indent}const {ctype(red.dtype)} {acc}_out = {results[red]};")
            results[red] = f"{acc}_out"
        return results


def _invariant_operands(kernel: Kernel, varying: set) -> list:
    """The operands that no loop of ``varying`` changes of the kernel's values that those
    loops do change (a reduction's result counts as changing; its body stays inside it),
    operands first."""
    varies: dict = {}
    for e in walk(*(s.value for s in kernel.stores)):
        index = e.index if isinstance(e, Load) else e.expr if isinstance(e, IndexValue) else None
        own = isinstance(e, Reduce) or (index is not None and bool(varying & index.free_symbols))
        varies[e] = own or any(varies[c] for c in children(e))
    return list(dict.fromkeys(c for e, changes in varies.items()
                              if changes and not isinstance(e, Reduce)
                              for c in children(e) if not varies[c]))


def _row_vars(kernel) -> list[str]:
    return [f"r{i}" for i in range(len(kernel.reduction_sizes))]


# NOTE [column-wise reductions]
# A reduction over a strided dim whose points are contiguous along the last kept dim (the
# column sums of a bias gradient: rows of stride n, points of stride 1) would read memory
# with a stride in its vectorized reduction loop. Such a kernel instead runs chunks of
# _COLUMNS points of the last kept dim: per chunk, one accumulator per point (arrays), the
# reduction loops outside and the point loop inside, contiguous and vectorized; later passes
# and the stores loop over the chunk's points the same way.
_COLUMNS = 64
KERNELS_PER_LIBRARY = 16  # fewest distinct kernels a library is built for (CompiledProgram.load)


# ---------------------------------------------------------------------------------------
# The compiled program
# ---------------------------------------------------------------------------------------
class CompiledProgram(codegen.CompiledProgram):
    """A LoopProgram as one C++ library and the shared wrapper (backends/codegen.py, NOTE
    [wrapper memory]) that calls its kernels through ctypes."""

    def write(self, kernel: Kernel):
        w = _KernelWriter(kernel, self.program.aliases)
        return w, w.source({b: self.program.buffers[b].type for b in w.buffers})

    def load(self, texts: list[str]) -> str:
        """The distinct kernels' source, built as one library, or, for a program of many
        kernels, as a library per core built in parallel (each compiler also parses the
        prelude, so a library takes ``KERNELS_PER_LIBRARY`` kernels at least). The C++ wrapper,
        where it applies, joins the first library (NOTE [C++ wrapper])."""
        prelude = with_error_codes(_PRELUDE) + _INDEX_HELPERS
        names = list(dict.fromkeys(w.name for w in self.writers.values()))  # as ``texts``
        parts = max(1, min(os.cpu_count() or 1, len(texts) // KERNELS_PER_LIBRARY))
        chunks = [(texts[j::parts], names[j::parts]) for j in range(parts)]
        self.native = cpp_wrapper.generate(
            self.program, self.plan, self.writers, self.bodies) \
            if cpp_wrapper.applies(self.program, self.plan) else None
        if self.native is not None:
            chunks[0] = ([*chunks[0][0], self.native.source], [*chunks[0][1], "plait_program"])
        kernels = "\n\n".join([prelude, *texts]) + "\n"
        self.cpp_source = kernels + (f"\n{self.native.source}\n" if self.native else "")
        with concurrent.futures.ThreadPoolExecutor(parts + 1) as pool:  # g++ outside the GIL
            if self.native is not None:
                pool.submit(cpp_wrapper.memory)  # the wrapper's, on first use: alongside
                if self.native.uses_runtime:
                    cpp_wrapper.runtime_future()  # in the background: nothing waits for it
            libraries = list(pool.map(
                lambda chunk: build("\n\n".join([prelude, *chunk[0]]) + "\n", chunk[1]), chunks))
        self._library_of = {n: lib for lib, (_, ns) in zip(libraries, chunks) for n in ns}
        return kernels  # the wrapper's listing follows

    def launch(self, i: int, k: Kernel, slot: dict):
        w = self.writers[i]
        call = _KernelCall(self._library_of[w.name], w.name, tuple(slot[b] for b in w.buffers),
                           w.checks_error, w.symbols, slot.get(codegen.SIZES))
        return call, f"{w.name}({', '.join((*w.buffers, *map(str, w.symbols)))})"

    def wrap(self, program, plan):
        """The C++ wrapper where it applies (NOTE [C++ wrapper]), else the Python one."""
        wrapper = super().wrap(program, plan)
        if self.native is None:
            return wrapper
        try:
            return cpp_wrapper.NativeWrapper.of(program, plan, self.native, self._library_of,
                                                wrapper)
        except BackendError as e:  # its memory library does not build (no torch headers?)
            cpp_wrapper.warn_off(e)
            return wrapper

    def listing(self, wrapper_source: str) -> str:
        if self.native is not None:
            return "\n" + wrapper_source + "\n"
        return "\n/* Python wrapper:\n" + wrapper_source + "\n*/\n"

    @functools.cached_property
    def runner(self) -> codegen.Runner:
        return codegen.Runner(self._wrapper, self._constants, _CPU)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.runner(inputs)


class _KernelCall:
    """A wrapper step calling one kernel of the library on its buffers' pointers; it pickles
    as the library and the kernel's name (NOTE [program cache])."""

    def __init__(self, library: Library, cname: str, args: tuple[int, ...], checks_error: bool,
                 symbols: tuple = (), sizes: int | None = None):
        self._reduce = (_KernelCall, (library, cname, args, checks_error, symbols, sizes))
        self.fn, self.args = getattr(library.cdll, cname), args
        self.symbols, self.sizes = symbols, sizes  # its size parameters, from env[sizes]
        self.fn.argtypes = [ctypes.c_void_p] * len(args) + [ctypes.c_int64] * len(symbols)
        self.fn.restype = None
        self.take_error = library.cdll.plait_take_error if checks_error else None

    def __reduce__(self):
        return self._reduce

    def __call__(self, env, device):
        if self.symbols:
            values = env[self.sizes]
            self.fn(*[env[s].data_ptr() for s in self.args], *[values[s] for s in self.symbols])
        else:
            self.fn(*[env[s].data_ptr() for s in self.args])
        if self.take_error is not None and (code := self.take_error()):
            raise kernel_error(code)


_CPU = torch.device("cpu")


# the settings its code reads, which join the cache key (NOTE [sanitized builds])
READS = ("cpp_compiler", "cpp_flags", "cpp_wrapper", "cpp_sanitize")


def target() -> codegen.Target:
    """What the ``cpp`` backend's code generator accepts (NOTE [pipeline])."""
    return codegen.Target(frozenset(CPP_OPS), CPP_DTYPES)
