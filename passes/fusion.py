"""Fusion: merge kernels that read what another writes, or read what another reads.

NOTE [fusion]
Lowering already fuses every chain of elementwise ops and views into one expression; the
kernels it leaves are split at stored values (reductions, values with several users). This
pass merges a producer kernel P into the first kernel C that reads one of P's buffers
(*vertical*), when their loops line up, and rewrites C's loads of that buffer into P's
expression:

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

Two kernels that read a buffer in common and need nothing from each other merge too
(*siblings*): B joins A, at A's place, when everything B reads is written before A, and B's
loops, possibly reordered (loop ordering after fusion), cover A's the way A's do, with B's
reads of the shared buffers at A's indices: the shared buffer is read once. Where A is
elementwise and B a reduction whose loops cover A's, A joins B instead, still at A's place
(a backward's GELU, recomputed for a weight's gradient, inside its own gradient's bias sums).

NOTE [fusion scheduler]
Compile time must grow with the program, not with its square. The pass keeps an index of
the program: each buffer's writer and readers, each kernel's place. Candidates come from that
index: a producer's first reader (vertical), and pairs of readers of one buffer (siblings,
the nearest ``SIBLING_WINDOW`` readers of each buffer, found by bisection in the buffer's
sorted readers, queued once however many buffers the two share, scored by the bytes of those
buffers and tried best first: DenseNet's layers each read every earlier layer's output).
Vertical merges run first, in program order, until none is left; then sibling merges, best
first, with vertical merges after each round, until neither finds one: siblings are a final
round that can only add fusions, and loop ordering happens only there. A pair judged unable
to merge is never tried again (a merged kernel is a new kernel, with new pairs); a merge
re-examines only the kernels around it. Legality is decided
on the loads of the buffers concerned, their indices renamed (a memoized sympy substitution)
and compared, before any expression is rewritten: the whole-kernel rewrite runs only for a
merge that happens.
"""
from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
import operator
from collections import Counter

import attrs
import sympy

from ..graph.loops import (Kernel, Load, LoopProgram, Store, children, loop_vars, reads_at,
                           with_children)
from ..graph.types import is_static

SIBLING_WINDOW = 8  # readers of one buffer paired with each reader: keeps candidates linear
# An elementwise producer loading more than this many values per point (max pooling's
# gradient: a cotangent and a chosen entry per window entry) stays a kernel of its own
# rather than run inside a reduction's tiles, which read a few columns at a time (ResNet-50:
# its first BatchNorm's backward partial sums with the pooling's gradient inside took 0.82
# ms on an H200).
MAX_LOADS_INTO_A_REDUCTION = 8


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


@functools.lru_cache(maxsize=1 << 16)
def _substituted(expr: sympy.Expr, mapping: tuple) -> sympy.Expr:
    return expr.xreplace(dict(mapping))


def rename(expr, mapping: dict):
    """Loop variables renamed throughout an expression (or an index)."""
    mapping = tuple((k, v) for k, v in mapping.items() if k != v)
    if not mapping:
        return expr
    if isinstance(expr, sympy.Basic):
        return _substituted(expr, mapping)

    def replace(e):
        if isinstance(e, Load):
            return attrs.evolve(e, index=_substituted(e.index, mapping))
        if hasattr(e, "expr") and isinstance(getattr(e, "expr"), sympy.Basic):
            return attrs.evolve(e, expr=_substituted(e.expr, mapping))
        return None

    return rewrite(expr, replace)


def _renamed_stores(kernel: Kernel, mapping: dict, value=lambda v: v) -> list[Store]:
    return [Store(s.buffer, rename(s.index, mapping), value(rename(s.value, mapping)))
            for s in kernel.stores]


def _variables(kernel):
    return loop_vars("x", len(kernel.sizes)), loop_vars("r", len(kernel.reduction_sizes))


def _orders(n: int):
    """Loop orders to try when lining two kernels up (all of them for up to four loops)."""
    return itertools.permutations(range(n)) if n <= 4 else [tuple(range(n))]


