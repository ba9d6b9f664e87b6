"""Complex tensors: inputs, captured constants, intermediates and FFTs, against eager; their
derivatives (PyTorch's convention) against torch.func and torch.autograd."""
import pytest
import torch
from torch import func

import plait
from plait.passes import autodiff
from plait.tracer.interpret import inline


def _same(fn, *args):
    torch.testing.assert_close(plait.jit(fn)(*args), fn(*args))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_arithmetic(dtype):
    x, y = torch.randn(4, 3, dtype=dtype), torch.randn(3, dtype=dtype)
    _same(lambda a, b: (a * b + 2).exp() / (b.conj() + 1j), x, y)
    _same(lambda a: (a.abs(), a.real, a.imag, a.angle()), x)
    _same(torch.vdot, y, y.exp())  # the first operand conjugated


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


_REAL_TO_REAL = [
    lambda x: torch.fft.irfft(torch.fft.rfft(x) * 2).sum(),
    lambda x: torch.fft.rfft(x).abs().sum(),
    lambda x: torch.stft(x, 4, return_complex=True, window=torch.ones(4)).abs().pow(2).sum(),
    lambda x: (torch.view_as_complex(x.reshape(4, 2))
               @ torch.view_as_complex(x.reshape(4, 2)).conj()).real.sum(),
    # rfft/irfft's Hermitian halves: odd lengths, cut and padded signals, several dims
    lambda x: torch.fft.irfft(torch.fft.rfft(x, norm="ortho")[:4] * (1 + 2j), n=7).pow(3).sum(),
    lambda x: torch.fft.rfft(x, n=11, norm="forward").abs().pow(2).sum(),
    lambda x: torch.fft.irfft2(torch.fft.rfft2(x.reshape(2, 4)) * (1 - 1j)).pow(2).sum(),
    lambda x: torch.fft.hfft(torch.view_as_complex(x.reshape(4, 2)), n=7,
                             norm="ortho").pow(2).sum(),
    lambda x: torch.fft.ifft(torch.fft.fft2(x.reshape(2, 4), norm="forward"), dim=0).angle().sum(),
    lambda x: torch.polar(x[:4].exp(), x[4:]).log().sin().imag.sum(),
]


@pytest.mark.parametrize("fn", _REAL_TO_REAL)
def test_derivatives_through_complex_values(fn):
    x, t, xs = torch.randn(8), torch.randn(8), torch.randn(3, 8)
    expected = func.grad(fn)(x)
    torch.testing.assert_close(plait.grad(fn)(x), expected)
    torch.testing.assert_close(plait.jit(plait.grad(fn), backend="cpp")(x), expected)
    torch.testing.assert_close(plait.jvp(fn, (x,), (t,)), func.jvp(fn, (x,), (t,)))
    torch.testing.assert_close(plait.jacrev(fn)(x), func.jacrev(fn)(x))
    torch.testing.assert_close(plait.jacfwd(fn)(x), func.jacfwd(fn)(x))
    torch.testing.assert_close(plait.vmap(plait.grad(fn))(xs), func.vmap(func.grad(fn))(xs))


def test_second_derivatives_through_complex_values():
    fn = _REAL_TO_REAL[4]
    x = torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(plait.hessian(fn)(x), func.hessian(fn)(x))


_OF_COMPLEX = {  # (z, w) -> a complex or real value; derivatives in z
    "exp": lambda z, w: z.exp(), "log": lambda z, w: z.log(), "sin": lambda z, w: z.sin(),
    "tanh": lambda z, w: z.tanh(), "sqrt": lambda z, w: z.sqrt(), "mul": lambda z, w: z * w,
    "div": lambda z, w: w / z, "pow": lambda z, w: z ** w, "pow_scalar": lambda z, w: z ** 2.5,
    "abs": lambda z, w: z.abs(), "angle": lambda z, w: z.angle(), "real": lambda z, w: z.real,
    "imag": lambda z, w: z.imag, "conj": lambda z, w: z.conj() * w, "sgn": lambda z, w: z.sgn(),
    "polar": lambda z, w: torch.polar(z.abs(), z.angle() + 1),
    "view_as_real": lambda z, w: torch.view_as_real(z) * torch.arange(2),
    "view_as_complex": lambda z, w: torch.view_as_complex(torch.view_as_real(z).flip(-1)),
    "to_complex64": lambda z, w: z.to(torch.complex64).exp(),
    "matmul": lambda z, w: z.reshape(2, 3) @ w.reshape(3, 2),
    "matmul_adjoint": lambda z, w: z.reshape(2, 3) @ z.reshape(2, 3).mH,
    "vdot": lambda z, w: torch.vdot(z, w), "prod": lambda z, w: z.prod(),
    "cumprod": lambda z, w: z.cumprod(0), "mean": lambda z, w: z.mean(),
    "fft": lambda z, w: torch.fft.fft(z),
    "ifft_ortho": lambda z, w: torch.fft.ifft(z, norm="ortho"),
    "fft_forward": lambda z, w: torch.fft.fft(z, n=9, norm="forward"),
    "fft2": lambda z, w: torch.fft.fft2(z.reshape(2, 3)),
    "irfft": lambda z, w: torch.fft.irfft(z),
    "irfft2": lambda z, w: torch.fft.irfft2(z.reshape(2, 3)),
}


