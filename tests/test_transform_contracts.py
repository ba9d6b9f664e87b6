"""plait's transforms against torch.func on the contracts PyTorch's own torch.func tests
(test/functorch/test_eager_transforms.py) hold them to: each case runs the same code with
``plait`` and with ``torch.func`` as the transform namespace ``T`` and compares the results;
where torch.func raises, plait raises a ``PlaitError``."""
from __future__ import annotations

import pytest
import torch
import torch.func as tf
from torch.testing import assert_close

import plait
from plait.errors import PlaitError


def _same(case, *args):
    """``case(T, *args)`` with plait's transforms gives torch.func's result."""
    assert_close(case(plait, *args), case(tf, *args))


def _refused(case, *args):
    """torch.func raises on ``case``; plait raises a PlaitError."""
    with pytest.raises(Exception) as torch_exc:
        case(tf, *args)
    assert not isinstance(torch_exc.value, AssertionError)
    with pytest.raises(PlaitError):
        case(plait, *args)


# ---------------------------------------------------------------------------------------
# outputs that are an input, or one value several times
# ---------------------------------------------------------------------------------------
_ALIASING = {
    "input_thrice": lambda x: (x, (x, x)),
    "input_and_value": lambda x: (x, x.sin()),
    "value_twice": lambda x: (lambda y: (y, {"again": y}))(x * 2),
    "input_read_and_returned": lambda x: (x * x, (x, x)),
}


@pytest.mark.parametrize("name", sorted(_ALIASING))
def test_vjp_sums_the_cotangents_of_an_output_returned_several_times(name):
    f = _ALIASING[name]
    x = torch.randn(3)

    def case(T, x):
        out, vjp_fn = T.vjp(f, x)
        cts = torch.utils._pytree.tree_map(lambda o: torch.randn(o.shape, generator=torch.
                                           Generator().manual_seed(o.numel())), out)
        cts = torch.utils._pytree.tree_unflatten(
            [c * (k + 1) for k, c in enumerate(torch.utils._pytree.tree_leaves(cts))],
            torch.utils._pytree.tree_structure(cts))
        return out, vjp_fn(cts)

    _same(case, x)
    _same(lambda T, x: T.jacrev(f)(x), x)
    _same(lambda T, x: T.jacfwd(f)(x), x)
    # inside a traced function too
    _same(lambda T, x: plait.jit(lambda x: case(T, x))(x) if T is plait else case(T, x), x)

    # vjp_fn of a vjp on real tensors, called under a transform
    def batched(T, x):
        out, vjp_fn = T.vjp(f, x)
        return T.vmap(vjp_fn)(torch.utils._pytree.tree_map(
            lambda o: torch.arange(2.0)[:, None] + o, out))

    _same(batched, x)


def test_jitted_function_returning_its_input_twice_is_recorded_by_autograd():
    x = torch.randn(3, requires_grad=True)
    a, b = plait.jit(lambda x: (x, x))(x)
    (a * 2 + b * 3).sum().backward()
    assert_close(x.grad, torch.full((3,), 5.0))


# ---------------------------------------------------------------------------------------
# torch.no_grad inside a transformed function
# ---------------------------------------------------------------------------------------
def _cube(x):
    return x ** 3


def _grad_under_no_grad(T, x):
    with torch.no_grad():
        s = T.grad(_cube)(x)
    return x ** 3 - s


def _grad_and_value_under_no_grad(T, x):
    with torch.no_grad():
        g, v = T.grad_and_value(lambda x: (x ** 4).sum())(x)
    return (x ** 3 - g * v).sum()


def _grad_under_enable_grad_under_no_grad(T, x):
    with torch.no_grad(), torch.enable_grad():
        s = T.grad(_cube)(x)
    return x ** 3 - s


def _mixed_under_no_grad(T, x):
    with torch.no_grad():
        s = x.sin() * T.vjp(_cube, x)[1](torch.ones_like(x))[0]
    return (x ** 3 - s).sum()


@pytest.mark.parametrize("h", [_grad_under_no_grad, _grad_and_value_under_no_grad,
                               _grad_under_enable_grad_under_no_grad, _mixed_under_no_grad])
def test_no_grad_inside_a_transform_stops_only_the_outer_derivative(h):
    x = torch.tensor(1.5)
    _same(lambda T, x: T.grad(lambda x: h(T, x))(x), x)
    _same(lambda T, x: T.grad(T.grad(lambda x: h(T, x)))(x), x)
    _same(lambda T, x: T.jacrev(lambda x: h(T, x))(x), x)
    _same(lambda T, x: T.jacfwd(lambda x: h(T, x))(x), x)  # forward mode passes no_grad
    _same(lambda T, x: T.jvp(lambda x: h(T, x), (x,), (torch.ones(()),)), x)
    _same(lambda T, x: plait.jit(plait.grad(lambda x: h(T, x)))(x) if T is plait
          else T.grad(lambda x: h(T, x))(x), x)


def test_transform_called_under_no_grad_differentiates_as_ever():
    x = torch.tensor(1.5)

    def case(T, x):
        with torch.no_grad():
            return T.grad(lambda x: _grad_under_no_grad(T, x))(x), T.grad(_cube)(x)

    _same(case, x)


