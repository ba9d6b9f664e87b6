"""Differentiation as graph -> graph passes: ``vjp`` (reverse mode) and ``jvp`` (forward).

NOTE [autodiff]
``vjp(graph, wrt)`` returns a graph taking the original inputs followed by one cotangent per
output, and returning the original outputs followed by the cotangents of the inputs listed in
``wrt``. It replays the forward graph into a fresh trace, then walks the nodes backwards and
applies each primitive's ``vjp`` rule::

    rule(cotangents_of_outputs, *operands, outs=outputs, **params) -> one cotangent per operand

A rule that also takes ``needed`` gets, per operand, whether its cotangent is wanted (it
depends on what is differentiated), and may give None for the others: a custom function's
``ctx.needs_input_grad``.
Rules are written with torch calls on tracers (traced like user code) or ``bind``; they see
the forward values they need, and only those stay alive, so the saved residuals are exactly
what the rules read. A ``None`` cotangent means zero. Integer and boolean values carry no
cotangent (as in torch.func). A complex value's cotangent is dL/dRe + i dL/dIm, as in
PyTorch: each VJP is the transpose of the derivative with C seen as R^2 (NOTE [complex
derivatives] in tracer/primitives.py), and a real operand's share of a complex cotangent is
its real part. Primitives whose rules do not hold on complex values (``COMPLEX_RULES`` lists
those that do) raise UnsupportedOpError there.

``jvp(graph, wrt)`` is one forward pass: each node's tangents come from its primitive's
``jvp`` rule (``rule(operands, tangents, outs, **params)``). Elementwise primitives share
their derivative tables with the VJP rules; linear ones map tangents through themselves. A
primitive without a ``jvp`` rule has one derived from its ``vjp`` rule: the VJP is linear in
its cotangent, so differentiating it once more with respect to the cotangent (at zero), with
the tangent as cotangent, gives J @ t (simplification then removes the dead half). With
complex values too: the VJP is the real transpose of J (not its complex transpose), whose
transpose is J again.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable, Sequence

import torch

from ..errors import UnsupportedOpError
from ..graph import Graph, GraphBuilder, TensorType, Value, extract
from ..tracer.primitives import COMPLEX_RULES, ELEMENTWISE
from ..tracer.registry import get_primitive, is_effectful
from ..tracer.interpret import graph_of, inline, replay
from ..tracer.nn import attention_scores, heads_first, refuse_dropout_derivative
from ..tracer.trace import Trace, bind, current_trace, tracing
from .attention import attention_layout, fuse_attention
from .layout import channels_last


def differentiable(t: TensorType) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def zeros(t: TensorType):
    return bind("full", shape=t.shape, value=0.0, dtype=t.dtype, device=t.device)


def _fit(ct, t: TensorType, trace: Trace):
    """A rule's cotangent, checked against its operand's type (and cast to its dtype): a
    complex one of a real operand is its real part (a real value's path into C is
    R-linear, and the real part is its transpose)."""
    ct_t = trace.type_of(ct)
    if ct_t.shape != t.shape:
        raise AssertionError(f"VJP rule returned a cotangent of {ct_t} for an operand of {t}")
    if ct_t.dtype.is_complex and not t.dtype.is_complex:
        ct = bind("real", ct)
    return ct if trace.type_of(ct).dtype == t.dtype else bind("convert", ct, dtype=t.dtype)


def _name(node) -> str:
    return f"{node.prim} ({node.kwargs['op']})" if node.prim == "opaque" else node.prim


def _check_complex(node, operand_types) -> None:
    if node.prim not in COMPLEX_RULES and any(
            t.dtype.is_complex for t in (*operand_types, *node.out_types)):
        raise UnsupportedOpError(
            f"the primitive {_name(node)} has no derivative rule for complex values (traced "
            f"from {node.provenance.aten or 'the function'}); compute it on the real and "
            "imaginary parts (torch.view_as_real) or keep it outside the differentiated "
            "function")


# ATen factories that read their tensor operand's shape, dtype and device only (traced as
# opaque draws): their results carry no derivative with respect to it, as in eager
_SHAPE_ONLY_FACTORIES = frozenset({"randn_like", "rand_like", "randint_like", "empty_like"})


def _reads_only_shape(node) -> bool:
    return node.prim == "opaque" and str(node.kwargs["op"]).split(".")[1] in _SHAPE_ONLY_FACTORIES


@functools.cache
def _takes_needed(rule: Callable) -> bool:
    return "needed" in inspect.signature(rule).parameters


def depends_on(graph: Graph, inputs: Sequence[int]) -> set[int]:
    """The nodes whose values depend on the graph inputs ``inputs`` (those nodes included)."""
    active = {graph.inputs[i] for i in inputs}
    for n in graph.order:
        if any(v.node in active for v in graph.operands(n)):
            active.add(n)
    return active


def backward(graph: Graph, env: dict[Value, object], seeds: dict[Value, object],
             trace: Trace, wrt: Sequence[int]) -> dict[Value, object]:
    """Propagate cotangents from ``seeds`` (graph value -> tracer) to the values that depend
    on the inputs ``wrt``; return the accumulated cotangents (graph value -> tracer) of the
    values reached. Nodes that do not depend on them need no rule (a random draw does not)."""
    active = depends_on(graph, wrt)
    cts: dict[Value, object] = dict(seeds)
    for n in reversed(graph.order):
        node = graph.node(n)
        if node.prim in ("input", "constant") or n not in active:
            continue
        outs = [Value(n, i) for i in range(len(node.out_types))]
        node_cts = [cts.pop(v, None) for v in outs]
        operands = graph.operands(n)
        operand_types = [graph.type_of(v) for v in operands]
        if all(c is None for c in node_cts):
            continue
        if not any(map(differentiable, operand_types)):
            continue
        rule = get_primitive(node.prim).vjp
        if rule is None and _reads_only_shape(node):
            continue
        if rule is None:
            raise UnsupportedOpError(
                f"the primitive {_name(node)} has no derivative rule, so plait cannot "
                f"differentiate through it (traced from {node.provenance.aten or 'the function'})."
                " Keep this op outside the differentiated function.")
        _check_complex(node, operand_types)
        node_cts = [c if c is not None or not differentiable(t) else zeros(t)
                    for c, t in zip(node_cts, node.out_types)]
        # a rule that takes ``needed`` learns which operands need a cotangent (NOTE [autodiff])
        needed = {"needed": tuple(v.node in active and differentiable(t) for v, t in zip(
            operands, operand_types))} if _takes_needed(rule) else {}
        with trace.provenance_of(node.provenance):  # the derivative of the user's line
            in_cts = rule(node_cts, *[env[v] for v in operands],
                          outs=tuple(env[v] for v in outs), **node.kwargs, **needed)
            for v, t, c in zip(operands, operand_types, in_cts):
                if c is not None and differentiable(t):
                    c = _fit(c, t, trace)
                    cts[v] = c if v not in cts else bind("add", cts[v], c)
    return cts


def vjp(graph: Graph, wrt: Sequence[int], fuse: bool = True, layout: str = "all",
        attention_devices: str = "cuda") -> Graph:
    """(inputs, output cotangents) -> (outputs, cotangents of inputs ``wrt``); ``fuse``,
    ``layout`` and ``attention_devices``: as ``joint`` takes them."""
    return joint(graph, wrt, range(len(graph.outputs)), fuse, layout, attention_devices)


def jvp(graph: Graph, wrt: Sequence[int]) -> Graph:
    """(inputs, tangents of inputs ``wrt``) -> (outputs, tangents of outputs): one forward
    pass, each node's tangents from its ``jvp`` rule, or derived from its ``vjp`` rule."""
    trace = Trace()
    with tracing(trace):
        primals = [trace.new_input(t) for t in graph.input_types]
        tangent = {Value(graph.inputs[i], 0): trace.new_input(graph.input_types[i])
                   for i in wrt}

        def visit(n, operands):
            node = graph.node(n)
            out = bind(node.prim, *operands, **node.kwargs)
            outs = list(out) if isinstance(out, tuple) else [out]
            types = [graph.type_of(v) for v in graph.operands(n)]
            tangents = [tangent.get(v) if differentiable(t) else None
                        for v, t in zip(graph.operands(n), types)]
            if all(t is None for t in tangents):
                return outs
            _check_complex(node, types)
            rule = get_primitive(node.prim).jvp
            out_tangents = rule(operands, tangents, tuple(outs), **node.kwargs) if rule else None
            if out_tangents is None:
                out_tangents = _derived_jvp(node, operands, tangents, types)
            for i, (t, ty) in enumerate(zip(out_tangents, node.out_types)):
                if t is not None and differentiable(ty):
                    tangent[Value(n, i)] = _fit(t, ty, trace)
            return outs

        env = replay(graph, primals, visit)
        outs = [env[v] for v in graph.outputs]
        tangents_out = [tangent[v] if v in tangent else zeros(t)
                        for v, t in zip(graph.outputs, graph.output_types)]
        return trace.builder.build([trace.value_of(x) for x in outs + tangents_out])


