"""Memory passes over LoopPrograms: liveness, in-place reuse, memory-aware order, pool planning.

NOTE [memory passes]
The C++ backend runs them after fusion: ``reuse -> reorder -> plan`` (each behind its switch in
``plait.config``: ``inplace``, ``reorder``, ``plan_memory``).

* ``liveness``: a *storage* is a buffer together with the in-place aliases that took it over
  (``LoopProgram.aliases``: new buffer -> the buffer whose memory it writes into). A storage
  lives from the first kernel using any of its buffers to the last (inputs and constants all
  along, storages holding an output to the end) and is counted once; the peak is the largest
  sum of live bytes during one kernel (its inputs and outputs both live).
* ``reuse``: a kernel's store takes over a buffer it reads when that buffer has the same numel
  and dtype, no kernel after this one reads it, it is not a (non-donated) input, constant or output, and the
  kernel reads it only at the index it stores at. That is read-before-write per element in the
  generated code: reductions run over the whole row before any store of the row, a store's
  value is computed before it is written, and other stores of the same pass that come later
  must not read the buffer (their loads would see the new values). An extern's output is fine
  to take over (the wrapper copies an extern's result that shares memory with its inputs, so
  every buffer owns its memory); an extern never writes into an input. A graph input is taken
  over only when the caller donated it (``jit(..., donate_argnums=...)``): its storage is the
  caller's, live on entry, so an output written into it costs no bytes of its own.
* ``reorder``: kernels depend on the writers of what they read and, for a takeover, the
  taking kernel on every other reader of the storage it takes. Fenced kernels (control edges)
  and effectful externs (checks, random draws) are barriers: nothing moves across them, so
  effects keep their traced order. Several topological orders are tried (the given one, two
  greedy ones with a heap, BFS and DFS), each O(E log V) at most, and the one with the lowest
  peak wins; the given order stays unless another is strictly better.
* ``plan``: the storages that kernels write and that hold no output (outputs are handed to the
  caller: they get allocations of their own; extern results are allocated by torch) get slots
  of a per-call pool: a slot is reused by a later storage of the same or smaller size once its
  storages are dead, best fit first, but only where holding the slot (idle between its users,
  and its excess over a smaller user) keeps every kernel's live bytes within the liveness peak:
  the plan never raises the peak. Slots are allocated at their first user and freed after their
  last (not kept across calls: concurrent calls stay independent, and an idle pool would hold
  memory between calls).
"""
from __future__ import annotations

import collections
import heapq
from typing import Callable

import attrs
import sympy
import torch

from ..graph.loops import Kernel, Load, LoopProgram, is_inner, walk


# ---------------------------------------------------------------------------------------
# Liveness
# ---------------------------------------------------------------------------------------
@attrs.frozen
class Liveness:
    uses: dict     # buffer -> (first, last) kernel using it, for buffers some kernel uses
    storage: dict  # buffer -> its storage (the buffer that an in-place chain starts from)
    span: dict     # storage -> (first, last): -1 bound on entry, len(kernels) kept to the end
    nbytes: dict   # storage -> bytes
    live: tuple    # live bytes during each kernel

    @property
    def peak(self) -> int:
        entry = sum(n for s, n in self.nbytes.items() if self.span[s][0] < 0)
        return max(self.live, default=entry)


def storages(program: LoopProgram) -> dict:
    """buffer -> the storage it uses (the root of its chain of in-place aliases)."""
    def root(b):
        while b in program.aliases:
            b = program.aliases[b]
        return b

    return {b: root(b) for b in program.buffers}


def liveness(program: LoopProgram) -> Liveness:
    kernels, end = program.kernels, len(program.kernels)
    uses: dict = {}
    for i, k in enumerate(kernels):
        for b in (*k.reads, *k.writes):
            uses[b] = (uses.get(b, (i, i))[0], i)
    storage = storages(program)
    span: dict = {}
    for b, (first, last) in uses.items():
        s = storage[b]
        f, l = span.get(s, (first, last))
        span[s] = (min(f, first), max(l, last))
    for b in (*program.inputs, *program.constants):
        span[storage[b]] = (-1, end)
    for b in program.outputs:  # an output no kernel writes is allocated at the end
        span[storage[b]] = (span.get(storage[b], (end, end))[0], end)
    nbytes = {s: program.buffers[s].type.nbytes for s in span}
    delta = [0] * (end + 1)
    for s, (f, l) in span.items():
        if f <= l and f < end:
            delta[max(f, 0)] += nbytes[s]
            delta[min(l, end - 1) + 1] -= nbytes[s]
    live, total = [], 0
    for d in delta[:end]:
        total += d
        live.append(total)
    return Liveness(uses, storage, span, nbytes, tuple(live))


