"""The cpp backend's wrapper generated as C++ (NOTE [C++ wrapper], NOTE [native loops]): one
native call per program, externs through ATen or back into Python, scans as C++ loops; each
against eager PyTorch, torch.func and the Python wrapper."""
import concurrent.futures
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import plait
from plait.backends import cpp_wrapper
from plait.backends.cpp_wrapper import NativeWrapper
from plait.errors import BackendError, CheckError
from test_control import rnn, rnn_args, rnn_ref


@pytest.fixture(autouse=True)
def cpp():
    plait.config.backend = "cpp"  # conftest's autouse fixture restores it
    cpp_wrapper.runtime_future().result()  # built: every call below runs natively


def _wrapper(lowered):
    return lowered.compiled._wrapper


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _step_matches_torch_func(loss_fn, ref_fn, args, argnums):
    """jit(grad_and_value(loss_fn)) against torch.func's of ``ref_fn``: the step, its results."""
    step = plait.jit(plait.grad_and_value(loss_fn, argnums=argnums))
    got = step(*args)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(
            torch.func.grad_and_value(ref_fn, argnums=argnums)(*args))):
        assert_close(a, b)
    return step, got


def mlp_loss(w1, b1, w2, x, y):
    h = F.gelu(x @ w1 + b1)
    return F.cross_entropy(h @ w2.t(), y)


def mlp_args():
    g = _gen(1)
    return (torch.randn(16, 32, generator=g) * 0.2, torch.randn(32, generator=g),
            torch.randn(10, 32, generator=g) * 0.2, torch.randn(8, 16, generator=g),
            torch.randint(0, 10, (8,), generator=g))


def test_a_training_step_is_one_native_call_and_matches_torch_func():
    args = mlp_args()
    step, (grads, loss) = _step_matches_torch_func(mlp_loss, mlp_loss, args, (0, 1, 2))
    wrapper = _wrapper(step.lower(*args))
    assert isinstance(wrapper, NativeWrapper)
    assert not wrapper._steps  # every extern (the matmuls) runs natively, through ATen
    with plait.config.patch(cpp_wrapper=False):
        python = plait.jit(plait.grad_and_value(mlp_loss, argnums=(0, 1, 2)))
        assert not isinstance(_wrapper(python.lower(*args)), NativeWrapper)
        for got, want in zip(torch.utils._pytree.tree_leaves(python(*args)),
                             torch.utils._pytree.tree_leaves((grads, loss))):
            assert_close(got, want, rtol=0, atol=0)  # the same kernels and library calls


@pytest.mark.parametrize("fails", [False, True])
def test_calls_step_through_python_until_the_runtime_is_built(monkeypatch, fails):
    """The ATen runtime builds in the background (NOTE [C++ wrapper]): meanwhile, and for good
    where it cannot build (with one warning), a program needing it runs its Python wrapper."""
    pending = concurrent.futures.Future()
    monkeypatch.setattr(cpp_wrapper, "_building", [pending])
    monkeypatch.setattr(cpp_wrapper, "_warned", [])
    args = mlp_args()
    step, _ = _step_matches_torch_func(lambda *a: mlp_loss(*a) * 2, lambda *a: mlp_loss(*a) * 2,
                                       args, (0, 1))
    wrapper = _wrapper(step.lower(*args))
    assert isinstance(wrapper, NativeWrapper) and not wrapper._ready()
    if fails:
        pending.set_exception(BackendError("no torch headers"))
        with pytest.warns(UserWarning, match="C\\+\\+ wrapper is off: no torch headers"):
            step(*args)
    else:
        pending.set_result(cpp_wrapper.runtime())
    _step_matches_torch_func(lambda *a: mlp_loss(*a) * 2, lambda *a: mlp_loss(*a) * 2, args,
                             (0, 1))
    assert wrapper._ready() != fails


