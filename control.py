"""Structured control flow and rematerialization: ``cond``, ``while_loop``, ``fori_loop``,
``scan`` and ``checkpoint``, primitives whose bodies are graphs.

NOTE [control-flow primitives]
A branch or loop body is traced once, in a nested trace (tracers of the enclosing trace it
captures become extra operands of its node, as for a transform), into a graph held among its
node's params: a scan of 1000 steps is one node, printed with its body nested below it.
Each primitive keeps all its rules here, side by side:

  cond        operands (pred, *args); branches ``true_branch``/``false_branch`` take args.
  while_loop  operands (*carry, *consts); ``cond_graph`` and ``body_graph`` take both.
  scan        operands (*init, *xs, *consts); ``body`` maps (carry, x_t, consts) to
              (carry, y_t); results (carry, ys stacked along dim 0).
  checkpoint  operands (*args); ``body``'s first ``n_outputs`` outputs are the results, the
              rest the values its backward reads rather than recomputes (NOTE [checkpoint]).

Derivatives are the bodies' own, derived by the graph passes: cond's VJP and JVP are conds of
the branches' VJPs and JVPs; scan's JVP is a scan of the body's JVP; scan's VJP runs the
forward again to keep each step's carry, then a reverse scan of the body's VJP (each step
recomputes its body from its carry, so only carries are stored). A while_loop's trip count is
only known when it runs, so it has forward mode only. vmap batches a body with the batching
pass; a batched predicate computes both branches and selects, and a batched while_loop runs
until every example's predicate is false, each example keeping its carry once done.

When a program runs, a node runs its bodies as programs of their own, compiled once per body
(by ``config.backend``, "auto": the one for the tensors' device; cached by the body's digest
and backend); under a recording torch.autograd, a torch.func transform or a dispatch mode
they run op by op with torch, so the recording sees them. Called on real tensors outside any trace, the functions run as Python
(``cond`` as an ``if``, the loops as loops), as torch.cond does eagerly.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence

import attrs
import torch
import torch.utils.checkpoint
from torch.utils import _pytree as pytree

from .backends import resolve_backend
from .compiler.pipeline import compiled_body
from .config import config
from .errors import ShapeError, TraceError, UnsupportedOpError
from .graph import Graph, Provenance, TensorType, Value, extract
from .passes import autodiff
from .tracer import batching
from .passes.autodiff import differentiable, zeros
from .tracer.interpret import graph_of, inline, replay
from .passes.simplify import with_carry_history
from .tracer.registry import bodies, define, draws_random, is_effectful
from .tracer.trace import (TRACING_CONTEXTS, bind, current_trace, foreign_mode_active,
                           on_tracers, tracing_active, user_source)
from .transforms import _TENSOR, _Traced, vjp_graph


# ---------------------------------------------------------------------------------------
# Bodies: traced into graphs, rewired, and run
# ---------------------------------------------------------------------------------------
def _rewired(graph: Graph, inputs: Sequence[int | TensorType], first_output: int = 0) -> Graph:
    """``graph`` on new inputs, each one of its own (by position) or a type (an input it does
    not read), with its outputs from ``first_output`` on."""
    return extract(graph, graph.order, [Value(graph.inputs[i], 0) if isinstance(i, int) else i
                                        for i in inputs], graph.outputs[first_output:])


def _recorded(tensors: Sequence[torch.Tensor]) -> bool:
    """Must a body run op by op with torch, so that what records ops sees them?"""
    return foreign_mode_active() or any(
        type(t) is not torch.Tensor or torch._C._functorch.is_functorch_wrapped_tensor(t)
        or t.requires_grad and torch.is_grad_enabled() for t in tensors)


def _program(graph: Graph, tensors: Sequence[torch.Tensor]) -> Callable:
    """A body's program for these tensors (NOTE [control-flow primitives])."""
    return compiled_body(graph, "eager" if _recorded(tensors) else
                         resolve_backend(config.backend, tensors))


def _bind_here(prim: str, *operands, **params) -> tuple:
    """A control-flow node for the user's call, with its line as provenance."""
    trace = current_trace()
    with trace.provenance_of(Provenance(f"plait.{prim}",
                                        user_source() if config.provenance else None)):
        return bind(prim, *operands, **params)


def _type(x) -> TensorType:
    trace = current_trace()
    return trace.builder.type_of(trace.value_of(x))


def _tensors(tree, what: str) -> tuple[list, Any]:
    leaves, spec = pytree.tree_flatten(tree)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TraceError(f"{what} must be tensors (or pytrees of them), got a "
                             f"{type(leaf).__name__}")
    return leaves, spec


def _only_tensors(structure, what: str) -> None:
    """A traced body's results (``_Traced.structure``) are tensors, or pytrees of them."""
    for leaf in pytree.tree_leaves(structure):
        if leaf is not _TENSOR and leaf is not None:
            raise TraceError(f"{what} must be tensors (or pytrees of them), got a "
                             f"{type(leaf).__name__}")


