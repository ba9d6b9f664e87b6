"""The primitive set: every op a graph can contain, each with all of its rules side by side.

NOTE [primitive set]
Primitives are strict, in the style of ``jax.lax`` and ``torch._prims``: elementwise
primitives take operands of one shape and one dtype; broadcasting and type promotion happen
while tracing (``tracer/aten.py``), where they match eager PyTorch exactly. So every rule
here is short, and later stages (autodiff, batching, lowering) see a small, regular set.

A ``Primitive`` holds, next to each other:
  * ``infer``: operand types + params -> output types (raises ShapeError on a mismatch);
  * ``impl``: the eager implementation on torch tensors (the reference semantics);
  * ``vjp`` / ``jvp``: the reverse- and forward-mode derivative rules (a missing ``jvp`` is
    derived from ``vjp`` by transposition);
  * ``batch``: the vmap rule (a primitive without one is batched by a loop).
How the compiling backends lower a primitive is lowering's business (``passes/lowering.py``:
a loop expression for elementwise ops and views, an extern for everything else).
Elementwise families are tables: one row per primitive, one shared rule per family.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..errors import CheckError, ShapeError, UnsupportedOpError
from ..graph.types import TensorType, equal_sizes
from .registry import PRIMITIVES, OperandSlot, batch_rule, define, jvp_rule, vjp_rule
from .sizes import holds, same_size
from .trace import bind, current_trace

prims = torch.ops.prims


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


def _div(a, b):
    """prims.div: true division of floating-point and complex values, truncating of integers."""
    exact = a.is_floating_point() or a.is_complex()
    return torch.div(a, b, rounding_mode=None if exact else "trunc")


# The same under another name. torch.ops.prims' own ops also fail under torch.func's
# transforms (their autograd has no setup_context), where the eager backend runs a graph.
_TORCH_NAMED = {
    "div": _div, "bessel_i0": torch.i0, "bessel_i0e": torch.special.i0e,
    "bessel_i1": torch.special.i1, "bessel_i1e": torch.special.i1e,
    "bessel_j0": torch.special.bessel_j0, "bessel_j1": torch.special.bessel_j1,
    "erf_inv": torch.special.erfinv, "erfcx": torch.special.erfcx,
    "ndtri": torch.special.ndtri, "spherical_bessel_j0": torch.special.spherical_bessel_j0,
    "gcd": torch.gcd, "igamma": torch.special.gammainc, "igammac": torch.special.gammaincc,
    "zeta": torch.special.zeta, "shift_left": torch.bitwise_left_shift,
    "shift_right_arithmetic": torch.bitwise_right_shift,
}


def _prim_impl(name: str):
    if name in _TORCH_NAMED:
        return _TORCH_NAMED[name]
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
SPECIAL_UNARY = ("airy_ai bessel_y0 bessel_y1 entr log_ndtr modified_bessel_i0 "
                 "modified_bessel_i1 modified_bessel_k0 modified_bessel_k1 scaled_modified_bessel_k0 "
                 "scaled_modified_bessel_k1").split()
SPECIAL_BINARY = ("chebyshev_polynomial_t chebyshev_polynomial_u chebyshev_polynomial_v "
                  "chebyshev_polynomial_w shifted_chebyshev_polynomial_t "
                  "shifted_chebyshev_polynomial_u shifted_chebyshev_polynomial_v "
                  "shifted_chebyshev_polynomial_w hermite_polynomial_h hermite_polynomial_he "
                  "laguerre_polynomial_l legendre_polynomial_p").split()
for _name in SPECIAL_UNARY + SPECIAL_BINARY:
    define(_name, _elementwise_infer(_name, None), getattr(torch.special, _name))

# Every primitive computed point by point from operands of its result's shape.
ELEMENTWISE = frozenset(UNARY + BINARY + list(UNARY_PREDICATES) + list(COMPARISONS)
                        + SPECIAL_UNARY + SPECIAL_BINARY + ["polygamma", "where", "convert"])


def _polygamma_infer(x, *, n):
    return (x,)


define("polygamma", _polygamma_infer, lambda x, *, n: torch.polygamma(n, x))


# Derivatives of the elementwise primitives, as PyTorch's autograd formulas give them:
# unary ones as d(x, y) with y = f(x) (None: zero almost everywhere), binary ones as the
# cotangents of both operands.
#
# NOTE [complex derivatives]
# A complex value's cotangent is dL/dRe + i dL/dIm (PyTorch's convention): a VJP is the
# transpose of the derivative with C seen as R^2. For a holomorphic f that is the cotangent
# times conj(f'(z)), so the VJP rules conjugate the derivative of a complex operand (a binary
# rule, linear in its cotangent, runs on conj(ct) and is conjugated back), and the JVP rules
# multiply by f'(z) as they are. A real function of a complex operand (abs) has a d whose
# tangent is Re(d t) and cotangent ct conj(d). A complex cotangent of a real value is its
# real part (autodiff's ``_fit``: the transpose of the reals' inclusion in C). Maps with real
# coefficients (layout, sums, gathers) keep their rules: their transpose is their adjoint; a
# matrix product's cotangent takes the other operand conjugated (ct_A = ct B^H), a DFT's is
# the inverse transform. Only the primitives in COMPLEX_RULES have rules that hold on complex
# values; autodiff refuses the others there.
_LN2, _LN10 = math.log(2.0), math.log(10.0)
_UNARY_DERIVATIVES = {
    "abs": lambda x, y: _conj(x) / _nonzero(y) if x.dtype.is_complex else torch.sign(x),
    "acos": lambda x, y: -torch.rsqrt(1 - x * x),
    "acosh": lambda x, y: torch.rsqrt(x + 1) * torch.rsqrt(x - 1) if x.dtype.is_complex
    else torch.rsqrt(x * x - 1),  # the two roots differ off the real line
    "asin": lambda x, y: torch.rsqrt(1 - x * x),
    "asinh": lambda x, y: torch.rsqrt(x * x + 1),
    "atan": lambda x, y: 1 / (1 + x * x),
    "atanh": lambda x, y: 1 / (1 - x * x),
    "cbrt": lambda x, y: torch.pow(x * x, -1.0 / 3) / 3,
    "cos": lambda x, y: -torch.sin(x),
    "cosh": lambda x, y: torch.sinh(x),
    "digamma": lambda x, y: torch.polygamma(1, x),
    "erf": lambda x, y: 2 / math.sqrt(math.pi) * torch.exp(-x * x),
    "erfc": lambda x, y: -2 / math.sqrt(math.pi) * torch.exp(-x * x),
    "erf_inv": lambda x, y: math.sqrt(math.pi) / 2 * torch.exp(y * y),
    "erfcx": lambda x, y: 2 * x * y - 2 / math.sqrt(math.pi),
    "exp": lambda x, y: y,
    "exp2": lambda x, y: y * _LN2,
    "expm1": lambda x, y: y + 1,
    "lgamma": lambda x, y: torch.digamma(x),
    "log": lambda x, y: 1 / x,
    "log10": lambda x, y: 1 / (x * _LN10),
    "log1p": lambda x, y: 1 / (x + 1),
    "log2": lambda x, y: 1 / (x * _LN2),
    "ndtri": lambda x, y: math.sqrt(2 * math.pi) * torch.exp(y * y / 2),
    "neg": lambda x, y: -1.0,
    "reciprocal": lambda x, y: -y * y,
    "rsqrt": lambda x, y: -0.5 * y * y * y,
    "sin": lambda x, y: torch.cos(x),
    "sinh": lambda x, y: torch.cosh(x),
    "sqrt": lambda x, y: 0.5 / y,
    "tan": lambda x, y: 1 + y * y,
    "tanh": lambda x, y: 1 - y * y,
    "bessel_i0": lambda x, y: torch.special.i1(x),
    "entr": lambda x, y: -(1 + torch.log(x)),  # eager's: NaN below 0, inf at 0
    "log_ndtr": lambda x, y: torch.exp(-(y + x * x / 2)) / math.sqrt(2 * math.pi),
    "bessel_i0e": lambda x, y: torch.special.i1e(x) - torch.sign(x) * y,
    "bessel_i1": lambda x, y: torch.where(x == 0, 0.5, torch.special.i0(x) - y / _nonzero(x)),
    "bessel_i1e": lambda x, y: torch.where(
        x == 0, 0.5, torch.special.i0e(x) - y * (torch.sign(x) + 1 / _nonzero(x))),
    **{name: lambda x, y: None for name in ("ceil", "floor", "round", "trunc", "sign")},
}


def _nonzero(x):
    """x with zeros replaced by ones: a divisor whose unused branch stays finite (so no
    inf * 0 = NaN reaches a derivative through the other branch of a where)."""
    return torch.where(x == 0, 1.0, x)


def _conj(x):
    """x's complex conjugate (a real tensor, or a number, is its own)."""
    return bind("conj", x) if isinstance(x, torch.Tensor) and x.dtype.is_complex else x


