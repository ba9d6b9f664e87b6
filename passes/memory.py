"""Memory passes over LoopPrograms: liveness, in-place reuse, memory-aware order, collectives'
overlap, pool planning.

NOTE [memory passes]
Both compiling backends (cpp, triton) run them after fusion (NOTE [pipeline] in
compiler/pipeline.py): ``reuse -> reorder -> overlap -> plan``, each behind its switch in
``plait.config`` (``inplace``, ``reorder``, ``overlap``, ``plan_memory``).

* ``liveness``: a *storage* is a buffer together with the in-place aliases that took it over
  (``LoopProgram.aliases``: new buffer -> the buffer whose memory it writes into). A storage
  lives from the first kernel using any of its buffers to the last (inputs and constants all
  along, storages holding an output to the end) and is counted once; the peak is the largest
  sum of live bytes during one kernel (its inputs and outputs both live).
* ``reuse``: a kernel's store takes over a buffer it reads when that buffer has the same numel
  and dtype, no kernel after this one reads it, it is not a (non-donated) input, constant or
  output, and the kernel reads it only at the index it stores at (never through an indirect
  load, which may read any element). That is read-before-write
  per element in the generated code: reductions run over the whole row before any store of
  the row, a store's value is computed before it is written, and other stores of the same
  pass that come later must not read the buffer (their loads would see the new values). An
  extern's output is fine to take over (the wrapper copies an extern's result that shares
  memory with its inputs, so every buffer owns its memory); an extern never writes into an
  input. A graph input is taken over only when the caller donated it (``jit(...,
  donate_argnums=...)``): its storage is the caller's, live on entry, so an output written
  into it costs no bytes of its own. A mutated input (running statistics, an optimizer's
  state) is taken over by its own new value alone (``LoopProgram.updates``): the caller
  writes that output into it after the call, which then costs nothing, where it was a
  result handed over and a copy per input (30 of a small ResNet's forward). Comm buffers
  never take over nor are taken over (they live in their pools), and neither is a
  collective's operand (the collective may read it until its wait, placed later by
  ``overlap``).
* ``reorder``: kernels depend on the writers of what they read, for a takeover the taking
  kernel on every other reader of the storage it takes, and the readers of a collective's
  results on its Wait. Fenced kernels (control edges) and effectful externs (checks, random
  draws) are barriers: nothing moves across them, so effects keep their traced order.
  Collectives are chained instead: each after the one before (every rank issues them in one
  order) and between the barriers around it, while compute moves across them. Several
  topological orders are tried (the given one, two greedy ones with a heap, BFS, and DFS from
  the first root and from the last), each O(E log V) at most, and the one with the lowest
  peak wins; the given order stays unless another is strictly better. Each is measured as it
  will run, after ``overlap``, and one that narrows a collective's overlap is not taken.
* ``overlap``: NOTE [overlap].
* ``plan``: first the comm pools: one per (comm buffer type, group), holding its comm buffers
  (NOTE [comm buffers]) at offsets placed first-fit, in order of first use, at the lowest
  multiple of ``COMM_ALIGN`` free over the buffer's lifetime, so buffers whose lifetimes do
  not overlap share offsets; the plan depends on the program alone, so every rank gets the
  same one. A pool is held at its full size from its first comm buffer's first kernel to its
  last one's last kernel (those bytes replace its buffers' in the live bytes). With
  ``comm_reuse`` (``config.comm_pool_reuse``) an intermediate whose lifetime lies within a
  pool's and that fits in a range free throughout it takes that offset: its bytes leave the
  live bytes (never raising the peak; lowering it where that storage was live at the peak).
  Then the other storages that kernels write and that hold no output (outputs are handed to
  the caller: they get allocations of their own; extern results are allocated by torch) get
  slots of a per-call pool: a slot is reused by a later storage of the same or smaller size
  once its storages are dead, best fit first, but only where holding the slot (idle between
  its users, and its excess over a smaller user) keeps every kernel's live bytes within the
  peak so far: slots never raise the peak. Slots are allocated at their first user and freed
  after their last (not kept across calls: concurrent calls stay independent, and an idle
  pool would hold memory between calls).

NOTE [overlap]
A collective runs as two steps where it can (``Extern.split``): its start issues it (torch's
functional collectives return a pending result at once) and a ``Wait`` completes it. The
start moves up, past compute it does not depend on, to just after the last step it must
follow: a writer of its operands, the collective before it, a barrier; one whose operand is
another collective's result stays where it is (moving it up would pull that one's wait up
with it). A kernel whose only reader is the collective (gradients joined for one
all-reduce), which memory-aware order may leave late, moves up first, to just after the
writers of what it reads. The wait goes just before the first step that reads a result, or
the next barrier, or the end. Compute in between runs while the collective communicates
(NCCL on its own stream, gloo on its threads). The wait also reads the collective's
operands, so liveness keeps them alive, unwritten and out of reused slots until the
collective is done.
Collectives keep their order: a start never moves past another collective.
"""
from __future__ import annotations

