"""Lowering: a primitive graph becomes a LoopProgram (graph/loops.py).

NOTE [lowering]
Each graph value becomes either a buffer or a *lazy* value: a function from an index (one
sympy expression per dimension) to an expression DAG. Elementwise primitives, constants,
iotas and views (broadcast, reshape, transpose, slice, rev, pad, concatenate) give lazy
values, so a chain of them becomes one expression (vertical fusion) and views are index
rewrites, never copies. A lazy value is materialized (a pointwise kernel stores it) only where
it must be: a graph output, an extern operand, or a value with several users that does real
work (recomputing it per use would cost more than one store and a load per use). A reduction
is a kernel with its operand's expression inlined. A gather is lazy too: an indirect load
(NOTE [loop IR]) of its operand, which must be in memory (a lazy one is stored), at the
positions its index operand's expression computes, so the index and the gathered values are
never stored (cross-entropy loads ``logits[row, target[row]]`` in its final reduction).
Every other primitive (dot_general, scatter, sort, scans, linalg, FFTs, opaque ops, ...) is
an Extern over buffers, as is any op or dtype the code generator cannot express
(``supported_ops``, ``supported_dtypes``).
A buffer that no kernel writes has no elements: the runtime allocates it empty. A node that a
control edge orders gets a kernel of its own, fenced: fusion leaves it alone.

NOTE [lowering collectives]
A collective is an Extern marked ``collective`` and, where it can be waited for apart, with
its (start, wait) pair (``tracer.collectives.SPLIT``; NOTE [overlap] in passes/memory.py).
torch's functional collectives work along dim 0: another ``dim`` is moved there and back by
views, so the copies are kernels that fuse with their neighbours and the collective's buffers
are its own. With ``comm_buffers`` (a backend that plans them), a sum all_reduce whose operand
may become a communication buffer (``tracer.collectives.comm_buffer_type``: symmetric memory
enabled for the group, a small CUDA tensor) realizes that operand as one and calls the comm
type's all-reduce instead (NOTE [comm buffers]). Its layout must still be free: a lazy value
(stored by a kernel of ours; a view of an argument is copied that way in either path) or a
buffer one of our kernels writes; an input, constant or extern result as it is (memory not
ours to place) takes the regular collective. A graph output that is a comm buffer is copied
out.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Iterable

import attrs
import sympy
import torch

from ..graph import Graph, TensorType, Value, rewrite
from ..graph.types import concrete, contiguous_strides, hints, size_hint
from ..graph.loops import (Apply, Buffer, CommKind, Constant, Extern, IndexValue, Kernel, Load,
                           LoopProgram, Reduce, Store, children, loop_vars, walk,
                           with_children)
from ..tracer import collectives
from ..tracer.primitives import ELEMENTWISE, SPECIAL_BINARY, SPECIAL_UNARY
from ..tracer.registry import Impl, is_effectful

REDUCTIONS = frozenset(("sum", "prod", "amax", "amin", "argmax", "argmin"))
VIEWS = frozenset(("broadcast_in_dim", "reshape", "transpose", "slice", "rev", "pad",
                   "concatenate", "stop_gradient", "no_grad", "no_fwd_grad", "after",
                   "custom_vjp"))


@attrs.frozen
class Lazy:
    """A value not in memory: ``at(index)`` is its expression at that index. ``buffer``
    names the buffer it is, whole and as stored, if it is one (``in_memory``); a view of a
    buffer is lazy (``_buffer_view`` sees through it for an extern)."""

    type: TensorType
    at: Callable[[tuple], object] = attrs.field(converter=lambda at: _memoized(at))
    buffer: str | None = None
    origins: frozenset = frozenset()  # the graph nodes its expression computes


def _memoized(at: Callable) -> Callable:
    """``at`` returning one shared expression per index: a lazy value used twice by one
    expression is one subexpression of the DAG, not two trees (so values recomputed at each
    use, NOTE [lowering], stay linear in size)."""
    if hasattr(at, "cache"):
        return at
    cache: dict = {}

    def memo(index):
        if index not in cache:
            cache[index] = at(index)
        return cache[index]

    memo.cache = cache
    return memo


def flat(index, shape) -> sympy.Expr:
    return sum((i * s for i, s, n in zip(index, contiguous_strides(shape), shape) if n != 1),
               sympy.Integer(0))


def unflat(offset, shape) -> tuple:
    return tuple(sympy.Integer(0) if n == 1 else sympy.Mod(sympy.floor(offset / s), n)
                 if d else sympy.floor(offset / s)
                 for d, (n, s) in enumerate(zip(shape, contiguous_strides(shape))))


def _loops(shape, prefix: str):
    """One loop variable per dimension of size other than 1 (a size-1 dimension is index 0),
    and the loops' sizes: kernels over shapes equal but for size-1 dims line up."""
    names = iter(loop_vars(prefix, sum(1 for n in shape if n != 1)))
    index = tuple(sympy.Integer(0) if n == 1 else next(names) for n in shape)
    return index, tuple(n for n in shape if n != 1)


