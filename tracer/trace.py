"""Tracing: run a Python function on tracer tensors and record a primitive graph.

NOTE [how an op is traced]
The user's function runs under ``torch.func.functionalize`` on ``TracerTensor`` inputs.
Functionalization turns in-place ops, ``out=`` and writes through views into functional ops
(and, at the end, a ``copy_`` into every mutated input, which becomes a write-back output).
Every ATen op then reaches ``Trace.dispatch`` (through ``_TraceMode``: NOTE [tracing through
a mode]), which tries, in order:
  1. a plait handler (``HANDLERS``, filled by ``tracer/aten.py``) that emits primitives (or
     returns NotImplemented: the plain rules of NOTE [plain forms of torch's references]);
  2. PyTorch's decomposition table (``torch._refs`` and ``torch._decomp``): the decomposition
     runs on tracers, so its ops come back here, and ``torch.ops.prims`` ops map 1:1 to plait
     primitives;
  3. an opaque node that calls the ATen op at run time, typed by the op's meta kernel (also
     the fallback when a decomposition fails on tracers).
Only the outermost op of a user call records provenance and wraps errors; the ops a
decomposition issues inherit that provenance.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import threading
import types
import weakref
from typing import Any, Callable, Sequence

import networkx as nx
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.autograd.forward_ad import _set_fwd_grad_enabled
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..config import config
from ..errors import (ConcretizationError, OpError, PlaitError, ShapeError, TraceError,
                      TransformError, UnsupportedDtypeError, UnsupportedOpError)
from ..graph import Constant, Graph, GraphBuilder, Node, Provenance, TensorType, Value, rewrite
from ..graph.types import contiguous_strides, is_symbolic
from .registry import OperandSlot, draws_random, get_primitive, is_effectful
from .sizes import current as current_sizes
from .sizes import Specialized, params_dimensions, reported

aten = torch.ops.aten


class _PerThread(threading.local):
    """A thread's traces in progress, outermost first: traces are per thread (NOTE [threads])."""

    def __init__(self):
        self.traces: list[Trace] = []


_THREAD = _PerThread()
# ATen/prims op -> handler emitting primitives; filled by tracer/aten.py.
HANDLERS: dict[Any, Callable] = {}
# Finders of a handler for an op HANDLERS lacks (``op -> handler or None``): ops defined
# after plait is imported (tracer/custom.py: torch.library custom ops with a derivative).
HANDLER_FINDERS: list[Callable] = []
_PLAIT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The package root is the repository root, so skip plait's own modules, not the whole tree
# (examples/ and tests/ are user code).
_PLAIT_DIRS = tuple(os.path.join(_PLAIT_ROOT, d) + os.sep for d in (
    "tracer", "graph", "passes", "backends", "compiler"))
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SKIP_DIRS = _PLAIT_DIRS + (_TORCH_DIR, os.path.dirname(contextlib.__file__) + os.sep)
_SKIP_FILES = {os.path.join(_PLAIT_ROOT, f) for f in ("api.py", "__init__.py", "config.py",
                                                     "transforms.py", "control.py", "rules.py")}


def _draws_uniform(node) -> bool:
    """Is ``node`` a draw from [0, 1) of a floating dtype (``torch.rand``, ``rand_like``)?"""
    return node.prim == "opaque" and node.kwargs["op"].overloadpacket.__name__ in (
        "rand", "rand_like") and node.out_types[0].dtype.is_floating_point


# comparison of a draw u in [0, 1) with a number c -> its value where c decides it, else None
# (NOTE [values decided by ranges])
_DECIDED = {
    "lt": lambda c: False if c <= 0 else True if c > 1 else None,
    "le": lambda c: False if c < 0 else True if c > 1 else None,
    "gt": lambda c: True if c < 0 else False if c > 1 else None,
    "ge": lambda c: True if c <= 0 else False if c > 1 else None,
}
_MIRRORED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}  # c < u is u > c


class TracerTensor(torch.Tensor):
    """A tensor that records the ops applied to it instead of computing them.

    It reports its shape, dtype and device like a real tensor (always dense and contiguous)
    but owns no storage; ``_value`` names the graph value it stands for.
    """

    _trace: "Trace"
    _value: Value
    # Set on a view's base and shared by every view made from it: the tracers that share one
    # storage in eager. A write into a view is a rebind only when no other of them is alive.
    _aliases: weakref.WeakValueDictionary | None  # id -> tracer (a WeakSet compares them)
    # Known to be laid out contiguously from offset 0 in eager too. Tracers present a
    # contiguous layout (but inputs given ``layout``), while eager's ops keep their operands'
    # strides, so only dense tracers may be read through raw strides (as_strided).
    _dense: bool
    # Eager's (strides, storage offset or None) where known otherwise (NOTE [eager layouts]
    # in tracer/aten.py); an input made with it reports it.
    _layout: tuple | None
    # The user's op that made this tracer, from which eager's layout is derived on demand
    # (``Origin``); None for inputs and for values made otherwise.
    _origin: "Origin | None"

    @staticmethod
    def __new__(cls, trace: "Trace", value: Value, layout: tuple | None = None):
        t = trace.builder.type_of(value)
        strides, offset = layout or (None, None)
        self = torch.Tensor._make_wrapper_subclass(cls, reported(t.shape), strides,
                                                   None if strides is None else offset or 0,
                                                   dtype=t.dtype,
                                                   device=torch.device(t.device),
                                                   requires_grad=False)
        self._trace, self._value, self._aliases, self._dense = trace, value, None, False
        self._layout, self._origin = layout, None
        return self

    def known_layout(self) -> tuple | None:
        """Eager's (strides, storage offset or None) of the tensor this tracer stands for,
        where known without deriving it (NOTE [eager layouts] in tracer/aten.py)."""
        if self._layout is not None:
            return self._layout
        return (contiguous_strides(self.shape), 0) if self._dense else None

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return current_trace(func).dispatch(func, args, kwargs or {})

    def __repr__(self) -> str:
        return f"TracerTensor({self._trace.builder.type_of(self._value)})"

    # Python's own protocols reach ATen as ops with no tensor result; say what went wrong.
    def __bool__(self):
        raise _concretization("bool()")

    def __index__(self):
        raise _concretization("use as an index")


_BATCH_NORM_SOURCE = os.path.join(_TORCH_DIR, "nn", "modules", "batchnorm.py")


def _concretization(what: str) -> ConcretizationError:
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename != _BATCH_NORM_SOURCE:
        frame = frame.f_back
    if frame is not None and frame.f_locals.get("self") is not None and \
            getattr(frame.f_locals["self"], "momentum", 0) is None:
        return ConcretizationError(
            "BatchNorm with momentum=None (a cumulative average: the module reads "
            "1 / num_batches_tracked as a Python float each call) is not supported under "
            "plait.jit in training mode. Give it a momentum (e.g. momentum=0.1), or call it "
            "in eval mode.")
    return ConcretizationError(
        f"{what} needs the concrete value of a traced tensor, but under plait.jit a tensor's "
        "value is only known when the compiled function runs. Compute both sides and pick "
        "with torch.where(condition, a, b); branch or loop on it in the program with "
        "plait.cond or plait.while_loop:\n"
        "    y = plait.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))\n"
        "    i, x = plait.while_loop(lambda i, x: i < n, lambda i, x: (i + 1, x / 2), (i, x))\n"
        "or pass the value as a static argument (static_argnums) so each value compiles its "
        "own version.")


