"""Trace a whole Python function: pytree arguments in, a graph plus output structure out."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import attrs
import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from ..errors import (ConcretizationError, OpError, PlaitError, TraceError,
                      UnsupportedOpError)
from ..graph import Graph, TensorType
from .aten import eager_layout  # (importing tracer/aten.py registers the handlers)
from . import collectives as _collectives  # noqa: F401
from .custom import traceable_apply
from . import linalg as _linalg  # noqa: F401
from . import nn as _nn  # noqa: F401
from .strided import (address_order, broadcast_dims, compact, dense_order,
                      inverse_permutation, passed, passed_order)
from .sizes import Sizes, symbolic_sizes
from .state import (State, bindings, follow, layout_key, module_state, reach,
                    refuse_dtensor, slot_guards)
from .trace import (Trace, TracerTensor, captured_write_error, check_dtype, is_dense,
                    state_writes, tracing)


@attrs.frozen
class Static:
    """An argument that is part of the compilation key rather than a traced input."""

    value: Any

    def leaf(self, results: list[torch.Tensor]) -> Any:
        return self.value


@attrs.frozen
class Permuted:
    """A result leaf that eager lays out as a permutation of its dims (a channels-last
    image, a transpose): the graph computes it in the order of eager's addresses, and the
    call returns that output permuted back, a view with eager's strides (NOTE [eager's
    layouts of results])."""

    index: int  # of the graph output
    permutation: tuple[int, ...]

    def leaf(self, results: list[torch.Tensor]) -> torch.Tensor:
        return results[self.index].permute(self.permutation)

    def unpermuted(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, of the leaf's shape, in its graph output's order."""
        return t.permute(inverse_permutation(self.permutation))


@attrs.frozen
class TracedFunction:
    """A traced function: its graph, and how graph values map back to Python values.

    Graph outputs are the tensor leaves of the result, in ``out_tree`` order, followed by the
    new values of the inputs the function mutated (``mutated_inputs`` indexes tensor inputs).
    ``out_leaves`` holds each result leaf: an int (position among graph outputs) for a tensor
    leaf, ``Permuted`` for one returned as a permuted view of its graph output, or
    ``Static(value)`` for a non-tensor leaf returned as is (``leaf(results)`` for both).
    """

    graph: Graph
    out_tree: pytree.TreeSpec
    out_leaves: tuple
    mutated_inputs: tuple[int, ...]
    # Tracers of enclosing traces the function captured: the graph's last inputs, in order.
    captured: tuple = ()
    # The captured state the graph reads after the arguments' tensors (NOTE [live state])
    state: State | None = None
    # (graph of the graph's inputs, bool): what the trace took a branch on (NOTE [value
    # guards]); it holds for inputs where each graph computes its bool again
    guards: tuple = ()
    # A dynamic trace's size symbols and the guards on them (NOTE [dynamic dimensions])
    sizes: Sizes | None = None


def _as_plait_error(e: RuntimeError) -> PlaitError | None:
    """Some misuses surface as torch's own RuntimeErrors, before plait's dispatch sees them."""
    message = str(e)
    if "mutating a non-functional tensor" in message:  # functionalize's check, in C++
        return captured_write_error()
    if "isFunctionalTensor(base_)" in message:  # a functionalize inside another
        return TraceError(
            "torch.func.functionalize(f) called inside a function plait traces: plait's "
            "traces are functionalized already, and torch cannot nest functionalize. Call f "
            "itself there (torch.func.functionalize(f) passed to plait directly is fine).")
    if "no rule registered for HigherOrderOperator" in message:
        op = message.split("HigherOrderOperator ", 1)[1].split(" ", 1)[0]
        return UnsupportedOpError(
            f"torch's higher-order op {op} reached plait's trace by a name bound before "
            "tracing began (from torch._higher_order_ops... import ...). Call plait's own "
            "(plait.cond, plait.while_loop, plait.scan), or torch's through its module "
            f"(torch.cond, torch._higher_order_ops.{op}), which plait traces as its own.")
    if "not allocated" in message or "unallocated storage" in message:
        return ConcretizationError(
            "an operation read the data of a traced tensor directly (.tolist(), or a tensor "
            "of split sizes or indices given to an op that needs Python numbers), but under "
            "plait.jit its value is only known when the compiled function runs. Use "
            "torch.where(condition, a, b) instead of a Python choice, or pass such values as "
            "a static argument (static_argnums)")
    return None