def _nodes(lazy) -> list:
    """The nodes of ``lazy``'s expression at a point."""
    return walk(lazy.at(loop_vars("x", lazy.type.ndim)))


def _gathered(expr, i, gathered: tuple):
    """``expr`` (at a point whose gathered coordinate is ``i``) with each load that reads
    along ``i`` made indirect: ``i`` is the gather's position there."""
    if isinstance(expr, Load):
        return attrs.evolve(expr, indirect=gathered) \
            if i in sympy.sympify(expr.index).free_symbols else expr
    return with_children(expr, tuple(_gathered(c, i, gathered) for c in children(expr)))


# kept: sympy's Min and Max simplify as they build (slow), and a model's blocks clamp alike
@functools.lru_cache(maxsize=1 << 14)
def _clamp(e, n):
    return sympy.Max(0, sympy.Min(n - 1, e))


# extern -> the operand that is a convolution's kernel (its weight)
_CONV_KERNELS = {"conv": 1, "conv_backward": 2}


# the views attention reads in place (as tensor methods: reshape, permute, narrow)
STRIDED_VIEWS = frozenset(("reshape", "transpose", "slice"))


def _reads_transposed(extern: str, permutation, operand: int) -> bool:
    """Does the extern read its ``operand`` transposed by ``permutation`` as it is (a view
    of its buffer, not a copy)? BLAS reads any transpose; the attention library's fused
    kernels need the last dim contiguous (else torch silently takes its path that stores the
    scores), so only transposes that keep it; a convolution library reads its kernel in any
    layout (a channels-last model's weights, NOTE [strided arguments])."""
    return extern == "dot_general" or _CONV_KERNELS.get(extern) == operand or (
        extern == "attention" and permutation[-1] == len(permutation) - 1)


# A value with several users is stored once rather than recomputed at each use when it costs
# more than this many operations, or reads more than this many buffers of its own size
# (smaller ones, such as per-row statistics, are broadcast and cost little to read again).
RECOMPUTE_MAX_OPS = 32
RECOMPUTE_MAX_READS = 2

# Elementwise ops that cost many times a load (trigonometric and special functions): a value
# computing one that a broadcast repeats is stored once, as a gather's is (``repeats_costly``)
COSTLY_OPS = frozenset("sin cos tan asin acos atan atan2 sinh cosh asinh acosh atanh erf_inv "
                       "lgamma digamma igamma igammac zeta".split()) | frozenset(
    SPECIAL_UNARY + SPECIAL_BINARY)


