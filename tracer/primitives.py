"""The primitive set: every op a graph can contain, each with all of its rules side by side.

NOTE [primitive set]
Primitives are strict, in the style of ``jax.lax`` and ``torch._prims``: elementwise
primitives take operands of one shape and one dtype; broadcasting and type promotion happen
while tracing (``tracer/aten.py``), where they match eager PyTorch exactly. So every rule
here is short, and later stages (autodiff, batching, lowering) see a small, regular set.

A ``Primitive`` holds, next to each other:
  * ``infer``: operand types + params -> output types (raises ShapeError on a mismatch);
  * ``impl``: the eager implementation on torch tensors (the reference semantics);
  * ``jvp`` / ``transpose`` / ``batch`` / ``lower``: transform and lowering rules, attached
    by the modules that implement those stages, one per primitive.
Elementwise families are tables: one row per primitive, one shared rule per family.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import attrs
import torch

from ..errors import CheckError, GraphError, ShapeError
from ..graph.types import TensorType

prims = torch.ops.prims


@attrs.define(eq=False)
class Primitive:
    name: str
    infer: Callable[..., tuple[TensorType, ...]] | None
    impl: Callable[..., Any]
    multiple_results: bool = False
    # Effectful primitives are never removed, merged, folded or reordered.
    effectful: bool = False
    jvp: Callable | None = None
    transpose: Callable | None = None
    batch: Callable | None = None
    lower: Callable | None = None

    def __repr__(self) -> str:
        return f"<primitive {self.name}>"


PRIMITIVES: dict[str, Primitive] = {}


def get_primitive(name: str) -> Primitive:
    try:
        return PRIMITIVES[name]
    except KeyError:
        raise GraphError(f"unknown primitive {name!r}") from None


def define(name: str, infer, impl, **kwargs) -> Primitive:
    assert name not in PRIMITIVES, name
    PRIMITIVES[name] = prim = Primitive(name, infer, impl, **kwargs)
    return prim


def _types(*shape_dtype_device) -> tuple[TensorType, ...]:
    return tuple(TensorType(s, d, dev) for s, d, dev in shape_dtype_device)


def _check(ok: bool, prim: str, message: str, *types: TensorType) -> None:
    if not ok:
        raise ShapeError(f"{prim}: {message}; operand types: {', '.join(map(str, types))}")


def _norm_dims(dims, ndim: int, prim: str) -> tuple[int, ...]:
    out = []
    for d in dims:
        if not -max(ndim, 1) <= d < max(ndim, 1):
            raise ShapeError(f"{prim}: dimension {d} out of range for a rank-{ndim} operand")
        out.append(d % max(ndim, 1))
    return tuple(out)


# ---------------------------------------------------------------------------------------
# Graph plumbing: inputs, constants, opaque torch calls
# ---------------------------------------------------------------------------------------
define("input", None, None)
define("constant", lambda *, value: _types((value.tensor.shape, value.tensor.dtype,
                                            str(value.tensor.device))),
       lambda *, value: value.tensor)


def _opaque_impl(*tensors, op, template, out_types):
    args, kwargs = _fill_template(template, [t.contiguous() for t in tensors])
    out = op(*args, **kwargs)
    return tuple(out) if isinstance(out, (tuple, list)) else () if out is None else (out,)


def _fill_template(template, tensors):
    def fill(x):
        if isinstance(x, OperandSlot):
            return tensors[x.index]
        if isinstance(x, tuple):
            return type(x)(fill(v) for v in x) if not hasattr(x, "_fields") else x
        return x

    args, kwargs = template
    return [fill(a) for a in args], {k: fill(v) for k, v in kwargs}


@attrs.frozen
class OperandSlot:
    """Marks where the i-th tensor operand goes in an opaque op's argument template."""

    index: int

    def __repr__(self) -> str:
        return f"${self.index}"


def _check_impl(failed, *, message):
    if bool(failed.any()):
        raise CheckError(message)
    return ()


# A run-time check: raises CheckError when any element of its bool operand is true, where
# eager raises on the data (no result; effectful, so it always runs).
define("check", lambda failed, *, message: (), _check_impl, multiple_results=True,
       effectful=True)


# An opaque node calls a torch op that has no decomposition: correct, but a black box for
# fusion and (for now) transforms. Its output types were computed from the op's meta kernel.
define("opaque", lambda *types, op, template, out_types: out_types, _opaque_impl,
       multiple_results=True)


