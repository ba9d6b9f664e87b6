"""Replaying a compiled program's launches as one CUDA graph.

NOTE [CUDA graphs]
A compiled program launches hundreds of kernels and library calls per call, each through
Python: on a GPT-2 training step, 680 launches took 50 ms of host time, twice the GPU's
work. ``Graphed`` records a program's launches once as a CUDA graph and replays it with one
call, so the host's share of a call is a few checks and copies.

Capture. The first call compiles the kernels and warms the libraries (cuBLAS, cuDNN), the
second shows which inputs keep their memory from call to call (parameters updated in place,
a step's residuals in a graph's own memory); the third captures the program. Inputs that
kept their address are *static*: the graph reads them where they are. The others are
*dynamic*: each call copies them into buffers of the graph's own. Each graph captures into a
memory pool of its own, which holds the program's peak memory between calls (``pool_bytes``).
Before a replay every static input is checked: another address, or a layout no longer
contiguous, captures again, reading it at its new address the first time it moves (the
backward's residuals, once the forward was captured again) and copying it in from its second
move on (dynamic, for good: a scalar seed of ``loss.backward()`` sits where the caching
allocator puts it, the same address for a few steps, then another after other work ran
between them, and settling it each time would spend every capture). After ``MAX_CAPTURES``
captures on a device nothing is read in place any more once it has moved: an input that
moves is copied in from then on and none settles, so each later capture copies one more
input or output, and the captures end (chained programs, each block of a model compiled
alone, move each other's inputs by turns as each is captured again). Anything a capture
refuses (a host synchronisation in an extern) leaves the program uncaptured for good. NCCL's
collectives are captured with the kernels around them, start and wait (NOTE [overlap] in
passes/memory.py): every rank replays one program, so each issues its collectives in the
order the others do; a program with another backend's (gloo's) is never captured
(``graphable``).

Outputs. A replay writes the same memory every time, so an output handed to the caller
must be dead before the next replay writes over it. Outputs are *lent* as new tensors on the
graph's memory (a training step's residuals, read by its backward and then freed; gradients
that the optimizer consumes and ``zero_grad`` drops) until one is found alive at the next
call: its storage's use count is above the graph's own. That call then runs launch by launch
into fresh memory, leaving the old results intact, and from then on that output is *copied*
out of the graph's memory after each replay (a loss kept for logging, ``out = f(x)``, whose
old ``out`` lives while the next call runs). An output on a dynamic input's buffer or on a
constant is always copied; one on a static input is the caller's own memory, lent (a view
of that input, rebuilt at each replay, where it lies within it). Nothing the caller holds
is ever written by a replay.

Memory shared with the program before. A backward program runs after its forward, never
beside it, and the forward's temporaries are dead by then: ``replays_after`` makes the
backward's graph capture into the memory pool of the forward's graph (on that device, as
captured then), so the two hold about the step's peak between them rather than each its
own (GPT-2 small's module path: the two pools were 1.5x a functional step's memory). The
forward's outputs (the residuals) stay allocated to its capture, so the backward's capture
never takes their memory; it takes the forward's temporaries', which the next forward replay
writes again. So everything the backward writes in its own memory is copied out after each
replay, never lent (a gradient the optimizer keeps, or that accumulates over steps, would be
overwritten), and a forward's graph captured again goes to a pool of its own: captured
after the backward's, its outputs could take memory the backward writes. The two share one
lock and one event, so their replays never overlap.

Sizes. A program of symbolic sizes (NOTE [symbolic sizes] in graph/types.py) runs at
whatever sizes its inputs have; a graph replays one call's sizes. So each shape of the
inputs has its own graph, warmed and captured as above, and only the SHAPES_KEPT most
recently used are kept: a size seen once runs launch by launch, a size that recurs replays.

Randomness. torch registers its CUDA generator with each capture: a replay draws the
numbers eager would draw from the generator's state at that call, and advances it as eager.

Streams. A replay runs on the caller's current stream, ordered after the last replay of the
same graph, or of the one it shares memory with, by an event, under a lock.
"""
from __future__ import annotations

import collections
import logging
import operator
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence

import torch

from ..config import config

_log = logging.getLogger("plait.kernels")

WARM_CALLS = 2     # calls before the capture: compilation and library warm-up, then addresses
MAX_CAPTURES = 6   # captures per device before every input that moves is copied in
STEADY_CALLS = 2   # calls a dynamic input stays put before it is read in place
SHAPES_KEPT = 4    # a program of symbolic sizes: the shapes of inputs whose graphs are kept