def _derived_jvp(node, operands, tangents, types) -> list:
    """A node's JVP from its VJP: the VJP is linear in its cotangents, so differentiating it
    in them (at zero), with the tangents as cotangents, gives J @ t."""
    builder = GraphBuilder()
    ins = [builder.add_input(t) for t in types]
    alone = builder.build(builder.add_node(node.prim, ins, node.kwargs, node.out_types,
                                           node.provenance))
    wrt = [i for i, t in enumerate(tangents) if t is not None]
    n_in, n_out = len(types), len(node.out_types)
    linear = vjp(alone, wrt)  # (x, u) -> (y, J^T u)
    transposed = vjp(linear, range(n_in, n_in + n_out))
    at_zero = [zeros(t) for t in node.out_types]
    results = inline(transposed, list(operands) + at_zero + at_zero + [tangents[i] for i in wrt])
    return results[n_out + len(wrt):]


# NOTE [forward and backward programs]
# Under torch.autograd a jitted call is one autograd node (api.py) whose forward and backward
# are two compiled programs, cut out of one joint graph: ``joint`` differentiates the traced
# graph (inputs, seeds) -> (outputs, gradients), simplification runs on it whole, and
# ``split`` cuts it. A node fed by a seed (a cotangent) is backward work; the backward program
# reads the forward values it needs (the residuals) as inputs. The VJP rules read many
# elementwise intermediates (a GELU written out, a layer norm's centred input, softmax's
# exponentials); saving each would hold several copies of every activation. So a forward
# value is recomputed in the backward program, where it fuses into the kernels that read it,
# rather than saved when it depends on no input (constants, ``full``, ``iota``), is a layout
# op (``_LAYOUT``: a broadcast saved would cost its broadcast size), or is elementwise with
# at most ``RECOMPUTE_LIMIT`` distinct elementwise nodes to redo back to the values that are
# saved: matrix products, reductions, gathers by computed positions, inputs, and elementwise
# values whose chain grew too long (a residual stream's running sum is saved every few
# blocks, not redone from the start). A gather by a table built at trace time reads one value
# per element, as an elementwise node does, and is redone like one where its result is no
# smaller than what it reads (``_gathers_by_a_table``): max pooling's backward
# gathers the saved indices of the windows holding each input position, four times their
# bytes, which the forward would otherwise store (1.6 GB for ResNet-50's first pooling).
# Values that combine values read through a strided slice of a saved value are saved, not
# redone: redoing them would save the whole sliced value (max pooling's scan, NOTE [strided
# max pooling], would save its padded input, four times its result, and redo its last
# entries from it); a value of one such value alone (the scan's result compared with an
# entry) is redone from it. The
# limit fits a GELU's derivative after a bias, in float32 for bfloat16 operands:
# under a lower one its float32 intermediates were saved, twice the activation's bytes each
# (GPT-2 small's module path held 1.5 GB more than its functional step). A custom VJP's
# marker is gone by then (``erase_markers``): a BatchNorm's output is redone from its input
# and statistics, which its backward saves anyway. An effectful node (a random draw, a
# check) runs once, in the forward program: a dropout mask is saved, never drawn again.
_LAYOUT = frozenset({"broadcast_in_dim", "reshape", "transpose", "squeeze", "slice"})
RECOMPUTE_LIMIT = 16
# Nodes this small (per-channel statistics: a BatchNorm's mean and 1/std from its sums) are
# redone at no cost and do not count against the limit.
RECOMPUTE_FREE_NUMEL = 4096