def _same_types(got: Sequence[TensorType], want: Sequence[TensorType], what: str) -> None:
    if tuple(got) != tuple(want):
        raise TraceError(f"{what}: {[str(t) for t in got]} where {[str(t) for t in want]} "
                         "are expected (the same shapes and dtypes)")


def _expanded(x, have: bool, want: bool, axis_size: int):
    return x.unsqueeze(0).expand(axis_size, *x.shape) if want and not have else x


def _batched_outputs(graph: Graph, have: Sequence[bool], want: Sequence[bool],
                     axis_size: int) -> Graph:
    """A batched body whose outputs are batched where ``want`` says (broadcast where not)."""
    if list(have) == list(want):
        return graph
    return graph_of(lambda *ins: [_expanded(o, h, w, axis_size) for o, h, w in
                                   zip(inline(graph, ins), have, want)], graph.input_types)


def _carry_flags(body: Graph, flags: list[bool], n_carry: int, axis_size: int) -> list[bool]:
    """Which carries are batched: those batched on entry, and those the batched body makes
    batched, until nothing changes."""
    carry = list(flags[:n_carry])
    while True:
        _, out = batching.vmap(body, carry + list(flags[n_carry:]), axis_size)
        new = [a or b for a, b in zip(carry, out[:n_carry])]
        if new == carry:
            return carry
        carry = new


def _or_zeros(ct, like):
    return ct if ct is not None else torch.zeros_like(like)


def _take(values: Sequence, *counts: int) -> list[list]:
    it = iter(values)
    return [[next(it) for _ in range(n)] for n in counts]


# ---------------------------------------------------------------------------------------
# cond
# ---------------------------------------------------------------------------------------
def _cond_infer(pred, *args, true_branch, false_branch):
    if pred.numel != 1:
        raise ShapeError(f"cond: the predicate must have one element, got {pred}")
    _same_types(args, true_branch.input_types, "cond: operands")
    return true_branch.output_types


def _cond_impl(pred, *args, true_branch, false_branch):
    branch = true_branch if bool(pred) else false_branch
    return tuple(_program(branch, args)(list(args)))


def _draws(graph: Graph) -> bool:
    """Does ``graph``, or a body inside it, draw random numbers?"""
    return any(draws_random(node) or any(map(_draws, bodies(node)))
               for node in map(graph.node, graph.order))


def _refuse_drawing(what: str, where: str, *graphs: Graph) -> None:
    """Reverse mode runs these bodies again in the backward, which would draw anew."""
    if any(map(_draws, graphs)):
        raise UnsupportedOpError(
            f"differentiating {what} draws random numbers (dropout, torch.rand): its "
            "backward runs it again, which would draw other numbers than the forward's; "
            f"draw them before {where} and pass them in, or write it in Python")


def _cond_vjp(cts, pred, *args, outs, true_branch, false_branch):
    _refuse_drawing("plait.cond whose branch", "the cond", true_branch, false_branch)
    wrt = [i for i, t in enumerate(true_branch.input_types) if differentiable(t)]
    n = len(true_branch.input_types) + len(outs)
    branches = {k: _rewired(vjp_graph(g, wrt), range(n), len(outs))
                for k, g in (("true_branch", true_branch), ("false_branch", false_branch))}
    grads = iter(bind("cond", pred, *args, *map(_or_zeros, cts, outs), **branches))
    return [None] + [next(grads) if i in wrt else None for i in range(len(args))]


def _cond_jvp(operands, tangents, outs, true_branch, false_branch):
    wrt = [i for i, t in enumerate(tangents[1:]) if t is not None]
    n = len(true_branch.input_types) + len(wrt)
    branches = {k: _rewired(autodiff.jvp(g, wrt), range(n), len(outs))
                for k, g in (("true_branch", true_branch), ("false_branch", false_branch))}
    return list(bind("cond", *operands, *[tangents[1 + i] for i in wrt], **branches))


def _cond_batch(operands, batched, axis_size, true_branch, false_branch):
    pred, args = operands[0], list(operands[1:])
    (tb, t_flags), (fb, f_flags) = (batching.vmap(g, batched[1:], axis_size)
                                    for g in (true_branch, false_branch))
    flags = [batched[0] or a or b for a, b in zip(t_flags, f_flags)]
    tb = _batched_outputs(tb, t_flags, flags, axis_size)
    fb = _batched_outputs(fb, f_flags, flags, axis_size)
    if not batched[0]:
        return list(bind("cond", pred, *args, true_branch=tb, false_branch=fb)), flags
    # a predicate per example: both branches, then each example's pick
    pick = pred.reshape(axis_size)
    return [torch.where(pick.reshape(axis_size, *[1] * (a.ndim - 1)), a, b)
            for a, b in zip(inline(tb, args), inline(fb, args))], flags