_live: weakref.WeakSet = weakref.WeakSet()  # every _Capture not yet released


def held_bytes(device: torch.device | None = None) -> int:
    """Device memory the pools of live CUDA graphs hold (on ``device``, or on all)."""
    return sum(c.pool_bytes for c in list(_live) if device is None or c.device == device)


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _Capture:
    """One captured graph of a program on a device: the addresses of its static inputs, the
    buffers of its dynamic inputs, its outputs and each output's storage use count with no
    caller holding it."""

    def __init__(self, run: Callable, inputs: Sequence[torch.Tensor], static: list[bool],
                 copied: set[int], constants: Sequence[torch.Tensor], device: torch.device,
                 recorder, pool=None):
        self.device = device
        before = recorder.reserved(device)
        self.buffers = [t if s else torch.empty(t.shape, dtype=t.dtype, device=t.device)
                        for t, s in zip(inputs, static)]
        for b, t, s in zip(self.buffers, inputs, static):
            if not s:
                b.copy_(t)
        # (a graph sharing another's pool may not lend its memory: NOTE [CUDA graphs])
        self.shared = pool is not None
        self.graph, self.outputs = recorder.capture(run, self.buffers, device, pool)
        self.pool = recorder.pool(self.graph)
        self.pool_bytes = recorder.reserved(device) - before
        self.addresses = [t.data_ptr() if s else 0 for t, s in zip(inputs, static)]
        # the static inputs, picked out of a call's list in C (checked at every replay)
        self._fixed = _picker([i for i, s in enumerate(static) if s])
        self._fixed_addresses = self._fixed(self.addresses)
        storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
        ours = {storage(t) for t in (*(b for b, s in zip(self.buffers, static) if not s),
                                     *constants)}
        theirs = {storage(t) for t, s in zip(inputs, static) if s}
        # an output on a static input is the caller's memory, which no replay writes (but
        # for a donated input, given up by the caller): lent, never checked; one on a buffer
        # of the graph's own or a constant is copied out, as are those found held once
        self.checked = [j for j, o in enumerate(self.outputs) if storage(o) not in theirs]
        self.baseline = {j: _use_count(self.outputs[j]) for j in self.checked}
        # ... and, where it lies within one static input, is rebuilt on that input at each
        # replay rather than kept here: kept, it would hold the caller's memory, and the
        # program that lent it (a forward, whose residual a backward's result views) would
        # find it held by its caller
        self.views = {j: v for j, o in enumerate(self.outputs) if storage(o) in theirs
                      and (v := _within(o, inputs, static)) is not None}
        self.copy = [j for j, o in enumerate(self.outputs) if j not in self.views
                     and (j in copied or storage(o) in ours or self.shared)]
        self.outputs = [None if j in self.views else o for j, o in enumerate(self.outputs)]
        # the static inputs are the caller's: read where they are, never kept alive here
        self.buffers = [None if s else b for b, s in zip(self.buffers, static)]
        _live.add(self)

    def moved(self, inputs: Sequence[torch.Tensor], addresses: list[int]) -> list[int]:
        """The static inputs that are no longer where the graph reads them."""
        if self._fixed(addresses) == self._fixed_addresses and all(
                map(torch.Tensor.is_contiguous, self._fixed(inputs))):
            return []
        return [i for i, (t, now, then) in enumerate(zip(inputs, addresses, self.addresses))
                if then and (now != then or not t.is_contiguous())]

    def alive(self) -> list[int]:
        """The outputs the caller still holds (their storage used beyond the graph's own)."""
        return [j for j in self.checked if _use_count(self.outputs[j]) > self.baseline[j]]


