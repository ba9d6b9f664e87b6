"""Neural-network ops (tracer/nn.py): results against eager, and graphs free of opaque nodes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import plait
from plait.errors import PlaitError

nan = float("nan")


def check(fn, *args, **close):
    """fn under plait.jit equals eager, and its graph has no opaque node."""
    jitted = plait.jit(fn)
    assert_close(jitted(*args), fn(*args), equal_nan=True, **close)
    graph = jitted.lower(*args).graph
    opaque = [graph.node(n).kwargs["op"] for n in graph.nx.nodes
              if graph.node(n).prim == "opaque"]
    assert not opaque, opaque


def randn(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


# ---------------------------------------------------------------------------------------
# Convolution
# ---------------------------------------------------------------------------------------
CONV_CASES = [dict(), dict(stride=2), dict(padding=1), dict(padding=2, dilation=2),
              dict(stride=3, padding=1), dict(groups=2),
              dict(stride=2, padding=1, dilation=2, groups=2), dict(padding="same"),
              dict(padding="valid", stride=1)]


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("kwargs", CONV_CASES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_conv(nd, kwargs, bias):
    conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    x, w = randn(2, 4, *[7 - d for d in range(nd)]), randn(6, 4 // kwargs.get("groups", 1),
                                                          *[3] * nd)
    b = randn(6) if bias else None
    check(lambda x, w, b: conv(x, w, b, **kwargs), x, w, b)


TRANSPOSE_CASES = [dict(), dict(stride=2), dict(stride=2, padding=1, output_padding=1),
                   dict(padding=2, dilation=2), dict(groups=2, stride=3, dilation=2),
                   dict(stride=2, padding=3)]  # padding beyond the kernel: negative pads


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("kwargs", TRANSPOSE_CASES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_conv_transpose(nd, kwargs, bias):
    conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
    x, w = randn(2, 4, *[5 - d for d in range(nd)]), randn(4, 3, *[3] * nd)
    b = randn(3 * kwargs.get("groups", 1)) if bias else None
    check(lambda x, w, b: conv(x, w, b, **kwargs), x, w, b)


def test_conv_unbatched_and_module():
    conv = torch.nn.Conv2d(3, 5, 3, stride=2, padding=1, bias=True)
    check(lambda x: conv(x), randn(3, 9, 8))


def test_conv_shape_errors_are_plait_errors():
    with pytest.raises(PlaitError):
        plait.jit(F.conv2d)(randn(1, 4, 5, 5), randn(6, 3, 3, 3))  # channels do not match
    with pytest.raises(PlaitError):
        plait.jit(F.conv2d)(randn(1, 4, 2, 2), randn(6, 4, 3, 3))  # input smaller than kernel
    # as eager refuses them, also where the convolution would be a product (NOTE
    # [convolutions as products]): a tiling kernel larger than the input, an empty input
    with pytest.raises(PlaitError):
        plait.jit(lambda x, w: F.conv2d(x, w, stride=2))(randn(1, 4, 1, 1), randn(6, 4, 2, 2))
    with pytest.raises(PlaitError):
        plait.jit(F.conv2d)(torch.randn(1, 4, 0, 3), randn(6, 4, 1, 1))


def check_grad(fn, *args):
    """plait.grad of sum(fn(*args) * a fixed cotangent) equals torch.func.grad's, for every
    argument."""
    ct = randn(*fn(*args).shape)
    loss = lambda *a: (fn(*a) * ct).sum()
    argnums = tuple(range(len(args)))
    assert_close(plait.grad(loss, argnums=argnums)(*args),
                 torch.func.grad(loss, argnums=argnums)(*args), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("kwargs", CONV_CASES, ids=str)
def test_conv_grad(nd, kwargs):
    conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    x, w = randn(2, 4, *[7 - d for d in range(nd)]), randn(6, 4 // kwargs.get("groups", 1),
                                                          *[3] * nd)
    check_grad(lambda x, w, b: conv(x, w, b, **kwargs), x, w, randn(6))


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("kwargs", TRANSPOSE_CASES, ids=str)
def test_conv_transpose_grad(nd, kwargs):
    conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
    x, w = randn(2, 4, *[5 - d for d in range(nd)]), randn(4, 3, *[3] * nd)
    check_grad(lambda x, w, b: conv(x, w, b, **kwargs), x, w, randn(3 * kwargs.get("groups", 1)))


def test_conv_grad_of_grad():
    """The conv VJP is itself made of convs, so it differentiates again."""
    x, w, v = randn(2, 4, 7, 6), randn(6, 2, 3, 3), randn(2, 4, 7, 6)

    def inner(grad):
        loss = lambda x, w: (F.conv2d(x, w, stride=2, padding=2, dilation=2, groups=2) ** 2).sum()
        return lambda x, w: (grad(loss)(x, w) * v).sum()  # d loss/dx, projected on v

    assert_close(plait.grad(inner(plait.grad), argnums=(0, 1))(x, w),
                 torch.func.grad(inner(torch.func.grad), argnums=(0, 1))(x, w),
                 rtol=1e-4, atol=1e-5)


def test_conv_backward_without_the_input_gradient():
    """A first layer's input gradient (its images') is not computed: the conv_backward that
    nothing reads d_lhs of computes the kernel's alone, whose own derivatives are still
    eager's."""
    from plait.tracer.trace import bind

    x, w, ct, v = (t.double() for t in (randn(2, 3, 8, 8), randn(4, 3, 3, 3),
                                        randn(2, 4, 8, 8), randn(4, 3, 3, 3)))
    loss = lambda w, x: F.conv2d(x, w, padding=1).tanh().sum()  # noqa: E731
    jitted = plait.jit(plait.grad(loss))
    graph = jitted.lower(w, x).graph
    (node,) = [graph.node(n) for n in graph.order if graph.node(n).prim == "conv_backward"]
    assert node.kwargs["lhs_grad"] is False and len(node.out_types) == 1
    assert_close(jitted(w, x), torch.func.grad(loss)(w, x))

    def projected(w, x, ct):  # the kernel's gradient alone, projected on v
        (d_rhs,) = bind("conv_backward", ct, x, w, window_strides=(1, 1),
                        padding=((1, 1), (1, 1)), lhs_dilation=(1, 1), rhs_dilation=(1, 1),
                        feature_group_count=1, lhs_grad=False)
        return (d_rhs * v).sum()

    def projected_eager(w, x, ct):
        return (torch.func.grad(lambda w: (F.conv2d(x, w, padding=1) * ct).sum())(w) * v).sum()
    assert_close(plait.grad(projected, argnums=(0, 1, 2))(w, x, ct),
                 torch.func.grad(projected_eager, argnums=(0, 1, 2))(w, x, ct))


