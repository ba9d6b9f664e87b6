"""The compiler's pipeline, from a traced graph to a runnable program, in one place.

NOTE [pipeline]
A compilation is this list of stages, run in order; each is a pure function of what the one
before made and of the settings it names (``reads``), and each is recorded (``Stages``: its
result, which prints with ``.as_text()``, and its seconds):

  traced          the graph as traced (api.py records it)
  GRAPH_STAGES    simplification, Graph -> Graph (passes/simplify.py, attention.py, layout.py,
                  padding.py)
  TRAINING        under torch.autograd: the joint forward-and-backward graph, simplified, split
                  into the forward and backward programs (passes/autodiff.py; NOTE [forward
                  and backward programs]), each compiled on by the stages below
  LOOP_STAGES     for a backend that generates loop code: lower to a LoopProgram, simplify
                  its indices, fuse, again, split reductions, reuse buffers in place, reorder,
                  overlap collectives, plan memory (passes/lowering.py, indexing.py,
                  fusion.py, split.py, memory.py)
  codegen         the backend writes each kernel and the wrapper that calls them
  native          ... builds and loads them (C++: a shared library; Triton: at the first call
                  on a device, ``device``)
  wrapper         ... and makes the steps a call runs

A stage switched off by its setting (``when``) still appears, its input as its output. A
backend that interprets the graph (eager, a user's) gets the simplified graph: its work is
one stage, ``compile``. A new pass is one ``Stage`` in its list and its module.

Settings are read from ``config`` once, when a compilation begins (``snapshot``), and each
stage receives those it names; no pass reads or writes the global config. The settings that
change what a compilation makes are those the stages name, those tracing reads
(``TRACING_READS``) and a backend's own (``Backend.reads``): ``settings_key`` derives the
cache key from them.
"""
from __future__ import annotations

import contextlib
import importlib
import operator
import types
from typing import Any, Callable

import attrs

from ..backends import Backend, Target, get_backend
from ..config import config
from ..graph import Graph
from ..passes import memory
from .stages import Stages, collector_paused


@attrs.frozen
class Stage:
    """One step of the pipeline: the pass ``fn`` (``"module.function"`` of passes/, imported
    when first run: a program loaded from the disk cache runs without the compiler proper),
    called as ``fn(ir, **arguments)``. ``reads`` maps each keyword argument to the setting it
    takes (a tuple: settings passed under their own names), ``target`` names the backend's
    ``Target`` fields passed under theirs. ``when``: the setting that switches the stage on;
    ``target_when``: the ``Target`` field that must be true as well."""

    name: str
    fn: str
    reads: dict | tuple = ()
    target: tuple = ()
    when: str | None = None
    target_when: str | None = None

    @property
    def settings(self) -> tuple[str, ...]:
        """The settings this stage reads, its switch's included."""
        read = tuple(self.reads.values()) if isinstance(self.reads, dict) else self.reads
        return read + ((self.when,) if self.when else ())

    def on(self, settings, target: Target | None) -> bool:
        return (self.when is None or bool(getattr(settings, self.when))) and \
            (self.target_when is None or bool(getattr(target, self.target_when)))

    def __call__(self, ir, settings, target: Target | None = None, **given):
        """``given``: the arguments of this call alone (what to differentiate)."""
        reads = self.reads if isinstance(self.reads, dict) else {r: r for r in self.reads}
        arguments = {arg: getattr(settings, name) for arg, name in reads.items()}
        arguments |= {name: getattr(target, name) for name in self.target}
        return _pass(self.fn)(ir, **arguments, **given)


def _pass(name: str) -> Callable:
    module, function = name.rsplit(".", 1)
    return getattr(importlib.import_module(f"..passes.{module}", __package__), function)


GRAPH_STAGES = (
    Stage("erase_markers", "simplify.erase_markers"),
    Stage("dce", "simplify.dce"),
    Stage("fold_constants", "simplify.fold_constants", reads={"max_numel": "fold_max_numel"}),
    Stage("fuse_attention", "attention.fuse_attention", when="fuse_attention"),
    Stage("attention_layout", "attention.attention_layout", reads={"devices": "attention_layout"}),
    Stage("channels_last", "layout.channels_last", reads={"devices": "channels_last"}),
    Stage("algebra", "simplify.algebra"),
    Stage("pad_products", "padding.pad_products", reads={"devices": "pad_products"}),
    Stage("cse", "simplify.cse"),
    Stage("dce", "simplify.dce"),
    Stage("unread_ys", "simplify.unread_ys"),
    Stage("unread_input_grads", "simplify.unread_input_grads"),
)

# the forward-and-backward graph: differentiated, then simplified by GRAPH_STAGES, then split
# into the forward and backward graphs (``autodiff.split``)
JOINT = Stage("joint", "autodiff.joint", reads={"fuse": "fuse_attention",
                                                 "attention_devices": "attention_layout",
                                                 "layout": "channels_last"})
SPLIT = Stage("split", "autodiff.split")

LOOP_STAGES = (
    Stage("inline", "lowering.inline_checkpoints"),
    Stage("epilogues", "epilogues.bias_epilogues", reads={"devices": "bias_epilogues"}),
    Stage("lower", "lowering.lower",
          target=("supported_ops", "supported_dtypes", "comm_buffers")),
    Stage("index", "indexing.simplify_indices"),
    Stage("fuse", "fusion.fuse"),
    Stage("reindex", "indexing.simplify_indices"),
    Stage("split", "split.split_reductions", when="split_reductions",
          target_when="split_reductions"),
    Stage("reuse", "memory.reuse", when="inplace"),
    Stage("reorder", "memory.reorder", reads={"overlapped": "overlap"}, when="reorder"),
    Stage("overlap", "memory.overlap", when="overlap"),
    Stage("plan", "memory.plan", reads={"pool": "plan_memory", "comm_reuse": "comm_pool_reuse"}),
)