class _Lowering:
    def __init__(self, graph: Graph, supported_ops: Iterable[str],
                 supported_dtypes: Iterable[torch.dtype], comm_buffers: bool):
        self.graph = graph
        self.ops, self.dtypes = frozenset(supported_ops), frozenset(supported_dtypes)
        self.comm_buffers = comm_buffers
        self.buffers: dict[str, Buffer] = {}
        self.stored: set[str] = set()  # the buffers our kernels write
        self.constants: dict[str, torch.Tensor] = {}
        self.kernels: list = []
        self.values: dict[Value, Lazy] = {}
        self.uses: dict[Value, int] = {}
        for n in graph.order:
            for v in graph.operands(n):
                self.uses[v] = self.uses.get(v, 0) + 1
        for v in graph.outputs:
            self.uses[v] = self.uses.get(v, 0) + 1
        self.ordered = {n for edge in graph.control_edges() for n in edge}
        self.returned = set(graph.outputs)

    # -- buffers ---------------------------------------------------------------------------
    def new_buffer(self, prefix: str, type: TensorType, comm: CommKind | None = None) -> str:
        name = f"{prefix}{len(self.buffers)}"
        self.buffers[name] = Buffer(name, type, comm)
        return name

    def in_memory(self, name: str) -> Lazy:
        t = self.buffers[name].type
        return Lazy(t, lambda idx: Load(name, flat(idx, t.shape), t.dtype), name)

    def realize(self, v: Value, fenced: bool = False, fresh: bool = False) -> str:
        """The buffer holding ``v`` (a pointwise kernel stores it first if it is lazy, or
        into a ``fresh`` buffer of its own)."""
        lazy = self.values[v]
        if self.held(lazy) and not (fenced or fresh):
            return lazy.buffer
        name = self.store(lazy, fenced)
        self.values[v] = self.in_memory(name)
        return name

    def held(self, lazy: Lazy) -> bool:
        """Is ``lazy`` a whole buffer as it is (nothing to store)?"""
        return lazy.buffer is not None

    def store(self, lazy: Lazy, fenced: bool = False, comm: CommKind | None = None) -> str:
        """A new buffer that a pointwise kernel stores ``lazy`` into."""
        name = self.new_buffer("buf", lazy.type, comm)
        xs, sizes = _loops(lazy.type.shape, "x")
        self.kernels.append(Kernel(f"kernel{len(self.kernels)}", sizes, (),
                                   (Store(name, flat(xs, lazy.type.shape), lazy.at(xs)),),
                                   fenced, lazy.origins))
        self.stored.add(name)
        return name

    # -- nodes -----------------------------------------------------------------------------
    def loopable(self, node, types) -> bool:
        if any(t.dtype not in self.dtypes for t in (*types, *node.out_types)):
            return False
        if node.prim in ELEMENTWISE:
            return node.prim in self.ops
        if node.prim == "gather":  # from no elements: the extern raises, as eager does (a
            # kernel's checked positions raise too, where a symbolic size turns out empty)
            return types[0].ndim > 0 and types[0].numel_hint > 0
        if node.prim == "embedding_rows":
            return "where" in self.ops
        return node.prim in REDUCTIONS or node.prim in VIEWS or node.prim in ("full", "iota")

    def lower(self) -> LoopProgram:
        g = self.graph
        inputs, donated, updated_by = [], set(), {}
        for n in g.order:
            node = g.node(n)
            outs = [Value(n, i) for i in range(len(node.out_types))]
            if node.prim == "input":
                inputs.append(self.new_buffer("in", node.out_types[0]))
                if node.kwargs.get("donated"):
                    donated.add(inputs[-1])
                if "updated_by" in node.kwargs:
                    updated_by[inputs[-1]] = node.kwargs["updated_by"]
                self.values[outs[0]] = self.in_memory(inputs[-1])
                continue
            if node.prim == "constant":
                name = self.new_buffer("const", node.out_types[0])
                self.constants[name] = node.kwargs["value"].tensor.contiguous()
                self.values[outs[0]] = self.in_memory(name)
                continue
            operands = g.operands(n)
            types = [g.type_of(v) for v in operands]
            if node.prim in collectives.SPLIT:
                self.collective(n, node, operands[0], outs[0])
                continue
            if not self.loopable(node, types):
                self.extern(n, node, operands, outs)
                continue
            if not node.out_types[0].numel:  # nothing to compute: an empty buffer
                self.values[outs[0]] = self.in_memory(self.new_buffer("buf", node.out_types[0]))
                continue
            if node.prim == "gather":
                lazy = self.gather(n, node, *operands)
            else:
                args = [self.values[v] for v in operands]
                if node.prim == "broadcast_in_dim" and self.repeats_costly(
                        args[0], node.out_types[0]):
                    # stored once rather than computed again at every repeat (T5's position
                    # bias, an embedding of relative positions, over the batch and the
                    # passes of each attention's softmax; rotary embeddings' cos and sin
                    # over the heads)
                    self.realize(operands[0])
                    args = [self.values[operands[0]]]
                if node.prim in REDUCTIONS:
                    self.reduction(n, node, args[0], outs[0], n in self.ordered)
                    continue
                lazy = Lazy(node.out_types[0], _LAZY[node.prim](node, args, node.out_types[0]),
                            origins=_origins(n, args))
            self.values[outs[0]] = lazy
            if n in self.ordered:  # a control edge orders it: a kernel of its own
                self.realize(outs[0], fenced=True)
            elif self.uses.get(outs[0], 0) > 1 and self.worth_storing(lazy):
                self.realize(outs[0])
        outputs: list[str] = []
        for v in g.outputs:  # outputs never alias: a value returned twice is stored twice,
            b = self.realize(v)  # and a comm buffer is copied out
            outputs.append(self.realize(v, fresh=True) if b in outputs or self.buffers[b].comm
                           else b)
        provenance = {n: "  ".join(filter(None, (g.node(n).prim, g.node(n).provenance.aten,
                                                 g.node(n).provenance.source)))
                      for n in g.order}
        return LoopProgram(dict(self.buffers), tuple(inputs), dict(self.constants),
                           tuple(self.kernels), tuple(outputs), provenance,
                           donated=frozenset(donated),
                           updates={b: outputs[k] for b, k in updated_by.items()})

    def repeats_costly(self, lazy: Lazy, repeated: TensorType) -> bool:
        """Is computing ``lazy`` at every point of its broadcast to ``repeated`` costly: does
        it read a buffer indirectly (a gather, checked per point) or compute one of the
        ``COSTLY_OPS``?"""
        return not self.held(lazy) and repeated.numel_hint > lazy.type.numel_hint and any(
            isinstance(e, Load) and e.indirect or isinstance(e, Apply) and e.op in COSTLY_OPS
            for e in _nodes(lazy))

    def worth_storing(self, lazy: Lazy) -> bool:
        """Is one store and a load per use cheaper than computing ``lazy`` at each use (an
        indirect load, a random access, counts as an operation)?"""
        nodes = _nodes(lazy)
        ops = sum(isinstance(e, (Apply, Reduce)) or isinstance(e, Load) and bool(e.indirect)
                  for e in nodes)
        reads = {e.buffer for e in nodes if isinstance(e, Load)
                 and self.buffers[e.buffer].type.numel_hint >= lazy.type.numel_hint}
        return ops > RECOMPUTE_MAX_OPS or (ops > 0 and len(reads) > RECOMPUTE_MAX_READS)

    def gather(self, n, node, x: Value, index: Value) -> Lazy:
        """torch.gather as an indirect load (NOTE [loop IR]): ``x``'s buffer (a reshape of a
        buffer reads it as it is, and a lazy ``x`` computed elementwise from loads, a slice
        of a buffer or a biased product's result, reads those where they lie, ``_remap``;
        another lazy ``x`` is stored first) at the output's point with its ``dim`` coordinate
        replaced by the index operand's value there."""
        shape, dim, t = self.graph.type_of(x).shape, node.kwargs["dim"], node.out_types[0]
        position, (i,) = self.values[index], loop_vars("i", 1)
        source = self._buffer_view(x, "gather")[0]
        remap = self._remap(self.values[x], dim) if source is None else None
        if source is None and remap is None:
            source = self.realize(x)

        def at(idx):
            point = (*idx[:dim], i, *idx[dim + 1:])
            gathered = ((position.at(idx), shape[dim]),)
            if remap:
                return _gathered(remap(point), i, gathered)
            return Load(source, flat(point, shape), t.dtype, indirect=gathered)

        return Lazy(t, at, origins=_origins(n, [position]))

    def _remap(self, lazy: Lazy, dim: int):
        """For a lazy value computed elementwise from loads (a slice or another view of a
        buffer, a product's result plus its bias), its expression at a point, which a gather
        along ``dim`` reads at the gathered points alone; else None (a reduction, a load that
        is indirect already, an index value that varies along ``dim``)."""
        if self.held(lazy):
            return None
        point = loop_vars("x", lazy.type.ndim)
        nodes = walk(lazy.at(point))
        if any(isinstance(e, Reduce) or isinstance(e, Load) and e.indirect
               or isinstance(e, IndexValue) and point[dim] in e.expr.free_symbols
               for e in nodes):
            return None
        return lazy.at

    def extern(self, n, node, operands, outs):
        names, views = [], []
        for i, v in enumerate(operands):
            name, steps = self._buffer_view(v, node.prim, i)
            names.append(name or self.realize(v))
            views.append(steps)
        results = tuple(self.new_buffer("buf", t) for t in node.out_types)
        label = str(node.kwargs["op"]) if node.prim == "opaque" else node.prim
        self.kernels.append(Extern(f"extern{len(self.kernels)}",
                                   Impl(node.prim, tuple(views) if any(views) else ()),
                                   tuple(names), results, node.params, label, frozenset({n}),
                                   fenced=is_effectful(node) or n in self.ordered))
        for v, name in zip(outs, results):
            self.values[v] = self.in_memory(name)

    def collective(self, n, node, v: Value, out: Value):
        """NOTE [lowering collectives]."""
        params, x = node.kwargs, self.values[v]
        ours = x.type.dtype in self.dtypes  # kernels can store it (move it, compute it)
        dim = (params.get("dim") or 0) if ours else 0
        result = self.new_buffer("buf", _moved_type(node.out_types[0], dim, 0) if dim
                                 else node.out_types[0])
        kind = collectives.comm_buffer_type(node.prim, params, x.type) \
            if self.comm_buffers and ours else None
        if kind is not None and (not self.held(x) or x.buffer in self.stored):
            comm = collectives.COMM_BUFFER_TYPES[kind]
            operand = self.comm_buffer(v, CommKind(kind, params["group_name"]))
            extern = Extern("", _one_shot(comm.all_reduce), (operand,), (result,),
                            (("group_name", params["group_name"]),), comm.label)
        else:  # another dtype along another dim: the impl moves it, start and wait in one
            operand = self.store(_moved(x, dim, 0)) if dim else self.realize(v)
            extern = Extern("", Impl(node.prim), (operand,), (result,),
                            tuple(sorted({**params, **({"dim": 0} if dim else {})}.items())),
                            node.prim, split=collectives.SPLIT[node.prim]
                            if ours or not params.get("dim") else None)
        self.kernels.append(attrs.evolve(extern, name=f"extern{len(self.kernels)}",
                                         origins=frozenset({n}), collective=True))
        self.values[out] = _moved(self.in_memory(result), 0, dim) if dim else \
            self.in_memory(result)

    def comm_buffer(self, v: Value, kind: CommKind) -> str:
        """``v`` in a comm buffer of ``kind``: the buffer our kernel wrote, or a new one a
        kernel stores it into (a buffer already of another kind is copied)."""
        lazy = self.values[v]
        if self.held(lazy) and self.buffers[lazy.buffer].comm in (None, kind):
            self.buffers[lazy.buffer] = attrs.evolve(self.buffers[lazy.buffer], comm=kind)
            return lazy.buffer
        name = self.store(lazy, comm=kind)
        self.values[v] = self.in_memory(name)  # its other users read it there
        return name

    def _buffer_view(self, v: Value, extern: str, operand: int = 0):
        """The extern's ``operand`` that is a view of a buffer: the buffer, and the view's steps
        ((tensor method, argument), ...) that the extern applies when it runs, so no copy is
        stored: a reshape of the whole buffer and, where the extern reads it as it is
        (``_reads_transposed``), a transpose of that. (None, ()) otherwise. A lazy value
        that the program returns or that other nodes use is stored here, in its own shape,
        and the views become views of its buffer, so that it is stored once and not computed
        again by its other users (softmax's probabilities, kept for the backward and
        reshaped for a batched product; an embedding's layer norm, reshaped for the first
        products and added back after the attention)."""
        steps, views = [], []
        if extern == "attention":
            v = self._strided_view(v, steps, views)
        if not steps:
            for prim, method, param in (("transpose", "permute", "permutation"),
                                        ("reshape", "reshape", "shape")):
                node = self.graph.node(v.node)
                if node.prim == prim and (prim == "reshape" or _reads_transposed(
                        extern, node.kwargs[param], operand)):
                    steps.insert(0, (method, node.kwargs[param]))
                    views.insert(0, v)
                    (v,) = self.graph.operands(v.node)
        if steps and not self.held(self.values[v]) and (v in self.returned
                                                         or self.uses.get(v, 0) > 1):
            self.realize(v)
            for view in views:
                node, (source,) = self.graph.node(view.node), self.graph.operands(view.node)
                args = [self.values[source]]
                self.values[view] = Lazy(node.out_types[0], _LAZY[node.prim](
                    node, args, node.out_types[0]), origins=_origins(view.node, args))
        source = self.values[v]
        return (source.buffer, tuple(steps)) if steps and self.held(source) else (None, ())

    def _strided_view(self, v: Value, steps: list, views: list) -> Value:
        """What attention's operand ``v`` views through reshapes, transposes and slices
        (the heads of a fused qkv projection, NOTE [bias epilogues]), the chain's steps put
        in ``steps`` and its values in ``views`` where the view keeps the last dim's unit
        stride (as attention's fused kernels need); else ``v``, nothing put."""
        chain, values, source = [], [], v
        while (node := self.graph.node(source.node)).prim in STRIDED_VIEWS:
            params, (operand,) = node.kwargs, self.graph.operands(source.node)
            if node.prim == "slice":
                if any(step != 1 for step in params["step"]):
                    break
                chain[:0] = [("narrow", d, a, b - a) for d, (a, b, n) in enumerate(zip(
                    params["start"], params["limit"], self.graph.type_of(operand).shape))
                    if (a, b) != (0, n)]
            else:
                chain.insert(0, ("reshape", params["shape"]) if node.prim == "reshape" else
                             ("permute", params["permutation"]))
            values.insert(0, source)
            source = operand
        if not chain:
            return v
        # at the traced sizes, for symbolic ones: a view that copies at another size (a
        # reshape) is still correct there (NOTE [symbolic sizes])
        view = torch.empty(tuple(map(size_hint, self.graph.type_of(source).shape)),
                           device="meta")
        for method, *args in chain:
            view = getattr(view, method)(*concrete(tuple(args), hints(args)))
        if view.ndim and view.stride(-1) != 1:
            return v
        steps += chain
        views += values
        return source

    def reduction(self, n, node, x: Lazy, out: Value, fenced: bool):
        t = node.out_types[0]
        # over no elements but one (no dims, a scalar, dims of size 1): the value itself,
        # reshaped to the result (argmax/argmin: 0); every Reduce loops over its kernel's
        # reduction loops
        dims = node.kwargs["dims"] if x.type.ndim else ()
        if all(x.type.shape[d] == 1 for d in dims):
            self.values[out] = (Lazy(t, lambda idx: Constant(0, t.dtype), origins={n})
                                if node.prim in ("argmax", "argmin") else
                                x if x.type.shape == t.shape else
                                Lazy(t, _reshape(None, [x], t), origins=_origins(n, [x])))
            return
        kept = [d for d in range(x.type.ndim) if d not in dims]
        xs, sizes = _loops([x.type.shape[d] for d in kept], "x")
        rs, reduction_sizes = _loops([x.type.shape[d] for d in dims], "r")
        index = [None] * x.type.ndim
        for d, v in zip(kept, xs):
            index[d] = v
        for d, v in zip(dims, rs):
            index[d] = v
        name = self.new_buffer("buf", t)
        self.stored.add(name)
        self.kernels.append(Kernel(
            f"kernel{len(self.kernels)}", sizes, reduction_sizes,
            (Store(name, flat(xs, t.shape), Reduce(node.prim, x.at(tuple(index)), t.dtype)),),
            fenced, x.origins | {n}))
        self.values[out] = self.in_memory(name)


