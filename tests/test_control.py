"""Structured control flow and remat (NOTE [control-flow primitives], NOTE [checkpoint]):
cond, while_loop, fori_loop, scan and checkpoint, each against a plain-Python reference (and
torch.func where it applies), through jit, grad, jvp and vmap."""
import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.testing import assert_close

import plait
from plait.errors import ConcretizationError, TraceError, UnsupportedOpError


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(params=["cpp", "eager"])
def backend(request):
    """The backend of the program and of the bodies it runs (config.backend)."""
    plait.config.backend = request.param  # the autouse fixture restores it
    return request.param


# ---------------------------------------------------------------------------------------
# cond
# ---------------------------------------------------------------------------------------
def branchy(x, w):
    return plait.cond(x.sum() > 0, lambda x: (x * w).sin(), lambda x: x.cos() * w, (x,))


def branchy_ref(x, w):
    return (x * w).sin() if x.sum() > 0 else x.cos() * w


def test_cond_takes_either_branch_from_one_trace(backend):
    w = torch.randn(5, generator=_gen(1))
    jitted = plait.jit(branchy)
    for x in (torch.rand(5) + 0.1, -torch.rand(5) - 0.1):
        assert_close(jitted(x, w), branchy_ref(x, w))
    assert jitted.trace_count == 1


def test_cond_grad_and_jvp_match_torch_func_on_both_branches(backend):
    w = torch.randn(5, generator=_gen(1))
    for x in (torch.rand(5) + 0.1, -torch.rand(5) - 0.1):
        loss, ref = (lambda f: lambda x, w: f(x, w).square().sum())(branchy), \
            (lambda x, w: branchy_ref(x, w).square().sum())
        for got, want in zip(plait.jit(plait.grad(loss, argnums=(0, 1)))(x, w),
                             torch.func.grad(ref, argnums=(0, 1))(x, w)):
            assert_close(got, want)
        t = torch.randn(5, generator=_gen(2))
        assert_close(plait.jvp(branchy, (x, w), (t, t))[1],
                     torch.func.jvp(branchy_ref, (x, w), (t, t))[1])


def test_cond_under_vmap_picks_per_example():
    w = torch.randn(5, generator=_gen(1))
    xs = torch.randn(6, 5, generator=_gen(3))
    want = torch.stack([branchy_ref(x, w) for x in xs])
    assert_close(plait.vmap(branchy, in_dims=(0, None))(xs, w), want)
    assert_close(plait.jit(plait.vmap(branchy, in_dims=(0, None)))(xs, w), want)
    # a predicate that is the same for every example keeps one branch
    same = plait.vmap(lambda x, p: plait.cond(p, torch.sin, torch.cos, (x,)), in_dims=(0, None))
    assert_close(same(xs, torch.tensor(False)), xs.cos())


def test_cond_branches_capture_values_of_the_enclosing_function():
    def f(x, y):
        z = y * 3  # a traced value that only the branches read
        return plait.cond(x.mean() > 0, lambda x: x + z, lambda x: x - z.exp(), [x])

    x, y = torch.randn(4, generator=_gen(4)), torch.randn(4, generator=_gen(5))
    for sign in (1, -1):
        want = sign * x.abs() + y * 3 if sign > 0 else sign * x.abs() - (y * 3).exp()
        assert_close(plait.jit(f)(sign * x.abs(), y), want)
        assert_close(plait.grad(lambda y: f(sign * x.abs(), y).sum())(y),
                     torch.func.grad(lambda y: f(sign * x.abs(), y).sum())(y))


def test_torch_cond_inside_jit_is_plait_cond():
    def f(x):
        return torch.cond(x.sum() > 0, lambda x: x * 2, lambda x: x - 1, (x,))

    jitted = plait.jit(f)
    assert_close(jitted(torch.ones(3)), torch.full((3,), 2.0))
    assert_close(jitted(-torch.ones(3)), torch.full((3,), -2.0))
    assert jitted.trace_count == 1
    assert "cond[" in plait.make_graph(f)(torch.ones(3)).as_text()