def test_results_of_every_dtype_and_rank_come_back_as_they_are():
    """A result is handed to Python as a DLPack tensor of its own dtype and shape (NOTE [C++
    wrapper]): each DLPack type code, a 0-dim and an empty result."""
    def f(x):
        return (x > 0, x.to(torch.int8), x.abs().to(torch.uint8), x.to(torch.int16) + 1,
                x.to(torch.int32) - 1, x.to(torch.int64) * 3, x.double() * 2,
                x.to(torch.bfloat16) * 2, x.to(torch.complex64) * 1j, x.sum(), x[:0] * 2)

    x = torch.randn(3, 4, generator=_gen(6)) * 5
    jitted = plait.jit(f)
    assert isinstance(_wrapper(jitted.lower(x)), NativeWrapper)
    for got, want in zip(jitted(x), f(x)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert_close(got, want)
    # dtypes DLPack may lack go as bytes, viewed as their dtype in Python
    g = lambda x: (x.to(torch.complex32), (x * 100).abs().to(torch.uint64))  # noqa: E731
    assert isinstance(_wrapper(plait.jit(g).lower(x)), NativeWrapper)
    for got, want in zip(plait.jit(g)(x), g(x)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.to(torch.complex64), want.to(torch.complex64))


def test_a_built_runtime_loads_without_a_process(monkeypatch):
    """A process of its own builds the runtime; one already built is loaded at once: that
    process's start (importing torch, for seconds) would take the cores from the calls."""
    monkeypatch.setattr(cpp_wrapper, "_building", [])

    def no_process(*args, **kwargs):
        raise AssertionError("a process was started for a runtime already built")

    monkeypatch.setattr(cpp_wrapper.subprocess, "run", no_process)
    future = cpp_wrapper.runtime_future()
    assert future.done() and future.result() is cpp_wrapper.runtime()


@pytest.mark.parametrize("shape", [((2, 3, 5, 4), (2, 3, 4, 6)), ((5, 4), (6, 4)),
                                   ((3, 5, 4), (4, 7))])
def test_matmuls_of_transposed_and_batched_operands(shape):
    a, b = torch.randn(*shape[0], generator=_gen(2)), torch.randn(*shape[1], generator=_gen(3))
    fn = (lambda a, b: a @ b.mT) if shape == ((5, 4), (6, 4)) else (lambda a, b: (a @ b).mT @ a)
    if shape[0] == (3, 5, 4):
        fn = lambda a, b: torch.einsum("bij,jk->bki", a, b)  # noqa: E731
    assert_close(plait.jit(fn)(a, b), fn(a, b))


@pytest.mark.parametrize("causal", [False, True])
def test_attention_and_convolution_run_natively_with_their_gradients(causal):
    def loss(q, k, v, img, kernel):
        a = F.scaled_dot_product_attention(q, k, v.transpose(-2, -1), is_causal=causal)
        c = F.conv2d(img, kernel, padding=1, stride=(1, 2), groups=2).relu()
        return a.square().sum() + c.mean()

    g = _gen(4)
    args = (torch.randn(2, 3, 8, 4, generator=g), torch.randn(2, 3, 8, 4, generator=g),
            torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 4, 6, 6, generator=g),
            torch.randn(6, 2, 3, 3, generator=g))
    step, _ = _step_matches_torch_func(loss, loss, args, (0, 1, 2, 3, 4))
    program = step.lower(*args).compiled.program
    assert {"attention", "attention_backward", "conv", "conv_backward"} <= {
        getattr(k, "label", None) for k in program.kernels}
    assert not _wrapper(step.lower(*args))._steps  # none of them calls back into Python


