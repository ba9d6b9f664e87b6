"""grad, vjp, jvp, vmap, jacrev, jacfwd, hessian: drop-in replacements for ``torch.func``.

NOTE [how a transform runs]
A transform traces the function it wraps into a graph (a nested trace when it is called
inside ``jit`` or another transform: tracers of enclosing traces that the function captures
become extra graph inputs), transforms that graph with a pass (``passes/autodiff.py``,
``tracer/batching.py``) and inlines the result into the enclosing trace. Called on real
tensors, a transformed function runs through ``jit`` (so it is traced once per signature and
cached). The one-shot forms (``jvp(f, ...)``, ``vjp(f, ...)``, ``vmap(f)(...)``) keep that
jit per function and options (``_staged_for``), so calling them again on the same function
reuses its compilations, as calling one ``g = grad(f)`` again does (``grad(f)(x)`` written
inline makes a new function, traced at each call). Inside a traced function the
user holds ``functionalize`` wrappers; a transform unwraps them to tracers on entry and wraps
its results again on exit.
"""
from __future__ import annotations

import functools
import types
import weakref
from typing import Any, Callable, Sequence

import torch
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch.utils import _pytree as pytree

from .config import config
from .errors import TraceError, TransformError
from .passes import autodiff
from .tracer.interpret import inline
from .tracer import trace_function
from .tracer.strided import broadcast_dims, inverse_permutation, passed_order
from .tracer.trace import (TracerTensor, bind, current_trace, foreign_mode_active, on_tracers,
                           tracing_active)


def vjp_graph(graph, wrt: Sequence[int]):
    """``autodiff.vjp`` under the settings tracing reads now (attention fusion and layout,
    channels-last convolutions), which the passes take as arguments."""
    return autodiff.vjp(graph, wrt, config.fuse_attention, config.channels_last,
                        config.attention_layout)


# ---------------------------------------------------------------------------------------
# Running a transform body on tracers
# ---------------------------------------------------------------------------------------
def _staged(body: Callable) -> Callable:
    """``body(*args)`` works on tracers of the current trace. Outside any trace, run it
    through a cached jit; inside one, run it directly (its nodes land in the enclosing
    graph), converting between the user's functionalize wrappers and tracers."""
    from .api import jit

    inside = on_tracers(_under_grad_modes(body))
    jitted = jit(inside)

    @functools.wraps(body)
    def run(*args, **kwargs):
        if tracing_active():
            return inside(*args, **kwargs)
        # with grad mode on and an input (or captured tensor) that requires grad, torch.autograd
        # records the call, as it records torch.func's (NOTE [jit under torch.autograd])
        if not torch.is_inference_mode_enabled():
            return jitted(*args, **kwargs)
        # tensors a trace makes (a Jacobian's basis) are guarded by their version counters,
        # which inference tensors lack: trace and run outside inference mode, recording nothing
        with torch.inference_mode(False), torch.no_grad():
            return jitted(*args, **kwargs)

    return run


# NOTE [transforms under no_grad]
# A transform called inside a traced function while grad mode is off (``torch.no_grad()``
# around ``grad(g)(x)`` inside the function ``grad(h)`` differentiates) computes its own
# derivatives as ever (its trace starts with grad mode on), but its results are, to the
# enclosing levels, values computed under no_grad, as an ATen op's are (NOTE [grad mode while
# tracing]): they pass through ``no_grad`` (and ``no_fwd_grad`` with forward-mode AD off),
# as torch.func's levels treat them. Its nodes are bound into the enclosing trace directly,
# not through ATen dispatch, so they are marked here.
def _under_grad_modes(body: Callable) -> Callable:
    """``body`` whose tracer results pass through the markers of the grad modes that are off
    where it is called (NOTE [transforms under no_grad])."""
    def run(*args, **kwargs):
        off = [prim for prim, on in (("no_grad", torch.is_grad_enabled()),
                                     ("no_fwd_grad", torch._C._is_fwd_grad_enabled())) if not on]
        out = body(*args, **kwargs)
        for prim in off:
            out = pytree.tree_map_only(TracerTensor, lambda t: bind(prim, t) if (
                t.dtype.is_floating_point or t.dtype.is_complex) else t, out)
        return out

    return run


_BUILTIN_BODIES: dict = {}  # builtin function -> {key: staged body} (builtins live forever)


def _staged_for(func: Callable, key: tuple, body: Callable) -> Callable:
    """``_staged(body)``, made once per (``func``, ``key``) (``_kept_for``)."""
    return _kept_for(func, key, lambda: _staged(body))


