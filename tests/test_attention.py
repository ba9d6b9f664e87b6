"""Attention fusion (NOTE [attention fusion]): softmax(q @ kᵀ * scale) @ v runs as one fused
attention kernel that stores no score matrix, on every backend, with eager's results."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.testing import assert_close

import plait
from plait.passes import algebra, dce
from plait.tracer import nn as plait_nn

BACKENDS = ["eager", "cpp", "triton"]


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v


def _qkv(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype) for _ in range(3)]


def _prims(graph) -> list[str]:
    return [graph.node(n).prim for n in graph.order]


def _scores_bytes(q, k) -> int:
    return q.shape[:-1].numel() * k.shape[-2] * q.element_size()


VARIANTS = {
    "scaled": attention,
    "divided": lambda q, k, v: F.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]),
                                         dim=-1) @ v,
    "unscaled": lambda q, k, v: (q @ k.mT).softmax(-1) @ v,
    "scaled_twice": lambda q, k, v: torch.softmax(0.5 * (q @ k.mT) * 0.25, -1) @ v,
    "k_given_transposed": lambda q, k, v: torch.softmax(q @ k.mT.contiguous(), -1) @ v,
    "v_transposed": lambda q, k, v: torch.softmax(q @ k.mT, -1) @ v.mT.contiguous().mT,
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_fused_attention_matches_eager(backend, name):
    fn = VARIANTS[name]
    q, k, v = _qkv(2, 3, 16, 8)
    jitted = plait.jit(fn, backend=backend)
    assert _prims(jitted.lower(q, k, v).graph).count("attention") == 1
    assert "exp" not in _prims(jitted.lower(q, k, v).graph)
    assert_close(jitted(q, k, v), fn(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(16, 8), (4, 16, 8), (2, 2, 3, 16, 8)])
def test_any_number_of_batch_dims(shape):
    q, k, v = _qkv(*shape)
    jitted = plait.jit(attention, backend="cpp")
    assert "attention" in _prims(jitted.lower(q, k, v).graph)
    assert_close(jitted(q, k, v), attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_cross_attention_shapes():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 4, 7, 8, generator=g),
               torch.randn(2, 4, 7, 3, generator=g))
    jitted = plait.jit(attention, backend="cpp")
    assert "attention" in _prims(jitted.lower(q, k, v).graph)
    assert_close(jitted(q, k, v), attention(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    q, k, v = _qkv(2, 2, 32, 16, dtype=dtype)
    jitted = plait.jit(attention, backend="cpp")
    assert _prims(jitted.lower(q, k, v).graph).count("attention") == 1
    # eager rounds the scores and probabilities to the low precision in between; the fused
    # kernel does not: compare both against float32
    exact = attention(*(x.float() for x in (q, k, v)))
    ours, eagers = jitted(q, k, v).float(), attention(q, k, v).float()
    assert (ours - exact).abs().max() <= (eagers - exact).abs().max() + 1e-3


def test_no_score_matrix_is_stored():
    q, k, v = _qkv(2, 2, 64, 16)
    lowered = plait.jit(attention, backend="cpp").lower(q, k, v)
    # the result and each row's log-sum-exp (for a backward)
    assert [(k.reads, len(k.writes)) for k in lowered.kernels] == [(("in0", "in1", "in2"), 2)]
    rows = q.numel() // q.shape[-1]
    assert lowered.stats["peak_bytes"] == 4 * q.nbytes + 4 * rows  # the inputs and results
    with plait.config.patch(fuse_attention=False):
        unfused = plait.jit(attention, backend="cpp").lower(q, k, v)
    assert unfused.stats["peak_bytes"] >= 4 * q.nbytes + _scores_bytes(q, k)


NOT_ATTENTION = {
    "probabilities_returned": lambda q, k, v: (lambda p: (p @ v, p))(
        torch.softmax(q @ k.mT, -1)),
    "scores_returned": lambda q, k, v: (lambda s: (torch.softmax(s, -1) @ v, s))(q @ k.mT),
    "softmax_over_queries": lambda q, k, v: torch.softmax(q @ k.mT, -2) @ v,
    "scale_is_a_tensor": lambda q, k, v: torch.softmax(q @ k.mT * q.sum(), -1) @ v,
    "log_softmax": lambda q, k, v: torch.log_softmax(q @ k.mT, -1) @ v,
}


@pytest.mark.parametrize("name", sorted(NOT_ATTENTION))
def test_other_patterns_are_left_alone(name):
    fn = NOT_ATTENTION[name]
    q, k, v = _qkv(2, 16, 8)
    jitted = plait.jit(fn, backend="cpp")
    assert "attention" not in _prims(jitted.lower(q, k, v).graph)
    assert_close(jitted(q, k, v), fn(q, k, v), atol=1e-5, rtol=1e-5)


def test_attention_of_an_attention_output():
    """softmax(softmax(q @ k.T) @ k2 * c) @ v: the inner product is both the inner pattern's
    matmul and the outer pattern's scores; the inner one is fused, the outer left alone."""
    q, k, v = _qkv(2, 16, 8)
    k2 = torch.randn(2, 16, 16)

    def nested(q, k, v, k2):
        return torch.softmax(torch.softmax(q @ k.mT, -1) @ k2 * 0.5, -1) @ v

    jitted = plait.jit(nested, backend="cpp")
    assert _prims(jitted.lower(q, k, v, k2).graph).count("attention") == 1
    assert_close(jitted(q, k, v, k2), nested(q, k, v, k2), atol=1e-5, rtol=1e-5)


def test_scores_divided_by_zero():
    q, k, v = _qkv(2, 16, 8)

    def by_zero(q, k, v):
        return torch.softmax(q @ k.mT / 0.0, -1) @ v

    assert_close(plait.jit(by_zero, backend="cpp")(q, k, v), by_zero(q, k, v), equal_nan=True)