define("cond", _cond_infer, _cond_impl, multiple_results=True, vjp=_cond_vjp, jvp=_cond_jvp,
       batch=_cond_batch)


def cond(pred, true_fn: Callable, false_fn: Callable, operands: tuple | list = ()):
    """``true_fn(*operands)`` if ``pred`` else ``false_fn(*operands)``, with torch.cond's
    signature; in a traced function both branches are traced once and the choice is made
    when the program runs. ``pred`` is a bool or a one-element tensor; the branches return
    the same structure of tensors of the same shapes and dtypes."""
    if not isinstance(operands, (tuple, list)):
        raise TraceError(f"plait.cond: operands must be a tuple or list, got "
                         f"{type(operands).__name__}")
    if isinstance(pred, torch.Tensor) and pred.numel() != 1:
        raise TraceError(f"plait.cond: the predicate must be a bool or a one-element tensor, "
                         f"got a tensor of shape {tuple(pred.shape)}")
    if not tracing_active() or not isinstance(pred, torch.Tensor):
        return true_fn(*operands) if pred else false_fn(*operands)
    return _cond_traced(pred, true_fn, false_fn, tuple(operands))


@on_tracers
def _cond_traced(pred, true_fn, false_fn, operands):
    if _type(pred).dtype != torch.bool:
        pred = pred != 0
    t, f = _Traced(true_fn, operands, {}), _Traced(false_fn, operands, {})
    for side in (t, f):
        _only_tensors(side.structure(), "plait.cond: a branch's results")
    if pytree.tree_structure(t.structure()) != pytree.tree_structure(f.structure()):
        raise TraceError(f"plait.cond: the branches return different structures: "
                         f"{pytree.tree_structure(t.structure())} and "
                         f"{pytree.tree_structure(f.structure())}")
    _same_types(f.graph.output_types, t.graph.output_types,
                "plait.cond: the false branch returns")
    n, n_t, n_f = len(t.tensor_pos), len(t.traced.captured), len(f.traced.captured)
    t_caps = list(t.graph.input_types[n:])
    f_caps = list(f.graph.input_types[n:])
    outs = _bind_here("cond", pred, *t.inputs, *f.inputs[n:],
                true_branch=_rewired(t.graph, [*range(n + n_t), *f_caps]),
                false_branch=_rewired(f.graph, [*range(n), *t_caps, *range(n, n + n_f)]))
    return t.outputs(list(outs))


# ---------------------------------------------------------------------------------------
# while_loop
# ---------------------------------------------------------------------------------------
def _while_infer(*types, cond_graph, body_graph, n_carry):
    _same_types(types, body_graph.input_types, "while_loop: operands")
    _same_types(body_graph.output_types, types[:n_carry], "while_loop: the body returns")
    return types[:n_carry]


def _while_impl(*tensors, cond_graph, body_graph, n_carry):
    carry, consts = list(tensors[:n_carry]), list(tensors[n_carry:])
    cond, body = _program(cond_graph, tensors), _program(body_graph, tensors)
    while bool(cond(carry + consts)[0]):
        carry = list(body(carry + consts))
    return tuple(carry)


def _while_vjp(cts, *operands, outs, cond_graph, body_graph, n_carry):
    raise UnsupportedOpError(
        "reverse-mode differentiation through plait.while_loop: its trip count is only known "
        "when it runs, so its steps cannot be replayed backwards. Use plait.fori_loop with "
        "Python int bounds or plait.scan (both differentiable), or forward mode (plait.jvp).")


def _while_jvp(operands, tangents, outs, cond_graph, body_graph, n_carry):
    types, n = body_graph.input_types, n_carry
    dc = [i for i in range(n) if differentiable(types[i])]
    wk = [i for i in range(n, len(types)) if tangents[i] is not None]
    n_k = len(types) - n
    jvp = autodiff.jvp(body_graph, dc + wk)  # (carry, consts, tangents) -> (carry, tangents)

    def body(*ins):
        c, tc, k, tk = _take(ins, n, len(dc), n_k, len(wk))
        out = inline(jvp, c + k + tc + tk)
        return out[:n] + [out[n + i] for i in dc]

    new_types = [*types[:n], *[types[i] for i in dc], *types[n:], *[types[i] for i in wk]]
    cond_graph = _rewired(cond_graph, [*range(n), *[types[i] for i in dc], *range(n, len(types)),
                                       *[types[i] for i in wk]])
    out = bind("while_loop", *operands[:n], *[_or_zeros(tangents[i], operands[i]) for i in dc],
               *operands[n:], *[tangents[i] for i in wk], cond_graph=cond_graph,
               body_graph=graph_of(body, new_types), n_carry=n + len(dc))
    return [out[n + dc.index(i)] if i in dc else None for i in range(n)]


