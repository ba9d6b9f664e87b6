"""plait.vmap gives torch.func.vmap's answers where memory layout shows: the strides,
contiguity and storage offset an example reports, as_strided on an example (read from each
example's own storage, as functorch's batching rule does), views of examples of
non-contiguous batches, and reverse mode through in-place writes into views."""
import pytest
import torch

import plait
from plait.errors import PlaitError


def _batches():
    """Batched tensors of one logical shape [4, 5, 6], laid out in different ways."""
    g = torch.Generator().manual_seed(0)
    return {
        "contiguous": torch.randn(4, 5, 6, generator=g),
        "transposed": torch.randn(4, 6, 5, generator=g).transpose(1, 2),
        "permuted": torch.randn(5, 6, 4, generator=g).permute(2, 0, 1),
        "sliced": torch.randn(5, 6, 7, generator=g)[1:, 1:, 1:],
        "stepped": torch.randn(4, 10, 6, generator=g)[:, ::2],
        "expanded": torch.randn(1, 5, 6, generator=g).expand(4, 5, 6),
    }


BATCHES = _batches()


def _same(got, expected):
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


# -- what an example reports about its layout ---------------------------------------------
def _layout_of(t):
    facts = [*t.stride(), t.storage_offset(), t.is_contiguous(),
             t.is_contiguous(memory_format=torch.contiguous_format)]
    return t.sum() * 0 + torch.tensor([float(f) for f in facts])


@pytest.mark.parametrize("in_dims", [0, 1, 2])
@pytest.mark.parametrize("batch", ["contiguous", "transposed", "permuted", "stepped",
                                   "expanded"])
def test_an_example_reports_torch_funcs_layout(batch, in_dims):
    x = BATCHES[batch]
    _same(plait.vmap(_layout_of, in_dims=in_dims)(x),
          torch.func.vmap(_layout_of, in_dims=in_dims)(x))


def test_nested_examples_report_torch_funcs_layout():
    x = torch.randn(2, 3, 4, 5)
    f = lambda g: g(g(_layout_of, in_dims=1), in_dims=2)  # noqa: E731
    _same(f(plait.vmap)(x), f(torch.func.vmap)(x))


def test_a_compiled_vmap_follows_its_arguments_layout():
    """The layout is part of what a compilation is for: the same shape, laid out anew,
    answers anew."""
    f = plait.vmap(lambda t: t.as_strided([2, 3], [1, 2], 0) + t.is_contiguous())
    for x in (torch.arange(12.).reshape(2, 3, 2).transpose(1, 2),
              torch.arange(12.).reshape(2, 2, 3)):
        _same(f(x), torch.func.vmap(lambda t: t.as_strided([2, 3], [1, 2], 0)
                                    + t.is_contiguous())(x))


# -- as_strided on an example ------------------------------------------------------------
AS_STRIDED = [  # (batch, in_dims, size, stride, storage_offset)
    ("contiguous", 0, [5, 2], [6, 3], None),
    ("contiguous", 0, [3, 3], [1, 2], 4),
    ("transposed", 0, [5, 2], [1, 10], None),
    ("transposed", 0, [6, 5], [5, 1], 0),
    ("permuted", 1, [3, 5], [1, 4], 2),  # the batch dim is outermost in memory
    ("expanded", 0, [2, 7], [1, 3], 5),  # every example reads the one memory
]


@pytest.mark.parametrize("batch,in_dims,size,stride,offset", AS_STRIDED)
def test_as_strided_reads_each_examples_own_memory(batch, in_dims, size, stride, offset):
    x = BATCHES[batch]
    offset = None if offset is None else offset + x.storage_offset()  # an absolute offset
    f = lambda t: t.as_strided(size, stride, offset) * 2  # noqa: E731
    _same(plait.vmap(f, in_dims=in_dims)(x), torch.func.vmap(f, in_dims=in_dims)(x))


def test_as_strided_on_a_non_contiguous_batch_at_an_offset():
    """A batch at an offset in its storage (``x[1:]``, ``x[:, t]``) shares a compilation
    with its other slices: as_strided from the example's own offset follows torch.func, one
    naming another offset is refused (the trace does not know where the batch starts)."""
    x = torch.randn(5, 3, 2).transpose(1, 2)[1:]  # examples at storage offset 6 on
    f = lambda t: t.as_strided([2, 2], [2, 1])  # noqa: E731
    _same(plait.vmap(f)(x), torch.func.vmap(f)(x))
    with pytest.raises(PlaitError, match="as_strided with a storage_offset"):
        plait.vmap(lambda t: t.as_strided([2, 2], [2, 1], 7))(x)


def test_slices_at_offsets_share_a_compilation():
    f = plait.jit(lambda t: t * 2)
    x = torch.randn(4, 6, 3)
    for t in range(6):
        _same(f(x[:, t]), x[:, t] * 2)
    assert f.trace_count == 2  # the slice at offset 0, and those after it


def test_the_scatter_of_as_strided_under_vmap():
    """torch.func has no batching rule for it; by as_strided's, each example's offset counts
    from its own storage offset: an eager loop shifts it so."""
    x, src = BATCHES["transposed"], torch.randn(4, 3, 2)
    f = lambda t, s, at: t.as_strided_scatter(s * 3, [3, 2], [1, 5], at)  # noqa: E731
    expected = torch.stack([f(x[i], src[i], 1 + x[i].storage_offset()) for i in range(4)])
    _same(plait.vmap(lambda t, s: f(t, s, 1 + x.storage_offset()))(x, src), expected)


