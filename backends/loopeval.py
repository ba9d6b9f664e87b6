"""The ``loops`` backend: lower a graph (passes/lowering.py) and evaluate the LoopProgram with
torch, one whole kernel at a time over a grid of its loop variables.

It is the reference for lowering, independent of any code generator: a lowering bug shows
up here as a wrong answer, a code generator bug only in that generator.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import sympy
import torch

from ..graph import Graph
from ..graph.loops import Apply, Constant, Extern, IndexValue, Load, LoopProgram, Reduce
from ..tracer.primitives import get_primitive


def _index(expr, env: dict, shape):
    """A sympy index expression (or condition) evaluated on the grid ``env``."""
    if isinstance(expr, sympy.Symbol):
        return env[expr.name]
    if expr.is_Integer or expr is sympy.true or expr is sympy.false:
        return torch.full(shape, int(expr) if expr.is_Integer else bool(expr))
    if isinstance(expr, sympy.floor):
        num, den = expr.args[0].as_numer_denom()
        return torch.div(_index(num, env, shape), int(den), rounding_mode="floor")
    ops = {sympy.Add: torch.add, sympy.Mul: torch.mul, sympy.Mod: torch.remainder,
           sympy.Max: torch.maximum, sympy.Min: torch.minimum, sympy.And: torch.logical_and,
           sympy.StrictLessThan: torch.lt, sympy.GreaterThan: torch.ge,
           sympy.LessThan: torch.le, sympy.StrictGreaterThan: torch.gt}
    args = [_index(a, env, shape) for a in expr.args]
    result = args[0]
    for a in args[1:]:
        result = ops[type(expr)](result, a)
    return result


def _value(expr, env, shape, buffers, memo):
    if expr in memo:
        return memo[expr]
    if isinstance(expr, Load):
        out = buffers[expr.buffer].reshape(-1)[_index(expr.index, env, shape)]
    elif isinstance(expr, Constant):
        out = torch.full(shape, expr.value, dtype=expr.dtype)
    elif isinstance(expr, IndexValue):
        out = _index(expr.expr, env, shape).to(expr.dtype)
    elif isinstance(expr, Apply):
        args = [_value(a, env, shape, buffers, memo) for a in expr.args]
        out = get_primitive(expr.op).impl(*args, **expr.kwargs)
    else:
        raise TypeError(f"not an expression: {expr!r}")
    memo[expr] = out
    return out


def _reduce(r: Reduce, outer, env, shape, buffers):
    body = _value(r.body, env, shape, buffers, {})
    rows = body.reshape(*outer, math.prod(shape[len(outer):]))
    if r.op in ("argmax", "argmin"):
        return getattr(torch, r.op)(rows, -1)
    if not rows.shape[-1] and r.op in ("sum", "prod"):
        return torch.full(tuple(outer), 0 if r.op == "sum" else 1, dtype=r.dtype)
    return {"sum": torch.sum, "prod": torch.prod, "amax": torch.amax,
            "amin": torch.amin}[r.op](rows, -1).to(r.dtype)


def _grid(outer, red) -> dict:
    """Index tensors of the loop variables over the grid outer + red."""
    shape = outer + red
    grids = torch.meshgrid(*[torch.arange(n) for n in shape], indexing="ij") if shape else ()
    names = [f"x{i}" for i in range(len(outer))] + [f"r{i}" for i in range(len(red))]
    return dict(zip(names, grids))


def _run_kernel(kernel, buffers, program):
    outer, red = tuple(kernel.sizes), tuple(kernel.reduction_sizes)
    if not math.prod(outer):
        return
    shape = outer + red
    env, point = _grid(outer, red), _grid(outer, ())
    for store in kernel.stores:
        value = store.value
        if isinstance(value, Reduce):
            value = _reduce(value, outer, env, shape, buffers)
        else:
            value = _value(value, point, outer, buffers, {})
        out = buffers.setdefault(store.buffer, _empty(program.buffers[store.buffer]))
        out.reshape(-1)[_index(store.index, point, outer)] = value.to(out.dtype)


def run_program(program: LoopProgram, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    buffers = {n: _empty(b) for n, b in program.buffers.items() if not b.type.numel}
    buffers |= dict(zip(program.inputs, (t.contiguous() for t in inputs)))
    buffers |= program.constants
    for kernel in program.kernels:
        if isinstance(kernel, Extern):
            outs = kernel.fn(*[buffers[n] for n in kernel.inputs], **dict(kernel.params))
            buffers.update(zip(kernel.outputs, (o.contiguous() for o in outs)))
        else:
            _run_kernel(kernel, buffers, program)
    return [buffers[n] for n in program.outputs]


def _empty(buffer):
    return torch.empty(buffer.type.shape, dtype=buffer.type.dtype)


def compile_graph(graph: Graph) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]:
    from ..passes.lowering import lower

    program = lower(graph)
    return lambda inputs: run_program(program, inputs)


