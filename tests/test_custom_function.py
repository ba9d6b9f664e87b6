"""torch.autograd.Function inside plait.jit and the transforms (NOTE [custom functions]): the
forward is traced, the user's backward is the derivative. Checked against eager autograd and
torch.func."""
import pytest
import torch
from torch.testing import assert_close

import plait
from plait.errors import TraceError


class RoundStraightThrough(torch.autograd.Function):
    """Old style (ctx in forward): a derivative that is not the forward's own."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return torch.round(x * scale) / scale

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.sigmoid(x) * ctx.scale, None


class ScaledSin(torch.autograd.Function):
    """New style (setup_context), a tensor kept as a ctx attribute, generate_vmap_rule."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, w):
        return torch.sin(x) * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.x, ctx.w = inputs

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.cos(ctx.x) * ctx.w, grad * torch.sin(ctx.x)


class SplitPair(torch.autograd.Function):
    """Two outputs, one marked non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        index = torch.argmax(x, dim=-1)
        ctx.mark_non_differentiable(index)
        return x.square(), index

    @staticmethod
    def backward(ctx, grad, _):
        (x,) = ctx.saved_tensors
        return 3.0 * grad * x


def _loss(x, w):
    y = RoundStraightThrough.apply(x, 4.0) + ScaledSin.apply(x, w)
    sq, index = SplitPair.apply(y)
    return (sq * (index.float() + 1).unsqueeze(-1)).sum()


def _eager_grads(x, w):
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    return torch.autograd.grad(_loss(*leaves), leaves)


def test_jit_runs_the_forward():
    x, w = torch.randn(3, 5), torch.randn(5)
    assert_close(plait.jit(_loss)(x, w), _loss(x, w))


def test_grad_uses_the_users_backward():
    x, w = torch.randn(3, 5), torch.randn(5)
    assert_close(plait.grad(_loss, argnums=(0, 1))(x, w), _eager_grads(x, w))


def test_jitted_call_under_autograd_uses_the_users_backward():
    x, w = torch.randn(3, 5), torch.randn(5)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    plait.jit(_loss)(*leaves).backward()
    assert_close((leaves[0].grad, leaves[1].grad), _eager_grads(x, w))


def test_new_style_function_under_vmap_jacrev_and_jvp_matches_torch_func():
    x, w = torch.randn(4, 3), torch.randn(3)

    def f(x):
        return ScaledSin.apply(x, w)

    assert_close(plait.vmap(f)(x), torch.func.vmap(f)(x))
    assert_close(plait.jacrev(f)(x[0]), torch.func.jacrev(f)(x[0]))
    t = torch.randn(4, 3)
    want = (f(x), torch.autograd.functional.jvp(f, x, t)[1])
    assert_close(plait.jvp(f, (x,), (t,)), want)


class TripledInPlace(torch.autograd.Function):
    """Writes into its input (ctx.mark_dirty) and returns it; its backward is not the
    op's own, so a test shows whose runs."""

    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


def _reads_after_the_write(x):
    y = x.sin()
    z = TripledInPlace.apply(y)
    return (z * y + x).sum()  # y is z after the write, as in eager


def test_a_function_writing_into_its_input_is_differentiated_at_the_value_before():
    x = torch.randn(5, requires_grad=True)
    want = torch.autograd.grad(_reads_after_the_write(x), x)[0]
    assert_close(plait.jit(_reads_after_the_write)(x), _reads_after_the_write(x))
    assert_close(plait.grad(_reads_after_the_write)(x), want)
    assert_close(torch.autograd.grad(plait.jit(_reads_after_the_write)(x), x)[0], want)
    batch = [torch.randn(5, requires_grad=True) for _ in range(3)]  # torch.func refuses it
    assert_close(plait.vmap(plait.grad(_reads_after_the_write))(torch.stack(batch)),
                 torch.stack([torch.autograd.grad(_reads_after_the_write(b), b)[0]
                              for b in batch]))


