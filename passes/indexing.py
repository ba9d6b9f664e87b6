"""Index simplification: each kernel's index expressions, simplified with its loops' ranges.

NOTE [index simplification]
Lowering composes views as sympy expressions over the loop variables, and sympy simplifies
them without knowing that ``x0`` runs over ``[0, 384)``: a reshape of a reshape leaves
``Mod(x0, 384)``, ``floor(x0/384)``, ``Min(127, x0 - 256)`` that a kernel then computes per
element (integer divisions in the innermost loop, and strides no analysis can read). This pass
knows each variable's range (outer and reduction loops, an indirect load's positions) and
bounds every subexpression by interval arithmetic, bottom up:

  Mod(a, n)  -> a            when 0 <= a < n
  floor(a)   -> k            when a lies in [k, k + 1)
  floor(a/n) with a = g*q + b, 0 <= b < g, g | n (q an integer expression) -> floor(q/(n/g))
  floor(floor(a)/n)  -> floor(a/n)   (n a positive integer)
  c*Mod(a, n) + c*n*floor(a/n)  -> c*a, as often as it applies (a position split into
                                   three or more parts: each join makes the next one's)
  Min/Max    -> the operands that can win
  a < b, ... -> true/false   when the bounds decide it

Each rewrite holds for every point of the loops, so the kernel computes the same values;
loads that were equal stay equal (one kernel's indices are rewritten with one set of ranges).
"""
from __future__ import annotations

import functools
import math

import attrs
import sympy

from ..graph.loops import IndexValue, Kernel, Load, LoopProgram, Store, loop_vars
from .fusion import rewrite


def simplify_indices(program: LoopProgram) -> LoopProgram:
    kernels = tuple(_kernel(k) if isinstance(k, Kernel) else k for k in program.kernels)
    return attrs.evolve(program, kernels=kernels)


def _kernel(k: Kernel) -> Kernel:
    ranges = {**dict(zip(loop_vars("x", len(k.sizes)), k.sizes)),
              **dict(zip(loop_vars("r", len(k.reduction_sizes)), k.reduction_sizes))}

    def replace(e):
        if isinstance(e, Load):
            inner = {**ranges, **dict(zip(loop_vars("i", len(e.indirect)),
                                          (n for _, n in e.indirect)))}
            return attrs.evolve(e, index=simplify(e.index, inner))
        if isinstance(e, IndexValue):
            return attrs.evolve(e, expr=simplify(e.expr, ranges))
        return None

    stores = tuple(Store(s.buffer, simplify(s.index, ranges), rewrite(s.value, replace))
                   for s in k.stores)
    return attrs.evolve(k, stores=stores)


def simplify(expr, ranges: dict):
    """``expr`` simplified knowing that each symbol ``s`` of ``ranges`` lies in
    ``[0, ranges[s])`` (NOTE [index simplification])."""
    expr = sympy.sympify(expr)
    known = tuple(sorted((s.name, n) for s, n in ranges.items() if s in expr.free_symbols))
    return _simplified(expr, known)


@functools.lru_cache(maxsize=1 << 15)
def _simplified(expr, known: tuple):
    ranges = {sympy.Symbol(name, integer=True, nonnegative=True): n for name, n in known}
    bounds: dict = {}

    def bound(e) -> tuple:
        """Inclusive (low, high) of ``e`` over the ranges (sympy numbers; +-oo unknown)."""
        if e not in bounds:
            bounds[e] = _bound(e, bound, ranges)
        return bounds[e]

    def go(e):
        if not e.args or e.is_Number:
            return e
        args = tuple(go(a) for a in e.args)
        if args != e.args:
            e = e.func(*args)
        return _rule(e, bound)

    return go(expr)


def _bound(e, bound, ranges) -> tuple:
    inf = sympy.oo
    if e.is_Number:
        return e, e
    if e.is_Symbol:
        if e not in ranges:
            return -inf, inf
        n = ranges[e]  # a symbolic size is unbounded here (NOTE [symbolic sizes])
        return sympy.Integer(0), sympy.Integer(n - 1) if isinstance(n, int) else inf
    if isinstance(e, sympy.Add):
        lo, hi = zip(*map(bound, e.args))
        return sympy.Add(*lo), sympy.Add(*hi)
    if isinstance(e, sympy.Mul):
        lo, hi = sympy.Integer(1), sympy.Integer(1)
        for a in e.args:
            alo, ahi = bound(a)
            corners = [x * y for x in (lo, hi) for y in (alo, ahi)
                       if not ({x, y} & {inf, -inf} and 0 in (x, y))]
            if len(corners) < 4:
                return -inf, inf
            lo, hi = min(corners), max(corners)
        return lo, hi
    if isinstance(e, sympy.floor):
        lo, hi = bound(e.args[0])
        return sympy.floor(lo), sympy.floor(hi)
    if isinstance(e, sympy.Mod) and e.args[1].is_Integer and e.args[1] > 0:
        lo, hi = bound(e.args[0])
        n = e.args[1]
        return (lo, hi) if lo >= 0 and hi < n else (sympy.Integer(0), n - 1)
    if isinstance(e, (sympy.Min, sympy.Max)):
        lo, hi = zip(*map(bound, e.args))
        pick = min if isinstance(e, sympy.Min) else max
        return pick(lo), pick(hi)
    return -inf, inf