def _kept_for(func: Callable, key: tuple, make: Callable) -> Callable:
    """``make()``, made once per (``func``, ``key``): ``key`` names everything else
    the result depends on. A Python function keeps its bodies itself, so they go with it (the
    body refers to ``func``: kept anywhere else, they would keep it alive), under the
    attribute ``_plait_staged`` with a weak reference to their owner: ``functools.wraps``
    copies the attribute into a wrapper, which must not take the wrapped function's bodies.
    A module's builtin (``torch.sin``) keeps them in ``_BUILTIN_BODIES``; other callables
    (modules, partials, bound methods, which hold their object) are not cached."""
    if isinstance(func, types.BuiltinFunctionType) and \
            isinstance(getattr(func, "__self__", None), (types.ModuleType, type(None))):
        bodies = _BUILTIN_BODIES.setdefault(func, {})
    elif isinstance(func, types.FunctionType):
        owner, bodies = vars(func).get("_plait_staged", (None, None))
        if owner is None or owner() is not func:
            owner, bodies = weakref.ref(func), {}
            func._plait_staged = owner, bodies
    else:
        return make()
    if key not in bodies:
        bodies[key] = make()
    return bodies[key]


class _Traced:
    """A function traced on some arguments: its graph plus how to call and read it."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, writable: bool = False):
        leaves, self.in_tree = pytree.tree_flatten((args, kwargs))
        self.tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        # A nested trace runs its own functionalize; the enclosing one's layer is set aside
        # meanwhile (the tracers it holds are unwrapped where they are used).
        with temporarily_clear_interpreter_stack():
            self.traced = trace_function(fn, leaves, self.in_tree)
        mutated = self.traced.mutated_inputs
        if mutated and not writable:
            if mutated[-1] >= len(self.tensor_pos):
                raise TraceError("a function under plait.jvp/vmap writes into a module "
                                 "buffer (BatchNorm's running statistics, in training mode); "
                                 "only grad and vjp write such state. Call model.eval(), or "
                                 "give the BatchNorm track_running_stats=False "
                                 "(torch.func.replace_all_batch_norm_modules_ does so).")
            raise TraceError("a function under a plait transform mutates one of its tensor "
                             "arguments; transforms need functions without side effects "
                             "on their inputs (clone the argument first).")
        self.inputs = [leaves[i] for i in self.tensor_pos] + list(self.traced.captured)
        self.graph = self.traced.graph

    def writes(self, values: Sequence[Any], differentiated: Sequence[int] = ()) -> list:
        """(tensor, new value) for each argument or captured tracer the function wrote (new
        values: the graph's last outputs, in ``values``): BatchNorm's running statistics in
        buffers passed to ``functional_call`` or held by a module (NOTE [writes to captured
        tracers]). An argument being differentiated may not be mutated (as in torch.func)."""
        mutated = self.traced.mutated_inputs
        if differentiated and set(mutated) & set(differentiated):
            raise TraceError("a function under plait.grad/vjp mutates an argument it is "
                             "differentiated with respect to; clone it first, or "
                             "differentiate with respect to other arguments.")
        return [(self.inputs[i], v) for i, v in zip(mutated, values[len(values) - len(mutated):])]

    @staticmethod
    def write_back(writes: list) -> None:
        """Write the new values (``writes``' pairs) into what the function wrote, as eager
        would."""
        for dst, value in writes:
            current_trace().rebind(dst, value)

    def leaf_index(self, leaf_positions: Sequence[int]) -> list[int]:
        """Graph input indices of the given argument leaves (which must be tensors)."""
        return [self.tensor_pos.index(p) for p in leaf_positions]

    def outputs(self, values: Sequence[Any]):
        """The function's result structure, filled with graph output ``values``."""
        leaves = [values[x] if isinstance(x, int) else x.leaf(values)
                  for x in self.traced.out_leaves]
        return pytree.tree_unflatten(leaves, self.traced.out_tree)

    def structure(self):
        """The function's result with ``_TENSOR`` for each tensor (non-tensors as they are)."""
        return self.outputs([_TENSOR] * len(self.graph.outputs))


def _argnums(argnums, n_args: int) -> tuple[int, ...]:
    """``argnums`` (an int or a tuple of ints, as torch.func takes) as argument positions,
    each checked to name one of the ``n_args`` arguments, once (torch.func's checks and
    wording)."""
    if not isinstance(argnums, (int, tuple)) or isinstance(argnums, bool):
        raise TransformError(f"argnums must be int or Tuple[int, ...], got: {type(argnums)}; "
                             "name the differentiated arguments by position")
    nums = (argnums,) if isinstance(argnums, int) else argnums
    for num in nums:
        if not isinstance(num, int) or isinstance(num, bool):
            raise TransformError(f"argnum must be int, got: {type(num)} (in argnums={argnums!r})")
        if not -n_args <= num < n_args:
            raise TransformError(f"Got argnum={num}, but only {n_args} positional inputs; "
                                 "argnums names positional arguments of the call")
    if not nums:
        raise TransformError("argnums must be non-empty: name at least one argument")
    positions = tuple(n % n_args for n in nums)
    if len(set(positions)) != len(positions):
        raise TransformError(f"argnums elements must be unique, got {argnums}; name each "
                             "argument once")
    return positions


_TENSOR = object()  # stands for each tensor result where only the results' structure matters


# How torch.func's messages name each call (plait's say the same, so code matching them works)
_GRAD, _VJP, _JVP = "grad_and_value(f)(*args)", "vjp(f, *primals)", "jvp(f, primals, tangents)"


def _only_tensors(out, api: str) -> None:
    """The transforms differentiate and batch tensors: a function returns tensors (or
    pytrees of them) besides its aux, as torch.func requires; ``vjp`` and ``jvp`` at least
    one. ``out``: the result, or its structure with ``_TENSOR`` for each tensor
    (``_Traced.structure``)."""
    leaves = pytree.tree_leaves(out)
    if leaves in ([], [None]) and api in (_VJP, _JVP):
        raise TransformError(f"{api}: Expected f to be a function that has non-empty output "
                             f"(got output = {out!r}); return at least one tensor")
    for leaf in leaves:
        if not (leaf is _TENSOR or isinstance(leaf, torch.Tensor)):
            raise TransformError(f"{api}: expected f(*primals) to return only tensors, got "
                                 f"unsupported type {type(leaf)}; return other values as aux "
                                 "(has_aux=True) or outside the transformed function")


def _argnum_leaves(args: tuple, kwargs: dict, argnums: int | tuple[int, ...]):
    """Positions (in the flattened (args, kwargs)) of the leaves of the chosen arguments."""
    nums = _argnums(argnums, len(args))
    positions, start = {}, 0
    for i, a in enumerate(args):
        n = len(pytree.tree_leaves(a))
        positions[i] = list(range(start, start + n))
        start += n
    chosen = [positions[num] for num in nums]
    flat = pytree.tree_leaves((args, kwargs))
    for pos in chosen:
        for p in pos:
            x = flat[p]
            if not (isinstance(x, torch.Tensor) and (x.dtype.is_floating_point
                                                     or x.dtype.is_complex)):
                raise TransformError(f"argnums={argnums}: differentiated arguments must be "
                                 f"floating-point or complex tensors (or pytrees of them), got "
                                 f"{type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype}")
    return chosen


def _split_aux(out, has_aux: bool, api: str):
    """``(output, aux)``: with ``has_aux`` the function returns a pair, a tuple, whose aux
    holds only tensors (torch.func's contract)."""
    if not has_aux:
        return out, None
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TransformError(f"{api}: output of function f should be a tuple: (output, aux) "
                             f"if has_aux is True, got a {type(out).__name__}; return the "
                             "pair (output, aux)")
    for leaf in pytree.tree_leaves(out[1]):
        if not (leaf is _TENSOR or isinstance(leaf, torch.Tensor)):
            raise TransformError(f"{api}: aux: Expected tensors, got unsupported type "
                                 f"{type(leaf)}; return other values outside the transformed "
                                 "function")
    return out


# ---------------------------------------------------------------------------------------
# Reverse mode
# ---------------------------------------------------------------------------------------
def _vjp_body(func: Callable, argnums, has_aux: bool, args: tuple, kwargs: dict,
              seeds_for: Callable, write_back: bool = True):
    """Trace ``func``, differentiate it and inline the result. ``seeds_for(main, types)``
    gives the cotangents ({graph output index: tracer}) of the non-aux result ``main``, whose
    tensors are given as graph output indices. Returns the result and the cotangents of the
    chosen arguments' leaves, one list per argument. With ``write_back``, arguments the
    function mutates (and does not differentiate) get their new values."""
    chosen = _argnum_leaves(args, kwargs, argnums)
    t = _Traced(func, args, kwargs, writable=True)
    types = t.graph.output_types
    api = _GRAD if seeds_for is _scalar_seed else _VJP
    main, _ = _split_aux(t.structure(), has_aux, api)
    if api == _VJP:
        _only_tensors(main, api)
    slots = t.outputs(list(range(len(types))))  # graph output indices, in the result's place
    main = slots[0] if has_aux else slots
    seeds = seeds_for(main, types)
    cotangents = [seeds[k] if k in seeds else autodiff.zeros(ty) for k, ty in enumerate(types)]
    wrt = [i for pos in chosen for i in t.leaf_index(pos)]
    results = inline(vjp_graph(t.graph, wrt), t.inputs + cotangents)
    values, grads = results[:len(types)], iter(results[len(types):])
    writes = t.writes(values, wrt)  # checked where the forward pass wrote them too
    if write_back:
        t.write_back(writes)
    return t.outputs(values), [[next(grads) for _ in pos] for pos in chosen]


def _as_argnums_tree(args, argnums, grouped):
    """Cotangent leaves, per chosen argument, rebuilt in that argument's structure."""
    trees = [pytree.tree_unflatten(g, pytree.tree_structure(args[n])) for n, g in
             zip((argnums,) if isinstance(argnums, int) else argnums, grouped)]
    return trees[0] if isinstance(argnums, int) else tuple(trees)


def _scalar_seed(main, types):
    """grad's cotangent: 1 for its one scalar, floating-point output."""
    if not isinstance(main, int):
        raise TransformError(f"{_GRAD}: Expected f(*args) to return a Tensor, got "
                             f"{type(main)}; grad needs one scalar tensor (use vjp or jacrev "
                             "for other outputs)")
    if types[main].shape != () or not types[main].dtype.is_floating_point:
        raise TransformError(f"{_GRAD}: Expected f(*args) to return a scalar Tensor, got "
                             f"{types[main]}; grad needs one floating-point scalar tensor: "
                             "use vjp or jacrev for other outputs")
    ty = types[main]
    return {main: bind("full", shape=(), value=1.0, dtype=ty.dtype, device=ty.device)}


def grad_and_value(func: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False):
    """As ``torch.func.grad_and_value``: ``(gradient, value)`` of a function returning one
    scalar (``(gradient, (value, aux))`` with ``has_aux``), w.r.t. the arguments ``argnums``."""
    @_staged
    def body(*args, **kwargs):
        out, grouped = _vjp_body(func, argnums, has_aux, args, kwargs, _scalar_seed)
        return _as_argnums_tree(args, argnums, grouped), out

    return body


def grad(func: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False):
    """As ``torch.func.grad``: the gradient of a function returning one scalar w.r.t. the
    arguments ``argnums`` (``(gradient, aux)`` with ``has_aux``)."""
    both = grad_and_value(func, argnums, has_aux)

    @functools.wraps(func)
    def run(*args, **kwargs):
        g, out = both(*args, **kwargs)
        return (g, out[1]) if has_aux else g

    return run


def vjp(func: Callable, *primals, has_aux: bool = False):
    """As ``torch.func.vjp``: ``(output, vjp_fn)`` (``(output, vjp_fn, aux)`` with
    ``has_aux``), where ``vjp_fn(cotangents)`` returns one cotangent per primal. Inside a
    trace the forward pass is traced twice, and simplification (CSE) merges the copies."""
    if not tracing_active():
        return _recorded_vjp(func, primals, has_aux)
    main, aux = _split_aux(_forward(func, primals), has_aux, _VJP)
    _only_tensors(main, _VJP)
    vjp_fn = _traced_vjp_fn(func, primals, has_aux)
    return (main, vjp_fn, aux) if has_aux else (main, vjp_fn)


def _traced_vjp_fn(func: Callable, primals: tuple, has_aux: bool) -> Callable:
    """``vjp``'s ``vjp_fn`` inside a trace: ``func`` traced again and differentiated
    there (arguments it mutates were written by the forward pass already)."""
    argnums = tuple(range(len(primals)))

    def backward(primal_args, cotangents):
        def seeds(main_slots, types):
            slots = pytree.tree_leaves(main_slots)
            cts = _cotangent_leaves(main_slots, cotangents, [types[k].shape for k in slots])
            return dict(zip(slots, cts))

        _, grouped = _vjp_body(func, argnums, has_aux, tuple(primal_args), {}, seeds,
                               write_back=False)
        return tuple(pytree.tree_unflatten(g, pytree.tree_structure(p))
                     for g, p in zip(grouped, primal_args))

    staged = _staged_for(func, ("vjp", len(primals), has_aux), backward)

    def vjp_fn(cotangents):
        return staged(primals, cotangents)

    return vjp_fn


def _cotangent_leaves(outputs, cotangents, shapes) -> list:
    """``cotangents``' leaves, checked against the structure of the function's ``outputs``
    and the shapes of its tensors."""
    tree = pytree.tree_structure(outputs)
    cts, ct_tree = pytree.tree_flatten(cotangents)
    if tree != ct_tree:
        raise TransformError(f"vjp_fn: Expected pytree structure of cotangents to be the "
                             f"same as pytree structure of outputs to the function. "
                             f"cotangents: {ct_tree}, primal output: {tree}")
    for shape, ct in zip(shapes, cts):
        if not isinstance(ct, torch.Tensor) or tuple(ct.shape) != tuple(shape):
            raise TransformError(f"vjp_fn: a cotangent must be a tensor of the output's shape "
                             f"{list(shape)}, got {ct!r:.60}")
    return cts


def _recorded_vjp(func: Callable, primals: tuple, has_aux: bool):
    """``vjp`` called on real tensors: ``func`` runs once, jitted and recorded by
    torch.autograd (NOTE [jit under torch.autograd]); ``vjp_fn`` runs the compiled backward
    on the residuals saved then, so it answers for the values of that call (captured state
    included), as torch.func's does, however often it is called. With grad mode on, a primal
    that requires grad enters through an alias recorded by torch.autograd (one per primal, so
    a tensor passed twice gets a cotangent each time), and the outputs stay recorded, as
    torch.func's do; ``vjp_fn``'s cotangents are not recorded (``create_graph``)."""
    from .api import jit

    _argnum_leaves(primals, {}, tuple(range(len(primals))))  # floating-point tensors only, as torch.func
    flat, tree = pytree.tree_flatten(primals)
    tracked = torch.is_grad_enabled() and any(x.requires_grad for x in flat)
    leaves = [x.view_as(x) if tracked and x.requires_grad else x.detach().requires_grad_()
              for x in flat]
    jitted = _kept_for(func, ("jit",), lambda: jit(func))
    with torch.enable_grad():
        out = jitted(*pytree.tree_unflatten(leaves, tree))
    main, aux = _split_aux(out, has_aux, _VJP)
    _only_tensors(main, _VJP)
    outputs = pytree.tree_leaves(main)
    # the call, for vjp_fn inside a trace: its traced function, the tensors it read, and
    # their versions now
    last = getattr(jitted, "jitted", jitted).last_call()
    call = None if last is None or any(map(broadcast_dims, leaves)) else (
        last, [t._version for t in leaves + last[1]], [passed_order(x) for x in leaves])
    recording: list = []  # vjp_fn as a jitted function of the primals, made once

    def vjp_fn(cotangents, retain_graph: bool = True, create_graph: bool | None = None):
        """The cotangents of the primals (``retain_graph`` is always so: call it again;
        ``create_graph`` only where nothing is recorded, so that it changes nothing).
        Called inside a trace (``vmap(vjp_fn)``, ``vjp(vjp_fn, ...)``), the graph of the
        call is differentiated there, at the tensors that call read. Made under no_grad on
        primals that require grad and called with grad mode on, its results are recorded by
        torch.autograd as a function of the primals, as torch.func's are."""
        if tracing_active():
            _check_unwritten(call, leaves)
            return _vjp_of_call(call, leaves, main, cotangents, tree)
        recorded_by_torch = not tracked and torch.is_grad_enabled() and any(
            x.requires_grad for x in flat)
        if call is not None and (recorded_by_torch or foreign_mode_active()):
            # a dispatch mode (make_fx) or torch.func transform sees the jitted vjp's ops
            _check_unwritten(call, flat)
            if not recording:
                recording.append(jit(lambda primals, cts: _vjp_of_call(
                    call, primals, main, cts, tree)))
            return recording[0](list(flat), cotangents)
        if create_graph and (tracked or any(
                isinstance(c, torch.Tensor) and c.requires_grad
                for c in pytree.tree_leaves(cotangents))):
            raise TraceError("vjp_fn(create_graph=True) is not supported; take higher "
                             "derivatives by composing plait's transforms, e.g. "
                             "plait.vjp(lambda x: plait.vjp(f, x)[1](ct), x).")
        cts = _cotangent_leaves(main, cotangents, [o.shape for o in outputs])
        recorded = [(o, c) for o, c in zip(outputs, cts) if o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in recorded], leaves, [c for _, c in recorded],
                                    retain_graph=True, allow_unused=True) if recorded else ()
        grads = [g if g is not None else torch.zeros_like(x)
                 for g, x in zip(list(grads) or [None] * len(leaves), leaves)]
        return pytree.tree_unflatten(grads, tree)

    detach = functools.partial(pytree.tree_map_only, torch.Tensor, torch.Tensor.detach) \
        if not tracked else lambda tree: tree
    return (detach(main), vjp_fn, detach(aux)) if has_aux else (detach(main), vjp_fn)


def _check_unwritten(call, primals: list) -> None:
    """The vjp's call can be differentiated again (``_vjp_of_call``): its state was read back,
    and none of the tensors it read (``primals``, then the state) was written since (they
    would be read at their new values, where torch.func's vjp_fn answers for the old ones)."""
    if call is None:
        raise TraceError("vjp_fn of a plait.vjp made outside a traced function was called "
                         "inside one (or made under no_grad and recorded), and that call's "
                         "state cannot be read back (or a primal repeats its elements, made by "
                         "expand); call plait.vjp inside the traced function instead.")
    (_, state), versions, _ = call
    if [t._version for t in primals + state] != versions:
        raise TraceError("vjp_fn of a plait.vjp was called inside a traced function (or "
                         "recorded) after a tensor its function read was written in place; "
                         "call plait.vjp again, or inside the traced function.")


def _vjp_of_call(call, primals: list, main, cotangents, tree):
    """``vjp_fn`` of a ``vjp`` made on real tensors, inside a trace: the graph of that call
    (``Jitted.last_call``: its traced function and the state it read), differentiated at
    ``primals`` and the state (checked by ``_check_unwritten``)."""
    (traced, state), _, orders = call
    # what the call's program was given (NOTE [strided arguments])
    tensors = [p if o is None else p.permute(o) for p, o in zip(primals, orders)] + state
    graph = traced.graph
    leaves = [traced.out_leaves[k] for k in range(len(pytree.tree_leaves(main)))]
    cts = _cotangent_leaves(main, cotangents, [x.shape for x in pytree.tree_leaves(main)])
    # a result returned permuted (NOTE [eager's layouts of results]) seeds its graph output
    slots = [x if isinstance(x, int) else x.index for x in leaves]
    cts = [ct if isinstance(x, int) else x.unpermuted(ct) for x, ct in zip(leaves, cts)]
    summed: dict = {}  # an output returned several times gets the sum of its cotangents
    for k, ct in zip(slots, cts):
        summed[k] = ct if k not in summed else summed[k] + ct
    seeds = [summed.get(k, autodiff.zeros(t)) for k, t in enumerate(graph.output_types)]
    grads = inline(vjp_graph(graph, range(len(primals))), tensors + seeds)[len(graph.outputs):]
    grads = [g if o is None else g.permute(inverse_permutation(o))
             for g, o in zip(grads, orders)]
    current_trace().pin(tensors)  # a compilation holds while they are not written
    return pytree.tree_unflatten(grads, tree)


def _forward(func: Callable, primals: tuple):
    """func(*primals), traced and inlined (or jitted at top level) like a transform's."""
    def run(*p):
        t = _Traced(func, p, {}, writable=True)
        values = inline(t.graph, t.inputs)
        t.write_back(t.writes(values))
        return t.outputs(values)

    return _staged_for(func, ("forward",), run)(*primals)


# ---------------------------------------------------------------------------------------
# Forward mode and vectorization
# ---------------------------------------------------------------------------------------
def jvp(func: Callable, primals: tuple, tangents: tuple, *, strict: bool = False,
        has_aux: bool = False):
    """As ``torch.func.jvp``: ``(output, tangent of the output)`` (and ``aux``)."""
    if not isinstance(primals, tuple):
        raise TransformError(f"{_JVP}: Expected primals to be a tuple. E.g. it should be valid "
                             f"to call f(*primals); got a {type(primals).__name__}")
    if pytree.tree_structure(primals) != pytree.tree_structure(tangents):
        raise TransformError(f"{_JVP}: Expected primals and tangents to have the same python "
                             f"structure, got primals with structure "
                             f"{pytree.tree_structure(primals)} and tangents with structure "
                             f"{pytree.tree_structure(tangents)}")
    _only_tensor_primals(primals, _JVP, "primals")
    _only_tensor_primals(tangents, _JVP, "tangents")

    def body(primal_args, tangent_args):
        t = _Traced(func, primal_args, {})
        leaves = pytree.tree_leaves(tangent_args)
        wrt = list(range(len(t.tensor_pos)))
        if strict:
            active = autodiff.depends_on(t.graph, wrt)
            if any(v.node not in active for v in t.graph.outputs):
                raise TransformError(f"{_JVP[:-1]}, strict=True): The output of f is "
                                     "independent of the inputs. This is not allowed with "
                                     "strict=True (pass strict=False for a zero tangent)")
        for p, tan in zip(pytree.tree_leaves(primal_args), leaves):
            if isinstance(p, torch.Tensor) and tuple(p.shape) != tuple(tan.shape):
                raise TransformError(f"{_JVP}: a tangent of shape {list(tan.shape)} for a "
                                     f"primal of shape {list(p.shape)}; give each tangent "
                                     "its primal's shape")
        results = inline(autodiff.jvp(t.graph, wrt), t.inputs + [
            leaves[i] for i in t.tensor_pos])
        n = len(t.graph.outputs)
        _only_tensors(_split_aux(t.structure(), has_aux, _JVP)[0], _JVP)
        out, aux = _split_aux(t.outputs(results[:n]), has_aux, _JVP)
        tangent_out, _ = _split_aux(t.outputs(results[n:]), has_aux, _JVP)
        return (out, tangent_out, aux) if has_aux else (out, tangent_out)

    return _staged_for(func, ("jvp", has_aux, strict), body)(primals, tangents)


def _only_tensor_primals(primals: tuple, api: str, name: str = "primals") -> None:
    """``primals`` (or tangents: ``name``) hold at least one tensor and only tensors."""
    leaves = pytree.tree_leaves(primals)
    if not leaves:
        raise TransformError(f"{api}: Expected {name} to contain at least one Tensor; pass "
                             "the tensors to differentiate")
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TransformError(f"{api}: Expected {name} to only contain Tensors, got "
                                 f"{type(leaf)}; close over other values in f instead")


def _check_chunk_size(what: str, chunk_size) -> None:
    if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size > 0):
        raise TransformError(f"{what}: `chunk_size` should be greater than 0 (or None), got "
                             f"{chunk_size!r}")