def test_conv_primitive_vjp_all_params():
    """Input dilation, negative padding and groups together, which the torch front ends
    never emit at once: the rule against autograd through the primitive's implementation."""
    from plait.tracer.nn import _conv_impl
    from plait.tracer.trace import bind

    params = dict(window_strides=(2, 3), padding=((-2, 3), (3, -1)), lhs_dilation=(3, 2),
                  rhs_dilation=(2, 1), feature_group_count=3)
    x, w = randn(2, 6, 5, 4).double(), randn(9, 2, 2, 3).double()
    ct = randn(*_conv_impl(x, w, **params).shape).double()
    got = plait.grad(lambda x, w: (bind("conv", x, w, **params) * ct).sum(),
                     argnums=(0, 1))(x, w)
    x, w = x.requires_grad_(), w.requires_grad_()
    assert_close(got, torch.autograd.grad((_conv_impl(x, w, **params) * ct).sum(), (x, w)))


@pytest.mark.parametrize("in_dims", [(0, None), (None, 0), (0, 0)])
def test_conv_vmap_batches_examples_or_kernels(in_dims):
    x, w = randn(2, 4, 9, 9), randn(6, 2, 3, 3)
    args = [randn(3, *a.shape) if d == 0 else a for a, d in zip((x, w), in_dims)]
    conv = lambda x, w: F.conv2d(x, w, padding=1, stride=2, groups=2)  # noqa: E731
    graph = plait.make_graph(plait.vmap(conv, in_dims=in_dims))(*args)
    assert sum(graph.node(n).prim == "conv" for n in graph.order) == 1  # not one per example
    assert_close(plait.vmap(conv, in_dims=in_dims)(*args),
                 torch.func.vmap(conv, in_dims=in_dims)(*args))


