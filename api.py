"""The public entry points: jit, make_graph, and the Lowered view of one compilation.

They only wire stages together: trace (tracer/), then the driver (compiler/pipeline.py) for
the rest.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import itertools
import logging
import operator
import threading
import time
import types
from typing import Callable, Sequence

import torch
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from . import debug
from .backends import get_backend, program_cache, resolve_backend
from .backends.eager import compile_graph as eager_program
from .config import config
from .distributed import ddp_call
from .errors import DistributedError, TraceError
from .graph import Graph, TensorType
from .compiler import pipeline
from .compiler.stages import Stages, collector_paused
from .passes import autodiff, memory
from .tracer import Static, TracedFunction, trace_function
from .tracer.sizes import reopened
from .tracer.state import (STATE_LOCK, fully_sharded, hook_module, hooks_outside,
                           tensor_key)
from .tracer.strided import passed
from .tracer.trace import foreign_mode_active, no_dynamo_import, tracing_active

_cache_log = logging.getLogger("plait.cache")


def _positions(fn: Callable, argnums: Sequence[int] | int, what: str) -> tuple[int, ...]:
    """``argnums`` as a tuple of positions, each checked to be an int that names one of
    ``fn``'s positional parameters where its signature says how many it takes (as JAX
    checks them: a position past the last would be silently ignored)."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in nums):
        raise TraceError(f"{what} must be an int or a sequence of ints, got {argnums!r}")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: checked by its calls
        return nums
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return nums
    n = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    beyond = [i for i in nums if not -n <= i < n]
    if beyond:
        raise TraceError(f"{what}={nums} names positions {beyond}, but "
                         f"{debug.function_name(fn)} takes {n} positional arguments; name "
                         "positions of its parameters (keyword arguments are static when "
                         "they are not tensors)")
    return nums


def _picked(argnums: Sequence[int], n: int) -> set[int]:
    """The positions of ``n`` positional arguments that ``argnums`` names (negative ones count
    from the end)."""
    return {i % n for i in argnums if -n <= i < n}


@functools.cache
def _tensors_tree(n: int) -> pytree.TreeSpec:
    """The tree of a call with ``n`` positional tensors and nothing else."""
    return pytree.tree_flatten(((None,) * n, {}), is_leaf=lambda x: x is None)[1]


def _flatten(args: tuple, kwargs: dict, static_argnums: Sequence[int], floats: bool):
    """Split a call into its leaves and a hashable signature (the cache key). With
    ``floats``, a Python float leaf is traced: it becomes a 0-d tensor of the default dtype,
    or float64 where every floating-point tensor argument is float64. A 0-d tensor promotes
    as eager promotes a Python float (a bf16 tensor stays bf16, an int one becomes the
    default dtype)."""
    if not kwargs and not static_argnums and all(isinstance(a, torch.Tensor) for a in args):
        # the common call, keyed without flattening (and hashing) a pytree: most of a
        # cached call's host time otherwise
        return list(args), _tensors_tree(len(args)), tuple(map(tensor_key, args))
    static = _picked(static_argnums, len(args))
    args = tuple(Static(a) if i in static else a for i, a in enumerate(args))
    leaves, tree = pytree.tree_flatten((args, kwargs))
    signature = [tree]
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    device = tensors[0].device if tensors else None
    # float64 where every floating tensor is: a double's digits are not rounded away
    real = {x.dtype for x in tensors if x.dtype.is_floating_point}
    dtype = torch.float64 if real == {torch.float64} else torch.get_default_dtype()
    for i, x in enumerate(leaves):
        if floats and type(x) is float:
            leaves[i] = x = torch.tensor(x, dtype=dtype, device=device)
        if isinstance(x, torch.Tensor):
            signature.append(tensor_key(x))
            continue
        if not isinstance(x, Static):
            leaves[i] = x = Static(x)
        key = x.value
        if isinstance(key, slice):  # unhashable before Python 3.12
            key = (key.start, key.stop, key.step)
        try:
            hash(key)
        except TypeError:
            raise TraceError(
                f"argument leaf {x.value!r} of type {type(x.value).__name__} is neither a "
                "tensor nor hashable; plait keys compilations on non-tensor arguments. Pass "
                "it as a tensor, or make it hashable (e.g. a tuple).") from None
        signature.append((type(x.value), key))
    return leaves, tree, tuple(signature)


def _sized(signature: tuple, dynamic: dict) -> tuple:
    """``signature`` with the dynamic dimensions of its dense tensors' shapes left out (NOTE
    [automatic dynamic]); sizes 0 and 1 stay, and a tensor that is not dense (``tensor_key``:
    strides, a view) keeps its sizes: they trace static (NOTE [dynamic dimensions])."""
    out, j = [], 0
    for e in signature:
        if isinstance(e, tuple) and e and isinstance(e[0], torch.Size):
            dims = dynamic.get(j, ()) if e[4] is True else ()
            if dims:
                e = (tuple(None if d in dims and n >= 2 else n
                           for d, n in enumerate(e[0])), *e[1:])
            j += 1
        out.append(e)
    return tuple(out)


def _erased(signature: tuple) -> set:
    """The (tensor, dim) whose sizes ``_sized`` left out of ``signature``."""
    tensors = [e for e in signature if isinstance(e, tuple) and e and isinstance(e[0], tuple)
               and len(e) == 6]
    return {(j, d) for j, e in enumerate(tensors) for d, n in enumerate(e[0]) if n is None}


class _once:
    """``functools.cached_property`` whose computation holds its object's lock (``_lock``, an
    RLock: one such property may ask for another). Threads asking at once wait for the one
    computing, and other objects compute meanwhile: Python 3.11's cached_property holds one
    lock for every object of the class, so one compilation would wait for another's."""

    def __init__(self, fn: Callable):
        functools.update_wrapper(self, fn)
        self._fn, self._name = fn, fn.__name__

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        with obj._lock:
            if self._name not in obj.__dict__:  # set: found there first from then on
                with reopened(obj.sizes):  # NOTE [dynamic dimensions]
                    obj.__dict__[self._name] = self._fn(obj)
        return obj.__dict__[self._name]