def linearize(func: Callable, *primals):
    """As ``torch.func.linearize``: ``(func(*primals), jvp_fn)``, where ``jvp_fn(*tangents)``
    is the JVP at ``primals`` (each call runs ``jvp``'s cached compilation)."""
    _only_tensor_primals(primals, "linearize")
    out = jvp(func, primals, pytree.tree_map(torch.zeros_like, primals))[0]

    def jvp_fn(*tangents):
        return jvp(func, primals, tangents)[1]

    return out, jvp_fn


def _broadcast_prefix(prefix, tree, what: str) -> list:
    """Expand an in_dims/out_dims prefix (int, None or a pytree) to one entry per leaf."""
    try:
        return pytree.tree_leaves(pytree.tree_map(lambda p, sub: [p] * len(pytree.tree_leaves(
            sub)), prefix, tree, is_leaf=lambda x: x is None or isinstance(x, int)),
            is_leaf=lambda x: isinstance(x, list))
    except (ValueError, TypeError):
        raise TraceError(f"vmap: {what} {prefix!r} does not match the structure of "
                         f"{pytree.tree_structure(tree)}") from None


def _leaf_dims(prefix, tree, what: str) -> list:
    if prefix is None or isinstance(prefix, int):
        return [prefix] * len(pytree.tree_leaves(tree))
    return [d for part in _broadcast_prefix(prefix, tree, what) for d in part]


