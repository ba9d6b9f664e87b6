"""The loop-level IR: buffers, kernels whose bodies are expression DAGs over loads, externs.

NOTE [loop IR]
Lowering (passes/lowering.py) turns a primitive graph into a ``LoopProgram``: an ordered list
of kernels over named, contiguous buffers. A ``Kernel`` loops over ``sizes`` (loop variables
``x0, x1, ...``) and, for a reduction, over ``reduction_sizes`` (``r0, r1, ...``) inside
them; each of its ``stores`` writes one value per point of the outer loops. Values are
expression DAGs:

  ``Load(buffer, index)``    an element of a buffer; ``index`` is a sympy expression over the
                             loop variables giving the flat (row-major) element offset
  ``Load(.., indirect)``     an indirect load (a gather): ``indirect`` is ((position, size),
                             ...), integer value expressions bound in order to ``i0, i1, ..``,
                             which ``index`` may use; the positions are its children
  ``Constant(value)``        a Python scalar
  ``IndexValue(expr)``       an index expression used as a value (iota)
  ``Apply(op, args)``        an elementwise primitive (``add``, ``exp``, ``where``, ...) or
                             ``convert``, with the primitive's params
  ``Reduce(op, body)``       ``body`` (over outer and reduction variables) combined over the
                             reduction loops; ``op`` is sum, prod, amax, amin, argmax, argmin.
                             A body may use other reductions of the kernel (each is computed
                             in its own pass over the reduction loops, in dependency order).

A store whose index uses the reduction variables is an *inner* store: it runs once per point
of the reduction loops, after every reduction it uses (a row kernel: softmax's max, sum and
normalized output in one kernel). Other stores run once per outer point.

Every node knows its dtype. Nodes are frozen and compare by value, so a DAG shares equal
subexpressions and code generators can emit each once. Loads are always in bounds: lowering
clamps the indices of a branch that ``where`` discards (padding, concatenation), and a code
generator checks each indirect position against its size: one outside ``[0, size)`` is read
at 0 and recorded, and the program raises ``CheckError`` as eager's gather does, except on
CUDA (NOTE [kernel errors] in backends/codegen.py). An index with ``i..`` is data-dependent:
an indirect load never reads "the element at a store's index" (``reads_at``: vertical fusion,
in-place reuse) and has no known stride; two loads with equal index and positions are still
the same load (sibling fusion). An
``Extern`` runs a torch function on whole buffers (a library call such as a matmul, or a
primitive with no loop form); a collective is an Extern marked ``collective``, and a ``Wait``
completes one that was only started (NOTE [overlap] in passes/memory.py). A ``Buffer`` with a
``comm`` kind is a communication buffer (NOTE [comm buffers] in tracer/collectives.py).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import attrs
import sympy
import torch

from .printer import format_param
from .types import TensorType, dtype_name, hinted, size_hint


def loop_vars(prefix: str, n: int) -> tuple[sympy.Symbol, ...]:
    """Loop variables ``x0..`` (outer) or ``r0..`` (reduction), or an indirect load's
    positions ``i0..`` (checked into range): non-negative integers."""
    return tuple(sympy.Symbol(f"{prefix}{i}", integer=True, nonnegative=True) for i in range(n))


@attrs.frozen
class CommKind:
    """What a communication buffer is for: its type (a key of
    ``tracer.collectives.COMM_BUFFER_TYPES``) and the process group it talks to."""

    type: str
    group: str


@attrs.frozen
class Buffer:
    name: str
    type: TensorType
    comm: CommKind | None = None  # a communication buffer: planned in its (type, group) pool


@attrs.frozen(cache_hash=True)
class Load:
    buffer: str
    index: sympy.Expr
    dtype: torch.dtype
    indirect: tuple = ()  # ((position, size), ...): i0.. of ``index`` (NOTE [loop IR])


@attrs.frozen(cache_hash=True)
class Constant:
    value: Any
    dtype: torch.dtype


@attrs.frozen(cache_hash=True)
class IndexValue:
    expr: sympy.Expr
    dtype: torch.dtype


@attrs.frozen(cache_hash=True)
class Apply:
    op: str
    args: tuple
    params: tuple  # sorted (name, value) pairs of the primitive's params
    dtype: torch.dtype

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)


@attrs.frozen(cache_hash=True)
class Reduce:
    op: str
    body: Any
    dtype: torch.dtype


Expr = Load | Constant | IndexValue | Apply | Reduce


@attrs.frozen
class Store:
    buffer: str
    index: sympy.Expr  # over the outer loop variables (and, for an inner store, ``r..``)
    value: Any


def is_inner(store: Store) -> bool:
    """Does the store write once per point of the reduction loops too (an inner store)?"""
    return any(s.name.startswith("r") for s in sympy.sympify(store.index).free_symbols)


@attrs.frozen
class Kernel:
    name: str
    sizes: tuple[int, ...]
    reduction_sizes: tuple[int, ...]
    stores: tuple[Store, ...]
    # computes a node that a control edge orders: fusion never merges it with another
    fenced: bool = False
    origins: frozenset = frozenset()  # the graph nodes it computes (provenance)

    @functools.cached_property
    def loads(self) -> dict[str, tuple[Load, ...]]:
        """buffer -> the distinct loads of it, in the order the stores' DAGs first reach
        them (loads inside an indirect load's positions included)."""
        found: dict[str, dict[Load, None]] = {}
        for node in walk(*(s.value for s in self.stores)):
            if isinstance(node, Load):
                found.setdefault(node.buffer, {})[node] = None
        return {b: tuple(ls) for b, ls in found.items()}

    @functools.cached_property
    def reads(self) -> tuple[str, ...]:
        return tuple(self.loads)

    @functools.cached_property
    def writes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.buffer for s in self.stores))