def _unary_vjp(d):
    def rule(cts, x, *, outs):
        derivative = d(x, outs[0])
        return (None if derivative is None else cts[0] * _conj(derivative),)

    return rule


def _unary_jvp(d):
    def rule(operands, tangents, outs):
        derivative = d(operands[0], outs[0])
        return (None if derivative is None else tangents[0] * derivative,)

    return rule


for _name, _d in _UNARY_DERIVATIVES.items():
    PRIMITIVES[_name].vjp, PRIMITIVES[_name].jvp = _unary_vjp(_d), _unary_jvp(_d)


@vjp_rule("polygamma")
def _polygamma_vjp(cts, x, *, outs, n):
    return (cts[0] * torch.polygamma(n + 1, x),)


def _pow_vjp(ct, a, b, y):
    real_exponent = (torch.imag(b) == 0) & (torch.real(b) >= 0) if b.dtype.is_complex else b >= 0
    base = torch.where(b == 0, 0.0, ct * b * torch.pow(a, b - 1))
    exponent = torch.where((a == 0) & real_exponent, 0.0, ct * y * torch.log(a))
    return base, exponent


_BINARY_DERIVATIVES = {
    "add": lambda ct, a, b, y: (ct, ct),
    "sub": lambda ct, a, b, y: (ct, -ct),
    "mul": lambda ct, a, b, y: (ct * b, ct * a),
    "div": lambda ct, a, b, y: (ct / b, -ct * a / (b * b)),
    "pow": _pow_vjp,
    "nextafter": lambda ct, a, b, y: (ct, None),  # as eager: the step counts as identity
    "atan2": lambda ct, a, b, y: (ct * b / (a * a + b * b), -ct * a / (a * a + b * b)),
    "hypot": lambda ct, a, b, y: (ct * a / y, ct * b / y),
    "fmod": lambda ct, a, b, y: (ct, -ct * torch.trunc(a / b)),
    "remainder": lambda ct, a, b, y: (ct, -ct * torch.floor(a / b)),
    "maximum": lambda ct, a, b, y: (_split(ct, a == b, a < b), _split(ct, a == b, a > b)),
    "minimum": lambda ct, a, b, y: (_split(ct, a == b, a > b), _split(ct, a == b, a < b)),
    # fmax/fmin pick the number over a NaN; the picked operand takes the whole cotangent
    "fmax": lambda ct, a, b, y: (torch.where((a >= b) | torch.isnan(b), ct, 0.0),
                                 torch.where((a >= b) | torch.isnan(b), 0.0, ct)),
    "fmin": lambda ct, a, b, y: (torch.where((a <= b) | torch.isnan(b), ct, 0.0),
                                 torch.where((a <= b) | torch.isnan(b), 0.0, ct)),
}


def _split(ct, tie, lose):
    """maximum/minimum: a tie splits the cotangent, the loser gets none; a NaN feeds both."""
    return torch.where(lose, 0.0, torch.where(tie, ct / 2, ct))