def test_switched_off_by_config():
    q, k, v = _qkv(2, 16, 8)
    with plait.config.patch(fuse_attention=False):
        jitted = plait.jit(attention, backend="cpp")
        assert "attention" not in _prims(jitted.lower(q, k, v).graph)
        assert_close(jitted(q, k, v), attention(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("keys, fused", [(197, False), (1024, True)])
def test_float32_attention_on_cuda_over_few_keys_stays_written_out(keys, fused):
    """Written out, and scaled_dot_product_attention (masked or not) as its math form."""
    q, k, v = (x.cuda() for x in _qkv(2, 3, keys, 16))
    mask = torch.randn(keys, keys, device="cuda")
    for fn in (attention, lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
               lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)):
        assert ("attention" in _prims(plait.make_graph(fn)(q, k, v))) == fused
        assert_close(plait.jit(fn)(q, k, v), fn(q, k, v), atol=1e-5, rtol=1e-5)
    half = [x.half() for x in (q, k, v)]  # half precision fuses at any length
    assert "attention" in _prims(plait.make_graph(attention)(*half))


def _masks(g) -> dict:
    """name -> (a mask of [2, 4, 8, 12] scores, is_causal)."""
    return {
        "bias_over_heads": (torch.randn(1, 4, 8, 12, generator=g), False),  # T5's, learned
        "key_padding": (torch.where(torch.rand(2, 1, 1, 12, generator=g) > 0.3, 0.0,
                                    float("-inf")), False),
        "rows_and_keys": (torch.randn(8, 12, generator=g), False),
        "boolean": (torch.rand(2, 1, 8, 12, generator=g) > 0.3, False),
        "boolean_and_causal": (torch.rand(8, 12, generator=g) > 0.3, True),
    }


def _masked_operands(device="cpu"):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, n, 16, generator=g) for n in (8, 12, 12))
    return [x.to(device) for x in (q, k, v)], g


@pytest.mark.parametrize("backend", [*BACKENDS, pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name", sorted(_masks(torch.Generator())))
def test_masked_attention_runs_the_fused_kernels(name, backend, monkeypatch):
    """With a mask, additive (its gradient too: T5's learned position bias) or boolean, with
    or without causal masking, scaled_dot_product_attention is the attention primitive:
    torch's fused kernels forward and backward. The bias's gradient is written out, only
    where the bias is differentiated (else nothing of the scores' size is computed)."""
    device = "cuda" if backend == "cuda" else "cpu"
    monkeypatch.setattr(plait_nn, "FLOAT32_WRITTEN_MAX_KEYS", 0)  # fused on CUDA at 12 keys
    (q, k, v), g = _masked_operands(device)
    mask, causal = _masks(g)[name]
    args = (q, k, v, mask.to(device))

    def loss(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              is_causal=causal).square().sum()

    argnums = (0, 1, 2) if mask.dtype == torch.bool else (0, 1, 2, 3)
    prims = _prims(plait.make_graph(plait.grad(loss, argnums))(*args))
    assert prims.count("attention") == prims.count("attention_backward") == 1
    assert "opaque" not in prims
    assert "exp" not in _prims(plait.make_graph(plait.grad(loss, (0, 1, 2)))(*args))
    leaves = [x.clone().requires_grad_() for x in args[:len(argnums)]]
    want = torch.autograd.grad(loss(*leaves, *args[len(argnums):]), leaves)
    jitted = plait.jit(plait.grad(loss, argnums), **{} if backend == "cuda" else
                       {"backend": backend})
    assert_close(jitted(*args), want, atol=1e-5, rtol=1e-5)


BIASED = {
    "t5": lambda q, k, v, b: (q @ k.transpose(2, 3) + b).softmax(-1) @ v,
    "bert": lambda q, k, v, b: F.softmax(q @ k.mT / 4.0 + b, dim=-1) @ v,
    "bias_first": lambda q, k, v, b: (b + q @ k.mT * 0.25).softmax(-1) @ v,
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(BIASED))
def test_written_out_attention_with_an_additive_mask_is_fused(name, backend):
    """softmax(q @ kᵀ * scale + mask) @ v is fused, the mask read as it broadcasts (a mask
    over keys [2, 1, 1, 12], not repeated over heads and rows), differentiated with q, k and
    v where it is a learned bias."""
    fn = BIASED[name]
    (q, k, v), g = _masked_operands()
    for mask in (torch.where(torch.rand(2, 1, 12, generator=g) > 0.3, 0.0, float("-inf"))
                 .unsqueeze(1), torch.randn(4, 8, 12, generator=g)):
        graph = plait.jit(fn, backend=backend).lower(q, k, v, mask).graph
        (node,) = [n for n in graph.order if graph.node(n).prim == "attention"]
        assert graph.type_of(graph.operands(node)[3]).shape == (1, *mask.shape)[-4:]
        assert "exp" not in _prims(graph)
        assert_close(plait.jit(fn, backend=backend)(q, k, v, mask), fn(q, k, v, mask),
                     atol=1e-5, rtol=1e-5)
    loss = lambda *args: fn(*args).square().sum()  # noqa: E731
    leaves = [x.clone().requires_grad_() for x in (q, k, v, mask)]
    assert_close(plait.jit(plait.grad(loss, (0, 1, 2, 3)), backend=backend)(q, k, v, mask),
                 torch.autograd.grad(loss(*leaves), leaves), atol=1e-5, rtol=1e-5)


def test_half_precision_attention_with_a_float32_mask():
    """bf16 scores converted to float32 for the mask and the softmax: fused, the mask taken
    in bf16, within bf16's precision of the float64 result (as eager's sdpa is)."""
    def fn(q, k, v, b):
        return ((q @ k.mT).float() + b).softmax(-1).to(q.dtype) @ v

    (q, k, v), g = _masked_operands()
    q, k, v = (x.bfloat16() for x in (q, k, v))
    bias = torch.randn(1, 4, 8, 12, generator=g)
    assert "attention" in _prims(plait.make_graph(fn)(q, k, v, bias))
    want = fn(*(x.double() for x in (q, k, v, bias)))
    assert_close(plait.jit(fn)(q, k, v, bias).double(), want, atol=3e-2, rtol=3e-2)


def test_masked_attention_derivatives_of_every_order():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, n, 4, generator=g, dtype=torch.float64) for n in (5, 6, 6))
    bias = torch.randn(1, 5, 6, generator=g, dtype=torch.float64)

    def sdpa(q, b):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=b).square().sum()

    def written(q, b):
        return ((q @ k.mT * 0.5 + b).softmax(-1) @ v).square().sum()

    for argnum, x in ((0, q), (1, bias)):
        assert_close(plait.hessian(sdpa, argnum)(q, bias),
                     torch.func.hessian(written, argnum)(q, bias))
        assert_close(plait.jvp(lambda x: sdpa(*[x if i == argnum else a
                                                for i, a in enumerate((q, bias))]),
                               (x,), (torch.ones_like(x),))[1],
                     torch.func.jvp(lambda x: written(*[x if i == argnum else a
                                                        for i, a in enumerate((q, bias))]),
                                    (x,), (torch.ones_like(x),))[1])
    per_bias = plait.vmap(plait.grad(sdpa, 1), (None, 0))(q, torch.stack([bias, 2 * bias]))
    assert_close(per_bias, torch.stack([torch.func.grad(written, 1)(q, b)
                                        for b in (bias, 2 * bias)]))


