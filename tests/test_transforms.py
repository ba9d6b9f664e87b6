"""plait.grad / grad_and_value / vjp against torch.func and torch.autograd."""
import pytest
import torch
from torch.testing import assert_close

import plait
from plait.errors import TraceError, UnsupportedOpError


def _mlp_loss(params, x, y):
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return torch.nn.functional.mse_loss(h @ params["w2"], y)


@pytest.fixture
def mlp():
    params = {"w1": torch.randn(4, 8), "b1": torch.randn(8), "w2": torch.randn(8, 2)}
    return params, torch.randn(16, 4), torch.randn(16, 2)


def test_grad_of_pytree_argument_matches_torch_func(mlp):
    torch.testing.assert_close(plait.grad(_mlp_loss)(*mlp), torch.func.grad(_mlp_loss)(*mlp))


@pytest.mark.parametrize("argnums", [0, 1, (0, 1), (1, 0), -1])
def test_argnums_forms(argnums):
    f = lambda a, b: (torch.sin(a) * b).sum()  # noqa: E731
    a, b = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(plait.grad(f, argnums)(a, b), torch.func.grad(f, argnums)(a, b))


def test_has_aux_and_grad_and_value(mlp):
    def f(params, x, y):
        loss = _mlp_loss(params, x, y)
        return loss, {"loss": loss.detach() * 2}

    for plait_fn, torch_fn in ((plait.grad, torch.func.grad),
                               (plait.grad_and_value, torch.func.grad_and_value)):
        torch.testing.assert_close(plait_fn(f, has_aux=True)(*mlp),
                                   torch_fn(f, has_aux=True)(*mlp))


def test_detach_stops_the_gradient():
    f = lambda x: (x * x.detach()).sum()  # noqa: E731
    x = torch.randn(5)
    torch.testing.assert_close(plait.grad(f)(x), x)


def test_compositions():
    f = lambda x: torch.sin(x).pow(3).sum()  # noqa: E731
    x = torch.randn(4)
    expected = torch.func.grad(lambda y: torch.func.grad(f)(y).sum())(x)
    torch.testing.assert_close(plait.grad(lambda y: plait.grad(f)(y).sum())(x), expected)
    torch.testing.assert_close(plait.jit(plait.grad(f))(x), torch.func.grad(f)(x))
    graph = plait.make_graph(plait.grad(f))(x)
    assert {graph.node(n).prim for n in graph.nx.nodes} >= {"sin", "cos", "mul"}


def test_closure_over_an_outer_tracer():
    x = torch.randn(3)

    def outer(w):
        return plait.grad(lambda v: (v * torch.sin(w)).sum())(x) * w

    torch.testing.assert_close(plait.jit(outer)(x), torch.sin(x) * x)
    torch.testing.assert_close(plait.grad(lambda w: outer(w).sum())(x),
                               torch.func.grad(lambda w: (torch.sin(w) * w).sum())(x))


def test_vjp_matches_torch_func():
    x = torch.randn(3, 4)
    out, fn = plait.vjp(lambda a: (torch.exp(a), a.sum(0)), x)
    eout, efn = torch.func.vjp(lambda a: (torch.exp(a), a.sum(0)), x)
    cts = (torch.randn(3, 4), torch.randn(4))
    torch.testing.assert_close(out, eout)
    torch.testing.assert_close(fn(cts), efn(cts))


def test_errors():
    x = torch.randn(3)
    with pytest.raises(TraceError, match="scalar"):
        plait.grad(lambda a: a * 2)(x)
    with pytest.raises(TraceError, match="argnums"):
        plait.grad(lambda a: a.sum(), argnums=3)(x)
    with pytest.raises(TraceError, match="floating-point"):
        plait.grad(lambda a, n: a.sum() * n, argnums=1)(x, torch.tensor(2))
    with pytest.raises(TraceError, match="pair"):
        plait.grad(lambda a: a.sum(), has_aux=True)(x)
    with pytest.raises(UnsupportedOpError, match="logcumsumexp has no derivative rule for co"):
        plait.grad(lambda a: torch.logcumsumexp(torch.fft.fft(a), 0).abs().sum())(x)
    _, fn = plait.vjp(torch.sin, x)
    with pytest.raises(TraceError, match="shape"):
        fn(torch.randn(4))