# ---------------------------------------------------------------------------------------
# In-place reuse
# ---------------------------------------------------------------------------------------
def _takes_over(kernel: Kernel, position: int, b: str) -> bool:
    """May the kernel's store at ``position`` write into ``b``'s memory (NOTE [memory
    passes]): every load of ``b`` at the store's index, and no later store of the same pass
    reading ``b``?"""
    store = kernel.stores[position]
    loads = [e for s in kernel.stores for e in walk(s.value)
             if isinstance(e, Load) and e.buffer == b]
    if any(sympy.expand(e.index - store.index) != 0 for e in loads):
        return False
    later = [s for s in kernel.stores[position + 1:] if is_inner(s) == is_inner(store)]
    return not any(isinstance(e, Load) and e.buffer == b for s in later for e in walk(s.value))


def reuse(program: LoopProgram) -> LoopProgram:
    """Stores take over buffers they read in place, where that is safe (NOTE [memory
    passes]). Kernels after the taker that still read the buffer, and depend on nothing from
    the taker on, are moved to just before it, so the takeover can happen."""
    kernels = list(program.kernels)
    kept = {*(set(program.inputs) - program.donated), *program.constants, *program.outputs}
    aliases = dict(program.aliases)
    taken = set(aliases.values())  # a buffer's memory goes to one new buffer
    types = {n: b.type for n, b in program.buffers.items()}
    i = 0
    while i < len(kernels):
        k = kernels[i]
        for position, store in enumerate(k.stores if isinstance(k, Kernel) else ()):
            out = types[store.buffer]
            if store.buffer in aliases:
                continue
            # a donated input first: the caller holds its memory anyway, the other one dies
            for b in sorted(k.reads, key=lambda b: b not in program.donated):
                if b in kept or b in taken or b in k.writes or \
                        (types[b].numel, types[b].dtype) != (out.numel, out.dtype) or \
                        not out.numel or not _takes_over(k, position, b):
                    continue
                later = [j for j in range(i + 1, len(kernels)) if b in kernels[j].reads]
                if not _hoistable(kernels, i, later, aliases):
                    continue
                kernels[i:i] = [kernels[j] for j in later]
                for j in reversed(later):
                    del kernels[j + len(later)]
                i += len(later)
                aliases[store.buffer] = b
                taken.add(b)
                break
        i += 1
    return attrs.evolve(program, kernels=tuple(kernels), aliases=aliases)


def _hoistable(kernels: list, i: int, later: list[int], aliases: dict) -> bool:
    """Can the kernels at ``later`` run just before kernel ``i``: each reads only what is
    written before ``i``, writes no buffer in place, and no barrier lies between?"""
    if not later:
        return True
    written_before = {b for k in kernels[:i] for b in k.writes}
    written_after = {b for k in kernels[i:] for b in k.writes}
    return not any(_barrier(k) for k in kernels[i:later[-1] + 1]) and all(
        not (set(kernels[j].reads) & written_after - written_before)
        and not any(w in aliases for w in kernels[j].writes) for j in later)


# ---------------------------------------------------------------------------------------
# Memory-aware order
# ---------------------------------------------------------------------------------------
def _barrier(k) -> bool:
    """Does nothing move across it: a fenced kernel, or an extern with effects (a check with
    no result, an effectful primitive, a random ATen op)?"""
    from ..tracer.primitives import PRIMITIVES

    if isinstance(k, Kernel):
        return k.fenced
    op = dict(k.params).get("op")
    return not k.outputs or getattr(PRIMITIVES.get(k.label), "effectful", False) or (
        isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags)