def _plans(p: Kernel, c: Kernel):
    """Ways P's loop variables can map into the merged kernel (with what C's must become,
    and the merged loops): P's loops reordered to run as C's (loop ordering after fusion),
    else both kernels' loops split into the loops they share (NOTE [shared loops])."""
    px, pr = _variables(p)
    cx, cr = _variables(c)
    if not pr:
        for target in (cx + cr, cx):
            sizes = (c.sizes + c.reduction_sizes) if len(target) > len(cx) else c.sizes
            if len(target) != len(px) or Counter(sizes) != Counter(p.sizes):
                continue
            for order in _orders(len(px)):  # P's loop k runs as C's loop order[k]
                if all(p.sizes[k] == sizes[order[k]] for k in range(len(px))):
                    yield ({px[k]: target[order[k]] for k in range(len(px))}, {}, c.sizes,
                           c.reduction_sizes)
        shared = _covering(p, c)
    else:
        if p.sizes == c.sizes and c.reduction_sizes in (p.reduction_sizes, ()):
            yield dict(zip(px + pr, cx + pr)), {}, p.sizes, p.reduction_sizes
        elif not c.reduction_sizes and c.sizes == p.sizes + p.reduction_sizes:
            inner = dict(zip(cx[len(px):], pr))  # C's trailing loops become the rows' loops
            yield dict(zip(px + pr, cx[:len(px)] + pr)), inner, p.sizes, p.reduction_sizes
        rows = _common_split(p.reduction_sizes, *([c.reduction_sizes] if cr else []))
        shared = ((_common_split(p.sizes, c.sizes), rows),
                  None if cr else _cut(_common_split(p.sizes + p.reduction_sizes, c.sizes),
                                       p.sizes))
    for loops in shared:
        if loops is not None and None not in loops:
            yield _split_onto(p, *loops), _split_onto(c, *loops), *loops


def _covering(e: Kernel, k: Kernel) -> tuple:
    """The loops an elementwise kernel E and a kernel K share where E's points are K's
    outer and reduction points, or K's outer points (NOTE [shared loops])."""
    return (_cut(_common_split(e.sizes, k.sizes + k.reduction_sizes), k.sizes),
            (_common_split(e.sizes, k.sizes), k.reduction_sizes))