class Cube(torch.autograd.Function):
    """With a jvp staticmethod and torch's generated vmap rule."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x ** 3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x ** 2 * g

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 3 * x ** 2 * t


def test_apply_passed_to_a_transform_as_the_function():
    """``Cube.apply`` taken before any trace began is torch's own apply: plait traces it as
    its own (NOTE [custom functions]), as torch.func accepts it."""
    x, t = torch.randn(4, 3), torch.randn(4, 3)
    assert_close(plait.vmap(Cube.apply)(x), torch.func.vmap(Cube.apply)(x))
    assert_close(plait.jvp(Cube.apply, (x,), (t,)), torch.func.jvp(Cube.apply, (x,), (t,)))
    assert_close(plait.jit(Cube.apply, backend="cpp")(x), Cube.apply(x))
    assert_close(plait.grad(lambda a: Cube.apply(a).sum())(x),
                 torch.func.grad(lambda a: Cube.apply(a).sum())(x))


@pytest.mark.parametrize("saved", ["input", "output", "a view"])
def test_saving_an_input_returned_as_it_is_is_refused_as_eager_refuses_it(saved):
    class ReturnsInput(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward({"input": inputs[0], "output": output,
                                   "a view": inputs[0].view_as(inputs[0])}[saved])

        @staticmethod
        def backward(ctx, g):
            return g

    def f(x):
        return ReturnsInput.apply(x.clone()).sum()

    x = torch.tensor([2.0, 3.0], requires_grad=True)
    if saved == "a view":  # what torch's message advises: it runs, in eager and in plait
        assert_close(plait.grad(f)(x), torch.func.grad(f)(x))
        return
    for run in (lambda: f(x), lambda: plait.grad(f)(x), lambda: plait.jit(f)(x)):
        with pytest.raises(RuntimeError, match="returned as-is as output is being saved"):
            run()


def test_needs_input_grad_names_the_inputs_being_differentiated():
    seen = {}

    class Product(torch.autograd.Function):
        @staticmethod
        def forward(x, y):
            return x * y

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs)

        @staticmethod
        def backward(ctx, g):
            x, y = ctx.saved_tensors
            seen[T] = ctx.needs_input_grad
            return (g * y if ctx.needs_input_grad[0] else None,
                    g * x if ctx.needs_input_grad[1] else None)

    x, y = torch.tensor(2.0), torch.tensor(3.0)
    for argnums in (0, 1, (0, 1)):
        for T in (torch.func, plait):
            got = T.grad(Product.apply, argnums=argnums)(x, y)
            assert_close(got, torch.func.grad(lambda a, b: a * b, argnums=argnums)(x, y))
        assert seen[plait] == seen[torch.func]


@plait.custom_vjp
def clipped(x, bound):
    """The identity, whose cotangent is clipped to [-bound, bound]."""
    return x * 1


clipped.defvjp(lambda x, bound: (x * 1, bound), lambda bound, g: (g.clamp(-bound, bound), None))


@plait.custom_vjp
def scaled_pair(x, y):
    """Pytree output and residuals: ({"sum": x + y, "prod": x * y}, residuals (x, y, 2.0))."""
    return {"sum": x + y, "prod": x * y}


scaled_pair.defvjp(lambda x, y: ({"sum": x + y, "prod": x * y}, (x, y, 2.0)),
                   lambda res, g: ((g["sum"] + g["prod"] * res[1]) * res[2],
                                   (g["sum"] + g["prod"] * res[0]) * res[2]))


def test_custom_vjp_clips_cotangents_everywhere():
    """NOTE [custom derivative rules]: the user's bwd under plait's grad, jit, vmap and under
    eager torch.autograd alike."""
    x = torch.linspace(-3, 3, 7)
    loss = lambda a: (clipped(a, 0.5) * 10).sum()  # noqa: E731
    want = torch.full_like(x, 0.5)
    assert_close(plait.grad(loss)(x), want)
    assert_close(plait.jit(plait.grad(loss), backend="cpp")(x), want)
    assert_close(plait.vmap(plait.grad(loss))(x.reshape(7, 1)), want.reshape(7, 1))
    leaf = x.clone().requires_grad_()
    loss(leaf).backward()
    assert_close(leaf.grad, want)
    assert_close(plait.jit(loss, backend="cpp")(x), loss(x))


def test_custom_vjp_with_pytree_outputs_and_residuals():
    x, y = torch.randn(3), torch.randn(3)
    loss = lambda a, b: (lambda o: o["sum"].sum() + o["prod"].sum())(scaled_pair(a, b))  # noqa
    gx, gy = plait.grad(loss, argnums=(0, 1))(x, y)
    assert_close(gx, 2 * (1 + y))
    assert_close(gy, 2 * (1 + x))


def test_custom_rule_needs_its_definition():
    bare = plait.custom_vjp(lambda x: x)
    with pytest.raises(TraceError, match="defvjp"):
        bare(torch.randn(2))


@plait.custom_jvp
def softplus2(x):
    """softplus, whose derivative rule says twice its derivative (so tests see the rule)."""
    return torch.nn.functional.softplus(x)


softplus2.defjvp(lambda primals, tangents: (softplus2(primals[0]),
                                            2 * torch.sigmoid(primals[0]) * tangents[0]))


def test_custom_jvp_rule_in_both_modes():
    """Forward mode calls the rule; reverse mode transposes it (as JAX's custom_jvp)."""
    x, t = torch.randn(5), torch.randn(5)
    want = 2 * torch.sigmoid(x)
    loss = lambda a: softplus2(a).sum()  # noqa: E731
    assert_close(plait.grad(loss)(x), want)
    assert_close(plait.jit(plait.grad(loss), backend="cpp")(x), want)
    assert_close(plait.jvp(softplus2, (x,), (t,))[1], want * t)
    assert_close(plait.jacrev(softplus2)(x), torch.diag(want))
    leaf = x.clone().requires_grad_()
    loss(leaf).backward()
    assert_close(leaf.grad, want)
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(softplus2(fwAD.make_dual(x, t))).tangent
    assert_close(tangent, want * t)


def test_custom_jvp_second_derivative_in_eager_autograd():
    x = torch.randn(4, requires_grad=True)
    (g,) = torch.autograd.grad(softplus2(x).sum(), x, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), x)
    s = torch.sigmoid(x)
    assert_close(h, 2 * s * (1 - s))