# ---------------------------------------------------------------------------------------
# Elementwise
# ---------------------------------------------------------------------------------------
def _elementwise_infer(name: str, out_dtype: torch.dtype | Callable | None):
    """``out_dtype``: a fixed dtype, a function of the operand dtype, or None (the same)."""
    def infer(*types: TensorType):
        first = types[0]
        for t in types[1:]:
            _check(t.shape == first.shape, name, "operands must have one shape", *types)
            _check(t.dtype == first.dtype, name, "operands must have one dtype", *types)
        dtype = out_dtype(first.dtype) if callable(out_dtype) else out_dtype or first.dtype
        return (TensorType(first.shape, dtype, first.device),)

    return infer


def _real_of(dtype: torch.dtype) -> torch.dtype:
    return dtype.to_real() if dtype.is_complex else dtype


# Where a public torch function computes exactly what the prim defines (operands of one
# dtype and shape), call it: the prims' own Python implementations cost ~25 us per call.
_TORCH_EQUIVALENT = set(
    "abs acos acosh asin asinh atan atanh bitwise_not ceil cos cosh digamma erf erfc exp exp2 "
    "expm1 floor lgamma log log10 log1p log2 neg reciprocal round rsqrt sign sin sinh sqrt tan "
    "tanh trunc add sub mul atan2 bitwise_and bitwise_or bitwise_xor fmax fmin fmod hypot "
    "maximum minimum nextafter pow remainder eq ne lt le gt ge isfinite signbit".split())


def _prim_impl(name: str):
    return getattr(torch, name) if name in _TORCH_EQUIVALENT else getattr(prims, name).default


UNARY = ("abs acos acosh asin asinh atan atanh bessel_i0 bessel_i0e bessel_i1 bessel_i1e "
         "bessel_j0 bessel_j1 bitwise_not cbrt ceil cos cosh digamma erf erf_inv erfc erfcx "
         "exp exp2 expm1 floor lgamma log log10 log1p log2 ndtri neg reciprocal round rsqrt "
         "sign sin sinh spherical_bessel_j0 sqrt tan tanh trunc").split()
UNARY_PREDICATES = ("isfinite", "signbit")
BINARY = ("add atan2 bitwise_and bitwise_or bitwise_xor div fmax fmin fmod gcd hypot igamma "
          "igammac maximum minimum mul nextafter pow remainder shift_left "
          "shift_right_arithmetic sub zeta").split()
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")

for _name in UNARY + BINARY:  # abs of a complex number is real
    define(_name, _elementwise_infer(_name, _real_of if _name == "abs" else None),
           _prim_impl(_name))
for _name in UNARY_PREDICATES + COMPARISONS:
    define(_name, _elementwise_infer(_name, torch.bool), _prim_impl(_name))

# Special functions with no torch prim: elementwise, defined by torch.special.
SPECIAL_UNARY = ("airy_ai bessel_y0 bessel_y1 modified_bessel_i0 modified_bessel_i1 "
                 "modified_bessel_k0 modified_bessel_k1 scaled_modified_bessel_k0 "
                 "scaled_modified_bessel_k1").split()
SPECIAL_BINARY = ("chebyshev_polynomial_t chebyshev_polynomial_u chebyshev_polynomial_v "
                  "chebyshev_polynomial_w shifted_chebyshev_polynomial_t "
                  "shifted_chebyshev_polynomial_u shifted_chebyshev_polynomial_v "
                  "shifted_chebyshev_polynomial_w hermite_polynomial_h hermite_polynomial_he "
                  "laguerre_polynomial_l legendre_polynomial_p").split()
for _name in SPECIAL_UNARY + SPECIAL_BINARY:
    define(_name, _elementwise_infer(_name, None), getattr(torch.special, _name))


def _polygamma_infer(x, *, n):
    return (x,)


define("polygamma", _polygamma_infer, lambda x, *, n: torch.polygamma(n, x))




# Complex numbers: parts, assembly, conjugation. A complex value is one elementwise operand
# like any other; these are the only primitives that cross between real and complex.
def _complex_infer(re, im):
    _check(re.shape == im.shape and re.dtype == im.dtype and re.dtype.is_floating_point,
           "complex", "parts must be floating point of one shape and dtype", re, im)
    return (TensorType(re.shape, re.dtype.to_complex(), re.device),)


def _part_infer(name: str):
    def infer(x):
        _check(x.dtype.is_complex, name, "operand must be complex", x)
        return (TensorType(x.shape, x.dtype.to_real(), x.device),)

    return infer


define("complex", _complex_infer, torch.complex)
define("real", _part_infer("real"), lambda x: torch.real(x).clone())
define("imag", _part_infer("imag"), lambda x: torch.imag(x).clone())
define("conj", _elementwise_infer("conj", None), torch.conj_physical)


