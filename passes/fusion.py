"""Fusion: merge a kernel into the first kernel that reads what it writes.

NOTE [fusion]
Lowering already fuses every chain of elementwise ops and views into one expression; the
kernels it leaves are split at stored values (reductions, values with several users). This
pass merges a producer kernel P into the first kernel C that reads one of P's buffers, when
their loops line up, and rewrites C's loads of that buffer into P's expression:

  * P elementwise over the same elements as C's loops (C's outer loops, or its outer and
    reduction loops together): P's value is computed in place of the load;
  * P a reduction over C's outer loops, C a reduction over the same rows or elementwise over
    the rows' points: C gets P's reduction (a later pass over the same rows, or an inner
    store: the row kernel of softmax and layer norm).

Loads must be element-aligned: the index C reads at is the index P stores at (never so for
an indirect load, whose index is data-dependent: P's buffer stays in memory). P's store stays
in the merged kernel only if a later kernel or the program's outputs still need its buffer.
The merged kernel takes C's place, which is safe because buffers are written once. A merge
never crosses an extern (an extern reading P's buffer is its first reader) and never reorders
kernels, so no cycle can appear; a fenced kernel (one a control edge orders) is never merged.
"""
from __future__ import annotations

import itertools

import attrs
import sympy

from ..graph.loops import (Kernel, Load, LoopProgram, Store, children, loop_vars, reads_at, walk,
                           with_children)


def rewrite(expr, replace):
    """``expr`` with every node for which ``replace`` returns a value replaced by it; nodes
    are offered to ``replace`` with their children already rewritten."""
    memo: dict = {}

    def go(e):
        if e not in memo:
            e2 = with_children(e, tuple(go(k) for k in children(e)))
            new = replace(e2)
            memo[e] = e2 if new is None else new
        return memo[e]

    return go(expr)


def rename(expr, mapping: dict):
    """Loop variables renamed (sympy substitution) throughout an expression."""
    def replace(e):
        if isinstance(e, Load):
            return attrs.evolve(e, index=e.index.subs(mapping, simultaneous=True))
        if hasattr(e, "expr") and isinstance(getattr(e, "expr"), sympy.Basic):
            return attrs.evolve(e, expr=e.expr.subs(mapping, simultaneous=True))
        return None

    return rewrite(expr, replace)


def _variables(kernel):
    return loop_vars("x", len(kernel.sizes)), loop_vars("r", len(kernel.reduction_sizes))


def _orders(n: int):
    """Loop orders to try when lining two kernels up (all of them for up to four loops)."""
    return itertools.permutations(range(n)) if n <= 4 else [tuple(range(n))]


def _plans(p: Kernel, c: Kernel):
    """Ways P's loop variables can map into the merged kernel (with what C's must become,
    and the merged loops): P's loops reordered to run as C's (loop ordering after fusion)."""
    px, pr = _variables(p)
    cx, cr = _variables(c)
    if not pr:
        for target in (cx + cr, cx):
            sizes = (c.sizes + c.reduction_sizes) if len(target) > len(cx) else c.sizes
            if len(target) != len(px) or sorted(sizes) != sorted(p.sizes):
                continue
            for order in _orders(len(px)):  # P's loop k runs as C's loop order[k]
                if all(p.sizes[k] == sizes[order[k]] for k in range(len(px))):
                    yield ({px[k]: target[order[k]] for k in range(len(px))}, {}, c.sizes,
                           c.reduction_sizes)
        return
    if p.sizes == c.sizes and c.reduction_sizes in (p.reduction_sizes, ()):
        yield dict(zip(px + pr, cx + pr)), {}, p.sizes, p.reduction_sizes
    elif not c.reduction_sizes and c.sizes == p.sizes + p.reduction_sizes:
        inner = dict(zip(cx[len(px):], pr))  # C's trailing loops become the rows' loops
        yield dict(zip(px + pr, cx[:len(px)] + pr)), inner, p.sizes, p.reduction_sizes


def _merge(p: Kernel, c: Kernel, keep: set[str]) -> Kernel | None:
    if p.fenced or c.fenced:
        return None
    for plan in _plans(p, c):
        merged = _merged(p, c, keep, *plan)
        if merged is not None:
            return merged
    return None