@torch.library.custom_op("plait_test::rounded_mm", mutates_args=())
def rounded_mm(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(a @ b * scale)


@rounded_mm.register_fake
def _(a, b, scale):
    return a.new_empty(a.shape[0], b.shape[1])


def _rounded_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.scale = inputs[2]  # a tensor kept as a ctx attribute


def _rounded_mm_backward(ctx, grad):  # straight through the rounding: not the op's own
    a, b = ctx.saved_tensors
    grad = grad * ctx.scale
    return grad @ b.T, a.T @ grad, None


rounded_mm.register_autograd(_rounded_mm_backward, setup_context=_rounded_mm_setup)


@torch.library.custom_op("plait_test::plain_mm", mutates_args=())
def plain_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@plain_mm.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


def test_custom_op_with_a_registered_derivative_uses_it():
    """torch.library.custom_op + register_autograd (transformers' mixture-of-experts matmul):
    the op runs as itself, and its registered backward is the derivative, under plait.grad
    and through a jitted call under eager autograd."""
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    scale = torch.tensor(4.0)

    def f(a, b):
        return (rounded_mm(a, b, scale).sin() * torch.arange(5.0)).sum()

    want = torch.autograd.grad(f(a, b), (a, b))
    assert_close(plait.jit(f)(a, b), f(a, b))
    assert_close(plait.grad(f, argnums=(0, 1))(a, b), want)
    assert_close(torch.autograd.grad(plait.jit(f)(a, b), (a, b)), want)


def test_custom_op_without_a_derivative_is_refused_when_differentiated():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    assert_close(plait.jit(plain_mm)(a, b), a @ b)
    with pytest.raises(plait.errors.PlaitError, match="plain_mm"):
        plait.grad(lambda a: plain_mm(a, b).sum())(a)


def test_a_custom_op_whose_derivative_gives_no_gradient_is_refused():
    """torch's chunked linear_cross_entropy computes its gradients in the forward, for the
    arguments that require grad, which plait's traced tensors do not: its registered
    backward has none to give, and zero would be a wrong answer."""
    x, w = torch.randn(4, 8), torch.randn(5, 8)
    target = torch.randint(0, 5, (4,))

    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2, allow_retain_graph=True)

    def loss(x):
        return torch.nn.functional.linear_cross_entropy(x, w, target, options=options)

    assert_close(plait.jit(loss)(x), loss(x))
    with pytest.raises(plait.errors.PlaitError, match="gave no gradient"):
        plait.grad(loss)(x)


# ---------------------------------------------------------------------------------------
# NOTE [grouped products]: torch._grouped_mm, an opaque call differentiated by grouped products
# ---------------------------------------------------------------------------------------
def _per_group(a, b, offs):
    """The grouped product written out, group by group (its rows end at ``offs``)."""
    ends = offs.tolist()
    return torch.cat([a[s:e] @ b[i] for i, (s, e) in enumerate(zip([0] + ends[:-1], ends))])


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize("backend", ["eager", "cpp", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_grouped_products_of_experts_differentiate_as_the_groups_written_out(backend):
    """A mixture of experts' [S, K] x [G, K, N] product (transformers' on CUDA), an empty
    group among them and groups of a number of rows CUDA's kernel takes only through a view
    (NOTE [grouped products]): values, both gradients and a jitted module's loss.backward()
    against the product written out per group."""
    device = "cuda" if backend == "cuda" else "cpu"
    backend = None if backend == "cuda" else backend
    offs = torch.tensor([5, 5, 16], dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 8, generator=g).bfloat16().to(device)
    b = torch.randn(3, 8, 8, generator=g).bfloat16().to(device)

    def loss(grouped):
        return lambda a, b: grouped(a, b, offs=offs).tanh().sum()
    mine = loss(torch._grouped_mm)
    theirs = loss(_per_group)
    assert_close(plait.jit(mine, backend=backend)(a, b), theirs(a, b), atol=0.1, rtol=1e-2)
    got = plait.jit(plait.grad(mine, argnums=(0, 1)), backend=backend)(a, b)
    want = torch.func.grad(theirs, argnums=(0, 1))(a, b)
    for x, y in zip(got, want):
        assert_close(x, y, atol=5e-2, rtol=2e-2)

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(b.clone())

        def forward(self, a):
            return torch._grouped_mm(a, self.weight, offs=offs)
    experts = Experts()
    x = a.clone().requires_grad_()
    plait.jit(experts, backend=backend)(x).square().sum().backward()
    x_ref, w_ref = a.clone().requires_grad_(), b.clone().requires_grad_()
    _per_group(x_ref, w_ref, offs).square().sum().backward()
    assert_close(x.grad, x_ref.grad, atol=5e-2, rtol=2e-2)
    assert_close(experts.weight.grad, w_ref.grad, atol=5e-2, rtol=2e-2)
