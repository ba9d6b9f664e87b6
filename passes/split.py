"""Split reductions: a long reduction to few outputs becomes two kernels, so that a GPU has
enough programs to run it on.

NOTE [split reductions]
A GPU kernel runs one program per output (or per few neighbouring outputs, for a column
sum), and each program loops over its row. A reduction of many elements to few outputs (a
bias gradient: 768 column sums of 8192 rows; BatchNorm's statistics: 64 channels of
64x56x56 points) then runs on fewer programs than the GPU has multiprocessors, each walking
a long row alone. ``split_reductions`` rewrites such a kernel into

  * a *partial* kernel, whose outer loops gain a first loop over ``K`` chunks of the first
    reduction loop (``r0 -> k * (R0 / K) + r0``), storing each reduction's partial result
    per chunk into a new buffer ``[K, outputs...]``, and
  * a *final* kernel over the original outer loops that reduces the ``K`` partials (sums
    of sums, maxima of maxima) and computes the original stores from them.

The chunk loop goes first, so the outer loop the outputs are contiguous along stays
innermost: a column sum's chunks still read neighbouring columns together, and the final
kernel reads the partials contiguously too. ``K`` is the smallest divisor of ``R0`` that gives
at least ``SPLIT_OUTPUTS`` partial outputs, keeping each chunk ``MIN_CHUNK`` elements long or
more; a column sum, whose programs take ``COLUMN_TILE_OUTPUTS`` neighbouring outputs each,
aims for that many times as many, in chunks of ``MIN_COLUMN_CHUNK`` rows or more. Only
kernels whose reductions are sums, products, maxima or minima are split; partials of
half-precision results are kept in float32, so the result is rounded once, as unsplit. A
reduction whose body uses another (a variance, after its mean) splits pass by pass: each
pass has its partial and final kernels, the final one storing the pass's results for the
passes after it to load. A row kernel's stores inside its reduction loops stay in the first
partial kernel when they use no reduction (a GELU's gradient, summed for its bias's), and
otherwise (BatchNorm's backward: the input's gradient, after the two sums over each
channel) move to a kernel of their own over the outer and row points, in memory order,
which loads the totals: it reads the rows once more, as the unsplit kernel's last pass did,
with every point in parallel.
"""
from __future__ import annotations

import math

import attrs
import sympy
import torch

from ..graph.loops import (Apply, Buffer, Kernel, Load, LoopProgram, Reduce, Store, children,
                           column_wise, is_inner, levels, loop_vars, reduces, with_children)
from ..graph.types import TensorType, is_static
from .fusion import rename

SPLIT_OUTPUTS = 4096   # outputs (times chunks) below which a long reduction is split
MIN_CHUNK = 1024       # elements a chunk keeps at least
COLUMN_TILE_OUTPUTS = 16  # a column sum's program takes this many neighbouring outputs (the
                       # Triton backend's column tiles, 8 to 32): it aims for as many programs
MIN_COLUMN_CHUNK = 128  # rows a column sum's chunk keeps at least, of 2 * MIN_CHUNK or more
                       # (ViT-B's GELU gradient with its bias's, [12608, 3072] on an H100: 2
                       # chunks 257 us, 32 of 394 rows 209; its step 167.3 -> 165.3 ms)
_COMBINE = {"sum": "sum", "prod": "prod", "amax": "amax", "amin": "amin"}
_HALF = (torch.bfloat16, torch.float16)


def split_reductions(program: LoopProgram) -> LoopProgram:
    buffers, kernels = dict(program.buffers), []
    for k in program.kernels:
        chunks = _chunks(k) if isinstance(k, Kernel) and is_static(
        k.sizes + k.reduction_sizes) else 1  # a symbolic size stays one reduction
        if chunks == 1:
            kernels.append(k)
            continue
        split, made = _split(k, chunks, buffers[k.writes[0]].type.device)
        buffers.update(made)
        kernels += split
    if len(kernels) == len(program.kernels):
        return program
    return attrs.evolve(program, buffers=buffers, kernels=tuple(kernels))


def _levels(k: Kernel) -> list[list[Reduce]] | None:
    """The kernel's reductions by pass, if it is one that splits (NOTE [split reductions])."""
    if k.fenced or not k.reduction_sizes:
        return None
    found = levels(*(s.value for s in k.stores))
    return found if all(r.op in _COMBINE for level in found for r in level) else None