# NOTE [shared loops]
# Two kernels over the same elements may count them with different loops: a layer norm's
# statistics run over [B, T] rows while its output, stored for a matrix product, runs over
# [B*T, D]; softmax's rows are [B, H, T] and the product's operand [B*H, T, E]. Where each
# kernel's loops are products of consecutive runs of one list of loops (the cuts of both
# lists of sizes, merged), the merged kernel runs those loops and each kernel's variables
# become affine in them (x0 over B*T = T*y0 + y1): indices stay affine, loads still compare
# exactly, and the row kernel forms as if the loops had lined up. Sizes that interleave
# ([6, 4] against [4, 6]) share no such list and stay apart.
def _common_split(*shapes: tuple) -> tuple | None:
    """The loops each of ``shapes`` (one product) is consecutive runs of, or None."""
    if any(0 in shape for shape in shapes) or len({math.prod(s) for s in shapes}) > 1:
        return None
    if not all(map(is_static, shapes)):  # symbolic sizes share loops only as they are
        return shapes[0] if len(set(shapes)) == 1 else None
    cuts = sorted({n for shape in shapes for n in itertools.accumulate(shape, operator.mul)})
    sizes, done = [], 1
    for n in cuts:
        if n % done:
            return None
        if n != done:
            sizes.append(n // done)
            done = n
    return tuple(sizes)


def _cut(sizes: tuple | None, outer: tuple):
    """``sizes`` split into the loops covering ``outer``'s product and the rest, or None."""
    if sizes is None:
        return None
    prefix = list(itertools.accumulate(sizes, operator.mul, initial=1))
    n = math.prod(outer)
    return (sizes[:prefix.index(n)], sizes[prefix.index(n):]) if n in prefix else None


def _split_onto(k: Kernel, sizes: tuple, reduction_sizes: tuple) -> dict:
    """K's loop variables as expressions in the variables of ``sizes`` and
    ``reduction_sizes``, which K's loops (outer then reduction) are consecutive runs of."""
    merged = sizes + reduction_sizes
    names = loop_vars("x", len(sizes)) + loop_vars("r", len(reduction_sizes))
    exprs, j = {}, 0
    for v, n in zip(sum(_variables(k), ()), k.sizes + k.reduction_sizes):
        e, covered = sympy.Integer(0), 1
        while covered != n:  # the runs' products reach n exactly (symbolic sizes too)
            e, covered, j = e * merged[j] + names[j], covered * merged[j], j + 1
        exprs[v] = e
    return exprs


def _merge(p: Kernel, c: Kernel, keep: set[str]) -> Kernel | None:
    """P merged into C (vertical), keeping P's stores of ``keep``; None where they cannot,
    or where an elementwise P of many loads would be inlined into reduction C."""
    if c.reduction_sizes and not p.reduction_sizes and \
            sum(map(len, p.loads.values())) > MAX_LOADS_INTO_A_REDUCTION:
        return None
    inlined = [b for b in p.writes if b in c.loads]
    for p_vars, c_vars, sizes, reduction_sizes in _plans(p, c):
        at = {s.buffer: rename(s.index, p_vars) for s in p.stores if s.buffer in inlined}
        if all(reads_at(rename(load, c_vars), at[b]) for b in inlined for load in c.loads[b]):
            stores = {s.buffer: s for s in _renamed_stores(p, p_vars)}

            def inline(e):
                return stores[e.buffer].value if isinstance(e, Load) and \
                    e.buffer in stores else None

            kept = [s for s in stores.values() if s.buffer in keep]
            return Kernel(c.name, sizes, reduction_sizes,
                          tuple(kept + _renamed_stores(c, c_vars, lambda v: rewrite(v, inline))),
                          origins=p.origins | c.origins)
    return None


def _sibling(a: Kernel, b: Kernel, shared: set[str]) -> Kernel | None:
    """B joined to A (they read ``shared`` in common, neither needs the other): B's loops,
    possibly reordered (loop ordering after fusion) or split with A's into loops both share
    (NOTE [shared loops]), must cover A's rows' points the way A's do, with B's reads of the
    shared buffers at the indices A reads them at."""
    if b.reduction_sizes and b.reduction_sizes != a.reduction_sizes:
        return None
    for a_vars, b_vars, loops in _sibling_plans(a, b):
        if all({rename(load, b_vars) for load in b.loads[n]} ==
               {rename(load, a_vars) for load in a.loads[n]} for n in shared):
            return Kernel(a.name, *loops, tuple(_renamed_stores(a, a_vars) +
                                                _renamed_stores(b, b_vars)),
                          origins=a.origins | b.origins)
    return None


def _siblings(a: Kernel, b: Kernel) -> Kernel | None:
    """B joined to A; else, where A is elementwise and B a reduction, A joined to B (at A's
    place: a backward's recomputed GELU inside its gradient's bias sums, reading the
    pre-activation once)."""
    shared = set(a.reads) & set(b.reads)
    joined = _sibling(a, b, shared)
    if joined is None and b.reduction_sizes and not a.reduction_sizes:
        joined = _sibling(b, a, shared)
    return joined


def _sibling_plans(a: Kernel, b: Kernel):
    """(A's variables, B's variables, the merged loops): B's loops reordered onto A's, else
    both split into shared loops."""
    ax, ar = _variables(a)
    bx, _ = _variables(b)
    if not b.reduction_sizes and len(bx) == len(ax) + len(ar):  # B's stores become inner
        target, sizes = ax + ar, a.sizes + a.reduction_sizes
    else:
        target, sizes = ax, a.sizes
    for order in _orders(len(bx)) if len(bx) == len(target) else ():
        if all(b.sizes[k] == sizes[order[k]] for k in range(len(bx))):  # B's k as A's order[k]
            yield {}, {bx[k]: target[order[k]] for k in range(len(bx))}, (a.sizes,
                                                                           a.reduction_sizes)
    for loops in _covering(b, a) if not b.reduction_sizes else (
            (_common_split(b.sizes, a.sizes), a.reduction_sizes),):
        if loops is not None and None not in loops:
            yield _split_onto(a, *loops), _split_onto(b, *loops), loops


class _Schedule:
    """The program being fused, indexed (NOTE [fusion scheduler]): kernels by place, each
    buffer's writer and readers. A merged kernel takes one of its parts' places; places only
    ever disappear, so their order stays the program's."""

    def __init__(self, program: LoopProgram):
        self.outputs = set(program.outputs)
        self.at = dict(enumerate(program.kernels))  # place -> kernel
        self.writer: dict[str, int] = {}            # buffer -> the place writing it
        self.readers: dict[str, list[int]] = {}     # buffer -> the places reading it, sorted
        self.failed: set[tuple[int, int]] = set()   # (id, id) of pairs judged unmergeable
        self.seen: list = []                        # every kernel indexed: their ids stay theirs
        self.nbytes = {n: b.type.nbytes_hint for n, b in program.buffers.items()}
        self.producers: list[int] = []              # places to try as producers (a heap)
        self.pairs: list = []                       # (-bytes, place, place) siblings (a heap)
        for i, k in self.at.items():
            self._index(i, k)
        for i, k in self.at.items():
            self._offer(i, k)

    def _index(self, i: int, k) -> None:
        self.seen.append(k)
        for b in k.reads:
            bisect.insort(self.readers.setdefault(b, []), i)
        for b in k.writes:
            self.writer[b] = i

    def _unindex(self, i: int) -> None:
        k = self.at.pop(i)
        for b in k.reads:
            readers = self.readers[b]
            del readers[bisect.bisect_left(readers, i)]
        for b in k.writes:
            if self.writer.get(b) == i:
                del self.writer[b]

    def _mergeable(self, i: int) -> bool:
        k = self.at.get(i)
        return isinstance(k, Kernel) and not k.fenced

    def _offer(self, i: int, k) -> None:
        """Queue what a new kernel at ``i`` may merge with: as a producer, and as a sibling of
        its buffers' nearest readers."""
        if not self._mergeable(i):
            return
        heapq.heappush(self.producers, i)
        near = set()  # each sibling once, however many buffers the two share
        for b in k.reads:
            readers = self.readers[b]
            n = bisect.bisect_left(readers, i)
            near.update(readers[max(0, n - SIBLING_WINDOW):n + SIBLING_WINDOW + 1])
        near.discard(i)
        reads = set(k.reads)
        for j in near:  # the heap orders them
            if self._mergeable(j):
                saved = sum(self.nbytes[s] for s in reads.intersection(self.at[j].reads))
                heapq.heappush(self.pairs, (-saved, min(i, j), max(i, j)))

    def _replace(self, gone: tuple[int, ...], i: int, merged: Kernel) -> None:
        moved = set()
        for g in gone:
            moved |= set(self.at[g].writes)
            self._unindex(g)
        self.at[i] = merged
        self._index(i, merged)
        self._offer(i, merged)
        # their producers have a new first reader; a reader of what moved, new siblings
        for b in merged.reads:
            if b in self.writer and self._mergeable(self.writer[b]):
                heapq.heappush(self.producers, self.writer[b])
        for b in moved & set(merged.writes):
            for j in self.readers.get(b, ()):
                self._offer(j, self.at[j])

    def vertical(self) -> bool:
        merged = False
        while self.producers:
            i = heapq.heappop(self.producers)
            if not self._mergeable(i):
                continue
            p = self.at[i]
            readers = {j for b in p.writes for j in self.readers.get(b, ()) if j != i}
            if not readers:
                continue
            first = place = min(readers)
            if not self._mergeable(first):  # an extern reads P first: a later reader that
                # needs nothing written after P joins it, at P's place
                first = next((j for j in sorted(readers) if self._mergeable(j) and all(
                    self.writer.get(r, -1) <= i for r in self.at[j].reads)), None)
                if first is None:
                    continue
                place = i
            keep = {b for b in p.writes if b in self.outputs
                    or any(j not in (i, first) for j in self.readers.get(b, ()))}
            merged |= self._try(i, first, place, lambda a, b: _merge(a, b, keep))
        return merged

    def siblings(self) -> bool:
        merged = False
        while self.pairs:
            _, i, j = heapq.heappop(self.pairs)
            if not (self._mergeable(i) and self._mergeable(j)):
                continue
            # everything B reads is written before A (A's own writes included)
            if any(self.writer.get(r, -1) >= i for r in self.at[j].reads):
                continue
            merged |= self._try(i, j, i, _siblings)
        return merged

    def _try(self, i: int, j: int, place: int, merge) -> bool:
        """``merge(kernel at i, kernel at j)`` put at ``place``, unless that pair was judged
        unmergeable before; a None result is remembered as that judgement."""
        key = (id(self.at[i]), id(self.at[j]))
        if key in self.failed:
            return False
        new = merge(self.at[i], self.at[j])
        if new is None:
            self.failed.add(key)
            return False
        self._replace((i, j), place, new)
        return True

    def kernels(self) -> tuple:
        return tuple(self.at[i] for i in sorted(self.at))


def fuse(program: LoopProgram) -> LoopProgram:
    """Vertical merges first; then siblings sharing reads (reordering loops to line them
    up), as a final round that can only add fusions, each round followed by vertical merges
    again (NOTE [fusion scheduler])."""
    schedule = _Schedule(program)
    schedule.vertical()
    while schedule.siblings() | schedule.vertical():
        pass
    kernels = schedule.kernels()
    buffers = {n: b for n, b in program.buffers.items()
               if n in program.inputs or n in program.constants or n in program.outputs
               or n in schedule.writer or schedule.readers.get(n)}
    return attrs.evolve(program, buffers=buffers, kernels=kernels)