def _merged(p, c, keep, p_vars, c_vars, sizes, reduction_sizes) -> Kernel | None:
    stores = {s.buffer: Store(s.buffer, s.index.subs(p_vars, simultaneous=True),
                              rename(s.value, p_vars)) for s in p.stores}
    aligned = True

    def inline(e):
        nonlocal aligned
        if isinstance(e, Load) and e.buffer in stores:
            store = stores[e.buffer]
            if not reads_at(e, store.index):
                aligned = False
                return None
            return store.value
        return None

    c_stores = [Store(s.buffer, s.index.subs(c_vars, simultaneous=True),
                      rewrite(rename(s.value, c_vars), inline)) for s in c.stores]
    if not aligned:
        return None
    kept = [s for s in stores.values() if s.buffer in keep]
    return Kernel(c.name, sizes, reduction_sizes, tuple(kept + c_stores),
                  origins=p.origins | c.origins)


def _loads(kernel, buffer) -> set:
    return {(e.index, e.indirect) for s in kernel.stores for e in walk(s.value)
            if isinstance(e, Load) and e.buffer == buffer}


def _sibling(a: Kernel, b: Kernel, shared: set[str]) -> Kernel | None:
    """B joins A (they read a buffer in common, neither needs the other): B's loops,
    possibly reordered (loop ordering after fusion), must cover A's rows' points the way A's
    do, with B's reads of the shared buffers at the indices A reads them at."""
    if a.fenced or b.fenced:
        return None
    ax, ar = _variables(a)
    bx, _ = _variables(b)
    if b.reduction_sizes and b.reduction_sizes != a.reduction_sizes:
        return None
    if not b.reduction_sizes and len(bx) == len(ax) + len(ar):  # B's stores become inner
        target, sizes = ax + ar, a.sizes + a.reduction_sizes
    elif len(bx) == len(ax):
        target, sizes = ax, a.sizes
    else:
        return None
    for order in _orders(len(bx)):  # B's loop k runs as A's loop order[k]
        if tuple(b.sizes[k] for k in range(len(bx))) != tuple(sizes[order[k]]
                                                            for k in range(len(bx))):
            continue
        mapping = {bx[k]: target[order[k]] for k in range(len(bx))}
        stores = [Store(st.buffer, st.index.subs(mapping, simultaneous=True),
                        rename(st.value, mapping)) for st in b.stores]
        renamed = attrs.evolve(b, stores=tuple(stores))
        if all(_loads(renamed, n) == _loads(a, n) for n in shared):
            return Kernel(a.name, a.sizes, a.reduction_sizes, a.stores + renamed.stores,
                          origins=a.origins | b.origins)
    return None


def _vertical(kernels, outputs) -> bool:
    for i, p in enumerate(kernels):
        if not isinstance(p, Kernel):
            continue
        readers = [j for j in range(i + 1, len(kernels))
                   if set(p.writes) & set(kernels[j].reads)]
        if not readers or not isinstance(kernels[readers[0]], Kernel):
            continue
        first = readers[0]
        later = {b for k in kernels[first + 1:] for b in k.reads} | set(outputs)
        new = _merge(p, kernels[first], {b for b in p.writes if b in later})
        if new is not None:
            kernels[first] = new
            del kernels[i]
            return True
    return False


def _horizontal(kernels) -> bool:
    for i, a in enumerate(kernels):
        for j in range(i + 1, len(kernels)):
            b = kernels[j]
            between = {w for k in kernels[i:j] for w in k.writes}
            shared = set(a.reads) & set(b.reads)
            if not (isinstance(a, Kernel) and isinstance(b, Kernel)) or not shared or \
                    set(b.reads) & between:
                continue
            new = _sibling(a, b, shared)
            if new is not None:
                kernels[i] = new
                del kernels[j]
                return True
    return False


def fuse(program: LoopProgram) -> LoopProgram:
    """Vertical merges first; then siblings sharing reads (reordering loops to line them
    up), as a final round that can only add fusions; then vertical again."""
    kernels = list(program.kernels)
    while _vertical(kernels, program.outputs):
        pass
    while _horizontal(kernels) or _vertical(kernels, program.outputs):
        pass
    buffers = {n: b for n, b in program.buffers.items()
               if n in program.inputs or n in program.constants or n in program.outputs
               or any(n in k.reads or n in k.writes for k in kernels)}
    return attrs.evolve(program, buffers=buffers, kernels=tuple(kernels))