def _picker(positions: list[int]) -> Callable[[Sequence], tuple]:
    """A sequence's items at ``positions``, as a tuple (``operator.itemgetter``'s, always)."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    return lambda seq: tuple(seq[i] for i in positions)


def _within(o: torch.Tensor, inputs: Sequence[torch.Tensor], static: list[bool]):
    """(input, shape, strides, offset from the input's first element) of output ``o`` where
    its elements lie within one static (contiguous) input of its dtype; else None."""
    size = o.element_size()
    last = sum((n - 1) * st for n, st in zip(o.shape, o.stride())) + 1 if o.numel() else 0
    for i, (t, s) in enumerate(zip(inputs, static)):
        start = t.data_ptr()
        if s and t.dtype == o.dtype and start <= o.data_ptr() and \
                o.data_ptr() + last * size <= start + t.numel() * size:
            return i, tuple(o.shape), o.stride(), (o.data_ptr() - start) // size
    return None


class _CudaRecorder:
    """Captures and replays with torch.cuda's graphs."""

    @staticmethod
    def reserved(device) -> int:
        """The device memory torch holds, its cache emptied (as a capture's start empties it).
        No garbage collection: with a large heap (torch.compile's caches, say) each one
        takes hundreds of milliseconds, and torch's own capture stopped collecting for that."""
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(device)

    @staticmethod
    def synchronizes(run, inputs, device) -> tuple[list, bool]:
        """Run the program, and say whether it synchronized with the host (a capture would
        fail, and a failed capture leaves torch's CUDA generator unusable)."""
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                outputs = run(inputs, device)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        found = [w for w in caught if "called a synchronizing" in str(w.message)]
        if found:
            _log.debug("CUDA graph: %s (%s:%d)", found[0].message, found[0].filename,
                       found[0].lineno)
        for w in caught:  # the program's own warnings still reach the caller
            if w not in found and "debug mode" not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return outputs, bool(found)

    @staticmethod
    def capture(run, buffers, device, pool=None):
        """The graph of ``run`` on ``buffers`` (in ``pool``, a graph's ``pool()``, or in a new
        pool) and its outputs."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch.cuda.graph(graph, pool=pool,
                                                          capture_error_mode="thread_local"):
            outputs = run(buffers, device)
        return graph, outputs

    @staticmethod
    def pool(graph):
        return graph.pool()

    @staticmethod
    def replay(capture: _Capture, inputs) -> None:
        capture.graph.replay()


class Graphed:
    """``run(inputs, device) -> outputs`` of a compiled program, replayed as a CUDA graph per
    device once it is warm (NOTE [CUDA graphs]). ``constants(device)``: the tensors the
    program reads besides its inputs there (an output on one of them is always copied).
    ``recorder`` captures and replays (torch.cuda's graphs; the tests give one that reruns)."""

    def __init__(self, run: Callable[[Sequence[torch.Tensor], torch.device], list],
                 constants: Callable, recorder=_CudaRecorder, sized: bool = False):
        self._run, self._constants, self._recorder = run, constants, recorder
        self._sized = sized  # a program of symbolic sizes: a graph per shape of its inputs
        # device (and with ``sized`` the inputs' shapes) -> _DeviceState, the most recent last
        self._state: collections.OrderedDict = collections.OrderedDict()
        self._latest: dict = {}  # device -> its state of the last call
        self._after: Graphed | None = None
        self._turns = _Turns()

    def replays_after(self, before: "Graphed") -> None:
        """This program runs after ``before`` and never beside it (a backward after its
        forward): its graphs capture into the memory pool of ``before``'s (NOTE [CUDA
        graphs]). Said before this one's first call."""
        self._after, self._turns = before, before._turns

    def _pool(self, device):
        """The pool this program's next capture on ``device`` goes to (None: a new one)."""
        before = self._after._latest.get(device) if self._after is not None else None
        capture = before.capture if before is not None else None
        # (the forward's own pool: never one it shares, as a forward captured again would)
        return capture.pool if capture is not None and not capture.shared else None

    def __call__(self, inputs: Sequence[torch.Tensor], device: torch.device) -> list:
        if not config.cuda_graphs or (device.type == "cuda"
                                      and torch.cuda.is_current_stream_capturing()):
            return self._run(inputs, device)
        with self._turns.lock:
            key = (device, tuple(t.shape for t in inputs)) if self._sized else device
            state = self._state.get(key)
            if state is None:
                state = self._state[key] = _DeviceState()
                if len(self._state) > SHAPES_KEPT:  # sizes that vary: the oldest's graph goes
                    self._state.popitem(last=False)
            self._state.move_to_end(key)
            self._latest[device] = state
            if not state.refused:
                return state.call(self, inputs, device)
        return self._run(inputs, device)


class _Turns:
    """What orders the replays of graphs sharing memory (NOTE [CUDA graphs]): a lock, and
    per device the event after the last replay's copies."""

    def __init__(self):
        self.lock = threading.Lock()
        self.done: dict = {}  # device -> torch.cuda.Event


def _rebuilt(inputs, i: int, shape: tuple, strides: tuple, offset: int) -> torch.Tensor:
    """An output on static input ``i`` (``_within``), on the input at this call (at the
    address the graph read: the static inputs were checked)."""
    t = inputs[i].detach()
    return t.as_strided(shape, strides, t.storage_offset() + offset)


class _DeviceState:
    """A program's graph on one device, and what its calls showed."""

    def __init__(self):
        self.calls, self.captures, self.refused, self.vetted = 0, 0, False, False
        self.addresses: list | None = None  # the inputs' addresses at the last call
        self.dynamic: set[int] = set()
        self.steady: dict[int, int] = {}  # dynamic input -> calls it has stayed where it is
        self.moved_once: set[int] = set()  # static inputs that have moved
        self.unsteady: set[int] = set()  # inputs that moved twice: never read in place again
        self.copied: set[int] = set()  # outputs found alive once: copied out from then on
        self.capture: _Capture | None = None

    def call(self, owner: Graphed, inputs, device) -> list:
        addresses = list(map(torch.Tensor.data_ptr, inputs))
        previous, self.addresses = self.addresses, addresses
        stayed = [a == b for a, b in zip(addresses, previous or [])]
        self.calls += 1
        if self.capture is None:
            self.dynamic |= {i for i, kept in enumerate(stayed) if not kept}
            if self.calls < WARM_CALLS:
                return owner._run(inputs, device)
            if not self.vetted:  # (a call that raised is no answer: the next one asks again)
                outputs, self.refused = owner._recorder.synchronizes(owner._run, inputs, device)
                self.vetted = True
                if self.refused:
                    _log.debug("CUDA graph: the program synchronizes with the host: not "
                               "captured")
                return outputs
            if not self._capture(owner, inputs, device):
                return owner._run(inputs, device)
        else:
            self.steady = {i: self.steady.get(i, 0) + 1 if stayed[i] else 0
                           for i in self.dynamic}
            moved, alive = self.capture.moved(inputs, addresses), self.capture.alive()
            # a dynamic input that stays put (a residual of a program whose graph now lends
            # it) is read in place, once it has for STEADY_CALLS calls (until the limit)
            limited = self.captures >= MAX_CAPTURES
            settled = set() if limited else {
                i for i, n in self.steady.items() if n >= STEADY_CALLS
                and inputs[i].is_contiguous() and i not in self.unsteady}
            if moved or alive or settled:
                # a static input moved, the caller still holds results of the last replay
                # (left to it, with the graph's memory under them), or a dynamic input
                # settled: capture again, with those inputs copied in or read in place and
                # those outputs copied out from now on. A static input that moves for the
                # first time is read in place at its new address (a residual of a program
                # captured again, which stays there); one that moves again is copied in.
                again = set(moved) if limited else set(moved) & self.moved_once
                self.moved_once |= set(moved)
                self.unsteady |= again
                self.dynamic = (self.dynamic | again) - settled
                self.copied |= set(alive)
                _log.debug("CUDA graph: inputs %s moved, %s settled, outputs %s held: "
                           "capturing again", moved, sorted(settled), alive)
                self.capture = None
                if not self._capture(owner, inputs, device):
                    return owner._run(inputs, device)
        capture, done = self.capture, owner._turns.done.get(device)
        if device.type == "cuda" and done is not None:
            torch.cuda.current_stream(device).wait_event(done)
        for i in self.dynamic:
            capture.buffers[i].copy_(inputs[i])
        owner._recorder.replay(capture, inputs)
        outs = capture.outputs
        results = [o.detach() if o is not None else _rebuilt(inputs, *capture.views[j])
                   for j, o in enumerate(outs)]  # lent: new tensors on the graph's memory
        if capture.copy:
            fresh = [torch.empty_like(outs[j]) for j in capture.copy]
            torch._foreach_copy_(fresh, [outs[j] for j in capture.copy])
            for j, t in zip(capture.copy, fresh):
                results[j] = t
        if device.type == "cuda":
            if done is None:
                done = owner._turns.done[device] = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
        return results

    def _capture(self, owner: Graphed, inputs, device) -> bool:
        """Capture the program (NOTE [CUDA graphs]); False where it cannot be."""
        if any(t.device != device for t in inputs):
            _log.debug("CUDA graph: inputs on other devices: not captured")
            self.refused = True
            return False
        self.captures += 1
        self.dynamic |= {i for i, t in enumerate(inputs) if not t.is_contiguous()}
        static = [i not in self.dynamic for i in range(len(inputs))]
        try:
            self.capture = _Capture(owner._run, inputs, static, self.copied,
                                    owner._constants(device), device, owner._recorder,
                                    owner._pool(device))
        except Exception as e:  # a host synchronisation: no graph here
            _log.debug("CUDA graph: capture failed, running launch by launch: %s", e)
            self.refused = True
            return False
        return True