@attrs.frozen
class Extern:
    name: str
    fn: Callable[..., Any]  # torch tensors in, a tensor or a tuple of tensors out
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: tuple  # sorted (name, value) pairs passed as keyword arguments
    label: str     # what it calls, for printing
    origins: frozenset = frozenset()
    # Communicates with the other ranks: every rank must issue its collectives in one order,
    # so no pass reorders collectives against each other (compute may move across them).
    collective: bool = False
    # (start, wait) of a collective that can be issued and waited for apart: ``start`` takes
    # the inputs (and params) and returns the pending results, ``wait`` completes one; ``fn``
    # does both. passes.memory.overlap splits such an Extern into its start and a ``Wait``.
    split: tuple | None = None
    # Runs where it was traced, nothing moving across it: it has an effect other than
    # communicating (a check, a random draw) or a control edge orders it.
    fenced: bool = False

    @property
    def reads(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.inputs))

    @property
    def writes(self) -> tuple[str, ...]:
        return self.outputs


@attrs.frozen
class Wait:
    """Completes the collective that the Extern ``start`` issued: each of its ``outputs``
    becomes ``fn(pending, **params)``. It also reads the collective's ``inputs``: the
    collective may read them until it is done, so they stay alive (and unwritten) until here."""

    name: str
    fn: Callable[..., Any]
    start: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: tuple
    label: str
    origins: frozenset = frozenset()
    fenced = False  # a wait may move: as late as the first reader of its results

    @property
    def reads(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.inputs, *self.outputs)))

    @property
    def writes(self) -> tuple[str, ...]:
        return ()


@attrs.frozen
class LoopProgram:
    buffers: dict  # name -> Buffer
    inputs: tuple[str, ...]     # graph inputs, in order
    constants: dict             # buffer name -> torch.Tensor (contiguous)
    kernels: tuple              # Kernel | Extern | Wait, in execution order
    outputs: tuple[str, ...]    # graph outputs, in order (may repeat or name inputs)
    # graph node -> "primitive  aten op  file:line", for the kernels' origins
    provenance: dict = attrs.field(factory=dict)
    # in-place reuse (passes/memory.py): buffer -> the buffer whose storage it takes over, at
    # the kernel that writes it; a backend that ignores it stays correct (a fresh buffer)
    aliases: dict = attrs.field(factory=dict)
    # inputs the caller donated (``jit(donate_argnums=...)``): reuse may write into them
    donated: frozenset = frozenset()
    # mutated input -> the output holding its new value: reuse may write that one into it
    updates: dict = attrs.field(factory=dict)

    def as_text(self) -> str:
        return program_to_text(self)

    def describe(self, kernel) -> list[str]:
        """One line per graph node a kernel computes: what it is and where it came from."""
        return [self.provenance[n] for n in sorted(kernel.origins) if n in self.provenance]