def _while_batch(operands, batched, axis_size, cond_graph, body_graph, n_carry):
    n, consts = n_carry, list(operands[n_carry:])
    carry_flags = _carry_flags(body_graph, list(batched), n, axis_size)
    _, (per_example,) = batching.vmap(cond_graph, carry_flags + list(batched[n:]), axis_size)
    if per_example:
        carry_flags = [True] * n
    flags = carry_flags + list(batched[n:])
    body, out_flags = batching.vmap(body_graph, flags, axis_size)
    body = _batched_outputs(body, out_flags, carry_flags, axis_size)
    cond_b, _ = batching.vmap(cond_graph, flags, axis_size)
    carry = [_expanded(x, b, w, axis_size) for x, b, w in zip(operands, batched, carry_flags)]
    if per_example:  # step the examples still running; stop when none is
        running = cond_b

        def step(*ins):
            keep = inline(running, ins)[0]
            return [torch.where(keep.reshape(axis_size, *[1] * (c.ndim - 1)), new, c)
                    for new, c in zip(inline(body, ins), ins[:n])]

        types = body.input_types
        body = graph_of(step, types)
        cond_b = graph_of(lambda *ins: [inline(running, ins)[0].any()], types)
    return list(bind("while_loop", *carry, *consts, cond_graph=cond_b, body_graph=body,
                     n_carry=n)), carry_flags


define("while_loop", _while_infer, _while_impl, multiple_results=True, vjp=_while_vjp,
       jvp=_while_jvp, batch=_while_batch)


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def while_loop(cond_fn: Callable, body_fn: Callable, carried_inputs: tuple | list) -> tuple:
    """``while cond_fn(*carried): carried = body_fn(*carried)``, with torch's while_loop
    signature: ``cond_fn`` returns a one-element bool tensor, ``body_fn`` the carried values
    with their shapes and dtypes. In a traced function both are traced once and the loop runs
    in the program. Forward mode (jvp) and vmap go through it; reverse mode does not (its
    trip count is unknown until it runs): use ``fori_loop`` or ``scan`` for that."""
    if not isinstance(carried_inputs, (tuple, list)):
        raise TraceError("plait.while_loop: carried_inputs must be a tuple or list, got "
                         f"{type(carried_inputs).__name__}")
    carried = tuple(carried_inputs)
    if not tracing_active():
        while _truth(cond_fn(*carried)):
            out = _as_tuple(body_fn(*carried))
            if pytree.tree_structure(out) != pytree.tree_structure(carried):
                raise TraceError("plait.while_loop: body_fn must return the carried values' "
                                 f"structure {pytree.tree_structure(carried)}, got "
                                 f"{pytree.tree_structure(out)}")
            carried = out
        return carried
    return _while_traced(cond_fn, body_fn, carried)


def _truth(pred) -> bool:
    if isinstance(pred, torch.Tensor) and pred.numel() != 1:
        raise TraceError("plait.while_loop: cond_fn must return a bool or a one-element "
                         f"tensor, got a tensor of shape {tuple(pred.shape)}")
    return bool(pred)


def _predicate(pred):
    if not isinstance(pred, torch.Tensor) or pred.numel() != 1:
        raise TraceError("plait.while_loop: cond_fn must return a one-element tensor, got "
                         f"{pred!r}" if not isinstance(pred, torch.Tensor) else
                         f"a tensor of shape {tuple(pred.shape)}")
    return pred.reshape(()) != 0 if pred.dtype != torch.bool else pred.reshape(())


@on_tracers
def _while_traced(cond_fn, body_fn, carried):
    leaves, spec = _tensors(carried, "plait.while_loop: carried_inputs")
    c = _Traced(lambda *xs: _predicate(cond_fn(*xs)), carried, {})
    b = _Traced(lambda *xs: _as_tuple(body_fn(*xs)), carried, {})
    if pytree.tree_structure(b.structure()) != spec:
        raise TraceError("plait.while_loop: body_fn must return the carried values' structure "
                         f"{spec}, got {pytree.tree_structure(b.structure())}")
    n = len(leaves)
    _same_types(b.graph.output_types, c.graph.input_types[:n],
                "plait.while_loop: body_fn returns")
    c_caps, b_caps = list(c.graph.input_types[n:]), list(b.graph.input_types[n:])
    outs = _bind_here("while_loop", *leaves, *c.inputs[n:], *b.inputs[n:],
                cond_graph=_rewired(c.graph, [*range(n + len(c_caps)), *b_caps]),
                body_graph=_rewired(b.graph, [*range(n), *c_caps,
                                              *range(n, n + len(b_caps))]), n_carry=n)
    return pytree.tree_unflatten(list(outs), spec)