def _frexp_infer(x):
    _check(x.dtype.is_floating_point, "frexp", "operand must be floating point", x)
    return (x, TensorType(x.shape, torch.int32, x.device))


# x = mantissa * 2**exponent, |mantissa| in [0.5, 1): exact, so not composed from log2.
define("frexp", _frexp_infer, lambda x: tuple(torch.frexp(x)), multiple_results=True)


def _where_infer(pred, a, b):
    _check(pred.dtype == torch.bool, "where", "predicate must be bool", pred, a, b)
    _check(pred.shape == a.shape == b.shape, "where", "operands must have one shape", pred, a, b)
    _check(a.dtype == b.dtype, "where", "branches must have one dtype", pred, a, b)
    return (a,)


define("where", _where_infer, torch.where)


def _convert_infer(x, *, dtype):
    return (TensorType(x.shape, dtype, x.device),)


define("convert", _convert_infer, lambda x, *, dtype: x.to(dtype))


# ---------------------------------------------------------------------------------------
# Creation
# ---------------------------------------------------------------------------------------
define("full", lambda *, shape, value, dtype, device: _types((shape, dtype, device)),
       lambda *, shape, value, dtype, device: torch.full(shape, value, dtype=dtype,
                                                         device=device))
define("iota", lambda *, length, start, step, dtype, device: _types(((length,), dtype, device)),
       lambda *, length, start, step, dtype, device: torch.arange(
           start, start + length * step, step, dtype=dtype, device=device)[:length])


# ---------------------------------------------------------------------------------------
# Shape and layout (views in eager; index rewrites when lowered)
# ---------------------------------------------------------------------------------------
def _broadcast_infer(x, *, shape, broadcast_dimensions):
    ok = len(broadcast_dimensions) == x.ndim and all(
        0 <= d < len(shape) and x.shape[i] in (1, shape[d])
        for i, d in enumerate(broadcast_dimensions)) and list(broadcast_dimensions) == sorted(
        broadcast_dimensions)
    _check(ok, "broadcast_in_dim",
           f"cannot broadcast to {list(shape)} along dims {list(broadcast_dimensions)}", x)
    return (TensorType(shape, x.dtype, x.device),)


def _broadcast_impl(x, *, shape, broadcast_dimensions):
    view = [1] * len(shape)
    for i, d in enumerate(broadcast_dimensions):
        view[d] = x.shape[i]
    return x.reshape(view).expand(shape)


define("broadcast_in_dim", _broadcast_infer, _broadcast_impl)


def _reshape_infer(x, *, shape):
    _check(math.prod(shape) == x.numel, "reshape", f"cannot reshape to {list(shape)}", x)
    return (TensorType(shape, x.dtype, x.device),)


define("reshape", _reshape_infer, lambda x, *, shape: x.reshape(shape))


def _transpose_infer(x, *, permutation):
    _check(sorted(permutation) == list(range(x.ndim)), "transpose",
           f"{list(permutation)} is not a permutation of the dims", x)
    return (TensorType([x.shape[p] for p in permutation], x.dtype, x.device),)


define("transpose", _transpose_infer, lambda x, *, permutation: x.permute(permutation))