def walk(*exprs) -> list:
    """Every distinct node (by value) of expression DAGs once, operands before users."""
    seen: dict[Any, None] = {}

    def visit(e):
        if e in seen:
            return
        for child in children(e):
            visit(child)
        seen[e] = None

    for e in exprs:
        visit(e)
    return list(seen)


def reads_at(load: Load, index) -> bool:
    """Does ``load`` read the element at flat ``index`` at every point (the same offset
    expression; an indirect load may read any element)?"""
    return not load.indirect and _same_offset(load.index, index)


@functools.lru_cache(maxsize=1 << 16)
def _same_offset(a, b) -> bool:
    return sympy.expand(a - b) == 0


def children(expr) -> tuple:
    if isinstance(expr, Apply):
        return expr.args
    if isinstance(expr, Reduce):
        return (expr.body,)
    if isinstance(expr, Load):
        return tuple(p for p, _ in expr.indirect)
    return ()


def with_children(expr, kids: tuple):
    """``expr`` with its children (as ``children`` lists them) replaced by ``kids``."""
    if kids == children(expr):
        return expr
    if isinstance(expr, Apply):
        return attrs.evolve(expr, args=kids)
    if isinstance(expr, Reduce):
        return attrs.evolve(expr, body=kids[0])
    return attrs.evolve(expr, indirect=tuple((p, n) for p, (_, n) in zip(kids, expr.indirect)))


def levels(*exprs) -> list[list]:
    """The kernel's reductions, grouped into passes: a reduction whose body uses others
    comes in a later pass than all of them."""
    depth: dict = {}

    def visit(red):
        if red not in depth:
            inside = reduces(red.body)
            depth[red] = 1 + max((visit(r) for r in inside), default=-1)
        return depth[red]

    for red in reduces(*exprs):
        visit(red)
    return [[r for r, d in depth.items() if d == level]
            for level in range(max(depth.values(), default=-1) + 1)]


def column_wise(kernel: Kernel, mixed: bool = False) -> bool:
    """Does the kernel reduce along a strided axis of data contiguous along its outer loop
    (a column sum)? Then a program should take neighbouring outputs together. With
    ``mixed``, one such load is enough, whatever the others (a tile of neighbouring rows
    still reads contiguous chunks along them); without, every load must step by 0 or 1
    along the outer loop."""
    if not kernel.sizes or not kernel.reduction_sizes:
        return False
    body = [s.value for s in kernel.stores]
    if any(r.op not in ("sum", "prod", "amax", "amin") for r in reduces(*body)):
        return False
    x = loop_vars("x", len(kernel.sizes))[-1]
    r = loop_vars("r", len(kernel.reduction_sizes))[-1]
    # (a heuristic: at the traced sizes where they are symbolic)
    strides = [_strides(hinted(e.index), x, r, size_hint(kernel.sizes[-1]),
                        size_hint(kernel.reduction_sizes[-1]), mixed)
               for e in walk(*body) if isinstance(e, Load) and not e.indirect]
    if not strides or None in strides:
        return False
    if mixed:
        return any(sx == 1 and sr not in (0, 1) for sx, sr in strides)
    return all(sx in (0, 1) for sx, _ in strides) and any(sr not in (0, 1) for _, sr in strides)