# ---------------------------------------------------------------------------------------
# scan
# ---------------------------------------------------------------------------------------
def _scan_infer(*types, body, n_carry, n_xs, length, reverse):
    xs = types[n_carry:n_carry + n_xs]
    for t in xs:
        if t.ndim == 0 or t.shape[0] != length:
            raise ShapeError(f"scan: xs of {t} for {length} steps")
    steps = [attrs.evolve(t, shape=t.shape[1:]) for t in xs]
    _same_types([*types[:n_carry], *steps, *types[n_carry + n_xs:]], body.input_types,
                "scan: operands")
    outs = body.output_types
    return (*outs[:n_carry], *[attrs.evolve(y, shape=(length, *y.shape))
                               for y in outs[n_carry:]])


def _scan_impl(*tensors, body, n_carry, n_xs, length, reverse):
    carry, xs, consts = (list(tensors[:n_carry]), tensors[n_carry:n_carry + n_xs],
                         list(tensors[n_carry + n_xs:]))
    y_types = body.output_types[n_carry:]
    ys: list[list] = [[None] * length for _ in y_types]
    step = _program(body, tensors)
    for i in reversed(range(length)) if reverse else range(length):
        out = step(carry + [x[i] for x in xs] + consts)
        carry = out[:n_carry]
        for k, y in enumerate(out[n_carry:]):
            ys[k][i] = y
    return (*carry, *[torch.stack(y) if length else
                      torch.empty((0, *t.shape), dtype=t.dtype, device=t.device)
                      for y, t in zip(ys, y_types)])


def _scan_vjp(cts, *operands, outs, body, n_carry, n_xs, length, reverse):
    _refuse_drawing("plait.scan (or fori_loop) whose body", "the loop", body)
    nc, nx, types = n_carry, n_xs, body.input_types
    nk, ny, out_types = len(types) - nc - nx, len(outs) - nc, body.output_types
    diff = [i for i, t in enumerate(types) if differentiable(t)]
    dc, dx, dk = ([i for i in diff if i < nc], [i for i in diff if nc <= i < nc + nx],
                  [i for i in diff if i >= nc + nx])
    carry0, xs, consts = _take(operands, nc, nx, nk)
    params = {"n_xs": nx, "length": length}
    # the carry before each step: the forward again, keeping them (simplification merges
    # the forward into this scan)
    carries = bind("scan", *operands, body=with_carry_history(body, nc), n_carry=nc,
                   reverse=reverse, **params)[nc + ny:]
    # then backwards: each step recomputes its body from its carry and takes its VJP
    vjp = _rewired(vjp_graph(body, diff), range(len(types) + nc + ny), nc + ny)

    def step(*ins):
        ct_c, acc, c, x, ct_y, k = _take(ins, len(dc), len(dk), nc, nx, ny, nk)
        full = [torch.zeros_like(v) for v in c]
        for j, i in enumerate(dc):
            full[i] = ct_c[j]
        grads = dict(zip(diff, inline(vjp, c + x + k + full + ct_y)))
        return ([grads[i] for i in dc] + [a + grads[i] for a, i in zip(acc, dk)]
                + [grads[i] for i in dx])

    step_types = [*[types[i] for i in dc + dk], *types[:nc + nx], *out_types[nc:],
                  *types[nc + nx:]]
    res = bind("scan", *[_or_zeros(cts[i], outs[i]) for i in dc],
               *[torch.zeros_like(operands[i]) for i in dk], *carries, *xs,
               *[_or_zeros(c, y) for c, y in zip(cts[nc:], outs[nc:])], *consts,
               body=graph_of(step, step_types), n_carry=len(dc) + len(dk),
               n_xs=nc + nx + ny, length=length, reverse=not reverse)
    grads = dict(zip(dc + dk + dx, res))
    return [grads.get(i) for i in range(len(operands))]


def _scan_jvp(operands, tangents, outs, body, n_carry, n_xs, length, reverse):
    nc, nx, types = n_carry, n_xs, body.input_types
    nk, ny = len(types) - nc - nx, len(outs) - nc
    dc = [i for i in range(nc) if differentiable(types[i])]
    wx = [i for i in range(nc, nc + nx) if tangents[i] is not None]
    wk = [i for i in range(nc + nx, len(types)) if tangents[i] is not None]
    jvp = autodiff.jvp(body, dc + wx + wk)  # (inputs, tangents) -> (outputs, their tangents)

    def step(*ins):
        c, tc, x, tx, k, tk = _take(ins, nc, len(dc), nx, len(wx), nk, len(wk))
        out = inline(jvp, c + x + k + tc + tx + tk)
        primal, tangent = out[:nc + ny], out[nc + ny:]
        return primal[:nc] + [tangent[i] for i in dc] + primal[nc:] + tangent[nc:]

    step_types = [*types[:nc], *[types[i] for i in dc], *types[nc:nc + nx],
                  *[types[i] for i in wx], *types[nc + nx:], *[types[i] for i in wk]]
    res = bind("scan", *operands[:nc], *[_or_zeros(tangents[i], operands[i]) for i in dc],
               *operands[nc:nc + nx], *[tangents[i] for i in wx], *operands[nc + nx:],
               *[tangents[i] for i in wk], body=graph_of(step, step_types),
               n_carry=nc + len(dc), n_xs=nx + len(wx), length=length, reverse=reverse)
    y_tangents = res[nc + len(dc) + ny:]
    return ([res[nc + dc.index(i)] if i in dc else None for i in range(nc)]
            + [t if differentiable(y) else None
               for t, y in zip(y_tangents, body.output_types[nc:])])