import collections
import heapq
import math
from typing import Callable

import attrs
import sympy

from ..graph.loops import Extern, Kernel, Load, LoopProgram, Wait, is_inner, reads_at, walk
from ..graph.types import TensorType, size_hint


# ---------------------------------------------------------------------------------------
# Liveness
# ---------------------------------------------------------------------------------------
@attrs.frozen
class Liveness:
    uses: dict     # buffer -> (first, last) kernel using it, for buffers some kernel uses
    storage: dict  # buffer -> its storage (the buffer that an in-place chain starts from)
    span: dict     # storage -> (first, last): -1 bound on entry, len(kernels) kept to the end
    nbytes: dict   # storage -> bytes (an expression of symbolic sizes: NOTE [symbolic sizes])
    live: tuple    # live bytes during each kernel (at the traced sizes, for a symbolic one)

    @property
    def peak(self) -> int:
        entry = sum(size_hint(n) for s, n in self.nbytes.items() if self.span[s][0] < 0)
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
            delta[max(f, 0)] += size_hint(nbytes[s])
            delta[min(l, end - 1) + 1] -= size_hint(nbytes[s])
    live, total = [], 0
    for d in delta[:end]:
        total += d
        live.append(total)
    return Liveness(uses, storage, span, nbytes, tuple(live))


def program_stats(program: LoopProgram) -> dict[str, int]:
    """The compiler's estimate of a program's memory traffic and footprint: each kernel reads
    each buffer it reads once (one read only through indirect loads: an element per point of
    its loops at most) and writes each buffer once; the peak is the largest sum of
    live bytes (``passes.memory.liveness``: a storage lives from the kernel that writes it to
    the last that uses it or an in-place alias of it; inputs and constants all along, outputs
    to the end). A Wait moves no data."""
    size = {n: b.type.nbytes for n, b in program.buffers.items()}
    kernels = [k for k in program.kernels if not isinstance(k, Wait)]
    return {"kernels": sum(isinstance(k, Kernel) for k in kernels),
            "externs": sum(isinstance(k, Extern) for k in kernels),
            "bytes_read": sum(_bytes_read(k, n, program.buffers[n].type)
                              for k in kernels for n in k.reads),
            "bytes_written": sum(size[n] for k in kernels for n in k.writes),
            "peak_bytes": liveness(program).peak}


def _bytes_read(kernel, buffer: str, t: TensorType) -> int:
    if not isinstance(kernel, Kernel) or any(not e.indirect for e in kernel.loads[buffer]):
        return t.nbytes
    points = math.prod(kernel.sizes) * math.prod(kernel.reduction_sizes)
    return min(t.nbytes, points * t.dtype.itemsize)


