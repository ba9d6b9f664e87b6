"""What a jit's program reads of a tensor that is not contiguous: a view of its memory
(NOTE [strided arguments]), for its arguments and its captured state alike."""
from __future__ import annotations

import functools
from typing import Sequence

import torch


# NOTE [strided arguments]
# A jit's program reads its inputs as dense blocks of memory in the order of their dims. An
# argument laid out otherwise is still read where it lies, not copied at each call, where
# its elements fill a block of memory in some order: it is passed as a view of its memory,
# and the graph turns that view back into the argument (lowering reads the way back as an
# index remap, so no kernel copies it). ``compact`` makes the view: one element along each
# dim the argument repeats along (stride 0: ``x.expand(n, m)``, a mask broadcast over
# heads), then the dims in the order of their addresses (a transpose, a channels-last
# image); the graph permutes it back and broadcasts it. ``x.expand(12000, 12000).amax()``
# reads 12000 elements, not 144 million. The strides are part of the compilation's key, so
# the call and the trace agree on the view. A module's parameters and buffers (the captured
# state, NOTE [live state]) laid out so, a channels-last model's convolution weights, are
# read the same way (``State.read`` passes their views; ``tensor_keys`` keys the strides of
# those not contiguous), and a convolution reads its operands through a transpose
# (lowering's ``_reads_transposed``): the library is handed the weight as it lies. An
# argument with gaps between its elements (a
# slice ``x[:, ::2]``) is still made contiguous by the program. What the function writes
# into a permuted argument is written back permuted into the block, so into the argument;
# writing into a repeating one is refused, as eager refuses it. A leaf that repeats its
# elements and requires grad is passed whole: torch.autograd gives each of its elements a
# gradient of its own, which a program reading one of them could not (``tensor_key``
# tells the two apart). A torch.func transform's wrapped tensor is passed as it is
# (``passed``).
def broadcast_dims(x: torch.Tensor) -> tuple[int, ...]:
    """The dims along which argument ``x`` repeats its elements (stride 0, more than one
    element), unless it is a leaf that requires grad (NOTE [strided arguments])."""
    if x.layout != torch.strided or x.requires_grad and x.grad_fn is None:
        return ()
    return tuple(d for d, (n, s) in enumerate(zip(x.shape, x.stride())) if not s and n > 1)


def address_order(x: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation of ``x``'s dims that makes it contiguous (outermost in memory first),
    or None where it is contiguous already or no permutation makes it so (gaps, overlaps)."""
    return dense_order(x.shape, x.stride()) if x.layout == torch.strided else None


@functools.lru_cache(maxsize=4096)  # asked at every call for each argument not contiguous
def dense_order(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...] | None:
    """``address_order`` of a tensor of ``shape`` laid out with ``strides`` (hashable)."""
    def dense(dims):  # are these dims' strides, in this order, a contiguous block's?
        expected = 1
        for d in reversed([d for d in dims if shape[d] != 1]):
            if strides[d] != expected:
                return False
            expected *= shape[d]
        return True

    if 0 in shape or dense(range(len(shape))):
        return None
    order = tuple(sorted(range(len(shape)), key=lambda d: (-strides[d], d)))
    return order if dense(order) else None


def compact(x: torch.Tensor) -> torch.Tensor:
    """What a jit's program reads of argument ``x``: a view of its memory, dense where its
    elements fill a block of memory (NOTE [strided arguments])."""
    x = _narrowed(x)
    order = address_order(x)
    return x if order is None else x.permute(order)


def inverse_permutation(order: Sequence[int]) -> tuple[int, ...]:
    return tuple(order.index(d) for d in range(len(order)))


def _narrowed(x: torch.Tensor) -> torch.Tensor:
    for d in broadcast_dims(x):
        x = x.narrow(d, 0, 1)
    return x


def passed(x: torch.Tensor) -> torch.Tensor:
    """What a jit's program is given for argument ``x``: ``compact(x)`` where that is
    another view of its memory (NOTE [strided arguments]); a tensor a torch.func transform
    wraps (its memory is not its own layout's) as it is."""
    if x.layout != torch.strided or x.is_contiguous() or \
            torch._C._functorch.is_functorch_wrapped_tensor(x):
        return x
    return compact(x)


def passed_order(x: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation of argument ``x``'s dims that ``passed`` gives its jit's program
    (NOTE [strided arguments]), or None."""
    return address_order(_narrowed(x)) if passed(x) is not x else None


