"""Complex tensors: inputs, captured constants, intermediates and FFTs, against eager."""
import pytest
import torch

import plait


def _same(fn, *args):
    torch.testing.assert_close(plait.jit(fn)(*args), fn(*args))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_arithmetic(dtype):
    x, y = torch.randn(4, 3, dtype=dtype), torch.randn(3, dtype=dtype)
    _same(lambda a, b: (a * b + 2).exp() / (b.conj() + 1j), x, y)
    _same(lambda a: (a.abs(), a.real, a.imag, a.angle()), x)


def test_complex_parts_roundtrip_and_captured_constant():
    c = torch.randn(3, dtype=torch.complex64)
    x = torch.randn(3, 2)
    _same(lambda a: torch.view_as_real(torch.view_as_complex(a) * c), x)
    _same(lambda a, b: torch.polar(a.abs(), b), torch.randn(3), torch.randn(3))


def test_abs_of_complex_is_real():
    graph = plait.jit(lambda a: a.abs()).lower(torch.randn(3, dtype=torch.complex64)).graph
    assert graph.type_of(graph.outputs[0]).dtype == torch.float32


@pytest.mark.parametrize("fn", [
    lambda x: torch.fft.fft(x),
    lambda x: torch.fft.rfft(x, n=10, norm="ortho"),
    lambda x: torch.fft.irfft(torch.fft.rfft(x)),
    lambda x: torch.fft.fft2(x, norm="forward"),
    lambda x: torch.fft.hfft(x[0]),
])
def test_fft_matches_eager(fn):
    x = torch.randn(4, 8)
    _same(fn, x)
    graph = plait.jit(fn).lower(x).graph
    prims = {graph.node(n).prim for n in graph.nx.nodes}
    assert "opaque" not in prims and any(p.startswith("fft_") for p in prims)


def test_view_as_complex_needs_pairs():
    with pytest.raises(plait.errors.ShapeError, match="size 2"):
        plait.jit(torch.view_as_complex)(torch.randn(3, 3))