def _prims_of(fn, *args) -> list[str]:
    graph = plait.jit(fn).lower(*args).graph
    return [graph.node(n).prim for n in graph.order]


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("kernel, stride", [(1, 1), (1, 2), (2, 2), (3, 3)])
def test_a_pointwise_or_patch_conv_is_a_matrix_product(nd, kernel, stride):
    """NOTE [convolutions as products]: 1x1 kernels, strided or not, and kernels that tile
    the input (7 = 3 * 2 + 1: the remainder left out); results and gradients against
    eager."""
    conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    x, w, b = randn(2, 4, *[7 - d for d in range(nd)]), randn(6, 4, *[kernel] * nd), randn(6)
    f = lambda x, w, b: conv(x, w, b, stride=stride)  # noqa: E731
    check(f, x, w, b)
    check_grad(f, x, w, b)
    prims = _prims_of(f, x, w, b)
    assert "dot_general" in prims and "conv" not in prims


def test_a_conv_stays_a_convolution_where_not_chosen(monkeypatch):
    from plait.tracer import nn

    monkeypatch.setattr(nn, "CONV_AS_PRODUCT_DEVICES", frozenset())
    x, w = randn(2, 4, 5, 5), randn(6, 4, 1, 1)
    assert "conv" in _prims_of(F.conv2d, x, w)
    # and where padded, grouped, or its windows overlap or skip pixels, it is a
    # convolution on every device
    monkeypatch.undo()
    assert "conv" in _prims_of(lambda x, w: F.conv2d(x, w, padding=1), x, w)
    assert "conv" in _prims_of(lambda x, w: F.conv2d(x, w[:, :2], groups=2), x, w)
    w3 = randn(6, 4, 3, 3)
    assert "conv" in _prims_of(lambda x, w: F.conv2d(x, w, stride=2), x, w3)
    assert "conv" in _prims_of(lambda x, w: F.conv2d(x, w, stride=3, dilation=2), x, w3)


@pytest.mark.parametrize("in_dims", [(0, None), (None, 0), (0, 0)])
def test_a_pointwise_conv_vmaps_and_differentiates_twice(in_dims):
    x, w = randn(2, 4, 6, 6), randn(5, 4, 1, 1)
    args = [randn(3, *a.shape) if d == 0 else a for a, d in zip((x, w), in_dims)]
    conv = lambda x, w: F.conv2d(x, w, stride=2).tanh()  # noqa: E731
    assert_close(plait.vmap(conv, in_dims=in_dims)(*args),
                 torch.func.vmap(conv, in_dims=in_dims)(*args))
    loss = lambda x, w: conv(x, w).pow(2).sum()  # noqa: E731
    assert_close(plait.hessian(loss)(x.double(), w.double()),
                 torch.func.hessian(loss)(x.double(), w.double()))


def test_conv_hessian_with_respect_to_its_input():
    """jacfwd over jacrev: 324 basis vectors vmapped through the convolution's backward."""
    x, w = randn(1, 4, 9, 9).double(), randn(4, 1, 3, 3).double()
    f = lambda x: F.conv2d(x, w, padding=1, groups=4).tanh().sum()  # noqa: E731
    assert_close(plait.hessian(f)(x), torch.func.hessian(f)(x))


# ---------------------------------------------------------------------------------------
# Pooling
# ---------------------------------------------------------------------------------------
AVG_CASES = [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1),
             dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
             dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
             dict(kernel_size=2, stride=3, ceil_mode=True), dict(kernel_size=3, padding=1,
                                                                   divisor_override=2)]


@pytest.mark.parametrize("nd, kwargs", [  # avg_pool1d has no divisor_override
    (nd, kwargs) for nd in (1, 2, 3) for kwargs in AVG_CASES
    if nd > 1 or "divisor_override" not in kwargs], ids=str)
def test_avg_pool(nd, kwargs):
    pool = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[nd - 1]
    check(lambda x: pool(x, **kwargs), randn(2, 3, *[8 - d for d in range(nd)]))


def test_avg_pool_integers_truncate():
    check(lambda x: F.avg_pool2d(x, 3, stride=2, padding=1), torch.arange(-30, 40).reshape(
        1, 2, 5, 7))