def _successors(program: LoopProgram) -> list[set[int]]:
    kernels = program.kernels
    writer = {b: i for i, k in enumerate(kernels) for b in k.writes}
    taker = {b: writer[out] for out, b in program.aliases.items() if out in writer}
    succ: list[set[int]] = [set() for _ in kernels]
    previous, segment = None, []
    for i, k in enumerate(kernels):
        for b in k.reads:
            if writer.get(b, i) != i:
                succ[writer[b]].add(i)
            if taker.get(b, i) != i:  # read before the taking kernel overwrites it
                succ[i].add(taker[b])
        if _barrier(k):
            for j in segment + ([previous] if previous is not None else []):
                succ[j].add(i)
            previous, segment = i, []
        else:
            if previous is not None:
                succ[previous].add(i)
            segment.append(i)
    return succ


class _Fifo(collections.deque):
    push, pop, seed = collections.deque.append, collections.deque.popleft, collections.deque.extend

    def changed(self, k):
        pass


class _Lifo(list):
    push = list.append

    def seed(self, ks):  # the first seed on top: a depth-first walk from it
        self.extend(reversed(ks))

    def changed(self, k):
        pass


class _Greedy:
    """The ready kernel with the least ``key(allocates, frees)`` bytes (then the earliest):
    a heap whose stale entries are skipped; a key changes only when the kernel becomes the
    last user of a storage."""

    def __init__(self, key, alloc, freed):
        self.key, self.alloc, self.freed = key, alloc, freed
        self.heap, self.ready = [], set()

    def entry(self, k):
        return self.key(self.alloc[k], self.freed[k]), k

    def push(self, k):
        self.ready.add(k)
        heapq.heappush(self.heap, self.entry(k))

    def seed(self, ks):
        for k in ks:
            self.push(k)

    def changed(self, k):
        if k in self.ready:
            heapq.heappush(self.heap, self.entry(k))

    def pop(self):
        while True:
            entry = heapq.heappop(self.heap)
            if entry[1] in self.ready and entry == self.entry(entry[1]):
                self.ready.remove(entry[1])
                return entry[1]

    def __bool__(self):
        return bool(self.ready)


def _schedule(program: LoopProgram, succ, frontier_of: Callable) -> list[int]:
    """A topological order picking ready kernels from the frontier, with the storage
    bookkeeping that greedy frontiers read (bytes each kernel allocates and would free)."""
    kernels, lv = program.kernels, liveness(program)
    touches = [{lv.storage[b] for b in (*k.reads, *k.writes)} for k in kernels]
    users = collections.defaultdict(list)
    for i, ss in enumerate(touches):
        for s in ss:
            users[s].append(i)
    end = len(kernels)
    freeable = {s for s, (f, l) in lv.span.items() if 0 <= f and l < end}
    alloc = [sum(lv.nbytes[b] for b in k.writes if lv.storage[b] == b) for k in kernels]
    freed = [0] * end
    remaining = {s: len(u) for s, u in users.items()}
    frontier = frontier_of(alloc, freed)
    npred = [0] * end
    for ss in succ:
        for j in ss:
            npred[j] += 1
    frontier.seed([i for i in range(end) if not npred[i]])
    order, done = [], set()
    while frontier:
        k = frontier.pop()
        order.append(k)
        done.add(k)
        for s in touches[k]:
            remaining[s] -= 1
            if remaining[s] == 1 and s in freeable:  # its last user now frees it
                (last,) = (u for u in users[s] if u not in done)
                freed[last] += lv.nbytes[s]
                frontier.changed(last)
        for j in succ[k]:
            npred[j] -= 1
            if not npred[j]:
                frontier.push(j)
    return order


STRATEGIES = {
    "bfs": lambda alloc, freed: _Fifo(),
    "dfs": lambda alloc, freed: _Lifo(),
    "least_peak": lambda alloc, freed: _Greedy(lambda a, f: (a, a - f), alloc, freed),
    "least_live": lambda alloc, freed: _Greedy(lambda a, f: (a - f, a), alloc, freed),
}