def test_cond_prints_its_branches_nested():
    text = plait.make_graph(branchy)(torch.ones(5), torch.ones(5)).as_text()
    assert "true_branch: graph(" in text and "false_branch: graph(" in text
    assert "sin(" in text and "cos(" in text
    assert "# plait.cond" in text


def test_cond_refusals_name_the_problem():
    x = torch.randn(3)
    with pytest.raises(TraceError, match="one-element"):
        plait.jit(lambda x: plait.cond(x > 0, torch.sin, torch.cos, (x,)))(x)
    with pytest.raises(TraceError, match="the false branch returns"):
        plait.jit(lambda x: plait.cond(x.sum() > 0, torch.sin, lambda x: x[:2], (x,)))(x)
    with pytest.raises(TraceError, match="different structures"):
        plait.jit(lambda x: plait.cond(x.sum() > 0, lambda x: (x, x), lambda x: x, (x,)))(x)


def test_python_branch_error_points_to_cond():
    """Under a transform a branch on a value has no value to take (plait.jit takes it on its
    call's tensors: NOTE [value guards])."""
    with pytest.raises(ConcretizationError, match="plait.cond") as info:
        plait.grad(lambda x: (x * 2 if x.sum() > 0 else x).sum())(torch.randn(3))
    assert "plait.while_loop" in str(info.value)


# ---------------------------------------------------------------------------------------
# while_loop and fori_loop
# ---------------------------------------------------------------------------------------
def newton_sqrt(a):
    """Newton's iterations for sqrt(a), until converged (a data-dependent trip count)."""
    def cond(i, x):
        return ((x * x - a).abs().max() > 1e-5 * a.max()) & (i < 100)

    def body(i, x):
        return i + 1, 0.5 * (x + a / x)

    return plait.while_loop(cond, body, (torch.zeros((), dtype=torch.int64), torch.ones_like(a)))


def test_while_loop_runs_newton_to_convergence(backend):
    a = torch.rand(6, generator=_gen(6)) * 50 + 0.5
    steps, root = plait.jit(newton_sqrt)(a)
    assert_close(root, a.sqrt())
    eager_steps, eager_root = newton_sqrt(a)  # outside a trace: a Python loop
    assert steps.item() == eager_steps.item() > 3
    assert_close(root, eager_root)


def test_while_loop_forward_mode_and_reverse_mode_refusal():
    a = torch.rand(4, generator=_gen(7)) + 0.5
    tangent = torch.randn(4, generator=_gen(8))
    _, out = plait.jvp(lambda a: newton_sqrt(a)[1], (a,), (tangent,))
    assert_close(out, tangent * 0.5 / a.sqrt(), rtol=1e-4, atol=1e-5)
    with pytest.raises(UnsupportedOpError, match="fori_loop .* or plait.scan"):
        plait.grad(lambda a: newton_sqrt(a)[1].sum())(a)


def test_while_loop_under_vmap_runs_each_example_to_its_own_end(backend):
    a = torch.tensor([[0.5, 2.0], [400.0, 9e4], [1.0, 1.0]])
    steps, roots = plait.vmap(newton_sqrt)(a)
    assert_close(roots, a.sqrt(), rtol=1e-5, atol=1e-6)
    assert steps.tolist() == [newton_sqrt(x)[0].item() for x in a]
    assert len(set(steps.tolist())) == 3  # different trip counts, one loop


def test_torch_while_loop_inside_jit():
    import torch._higher_order_ops
    from torch._higher_order_ops.while_loop import while_loop  # bound before tracing

    def f(x, loop):
        return loop(lambda i, x: i < 5, lambda i, x: (i + 1, x * 2),
                    (torch.zeros((), dtype=torch.int64), x))

    i, x = plait.jit(lambda x: f(x, torch._higher_order_ops.while_loop))(torch.ones(3))
    assert i.item() == 5 and x.tolist() == [32.0] * 3
    with pytest.raises(UnsupportedOpError, match="plait.while_loop"):
        plait.jit(lambda x: f(x, while_loop))(torch.ones(3))


def power_iteration(m):
    v = torch.ones(m.shape[0], dtype=m.dtype) / m.shape[0] ** 0.5
    v = plait.fori_loop(0, 60, lambda i, v: (m @ v) / (m @ v).norm(), v)
    return v @ m @ v