def _binary_vjp(d):
    def rule(cts, a, b, *, outs):
        if not a.dtype.is_complex:
            return d(cts[0], a, b, outs[0])
        return tuple(map(_conj, d(_conj(cts[0]), a, b, outs[0])))  # ct * conj(derivative)

    return rule


def _binary_jvp(d):
    """Elementwise, so each operand's VJP (linear in the cotangent, a diagonal Jacobian)
    applied to that operand's tangent is its share of the output tangent."""
    def rule(operands, tangents, outs):
        parts = [d(t, *operands, outs[0])[i] for i, t in enumerate(tangents) if t is not None]
        parts = [p for p in parts if p is not None]
        return (sum(parts[1:], parts[0]) if parts else None,)

    return rule


for _name, _d in _BINARY_DERIVATIVES.items():
    PRIMITIVES[_name].vjp, PRIMITIVES[_name].jvp = _binary_vjp(_d), _binary_jvp(_d)




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
vjp_rule("complex")(lambda cts, re, im, *, outs: (bind("real", cts[0]), bind("imag", cts[0])))
vjp_rule("real")(lambda cts, x, *, outs: (cts[0],))  # the engine makes it ct + 0i
vjp_rule("imag")(lambda cts, x, *, outs: (bind("complex", torch.zeros_like(cts[0]), cts[0]),))
vjp_rule("conj")(lambda cts, x, *, outs: (_conj(cts[0]),))


def _frexp_infer(x):
    _check(x.dtype.is_floating_point, "frexp", "operand must be floating point", x)
    return (x, TensorType(x.shape, torch.int32, x.device))


# x = mantissa * 2**exponent, |mantissa| in [0.5, 1): exact, so not composed from log2.
define("frexp", _frexp_infer, lambda x: tuple(torch.frexp(x)), multiple_results=True)


@vjp_rule("frexp")
def _frexp_vjp(cts, x, *, outs):
    return (cts[0] / torch.exp2(outs[1].to(x.dtype)),)


def _where_infer(pred, a, b):
    _check(pred.dtype == torch.bool, "where", "predicate must be bool", pred, a, b)
    _check(pred.shape == a.shape == b.shape, "where", "operands must have one shape", pred, a, b)
    _check(a.dtype == b.dtype, "where", "branches must have one dtype", pred, a, b)
    return (a,)


define("where", _where_infer, torch.where)


@vjp_rule("where")
def _where_vjp(cts, pred, a, b, *, outs):
    return None, torch.where(pred, cts[0], 0.0), torch.where(pred, 0.0, cts[0])


def _convert_infer(x, *, dtype):
    return (TensorType(x.shape, dtype, x.device),)


define("convert", _convert_infer, lambda x, *, dtype: x.to(dtype))

# The identity, made only to carry control edges (plait.control_dependency): derivatives,
# batching and lowering treat it as the value itself; the edges keep it in order.
define("after", lambda x: (x,), lambda x: x,
       vjp=lambda cts, x, *, outs: (cts[0],))

# The identity, through which no derivative flows (Tensor.detach; saved statistics).
define("stop_gradient", lambda x: (x,), lambda x: x,
       vjp=lambda cts, x, *, outs: (None,))

# The identity, through which reverse-mode derivatives do not flow and forward-mode ones do:
# the result of an op traced with grad mode off (torch.no_grad() inside a function under
# plait.grad), which torch.func's reverse mode treats as a constant and its jvp does not.
define("no_grad", lambda x: (x,), lambda x: x, vjp=lambda cts, x, *, outs: (None,))

# Its twin, through which forward-mode derivatives do not flow and reverse-mode ones do: the
# result of an op traced with forward-mode AD off (torch.autograd.forward_ad), as torch.func.
define("no_fwd_grad", lambda x: (x,), lambda x: x, vjp=lambda cts, x, *, outs: (cts[0],))


@vjp_rule("convert")
def _convert_vjp(cts, x, *, outs, dtype):
    # the engine casts it back (to its real part where x is real)
    return (cts[0] if dtype.is_floating_point or dtype.is_complex else None,)


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
        0 <= d < len(shape) and (x.shape[i] == 1 or same_size(x.shape[i], shape[d]))
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


@vjp_rule("broadcast_in_dim")
def _broadcast_vjp(cts, x, *, outs, shape, broadcast_dimensions):
    """Sum over the new dims and over the size-1 dims that were stretched."""
    kept = {d: i for i, d in enumerate(broadcast_dimensions)}
    dims = [d for d in range(len(shape)) if d not in kept or
            (x.shape[kept[d]] == 1 and shape[d] != 1)]
    ct = torch.sum(cts[0], dims) if dims else cts[0]
    return (ct.reshape(x.shape),)


def _reshape_infer(x, *, shape):
    _check(equal_sizes(math.prod(shape), x.numel), "reshape", f"cannot reshape to {list(shape)}",
           x)
    return (TensorType(shape, x.dtype, x.device),)


define("reshape", _reshape_infer, lambda x, *, shape: x.reshape(shape))

vjp_rule("reshape")(lambda cts, x, *, outs, shape: (cts[0].reshape(x.shape),))


def _transpose_infer(x, *, permutation):
    _check(sorted(permutation) == list(range(x.ndim)), "transpose",
           f"{list(permutation)} is not a permutation of the dims", x)
    return (TensorType([x.shape[p] for p in permutation], x.dtype, x.device),)


define("transpose", _transpose_infer, lambda x, *, permutation: x.permute(permutation))

vjp_rule("transpose")(lambda cts, x, *, outs, permutation: (
    cts[0].permute([permutation.index(d) for d in range(len(permutation))]),))