# ---------------------------------------------------------------------------------------
# In-place reuse
# ---------------------------------------------------------------------------------------
def _takes_over(kernel: Kernel, position: int, b: str) -> bool:
    """May the kernel's store at ``position`` write into ``b``'s memory (NOTE [memory
    passes]): every load of ``b`` at the store's index (none indirect: it may read any
    element), and no later store of the same pass reading ``b``?"""
    store = kernel.stores[position]
    if not all(reads_at(e, store.index) for e in kernel.loads[b]):
        return False
    later = [s for s in kernel.stores[position + 1:] if is_inner(s) == is_inner(store)]
    return not any(isinstance(e, Load) and e.buffer == b for s in later for e in walk(s.value))


def reuse(program: LoopProgram) -> LoopProgram:
    """Stores take over buffers they read in place, where that is safe (NOTE [memory
    passes]). Kernels after the taker that still read the buffer, and depend on nothing from
    the taker on, are moved to just before it, so the takeover can happen."""
    kernels = list(program.kernels)
    # a collective may read its operands until its wait (NOTE [overlap]), which comes later
    kept = {*(set(program.inputs) - program.donated - set(program.updates)),
            *program.constants, *program.outputs,
            *(b for k in kernels if _collective(k) for b in k.reads),
            *(b for b, buf in program.buffers.items() if buf.comm)}
    aliases = dict(program.aliases)
    taken = set(aliases.values())  # a buffer's memory goes to one new buffer
    types = {n: b.type for n, b in program.buffers.items()}
    i = 0
    while i < len(kernels):
        k = kernels[i]
        for position, store in enumerate(k.stores if isinstance(k, Kernel) else ()):
            out = types[store.buffer]
            if store.buffer in aliases or program.buffers[store.buffer].comm:
                continue  # a comm buffer lives in its pool
            # a donated or updated input first: the caller holds its memory anyway, the
            # other one dies; an updated input holds its own new value alone
            for b in sorted(k.reads, key=lambda b: program.updates.get(b) != store.buffer
                            and b not in program.donated):
                if b in kept or b in taken or b in k.writes or \
                        program.updates.get(b, store.buffer) != store.buffer or \
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
    written_after = {b for k in kernels[i:] for b in k.writes}  # each buffer is written once
    return not any(_barrier(k) for k in kernels[i:later[-1] + 1]) and all(
        not (set(kernels[j].reads) & written_after)
        and not any(w in aliases for w in kernels[j].writes) for j in later)


# ---------------------------------------------------------------------------------------
# Memory-aware order
# ---------------------------------------------------------------------------------------
def _barrier(k) -> bool:
    """Does nothing move across it: a fenced kernel or extern (a control edge orders it, or
    it has an effect other than communicating: lowering marks it)?"""
    return k.fenced


def _collective(k) -> bool:
    return isinstance(k, Extern) and k.collective


def _successors(program: LoopProgram) -> list[set[int]]:
    """Each kernel's successors: the readers of what it writes, the kernel taking over a
    buffer after that buffer's readers, the readers of a collective's results after its
    wait, each collective after the one before (every rank issues them in one order), and
    everything across a barrier."""
    kernels = program.kernels
    writer = {b: i for i, k in enumerate(kernels) for b in k.writes}
    taker = {b: writer[out] for out, b in program.aliases.items() if out in writer}
    done = {b: i for i, k in enumerate(kernels) if isinstance(k, Wait) for b in k.outputs}
    succ: list[set[int]] = [set() for _ in kernels]
    previous, segment, collective = None, [], None
    for i, k in enumerate(kernels):
        for b in k.reads:
            if writer.get(b, i) != i:
                succ[writer[b]].add(i)
            if taker.get(b, i) != i:  # read before the taking kernel overwrites it
                succ[i].add(taker[b])
            if done.get(b, i) != i:  # completed before it is read
                succ[done[b]].add(i)
        if _collective(k):
            if collective is not None:
                succ[collective].add(i)
            collective = i
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
    """A depth-first walk from the first root (``last_root``: from the last; which root a
    walk should start from depends on the program, so both are tried)."""

    push = list.append

    def __init__(self, last_root: bool = False):
        super().__init__()
        self.last_root = last_root

    def seed(self, ks):
        self.extend(ks if self.last_root else reversed(ks))

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