def test_embeddings_and_scatters_run_natively():
    """An embedding with a padding row (its rows a kernel's), its gradient (a scatter adding
    into zeros) and a scatter without a reduction run in the runtime, the scatters written
    in place into their outputs."""
    def loss(table, src, ids, index):
        rows = F.embedding(ids, table, padding_idx=0)
        return rows.square().sum() + torch.scatter(table, 0, index, src).sin().sum()

    g = _gen(5)
    args = (torch.randn(10, 4, generator=g), torch.randn(3, 4, generator=g),
            torch.tensor([[0, 3, 9, 3, 0, 1]]), torch.tensor([[1, 4, 7, 2]] * 3))
    step, _ = _step_matches_torch_func(loss, loss, args, (0, 1))
    program = step.lower(*args).compiled.program
    assert "scatter" in {getattr(k, "label", None) for k in program.kernels}
    assert not _wrapper(step.lower(*args))._steps  # none of them calls back into Python


@pytest.mark.parametrize("argnums", [(0, 1, 2), (1, 2)])
def test_channels_last_convolutions_run_natively_with_their_gradients(argnums):
    """NOTE [channels-last convolutions]: the runtime hands ATen channels-last views, and
    (argnums without the images) a conv_backward without the input's gradient."""
    def loss(img, k1, k2):
        h = F.conv2d(img, k1, padding=1).relu()
        return F.conv2d(h, k2, stride=2, padding=1).square().mean()

    g = _gen(5)
    args = (torch.randn(2, 3, 8, 8, generator=g), torch.randn(6, 3, 3, 3, generator=g),
            torch.randn(4, 6, 3, 3, generator=g))
    with plait.config.patch(channels_last="all"):
        step, _ = _step_matches_torch_func(loss, loss, args, argnums)
        lowered = step.lower(*args)
    convs = [k for k in lowered.compiled.program.kernels
             if getattr(k, "label", None) in ("conv", "conv_backward")]
    assert len(convs) == 4 and all(dict(k.params)["channels_last"] for k in convs)
    assert not _wrapper(lowered)._steps  # none of them calls back into Python


def test_python_steps_run_other_externs_and_their_errors_propagate():
    spd = torch.eye(3) * 2
    chol = plait.jit(lambda m: torch.linalg.cholesky(m) * 2)
    assert_close(chol(spd), torch.linalg.cholesky(spd) * 2)
    assert len(_wrapper(chol.lower(spd))._steps) == 2  # cholesky and its check: Python steps
    with pytest.raises(torch.linalg.LinAlgError):  # raised in the step, as eager raises it
        chol(-spd)
    assert_close(chol(spd), torch.linalg.cholesky(spd) * 2)