# what tracing reads (tracer/): it decides the traced graph, so the compilations of a function
TRACING_READS = ("allow_opaque", "fuse_attention", "symm_mem_max_bytes")

SETTINGS = tuple(sorted({"simplify", *TRACING_READS, *(
    name for stage in (*GRAPH_STAGES, JOINT, *LOOP_STAGES) for name in stage.settings)}))
_values = operator.attrgetter(*SETTINGS)


def snapshot(backend: Backend | None = None):
    """The settings a compilation reads (``backend``'s too), as ``config`` has them now."""
    names = SETTINGS + (backend.reads if backend is not None else ())
    return types.SimpleNamespace(**{name: getattr(config, name) for name in names})


def settings_key(settings=None) -> tuple:
    """What the caches key a compilation by, of the settings: those of a ``snapshot`` (its
    backend's among them), or by default config's now (read on every call of a jitted
    function; a backend's own join through its ``cache_key``)."""
    if settings is None:
        return _values(config)
    return tuple(sorted(vars(settings).items()))


def _run(stages: Stages, stage: Stage, ir, settings, target=None):
    return stages.run(stage.name, stage if stage.on(settings, target) else _same, ir,
                      settings, target)


def _same(ir, *_):
    return ir


@contextlib.contextmanager
def under(settings):
    """``config`` as ``settings`` has it, for the code that reads it below the stages (a
    backend's code generator, the tracing of derivative rules), with the collector paused
    (NOTE [collector paused while compiling]). Only the settings that differ are set: threads
    compiling at once under the same settings never restore each other's (config is
    process-wide)."""
    with config.patch(**{k: v for k, v in vars(settings).items() if getattr(config, k) != v}), \
            collector_paused():
        yield


def simplified(graph: Graph, settings, stages: Stages | None = None,
               on_pass: Callable[[str, Graph], None] | None = None) -> Graph:
    """``graph`` through GRAPH_STAGES (none where ``settings.simplify`` is off);
    ``on_pass(name, graph)`` sees the graph after each (the debug report draws them)."""
    stages = stages or Stages()
    if not settings.simplify:
        return graph
    for stage in GRAPH_STAGES:
        graph = _run(stages, stage, graph, settings)
        if on_pass is not None:
            on_pass(stage.name, graph)
    return graph


def training(graph: Graph, wrt, seeded, kept, settings, stages: Stages):
    """TRAINING: the forward and backward graphs of ``graph`` for the inputs ``wrt`` and the
    outputs ``seeded``, and the inputs the backward reads where they are; ``kept``: the
    inputs a call does not write (NOTE [forward and backward programs])."""
    with under(settings):
        joint = stages.run("joint", JOINT, graph, settings, wrt=wrt, seeded=seeded)
        joint = simplified(joint, settings, stages)
        forward, backward, read = stages.run("split", SPLIT, joint, settings,
                                             n_primals=len(graph.inputs),
                                             n_outputs=len(graph.outputs), unchanged=kept,
                                             keep=False)
    stages.record("forward", forward, 0.0)
    return forward, backward, read


def scheduled(graph: Graph, backend: Backend, settings, stages: Stages):
    """``graph`` (simplified) through LOOP_STAGES for ``backend``'s code generator (what its
    ``target`` accepts): the loop program and its memory plan."""
    with under(settings):
        target = backend.target()
        program = graph
        for stage in LOOP_STAGES[:-1]:
            program = _run(stages, stage, program, settings, target)
        return program, _run(stages, LOOP_STAGES[-1], program, settings, target)


def compiled(graph: Graph, backend: Backend, settings, stages: Stages,
             schedule: tuple | None = None) -> Callable:
    """``graph`` (simplified) made runnable by ``backend``: interpreted, or scheduled (or
    given ``scheduled``'s ``schedule``) and generated (NOTE [pipeline]). Runs under
    ``settings``, which a backend's code generator may read from config."""
    with under(settings):
        if backend.target is None:
            return stages.run("compile", backend.factory, graph, keep=False)
        program, plan = schedule or scheduled(graph, backend, settings, stages)
        return generated(backend.name, program, plan, stages)


def generated(backend: str, program, plan=None, stages: Stages | None = None) -> Callable:
    """A loop program (``scheduled``'s, or one made by hand) compiled by ``backend``'s code
    generator; ``plan``: its memory plan (by default one without a pool)."""
    stages = stages or Stages()
    return get_backend(backend).factory(
        program, plan or memory.plan(program, pool=False), stages,
        lambda body: compiled_body(body, backend, stages))


_BODIES: dict = {}  # (body digest, backend, settings) -> its compiled program


def compiled_body(graph: Graph, backend: str, into: Stages | None = None) -> Any:
    """A control-flow body (or branch) as a program of its own on ``backend``: simplified and
    compiled once per body, backend and settings (NOTE [control-flow primitives], NOTE [native
    loops]). Its stages are recorded in ``into`` too (the program that calls it), each named
    ``body <digest>.<stage>``, when it is compiled."""
    chosen = get_backend(backend)
    key = (graph.digest, chosen.cache_key(), settings_key())
    if key not in _BODIES:
        settings, stages = snapshot(chosen), Stages("control-flow body")
        _BODIES[key] = compiled(simplified(graph, settings, stages), chosen, settings, stages)
        for name, seconds in (stages.seconds.items() if into is not None else ()):
            into.record(f"body {graph.digest[:8]}.{name}", stages.irs.get(name), seconds)
    return _BODIES[key]