@functools.lru_cache(maxsize=1 << 14)  # a model's blocks repeat their kernels' indices
def _strides(index, x, r, nx: int, nr: int, sampled: bool) -> tuple[int, int] | None:
    """``index``'s steps along loop variables ``x`` and ``r``: its coefficients where it is
    affine in them; else, with ``sampled``, the most common of its differences at points
    across both ranges (the other loop variables at 0), leaving out those where it does not
    move along ``x`` (a part of a concatenation is clamped outside its own columns); else
    None (an unknown stride)."""
    expanded = sympy.expand(index)
    if expanded.is_polynomial(x, r) and sympy.degree(expanded, x) <= 1 \
            and sympy.degree(expanded, r) <= 1:
        return expanded.coeff(x, 1), expanded.coeff(r, 1)
    if not sampled:
        return None
    others = {v: sympy.Integer(0) for v in index.free_symbols - {x, r}}
    at = lambda i, j: int(index.xreplace({**others, x: sympy.Integer(i),  # noqa: E731
                                          r: sympy.Integer(j)}))
    points = [(i * max(nx - 2, 0) // 7, j * max(nr - 2, 0) // 3)
              for i in range(8) for j in range(4)]
    steps = [(at(i + 1, j) - at(i, j), at(i, j + 1) - at(i, j)) for i, j in points]
    moving = [s for s in steps if s[0] != 0] or steps
    return max(set(moving), key=moving.count)


def reduces(*exprs) -> list:
    """The Reduce nodes of expression DAGs, not looking inside them."""
    out, seen = [], set()

    def visit(e):
        if e in seen:
            return
        seen.add(e)
        if isinstance(e, Reduce):
            out.append(e)
            return
        for c in children(e):
            visit(c)

    for e in exprs:
        visit(e)
    return out


def program_to_text(program) -> str:
    """A loop program (graph/loops.py) as text: each step in order, a kernel with its loops,
    its values (``t..``, operands first), its stores and the source lines it computes.

        program(in0: f32[4,8], in1: f32[8,8]) {
          buf2: f32[4,8] = extern0 dot_general(in0, in1)
          kernel3 for x0 < 4, reduce r0 < 8 {  # aten._softmax.default  model.py:3
            t0: f32 = amax[r](buf2[r0 + 8*x0])
            ...
            buf5[r0 + 8*x0] = t5
          }
          return (buf5)
        }
    """
    def typed(b: str) -> str:
        return f"{b}: {program.buffers[b].type}"

    def kernel_lines(k: Kernel) -> list[str]:
        names: dict = {}

        def value(e) -> str:
            if isinstance(e, Load):
                where = "".join(f", i{j}={value(p)} in [0,{n})" for j, (p, n) in
                                enumerate(e.indirect))
                return f"{e.buffer}[{e.index}{where}]"
            if isinstance(e, Constant):
                return repr(e.value)
            if isinstance(e, IndexValue):
                return f"index({e.expr})"
            return names[e]

        loops = [f"x{i} < {n}" for i, n in enumerate(k.sizes)]
        if k.reduction_sizes:
            loops.append("reduce " + ", ".join(f"r{i} < {n}"
                                               for i, n in enumerate(k.reduction_sizes)))
        where = dict.fromkeys(line.split("  ", 1)[-1] for line in program.describe(k))
        comment = f"  # {'; '.join(where)}" if where else ""
        lines = [f"  {k.name} for {', '.join(loops) or '()'} {{{comment}"]
        for e in walk(*(s.value for s in k.stores)):
            if isinstance(e, Apply):
                params = ", ".join(f"{n}={format_param(v)}" for n, v in e.params)
                rhs = f"{e.op}{f'[{params}]' if params else ''}(" \
                      f"{', '.join(value(a) for a in e.args)})"
            elif isinstance(e, Reduce):
                rhs = f"{e.op}[r]({value(e.body)})"
            else:
                continue
            names[e] = f"t{len(names)}"
            lines.append(f"    {names[e]}: {dtype_name(e.dtype)} = {rhs}")
        lines += [f"    {s.buffer}[{s.index}] = {value(s.value)}" for s in k.stores]
        return lines + ["  }"]

    lines = [f"program({', '.join(typed(b) for b in program.inputs)}) {{"]
    lines += [f"  {typed(b)} = constant" for b in program.constants]
    for k in program.kernels:
        if isinstance(k, Kernel):
            lines += kernel_lines(k)
            continue
        outs = ", ".join(typed(b) for b in k.outputs) or "()"
        what = f"wait({k.start})" if isinstance(k, Wait) else f"{k.label}"
        lines.append(f"  {outs} = {k.name} {what}({', '.join(k.inputs)})")
    taken = {o: b for o, b in program.aliases.items()}
    if taken:
        lines.append("  # in place: " + ", ".join(f"{o} in {b}" for o, b in taken.items()))
    lines.append(f"  return ({', '.join(program.outputs)})")
    return "\n".join(lines + ["}"])