_FUNCTIONALIZED = torch.func.functionalize(lambda: None).__code__


def _traceable(fn: Callable) -> Callable:
    """The function to trace for ``fn``: a ``torch.func.functionalize`` wrapper traces as the
    function it wraps (a trace is functionalized already, and torch cannot nest
    functionalize: it has the same mutations of its inputs either way), and a custom
    function's ``apply`` as plait's (NOTE [custom functions])."""
    while getattr(fn, "__code__", None) is _FUNCTIONALIZED:
        fn = fn.__wrapped__
    return traceable_apply(fn)


def _module_dicts(module: torch.nn.Module) -> list[tuple[dict, dict]]:
    """The dicts of a module tree (each module's attributes, parameters, buffers and
    submodules), each with a copy of what it holds now."""
    return [(d, dict(d)) for m in module.modules()
            for d in (vars(m), m._parameters, m._buffers, m._modules)]


def _check_kept(module: torch.nn.Module, structure: tuple, tensors: list,
                saved: list[tuple[dict, dict]]) -> None:
    """The traced function must leave a module's parameters and buffers as they were: the
    graph takes those as its inputs, and each call reads the module's anew (NOTE [live
    state]). One that made, dropped or replaced some (holding this trace's tracers, which
    have no memory) is put back as it was, and the trace refused."""
    after = module_state(module)
    if list(map(id, after.tensors)) == list(map(id, tensors)):
        return
    for d, copy in saved:
        d.clear()
        d.update(copy)
    before, now = bindings(structure), bindings(after.structure)
    changed = sorted(set(before) ^ set(now) | {
        n for n in set(before) & set(now) if tensors[before[n]] is not after.tensors[now[n]]})
    raise TraceError(
        f"the traced function changed the parameters or buffers of its "
        f"{type(module).__name__} module while it ran ({', '.join(changed)}): plait compiles "
        "a module's tensors as inputs and reads them at each call, so a trace must leave "
        "them as they were. A module that makes them on its first call (the function of "
        "torch.func.linearize, which folds its constants then; a lazy module) must be "
        "called once outside plait first. The module was put back as it was.")


def _input_layout(x: torch.Tensor) -> tuple[bool, tuple | None]:
    """Whether an argument is dense in eager, and else its layout where known (NOTE [eager
    layouts] in tracer/aten.py): what jit keys of a tensor, or what a tracer of an enclosing
    trace knows (a nested transform's argument, vmap's example)."""
    if isinstance(x, TracerTensor):
        return x._dense, x._layout
    return (True, None) if is_dense(x) else (False, layout_key(x))


def _strided_input(trace: Trace, x: torch.Tensor) -> TracerTensor:
    """The tracer of argument ``x``, whose graph input is ``compact(x)``, permuted back into
    ``x``'s dims and broadcast (NOTE [strided arguments])."""
    one = compact(x)
    tracer = trace.new_input(TensorType.of(one), *_input_layout(one))
    order = passed_order(x)
    if order is not None:
        tracer = trace.bind("transpose", tracer, permutation=inverse_permutation(order))
    if broadcast_dims(x):
        tracer = trace.bind("broadcast_in_dim", tracer, shape=tuple(x.shape),
                            broadcast_dimensions=tuple(range(x.ndim)))
    tracer._dense, tracer._layout = False, layout_key(x)
    return tracer