def vmap(func: Callable, in_dims=0, out_dims=0, randomness: str = "error",
         chunk_size: int | None = None):
    """As ``torch.func.vmap``: ``func`` mapped over dimension ``in_dims`` of its arguments,
    results stacked along ``out_dims``. ``chunk_size`` is checked as torch.func checks it;
    the whole batch is always computed at once (the results are the same)."""
    from .tracer import batching

    _check_chunk_size("vmap", chunk_size)
    if randomness not in batching.RANDOMNESS:
        raise TraceError(f"vmap: randomness must be one of {batching.RANDOMNESS}, got "
                         f"{randomness!r}")

    @functools.wraps(func)
    def run(*args, **kwargs):
        dims_tree = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)
        if isinstance(in_dims, tuple) and len(in_dims) != len(args):
            raise TraceError(f"vmap: in_dims {in_dims} has {len(in_dims)} entries for "
                             f"{len(args)} arguments")
        dims = _leaf_dims(dims_tree, args, "in_dims")
        return _vmapped(func, dims, out_dims, randomness, args, kwargs)

    return run


def _write_mapped(t: _Traced, results: list, flags: list, args: list, dims: list,
                  size: int) -> None:
    """The arguments the mapped function wrote into, written with their new values, each
    example's along its mapped dim, as torch.func's vmap writes them."""
    mutated = t.traced.mutated_inputs
    values = zip(mutated, results[len(results) - len(mutated):], flags[len(flags) - len(mutated):])
    writes = []
    for i, value, batched in values:
        if i >= len(t.tensor_pos):
            raise TraceError("a function under plait.vmap writes into a module buffer "
                             "(BatchNorm's running statistics, in training mode); call "
                             "model.eval(), or give the BatchNorm track_running_stats=False "
                             "(torch.func.replace_all_batch_norm_modules_ does so).")
        arg, d = args[t.tensor_pos[i]], (dims + [None] * len(args))[t.tensor_pos[i]]
        if d is None:
            if batched:
                raise TransformError(
                    "vmap: a function writes into an argument that is not mapped (in_dims "
                    "None) a value that varies over the batch, which torch.func refuses too: "
                    "map the argument too, or write into a copy of it.")
            writes.append((arg, value))
        else:
            value = value if batched else value.unsqueeze(0).expand(size, *value.shape)
            writes.append((arg, value.movedim(0, d)))
    t.write_back(writes)