# ---------------------------------------------------------------------------------------
# vmap and jvp
# ---------------------------------------------------------------------------------------
def test_vmap_in_dims_out_dims_and_none():
    x, w = torch.randn(5, 3), torch.randn(3, 2)
    f = lambda x, w: torch.tanh(x @ w)  # noqa: E731
    torch.testing.assert_close(plait.vmap(f, (0, None))(x, w), torch.func.vmap(f, (0, None))(x, w))
    torch.testing.assert_close(plait.vmap(f, (1, None), out_dims=1)(x.t(), w),
                               torch.func.vmap(f, (1, None), out_dims=1)(x.t(), w))


def test_vmap_nested_in_dims_pytree():
    params = {"a": torch.randn(4, 3), "b": torch.randn(3)}
    f = lambda p, x: (p["a"] * x + p["b"]).sum()  # noqa: E731
    in_dims = ({"a": 0, "b": None}, None)
    x = torch.randn(())
    torch.testing.assert_close(plait.vmap(f, in_dims)(params, x),
                               torch.func.vmap(f, in_dims)(params, x))


def test_per_example_gradients(mlp):
    params, x, y = mlp
    per_example = lambda p, xi, yi: _mlp_loss(p, xi[None], yi[None])  # noqa: E731
    torch.testing.assert_close(
        plait.vmap(plait.grad(per_example), (None, 0, 0))(params, x, y),
        torch.func.vmap(torch.func.grad(per_example), (None, 0, 0))(params, x, y))


def test_vmap_of_unvectorized_primitive_loops():
    x = torch.randn(4, 3, 3)
    x = x @ x.mT + 3 * torch.eye(3)
    torch.testing.assert_close(plait.vmap(torch.linalg.cholesky)(x), torch.linalg.cholesky(x))


def test_softmax_derivatives_by_its_rule_batched_and_of_second_order():
    """Softmax's result carries its own VJP (``SoftmaxRule``): per-example gradients stay
    one vectorized softmax (the rule batches), and its Hessian and JVP are eager's."""
    w = torch.randn(5, 7)

    def f(x):
        return (torch.softmax(x, -1) * w).sum()

    x, xs, t = torch.randn(5, 7), torch.randn(3, 5, 7), torch.randn(5, 7)
    per_example = plait.jit(plait.vmap(plait.grad(f)))
    assert_close(per_example(xs), torch.func.vmap(torch.func.grad(f))(xs))
    graph = per_example.lower(xs).graph
    assert [graph.node(n).prim for n in graph.order].count("exp") == 1  # not a loop
    assert_close(plait.hessian(f)(x), torch.func.hessian(f)(x), atol=1e-5, rtol=1e-4)
    assert_close(plait.jvp(f, (x,), (t,))[1], torch.func.jvp(f, (x,), (t,))[1])

    def half(x):
        return torch.softmax(x.to(torch.bfloat16), 0).float().square().sum()
    assert_close(plait.grad(half)(x), torch.func.grad(half)(x), atol=1e-2, rtol=1e-2)


def test_vmap_randomness():
    with pytest.raises(UnsupportedOpError, match="randomness"):
        plait.vmap(lambda x: x + torch.rand(3))(torch.zeros(2, 3))
    same = plait.vmap(lambda x: x + torch.rand(3), randomness="same")(torch.zeros(2, 3))
    torch.testing.assert_close(same[0], same[1])
    different = plait.vmap(lambda x: x + torch.rand(3), randomness="different")(
        torch.zeros(2, 3))
    assert not torch.equal(different[0], different[1])


def test_vmap_errors():
    with pytest.raises(TraceError, match="different sizes"):
        plait.vmap(torch.add)(torch.randn(2), torch.randn(3))
    with pytest.raises(TraceError, match="out of range"):
        plait.vmap(torch.sin, in_dims=2)(torch.randn(2))
    with pytest.raises(TraceError, match="randomness"):
        plait.vmap(torch.sin, randomness="sometimes")