@pytest.mark.parametrize("batch,in_dims,size,stride,offset", [
    ("contiguous", 1, [2], [1], 0),  # torch reads into the next example
    ("stepped", 0, [2, 6], [6, 1], None),  # and between an example's rows
    ("sliced", 2, [3], [1], None),
    ("expanded", 2, [4], [7], 1),  # an example repeating its rows
])
def test_as_strided_across_examples_is_refused(batch, in_dims, size, stride, offset):
    with pytest.raises(PlaitError, match="as_strided"):
        plait.vmap(lambda t: t.as_strided(size, stride, offset), in_dims=in_dims)(
            BATCHES[batch])


def test_as_strided_outside_the_example_is_refused_as_torch_refuses():
    x = BATCHES["contiguous"]
    f = lambda t: t.as_strided([5, 7], [6, 1])  # noqa: E731
    with pytest.raises(RuntimeError, match="outside"):
        torch.func.vmap(f)(x)
    with pytest.raises(PlaitError, match="as_strided.*outside"):
        plait.vmap(f)(x)


# -- views of examples -------------------------------------------------------------------
VIEWS = {
    "unfold": lambda t: t.unfold(-1, 2, 1) * 2,
    "diagonal": lambda t: t.diagonal(1, 0, 1) * 2,
    "narrow": lambda t: t.narrow(1, 1, 2) * 2,
    "select": lambda t: t.select(1, 2) * 2,
    "expand": lambda t: t[:1].expand(3, -1) * 2,
    "movedim": lambda t: t.movedim(0, 1) * 2,
    "unflatten": lambda t: t.reshape(-1).unflatten(0, (2, -1)) * 2,
    "view_as_real": lambda t: torch.view_as_real(torch.complex(t, t * 2)),
    "view_of_contiguous": lambda t: t.t().contiguous().view(-1) * 2,
    "split": lambda t: torch.stack(t.split(1, 0)[::-1], 0),
    "unbind": lambda t: t.unbind(1)[0] * 2,
    "written_view": lambda t: t.clone().t_().diagonal().mul_(3),
}


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_views_of_examples_of_laid_out_batches(view):
    f = VIEWS[view]
    for batch, in_dims in (("transposed", 1), ("stepped", 2), ("permuted", 0)):
        x = BATCHES[batch]
        _same(plait.vmap(f, in_dims=in_dims)(x), torch.func.vmap(f, in_dims=in_dims)(x))


# -- reverse mode through in-place writes into views -------------------------------------
def _scaled_row(x, z):
    y = x.clone()
    y[0].mul_(2)
    y.view(-1)[1:4].add_(z)
    return y * x


def _transposed_add(x, z):
    y = x.clone()
    y.transpose(0, 1).add_(1)
    return (y * y).sum(0) + z.sum()


def _diagonal_copy(x, z):
    y = x.clone()
    y.diagonal().copy_(z * 2)
    return y.sin()


def _written_argument_view(x, z):
    x = x * 1
    x.transpose(0, 1)[0].add_(z)
    return x.exp()


WRITES = [_scaled_row, _transposed_add, _diagonal_copy, _written_argument_view]


@pytest.mark.parametrize("f", WRITES, ids=lambda f: f.__name__)
def test_vmap_of_vjp_through_writes_into_views(f):
    g = torch.Generator().manual_seed(1)
    xs, zs = torch.randn(5, 3, 3, generator=g), torch.randn(5, 3, generator=g)
    ct = torch.randn(f(xs[0], zs[0]).shape, generator=g)
    expected = torch.func.vmap(lambda x, z: torch.func.vjp(f, x, z)[1](ct))(xs, zs)
    for vjp in (torch.func.vjp, plait.vjp):
        got = plait.vmap(lambda x, z: vjp(f, x, z)[1](ct))(xs, zs)
        for a, b in zip(got, expected):
            _same(a, b)
    # the batch mapped along another dim
    got = plait.vmap(lambda x, z: plait.vjp(f, x, z)[1](ct), in_dims=(2, 1))(
        xs.permute(1, 2, 0), zs.t())
    for a, b in zip(got, expected):
        _same(a, b)


@pytest.mark.parametrize("f", WRITES, ids=lambda f: f.__name__)
def test_vmap_of_an_eager_vjp_fn_through_writes_into_views(f):
    g = torch.Generator().manual_seed(2)
    x, z = torch.randn(3, 3, generator=g), torch.randn(3, generator=g)
    _, vjp_fn = torch.func.vjp(f, x, z)
    cts = torch.randn(4, *f(x, z).shape, generator=g)
    for a, b in zip(plait.vmap(vjp_fn)(cts), torch.func.vmap(vjp_fn)(cts)):
        _same(a, b)


@pytest.mark.parametrize("f", WRITES, ids=lambda f: f.__name__)
def test_torch_func_vjp_traced_through_writes_into_views(f):
    """torch.autograd inside a trace replays the views written in place."""
    g = torch.Generator().manual_seed(3)
    x, z = torch.randn(3, 3, generator=g), torch.randn(3, generator=g)
    ct = torch.randn(f(x, z).shape, generator=g)
    run = lambda x, z: torch.func.vjp(f, x, z)[1](ct)  # noqa: E731
    for a, b in zip(plait.jit(run)(x, z), run(x, z)):
        _same(a, b)