MAX_CASES = [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1, dilation=2),
             dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)]


@pytest.fixture(params=["tables", "scanned"])
def max_pool_path(request, monkeypatch):
    """Both ways max pooling is traced (NOTE [strided max pooling]): window tables (the CPU's)
    and the entry-by-entry scan (CUDA's), here on the CPU."""
    if request.param == "scanned":
        monkeypatch.setattr(plait.tracer.nn, "SCANNED_MAX_POOL_DEVICES", frozenset({"cpu"}))
    return request.param


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("kwargs", MAX_CASES, ids=str)
def test_max_pool_indices(nd, kwargs, max_pool_path):
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[nd - 1]
    check(lambda x: pool(x, return_indices=True, **kwargs), randn(2, 3, *[8 - d for d in
                                                                            range(nd)]))


def test_max_pool_ties_nan_and_inf_like_eager(max_pool_path):
    """First max wins; the last NaN wins over everything; an all -inf window indexes its
    first position inside the input."""
    x = torch.tensor([[[1., 3, 3, 2, nan, 0, nan, 5, -1]]])
    check(lambda x: F.max_pool1d(x, 3, stride=1, padding=1, return_indices=True), x)
    check(lambda x: F.adaptive_max_pool1d(x, 4, return_indices=True), x)
    inf = torch.full((1, 1, 4, 4), -float("inf"))
    check(lambda x: F.max_pool2d(x, 3, stride=1, padding=1, return_indices=True), inf)
    x = randn(1, 2, 6, 6)
    x[0, 0, 1, 1] = x[0, 0, 0, 2] = x[0, 1, 4, 4] = nan
    check(lambda x: F.max_pool2d(x, 3, stride=2, return_indices=True), x)
    check(lambda x: F.adaptive_max_pool2d(x, (1, 4), return_indices=True), x)


@pytest.mark.parametrize("pool", [
    lambda x: F.max_pool2d(x, 2),
    lambda x: F.max_pool2d(x, 3, stride=1, padding=1),
    lambda x: F.adaptive_max_pool2d(x, (3, 2)),
    lambda x: F.max_pool1d(x.flatten(2), 4, stride=2),
], ids=["max2", "max3s1p1", "adaptive_max", "max1d"])
def test_max_pool_gradient_goes_to_the_first_of_tied_maxima(pool, max_pool_path):
    """Tied maxima (integers, here): eager's gradient goes to the position its index names,
    the first, not shared among them."""
    x = torch.randint(0, 3, (2, 3, 6, 5), generator=torch.Generator().manual_seed(0)).float()
    loss = lambda x: (pool(x) * (1 + torch.arange(pool(x).shape[-1]) / 8)).sum()  # noqa: E731
    leaf = x.clone().requires_grad_()
    want, = torch.autograd.grad(loss(leaf), leaf)
    assert_close(plait.jit(plait.grad(loss))(x), want, rtol=0, atol=0)
    module = leaf.detach().clone().requires_grad_()
    plait.jit(loss)(module).backward()
    assert_close(module.grad, want, rtol=0, atol=0)


@pytest.mark.parametrize("pool", [
    lambda x: F.max_pool2d(x, 3, stride=2, padding=1),
    lambda x: F.max_pool2d(x, 2, stride=1, dilation=2, ceil_mode=True),
    lambda x: F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False),
    lambda x: F.adaptive_max_pool2d(x, (4, 3)),
    lambda x: F.max_pool1d(x.flatten(2), 5, stride=3),
], ids=["max3s2p1", "max_dilated_ceil", "avg", "adaptive_max", "max1d"])
def test_pooling_gradients_gather_back(pool, max_pool_path):
    """A pooling's gradient equals torch.autograd's, and gathers the windows' cotangents
    back through the inverse of its static window tables: no scatter."""
    x = randn(2, 3, 11, 9)
    loss = lambda x: (pool(x) * (1 + torch.arange(pool(x).shape[-1]) / 8)).sum()
    leaf = x.clone().requires_grad_()
    want, = torch.autograd.grad(loss(leaf), leaf)
    grad = plait.jit(plait.grad(loss))
    assert_close(grad(x), want)
    graph = grad.lower(x).traced.graph
    assert "scatter" not in {graph.node(n).prim for n in graph.order}


