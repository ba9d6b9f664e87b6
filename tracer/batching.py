"""Vectorization as a graph -> graph pass: ``vmap``.

NOTE [batching]
``vmap(graph, batched, axis_size)`` returns a graph taking the same inputs, where those marked
``batched`` carry an extra leading dimension of ``axis_size``, and computing every example at
once; it also says which outputs are batched (the others are the same for every example).
Batch dimensions are always leading, so each primitive's ``batch`` rule is short::

    rule(operands, batched, axis_size, **params) -> (outputs, which outputs are batched)

A rule is only called when some operand is batched. A primitive without a rule, or whose
rule returns NotImplemented for these operands, runs once per example (a loop, unrolled in
the graph: correct for every primitive, opaque ops included, but not vectorized). Random
ops follow ``randomness``: "error" refuses them, "different" draws per example (the loop),
"same" draws once for all examples.
"""
from __future__ import annotations

from typing import Sequence

import attrs

from ..errors import UnsupportedOpError
from ..graph import Graph, Value
from .nn import conv_vjp_written
from .primitives import loop
from .registry import draws_random, get_primitive, is_effectful
from .trace import Trace, bind, current_trace, tracing
from .interpret import graph_of, inline, replay

RANDOMNESS = ("error", "different", "same")


def _outs(result) -> list:
    return list(result) if isinstance(result, tuple) else [result]


def vmap(graph: Graph, batched: Sequence[bool], axis_size: int,
         randomness: str = "error") -> tuple[Graph, list[bool]]:
    trace = Trace()
    is_batched: dict[Value, bool] = {}
    with tracing(trace):
        inputs = []
        for t, b in zip(graph.input_types, batched):
            inputs.append(trace.new_input(type(t)((axis_size, *t.shape), t.dtype, t.device)
                                          if b else t))

        def visit(n, operands):
            node = graph.node(n)
            flags = [is_batched[v] for v in graph.operands(n)]
            if draws_random(node):
                outs, out_flags = _random(node, operands, flags, axis_size, randomness)
            elif not any(flags) and not (is_effectful(node) and node.prim == "opaque"):
                outs, out_flags = _outs(bind(node.prim, *operands, **node.kwargs)), None
            else:
                rule = get_primitive(node.prim).batch
                result = rule(operands, flags, axis_size, **node.kwargs) if rule \
                    else NotImplemented
                outs, out_flags = result if result is not NotImplemented else \
                    loop(node.prim, operands, flags, axis_size, node.kwargs)
                outs = _outs(outs) if not isinstance(outs, list) else outs
            for i in range(len(node.out_types)):
                is_batched[Value(n, i)] = bool(out_flags[i]) if out_flags else False
            return outs

        for n, b in zip(graph.inputs, batched):
            is_batched[Value(n, 0)] = b
        env = replay(graph, inputs, visit)
        out = trace.builder.build([trace.value_of(env[v]) for v in graph.outputs])
    return out, [is_batched[v] for v in graph.outputs]


def _random(node, operands, flags, axis_size, randomness):
    op = node.kwargs["op"] if node.prim == "opaque" else f"{node.prim} with dropout"
    if randomness == "error":
        raise UnsupportedOpError(
            f"vmap: {op} draws random numbers, and vmap(randomness='error') (the default) "
            "refuses random ops; pass randomness='different' (independent draws per example) "
            "or 'same' (one draw shared by all examples)")
    if randomness == "same" and not any(flags):
        return _outs(bind(node.prim, *operands, **node.kwargs)), None
    if randomness == "same":
        raise UnsupportedOpError(f"vmap(randomness='same'): {op} takes a batched operand, so "
                                 "its draws cannot be shared")
    return loop(node.prim, operands, flags, axis_size, node.kwargs)


def _written_out(form):
    """The batching rule of a primitive that computes what ``form`` (torch calls on tracers)
    writes out: ``form`` vmapped (NOTE [convolution backward])."""
    def rule(operands, batched, axis_size, **params):
        trace = current_trace()
        types = [trace.type_of(x) for x in operands]
        types = [attrs.evolve(t, shape=t.shape[1:]) if b else t for t, b in zip(types, batched)]
        graph = graph_of(lambda *ins: form(*ins, **params), types)
        batched_graph, flags = vmap(graph, batched, axis_size)
        return inline(batched_graph, operands), flags

    return rule


get_primitive("conv_backward").batch = _written_out(
    lambda ct, lhs, rhs, lhs_grad=True, **params:
    conv_vjp_written([ct], lhs, rhs, **params)[not lhs_grad:])