def _slice_infer(x, *, start, limit, step):
    ok = len(start) == len(limit) == len(step) == x.ndim and all(
        0 <= s <= l <= n and st >= 1 for s, l, n, st in zip(start, limit, x.shape, step))
    _check(ok, "slice", f"bad slice start={list(start)} limit={list(limit)} step={list(step)}", x)
    shape = [max(0, -(-(l - s) // st)) for s, l, st in zip(start, limit, step)]
    return (TensorType(shape, x.dtype, x.device),)


define("slice", _slice_infer, lambda x, *, start, limit, step: x[
    tuple(slice(s, l, st) for s, l, st in zip(start, limit, step))])


def _pad_infer(x, *, low, high, value):
    _check(len(low) == len(high) == x.ndim and min(low + high, default=0) >= 0, "pad",
           f"bad padding low={list(low)} high={list(high)}", x)
    return (TensorType([n + lo + hi for n, lo, hi in zip(x.shape, low, high)], x.dtype,
                       x.device),)


def _pad_impl(x, *, low, high, value):
    flat = [p for lo, hi in zip(reversed(low), reversed(high)) for p in (lo, hi)]
    return torch.nn.functional.pad(x, flat, value=value)


define("pad", _pad_infer, _pad_impl)


def _concatenate_infer(*xs, dim):
    first = xs[0]
    for t in xs[1:]:
        ok = t.ndim == first.ndim and t.dtype == first.dtype and all(
            a == b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != dim)
        _check(ok, "concatenate", f"operands do not fit along dim {dim}", *xs)
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in xs)
    return (TensorType(shape, first.dtype, first.device),)


define("concatenate", _concatenate_infer, lambda *xs, dim: torch.cat(xs, dim))


def _rev_infer(x, *, dims):
    _norm_dims(dims, x.ndim, "rev")
    return (x,)


define("rev", _rev_infer, lambda x, *, dims: torch.flip(x, dims))


# ---------------------------------------------------------------------------------------
# Reductions and scans
# ---------------------------------------------------------------------------------------
def _reduce_infer(name: str, out_dtype: torch.dtype | None = None):
    def infer(x, *, dims):
        dims = _norm_dims(dims, x.ndim, name)
        if name in ("amax", "amin", "argmax", "argmin"):
            _check(all(x.shape[d] > 0 for d in dims) if x.ndim else True, name,
                   "cannot reduce over an empty dimension without an identity", x)
        shape = [n for i, n in enumerate(x.shape) if i not in dims]
        return (TensorType(shape, out_dtype or x.dtype, x.device),)

    return infer


def _reduce_impl(fn, one_dim_at_a_time: bool = False):
    """Reducing over no dims is the identity (a copy, so no output aliases an operand)."""
    def impl(x, *, dims):
        if not dims:
            return x.clone()
        if not one_dim_at_a_time:
            return fn(x, dims)
        for d in sorted(dims, reverse=True):  # torch.prod takes one dim
            x = fn(x, d)
        return x

    return impl


REDUCTIONS = {"sum": _reduce_impl(torch.sum), "prod": _reduce_impl(torch.prod, True),
              "amax": _reduce_impl(torch.amax), "amin": _reduce_impl(torch.amin)}
for _name, _impl in REDUCTIONS.items():
    define(_name, _reduce_infer(_name), _impl)


def _arg_reduce_impl(fn):
    """One dim; ties and NaN resolve as torch.argmax/argmin do."""
    return lambda x, *, dims: fn(x, dims[0]) if x.ndim else torch.zeros_like(x, dtype=torch.int64)


define("argmax", _reduce_infer("argmax", torch.int64), _arg_reduce_impl(torch.argmax))
define("argmin", _reduce_infer("argmin", torch.int64), _arg_reduce_impl(torch.argmin))


def _scan_infer(name: str, with_indices: bool):
    def infer(x, *, dim):
        _norm_dims((dim,), x.ndim, name)
        if with_indices:
            return (x, TensorType(x.shape, torch.int64, x.device))
        return (x,)

    return infer


def _scan_impl(fn, with_indices: bool):
    if with_indices:  # cummax/cummin return (values, indices)
        return lambda x, *, dim: tuple(fn(x, dim))
    return lambda x, *, dim: fn(x, dim)


SCANS = {"cumsum": (torch.cumsum, False), "cumprod": (torch.cumprod, False),
         "logcumsumexp": (torch.logcumsumexp, False), "cummax": (torch.cummax, True),
         "cummin": (torch.cummin, True)}
for _name, (_fn, _indices) in SCANS.items():
    define(_name, _scan_infer(_name, _indices), _scan_impl(_fn, _indices),
           multiple_results=_indices)


# ---------------------------------------------------------------------------------------
# Contraction, indexing, sorting
# ---------------------------------------------------------------------------------------
def _dot_general_infer(lhs, rhs, *, contracting, batch):
    (lc, rc), (lb, rb) = contracting, batch
    ok = (lhs.dtype == rhs.dtype and len(lc) == len(rc) and len(lb) == len(rb)
          and all(lhs.shape[a] == rhs.shape[b] for a, b in zip(lc + lb, rc + rb)))
    _check(ok, "dot_general", f"contracting {list(lc)}x{list(rc)} batch {list(lb)}x{list(rb)} "
           "do not match", lhs, rhs)
    free_l = [n for i, n in enumerate(lhs.shape) if i not in lc + lb]
    free_r = [n for i, n in enumerate(rhs.shape) if i not in rc + rb]
    return (TensorType([lhs.shape[i] for i in lb] + free_l + free_r, lhs.dtype, lhs.device),)


def _dot_general_impl(lhs, rhs, *, contracting, batch):
    """Batch dims first, then lhs free dims, then rhs free dims (as jax.lax.dot_general)."""
    (lc, rc), (lb, rb) = contracting, batch
    lf = [i for i in range(lhs.ndim) if i not in lc + lb]
    rf = [i for i in range(rhs.ndim) if i not in rc + rb]
    size = lambda t, dims: math.prod(t.shape[d] for d in dims)
    a = lhs.permute(list(lb) + lf + list(lc)).reshape(size(lhs, lb), size(lhs, lf), size(lhs, lc))
    b = rhs.permute(list(rb) + list(rc) + rf).reshape(size(rhs, rb), size(rhs, rc), size(rhs, rf))
    return torch.bmm(a, b).reshape([lhs.shape[i] for i in lb] + [lhs.shape[i] for i in lf]
                       + [rhs.shape[i] for i in rf])


define("dot_general", _dot_general_infer, _dot_general_impl)


def _gather_infer(x, index, *, dim):
    ok = index.dtype == torch.int64 and index.ndim == x.ndim
    _check(ok, "gather", f"index must be int64 with the operand's rank (dim={dim})", x, index)
    return (TensorType(index.shape, x.dtype, x.device),)


define("gather", _gather_infer, lambda x, index, *, dim: torch.gather(x, dim, index))


def _scatter_infer(x, index, src, *, dim, reduce, include_self):
    ok = index.dtype == torch.int64 and index.ndim == x.ndim == src.ndim and x.dtype == src.dtype
    _check(ok, "scatter", f"index must be int64 and all operands of one rank (dim={dim})",
           x, index, src)
    return (x,)


def _scatter_impl(x, index, src, *, dim, reduce, include_self):
    if reduce is None:
        return torch.scatter(x, dim, index, src)
    return torch.scatter_reduce(x, dim, index, src, reduce, include_self=include_self)


define("scatter", _scatter_infer, _scatter_impl)


def _sort_infer(x, *, dim, descending, stable):
    _norm_dims((dim,), x.ndim, "sort")
    return (x, TensorType(x.shape, torch.int64, x.device))


define("sort", _sort_infer, lambda x, *, dim, descending, stable: tuple(
    torch.sort(x, dim=dim, descending=descending, stable=stable)), multiple_results=True)


def _topk_infer(x, *, k, dim, largest, sorted):
    (d,) = _norm_dims((dim,), x.ndim, "topk")
    _check(0 <= k <= (x.shape[d] if x.ndim else 1), "topk", f"k={k} out of range", x)
    shape = list(x.shape)
    if shape:
        shape[d] = k
    return (TensorType(shape, x.dtype, x.device), TensorType(shape, torch.int64, x.device))


define("topk", _topk_infer, lambda x, *, k, dim, largest, sorted: tuple(
    torch.topk(x, k, dim=dim, largest=largest, sorted=sorted)), multiple_results=True)


# ---------------------------------------------------------------------------------------
# Fourier transforms (library calls, as ATen's: real->complex, complex->real, complex->complex)
# ---------------------------------------------------------------------------------------
def _fft_infer(kind: str):
    def infer(x, *, dim, normalization, **option):
        dims = _norm_dims(dim, x.ndim, f"fft_{kind}")
        _check(x.dtype.is_complex == (kind != "r2c"), f"fft_{kind}",
               "operand must be " + ("real" if kind == "r2c" else "complex"), x)
        shape = list(x.shape)
        if kind == "r2c" and option["onesided"]:
            shape[dims[-1]] = shape[dims[-1]] // 2 + 1
        if kind == "c2r":
            shape[dims[-1]] = option["last_dim_size"]
        dtype = {"r2c": x.dtype.to_complex(), "c2r": x.dtype.to_real(), "c2c": x.dtype}[kind]
        return (TensorType(shape, dtype, x.device),)

    return infer


def _fft_impl(op):
    """The one kind-specific option (onesided, last_dim_size, forward) is the last argument."""
    return lambda x, *, dim, normalization, **option: op(x, dim, normalization,
                                                         *option.values())


for _kind in ("r2c", "c2r", "c2c"):
    define(f"fft_{_kind}", _fft_infer(_kind),
           _fft_impl(getattr(torch.ops.aten, f"_fft_{_kind}").default))


def is_effectful(node) -> bool:
    """Must this node run exactly as traced (never removed, merged, folded or moved)?

    True for effectful primitives, for opaque calls to random ops (each call draws anew) and
    for opaque ops with no result (checks such as aten._linalg_check_errors).
    """
    if get_primitive(node.prim).effectful:
        return True
    return node.prim == "opaque" and (not node.out_types or torch.Tag.nondeterministic_seeded
                                      in node.kwargs["op"].tags)