def _scan_batch(operands, batched, axis_size, body, n_carry, n_xs, length, reverse):
    nc, nx = n_carry, n_xs
    carry_flags = _carry_flags(body, list(batched), nc, axis_size)
    flags = carry_flags + list(batched[nc:])
    vbody, out_flags = batching.vmap(body, flags, axis_size)
    y_flags = list(out_flags[nc:])
    vbody = _batched_outputs(vbody, out_flags, carry_flags + y_flags, axis_size)
    carry = [_expanded(x, b, w, axis_size) for x, b, w in
             zip(operands[:nc], batched, carry_flags)]
    xs = [x.movedim(0, 1) if b else x for x, b in zip(operands[nc:nc + nx], batched[nc:])]
    res = bind("scan", *carry, *xs, *operands[nc + nx:], body=vbody, n_carry=nc, n_xs=nx,
               length=length, reverse=reverse)
    ys = [y.movedim(1, 0) if b else y for y, b in zip(res[nc:], y_flags)]
    return list(res[:nc]) + ys, carry_flags + y_flags


define("scan", _scan_infer, _scan_impl, multiple_results=True, vjp=_scan_vjp, jvp=_scan_jvp,
       batch=_scan_batch)


def scan(f: Callable, init, xs, length: int | None = None, reverse: bool = False):
    """``jax.lax.scan``'s contract: ``f(carry, x) -> (carry, y)`` applied along dim 0 of
    ``xs`` (a pytree of tensors, or None with ``length``), returning the final carry and the
    ``y``s stacked. In a traced function ``f`` is traced once: the scan is one node however
    long, differentiable (its backward is a reverse scan) and batchable."""
    leaves, spec = _tensors(xs, "plait.scan: xs") if xs is not None else ([], None)
    lengths = {x.shape[0] if x.ndim else None for x in leaves}
    if None in lengths or len(lengths) > 1 or length is not None and lengths - {length}:
        raise TraceError(f"plait.scan: every xs leaf is scanned along dim 0, so they need one "
                         f"length{f' (length={length})' if length is not None else ''}; got "
                         f"shapes {[tuple(x.shape) for x in leaves]}")
    if length is None and not leaves:
        raise TraceError("plait.scan: xs has no tensors, so give the number of steps: length=")
    length = length if length is not None else lengths.pop()
    if not tracing_active():
        return _scan_eager(f, init, leaves, spec, length, reverse)
    return _scan_traced(f, init, xs, length, reverse)


def _pair(out) -> tuple:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TraceError(f"plait.scan: f must return a pair (carry, y), got {type(out).__name__}")
    return tuple(out)


def _scan_eager(f, carry, leaves, spec, length: int, reverse: bool):
    if length == 0:
        raise TraceError("plait.scan of zero steps outside a traced function: the shapes of "
                         "its ys are unknown without running f; call it under plait.jit")
    ys = [None] * length
    for i in reversed(range(length)) if reverse else range(length):
        x = pytree.tree_unflatten([x[i] for x in leaves], spec) if spec is not None else None
        carry, ys[i] = _pair(f(carry, x))
    return carry, pytree.tree_map(lambda *y: None if y[0] is None else torch.stack(y), *ys)


@on_tracers
def _scan_traced(f, init, xs, length, reverse):
    carry_leaves, carry_spec = _tensors(init, "plait.scan: init")
    leaves, spec = pytree.tree_flatten(xs) if xs is not None else ([], None)
    example = pytree.tree_unflatten([x[0] if length else x.new_zeros(x.shape[1:])
                                     for x in leaves], spec) if xs is not None else None
    t = _Traced(lambda c, x: _pair(f(c, x)), (init, example), {})
    carry, ys = t.structure()
    _only_tensors(ys, "plait.scan: the ys f returns")
    if pytree.tree_structure(carry) != carry_spec:
        raise TraceError(f"plait.scan: f must return a carry of init's structure {carry_spec}, "
                         f"got {pytree.tree_structure(carry)}")
    nc = len(carry_leaves)
    _same_types(t.graph.output_types[:nc], t.graph.input_types[:nc],
                "plait.scan: f returns a carry of")
    outs = _bind_here("scan", *t.inputs[:nc], *leaves, *t.inputs[nc + len(leaves):], body=t.graph,
                n_carry=nc, n_xs=len(leaves), length=length, reverse=reverse)
    return t.outputs(list(outs))