def test_gather_back_keeps_scatter_for_many_readers():
    """A static table where one position has more readers than the gather-back limit keeps
    the scatter (a gather back would read every position that many times)."""
    x = randn(3, 4)
    table = torch.tensor([0] * 20 + [1, 2])
    loss = lambda x: (x.index_select(0, table) * torch.arange(22.0)[:, None]).sum()
    leaf = x.clone().requires_grad_()
    want, = torch.autograd.grad(loss(leaf), leaf)
    grad = plait.jit(plait.grad(loss))
    assert_close(grad(x), want)
    graph = grad.lower(x).traced.graph
    assert "scatter" in {graph.node(n).prim for n in graph.order}


def test_gather_back_needs_a_table_as_long_as_the_index():
    """A one-entry table broadcast along the gathered dim picks that entry at every
    position: its cotangents all land there (the scatter), not just the first one's."""
    from plait.tracer.trace import bind

    x, w = randn(5, 3), torch.arange(1.0, 13.0).reshape(4, 3)

    def loss(x):
        one = bind("reshape", torch.tensor([[2]]), shape=(1,))
        index = bind("broadcast_in_dim", one, shape=(4, 3), broadcast_dimensions=(0,))
        return (bind("gather", x, index, dim=0) * w).sum()

    want = torch.zeros(5, 3)
    want[2] = w.sum(0)
    assert_close(plait.grad(loss)(x), want)


@pytest.mark.parametrize("size", [1, 3, (2, 5), 4])
def test_adaptive_pools(size):
    x = randn(2, 3, 7, 9)
    check(lambda x: F.adaptive_max_pool2d(x, size, return_indices=True), x)
    check(lambda x: F.adaptive_avg_pool2d(x, size), x)
    check(lambda x: F.adaptive_max_pool1d(x[0], size if isinstance(size, int) else 3,
                                          return_indices=True), x)
    x3 = randn(2, 7, 5, 9)
    check(lambda x: F.adaptive_avg_pool3d(x, size if isinstance(size, int) else (2, 3, 4)), x3)
    check(lambda x: F.adaptive_max_pool3d(x, size if isinstance(size, int) else (2, 3, 4),
                                          return_indices=True), x3)


def test_pool_errors_are_plait_errors():
    with pytest.raises(PlaitError):  # padding more than half the kernel
        plait.jit(lambda x: F.avg_pool2d(x, 2, padding=2))(randn(1, 1, 6, 6))
    with pytest.raises(PlaitError):
        plait.jit(lambda x: F.max_pool2d(x, 2))(randn(6, 6))


# ---------------------------------------------------------------------------------------
# Normalization
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("affine", [False, True])
def test_group_norm(affine):
    x = randn(3, 6, 4, 5)
    w, b = (randn(6), randn(6)) if affine else (None, None)
    check(lambda x, w, b: F.group_norm(x, 3, w, b, eps=1e-3), x, w, b)
    check(lambda x, w, b: torch.native_group_norm(x, w, b, 3, 6, 20, 2, 1e-5), x, w, b)


@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 5), (2, 4, 3, 5), (2, 4, 3, 2, 2)])
@pytest.mark.parametrize("affine", [False, True])
def test_batch_norm_training_gradients(shape, affine):
    """Training-mode BatchNorm differentiates by PyTorch's formula (aten.BatchNormRule),
    first and second derivatives, with and without weight and bias."""
    x = randn(*shape).double()
    w, b = (randn(shape[1]).double() + 2, randn(shape[1]).double()) if affine else (None, None)
    fn = lambda x, w=None, b=None: F.batch_norm(x, None, None, w, b, training=True)  # noqa: E731
    check_grad(fn, x, *((w, b) if affine else ()))
    ct = randn(*shape).double()
    loss = lambda x: (fn(x, w, b).sin() * ct).sum()  # noqa: E731
    assert_close(plait.hessian(loss)(x), torch.func.hessian(loss)(x))


