"""Dynamic dimensions: one compilation for the sizes an argument's dimension takes (NOTE
[automatic dynamic] in api.py, NOTE [dynamic dimensions] in tracer/sizes.py), checked
against eager at every size, on both code generators."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import plait


@pytest.fixture(params=["cpp", "triton"])
def backend(request):
    """The code generators that compile symbolic sizes: C++, and Triton's kernels under its
    CPU interpreter (TRITON_INTERPRET=1, tests/conftest.py)."""
    return request.param


def _grads(module, loss):
    module.zero_grad()
    loss.backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    return grads


def test_a_batch_that_varies_compiles_once_more_for_every_size(backend):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    f = plait.jit(m, backend=backend)
    with torch.no_grad():
        for b in range(1, 25):
            x = torch.randn(b, 32)
            assert_close(f(x), m(x))
    # size 1 traces static (broadcasting branches on it), 2 makes dim 0 symbolic
    assert f.jitted.trace_count == 2, f.jitted.dynamic_failure
    assert f.jitted.dynamic_failure is None


def test_a_row_length_that_varies_reduces_over_a_symbolic_size(backend):
    f = plait.jit(lambda x: F.layer_norm(x, x.shape[-1:]), backend=backend)
    # (Triton's interpreter runs every lane of a looped row's chunks: fewer lengths there)
    for n in range(8, 28, 1 if backend == "cpp" else 5):
        x = torch.randn(4, n)
        assert_close(f(x), F.layer_norm(x, x.shape[-1:]))
    assert f.trace_count == 2, f.dynamic_failure


def test_image_sizes_that_vary_share_a_convolution(backend):
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                            torch.nn.AdaptiveAvgPool2d(1))
    f = plait.jit(m, backend=backend)
    with torch.no_grad():
        for n in range(8, 17):
            x = torch.randn(2, 3, n, n)
            assert_close(f(x), m(x))
    assert f.jitted.trace_count == 2, f.jitted.dynamic_failure


def test_training_over_batches_of_every_size_compiles_twice(backend):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    f = plait.jit(m, backend=backend)
    for b in range(2, 31):
        x = torch.randn(b, 16)
        got = _grads(m, f(x).pow(2).mean())
        want = _grads(m, m(x).pow(2).mean())
        for g, w in zip(got, want):
            assert_close(g, w)
    assert f.jitted.trace_count == 2, f.jitted.dynamic_failure


class _Attention(torch.nn.Module):
    """A pre-norm causal attention block as transformers writes one (nn.Linear on [B, T, C],
    views into heads, sdpa)."""

    def __init__(self, width: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm, self.qkv = torch.nn.LayerNorm(width), torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm(x)).split(C, dim=-1)
        q, k, v = [t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v)]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(B, T, C))


def test_sequence_lengths_that_vary_share_an_attention_block_in_inference_and_training(backend):
    torch.manual_seed(0)
    m = _Attention()
    f = plait.jit(m, backend=backend)
    with torch.no_grad():
        for t in (5, 7, 16, 33):
            x = torch.randn(2, t, 32)
            assert_close(f(x), m(x))
    for t in (6, 9):
        x = torch.randn(2, t, 32)
        for g, w in zip(_grads(m, f(x).square().sum()), _grads(m, m(x).square().sum())):
            assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert f.jitted.trace_count <= 3, f.jitted.dynamic_failure
    assert f.jitted.dynamic_failure is None


def test_a_branch_on_a_size_is_a_guard_and_each_side_compiles_once(backend):
    def fn(x):
        return x.sin() if x.shape[0] > 8 else x.cos()

    f = plait.jit(fn, backend=backend)
    for b in (3, 4, 5, 12, 13, 6, 20):
        x = torch.randn(b, 3)
        assert_close(f(x), fn(x))
    # 3 static; 4 symbolic with the guard s <= 8; 12 symbolic with s > 8
    assert f.trace_count == 3, f.dynamic_failure


def test_a_trace_that_decides_a_size_compiles_each_size_and_says_why(backend):
    def fn(x):
        return x.view(4, -1).sum(0) if x.shape[0] == 8 else x.sum(1)

    f = plait.jit(fn, backend=backend)
    for b in (3, 8, 5, 8):
        x = torch.randn(b, 6)
        assert_close(f(x), fn(x))
    assert f.dynamic_failure is not None


def test_dynamic_false_compiles_each_size_and_true_every_size_from_the_first_call(backend):
    fn = lambda x: (x * 2).sum(-1)  # noqa: E731
    static = plait.jit(fn, dynamic=False, backend=backend)
    dynamic = plait.jit(fn, dynamic=True, backend=backend)
    for n in (3, 4, 5):
        x = torch.randn(n, n + 1)
        assert_close(static(x), fn(x))
        assert_close(dynamic(x), fn(x))
    assert static.trace_count == 3
    assert dynamic.trace_count == 1, dynamic.dynamic_failure
    with pytest.raises(plait.errors.TraceError, match="dynamic="):
        plait.jit(fn, dynamic="yes")


def test_mark_dynamic_makes_a_dimension_symbolic_before_it_varies(backend):
    f = plait.jit(lambda x: x.softmax(-1), backend=backend)
    x = torch.randn(5, 7)
    plait.mark_dynamic(x, 0)
    assert_close(f(x), x.softmax(-1))
    y = torch.randn(9, 7)
    assert_close(f(y), y.softmax(-1))
    assert f.trace_count == 1, f.dynamic_failure


def test_a_symbolic_program_keeps_its_memory_plan_at_every_size(backend):
    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                            torch.nn.GELU(), torch.nn.Linear(64, 4))
    f = plait.jit(m, backend=backend)
    # (Triton's interpreter keeps a launch's arguments alive: the plan check is cpp's)
    with plait.config.patch(check_memory_plan=backend == "cpp"), torch.no_grad():
        for b in (3, 4, 50, 7):
            x = torch.randn(b, 16)
            assert_close(f(x), m(x))
    assert f.jitted.trace_count == 2, f.jitted.dynamic_failure


def test_the_reference_backend_runs_a_symbolic_graph():
    fn = lambda x, w: torch.tanh(x @ w).reshape(-1, 2).sum(1)  # noqa: E731
    f = plait.jit(fn, backend="eager")
    w = torch.randn(6, 4)
    for b in (3, 4, 9):
        x = torch.randn(b, 6)
        assert_close(f(x, w), fn(x, w))
    assert f.trace_count == 2, f.dynamic_failure


def test_the_retrace_warning_names_the_dimension_and_why_it_is_not_symbolic(caplog):
    f = plait.jit(lambda x: x + 1, dynamic=False)
    with plait.config.patch(retrace_warning=2), caplog.at_level("WARNING", "plait.cache"):
        for n in range(2, 6):
            f(torch.randn(n))
    assert "dim 0: 3, then 4" in caplog.text and "dynamic=False" in caplog.text


def test_dynamic_true_keeps_symbolic_only_the_dimensions_that_vary_where_all_cannot_be(backend):
    m = torch.nn.Linear(8, 4)
    # the product's inner dim must be 8: not every dim varies
    f = plait.jit(m, dynamic=True, backend=backend)
    with torch.no_grad():
        for b in (3, 5, 9):
            x = torch.randn(b, 8)
            assert_close(f(x), m(x))
    assert f.jitted.dynamic_failure is None
    assert f.jitted.trace_count <= 3


def test_dropout_over_batches_of_every_size_draws_as_eager_does(backend):
    d = torch.nn.Dropout(0.3)
    f = plait.jit(d, backend=backend)
    zeros, means = [], []
    for b in (3, 4, 200, 301):
        x = torch.ones(b, 64)
        torch.manual_seed(b)
        y = f(x)
        torch.manual_seed(b)
        assert_close(y, d(x))  # the same Bernoulli draws from the same generator state
        zeros.append((y == 0).float().mean().item())
        means.append(y.mean().item())
    assert abs(sum(zeros) / 4 - 0.3) < 0.03 and abs(sum(means) / 4 - 1.0) < 0.05
    assert f.jitted.trace_count == 2, f.jitted.dynamic_failure


def test_a_transformer_encoder_layer_over_sequence_lengths_compiles_twice(backend):
    torch.manual_seed(0)
    m = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    f = plait.jit(m, backend=backend)
    m.eval()
    with torch.no_grad():
        for t in range(3, 19):
            x = torch.randn(2, t, 32)
            assert_close(f(x), m(x))
    m.train()
    for t in (5, 8):
        x = torch.randn(2, t, 32)
        for g, w in zip(_grads(m, f(x).square().sum()), _grads(m, m(x).square().sum())):
            assert_close(g, w, rtol=1e-4, atol=1e-4)
    # eval: a static trace and a symbolic one; train: one symbolic
    assert f.jitted.trace_count == 3, f.jitted.dynamic_failure


def test_arguments_that_are_not_dense_keep_their_sizes_in_the_key(backend):
    conv = torch.nn.Conv2d(3, 4, 3)
    f = plait.jit(conv, backend=backend)
    with torch.no_grad():
        for n in (8, 16, 4):  # channels-last images: traced static, keyed by their sizes
            x = torch.randn(n, 3, 10, 10).to(memory_format=torch.channels_last)
            assert_close(f(x), conv(x))
    g = plait.jit(lambda x: x.sum(0) * 2, backend=backend)
    for n in (5, 7, 3):
        a = torch.randn(n, 4)
        assert_close(g(a.t()), a.t().sum(0) * 2)


def test_sizes_decided_equal_and_size_arithmetic_are_guarded(backend):
    eq = plait.jit(lambda x, y: x.sum() if x.shape[0] == y.shape[0] else y.sum() * 10,
                   backend=backend)
    for a, b in ((3, 3), (4, 4), (4, 5), (6, 6), (7, 2)):
        x, y = torch.randn(a), torch.randn(b)
        assert_close(eq(x, y), x.sum() if a == b else y.sum() * 10)
    half = plait.jit(lambda x: x.sin() if x.shape[0] // 2 > 3 else x.cos(), backend=backend)
    odd = plait.jit(lambda x: x.sin() if x.shape[0] % 2 == 0 else x.cos(), backend=backend)
    for n in (3, 4, 9, 10, 11, 5):
        x = torch.randn(n)
        assert_close(half(x), x.sin() if n // 2 > 3 else x.cos())
        assert_close(odd(x), x.sin() if n % 2 == 0 else x.cos())
    assert half.trace_count == 3 and odd.trace_count == 3, (half.dynamic_failure,
                                                             odd.dynamic_failure)


def test_two_arguments_sizes_that_meet_are_guarded_equal_and_the_loss_stays_traced(backend):
    """Logits and labels, each its own size symbols: the loss's gather and broadcasts
    guard them equal (torch's duck sizing would make them one), so cross-entropy is traced,
    not run as one opaque op, and gradients match eager's at every length; labels of
    another length retrace and fail as eager does, and the lengths after them still share
    one program."""
    def loss(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    jitted = plait.jit(loss, backend=backend)
    for n in (3, 5, 8, 13):
        logits = torch.randn(2, n, 7, requires_grad=True)
        labels = torch.randint(0, 7, (2, n))
        labels[0, 0] = -100
        assert_close(jitted(logits, labels), loss(logits, labels))
        got, = torch.autograd.grad(jitted(logits, labels), logits)
        want, = torch.autograd.grad(loss(logits, labels), logits)
        assert_close(got, want)
    assert jitted.trace_count == 2
    graph = jitted.lower(logits, labels).graph
    assert not [n for n in graph.order if graph.node(n).prim == "opaque"]
    with pytest.raises(Exception, match="batch_size|match|broadcast"):
        loss(torch.randn(2, 4, 7), torch.randint(0, 7, (2, 5)))
    with pytest.raises(Exception, match="batch_size|match|broadcast"):
        jitted(torch.randn(2, 4, 7), torch.randint(0, 7, (2, 5)))
    # a call eager refuses too leaves the symbolic program in use for the lengths after it
    traces, logits, labels = jitted.trace_count, torch.randn(2, 21, 7), torch.randint(0, 7, (2, 21))
    assert_close(jitted(logits, labels), loss(logits, labels))
    assert jitted.trace_count == traces and jitted.dynamic_failure is None


def test_a_size_that_may_be_one_is_squeezed_as_eager_squeezes_it(backend):
    f = plait.jit(lambda x: x[1:].squeeze(0), backend=backend)
    for n in (5, 6, 2, 3):
        x = torch.randn(n, 3)
        got, want = f(x), x[1:].squeeze(0)
        assert got.shape == want.shape
        assert_close(got, want)


def test_a_backward_whose_inputs_hold_no_size_compiles_each_size(backend):
    f = plait.jit(lambda x: (2 * x).sum(), backend=backend)
    for n in (3, 4, 6):
        x = torch.randn(n, requires_grad=True)
        f(x).backward()
        assert_close(x.grad, torch.full((n,), 2.0))
    assert "no input's dimension" in f.dynamic_failure


def test_a_constant_broadcast_to_a_symbolic_shape_is_traced(backend):
    def fn(x):  # a causal mask and-ed with a constant, as transformers' mask functions do
        keep = torch.ones(1, 1, x.shape[1], x.shape[1], dtype=torch.bool).tril()
        return torch.where(torch.tensor([True]) & keep, x[:, None, :, None], 0.0)

    f = plait.jit(fn, backend=backend)
    for n in (3, 4, 6):
        x = torch.randn(2, n)
        assert_close(f(x), fn(x))
    assert f.trace_count == 2, f.dynamic_failure


def test_attention_written_out_keeps_its_sizes_symbolic(backend):
    """Attention plait does not fuse (as float32 attention on a GPU over few keys) is
    written out, not ATen's math form, which reads a size as a number on CUDA."""
    torch.manual_seed(0)
    m = _Attention()
    with plait.config.patch(fuse_attention=False):
        f = plait.jit(m, backend=backend)
        with torch.no_grad():
            for t in (5, 7, 16):
                x = torch.randn(2, t, 32)
                assert_close(f(x), m(x))
    assert f.jitted.trace_count == 2, f.jitted.dynamic_failure


def test_batched_products_broadcast_their_symbolic_batch_dims(backend):
    fn = lambda a, b: a @ b.mT  # noqa: E731
    f = plait.jit(fn, backend=backend)
    for n in (3, 4, 6):
        a, b = torch.randn(2, 1, n, 8), torch.randn(3, n, 8)
        assert_close(f(a, b), fn(a, b))
    assert f.trace_count == 2, f.dynamic_failure


def test_a_size_asked_for_as_a_number_compiles_each_size(backend):
    """``aten.size`` promises numbers (C++ code asks it so): a symbolic size there would
    be its hint, silently; the function compiles each size instead."""
    def fn(x):
        return x * torch.ops.aten.size.default(x)[0]

    f = plait.jit(fn, backend=backend)
    for n in (3, 4, 6):
        x = torch.randn(n)
        assert_close(f(x), fn(x))
    assert "aten.size" in f.dynamic_failure


def test_a_view_whose_size_equals_the_input_once_expanded(backend):
    def fn(x):  # a relative shift as XLNet writes one: [B, H, 2n-1, n] viewed [B, H, n, 2n-1]
        b, h, n = x.shape
        y = x[..., None].expand(b, h, n, n)
        y = torch.cat([y, y[..., 1:]], 3).transpose(2, 3).contiguous() * 2
        return y.view(b, h, n, 2 * n - 1)

    f = plait.jit(fn, backend=backend)
    for n in (3, 4, 6):
        x = torch.randn(2, 4, n)
        assert_close(f(x), fn(x))
    assert f.trace_count == 2, f.dynamic_failure


@pytest.mark.cuda
def test_sizes_that_vary_share_gpu_kernels_and_recurring_sizes_replay_graphs():
    torch.manual_seed(0)
    m = _Attention().cuda()
    f = plait.jit(m)
    with torch.no_grad():
        for t in (5, 7, 16, 16, 16, 16, 33, 7, 7, 7, 7, 100, 5):
            x = torch.randn(2, t, 32, device="cuda")
            assert_close(f(x), m(x), rtol=1e-4, atol=1e-4)
    for t in (6, 9, 6, 6, 6):
        x = torch.randn(2, t, 32, device="cuda")
        for g, w in zip(_grads(m, f(x).square().sum()), _grads(m, m(x).square().sum())):
            assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert f.jitted.trace_count <= 3 and f.jitted.dynamic_failure is None, \
        f.jitted.dynamic_failure