def power_iteration_ref(m):
    v = torch.ones(m.shape[0], dtype=m.dtype) / m.shape[0] ** 0.5
    for _ in range(60):
        v = (m @ v) / (m @ v).norm()
    return v @ m @ v


def test_fori_loop_power_iteration_and_its_gradient(backend):
    a = torch.randn(6, 6, dtype=torch.float64, generator=_gen(9))
    m = a @ a.T
    assert_close(plait.jit(power_iteration)(m), torch.linalg.eigvalsh(m)[-1])
    assert_close(plait.jit(plait.grad(power_iteration))(m),
                 torch.func.grad(power_iteration_ref)(m))


def test_fori_loop_with_traced_bounds_is_a_while_loop():
    def f(x, n):
        return plait.fori_loop(0, n, lambda i, x: x + i, x)

    jitted = plait.jit(f)
    assert_close(jitted(torch.zeros(2), torch.tensor(5)), torch.full((2,), 10.0))
    assert_close(jitted(torch.zeros(2), torch.tensor(3)), torch.full((2,), 3.0))
    assert jitted.trace_count == 1


# ---------------------------------------------------------------------------------------
# scan
# ---------------------------------------------------------------------------------------
def rnn(w, u, xs, h0):
    def cell(h, x):
        h = torch.tanh(h @ w + x @ u)
        return h, h.square().sum(-1)

    h, ys = plait.scan(cell, h0, xs)
    return h.sum() + ys.mean()


def rnn_ref(w, u, xs, h0):
    h, ys = h0, []
    for x in xs:
        h = torch.tanh(h @ w + x @ u)
        ys.append(h.square().sum(-1))
    return h.sum() + torch.stack(ys).mean()


def rnn_args(steps=200, batch=3):
    g = _gen(10)
    return (torch.randn(8, 8, generator=g) * 0.3, torch.randn(4, 8, generator=g),
            torch.randn(steps, batch, 4, generator=g), torch.randn(batch, 8, generator=g))


def test_scan_rnn_forward_and_weight_gradients(backend):
    args = rnn_args()
    assert_close(plait.jit(rnn)(*args), rnn_ref(*args))
    step = plait.jit(plait.grad(rnn, argnums=(0, 1, 3)))
    for got, want in zip(step(*args), torch.func.grad(rnn_ref, argnums=(0, 1, 3))(*args)):
        assert_close(got, want)


def test_scan_graph_stays_small_for_200_steps():
    args = rnn_args()
    forward = plait.make_graph(rnn)(*args)
    step = plait.make_graph(plait.grad(rnn, argnums=(0, 1)))(*args)
    assert sum(forward.node(n).prim == "scan" for n in forward.order) == 1
    assert len(forward) < 20 and len(step) < 60
    assert len(plait.make_graph(rnn)(*rnn_args(steps=10))) == len(forward)


def test_a_scans_unread_per_step_outputs_leave_it():
    """The reverse scan of an RNN's weight gradients computes no cotangent of the inputs (no
    per-step output, one matmul less a step), and the forward runs once."""
    args = rnn_args(steps=10)
    graph = plait.jit(plait.grad(rnn, argnums=(0, 1))).lower(*args).graph
    scans = [graph.node(n) for n in graph.order if graph.node(n).prim == "scan"]
    assert len(scans) == 2
    forward, reverse = sorted(scans, key=lambda node: node.kwargs["reverse"])
    assert len(reverse.out_types) == reverse.kwargs["n_carry"]  # no per-step outputs left
    dots = [sum(b.node(n).prim == "dot_general" for n in b.order)
            for b in (forward.kwargs["body"], reverse.kwargs["body"])]
    assert dots == [2, 5]  # h @ w, x @ u; again, and the cotangents of h, w and u