def test_a_kernel_error_stops_the_call_and_raises():
    fn = plait.jit(lambda a, b: (a // b) + 1)
    a, b = torch.arange(6), torch.tensor([1, 2, 3, 1, 2, 3])
    assert torch.equal(fn(a, b), a // b + 1)
    with pytest.raises(CheckError, match="ZeroDivisionError"):
        fn(a, torch.tensor([1, 2, 0, 1, 2, 3]))
    assert torch.equal(fn(a, b), a // b + 1)  # and the next call is fine


def _in_a_process(code: str, cpp_wrapper: bool = True) -> None:
    """``code`` in a Python process of its own (the cpp backend, this session's cache): a
    crash fails the test rather than ending the session."""
    env = dict(os.environ, PLAIT_CACHE_DIR=plait.config.cache_dir, PLAIT_BACKEND="cpp",
               PLAIT_CPP_WRAPPER=str(int(cpp_wrapper)))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("native", [True, False])
def test_a_program_checks_its_inputs_before_any_kernel_runs(native):
    """NOTE [entry checks]: too few or too many inputs, or one without memory (a tracer that
    escaped its trace, a meta tensor), raise; the kernels would fault on them."""
    _in_a_process("""
        import pytest, torch, plait
        from plait.errors import BackendError
        runner = plait.jit(lambda x, y: x * y + 1).lower(torch.ones(3), torch.ones(3)).runner
        two = torch.full((3,), 2.0)
        assert torch.equal(runner([torch.ones(3), two])[0], torch.full((3,), 3.0))
        for inputs, message in [([two], "takes 2 input tensors and was given 1"),
                                ([two] * 3, "was given 3"),
                                ([two, torch.ones(3, device="meta")], "input 1 .* no memory")]:
            with pytest.raises(BackendError, match=message):
                runner(inputs)
        assert torch.equal(runner([torch.ones(3), two])[0], torch.full((3,), 3.0))
        # an empty tensor may have no memory: it has nothing to read
        empty = plait.jit(lambda x: x * 2).lower(torch.ones(0, 3)).runner
        assert torch.empty(0, 3).data_ptr() == 0
        assert empty([torch.empty(0, 3)])[0].shape == (0, 3)
        # nor one the program does not read (make_functional's meta parameters)
        unread = plait.jit(lambda x, y: x * 2).lower(torch.ones(3), torch.ones(3)).runner
        assert torch.equal(unread([two, torch.ones(3, device="meta")])[0], two * 2)
    """, native)


@pytest.mark.slow  # 9 s
def test_a_linearized_function_under_vmap_is_refused_then_matches_torch_func():
    """torch.func.linearize's function folds its constants into new parameters of its module
    at its first call. Traced, they held plait's tracers, which the compiled program was
    then given as inputs: a segmentation fault. The trace is refused and the module put back
    as it was; called once by eager first, the function compiles and matches torch.func."""
    _in_a_process("""
        import pytest, torch, plait
        from torch.func import linearize
        _, jvp_fn = linearize(lambda x: (x.cos(), x.sum()), torch.randn(3, 1))
        tangents = torch.randn(3, 3, 1)
        with pytest.raises(plait.errors.TraceError, match="_FX_CONST_FOLDED_ATTRS"):
            plait.vmap(jvp_fn)(tangents)
        want = torch.func.vmap(jvp_fn)(tangents)  # the module as it was: eager folds now
        for got, w in zip(plait.vmap(jvp_fn)(tangents), want):
            torch.testing.assert_close(got, w)
        for got, w in zip(plait.jit(jvp_fn)(tangents[1]), jvp_fn(tangents[1])):
            torch.testing.assert_close(got, w)
    """)


# ---------------------------------------------------------------------------------------
# Scans as C++ loops
# ---------------------------------------------------------------------------------------
def _python_calls(fn, *args) -> int:
    """How many Python functions run during ``fn(*args)``."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return calls


def test_a_scan_and_its_gradient_run_no_python_per_step():
    calls = {}
    for steps in (10, 200):
        args = rnn_args(steps)
        step, _ = _step_matches_torch_func(rnn, rnn_ref, args, (0, 1, 3))
        wrapper = _wrapper(step.lower(*args))
        assert not wrapper._steps and len(wrapper._bodies) >= 2  # forward and reverse loops
        calls[steps] = _python_calls(step, *args)
    assert calls[200] == calls[10]  # 20 times the steps, not one Python call more


def test_reverse_nested_and_pytree_scans_match_python():
    def fn(xs, c0):
        def outer(c, x):
            inner, ys = plait.scan(lambda a, y: (a * 0.5 + y, a.sum()), c["a"], x)
            return {"a": inner.tanh(), "n": c["n"] + ys.sum()}, (inner.sum(), ys)

        return plait.scan(outer, c0, xs, reverse=True)

    def ref(xs, c0):
        c, firsts, seconds = dict(c0), [None] * len(xs), [None] * len(xs)
        for i in reversed(range(len(xs))):
            a, ys = c["a"], []
            for y in xs[i]:
                ys.append(a.sum())
                a = a * 0.5 + y
            c = {"a": a.tanh(), "n": c["n"] + torch.stack(ys).sum()}
            firsts[i], seconds[i] = a.sum(), torch.stack(ys)
        return c, (torch.stack(firsts), torch.stack(seconds))

    xs, c0 = torch.randn(5, 4, 3, generator=_gen(5)), {"a": torch.randn(3), "n": torch.zeros(())}
    jitted = plait.jit(fn)
    for got, want in zip(torch.utils._pytree.tree_leaves(jitted(xs, c0)),
                         torch.utils._pytree.tree_leaves(ref(xs, c0))):
        assert_close(got, want)
    assert not _wrapper(jitted.lower(xs, c0))._steps


def test_a_scan_of_no_steps_returns_its_initial_carry():
    fn = plait.jit(lambda c, xs: plait.scan(lambda c, x: (c + x, c * x), c, xs))
    c, xs = torch.randn(3), torch.randn(0, 3)
    carry, ys = fn(c, xs)
    assert_close(carry, c) and ys.shape == (0, 3)


def test_a_native_program_and_its_loop_bodies_pickle():
    """The program cache keeps runners (NOTE [program cache]): one with scan bodies loads and
    runs in place of a compiled one."""
    args = rnn_args(7)
    lowered = plait.jit(plait.grad(rnn, argnums=(0, 1)))
    want = lowered(*args)
    runner = pickle.loads(pickle.dumps(lowered.lower(*args).compiled.runner))
    for got, w in zip(runner(list(args)), want):
        assert_close(got, w)


def test_a_while_loop_runs_no_python_per_iteration():
    def count_to(n, x):  # fori_loop with tensor bounds: a while_loop, its trip count data
        return plait.fori_loop(torch.tensor(0), n, lambda i, x: x * 1.01 + i, x)

    def ref(n, x):
        for i in range(int(n)):
            x = x * 1.01 + i
        return x

    jitted, x = plait.jit(count_to), torch.randn(4, generator=_gen(6))
    calls = {}
    for n in (0, 3, 300):
        assert_close(jitted(torch.tensor(n), x), ref(n, x))
        calls[n] = _python_calls(jitted, torch.tensor(n), x)
    assert calls[300] == calls[3] == calls[0]
    assert not _wrapper(jitted.lower(torch.tensor(3), x))._steps


def test_a_cond_runs_its_branches_natively():
    def fn(x, w):
        return plait.cond(x.sum() > 0, lambda x: (x @ w).relu(), lambda x: x.flip(0) @ w, (x,))

    jitted, w = plait.jit(fn), torch.randn(3, 2, generator=_gen(7))
    for x in (torch.rand(4, 3) + 0.1, -torch.rand(4, 3) - 0.1):
        want = (x @ w).relu() if x.sum() > 0 else x.flip(0) @ w
        assert_close(jitted(x, w), want)
    assert jitted.trace_count == 1 and not _wrapper(jitted.lower(x, w))._steps


def test_a_program_of_symbolic_sizes_runs_natively_at_every_size():
    """NOTE [symbolic sizes]: allocations, results' shapes, kernels' sizes and the views of
    native matrix products, attention and cumulative sums come from the call's sizes; a
    Python step's types too (a cumulative log-sum-exp is one)."""
    torch.manual_seed(0)
    w, wo = torch.randn(16, 48), torch.randn(16, 16)

    def fn(x):
        q, k, v = (x @ w).view(x.shape[0], x.shape[1], 3, 2, 8).unbind(2)
        a = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                           is_causal=True)
        return a.transpose(1, 2).reshape(x.shape) @ wo + x.cumsum(1) + x.logcumsumexp(1)

    f = plait.jit(fn)
    for n in (3, 4, 9, 17, 4):
        x = torch.randn(2, n, 16)
        assert_close(f(x), fn(x), rtol=1e-4, atol=1e-4)
    assert f.trace_count == 2, f.dynamic_failure
    wrapper = _wrapper(f._latest[2].lowered)  # the compilation the calls ran
    assert isinstance(wrapper, NativeWrapper) and wrapper._size_items
    assert len(wrapper._steps) == 1  # the log-sum-exp: a Python step at the call's sizes
    assert len(wrapper._size_arrays) == 3  # S once per distinct size: 4, 9, 17 (3: static)