def _moved_type(t: TensorType, source: int, destination: int) -> TensorType:
    order = list(range(t.ndim))
    order.insert(destination, order.pop(source))  # the result's dim i is dim order[i]
    return attrs.evolve(t, shape=[t.shape[d] for d in order])


def _moved(x: Lazy, source: int, destination: int) -> Lazy:
    """``x`` with dim ``source`` moved to ``destination`` (a view: an index rewrite)."""
    def at(idx):
        idx = list(idx)
        idx.insert(source, idx.pop(destination))
        return x.at(tuple(idx))

    return Lazy(_moved_type(x.type, source, destination), at, origins=x.origins)


def _one_shot(all_reduce):
    return lambda x, *, group_name: (all_reduce(x, group_name),)


def _origins(n: int, args) -> frozenset:
    return frozenset({n}).union(*(a.origins for a in args))


# ---------------------------------------------------------------------------------------
# Lazy values, one rule per primitive: (node, operand lazies, out type) -> index -> expr
# ---------------------------------------------------------------------------------------
def _elementwise(node, args, t):
    params = node.params
    return lambda idx: Apply(node.prim, tuple(a.at(idx) for a in args), params, t.dtype)


def _broadcast(node, args, t):
    (x,), dims = args, node.kwargs["broadcast_dimensions"]
    return lambda idx: x.at(tuple(sympy.Integer(0) if x.type.shape[i] == 1 else idx[d]
                                  for i, d in enumerate(dims)))