def test_scan_under_vmap_over_sequences(backend):
    w, u, xs, h0 = rnn_args(steps=30)
    sequences = torch.randn(5, 30, 3, 4, generator=_gen(11))
    batched = plait.vmap(rnn, in_dims=(None, None, 0, None))
    want = torch.stack([rnn_ref(w, u, s, h0) for s in sequences])
    assert_close(batched(w, u, sequences, h0), want)
    assert_close(plait.jit(batched)(w, u, sequences, h0), want)
    # per-sequence gradients of the weights
    per_example = plait.vmap(plait.grad(rnn), in_dims=(None, None, 0, None))(w, u, sequences, h0)
    assert_close(per_example, torch.stack([torch.func.grad(rnn_ref)(w, u, s, h0)
                                           for s in sequences]))


def test_scan_jvp_matches_torch_func():
    args = rnn_args(steps=20)
    tangents = tuple(torch.randn(a.shape, generator=_gen(12 + i)) for i, a in enumerate(args))
    assert_close(plait.jvp(rnn, args, tangents)[1], torch.func.jvp(rnn_ref, args, tangents)[1])


def test_scan_pytrees_reverse_and_length():
    def f(init, xs):
        def step(carry, x):
            a, b = carry["a"], carry["b"]
            return {"a": a + x[0], "b": b * x[1]}, (a * b, None)

        return plait.scan(step, init, xs, reverse=True)

    init = {"a": torch.zeros(2), "b": torch.ones(2)}
    xs = (torch.randn(7, 2, generator=_gen(13)), torch.rand(7, 2, generator=_gen(14)) + 0.5)
    got, want = plait.jit(f)(init, xs), f(init, xs)  # traced, and a Python loop
    assert_close(got[0], want[0])
    assert_close(got[1][0], want[1][0])
    assert got[1][1] is None
    a, b = torch.zeros(2), torch.ones(2)
    for i in reversed(range(7)):
        a, b = a + xs[0][i], b * xs[1][i]
    assert_close(got[0]["a"], a) and assert_close(got[0]["b"], b)
    counted = plait.jit(lambda c: plait.scan(lambda c, _: (c + 1, c), c, None, length=4))
    carry, ys = counted(torch.zeros(()))
    assert carry.item() == 4 and ys.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_torch_scan_inside_jit():
    import torch._higher_order_ops

    def f(xs):
        return torch._higher_order_ops.scan(lambda c, x: (c + x, (c + x).clone()), torch.zeros(3), xs, dim=1)

    xs = torch.randn(3, 5, generator=_gen(15))
    carry, ys = plait.jit(f)(xs)
    assert_close(carry, xs.sum(1))
    assert_close(ys, xs.cumsum(1))


def test_scan_refusals_name_the_problem():
    xs = torch.randn(4, 2)
    with pytest.raises(TraceError, match="carry of"):
        plait.jit(lambda xs: plait.scan(lambda c, x: (c.double(), x), torch.zeros(2), xs))(xs)
    with pytest.raises(TraceError, match="pair"):
        plait.jit(lambda xs: plait.scan(lambda c, x: c + x, torch.zeros(2), xs))(xs)
    with pytest.raises(TraceError, match="one\nlength|one length"):
        plait.scan(lambda c, x: (c, x), torch.zeros(2), (xs, torch.randn(3, 2)))


def test_torch_func_of_a_jitted_scan_runs_it_op_by_op():
    args = rnn_args(steps=12)
    assert_close(torch.func.grad(plait.jit(rnn))(*args), torch.func.grad(rnn_ref)(*args))


def test_jitted_scan_under_torch_autograd(backend):
    w, u, xs, h0 = rnn_args(steps=15)
    w = w.clone().requires_grad_()
    plait.jit(rnn)(w, u, xs, h0).backward()
    assert_close(w.grad, torch.func.grad(rnn_ref)(w.detach(), u, xs, h0))


def test_control_flow_on_the_triton_backend():
    plait.config.backend = "triton"  # Triton's interpreter on the CPU
    w = torch.randn(5, generator=_gen(1))
    for x in (torch.rand(5) + 0.1, -torch.rand(5) - 0.1):
        assert_close(plait.jit(branchy)(x, w), branchy_ref(x, w))
    args = rnn_args(steps=6, batch=2)
    for got, want in zip(plait.jit(plait.grad(rnn, argnums=(0, 1)))(*args),
                         torch.func.grad(rnn_ref, argnums=(0, 1))(*args)):
        assert_close(got, want)