def _vmapped(func, dims, out_dims, randomness, args, kwargs):
    from .tracer import batching

    def body(args, kwargs):
        leaves, tree = pytree.tree_flatten(args)
        sizes = set()
        for x, d in zip(leaves, dims):
            if d is None:
                continue
            if not isinstance(x, torch.Tensor):
                raise TraceError(f"vmap: in_dims gives dim {d} for a non-tensor argument")
            if not -x.ndim <= d < x.ndim:
                raise TraceError(f"vmap: in_dims {d} is out of range for an argument of "
                                 f"shape {list(x.shape)}")
            sizes.add(x.shape[d])
        if len(sizes) != 1:
            raise TraceError("vmap: " + ("no argument is mapped (in_dims are all None)"
                                         if not sizes else
                                         f"mapped dims have different sizes {sorted(sizes)}"))
        (size,) = sizes
        moved = [x.movedim(d, 0) if d is not None else x for x, d in zip(leaves, dims)]
        example = [x[0] if d is not None else x for x, d in zip(moved, dims)]
        t = _Traced(func, pytree.tree_unflatten(example, tree), kwargs, writable=True)
        kw_leaves = pytree.tree_leaves(kwargs)  # keyword arguments are not mapped (torch.func)
        mapped = [d is not None for d in dims] + [False] * len(kw_leaves)
        flags = [mapped[i] for i in t.tensor_pos] + [False] * len(t.traced.captured)
        graph, out_flags = batching.vmap(t.graph, flags, size, randomness)
        results = inline(graph, [(moved + kw_leaves)[i] for i in t.tensor_pos]
                         + list(t.traced.captured))
        # the views of the arguments go before they are written (a write through a live
        # view would leave it stale)
        del moved, example
        t.inputs = []
        _write_mapped(t, results, out_flags, leaves + kw_leaves, dims, size)
        _only_tensors(t.structure(), "vmap")
        out = t.outputs(list(range(len(results))))
        placed = []
        for k, d in zip(pytree.tree_leaves(out), _leaf_dims(out_dims, out, "out_dims")):
            r = results[k]
            if d is None:
                if out_flags[k]:
                    raise TraceError("vmap: out_dims=None for an output that depends on the "
                                     "mapped inputs")
                placed.append(r)
            else:
                r = r if out_flags[k] else r.unsqueeze(0).expand(size, *r.shape)
                if not -r.ndim <= d < r.ndim:  # else movedim's IndexError, not a PlaitError
                    raise TraceError(f"vmap: out_dims {d} is out of range for an output of "
                                     f"shape {list(r.shape[1:])} (and its batch dim)")
                placed.append(r.movedim(0, d))
        return pytree.tree_unflatten(placed, pytree.tree_structure(out))

    key = ("vmap", tuple(dims), repr(out_dims), randomness)
    return _staged_for(func, key, body)(args, kwargs)


