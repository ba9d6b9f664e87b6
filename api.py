"""The public entry points: jit, make_graph, and the Lowered view of one compilation.

They only wire stages together: trace (tracer/), simplify (passes/), compile (backends/).
"""
from __future__ import annotations

import collections
import functools
import logging
import time
from typing import Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from . import debug
from .backends import get_backend, program_cache, resolve_backend
from .config import config
from .errors import TraceError
from .graph import Graph, TensorType
from .passes import memory, simplify
from .passes.pipeline import Stages
from .tracer import Static, TracedFunction, trace_function
from .tracer.trace import is_dense, no_dynamo_import, tracing_active

_cache_log = logging.getLogger("plait.cache")


def _positions(argnums: Sequence[int] | int) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def _picked(argnums: Sequence[int], n: int) -> set[int]:
    """The positions of ``n`` positional arguments that ``argnums`` names (negative ones count
    from the end)."""
    return {i % n for i in argnums if -n <= i < n}


@functools.cache
def _tensors_tree(n: int) -> pytree.TreeSpec:
    """The tree of a call with ``n`` positional tensors and nothing else."""
    return pytree.tree_flatten(((None,) * n, {}), is_leaf=lambda x: x is None)[1]


def _tensor_key(x: torch.Tensor) -> tuple:
    """What compiling a tensor argument depends on."""
    return x.shape, x.dtype, x.device, x.layout, is_dense(x)


def _flatten(args: tuple, kwargs: dict, static_argnums: Sequence[int]):
    """Split a call into its leaves and a hashable signature (the cache key)."""
    if not kwargs and not static_argnums and all(isinstance(a, torch.Tensor) for a in args):
        # the common call, keyed without flattening (and hashing) a pytree: most of a
        # cached call's host time otherwise
        return list(args), _tensors_tree(len(args)), tuple(map(_tensor_key, args))
    static = _picked(static_argnums, len(args))
    args = tuple(Static(a) if i in static else a for i, a in enumerate(args))
    leaves, tree = pytree.tree_flatten((args, kwargs))
    signature = [tree]
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            signature.append(_tensor_key(x))
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


class Lowered:
    """One compilation of a jitted function for one signature, for inspection. Its stages run
    when first needed, under the settings it was created with; a call needs only ``runner``,
    which the program cache may give without simplifying or compiling anything."""

    def __init__(self, traced: TracedFunction, backend: str, donated: frozenset = frozenset(),
                 stages: Stages | None = None):
        self.traced = traced
        self.backend = backend
        self.donated = donated
        self._stages = stages or Stages()
        # a mutated input is written back after the call: its memory is not free for results
        self.source_graph = traced.graph.donating(sorted(donated - set(traced.mutated_inputs)))
        self._config = config.keyed()
        self._keeps_program = config.program_cache

    @property
    def traced_graph(self) -> Graph:
        """The graph as traced, before any pass."""
        return self.traced.graph

    @functools.cached_property
    def _simplified(self) -> tuple[Graph, tuple]:
        passes: list = []
        last = time.perf_counter()

        def on_pass(name: str, graph: Graph) -> None:
            nonlocal last
            now = time.perf_counter()
            passes.append((name, graph))
            self._stages.record(name, graph, now - last)
            last = now

        with config.patch(**self._config), no_dynamo_import():
            graph = simplify(self.source_graph, on_pass) if config.simplify else self.source_graph
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

    @functools.cached_property
    def compiled(self):
        """The backend's callable for this graph (compiled on first use)."""
        backend = get_backend(self.backend)
        graph = self.graph
        with config.patch(**self._config), no_dynamo_import():
            if backend.staged:
                return backend.factory(graph, stages=self._stages)
            return self._stages.run("compile", backend.factory, graph, keep=False)

    @property
    def stages(self) -> dict:
        """Stage name -> what it made, in the order they ran (NOTE [pipeline]): the traced
        graph, the graph after each simplify pass, and for a compiling backend the loop
        program after lowering, fusion and each memory pass, then the memory plan. Each
        prints with ``.as_text()``. Compiles what is not compiled yet."""
        self.compiled
        return dict(self._stages.irs)

    @property
    def timings(self) -> dict:
        """Stage name -> seconds, in the order they ran: ``stages``' and, for a compiling
        backend, ``codegen`` (writing the kernels), ``native`` (compiling and loading them)
        and ``wrapper`` (the steps that call them)."""
        self.compiled
        return dict(self._stages.seconds)

    @functools.cached_property
    def runner(self):
        """What a call runs: the program an earlier process compiled and kept on disk (NOTE
        [program cache]), or else ``compiled``'s runner (kept for the next process where it
        pickles), or ``compiled`` itself for a backend whose programs are not kept."""
        backend = get_backend(self.backend)
        if not (self._keeps_program and backend.keeps_programs):
            return self.compiled
        key = program_cache.key(self.source_graph, backend, tuple(self._config.values()))
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

    def __call__(self, tensors: list[torch.Tensor]):
        if self._written:
            _check_not_aliased(tensors, self._written)
        outs = self._run(tensors)
        for k, i in enumerate(self._mutated, len(outs) - len(self._mutated)):
            with torch.no_grad():
                tensors[i].copy_(outs[k])
        kept = [t for i, t in enumerate(tensors) if i not in self._donated] \
            if self._donated else tensors
        results = _distinct(outs[:len(outs) - len(self._mutated)], kept)
        leaves = [results[x] if isinstance(x, int) else x.value for x in self._out_leaves]
        return pytree.tree_unflatten(leaves, self._out_tree)