# ---------------------------------------------------------------------------------------
# results recorded by torch.autograd, as torch.func's are
# ---------------------------------------------------------------------------------------
def test_transform_results_are_recorded_by_torch_autograd():
    """A loss mixing a Jacobian with recorded values differentiates through both (the
    Jacobian's term was silently dropped while transforms ran under torch.no_grad)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    r = torch.linspace(0.5, 1.0, 5).reshape(-1, 1)

    def grads(T):
        derivs = T.vmap(T.jacrev(model))(r).reshape(-1, 1)
        loss = (model(r) ** 2).mean() + (derivs ** 2).mean()
        return torch.autograd.grad(loss, list(model.parameters()))

    assert_close(grads(plait), grads(tf))


@pytest.mark.parametrize("case", [
    lambda T, x: torch.autograd.grad(T.grad(lambda x: x.sin().sum())(x).sum(), x),
    lambda T, x: torch.autograd.grad(T.vmap(torch.sin)(x).sum(), x),
    lambda T, x: torch.autograd.grad(T.jvp(torch.sin, (x,), (torch.ones(3),))[1].sum(), x),
    lambda T, x: torch.autograd.grad(T.vjp(lambda x: x ** 3, x)[0].sum(), x),
    lambda T, x: torch.autograd.grad(T.vjp(lambda a, b: a * b, x, x)[0].sum(), x),
    lambda T, x: T.vjp(lambda a, b: a * b.exp(), x, x)[1](torch.ones(3)),
], ids=["grad", "vmap", "jvp", "vjp_output", "vjp_output_twice", "vjp_fn_twice"])
def test_composes_with_torch_autograd(case):
    x = torch.randn(3, requires_grad=True)
    _same(case, x)


def test_no_grad_around_a_transform_records_nothing():
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        g = plait.grad(lambda x: x.sin().sum())(x)
        out, vjp_fn = plait.vjp(torch.sin, x)
    assert not g.requires_grad and not out.requires_grad
    assert_close(g, x.detach().cos())


# ---------------------------------------------------------------------------------------
# transforms under torch.inference_mode
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [
    lambda T, x: T.jacrev(lambda x: x ** 2)(x),
    lambda T, x: T.jacrev(T.grad(lambda x: (x ** 3).sum()))(x),
    lambda T, x: T.jacfwd(lambda x: x.sin())(x),
    lambda T, x: T.vjp(lambda x: x ** 2, x)[1](torch.ones(3)),
], ids=["jacrev", "jacrev_grad", "jacfwd", "vjp"])
def test_transforms_under_inference_mode(case):
    x = torch.randn(3)

    def inference(T, x):
        with torch.inference_mode():
            result = case(T, x)
            assert torch.is_inference_mode_enabled()
        return result

    _same(inference, x)


# ---------------------------------------------------------------------------------------
# argument contracts: torch.func's checks and wording, as PlaitErrors
# ---------------------------------------------------------------------------------------
def _raises_as_torch_func(case, *args):
    """torch.func raises a RuntimeError or ValueError; plait raises a PlaitError of that
    class, whose message has torch.func's (up to plait's added fix)."""
    with pytest.raises((RuntimeError, ValueError)) as torch_exc:
        case(tf, *args)
    with pytest.raises(PlaitError) as plait_exc:
        case(plait, *args)
    assert isinstance(plait_exc.value, type(torch_exc.value))
    first = str(torch_exc.value).split(". ")[0].split(", got")[0].split(" (got")[0].rstrip(".")
    assert first in str(plait_exc.value), (first, str(plait_exc.value))


_x = torch.randn(3)
_sum = (lambda x, y: (x * y).sum())


@pytest.mark.parametrize("case", [
    lambda T: T.grad(_sum, argnums=[0])(_x, _x),
    lambda T: T.grad(_sum, argnums=("0",))(_x, _x),
    lambda T: T.grad(_sum, argnums=-3)(_x, _x),
    lambda T: T.jacrev(_sum, argnums=())(_x, _x),
    lambda T: T.jacfwd(_sum, argnums=(0, -2))(_x, _x),
    lambda T: T.jacrev(_sum, argnums=(1, 0.0))(_x, _x),
    lambda T: T.grad(lambda x: [x.sum(), x], has_aux=True)(_x),
    lambda T: T.grad(lambda x: (x.sum(), x, x), has_aux=True)(_x),
    lambda T: T.grad(lambda x: (x.sum(), [x, 1]), has_aux=True)(_x),
    lambda T: T.vjp(lambda x: (x, "aux"), _x, has_aux=True),
    lambda T: T.jvp(lambda x: (x, 1.0), (_x,), (_x,), has_aux=True),
    lambda T: T.jacrev(lambda x: (x, {"a": 1}), has_aux=True)(_x),
    lambda T: T.jacfwd(lambda x: [x, x], has_aux=True)(_x),
    lambda T: T.grad(lambda x: x)(_x),
    lambda T: T.grad(lambda x: {"a": x.sum()})(_x),
    lambda T: T.vjp(lambda x: None, _x),
    lambda T: T.vjp(lambda x: (), _x),
    lambda T: T.vjp(lambda x: 1.5, _x),
    lambda T: T.jvp(lambda x: None, (_x,), (_x,)),
    lambda T: T.jvp(lambda x: (x, "s"), (_x,), (_x,)),
    lambda T: T.jacrev(lambda x: ())(_x),
    lambda T: T.jacfwd(lambda x: ())(_x),
    lambda T: T.vjp(lambda x: (x, (x, x)), _x)[1](((_x, (_x, _x)),)),
    lambda T: T.jvp(torch.sin, _x, (_x,)),
    lambda T: T.jvp(torch.sin, (_x,), _x),
    lambda T: T.jvp(torch.sin, (_x,), [_x]),
    lambda T: T.jvp(torch.sin, (_x, _x), (_x, _x, _x)),
    lambda T: T.jvp(torch.sin, (1.0,), (_x,)),
    lambda T: T.jvp(torch.sin, (_x,), (1.0,)),
    lambda T: T.jvp(torch.sin, (), ()),
    lambda T: T.jvp(lambda x: (x, _x * 2), (_x,), (_x,), strict=True),
    lambda T: T.jacrev(torch.conj)(_x.to(torch.complex64)),
    lambda T: T.jacfwd(lambda x: x * 0.5j)(_x),
    lambda T: T.jacrev(lambda x: x * 0.5j)(_x),
    lambda T: T.jacrev(torch.sin, chunk_size=0)(_x),
])
def test_contract_errors_match_torch_func(case):
    _raises_as_torch_func(case)


def test_jacrev_accepts_torch_funcs_chunk_assembly_option():
    x, y = torch.randn(4, 2), torch.randn(1, 2)
    f = (lambda x, y: ((x.sin(), x + y), (x + 2, x.sum())))
    for copy in (True, False):
        _same(lambda T, x, y: T.jacrev(f, argnums=(0, 1), chunk_size=3,
                                       _preallocate_and_copy=copy)(x, y), x, y)


def test_a_draw_shaped_like_an_input_carries_no_derivative():
    """d/dx (x * randn_like(x)) is the draw (randn_like reads only x's shape), as in eager:
    checked by the draws' statistics against eager's."""
    x = torch.randn(20000)
    noisy = (lambda x: (x * torch.randn_like(x)).sum())
    got = plait.grad(noisy)(x)
    tangent = plait.jvp(lambda x: x * torch.randn_like(x), (x,), (torch.ones_like(x),))[1]
    x_eager = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(noisy(x_eager), x_eager)
    for draws in (got, tangent):
        assert abs(draws.mean() - want.mean()) < 0.05
        assert abs(draws.var() - want.var()) < 0.1


# ---------------------------------------------------------------------------------------
# Errors of the class and words torch.func raises, so code catching them keeps working
# ---------------------------------------------------------------------------------------
def _write_captured(T):
    captured = torch.randn(3)

    def foo(x):
        captured.copy_(x)
        return (x * captured).sum()

    return T.grad(foo)(torch.tensor([1.0, 2.0, 3.0]))


def _retain_grad(T):
    def f(x):
        y = x.sin()
        y.retain_grad()
        return y.sum()

    return T.grad(f)(torch.randn(3))


class _KeywordTensors(torch.autograd.Function):
    @staticmethod
    def forward(x, *, y):
        return x + y

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def vmap(info, in_dims, x, *, y):
        return x + y, 0


def _keyword_tensors(T):
    return T.vmap(_KeywordTensors.apply)(torch.randn(3), y=torch.randn(3))


@pytest.mark.parametrize("case, error, words", [
    (_write_captured, RuntimeError, "mutate a captured Tensor"),
    (_retain_grad, Exception, "retain_grad"),
    (_keyword_tensors, NotImplementedError, "kwarg-only Tensor args"),
], ids=["write into a captured tensor", "retain_grad", "apply with keyword tensors"])
def test_refusals_are_torch_funcs_errors(case, error, words):
    for T in (tf, plait):
        with pytest.raises(error, match=words if T is plait else None):
            case(T)
    with pytest.raises(PlaitError):
        case(plait)


def test_a_custom_function_that_does_not_materialize_grads_gets_none():
    """ctx.set_materialize_grads(False): an output no gradient reached gives its backward
    None, as torch.autograd does, rather than zeros."""
    seen = []

    class TwoOutputs(torch.autograd.Function):
        @staticmethod
        def forward(x, y):
            return x * 1, y * 1

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.set_materialize_grads(False)

        @staticmethod
        def backward(ctx, gx, gy):
            seen.append((gx is None, gy is None))
            return gx, gy

    def f(y, x):
        return TwoOutputs.apply(x, y)[0] ** 2

    x, y = torch.tensor(2.0), torch.tensor(3.0)
    for T in (tf, plait):
        seen.clear()
        assert_close(T.grad(f, argnums=1)(y, x), torch.tensor(4.0))
        assert seen == [(False, True)], T