def test_batch_norm_backward_reads_its_input_twice():
    """Two kernels: the statistics then the cotangent's two sums (one reduction kernel), and
    the input's gradient (the relu's mask recomputed in both); differentiating the
    decomposition summed the mean's zero share through the variance in a third. Half
    precision is computed at float32, as eager does."""
    x, g = randn(4, 16, 12, 12), randn(4, 16, 12, 12)
    w, b = randn(16) + 2, randn(16)

    def loss(x, w, b):
        return (F.relu(F.batch_norm(x, None, None, w, b, training=True)) * g).sum()
    lowered = plait.jit(plait.grad(loss, argnums=(0, 1, 2)), backend="cpp").lower(x, w, b)
    assert lowered.stats["kernels"] == 2
    assert_close(plait.jit(plait.grad(loss, argnums=(0, 1, 2)), backend="cpp")(x, w, b),
                 torch.func.grad(loss, argnums=(0, 1, 2))(x, w, b), rtol=1e-4, atol=1e-4)
    for half in (torch.bfloat16, torch.float16):
        xh = x.to(half)
        got = plait.jit(plait.grad(loss, argnums=(0, 1, 2)))(xh, w, b)
        want = torch.func.grad(loss, argnums=(0, 1, 2))(xh, w, b)
        assert got[0].dtype == half
        assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_local_response_norm():
    check(lambda x: F.local_response_norm(x, 3), randn(2, 6, 5, 4))
    check(lambda x: F.local_response_norm(x, 2, k=2.0), randn(2, 6, 5, 4, 3))


# ---------------------------------------------------------------------------------------
# Contractions and distances
# ---------------------------------------------------------------------------------------
def test_bilinear():
    check(lambda a, b, w, bias: F.bilinear(a, b, w, bias), randn(4, 3), randn(4, 5),
          randn(6, 3, 5), randn(6))
    check(lambda a, b, w: F.bilinear(a, b, w), randn(2, 4, 3), randn(2, 4, 5), randn(6, 3, 5))


def test_addbmm():
    x, b1, b2 = randn(3, 5), randn(4, 3, 2), randn(4, 2, 5)
    check(lambda x, b1, b2: torch.addbmm(x, b1, b2), x, b1, b2)
    check(lambda x, b1, b2: torch.addbmm(x, b1, b2, beta=0.5, alpha=2), x, b1, b2)
    check(lambda x, b1, b2: torch.addbmm(x, b1, b2, beta=0), torch.full((3, 5), nan), b1, b2)


@pytest.mark.parametrize("fn, shapes", [
    (torch.addmm, [(5,), (3, 4), (4, 5)]),
    (lambda x, a, b: torch.addmm(x, a, b, beta=0.5, alpha=2.0), [(5,), (3, 4), (4, 5)]),
    (torch.addmv, [(3,), (3, 4), (4,)]),
    (lambda x, a, b: torch.baddbmm(x, a, b, alpha=-1.0), [(2, 3, 5), (2, 3, 4), (2, 4, 5)]),
    (lambda x, a, b: F.linear(a, b.mT, x), [(5,), (2, 3, 4), (4, 5)]),
    (torch._addmm_activation, [(5,), (3, 4), (4, 5)]),  # addmm then relu (inductor's op)
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_plus_keep_the_operands_dtype(fn, shapes, dtype):
    """addmm and kin: the product in the operands' dtype (a bf16 GEMM, as eager's BLAS call),
    not the float32 one of torch's decompositions; the sum rounded to bf16 once more than
    eager's fused epilogue, so within a bf16 unit or two."""
    x, a, b = (randn(*s).to(dtype) for s in shapes)
    check(fn, x, a, b, **({} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.02}))
    graph = plait.jit(fn).lower(x, a, b).graph
    dots = [n for n in graph.nx.nodes if graph.node(n).prim == "dot_general"]
    assert dots and all(t.dtype == dtype for n in dots for t in graph.node(n).out_types)


def test_addmm_of_mixed_dtypes_is_refused():
    x, a, b = randn(5).double(), randn(3, 4), randn(4, 5)
    with pytest.raises(PlaitError, match="one dtype"):
        plait.jit(torch.addmm)(x, a, b)


@pytest.mark.parametrize("p", [0.0, 1.0, 2.0, 3.5, float("inf")])
@pytest.mark.parametrize("rows", [(4, 6), (30, 7)])  # eager uses a matmul past 25 rows
def test_cdist_and_pdist(p, rows):
    x1, x2 = randn(2, rows[0], 5), randn(rows[1], 5)
    check(lambda a, b: torch.cdist(a, b, p), x1, x2, rtol=1e-4, atol=1e-5)
    check(lambda a: F.pdist(a, p), x1[0], rtol=1e-4, atol=1e-5)
    check(lambda a, b: torch.cdist(a, b, p), x1[:, :0], x2)


@pytest.mark.parametrize("mode", ["donot_use_mm_for_euclid_dist", "use_mm_for_euclid_dist"])
def test_cdist_compute_mode(mode):
    check(lambda a, b: torch.cdist(a, b, compute_mode=mode), randn(3, 4), randn(5, 4),
          rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------
# embedding_bag and anti-aliased resampling
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_embedding_bag(mode, padding_idx, include_last_offset):
    w = randn(10, 3)
    w[4, 1] = w[5, 0] = nan  # max keeps the bag's first row, then strictly greater ones
    i, o = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 5]), torch.tensor([0, 3, 3, 6])
    psw = randn(9) if mode == "sum" else None
    check(lambda w, i, o, psw: F.embedding_bag(
        i, w, o, mode=mode, per_sample_weights=psw, padding_idx=padding_idx,
        include_last_offset=include_last_offset), w, i, o, psw)
    # every output of the ATen op, its quirks included
    check(lambda w, i, o: torch.ops.aten._embedding_bag(
        w, i, o, False, ("sum", "mean", "max").index(mode), False, None, include_last_offset,
        -1 if padding_idx is None else padding_idx), w, i, o)