def _distinct(outs: list, inputs: list) -> list:
    """Outputs that share memory with an earlier output or with an argument (a backend's view,
    or one value returned twice) become copies: the graph's outputs are values, and a later
    in-place write to one must not show through another. An argument returned as is stays."""
    taken = {t.untyped_storage().data_ptr(): t for t in inputs if t.numel()}
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


def _check_not_aliased(tensors, written: dict[int, str]) -> None:
    """A graph treats its inputs as distinct values; if one that is written (mutated by the
    function, or donated for results; ``written``: argument -> why) shares memory with
    another, the write would show through both."""
    storages = [t.untyped_storage().data_ptr() for t in tensors]
    for i, why in written.items():
        if storages.count(storages[i]) > 1:
            raise TraceError(
                f"tensor argument {i} {why} and shares memory with another argument; "
                "plait.jit treats arguments as independent values. Pass distinct tensors "
                "(e.g. .clone() one of them).")


class Jitted:
    """``plait.jit(fn)``: compiles ``fn`` once per input signature and caches the result."""

    def __init__(self, fn: Callable, static_argnums: Sequence[int] | int = (),
                 backend: str | None = None, donate_argnums: Sequence[int] | int = ()):
        self.fn = fn
        self.static_argnums = _positions(static_argnums)
        self.donate_argnums = _positions(donate_argnums)
        if set(self.static_argnums) & set(self.donate_argnums):
            raise TraceError(f"arguments {sorted(set(self.static_argnums) & set(self.donate_argnums))}"
                             " are both static and donated; only tensor arguments can be "
                             "donated. Drop them from donate_argnums or static_argnums.")
        self.backend = backend
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self.trace_count = 0
        functools.update_wrapper(self, fn)

    def _key(self, args, kwargs):
        """The call's leaves, their tree, its tensors, the cache key, and the backend that
        compiles it."""
        leaves, tree, signature = _flatten(args, kwargs, self.static_argnums)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        backend = get_backend(resolve_backend(self.backend or config.backend, tensors))
        key = (signature, backend.cache_key(), config.cache_key())
        return leaves, tree, tensors, key, backend.name

    def lower(self, *args, **kwargs) -> Lowered:
        leaves, tree, _, _, backend = self._key(args, kwargs)
        return self._lower(leaves, tree, backend, self._donated(args))

    def _donated(self, args: tuple) -> frozenset[int]:
        """The graph inputs (tensor leaves, in order) that the donated arguments hold."""
        donate = _picked(self.donate_argnums, len(args))
        static = _picked(self.static_argnums, len(args))
        positions, start = set(), 0
        for i, a in enumerate(args):
            n = 0 if i in static else sum(isinstance(x, torch.Tensor)
                                          for x in pytree.tree_leaves(a))
            if i in donate:
                positions.update(range(start, start + n))
            start += n
        return frozenset(positions)

    @no_dynamo_import()
    def _lower(self, leaves, tree, backend: str, donated: frozenset = frozenset()) -> Lowered:
        self.trace_count += 1
        stages = Stages(debug.function_name(self.fn))
        start = time.perf_counter()
        traced = trace_function(self.fn, leaves, tree)
        stages.record("traced", traced.graph, time.perf_counter() - start)
        lowered = Lowered(traced, backend, donated, stages)
        debug.on_compile(self.fn, lowered)  # logs; writes the report when debug_dir is set
        return lowered

    def __call__(self, *args, **kwargs):
        if tracing_active():  # inside another jit or a transform: traced into its graph, as
            return self.fn(*args, **kwargs)  # JAX inlines a nested jit (its kernels ran on tracers)
        leaves, tree, tensors, key, backend = self._key(args, kwargs)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            raise TraceError(
                "an argument requires grad, but a plait.jit function is not recorded by "
                "torch.autograd, so backward() would not reach it. Differentiate with "
                "plait.grad / plait.vjp, or call it under torch.no_grad() (or pass detached "
                "tensors).")
        compiled = self._cache.get(key)
        if compiled is None:
            name = debug.function_name(self.fn)
            _cache_log.debug("%s %s for inputs %s", "retrace" if self.trace_count else "miss",
                             name, [str(TensorType.of(t)) for t in tensors])
            compiled = self._cache[key] = _Compiled(
                self._lower(leaves, tree, backend, self._donated(args)))
            if len(self._cache) > config.cache_size:
                self._cache.popitem(last=False)
                _cache_log.debug("%s: evicted the oldest signature", name)
        else:
            if _cache_log.isEnabledFor(logging.DEBUG):  # the name costs more than the hit
                _cache_log.debug("hit %s", debug.function_name(self.fn))
            self._cache.move_to_end(key)
        return compiled(tensors)

    def clear_cache(self) -> None:
        self._cache.clear()