class Lowered:
    """One compilation of a jitted function for one signature, for inspection. Its stages run
    when first needed, under the settings it was created with; a call needs only ``runner``,
    which the program cache may give without simplifying or compiling anything."""

    def __init__(self, traced: TracedFunction, backend: str, donated: frozenset = frozenset(),
                 stages: Stages | None = None, simplified: bool = False, settings=None):
        self.traced = traced
        self._simplify = not simplified
        self.backend = backend
        self.donated = donated
        self._stages = stages or Stages()
        # a mutated input is written back after the call: its memory may hold its new value,
        # no other result
        mutated = traced.mutated_inputs
        self.source_graph = traced.graph.donating(sorted(donated - set(mutated))).updating(
            mutated, len(traced.graph.outputs) - len(mutated))
        self._settings = settings or pipeline.snapshot(get_backend(backend))
        self._keeps_program = config.program_cache
        self._lock = threading.RLock()

    @property
    def sizes(self):
        """The size symbols of a dynamic compilation (NOTE [dynamic dimensions]), or None."""
        return self.traced.sizes

    @property
    def traced_graph(self) -> Graph:
        """The graph as traced, before any pass."""
        return self.traced.graph

    @_once
    def _simplified(self) -> tuple[Graph, tuple]:
        passes: list = []

        def on_pass(name: str, graph: Graph) -> None:
            passes.append((name, graph))

        with no_dynamo_import(), collector_paused():
            graph = pipeline.simplified(self.source_graph, self._settings, self._stages,
                                        on_pass) if self._simplify else self.source_graph
        return graph, tuple(passes)

    @property
    def graph(self) -> Graph:
        """The graph the backend compiles: the traced one (donations marked), simplified."""
        return self._simplified[0]

    @property
    def passes(self) -> tuple[tuple[str, Graph], ...]:
        """(pass name, graph after it), in the order they ran."""
        return self._simplified[1]

    def as_text(self) -> str:
        return self.graph.as_text()

    def draw(self, path, stage: str = "simplified", engine: str = "auto"):
        """Draw one stage as SVG: ``traced``, a pass name (``debug.stages``), ``simplified``."""
        return debug.stage(self, stage).draw(path, engine)

    @_once
    def scheduled(self) -> tuple | None:
        """For a backend that generates code, the loop program and its memory plan made for
        it (the stages up to ``plan``; no code is generated); None for one that interprets
        the graph."""
        backend = get_backend(self.backend)
        if backend.target is None:
            return None
        graph = self.graph
        with no_dynamo_import():
            return pipeline.scheduled(graph, backend, self._settings, self._stages)

    @_once
    def compiled(self):
        """The backend's callable for this graph (compiled on first use)."""
        schedule = self.scheduled
        with no_dynamo_import():
            return pipeline.compiled(self.graph, get_backend(self.backend), self._settings,
                                     self._stages, schedule)

    @property
    def stages(self) -> dict:
        """Stage name -> what it made, in the order they ran (NOTE [pipeline]): the traced
        graph, the graph after each simplify pass, and for a backend that generates code
        the loop program after lowering, fusion and each memory pass, then the memory plan.
        Each prints with ``.as_text()``. Runs the stages not run yet, generating no code."""
        self.scheduled
        return dict(self._stages.irs)

    @property
    def timings(self) -> dict:
        """Stage name -> seconds, in the order they ran: ``stages``' and, for a compiling
        backend, ``codegen`` (writing the kernels), ``native`` (compiling and loading them)
        and ``wrapper`` (the steps that call them)."""
        self.compiled
        return dict(self._stages.seconds)

    @_once
    def runner(self):
        """What a call runs: the program an earlier process compiled and kept on disk (NOTE
        [program cache]), or else ``compiled``'s runner (kept for the next process where it
        pickles), or ``compiled`` itself for a backend whose programs are not kept."""
        backend = get_backend(self.backend)
        if not (self._keeps_program and backend.keeps_programs):
            return self.compiled
        key = program_cache.key(self.source_graph, backend, pipeline.settings_key(
            self._settings))
        runner = program_cache.load(key)
        if runner is not None:
            _cache_log.debug("program cache hit: %s", key)
            return runner
        runner = getattr(self.compiled, "runner", None)
        program_cache.store(key, runner)
        return self.compiled if runner is None else runner

    @property
    def kernels(self) -> tuple:
        """The generated kernels (``.name``, ``.source``, ``.reads``, ``.writes``); none for
        a backend that interprets the graph."""
        return tuple(getattr(self.compiled, "kernels", ()))

    @property
    def source(self) -> str:
        """The generated code (kernels and wrapper), or the graph's text for a backend that
        generates none."""
        return getattr(self.compiled, "source", None) or self.as_text()

    @property
    def stats(self) -> dict[str, int]:
        """kernels, externs, bytes_read, bytes_written (the compiler's estimate of memory
        traffic) and peak_bytes, for a backend that lowers to loops; empty otherwise."""
        program = getattr(self.compiled, "program", None)
        return memory.program_stats(program) if program is not None else {}

    @property
    def memory(self) -> dict:
        """The memory plan, for a backend that lowers to loops (empty otherwise): each buffer's
        bytes, lifetime and storage, the in-place pairs, the pool slots and the estimated peak
        (``stats["peak_bytes"]``); see NOTE [memory passes]."""
        plan = getattr(self.compiled, "plan", None)
        return memory.report(self.compiled.program, plan) if plan is not None else {}

    def __repr__(self) -> str:
        return f"<plait.Lowered backend={self.backend!r}\n{self.as_text()}>"


class _DynamicFailed(Exception):
    """A dynamic compilation's training programs failed to compile (NOTE [automatic
    dynamic]): the call compiles static instead."""


class _Compiled:
    """A compiled signature: run the graph, then rebuild the outputs and write back inputs."""

    def __init__(self, lowered: Lowered):
        self.lowered = lowered
        traced = lowered.traced
        self._run = lowered.runner
        self._out_tree, self._out_leaves = traced.out_tree, traced.out_leaves
        self._mutated = traced.mutated_inputs
        self._donated = donated = lowered.donated
        # the arguments the compiled code writes, and why (checked for aliasing per call)
        self._written = {i: "is donated (donate_argnums)" for i in donated} | {
            i: "is mutated by the function" for i in self._mutated}
        self._programs: dict[tuple[int, ...], _Differentiable] = {}
        self._lock = threading.Lock()  # one thread makes a set of inputs' programs
        # the inputs each result depends on through floating-point values: those
        # torch.autograd may want gradients of (one no result reaches gets none, as in eager)
        graph = traced.graph
        self._reaches = autodiff.reaching(graph)[:len(graph.outputs) - len(self._mutated)]
        reached = functools.reduce(operator.or_, self._reaches, 0)
        self._read = [bool(reached >> i & 1) for i in range(len(graph.inputs))]
        # NOTE [value guards]: (program, its input count, the bool it must compute again);
        # the compilations of one signature that took other branches, this one among them
        self.guards = [(eager_program(g), len(g.inputs), value) for g, value in traced.guards]
        self.sizes = traced.sizes  # NOTE [dynamic dimensions]
        self.variants = [self]

    def holds(self, tensors: list[torch.Tensor]) -> bool:
        """Does every branch this compilation took go the same way for ``tensors``, and do
        its guards on sizes hold?"""
        if self.sizes is not None and self.sizes.values(tensors) is None:
            return False
        with torch.no_grad():
            return all(bool(run(tensors[:n])[0]) == value for run, n, value in self.guards)

    def variant(self, tensors: list[torch.Tensor]) -> "_Compiled | None":
        """The compilation of this signature whose branches ``tensors`` take, if any."""
        return next((c for c in self.variants if c.holds(tensors)), None)

    def _differentiable(self, wrt) -> "_Differentiable":
        try:
            return _Differentiable(self.lowered, wrt, self._reaches)
        except Exception as e:
            if self.sizes is None:
                raise
            raise _DynamicFailed(e) from e

    def __call__(self, tensors: list[torch.Tensor], interpreted: bool = False):
        """``interpreted``: the program runs torch's ops (the eager backend) under a mode or
        transform that records them, torch.autograd's own recording included."""
        if self._written and not interpreted:
            _check_not_aliased(tensors, self._written)
        wrt = tuple(itertools.compress(itertools.count(), map(
            operator.and_, map(_requires_grad, tensors), self._read))) \
            if torch.is_grad_enabled() and not interpreted else ()
        if wrt:
            program = self._programs.get(wrt)
            if program is None:
                with self._lock:
                    program = self._programs.get(wrt) or self._differentiable(wrt)
                    self._programs[wrt] = program
            results = _Node.apply(program, len(tensors), *tensors)
        else:
            kept = [t for i, t in enumerate(tensors) if i not in self._donated] \
                if self._donated else tensors
            results = _written_back(self._run(tensors), tensors, self._mutated, kept)
        leaves = [results[x] if isinstance(x, int) else x.leaf(results)
                  for x in self._out_leaves]
        return pytree.tree_unflatten(leaves, self._out_tree)