def fori_loop(lower, upper, body_fun: Callable, init_val):
    """``jax.lax.fori_loop``: ``val = body_fun(i, val)`` for ``i`` from ``lower`` to
    ``upper - 1`` (``i`` a 0-d int64 tensor). With Python int bounds it is a ``scan``, so
    differentiable; with tensor bounds a ``while_loop`` (forward mode only)."""
    if isinstance(lower, int) and isinstance(upper, int):
        if upper <= lower:
            return init_val
        leaves = [x for x in pytree.tree_leaves(init_val) if isinstance(x, torch.Tensor)]
        steps = torch.arange(lower, upper, device=leaves[0].device if leaves else None)
        return scan(lambda val, i: (body_fun(i, val), None), init_val, steps)[0]
    i = torch.as_tensor(lower, dtype=torch.int64)
    _, _, val = while_loop(lambda i, n, val: i < n,
                           lambda i, n, val: (i + 1, n, body_fun(i, val)),
                           (i, torch.as_tensor(upper, dtype=torch.int64), init_val))
    return val


# ---------------------------------------------------------------------------------------
# checkpoint
# ---------------------------------------------------------------------------------------
# NOTE [checkpoint]
# ``checkpoint(fn)``'s node holds fn's graph. Its VJP is a second checkpoint node whose body
# replays the forward from the node's operands and takes its VJP there, so the backward
# recomputes fn's intermediates instead of reading saved ones: only the operands (and the
# values a policy saves) live from the forward to the backward. Simplification cannot merge
# the replay with the forward (they are different nodes), and lowering inlines both bodies
# (``passes/lowering.py: inline_checkpoints``) where no pass merges computations any more.
# Random draws are always saved (the backward must see the forward's dropout mask, as
# torch.utils.checkpoint's replayed RNG state gives), and a policy may save more: with
# ``checkpoint_policies.dots_saveable`` the matrix products' results, as JAX's policy.
class checkpoint_policies:
    """What a checkpoint keeps for its backward besides its operands (JAX's names): a
    policy is called with each primitive's name."""

    @staticmethod
    def nothing_saveable(prim: str) -> bool:
        return False

    @staticmethod
    def dots_saveable(prim: str) -> bool:
        return prim == "dot_general"


def _checkpoint_infer(*types, body, n_outputs):
    _same_types(types, body.input_types, "checkpoint: operands")
    return body.output_types


def _checkpoint_impl(*tensors, body, n_outputs):
    return tuple(_program(body, tensors)(list(tensors)))


def _remat_backward(body: Graph, wrt: list[int], n_outputs: int, *ins) -> list:
    """(operands, saved values, output cotangents) -> operand cotangents: the forward
    replayed, saved values read rather than recomputed, then its VJP."""
    saved = body.outputs[n_outputs:]
    args, given, seeds = _take(ins, len(body.inputs), len(saved), len(body.outputs))
    given = dict(zip(saved, given))

    def visit(n, operands):
        node = body.node(n)
        mine = [given.get(Value(n, i)) for i in range(len(node.out_types))]
        if all(v is not None for v in mine):
            return mine
        out = bind(node.prim, *operands, **node.kwargs)
        return [g if g is not None else o for g, o in
                zip(mine, out if isinstance(out, tuple) else (out,))]

    env = replay(body, args, visit)
    seed_of: dict[Value, Any] = {}
    for v, s, t in zip(body.outputs, seeds, body.output_types):
        if differentiable(t):
            seed_of[v] = s if v not in seed_of else bind("add", seed_of[v], s)
    cts = autodiff.backward(body, env, seed_of, current_trace(), wrt)
    grads = [cts.get(Value(body.inputs[i], 0)) for i in wrt]
    return [g if g is not None else zeros(body.input_types[i]) for g, i in zip(grads, wrt)]


def _checkpoint_vjp(cts, *operands, outs, body, n_outputs):
    wrt = [i for i, t in enumerate(body.input_types) if differentiable(t)]
    types = [*body.input_types, *body.output_types[n_outputs:], *body.output_types]
    backward = graph_of(functools.partial(_remat_backward, body, wrt, n_outputs), types)
    grads = iter(bind("checkpoint", *operands, *outs[n_outputs:], *map(_or_zeros, cts, outs),
                      body=backward, n_outputs=len(wrt)))
    return [next(grads) if i in wrt else None for i in range(len(operands))]


def _checkpoint_jvp(operands, tangents, outs, body, n_outputs):
    wrt = [i for i, t in enumerate(tangents) if t is not None]
    jvp = autodiff.jvp(body, wrt)
    n = len(body.outputs)
    jvp = extract(jvp, jvp.order, [Value(m, 0) for m in jvp.inputs], jvp.outputs[n:n + n_outputs])
    out = bind("checkpoint", *operands, *[tangents[i] for i in wrt], body=jvp,
               n_outputs=n_outputs)
    return list(out) + [None] * (n - n_outputs)