def _gathers_by_a_table(g: Graph, n: int, pinned: set[int]) -> bool:
    """Does gather ``n`` pick by a table built at trace time (depending on no input), making
    no fewer values than it reads from (saved, its result would cost more than its data)?"""
    data, index = g.operands(n)
    return index.node not in pinned and \
        g.type_of(Value(n, 0)).numel_hint >= g.type_of(data).numel_hint


def _recomputed(g: Graph, pinned: set[int]) -> dict[int, frozenset]:
    """Forward node -> the elementwise nodes to redo to recompute it from saved values, for
    the nodes recomputed rather than saved (one sweep in program order; each set is
    bounded, so the sweep is linear). Distinct nodes: a value read twice on the way (a GELU's
    x, x**3) is redone once."""
    redo: dict[int, frozenset] = {}
    strided: set[int] = set()  # read through a strided slice of a saved value: saved
    for n in g.order:
        prim = g.node(n).prim
        if n not in pinned or prim == "input" or is_effectful(g.node(n)):
            continue
        read = {v.node for v in g.operands(n)} & pinned
        combines = len(read) > 1 and bool(read & strided)
        slices_saved = prim == "slice" and max(g.node(n).kwargs["step"]) > 1 and \
            not all(r in redo or g.node(r).prim == "input" for r in read)
        if combines or slices_saved:
            if prim in _LAYOUT or prim in ELEMENTWISE:
                strided.add(n)
            continue
        if prim in _LAYOUT or prim in ELEMENTWISE or prim == "gather" and \
                _gathers_by_a_table(g, n, pinned):
            free = prim in _LAYOUT or g.node(n).out_types[0].numel_hint <= RECOMPUTE_FREE_NUMEL
            nodes = frozenset(() if free else (n,)).union(
                *(redo.get(v.node, ()) for v in g.operands(n)))
            if len(nodes) <= RECOMPUTE_LIMIT:
                redo[n] = nodes
    return redo


