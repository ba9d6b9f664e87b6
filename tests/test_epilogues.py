"""Bias epilogues (NOTE [bias epilogues], passes/epilogues.py): a product's bias that only
attention reads is added by the product's library call, and attention reads its heads as
views of that result; results and gradients stay eager's."""
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import plait
from plait.graph.loops import Extern, Kernel

torch.manual_seed(0)
W, B = torch.randn(64, 192) * 0.1, torch.randn(192)
WQ, BQ = torch.randn(64, 64) * 0.1, torch.randn(64)


def heads(t):
    return t.view(2, 16, 4, 16).transpose(1, 2)


def fused_qkv(x):
    """ViT's projection: one linear, cut into q, k and v along a dim of its own."""
    q, k, v = F.linear(x, W.t(), B).view(2, 16, 3, 4, 16).permute(2, 0, 3, 1, 4).unbind(0)
    return F.scaled_dot_product_attention(q, k, v) * 2


def split_qkv(x):
    """GPT-2's: ``addmm`` split along the features."""
    q, k, v = torch.addmm(B, x.view(-1, 64), W).view(2, 16, 192).split(64, dim=2)
    return F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True) * 2


def three_linears(x):
    """BERT's: a linear each."""
    q, k, v = (heads(F.linear(x, w, BQ)) for w in (WQ, WQ.t(), WQ * 2))
    return F.scaled_dot_product_attention(q, k, v) * 2


def _program(f, *args):
    return plait.jit(f, backend="cpp").lower(*args).compiled.program


@pytest.mark.parametrize("layout", ["none", "all"])  # NOTE [attention in the kernels' layout]
@pytest.mark.parametrize("f", [fused_qkv, split_qkv, three_linears])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reads_its_heads_where_the_product_and_its_bias_wrote_them(
        f, dtype, layout, monkeypatch):
    monkeypatch.setattr(plait.config, "attention_layout", layout)
    monkeypatch.setattr(plait.config, "bias_epilogues", "all")
    x = torch.randn(2, 16, 64, dtype=dtype)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        program = _program(f, x)
        got, want = plait.jit(f, backend="cpp")(x), f(x)
    externs = [k.fn.prim for k in program.kernels if isinstance(k, Extern)]
    assert externs.count("dot_bias") == (3 if f is three_linears else 1)
    assert "dot_general" not in externs
    # no kernel between the products and attention: no kernel adds a bias, none copies heads
    described = [line for k in program.kernels if isinstance(k, Kernel)
                 for line in program.describe(k)]
    assert described and not any(op in line for line in described
                                 for op in ("addmm", "linear", "unbind", "split"))
    # rounded once, as eager's addmm: equal to eager's, not merely close
    assert_close(got, want, atol=1e-6 if dtype == torch.float32 else 0, rtol=1e-6)


def test_a_sum_another_product_reads_is_added_by_its_product(monkeypatch):
    monkeypatch.setattr(plait.config, "bias_epilogues", "all")
    x, w2 = torch.randn(32, 64), torch.randn(16, 192)
    f = lambda x: F.linear(F.linear(x, W.t(), B), w2)  # noqa: E731
    externs = [k.fn.prim for k in _program(f, x).kernels if isinstance(k, Extern)]
    assert externs == ["dot_bias", "dot_general"]
    assert_close(plait.jit(f, backend="cpp")(x), f(x))


def test_a_sum_read_by_anything_else_keeps_its_add(monkeypatch):
    """An output, an elementwise reader or a product read twice: the add stays (an
    elementwise kernel writes it anyway), and a training step's forward, which saves the
    heads for its backward, is unchanged; gradients are eager's."""
    monkeypatch.setattr(plait.config, "bias_epilogues", "all")
    x = torch.randn(2, 16, 64)
    returned = lambda x: (fused_qkv(x), F.linear(x, W.t(), B))  # noqa: E731
    activated = lambda x: F.gelu(F.linear(x, W.t(), B))  # noqa: E731
    for f in (returned, activated):
        externs = [k.fn.prim for k in _program(f, x).kernels if isinstance(k, Extern)]
        assert "dot_general" in externs and "dot_bias" not in externs[1:]
        assert_close(plait.jit(f, backend="cpp")(x), f(x))
    x.requires_grad_()
    got = torch.autograd.grad(plait.jit(fused_qkv, backend="cpp")(x).sum(), x)
    assert_close(got, torch.autograd.grad(fused_qkv(x).sum(), x))


def test_only_on_the_devices_configured(monkeypatch):
    x = torch.randn(2, 16, 64)
    externs = [k.fn.prim for k in _program(fused_qkv, x).kernels if isinstance(k, Extern)]
    assert plait.config.bias_epilogues == "cuda" and "dot_bias" not in externs
    monkeypatch.setattr(plait.config, "bias_epilogues", "everywhere")
    with pytest.raises(plait.PlaitError, match="bias_epilogues='everywhere'"):
        _program(fused_qkv, x)
