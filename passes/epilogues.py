"""Bias epilogues: a matrix product and the bias added to its rows, in one library call.

NOTE [bias epilogues]
A linear layer traces as a product and an add of its bias broadcast over the rows (torch's
addmm decomposition). Where an elementwise kernel reads the sum (an activation, a residual,
a layer norm), lowering inlines the add into that kernel at no cost. Where only library
calls read it (the q, k and v projections attention reads, a product's operand), the add is
a kernel of its own: one more pass over the product's memory, where cuBLAS adds the bias as
it writes the product (its epilogue). ViT-B/16's inference made 36 such kernels, biasing and cutting out
the heads of its fused qkv projection, 0.40 ms of a 6 ms step on an H200 (torch.compile
calls addmm). So a sum whose every reader is another product, or attention through
reshapes, transposes and slices alone, becomes one ``dot_bias`` (``torch.addmm``), and
lowering hands attention its heads as views of that result (``_buffer_view``). A sum that
the program returns, or that a training step's forward saves for its backward, stays an
add: an output is stored whole in a buffer of its own, which a kernel writes anyway. Only
2-D products: linear layers flatten their leading dims. The sum is rounded once, as
eager's addmm rounds it (the decomposition rounds the product, then the sum). It runs after
differentiation, as a stage of lowering, so ``dot_bias`` needs no transform rules;
``config.bias_epilogues`` names the devices (default "cuda": on the CPU, torch's addmm
adds the bias in a pass of its own).
"""
from __future__ import annotations

import torch

from ..config import device_kinds
from ..graph import Graph, Value, rewrite
from .lowering import STRIDED_VIEWS
from .simplify import dce


def _unconverted(graph: Graph, v: Value, dtype: torch.dtype | None) -> Value | None:
    """``v`` itself (``dtype`` None), or what ``v`` converts from ``dtype``, read by that
    convert alone (else None)."""
    if dtype is None:
        return v
    if graph.node(v.node).prim != "convert" or len(graph.users(v.node)) != 1:
        return None
    (u,) = graph.operands(v.node)
    return u if graph.type_of(u).dtype == dtype else None


def _product_and_bias(graph: Graph, n: int) -> tuple[Value, Value, Value, int] | None:
    """(lhs, rhs, bias, the product's node) where node ``n`` adds a bias broadcast over the
    rows of a 2-D product that nothing else reads, in the product's dtype (or in a wider one,
    converted back: ``n`` is then the convert); else None."""
    node, add, narrow = graph.node(n), n, None
    if node.prim == "convert":
        (v,) = graph.operands(n)
        add, narrow = v.node, node.out_types[0].dtype
        if graph.node(add).prim != "add" or len(graph.users(add)) != 1:
            return None
    elif node.prim != "add":
        return None
    t = node.out_types[0]
    for product, broadcast in (graph.operands(add), graph.operands(add)[::-1]):
        product = _unconverted(graph, product, narrow)
        if product is None or graph.node(broadcast.node).prim != "broadcast_in_dim" or \
                graph.node(broadcast.node).kwargs["broadcast_dimensions"] != (1,):
            continue
        dot = graph.node(product.node)
        bias = _unconverted(graph, graph.operands(broadcast.node)[0], narrow)
        if dot.prim == "dot_general" and dot.kwargs["batch"] == ((), ()) and t.ndim == 2 and \
                graph.type_of(product) == t and len(graph.users(product.node)) == 1 and \
                bias is not None and graph.type_of(bias).shape == t.shape[1:] and \
                graph.type_of(bias).dtype == t.dtype:
            return (*graph.operands(product.node), bias, product.node)
    return None


def _read_by_libraries(graph: Graph, n: int, outputs: set[int]) -> bool:
    """Do only library calls read node ``n``'s value where it lies: another product, or
    attention through the views lowering hands it in place (``STRIDED_VIEWS``) that no
    output is?"""
    stack = [n]
    while stack:
        m = stack.pop()
        if m in outputs:
            return False
        for user in graph.users(m):
            prim = graph.node(user).prim
            if prim in STRIDED_VIEWS:
                stack.append(user)
            elif not (prim == "attention" or prim == "dot_general" and m == n):
                return False
    return True


def bias_epilogues(graph: Graph, devices: str = "cuda") -> Graph:
    """NOTE [bias epilogues]; ``devices``: those whose sums go into the product (one of
    ``config.DEVICE_CHOICES``, ``config.bias_epilogues``)."""
    kinds = device_kinds("bias_epilogues", devices)
    outputs = {v.node for v in graph.outputs}
    found = {}
    for n in graph.order:
        node = graph.node(n)
        if node.prim in ("add", "convert") and \
                torch.device(node.out_types[0].device).type in kinds and \
                (match := _product_and_bias(graph, n)) is not None and \
                _read_by_libraries(graph, n, outputs):
            found[n] = match
    if not found:
        return graph
    values: dict[Value, Value] = {}  # the graph's values -> the rewritten graph's

    def visit(b, n, operands, preds):
        values.update(zip(graph.operands(n), operands))
        if n not in found:
            return None
        *operands, product = found[n]
        product = graph.node(product)
        return b.add_node("dot_bias", tuple(values[v] for v in operands), product.kwargs,
                          graph.node(n).out_types, product.provenance, after=preds)

    return dce(rewrite(graph, visit))
