"""Differentiation as graph -> graph passes: ``vjp`` (reverse mode) and ``jvp`` (forward).

NOTE [autodiff]
``vjp(graph, wrt)`` returns a graph taking the original inputs followed by one cotangent per
output, and returning the original outputs followed by the cotangents of the inputs listed in
``wrt``. It replays the forward graph into a fresh trace, then walks the nodes backwards and
applies each primitive's ``vjp`` rule::

    rule(cotangents_of_outputs, *operands, outs=outputs, **params) -> one cotangent per operand

Rules are written with torch calls on tracers (traced like user code) or ``bind``; they see
the forward values they need, and only those stay alive, so the saved residuals are exactly
what the rules read. A ``None`` cotangent means zero. Integer and boolean values carry no
cotangent (as in torch.func); complex values are refused for now.

``jvp(graph, wrt)`` is one forward pass: each node's tangents come from its primitive's
``jvp`` rule (``rule(operands, tangents, outs, **params)``). Elementwise primitives share
their derivative tables with the VJP rules; linear ones map tangents through themselves. A
primitive without a ``jvp`` rule has one derived from its ``vjp`` rule: the VJP is linear in
its cotangent, so differentiating it once more with respect to the cotangent (at zero), with
the tangent as cotangent, gives J @ t (simplification then removes the dead half).
"""
from __future__ import annotations

from typing import Sequence

from ..errors import UnsupportedOpError
from ..graph import Graph, GraphBuilder, TensorType, Value
from ..tracer.primitives import get_primitive
from ..tracer.trace import Trace, bind, tracing
from .interpret import inline, replay


def differentiable(t: TensorType) -> bool:
    return t.dtype.is_floating_point


def zeros(t: TensorType):
    return bind("full", shape=t.shape, value=0.0, dtype=t.dtype, device=t.device)


def _fit(ct, t: TensorType, trace: Trace):
    """A rule's cotangent, checked against its operand's type (and cast to its dtype)."""
    ct_t = trace.type_of(ct)
    if ct_t.shape != t.shape:
        raise AssertionError(f"VJP rule returned a cotangent of {ct_t} for an operand of {t}")
    return ct if ct_t.dtype == t.dtype else bind("convert", ct, dtype=t.dtype)


def _refuse_complex(node, operand_types) -> None:
    if any(t.dtype.is_complex for t in (*operand_types, *node.out_types)):
        raise UnsupportedOpError(f"differentiating {node.prim} on complex values is not "
                                 "supported yet; differentiate a real-valued function")


def backward(graph: Graph, env: dict[Value, object], seeds: dict[Value, object],
             trace: Trace) -> dict[Value, object]:
    """Propagate cotangents from ``seeds`` (graph value -> tracer) to every value; return the
    accumulated cotangents (graph value -> tracer) of the values reached."""
    cts: dict[Value, object] = dict(seeds)
    for n in reversed(graph.order):
        node = graph.node(n)
        if node.prim in ("input", "constant"):
            continue
        outs = [Value(n, i) for i in range(len(node.out_types))]
        node_cts = [cts.pop(v, None) for v in outs]
        operands = graph.operands(n)
        operand_types = [graph.type_of(v) for v in operands]
        if all(c is None for c in node_cts):
            continue
        _refuse_complex(node, operand_types)
        if not any(map(differentiable, operand_types)):
            continue
        rule = get_primitive(node.prim).vjp
        if rule is None:
            what = f"{node.prim} ({node.kwargs['op']})" if node.prim == "opaque" else node.prim
            raise UnsupportedOpError(
                f"the primitive {what} has no derivative rule, so plait cannot differentiate "
                f"through it (traced from {node.provenance.aten or 'the function'}). Keep this "
                "op outside the differentiated function.")
        node_cts = [c if c is not None or not differentiable(t) else zeros(t)
                    for c, t in zip(node_cts, node.out_types)]
        in_cts = rule(node_cts, *[env[v] for v in operands],
                      outs=tuple(env[v] for v in outs), **node.kwargs)
        for v, t, c in zip(operands, operand_types, in_cts):
            if c is not None and differentiable(t):
                c = _fit(c, t, trace)
                cts[v] = c if v not in cts else bind("add", cts[v], c)
    return cts


def vjp(graph: Graph, wrt: Sequence[int]) -> Graph:
    """(inputs, output cotangents) -> (outputs, cotangents of inputs ``wrt``)."""
    trace = Trace()
    with tracing(trace):
        primals = [trace.new_input(t) for t in graph.input_types]
        seeds = [trace.new_input(t) for t in graph.output_types]
        env = replay(graph, primals)
        outs = [env[v] for v in graph.outputs]
        seed_of: dict[Value, object] = {}
        for v, t, s in zip(graph.outputs, graph.output_types, seeds):
            if differentiable(t):
                seed_of[v] = s if v not in seed_of else bind("add", seed_of[v], s)
        cts = backward(graph, env, seed_of, trace)
        grads = []
        for i in wrt:
            v, t = Value(graph.inputs[i], 0), graph.input_types[i]
            grads.append(cts.get(v) if v in cts else zeros(t))
        return trace.builder.build([trace.value_of(x) for x in outs + grads])


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
            _refuse_complex(node, types)
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