def _reshape(node, args, t):
    (x,) = args
    groups = _reshape_groups(t.shape, x.type.shape)
    return lambda idx: x.at(tuple(
        i for (out, shape) in groups
        for i in unflat(flat(idx[out.start:out.stop], t.shape[out]), shape)))


def _reshape_groups(out_shape, in_shape) -> list[tuple[slice, tuple]]:
    """The reshape as independent groups (a slice of the out dims, the in dims' sizes) of
    equal size, cut wherever the two shapes' prefix products meet: splitting or merging one
    dim then needs no division or remainder of a sum of indices (sympy's simplification of
    those dominated lowering time)."""
    if 0 in out_shape:
        return [(slice(0, len(out_shape)), tuple(in_shape))]
    firsts = []
    for shape in (out_shape, in_shape):
        first: dict[int, int] = {}
        for k in range(len(shape) + 1):
            first.setdefault(math.prod(shape[:k]), k)
        firsts.append(first)
    cuts = sorted((firsts[0][v], firsts[1][v]) for v in firsts[0].keys() & firsts[1].keys())
    cuts.append((len(out_shape), len(in_shape)))
    return [(slice(i0, i1), tuple(in_shape[j0:j1]))
            for (i0, j0), (i1, j1) in zip(cuts, cuts[1:]) if (i0, j0) != (i1, j1)]


