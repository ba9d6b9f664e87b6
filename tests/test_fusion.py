"""Fusion of lowered kernels: kernel counts and reads for known patterns, via the loop-IR
interpreter (which checks every result against eager)."""
import pytest
import torch
import torch.nn.functional as F

from plait.graph.loops import Kernel
from plait.passes.fusion import _common_split, fuse
from plait.passes.indexing import simplify_indices
from test_lowering import _lowered


def _fused(fn, *args):
    return _lowered(fn, *args, passes=(simplify_indices, fuse))


def _readers(program, buffer):
    return [k.name for k in program.kernels if buffer in k.reads]


def test_softmax_and_layer_norm_are_one_kernel_reading_the_input_once():
    x = torch.randn(6, 9)
    for fn in (lambda x: torch.softmax(x, -1),
               lambda x: torch.nn.functional.layer_norm(x, (9,)),
               lambda x: torch.logsumexp(x, 1)):
        program = _fused(fn, x)
        assert len(program.kernels) == 1 and _readers(program, program.inputs[0])


def test_pointwise_chain_is_one_kernel():
    x = torch.randn(5, 7)
    program = _fused(lambda x: torch.nn.functional.gelu(x * 2 + 1).sin().t(), x)
    assert len(program.kernels) == 1


def test_loop_ordering_after_fusion_reads_x_once():
    def f(x):
        y = torch.sum(torch.sum(x, dim=-1))
        z = x / 10.0
        z_t = z.t().contiguous().t()
        return y, z, z_t

    x = torch.randn(16, 8)
    program = _fused(f, x)
    assert len(_readers(program, program.inputs[0])) == 1
    assert len(set(program.outputs)) == 3  # z and z_t are separate buffers


def test_siblings_in_transposed_loop_orders_share_a_kernel():
    x = torch.randn(8, 8)
    program = _fused(lambda x: (x.sum(1), (x.t() * 2).contiguous()), x)
    assert len(_readers(program, program.inputs[0])) == 1


def test_an_elementwise_kernel_joins_a_later_reduction_sharing_its_reads():
    """A backward's recomputed activation (stored for a weight's product) and, later, its
    gradient summed for the bias read the pre-activation once: the elementwise kernel joins
    the reduction at its own place."""
    def f(m, b, dy, w):
        da = dy @ w
        h = m + b
        return torch.exp(h).t() @ dy, (torch.sigmoid(h) * da).sum(0)

    m, b, dy, w = torch.randn(12, 8), torch.randn(8), torch.randn(12, 5), torch.randn(5, 8)
    program = _fused(f, m, b, dy, w)
    (kernel,) = [k for k in program.kernels if isinstance(k, Kernel)]
    assert kernel.reduction_sizes and program.inputs[0] in kernel.reads
    assert program.kernels.index(kernel) == 1  # before the product reading what it stores


def test_fusion_stops_at_externs_and_mismatched_loops():
    x = torch.randn(4, 6)
    program = _fused(lambda x: (torch.exp(x) @ x.t()).sum(0) + x.sum(), x)
    assert sum(isinstance(k, Kernel) for k in program.kernels) >= 2


@pytest.mark.parametrize("fn, args", [
    # layer norm's rows are [4, 6], its output is stored as [24, 16] for the product
    (lambda x, w: F.layer_norm(x, (16,)) @ w, (torch.randn(4, 6, 16), torch.randn(16, 5))),
    # softmax's rows are [2, 3, 7], its result the batched product's operand [6, 7, 7]
    (lambda x, v: torch.softmax(x, -1) @ v, (torch.randn(2, 3, 7, 7), torch.randn(2, 3, 7, 4))),
])
def test_kernels_counting_the_same_points_with_other_loops_merge(fn, args):
    """NOTE [shared loops]: the input is read once, by one kernel whose loops split both
    kernels' (the row statistics and the values stored from them, before: two passes)."""
    program = _fused(fn, *args)
    assert len(_readers(program, program.inputs[0])) == 1


def test_an_elementwise_producer_merges_into_a_reduction_over_other_loops():
    def f(x):  # y over [3, 4, 5], stored (an output), summed over rows [12] of columns 5
        y = x.exp() * 2
        return y, y.reshape(12, 5).sum(1)

    program = _fused(f, torch.randn(3, 4, 5))
    assert sum(isinstance(k, Kernel) for k in program.kernels) == 1


def test_loops_that_interleave_stay_apart():
    x = torch.randn(6, 4)
    program = _fused(lambda x: torch.softmax(x, -1).reshape(4, 6).t().sum(0), x)
    assert sum(isinstance(k, Kernel) for k in program.kernels) == 2


@pytest.mark.parametrize("shapes, want", [
    (((2, 3, 197), (6, 197)), (2, 3, 197)),
    (((6, 197, 64), (2, 3, 197 * 64)), (2, 3, 197, 64)),
    (((2, 1, 3), (6,), (1, 6, 1)), (2, 3)),
    (((), (1, 1)), ()),
    (((6, 4), (4, 6)), None),   # interleaved cuts
    (((6,), (5,)), None),        # other products
    (((0, 3), (3, 0)), None),
])
def test_common_split(shapes, want):
    assert _common_split(*shapes) == want


def test_a_kernel_after_an_extern_joins_the_producer_the_extern_reads_first():
    """y is read by the product first, then by a kernel computed only for the outputs
    (lowered last): that kernel joins y's, before the product, and x is read once."""
    def f(x, w):
        y = x.exp()
        return y @ w, y * 3

    program = _fused(f, torch.randn(4, 6), torch.randn(6, 5))
    assert len(_readers(program, program.inputs[0])) == 1
    assert sum(isinstance(k, Kernel) for k in program.kernels) == 1


@pytest.mark.parametrize("entries, inlined", [(3, True), (12, False)])
def test_an_elementwise_producer_of_many_loads_stays_out_of_a_reduction(entries, inlined):
    """A sum of shifted windows (max pooling's gradient is one) stored for two readers, a
    column sum the first: with more loads per point than MAX_LOADS_INTO_A_REDUCTION it is
    not computed inside the column sum's kernel."""
    def f(x):
        padded = F.pad(x, (0, entries))
        y = sum(padded[:, k:k + 16] * (k + 1) for k in range(entries))
        return y.sum(0), y * 2

    program = _fused(f, torch.randn(32, 16))
    (reduction,) = [k for k in program.kernels if k.reduction_sizes]
    assert (program.inputs[0] in reduction.reads) == inlined