def _rule(e, bound):
    if isinstance(e, sympy.Mod) and e.args[1].is_Integer and e.args[1] > 0:
        lo, hi = bound(e.args[0])
        if lo >= 0 and hi < e.args[1]:
            return e.args[0]
    elif isinstance(e, sympy.floor):
        lo, hi = bound(e.args[0])
        if lo.is_finite and hi.is_finite and math.floor(lo) == math.floor(hi):
            return sympy.Integer(math.floor(lo))
        return _floor_of_floor(e.args[0]) or _floor_of_sum(e.args[0], bound) or e
    elif isinstance(e, sympy.Add):
        while isinstance(e, sympy.Add) and (joined := _mod_and_floor(e)) is not None:
            e = joined
        return e
    elif isinstance(e, (sympy.Min, sympy.Max)):
        low, high = {a: bound(a)[0] for a in e.args}, {a: bound(a)[1] for a in e.args}
        if isinstance(e, sympy.Min):  # an operand that some other one never exceeds loses
            keep = [a for a in e.args if not any(high[b] <= low[a] for b in e.args if b != a)]
        else:
            keep = [a for a in e.args if not any(low[b] >= high[a] for b in e.args if b != a)]
        keep = keep or [e.args[0]]
        if len(keep) < len(e.args):
            return e.func(*keep)
    elif isinstance(e, sympy.core.relational.Relational) and e.rel_op in ("<", "<=", ">",
                                                                          ">="):
        lo, hi = bound(e.lhs - e.rhs)
        holds = {"<": hi < 0, "<=": hi <= 0, ">": lo > 0, ">=": lo >= 0}[e.rel_op]
        fails = {"<": lo >= 0, "<=": lo > 0, ">": hi <= 0, ">=": hi < 0}[e.rel_op]
        if holds or fails:  # bounds are numbers or +-oo: each comparison is decided
            return sympy.true if holds else sympy.false
    return e


def _floor_of_sum(arg, bound):
    """floor((g*q + b) / (g*m)) -> floor(q/m) where q is an integer expression and
    0 <= b < g (so b shifts g*q by less than one step of g); m = 1 gives q."""
    num, den = arg.as_numer_denom()
    if not (den.is_Integer and den > 1 and isinstance(num, sympy.Add)):
        return None
    coefficients = [t.as_coeff_Mul()[0] for t in num.args]
    if not all(c.is_Integer for c in coefficients):
        return None
    for g in sorted({math.gcd(int(den), int(c)) for c in coefficients}, reverse=True):
        if g == 1:
            break
        whole = [t for t, c in zip(num.args, coefficients) if c % g == 0]
        rest = sympy.Add(*[t for t, c in zip(num.args, coefficients) if c % g != 0])
        lo, hi = bound(rest)
        if whole and lo >= 0 and hi < g:
            q = sympy.expand(sympy.Add(*whole) / g)
            return q if g == den else sympy.floor(q / (den // g))
    return None


def _floor_of_floor(arg):
    """floor(floor(a)/n) -> floor(a/n) for a positive integer n (sympy keeps both floors)."""
    c, inner = arg.as_coeff_Mul()
    if isinstance(inner, sympy.floor) and c.is_Rational and c.p == 1 and c.q > 1:
        return sympy.floor(inner.args[0] / c.q)
    return None


def _mod_and_floor(e):
    """c*Mod(a, n) + c*n*floor(a/n) -> c*a: a position split into a row and a column
    and joined again (a reshape of a reshape)."""
    terms = list(e.args)
    for i, t in enumerate(terms):
        c, mod = t.as_coeff_Mul()
        if not isinstance(mod, sympy.Mod):
            continue
        a, n = mod.args
        partner = c * n * (_floor_of_floor(a / n) or sympy.floor(a / n))
        if partner in terms:
            terms.remove(partner)
            terms[terms.index(t)] = c * a
            return sympy.Add(*terms)
    return None