def _schedule(program: LoopProgram, lv: Liveness, succ, frontier_of: Callable) -> list[int]:
    """A topological order picking ready kernels from the frontier, with the storage
    bookkeeping that greedy frontiers read (bytes each kernel allocates and would free;
    ``lv``: the program's liveness, in its given order)."""
    kernels = program.kernels
    touches = [{lv.storage[b] for b in (*k.reads, *k.writes)} for k in kernels]
    users = collections.defaultdict(list)
    for i, ss in enumerate(touches):
        for s in ss:
            users[s].append(i)
    end = len(kernels)
    freeable = {s for s, (f, l) in lv.span.items() if 0 <= f and l < end}
    alloc = [sum(size_hint(lv.nbytes[b]) for b in k.writes if lv.storage[b] == b)
             for k in kernels]
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
                freed[last] += size_hint(lv.nbytes[s])
                frontier.changed(last)
        for j in succ[k]:
            npred[j] -= 1
            if not npred[j]:
                frontier.push(j)
    return order


STRATEGIES = {
    "bfs": lambda alloc, freed: _Fifo(),
    "dfs": lambda alloc, freed: _Lifo(),
    "dfs_last_root": lambda alloc, freed: _Lifo(last_root=True),
    "least_peak": lambda alloc, freed: _Greedy(lambda a, f: (a, a - f), alloc, freed),
    "least_live": lambda alloc, freed: _Greedy(lambda a, f: (a - f, a), alloc, freed),
}


def reorder(program: LoopProgram, overlapped: bool = False) -> LoopProgram:
    """The kernels in the order, among the strategies' topological orders, with the lowest
    estimated peak; the given order unless another is strictly lower. ``overlapped``: the
    ``overlap`` pass runs next, so each order is measured as it will run, after it, and one
    where a collective overlaps fewer kernels than in the given order is not taken (the
    compute between its start and its wait hides its communication, NOTE [overlap])."""
    settle = overlap if overlapped else (lambda p: p)
    succ, lv = _successors(program), liveness(program)
    given = settle(program)  # the program itself where nothing settles
    best, windows = program, _overlap_windows(given)
    best_peak = (lv if given is program else liveness(given)).peak
    for strategy in STRATEGIES.values():
        order = _schedule(program, lv, succ, strategy)
        candidate = attrs.evolve(program, kernels=tuple(program.kernels[i] for i in order))
        settled = settle(candidate)
        if (peak := liveness(settled).peak) < best_peak and all(
                n >= windows[start] for start, n in _overlap_windows(settled).items()):
            best, best_peak = candidate, peak
    return best


def _overlap_windows(program: LoopProgram) -> dict[str, int]:
    """For each collective waited for apart: how many steps run between its start and its
    wait."""
    position = {k.name: i for i, k in enumerate(program.kernels)}
    return {k.start: i - position[k.start] - 1 for i, k in enumerate(program.kernels)
            if isinstance(k, Wait)}


# ---------------------------------------------------------------------------------------
# Communication overlap
# ---------------------------------------------------------------------------------------
def _hoist_operands(kernels: list, needs: set, taking: set) -> None:
    """Move each kernel that computes a collective's operands (``needs``) and nothing any
    placed kernel reads (a bucket's gradients joined into one) up to just after the last
    step it must follow, so the collective can start there too (NOTE [overlap]); one that
    writes into a buffer it took over (``taking``), or reads another collective's result
    (whose wait it would pull up), stays."""
    results = {b for k in kernels if _collective(k) for b in k.writes}
    movable = [k for k in kernels if isinstance(k, Kernel) and not _barrier(k)
               and needs & set(k.writes) and not set(k.writes) & taking
               and not set(k.reads) & results]
    for k in reversed(movable):
        j = next(i for i in reversed(range(len(kernels))) if kernels[i] is k)
        reads, writes = set(k.reads), set(k.writes)
        if any(writes & set(q.reads) for q in kernels[j + 1:]):
            continue
        i = j
        while i and not (_barrier(kernels[i - 1]) or reads & set(kernels[i - 1].writes)
                         or writes & set(kernels[i - 1].reads)):
            i -= 1
        kernels.insert(i, kernels.pop(j))