# NOTE [jit under torch.autograd]
# Called with grad mode on and a tensor that requires grad among its inputs (an argument, or
# captured state such as a module's parameters), a jitted function is recorded by
# torch.autograd as one node, ``_Node``: its forward runs a compiled program that also returns
# the residuals its backward needs, its backward a second compiled program, both cut from one
# differentiated graph (NOTE [forward and backward programs]) and made once per compilation
# and set of differentiated inputs. As in eager, an input gets no gradient (None, not zeros)
# unless a result that received a gradient depends on it through floating-point values
# (``autodiff.reaching``): a pooler a masked-LM loss never reads, a branch taken only for
# an output the loss ignores. The backward program is not itself recorded: a second
# derivative needs plait's own transforms.
class _Differentiable:
    """The forward and backward programs of one compilation, for the inputs ``wrt``;
    ``reaches``: the bit set of the inputs each result depends on."""

    def __init__(self, lowered: Lowered, wrt: tuple[int, ...], reaches: list[int]):
        traced, self.wrt, self.reaches = lowered.traced, wrt, reaches
        self.sizes = lowered.sizes
        graph = traced.graph
        self.n_outputs = len(graph.outputs)
        self.n_results = self.n_outputs - len(traced.mutated_inputs)
        self.mutated = traced.mutated_inputs
        self.output_types = graph.output_types
        self.seeded = [k for k in range(self.n_results)
                       if autodiff.differentiable(graph.output_types[k])]
        name = lowered._stages.name
        stages = Stages(f"{name} (forward)")
        with no_dynamo_import(), reopened(self.sizes):
            # a primal the call does not write is read by the backward where it is (a
            # weight): returned by the forward, a CUDA graph would copy it out every call
            forward, backward, self.read = pipeline.training(
                graph, wrt, self.seeded, frozenset(range(len(graph.inputs))) - set(self.mutated),
                lowered._settings, stages)
        backward_stages = Stages(f"{name} (backward)")
        backward_stages.record("backward", backward, 0.0)
        self._forward = Lowered(_program(forward.updating(self.mutated, self.n_results),
                                         self.sizes),
                                lowered.backend, stages=stages, simplified=True,
                                settings=lowered._settings)
        self._backward = Lowered(_program(backward, self.sizes), lowered.backend,
                                 stages=backward_stages,
                                 simplified=True, settings=lowered._settings)
        self._lock = threading.RLock()  # for _backward_runner
        if self.sizes is not None:  # compiled now: where size symbols fail, the call
            self._forward.runner       # compiles static instead (Jitted.__call__)
            self._backward_runner

    def forward(self, tensors: list[torch.Tensor]) -> tuple[list, list]:
        outs = self._forward.runner(tensors)
        results = _written_back(outs[:self.n_outputs], tensors, self.mutated, tensors)
        return results, [tensors[i] for i in self.read] + outs[self.n_outputs:]

    def backward(self, residuals, cotangents, shapes=None) -> list:
        """Each input's gradient, None where no result with a cotangent (torch gives None
        for a result no gradient reached) depends on it; ``shapes``: the results' shapes,
        where their types are symbolic."""
        seeds = [_zeros(self.output_types[k], shapes and shapes[k]) if cotangents[k] is None
                 else cotangents[k].contiguous() for k in self.seeded]
        reached = functools.reduce(operator.or_, (
            self.reaches[k] for k in self.seeded if cotangents[k] is not None), 0)
        grads = self._backward_runner(list(residuals) + seeds)
        return [g if reached >> i & 1 else None for i, g in zip(self.wrt, grads)]

    @_once
    def _backward_runner(self):
        runner = self._backward.runner
        # its CUDA graphs share the forward's memory (NOTE [CUDA graphs])
        if (pair := getattr(runner, "replays_after", None)) is not None:
            pair(self._forward.runner)
        return runner


def _zeros(t, shape=None) -> torch.Tensor:
    return torch.zeros(shape or t.shape, dtype=t.dtype, device=t.device)


def _program(graph: Graph, sizes=None) -> TracedFunction:
    return TracedFunction(graph, pytree.tree_structure(()), (), (), sizes=sizes)


class _Node(torch.autograd.Function):
    """NOTE [jit under torch.autograd]."""

    @staticmethod
    def forward(ctx, program: _Differentiable, n_inputs: int, *tensors):
        results, residuals = program.forward(list(tensors))
        ctx.program, ctx.n_inputs = program, n_inputs
        # the results' sizes, where their types are symbolic (a missing cotangent's zeros)
        ctx.shapes = [r.shape for r in results] if program.sizes is not None else None
        ctx.set_materialize_grads(False)  # a result no gradient reached: None (reaching)
        ctx.save_for_backward(*residuals)
        ctx.mark_non_differentiable(*[r for r in results
                                      if not (r.dtype.is_floating_point or r.dtype.is_complex)])
        return tuple(results)

    @staticmethod
    def backward(ctx, *cotangents):
        if tracing_active():
            raise TraceError(
                "the backward of a plait.jit call made outside a traced function (or a "
                "vjp_fn of plait.vjp called on real tensors) was run inside one, or "
                "differentiated; call plait.vjp inside the traced function instead.")
        if torch.is_grad_enabled():
            raise TraceError(
                "a second derivative through a plait.jit function (create_graph=True, or "
                "differentiating its gradient) is not supported by torch.autograd; take "
                "higher derivatives with plait's transforms, e.g. plait.grad(plait.grad(f)).")
        program = ctx.program
        grads = [None] * ctx.n_inputs
        for i, g in zip(program.wrt, program.backward(ctx.saved_tensors, cotangents,
                                                      ctx.shapes)):
            grads[i] = g
        return (None, None, *grads)