def _transpose(node, args, t):
    (x,), perm = args, node.kwargs["permutation"]
    return lambda idx: x.at(tuple(idx[perm.index(d)] for d in range(len(perm))))


def _slice(node, args, t):
    (x,), k = args, node.kwargs
    return lambda idx: x.at(tuple(s + i * st for i, s, st in zip(idx, k["start"], k["step"])))


def _rev(node, args, t):
    (x,), dims = args, node.kwargs["dims"]
    return lambda idx: x.at(tuple(n - 1 - i if d in dims else i
                                  for d, (i, n) in enumerate(zip(idx, x.type.shape))))


def _inside(idx, offsets, shape):
    return sympy.And(*[sympy.And(i - o >= 0, i - o < n) for i, o, n in zip(idx, offsets, shape)])


def _pad(node, args, t):
    (x,), low, value = args, node.kwargs["low"], node.kwargs["value"]
    if not x.type.numel:  # all padding: nothing to load
        return lambda idx: Constant(value, t.dtype)

    def at(idx):
        inner = x.at(tuple(_clamp(i - lo, n) for i, lo, n in zip(idx, low, x.type.shape)))
        return Apply("where", (IndexValue(_inside(idx, low, x.type.shape), torch.bool), inner,
                               Constant(value, t.dtype)), (), t.dtype)

    return at