def reaching(graph: Graph) -> list[int]:
    """For each output, the bit set of the inputs it depends on through floating-point
    values: the inputs a cotangent of that output reaches (eager's autograd records no
    path through an integer or boolean value). One pass in order, a bit set per node."""
    position = {n: i for i, n in enumerate(graph.inputs)}
    masks: dict[int, int] = {}
    for n in graph.order:
        mask = 1 << position[n] if n in position else 0
        for v in graph.operands(n):
            if differentiable(graph.type_of(v)):
                mask |= masks[v.node]
        masks[n] = mask
    return [masks[v.node] if differentiable(graph.type_of(v)) else 0 for v in graph.outputs]


def joint(graph: Graph, wrt: Sequence[int], seeded: Sequence[int], fuse: bool = True,
          layout: str = "all", attention_devices: str = "cuda") -> Graph:
    """(inputs, one seed per output in ``seeded``) -> (outputs, cotangents of inputs ``wrt``);
    seeds of outputs that are not floating point are ignored (NOTE [autodiff]). Attention
    written out is fused first (``fuse``, ``config.fuse_attention``), to differentiate by its
    fused rule (NOTE [attention fusion]), stored as its kernels store it on the devices
    ``attention_devices`` names (``config.attention_layout``: NOTE [attention in the
    kernels' layout]), and convolutions made channels-last (on the devices ``layout``
    names, ``config.channels_last``), so their backward is too (NOTE [channels-last
    convolutions])."""
    graph = channels_last(attention_layout(fuse_attention(graph) if fuse else graph,
                                           attention_devices), layout)
    trace = Trace()
    with tracing(trace):
        primals = [trace.new_input(t) for t in graph.input_types]
        seeds = [trace.new_input(graph.output_types[k]) for k in seeded]
        env = replay(graph, primals)
        outs = [env[v] for v in graph.outputs]
        seed_of: dict[Value, object] = {}
        for k, s in zip(seeded, seeds):
            v = graph.outputs[k]
            if differentiable(graph.output_types[k]):
                seed_of[v] = s if v not in seed_of else bind("add", seed_of[v], s)
        cts = backward(graph, env, seed_of, trace, wrt)
        grads = [cts.get(Value(graph.inputs[i], 0)) for i in wrt]
        grads = [g if g is not None else zeros(graph.input_types[i]) for g, i in zip(grads, wrt)]
        return trace.builder.build([trace.value_of(x) for x in outs + grads])


def _backward_part(g: Graph, n_outputs: int, tangent: set[int], pinned: set[int],
                   recomputed: dict) -> tuple[set[int], dict[Value, None]]:
    """The joint graph's nodes the backward program runs, and the forward values it reads
    (the residuals, in the order first reached)."""
    in_backward: set[int] = set()
    residuals: dict[Value, None] = {}
    stack = list(g.outputs[n_outputs:])
    while stack:
        v = stack.pop()
        node = g.node(v.node)
        if v.node in in_backward or v in residuals or v.node in tangent and node.prim == "input":
            continue
        if node.prim != "input" and (v.node in tangent or v.node not in pinned
                                     or v.node in recomputed):
            in_backward.add(v.node)
            stack += g.operands(v.node)
        else:
            residuals[v] = None
    return in_backward, residuals


