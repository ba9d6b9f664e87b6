"""NOTE [plain forms of torch's references]: plait promotes and broadcasts the plain forms of
ATen's elementwise ops, sums and means itself. Held against the references they replace: the
same graph on OpInfo samples of every dtype, and no symbolic-shapes import while tracing."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

import plait
from plait.tracer import aten
from plait.tracer.trace import HANDLERS

DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
          torch.complex64)
SAMPLES = 4
_PACKETS = {op.overloadpacket.__name__ for op in aten.PLAIN_FORMS}
OPS = [op for op in op_db if op.name.split(".")[-1] in _PACKETS or op.aten_name in _PACKETS]


def _graph_or_error(fn, args, kwargs) -> str:
    try:
        return plait.make_graph(lambda *a: fn(*a, **kwargs))(*args).digest
    except plait.PlaitError as e:
        return type(e).__name__


@pytest.fixture
def counted(monkeypatch):
    """How many calls the plain rules took."""
    calls = []
    for op in aten.PLAIN_FORMS:
        monkeypatch.setitem(HANDLERS, op, lambda *a, _h=HANDLERS[op], **k: calls.append(1) or
                            _h(*a, **k))
    return calls


@pytest.mark.parametrize("op", OPS, ids=lambda op: f"{op.name}.{op.variant_test_name}")
def test_the_graph_of_the_reference(op, monkeypatch):
    pairs = []
    for dtype in DTYPES:
        if dtype not in op.supported_dtypes("cpu"):
            continue
        for sample in list(op.sample_inputs("cpu", dtype))[:SAMPLES]:
            args = (sample.input, *sample.args)
            try:
                op(*args, **sample.kwargs)
            except Exception:
                continue  # eager rejects it
            pairs.append((dtype, args, sample.kwargs, _graph_or_error(op, args, sample.kwargs)))
    assert pairs
    with monkeypatch.context() as m:  # now without the plain rules: the references run
        for form in aten.PLAIN_FORMS:
            m.delitem(HANDLERS, form)
        for dtype, args, kwargs, plain in pairs:
            assert plain == _graph_or_error(op, args, kwargs), (dtype, args, kwargs)


@pytest.mark.parametrize("case", [
    (lambda x, y: x * 2 + y, torch.float32, torch.bfloat16),
    (lambda x, y: (x - y) ** 2 / 3, torch.int64, torch.float32),
    (lambda x, y: -x.sum(0, keepdim=True) + y.mean(), torch.bfloat16, torch.float32),
    (lambda x, y: x.to(torch.float64) ** 0.5 + y.sum(dtype=torch.float64), torch.int32,
     torch.int64),
    (lambda x, y: torch.exp(x) * torch.tensor(2.0) > y, torch.float32, torch.int64),
    (lambda x, y: 2 ** x - 1 / (y + 1), torch.float32, torch.bool),
])
def test_mixed_dtypes_scalars_and_broadcasts(case, counted):
    fn, dx, dy = case
    x, y = torch.arange(12).reshape(3, 4).to(dx), (torch.arange(4) % 2).to(dy)
    got, want = plait.jit(fn)(x, y), fn(x, y)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-2 if torch.bfloat16 in (dx, dy) else 1e-5,
                               atol=1e-5)
    assert counted


def test_a_plain_trace_does_not_import_symbolic_shapes():
    """The warm-start cost the plain rules remove (about 15 ms once per process): a warm
    start traces (``lower`` runs no pass before it is asked for a stage) and loads."""
    script = """
import sys, torch, torch.nn.functional as F, plait
def loss(w, x, y):
    h = F.gelu(x @ w.T * 2.0 + 1)
    return F.mse_loss(h, y) + (h.sum(-1, keepdim=True) / h.mean()).pow(2).sum()
plait.jit(plait.grad(loss)).lower(torch.randn(8, 4), torch.randn(5, 4), torch.randn(5, 8))
print("torch.fx.experimental.symbolic_shapes" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False"