# NOTE [eager's layouts of results]
# A graph value is a dense block in the order of its dims, while eager lays a result out as
# its ops do: a convolution of a channels-last image is channels-last, ``x.t()`` is a
# transpose. A jit's call returns what eager returns where eager's layout is the dense
# block of some order of the dims: the graph's output is the result transposed into that
# order (which simplification cancels against a layout pass's transpose back, so a
# channels-last convolution's output is written once, where it lies) and the call permutes
# it back, a view with eager's strides. Eager's layout is derived from the ops that made the
# result (``eager_layout``: meta kernels along the chain), which is eager's as long as the
# ops dispatched are eager's: ``Tensor.contiguous()``, which torch skips for a tracer (it
# reports itself contiguous), copies where eager's layout is another (tracer/aten.py). A
# transpose of an argument comes back as a view of it, as eager's; a result with gaps or an
# offset (a slice) comes back contiguous, a new tensor.
def _eager_order(tracer: TracerTensor) -> tuple[int, ...] | None:
    """The order of ``tracer``'s dims by eager's addresses where that is not theirs and its
    elements fill a block (NOTE [eager's layouts of results]), else None."""
    if tracer.ndim < 2 or tracer.numel() < 2:
        return None
    layout = eager_layout(tracer)
    return None if layout is None else dense_order(tracer.shape, layout[0])


def _written_as_passed(trace: Trace, tracer: TracerTensor, x: torch.Tensor):
    """The value written into argument ``x`` (``tracer``'s now), as its graph input holds it:
    in the order of its addresses (NOTE [strided arguments])."""
    order = address_order(x)
    return trace.value_of(tracer if order is None else
                          trace.bind("transpose", tracer, permutation=order))


def _is_size(x) -> bool:
    return isinstance(x, torch.Size)  # a static leaf: torch's pytree would rebuild a tuple