def overlap(program: LoopProgram) -> LoopProgram:
    """Each collective that can be waited for apart starts right after the last step it must
    follow and is waited for right before the first step that needs it (NOTE [overlap])."""
    if not any(isinstance(k, Extern) and k.split for k in program.kernels):
        return program  # the common case, and reorder settles every order it tries
    kernels: list = []
    taking = set(program.aliases)
    for k in program.kernels:
        i, needs = len(kernels), set(k.reads)
        # an operand that another collective computes is ready at that one's wait, which
        # comes as late as it can: here
        if isinstance(k, Extern) and k.split and not any(
                _collective(p) and needs & set(p.writes) for p in kernels):
            _hoist_operands(kernels, needs, taking)
            while i and not (_barrier(kernels[i - 1]) or _collective(kernels[i - 1])
                             or needs & set(kernels[i - 1].writes)):
                i -= 1
        kernels.insert(i, k)
    i = 0
    while i < len(kernels):
        k = kernels[i]
        if isinstance(k, Extern) and k.split:
            (start, wait), outputs = k.split, set(k.outputs)
            kernels[i] = attrs.evolve(k, fn=start, split=None)
            end = next((j for j in range(i + 1, len(kernels)) if _barrier(kernels[j])
                        or outputs & set(kernels[j].reads)), len(kernels))
            kernels.insert(end, Wait(f"wait_{k.name}", wait, k.name, k.inputs, k.outputs,
                                     k.params, k.label, k.origins))
        i += 1
    return attrs.evolve(program, kernels=tuple(kernels))


# ---------------------------------------------------------------------------------------
# Pool planning
# ---------------------------------------------------------------------------------------
@attrs.frozen
class Slot:
    nbytes: int
    storages: tuple[str, ...]
    first: int  # the kernel before which it is allocated
    last: int   # the kernel after which it is freed


# Every storage in a comm pool starts at a multiple of this many bytes (vector loads).
COMM_ALIGN = 256


@attrs.frozen
class CommPool:
    """The pool of one (comm buffer type, group): allocated before kernel ``first`` and
    released after ``last``; ``offsets``: storage -> byte offset, its comm buffers (``comm``)
    and intermediates placed in its free ranges (``config.comm_pool_reuse``)."""

    type: str
    group: str
    nbytes: int
    offsets: dict
    comm: tuple[str, ...]
    first: int
    last: int


