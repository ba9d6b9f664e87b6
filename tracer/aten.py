"""ATen and prims ops -> plait primitives.

Handlers receive the op's arguments (tracers, real tensors, Python values) and emit
primitives with ``bind``. A handler may also call torch functions on tracers: those re-enter
the dispatcher and are traced like any other op, which keeps the composite handlers (advanced
indexing, scatter of a mask) short. Promotion and broadcasting of elementwise ops come from
``torch._refs``, which mirror eager exactly: reached through the decomposition table, or,
for the plain forms of the common ops, followed here (NOTE [plain forms of torch's
references]). The ``prims`` handlers then only need to line up Python scalars and 0-dim
tensors.
"""
from __future__ import annotations

import functools
import math

import attrs
import sympy
import torch
import torch._prims  # noqa: F401  (registers every torch.ops.prims op before handlers bind)
import torch._refs.nn.functional

from ..errors import OpError, ShapeError, UnsupportedOpError
from ..graph import TensorType
from ..graph.types import contiguous_strides, dimension, equal_sizes, is_symbolic
from .primitives import (BINARY, COMPARISONS, SPECIAL_BINARY, SPECIAL_UNARY, UNARY,
                         UNARY_PREDICATES)
from . import randomness as _randomness  # noqa: F401  (refuses seeding while tracing)
from .sizes import Specialized, is_one, params_dimensions, reported, same_size
from .trace import (FUNCTION_HANDLERS, HANDLERS, TracerTensor, _NeedsFallback, _meta_with,
                    bind, current_trace, unwrap_functional)

aten, prims = torch.ops.aten, torch.ops.prims


def handles(*ops):
    def register(fn):
        for op in ops:
            if op is not None:  # ops missing from this torch version
                HANDLERS[op] = fn
        return fn

    return register


def _prim(name: str):
    packet = getattr(prims, name, None)
    return getattr(packet, "default", None)


def type_of(x) -> TensorType:
    return current_trace().type_of(x)


def alias(x) -> TracerTensor:
    """A new tracer for the same value (never hand back the argument object itself: a later
    write to one must not rebind the other). Whether it is a view is the dispatcher's call,
    from the op's schema."""
    trace = current_trace()
    return TracerTensor(trace, trace.value_of(x))


def full(shape, value, dtype, device):
    return bind("full", shape=tuple(shape), value=value, dtype=dtype, device=str(device))


def broadcast_to(x, shape):
    t = type_of(x)
    shape = tuple(map(dimension, shape))  # size expressions compare without guards
    if t.shape == shape:
        return x
    lead = len(shape) - t.ndim
    if lead < 0:
        raise ShapeError(f"cannot broadcast {t} to {list(shape)}")
    return bind("broadcast_in_dim", x, shape=shape, broadcast_dimensions=tuple(
        range(lead, len(shape))))


def convert(x, dtype):
    return x if type_of(x).dtype == dtype else bind("convert", x, dtype=dtype)


def reshape(x, shape):
    return x if type_of(x).shape == tuple(shape) else bind("reshape", x, shape=tuple(shape))


# ---------------------------------------------------------------------------------------
# prims (the targets of torch._refs)
# ---------------------------------------------------------------------------------------
def broadcast_shapes(*shapes) -> tuple[int, ...]:
    """The shape ``shapes`` broadcast to (torch.broadcast_shapes imports the symbolic-shapes
    machinery on its first call: NOTE [plain forms of torch's references])."""
    out = [1] * max(map(len, shapes), default=0)
    for shape in shapes:  # sizes equal only at these sizes are guarded (``same_size``)
        for i, n in enumerate(map(dimension, shape), len(out) - len(shape)):
            if not is_one(n) and not is_one(out[i]) and not same_size(n, out[i]):
                raise ShapeError("shapes " + ", ".join(str(list(s)) for s in shapes) +
                                 " do not broadcast: sizes must match or be 1 in every dim")
            out[i] = n if is_one(out[i]) else out[i]
    return tuple(out)


def common_shape(operands) -> tuple[tuple[int, ...], str]:
    """Broadcast shape and device of the tensor operands."""
    tensors = [x for x in operands if isinstance(x, torch.Tensor)]
    return broadcast_shapes(*[type_of(x).shape for x in tensors]), type_of(tensors[0]).device


def line_up(operands, dtype, shape, device) -> list:
    """Operands -> tracers of one shape and dtype, as strict primitives need: tensors are
    converted and broadcast, Python scalars become ``full``."""
    return [broadcast_to(convert(x, dtype), shape) if isinstance(x, torch.Tensor)
            else full(shape, x, dtype, device) for x in operands]


def _elementwise(name):
    """prims' operands already share a dtype, except Python scalars and 0-dim tensors."""
    def handler(*args):
        shape, device = common_shape(args)
        widest = max((x for x in args if isinstance(x, torch.Tensor)),
                     key=lambda x: type_of(x).ndim)
        return bind(name, *line_up(args, type_of(widest).dtype, shape, device))

    return handler


for _name in UNARY + BINARY + list(UNARY_PREDICATES) + list(COMPARISONS):
    HANDLERS[_prim(_name)] = _elementwise(_name)


@handles(_prim("where"))
def _prims_where(pred, a, b):
    shape, device = common_shape((pred, a, b))
    dtype = next(type_of(x).dtype for x in sorted(
        (x for x in (a, b) if isinstance(x, torch.Tensor)), key=lambda x: -type_of(x).ndim))
    (pred,) = line_up((pred,), torch.bool, shape, device)
    return bind("where", pred, *line_up((a, b), dtype, shape, device))


@handles(_prim("convert_element_type"))
def _prims_convert(a, dtype):
    return convert(a, dtype) if type_of(a).dtype != dtype else alias(a)


@handles(_prim("broadcast_in_dim"))
def _prims_broadcast(a, shape, broadcast_dimensions):
    return bind("broadcast_in_dim", a, shape=tuple(shape),
                     broadcast_dimensions=tuple(broadcast_dimensions))


@handles(_prim("reshape"))
def _prims_reshape(a, shape):
    return bind("reshape", a, shape=tuple(shape))


@handles(_prim("transpose"))
def _prims_transpose(a, permutation):
    return bind("transpose", a, permutation=tuple(permutation))


@handles(_prim("squeeze"))
def _prims_squeeze(a, dimensions):
    shape = [n for i, n in enumerate(type_of(a).shape) if i not in dimensions]
    return bind("reshape", a, shape=tuple(shape))