@pytest.mark.parametrize("name", list(_OF_COMPLEX))
def test_derivatives_of_complex_inputs(name):
    fn = _OF_COMPLEX[name]
    z, w = torch.randn(6, dtype=torch.complex128), torch.randn(6, dtype=torch.complex128)
    # reverse mode with a complex cotangent: the VJP pass on the graph, compiled (plait.vjp
    # differentiates real arguments only)
    ct = torch.randn_like(fn(z, w))
    graph = plait.make_graph(fn)(z, w)
    vjp = plait.jit(lambda *a: inline(autodiff.vjp(graph, [0]), list(a))[1], backend="cpp")
    torch.testing.assert_close(vjp(z, w, ct), func.vjp(fn, z, w)[1](ct)[0])
    # forward mode with a complex tangent
    t = torch.randn_like(z)
    torch.testing.assert_close(plait.jvp(lambda z: fn(z, w), (z,), (t,)),
                               func.jvp(lambda z: fn(z, w), (z,), (t,)))
    # a real loss under torch.autograd: its gradient dL/dRe + i dL/dIm
    def loss(z, w):
        y = fn(z, w)
        return (y.abs() ** 2 if y.is_complex() else y ** 3).sum()

    leaf = z.clone().requires_grad_()
    got, = torch.autograd.grad(plait.jit(loss, backend="cpp")(leaf, w), leaf)
    torch.testing.assert_close(got, func.grad(loss)(z, w))


@pytest.mark.parametrize("name", (
    "abs acos acosh asin asinh atan atanh cos cosh exp exp2 expm1 log log10 log1p log2 neg "
    "reciprocal rsqrt sigmoid sin sinh sqrt tan tanh").split())
def test_complex_elementwise_derivatives(name):
    """Over the whole plane (each branch of the square roots in the inverse functions)."""
    def fn(x):
        return (getattr(torch, name)(torch.view_as_complex(x)) ** 2).real.sum()

    x, t = torch.randn(40, 2, dtype=torch.float64) * 2, torch.randn(40, 2, dtype=torch.float64)
    torch.testing.assert_close(plait.grad(fn)(x), func.grad(fn)(x))
    torch.testing.assert_close(plait.jvp(fn, (x,), (t,)), func.jvp(fn, (x,), (t,)))


def test_abs_of_complex_zero_has_zero_derivative():
    x = torch.tensor([[0.0, 0.0], [3.0, -4.0]])
    loss = lambda x: torch.view_as_complex(x).abs().sum()  # noqa: E731
    torch.testing.assert_close(plait.grad(loss)(x), func.grad(loss)(x))
    torch.testing.assert_close(plait.grad(loss)(x), torch.tensor([[0.0, 0.0], [0.6, -0.8]]))


def test_conjugating_twice_leaves_no_op():
    """The complex VJP of an addition conjugates the cotangent twice: simplified away."""
    c = torch.randn(4, dtype=torch.complex64)
    graph = plait.make_graph(plait.grad(
        lambda x: (torch.view_as_complex(x) + c).real.sum()))(torch.randn(4, 2))
    assert "conj" not in {graph.node(n).prim for n in graph.nx.nodes}


def test_complex_values_without_a_rule_are_refused():
    fn = lambda x: torch.logcumsumexp(torch.view_as_complex(x), 0).abs().sum()  # noqa: E731
    with pytest.raises(plait.errors.UnsupportedOpError, match="logcumsumexp.*complex"):
        plait.grad(fn)(torch.randn(3, 2))
    with pytest.raises(plait.errors.UnsupportedOpError, match="logcumsumexp.*complex"):
        plait.jvp(fn, (torch.randn(3, 2),), (torch.randn(3, 2),))


def test_autograd_through_jit_carries_complex_output_cotangents():
    x = torch.randn(10, dtype=torch.float64, requires_grad=True)
    f = lambda a: torch.fft.rfft(a) * torch.fft.fft(a)[:6]  # noqa: E731
    ct = torch.randn(6, dtype=torch.complex128)
    (got,) = torch.autograd.grad(plait.jit(f, backend="cpp")(x), x, ct)
    (want,) = torch.autograd.grad(f(x), x, ct)
    torch.testing.assert_close(got, want)


def test_grad_and_vjp_of_complex_arguments_match_torch_func():
    z = torch.randn(5, dtype=torch.complex128)
    f = lambda a: (a * a.conj() + a.exp()).abs().sum()  # noqa: E731
    torch.testing.assert_close(plait.grad(f)(z), torch.func.grad(f)(z))
    ct = torch.randn(5, dtype=torch.complex128)
    (got,) = plait.vjp(lambda a: a.exp() * 2, z)[1](ct)
    (want,) = torch.func.vjp(lambda a: a.exp() * 2, z)[1](ct)
    torch.testing.assert_close(got, want)


def test_jacobians_of_complex_arguments_are_refused():
    """torch.func refuses them too: reverse mode gives conj(f'(z)), forward mode f'(z)."""
    z = torch.randn(3, dtype=torch.complex64)
    for jacobian in (plait.jacrev, plait.jacfwd):
        with pytest.raises(plait.errors.TraceError, match="inputs to be real.*complex"):
            jacobian(lambda a: a * a)(z)