def captured_write_error() -> TransformError:
    """As torch.func's (a RuntimeError, with its words)."""
    return TransformError(
        "the traced function writes into a tensor it did not receive as an argument: the "
        "in-place operation would mutate a captured Tensor (a closure or global tensor: plait "
        "reads those at each call but writes back only arguments and modules' parameters and "
        "buffers). Pass the tensor as an argument instead.")


def tracing_active() -> bool:
    return bool(_THREAD.traces)


def foreign_mode_active() -> bool:
    """Is a dispatch mode (``make_fx``, ``FakeTensorMode``) or a torch.func transform other
    than plait's on? What records ops must then see torch ops, not compiled kernels."""
    return bool(torch._C._len_torch_dispatch_stack()) or \
        torch._C._functorch.peek_interpreter_stack() is not None


def current_trace(func=None) -> "Trace":
    if not _THREAD.traces:
        raise TraceError(f"a traced tensor was used outside of its trace (op {func}): a tracer "
                         "escaped the traced function (e.g. stored in a global; return it "
                         "instead), or a module was called in one thread while plait.jit "
                         "traced it in another (its parameters are tracers meanwhile; call "
                         "its jitted version in every thread).")
    return _THREAD.traces[-1]


_DATA_DEPENDENT = {
    aten._local_scalar_dense.default: ".item() / float() / int()",
    aten.is_nonzero.default: "bool() / a Python branch",
    aten.item.default: ".item()",
}
_DYNAMIC_SHAPE = ("nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
                  "unique_consecutive", "repeat_interleave", "bincount", "argwhere")


class _NeedsFallback(Exception):
    """Raised inside a decomposition that plait cannot follow: use an opaque node instead."""