def _concatenate(node, args, t):
    dim = node.kwargs["dim"]
    args = [a for a in args if a.type.shape[dim]]  # empty parts hold nothing to load
    starts = [sum(a.type.shape[dim] for a in args[:k]) for k in range(len(args))]

    def at(idx):
        def part(k):
            shifted = list(idx)
            shifted[dim] = _clamp(idx[dim] - starts[k], args[k].type.shape[dim])
            return args[k].at(tuple(shifted))

        expr = part(len(args) - 1)
        for k in reversed(range(len(args) - 1)):
            expr = Apply("where", (IndexValue(idx[dim] < starts[k + 1], torch.bool), part(k),
                                   expr), (), t.dtype)
        return expr

    return at


def _embedding_rows(node, args, t):
    """An embedding's rows where ``kept`` (broadcast along its dims of size 1), else 0: the
    primitive exists for its gradient's scale (tracer/nn.py); its value is elementwise."""
    rows, _, kept = args

    def at(idx):
        where = tuple(sympy.Integer(0) if n == 1 else i for i, n in zip(idx, kept.type.shape))
        return Apply("where", (kept.at(where), rows.at(idx), Constant(0, t.dtype)), (),
                     t.dtype)

    return at


_LAZY = {name: _elementwise for name in ELEMENTWISE} | {
    "broadcast_in_dim": _broadcast, "reshape": _reshape, "transpose": _transpose,
    "slice": _slice, "rev": _rev, "pad": _pad, "concatenate": _concatenate,
    "embedding_rows": _embedding_rows,
    "stop_gradient": lambda node, args, t: args[0].at,
    "no_grad": lambda node, args, t: args[0].at,
    "no_fwd_grad": lambda node, args, t: args[0].at,
    "after": lambda node, args, t: args[0].at,
    "custom_vjp": lambda node, args, t: args[-1].at,  # NOTE [custom functions]
    "full": lambda node, args, t: _full(node.kwargs["value"], t.dtype),
    "iota": lambda node, args, t: lambda idx: IndexValue(
        node.kwargs["start"] + idx[0] * node.kwargs["step"], t.dtype),
}