_requires_grad = operator.attrgetter("requires_grad")


def _torch_modes() -> tuple:
    """torch's global settings that a trace reads, keyed like the arguments (NOTE [live
    state]): the default dtype (of factories given none), deterministic mode (which some
    decompositions follow) and autocast's, per device."""
    return (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
            *(torch.is_autocast_enabled(d) and torch.get_autocast_dtype(d)
              for d in ("cpu", "cuda")))


def _written_back(outs: list, tensors: list, mutated: tuple, kept: list) -> list:
    """A program's results: its last outputs, the new values of the ``mutated`` inputs, are
    written into them (as eager's in-place ops would), and the results made distinct from
    each other and from the ``kept`` inputs (``_distinct``)."""
    n_results = len(outs) - len(mutated)
    with torch.no_grad():
        for k, i in enumerate(mutated, n_results):
            if not _in_place(outs[k], tensors[i]):
                tensors[i].copy_(outs[k])
    return _distinct(outs[:n_results], kept)


def _in_place(new: torch.Tensor, old: torch.Tensor) -> bool:
    """Was an input's new value written into it (``Graph.updating``)?"""
    return new is old or (_has_storage(new) and new.data_ptr() == old.data_ptr()
                          and new.shape == old.shape and old.is_contiguous())


def _has_storage(t: torch.Tensor) -> bool:
    return not (isinstance(t, FakeTensor) or torch._is_functional_tensor(t)
                or torch._C._functorch.is_functorch_wrapped_tensor(t))


def _distinct(outs: list, inputs: list) -> list:
    """Outputs that share memory with an earlier output or with an argument (a backend's view,
    or one value returned twice) become copies: the graph's outputs are values, and a later
    in-place write to one must not show through another. An argument returned as is stays."""
    if not all(map(_has_storage, outs)):  # a fake or wrapped tensor (_interpreted)
        return outs
    # (an empty input may share a storage too: a result then copied needlessly, not wrongly)
    taken = dict(zip(_storages(inputs), inputs))
    result, returned = [], set()
    for out in outs:
        ptr = out.untyped_storage().data_ptr() if out.numel() else None
        if ptr is not None and ptr in taken and (taken[ptr] is not out or id(out) in returned):
            out = out.clone()
        elif ptr is not None:
            taken[ptr] = out
        returned.add(id(out))
        result.append(out)
    return result