class Trace:
    """One tracing session: a graph builder plus the bookkeeping of the tracers in it."""

    def __init__(self):
        self.builder = GraphBuilder()
        self._constants: dict[int, tuple[torch.Tensor, Value]] = {}
        self._provenance = Provenance()
        self._inherited: Provenance | None = None
        self._depth = 0
        self._captures: dict[int, tuple[TracerTensor, Value]] = {}
        self._captured_writes: dict[int, Value] = {}  # NOTE [writes to captured tracers]
        # the functionalize wrappers that hold a root trace's module state while it runs,
        # each with whether it holds a parameter (NOTE [writes to captured tracers])
        self.state_wrappers: list[tuple[torch.Tensor, bool]] = []
        self._last_effect: int | None = None
        self.seeded: str | None = None  # a seeding call traced (NOTE [random draws])
        self.captured: list[TracerTensor] = []  # enclosing traces' tracers, in input order
        # NOTE [live state]: captured tensors the caller may change, lifted to inputs when
        # first read (id -> tensor); the lifted ones, in input order; the baked ones
        self.live: dict[int, torch.Tensor] = {}
        self.lifted: dict[int, TracerTensor] = {}
        self.baked: dict[int, torch.Tensor] = {}
        self.pinned: dict[int, torch.Tensor] = {}  # live ones whose value the trace read
        # NOTE [value guards]: a jit's root trace runs on its call's tensors (``arguments``,
        # one per input made before tracing began) and evaluates graphs on them
        # (``evaluate(graph, tensors) -> outputs``); the guards it took: (graph, value)
        self.arguments: list[torch.Tensor] | None = None
        self.evaluate: Callable | None = None
        self.guards: list[tuple[Graph, bool]] = []

    @property
    def issued_by_torch(self) -> bool:
        """Is the op being traced issued by PyTorch's code (a decomposition, or a torch
        function written in Python) rather than by the user's?"""
        if self._depth > 1:
            return True
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(_PLAIT_DIRS):
            frame = frame.f_back
        return frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR)

    # -- values ----------------------------------------------------------------------------
    def new_input(self, type: TensorType, dense: bool = True,
                  layout: tuple | None = None) -> TracerTensor:
        tracer = TracerTensor(self, self.builder.add_input(type), layout)
        tracer._dense = dense
        return tracer

    def value_of(self, x: Any) -> Value:
        x = unwrap_functional(x)
        if isinstance(x, TracerTensor):
            if x._trace is self:
                return x._value
            if x._trace in _THREAD.traces:  # an enclosing trace's, captured by a closure
                return self._capture(x)
            raise TraceError("a tracer of a finished trace was used: it escaped its traced "
                             "function (e.g. stored in a global; return it instead), or a "
                             "function under a plait transform wrote into a tensor it "
                             "captured (a module buffer, such as BatchNorm's running "
                             "statistics; pass such tensors as arguments, e.g. "
                             "functional_call(model, (params, buffers), x)).")
        if isinstance(x, torch.Tensor):
            return self.constant(x)
        raise TraceError(f"expected a tensor operand, got {type(x).__name__}")

    def _capture(self, outer: TracerTensor) -> Value:
        """An enclosing trace's tracer becomes an extra input of this (nested) trace; the
        transform that started this trace passes it back in when it inlines the result."""
        hit = self._captures.get(id(outer))
        if hit is None:
            hit = self._captures[id(outer)] = (outer, self.builder.add_input(
                outer._trace.type_of(outer)))
            self.captured.append(outer)
        return self._captured_writes.get(id(outer), hit[1])

    def captured_writes(self) -> list[tuple[int, Value]]:
        """(index in ``captured``, new value) of each captured tracer this trace wrote."""
        return [(k, self._captured_writes[id(outer)]) for k, outer in enumerate(self.captured)
                if id(outer) in self._captured_writes]

    def constant(self, tensor: torch.Tensor) -> Value:
        """A real tensor the function captured: an input of the outermost trace if it is
        live state, else a constant whose version is kept (NOTE [live state])."""
        check_dtype(tensor, "a captured tensor")
        root = _THREAD.traces[0] if _THREAD.traces else self
        if id(tensor) in root.live:
            lifted = root.lifted.get(id(tensor))
            if lifted is None:
                lifted = root.lifted[id(tensor)] = root.new_input(TensorType.of(tensor),
                                                                  is_dense(tensor))
            return self.value_of(lifted)
        root.baked[id(tensor)] = tensor
        hit = self._constants.get(id(tensor))
        if hit is None or hit[0] is not tensor:
            hit = self._constants[id(tensor)] = (tensor, self._bake(tensor))
        return hit[1]

    def pin(self, tensors: Sequence[torch.Tensor]) -> None:
        """Real ``tensors`` the function reads as they are now (their values were taken at
        an earlier time, which the compilation answers for): a live one is guarded by
        identity and version as a baked one is (NOTE [live state])."""
        root = _THREAD.traces[0]
        for t in tensors:
            if id(t) in root.live:
                root.pinned[id(t)] = t

    def live_value(self, x: Any) -> torch.Tensor | None:
        """The live tensor that tracer ``x`` stands for, if it is one lifted by the
        outermost trace (through the captures of nested ones), now pinned: its value
        specializes the compilation (a tensor of split sizes, say), so its identity and
        version are guarded (NOTE [live state])."""
        x, root = unwrap_functional(x), _THREAD.traces[0]
        if isinstance(x, torch.Tensor) and id(x) in root.live:  # read before it is lifted
            root.pinned[id(x)] = x
            return x
        if not isinstance(x, TracerTensor) or x._trace is not self:
            return None
        outer = next((o for o, v in self._captures.values() if v == x._value), None)
        if outer is not None:
            return outer._trace.live_value(outer)
        key = next((k for k, t in root.lifted.items() if t._value == x._value), None)
        if self is not root or key is None:
            return None
        root.pinned[key] = root.live[key]
        return root.live[key]

    # NOTE [value guards]
    # A Python branch on a tensor's value (``if (mask > 0).any():``, Longformer's "is any
    # token global?") needs a value a trace does not have. plait.jit traces on its call's
    # tensors, so where the branch is on a one-element bool computed from them, with nothing
    # random or effectful on the way, the trace computes it: the graph of the value so far,
    # cut to what it reads, run on the call's tensors by the reference backend. The trace
    # takes that branch and keeps (graph, bool) as a guard; a later call of the signature
    # runs the guards first (a few small ops) and uses the compilation whose guards all
    # hold, or traces the other branch as another compilation of the signature (at most
    # ``config.cache_size``). Only bools: a guard on a number (``.item()``, ``bool()`` of a
    # float, which reaches plait as the same op) would compile once per value.
    # Under a transform (grad, vmap) or in a control-flow body there are no call tensors,
    # and the branch is refused as before.
    def guarded_value(self, x: Any) -> torch.Tensor | None:
        """The value of the one-element bool tracer ``x``, computed from this call's tensors,
        where this is a jit's root trace and nothing random or effectful leads to ``x``; the
        compilation then holds for calls where it is the same (NOTE [value guards])."""
        x = unwrap_functional(x)
        if self.evaluate is None or not isinstance(x, TracerTensor) or x._trace is not self \
                or self.type_of(x).numel != 1:
            return None
        graph = self.builder.build([x._value])
        needed = nx.ancestors(graph.nx, x._value.node) | {x._value.node}
        if any(is_effectful(graph.node(n)) for n in needed):
            return None
        guard = rewrite(graph, keep=needed)
        tensors = self.arguments + [self.live[k] for k in self.lifted]
        with _disable_current_modes(), torch.no_grad():
            value = self.evaluate(guard, tensors)[0]
        self.guards.append((guard, bool(value)))
        return value

    # NOTE [values decided by ranges]
    # A branch on a comparison of a uniform draw in [0, 1) (``torch.rand``) with a number
    # outside that range has one outcome, whatever is drawn: transformers' LayerDrop draws
    # ``torch.rand([])`` each training step and skips a layer where it is below
    # ``layerdrop``, 0.0 by default (never). The draw stays in the graph (it is random, so
    # effectful: the generator advances as in eager) and the trace takes the branch, with
    # no guard: the value is known under any transform too. Only bounds that hold however
    # the draw was rounded to its dtype are used: a number below 0 or at 0, above 1.
    def decided_value(self, x: Any) -> torch.Tensor | None:
        """The value of the one-element bool tracer ``x`` where it compares a uniform draw
        with a number outside [0, 1] that decides it (NOTE [values decided by ranges])."""
        x = unwrap_functional(x)
        if not isinstance(x, TracerTensor) or x._trace is not self:
            return None
        node, operands = self.defining(x)
        if node.prim not in _DECIDED:
            return None
        prim, (draw, bound) = node.prim, (self.builder.node(v.node) for v in operands)
        if draw.prim == "full":
            prim, draw, bound = _MIRRORED[prim], bound, draw
        if not (_draws_uniform(draw) and bound.prim == "full"):
            return None
        decided = _DECIDED[prim](float(bound.kwargs["value"]))
        return None if decided is None else torch.tensor(decided)

    def _drawn(self, x: Any) -> bool:
        """Does this trace's tracer ``x`` depend on a random draw?"""
        x = unwrap_functional(x)
        if not isinstance(x, TracerTensor) or x._trace is not self:
            return False
        graph = self.builder.build([x._value])
        return any(draws_random(graph.node(n)) for n in
                   nx.ancestors(graph.nx, x._value.node) | {x._value.node})

    def _bake(self, tensor: torch.Tensor) -> Value:
        """A constant node; a broadcast view (stride 0 along a dim: a mask or a scalar that
        a decomposition expanded, as torch's ``where`` does) is baked as the tensor it
        repeats and broadcast in the graph, so the program holds, copies and hashes the
        mask's bytes, not the view's (a causal mask over [8, 12, 1024, 1024] scores)."""
        kept = tuple(d for d in range(tensor.ndim) if tensor.stride(d) or tensor.shape[d] <= 1)
        if len(kept) == tensor.ndim:
            return self.builder.add_node("constant", (), {"value": Constant(tensor)},
                                         (TensorType.of(tensor),), self._provenance)[0]
        repeated = self.constant(tensor[tuple(slice(None) if d in kept else 0
                                              for d in range(tensor.ndim))])
        return self.builder.add_node(
            "broadcast_in_dim", (repeated,), {"shape": tuple(tensor.shape),
                                              "broadcast_dimensions": kept},
            (TensorType.of(tensor),), self._provenance)[0]

    def type_of(self, x: Any) -> TensorType:
        return self.builder.type_of(self.value_of(x))

    def defining(self, x: Any) -> tuple[Node, tuple[Value, ...]]:
        """The node that computes tracer (or graph value) ``x`` in this trace, and its
        operands: for a rule that reads a table the trace built (NOTE [nn ops])."""
        value = x if isinstance(x, Value) else self.value_of(x)
        return self.builder.node(value.node), self.builder.operands(value.node)

    def bind(self, prim_name: str, *operands: Any, **params: Any):
        """Add one primitive node; return its result tracer(s)."""
        prim = get_primitive(prim_name)
        values = [self.value_of(x) for x in operands]
        params = {k: params_dimensions(v) for k, v in params.items()}  # NOTE [dynamic dimensions]
        out_types = prim.infer(*[self.builder.type_of(v) for v in values], **params)
        outs = self.builder.add_node(prim_name, values, params, out_types, self._provenance)
        self._chain_effect()
        tracers = tuple(TracerTensor(self, v) for v in outs)
        return tracers if prim.multiple_results else tracers[0]

    def _without(self, prim: str) -> Callable[["TracerTensor"], "TracerTensor"]:
        """A tracer through ``prim`` (``no_grad`` or ``no_fwd_grad``), if it could carry a
        derivative."""
        def through(t: "TracerTensor") -> "TracerTensor":
            dtype = self.type_of(t).dtype
            return self.bind(prim, t) if dtype.is_floating_point or dtype.is_complex else t

        return through

    def _reporting_views(self, func, args, kwargs, out):
        """``out``, a view op's results, each reporting the layout eager's view has of its
        base laid out as eager lays it out where that is known (else as it reports), NOTE
        [eager layouts]: the strides a user reads from a view (and passes to as_strided, as
        Longformer's chunking does) are then eager's wherever the base's are. The views'
        layouts count as eager's known ones where the base's is."""
        base = args[0]
        if func in _NOT_REREPORTED or any(isinstance(a, torch.Tensor)
                                          for a in (*args[1:], *kwargs.values())):
            return out
        known = _eager_layout_of(base)
        # a view eager could not make of that layout (torch would raise, which plait's own
        # views of its reports may ask for) keeps its report, without a C++ exception
        if func is _VIEW and not _viewable(base.shape, (known or (base.stride(),))[0],
                                           args[1]):
            return out
        try:
            with _disable_current_modes():
                viewed = func(_meta_with(self.type_of(base), known or (
                    tuple(base.stride()), base.storage_offset())), *args[1:], **kwargs)
        except Exception:  # noqa: BLE001 - no meta kernel: the views report as they are
            return out
        single = isinstance(out, torch.Tensor)
        outs, views = ([out], [viewed]) if single else (list(out), list(viewed))
        if len(outs) != len(views):
            return out
        for k, (t, m) in enumerate(zip(outs, views)):
            layout = (tuple(m.stride()), m.storage_offset())
            if not isinstance(t, TracerTensor) or (tuple(t.stride()), t.storage_offset()) == \
                    layout:
                continue
            outs[k] = TracerTensor(self, t._value, layout)
            outs[k]._layout = t._layout or (
                (layout[0], layout[1] if known[1] is not None else None) if known else None)
        return outs[0] if single else type(out)(outs)

    def _chain_effect(self) -> None:
        """Effects keep their program order: an effectful node (a check, a random draw) gets
        a control edge from the one before."""
        n = self.builder.last_node
        if is_effectful(self.builder.node(n)):
            if (seeded := _THREAD.traces[0].seeded) and draws_random(self.builder.node(n)):
                raise TraceError(
                    f"{seeded} in a function plait traces, then a random draw: the seeding "
                    "would run once, while tracing, not at each call, so the compiled "
                    "function's draws would not follow it. Seed before calling the jitted "
                    "or transformed function.")
            if self._last_effect is not None:
                self.builder.add_control_edge(self._last_effect, n)
            self._last_effect = n

    def order_after(self, value: Any, deps) -> "TracerTensor":
        """``value``, through a node that control edges order after the nodes making
        ``deps`` (see plait.control_dependency)."""
        out = self.bind("after", value)
        for dep in deps:
            self.builder.add_control_edge(self.value_of(dep).node, out._value.node)
        return out

    # -- dispatch --------------------------------------------------------------------------
    @contextlib.contextmanager
    def provenance_of(self, provenance: Provenance):
        """Nodes made meanwhile come from ``provenance`` (a graph pass replaying or
        differentiating a node gives its nodes the user's op and line)."""
        saved, self._inherited = self._inherited, provenance
        self._provenance = provenance
        try:
            yield
        finally:
            self._inherited = saved
            self._provenance = saved or Provenance()

    def dispatch(self, func, args: tuple, kwargs: dict):
        outermost = self._depth == 0
        if outermost:
            self._provenance = self._inherited or Provenance(
                str(func), user_source() if config.provenance else None)
        self._depth += 1
        try:
            out = self._dispatch(func, args, kwargs)
            if outermost:  # NOTE [grad mode while tracing]
                if not torch.is_grad_enabled():
                    out = pytree.tree_map_only(TracerTensor, self._without("no_grad"), out)
                if not torch._C._is_fwd_grad_enabled():
                    out = pytree.tree_map_only(TracerTensor, self._without("no_fwd_grad"), out)
                if current_sizes() is None:  # eager's layouts: of concrete sizes only
                    if func.is_view and isinstance(args[0], TracerTensor):
                        out = self._reporting_views(func, args, kwargs, out)
                    Origin.record(func, args, kwargs, out)
            if func.is_view and isinstance(base := args[0], TracerTensor):
                if base._aliases is None:
                    base._aliases = weakref.WeakValueDictionary({id(base): base})
                for t in pytree.tree_leaves(out):
                    if isinstance(t, TracerTensor):
                        t._aliases = base._aliases
                        base._aliases[id(t)] = t
            return out
        except ShapeError as e:
            if outermost and not str(e).startswith(str(func)):
                raise ShapeError(f"{func}: {e} (operands: {_describe(args, kwargs)})") from None
            raise
        except PlaitError:
            raise
        except _NeedsFallback:
            if outermost:
                raise UnsupportedOpError(f"{func}: plait cannot trace this use of the op; "
                                         f"operands: {_describe(args, kwargs)}") from None
            raise
        except Exception as e:
            if not outermost:
                raise
            raise OpError(f"{func} failed while tracing: {e} (operands: "
                          f"{_describe(args, kwargs)}). If eager PyTorch accepts these "
                          "arguments, this is a plait bug; please report it.") from e
        finally:
            self._depth -= 1
            if outermost:
                self._provenance = self._inherited or Provenance()

    def _dispatch(self, func, args, kwargs):
        if func in _DATA_DEPENDENT:
            live = self.live_value(args[0])
            if live is None and self.type_of(args[0]).dtype == torch.bool:
                live = self.decided_value(args[0])
            if live is None and self.type_of(args[0]).dtype == torch.bool:
                live = self.guarded_value(args[0])
            if live is None and self._drawn(args[0]):
                raise ConcretizationError(
                    "a Python branch on a random draw (torch.rand and the like) under "
                    "plait.jit: each call draws anew, so no value exists while tracing. "
                    "Compute both sides and pick with torch.where(draw < p, a, b), or, for "
                    "transformers' LayerDrop, set the config's encoder_layerdrop and "
                    "decoder_layerdrop to 0 (a comparison the range of the draw decides "
                    "traces: NOTE [values decided by ranges]).")
            if live is None:
                raise _concretization(_DATA_DEPENDENT[func])
            with _disable_current_modes():
                return func(live, *args[1:], **kwargs)
        name = func.overloadpacket.__name__
        if name in _DYNAMIC_SHAPE:
            raise UnsupportedOpError(
                f"{func}: its output shape depends on the values of its input, which plait "
                "cannot know while tracing. Use a fixed-size formulation (e.g. torch.where "
                "with a mask) or run this part outside plait.jit.")
        handler = HANDLERS.get(func) or next(
            (h for h in (find(func) for find in HANDLER_FINDERS) if h is not None), None)
        if handler is not None:
            out = handler(*args, **kwargs)
            if out is not NotImplemented:  # a plain rule passing on a call it does not fit
                return out
        if func._schema.is_mutable:
            return self._functionalize(func, args, kwargs)
        decomposition = _decomposition(func)
        if decomposition is not None:
            try:
                out = decomposition(*args, **kwargs)
            except Exception as failure:  # one plait cannot follow: call the op itself
                try:
                    return self.opaque(func, args, kwargs)
                except UnsupportedOpError:
                    raise failure from None
            if out is not NotImplemented:
                return out
        return self.opaque(func, args, kwargs)

    def _functionalize(self, func, args, kwargs):
        """An in-place op issued by a decomposition: compute out of place, then rebind."""
        name = func.overloadpacket.__name__
        functional = getattr(aten, name[:-1], None) if name.endswith("_") else None
        overload = getattr(functional, func._overloadname, None) if functional else None
        if overload is None:
            raise _NeedsFallback(func)
        out = overload(*args, **kwargs)
        if not isinstance(out, TracerTensor) or \
                self.type_of(out).shape != self.type_of(args[0]).shape:
            raise _NeedsFallback(f"{func} changes its operand's metadata")
        return aten.copy_.default(args[0], out)

    def rebind(self, dst: Any, src: Any) -> Any:
        """Make tracer ``dst`` stand for ``src``'s value (the functional form of a write)."""
        if not isinstance(dst, TracerTensor) and self._depth > 1:
            raise _NeedsFallback("a decomposition writes into a tensor it made eagerly")
        if not isinstance(dst, TracerTensor):
            raise captured_write_error()
        if dst._trace is not self and dst._trace in _THREAD.traces:  # NOTE [writes to ...]
            self._capture(dst)
            self._captured_writes[id(dst)] = self.value_of(src)
            return dst
        if dst._aliases is not None and len(dst._aliases) > 1:
            raise _NeedsFallback("write through a view inside a decomposition")
        dst._value = self.value_of(src)
        return dst

    def opaque(self, func, args, kwargs):
        """A node that calls ``func`` at run time; its types come from the meta kernel."""
        if not config.allow_opaque:
            raise UnsupportedOpError(f"{func} has no plait decomposition and opaque ops are "
                                     "disabled (config.allow_opaque=False)")
        flat, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        device = next((self.type_of(t).device for t in tensors), None) or str(
            kwargs.get("device") or "cpu")
        slots = iter(range(len(tensors)))
        template = pytree.tree_unflatten(
            [OperandSlot(next(slots)) if isinstance(x, torch.Tensor) else x for x in flat], spec)
        try:
            types = pytree.tree_map(
                lambda x: self.type_of(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
            # no mode of the trace sees the meta tensors made or the meta call: one tracing
            # random draws (an enclosing trace's) would record it as a draw of its own, and a
            # factory of symbolic sizes as a node, on the meta device. Symbolic sizes (NOTE
            # [dynamic dimensions]) go through fake tensors of the trace's ShapeEnv, whose
            # meta kernels take them (guarding what they compare); ATen's C++ ones do not
            sizes = current_sizes()
            fake = FakeTensorMode(shape_env=sizes.env) if sizes is not None and any(
                is_symbolic(t) for t in pytree.tree_leaves(types)) else contextlib.nullcontext()
            with _disable_current_modes(), fake:
                meta_args, meta_kwargs = pytree.tree_map(
                    lambda x: _meta(x) if isinstance(x, TensorType) else
                    (torch.device("meta") if isinstance(x, torch.device) else x), types)
                if "device" in meta_kwargs:
                    meta_kwargs["device"] = torch.device("meta")
                out = func(*meta_args, **meta_kwargs)
        except Exception as e:
            raise UnsupportedOpError(f"{func}: plait has no decomposition for it and cannot "
                                     f"infer its output from its meta kernel ({e})") from None
        outs = out if isinstance(out, (tuple, list)) else () if out is None else (out,)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise UnsupportedOpError(f"{func} returns non-tensor values; plait cannot trace it")
        out_types = tuple(TensorType(o.shape, o.dtype, device) for o in outs)
        for t in out_types:
            check_dtype(t, str(func))
        targs, tkwargs = template
        frozen = (tuple(_hashable(a) for a in targs),
                  tuple(sorted((k, _hashable(v)) for k, v in tkwargs.items())))
        values = [self.value_of(t) for t in tensors]
        nodes = self.builder.add_node("opaque", values, {"op": func, "template": frozen,
                                                         "out_types": out_types},
                                      out_types, self._provenance)
        self._chain_effect()
        tracers = [TracerTensor(self, v) for v in nodes]
        if out is None:
            return None
        if isinstance(out, torch.Tensor):
            return tracers[0]
        return type(out)(tracers) if isinstance(out, tuple) else tracers


def _decomposition(func) -> Callable | None:
    from torch._decomp import decomposition_table

    if func.namespace == "prims":
        return None
    fn = decomposition_table.get(func)
    if fn is None and torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CompositeImplicitAutograd"):
        fn = func.decompose
    return fn


# NOTE [dynamo import]
# torch's Python references (torch._refs, most of the decomposition table) wrap their type
# promotion in ``torch._disable_dynamo`` (as do the eager kernels of ``torch.ops.prims``, which
# constant folding runs), whose first call imports torch._dynamo to build the
# disabled function: most of a second, once per process, and the bulk of a warm start from
# the disk cache. It caches the disabled function as ``fn.__dynamo_disable``. While dynamo is
# not imported, no dynamo frame can run, so disabling is moot: while plait traces or
# compiles, those layers get ``fn`` itself as their cached function, and lose it again afterwards (a later
# torch.compile builds the real one as usual).
_DISABLE_CODE = torch._disable_dynamo(lambda: None).__code__


@functools.cache
def _dynamo_layers() -> tuple:
    """The functions that torch's references and prims kernels wrap with ``_disable_dynamo``
    (found through the closures of the decompositions, the refs modules' functions and the
    custom ops' kernels)."""
    import torch._refs.fft
    import torch._refs.linalg
    import torch._refs.nn.functional
    import torch._refs.special
    from torch._decomp import decomposition_table
    from torch._library.custom_ops import OPDEFS

    roots = list(decomposition_table.values())
    roots += [f for op in list(OPDEFS.values()) for f in op._backend_fns.values()]
    for module in (torch._refs, torch._refs.fft, torch._refs.linalg, torch._refs.nn.functional,
                   torch._refs.special):
        roots += [f for f in vars(module).values() if callable(f)]
    layers, seen = [], set()
    while roots:
        f = roots.pop()
        if not callable(f) or id(f) in seen:
            continue
        seen.add(id(f))
        if getattr(f, "__code__", None) is _DISABLE_CODE:  # the layer's own ``fn``
            layers.append(f.__closure__[f.__code__.co_freevars.index("fn")].cell_contents)
        roots += [c.cell_contents for c in getattr(f, "__closure__", None) or ()
                  if c.cell_contents is not None]
        roots.append(getattr(f, "__wrapped__", None))
    return tuple(layers)


@contextlib.contextmanager
def _dynamo_bypassed():
    """NOTE [dynamo import]: the layers get ``fn`` as their disabled function (those without
    one of their own), unless dynamo is imported already."""
    bare = [] if "torch._dynamo" in sys.modules else [
        f for f in _dynamo_layers() if not hasattr(f, "__dynamo_disable")]
    for f in bare:
        f.__dynamo_disable = f
    try:
        yield
    finally:
        for f in bare:
            del f.__dynamo_disable


class _WhileAnyThread:
    """Process-wide changes (context managers made by ``contexts``) held while any thread is
    inside: the first entry makes them, the last exit undoes them (NOTE [threads]). Saved and
    restored by each entry instead, two threads' overlapping blocks would restore each
    other's values, and the second to leave would leave the change made for good."""

    def __init__(self, contexts: Callable[[], list]):
        self._contexts, self._lock, self._inside, self._held = contexts, threading.Lock(), 0, None

    @contextlib.contextmanager
    def __call__(self):
        with self._lock:
            if not self._inside:
                with contextlib.ExitStack() as stack:
                    for context in self._contexts():
                        stack.enter_context(context())
                    self._held = stack.pop_all()
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if not self._inside:
                    self._held.close()


_DYNAMO_BYPASS = _WhileAnyThread(lambda: [_dynamo_bypassed])


def no_dynamo_import():
    """Inside, torch's references do not import torch._dynamo (NOTE [dynamo import])."""
    return _DYNAMO_BYPASS()


def _hashable(x):
    if isinstance(x, (torch.SymInt, torch.SymFloat)):  # a size (NOTE [dynamic dimensions])
        return params_dimensions(x)
    if isinstance(x, list):
        return tuple(_hashable(v) for v in x)
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_hashable(v) for v in x)
    try:
        hash(x)
    except TypeError:
        raise UnsupportedOpError(f"an opaque op takes an argument plait cannot key on: {x!r}")
    return x


def _meta(t: TensorType) -> torch.Tensor:
    return torch.empty(reported(t.shape), dtype=t.dtype, device="meta")


def _describe(args, kwargs) -> str:
    def one(x):
        if isinstance(x, TracerTensor):
            return str(x._trace.builder.type_of(x._value))
        if isinstance(x, torch.Tensor):
            return f"tensor {str(TensorType.of(x))}"
        return repr(x)

    parts = [one(a) for a in pytree.tree_leaves(args)]
    parts += [f"{k}={one(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def user_source() -> str | None:
    """``file:line`` of the user's code that the op being traced comes from."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(_SKIP_DIRS) or filename in _SKIP_FILES
                or filename.startswith("<")):
            return f"{os.path.basename(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _wrapped(wrapper: torch.Tensor) -> torch.Tensor:
    torch._sync(wrapper)
    return torch._from_functional_tensor(wrapper)


@contextlib.contextmanager
def state_writes(trace: Trace):
    """Take the writes a nested ``trace`` makes into the module state of the outermost one.

    NOTE [writes to captured tracers]
    A function under a transform may write into a tensor an enclosing trace holds: a module
    buffer, say BatchNorm's running statistics, which the outermost trace (a ``jit``) reads
    as an input and holds in a functionalize wrapper while it runs. The nested trace's ops
    reach the wrapper, whose functionalize kernel makes it hold the nested trace's tracer:
    a value of a graph that is about to end. So when the nested function has run, each such
    wrapper is set back to the tracer it held before, and the write becomes a write of this
    trace into that enclosing tracer (``Trace.rebind``): within the trace the tracer reads the
    new value, and the value becomes an extra output of the graph, which the transform writes
    back into the tracer once it has inlined the graph (``_Traced.write_back``), as it writes
    back the arguments a function mutates. A transform nested in another passes the write
    outwards in turn. Buffers only: a write into a parameter is refused, as torch.func
    refuses it."""
    wrappers = _THREAD.traces[0].state_wrappers if _THREAD.traces else []
    before = [_wrapped(w) for w, _ in wrappers]
    yield
    for (wrapper, parameter), outer in zip(wrappers, before):
        inner = _wrapped(wrapper)
        if inner is not outer and isinstance(inner, TracerTensor) and inner._trace is trace:
            if parameter:
                raise TraceError("a function under a plait transform writes into a module's "
                                 "parameter (a parametrization's original assigned through "
                                 "functional_call, say); transforms write module buffers "
                                 "only. Make the write outside the transformed function.")
            trace.rebind(outer, inner)
            torch._functionalize_replace(wrapper, outer)
            torch._functionalize_commit_update(wrapper)


def unwrap_functional(x: Any) -> Any:
    """The tracer inside a ``torch.func.functionalize`` wrapper (what user code holds inside
    a traced function), with its pending writes applied; anything else as it is."""
    if isinstance(x, torch.Tensor) and torch._is_functional_tensor(x):
        torch._sync(x)
        return torch._C._functorch._unwrap_functional_tensor(x, True)
    return x


def on_tracers(fn: Callable) -> Callable:
    """``fn`` called from user code inside a traced function: its tensor arguments are
    unwrapped to tracers, and its tracer results wrapped back at the caller's functionalize
    level (the way transforms and plait.control_dependency work inside jit)."""
    def run(*args, **kwargs):
        level = torch._C._functorch.maybe_current_level()
        out = fn(*pytree.tree_map(unwrap_functional, args),
                 **pytree.tree_map(unwrap_functional, kwargs))
        if level is None:
            return out
        return pytree.tree_map(lambda x: torch._C._functorch._wrap_functional_tensor(x, level)
                               if isinstance(x, TracerTensor) else x, out)

    return run


class Origin:
    """How eager made a tracer's value: the op, and its arguments with each tensor replaced by
    what eager's layout of it is made from (``_Operand``), so that eager's layout of the
    result can be derived when it is needed (as_strided on it: NOTE [eager layouts]) from
    the meta kernel, which computes eager's strides (torch.compile relies on the same).
    An origin holds no tracer, so it keeps no view alive (a write into a view depends on
    which views are alive)."""

    __slots__ = ("func", "args", "kwargs", "index", "_derived")

    def __init__(self, func, args, kwargs, index):
        self.func, self.args, self.kwargs, self.index = func, args, kwargs, index
        self._derived = _UNDERIVED

    @staticmethod
    def record(func, args, kwargs, out) -> None:
        """Give each new tracer among ``out`` the origin ``func(*args, **kwargs)``."""
        results = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        given = {id(a) for a in pytree.tree_leaves((args, kwargs))}
        fresh = [(k, t) for k, t in enumerate(results) if isinstance(t, TracerTensor)
                 and t._origin is None and t._layout is None and not t._dense
                 and id(t) not in given]
        if fresh:
            operands = pytree.tree_map_only(torch.Tensor, _Operand.of, (args, kwargs))
            for k, t in fresh:
                t._origin = Origin(func, *operands, k)

    def layout(self) -> tuple | None:
        """Eager's (strides, storage offset or None) of the result, or None where unknown:
        derived from the operands' layouts in turn, without recursion (a chain of origins
        runs through the whole model)."""
        stack = [self]
        while stack:
            origin = stack[-1]
            pending = [o.origin for o in pytree.tree_leaves((origin.args, origin.kwargs))
                       if isinstance(o, _Operand) and o.origin is not None
                       and o.origin._derived is _UNDERIVED]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            origin._derived = origin._derive()
        return self._derived

    def _derive(self) -> tuple | None:
        leaves, spec = pytree.tree_flatten((self.args, self.kwargs))
        operands = [o for o in leaves if isinstance(o, _Operand)]
        layouts = [o.layout() for o in operands]
        if any(layout is None for layout in layouts):
            return None
        # a model's repeated blocks ask for the same derivations: each runs its meta
        # kernels once (layer norm's and addmm's are Python, ~1 ms each)
        key = (self.func, self.index, spec, *((o.type, o.layout()) if isinstance(o, _Operand)
                                              else o for o in leaves))
        try:
            return _DERIVATIONS[key]
        except TypeError:  # an unhashable argument: derived every time
            return self._derived_anew(operands, layouts)
        except KeyError:
            if len(_DERIVATIONS) >= _DERIVATIONS_KEPT:
                _DERIVATIONS.clear()
            derived = _DERIVATIONS[key] = self._derived_anew(operands, layouts)
            return derived

    def _derived_anew(self, operands: list, layouts: list) -> tuple | None:
        """Eager's layout of the result, from the meta kernel on the operands' layouts."""
        try:
            with _disable_current_modes(), torch.no_grad():
                # a convolution's layout depends on the device's kernel, which meta tensors
                # do not name: it runs on fake tensors of the operands' devices
                fake = FakeTensorMode() if self.func in _CHOSEN_BY_DEVICE else None
                metas = {id(o): _meta_with(o.type, layout, fake)
                         for o, layout in zip(operands, layouts)}
                args, kwargs = pytree.tree_map_only(_Operand, lambda o: metas[id(o)],
                                                    (self.args, self.kwargs))
                if fake is None and kwargs.get("device") is not None:  # (x.to(device=...)):
                    kwargs["device"] = "meta"  # a copy's layout is the same on every device
                with fake or contextlib.nullcontext():
                    out = self.func(*args, **kwargs)
        except Exception:  # noqa: BLE001 - no meta kernel: the layout stays unknown
            if self.func not in _RESHAPES:
                return None
            # a tracer reports a contiguous layout, so the user's reshape became a view
            # where eager's copies (into a contiguous result)
            return contiguous_strides(self.args[1]), 0

        result = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)][self.index]
        known_offsets = all(layout[1] is not None for layout in layouts)
        return tuple(result.stride()), result.storage_offset() if known_offsets else None


_VIEW = torch.ops.aten.view.default
# as_strided reports the strides it is given (plait's handler checks they are eager's);
# a dtype view's strides are the base's, scaled
_NOT_REREPORTED = (torch.ops.aten.as_strided.default, torch.ops.aten.view.dtype)


def _viewable(shape, strides, size) -> bool:
    """Can ``view(size)`` be made of a tensor of ``shape`` laid out with ``strides`` (torch's
    rule: each run of dims merged into new ones must be contiguous within itself)?"""
    numel = math.prod(shape)
    size = list(size)
    if -1 in size:
        rest = math.prod(n for n in size if n != -1)
        size[size.index(-1)] = numel // rest if rest else 0
    if numel == 0 or not shape:
        return True
    d, base, old_numel, new_numel = len(size) - 1, strides[-1], 1, 1
    for k in range(len(shape) - 1, -1, -1):
        old_numel *= shape[k]
        if k == 0 or (shape[k - 1] != 1 and strides[k - 1] != old_numel * base):
            while d >= 0 and (new_numel < old_numel or size[d] == 1):
                new_numel *= size[d]
                d -= 1
            if new_numel != old_numel:
                return False
            if k > 0:
                base, old_numel, new_numel = strides[k - 1], 1, 1
    return d == -1


def _eager_layout_of(t: TracerTensor) -> tuple | None:
    """Eager's (strides, storage offset or None) of tracer ``t`` where known without
    deriving it (known, or derived already for an earlier as_strided); else None."""
    if (known := t.known_layout()) is not None:
        return known
    derived = t._origin._derived if t._origin is not None else None
    return None if derived is _UNDERIVED else derived


_UNDERIVED = object()
_DERIVATIONS: dict = {}  # Origin._derive's memo: (op, operands' types and layouts, ...) ->
_DERIVATIONS_KEPT = 4096  # layout; cleared whole when full
_RESHAPES = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
_CHOSEN_BY_DEVICE = (torch.ops.aten.convolution.default,)


class _Operand:
    """A tensor operand of an ``Origin``: its type, and its eager layout or its origin."""

    __slots__ = ("type", "known", "origin")

    def __init__(self, type, known, origin):
        self.type, self.known, self.origin = type, known, origin

    @staticmethod
    def of(t: torch.Tensor) -> "_Operand":
        if not isinstance(t, TracerTensor):  # a real tensor (a constant): its own layout
            return _Operand(TensorType(t.shape, t.dtype, str(t.device)),
                            (tuple(t.stride()), t.storage_offset()), None)
        known = t.known_layout()
        return _Operand(t._trace.builder.type_of(t._value), known, None if known else t._origin)

    def layout(self) -> tuple | None:
        return self.known if self.origin is None else self.origin._derived


def _meta_with(type: TensorType, layout: tuple, fake: FakeTensorMode | None = None):
    """A meta tensor of ``type`` laid out as ``layout`` (strides, storage offset), or with
    ``fake``, a fake tensor of that mode on ``type``'s device."""
    strides, offset = layout
    size = 1 + (offset or 0) + sum((n - 1) * abs(st) for n, st in zip(type.shape, strides))
    meta = torch.empty(size, dtype=type.dtype, device="meta").as_strided(
        type.shape, strides, offset or 0)
    return meta if fake is None else FakeTensor(fake, meta, torch.device(type.device))


def is_dense(tensor: torch.Tensor) -> bool:
    return (tensor.layout == torch.strided and tensor.is_contiguous()
            and tensor.storage_offset() == 0)


_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2}