def test_grouped_query_attention_with_a_mask():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 8, 4, generator=g) for h in (8, 2, 2))
    mask = torch.randn(8, 8, generator=g)

    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    assert "attention" in _prims(plait.make_graph(fn)(q, k, v, mask))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, mask)]
    loss = lambda *args: fn(*args).square().sum()  # noqa: E731
    assert_close(plait.grad(loss, (0, 1, 2, 3))(q, k, v, mask),
                 torch.autograd.grad(loss(*leaves), leaves), atol=1e-5, rtol=1e-5)


CAUSAL = {
    "masked_fill": lambda q, k, v: (q @ k.mT * 0.5).masked_fill(
        ~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), float("-inf"))
    .softmax(-1) @ v,
    "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CAUSAL))
def test_causal_attention_is_fused(backend, name):
    q, k, v = _qkv(2, 3, 16, 8)
    jitted = plait.jit(CAUSAL[name], backend=backend)
    graph = jitted.lower(q, k, v).graph
    attention_nodes = [graph.node(n) for n in graph.order if graph.node(n).prim == "attention"]
    assert [a.kwargs["causal"] for a in attention_nodes] == [True]
    assert "exp" not in _prims(graph)
    assert_close(jitted(q, k, v), CAUSAL["masked_fill"](q, k, v), atol=1e-5, rtol=1e-5)


def test_a_mask_that_is_not_causal_is_left_alone():
    q, k, v = _qkv(2, 16, 8)
    band = torch.ones(16, 16, dtype=torch.bool).tril().triu(-2)
    fn = lambda q, k, v: (q @ k.mT).masked_fill(~band, float("-inf")).softmax(-1) @ v  # noqa
    assert "attention" not in _prims(plait.jit(fn, backend="cpp").lower(q, k, v).graph)
    assert_close(plait.jit(fn, backend="cpp")(q, k, v), fn(q, k, v))


def _index_mask(keep, fill):
    """scaled_dot_product_attention given the additive mask a library builds from index
    comparisons (as transformers' masks are while a compiler traces them), [B, 1, M, N]."""
    def fn(q, k, v):
        rows = torch.arange(q.shape[-2])[:, None]
        keys = torch.arange(k.shape[-2])[None, :]
        allowed = keep(rows, keys).expand(q.shape[0], 1, -1, -1)
        mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, fill)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return fn


KNOWN_MASKS = {  # name -> (keep, fill, the attention node's causal flag, whether a bias stays)
    "causal": (lambda i, j: j <= i, float("-inf"), True, False),
    "causal_lowest": (lambda i, j: j <= i, torch.finfo(torch.float32).min, True, False),
    "all_kept": (lambda i, j: j >= 0, float("-inf"), False, False),
    "sliding_window": (lambda i, j: (j <= i) & (j > i - 3), float("-inf"), False, True),
    "anticausal": (lambda i, j: j >= i, float("-inf"), False, True),
}


@pytest.mark.parametrize("name", sorted(KNOWN_MASKS))
def test_a_mask_known_when_compiling_becomes_the_kernels_flag(name):
    """NOTE [masks known when compiling]: a causal mask built from indices is the fused
    kernels' causal flag (flash and cuDNN take no bias), an all-zero one no bias; any other
    mask stays the bias. Values and gradients as eager's."""
    keep, fill, causal, biased = KNOWN_MASKS[name]
    fn = _index_mask(keep, fill)
    q, k, v = _qkv(2, 3, 16, 8)
    loss = lambda q, k, v: fn(q, k, v).square().sum()  # noqa: E731
    for f in (fn, plait.grad(loss, argnums=(0, 1, 2))):
        graph = plait.jit(f, backend="cpp").lower(q, k, v).graph
        nodes = [n for n in graph.order if graph.node(n).prim == "attention"]
        assert [(graph.node(n).kwargs["causal"], len(graph.operands(n)) == 4)
                for n in nodes] == [(causal, biased)]
    assert_close(plait.jit(fn, backend="cpp")(q, k, v), fn(q, k, v), atol=1e-5, rtol=1e-5)
    theirs = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert_close(plait.jit(plait.grad(loss, argnums=(0, 1, 2)), backend="cpp")(q, k, v),
                 theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fn", [attention, CAUSAL["masked_fill"], CAUSAL["sdpa"]],
                         ids=["written_out", "causal", "sdpa"])