# ---------------------------------------------------------------------------------------
# Jacobians: a vmap over basis vectors of vjp (reverse) or jvp (forward)
# ---------------------------------------------------------------------------------------
def _real_only(api: str, values, what: str) -> None:
    """Jacobians of complex values are refused (as by torch.func: reverse and forward mode
    disagree there by a conjugate)."""
    for idx, x in enumerate(pytree.tree_leaves(values)):
        if isinstance(x, torch.Tensor) and x.dtype.is_complex:
            raise TransformError(f"{api}: Expected all {what} to be real but received complex "
                                 f"tensor at flattened input idx: {idx}; pass real and "
                                 "imaginary parts apart (torch.view_as_real)")


def _with_args(func: Callable, args: tuple, argnums, api: str) -> tuple[Callable, tuple]:
    """``func`` as a function of the ``argnums`` arguments only, and their values."""
    nums = _argnums(argnums, len(args))
    _real_only(api, [args[n] for n in nums], "inputs")

    def of_chosen(*chosen):
        full = list(args)
        for n, value in zip(nums, chosen):
            full[n] = value
        return func(*full)

    return of_chosen, tuple(args[n] for n in nums)


def _basis(like: torch.Tensor) -> torch.Tensor:
    """The standard basis of ``like``'s space: [numel, *like.shape]."""
    n = like.numel()
    return torch.eye(n, dtype=like.dtype, device=like.device).reshape(n, *like.shape)