def check_dtype(x: torch.Tensor | TensorType, where: str) -> None:
    """Sparse and quantized tensors are outside plait's primitive set."""
    layout = getattr(x, "layout", torch.strided)
    if x.dtype in _QUANTIZED or layout != torch.strided:
        what = f"dtype {x.dtype}" if layout == torch.strided else f"layout {layout}"
        raise UnsupportedDtypeError(f"{where}: plait does not support {what} (sparse and "
                                    "quantized tensors); run this part outside plait.jit")


# NOTE [torch-function handlers]
# Some torch functions must be caught above the dispatcher, at the torch-function layer:
#  * factories with no tensor operand never reach TracerTensor's dispatch: they would run
#    once, at trace time, and be baked in as constants. For random ones that is a wrong
#    answer (eager draws anew on every call), so they are routed into the graph as opaque
#    (effectful) nodes;
#  * composite ops whose C++ body writes into a fresh eager tensor (circular padding).
# A handler returns NotImplemented to let the call run as usual. Its tensor arguments may
# be functionalization wrappers, not tracers: it may only call torch functions on them.
FUNCTION_HANDLERS: dict[Callable, Callable] = {}
_RANDOM_FACTORIES = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal}


def _random_factory(func):
    def handler(*args, **kwargs):
        if any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves((args, kwargs))):
            return NotImplemented
        with _SeededOpsIntoTrace():
            return func(*args, **kwargs)

    return handler


