"""Padded matrix products: the dims a half-precision product runs slowly at, rounded up.

NOTE [padded products]
cuBLAS's fast kernels for 16-bit products read and write rows aligned to 16 bytes. An
operand or result whose rows are not a multiple of 8 elements long runs on its ``align1``
kernels, about 6x slower: GPT-2's LM head over its vocabulary of 50257, [8192, 768] x
[768, 50257] in bf16, took 15.2 ms for the forward product and both gradients' on an H100,
2.5 ms with the vocabulary padded to 50264 (padding the weight 0.08 ms, cutting the logits
back out 1.0 ms).

So each dim of a large 16-bit CUDA product (``PAD_MIN_FLOPS``) that is not a multiple of 8
is padded with zeros: a contracting dim in both operands (the zeros add nothing), a free
dim in its operand, the result then sliced back to its size. Which dims end up as rows in
memory depends on layouts lowering picks later (the library reads transposes in place), so
every such dim is padded, batch dims aside. The pads fuse into the kernels that make the
operands where plait makes them, and the slice is an index remap for the kernels that read
the result (a copy only where the library or the caller needs it whole). The pass runs in
simplification, before differentiation (``autodiff.joint``): the backward's products come
out padded too, the VJP of a slice being a pad and that of a pad a slice. torch.compile's
``pad_mm`` pads the same dims, choosing by benchmark; here the rule stands for the
measurement (``config.pad_products`` names the devices: "cuda", the default, "all" or
"none").
"""
from __future__ import annotations

import math

import attrs
import torch

from ..config import device_kinds
from ..graph import Graph, GraphBuilder, Value, rewrite

ALIGNMENT = 8  # elements: 16 bytes of a 16-bit float
PAD_MIN_FLOPS = 1 << 30  # smaller products gain less than the pads and the slice cost
_PADDED_DTYPES = (torch.float16, torch.bfloat16)


def _rounded(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _padded(b: GraphBuilder, x: Value, dims: set[int], provenance) -> Value:
    """``x`` with each of ``dims`` padded with zeros at its end to a multiple of 8."""
    t = b.type_of(x)
    high = tuple(_rounded(n) - n if d in dims else 0 for d, n in enumerate(t.shape))
    if not any(high):
        return x
    shape = tuple(n + h for n, h in zip(t.shape, high))
    return b.add_node("pad", (x,), {"low": (0,) * t.ndim, "high": high, "value": 0.0},
                      (attrs.evolve(t, shape=shape),), provenance)[0]


def _unaligned(shape, dims) -> set[int]:
    return {d for d in dims if shape[d] % ALIGNMENT and shape[d] > ALIGNMENT}


def pad_products(graph: Graph, devices: str = "cuda") -> Graph:
    """NOTE [padded products]; ``devices``: those whose products are padded (one of
    ``config.DEVICE_CHOICES``, ``config.pad_products``)."""
    kinds = device_kinds("pad_products", devices)

    def large(n) -> bool:
        """Is node ``n`` a 16-bit product on one of ``kinds`` big enough to pad?"""
        node = graph.node(n)
        if node.prim != "dot_general":
            return False
        t, lhs = node.out_types[0], graph.type_of(graph.operands(n)[0])
        contracted = math.prod(lhs.shape[d] for d in node.kwargs["contracting"][0])
        return t.dtype in _PADDED_DTYPES and torch.device(t.device).type in kinds \
            and 2 * t.numel * contracted >= PAD_MIN_FLOPS

    if not any(large(n) for n in graph.order):
        return graph

    def visit(b, n, operands, preds):
        node = graph.node(n)
        if preds or not large(n):
            return None
        t = node.out_types[0]
        lhs, rhs = (b.type_of(x) for x in operands)
        (lc, rc), (lb, rb) = node.kwargs["contracting"], node.kwargs["batch"]
        lfree = [d for d in range(lhs.ndim) if d not in lc + lb]
        rfree = [d for d in range(rhs.ndim) if d not in rc + rb]
        contracting = [i for i, d in enumerate(lc) if d in _unaligned(lhs.shape, lc)]
        lpad = _unaligned(lhs.shape, lfree) | {lc[i] for i in contracting}
        rpad = _unaligned(rhs.shape, rfree) | {rc[i] for i in contracting}
        if not lpad and not rpad:
            return None
        provenance = node.provenance
        lhs_p, rhs_p = _padded(b, operands[0], lpad, provenance), \
            _padded(b, operands[1], rpad, provenance)
        # the result's dims: batch, lhs's free, rhs's free (dot_general's order)
        padded = [False] * len(lb) + [d in lpad for d in lfree] + [d in rpad for d in rfree]
        wide = tuple(_rounded(n) if p else n for n, p in zip(t.shape, padded))
        product = b.add_node("dot_general", (lhs_p, rhs_p), node.kwargs,
                             (attrs.evolve(t, shape=wide),), provenance)[0]
        if wide == t.shape:
            return [product]
        return b.add_node("slice", (product,), {"start": (0,) * t.ndim, "limit": t.shape,
                                                "step": (1,) * t.ndim}, (t,), provenance)

    return rewrite(graph, visit)