def _storages(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's storage's address, in sweeps of torch's methods (at every call)."""
    return list(map(torch.UntypedStorage.data_ptr, map(torch.Tensor.untyped_storage, tensors)))


def _check_not_aliased(tensors, written: dict[int, str]) -> None:
    """A graph treats its inputs as distinct values; if one that is written (mutated by the
    function, or donated for results; ``written``: argument -> why) shares memory with
    another, the write would show through both."""
    storages = _storages(tensors)
    if len(set(storages)) == len(storages):
        return
    counts = collections.Counter(storages)
    for i, why in written.items():
        if counts[storages[i]] > 1 and storages[i]:  # 0: no memory (empty tensors)
            raise TraceError(
                f"tensor argument {i} {why} and shares memory with another argument; "
                "plait.jit treats arguments as independent values. Pass distinct tensors "
                "(e.g. .clone() one of them).")


def _change(before, now, sizes_static: str) -> str:
    """How one argument's key changed between two traces, and what to do about it;
    ``sizes_static``: why its sizes are not symbolic (NOTE [automatic dynamic])."""
    if len(before) != 6 or not isinstance(before[0], torch.Size) or len(now) != 6:
        kind = before[0]
        if kind is float:
            return (f" ({before[1]!r}, then {now[1]!r}): a float the function uses as a Python "
                    "number (float(), math functions, an op's scalar argument) is static, "
                    "and each value compiles anew. Compute with it as a tensor (torch "
                    "ops), or pass a tensor.")
        return (f" ({before[1]!r}, then {now[1]!r}): an argument of type {kind.__name__} is "
                "static, and each value compiles anew. Pass a tensor where it is data, or "
                "keep it to a few values.")
    shape, dtype, device, layout, dense, _ = before
    if shape != now[0]:
        dims = [f"dim {d}: {a}, then {b}" for d, (a, b) in enumerate(zip(shape, now[0]))
                if a != b] if len(shape) == len(now[0]) else [f"{list(shape)}, then "
                                                                f"{list(now[0])}"]
        return (f" (its shape, {'; '.join(dims)}): {sizes_static}")
    if dtype != now[1] or device != now[2]:
        return (f" (its dtype or device, {dtype} on {device}, then {now[1]} on {now[2]}): "
                "convert it once, before the calls.")
    return (" (its memory layout: strides or storage offset): plait compiles each layout "
            "once. Pass it contiguous (x.contiguous()).")


def _argument_name(path) -> str:
    """A leaf of ``(args, kwargs)`` named as the user knows it: ``argument 1``,
    ``argument 'lr'``, ``argument 0['w']``."""
    where, first, *rest = path
    name = f"argument {first.idx}" if where.idx == 0 else f"argument {first.key!r}"
    return name + pytree.keystr(tuple(rest))


# NOTE [automatic dynamic]
# A tensor argument's dimension that takes a second size at a later call (as torch.compile's
# automatic dynamic shapes), that ``mark_dynamic`` marks, or every dimension with
# ``dynamic=True``, is traced as a size symbol from then on (NOTE [dynamic dimensions] in
# tracer/sizes.py): the call key leaves such a dimension's size out (``_sized``; sizes 0 and
# 1 stay in it, as they trace static) and one compilation serves every size where its guards
# hold (another size compiles a variant, as a branch on a value does: NOTE [value guards]).
# Where tracing or compiling with symbols fails (an op the symbolic path does not handle, a
# trace that decided a size), a forced dimension stops being symbolic unless it varies, and
# else the function compiles one size at a time, as before, and ``dynamic_failure`` (and the
# retrace warning) says why: never a wrong answer, at worst a compilation per size. The
# training programs of a dynamic compilation are compiled at its first differentiated call
# (forward and backward at once), so a failure there still falls back before anything ran.
class Jitted:
    """``plait.jit(fn)``: compiles ``fn`` once per input signature and caches the result."""

    def __init__(self, fn: Callable, static_argnums: Sequence[int] | int = (),
                 backend: str | None = None, donate_argnums: Sequence[int] | int = (),
                 dynamic: bool | None = None):
        # its name and doc, not its attributes: a transform of a jitted function carries that
        # one's (functools.wraps copies them), and they would replace this one's cache and fn
        functools.update_wrapper(self, fn, updated=())
        self.fn = fn
        self.static_argnums = _positions(fn, static_argnums, "static_argnums")
        self.donate_argnums = _positions(fn, donate_argnums, "donate_argnums")
        if set(self.static_argnums) & set(self.donate_argnums):
            raise TraceError(f"arguments {sorted(set(self.static_argnums) & set(self.donate_argnums))}"
                             " are both static and donated; only tensor arguments can be "
                             "donated. Drop them from donate_argnums or static_argnums.")
        self.backend = backend
        if dynamic not in (None, True, False):
            raise TraceError(f"dynamic={dynamic!r}: pass None (a dimension that varies "
                             "becomes symbolic), True (every argument's dimensions are "
                             "symbolic from the first call) or False (one compilation per "
                             "size).")
        self.dynamic = dynamic
        # NOTE [automatic dynamic]: tensor argument -> its dimensions traced as size symbols
        self._dynamic: dict[int, frozenset[int]] = {}
        self._varied: dict[int, frozenset[int]] = {}  # the dimensions seen with two sizes
        self._forcing = True  # dynamic=True and mark_dynamic apply (until they fail)
        # (the arguments' ranks, argument) -> its shape at the first call of those ranks
        self._first_shapes: dict[tuple, torch.Size] = {}
        self.dynamic_failure: str | None = None  # why size symbols were given up, if they were
        self.eager_layouts = True  # NOTE [eager's layouts of results] (tracer/function.py)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._latest = (None, None, None)  # the last call's key, state signature and entry
        self._states: dict = {}  # argument signature -> the state its last trace read
        self._trace_floats = True  # until a trace needs one as a number (_floats_turn_static)
        self._signatures: collections.deque = collections.deque(maxlen=2)
        self._warned: set[str] = set()
        self.trace_count = 0
        self._lock = threading.Lock()  # the fields above, across threads
        self._compiling: dict = {}  # key -> the lock its compilation holds (NOTE [threads])

    def __reduce__(self):
        """Pickled as the function and the settings (``JittedModule.__reduce__``)."""
        return Jitted, (self.fn, self.static_argnums, self.backend, self.donate_argnums,
                        self.dynamic)

    def _key(self, args, kwargs):
        """The call's leaves, their tree, its tensors, the cache key, and the backend that
        compiles it."""
        leaves, tree, signature = _flatten(args, kwargs, self.static_argnums,
                                           self._trace_floats)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        backend = get_backend(resolve_backend(self.backend or config.backend, tensors))
        if self._dynamic and backend.symbolic_sizes:
            signature = _sized(signature, self._dynamic)
        key = (signature, backend.cache_key(), pipeline.settings_key(), _torch_modes())
        return leaves, tree, tensors, key, backend.name

    def lower(self, *args, **kwargs) -> Lowered:
        leaves, tree, _, _, backend = self._key(args, kwargs)
        symbolic = get_backend(backend).symbolic_sizes
        if symbolic:  # as a call would compile it, noting no size (lower is no call)
            self._sizes_turn_dynamic(args, leaves, observe=False)
        try:
            return self._lower(leaves, tree, backend, self._donated(args),
                               self._dynamic if symbolic else {})
        except Exception:
            if self._floats_turn_static(args, kwargs):
                return self.lower(*args, **kwargs)
            raise

    def _floats_turn_static(self, args, kwargs) -> bool:
        """A trace with traced floats failed (the function used one as a Python number:
        ``if lr > 0``, ``eps=`` of an op): are there floats to make static, for this
        function from now on, and trace again?"""
        if not self._trace_floats or not any(type(x) is float
                                             for x in pytree.tree_leaves((args, kwargs))):
            return False
        self._trace_floats = False
        _cache_log.debug("%s: tracing with its float arguments as tensors failed; they are "
                         "static from now on", debug.function_name(self.fn))
        return True

    def _donated(self, args: tuple) -> frozenset[int]:
        """The graph inputs (tensor leaves, in order) that the donated arguments hold."""
        donate = _picked(self.donate_argnums, len(args))
        static = _picked(self.static_argnums, len(args))
        positions, start = set(), 0
        for i, a in enumerate(args):
            n = 0 if i in static else sum(
                isinstance(x, torch.Tensor) or self._trace_floats and type(x) is float
                for x in pytree.tree_leaves(a))
            if i in donate:
                positions.update(range(start, start + n))
            start += n
        return frozenset(positions)

    @no_dynamo_import()
    def _lower(self, leaves, tree, backend: str, donated: frozenset = frozenset(),
               dynamic: dict | None = None) -> Lowered:
        with self._lock:
            self.trace_count += 1
        stages = Stages(debug.function_name(self.fn))
        start = time.perf_counter()
        traced = self._trace(leaves, tree, dynamic)
        stages.record("traced", traced.graph, time.perf_counter() - start)
        lowered = Lowered(traced, backend, donated, stages)
        debug.on_compile(self.fn, lowered)  # logs; writes the report when debug_dir is set
        return lowered

    def _trace(self, leaves, tree, dynamic: dict | None) -> TracedFunction:
        # the traced modules' parameters are tracers meanwhile (NOTE [threads])
        with collector_paused(), STATE_LOCK:
            return trace_function(self.fn, leaves, tree, live=True,
                                  eager_layouts=self.eager_layouts, dynamic=dynamic,
                                  evaluate=lambda graph, tensors: eager_program(graph)(tensors))

    def __call__(self, *args, **kwargs):
        if tracing_active():  # inside another jit or a transform: traced into its graph, as
            return self.fn(*args, **kwargs)  # JAX inlines a nested jit (its kernels ran on tracers)
        if foreign_mode_active():
            return self._interpreted(args, kwargs)
        leaves, tree, tensors, key, backend = self._key(args, kwargs)
        # an argument not contiguous passes the view of its memory it reads (NOTE [strided
        # arguments])
        tensors = list(map(passed, tensors))
        compiled, state, read = self._find(key, tensors)
        if compiled is None:
            with self._compiling_key(key):
                compiled, state, read = self._find(key, tensors)  # compiled meanwhile?
                if compiled is None:
                    compiled, read = self._compile(args, kwargs, leaves, tree, tensors, key,
                                                   backend, state, read)
            if compiled is None:  # its floats turned static: another key
                return self(*args, **kwargs)
        elif _cache_log.isEnabledFor(logging.DEBUG):  # the name costs more than the hit
            _cache_log.debug("hit %s", debug.function_name(self.fn))
        self._latest = key, read[0], compiled
        try:
            return compiled(tensors + read[1])
        except _DynamicFailed as e:
            self._give_up_dynamic(e.__cause__)
            self.clear_cache()
            return self(*args, **kwargs)

    def last_call(self) -> tuple | None:
        """The traced function the last call ran and the tensors it read besides its
        arguments' (the captured state, as it is now), or None (no call yet, or state that
        cannot be read back)."""
        key, _, compiled = self._latest
        state = self._states.get(key) if compiled is not None else None
        read = state.read() if state is not None else None
        return None if read is None else (compiled.lowered.traced, read[1])

    def _find(self, key, tensors):
        """``_lookup``, then the compilation whose value guards hold (NOTE [value guards])."""
        compiled, state, read = self._lookup(key)
        if compiled is not None and (compiled.guards or compiled.sizes):
            compiled = compiled.variant(tensors + read[1])
        return compiled, state, read

    def _lookup(self, key):
        """The compilation of ``key`` for the state as read now (None where there is none),
        the state, and what it read (None where it could not be read back)."""
        state = self._states.get(key)  # NOTE [live state]
        read = state.read() if state is not None else None
        if read is None:
            return None, state, None
        latest = self._latest  # once: another thread may replace it meanwhile
        if read[0] is latest[1] and key == latest[0]:
            return latest[2], state, read  # the last call's: its state's signature, unhashed
        with self._lock:
            compiled = self._cache.get((key, read[0]))
            if compiled is not None:
                self._cache.move_to_end((key, read[0]))
        return compiled, state, read

    @contextlib.contextmanager
    def _compiling_key(self, key):
        """Held while ``key`` compiles: another thread asking for it waits, then finds it
        compiled; other keys compile meanwhile (NOTE [threads] in tracer/trace.py)."""
        with self._lock:
            lock = self._compiling.setdefault(key, threading.RLock())
        try:
            with lock:
                yield
        finally:
            with self._lock:  # from now on a call finds the compilation in the cache
                if self._compiling.get(key) is lock:
                    del self._compiling[key]

    def _compile(self, args, kwargs, leaves, tree, tensors, key, backend: str, state, read):
        """Trace and compile a call that ``_lookup`` missed: the compilation and the state
        it reads, or (None, None) where its floats turned static (``_floats_turn_static``)."""
        name = debug.function_name(self.fn)
        if get_backend(backend).symbolic_sizes and (self._sizes_turn_dynamic(args, leaves) or
                                                    self._key(args, kwargs)[3] != key):
            return None, None  # keyed again: its dims turned symbolic (here or in a thread)
        _cache_log.debug("%s %s for inputs %s", "retrace" if self.trace_count else "miss",
                         name, [str(TensorType.of(t)) for t in tensors])
        # the dims the key leaves out, and no other (another thread may widen _dynamic)
        dynamic: dict = {}
        for j, d in _erased(key[0]):
            dynamic[j] = dynamic.get(j, frozenset()) | {d}
        try:
            lowered = self._lower(leaves, tree, backend, self._donated(args), dynamic)
            if dynamic:
                bound = lowered.sizes.bindings if lowered.sizes is not None else ()
                if {(j, d) for j, d, _ in bound} != _erased(key[0]):  # the key's promise
                    raise TraceError("the trace's size symbols are not the dimensions its "
                                     "key leaves out")
                compiled = _Compiled(lowered)  # where size symbols fail, static (below)
        except Exception as e:
            if self._floats_turn_static(args, kwargs):
                return None, None
            if dynamic:  # a call that fails at its own sizes too (as eager would) raises
                self._trace(leaves, tree, {})  # that, and keeps the symbolic sizes
                if self._give_up_dynamic(e):
                    return None, None
            raise
        state_before, state = state, lowered.traced.state
        read_before, read = read, state.read()
        if read is None:
            raise TraceError(
                f"{name}: the state it captures could not be read back right after it "
                "was traced (a path to a captured tensor or module that changes as it "
                "is followed). Pass such tensors as arguments.")
        if not dynamic:
            compiled = _Compiled(lowered)  # compiled here, outside the lock
        with self._lock:
            self._note_retrace(args, kwargs, key)
            if state_before is not None and read_before is None:  # compiled under a state
                for stale in [k for k in self._cache if k[0] == key]:  # no longer read
                    del self._cache[stale]
            self._states[key] = state
            first = self._cache.get((key, read[0]))
            if first is not None and (first.guards or first.sizes):  # another branch or
                # other sizes (NOTE [value guards], NOTE [dynamic dimensions])
                compiled.variants = first.variants
                compiled.variants.append(compiled)
                if len(compiled.variants) > config.cache_size:
                    del compiled.variants[0]
            else:
                self._cache[key, read[0]] = compiled
            if len(self._cache) > config.cache_size:
                self._cache.popitem(last=False)
                _cache_log.debug("%s: evicted the oldest signature", name)
        return compiled, read

    def _sizes_turn_dynamic(self, args, leaves, observe: bool = True) -> bool:
        """NOTE [automatic dynamic]: do this call's tensor arguments make dimensions dynamic
        that were not (marked with ``mark_dynamic``, or, with ``observe``, of another size
        than at the first trace of arguments of their ranks)? The call's key changes then:
        it is keyed again."""
        if self.dynamic is False or self.dynamic_failure is not None:
            return False
        with self._lock:
            return self._turn_dynamic([x for x in leaves if isinstance(x, torch.Tensor)],
                                      observe)

    def _turn_dynamic(self, tensors: list, observe: bool) -> bool:
        changed = False
        ranks = tuple(t.dim() for t in tensors)  # argument j is the same argument
        for j, t in enumerate(tensors):
            if observe:
                first = self._first_shapes.setdefault((ranks, j), t.shape)
                self._varied[j] = self._varied.get(j, frozenset()) | {
                    d for d, (a, b) in enumerate(zip(first, t.shape)) if a != b}
            dims = set(self._varied.get(j, ()))
            if self._forcing:
                dims.update(getattr(t, "_dynamo_dynamic_indices", ()))
                dims.update(range(t.dim()) if self.dynamic else ())
            dims = frozenset(dims) | self._dynamic.get(j, frozenset())
            if dims != self._dynamic.get(j, frozenset()):
                self._dynamic = {**self._dynamic, j: dims}  # replaced: read without the lock
                changed = True
        if changed:
            _cache_log.info("%s: traced with symbolic sizes from now on: %s",
                            debug.function_name(self.fn), ", ".join(
                                f"argument tensor {j}'s dims {sorted(d)}"
                                for j, d in self._dynamic.items()))
        return changed

    def _sizes_static(self, backend: str) -> str:
        """Why a tensor argument's sizes compile one at a time, and what to do about it."""
        if not get_backend(backend).symbolic_sizes:
            return (f"the {backend} backend compiles each size once (the cpp and triton "
                    "backends compile one program for every size). Pad the varying dims to "
                    "a few sizes and mask the padding, or use one of those backends.")
        if self.dynamic is False:
            return ("plait.jit(..., dynamic=False) compiles each size once. Leave dynamic unset "
                    "to compile one program for every size of a dimension that varies.")
        if self.dynamic_failure is not None:
            return ("compiling one program for every size failed, so each size compiles "
                    f"once ({self.dynamic_failure}). Please report it; meanwhile pad the "
                    "varying dims to a few sizes and mask the padding.")
        return ("its sizes 0 and 1 compile their own programs (a program for every size "
                "holds for sizes of 2 and more).")

    def _give_up_dynamic(self, error: Exception) -> bool:
        """A trace or compilation with size symbols failed: with dimensions made symbolic
        before they varied (dynamic=True, mark_dynamic), only those that vary are from now
        on; else this function compiles one size at a time from now on (as where it varies
        nowhere), and says why once."""
        with self._lock:
            return self._fall_back(error)

    def _fall_back(self, error: Exception) -> bool:
        varied = {j: d for j, d in self._varied.items() if d}
        if self._forcing and self._dynamic != varied:
            self._forcing, self._dynamic = False, varied
            _cache_log.info("%s: symbolic sizes failed (%s: %s); only dimensions that vary "
                            "are symbolic from now on", debug.function_name(self.fn),
                            type(error).__name__, error)
            return True
        self.dynamic_failure = f"{type(error).__name__}: {error}"
        self._dynamic = {}
        _cache_log.info("%s: compiling one size at a time, since symbolic sizes failed: %s",
                        debug.function_name(self.fn), self.dynamic_failure,
                        exc_info=error if _cache_log.isEnabledFor(logging.DEBUG) else None)
        return True

    def _interpreted(self, args, kwargs):
        """A call under a foreign dispatch mode (``make_fx``, ``FakeTensorMode``) or a
        torch.func transform (whose wrapped tensors have no storage for kernels to read):
        traced and simplified with them set aside, then run op by op with torch (the eager
        backend), so the mode or transform sees the graph's computation rather than compiled
        kernels."""
        with _disable_current_modes(), temporarily_clear_interpreter_stack():
            leaves, tree, tensors, _, _ = self._key(args, kwargs)
            tensors = list(map(passed, tensors))  # NOTE [strided arguments]
            compiled = _Compiled(self._lower(leaves, tree, "eager"))
            state = compiled.lowered.traced.state.read()[1]
        return compiled(tensors + state, interpreted=True)

    def _note_retrace(self, args, kwargs, key) -> None:
        """Past ``config.retrace_warning`` traces, warn once per argument that keeps changing
        (the leaves whose key differs from the previous trace's)."""
        # each leaf by what compiling depends on, not the leaf: no call's tensors kept alive
        leaves = [(path, tensor_key(x) if isinstance(x, torch.Tensor) else
                   (float, None) if type(x) is float and self._trace_floats else (type(x), x))
                  for path, x in pytree.tree_flatten_with_path((args, kwargs))[0]]
        self._signatures.append((leaves, key))
        if self.trace_count <= config.retrace_warning or len(self._signatures) < 2:
            return
        (before, key_before), (now, key_now) = self._signatures
        if len(before) != len(now):
            changed = [("the structure of the arguments", "")]
        else:
            changed = [(_argument_name(path), _change(a, b, self._sizes_static(key_now[1][0])))
                       for (path, a), (_, b) in zip(before, now) if a != b]
            changed = changed or ([("captured state (a module's attributes or parameters)", "")]
                                  if key_before == key_now else [("the configuration", "")])
        for what, how in changed:
            if what not in self._warned:
                self._warned.add(what)
                _cache_log.warning("%s has been traced %d times; it retraces because %s keeps "
                                   "changing%s", debug.function_name(self.fn),
                                   self.trace_count, what, how or ".")

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self._latest = (None, None, None)
            self._states.clear()

    def __get__(self, obj, objtype=None):
        """``@jit`` on a method: bound to its object, which is a static argument (its
        modules' parameters and buffers are read at each call, NOTE [live state])."""
        return self if obj is None else types.MethodType(self, obj)


class JittedModule(torch.nn.Module):
    """``plait.jit(module)``: the module, compiled, as ``torch.compile(module)`` returns it.
    Its parameters, buffers, ``state_dict``, ``train()``/``eval()`` and hooks are the
    original module's (``_orig_mod``), read at each call (NOTE [live state]), under the
    original names (no ``_orig_mod.`` in them, here or in a module holding this one);
    ``jitted`` is the ``Jitted`` of the module's call, for ``lower`` and ``trace_count``.
    Forward hooks of torch.distributed (FSDP's, registered by ``fully_shard(jitted)``) stay
    on this wrapper and run around each compiled call (NOTE [distributed wrappers] in
    tracer/state.py)."""

    def __init__(self, module: torch.nn.Module, jitted: Jitted):
        super().__init__()
        self._orig_mod = module
        self.__dict__["jitted"] = jitted
        self.register_load_state_dict_pre_hook(_into_original)

    def __call__(self, *args, **kwargs):
        # the module's own call, its hooks and torch's global ones, is what is traced; this
        # wrapper's, nn.Module's, would run the global hooks a second time
        if self._forward_pre_hooks or self._forward_hooks:
            return _around_hooks(self, self._call, args, kwargs)
        return self._call(*args, **kwargs)

    def _call(self, *args, **kwargs):
        return self.jitted(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """The compiled call without this wrapper's hooks, as ``nn.Module.forward`` is."""
        return self.jitted(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._orig_mod, name)

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        """This wrapper, then the original module's tree under the same names (so every
        parameter's and buffer's name is the original one; the wrapper and the original
        module share theirs)."""
        memo = set() if memo is None else memo
        if remove_duplicate:
            if self in memo:
                return
            memo.add(self)
        yield prefix, self
        yield from self._orig_mod.named_modules(memo, prefix, remove_duplicate)

    def register_forward_pre_hook(self, hook, **options):
        return _hooked(self, "register_forward_pre_hook", hook, options)

    def register_forward_hook(self, hook, **options):
        return _hooked(self, "register_forward_hook", hook, options)

    @property
    def trace_count(self) -> int:
        return self.jitted.trace_count

    def lower(self, *args, **kwargs) -> Lowered:
        return self.jitted.lower(*args, **kwargs)

    def __reduce__(self):
        """Pickled (``torch.save``, ``copy.deepcopy``) as the module and the jit's settings:
        what it compiled is native code of this process, compiled again (or read from the
        disk cache) after loading."""
        j = self.jitted
        return functools.partial(jit, static_argnums=j.static_argnums, backend=j.backend,
                                 donate_argnums=j.donate_argnums, dynamic=j.dynamic), \
            (self._orig_mod,)


class _JittedSharded(JittedModule):
    """``plait.jit`` of a model ``fully_shard`` manages as one unit: its forward compiled
    (``jitted``), its forward hooks (FSDP's among them) run around each compiled call (NOTE
    [distributed wrappers] in tracer/state.py)."""

    def _call(self, *args, **kwargs):
        module = self._orig_mod
        hooked = [k for k in ("_backward_pre_hooks", "_backward_hooks") if getattr(module, k)]
        hooked += ["torch's global forward hooks" for g in (
            torch.nn.modules.module._global_forward_hooks,
            torch.nn.modules.module._global_forward_pre_hooks) if g]
        if hooked:
            raise DistributedError(
                f"plait.jit of a model fully_shard manages traces its forward and runs its "
                f"forward hooks around each call, but it has {hooked[0]}, which would not "
                "run: compile its blocks instead, fully_shard(plait.jit(block)) for each.")
        return _around_hooks(module, self._compiled_forward, args, kwargs)

    def _compiled_forward(self, *args, **kwargs):
        with hooks_outside(self._orig_mod):
            return self.jitted(*args, **kwargs)


def _hooked(wrapper: JittedModule, register: str, hook, options: dict):
    """A forward hook registered on ``wrapper``: on the original module, traced with its
    call, unless torch.distributed's (NOTE [distributed wrappers] in tracer/state.py)."""
    owner = wrapper if hook_module(hook).startswith("torch.distributed") else wrapper._orig_mod
    return getattr(torch.nn.Module, register)(owner, hook, **options)


def _around_hooks(module: torch.nn.Module, call: Callable, args: tuple, kwargs: dict):
    """``call`` with ``module``'s own forward hooks (torch.distributed's) run around it, as
    ``nn.Module.__call__`` runs them (``with_kwargs`` and ``always_call`` among their
    options)."""
    for key, hook in list(module._forward_pre_hooks.items()):
        if key in module._forward_pre_hooks_with_kwargs:
            if (result := hook(module, args, kwargs)) is not None:
                args, kwargs = result
        elif (result := hook(module, args)) is not None:
            args = result if isinstance(result, tuple) else (result,)
    try:
        out = call(*args, **kwargs)
    except Exception:
        for key, hook in list(module._forward_hooks.items()):
            if key in module._forward_hooks_always_called:
                _forward_hook(module, key, hook, args, kwargs, None)
        raise
    for key, hook in list(module._forward_hooks.items()):
        result = _forward_hook(module, key, hook, args, kwargs, out)
        out = out if result is None else result
    return out


def _forward_hook(module: torch.nn.Module, key: int, hook, args, kwargs, out):
    return hook(module, args, kwargs, out) if key in module._forward_hooks_with_kwargs \
        else hook(module, args, out)


def _into_original(module: JittedModule, state_dict: dict, prefix: str, *_) -> None:
    """A ``load_state_dict`` of a module holding ``module``: its entries, named as the
    original module's (``JittedModule.state_dict``), go to that module (``_orig_mod``)."""
    inner = prefix + "_orig_mod."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


class _JittedDDP(JittedModule):
    """``plait.jit(DistributedDataParallel(model))``: the wrapped model compiled (``jitted``),
    DDP's bookkeeping run around each compiled call (NOTE [jit of DDP] in distributed.py)."""

    def __call__(self, *args, **kwargs):
        return ddp_call(self._orig_mod, self.jitted, args, kwargs)

    forward = __call__


def _original_modules(name: str):
    """``JittedModule``'s method ``name``: the original module's (backward hooks registered
    on the wrapper are the module's, and traced with its call)."""

    def method(self, *args, **kwargs):
        return getattr(self._orig_mod, name)(*args, **kwargs)

    method.__name__ = name
    return method


for _name in ("state_dict", "load_state_dict", "register_full_backward_pre_hook",
              "register_full_backward_hook", "register_backward_hook"):
    setattr(JittedModule, _name, _original_modules(_name))
del _name


def jit(fn: Callable | None = None, *, static_argnums: Sequence[int] | int = (),
        backend: str | None = None, donate_argnums: Sequence[int] | int = (),
        dynamic: bool | None = None):
    """Compile ``fn`` for each new input signature (shapes, dtypes, devices, pytree structure,
    and the values of non-tensor arguments other than floats, which are traced). Usable as
    ``@jit``, ``@jit(backend=...)``, on a method, or on a module (``plait.jit(model)``
    returns a ``JittedModule``).

    What ``fn`` captures (closure and global tensors, modules' parameters and buffers) is
    read at each call, and what a compilation depends on (``training``, shapes) is guarded
    (NOTE [live state]). With grad mode on and an input or parameter that requires grad,
    the call is recorded by torch.autograd (NOTE [jit under torch.autograd]).

    ``donate_argnums``: positional arguments whose tensors the caller hands over: compiled
    code may write results into their memory, so after the call their contents are undefined
    (as in JAX; pass tensors you no longer need, e.g. the old weights of a training step).
    A backend that plans no memory ignores the donation.

    ``dynamic`` (NOTE [automatic dynamic]): None, a tensor argument's dimension that takes a
    second size (or that ``mark_dynamic`` marks) is compiled for every size from then on;
    True, every dimension of every tensor argument is, from the first call; False, each
    size compiles its own version."""
    if fn is None:
        return functools.partial(jit, static_argnums=static_argnums, backend=backend,
                                 donate_argnums=donate_argnums, dynamic=dynamic)
    if isinstance(fn, torch.nn.parallel.DistributedDataParallel):  # NOTE [jit of DDP]
        return _JittedDDP(fn, Jitted(fn.module, static_argnums, backend, donate_argnums,
                                     dynamic))
    if isinstance(fn, torch.nn.Module) and fully_sharded(fn):  # NOTE [distributed wrappers]
        return _JittedSharded(fn, Jitted(fn.forward, static_argnums, backend, donate_argnums,
                                         dynamic))
    jitted = Jitted(fn, static_argnums, backend, donate_argnums, dynamic)
    return JittedModule(fn, jitted) if isinstance(fn, torch.nn.Module) else jitted


def mark_dynamic(tensor: torch.Tensor, dims: int | Sequence[int]) -> None:
    """Compile for every size of ``tensor``'s dimensions ``dims`` from the first call it is
    passed to a jitted function (NOTE [automatic dynamic]), as ``torch._dynamo.mark_dynamic``
    does for torch.compile (the same mark: either call serves both)."""
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if any(not -tensor.dim() <= d < tensor.dim() for d in dims):
        raise TraceError(f"mark_dynamic: dims {list(dims)} out of range for a tensor of "
                         f"{tensor.dim()} dims")
    marked = getattr(tensor, "_dynamo_dynamic_indices", set())
    tensor._dynamo_dynamic_indices = marked | {d % tensor.dim() for d in dims}


def make_graph(fn: Callable, static_argnums: Sequence[int] | int = ()):
    """``make_graph(fn)(*args)`` returns the (simplified) primitive graph of ``fn`` on args."""

    def build(*args, **kwargs) -> Graph:
        jitted = Jitted(fn, static_argnums)
        jitted.eager_layouts = False  # its outputs are fn's results, not their layouts
        return jitted.lower(*args, **kwargs).graph

    return build


def control_dependency(value: torch.Tensor, *deps: torch.Tensor) -> torch.Tensor:
    """``value``, computed only after whatever computes ``deps`` (inside ``jit`` and the
    transforms): the graph gets control edges, and no pass reorders or fuses across them.
    Outside a traced function, eager PyTorch runs in program order already: ``value``."""
    from .tracer.trace import current_trace, on_tracers, tracing_active

    if not tracing_active():
        return value
    return on_tracers(lambda v, ds: current_trace().order_after(v, ds))(value, deps)
