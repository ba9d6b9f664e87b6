"""Channels-last convolutions (NOTE [channels-last convolutions], passes/layout.py): the
convolutions of a graph run on [N, *spatial, C] values, the transposes between them sink
away, and every result and gradient stays eager's."""
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import plait
from plait.errors import PlaitError
from plait.passes.layout import channels_last


def _conv_bn_relu_conv(x, w1, w2, scale, shift):
    y = F.conv2d(x, w1, padding=1)
    y = F.batch_norm(y, None, None, scale, shift, training=True)
    return F.conv2d(F.relu(y) + y.mean((2, 3), keepdim=True), w2, stride=2, padding=1)


def _args(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, 8, 8, generator=g), torch.randn(6, 3, 3, 3, generator=g),
            torch.randn(4, 6, 3, 3, generator=g), torch.rand(6, generator=g) + 0.5,
            torch.randn(6, generator=g))


def _prims(graph) -> list[str]:
    return [graph.node(n).prim for n in graph.order]


def test_no_transpose_between_the_convolutions():
    args = _args()
    with plait.config.patch(channels_last="all"):
        graph = plait.jit(_conv_bn_relu_conv).lower(*args).graph
    convs = [graph.node(n) for n in graph.order if graph.node(n).prim == "conv"]
    assert len(convs) == 2 and all(c.kwargs["channels_last"] for c in convs)
    # the input moved channels-last and the result back; between them only broadcasts,
    # constants and per-channel statistics are transposed (lowering reads them through the
    # transpose), no activation
    read = [graph.operands(n)[0] for n in graph.order if graph.node(n).prim == "transpose"]
    assert [graph.node(v.node).prim for v in (read[0], read[-1])] == ["input", "conv"]
    assert all(graph.node(v.node).prim in ("broadcast_in_dim", "full")
               or graph.type_of(v).numel <= 6 for v in read[1:-1])
    with plait.config.patch(channels_last="all"):
        assert_close(plait.jit(_conv_bn_relu_conv)(*args), _conv_bn_relu_conv(*args),
                     atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("devices", ["cuda", "none"])
def test_the_cpu_stays_channels_first_where_not_chosen(devices):
    with plait.config.patch(channels_last=devices):
        graph = plait.jit(_conv_bn_relu_conv).lower(*_args()).graph
    assert "transpose" not in _prims(graph)
    assert not any(graph.node(n).kwargs.get("channels_last") for n in graph.order)


CONVS = {
    "strided": lambda x, w: F.conv2d(x, w, stride=2, padding=1),
    "dilated": lambda x, w: F.conv2d(x, w, padding=2, dilation=2),
    "1d": lambda x, w: F.conv1d(x.flatten(2), w[..., 0], padding=1),
    "3d": lambda x, w: F.conv3d(x.unsqueeze(2), w.unsqueeze(2), padding=(0, 1, 1)),
}


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("name", sorted(CONVS))
def test_gradients_match_eager(name, backend):
    """conv_backward on channels-last cotangents."""
    fn = CONVS[name]
    x, w = _args()[:2]

    def loss(x, w):
        return (fn(x, w).sin() * fn(x, w).shape[1]).sum()
    want = torch.func.grad(loss, argnums=(0, 1))(x, w)
    with plait.config.patch(channels_last="all"):
        jitted = plait.jit(plait.grad(loss, argnums=(0, 1)), backend=backend)
        graph = jitted.lower(x, w).graph
        got = jitted(x, w)
    assert {graph.node(n).kwargs.get("channels_last") for n in graph.order
            if graph.node(n).prim in ("conv", "conv_backward")} == {True}
    assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_second_derivatives_match_eager():
    """The written-out VJP of conv_backward, vmapped by the Hessian's forward mode."""
    x, w = (t.double() for t in _args()[:2])

    def loss(x):
        return F.conv2d(x, w, padding=1).tanh().sum()
    with plait.config.patch(channels_last="all"):
        got = plait.jit(plait.hessian(loss))(x)
    assert_close(got, torch.func.hessian(loss)(x))


def test_a_grouped_convolution_keeps_the_graph_channels_first():
    x, w1, w2, scale, shift = _args()

    def fn(x):
        y = F.conv2d(x, w1, padding=1)
        return F.conv2d(y, w1[:, :1], padding=1, groups=6)
    with plait.config.patch(channels_last="all"):
        graph = plait.jit(fn).lower(x).graph
    assert "transpose" not in _prims(graph)
    assert not any(graph.node(n).kwargs.get("channels_last") for n in graph.order)


def test_a_16_bit_grouped_convolution_runs_channels_last_where_its_kernels_are_fast(
        monkeypatch):
    """NOTE [channels-last convolutions]: in bf16 on CUDA (here the CPU stands in for it)
    a depthwise convolution turns with the others; values and gradients as eager's."""
    monkeypatch.setattr(plait.passes.layout, "GROUPED_HALF_DEVICES", frozenset({"cpu"}))
    x, w1 = (t.bfloat16() for t in _args()[:2])
    depthwise = torch.randn(6, 1, 3, 3, generator=torch.Generator().manual_seed(1)).bfloat16()

    def fn(x, w1, depthwise):
        y = F.conv2d(x, w1, padding=1)
        return F.conv2d(F.gelu(y), depthwise, padding=1, groups=6).square().mean()
    with plait.config.patch(channels_last="all"):
        graph = plait.jit(fn).lower(x, w1, depthwise).graph
        got = plait.jit(plait.grad_and_value(fn, argnums=(0, 1, 2)), backend="cpp")(
            x, w1, depthwise)
    convs = [graph.node(n) for n in graph.order if graph.node(n).prim == "conv"]
    assert len(convs) == 2 and all(c.kwargs["channels_last"] for c in convs)
    want = torch.func.grad_and_value(fn, argnums=(0, 1, 2))(x, w1, depthwise)
    assert_close(got[1], want[1], atol=2e-2, rtol=2e-2)
    for mine, eager in zip(got[0], want[0]):
        assert_close(mine, eager, atol=2e-2, rtol=2e-2)
    with plait.config.patch(channels_last="all"):  # float32: channels-first
        graph = plait.jit(fn).lower(x.float(), w1.float(), depthwise.float()).graph
    assert not any(graph.node(n).kwargs.get("channels_last") for n in graph.order)


def test_an_unknown_choice_is_refused():
    graph = plait.jit(_conv_bn_relu_conv).lower(*_args()).graph
    with pytest.raises(PlaitError, match="all, cuda, none"):
        channels_last(graph, "yes")
    with plait.config.patch(channels_last="yes"), \
            pytest.raises(PlaitError, match=r"config.channels_last='yes'.*all, cuda, none"):
        plait.jit(_conv_bn_relu_conv)(*_args())


def test_a_max_pool_between_convolutions_stays_channels_last(monkeypatch):
    """Max pooling's padded windows (pads and strided slices, NOTE [strided max pooling], as
    on CUDA) follow the convolution's layout: no activation is transposed between the
    convolutions, in the forward or the backward."""
    monkeypatch.setattr(plait.tracer.nn, "SCANNED_MAX_POOL_DEVICES", frozenset({"cpu"}))
    def f(x, w1, w2):
        return F.conv2d(F.max_pool2d(F.relu(F.conv2d(x, w1, padding=1)), 3, 2, 1), w2)

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 3, 12, 12, generator=g), torch.randn(8, 3, 3, 3, generator=g),
            torch.randn(4, 8, 3, 3, generator=g))
    loss = lambda *a: f(*a).square().sum()  # noqa: E731
    with plait.config.patch(channels_last="all"):
        step = plait.jit(plait.grad(loss, argnums=(0, 1, 2)))
        graph = step.lower(*args).graph
        got = step(*args)
    transposed = [graph.operands(n)[0] for n in graph.order
                  if graph.node(n).prim == "transpose"]
    assert all(graph.node(v.node).prim in ("input", "conv_backward", "full",
                                           "broadcast_in_dim") or
               graph.type_of(v).numel <= 8 * 9 for v in transposed), \
        [(graph.node(v.node).prim, graph.type_of(v)) for v in transposed]
    for a, b in zip(got, torch.func.grad(loss, argnums=(0, 1, 2))(*args)):
        assert_close(a, b, atol=1e-4, rtol=1e-4)