def test_jvp_and_hessian_vector_product():
    x, t = torch.randn(4), torch.randn(4)
    f = lambda x: (torch.sin(x) * x).sum()  # noqa: E731
    torch.testing.assert_close(plait.jvp(torch.exp, (x,), (t,)),
                               torch.func.jvp(torch.exp, (x,), (t,)))
    torch.testing.assert_close(plait.jvp(plait.grad(f), (x,), (t,)),
                               torch.func.jvp(torch.func.grad(f), (x,), (t,)))


# ---------------------------------------------------------------------------------------
# Jacobians and Hessians
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
def test_jacobians_match_torch_func(argnums):
    x, w = torch.randn(3), torch.randn(3, 2)
    f = lambda x, w: torch.tanh(x @ w)  # noqa: E731
    for plait_fn, torch_fn in ((plait.jacrev, torch.func.jacrev),
                               (plait.jacfwd, torch.func.jacfwd)):
        torch.testing.assert_close(plait_fn(f, argnums)(x, w), torch_fn(f, argnums)(x, w))


def test_jacobian_of_pytree_output_and_hessian():
    x = torch.randn(3)
    h = lambda x: {"a": x.sin(), "b": (x * 2).sum()}  # noqa: E731
    torch.testing.assert_close(plait.jacrev(h)(x), torch.func.jacrev(h)(x))
    torch.testing.assert_close(plait.jacfwd(h)(x), torch.func.jacfwd(h)(x))
    g = lambda x: (torch.sin(x) * x).sum()  # noqa: E731
    torch.testing.assert_close(plait.hessian(g)(x), torch.func.hessian(g)(x))


def test_jit_vmap_jacrev():
    xs = torch.randn(4, 3)
    f = lambda v: v.sin() * v  # noqa: E731
    torch.testing.assert_close(plait.jit(plait.vmap(plait.jacrev(f)))(xs),
                               torch.func.vmap(torch.func.jacrev(f))(xs))


def test_backward_graph_has_no_duplicated_forward_work():
    x, ct = torch.randn(4, 3), torch.randn(4, 3)

    def f(x):
        out, vjp_fn = plait.vjp(lambda a: torch.tanh(torch.exp(a)), x)  # forward traced twice
        return out, vjp_fn(ct)

    graph = plait.make_graph(f)(x)
    prims = [graph.node(n).prim for n in graph.nx.nodes]
    assert prims.count("exp") == 1 and prims.count("tanh") == 1
    out, (grad,) = plait.jit(f)(x)
    torch.testing.assert_close(grad, torch.func.vjp(lambda a: torch.tanh(torch.exp(a)), x)[1](
        ct)[0])