def _slice_infer(x, *, start, limit, step):
    ok = len(start) == len(limit) == len(step) == x.ndim and all(
        holds(0 <= s) and holds(s <= l) and holds(l <= n) and st >= 1
        for s, l, n, st in zip(start, limit, x.shape, step))
    _check(ok, "slice", f"bad slice start={list(start)} limit={list(limit)} step={list(step)}", x)
    shape = [-(-(l - s) // st) for s, l, st in zip(start, limit, step)]  # l >= s: checked
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


@vjp_rule("slice")
def _slice_vjp(cts, x, *, outs, start, limit, step):
    """Zeros around the cotangent: a pad, which lowers to a select; a strided dim spread
    first (``spread_strided``)."""
    ct = cts[0]
    for d, st in enumerate(step):
        if st > 1:
            ct = spread_strided(ct, d, st, start[d], x.shape[d])
    low = tuple(0 if st > 1 else s for s, st in zip(start, step))
    high = tuple(n - lo - m for n, lo, m in zip(x.shape, low, ct.shape))
    return (bind("pad", ct, low=low, high=high, value=0),)


def spread_strided(y, dim: int, step: int, offset: int, n: int):
    """y's entries i along ``dim`` at positions offset + step * i of a zero-filled dim of
    size n, those outside it dropped: a strided slice's transpose, as pads and a reshape,
    which lowering reads through (no index table). Max pooling's scan spreads its
    gradient with it too (NOTE [strided max pooling], tracer/nn.py)."""
    if step > 1:  # [.., o, ..] -> [.., o, step, ..] -> [.., o * step, ..]
        y = pad_dim(y.unsqueeze(dim + 1), dim + 1, 0, step - 1).flatten(dim, dim + 1)
    first, size = max(-offset, 0), y.shape[dim] + max(offset, 0)
    y = pad_dim(y, dim, max(offset, 0), max(0, first + n - size))
    return y.narrow(dim, first, n)


def pad_dim(y, dim: int, low: int, high: int, value=0):
    """y padded along ``dim`` alone, with ``value``."""
    if not (low or high):
        return y
    ends = [(low, high) if i == dim else (0, 0) for i in range(len(y.shape))]
    return bind("pad", y, low=tuple(lo for lo, _ in ends), high=tuple(hi for _, hi in ends),
                 value=value)


@vjp_rule("pad")
def _pad_vjp(cts, x, *, outs, low, high, value):
    return (cts[0][tuple(slice(lo, lo + n) for lo, n in zip(low, x.shape))],)


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


@vjp_rule("concatenate")
def _concatenate_vjp(cts, *xs, outs, dim):
    return tuple(torch.split(cts[0], [x.shape[dim] for x in xs], dim))


def _rev_infer(x, *, dims):
    _norm_dims(dims, x.ndim, "rev")
    return (x,)


define("rev", _rev_infer, lambda x, *, dims: torch.flip(x, dims))

vjp_rule("rev")(lambda cts, x, *, outs, dims: (torch.flip(cts[0], dims),))


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


def _unreduce(ct, x, dims):
    """A reduction's result (or cotangent) broadcast back over the reduced dims of x."""
    shape = [1 if d in dims else n for d, n in enumerate(x.shape)]
    return ct.reshape(shape).expand(x.shape)


vjp_rule("sum")(lambda cts, x, *, outs, dims: (_unreduce(cts[0], x, dims),))


@vjp_rule("amax", "amin")
def _extremum_vjp(cts, x, *, outs, dims):
    """Ties share the cotangent evenly (a NaN result passes none), as PyTorch's rule."""
    hit = (x == _unreduce(outs[0], x, dims)).to(x.dtype)
    count = _unreduce(torch.sum(hit, dims) if dims else hit, x, dims)
    return (_unreduce(cts[0], x, dims) * hit / count,)


@vjp_rule("prod")
def _prod_vjp(cts, x, *, outs, dims):
    """d/dx_i = product of the other elements: exclusive products from both ends, exact
    when some elements are zero."""
    if not x.numel():
        return (torch.zeros_like(x),)
    rest = [d for d in range(x.ndim) if d not in dims]
    moved = x.permute(rest + list(dims)).reshape([x.shape[d] for d in rest] + [-1])
    ones = moved.new_ones(moved.shape[:-1] + (1,))
    before = torch.cumprod(torch.cat([ones, moved[..., :-1]], -1), -1)
    after = torch.flip(torch.cumprod(torch.cat([ones, torch.flip(moved, [-1])[..., :-1]], -1),
                                     -1), [-1])
    others = (before * after).reshape([x.shape[d] for d in rest + list(dims)])
    others = others.permute([(rest + list(dims)).index(d) for d in range(x.ndim)])
    return (_unreduce(cts[0], x, dims) * _conj(others),)


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
    if fn in (torch.cumsum, torch.cumprod):  # an integer operand's dtype is the result's
        return lambda x, *, dim: fn(x, dim, dtype=x.dtype)  # (torch's would be int64)
    return lambda x, *, dim: fn(x, dim)


SCANS = {"cumsum": (torch.cumsum, False), "cumprod": (torch.cumprod, False),
         "logcumsumexp": (torch.logcumsumexp, False), "cummax": (torch.cummax, True),
         "cummin": (torch.cummin, True)}
for _name, (_fn, _indices) in SCANS.items():
    define(_name, _scan_infer(_name, _indices), _scan_impl(_fn, _indices),
           multiple_results=_indices)


def _reverse_cumsum(x, dim):
    return torch.flip(torch.cumsum(torch.flip(x, [dim]), dim), [dim])


def _later(x, dim):
    """Mask [..., i, k] of k >= i along dim (the outputs an input feeds in a scan)."""
    n = x.shape[dim]
    return torch.ones(n, n, dtype=torch.bool, device=x.device).triu()


vjp_rule("cumsum")(lambda cts, x, *, outs, dim: (_reverse_cumsum(cts[0], dim),))


@vjp_rule("logcumsumexp")
def _logcumsumexp_vjp(cts, x, *, outs, dim):
    """d y_k / d x_i = exp(x_i - y_k) for k >= i, summed in log space with the cotangent's
    positive and negative parts apart (PyTorch's formula, stable for large values)."""
    def reverse_logcumsumexp(v):
        return torch.flip(torch.logcumsumexp(torch.flip(v, [dim]), dim), [dim])

    ct, lowest = cts[0], torch.finfo(x.dtype).min
    log_abs = torch.log(torch.abs(ct))
    parts = [torch.where(keep, log_abs, lowest) for keep in (ct > 0, ct < 0)]
    pos, neg = (torch.exp(reverse_logcumsumexp(p - outs[0]) + x) for p in parts)
    return (pos - neg,)


@jvp_rule("logcumsumexp")
def _logcumsumexp_jvp(operands, tangents, outs, *, dim):
    """dy_k = sum_{i <= k} t_i exp(x_i - y_k): weights exp(x - max x) keep it in range
    (the derivation from the VJP would take log|0| at a zero tangent)."""
    (x,), (t,) = operands, tangents
    weight = torch.exp(x - torch.amax(x, dim, keepdim=True))
    total = torch.cumsum(weight, dim)  # 0 where every weight so far underflowed: 0, as eager
    return (torch.where(total == 0, 0.0, torch.cumsum(t * weight, dim) / _nonzero(total)),)


@vjp_rule("cumprod")
def _cumprod_vjp(cts, x, *, outs, dim):
    """d y_k / d x_i = prod_{j <= k, j != i} x_j for k >= i: products over a masked square,
    exact when some x_j are zero."""
    moved = x.movedim(dim, -1)
    n = moved.shape[-1]
    mask = _later(x, dim)
    # row i of the square holds x_j for j != i, and 1 at j == i
    square = torch.where(torch.eye(n, dtype=torch.bool, device=x.device), 1.0,
                         moved.unsqueeze(-2).expand(*moved.shape[:-1], n, n))
    partial = torch.cumprod(square, -1)  # [..., i, k] = prod_{j <= k, j != i} x_j
    ct = cts[0].movedim(dim, -1).unsqueeze(-2)
    return ((_conj(torch.where(mask, partial, 0.0)) * ct).sum(-1).movedim(-1, dim),)


@vjp_rule("cummax", "cummin")
def _cumextremum_vjp(cts, x, *, outs, dim):
    return (torch.zeros_like(x).scatter_add(dim, outs[1], cts[0]),)


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


def _matrices(lhs, rhs, contracting) -> tuple:
    """The [M, K] and [K, N] operands of a matrix product (transposed views, for BLAS)."""
    (lc, rc) = contracting
    return lhs if lc == (1,) else lhs.t(), rhs if rc == (0,) else rhs.t()


def _dot_general_impl(lhs, rhs, *, contracting, batch):
    """Batch dims first, then lhs free dims, then rhs free dims (as jax.lax.dot_general)."""
    (lc, rc), (lb, rb) = contracting, batch
    if not lb and lhs.ndim == rhs.ndim == 2 and len(lc) == 1:  # a matrix product: BLAS
        return torch.mm(*_matrices(lhs, rhs, contracting))
    lf = [i for i in range(lhs.ndim) if i not in lc + lb]
    rf = [i for i in range(rhs.ndim) if i not in rc + rb]
    size = lambda t, dims: math.prod(t.shape[d] for d in dims)
    a = lhs.permute(list(lb) + lf + list(lc)).reshape(size(lhs, lb), size(lhs, lf), size(lhs, lc))
    b = rhs.permute(list(rb) + list(rc) + rf).reshape(size(rhs, rb), size(rhs, rc), size(rhs, rf))
    return torch.bmm(a, b).reshape([lhs.shape[i] for i in lb] + [lhs.shape[i] for i in lf]
                       + [rhs.shape[i] for i in rf])


define("dot_general", _dot_general_infer, _dot_general_impl)


def _dot_bias_infer(lhs, rhs, bias, *, contracting, batch):
    (t,) = _dot_general_infer(lhs, rhs, contracting=contracting, batch=batch)
    _check(not batch[0] and t.ndim == 2 and bias.shape == t.shape[1:] and bias.dtype == t.dtype,
           "dot_bias", "expected a matrix product and a bias of its columns", lhs, rhs, bias)
    return (t,)


def _dot_bias_impl(lhs, rhs, bias, *, contracting, batch):
    return torch.addmm(bias, *_matrices(lhs, rhs, contracting))


# A matrix product with a bias added to each row, in one library call (its epilogue adds
# it): made by lowering's ``bias_epilogues`` (NOTE [bias epilogues]), never traced, so it
# has no transform rules.
define("dot_bias", _dot_bias_infer, _dot_bias_impl)


@vjp_rule("dot_general")
def _dot_general_vjp(cts, lhs, rhs, *, outs, contracting, batch):
    """Each operand's cotangent is itself a dot_general: the output cotangent contracted with
    the other operand over that operand's free dims, then transposed to the operand's order
    (no einsum, so no reshape/transpose chains reach the compiler)."""
    (lc, rc), (lb, rb) = contracting, batch
    lf = [i for i in range(lhs.ndim) if i not in lc + lb]
    rf = [i for i in range(rhs.ndim) if i not in rc + rb]
    nb = len(lb)
    out_lf = tuple(range(nb, nb + len(lf)))
    out_rf = tuple(range(nb + len(lf), nb + len(lf) + len(rf)))
    lhs, rhs = _conj(lhs), _conj(rhs)  # complex: the adjoint, ct_lhs = ct @ rhs^H
    return (_dot_cotangent(cts[0], rhs, out_rf, rf, rb, lb, lf, lc, rc),
            _dot_cotangent(cts[0], lhs, out_lf, lf, lb, rb, rf, rc, lc))


def _dot_cotangent(ct, other, out_free, other_free, other_batch, batch, free, contracted,
                   other_contracted):
    """The cotangent of one dot_general operand (its ``batch``, ``free`` and ``contracted``
    dims) from the output cotangent ``ct`` and the ``other`` operand."""
    nb = len(batch)
    result = bind("dot_general", ct, other, contracting=(out_free, tuple(other_free)),
                   batch=(tuple(range(nb)), tuple(other_batch)))
    # the result's dims: batch, this operand's free dims, then the other's contracted dims
    # in their order, each of which pairs with one of ours
    paired = [contracted[other_contracted.index(d)] for d in sorted(other_contracted)]
    dims = [*batch, *free, *paired]
    permutation = tuple(sorted(range(len(dims)), key=dims.__getitem__))
    if permutation == tuple(range(len(dims))):
        return result
    return bind("transpose", result, permutation=permutation)


def _gather_infer(x, index, *, dim):
    ok = index.dtype == torch.int64 and index.ndim == x.ndim and 0 <= dim < x.ndim and all(
        holds(i <= n) for d, (i, n) in enumerate(zip(index.shape, x.shape)) if d != dim)
    _check(ok, "gather", f"index must be int64 with the operand's rank and no longer than it "
           f"in every dim but dim={dim}", x, index)
    return (TensorType(index.shape, x.dtype, x.device),)


define("gather", _gather_infer, lambda x, index, *, dim: torch.gather(x, dim, index))

@vjp_rule("gather")
def _gather_vjp(cts, x, index, *, outs, dim):
    """The cotangents scattered back and added. Where the index picks one position per row
    of ``dim`` (nll_loss's target), a select instead: elementwise, so it fuses into what
    consumes it, where a scatter writes a buffer of x's size (a logits-sized one). Where it
    is a table built at trace time (pooling's windows), a gather through its inverse
    (``_gathered_back``)."""
    if index.shape[dim] == 1 and all(index.shape[d] == x.shape[d]
                                     for d in range(x.ndim) if d != dim):
        positions = bind("iota", length=x.shape[dim], start=0, step=1, dtype=index.dtype,
                          device=str(x.device))
        picked = positions.reshape([-1 if d == dim else 1 for d in range(x.ndim)]) == index
        return torch.where(picked, cts[0], torch.zeros((), dtype=x.dtype, device=x.device)), None
    table = _selected_positions(index, x, dim)
    if table is not None:
        inverse = _readers(table, x.shape[dim])
        if inverse is not None:
            return _gathered_back(cts[0], dim, *inverse), None
    # 16-bit floats are summed in float32, as eager's embedding backward sums them: a row
    # many positions read (BERT's one token type) adds thousands of cotangents, and
    # 16-bit atomic adds are also slow where they collide
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    summed = torch.zeros(x.shape, dtype=acc, device=x.device).scatter_add(
        dim, index, cts[0].to(acc))
    return summed.to(x.dtype), None


# A static gather's VJP gathers back where each position has at most this many readers
# (a 3x3 stride-1 pooling's window table over the spatial plane has 9).
GATHERED_BACK_MAX_READERS = 16


def _selected_positions(index, x, dim: int) -> torch.Tensor | None:
    """The positions along ``dim`` that a gather picks, where ``index`` is a table built at
    trace time (index_select by a constant, as pooling's window tables are) broadcast along
    the other dims, each as long as x's; else None."""
    trace = current_trace()
    if getattr(index, "_trace", None) is not trace:  # not this trace's own value
        return None
    node, operands = trace.defining(index)
    if node.prim != "broadcast_in_dim" or node.kwargs["broadcast_dimensions"] != (dim,) or \
            any(i != n for d, (i, n) in enumerate(zip(index.shape, x.shape)) if d != dim):
        return None
    while True:
        node, inner = trace.defining(operands[0])
        if node.prim == "constant":
            table = node.kwargs["value"].tensor.reshape(-1)
            # (a one-entry table broadcast along dim picks that entry at every position)
            return table if table.numel() == index.shape[dim] else None
        if node.prim != "reshape":
            return None
        operands = inner


def _readers(table: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The inverse of the positions ``table`` picks among ``n``: for each position, the
    entries of ``table`` that picked it ([n, r], padded) and which of those are real; None
    where a position has more than GATHERED_BACK_MAX_READERS readers, or the table is much
    shorter than ``n`` (the inverse would be mostly padding)."""
    table = table.cpu()
    if table.numel() == 0 or n > 4 * table.numel() or int(table.min()) < 0 or \
            int(table.max()) >= n:
        return None  # (a table much shorter than the dim, or out of range: the scatter)
    counts = torch.bincount(table, minlength=n)
    readers = int(counts.max())
    if readers > GATHERED_BACK_MAX_READERS:
        return None
    order = torch.argsort(table, stable=True)
    slot = torch.arange(readers)
    first = torch.cumsum(counts, 0) - counts
    inverse = order[(first[:, None] + slot).clamp(max=table.numel() - 1)]
    return inverse, slot < counts[:, None]


def _gathered_back(ct, dim: int, inverse: torch.Tensor, real: torch.Tensor):
    """The cotangent of x.index_select(dim, table) as a gather: each position sums the
    cotangents of the entries that read it (``_readers``). Elementwise and a short sum, it
    fuses with what computes ``ct``; a scatter writes a zeroed buffer with atomic adds."""
    n, readers = inverse.shape
    picked = ct.index_select(dim, inverse.reshape(-1).to(ct.device)).unflatten(dim, (n, readers))
    mask = real.reshape((n, readers) + (1,) * (ct.ndim - dim - 1)).to(ct.device)
    return torch.where(mask, picked, torch.zeros((), dtype=ct.dtype, device=ct.device)) \
        .sum(dim + 1)


def _scatter_infer(x, index, src, *, dim, reduce, include_self):
    ok = index.dtype == torch.int64 and index.ndim == x.ndim == src.ndim and x.dtype == src.dtype
    _check(ok, "scatter", f"index must be int64 and all operands of one rank (dim={dim})",
           x, index, src)
    return (x,)


def _scatter_impl(x, index, src, *, dim, reduce, include_self):
    if reduce is None:
        return torch.scatter(x, dim, index, src)
    if reduce == "sum" and include_self:  # scatter_reduce copies x twice, scatter_add once
        return torch.scatter_add(x, dim, index, src)
    return torch.scatter_reduce(x, dim, index, src, reduce, include_self=include_self)


define("scatter", _scatter_infer, _scatter_impl)


@vjp_rule("scatter")
def _scatter_vjp(cts, x, index, src, *, outs, dim, reduce, include_self):
    ct = cts[0]
    if x.dtype.is_complex and reduce not in (None, "sum"):
        raise UnsupportedOpError(f"scatter with reduce={reduce!r} has no derivative rule on "
                                 "complex values; scatter the real and imaginary parts apart")
    if reduce is None:  # overwritten positions owe nothing to x
        return ct.scatter(dim, index, 0.0), None, torch.gather(ct, dim, index)
    if reduce == "sum":
        kept = ct if include_self else ct.scatter(dim, index, 0.0)
        return kept, None, torch.gather(ct, dim, index)
    if reduce == "mean":  # a scattered position is the mean of its sources (and itself)
        count = torch.zeros_like(x).scatter_add(dim, index, torch.ones_like(src))
        hit = count > 0
        share = ct / torch.where(hit, count + int(include_self), 1.0)
        kept = torch.where(hit, share if include_self else 0.0, ct)
        return kept, None, torch.gather(share, dim, index)
    if reduce in ("amax", "amin"):  # the cotangent is shared by all that equal the result
        y = outs[0]
        self_hit = x == y
        if not include_self:
            self_hit = self_hit.scatter(dim, index, False)
        src_hit = src == torch.gather(y, dim, index)
        count = self_hit.to(ct.dtype).scatter_add(dim, index, src_hit.to(ct.dtype))
        share = ct / torch.where(count > 0, count, 1.0)
        return (torch.where(self_hit, share, 0.0), None,
                torch.where(src_hit, torch.gather(share, dim, index), 0.0))
    if reduce == "prod":  # products of the others, recomputed with zeros masked out
        y = outs[0]
        masked_x = torch.where(x == 0, 1.0, x)
        kept = ct * masked_x.scatter_reduce(dim, index, src, "prod",
                                            include_self=include_self) / masked_x
        kept = kept if include_self else kept.scatter(dim, index, 0.0)
        src_zero = src == 0
        zeros_there = torch.gather(torch.zeros_like(x).scatter_add(
            dim, index, src_zero.to(x.dtype)), dim, index)
        single_zero = src_zero & (zeros_there == 1)
        without_it = x.scatter_reduce(dim, index, torch.where(single_zero, 1.0, src), "prod",
                                      include_self=include_self)
        return kept, None, torch.where(
            single_zero, torch.gather(ct * without_it, dim, index),
            torch.gather(ct * y, dim, index) / torch.where(src_zero, 1.0, src))
    raise UnsupportedOpError(f"scatter with reduce={reduce!r} has no derivative rule yet")


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


@vjp_rule("sort", "topk")
def _selection_vjp(cts, x, *, outs, **params):
    """The selected values' cotangents go back to where they came from."""
    dim = params["dim"] if x.ndim else 0
    if not x.ndim:
        return (cts[0],)
    return (torch.zeros_like(x).scatter_add(dim, outs[1], cts[0]),)


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


# A DFT's adjoint is the DFT the other way, scaled alike (the normalization is a real factor).
vjp_rule("fft_c2c")(lambda cts, x, *, outs, dim, normalization, forward: (
    bind("fft_c2c", cts[0], dim=dim, normalization=normalization, forward=not forward),))


@vjp_rule("fft_r2c")
def _fft_r2c_vjp(cts, x, *, outs, dim, normalization, onesided):
    """The inverse transform of the cotangent, zero in the bins a onesided result drops (the
    engine keeps its real part: x is real)."""
    ct, last = cts[0], dim[-1]
    if onesided:
        high = tuple(x.shape[d] - n if d == last else 0 for d, n in enumerate(ct.shape))
        ct = bind("pad", ct, low=(0,) * x.ndim, high=high, value=0.0)
    return (bind("fft_c2c", ct, dim=dim, normalization=normalization, forward=False),)


@vjp_rule("fft_c2r")
def _fft_c2r_vjp(cts, x, *, outs, dim, normalization, last_dim_size):
    """The forward transform of the cotangent, onesided. A bin the Hermitian extension mirrors
    (all but the first, and the middle one of an even length) feeds two outputs: doubled."""
    ct, last = bind("fft_r2c", cts[0], dim=dim, normalization=normalization,
                     onesided=True), dim[-1]
    mirrored = last_dim_size - x.shape[last]
    if mirrored <= 0:
        return (ct,)
    return (torch.cat([ct.narrow(last, 0, 1), 2 * ct.narrow(last, 1, mirrored),
                       ct.narrow(last, 1 + mirrored, x.shape[last] - 1 - mirrored)], last),)


# The primitives whose derivative rules hold on complex values (NOTE [complex derivatives]).
COMPLEX_RULES = frozenset((
    "abs acos acosh asin asinh atan atanh cos cosh exp exp2 expm1 log log10 log1p log2 neg "
    "reciprocal rsqrt sin sinh sqrt tan tanh add sub mul div pow where convert complex real "
    "imag conj fft_r2c fft_c2r fft_c2c after stop_gradient no_grad no_fwd_grad "
    "broadcast_in_dim reshape transpose slice pad concatenate rev sum prod cumsum cumprod "
    "dot_general gather scatter custom_vjp").split())


# ---------------------------------------------------------------------------------------
# Batching rules (NOTE [batching] in tracer/batching.py): batch dims are leading, so most
# rules line the unbatched operands up and shift the dimension params by one.
# ---------------------------------------------------------------------------------------
def loop(prim: str, operands, batched, axis_size: int, params: dict):
    """The fallback rule: one call per example, results stacked."""
    per_example = [_results(bind(prim, *[x[k] if b else x for x, b in zip(operands, batched)],
                              **params)) for k in range(axis_size)]
    outs = [torch.stack([ex[i] for ex in per_example]) for i in range(len(per_example[0]))]
    return outs, [True] * len(outs)


def _results(result) -> list:
    return list(result) if isinstance(result, tuple) else [result]


def _spread(operands, batched, axis_size):
    """Every operand with the leading batch dim (unbatched ones broadcast to it)."""
    return [x if b else x.unsqueeze(0).expand(axis_size, *x.shape)
            for x, b in zip(operands, batched)]


def _shifted(shift_params: Callable[[dict], dict]):
    """A rule for ops whose operands all get the batch dim, with shifted dim params."""
    def rule(operands, batched, axis_size, **params):
        if shift_params(params) != params and not operands[0].ndim - batched[0]:
            return loop(rule.name, operands, batched, axis_size, params)
        out = bind(rule.name, *_spread(operands, batched, axis_size), **shift_params(params))
        outs = list(out) if isinstance(out, tuple) else [out]
        return outs, [True] * len(outs)

    return rule


def _shift(*keys: str):
    """Params naming dims (an int or a tuple of ints) move one to the right."""
    def shift(params):
        return {k: (tuple(d + 1 for d in v) if isinstance(v, tuple) else v + 1)
                if k in keys else v for k, v in params.items()}

    return shift


def _attach_shifted(names, *keys):
    for name in names:
        rule = _shifted(_shift(*keys))
        rule.name = name
        PRIMITIVES[name].batch = rule


_attach_shifted([*ELEMENTWISE, "complex", "real", "imag", "conj", "frexp", "stop_gradient",
                 "no_grad", "no_fwd_grad", "after"])
_attach_shifted(list(REDUCTIONS) + ["argmax", "argmin", "rev"], "dims")
_attach_shifted(list(SCANS) + ["sort", "topk", "gather", "scatter", "concatenate", "fft_r2c",
                               "fft_c2r", "fft_c2c"], "dim")


@batch_rule("broadcast_in_dim")
def _broadcast_batch(operands, batched, axis_size, *, shape, broadcast_dimensions):
    return [bind("broadcast_in_dim", operands[0], shape=(axis_size, *shape),
                  broadcast_dimensions=(0, *(d + 1 for d in broadcast_dimensions)))], [True]


batch_rule("reshape")(lambda ops, b, n, *, shape: (
    [bind("reshape", ops[0], shape=(n, *shape))], [True]))
batch_rule("transpose")(lambda ops, b, n, *, permutation: (
    [bind("transpose", ops[0], permutation=(0, *(p + 1 for p in permutation)))], [True]))
batch_rule("slice")(lambda ops, b, n, *, start, limit, step: (
    [bind("slice", ops[0], start=(0, *start), limit=(n, *limit), step=(1, *step))], [True]))
batch_rule("pad")(lambda ops, b, n, *, low, high, value: (
    [bind("pad", ops[0], low=(0, *low), high=(0, *high), value=value)], [True]))


@batch_rule("dot_general")
def _dot_general_batch(operands, batched, axis_size, *, contracting, batch):
    """The vmapped dim becomes the first batch dim of both operands."""
    lhs, rhs = _spread(operands, batched, axis_size)
    (lc, rc), (lb, rb) = contracting, batch
    up = lambda dims: tuple(d + 1 for d in dims)  # noqa: E731
    return [bind("dot_general", lhs, rhs, contracting=(up(lc), up(rc)),
                  batch=((0, *up(lb)), (0, *up(rb))))], [True]


# ---------------------------------------------------------------------------------------
# JVP rules of the linear primitives: the tangent goes through the primitive itself
# (missing tangents of a multi-operand op are zeros). Bilinear ones take one term per
# operand. Other primitives derive their JVP from their VJP (passes/autodiff.py).
# ---------------------------------------------------------------------------------------
def _zeros_for(tangents, operands):
    return [t if t is not None else torch.zeros_like(x) for t, x in zip(tangents, operands)]


def _linear_jvp(name: str, linear_in: tuple[int, ...] | None = None, **fixed):
    """``linear_in``: the operands the op is linear in (the others, e.g. indices or a
    predicate, pass through as they are); ``fixed`` overrides params (pad's value)."""
    def rule(operands, tangents, outs, **params):
        idx = range(len(operands)) if linear_in is None else linear_in
        if all(tangents[i] is None for i in idx):
            return (None,) * len(outs)
        args = list(operands)
        for i, t in zip(idx, _zeros_for([tangents[i] for i in idx], [operands[i] for i in idx])):
            args[i] = t
        out = bind(name, *args, **{**params, **fixed})
        return tuple(out) if isinstance(out, tuple) else (out,)

    return rule


for _name in ("after", "reshape", "transpose", "broadcast_in_dim", "slice", "concatenate",
              "rev", "sum", "cumsum", "real", "imag", "conj", "complex", "fft_r2c", "fft_c2r",
              "fft_c2c"):
    PRIMITIVES[_name].jvp = _linear_jvp(_name)
PRIMITIVES["pad"].jvp = _linear_jvp("pad", value=0.0)
PRIMITIVES["where"].jvp = _linear_jvp("where", (1, 2))
PRIMITIVES["gather"].jvp = _linear_jvp("gather", (0,))
jvp_rule("convert")(lambda ops, tans, outs, *, dtype: (  # the engine casts it
    tans[0] if dtype.is_floating_point or dtype.is_complex else None,))
jvp_rule("stop_gradient")(lambda ops, tans, outs: (None,))
jvp_rule("no_grad")(lambda ops, tans, outs: (tans[0],))
jvp_rule("no_fwd_grad")(lambda ops, tans, outs: (None,))


@jvp_rule("scatter")
def _scatter_jvp(operands, tangents, outs, *, dim, reduce, include_self):
    if reduce not in (None, "sum"):
        return None  # not linear: derived from the VJP
    return _linear_jvp("scatter", (0, 2))(operands, tangents, outs, dim=dim, reduce=reduce,
                                          include_self=include_self)


@jvp_rule("dot_general")
def _dot_general_jvp(operands, tangents, outs, **params):
    (lhs, rhs), (tl, tr) = operands, tangents
    terms = ([bind("dot_general", tl, rhs, **params)] if tl is not None else []) + (
        [bind("dot_general", lhs, tr, **params)] if tr is not None else [])
    return (sum(terms[1:], terms[0]),)


@jvp_rule("sort", "topk")
def _selection_jvp(operands, tangents, outs, **params):
    x, t = operands[0], tangents[0]
    if x.ndim == 0:
        return t, None
    return torch.gather(t, params["dim"], outs[1]), None