def _checkpoint_batch(operands, batched, axis_size, body, n_outputs):
    vbody, flags = batching.vmap(body, batched, axis_size)
    return list(bind("checkpoint", *operands, body=vbody, n_outputs=n_outputs)), flags


define("checkpoint", _checkpoint_infer, _checkpoint_impl, multiple_results=True,
       vjp=_checkpoint_vjp, jvp=_checkpoint_jvp, batch=_checkpoint_batch)


def checkpoint(fn: Callable | None = None, *, policy: Callable[[str], bool] | None = None):
    """``fn`` rematerialized (``jax.checkpoint``): differentiated, its backward recomputes
    its intermediates from its arguments instead of keeping them from the forward (NOTE
    [checkpoint]). ``policy(prim) -> bool`` saves the results of the primitives it accepts
    (``checkpoint_policies.dots_saveable``: the matrix products). On real tensors outside a
    traced function it is ``torch.utils.checkpoint.checkpoint`` (its policy unused there).
    Usable as ``@plait.checkpoint`` or ``@plait.checkpoint(policy=...)``."""
    if fn is None:
        return functools.partial(checkpoint, policy=policy)

    @functools.wraps(fn)
    def rematerialized(*args, **kwargs):
        if not tracing_active():
            return _TORCH_CHECKPOINT(fn, *args, use_reentrant=False, **kwargs)
        return _checkpoint_traced(fn, policy, args, kwargs)

    return rematerialized


@on_tracers
def _checkpoint_traced(fn, policy, args, kwargs):
    t = _Traced(fn, args, kwargs)
    g = t.graph
    saved = [Value(n, i) for n in g.order if g.node(n).prim != "input" and (
        is_effectful(g.node(n)) or policy is not None and policy(g.node(n).prim))
        for i in range(len(g.node(n).out_types))]
    body = extract(g, g.order, [Value(n, 0) for n in g.inputs], [*g.outputs, *saved])
    outs = _bind_here("checkpoint", *t.inputs, body=body, n_outputs=len(g.outputs))
    return t.outputs(list(outs[:len(g.outputs)]))


# ---------------------------------------------------------------------------------------
# torch's own spellings, while tracing
# ---------------------------------------------------------------------------------------
_TORCH_CHECKPOINT = torch.utils.checkpoint.checkpoint


def _torch_scan(combine_fn, init, xs, *, dim: int = 0, reverse: bool = False):
    """torch's scan (``combine_fn(carry, x) -> (carry, y)`` along ``dim``) as plait.scan."""
    if dim:
        xs = pytree.tree_map(lambda x: x.movedim(dim, 0), xs)
    carry, ys = scan(combine_fn, init, xs, reverse=reverse)
    return carry, (pytree.tree_map(lambda y: y.movedim(0, dim), ys) if dim else ys)


def _torch_checkpoint(function, *args, use_reentrant=None, context_fn=None,
                      determinism_check=None, debug=None, preserve_rng_state=True, **kwargs):
    if context_fn is not None and context_fn is not torch.utils.checkpoint.noop_context_fn:
        raise TraceError("torch.utils.checkpoint.checkpoint with a context_fn (selective "
                         "checkpointing) is not supported under plait; use "
                         "plait.checkpoint(fn, policy=plait.checkpoint_policies.dots_saveable)")
    return checkpoint(function)(*args, **kwargs)


def _torch_spellings() -> list[tuple[Any, str, Callable]]:
    import torch._higher_order_ops as hops
    import sys

    spellings = [(torch, "cond", cond), (hops, "cond", cond), (hops, "while_loop", while_loop),
                 (hops, "scan", _torch_scan), (torch.utils.checkpoint, "checkpoint",
                                               _torch_checkpoint)]
    for module, name, fn in (("cond", "cond", cond), ("while_loop", "while_loop", while_loop),
                             ("scan", "scan", _torch_scan)):
        mod = sys.modules.get(f"torch._higher_order_ops.{module}")
        if mod is not None:
            spellings.append((mod, name, fn))
    return [(m, n, f) for m, n, f in spellings if hasattr(m, n)]


@contextlib.contextmanager
def _torch_control_flow_traced():
    """torch.cond, torch's while_loop and scan, and torch.utils.checkpoint.checkpoint, called
    in a traced function, are plait's."""
    saved = [(m, n, getattr(m, n)) for m, n, _ in _SPELLINGS]
    for m, n, f in _SPELLINGS:
        setattr(m, n, f)
    try:
        yield
    finally:
        for m, n, original in saved:
            setattr(m, n, original)


_SPELLINGS = _torch_spellings()
TRACING_CONTEXTS.append(_torch_control_flow_traced)