def reorder(program: LoopProgram) -> LoopProgram:
    """The kernels in the order, among the strategies' topological orders, with the lowest
    estimated peak; the given order unless another is strictly lower."""
    succ = _successors(program)
    best, best_peak = program, liveness(program).peak
    for strategy in STRATEGIES.values():
        order = _schedule(program, succ, strategy)
        candidate = attrs.evolve(program, kernels=tuple(program.kernels[i] for i in order))
        if (peak := liveness(candidate).peak) < best_peak:
            best, best_peak = candidate, peak
    return best


# ---------------------------------------------------------------------------------------
# Pool planning
# ---------------------------------------------------------------------------------------
@attrs.frozen
class Slot:
    nbytes: int
    storages: tuple[str, ...]
    first: int  # the kernel before which it is allocated
    last: int   # the kernel after which it is freed


@attrs.frozen
class MemoryPlan:
    liveness: Liveness
    slots: tuple[Slot, ...]
    slot_of: dict  # pooled storage -> slot index
    live: tuple    # planned live bytes during each kernel (at most the liveness peak)

    @property
    def peak(self) -> int:
        return max(self.live, default=self.liveness.peak)

    def blocks(self) -> dict:
        """Every allocation a call makes -> (first, last) kernel: the storages neither pooled
        nor bound on entry (by name) and the pool slots (by index)."""
        lv = self.liveness
        return {**{s: span for s, span in lv.span.items()
                   if span[0] >= 0 and s not in self.slot_of},
                **{j: (slot.first, slot.last) for j, slot in enumerate(self.slots)}}


def plan(program: LoopProgram, pool: bool = True) -> MemoryPlan:
    """Pool slots for the storages kernels write that hold no output (NOTE [memory passes]);
    with ``pool=False`` every storage is allocated on its own."""
    lv = liveness(program)
    writer = {b: k for k in program.kernels for b in k.writes}
    outputs = {lv.storage[b] for b in program.outputs}
    poolable = sorted((s for s, (f, l) in lv.span.items()
                       if pool and isinstance(writer.get(s), Kernel) and s not in outputs
                       and lv.nbytes[s] and l < len(program.kernels)),
                      key=lambda s: (lv.span[s], s))
    live, peak = list(lv.live), lv.peak
    slots: list[dict] = []
    slot_of = {}

    def fits(slot, f, l, need) -> bool:
        idle, used = live[slot["last"] + 1:f], live[f:l + 1]
        return max(idle, default=0) + slot["nbytes"] <= peak and \
            max(used) + slot["nbytes"] - need <= peak

    for s in poolable:
        (f, l), need = lv.span[s], lv.nbytes[s]
        free = sorted((j for j, slot in enumerate(slots)
                       if slot["last"] < f and slot["nbytes"] >= need),
                      key=lambda j: (slots[j]["nbytes"], j))
        j = next((j for j in free if fits(slots[j], f, l, need)), None)
        if j is None:
            j = len(slots)
            slots.append({"nbytes": need, "storages": [], "first": f, "last": l})
        else:
            slot = slots[j]
            for i in range(slot["last"] + 1, l + 1):  # idle, then the excess over s
                live[i] += slot["nbytes"] - (need if i >= f else 0)
        slots[j]["storages"].append(s)
        slots[j]["last"] = l
        slot_of[s] = j
    return MemoryPlan(lv, tuple(Slot(d["nbytes"], tuple(d["storages"]), d["first"], d["last"])
                                for d in slots), slot_of, tuple(live))


def report(program: LoopProgram, memory_plan: MemoryPlan) -> dict:
    """``Lowered.memory``: each buffer's bytes, lifetime (first and last kernel using it) and
    storage; the in-place pairs (buffer, the buffer it took over); the pool slots; the peak."""
    lv = memory_plan.liveness
    return {
        "buffers": {b: {"bytes": program.buffers[b].type.nbytes, "first": f, "last": l,
                        "storage": lv.storage[b]} for b, (f, l) in lv.uses.items()},
        "inplace": tuple(program.aliases.items()),
        "pool": tuple({"bytes": s.nbytes, "storages": s.storages} for s in memory_plan.slots),
        "peak_bytes": memory_plan.peak,
    }