@attrs.frozen
class MemoryPlan:
    liveness: Liveness
    slots: tuple[Slot, ...]
    slot_of: dict  # pooled storage -> slot index
    live: tuple    # planned live bytes during each kernel
    comm_pools: tuple[CommPool, ...] = ()
    comm_of: dict = attrs.field(factory=dict)  # storage in a comm pool -> the pool's index

    @property
    def peak(self) -> int:
        return max(self.live, default=self.liveness.peak)

    def as_text(self) -> str:
        """Each allocation a call makes, over which kernels (by position), and what it holds."""
        lv = self.liveness
        lines = [f"memory plan: estimated peak {self.peak} B"]
        for block, (first, last) in self.blocks().items():
            if isinstance(block, str):
                lines.append(f"  {block}: {lv.nbytes[block]} B, kernels {first}..{last}")
            elif block[0] == "slot":
                slot = self.slots[block[1]]
                lines.append(f"  slot{block[1]}: {slot.nbytes} B, kernels {first}..{last}, "
                             f"holds {', '.join(slot.storages)}")
            else:
                pool = self.comm_pools[block[1]]
                held = ", ".join(f"{s} at {o}" for s, o in pool.offsets.items())
                lines.append(f"  comm pool {pool.type} {pool.group}: {pool.nbytes} B, kernels "
                             f"{first}..{last}, holds {held}")
        return "\n".join(lines)

    def blocks(self) -> dict:
        """Every allocation a call makes -> (first, last) kernel: the storages neither pooled
        nor bound on entry (by name), the pool slots (``("slot", j)``) and the comm pools
        (``("comm", j)``)."""
        lv = self.liveness
        return {**{s: span for s, span in lv.span.items()
                   if span[0] >= 0 and s not in self.slot_of and s not in self.comm_of},
                **{("slot", j): (slot.first, slot.last) for j, slot in enumerate(self.slots)},
                **{("comm", j): (p.first, p.last) for j, p in enumerate(self.comm_pools)}}


