"""The reference backend: run a graph primitive by primitive with torch.

Compilation resolves every node to (implementation, operand slots, params) once, so a call
is a tight loop; a slot is dropped right after its last use, as a real backend frees buffers.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..graph import Graph
from ..errors import BackendError
from ..graph.types import concrete, is_symbolic, size_bindings, size_values, unbound_symbols
from ..tracer.registry import get_primitive


def compile_graph(graph: Graph) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]:
    # Slots: graph inputs first, then every node output in topological order.
    slot: dict[tuple[int, int], int] = {}
    steps = []
    for n in graph.order:
        node = graph.node(n)
        if node.prim == "input":
            slot[(n, 0)] = node.kwargs["index"]
        else:
            steps.append(n)
    size = len(graph.inputs)
    for n in steps:
        for i in range(len(graph.node(n).out_types)):
            slot[(n, i)], size = size, size + 1
    operand_slots = {n: tuple(slot[(v.node, v.index)] for v in graph.operands(n)) for n in steps}
    last_use = {s: step for step, n in enumerate(steps) for s in operand_slots[n]}
    out_slots = [slot[(v.node, v.index)] for v in graph.outputs]

    constants: dict[int, torch.Tensor] = {}
    program = []
    for step, n in enumerate(steps):
        node = graph.node(n)
        outs = tuple(slot[(n, i)] for i in range(len(node.out_types)))
        if node.prim == "constant":
            constants[outs[0]] = node.kwargs["value"].tensor
            continue
        prim = get_primitive(node.prim)
        ins = operand_slots[n]
        dead = tuple(s for s in set(ins) if last_use[s] == step and s not in out_slots)
        program.append((prim.impl, ins, node.kwargs, is_symbolic(node.params), outs,
                        prim.multiple_results, dead))
    bindings = size_bindings(graph.input_types)
    if unbound := unbound_symbols(bindings, (t for n in steps for t in graph.node(n).out_types)):
        raise BackendError(f"the graph's sizes {sorted(map(str, unbound))} are no input's "
                           "dimension: a call cannot read them")

    def run(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        env = [None] * size
        env[:len(inputs)] = inputs
        for s, t in constants.items():
            env[s] = t
        sizes = size_values(bindings, inputs) if bindings else None  # NOTE [symbolic sizes]
        for impl, ins, params, symbolic, outs, multiple, dead in program:
            if symbolic:
                params = {k: concrete(v, sizes) for k, v in params.items()}
            result = impl(*[env[i] for i in ins], **params)
            if multiple:
                for s, r in zip(outs, result):
                    env[s] = r
            else:
                env[outs[0]] = result
            for s in dead:
                env[s] = None
        # torch's views keep their strides; a graph's values are dense in their dims' order
        # (the call lays results out as eager does: NOTE [eager's layouts of results])
        return [env[s].contiguous() for s in out_slots]

    return run