@pytest.mark.parametrize("reduce", ["sum", "mean", "prod", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_gradients_match_autograd(reduce, include_self):
    x, src = torch.randn(5, 3), torch.randn(6, 3)
    x[1, 0], src[2, 1] = 0.0, 0.0  # products with zeros take the exact path
    index, ct = torch.randint(0, 5, (6, 3)), torch.randn(5, 3)

    def f(a, b):
        return (a.scatter_reduce(0, index, b, reduce, include_self=include_self) * ct).sum()

    leaves = [x.clone().requires_grad_(), src.clone().requires_grad_()]
    expected = torch.autograd.grad(f(*leaves), leaves)
    torch.testing.assert_close(plait.grad(f, argnums=(0, 1))(x, src), expected)


def test_one_shot_transforms_reuse_their_compilation(monkeypatch):
    """NOTE [how a transform runs]: jvp, vjp and vmap called again on the same function trace
    it once, as grad(f) does; a new function (here a lambda made per call) traces anew."""
    from plait import api, transforms

    monkeypatch.setattr(transforms, "_BUILTIN_BODIES", {})  # torch.sin's, from other tests
    lowered = []
    original = api.Jitted._lower
    monkeypatch.setattr(api.Jitted, "_lower", lambda self, *a, **k: lowered.append(1) or
                        original(self, *a, **k))
    x = torch.randn(5)

    def f(x):
        return (x.sin() * 2).sum()

    for run, traces in [(lambda: plait.vmap(torch.sin)(torch.randn(3, 4)), 1),
                        (lambda: plait.jvp(f, (x,), (x,)), 1),
                        (lambda: plait.vjp(f, x)[1](torch.tensor(1.0)), 1),  # one program pair
                        (lambda: plait.jvp(lambda x: x.exp(), (x,), (x,)), 3)]:
        lowered.clear()
        for _ in range(3):
            run()
        assert len(lowered) == traces
    torch.testing.assert_close(plait.jvp(f, (x,), (x,))[1], torch.func.jvp(f, (x,), (x,))[1])


def test_a_wrapper_does_not_take_the_wrapped_functions_compilation():
    """functools.wraps copies a function's attributes, its cached compilations included: a
    wrapper (grad's own, or a user's decorator) must compile its own."""
    import functools

    def loss(x):
        return (x.sin() ** 2).sum()

    def twice(g):
        @functools.wraps(g)
        def h(x):
            return 2 * g(x)
        return h

    xs, x, t = torch.randn(4, 3), torch.randn(3), torch.randn(3)
    plait.vmap(loss)(xs)
    torch.testing.assert_close(plait.vmap(plait.grad(loss))(xs),
                               torch.func.vmap(torch.func.grad(loss))(xs))
    plait.jvp(loss, (x,), (t,))
    torch.testing.assert_close(plait.jvp(twice(loss), (x,), (t,))[1],
                               torch.func.jvp(twice(loss), (x,), (t,))[1])


def test_a_bound_builtin_method_is_not_kept_alive():
    import gc
    import weakref

    a, x, t = torch.randn(3), torch.randn(3), torch.randn(3)
    torch.testing.assert_close(plait.jvp(a.mul, (x,), (t,))[1], a * t)
    alive = weakref.ref(a)
    del a
    gc.collect()
    assert alive() is None


def test_transforms_write_nothing_into_the_users_objects():
    """A module (any callable that is not a Python function) keeps no cached compilation:
    it still pickles after a transform ran on it, and it gets eager's gradients."""
    import pickle

    model, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
    out, pullback = plait.vjp(model, x)
    (grad,) = pullback(torch.ones_like(out))
    torch.testing.assert_close(grad, torch.ones(4, 2) @ model.weight)
    assert "_plait_staged" not in vars(model)
    pickle.loads(pickle.dumps(model))


@pytest.mark.parametrize("name", ["jacrev", "jacfwd", "hessian"])
def test_jacobians_of_a_function_of_a_0_dim_tensor(name):
    x = torch.tensor(1.5, dtype=torch.float64)
    got = getattr(plait, name)(lambda x: x.sin() * x)(x)
    want = getattr(torch.func, name)(lambda x: x.sin() * x)(x)
    assert got.shape == want.shape == ()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("argnums,says", [(1.0, "must be int or Tuple"), ((), "must be non-empty"),
                                          ((0, 0), "must be unique"), ((1, -1), "must be unique"),
                                          (2, "argnum=2, but only 2 positional")])
@pytest.mark.parametrize("transform", ["grad", "jacrev", "jacfwd"])
def test_bad_argnums_are_refused_as_torch_func_refuses_them(transform, argnums, says):
    x = torch.randn(3)
    with pytest.raises(RuntimeError):  # torch.func refuses each too
        getattr(torch.func, transform)(lambda x, y: (x * y).sum(), argnums=argnums)(x, x)
    with pytest.raises(plait.PlaitError, match=says):
        getattr(plait, transform)(lambda x, y: (x * y).sum(), argnums=argnums)(x, x)


@pytest.mark.parametrize("call", [
    lambda f, x: plait.vjp(f, x), lambda f, x: plait.vmap(f)(x),
    lambda f, x: plait.jacrev(f)(x), lambda f, x: plait.jvp(f, (x,), (x,)),
    lambda f, x: plait.jit(plait.vmap(f))(x)], ids=["vjp", "vmap", "jacrev", "jvp", "jit_vmap"])
def test_a_non_tensor_result_is_refused_by_the_transforms(call):
    """torch.func takes functions returning tensors only; so does plait (jit returns them)."""
    def f(x):
        return x.sin(), None

    with pytest.raises(plait.PlaitError, match="only tensors"):
        call(f, torch.randn(3))
    out = plait.jit(f)(torch.randn(3))
    assert out[1] is None


@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_vmap_with_different_randomness_draws_once_per_example(backend):
    """The meta kernel that types a random draw ran under the enclosing trace, which recorded
    it as a draw of its own on the meta device: the cpp backend then read a meta tensor's
    (absent) data and the process died."""
    f = plait.jit(plait.vmap(lambda x: x + torch.rand(3), randomness="different"),
                  backend=backend)
    graph = f.lower(torch.zeros(4, 3)).graph
    draws = [graph.node(n) for n in graph.order if graph.node(n).prim == "opaque"]
    assert len(draws) == 4 and all("meta" not in str(d.params) for d in draws)
    out = f(torch.zeros(4, 3))
    assert ((out >= 0) & (out < 1)).all() and len({tuple(r.tolist()) for r in out}) == 4


def _no_grad(x):
    with torch.no_grad():
        y = x.sin()
    return (y * x).sum()


def _grad_disabled(x):
    with torch.set_grad_enabled(False):
        y = x.exp() * 2
    return (y * x + x.cos()).sum()


def _no_grad_then_enabled(x):
    with torch.no_grad():
        y = x.sin()
        with torch.enable_grad():
            z = y * x
    return (z + y).sum()


@pytest.mark.parametrize("f", [_no_grad, _grad_disabled, _no_grad_then_enabled])
@pytest.mark.parametrize("jit", [False, True])
def test_grad_mode_off_inside_a_differentiated_function(f, jit):
    """NOTE [grad mode while tracing]: torch.func's grad treats what was computed with grad
    mode off as a constant (it was differentiated through before); its jvp does not."""
    x = torch.randn(5, dtype=torch.float64)
    grad = plait.jit(plait.grad(f)) if jit else plait.grad(f)
    torch.testing.assert_close(grad(x), torch.func.grad(f)(x))
    t = torch.randn(5, dtype=torch.float64)
    for got, want in zip(plait.jvp(f, (x,), (t,)), torch.func.jvp(f, (x,), (t,))):
        torch.testing.assert_close(got, want)


def test_grad_under_an_outer_no_grad_still_differentiates():
    x = torch.randn(4, dtype=torch.float64)
    f = lambda x: (x.sin() * x).sum()  # noqa: E731
    with torch.no_grad():
        torch.testing.assert_close(plait.grad(f)(x), torch.func.grad(f)(x))
        torch.testing.assert_close(plait.jit(plait.grad(f))(x), torch.func.grad(f)(x))


# ---------------------------------------------------------------------------------------
# Captured state is live under the transforms too (NOTE [live state])
# ---------------------------------------------------------------------------------------
def test_held_transforms_read_captured_state_at_each_call():
    w = torch.randn(3)

    def f(x):
        return (x * w).sin().sum()

    x = torch.randn(3)
    g, h = plait.grad(f), plait.jacrev(plait.grad(f))
    g(x), h(x)
    w.add_(1.0)
    assert_close(g(x), torch.func.grad(f)(x))
    assert_close(h(x), torch.func.jacrev(torch.func.grad(f))(x))
    xs = torch.randn(4, 3)
    assert_close(plait.vmap(lambda x: x * w)(xs), torch.func.vmap(lambda x: x * w)(xs))
    t = torch.ones(3)
    assert_close(plait.jvp(f, (x,), (t,)), torch.func.jvp(f, (x,), (t,)))


def test_a_held_vmap_of_jacrev_of_a_module_follows_its_parameters():
    model = torch.nn.Linear(3, 2)
    jac = plait.vmap(plait.jacrev(model))
    xs = torch.randn(4, 3)
    with torch.no_grad():
        jac(xs)
        model.weight.mul_(2.0)
        assert_close(jac(xs), torch.func.vmap(torch.func.jacrev(model))(xs))


def test_vjp_fn_answers_for_the_values_at_vjp_time():
    """vjp_fn runs the compiled backward on what the forward saved: a captured variable
    rebound between vjp() and vjp_fn() does not change its answer (torch.func's neither)."""
    w = torch.randn(3)

    def f(x):
        return (x * w).sin()

    x, ct = torch.randn(3), torch.randn(3)
    (out, fn), (want_out, want_fn) = plait.vjp(f, x), torch.func.vjp(f, x)
    w = w + 1.0  # noqa: F841  (rebinds the cell f reads)
    assert_close(out, want_out)
    for _ in range(2):
        assert_close(fn(ct), want_fn(ct))
    # under a transform too: the graph of the vjp's call, at the tensors it read then
    cts = torch.randn(4, 3)
    assert_close(plait.vmap(fn)(cts), torch.func.vmap(want_fn)(cts))
    (got, got_fn), (want, want_fn2) = plait.vjp(fn, ct), torch.func.vjp(want_fn, ct)
    assert_close(got, want)
    assert_close(got_fn((ct,)), want_fn2((ct,)))
    assert_close(plait.grad(lambda c: fn(c)[0].pow(2).sum())(ct),
                 torch.func.grad(lambda c: want_fn(c)[0].pow(2).sum())(ct))


def test_vjp_fn_under_a_transform_is_refused_once_its_tensors_are_written():
    """torch.func's vjp_fn raises once a tensor saved for it is written in place (autograd's
    version check); plait's, under a transform, refuses then too, rather than differentiate
    at the new values."""
    x, cts = torch.randn(3), torch.randn(4, 3)
    _, fn = plait.vjp(torch.sin, x)
    batched = plait.vmap(fn)
    assert_close(batched(cts)[0], x.cos() * cts)
    x.add_(1.0)
    with pytest.raises(TraceError, match="written in place"):
        batched(cts)


def test_provenance_survives_the_transforms():
    """Each node of a differentiated graph names the user's op and line it derives from."""
    def f(x):
        y = torch.sin(x)
        return (y * y).sum()

    for transform in (plait.grad, plait.jacrev, lambda f: plait.vmap(plait.grad(f))):
        graph = plait.make_graph(transform(f))(torch.randn(3))
        nodes = [graph.node(n) for n in graph.order if graph.node(n).prim != "input"]
        assert nodes and all(n.provenance.source and n.provenance.source.startswith(
            "test_transforms.py:") for n in nodes), graph.as_text()


def test_forward_ad_turned_off_inside_jvp_stops_tangents_only():
    """As torch.func: what is computed with forward-mode AD off carries no tangent in jvp,
    and reverse mode differentiates through it."""
    import torch.autograd.forward_ad as fwAD

    def f(x):
        with fwAD._set_fwd_grad_enabled(False):
            y = x.sin()
        return y * x

    x, t = torch.randn(3), torch.randn(3)
    assert_close(plait.jvp(f, (x,), (t,)), torch.func.jvp(f, (x,), (t,)))
    loss = lambda x: f(x).sum()  # noqa: E731
    assert_close(plait.grad(loss)(x), torch.func.grad(loss)(x))
    assert_close(plait.jacfwd(f)(x), torch.func.jacfwd(f)(x))


def test_forward_ad_dual_tensors_inside_a_transform_are_refused():
    """Tracers carry no forward-AD tangent: torch.autograd.functional.jacobian in forward
    mode returned zeros under plait.vmap (torch.func.vmap raises)."""
    def jac(x):
        return torch.autograd.functional.jacobian(lambda x: x.sin() * x, x,
                                                  strategy="forward-mode", vectorize=True)

    with pytest.raises(UnsupportedOpError, match="plait.jacfwd"):
        plait.vmap(jac)(torch.randn(2, 3))
    with pytest.raises(UnsupportedOpError, match="forward_ad"):
        plait.jit(jac)(torch.randn(3))


def test_torch_func_options_work_or_are_refused_as_torch_func_does():
    x, t = torch.randn(3), torch.randn(3)
    f = torch.sin
    assert_close(plait.jvp(f, (x,), (t,), strict=True), torch.func.jvp(f, (x,), (t,), strict=True))
    with pytest.raises(RuntimeError):
        torch.func.jvp(lambda x: torch.ones(2), (x,), (t,), strict=True)
    with pytest.raises(TraceError, match="independent"):
        plait.jvp(lambda x: torch.ones(2), (x,), (t,), strict=True)
    for transform in ("vmap", "jacrev"):
        with pytest.raises(ValueError):
            getattr(torch.func, transform)(f, chunk_size=0)(x)
        with pytest.raises(TraceError, match="chunk_size"):
            getattr(plait, transform)(f, chunk_size=0)(x)
    xs = torch.randn(5, 3)
    assert_close(plait.vmap(f, chunk_size=2)(xs), torch.func.vmap(f, chunk_size=2)(xs))
    out, fn = plait.vjp(f, x)
    assert_close(fn(t, retain_graph=True), torch.func.vjp(f, x)[1](t))
    assert_close(fn(t, True, True), torch.func.vjp(f, x)[1](t))  # nothing to record
    with pytest.raises(TraceError, match="create_graph"):
        fn(t.requires_grad_(), create_graph=True)
    t = t.detach()
    (want_out, want_fn), (got_out, got_fn) = torch.func.linearize(f, x), plait.linearize(f, x)
    assert_close(got_out, want_out)
    assert_close(got_fn(t), want_fn(t))


def test_vmap_out_dims_out_of_range_is_refused():
    """movedim raised its IndexError from inside the trace, where torch.func raises too."""
    xs = torch.randn(2, 3)
    with pytest.raises(IndexError):
        torch.func.vmap(torch.sin, out_dims=3)(xs)
    with pytest.raises(TraceError, match="out_dims 3 is out of range"):
        plait.vmap(torch.sin, out_dims=3)(xs)
    assert_close(plait.vmap(torch.sin, out_dims=-2)(xs),
                 torch.func.vmap(torch.sin, out_dims=-2)(xs))


def test_jacfwd_has_aux_of_a_pytree_argument():
    """The aux comes from a jvp with zero tangents, which were made for tensor arguments
    only."""
    def f(p):
        return p["w"].sin() * p["b"], p["w"].cos()

    p = {"w": torch.randn(3), "b": torch.randn(3)}
    assert_close(plait.jacfwd(f, has_aux=True)(p), torch.func.jacfwd(f, has_aux=True)(p))


def test_linearize_of_pytree_primals():
    f = lambda p: p[0] * p[1].sin()  # noqa: E731
    primals, tangents = (torch.randn(3), torch.randn(3)), (torch.randn(3), torch.randn(3))
    out, jvp_fn = plait.linearize(f, primals)
    want_out, want_fn = torch.func.linearize(f, primals)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(jvp_fn(tangents), want_fn(tangents))


def test_vjp_made_under_no_grad_records_its_vjp_fn_as_torch_func_does():
    """torch.func's vjp made under no_grad on a primal that requires grad: the output is not
    recorded, but vjp_fn called with grad mode on gives a result recorded as a function of
    the primal (its derivative is the second derivative)."""
    for T in (torch.func, plait):
        x = torch.tensor(3.14, requires_grad=True)
        with torch.no_grad():
            out, vjp_fn = T.vjp(lambda x: x ** 3, x)
        (y,) = vjp_fn(torch.tensor(1.0))
        assert not out.requires_grad and y.requires_grad, T
        assert_close(y, 3 * x.detach() ** 2)
        assert_close(torch.autograd.grad(y, x)[0], 6 * x.detach())


def test_vmap_writes_a_mapped_argument_the_function_writes_into():
    def f(x):
        x.view(4, 2).add_(torch.ones(2))
        return x * 2

    for in_dims in (0, 1):
        x = torch.randn(3, 4, 2) if in_dims == 0 else torch.randn(4, 3, 2)
        x_t = x.clone()
        assert_close(plait.vmap(f, in_dims=in_dims)(x), torch.func.vmap(f, in_dims=in_dims)(x_t))
        assert_close(x, x_t)