def test_gradients_of_attention_run_the_fused_backward(fn):
    """Fused before differentiation: the forward and the backward run torch's fused kernels,
    no score matrix stored; the gradients are eager's."""
    q, k, v = _qkv(2, 16, 8)
    loss = lambda q, k, v: fn(q, k, v).square().sum()  # noqa: E731
    jitted = plait.jit(plait.grad(loss, argnums=(0, 1, 2)), backend="cpp")
    prims = _prims(jitted.lower(q, k, v).graph)
    assert "attention_backward" in prims and "exp" not in prims
    # the inputs, the result (the backward reads it), its cotangent, each row's log-sum-exp
    # and the three gradients: no score matrix
    rows = q.numel() // q.shape[-1]
    assert jitted.lower(q, k, v).stats["peak_bytes"] <= 8 * q.nbytes + 4 * rows
    # torch.func cannot differentiate SDPA's fused kernel on the CPU: the written-out form
    reference = CAUSAL["masked_fill"] if fn is CAUSAL["sdpa"] else fn
    theirs = torch.func.grad(lambda q, k, v: reference(q, k, v).square().sum(),
                             argnums=(0, 1, 2))(q, k, v)
    assert_close(jitted(q, k, v), theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("value_dim", [8, 4], ids=["fused_kernel", "math"])
@pytest.mark.parametrize("mask", ["none", "causal", "bias"])
def test_the_backward_reads_the_forward_statistics(value_dim, mask):
    """The attention primitive returns each row's log-sum-exp beside its result, and its
    backward reads both rather than running the forward again: torch's fused CPU kernel
    where torch picks it, else (v's head dim not q's) statistics from the scores and
    autograd's backward. Both implementations (Python, and the C++ wrapper's) match eager,
    causal or with an additive bias broadcast over the batch."""
    from plait.tracer.nn import _attention, _attention_backward

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 12, 8, generator=g) for _ in range(2))
    v, ct = (torch.randn(2, 3, 12, value_dim, generator=g) for _ in range(2))
    scale, causal = 0.3, mask == "causal"
    bias = (torch.randn(1, 3, 12, 12, generator=g),) if mask == "bias" else ()
    out, lse = _attention(q, k, v, *bias, scale=scale, causal=causal)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    scores = leaves[0] @ leaves[1].mT * scale + (bias[0] if bias else 0)
    if causal:
        scores = scores.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    expected = scores.softmax(-1) @ leaves[2]
    assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert_close(lse, scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(expected, leaves, ct)
    assert_close(_attention_backward(ct, q, k, v, out, lse, *bias, scale=scale, causal=causal),
                 grads, atol=1e-5, rtol=1e-5)

    def loss(q, k, v):
        return (F.scaled_dot_product_attention(q, k, v, *bias, is_causal=causal, scale=scale)
                * ct).sum()
    for wrapper in (True, False):
        with plait.config.patch(cpp_wrapper=wrapper):
            jitted = plait.jit(plait.grad_and_value(loss, argnums=(0, 1, 2)), backend="cpp")
            prims = _prims(jitted.lower(q, k, v).graph)
            assert prims.count("attention") == 1 and prims.count("attention_backward") == 1
            ours, value = jitted(q, k, v)
        assert_close(value, (expected * ct).sum(), atol=1e-4, rtol=1e-5)
        assert_close(ours, grads, atol=1e-5, rtol=1e-5)


def test_cuda_flash_pads_head_dims_to_eight(monkeypatch):
    """The CUDA flash kernel takes head dims that are multiples of 8 only: plait pads them
    as scaled_dot_product_attention does (checked on the CPU, the CUDA kernel played by the
    CPU's)."""

    dims = []

    def cuda_flash(q, k, v, dropout, causal, debug, *, scale):
        dims.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout, causal, scale=scale)
        return out, lse, *[None] * 7

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention", cuda_flash)
    q, k, v = _qkv(2, 3, 10, 36)
    for causal in (False, True):
        out, lse = plait_nn._cuda_flash(q, k, v, causal, 0.2)[:2]
        scores = q @ k.mT * 0.2
        if causal:
            scores = scores.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(),
                                        float("-inf"))
        assert_close(out, scores.softmax(-1) @ v, atol=1e-5, rtol=1e-5)
        assert_close(lse, scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
    assert dims == [(40, 40, 40)] * 2


@pytest.mark.cuda  # torch's CUDA attention kernels
@pytest.mark.parametrize("rows,keys,value_dim", [(100, 100, 64), (37, 100, 64), (100, 37, 64),
                                                 (100, 100, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_kernels_statistics_and_backward(causal, dtype, rows, keys, value_dim,
                                              monkeypatch):
    """On CUDA the result and statistics come from torch's flash, memory-efficient (padded
    to 32 rows) or cuDNN kernel, each that takes these operands (the one torch picks among
    them), or from the scores; the backward, given them stored contiguously as a compiled
    program stores them, or as they came (operands laid out as a projection leaves them,
    [batch, tokens, heads, dim] transposed, and the kernel's own output), gives the
    gradients of the math reference within the kernels' precision."""

    g = torch.Generator(device="cuda").manual_seed(0)
    q, ct = (torch.randn(2, rows, 4, d, generator=g, device="cuda", dtype=dtype).transpose(1, 2)
             for d in (64, value_dim))
    k, v = (torch.randn(2, keys, 4, d, generator=g, device="cuda", dtype=dtype).transpose(1, 2)
            for d in (64, value_dim))
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(SDPBackend.MATH):
        wide = [x.double() for x in leaves]
        expected = F.scaled_dot_product_attention(*wide, is_causal=causal, scale=0.125)
        grads = torch.autograd.grad(expected, leaves, ct.double())
    scores = wide[0] @ wide[1].mT * 0.125
    if causal:
        scores = scores.masked_fill(~torch.ones(rows, keys, dtype=torch.bool,
                                                device="cuda").tril(), float("-inf"))
    tolerance = {"atol": 3e-2, "rtol": 3e-2} if dtype == torch.bfloat16 else \
        {"atol": 1e-3, "rtol": 1e-3}
    kernels = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    picked = plait_nn._fused_kernel(q, k, v, None, causal, 0.125)
    tested = []
    for kernel, backend in kernels.items():
        with torch.nn.attention.sdpa_kernel(backend):  # (math takes any operands)
            try:
                torch._fused_sdp_choice(q, k, v, None, 0.0, causal, scale=0.125)
            except RuntimeError:  # "No available kernel": torch's kernel refuses them
                continue
        tested.append(kernel)
        monkeypatch.setattr(plait_nn, "_fused_kernel", lambda *args, kernel=kernel: kernel)
        out, lse = plait_nn._attention(q, k, v, scale=0.125, causal=causal)
        assert_close(out.double(), expected.to(out.dtype).double(), **tolerance)
        assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
        assert_close(lse.double(), scores.logsumexp(-1).detach(), atol=1e-3, rtol=1e-3)
        for stored in ([x.contiguous() for x in (ct, q, k, v, out, lse)],
                       [ct, q, k, v, out, lse]):
            assert_close(plait_nn._attention_backward(*stored, scale=0.125, causal=causal),
                         grads, **tolerance)
    assert picked in tested


@pytest.mark.cuda  # torch's cuDNN attention
@pytest.mark.parametrize("plait_first", [False, True])
def test_cudnn_backward_agrees_with_eagers_calls_of_the_same_shapes(plait_first):
    """torch caches cuDNN's backward plan per thread by q's, k's and v's strides but not
    the output's: eager's training and plait's, in one process (whose backwards run in
    torch.autograd's one thread for the device), each give the math reference's gradients,
    whichever runs first."""
    if not torch.backends.cuda.cudnn_sdp_enabled():
        pytest.skip("this torch has no cuDNN attention")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, ct = (torch.randn(2, 4, 32, 16, generator=g, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    wide = [x.double().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(F.scaled_dot_product_attention(*wide), wide, ct.double())

    def attend(q, k, v):
        with torch.nn.attention.sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    jitted = plait.jit(attend)
    for run in (jitted, attend) if plait_first else (attend, jitted):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        for got, expected in zip(torch.autograd.grad(run(*leaves), leaves, ct), want):
            assert_close(got.double(), expected, atol=3e-2, rtol=3e-2)


def test_attention_derivatives_of_every_order():
    q, k, v = _qkv(2, 8, 4, dtype=torch.float64)
    causal = lambda q: (CAUSAL["sdpa"](q, k, v) ** 2).sum()  # noqa: E731
    written = lambda q: (CAUSAL["masked_fill"](q, k, v) ** 2).sum()  # noqa: E731
    assert_close(plait.jvp(causal, (q,), (v,))[1], torch.func.jvp(written, (q,), (v,))[1])
    assert_close(plait.hessian(causal)(q), torch.func.hessian(written)(q))
    assert_close(plait.grad(lambda q: plait.grad(causal)(q).sum())(q),
                 torch.func.grad(lambda q: torch.func.grad(written)(q).sum())(q))
    per_example = plait.vmap(plait.grad(causal))(torch.stack([q, k]))
    assert_close(per_example, torch.stack([torch.func.grad(written)(x) for x in (q, k)]))


def test_grouped_query_attention():
    q = torch.randn(2, 8, 16, 4)
    k, v = torch.randn(2, 2, 16, 4), torch.randn(2, 2, 16, 4)
    fn = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, enable_gqa=True)
    jitted = plait.jit(fn, backend="cpp")
    assert "attention" in _prims(jitted.lower(q, k, v).graph)
    assert_close(jitted(q, k, v), fn(q, k, v), atol=1e-5, rtol=1e-5)
    repeated = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    for got, want in zip(plait.grad(lambda *a: fn(*a).sum(), argnums=(1, 2))(q, k, v),
                         torch.autograd.grad(repeated(q, k.requires_grad_(),
                                                      v.requires_grad_()).sum(), (k, v))):
        assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keys", ["rows", "columns", "three_dims"])
def test_the_library_gets_operands_its_fused_kernel_reads(keys):
    """The attention library's fused kernels read 4-D operands whose last dim is
    contiguous; given others, torch silently takes its path that stores the scores, and with
    only the fused kernel allowed it raises. Keys given as columns (kᵀ) are copied, not
    viewed; 3-D operands get a head dim."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = _qkv(*((4, 64, 16) if keys == "three_dims" else (2, 2, 64, 16)))
    fn = lambda q, kt, v: torch.softmax(q @ kt * q.shape[-1] ** -0.5, -1) @ v  # noqa: E731
    args = (q, k.mT.contiguous(), v)
    if keys != "columns":
        fn, args = attention, (q, k, v)
    jitted = plait.jit(fn, backend="cpp")
    assert "attention" in _prims(jitted.lower(*args).graph)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        assert_close(jitted(*args), fn(*args), atol=1e-5, rtol=1e-5)


def test_vmapped_attention_is_fused():
    q, k, v = _qkv(3, 2, 16, 8)
    jitted = plait.jit(plait.vmap(attention), backend="cpp")
    assert "attention" in _prims(jitted.lower(q, k, v).graph)
    assert_close(jitted(q, k, v), torch.vmap(attention)(q, k, v), atol=1e-5, rtol=1e-5)


def test_batched_matmul_of_transposed_operands_copies_nothing():
    """reshape(transpose(k)) becomes transpose(reshape(k)), which the matmul absorbs, and the
    extern reads its operands as views of the inputs."""
    q, k = _qkv(2, 3, 16, 8)[:2]
    fn = lambda q, k: (q @ k.transpose(-1, -2)).relu()  # noqa: E731
    jitted = plait.jit(fn, backend="cpp")
    lowered = jitted.lower(q, k)
    assert "transpose" not in _prims(dce(algebra(lowered.traced_graph)))
    assert lowered.kernels[0].reads == ("in0", "in1")  # the matmul, on the inputs as they are
    assert_close(jitted(q, k), fn(q, k))


def test_attention_under_no_grad_in_a_jitted_function_still_fuses():
    """NOTE [grad mode while tracing]: the outermost trace marks nothing no_grad."""
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))

    def f(q, k, v):
        with torch.no_grad():
            return torch.softmax(q @ k.mT * 0.3, -1) @ v

    graph = plait.make_graph(f)(q, k, v)
    assert "attention" in {graph.node(n).prim for n in graph.order}
    torch.testing.assert_close(plait.jit(f, backend="cpp")(q, k, v), f(q, k, v))


# -- NOTE [attention in the kernels' layout] ------------------------------------------------
@pytest.fixture
def cuda_layout(monkeypatch):
    """Attention stored as CUDA's kernels store it, on the CPU too."""
    monkeypatch.setattr(plait.config, "attention_layout", "all")


def _projected_attention(form: str):
    """A model's attention, as transformers and timm write it: one qkv projection, heads split
    by view + transpose, sdpa, heads joined by transpose + reshape; its arguments."""
    g = torch.Generator().manual_seed(4)
    b, m, heads, e = 2, 8, 4, 8
    kv_heads = 2 if form == "gqa" else heads
    keys = 6 if form == "cross" else m
    x, ctx = torch.randn(b, m, heads * e, generator=g), torch.randn(b, keys, heads * e, generator=g)
    wq = torch.randn(heads * e, heads * e, generator=g) / 6
    wkv = torch.randn(heads * e, 2 * kv_heads * e, generator=g) / 6
    mask = torch.randn(1, 1, m, keys, generator=g)

    def fn(x, wq, wkv, mask):
        q = (x @ wq).view(b, m, heads, e).transpose(1, 2)
        k, v = (t.view(b, keys, kv_heads, e).transpose(1, 2)
                for t in ((ctx if form == "cross" else x) @ wkv).chunk(2, -1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=form == "causal",
                                             attn_mask=mask if form == "mask" else None,
                                             enable_gqa=form == "gqa")
        return out.transpose(1, 2).reshape(b, m, heads * e).sin().sum()
    return fn, (x, wq, wkv, mask)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["plain", "causal", "mask", "gqa", "cross"])
def test_attention_stored_as_cudas_kernels_store_it(form, backend, cuda_layout):
    """NOTE [attention in the kernels' layout]: q, k, v, the output and the gradients stored
    [batch, rows, heads, head dim]; the transposes around them cancel with the model's own,
    so the projections' results are the operands and the output is the next product's.
    Values and gradients (the mask's too) against torch.func."""
    fn, args = _projected_attention(form)
    argnums = (0, 1, 2, 3) if form == "mask" else (0, 1, 2)
    step = plait.jit(plait.grad_and_value(fn, argnums), backend=backend)
    graph = step.lower(*args).graph
    nodes = [graph.node(n) for n in graph.order]
    assert [(n.prim, n.kwargs.get("bshd")) for n in nodes if "attention" in n.prim] == \
        [("attention", True), ("attention_backward", True)]
    if form != "gqa":  # (gqa's repeated heads are written by the kernel that repeats them)
        for n in graph.order:
            if "attention" in graph.node(n).prim:
                assert all(graph.node(v.node).prim != "transpose"
                           for v in graph.operands(n)[:5])
    grads, value = step(*args)
    assert_close(value, fn(*args), atol=1e-5, rtol=1e-5)
    assert_close(grads, torch.func.grad(fn, argnums)(*args), atol=1e-5, rtol=1e-5)


def test_attention_so_stored_has_derivatives_of_every_order(cuda_layout):
    q, k, v = (torch.randn(2, 8, 3, 4, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, 1, 8, 8, dtype=torch.float64)

    def loss(sdpa):
        return lambda q, bias: (sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                     bias) ** 2).sum()
    mine = loss(lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b))
    written = loss(lambda q, k, v, b: (q @ k.mT * 0.5 + b).softmax(-1) @ v)
    graph = plait.jit(mine).lower(q, bias).graph
    assert [graph.node(n).kwargs.get("bshd") for n in graph.order
            if graph.node(n).prim == "attention"] == [True]
    for argnum, x in ((0, q), (1, bias)):
        def at(f):
            return lambda x: f(*((x, bias) if argnum == 0 else (q, x)))
        tangent = (torch.ones_like(x),)
        assert_close(plait.hessian(mine, argnum)(q, bias),
                     torch.func.hessian(written, argnum)(q, bias))
        assert_close(plait.jvp(at(mine), (x,), tangent)[1],
                     torch.func.jvp(at(written), (x,), tangent)[1])
    per_example = plait.vmap(plait.grad(mine), (0, None))(torch.stack([q, 2 * q]), bias)
    assert_close(per_example, torch.stack([torch.func.grad(written)(x, bias)
                                           for x in (q, 2 * q)]))


class SelfAttention(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.qkv, self.out = heads, torch.nn.Linear(dim, 3 * dim), \
            torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, m, d = x.shape
        q, k, v = self.qkv(x).view(b, m, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, m, d))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_module_trained_with_attention_so_stored(backend, cuda_layout):
    """loss.backward() through a jitted module (a fused qkv projection split as timm's ViT
    splits it): the joint graph's attention and its backward are stored so too."""
    torch.manual_seed(5)
    model, x = SelfAttention(32, 4), torch.randn(2, 8, 32)
    jitted = plait.jit(copy.deepcopy(model), backend=backend)
    jitted(x).square().sum().backward()
    model(x).square().sum().backward()
    for (name, p), want in zip(jitted.named_parameters(), model.parameters()):
        assert_close(p.grad, want.grad, atol=1e-4, rtol=1e-4, msg=name)


# -- dropout (NOTE [attention dropout]) ---------------------------------------------------
def _dropped(q, k, v, causal, scale, keep, dropout):
    return (plait_nn.attention_scores(q, k, scale, causal).softmax(-1) * keep / (1 - dropout)) @ v


class PlayedFlash:
    """CUDA's flash kernel with dropout played on the CPU, as the real one behaves: the
    forward draws its mask from a generator state taken from torch's generator and returns
    that state (uint64 [2]), the backward replays the mask from the state it is handed.
    ``masks`` holds each forward's mask, ``replayed`` each state a backward was handed."""

    def __init__(self, monkeypatch):
        self.masks, self.replayed = [], []
        monkeypatch.setattr(plait_nn, "_dropout_kernel", lambda q, k, v, mask, p, causal, scale:
                            "flash" if 0 < p < 1 and mask is None else None)
        monkeypatch.setattr(plait_nn, "_cuda_flash", self.forward)
        monkeypatch.setattr(plait_nn, "_cuda_flash_backward", self.backward)

    @staticmethod
    def keep(seed: int, q, k, dropout):
        g = torch.Generator().manual_seed(seed)
        return torch.rand(*q.shape[:-1], k.shape[-2], generator=g) >= dropout

    def forward(self, q, k, v, causal, scale, dropout=0.0):
        seed = int(torch.randint(1 << 62, ()))
        self.masks.append(self.keep(seed, q, k, dropout))
        lse = plait_nn.attention_scores(q, k, scale, causal).logsumexp(-1).float()
        return (_dropped(q, k, v, causal, scale, self.masks[-1], dropout), lse,
                torch.tensor([seed, 0]).to(torch.uint64), torch.tensor(0).to(torch.uint64))

    def backward(self, ct, q, k, v, out, rows, causal, scale, dropout, state):
        self.replayed.append(int(state[0].view(torch.int64)[0]))
        keep = self.keep(self.replayed[-1], q, k, dropout)
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            return torch.autograd.grad(_dropped(*leaves, causal, scale, keep, dropout),
                                       leaves, ct)


def _sdpa_dropout(q, k, v, causal=True):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["none", "all"])  # (NOTE [attention in the kernels' layout])
def test_dropout_runs_in_the_primitive_and_its_backward_replays_the_mask(backend, causal,
                                                                         layout, monkeypatch):
    monkeypatch.setattr(plait.config, "attention_layout", layout)
    flash = PlayedFlash(monkeypatch)
    q, k, v, w = _qkv(2, 2, 16, 8) + [torch.randn(2, 2, 16, 8)]
    loss = lambda q, k, v: (_sdpa_dropout(q, k, v, causal) * w).sum()  # noqa: E731
    step = plait.jit(plait.grad_and_value(loss, argnums=(0, 1, 2)), backend=backend)
    graph = plait.make_graph(plait.grad_and_value(loss, argnums=(0, 1, 2)))(q, k, v)
    assert [graph.node(n).kwargs.get("dropout") for n in graph.order
            if graph.node(n).prim in ("attention", "attention_backward")] == [0.25, 0.25]
    assert "softmax" not in _prims(graph) and "exp" not in _prims(graph)
    compiled = step.lower(q, k, v).graph
    assert {compiled.node(n).kwargs.get("bshd", False) for n in compiled.order
            if "attention" in compiled.node(n).prim} == {layout == "all"}
    for _ in range(2):
        grads, value = step(q, k, v)
        keep = flash.masks[-1]
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        expected = (_dropped(*leaves, causal, q.shape[-1] ** -0.5, keep, 0.25) * w).sum()
        assert_close(value, expected.detach(), atol=1e-5, rtol=1e-5)
        assert_close(grads, torch.autograd.grad(expected, leaves), atol=1e-5, rtol=1e-5)
        assert flash.replayed[-1] != 0 and flash.keep(flash.replayed[-1], q, k, 0.25).equal(keep)
    assert len(flash.masks) == len(flash.replayed) == 2  # (tracing draws none)
    assert not flash.masks[0].equal(flash.masks[1])


def test_dropout_attention_draws_in_program_order_from_torchs_generator(monkeypatch):
    """Two identical calls are two draws (the primitive is effectful, never merged), taken
    from torch's generator: the same seed gives the same masks, another seed others."""
    PlayedFlash(monkeypatch)
    q, k, v = _qkv(2, 2, 16, 8)
    jitted = plait.jit(lambda q, k, v: _sdpa_dropout(q, k, v) - _sdpa_dropout(q, k, v))
    torch.manual_seed(1)
    first = jitted(q, k, v)
    assert first.abs().max() > 0.1
    torch.manual_seed(1)
    assert_close(jitted(q, k, v), first)
    assert not torch.equal(jitted(q, k, v), first)


def test_dropout_attention_in_a_trained_module(monkeypatch):
    """``model.train()`` drops, ``model.eval()`` does not: the training flag is read at every
    call, and the eval call runs no dropout (eager's result exactly)."""
    flash = PlayedFlash(monkeypatch)

    class SelfAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24)

        def forward(self, x):
            q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).movedim(-2, 1).unbind(3)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  dropout_p=0.5 if self.training else 0.0)

    model, x = SelfAttention(), torch.randn(2, 16, 8)
    jitted = plait.jit(model)
    for training in (True, False, True):
        model.train(training)
        drawn, replayed = len(flash.masks), len(flash.replayed)
        got = jitted(x)
        if not training:
            assert_close(got, model(x), atol=1e-6, rtol=1e-6)
        got.sum().backward()
        assert len(flash.masks) == drawn + training
        assert len(flash.replayed) == replayed + training


def test_derivatives_of_dropout_attention_that_need_the_mask_are_refused(monkeypatch):
    PlayedFlash(monkeypatch)
    q, k, v = _qkv(2, 2, 16, 8)
    loss = lambda q: _sdpa_dropout(q, k, v).square().sum()  # noqa: E731
    with pytest.raises(plait.errors.UnsupportedOpError, match="forward-mode.*dropout_p=0"):
        plait.jvp(loss, (q,), (v,))
    with pytest.raises(plait.errors.UnsupportedOpError, match="second derivative"):
        plait.grad(lambda q: plait.grad(loss)(q).sum())(q)
    with pytest.raises(plait.errors.UnsupportedOpError, match="randomness"):
        plait.vmap(loss)(torch.stack([q, q]))
    per_example = plait.vmap(loss, randomness="different")(torch.stack([q, q]))
    assert per_example[0] != per_example[1]
    with plait.config.patch(fuse_attention=False):  # the fix the refusal names
        assert plait.jvp(loss, (q,), (v,))[1].isfinite()


def test_vmapped_gradients_of_dropout_attention_replay_each_examples_mask(monkeypatch):
    """vmap(grad) with independent draws: each example's backward replays its own mask."""
    flash = PlayedFlash(monkeypatch)
    k, v = _qkv(2, 16, 8)[:2]
    queries = torch.randn(3, 2, 16, 8)
    loss = lambda q: _sdpa_dropout(q, k, v).square().sum()  # noqa: E731
    grads = plait.vmap(plait.grad(loss), randomness="different")(queries)
    assert len(flash.masks) == 3 and len(set(flash.replayed)) == 3
    for q, keep, grad in zip(queries, flash.masks, grads):
        leaf = q.clone().requires_grad_()
        expected = _dropped(leaf, k, v, True, 8 ** -0.5, keep.view(2, 16, 16), 0.25)
        assert_close(grad, torch.autograd.grad(expected.square().sum(), leaf)[0],
                     atol=1e-5, rtol=1e-5)


def test_checkpointed_dropout_attention_replays_the_mask_it_drew(monkeypatch):
    """A checkpoint's backward recomputes its body, but the dropout draw is saved (NOTE
    [checkpoint]): the backward replays the forward's mask, drawing none."""
    flash = PlayedFlash(monkeypatch)
    q, k, v = _qkv(2, 2, 16, 8)
    loss = lambda q: plait.checkpoint(_sdpa_dropout)(q, k, v).square().sum()  # noqa: E731
    grad = plait.jit(plait.grad(loss))(q)
    assert len(flash.masks) == 1
    leaf = q.clone().requires_grad_()
    expected = _dropped(leaf, k, v, True, 8 ** -0.5, flash.masks[0], 0.25).square().sum()
    assert_close(grad, torch.autograd.grad(expected, leaf)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.cuda  # torch's CUDA attention kernels
@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_dropout_attention_draws_as_eager(causal, kernel):
    """plait runs the fused kernel eager runs (the one an ``sdpa_kernel`` block allows as the
    call is traced), drawing from torch's CUDA generator where eager draws: after the same
    seed, eager's mask, so eager's output and gradients (to bf16's rounding: plait's
    projections round otherwise), in a module's ``loss.backward()`` (a forward and a
    backward program, the backward outside the block), call after call (the later ones
    replays of CUDA graphs); a mask of its own would differ by about the output's size."""
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[kernel]
    g = torch.Generator(device="cuda").manual_seed(0)
    proj = torch.nn.Linear(64, 3 * 64, device="cuda", dtype=torch.bfloat16)

    class SelfAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = proj

        def forward(self, x):
            q, k, v = self.proj(x).unflatten(-1, (3, 4, 16)).movedim(-2, 1).unbind(3)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=causal)

    def relative(a, b):
        return max(((x.float() - y.float()).norm() / y.float().norm()).item()
                   for x, y in zip(a, b))

    model = SelfAttention()
    x, w = (torch.randn(2, 128, 64, generator=g, device="cuda", dtype=dtype)
            for dtype in (torch.bfloat16, torch.float32))
    w = w.view(2, 128, 4, 16).transpose(1, 2)
    jitted = plait.jit(model)
    for seed in range(5):
        results = []
        for run in (jitted, model):
            torch.manual_seed(seed)
            with torch.nn.attention.sdpa_kernel(backend):
                out = run(x)
            (out.float() * w).sum().backward()
            results.append([out, *(p.grad for p in model.parameters())])
            model.zero_grad(set_to_none=True)
        assert relative(*results) < 2e-2


@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn"])
def test_a_cuda_kernel_torch_picked_is_traced_as_attention(kernel, monkeypatch):
    """Inside ``F.multi_head_attention_forward`` (which a function mode runs whole), torch's
    scaled_dot_product_attention picks a CUDA kernel at the ATen level: traced as plait's
    attention, its output eager's (on the CPU here: the call as torch issues it)."""
    from plait.tracer.trace import Trace

    monkeypatch.setattr(Trace, "issued_by_torch", property(lambda self: True))
    op = getattr(torch.ops.aten, f"_scaled_dot_product_{kernel}_attention").default
    q, k, v = (torch.randn(2, 3, 8, 16) for _ in range(3))
    bias = torch.randn(8, 8)
    extra = () if kernel == "flash" else (None if kernel == "cudnn" else bias, False)

    def f(q, k, v):
        return op(q, k, v, *extra, 0.0, True, scale=0.3)[0]

    mask = None if kernel != "efficient" else bias
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=kernel != "efficient",
                                          scale=0.3) if kernel != "efficient" else \
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask + torch.ones(8, 8).tril().log(),
                                       scale=0.3)
    assert_close(plait.jit(f)(q, k, v), want)