def _per_arg(argnums, values: list):
    return values[0] if isinstance(argnums, int) else tuple(values)


def jacrev(func: Callable, argnums: int | tuple[int, ...] = 0, *, has_aux: bool = False,
           chunk_size: int | None = None, _preallocate_and_copy: bool = False):
    """As ``torch.func.jacrev``: for each output leaf, the Jacobian w.r.t. each of
    ``argnums``, shaped output.shape + argument.shape (``chunk_size`` as in ``vmap``;
    ``_preallocate_and_copy``, how torch.func assembles chunks, changes nothing here)."""
    _check_chunk_size("jacrev", chunk_size)
    @_staged
    def body(*args):
        of_chosen, chosen = _with_args(func, args, argnums, "jacrev")
        out, vjp_fn, *aux = vjp(of_chosen, *chosen, has_aux=has_aux)
        _real_only("jacrev", out, "outputs")
        leaves, tree = pytree.tree_flatten(out)
        jacobians = []
        for i, leaf in enumerate(leaves):
            def row(e, i=i):
                return vjp_fn(pytree.tree_unflatten(
                    [e if k == i else torch.zeros_like(x) for k, x in enumerate(leaves)], tree))

            rows = vmap(row)(_basis(leaf))
            jacobians.append(_per_arg(argnums, [
                pytree.tree_map(lambda r: r.reshape((*leaf.shape, *r.shape[1:])), r)
                for r in rows]))
        result = pytree.tree_unflatten(jacobians, tree)
        return (result, aux[0]) if has_aux else result

    return body