def test_embedding_bag_2d_and_max_norm():
    w = randn(10, 4)
    check(lambda w, i: F.embedding_bag(i, w.clone(), mode="mean", max_norm=1.0), w,
          torch.tensor([[1, 2, 3], [4, 4, 9]]))


def test_embedding_grads_follow_eager_backward():
    """Eager's backward drops padding rows, scales by frequency if asked (embedding_bag's
    with its indexing quirk), and passes 'mean' bags' cotangents to rows past the last
    offset, which the forward leaves out."""
    w, i = randn(10, 4), torch.tensor([[1, 2, 2], [4, 2, 1]])
    for kwargs in (dict(padding_idx=2), dict(scale_grad_by_freq=True),
                   dict(padding_idx=1, scale_grad_by_freq=True)):
        check_grad(lambda w: F.embedding(i, w, **kwargs), w)
    i, o = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 5]), torch.tensor([0, 3, 3, 6])
    for kwargs in (dict(mode="sum", scale_grad_by_freq=True),
                   dict(mode="mean", scale_grad_by_freq=True, padding_idx=4),
                   dict(mode="mean", include_last_offset=True)):
        check_grad(lambda w: F.embedding_bag(i, w, o, **kwargs), w)
    check_grad(lambda w, psw: F.embedding_bag(i, w, o, mode="sum", per_sample_weights=psw,
                                              scale_grad_by_freq=True), w, randn(9))


def test_sparse_embedding_grad_is_refused():
    i = torch.tensor([1, 2, 2])
    with pytest.raises(PlaitError, match="sparse"):
        plait.grad(lambda w: F.embedding(i, w, sparse=True).sum())(randn(5, 3))
    check(lambda w: F.embedding(i, w, sparse=True), randn(5, 3))  # the forward is fine


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("size", [(3, 5), (13, 17)])
def test_interpolate_antialias(mode, size):
    x = randn(2, 3, 7, 9)
    check(lambda x: F.interpolate(x, size=size, mode=mode, antialias=True), x)
    check(lambda x: F.interpolate(x, scale_factor=0.6, mode=mode, antialias=True,
                                  align_corners=True), x)


def test_group_norm_errors_are_plait_errors():
    with pytest.raises(PlaitError):
        plait.jit(lambda x: torch.native_group_norm(x, None, None, 2, 6, 2, 4, 1e-5))(
            randn(2, 6, 2))


@pytest.mark.parametrize("cls", [pytest.param(torch.nn.LSTM, marks=pytest.mark.slow),  # 15 s
                                 pytest.param(torch.nn.GRU, marks=pytest.mark.slow), torch.nn.RNN])