FUNCTION_HANDLERS.update({f: _random_factory(f) for f in _RANDOM_FACTORIES})


def _data_escape(method: str):
    """A method that hands a tensor's data to Python (NumPy, a list, an address): on a traced
    value, whose data is only known at call time, it would bake the trace-time data into the
    compilation; refused instead. On live state it pins the tensor (NOTE [live state])."""
    def handler(x, *args, **kwargs):
        root = _THREAD.traces[0] if _THREAD.traces else None
        if root is not None and id(x) in root.live:  # read now, so pinned (NOTE [live state])
            root.pinned[id(x)] = x
        if not (isinstance(x, TracerTensor) or torch._is_functional_tensor(x)):
            return NotImplemented
        if method == "tolist":  # mostly to make a Python choice
            raise _concretization(".tolist()")
        raise ConcretizationError(
            f".{method}() needs the data of a traced tensor, but under plait.jit a tensor's "
            f"data is only known when the compiled function runs (what .{method}() returned "
            "while tracing would be baked in as a constant). Compute with torch operations "
            "instead, or run this part outside plait.jit.")

    return handler


FUNCTION_HANDLERS.update({getattr(torch.Tensor, m): _data_escape(m)
                          for m in ("numpy", "tolist", "data_ptr", "__array__")})


def _refused(message: str) -> Callable:
    """A handler refusing a torch function called on a traced tensor (elsewhere it runs)."""
    def handler(tensor, *args, **kwargs):
        if not (isinstance(tensor, TracerTensor) or torch._is_functional_tensor(tensor)):
            return NotImplemented
        raise UnsupportedOpError(message)

    return handler