@handles(_prim("split_dim"))
def _prims_split_dim(a, dim, outer_length):
    shape = list(type_of(a).shape)
    shape[dim:dim + 1] = [outer_length, shape[dim] // outer_length]
    return bind("reshape", a, shape=tuple(shape))


@handles(_prim("collapse_view"), _prim("collapse"))
def _prims_collapse(a, start, end):
    shape = list(type_of(a).shape)
    shape[start:end] = [math.prod(shape[start:end])]
    return bind("reshape", a, shape=tuple(shape))


@handles(_prim("view_of"))
def _prims_view_of(a):
    return alias(a)


@handles(_prim("clone"), _prim("copy_strided"))
def _prims_clone(a, *args, **kwargs):
    return alias(a)


@handles(_prim("rev"))
def _prims_rev(a, dims):
    return bind("rev", a, dims=tuple(dims))


@handles(_prim("cat"))
def _prims_cat(tensors, dim):
    return bind("concatenate", *tensors, dim=dim)


@handles(_prim("iota"))
def _prims_iota(length, *, start, step, dtype, device, requires_grad=False):
    return bind("iota", length=length, start=start, step=step, dtype=dtype, device=str(device))


@handles(_prim("full"))
def _prims_full(shape, fill_value, *, dtype, device, requires_grad=False):
    return full(shape, fill_value, dtype, device)


@handles(_prim("full_like"))
def _prims_full_like(a, fill_value, *, dtype, device, requires_grad=False):
    return full(type_of(a).shape, fill_value, dtype, device)


@handles(_prim("scalar_tensor"))
def _prims_scalar_tensor(s, *, dtype=None, device=None):
    return full((), s, dtype or torch.get_default_dtype(), device or "cpu")


# Uninitialized memory: any value is correct; zeros keep runs reproducible.
@handles(_prim("empty_strided"), _prim("empty_permuted"))
def _prims_empty_strided(shape, _layout, *, dtype, device, requires_grad=False):
    return full(shape, 0, dtype, device)


@handles(_prim("empty"))
def _prims_empty(shape, *, dtype, device, requires_grad=False):
    return full(shape, 0, dtype, device)


@handles(_prim("fill"))
def _prims_fill(a, value):
    t = type_of(a)
    return full(t.shape, value, t.dtype, t.device)


def _prims_reduction(name):
    def handler(inp, dims, *, output_dtype=None):
        out = bind(name, inp, dims=tuple(dims))
        return convert(out, output_dtype) if output_dtype is not None else out

    return handler


for _name in ("sum", "prod", "amax", "amin"):
    HANDLERS[_prim(_name)] = _prims_reduction(_name)


@handles(_prim("var"))
def _prims_var(inp, dims, correction, *, output_dtype=None):
    t = type_of(inp)
    dims = tuple(d % max(t.ndim, 1) for d in dims) if dims is not None else tuple(range(t.ndim))
    n = math.prod(t.shape[d] for d in dims)
    kept = tuple(i for i in range(t.ndim) if i not in dims)
    mean = bind("div", bind("sum", inp, dims=dims), full(
        [t.shape[i] for i in kept], n, t.dtype, t.device))
    centered = bind("sub", inp, bind("broadcast_in_dim", mean, shape=t.shape,
                                     broadcast_dimensions=kept))
    squares = bind("sum", bind("mul", centered, centered), dims=dims)
    out = bind("div", squares, full(type_of(squares).shape, max(0, n - correction), t.dtype,
                                    t.device))
    return convert(out, output_dtype) if output_dtype is not None else out


@handles(_prim("copy_to"))
def _prims_copy_to(a, b):
    return _copy_(a, b)


@handles(_prim("device_put"))
def _prims_device_put(a, device, non_blocking=False):
    if torch.device(type_of(a).device) != torch.device(device):
        raise _NeedsFallback("device transfer")
    return alias(a)


def _complex_part(name: str):
    """conj/real/imag of a real tensor: the tensor itself (conj, real) or zeros (imag)."""
    def handler(a):
        if type_of(a).dtype.is_complex:
            return bind(name, a)
        if name == "imag":
            raise _NeedsFallback("imag of a real tensor")  # eager raises too
        return alias(a)

    return handler


for _name in ("conj", "real", "imag"):
    HANDLERS[_prim(_name)] = _complex_part(_name)
HANDLERS[_prim("conj_physical")] = HANDLERS[aten._conj.default] = HANDLERS[
    aten.conj_physical.default] = _complex_part("conj")


@handles(aten.where.Scalar)
def _where_scalars(condition, a, b):
    """Two Python scalars: the dtype is their promotion as 0-dim tensors (float32 for floats)."""
    dtype = torch.result_type(torch.tensor(a), torch.tensor(b))
    shape, device = type_of(condition).shape, type_of(condition).device
    return bind("where", convert(condition, torch.bool), *line_up((a, b), dtype, shape, device))


@handles(getattr(aten.where, "ScalarOther", None), getattr(aten.where, "ScalarSelf", None))
def _where_one_scalar(condition, a, b):
    """A tensor and a Python scalar (some torch versions dispatch these overloads, with no
    decomposition): promoted as eager promotes a tensor with a scalar, all broadcast."""
    tensor = a if isinstance(a, torch.Tensor) else b
    dtype = torch.result_type(a, b)
    shape = broadcast_shapes(type_of(condition).shape, type_of(tensor).shape)
    device = type_of(tensor).device
    (pred,) = line_up((convert(condition, torch.bool),), torch.bool, shape, device)
    return bind("where", pred, *line_up((a, b), dtype, shape, device))


@handles(_prim("frexp"))
def _prims_frexp(x):
    return bind("frexp", x)


@handles(aten.complex.default)
def _complex(re, im):
    shape, device = common_shape((re, im))
    return bind("complex", *line_up((re, im), type_of(re).dtype, shape, device))


@handles(aten.view_as_real.default)
def _view_as_real(x):
    parts = [torch.unsqueeze(bind(name, x), -1) for name in ("real", "imag")]
    return torch.cat(parts, -1)


@handles(aten.view_as_complex.default)
def _view_as_complex(x):
    t = type_of(x)
    if not t.ndim or t.shape[-1] != 2:
        raise ShapeError(f"view_as_complex needs a last dimension of size 2, got {t}")
    return bind("complex", *(x.select(-1, i) for i in range(2)))


@handles(aten.polar.default)
def _polar(magnitude, angle):
    return torch.complex(magnitude * torch.cos(angle), magnitude * torch.sin(angle))


@handles(aten.angle.default)
def _angle(x):
    if type_of(x).dtype.is_complex:
        return torch.atan2(bind("imag", x), bind("real", x))
    x = convert(x, _float_result(x))  # integers promote, as in eager
    return torch.where(x < 0, math.pi, torch.where(torch.isnan(x), x, 0.0))


def _fft(kind: str):
    def handler(x, dim, normalization, option):
        ndim = max(type_of(x).ndim, 1)  # dims made non-negative: vmap shifts them
        return bind(f"fft_{kind}", x, dim=tuple(d % ndim for d in dim),
                    normalization=normalization,
                    **{{"r2c": "onesided", "c2r": "last_dim_size", "c2c": "forward"}[kind]:
                       option})

    return handler


for _kind in ("r2c", "c2r", "c2c"):
    HANDLERS[getattr(aten, f"_fft_{_kind}").default] = _fft(_kind)


@handles(_prim("as_strided"), _prim("as_strided_scatter"), _prim("view_of_dtype"),
         _prim("resize"), _prim("xor_sum"))
def _prims_no_equivalent(*args, **kwargs):
    raise _NeedsFallback("prim without a plait equivalent")


# ---------------------------------------------------------------------------------------
# ATen elementwise ops, sums and means: the plain forms of torch's references
# ---------------------------------------------------------------------------------------
# NOTE [plain forms of torch's references]
# Most ATen elementwise ops decompose to a reference (torch._refs) made by one of two generic
# factories: promote the operands (elementwise_dtypes, by the reference's promotion kind),
# broadcast them, run the body (usually one prim), convert the result. Run per op, the
# factories' wrappers cost most of a trace (signature binding, scalar and out= handling), and
# their torch._check imports torch.fx.experimental.symbolic_shapes, about 15 ms once per
# process: most of a warm start's tracing. So plait reads each such reference's body and
# promotion kind out of the reference itself (torch stays the one source of the semantics)
# and does the promotion and broadcasting here, with the same nodes as a result; sums, means,
# dtype conversions and add, sub and div without alpha get the same treatment by hand. A
# call outside the plain form (a keyword, an operand the reference rejects) gets
# NotImplemented from its plain rule, and the dispatcher runs the reference. (A few bodies,
# deg2rad's say, still call torch._check themselves.)
_K = torch._prims_common.ELEMENTWISE_TYPE_PROMOTION_KIND
_R = torch._prims_common.REDUCTION_OUTPUT_TYPE_KIND


def _code_named(factory, name: str):
    """The code of the function called ``name`` that ``factory`` defines, at any depth."""
    stack = [factory.__code__]
    while stack:
        code = stack.pop()
        if code.co_name == name:
            return code
        stack += [c for c in code.co_consts if hasattr(c, "co_consts")]
    return None


# The bodies of the generic references (none where a torch version renamed them: then every
# op runs its reference).
_GENERIC_BODIES = {_code_named(torch._refs._make_elementwise_unary_reference, "_ref"),
                   _code_named(torch._refs._make_elementwise_binary_reference, "_ref")} - {None}


def _closure(fn) -> dict:
    code = getattr(fn, "__code__", None)
    return {} if code is None else dict(zip(
        code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def _generic_reference(reference):
    """(body's closure, promotion kind) of a reference from the generic factories, read
    through its wrappers (each keeps the function it wraps as ``fn``; the factories'
    ``wraps(prim)`` points ``__wrapped__`` past them); None for any other, and for one with
    an extra check of its operand (neg's)."""
    kind = None
    while reference is not None:
        cells = _closure(reference)
        promotion = cells.get("self")
        if isinstance(promotion, torch._prims_common.wrappers.elementwise_type_promotion_wrapper):
            kind = promotion.type_promotion_kind
        if getattr(reference, "__code__", None) in _GENERIC_BODIES:
            return (cells, kind) if kind is not None and not cells.get("extra_meta") else None
        reference = cells.get("fn", getattr(reference, "__wrapped__", None))
    return None


def _symbolic_number(x):
    """A number that is a symbolic size (a mean's count: NOTE [dynamic dimensions]), as its
    expression; else None."""
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        x = params_dimensions(x)
    return x if isinstance(x, sympy.Basic) and x.free_symbols else None


def _promoted(operands, kind, body):
    """``body`` on ``operands`` promoted and broadcast as torch's elementwise references do,
    its result converted to the promoted result dtype. A real tensor operand (a constant) is
    converted and broadcast eagerly, as there. A prim body goes straight to its handler."""
    compute, result = torch._prims_common.elementwise_dtypes(*operands,
                                                              type_promotion_kind=kind)
    number = torch._prims_common.dtype_to_type_ctor(compute)
    device = next((type_of(x).device for x in operands if isinstance(x, TracerTensor)), "cpu")
    operands = [(full((), size, compute, device) if (size := _symbolic_number(x)) is not None
                 else number(x)) if not isinstance(x, torch.Tensor) else convert(x, compute)
                if isinstance(x, TracerTensor) else x.to(compute) for x in operands]
    if len(operands) > 1:
        shape = broadcast_shapes(*[x.shape for x in operands if isinstance(x, torch.Tensor)])
        # a 0-dim CPU tensor is left to the prim to broadcast, as in the references
        operands = [x if not isinstance(x, torch.Tensor) or
                    torch._prims_common.is_cpu_scalar_tensor(x) else
                    broadcast_to(x, shape) if isinstance(x, TracerTensor) or is_symbolic(shape)
                    else x.expand(shape) if x.shape != shape else x for x in operands]
    return convert(HANDLERS.get(body, body)(*operands), result)


def _generic_rule(cells, kind):
    body = cells["prim"]
    scalars_allowed = (cells.get("supports_lhs_python_scalar", False),
                       cells.get("supports_rhs_python_scalar", False))

    def plain(*args, **kwargs):
        if kwargs or any(not isinstance(x, torch.Tensor) and not allowed
                         for x, allowed in zip(args, scalars_allowed)):
            return NotImplemented
        return _promoted(args, kind, body)

    return plain


PLAIN_FORMS: set = set()  # the ops given a plain rule


def _plain(op, rule):
    HANDLERS[op] = rule
    PLAIN_FORMS.add(op)


def _pow(a, b):
    """torch._refs.pow's body (its special exponents) without the symbolic-shapes machinery
    it imports to compare them, and a cube as eager's kernels compute it (``x * x * x``, not
    ``std::pow``: GELU's tanh form cubes)."""
    if not isinstance(b, torch.Tensor):
        if b == 1.0:
            return a.clone()
        if b == 2.0:
            return a * a
        if b == 3.0:
            return a * a * a
        if b == 0.5:
            return torch.sqrt(a)
    elif not isinstance(a, torch.Tensor):
        if a == 1.0:
            return torch.fill(b, True)
        if a == 2.0 and (type_of(b).dtype.is_floating_point or type_of(b).dtype.is_complex):
            return torch.exp2(b)
    return prims.pow.default(a, b)


_OWN_BODIES = {aten.pow: _pow}  # generic references whose body is written here

for _op, _reference in list(torch._decomp.decomposition_table.items()):
    if isinstance(_op, torch._ops.OpOverload) and not _op._schema.is_mutable and \
            _op not in HANDLERS and (_generic := _generic_reference(_reference)):
        _cells, _kind = _generic
        if _own := _OWN_BODIES.get(_op.overloadpacket):
            _cells = {**_cells, "prim": _own}
        _plain(_op, _generic_rule(_cells, _kind))


def _neg(a):
    if type_of(a).dtype == torch.bool:
        return NotImplemented  # its reference's one extra check, with its message
    return _promoted((a,), _K.DEFAULT, prims.neg.default)


def _without_alpha(body):
    """add and sub: a generic binary body, when no alpha scales the second operand."""
    def plain(a, b, *, alpha=None):
        return NotImplemented if alpha is not None else _promoted((a, b), _K.DEFAULT, body)

    return plain


_plain(aten.neg.default, _neg)
_plain(aten.add.Tensor, _without_alpha(prims.add.default))
_plain(aten.sub.Tensor, _without_alpha(prims.sub.default))
_plain(aten.div.Tensor, lambda a, b: _promoted((a, b), _K.INT_TO_FLOAT, prims.div.default))
_plain(aten.to.dtype, lambda x, dtype, non_blocking=False, copy=False, memory_format=None:
       NotImplemented if non_blocking or copy or memory_format is not None else
       convert(x, dtype))


def _sum(x, dim=None, keepdim=False, *, dtype=None, mean=False):
    """The references' sum (and, with ``mean``, their mean) over ``dim`` (every dim for
    None or []), accumulated in the computation dtype of ``dtype``."""
    t = type_of(x)
    exact = t.dtype.is_floating_point or t.dtype.is_complex
    dtype = dtype or (t.dtype if exact or mean else torch.int64)
    if mean and not (dtype.is_floating_point or dtype.is_complex):
        return NotImplemented  # the reference's error
    dims = torch._prims_common.reduction_dims(t.shape, None if dim in ((), []) else dim)
    compute, result = torch._prims_common.reduction_dtypes(x, _R.KEEP_PROMOTED_TYPE if mean
                                                           else _R.SAME, dtype)
    out = bind("sum", convert(x, compute), dims=dims)
    if keepdim:
        out = bind("broadcast_in_dim", out, shape=tuple(
            1 if i in dims else n for i, n in enumerate(t.shape)),
            broadcast_dimensions=tuple(i for i in range(t.ndim) if i not in dims))
    if mean:
        count = math.prod(t.shape[i] for i in dims) if t.ndim else 1
        out = _promoted((out, count), _K.INT_TO_FLOAT, prims.div.default)
    return convert(out, dtype if mean else result)


for _op in (aten.sum.default, aten.sum.dim_IntList):
    _plain(_op, _sum)
for _op in (aten.mean.default, aten.mean.dim):
    _plain(_op, functools.partial(_sum, mean=True))


# var_mean takes one pass over inputs of at least this many bytes (NOTE in ``_var_mean``)
ONE_PASS_VARIANCE_BYTES = 1 << 20


@handles(aten.var_mean.correction)
def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    """Variance and mean over dims that are not only the last ones (BatchNorm's statistics
    over (N, H, W)) in one pass: sums of x - s and of its square, s being x's first element
    of each reduced set (the shifted-data formula: s is a sample, so the two sums do not
    cancel as sums of x and x**2 would). Both sums read x once, in one kernel; the mean's
    pass and then the deviations' would read it twice, an activation too large to stay in
    cache (ResNet-50's on an H200: 28.3 -> 26.8 ms a step). A smaller input stays with the
    reference, read again from cache (a small ResNet on the CPU: 1.74 ms a step, against
    1.84 in one pass), and so do the last dims (a layer norm's row: one kernel reads the
    row twice from its registers)."""
    t = type_of(x)
    dims = torch._prims_common.reduction_dims(t.shape, None if dim in ((), []) else dim)
    if not t.dtype.is_floating_point or not dims or \
            dims == tuple(range(t.ndim - len(dims), t.ndim)) or \
            t.nbytes < ONE_PASS_VARIANCE_BYTES:
        return NotImplemented
    shift = x[tuple(slice(0, 1) if d in dims else slice(None) for d in range(t.ndim))]
    centred = x - shift
    n = math.prod(t.shape[d] for d in dims)
    total, squares = centred.sum(dims, keepdim=True), (centred * centred).sum(dims, keepdim=True)
    mean = total / n
    var = (squares - total * mean).clamp(min=0) / max(n - (1 if correction is None
                                                              else correction), 0)
    mean = mean + shift
    return (var, mean) if keepdim else (var.squeeze(dims), mean.squeeze(dims))


# ---------------------------------------------------------------------------------------
# ATen ops handled directly: views, contractions, indexing, scans, sorting
# ---------------------------------------------------------------------------------------
@handles(aten.detach.default)
def _detach(x):
    return bind("stop_gradient", x) if type_of(x).dtype.is_floating_point else alias(x)


def statistics_without_gradient(compute):
    """Wrap a normalization handler whose outputs after the first are saved statistics:
    PyTorch's derivative ignores their cotangents, so plait stops gradients there too."""
    def handler(*args, **kwargs):
        out, *stats = compute(*args, **kwargs)
        return (out, *(bind("stop_gradient", s) if type_of(s).dtype.is_floating_point
                       else s for s in stats))

    return handler


@attrs.frozen
class BatchNormRule:
    """The VJP of batch normalization's output in training mode (a ``custom_vjp`` rule, NOTE
    [custom functions]): PyTorch's formula, two per-channel sums of the cotangent and one
    elementwise pass, computed at float32 or wider. Differentiating the decomposition
    instead also sums the mean's share through the variance, which is zero but costs a
    pass over the input: a BatchNorm's backward read its input three times, not two."""

    has_weight: bool
    has_bias: bool
    channel: int = 1  # the input's channel dim (the last, NOTE [channels-last convolutions])

    def permuted(self, perm: tuple[int, ...]) -> BatchNormRule:
        """The rule of the same normalization of transpose(x, perm)'s data laid out as x."""
        return attrs.evolve(self, channel=perm[self.channel])

    def backward(self, ct, output: int, operands: tuple) -> list:
        x, *affine, mean, rstd, _ = operands
        weight = affine[0] if self.has_weight else None
        wide = torch.promote_types(x.dtype, torch.float32)
        dims = [d for d in range(x.ndim) if d != self.channel]
        shape = [-1 if d == self.channel else 1 for d in range(x.ndim)]
        n = x.numel() // x.shape[self.channel]
        xhat = (x.to(wide) - mean.view(shape)) * rstd.view(shape)
        ct = ct.to(wide)
        sum_ct, sum_ct_xhat = ct.sum(dims), (ct * xhat).sum(dims)
        scale = rstd if weight is None else rstd * weight.to(wide)
        dx = (ct - (sum_ct / n).view(shape) - xhat * (sum_ct_xhat / n).view(shape)) * \
            scale.view(shape)
        grads = [dx.to(x.dtype)]
        if self.has_weight:
            grads.append(sum_ct_xhat.to(weight.dtype))
        if self.has_bias:
            grads.append(sum_ct.to(affine[-1].dtype))
        return grads + [None] * (len(operands) - len(grads))


def batch_norm_differentiated_as_a_whole(compute, training_position: int):
    """Wrap a batch normalization handler: in training mode its output takes the VJP of
    ``BatchNormRule`` (the statistics it saves are the batch's mean and 1/std)."""
    def handler(*args, **kwargs):
        out, *stats = compute(*args, **kwargs)
        x, weight, bias = args[:3]
        training = args[training_position] if len(args) > training_position \
            else kwargs["training"]
        if training and type_of(x).dtype.is_floating_point and x.ndim >= 2:
            affine = [t for t in (weight, bias) if t is not None]
            out = bind("custom_vjp", x, *affine, stats[0], stats[1], out,
                       rule=BatchNormRule(weight is not None, bias is not None), output=0)
        return (out, *stats)

    return handler


_decompositions = torch._decomp.decomposition_table
HANDLERS[aten.native_layer_norm.default] = statistics_without_gradient(
    _decompositions[aten.native_layer_norm.default])
HANDLERS[aten._native_batch_norm_legit_no_training.default] = statistics_without_gradient(
    _decompositions[aten._native_batch_norm_legit_no_training.default])
for _op, _training in ((aten.native_batch_norm.default, 5),
                       (aten._native_batch_norm_legit.default, 5),
                       (aten._native_batch_norm_legit.no_stats, 3),
                       (aten._native_batch_norm_legit_functional.default, 5)):
    HANDLERS[_op] = statistics_without_gradient(
        batch_norm_differentiated_as_a_whole(_decompositions[_op], _training))


@handles(aten.alias.default, aten.lift_fresh.default,
         aten.lift_fresh_copy.default, aten.contiguous.default, aten.positive.default,
         aten.resolve_conj.default, aten.resolve_neg.default)
def _identity(x, *args, **kwargs):
    return alias(x)


@handles(aten.clone.default)
def _clone(x, *, memory_format=None):
    out = alias(x)
    out._dense = memory_format == torch.contiguous_format
    return out


# A tracer of symbolic sizes is asked its sizes through dispatch (NOTE [dynamic dimensions]).
# ``aten.size`` promises numbers: C++ code that asks it (torch 2.11's matmul) would get each
# symbol's hint, silently (no guard), so a symbolic size there fails the dynamic trace.
def _numbers(sizes, op: str):
    if any(isinstance(n, torch.SymInt) and n.node.expr.free_symbols for n in sizes):
        raise Specialized(f"torch's C++ code asked {op} for numbers, of symbolic sizes")
    return sizes


@handles(aten.sym_size.default)
def _size(x):
    return x.shape


@handles(aten.size.default)
def _size_numbers(x):
    return _numbers(x.shape, "aten.size")


@handles(aten.sym_size.int)
def _size_of(x, dim):
    return x.shape[dim]


@handles(aten.size.int)
def _size_of_number(x, dim):
    return _numbers((x.shape[dim],), "aten.size.int")[0]


@handles(aten.stride.default, aten.sym_stride.default)
def _stride(x):
    return x.stride()


@handles(aten.stride.int, aten.sym_stride.int)
def _stride_of(x, dim):
    return x.stride()[dim]


@handles(aten.sym_numel.default)
def _numel(x):
    return math.prod(x.shape)


@handles(aten.numel.default)
def _numel_number(x):
    return _numbers((math.prod(x.shape),), "aten.numel")[0]


@handles(aten.dim.default)
def _dim(x):
    return x.dim()


@handles(aten.sym_storage_offset.default)
def _storage_offset(x):
    return x.storage_offset()


@handles(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(x, shape):
    t = type_of(x)
    shape = list(map(dimension, shape))  # size expressions compare without guards
    if -1 in shape:
        known = math.prod(n for n in shape if n != -1)
        shape[shape.index(-1)] = t.numel // known if known else 0
    if not equal_sizes(math.prod(shape), t.numel):
        raise ShapeError(f"shape {list(shape)} is invalid for input of size {t.numel} ({t})")
    return bind("reshape", x, shape=tuple(shape))


@handles(aten.permute.default)
def _permute(x, dims):
    ndim = type_of(x).ndim
    perm = tuple(d % max(ndim, 1) for d in dims)
    return _carry_layout(bind("transpose", x, permutation=perm), x, lambda strides, offset: (
        tuple(strides[d] for d in perm), offset))


@handles(aten.t.default, aten.transpose.int)
def _transpose(x, dim0=0, dim1=1):
    ndim = type_of(x).ndim
    if ndim < 2:
        return alias(x)
    perm = list(range(ndim))
    dim0, dim1 = dim0 % ndim, dim1 % ndim
    perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
    return bind("transpose", x, permutation=tuple(perm))


@handles(aten.expand.default)
def _expand(x, size, *, implicit=False):
    t = type_of(x)
    lead = len(size) - t.ndim
    shape = [t.shape[i - lead] if n == -1 else n for i, n in enumerate(size)]
    return broadcast_to(x, shape) if tuple(shape) != t.shape else alias(x)


@handles(aten.unsqueeze.default)
def _unsqueeze(x, dim):
    shape = list(type_of(x).shape)
    shape.insert(dim % (len(shape) + 1), 1)
    return bind("reshape", x, shape=tuple(shape))


@handles(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(x, dim=None):
    t = type_of(x)
    dims = range(t.ndim) if dim is None else [dim] if isinstance(dim, int) else dim
    dims = {d % max(t.ndim, 1) for d in dims}
    shape = [n for i, n in enumerate(t.shape) if not (i in dims and is_one(n))]
    return bind("reshape", x, shape=tuple(shape))


_PYTHON_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
                | torch._C.DispatchKeySet(torch._C.DispatchKey.PythonTLSSnapshot))


def _inplace_view(func, functional):
    """squeeze_/unsqueeze_/t_/transpose_ change a tensor's shape in place (matmul's C++ code
    uses them). The tracer takes the functional result's value, and its own wrapper metadata
    is changed by the op's ordinary kernel, run with plait's dispatch key excluded."""
    def handler(x, *args):
        if not isinstance(x, TracerTensor):
            raise _NeedsFallback(func)
        out = functional(x, *args)
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
            func(x, *args)
        x._value = out._value
        return x

    return handler


for _func, _functional in ((aten.squeeze_.default, aten.squeeze.default),
                           (aten.squeeze_.dim, aten.squeeze.dim),
                           (aten.squeeze_.dims, aten.squeeze.dims),
                           (aten.unsqueeze_.default, aten.unsqueeze.default),
                           (aten.transpose_.default, aten.transpose.int),
                           (aten.t_.default, aten.t.default)):
    HANDLERS[_func] = _inplace_view(_func, _functional)


@handles(aten.select.int)
def _select(x, dim, index):
    t = type_of(x)
    dim = dim % t.ndim
    if not -t.shape[dim] <= index < t.shape[dim]:
        raise IndexError(f"index {index} is out of bounds for dimension {dim} with size "
                         f"{t.shape[dim]}")
    index %= t.shape[dim]
    start = [0] * t.ndim
    limit = list(t.shape)
    start[dim], limit[dim] = index, index + 1
    sliced = bind("slice", x, start=tuple(start), limit=tuple(limit), step=(1,) * t.ndim)
    out = bind("reshape", sliced, shape=t.shape[:dim] + t.shape[dim + 1:])
    return _carry_layout(out, x, lambda strides, offset: (
        strides[:dim] + strides[dim + 1:], None if offset is None else
        offset + index * strides[dim]))


@handles(aten.slice.Tensor)
def _slice(x, dim=0, start=None, end=None, step=1):
    t = type_of(x)
    dim = dim % t.ndim
    if step <= 0:
        raise ShapeError("slice step must be positive")
    if isinstance(t.shape[dim], int) and not isinstance(start, (torch.SymInt, sympy.Basic)) \
            and not isinstance(end, (torch.SymInt, sympy.Basic)):
        start, end, _ = slice(start, end).indices(t.shape[dim])
    else:  # a symbolic size or bound: compared as Python would, each comparison a guard
        n = x.shape[dim]  # (NOTE [dynamic dimensions])
        start, end = (None if b is None else reported((b,))[0] for b in (start, end))
        start, end = _within(start, n, 0), _within(end, n, n)
    end = max(start, end)
    starts, limits = [0] * t.ndim, list(t.shape)
    starts[dim], limits[dim] = dimension(start), dimension(end)
    return bind("slice", x, start=tuple(starts), limit=tuple(limits),
                step=tuple(step if i == dim else 1 for i in range(t.ndim)))


def _within(i, n, default):
    """A slice bound ``i`` of a dimension of ``n`` elements in [0, n], as ``slice.indices``
    makes it."""
    if i is None:
        return default
    i = i + n if i < 0 else i
    return 0 if i < 0 else n if i > n else i


# Strided views. A tracer's value is logically contiguous, so a view given by strides over
# it (diagonal, unfold, as_strided) is a gather from the flattened value at index
# offset + sum(i_d * stride_d), built from iotas (fusible, no index tensor in memory).
def _strided_index(x, shape, strides, offset):
    """Flat indices of the view into ``x``, checked against ``x``'s extent."""
    t = type_of(x)
    if min(strides, default=0) < 0 or offset < 0 or any(n < 0 for n in shape):
        raise ShapeError(f"strided view size={list(shape)} stride={list(strides)} "
                         f"offset={offset}: sizes, strides and offset must be non-negative")
    last = offset + sum((n - 1) * st for n, st in zip(shape, strides))
    if math.prod(shape) and last >= t.numel:
        raise ShapeError(f"strided view size={list(shape)} stride={list(strides)} "
                         f"offset={offset} reaches element {last} of {t} (out of bounds)")
    index = full(shape, offset, torch.int64, t.device)
    for d, (n, st) in enumerate(zip(shape, strides)):
        if n > 1 and st:
            ramp = bind("iota", length=n, start=0, step=st, dtype=torch.int64, device=t.device)
            index = bind("add", index, bind("broadcast_in_dim", ramp, shape=tuple(shape),
                                            broadcast_dimensions=(d,)))
    return reshape(index, (math.prod(shape),))


def strided_view(x, shape, strides, offset=0):
    t = type_of(x)
    index = _strided_index(x, shape, strides, offset)
    return reshape(bind("gather", reshape(x, (t.numel,)), index, dim=0), shape)


def strided_scatter(x, src, shape, strides, offset=0):
    """``x`` with the strided view's elements replaced by ``src``."""
    t = type_of(x)
    index = _strided_index(x, shape, strides, offset)
    src = reshape(convert(broadcast_to(src, shape), t.dtype), (math.prod(shape),))
    flat = bind("scatter", reshape(x, (t.numel,)), index, src, dim=0, reduce=None,
                include_self=True)
    return reshape(flat, t.shape)


def _diagonal_layout(t: TensorType, offset, dim1, dim2):
    dim1, dim2 = dim1 % t.ndim, dim2 % t.ndim
    if dim1 == dim2:
        raise ShapeError(f"diagonal dimensions cannot be identical ({dim1}, {dim2})")
    strides = contiguous_strides(t.shape)
    n = max(0, min(t.shape[dim1] - max(-offset, 0), t.shape[dim2] - max(offset, 0)))
    keep = [d for d in range(t.ndim) if d not in (dim1, dim2)]
    start = offset * strides[dim2] if offset >= 0 else -offset * strides[dim1]
    return ([t.shape[d] for d in keep] + [n], [strides[d] for d in keep]
            + [strides[dim1] + strides[dim2]], start if n else 0)


@handles(aten.diagonal.default, aten.diagonal_copy.default)
def _diagonal(x, offset=0, dim1=0, dim2=1):
    """A strided slice of the flattened (dim1, dim2) plane, moved last: a pure index
    rewrite, unlike the general strided view's gather."""
    t = type_of(x)
    _diagonal_layout(t, offset, dim1, dim2)  # checks the dims
    dim1, dim2 = dim1 % t.ndim, dim2 % t.ndim
    rest = [d for d in range(t.ndim) if d not in (dim1, dim2)]
    rows, cols = t.shape[dim1], t.shape[dim2]
    length = max(0, min(rows + min(offset, 0), cols - max(offset, 0)))
    start = (offset if offset >= 0 else -offset * cols) if length else 0
    flat = x.permute(rest + [dim1, dim2]).reshape(*[t.shape[d] for d in rest], rows * cols)
    return flat[..., start:start + length * (cols + 1):cols + 1]


@handles(aten.diagonal_scatter.default)
def _diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    return strided_scatter(x, src, *_diagonal_layout(type_of(x), offset, dim1, dim2))


@handles(aten.unfold.default, aten.unfold_copy.default)
def _unfold(x, dimension, size, step):
    t = type_of(x)
    shape, strides = list(t.shape) or [1], list(contiguous_strides(t.shape)) or [1]
    d = dimension % len(shape)
    if size > shape[d] or step <= 0:
        raise ShapeError(f"unfold: size {size} exceeds dimension {d} of {t}, or step {step} "
                         "is not positive")
    element_stride = strides[d]
    shape[d], strides[d] = (shape[d] - size) // step + 1, strides[d] * step
    if not t.ndim:  # a 0-dim tensor unfolds to its one window
        shape, strides = [], []
    return strided_view(x, shape + [size], strides + [element_stride])


# NOTE [eager layouts]
# A tracer's value is a logical tensor. What eager lays out in memory matters only where code
# reads it: strides, contiguity and the storage offset, and as_strided, whose raw strides
# address memory. A tracer reports a contiguous layout at offset 0 (eager's where it is
# ``_dense``), except a view, which reports eager's view of its base as eager lays that out
# where known, else as the base reports (``Trace._reporting_views``: Longformer reads the
# strides of a reshape that is a view in eager), and an input whose eager layout is known,
# which reports it (``_layout``: the
# strides and the storage offset, None where unknown): an argument whose strides jit keys
# (``state.layout_key``; its offset too where that is 0: another is left out, so that the
# slices of a batch, ``x[:, t]`` for each ``t``, share a compilation), and
# vmap's example, cut from its batched argument by ``movedim`` and ``select``, whose tracers
# carry the layout they know (without reporting it) to the input of the example's trace.
# The example then reports what torch.func's does: the batched tensor's strides less the
# batch dim's, and its storage offset. as_strided and as_strided_scatter read a tensor
# through a reported layout that is eager's (or, issued by PyTorch's own code, through the
# reported one its arguments came from). Eager's layout of an intermediate result is derived
# when as_strided needs it, from the user's op that made it (``Origin``, tracer/trace.py) and
# the meta kernel (a convolution's on fake tensors of its device, whose kernel picks the
# layout), which computes eager's strides as torch.compile's fake tensors do
# (a reshape that plait's contiguous report turned into a view is eager's copy where the
# meta view fails): Longformer's chunking reads the strides of a reshaped projection. Only
# a value whose eager layout is the one it reports is read; any other is refused, since the
# strides the user passes came from that report. The elements in the order of their
# addresses (dims by stride) are the memory from the storage offset on, so the view's positions
# ``storage_offset - x.storage_offset() + sum(i_d * stride_d)`` index that order. Under vmap
# this is torch.func's rule (functorch's as_strided batching rule): each example reads from
# its own storage offset. Positions outside the elements, and layouts with gaps or overlaps
# (an example of a batch mapped along a dim that is not outermost in memory, whose elements
# have the other examples' between them; an expanded tensor), are refused: eager would read
# memory the trace does not hold.
def known_layout(x) -> tuple | None:
    """Eager's (strides, storage offset or None) of the tensor tracer ``x`` stands for, where
    known (NOTE [eager layouts])."""
    return x.known_layout() if isinstance(x, TracerTensor) else None


def eager_layout(x) -> tuple | None:
    """``known_layout``, or else the one derived from the op that made ``x`` (meta kernels
    follow their chain back: only as_strided pays for that)."""
    known = known_layout(x)
    if known is None and isinstance(x, TracerTensor) and x._origin is not None:
        return x._origin.layout()
    return known


def _contiguous(x, memory_format=torch.contiguous_format):
    """``Tensor.contiguous``: torch returns the tensor itself where it is laid out so
    already, which a tracer's report always says; where eager's layout is another, eager
    copies, and so does this, so that eager's layout of what follows is derived from the
    copy's (NOTE [eager's layouts of results] in tracer/function.py)."""
    tracer = unwrap_functional(x)
    if not isinstance(tracer, TracerTensor):
        return NotImplemented
    layout = eager_layout(tracer)
    if layout is None or _meta_with(type_of(tracer), layout).is_contiguous(
            memory_format=memory_format):
        return NotImplemented
    return x.clone(memory_format=memory_format)


FUNCTION_HANDLERS[torch.Tensor.contiguous] = _contiguous


def _carry_layout(out: TracerTensor, x, view) -> TracerTensor:
    """``out``, a view of ``x``, knows its eager layout, ``view(*x's)``, where ``x``'s is
    known."""
    layout = known_layout(x)
    if layout is not None:
        out._layout = view(*layout)
    return out


def _in_address_order(x, func: str, storage_offset):
    """How ``func`` (as_strided or its scatter) reads ``x``: the permutation putting its dims
    in the order of their addresses, and where the view starts in that order (NOTE [eager
    layouts])."""
    t = type_of(x)
    strides, base = tuple(x.stride()), x.storage_offset()
    layout = eager_layout(x)
    if not (current_trace().issued_by_torch or layout is not None and layout[0] == strides
            and layout[1] in (base, None)):
        raise UnsupportedOpError(
            f"{func} reads raw memory strides, and eager lays this value out in memory "
            f"otherwise than plait reports it (strides {list(strides)}), or in a way plait "
            "cannot derive (an op without a meta kernel on the way). Apply it to a function "
            "argument or a contiguous copy (x.clone(memory_format=torch.contiguous_format)), "
            "or use a logical op (diagonal, unfold, reshape, slicing) instead.")
    if storage_offset is not None and layout is not None and layout[1] is None and \
            not current_trace().issued_by_torch:
        raise UnsupportedOpError(
            f"{func} with a storage_offset, on an argument at an offset in its storage: "
            "plait.jit does not key that offset, so it cannot tell where the view "
            "starts. Leave storage_offset out (the view then starts at the tensor's own), or "
            "pass a tensor of its own (x.clone()).")
    big = sorted((d for d in range(t.ndim) if t.shape[d] != 1), key=lambda d: -strides[d])
    if t.numel and [strides[d] for d in big] != list(contiguous_strides(
            [t.shape[d] for d in big])):
        raise UnsupportedOpError(
            f"{func} on a tensor whose elements do not fill a block of memory (shape "
            f"{list(t.shape)}, strides {list(strides)}: gaps or overlaps between them), "
            "where eager reads whatever memory lies between; plait holds only the elements. "
            "Under vmap, as_strided reads each example's memory: map a dim that is outermost "
            "in memory (the batched tensor made contiguous with the batch dim first), or use "
            "logical ops (diagonal, unfold, reshape, slicing).")
    return tuple(big) + tuple(d for d in range(t.ndim) if is_one(t.shape[d])), \
        0 if storage_offset is None else storage_offset - base


def _check_reach(x, func: str, size, stride, start):
    numel, base = type_of(x).numel, x.storage_offset()
    last = start + sum((n - 1) * st for n, st in zip(size, stride))
    if math.prod(size) and (start < 0 or last >= numel):
        raise ShapeError(
            f"{func}(size={list(size)}, stride={list(stride)}, storage_offset="
            f"{base + start}) reads memory [{base + start}, {base + last}] outside the "
            f"tensor's elements, which fill [{base}, {base + numel - 1}] (under vmap, of "
            "each example's own storage, as in torch.func)")


@handles(aten.as_strided.default, aten.as_strided_copy.default)
def _as_strided(x, size, stride, storage_offset=None):
    perm, start = _in_address_order(x, "as_strided", storage_offset)
    _check_reach(x, "as_strided", size, stride, start)
    return strided_view(bind("transpose", x, permutation=perm), size, stride, start)


@handles(aten.as_strided_.default)
def _restrided(x, size, stride, storage_offset=None):
    """An in-place restride that leaves every element where it is (new strides only on dims
    of size 1: ATen's 1x1 adaptive average pooling of a channels-last input gives its mean
    channels-last strides so) is ``x`` itself; any other goes the way of in-place ops."""
    if list(size) == list(x.shape) and storage_offset in (None, x.storage_offset()) and all(
            n == 1 or a == b for n, a, b in zip(size, stride, x.stride())):
        return x
    return NotImplemented


@handles(aten.as_strided_scatter.default)
def _as_strided_scatter(x, src, size, stride, storage_offset=None):
    perm, start = _in_address_order(x, "as_strided_scatter", storage_offset)
    _check_reach(x, "as_strided_scatter", size, stride, start)
    out = strided_scatter(bind("transpose", x, permutation=perm), src, size, stride, start)
    return bind("transpose", out, permutation=tuple(perm.index(d) for d in range(len(perm))))


def _matmul_dtypes(op, a, b):
    ta, tb = type_of(a), type_of(b)
    if ta.dtype != tb.dtype:
        raise ShapeError(f"{op}: expected both operands to have one dtype, got {ta} and {tb}")


@handles(aten.mm.default)
def _mm(a, b):
    _matmul_dtypes("mm", a, b)
    return bind("dot_general", a, b, contracting=((1,), (0,)), batch=((), ()))


@handles(aten.bmm.default)
def _bmm(a, b):
    _matmul_dtypes("bmm", a, b)
    return bind("dot_general", a, b, contracting=((2,), (1,)), batch=((0,), (0,)))


@handles(aten.mv.default)
def _mv(a, b):
    _matmul_dtypes("mv", a, b)
    return bind("dot_general", a, b, contracting=((1,), (0,)), batch=((), ()))


@handles(aten.dot.default)
def _dot(a, b):
    _matmul_dtypes("dot", a, b)
    return bind("dot_general", a, b, contracting=((0,), (0,)), batch=((), ()))


@handles(aten.vdot.default)
def _vdot(a, b):  # the first operand conjugated
    return _dot(bind("conj", a) if type_of(a).dtype.is_complex else a, b)


def _product_plus(name: str, product):
    """``beta * x + alpha * product(a, b)`` (addmm, addmv, baddbmm). torch's decompositions
    compute these in float32 for bfloat16 and float16 operands (``pw_cast_for_opmath``), so a
    linear layer's matrix product ran as a float32 GEMM, six times slower on a GPU than
    eager's: the product here keeps the operands' dtype (accumulating in float32, as eager's
    BLAS call does) and only the additions compute in float32."""
    def handler(x, a, b, *, beta=1, alpha=1):
        _matmul_dtypes(name, x, a)
        if not type_of(x).dtype.is_floating_point and not type_of(x).dtype.is_complex:
            beta, alpha = int(beta), int(alpha)
        out = product(a, b)
        if alpha != 1:
            out = out * alpha
        if beta == 0:  # x is not read, NaN included
            return out
        return out + (x if beta == 1 else x * beta)

    return handler


HANDLERS[aten.addmm.default] = _product_plus("addmm", torch.mm)
HANDLERS[aten.addmv.default] = _product_plus("addmv", torch.mv)
HANDLERS[aten.baddbmm.default] = _product_plus("baddbmm", torch.bmm)


@handles(aten._addmm_activation.default)
def _addmm_activation(x, a, b, *, beta=1, alpha=1, use_gelu=False):
    out = torch.addmm(x, a, b, beta=beta, alpha=alpha)
    if not use_gelu:
        return torch.relu(out)
    # eager's CUDA kernel applies the tanh approximation, its CPU kernel the exact GELU
    return torch.nn.functional.gelu(out, approximate="tanh" if out.is_cuda else "none")


def _arg_reduction(name):
    def handler(x, dim=None, keepdim=False):
        t = type_of(x)
        if dim is None:
            flat = reshape(x, (t.numel,))
            out = bind(name, flat, dims=(0,)) if t.ndim else full((), 0, torch.int64, t.device)
            return reshape(out, (1,) * t.ndim) if keepdim else out
        if t.ndim == 0:
            return full((), 0, torch.int64, t.device)
        dim = dim % t.ndim
        out = bind(name, x, dims=(dim,))
        return reshape(out, t.shape[:dim] + (1,) + t.shape[dim + 1:]) if keepdim else out

    return handler


HANDLERS[aten.argmax.default] = _arg_reduction("argmax")
HANDLERS[aten.argmin.default] = _arg_reduction("argmin")


def _value_and_index(reduction, arg):
    def handler(x, dim, keepdim=False):
        t = type_of(x)
        if t.ndim == 0:
            return alias(x), full((), 0, torch.int64, t.device)
        dim = dim % t.ndim
        values, indices = bind(reduction, x, dims=(dim,)), bind(arg, x, dims=(dim,))
        if keepdim:
            kept = t.shape[:dim] + (1,) + t.shape[dim + 1:]
            values, indices = reshape(values, kept), reshape(indices, kept)
        return values, indices

    return handler


HANDLERS[aten.max.dim] = _value_and_index("amax", "argmax")
HANDLERS[aten.min.dim] = _value_and_index("amin", "argmin")


def _scan(name):
    def handler(x, dim, dtype=None):
        t = type_of(x)
        if dtype is None and name in ("cumsum", "cumprod") and not (
                t.dtype.is_floating_point or t.dtype.is_complex):
            dtype = torch.int64
        x = convert(x, dtype) if dtype is not None else x
        return bind(name, x, dim=dim % max(t.ndim, 1))

    return handler


for _name in ("cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"):
    HANDLERS[getattr(aten, _name).default] = _scan(_name)


@handles(aten.gather.default)
def _gather(x, dim, index, *, sparse_grad=False):
    return bind("gather", x, convert(index, torch.int64), dim=dim % max(type_of(x).ndim, 1))


def _scatter(x, dim, index, src, reduce=None, include_self=True):
    t = type_of(x)
    if not isinstance(src, torch.Tensor):
        src = full(type_of(index).shape, src, t.dtype, t.device)
    return bind("scatter", x, convert(index, torch.int64), src, dim=dim % max(t.ndim, 1),
                reduce=reduce,
                include_self=include_self)


_LEGACY_REDUCE = {"add": "sum", "multiply": "prod"}
HANDLERS[aten.scatter.src] = HANDLERS[aten.scatter.value] = \
    lambda x, dim, index, src: _scatter(x, dim, index, src)
HANDLERS[aten.scatter.reduce] = HANDLERS[aten.scatter.value_reduce] = \
    lambda x, dim, index, src, *, reduce: _scatter(x, dim, index, src, _LEGACY_REDUCE[reduce])
HANDLERS[aten.scatter_add.default] = lambda x, dim, index, src: _scatter(x, dim, index, src,
                                                                          "sum")
HANDLERS[aten.scatter_reduce.two] = \
    lambda x, dim, index, src, reduce, *, include_self=True: _scatter(x, dim, index, src,
                                                                     reduce, include_self)


@handles(aten.index_reduce.default)
def _index_reduce(x, dim, index, source, reduce, *, include_self=True):
    """Each slice ``source[..., i, ...]`` reduces into ``x[..., index[i], ...]``."""
    shape = type_of(x).shape
    if not shape:  # a 0-dim tensor acts as one of shape (1,)
        x, source = reshape(x, (1,)), reshape(source, (1,))
    src_t = type_of(source)
    dim %= src_t.ndim
    spread = broadcast_to(reshape(convert(index, torch.int64), (src_t.shape[dim],) + (1,) * (
        src_t.ndim - dim - 1)), src_t.shape)
    return reshape(_scatter(x, dim, spread, source, reduce, include_self), shape)


@handles(aten.put.default)
def _put(x, index, source, accumulate=False):
    """``x.flatten()[index] = source`` (or +=), negative indices counted from the end."""
    t = type_of(x)
    index = torch.reshape(convert(index, torch.int64), (-1,))
    index = torch.where(index < 0, index + t.numel, index)
    flat = _scatter(reshape(x, (t.numel,)), 0, index, torch.reshape(source, (-1,)),
                    "sum" if accumulate else None)
    return reshape(flat, t.shape)


@handles(aten.masked_scatter.default)
def _masked_scatter(x, mask, source):
    """The k-th True of the mask takes source's k-th element: a gather at cumsum(mask) - 1."""
    shape, _ = common_shape((x, mask))
    mask = broadcast_to(mask, shape)
    rank = torch.cumsum(torch.reshape(mask, (-1,)), 0) - 1
    taken = torch.reshape(torch.reshape(source, (-1,))[torch.clamp(rank, min=0)], shape)
    return torch.where(mask, taken, broadcast_to(x, shape))


@handles(aten.nonzero_static.default)
def _nonzero_static(x, *, size, fill_value=-1):
    """The first ``size`` nonzero coordinates in row-major order, padded with fill_value."""
    t = type_of(x)
    found = torch.reshape(x != 0, (-1,))
    if t.numel < size:
        found = torch.cat([found, torch.zeros(size - t.numel, dtype=torch.bool)])
    # A stable sort of "is zero" puts the nonzero positions first, in order.
    order = bind("sort", convert(torch.logical_not(found), torch.uint8), dim=0,
                 descending=False, stable=True)[1][:size]
    coords = [order // step % n for n, step in zip(t.shape, contiguous_strides(t.shape))]
    coords = torch.stack(coords, -1) if coords else torch.zeros(size, 0, dtype=torch.int64)
    keep = torch.arange(size) < torch.sum(found)
    return torch.where(torch.unsqueeze(keep, -1), coords, fill_value)


@handles(aten.histc.default)
def _histc(x, bins=100, min=0, max=0):
    """Bin ``(v - min) * bins / (max - min)``, truncated, in x's dtype, as ATen computes it;
    values outside [min, max] (and NaN) are not counted; max falls in the last bin."""
    t = type_of(x)
    if min > max:
        raise OpError(f"histc: max ({max}) must be larger than min ({min})")
    lo, hi = (torch.full((), v, dtype=t.dtype) for v in (min, max))
    if min == max and t.numel:  # the data's range, widened when it is one point
        lo, hi = torch.amin(x), torch.amax(x)
    same = lo == hi
    lo, hi = torch.where(same, lo - 1, lo), torch.where(same, hi + 1, hi)
    bind("check", torch.logical_not(torch.isfinite(lo) & torch.isfinite(hi)),
         message="torch.histc: the range of the data is not finite")
    flat = torch.reshape(x, (-1,))
    inside = torch.logical_and(flat >= lo, flat <= hi)
    pos = convert((flat - lo) * bins / (hi - lo), torch.int64)
    pos = torch.where(inside, torch.clamp(pos, 0, bins - 1), 0)
    counts = torch.zeros(bins, dtype=t.dtype)
    return _scatter(counts, 0, pos, convert(inside, t.dtype), "sum")


# Histograms (fixed bin counts, so static shapes). A value's bin is the number of edges at or
# below it, minus one, as ATen's binary search finds it; the last edge closes the last bin.
def _histogram_edges(x2d, bins, range):
    """Per dim: ``bins[d] + 1`` evenly spaced edges over ``range`` or the data's extent,
    widened by 0.5 each side when that is one point."""
    edges = []
    for d, nb in enumerate(bins):
        if range is not None:
            lo, hi = (torch.full((), float(v), dtype=x2d.dtype) for v in range[2 * d:2 * d + 2])
        elif x2d.shape[0]:
            lo, hi = torch.amin(x2d[:, d]), torch.amax(x2d[:, d])
        else:  # no data: [0, 1], as ATen (and NumPy) choose
            lo, hi = (torch.full((), float(v), dtype=x2d.dtype) for v in (0, 1))
        bind("check", torch.logical_not(torch.isfinite(lo) & torch.isfinite(hi) & (lo <= hi)),
             message="torch.histogram: the range of the bins is not finite, or min > max")
        same = lo == hi
        lo, hi = torch.where(same, lo - 0.5, lo), torch.where(same, hi + 0.5, hi)
        edges.append(torch.linspace(lo, hi, nb + 1, dtype=x2d.dtype))
    return edges


def _histogram_counts(x2d, edges, weight, density):
    bins = [e.shape[0] - 1 for e in edges]
    flat = torch.zeros(x2d.shape[0], dtype=torch.int64)
    inside = torch.ones(x2d.shape[0], dtype=torch.bool)
    for d, (e, nb) in enumerate(zip(edges, bins)):
        v = x2d[:, d]
        inside = inside & (v >= e[0]) & (v <= e[-1])
        flat = flat * nb + torch.clamp(_searchsorted(e, v, right=True) - 1, 0, nb - 1)
    weight = torch.ones_like(x2d[:, 0]) if weight is None else torch.reshape(weight, (-1,))
    hist = torch.zeros(math.prod(bins), dtype=x2d.dtype).scatter_add(
        0, torch.where(inside, flat, 0), torch.where(inside, weight, 0))
    hist = torch.reshape(hist, bins)
    if density:
        hist = hist / torch.sum(hist)
        for d, e in enumerate(edges):
            hist = hist / torch.reshape(e[1:] - e[:-1], [-1 if i == d else 1
                                                          for i in range(len(bins))])
    return hist


def _as_points(x):
    """histogram's 1-d view of its input: every element is one point of one coordinate."""
    return torch.reshape(x, (-1, 1))


@handles(aten.histogram.bin_ct)
def _histogram_bin_ct(x, bins=100, *, range=None, weight=None, density=False):
    (edges,) = _histogram_edges(_as_points(x), [bins], range)
    return _histogram_counts(_as_points(x), [edges], weight, density), edges


@handles(aten.histogram.bins_tensor)
def _histogram_bins_tensor(x, bins, *, weight=None, density=False):
    return _histogram_counts(_as_points(x), [bins], weight, density), bins


@handles(aten._histogramdd_bin_edges.default)
def _histogramdd_bin_edges(x, bins, *, range=None, weight=None, density=False):
    return _histogram_edges(torch.reshape(x, (-1, x.shape[-1])), bins, range)


@handles(aten._histogramdd_from_bin_cts.default)
def _histogramdd_from_bin_cts(x, bins, *, range=None, weight=None, density=False):
    x2d = torch.reshape(x, (-1, x.shape[-1]))
    return _histogram_counts(x2d, _histogram_edges(x2d, bins, range), weight, density)


@handles(aten._histogramdd_from_bin_tensors.default)
def _histogramdd_from_bin_tensors(x, bins, *, weight=None, density=False):
    return _histogram_counts(torch.reshape(x, (-1, x.shape[-1])), bins, weight, density)


@handles(aten.index_select.default)
def _index_select(x, dim, index):
    t = type_of(x)
    if t.ndim == 0:
        return _gather(x, 0, reshape(index, ()))
    dim = dim % t.ndim
    index = reshape(index, (type_of(index).numel,))
    shape = list(t.shape)
    shape[dim] = type_of(index).shape[0]
    expanded = bind("broadcast_in_dim", index, shape=tuple(shape), broadcast_dimensions=(dim,))
    return bind("gather", x, expanded, dim=dim)


def _flatten_indexed(x, indices):
    """Shared part of x[indices] and x[indices] = v: move the indexed dims to the front,
    flatten them to one, and compute the linear index of every selected position."""
    t = type_of(x)
    indices = list(indices) + [None] * (t.ndim - len(indices))
    for i in indices:
        if i is not None and type_of(i).dtype in (torch.bool, torch.uint8):
            raise _MaskIndex()
    positions = [d for d, i in enumerate(indices) if i is not None]
    rest = [d for d in range(t.ndim) if d not in positions]
    # as tracers report sizes: torch calls take them (NOTE [dynamic dimensions])
    bshape = reported(broadcast_shapes(*[type_of(indices[d]).shape for d in positions]))
    linear = None
    for d in positions:
        n = x.shape[d]
        i = indices[d].expand(bshape)
        i = torch.where(i < 0, i + n, i)
        linear = i if linear is None else linear * n + i
    sizes = [x.shape[d] for d in rest]
    flat = x.permute(positions + rest).reshape([math.prod(x.shape[d] for d in positions)] + sizes)
    count = math.prod(bshape)
    index = linear.reshape([count] + [1] * len(rest)).expand([count] + sizes)
    adjacent = positions == list(range(positions[0], positions[-1] + 1)) and positions[0] > 0
    return positions, rest, bshape, flat, index, adjacent


class _MaskIndex(Exception):
    pass


def _place(out, nb, before, nrest):
    """Advanced indexing puts the index dims where adjacent index positions were."""
    perm = list(range(nb, nb + before)) + list(range(nb)) + list(range(nb + before, nb + nrest))
    return out.permute(perm)


@handles(aten.index.Tensor)
def _index(x, indices):
    try:
        positions, rest, bshape, flat, index, adjacent = _flatten_indexed(x, indices)
    except _MaskIndex:
        raise UnsupportedOpError(
            "indexing with a boolean mask has a data-dependent shape; use torch.where(mask, "
            "x, other) or run it outside plait.jit") from None
    out = torch.gather(flat, 0, index).reshape(list(bshape) + [x.shape[d] for d in rest])
    return _place(out, len(bshape), positions[0], len(rest)) if adjacent else out


@handles(aten.index_put.default)
def _index_put(x, indices, values, accumulate=False):
    t = type_of(x)
    try:
        positions, rest, bshape, flat, index, adjacent = _flatten_indexed(x, indices)
    except _MaskIndex:
        return _mask_put(x, indices, values, accumulate)
    nb, sizes = len(bshape), [x.shape[d] for d in rest]
    target = list(bshape) + sizes
    if adjacent:
        before = positions[0]
        target = sizes[:before] + list(bshape) + sizes[before:]
        values = values.expand(target).permute(
            list(range(before, before + nb)) + list(range(before)) +
            list(range(before + nb, nb + len(sizes))))
    values = values.expand(list(bshape) + sizes).reshape(index.shape)
    values = values.to(t.dtype) if type_of(values).dtype != t.dtype else values
    out = torch.scatter_add(flat, 0, index, values) if accumulate else torch.scatter(
        flat, 0, index, values)
    out = out.reshape([x.shape[d] for d in positions] + sizes)
    inverse = [0] * t.ndim
    for i, d in enumerate(positions + rest):
        inverse[d] = i
    return out.permute(inverse)


def _mask_put(x, indices, values, accumulate):
    """x[mask] = v with a scalar v is a select, and has a static shape."""
    (mask, *more) = indices
    if more or type_of(values).numel != 1 or type_of(mask).dtype not in (torch.bool,):
        raise UnsupportedOpError(
            "x[mask] = values with a boolean mask and more than one value has a "
            "data-dependent shape; use torch.where(mask, value, x)")
    t = type_of(x)
    mask = mask.reshape(*mask.shape, *(1,) * (t.ndim - mask.dim())).expand(x.shape)
    values = values.reshape(()).to(t.dtype)
    return torch.where(mask, x + values if accumulate else values, x)


@handles(aten.sort.default)
def _sort(x, dim=-1, descending=False):
    return bind("sort", x, dim=dim % max(type_of(x).ndim, 1), descending=descending,
                stable=False)


@handles(aten.sort.stable)
def _sort_stable(x, *, stable=None, dim=-1, descending=False):
    return bind("sort", x, dim=dim % max(type_of(x).ndim, 1), descending=descending,
                stable=bool(stable))


@handles(aten.topk.default)
def _topk(x, k, dim=-1, largest=True, sorted=True):
    return bind("topk", x, k=k, dim=dim % max(type_of(x).ndim, 1), largest=largest,
                sorted=sorted)


# Order statistics: a stable sort, then a gather at a computed rank. NaNs sort last, so the
# count of non-NaN values gives the rank that eager's selection picks.
def _select_rank(x, dim, keepdim, rank_of):
    """Value and index at rank ``rank_of(valid_count, n)`` of each slice along ``dim``."""
    t = type_of(x)
    if not t.ndim:
        x, dim = reshape(x, (1,)), 0
    dim %= max(t.ndim, 1)
    n = type_of(x).shape[dim]
    if n == 0:
        raise ShapeError(f"cannot select from an empty dimension of {t}")
    values, indices = bind("sort", x, dim=dim, descending=False, stable=True)
    valid = torch.sum(torch.logical_not(torch.isnan(x)), dim, keepdim=True)
    rank = rank_of(valid, n)
    out = [torch.gather(v, dim, rank) for v in (values, indices)]
    if not keepdim or not t.ndim:
        out = [torch.squeeze(o, dim) for o in out]
    return tuple(out)


def _median_rank(valid, n):  # any NaN: the first NaN
    return torch.where(valid < n, valid, (n - 1) // 2)


def _nanmedian_rank(valid, n):  # the median of the non-NaN values (all NaN: a NaN)
    return torch.clamp(valid - 1, min=0) // 2


def _median(rank_of):
    def along(x, dim=0, keepdim=False):
        return _select_rank(x, dim, keepdim, rank_of)

    def overall(x):
        return _select_rank(reshape(x, (type_of(x).numel,)), 0, False, rank_of)[0]

    return along, overall


HANDLERS[aten.median.dim], HANDLERS[aten.median.default] = _median(_median_rank)
HANDLERS[aten.nanmedian.dim], HANDLERS[aten.nanmedian.default] = _median(_nanmedian_rank)


@handles(aten.kthvalue.default)
def _kthvalue(x, k, dim=-1, keepdim=False):
    n = type_of(x).shape[dim % type_of(x).ndim] if type_of(x).ndim else 1
    if not 1 <= k <= n:
        raise ShapeError(f"kthvalue: k={k} is out of range for a dimension of size {n}")
    return _select_rank(x, dim, keepdim, lambda valid, n: torch.full_like(valid, k - 1))


def _searchsorted(sorted_sequence, values, *, out_int32=False, right=False, side=None,
                  sorter=None):
    """Rank by counting: left = #(seq < v), right = n - #(v < seq), as a binary search."""
    if sorter is not None:
        sorted_sequence = torch.gather(sorted_sequence, -1, sorter)
    scalar = not isinstance(values, torch.Tensor)
    if scalar:
        values = torch.full((), values, dtype=type_of(sorted_sequence).dtype)
    seq_t, n = type_of(sorted_sequence), type_of(sorted_sequence).shape[-1]
    if seq_t.ndim == 1:
        seq = sorted_sequence
    else:
        seq = torch.unsqueeze(sorted_sequence, -2)
    v = torch.unsqueeze(values, -1)
    if right or side == "right":
        count = n - torch.sum(v < seq, -1)
    else:
        count = torch.sum(seq < v, -1)
    return convert(count, torch.int32 if out_int32 else torch.int64)


HANDLERS[aten.searchsorted.Tensor] = HANDLERS[aten.searchsorted.Scalar] = _searchsorted


@handles(aten.bucketize.Tensor, aten.bucketize.Scalar)
def _bucketize(x, boundaries, *, out_int32=False, right=False):
    return _searchsorted(boundaries, x, out_int32=out_int32, right=right)


@handles(aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar, aten.isin.Scalar_Tensor)
def _isin(elements, test_elements, *, assume_unique=False, invert=False):
    tests = torch.reshape(test_elements, (-1,)) if isinstance(test_elements, torch.Tensor) \
        else torch.full((1,), test_elements, dtype=type_of(elements).dtype)
    if not isinstance(elements, torch.Tensor):
        elements = torch.full((), elements, dtype=type_of(tests).dtype)
    found = torch.any(torch.unsqueeze(elements, -1) == tests, -1)
    return torch.logical_not(found) if invert else found


@handles(aten.constant_pad_nd.default)
def _constant_pad(x, pad, value=0):
    t = type_of(x)
    low, high = [0] * t.ndim, [0] * t.ndim
    for i in range(len(pad) // 2):
        low[t.ndim - 1 - i], high[t.ndim - 1 - i] = pad[2 * i], pad[2 * i + 1]
    if min(low + high, default=0) < 0:
        start = [max(0, -lo) for lo in low]
        limit = [n - max(0, -hi) for n, hi in zip(t.shape, high)]
        if any(s > l for s, l in zip(start, limit)):
            raise ShapeError(f"constant_pad_nd: padding {list(pad)} leaves a negative size for {t}")
        x = bind("slice", x, start=tuple(start), limit=tuple(limit), step=(1,) * t.ndim)
        low, high = [max(0, v) for v in low], [max(0, v) for v in high]
    if t.dtype == torch.bool:
        value = bool(value)
    elif not t.dtype.is_floating_point:
        value = int(value)
    return bind("pad", x, low=tuple(low), high=tuple(high), value=value)


def _pad(x, pad, mode="constant", value=None):
    """Circular padding, whose C++ body writes into a fresh eager tensor: per dim (last
    first), crop for negative pads, then wrap the cropped tensor around."""
    if mode != "circular":
        return NotImplemented
    if len(pad) % 2 or x.ndim - len(pad) // 2 not in (1, 2):
        raise ShapeError(f"circular padding of {len(pad) // 2} dims needs an input of "
                         f"{len(pad) // 2 + 1} or {len(pad) // 2 + 2} dims, got {x.ndim}")
    for i in range(len(pad) // 2):
        d, low, high = x.ndim - 1 - i, pad[2 * i], pad[2 * i + 1]
        x = torch.narrow(x, d, max(0, -low), x.shape[d] - max(0, -low) - max(0, -high))
        n, low, high = x.shape[d], max(0, low), max(0, high)
        if low > n or high > n:
            raise ShapeError(f"circular padding {list(pad)} wraps around a dimension of size "
                             f"{n} more than once")
        x = torch.cat([torch.narrow(x, d, n - low, low), x, torch.narrow(x, d, 0, high)], d)
    return x


FUNCTION_HANDLERS[torch.nn.functional.pad] = _pad


def _linear(x, weight, bias=None):
    """``F.linear`` of more than two dims with symbolic sizes (NOTE [dynamic dimensions]):
    ATen's C++ composite asks for their values, which would decide them; here a product over
    the flattened rows, as that composite computes it."""
    if x.dim() <= 2 or not any(isinstance(n, torch.SymInt) for n in x.shape):
        return NotImplemented
    out = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


FUNCTION_HANDLERS[torch.nn.functional.linear] = _linear


def _matmul(a, b):
    """``@`` of operands of 3 and more dims with symbolic sizes: a batched product over the
    broadcast batch dims, as ATen's C++ composite computes it (whose torch 2.11 form asks
    for the sizes' values)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) \
            or min(a.dim(), b.dim()) < 2 or max(a.dim(), b.dim()) < 3 \
            or not any(isinstance(n, torch.SymInt) for n in (*a.shape, *b.shape)):
        return NotImplemented
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return torch.bmm(a3, b3).reshape(*batch, a.shape[-2], b.shape[-1])


FUNCTION_HANDLERS.update(dict.fromkeys(
    (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__), _matmul))


def matmul(a, b):
    """``a @ b`` for a handler (inside one, torch functions skip FUNCTION_HANDLERS)."""
    out = _matmul(a, b)
    return a @ b if out is NotImplemented else out


def _dropout(x, p=0.5, training=True, inplace=False):
    """``F.dropout`` with symbolic sizes: ATen's C++ composite asks for the element count's
    value before it draws; here its CPU computation itself (a Bernoulli draw into a tensor
    like ``x``, scaled, then multiplied), which draws as eager does."""
    if not (training and 0 < p < 1) or not any(isinstance(n, torch.SymInt) for n in x.shape):
        return NotImplemented
    noise = torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)
    return x.mul_(noise) if inplace else x * noise


FUNCTION_HANDLERS[torch.nn.functional.dropout] = _dropout


def _reduce_loss(loss, reduction):
    return {"none": lambda v: v, "mean": torch.mean, "sum": torch.sum}[reduction](loss)


def _cosine_embedding_loss(x1, x2, target, margin=0.0, size_average=None, reduce=None,
                           reduction="mean"):
    """ATen's formula, whose C++ body writes into a fresh eager tensor."""
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
    if x1.shape != x2.shape or x1.ndim not in (1, 2) or target.ndim != x1.ndim - 1:
        raise ShapeError(f"cosine_embedding_loss: inputs {list(x1.shape)} and "
                         f"{list(x2.shape)} need one shape of 1 or 2 dims, and a target of "
                         f"one dim less, got {list(target.shape)}")
    dim = x1.ndim - 1
    eps = 1e-12
    cos = torch.sum(x1 * x2, dim) / torch.sqrt(
        (torch.sum(x1 * x1, dim) + eps) * (torch.sum(x2 * x2, dim) + eps))
    zeros = torch.zeros_like(cos)
    loss = (torch.where(target == 1, 1 - cos, zeros)
            + torch.where(target == -1, torch.clamp_min(cos - margin, 0), zeros))
    return _reduce_loss(loss, reduction)


def _hinge_embedding_loss(x, target, margin=1.0, size_average=None, reduce=None,
                          reduction="mean"):
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
    return torch._refs.nn.functional.hinge_embedding_loss(x, target, margin, reduction)


def _instance_norm(x, running_mean=None, running_var=None, weight=None, bias=None,
                   use_input_stats=True, momentum=0.1, eps=1e-5):
    """ATen's: batch norm over (1, N*C, ...) with the per-channel tensors repeated N times,
    then the running stats averaged back over N (its C++ body writes through an alias)."""
    if use_input_stats:
        torch.nn.functional._verify_spatial_size(x.size())
    n, c = x.shape[:2]
    repeat = lambda t: None if t is None else t.repeat(n)  # noqa: E731
    stats = [repeat(running_mean), repeat(running_var)]
    out = torch.nn.functional.batch_norm(x.reshape(1, n * c, *x.shape[2:]), *stats,
                                         repeat(weight), repeat(bias), use_input_stats,
                                         momentum, eps)
    for running, repeated in zip((running_mean, running_var), stats):
        if running is not None and use_input_stats:
            running.copy_(repeated.view(n, c).mean(0))
    return out.view(x.shape)


FUNCTION_HANDLERS.update({torch.nn.functional.cosine_embedding_loss: _cosine_embedding_loss,
                          torch.nn.functional.hinge_embedding_loss: _hinge_embedding_loss,
                          torch.nn.functional.instance_norm: _instance_norm})


@handles(aten.copy.default)
def _copy(dst, src, non_blocking=False):
    t = type_of(dst)
    return broadcast_to(convert(src, t.dtype), t.shape) if isinstance(src, torch.Tensor) else \
        full(t.shape, src, t.dtype, t.device)


@handles(aten.copy_.default)
def _copy_(dst, src, non_blocking=False):
    return current_trace().rebind(dst, _copy(dst, src))


@handles(aten.split_with_sizes.default, aten.split_with_sizes_copy.default,
         aten.unsafe_split_with_sizes.default)
def _split_with_sizes(x, split_sizes, dim=0):
    t = type_of(x)
    dim %= max(t.ndim, 1)
    if sum(split_sizes) != t.shape[dim]:
        raise ShapeError(f"split_with_sizes: sizes {list(split_sizes)} do not sum to "
                         f"{t.shape[dim]} ({t})")
    starts = [sum(split_sizes[:i]) for i in range(len(split_sizes))]
    return [_slice(x, dim, s, s + n) for s, n in zip(starts, split_sizes)]


@handles(aten.split.Tensor, aten.unsafe_split.Tensor, aten.split_copy.Tensor)
def _split(x, split_size, dim=0):
    n = type_of(x).shape[dim % max(type_of(x).ndim, 1)]
    sizes = [min(split_size, n - s) for s in range(0, n, split_size)] if split_size else [n]
    return _split_with_sizes(x, sizes or [0], dim)


def _like(value):
    def handler(x, *args, dtype=None, layout=None, device=None, pin_memory=None,
                memory_format=None):
        t = type_of(x)
        fill = args[0] if value is None else value
        return full(t.shape, fill, dtype or t.dtype, device or t.device)

    return handler


HANDLERS[aten.full_like.default] = _like(None)
HANDLERS[aten.zeros_like.default] = _like(0)
HANDLERS[aten.ones_like.default] = _like(1)
HANDLERS[aten.fill.Scalar] = lambda x, value: _like(value)(x)
HANDLERS[aten.fill.Tensor] = lambda x, value: broadcast_to(convert(value, type_of(x).dtype),
                                                            type_of(x).shape)


def _reduce_all(name):
    def handler(x):
        t = type_of(x)
        if t.numel == 0:
            raise ShapeError(f"{name}: cannot reduce an empty tensor ({t}) without a dim")
        return bind(name, x, dims=tuple(range(t.ndim)))

    return handler


HANDLERS[aten.max.default] = _reduce_all("amax")
HANDLERS[aten.min.default] = _reduce_all("amin")


@handles(aten.linalg_vector_norm.default)
def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """PyTorch's decomposition, but slices that are all zero are swapped for ones first and
    their norm set to 0 after: the same value, and a derivative of 0 there, as eager's
    subgradient, instead of 0 * inf (the double-where idiom)."""
    norm = torch._decomp.decomposition_table[aten.linalg_vector_norm.default]
    if ord in (0, math.inf, -math.inf) or not type_of(x).dtype.is_floating_point:
        return norm(x, ord, dim, keepdim, dtype=dtype)
    zero = torch.logical_not(torch.any(x != 0, dim=dim, keepdim=True))
    out = norm(torch.where(zero, 1.0, x), ord, dim, keepdim, dtype=dtype)
    return torch.where(torch.reshape(zero, out.shape), 0.0, out)


@attrs.frozen
class SoftmaxRule:
    """The VJP of softmax (a ``custom_vjp`` rule, NOTE [custom functions]): eager's formula,
    ``p * (ct - sum(ct * p))`` along ``dim``, computed in float32 for half types. It reads
    the probabilities alone; differentiating the decomposition reads the exponentials and
    their sums too, so a backward that has the probabilities saved (attention written out,
    whose product with the values reads them) still redid them from the scores."""

    dim: int  # non-negative

    def backward(self, ct, output: int, operands: tuple) -> list:
        x, p = operands
        wide = torch.promote_types(p.dtype, torch.float32)
        p, ct = p.to(wide), ct.to(wide)
        return [(p * (ct - (ct * p).sum(self.dim, keepdim=True))).to(x.dtype), None]

    def batched(self) -> SoftmaxRule:
        """The rule with a batch dim in front (``vmap``)."""
        return attrs.evolve(self, dim=self.dim + 1)

    def permuted(self, perm: tuple[int, ...]) -> SoftmaxRule:
        """The rule of the same softmax of transpose(x, perm)'s data laid out as x."""
        return attrs.evolve(self, dim=perm[self.dim])


def _softmax_rule(log: bool):
    """torch's decomposition of (log_)softmax (computed in float32 for half types), with the
    max subtracted for stability a constant to derivatives: the result does not depend on
    it (eager's derivative formulas never read it), and differentiating through it counts
    the ties of each row's max, two more passes over every row. Softmax's result takes the
    VJP of ``SoftmaxRule``."""
    def rule(x, dim, half_to_float):
        t = type_of(x)
        if t.ndim == 0 or t.shape[dim % t.ndim] == 0:
            return NotImplemented  # an empty row: torch's decomposition handles it
        half = t.dtype in (torch.float16, torch.bfloat16)
        wide = x.to(torch.float32) if half else x
        shifted = wide - bind("stop_gradient", torch.amax(wide, dim, keepdim=True))
        if log:
            out = shifted - torch.log(torch.sum(torch.exp(shifted), dim, keepdim=True))
        else:
            unnormalized = torch.exp(shifted)
            out = unnormalized / torch.sum(unnormalized, dim, keepdim=True)
        out = out if half_to_float else out.to(t.dtype)
        if log or not out.dtype.is_floating_point:
            return out
        return bind("custom_vjp", x, out, rule=SoftmaxRule(dim % t.ndim), output=0)

    return rule


handles(aten._softmax.default)(_softmax_rule(log=False))
handles(aten._log_softmax.default)(_softmax_rule(log=True))


@handles(aten._safe_softmax.default)
def _safe_softmax(x, dim, dtype=None):
    """softmax, but rows that are all -inf give 0 instead of NaN. Those rows are replaced
    before the softmax too, so no NaN reaches a derivative (the double-where idiom)."""
    masked = (x == float("-inf")).all(dim, keepdim=True)
    out = torch.softmax(torch.where(masked, 0.0, x), dim, dtype=dtype)
    return torch.where(masked, torch.zeros((), dtype=out.dtype, device=out.device), out)


def _float_result(*operands):
    """The dtype eager gives a special function: promoted, and floating."""
    metas = [torch.empty((), dtype=type_of(x).dtype) if isinstance(x, torch.Tensor) else x
             for x in operands]
    dtype = torch.result_type(*metas) if len(metas) > 1 else metas[0].dtype
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


def _special(name):
    def handler(*operands):
        shape, device = common_shape(operands)
        return bind(name, *line_up(operands, _float_result(*operands), shape, device))

    return handler


for _name in SPECIAL_UNARY:
    HANDLERS[getattr(aten, "special_" + _name).default] = _special(_name)
for _name in SPECIAL_BINARY:
    _packet = getattr(aten, "special_" + _name)
    for _overload in ("default", "n_scalar", "x_scalar"):
        HANDLERS[getattr(_packet, _overload)] = _special(_name)


@handles(aten.polygamma.default)
def _polygamma(n, x):
    return bind("polygamma", convert(x, _float_result(x)), n=n)



# Random ops are traced as calls of torch's own op (NOTE [random draws] in
# tracer/randomness.py); these handle the ones that need more.
@handles(aten.empty_like.default)
def _empty_like(x, *, dtype=None, layout=None, device=None, pin_memory=None,
                memory_format=None):
    """Uninitialized memory, as prims' ``empty``: zeros, but traced (torch's reference makes
    a real tensor), so that a C++ composite's draw into it is traced too: dropout's
    ``empty_like(x).bernoulli_(1 - p)`` on the CPU, which ``scaled_dot_product_attention``'s
    math path runs out of functionalization's sight (NOTE [attention dropout])."""
    if layout not in (None, torch.strided):
        return NotImplemented
    t = type_of(x)
    return full(t.shape, 0, dtype or t.dtype, device or t.device)


@handles(aten.bernoulli_.float)
def _bernoulli_in_place(x, p=0.5, *, generator=None):
    """The draw into a tensor, where functionalization did not reach (``_empty_like``): the
    same draws as ``bernoulli.p``, which fills a fresh tensor so."""
    return aten.copy_.default(x, aten.bernoulli.p(x, p, generator=generator))


def _drawn_alike(factory):
    """A random ``*_like`` op as its factory over the operand's shape: the same draws (the
    ``_like`` op fills a fresh tensor of that shape as the factory does), and no operand, so
    nothing is differentiated through the draw (torch's derivative of a draw is zero) and
    ``vmap(randomness="same")`` shares it, as torch.func does."""
    def handler(x, *bounds, dtype=None, layout=None, device=None, pin_memory=None,
                memory_format=None, **generator):
        t = type_of(x)
        return factory(*bounds, list(t.shape), **generator, dtype=dtype or t.dtype,
                       layout=layout, device=device or t.device)

    return handler


HANDLERS.update({like: _drawn_alike(factory) for like, factory in (
    (aten.rand_like.default, aten.rand.default), (aten.rand_like.generator, aten.rand.generator),
    (aten.randn_like.default, aten.randn.default),
    (aten.randn_like.generator, aten.randn.generator),
    (aten.randint_like.default, aten.randint.default),
    (aten.randint_like.generator, aten.randint.generator),
    (aten.randint_like.low_dtype, aten.randint.low),
    (aten.randint_like.low_generator_dtype, aten.randint.low_generator))})


def _rrelu(x, lower: float, upper: float, training: bool):
    """Randomized leaky ReLU and its slopes (``noise``): in training each non-positive
    element times a slope drawn uniformly from [lower, upper], 1 elsewhere (eager's CPU
    kernel draws only for those elements, so only the distribution is eager's); else leaky
    ReLU of the mean slope."""
    if not training:
        return torch.nn.functional.leaky_relu(x, (lower + upper) / 2), None
    drawn = torch.rand_like(x) * (upper - lower) + lower
    return torch.where(x <= 0, x * drawn, x), torch.where(x <= 0, drawn, 1.0)


@handles(aten.rrelu_with_noise.default)
def _rrelu_with_noise(x, noise, lower=0.125, upper=1 / 3, training=False, generator=None):
    """Writes the slopes into ``noise`` where it is traced; ``rrelu`` hands a fresh tensor
    of its own, which nothing reads again."""
    if generator is not None:
        return NotImplemented  # another stream than torch's: the op's fallback refuses it
    out, slopes = _rrelu(x, lower, upper, training)
    if slopes is not None and isinstance(noise, TracerTensor):
        aten.copy_.default(noise, slopes)
    return out


@handles(aten.rrelu_with_noise_functional.default)
def _rrelu_with_noise_functional(x, noise, lower=0.125, upper=1 / 3, training=False,
                                 generator=None):
    if generator is not None:
        return NotImplemented
    out, slopes = _rrelu(x, lower, upper, training)
    return out, alias(noise) if slopes is None else slopes


def _rrelu_in_place(x, lower=0.125, upper=1 / 3, training=False, generator=None):
    """``rrelu_``, which functionalization refuses (its C++ composite writes through the
    alias it returns): computed out of place, then written."""
    if not (isinstance(x, TracerTensor) or torch._is_functional_tensor(x)):
        return NotImplemented
    return x.copy_(torch.rrelu(x, lower, upper, training, generator))


def _functional_rrelu(input, lower=0.125, upper=1 / 3, training=False, inplace=False):
    """F.rrelu, whose ``inplace`` calls ``rrelu_`` where no handler sees it."""
    return _rrelu_in_place(input, lower, upper, training) if inplace else NotImplemented


FUNCTION_HANDLERS[torch.rrelu_] = _rrelu_in_place
FUNCTION_HANDLERS[torch.nn.functional.rrelu] = _functional_rrelu
