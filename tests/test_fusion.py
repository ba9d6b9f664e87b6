"""Fusion of lowered kernels: kernel counts and reads for known patterns, via the loop-IR
interpreter (which checks every result against eager)."""
import torch

from plait.graph.loops import Kernel
from plait.passes.fusion import fuse
from test_lowering import _lowered


def _fused(fn, *args):
    return _lowered(fn, *args, passes=(fuse,))


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


def test_fusion_stops_at_externs_and_mismatched_loops():
    x = torch.randn(4, 6)
    program = _fused(lambda x: (torch.exp(x) @ x.t()).sum(0) + x.sum(), x)
    assert sum(isinstance(k, Kernel) for k in program.kernels) >= 2