# NOTE [saved instead of redone]
# Recomputing a value is free in memory only where what it is redone from is saved anyway.
# The recomputed nodes the backward runs form regions (joined where one reads another); a
# region reads saved values and hands values to the backward's own work (the nodes fed by
# cotangents). Where every value it hands is one the forward stores anyway (an operand of a
# library call, whose lazy views lowering stores for it, or a forward output) and together
# they take no more bytes than the saved values only that region reads, they are saved
# instead: the same memory, and the backward no longer recomputes them. Attention written
# out over heads cut from one projection: the heads its products read are saved, not the
# projection (then biased and copied per head again in the backward: ViT-B/16's 36 such
# copies); softmax's probabilities (its rule reads them alone), not the scores. A reshape
# of a value stands for that value (the same memory), and a view the forward does not store
# (a broadcast of a row's sum) is looked through to what it views.
def _stored_instead(g: Graph, n_outputs: int, recomputed: dict, in_backward: set[int],
                    residuals: dict[Value, None]) -> set[int]:
    """The recomputed nodes better saved (NOTE [saved instead of redone]): those whose
    values a region of recomputed nodes hands to the backward's own work, where they are
    values the forward stores anyway and take no more bytes than the saved values that only
    that region reads."""
    from .lowering import reads_memory  # here: a warm start loads programs, never lowering
    redone = [n for n in g.order if n in in_backward and n in recomputed]
    region = {n: n for n in redone}

    def root(n: int) -> int:
        while region[n] != n:
            region[n] = n = region[region[n]]
        return n

    for n in redone:
        for v in g.operands(n):
            if v.node in region:
                region[root(v.node)] = root(n)
    computed: set[int] = set()  # what the forward computes for its outputs
    stack = [v.node for v in g.outputs[:n_outputs]]
    while stack:
        n = stack.pop()
        if n not in computed:
            computed.add(n)
            stack += [v.node for v in g.operands(n)]

    def viewed(v: Value) -> Value | None:
        """What ``v`` reshapes in place: a value that is not itself a view."""
        if g.node(v.node).prim != "reshape":
            return None
        (u,) = g.operands(v.node)
        return u if g.node(u.node).prim not in _LAYOUT else None

    # the forward's outputs and what its library calls read (a view, as its copy; the value
    # a reshape views in place)
    stored_anyway = {v.node for v in g.outputs[:n_outputs]}
    for n in computed:
        if reads_memory(g.node(n).prim):
            for v in g.operands(n):
                stored_anyway.add(v.node)
                if (u := viewed(v)) is not None:
                    stored_anyway.add(u.node)
    handed: dict[int, set[Value]] = {}  # region -> its values the backward's work reads
    reads: dict[int, set[Value]] = {}  # region -> the residuals it reads
    shared: set[Value] = set()  # residuals read by the backward's work or by two regions

    def hand(v: Value) -> None:
        """``v`` of a region is read outside it: stored, or if it reshapes a value in
        place or is a view the forward does not store, what it views (a broadcast of a
        row's sum stays redone from the sum)."""
        if (u := viewed(v)) is not None and u.node in region:
            hand(u)
            return
        if g.node(v.node).prim not in _LAYOUT or v.node in stored_anyway:
            handed.setdefault(root(v.node), set()).add(v)
            return
        for u in g.operands(v.node):
            if u.node in region:
                hand(u)
            elif u in residuals:
                shared.add(u)

    for n in in_backward:
        mine = root(n) if n in region else None
        for v in g.operands(n):
            if v.node in region and root(v.node) != mine:
                hand(v)
            if v in residuals:
                if mine is None:
                    shared.add(v)
                else:
                    reads.setdefault(mine, set()).add(v)
    for v in g.outputs[n_outputs:]:
        if v.node in region:
            hand(v)
    owners: dict[Value, int] = {}
    for r, vs in reads.items():
        for v in vs:
            if owners.setdefault(v, r) != r:
                shared.add(v)
    stored: set[int] = set()
    for r, values in handed.items():
        freed = sum(g.type_of(v).nbytes_hint for v in reads.get(r, set()) - shared
                    if g.node(v.node).prim != "input")
        if all(v.node in stored_anyway for v in values) and \
                sum(g.type_of(v).nbytes_hint for v in values) <= freed:
            stored.update(v.node for v in values)
    return stored