def _first_fit(span: tuple, need: int, placed: list, limit: int | None = None) -> int | None:
    """The lowest aligned offset where ``need`` bytes over the kernels ``span`` overlap none
    of the ``placed`` (offset, bytes, span) live at the same time; None past ``limit``."""
    offset = 0
    for lo, n in sorted((o, n) for o, n, (f, l) in placed if f <= span[1] and span[0] <= l):
        if offset + need <= lo:
            break
        offset = max(offset, -(-(lo + n) // COMM_ALIGN) * COMM_ALIGN)
    return offset if limit is None or offset + need <= limit else None


def _comm_pools(program: LoopProgram, lv: Liveness, live: list) -> list[CommPool]:
    """One pool per (type, group) of the comm buffers, each at the lowest offset free over its
    lifetime, in order of first use (a plan every rank computes alike); ``live`` gains each
    pool's bytes over its lifetime in place of its comm buffers'."""
    members = collections.defaultdict(list)
    for s in sorted(lv.span, key=lambda s: (lv.span[s], s)):
        if (kind := program.buffers[s].comm) is not None:
            members[(kind.type, kind.group)].append(s)
    pools = []
    for (kind, group), storages in sorted(members.items()):
        placed, offsets = [], {}
        for s in storages:
            offsets[s] = _first_fit(lv.span[s], lv.nbytes[s], placed)
            placed.append((offsets[s], lv.nbytes[s], lv.span[s]))
        nbytes = max(o + n for o, n, _ in placed)
        first, last = min(lv.span[s][0] for s in storages), max(lv.span[s][1] for s in storages)
        for i in range(first, last + 1):
            live[i] += nbytes - sum(lv.nbytes[s] for s in storages
                                    if lv.span[s][0] <= i <= lv.span[s][1])
        pools.append(CommPool(kind, group, nbytes, offsets, tuple(storages), first, last))
    return pools


def _into_comm_pools(pools: list, candidates: list, lv: Liveness, live: list) -> list:
    """Intermediates placed in the pools' free ranges where they fit over their lifetimes
    (their bytes leave ``live``: the pool holds them already); the pools with them."""
    placed = [[(o, lv.nbytes[s], lv.span[s]) for s, o in p.offsets.items()] for p in pools]
    offsets = [dict(p.offsets) for p in pools]
    for s in candidates:
        (f, l), need = lv.span[s], lv.nbytes[s]
        for j, p in enumerate(pools):
            if p.first <= f and l <= p.last and \
                    (o := _first_fit((f, l), need, placed[j], p.nbytes)) is not None:
                offsets[j][s] = o
                placed[j].append((o, need, (f, l)))
                for i in range(f, l + 1):
                    live[i] -= need
                break
    return [attrs.evolve(p, offsets=o) for p, o in zip(pools, offsets)]


def _at_least(a, b) -> bool:
    """``a >= b`` for every value of their size symbols (False where undecided)."""
    if isinstance(a, int) and isinstance(b, int):
        return a >= b
    return bool((sympy.sympify(a) - b).is_nonnegative)


def plan(program: LoopProgram, pool: bool = True, comm_reuse: bool = False) -> MemoryPlan:
    """The comm pools (NOTE [memory passes]), then, with ``comm_reuse``, intermediates in
    their free ranges, then pool slots for the other storages kernels write that hold no
    output; with ``pool=False`` those are allocated on their own."""
    lv = liveness(program)
    live = list(lv.live)
    comm_pools = _comm_pools(program, lv, live)
    writer = {b: k for k in program.kernels for b in k.writes}
    outputs = {lv.storage[b] for b in program.outputs}
    poolable = sorted((s for s, (f, l) in lv.span.items()
                       if isinstance(writer.get(s), Kernel) and s not in outputs
                       and lv.nbytes[s] and l < len(program.kernels)
                       and program.buffers[s].comm is None),
                      key=lambda s: (lv.span[s], s))
    if comm_reuse:
        comm_pools = _into_comm_pools(comm_pools, poolable, lv, live)
    comm_of = {s: j for j, p in enumerate(comm_pools) for s in p.offsets}
    peak = max(live, default=lv.peak)  # the pools' idle bytes count: slots never raise it
    slots: list[dict] = []
    slot_of = {}

    def fits(slot, f, l, need) -> bool:
        idle, used = live[slot["last"] + 1:f], live[f:l + 1]
        return max(idle, default=0) + size_hint(slot["nbytes"]) <= peak and \
            max(used) + size_hint(slot["nbytes"]) - size_hint(need) <= peak

    for s in poolable if pool else ():
        if s in comm_of:
            continue
        (f, l), need = lv.span[s], lv.nbytes[s]
        # a slot holds a storage at every size: at least as many bytes at all of them
        free = sorted((j for j, slot in enumerate(slots)
                       if slot["last"] < f and _at_least(slot["nbytes"], need)),
                      key=lambda j: (size_hint(slots[j]["nbytes"]), j))
        j = next((j for j in free if fits(slots[j], f, l, need)), None)
        if j is None:
            j = len(slots)
            slots.append({"nbytes": need, "storages": [], "first": f, "last": l})
        else:
            slot = slots[j]
            for i in range(slot["last"] + 1, l + 1):  # idle, then the excess over s
                live[i] += size_hint(slot["nbytes"]) - (size_hint(need) if i >= f else 0)
        slots[j]["storages"].append(s)
        slots[j]["last"] = l
        slot_of[s] = j
    return MemoryPlan(lv, tuple(Slot(d["nbytes"], tuple(d["storages"]), d["first"], d["last"])
                                for d in slots), slot_of, tuple(live), tuple(comm_pools),
                      comm_of)


def report(program: LoopProgram, memory_plan: MemoryPlan) -> dict:
    """``Lowered.memory``: each buffer's bytes, lifetime (first and last kernel using it) and
    storage; the in-place pairs (buffer, the buffer it took over); the pool slots; the comm
    pools (type, group, bytes, each storage's offset, which of them are comm buffers, the
    kernels they are held over); the peak."""
    lv = memory_plan.liveness
    return {
        "buffers": {b: {"bytes": program.buffers[b].type.nbytes, "first": f, "last": l,
                        "storage": lv.storage[b]} for b, (f, l) in lv.uses.items()},
        "inplace": tuple(program.aliases.items()),
        "pool": tuple({"bytes": s.nbytes, "storages": s.storages} for s in memory_plan.slots),
        "comm_pools": tuple({"type": p.type, "group": p.group, "bytes": p.nbytes,
                             "offsets": dict(p.offsets), "comm": p.comm, "first": p.first,
                             "last": p.last} for p in memory_plan.comm_pools),
        "peak_bytes": memory_plan.peak,
    }