def _chunks(k: Kernel) -> int:
    """How many chunks to split ``k``'s reduction into (1: not split)."""
    outputs, rows = math.prod(k.sizes), math.prod(k.reduction_sizes)
    if outputs >= SPLIT_OUTPUTS * COLUMN_TILE_OUTPUTS or rows < 2 * MIN_CHUNK \
            or _levels(k) is None:
        return 1
    columns = column_wise(k, mixed=True)  # (its strides: only for a kernel that may split)
    wanted = SPLIT_OUTPUTS * (COLUMN_TILE_OUTPUTS if columns else 1)
    shortest = MIN_COLUMN_CHUNK if columns else MIN_CHUNK
    if outputs >= wanted:
        return 1
    first = k.reduction_sizes[0]
    fits = [c for c in range(2, first + 1) if first % c == 0 and rows // c >= shortest]
    return next((c for c in fits if outputs * c >= wanted), max(fits, default=1))


def _split(k: Kernel, chunks: int, device: str) -> tuple[list[Kernel], dict]:
    """The partial and final kernels of each pass of ``k``'s reductions (NOTE [split
    reductions]), then a kernel for its stores inside the reduction loops, if any; and their
    buffers. A pass's totals are stored for the kernels after it that read them; the last
    pass's final kernel makes the original stores outside the reduction loops."""
    n, outputs = len(k.sizes), math.prod(k.sizes)
    xs, new_xs = loop_vars("x", n), loop_vars("x", n + 1)
    r0 = loop_vars("r", 1)[0]
    step = k.reduction_sizes[0] // chunks
    # the partial kernels' loops: the chunk first, then the original outer loops
    mapping = {**{x: new_xs[i + 1] for i, x in enumerate(xs)}, r0: new_xs[0] * step + r0}
    flat_outer = _flat(xs, k.sizes)
    levels = _levels(k)
    inner = [s for s in k.stores if is_inner(s)]
    # row stores that use no reduction (a GELU's gradient, whose column sums are the bias's)
    # are made where the first pass reads each point
    early = [s for s in inner if not reduces(s.value)]
    inner = [s for s in inner if s not in early]
    made, kernels, done = {}, [], {}  # done: a reduction of an earlier pass -> its total's load
    for level, reductions in enumerate(levels):
        partials = [Store(s.buffer, rename(s.index, mapping), rename(s.value, mapping))
                    for s in early] if level == 0 else []
        totals = {}
        for j, red in enumerate(reductions):
            dtype = torch.float32 if red.dtype in _HALF and red.op in ("sum", "prod") \
                else red.dtype
            name = f"{k.name}_partial{level}_{j}"
            made[name] = Buffer(name, TensorType((chunks, *k.sizes), dtype, device))
            body = _replaced(red.body, done)
            partials.append(Store(name, _flat(new_xs, (chunks, *k.sizes)),
                                  rename(Reduce(red.op, body, dtype), mapping)))
            total = Reduce(_COMBINE[red.op], Load(name, r0 * outputs + flat_outer, dtype),
                           dtype)
            totals[red] = total if dtype == red.dtype else \
                Apply("convert", (total,), (("dtype", red.dtype),), red.dtype)
        kernels.append(Kernel(f"{k.name}_partial{level}", (chunks, *k.sizes),
                              (step, *k.reduction_sizes[1:]), tuple(partials),
                              origins=k.origins))
        last = level == len(levels) - 1
        outer = [s for s in k.stores if not is_inner(s)]
        stores = [Store(s.buffer, s.index, _replaced(s.value, {**done, **totals}))
                  for s in outer] if last else []
        if not last or inner:  # totals later kernels read
            for j, red in enumerate(reductions):
                name = f"{k.name}_total{level}_{j}"
                made[name] = Buffer(name, TensorType(k.sizes, red.dtype, device))
                stores.append(Store(name, flat_outer, totals[red]))
                done[red] = Load(name, flat_outer, red.dtype)
        kernels.append(Kernel(f"{k.name}_final{level}", k.sizes, (chunks,), tuple(stores),
                              origins=k.origins))
    if inner:  # the row stores that use reductions: a kernel over outer and row points
        kernels.append(_rows_kernel(k, inner, done))
    return kernels, made


def _rows_kernel(k: Kernel, stores: list[Store], totals: dict) -> Kernel:
    """A kernel over ``k``'s outer and reduction points making its row ``stores`` from the
    reductions' ``totals``. Its loops go in the order of the first store's strides, largest
    first, so consecutive points are consecutive in memory (a column sum's rows are its
    outer loop in memory: its gradient's points go row by row)."""
    n = len(k.sizes)
    old = loop_vars("x", n) + loop_vars("r", len(k.reduction_sizes))
    sizes = k.sizes + k.reduction_sizes
    index = sympy.expand(stores[0].index)
    stride = [abs(index.coeff(v, 1)) if index.is_polynomial(v) else 0 for v in old]
    order = sorted(range(len(old)), key=lambda i: -stride[i])
    new = loop_vars("x", len(old))
    mapping = {old[i]: new[place] for place, i in enumerate(order)}
    return Kernel(f"{k.name}_rows", tuple(sizes[i] for i in order), (), tuple(
        Store(s.buffer, rename(s.index, mapping), rename(_replaced(s.value, totals), mapping))
        for s in stores), origins=k.origins)


def _replaced(expr, table: dict):
    """``expr`` with the nodes in ``table`` replaced, looking from the top: a replaced
    reduction's body (which may hold other replaced ones) is not visited."""
    memo: dict = {}

    def go(e):
        if e not in memo:
            memo[e] = table[e] if e in table else with_children(e, tuple(map(go, children(e))))
        return memo[e]

    return go(expr)


def _flat(variables, sizes) -> sympy.Expr:
    """The row-major flat index of loop ``variables`` over ``sizes``."""
    index, stride = sympy.Integer(0), 1
    for v, size in zip(reversed(variables), reversed(sizes)):
        index += v * stride
        stride *= size
    return index