def _full(value, dtype) -> Callable:
    """A constant, or a size expression as a value (NOTE [symbolic sizes]: a row length
    divided by)."""
    if not isinstance(value, sympy.Basic) or not value.free_symbols:
        return lambda idx: Constant(value, dtype)
    n = value.replace(lambda e: type(e).__name__ == "ToFloat", lambda e: e.args[0])
    if not n.is_integer:
        raise TypeError(f"full of {value}: only an integer size expression is a value")
    return lambda idx: IndexValue(n, dtype)


def reads_memory(prim: str) -> bool:
    """Does a node of ``prim`` read its operands from buffers (an extern), rather than
    inline them (a lazy value, a reduction's or a gather's operand expression)?"""
    return prim not in _LAZY and prim not in REDUCTIONS and prim != "gather"


def inline_checkpoints(graph: Graph) -> Graph:
    """Each ``checkpoint`` node replaced by its body (NOTE [checkpoint] in control.py): its
    recomputation is in the graph by now, and no later pass merges computations."""
    if not any(graph.node(n).prim == "checkpoint" for n in graph.order):
        return graph

    def visit(b, n, operands, preds):
        node = graph.node(n)
        if node.prim != "checkpoint":
            return None
        body = inline_checkpoints(node.kwargs["body"])
        values = b.splice(body, {Value(m, 0): v for m, v in zip(body.inputs, operands)},
                          after=preds)
        return [values[v] for v in body.outputs]

    return rewrite(graph, visit)


def lower(graph: Graph, supported_ops: Iterable[str] = ELEMENTWISE,
          supported_dtypes: Iterable[torch.dtype] = (
              torch.float32, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
              torch.uint8, torch.bool), comm_buffers: bool = False) -> LoopProgram:
    """``comm_buffers``: the backend plans communication buffers (NOTE [lowering
    collectives])."""
    return _Lowering(graph, supported_ops, supported_dtypes, comm_buffers).lower()