def test_recurrent_layers_grad_and_jit_match_torch_func(cls):
    """Their C++ composites write into views of tensors they just made (the gates of a
    step): a rebind, since no other alias of those is alive (``TracerTensor._aliases``)."""
    torch.manual_seed(0)
    m = cls(4, 8, num_layers=2, batch_first=True, bidirectional=True)
    x = torch.randn(3, 5, 4)
    params = {k: v.detach() for k, v in m.named_parameters()}
    f = lambda p, a: torch.func.functional_call(m, p, (a,))[0].pow(2).sum()  # noqa: E731
    want = torch.func.grad(f)(params, x)
    for got in (plait.grad(f)(params, x), plait.jit(plait.grad(f), backend="cpp")(params, x)):
        for k in want:
            torch.testing.assert_close(got[k], want[k], msg=k)
    torch.testing.assert_close(plait.jit(m, backend="cpp")(x)[0], m(x)[0])


def test_cross_entropy_gradient_reads_the_logits_as_eager_formulas_do():
    """The target's cotangent is a select (iota == target), not a scatter into a zero buffer
    of the logits' size, and log_softmax's max is a constant to derivatives (no counting of
    its ties): the backward fuses into the pass over the logits."""
    x, t = torch.randn(4, 10), torch.randint(0, 10, (4,))
    loss = lambda a: F.cross_entropy(a, t)  # noqa: E731
    assert_close(plait.grad(loss)(x), torch.func.grad(loss)(x))
    graph = plait.make_graph(plait.grad(loss))(x)
    prims = [graph.node(n).prim for n in graph.order]
    assert "scatter" not in prims
    for n in graph.order:
        if graph.node(n).prim == "amax":
            users = set(graph.users(n))
            while any(graph.node(u).prim == "broadcast_in_dim" for u in users):
                users = {v for u in users for v in (graph.users(u) if graph.node(u).prim
                                                    == "broadcast_in_dim" else [u])}
            assert "eq" not in {graph.node(u).prim for u in users}  # no ties counted


_ON_META = {  # (function, input shape) traced on a device other than the CPU's
    "max_pool2d": (lambda x: F.max_pool2d(x, 3, 2, 1), (2, 3, 9, 9)),
    "max_pool1d": (lambda x: F.max_pool1d(x, 3, 2), (2, 3, 9)),
    "adaptive_max_pool2d": (lambda x: F.adaptive_max_pool2d(x, (3, 2)), (2, 3, 9, 9)),
    "batch_norm": (lambda x: F.batch_norm(x, None, None, training=True), (2, 3, 5, 5)),
    "group_norm": (lambda x: F.group_norm(x, 3), (2, 6, 5, 5)),
    "fold": (lambda x: F.fold(x, (4, 4), 2), (2, 12, 9)),
    "pixel_shuffle": (lambda x: F.pixel_shuffle(x, 2), (2, 8, 3, 3)),
    "cross_entropy": (lambda x: F.cross_entropy(
        x, torch.zeros(4, dtype=torch.long, device=x.device), label_smoothing=0.1), (4, 7)),
    "causal_attention": (lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True),
                         (2, 2, 8, 4)),
    "logcumsumexp": (lambda x: x.logcumsumexp(-1), (4, 7)),
    "topk": (lambda x: x.topk(3).values, (4, 7)),
    "triu": (lambda x: x.triu(1), (5, 5)),
    "grid_sample": (lambda x: F.grid_sample(x, torch.zeros(2, 3, 3, 2, device=x.device),
                                            align_corners=False), (2, 3, 5, 5)),
}


@pytest.mark.parametrize("name", list(_ON_META))
def test_decompositions_make_their_constants_on_the_inputs_device(name):
    """A decomposition's constants (pooling's window tables, masks, positions) are made on
    the device of the values they meet: a CPU table beside a CUDA value traced to an opaque
    ATen call, run outside the fused kernels (max pooling's where, 0.65 ms of a ResNet-50
    step on an H200). Traced on the meta device, with its gradient: no opaque node."""
    fn, shape = _ON_META[name]
    x = torch.empty(shape, device="meta")
    graph = plait.jit(plait.grad(lambda x: fn(x).sum()), backend="eager").lower(x).traced.graph
    assert "opaque" not in {graph.node(n).prim for n in graph.order}