def jacfwd(func: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False,
           *, randomness: str = "error"):
    """As ``torch.func.jacfwd``: the Jacobians of ``jacrev``, from forward mode."""
    @_staged
    def body(*args):
        of_chosen, chosen = _with_args(func, args, argnums, "jacfwd")
        flat, tree = pytree.tree_flatten(chosen)
        per_input = []
        for j, leaf in enumerate(flat):
            def column(e, j=j):
                tangents = [e if k == j else torch.zeros_like(x) for k, x in enumerate(flat)]
                return jvp(of_chosen, chosen, pytree.tree_unflatten(tangents, tree),
                           has_aux=has_aux)[1]

            cols = vmap(column, randomness=randomness)(_basis(leaf))
            _real_only("jacfwd", cols, "outputs")
            per_input.append(pytree.tree_map(
                lambda c: c.movedim(0, -1).reshape((*c.shape[1:], *leaf.shape)), cols))
        out_tree = pytree.tree_structure(per_input[0])
        jacobians = [pytree.tree_unflatten([pytree.tree_leaves(p)[i] for p in per_input], tree)
                     for i in range(out_tree.num_leaves)]
        result = pytree.tree_unflatten([_per_arg(argnums, list(j)) for j in jacobians],
                                       out_tree)
        if has_aux:
            zeros = pytree.tree_map(torch.zeros_like, chosen)  # chosen may hold pytrees
            return result, jvp(of_chosen, chosen, zeros, has_aux=True)[2]
        return result

    return body


def hessian(func: Callable, argnums: int | tuple[int, ...] = 0):
    """As ``torch.func.hessian``: ``jacfwd(jacrev(func, argnums), argnums)``."""
    return jacfwd(jacrev(func, argnums), argnums)