def split(joint_graph: Graph, n_primals: int, n_outputs: int,
          unchanged: frozenset[int] = frozenset()) -> tuple[Graph, Graph, tuple[int, ...]]:
    """The forward program (primals -> outputs, residuals) and the backward one (primals
    read, residuals, seeds -> cotangents) of ``joint``'s graph (NOTE [forward and backward
    programs]), and which primals the backward reads. A primal in ``unchanged`` (one the
    call does not write) is read by the backward where it is, not returned by the forward."""
    g = joint_graph
    tangent, pinned = set(g.inputs[n_primals:]), set(g.inputs[:n_primals])
    for n in g.order:
        operands = {v.node for v in g.operands(n)}
        if operands & tangent:
            tangent.add(n)
        elif operands & pinned or is_effectful(g.node(n)):
            pinned.add(n)
    recomputed = _recomputed(g, pinned)
    in_backward, residuals = _backward_part(g, n_outputs, tangent, pinned, recomputed)
    if stored := _stored_instead(g, n_outputs, recomputed, in_backward, residuals):
        recomputed = {n: nodes for n, nodes in recomputed.items() if n not in stored}
        in_backward, residuals = _backward_part(g, n_outputs, tangent, pinned, recomputed)
    position = {g.inputs[i]: i for i in unchanged}
    read = [v for v in residuals if v.node in position]
    saved = [v for v in residuals if v.node not in position]
    forward_outputs = list(g.outputs[:n_outputs]) + saved
    in_forward: set[int] = set()
    stack = [v.node for v in forward_outputs] + [n for n in pinned if is_effectful(g.node(n))]
    while stack:
        n = stack.pop()
        if n not in in_forward:
            in_forward.add(n)
            stack += [v.node for v in g.operands(n)] + list(g.control_preds(n))
    primals = [Value(n, 0) for n in g.inputs[:n_primals]]
    seeds = [Value(n, 0) for n in g.inputs[n_primals:]]
    return (extract(g, in_forward, primals, forward_outputs),
            extract(g, in_backward, read + saved + seeds, g.outputs[n_outputs:]),
            tuple(position[v.node] for v in read))


# ---------------------------------------------------------------------------------------
# Second derivatives of attention: attention_backward's rules, from the written-out form's
# VJP (NOTE [attention fusion]), taken without fusing it back
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _backward_graph(types: tuple, scale: float, causal: bool) -> Graph:
    """(q, k, v[, bias], ct) -> (out, dq, dk, dv): the written-out attention's VJP."""
    forward = graph_of(lambda q, k, v, *bias: [
        attention_scores(q, k, scale, causal, *bias).softmax(-1) @ v], types)
    return vjp(forward, [0, 1, 2], fuse=False)


def _graph_for(q, k, v, bias, scale, causal) -> Graph:
    trace = current_trace()
    return _backward_graph(tuple(trace.type_of(x) for x in (q, k, v, *bias)), scale, causal)


def _backward_vjp(cts, ct, q, k, v, out, lse, *bias, outs, scale, causal=False, dropout=0.0,
                  kernel=None, bshd=False):
    if dropout:
        refuse_dropout_derivative("a second derivative")

    ct, q, k, v = heads_first(bshd, ct, q, k, v)
    graph = _graph_for(q, k, v, bias, scale, causal)
    second = vjp(graph, range(len(graph.inputs)), fuse=False)
    seeds = [zeros(graph.output_types[0]), *(
        c if c is not None else torch.zeros_like(x)
        for c, x in zip(heads_first(bshd, *cts), (q, k, v)))]
    *grads, gct = inline(second, [q, k, v, *bias, ct, *seeds])[4:]
    # none for out and lse: they are functions of q, k and v (and the bias), whose
    # cotangents above are the written-out form's, which reads no out or lse
    return [*heads_first(bshd, gct, *grads[:3]), None, None, *grads[3:]]


def _backward_jvp(operands, tangents, outs, *, scale, causal=False, dropout=0.0,
                  kernel=None, bshd=False):
    if dropout:
        refuse_dropout_derivative("a second derivative")

    ct, q, k, v, _, _, *bias = operands  # (out and lse: as in _backward_vjp)
    ct, q, k, v = heads_first(bshd, ct, q, k, v)
    graph = _graph_for(q, k, v, bias, scale, causal)
    # in the graph's input order
    given = [*heads_first(bshd, *tangents[1:4]), *tangents[6:],
             *heads_first(bshd, tangents[0])]
    wrt = [i for i, t in enumerate(given) if t is not None]
    return list(heads_first(bshd, *inline(jvp(graph, wrt),
                                           [q, k, v, *bias, ct, *(given[i] for i in wrt)])[5:8]))


get_primitive("attention_backward").vjp = _backward_vjp
get_primitive("attention_backward").jvp = _backward_jvp