FUNCTION_HANDLERS.update({
    # forward-mode AD's dual tensors: tracers carry no tangent, so it would be lost (and
    # torch.autograd.functional.jacobian in forward mode would return zeros)
    torch._make_dual: _refused(
        "torch.autograd.forward_ad (dual tensors, and torch.autograd.functional's jacobian "
        "or jvp in forward mode) inside plait.jit or a plait transform is not supported; "
        "use plait.jvp or plait.jacfwd."),
    torch.Tensor.retain_grad: _refused(
        "Tensor.retain_grad() inside plait.jit or a plait transform: a traced tensor has no "
        ".grad to fill (torch.func does not support it either). Return the intermediate and "
        "differentiate with respect to it, or take the gradient outside the traced function."),
})


# NOTE [nested torch functions]
# While a mode handles a torch function, the mode is off: the torch functions it calls
# (``F.multi_head_attention_forward``'s ``F.linear`` and ``F.dropout``) reach ATen's C++
# composites without FUNCTION_HANDLERS seeing them. With symbolic sizes some of those
# composites ask for a size's value (a 3-d ``linear``, ``dropout``), so in a dynamic trace a
# function of ``torch.nn.functional`` runs with the mode on, as a copy whose
# ``has_torch_function*`` checks say no (it would route itself back to the mode forever).
_FUNCTIONAL = "torch.nn.functional"
@functools.lru_cache(maxsize=None)
def _checking_no_overrides(func):
    never = {name: (lambda *args, **kwargs: False) for name in (
        "has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")}
    copy = types.FunctionType(func.__code__, {**func.__globals__, **never}, func.__name__,
                              func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return copy


class _FunctionCapture(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        handler = FUNCTION_HANDLERS.get(func)
        out = handler(*args, **(kwargs or {})) if handler is not None else NotImplemented
        if out is not NotImplemented:
            return out
        if current_sizes() is None:
            return func(*args, **(kwargs or {}))
        try:
            if getattr(func, "__module__", None) == _FUNCTIONAL:
                with self:  # NOTE [nested torch functions]
                    return _checking_no_overrides(func)(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))
        except Specialized as e:  # named by the innermost torch function, for the report
            if not getattr(e, "named", False):
                e.args, e.named = (f"{getattr(func, '__qualname__', func)}: {e}",), True
            raise


class _Mode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # No ``_disable_dynamo`` layer around __torch_dispatch__, whose first call would
        # import torch._dynamo (NOTE [dynamo import]); plait's modes never run under dynamo.
        return False


class _SeededOpsIntoTrace(_Mode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            return current_trace().opaque(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


class _TraceMode(_Mode):
    """NOTE [tracing through a mode]: torch's C++ dispatch to a tensor subclass first asks
    whether an argument is a DTensor, and that check imports torch.distributed.tensor: about
    80 ms once per process, the bulk of a warm start from the disk cache. A dispatch mode is
    asked before any subclass and skips the check, so while tracing, ops on tracers reach
    the trace through this mode (``TracerTensor.__torch_dispatch__`` remains for a tracer
    used outside its trace, which raises). The decompositions an op runs come back here."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, TracerTensor) for t in types) or _reads_live(args, kwargs) or \
                current_sizes() is not None and _sized_by_symbols(args, kwargs):
            with self:
                return current_trace(func).dispatch(func, args, kwargs or {})
        if torch.Tag.nondeterministic_seeded in func.tags:  # a random factory that a
            if func._schema.is_mutable:  # decomposition calls; not a draw into a tensor
                raise _lost_draw(func)  # that a C++ composite made, which is never traced
            out = current_trace(func).opaque(func, args, kwargs or {})
            # eager lays the draw out as its operand (dropout's bernoulli of empty_like(x))
            if current_sizes() is None:
                Origin.record(func, *pytree.tree_map_only(torch.Tensor, unwrap_functional,
                                                          (args, kwargs or {})), out)
            return out
        return func(*args, **(kwargs or {}))


def _sized_by_symbols(args, kwargs) -> bool:
    """Does an op take a symbolic size (a factory: ``torch.arange(x.shape[1])``)? It is
    traced then, not run (NOTE [dynamic dimensions])."""
    return any(isinstance(a, (torch.SymInt, torch.SymFloat)) and a.node.maybe_as_int() is None
               for a in pytree.tree_leaves((args, kwargs)))


def _lost_draw(func) -> UnsupportedOpError:
    return UnsupportedOpError(
        f"{func}: an op's C++ code draws random numbers into a tensor it made itself, out of "
        "plait's sight (functionalization does not reach inside it), so the compiled "
        "function would lose the draw. Run that op outside plait.jit, and please report it.")


def _reads_live(args, kwargs) -> bool:
    """Does an op on real tensors read live state (NOTE [live state])? Then it is
    traced, not run once and baked."""
    live = _THREAD.traces[0].live if _THREAD.traces else None
    return bool(live) and any(isinstance(x, torch.Tensor) and id(x) in live
                              for x in pytree.tree_leaves((args, kwargs)))


# NOTE [grad mode while tracing]
# A traced function starts with grad mode on, whatever the caller's (a transform's result is
# computed under torch.no_grad(), and torch.func's grad differentiates inside an outer
# no_grad too). An ATen op the function calls while grad mode is off (torch.no_grad(),
# torch.set_grad_enabled(False), torch.inference_mode()) has its results pass through
# ``no_grad``: reverse-mode derivatives stop there, as torch.func's do, and forward-mode ones
# (jvp) pass, as torch.func's do; with forward-mode AD off (torch.autograd.forward_ad's
# _set_fwd_grad_enabled(False)) they pass through ``no_fwd_grad``, which stops tangents and
# passes cotangents. The outermost trace marks them too: jit's path under torch.autograd
# differentiates its graph. Simplification erases the markers (every derivative is taken
# by then), so attention under torch.no_grad() in a jitted function still fuses.
# Context managers every trace runs under, registered by the modules that need them
# (tracer/custom.py: torch.autograd.Function).
TRACING_CONTEXTS: list[Callable] = []


# NOTE [threads]
# Traces are per thread: each thread has its own stack of traces in progress (``_THREAD``),
# as torch keeps its dispatch and function modes, grad modes and functorch levels per thread,
# so a jitted function called from several threads traces in each at once, and a thread
# calling a compiled program while another traces runs it. What a trace changes for the
# whole process (torch's mkldnn switch and is-compiling flag, ``Function.apply`` and torch's
# control-flow functions replaced by plait's, the dynamo bypass) is held while any thread
# traces (``_WhileAnyThread``): meanwhile other threads' eager code sees those changes too
# (plait's replacements run eagerly outside a trace; mkldnn off is slower, not different in
# meaning). A traced module's parameters and buffers are its tracers while its trace runs
# (NOTE [live state]), so jit's traces and the reads of a module's state for a call hold
# ``STATE_LOCK`` (tracer/state.py); an eager call of that module in another thread at that
# moment would see the tracers, as it would under ``torch.func.functional_call``.
# Compilation is per key (``api.Jitted``): one thread compiles a signature while others
# asking for it wait, and different signatures compile in parallel.
_PROCESS_WIDE = _WhileAnyThread(lambda: [_mkldnn_disabled, _compiling_announced,
                                         *TRACING_CONTEXTS])


@contextlib.contextmanager
def tracing(trace: Trace):
    _THREAD.traces.append(trace)
    try:
        # without mkldnn, torch's decompositions take their plain paths (an LSTM's layers
        # as matrix products, not one mkldnn_rnn_layer whose workspace only a run sizes)
        with _FunctionCapture(), no_dynamo_import(), _TraceMode(), torch.enable_grad(), \
                _set_fwd_grad_enabled(True), _PROCESS_WIDE():
            yield trace
    finally:
        _THREAD.traces.pop()


@contextlib.contextmanager
def _setting(get: Callable[[], Any], set_: Callable[[Any], None], value: Any):
    """A global setting of torch's set to ``value`` while the block runs."""
    previous = get()
    set_(value)
    try:
        yield
    finally:
        set_(previous)


def _compiling_announced():
    """``torch.compiler.is_compiling()`` is True while plait traces, as under torch.compile:
    libraries ask it to keep data-dependent shortcuts out of code being compiled (transformers
    reads a padding mask to skip it when it masks nothing, unless compiling), and a traced
    value cannot be read."""
    return _setting(lambda: torch.compiler._is_compiling_flag,
                    lambda on: setattr(torch.compiler, "_is_compiling_flag", on), True)


def _mkldnn_disabled():
    return _setting(torch._C._get_mkldnn_enabled, torch._C._set_mkldnn_enabled, False)


def bind(prim_name: str, *operands, **params):
    """Bind a primitive in the current trace (the handlers' way to emit nodes)."""
    return current_trace().bind(prim_name, *operands, **params)
