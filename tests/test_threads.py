"""Jitted functions, modules and transforms called from several threads at once (NOTE
[threads] in tracer/trace.py): per-thread traces, one compilation per key, results equal to
eager's."""
from __future__ import annotations

import threading

import pytest
import torch

import plait
from plait import backends
from plait.backends import eager


def in_threads(work, n: int = 8) -> None:
    """``work(i)`` in ``n`` threads started together; the first failure raised here."""
    start, errors = threading.Barrier(n), []

    def run(i):
        try:
            start.wait()
            work(i)
        except BaseException as e:  # noqa: BLE001 - raised again below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def f(x, y):
    return torch.tanh(x @ y).softmax(-1) * 2 + x.sum(-1, keepdim=True)


def model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                            torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8))
    return m.eval()  # BatchNorm reading its statistics: eager is deterministic in threads


def mixed_calls(n_calls: int, backend: str) -> None:
    """8 threads, each ``n_calls`` calls mixing shapes (some compile while others hit),
    a jitted function, a jitted module, backward through the module and torch.autograd.grad,
    plait.grad and plait.vmap; each result against eager's, computed beforehand (an eager
    call of the module while a thread traces it would see its tracers: NOTE [threads])."""
    m = model()
    jf, jm = plait.jit(f, backend=backend), plait.jit(m, backend=backend)
    grad_f = plait.grad(lambda x, y: f(x, y).square().sum())
    vmap_f = plait.vmap(f, in_dims=(0, None))
    g = torch.Generator().manual_seed(1)
    cases = []
    for rows in (2, 3, 5, 7):
        x, y = torch.randn(rows, 8, generator=g), torch.randn(8, 8, generator=g)
        xs = torch.randn(3, rows, 8, generator=g)
        xg = x.clone().requires_grad_()
        out = m(xg)
        dx, *dparams = torch.autograd.grad(out.square().sum(), [xg, *m.parameters()])
        cases.append(dict(x=x, y=y, xs=xs, f=f(x, y), m=out.detach(), dx=dx, dparams=dparams,
                          grad_f=torch.func.grad(lambda x, y: f(x, y).square().sum())(x, y),
                          vmap_f=torch.vmap(f, in_dims=(0, None))(xs, y)))
    for p in m.parameters():
        p.grad = None
    counts = [0] * len(cases)  # backward() calls per case, for the parameters' .grad
    lock = threading.Lock()
    # taken before the threads start: while plait traces the module in one thread, its
    # parameters are tracers to any other thread reading it (NOTE [threads])
    params = list(m.parameters())

    def work(i):
        for k in range(n_calls):
            j = (i + k) % len(cases)
            c, kind = cases[j], (i + k // 4) % 6  # every kind meets every case
            if kind == 0:
                torch.testing.assert_close(jf(c["x"], c["y"]), c["f"])
            elif kind == 1:
                with torch.no_grad():
                    torch.testing.assert_close(jm(c["x"]), c["m"])
            elif kind == 2:  # backward into the input and (accumulating) the parameters
                x = c["x"].clone().requires_grad_()
                jm(x).square().sum().backward()
                torch.testing.assert_close(x.grad, c["dx"])
                with lock:
                    counts[j] += 1
            elif kind == 3:
                x = c["x"].clone().requires_grad_()
                dx, *dparams = torch.autograd.grad(jm(x).square().sum(), [x, *params])
                torch.testing.assert_close(dx, c["dx"])
                for got, want in zip(dparams, c["dparams"]):
                    torch.testing.assert_close(got, want)
            elif kind == 4:
                torch.testing.assert_close(grad_f(c["x"], c["y"]), c["grad_f"])
            else:
                torch.testing.assert_close(vmap_f(c["xs"], c["y"]), c["vmap_f"])

    in_threads(work)
    for p, *want in zip(m.parameters(), *[c["dparams"] for c in cases]):
        total = sum(n * w for n, w in zip(counts, want))
        torch.testing.assert_close(p.grad, total, rtol=1e-4, atol=1e-4)
    # the row counts vary: a static trace, then one for every count (NOTE [automatic dynamic]),
    # and in training (a key of its own) one more; each thread waits for another's compile
    assert jf.trace_count == 2, jf.dynamic_failure
    assert jm.trace_count <= 4, jm.jitted.dynamic_failure


def test_mixed_calls_from_threads_equal_eager():
    mixed_calls(25, "eager")


@pytest.mark.slow
def test_many_mixed_calls_from_threads_equal_eager():
    mixed_calls(1000, "cpp")


def test_a_key_compiles_once_and_keys_compile_in_parallel(monkeypatch):
    """8 threads, two per key: each key's program is made once, the second thread waiting for
    the first's; the four keys' compilations run at once (the factory waits until all four
    are inside it, which it could not if they ran one after the other)."""
    inside = threading.Barrier(4, timeout=60)
    made = []

    def factory(graph):
        made.append(graph)
        inside.wait()
        return eager.compile_graph(graph)

    monkeypatch.setitem(backends._BACKENDS, "parallel",
                        backends.Backend("parallel", factory, None, False))
    jf = plait.jit(f, backend="parallel")
    inputs = [(torch.randn(rows, 8), torch.randn(8, 8)) for rows in (2, 3, 4, 5)]

    def work(i):
        x, y = inputs[i % 4]
        torch.testing.assert_close(jf(x, y), f(x, y))

    in_threads(work)
    assert len(made) == 4
    assert jf.trace_count == 4


def test_tracing_in_one_thread_is_invisible_to_another():
    """While one thread traces, another's calls of compiled functions run as calls, not
    inlined into that trace."""
    traced, go_on = threading.Event(), threading.Event()

    def slow(x):
        traced.set()
        assert go_on.wait(60)
        return x * 2

    jslow, jfast = plait.jit(slow), plait.jit(lambda x: x + 1)
    x = torch.randn(4, 8)
    jfast(x)  # compiled before
    result = []
    tracer = threading.Thread(target=lambda: result.append(jslow(x)))
    tracer.start()
    assert traced.wait(60)
    try:
        assert not plait.tracer.trace.tracing_active()
        torch.testing.assert_close(jfast(x), x + 1)  # runs meanwhile
    finally:
        go_on.set()
        tracer.join()
    torch.testing.assert_close(result[0], x * 2)
    assert jfast.trace_count == 1
