"""What the code generators (backends/cpp.py, backends/triton.py) share: printing sympy
index expressions, naming, ordering a kernel's reductions into passes, running externs, and
the kernel records compiled programs expose."""
from __future__ import annotations

import re

import attrs
import sympy
import torch

from ..errors import BackendError
from ..graph.loops import Extern, LoopProgram, Reduce, children


class IndexPrinter:
    """Prints an integer sympy index expression (or a condition on indices) in a target
    language over int64 loop variables. Subclasses name the target's syntax; ``floordiv``
    and ``mod`` are the operators that agree with sympy's floor and Mod on non-negative
    operands, the ``*_fn`` helpers handle the general case."""

    language = ""
    floordiv, floordiv_fn, mod_fn = "/", "", ""
    min_fn, max_fn = "", ""
    and_op, or_op, true, false = "&&", "||", "true", "false"

    def __init__(self, names: dict | None = None):
        self.names = names or {}  # loop variable -> another spelling

    def integer(self, n: int) -> str:
        return str(n)

    def __call__(self, e) -> str:
        e = sympy.sympify(e)
        if e.is_Integer:
            return self.integer(int(e))
        if e.is_Float:
            return repr(float(e))
        if e.is_Symbol:
            return self.names.get(e.name, e.name)
        if e is sympy.true or e is sympy.false:
            return self.true if e is sympy.true else self.false
        if isinstance(e, (sympy.Add, sympy.Mul)):
            op = " + " if isinstance(e, sympy.Add) else " * "
            return "(" + op.join(map(self, e.args)) + ")"
        if isinstance(e, sympy.Pow) and e.exp.is_Integer and e.exp > 0:
            return "(" + " * ".join([self(e.base)] * int(e.exp)) + ")"
        if isinstance(e, (sympy.floor, sympy.ceiling)):
            num, den = e.args[0].as_numer_denom()
            if not den.is_Integer:
                raise BackendError(f"cannot print index {e}: the divisor is not an integer")
            if isinstance(e, sympy.ceiling):  # ceil(n / d) = -floor(-n / d)
                num = -num
            q = self._binary(num, den, self.floordiv, self.floordiv_fn)
            return f"(-{q})" if isinstance(e, sympy.ceiling) else q
        if isinstance(e, sympy.Mod):
            return self._binary(*e.args, "%", self.mod_fn)
        if isinstance(e, (sympy.Min, sympy.Max)):
            fn = self.min_fn if isinstance(e, sympy.Min) else self.max_fn
            out = self(e.args[0])
            for a in e.args[1:]:
                out = f"{fn}({out}, {self(a)})"
            return out
        if isinstance(e, (sympy.And, sympy.Or)):  # conditions on indices (padding, concat)
            op = f" {self.and_op} " if isinstance(e, sympy.And) else f" {self.or_op} "
            return "(" + op.join(map(self, e.args)) + ")"
        if isinstance(e, sympy.core.relational.Relational):
            return f"({self(e.lhs)} {e.rel_op} {self(e.rhs)})"
        raise BackendError(f"cannot print index expression {e} ({type(e).__name__}) as "
                           f"{self.language}")

    def _binary(self, a, b, op: str, fn: str) -> str:
        if a.is_nonnegative and b.is_positive:  # the target's operator agrees here
            return f"({self(a)} {op} {self(b)})"
        return f"{fn}({self(a)}, {self(b)})"


def identifier(name: str, taken: set) -> str:
    """``name`` as a C identifier distinct from those ``taken`` (which it joins)."""
    base = re.sub(r"\W", "_", name)
    if not base or base[0].isdigit():
        base = "_" + base
    out, k = base, 1
    while out in taken:
        out, k = f"{base}_{k}", k + 1
    taken.add(out)
    return out


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


@attrs.frozen
class CompiledKernel:
    """One step of a compiled program, for inspection: a C++ function or an extern call."""

    name: str
    source: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]


def extern_results(k: Extern, args: list, program: LoopProgram) -> list[torch.Tensor]:
    """Run an extern on its argument tensors: its results, checked against their buffers'
    types, contiguous, and never sharing memory with an argument (a later in-place write or
    a reused slot must not change them)."""
    result = k.fn(*args, **dict(k.params))
    result = (result,) if isinstance(result, torch.Tensor) else tuple(result)
    if len(result) != len(k.outputs):
        raise BackendError(f"{k.name} ({k.label}) returned {len(result)} tensors, "
                           f"expected {len(k.outputs)}")
    for b, t in zip(k.outputs, result):
        want = program.buffers[b].type
        if tuple(t.shape) != tuple(want.shape) or t.dtype != want.dtype:
            raise BackendError(f"{k.name} ({k.label}) returned {t.dtype}{list(t.shape)} "
                               f"for {b}, which is {want.dtype}{list(want.shape)}")
    return [own(t.contiguous(), args) for t in result]


def own(t: torch.Tensor, inputs: list) -> torch.Tensor:
    """An extern's result as a buffer of its own: a copy where torch returned (a view of) an
    input, whose memory a later kernel may write in place or a pool slot may hand on."""
    ptr = t.untyped_storage().data_ptr()
    shared = t.numel() and any(x.untyped_storage().data_ptr() == ptr for x in inputs)
    return t.clone() if shared else t


def extern_text(k: Extern) -> str:
    params = "".join(f", {n}={v!r}" for n, v in k.params)
    return f"{', '.join(k.outputs)}{',' if len(k.outputs) == 1 else ''} = " \
           f"{k.label}({', '.join(k.inputs)}{params})"