# ---------------------------------------------------------------------------------------
# checkpoint
# ---------------------------------------------------------------------------------------
def block(h, w):
    return h + torch.tanh(h @ w) * torch.sigmoid(h)


def mlp_loss(ws, x, wrap=lambda f: f):
    h = x
    for w in ws:
        h = wrap(block)(h, w)
    return h.square().mean()


def mlp_args(blocks=16):
    g = _gen(16)
    return [torch.randn(64, 64, generator=g) / 8 for _ in range(blocks)], \
        torch.randn(256, 64, generator=g)


@pytest.mark.parametrize("policy", [None, plait.checkpoint_policies.dots_saveable])
def test_checkpoint_grads_equal_and_peak_memory_lower(policy):
    plait.config.backend = "cpp"  # a backend that plans memory
    ws, x = mlp_args()
    plain = plait.jit(plait.grad(mlp_loss))
    remat = plait.jit(plait.grad(lambda ws, x: mlp_loss(
        ws, x, lambda f: plait.checkpoint(f, policy=policy))))
    want = torch.func.grad(mlp_loss)(ws, x)
    for got, ref in zip(remat(ws, x), want):
        assert_close(got, ref)
    peak = {name: f.lower(ws, x).stats["peak_bytes"] for name, f in (("plain", plain),
                                                                      ("remat", remat))}
    if policy is None:
        assert peak["remat"] < 0.8 * peak["plain"], peak
    else:  # saving the products costs memory, never more than no checkpoint
        assert peak["remat"] <= peak["plain"], peak


def test_torch_utils_checkpoint_traces_into_plait_checkpoint():
    ws, x = mlp_args(blocks=3)

    def loss(ws, x):
        return mlp_loss(ws, x, lambda f: lambda *a: torch.utils.checkpoint.checkpoint(
            f, *a, use_reentrant=False))

    graph = plait.make_graph(loss)(ws, x)
    assert sum(graph.node(n).prim == "checkpoint" for n in graph.order) == 3
    for got, want in zip(plait.jit(plait.grad(loss))(ws, x), torch.func.grad(mlp_loss)(ws, x)):
        assert_close(got, want)
    # outside a trace it is torch's checkpoint, under torch.autograd
    w = ws[0].clone().requires_grad_()
    plait.checkpoint(block)(x, w).sum().backward()
    assert_close(w.grad, torch.func.grad(lambda w: block(x, w).sum())(ws[0]))


def test_checkpointed_dropout_backward_sees_the_forward_mask():
    x = torch.randn(64, 32, generator=_gen(17))

    def f(w):
        return plait.checkpoint(lambda w: torch.nn.functional.dropout(x * w, 0.5))(w)

    w = torch.rand(32, generator=_gen(18)) + 0.5
    y, vjp_fn = plait.vjp(f, w)
    (grad,) = vjp_fn(torch.ones_like(y))
    kept = (y != 0).float()
    assert 0.3 < kept.mean() < 0.7
    assert_close(grad, (kept * x * 2).sum(0))


def test_checkpoint_jvp_vmap_and_jit_under_autograd(backend):
    ws, x = mlp_args(blocks=2)
    ckpt = lambda ws, x: mlp_loss(ws, x, plait.checkpoint)  # noqa: E731
    tangents = [torch.randn(w.shape, generator=_gen(19)) for w in ws]
    assert_close(plait.jvp(ckpt, (ws, x), (tangents, torch.zeros_like(x)))[1],
                 torch.func.jvp(mlp_loss, (ws, x), (tangents, torch.zeros_like(x)))[1])
    xs = torch.randn(3, 256, 64, generator=_gen(20))
    assert_close(plait.vmap(ckpt, in_dims=(None, 0))(ws, xs),
                 torch.stack([mlp_loss(ws, b) for b in xs]))
    params = [w.clone().requires_grad_() for w in ws]
    plait.jit(ckpt)(params, x).backward()
    for p, want in zip(params, torch.func.grad(mlp_loss)(ws, x)):
        assert_close(p.grad, want)