def jit(fn: Callable | None = None, *, static_argnums: Sequence[int] | int = (),
        backend: str | None = None, donate_argnums: Sequence[int] | int = ()):
    """Compile ``fn`` for each new input signature (shapes, dtypes, devices, pytree structure,
    and the values of non-tensor arguments). Usable as ``@jit`` or ``@jit(backend=...)``.

    ``donate_argnums``: positional arguments whose tensors the caller hands over: compiled
    code may write results into their memory, so after the call their contents are undefined
    (as in JAX; pass tensors you no longer need, e.g. the old weights of a training step).
    A backend that plans no memory ignores the donation."""
    if fn is None:
        return functools.partial(jit, static_argnums=static_argnums, backend=backend,
                                 donate_argnums=donate_argnums)
    return Jitted(fn, static_argnums, backend, donate_argnums)


def make_graph(fn: Callable, static_argnums: Sequence[int] | int = ()):
    """``make_graph(fn)(*args)`` returns the (simplified) primitive graph of ``fn`` on args."""

    def build(*args, **kwargs) -> Graph:
        return Jitted(fn, static_argnums).lower(*args, **kwargs).graph

    return build


def control_dependency(value: torch.Tensor, *deps: torch.Tensor) -> torch.Tensor:
    """``value``, computed only after whatever computes ``deps`` (inside ``jit`` and the
    transforms): the graph gets control edges, and no pass reorders or fuses across them.
    Outside a traced function, eager PyTorch runs in program order already: ``value``."""
    from .tracer.trace import current_trace, on_tracers, tracing_active

    if not tracing_active():
        return value
    return on_tracers(lambda v, ds: current_trace().order_after(v, ds))(value, deps)