def trace_function(fn: Callable, leaves: Sequence[Any], in_tree: pytree.TreeSpec,
                   live: bool = False, evaluate: Callable | None = None,
                   eager_layouts: bool = False, dynamic: dict | None = None) -> TracedFunction:
    """Trace ``fn(*args, **kwargs)`` where ``(args, kwargs) = unflatten(leaves, in_tree)``.

    Tensor leaves become graph inputs (in order); ``Static`` leaves are passed unwrapped.
    With ``live`` (a jit's trace), an argument that is not contiguous is an input of the
    view of its memory it reads (NOTE [strided arguments]), and the state the function
    captures (its modules' parameters and buffers,
    then the other captured tensors it reads) becomes further inputs (NOTE [live state]),
    and with ``evaluate`` too (``evaluate(graph, tensors) -> outputs``), a branch on a bool
    computed from the call's tensors takes the branch they take (NOTE [value guards]). With
    ``eager_layouts``, a result eager lays out permuted is output in that order (NOTE
    [eager's layouts of results]). ``dynamic`` maps a tensor leaf's position among them to
    the dimensions traced as size symbols (NOTE [dynamic dimensions]).
    """
    trace, fn = Trace(), _traceable(fn)
    sizes = Sizes() if dynamic else None
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    roots = (fn, *[x.value for x in leaves if isinstance(x, Static)
                   and isinstance(x.value, torch.nn.Module)]) if live else ()
    reachable = reach(roots)
    modules = [follow(roots[r], path) for r, path in reachable.modules]
    structures, state_tensors = [], []
    saved = [_module_dicts(module) for module in modules]
    for module in modules:
        read = module_state(module)
        structures.append(read.structure)
        state_tensors.append(read.tensors)
    given = [leaves[i] for i in tensor_pos] + [t for ts in state_tensors for t in ts]
    viewed = {i for i, x in enumerate(given) if live and not isinstance(x, TracerTensor)
              and passed(x) is not x}
    with tracing(trace), symbolic_sizes(sizes) if sizes else contextlib.nullcontext():
        inputs = []
        for x in given:
            where = "a function argument" if len(inputs) < len(tensor_pos) else \
                "a module's parameter or buffer"
            check_dtype(x, where)
            refuse_dtensor(x, where)
            # a state tensor's layout is keyed as contiguous or not, and its strides where
            # not (state.tensor_keys)
            layout = _input_layout(x) if len(inputs) < len(tensor_pos) else (is_dense(x), None)
            if len(inputs) in viewed:
                inputs.append(_strided_input(trace, x))
            elif sizes is not None and len(inputs) in dynamic and layout[0] is True:
                inputs.append(trace.new_input(sizes.symbolic(x, len(inputs),
                                                             dynamic[len(inputs)]), *layout))
            else:
                inputs.append(trace.new_input(TensorType.of(x), *layout))
        originals = [t._value for t in inputs]
        if live and evaluate is not None:
            trace.arguments = list(map(passed, given))
            trace.evaluate = evaluate
        trace.live = {key: follow(roots[r], path)
                      for key, (r, path) in reachable.tensors.items()}

        def flat_fn(*tracers):
            filled = list(leaves)
            for i, t in zip(tensor_pos, tracers):
                filled[i] = t
            filled = [x.value if isinstance(x, Static) else x for x in filled]
            args, kwargs = pytree.tree_unflatten(filled, in_tree)
            with contextlib.ExitStack() as stack:
                if live:
                    trace.state_wrappers = [
                        (w, isinstance(t, torch.nn.Parameter)) for w, t in zip(
                            tracers[len(tensor_pos):], (t for ts in state_tensors for t in ts))]
                else:
                    stack.enter_context(state_writes(trace))
                state = iter(tracers[len(tensor_pos):])
                for module, structure, tensors in zip(modules, structures, state_tensors):
                    mine = [next(state) for _ in tensors]
                    stack.enter_context(_reparametrize_module(module, {
                        name: mine[i] for name, i in bindings(structure).items()}))
                result = fn(*args, **kwargs)
            raw.append(pytree.tree_flatten(result, is_leaf=_is_size))  # before functionalize
            return result

        raw = []
        try:
            # torch.autograd inside the function (torch.func.vjp) replays the views written
            # in place, rather than addressing them by strides, which tracers do not model
            with torch.autograd._force_original_view_tracking(True):
                out = torch.func.functionalize(flat_fn, remove="mutations")(*inputs)
        except PlaitError:
            raise
        except RuntimeError as e:  # torch's own checks (in C++ composites) land here
            raise _as_plait_error(e) or OpError(
                f"PyTorch raised while tracing: {e}. If eager PyTorch runs this call with "
                "these arguments, plait does not support it yet: run that part outside "
                "plait.jit, and please report it.") from None
        for module, structure, tensors, dicts in zip(modules, structures, state_tensors, saved):
            _check_kept(module, structure, tensors, dicts)
        # functionalize unwraps the result's tensors in order, but may rebuild containers
        # (torch.Size becomes a tuple): take the structure and non-tensor leaves from the raw
        # result, and the tensors from functionalize's.
        results = iter([x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)])
        raw_leaves, out_tree = raw[0]
        outputs, out_leaves = [], []
        for leaf in raw_leaves:
            if isinstance(leaf, torch.Tensor):
                tracer = next(results)
                # NOTE [dynamic dimensions]: eager's layouts are derived for concrete sizes
                order = _eager_order(tracer) if eager_layouts and sizes is None else None
                if order is None:
                    out_leaves.append(len(outputs))
                else:
                    out_leaves.append(Permuted(len(outputs), inverse_permutation(order)))
                    tracer = trace.bind("transpose", tracer, permutation=order)
                outputs.append(trace.value_of(tracer))
            else:
                out_leaves.append(Static(leaf))
        mutated = [i for i, (t, v) in enumerate(zip(inputs, originals)) if t._value != v]
        if any(i in viewed and broadcast_dims(given[i]) for i in mutated):
            raise TraceError(
                "the function writes into an argument that repeats its elements (stride 0, "
                "made by expand), as eager refuses too: more than one element of it is one "
                "memory location. Pass it cloned (x.clone()) or contiguous.")
        outputs += [_written_as_passed(trace, inputs[i], given[i]) if i in viewed
                    else inputs[i]._value for i in mutated]
        for k, value in trace.captured_writes():  # captured inputs follow the arguments'
            mutated.append(len(inputs) + k)
            outputs.append(value)
    graph = trace.builder.build(outputs)
    fixed = list(trace.baked.values()) + list(trace.pinned.values())
    state = State(roots, reachable.modules, tuple(
        reachable.tensors[key] for key in trace.lifted), tuple(
        (t, t._version) for t in fixed), tuple((*reachable.tensors[key], t)
                                               for key, t in trace.pinned.items()),
        *slot_guards(reachable.slots))
    return TracedFunction(graph, out_tree, tuple(out_leaves), tuple(mutated),
                          tuple(trace.captured), state if live else None, tuple(trace.guards),
                          sizes.check() if sizes is not None else None)