# ---------------------------------------------------------------------------------------
# composition
# ---------------------------------------------------------------------------------------
def gated(w, xs):
    """A scan whose step branches on its input, and a scan nested in a scan."""
    def cell(h, x):
        h = plait.cond(x.sum() > 0, lambda h: torch.tanh(h @ w + x),
                       lambda h: torch.sin(h @ w) - x, (h,))
        return h, h.sum()

    def outer(c, x):
        inner, _ = plait.scan(lambda a, y: (a * w[0] + y, None), c, x.reshape(2, 2).repeat(1, 2))
        return inner, inner.sum()

    _, ys = plait.scan(cell, torch.zeros(4, dtype=w.dtype), xs)
    return ys.square().sum() + plait.scan(outer, torch.ones(4, dtype=w.dtype), xs)[1].sum()


def gated_ref(w, xs):
    h, c, total = torch.zeros(4, dtype=w.dtype), torch.ones(4, dtype=w.dtype), 0
    for x in xs:
        h = torch.tanh(h @ w + x) if x.sum() > 0 else torch.sin(h @ w) - x
        for y in x.reshape(2, 2).repeat(1, 2):
            c = c * w[0] + y
        total = total + h.sum() ** 2 + c.sum()
    return total


def test_nested_control_flow_and_second_derivatives():
    w = torch.randn(4, 4, dtype=torch.float64, generator=_gen(21)) * 0.3
    xs = torch.randn(6, 4, dtype=torch.float64, generator=_gen(22))
    assert_close(plait.jit(gated)(w, xs), gated_ref(w, xs))
    assert_close(plait.hessian(gated)(w, xs), torch.func.hessian(gated_ref)(w, xs))
    assert_close(plait.grad(lambda w: plait.grad(gated)(w, xs).sum())(w),
                 torch.func.grad(lambda w: torch.func.grad(gated_ref)(w, xs).sum())(w))


def test_a_scan_and_its_gradient_share_one_forward_pass():
    args = rnn_args(steps=20)
    graph = plait.jit(plait.grad_and_value(rnn)).lower(*args).graph
    scans = [graph.node(n) for n in graph.order if graph.node(n).prim == "scan"]
    assert [s.kwargs["reverse"] for s in scans] == [False, True]


def test_differentiating_a_scan_whose_body_draws_is_refused():
    """The scan's backward runs its body again, which would draw another mask: refused by
    name, where the forward alone runs."""
    def f(x):
        return plait.scan(lambda c, x: (c + F.dropout(x, 0.5), c), x[0] * 0, x)[0].sum()

    x = torch.randn(4, 8)
    assert torch.isfinite(plait.jit(f)(x))
    with pytest.raises(plait.errors.UnsupportedOpError, match="draws random numbers"):
        plait.grad(f)(x)


def test_differentiating_a_cond_whose_branch_draws_is_refused():
    def f(x):
        return plait.cond(x.sum() > 0, lambda x: F.dropout(x, 0.5), lambda x: x * 2, (x,)).sum()

    x = torch.randn(4, 8)
    assert torch.isfinite(plait.jit(f)(x))
    with pytest.raises(plait.errors.UnsupportedOpError, match="draws random numbers"):
        plait.grad(f)(x)


def test_the_stages_of_a_native_body_are_recorded_in_its_callers():
    """NOTE [pipeline]: the cpp wrapper compiles a cond's branches as programs of their own;
    each branch's stages (simplification to the native build) are among its caller's."""
    def f(x):  # branches no other test compiles (bodies are compiled once per process)
        return plait.cond(x.sum() > 0, lambda x: x.sin() * 2.75, lambda x: x.cos() - 0.375,
                          (x,))

    lowered = plait.jit(f, backend="cpp").lower(torch.randn(7))
    assert_close(lowered.compiled([torch.ones(7)])[0], torch.ones(7).sin() * 2.75)
    bodies = {name.split(".")[0] for name in lowered.timings if name.startswith("body ")}
    assert len(bodies) == 2
    for body in bodies:
        assert {f"{body}.lower", f"{body}.plan", f"{body}.native"} <= set(lowered.timings)
        assert "kernel" in lowered.stages[f"{body}.fuse"].as_text()
