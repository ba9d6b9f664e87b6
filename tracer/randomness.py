"""Random draws in traced functions (NOTE [random draws]): seeding marks the trace."""
from __future__ import annotations

import contextlib
import functools

import torch

from .trace import _THREAD, TRACING_CONTEXTS

# NOTE [random draws]
# A random op is traced as a call of torch's own op: an opaque node, effectful (never merged,
# removed or recomputed, and kept in program order among the other effects), that draws from
# torch's generator each time the compiled function runs. Tensor-less factories (torch.rand,
# randn, randint, randperm, normal) are caught above the dispatcher (NOTE [torch-function
# handlers]), ``*_like`` draws become their factories (tracer/aten.py), and dropout in all its
# forms reaches the trace as torch's ``bernoulli`` into a fresh tensor. So after the same seed a
# compiled function draws eager's numbers wherever it calls the op eager calls, on a dense
# tensor of the same shape, in the same order (tests/test_randomness.py holds plait to that).
# Where torch's decomposition writes a draw out of another one (exponential_, cauchy_ and
# geometric_ from rand_like), or eager's kernel draws a data-dependent count of numbers (rrelu
# draws for the non-positive elements only), only the distribution is eager's.
#
# Seeding the generator (torch.manual_seed, torch.seed, torch.set_rng_state, with which
# torch.random.fork_rng and torch.testing's freeze_rng_state restore it, and torch.cuda's) in
# a traced function would run once, while tracing, and the compiled function's draws would
# not follow it. While a thread traces, such a call does nothing but mark the trace
# (``Trace.seeded``; the functions are replaced while any thread traces, NOTE [threads]), and a
# draw traced after it is refused: seeding around code that draws nothing (OpInfo's wrapper
# around a sample without dropout) stays harmless.
_SEEDING = [(torch, name) for name in ("manual_seed", "seed", "set_rng_state")] + \
    [(torch.random, name) for name in ("manual_seed", "seed", "set_rng_state")] + \
    [(torch.cuda, name) for name in ("manual_seed", "manual_seed_all", "seed", "seed_all",
                                     "set_rng_state", "set_rng_state_all")]


def _marked_while_tracing(module, name: str, original):
    @functools.wraps(original)
    def seeding(*args, **kwargs):
        if not _THREAD.traces:
            return original(*args, **kwargs)
        root = _THREAD.traces[0]
        root.seeded = root.seeded or f"{module.__name__}.{name}()"
        return torch.default_generator if name == "manual_seed" else None

    return seeding


@contextlib.contextmanager
def _seeding_marked():
    saved = [(module, name, getattr(module, name)) for module, name in _SEEDING]
    for module, name, original in saved:
        setattr(module, name, _marked_while_tracing(module, name, original))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


TRACING_CONTEXTS.append(_seeding_marked)
