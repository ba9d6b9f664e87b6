"""The ``loops`` backend: the LoopProgram the driver scheduled (NOTE [pipeline]: lowered,
fused and through the memory passes, as for every code generator) evaluated with torch, one
whole kernel at a time over a grid of its loops.

It is the reference for the loop passes, independent of any code generator: a bug in them
shows up here as a wrong answer, a code generator bug only in that generator.
"""
from __future__ import annotations

import math
from typing import Sequence

import sympy
import torch

from ..graph.loops import (Apply, Constant, Extern, IndexValue, Load, LoopProgram, Reduce,
                           is_inner)
from ..tracer.primitives import ELEMENTWISE
from ..tracer.registry import get_primitive
from .codegen import INDEX_OUT_OF_RANGE, Target, extern_results, kernel_error

# the dtypes its kernels compute in (others: externs, which run torch)
_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
           torch.uint8, torch.bool)


def _index(expr, env: dict, shape):
    """A sympy index expression (or condition) evaluated on the grid ``env``."""
    if isinstance(expr, sympy.Symbol):
        return env[expr.name]
    if expr.is_Integer or expr is sympy.true or expr is sympy.false:
        return torch.full(shape, int(expr) if expr.is_Integer else bool(expr))
    if isinstance(expr, sympy.floor):
        num, den = expr.args[0].as_numer_denom()
        return torch.div(_index(num, env, shape), int(den), rounding_mode="floor")
    if isinstance(expr, sympy.core.relational.Relational):  # compared as lhs - rhs times its
        num, _ = (expr.lhs - expr.rhs).as_numer_denom()     # positive denominator, with 0
        return _OPS[type(expr)](_index(num, env, shape), 0)
    args = [_index(a, env, shape) for a in expr.args]
    result = args[0]
    for a in args[1:]:
        result = _OPS[type(expr)](result, a)
    return result


_OPS = {sympy.Add: torch.add, sympy.Mul: torch.mul, sympy.Mod: torch.remainder,
        sympy.Max: torch.maximum, sympy.Min: torch.minimum, sympy.And: torch.logical_and,
        sympy.StrictLessThan: torch.lt, sympy.GreaterThan: torch.ge,
        sympy.LessThan: torch.le, sympy.StrictGreaterThan: torch.gt}


class _KernelEval:
    """Values of one kernel's expressions, on the grid of its outer loops ("point") or of its
    outer and reduction loops ("full"); a reduction is computed on the full grid and, used
    inside the reduction loops (an inner store or a later reduction), broadcast over them."""

    def __init__(self, kernel, buffers):
        self.outer, self.red = tuple(kernel.sizes), tuple(kernel.reduction_sizes)
        self.grids = {"point": _grid(self.outer, ()), "full": _grid(self.outer, self.red)}
        self.shapes = {"point": self.outer, "full": self.outer + self.red}
        self.buffers, self.memo = buffers, {}

    def index(self, expr, ctx, positions: dict | None = None):
        """``expr`` over the context's grid, and a gather's ``positions`` where given."""
        grid = self.grids[ctx] if positions is None else self.grids[ctx] | positions
        return _index(expr, grid, self.shapes[ctx])

    def value(self, expr, ctx):
        key = (expr, ctx)
        if key not in self.memo:
            self.memo[key] = self._value(expr, ctx)
        return self.memo[key]

    def _value(self, expr, ctx):
        shape = self.shapes[ctx]
        if isinstance(expr, Load):
            return self.buffers[expr.buffer].reshape(-1)[
                self.index(expr.index, ctx, self.positions(expr, ctx))]
        if isinstance(expr, Constant):
            return torch.full(shape, expr.value, dtype=expr.dtype)
        if isinstance(expr, IndexValue):
            return self.index(expr.expr, ctx).to(expr.dtype)
        if isinstance(expr, Apply):
            args = [self.value(a, ctx) for a in expr.args]
            return get_primitive(expr.op).impl(*args, **expr.kwargs)
        if isinstance(expr, Reduce):
            out = self._reduce(expr)
            return out if ctx == "point" else out.reshape(
                self.outer + (1,) * len(self.red)).expand(shape)
        raise TypeError(f"not an expression: {expr!r}")

    def positions(self, load: Load, ctx) -> dict:
        """An indirect load's positions ``i0..`` on the grid (NOTE [kernel errors]: one out
        of range raises, as eager's gather)."""
        out = {}
        for k, (p, n) in enumerate(load.indirect):
            p = self.value(p, ctx).to(torch.int64)
            if ((p < 0) | (p >= n)).any():
                raise kernel_error(INDEX_OUT_OF_RANGE)
            out[f"i{k}"] = p
        return out

    def _reduce(self, r: Reduce):
        rows = self.value(r.body, "full").reshape(*self.outer, math.prod(self.red))
        if r.op in ("argmax", "argmin"):
            return getattr(torch, r.op)(rows, -1)
        if not rows.shape[-1] and r.op in ("sum", "prod"):
            return torch.full(self.outer, 0 if r.op == "sum" else 1, dtype=r.dtype)
        return {"sum": torch.sum, "prod": torch.prod, "amax": torch.amax,
                "amin": torch.amin}[r.op](rows, -1).to(r.dtype)


def _grid(outer, red) -> dict:
    """Index tensors of the loop variables over the grid outer + red."""
    shape = outer + red
    grids = torch.meshgrid(*[torch.arange(n) for n in shape], indexing="ij") if shape else ()
    names = [f"x{i}" for i in range(len(outer))] + [f"r{i}" for i in range(len(red))]
    return dict(zip(names, grids))


def _run_kernel(kernel, buffers, program):
    if not math.prod(kernel.sizes):
        return
    evaluate = _KernelEval(kernel, buffers)
    for store in kernel.stores:
        ctx = "full" if is_inner(store) else "point"
        out = buffers.setdefault(store.buffer, _empty(program.buffers[store.buffer]))
        out.reshape(-1)[evaluate.index(store.index, ctx)] = evaluate.value(
            store.value, ctx).to(out.dtype)


def run_program(program: LoopProgram, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    buffers = {n: _empty(b) for n, b in program.buffers.items() if not b.type.numel}
    buffers |= dict(zip(program.inputs, (t.contiguous() for t in inputs)))
    buffers |= program.constants
    for kernel in program.kernels:
        if isinstance(kernel, Extern):
            outs = extern_results(kernel, [buffers[n] for n in kernel.inputs],
                                   [program.buffers[b].type for b in kernel.outputs])
            buffers.update(zip(kernel.outputs, outs))
        else:
            _run_kernel(kernel, buffers, program)
    return [buffers[n] for n in program.outputs]


def _empty(buffer):
    return torch.empty(buffer.type.shape, dtype=buffer.type.dtype)


def target() -> Target:
    """What the ``loops`` backend evaluates: every elementwise primitive and view, in every
    dtype torch has, planning no communication buffers."""
    return Target(frozenset(ELEMENTWISE), frozenset(_DTYPES), comm_buffers=False)


class Interpreted:
    """The ``loops`` backend's program: the scheduled LoopProgram, evaluated by ``run_program``
    at each call, which allocates each buffer on its own (the memory plan is the compiling
    backends' business: this one keeps none)."""

    def __init__(self, program: LoopProgram, plan, stages, bodies=None):
        self.program = program

    def __call__(self, inputs):
        return run_program(self.program, inputs)
