"""Channels-last convolutions: a graph whose convolutions run on [N, H, W, C] values.

NOTE [channels-last convolutions]
Every graph value is stored row-major in its logical shape, so a convolution's [N, C, H, W]
input and output are channels-first. cuDNN's fast kernels (tensor cores, on recent GPUs) read
and write channels-last memory: given channels-first tensors, it transposes the input and
weight before each kernel and the result after. On ResNet-50's training step that was 194
transposes, 4.2 ms of a 37 ms step on an H100.

This pass makes the channels-last layout logical: each ``conv`` becomes a ``conv`` with
``channels_last=True``, whose input and result are [N, *spatial, C], between two transposes;
where every convolution of the graph is ungrouped and takes params the library takes
(symmetric padding, no input dilation: NOTE [convolution backward]). cuDNN's channels-last
grouped convolutions are slow in float32 (ConvNeXt's depthwise 7x7 weight gradient: 33 ms a
step against 11 channels-first, on an H100), and a graph of both kinds would transpose
between them; in 16-bit floats on CUDA (``GROUPED_HALF_DEVICES``) they are the fast ones
(ConvNeXt's depthwise convolutions: ATen's channels-first kernels 22.7 ms a step, cuDNN's
channels-last 4.5 under torch.compile), so there grouped convolutions turn too.
The transposes then sink through the graph rather than stay: each value is carried as
*its new value, transposed by a permutation*, and

    an elementwise op (or ``stop_gradient``) of a transposed value is the op of the untransposed
        operands (the others transposed back, which fusion reads through), transposed;
    a reduction of a transposed value reduces the corresponding dims (and is transposed only
        where the dims it keeps change order: BatchNorm's statistics over (N, H, W) of an
        [N, H, W, C] value are plain [C] vectors);
    a transpose of a transposed value is one transpose (none, when they cancel: the
        ``permute(0, 2, 3, 1)`` around ConvNeXt's LayerNorm);
    a slice (or pad) of a transposed value slices (or pads) the corresponding dims;
    a convolution of a transposed-to-[N, C, H, W] value reads the value itself;
    a ``custom_vjp`` whose rule follows the layout (BatchNorm's, tracer/aten.py) takes the
        untransposed operands and a rule told the permutation;

and anything else (a reshape, a gather, a matrix product, a graph output) reads the transpose,
which lowering computes where it is read (an index remap) or stores where it must. A ResNet's
activations stay channels-last from the first convolution to the pooling at its end, with no
transpose between. Run before differentiation (``autodiff.joint``) as well as in
simplification, so a training step's backward derives from the channels-last forward and
``conv_backward`` takes channels-last cotangents too.

``config.channels_last`` picks the devices: "all" (the default: oneDNN's channels-last
kernels are faster on the CPU too, a small ResNet's training step 3.0 -> 2.6 ms on 2 cores),
"cuda" or "none".
"""
from __future__ import annotations

import attrs
import torch

from ..config import device_kinds
from ..graph import Graph, GraphBuilder, Value, input_marks
from ..tracer.primitives import ELEMENTWISE, REDUCTIONS

_BOUNDED = {"slice": ("start", "limit", "step"), "pad": ("low", "high")}  # per-dim bounds


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    out = [0] * len(perm)
    for i, p in enumerate(perm):
        out[p] = i
    return tuple(out)


def _is_identity(perm) -> bool:
    return tuple(perm) == tuple(range(len(perm)))


# the device types whose 16-bit grouped convolutions run channels-last (NOTE [channels-last
# convolutions])
GROUPED_HALF_DEVICES = frozenset({"cuda"})


def _eligible(node) -> bool:
    p, t = node.kwargs, node.out_types[0]
    grouped_ok = t.dtype in (torch.float16, torch.bfloat16) and \
        torch.device(t.device).type in GROUPED_HALF_DEVICES
    return (t.ndim >= 3 and (p["feature_group_count"] == 1 or grouped_ok)
            and all(lo == hi >= 0 for lo, hi in p["padding"])
            and all(d == 1 for d in p["lhs_dilation"]))


def channels_last(graph: Graph, devices: str = "all") -> Graph:
    """NOTE [channels-last convolutions]; ``devices``: those whose convolutions turn (one of
    ``config.DEVICE_CHOICES``, ``config.channels_last``)."""
    kinds = device_kinds("channels_last", devices)
    convs = [n for n in graph.order if graph.node(n).prim == "conv"
             and torch.device(graph.node(n).out_types[0].device).type in kinds]
    if not convs or not all(_eligible(graph.node(n)) and not graph.node(n).kwargs.get(
            "channels_last") for n in convs):
        return graph
    return _Rewrite(graph, set(convs)).run()


class _Rewrite:
    def __init__(self, graph: Graph, convs: set[int]):
        self.graph, self.convs, self.b = graph, convs, GraphBuilder()
        # old value -> (new value, perm): the old value is transpose(new value, perm)
        self.values: dict[Value, tuple[Value, tuple[int, ...] | None]] = {}
        self.transposed: dict[tuple[Value, tuple[int, ...]], Value] = {}
        # a node a control edge orders is copied as it is, its operands untransposed
        self.ordered = {u for edge in graph.control_edges() for u in edge}

    def transpose(self, v: Value, perm, provenance) -> Value:
        """``v`` transposed by ``perm`` in the new graph (once per value and perm; a transpose
        of a transpose composes, and cancels where it can)."""
        perm = tuple(perm)
        if _is_identity(perm):
            return v
        node = self.b.node(v.node)
        if node.prim == "transpose":  # transpose(transpose(x, p), perm) = transpose(x, p[perm])
            inner = node.kwargs["permutation"]
            return self.transpose(self.b.operands(v.node)[0], [inner[i] for i in perm],
                                  provenance)
        if (v, perm) not in self.transposed:
            t = self.b.type_of(v)
            shape = tuple(t.shape[i] for i in perm)
            (self.transposed[v, perm],) = self.b.add_node(
                "transpose", (v,), {"permutation": perm}, (attrs.evolve(t, shape=shape),),
                provenance)
        return self.transposed[v, perm]

    def plain(self, old: Value, provenance) -> Value:
        new, perm = self.values[old]
        return new if perm is None else self.transpose(new, perm, provenance)

    def run(self) -> Graph:
        g, b = self.graph, self.b
        ids: dict[int, int] = {}
        for n in g.order:
            node = g.node(n)
            preds = tuple(ids[p] for p in g.control_preds(n) if p in ids)
            if node.prim == "input":
                outs = [(b.add_input(node.out_types[0], input_marks(node)), None)]
            else:
                outs = self.visit(n, node, preds)
            for i, out in enumerate(outs):
                self.values[Value(n, i)] = out
            ids[n] = b.last_node
        return b.build([self.plain(v, g.node(v.node).provenance) for v in g.outputs])

    def visit(self, n: int, node, preds) -> list:
        g, b = self.graph, self.b
        operands = g.operands(n)
        carried = [self.values[v] for v in operands]
        perms = {perm for _, perm in carried if perm is not None}
        if n in self.convs:
            return self._conv(node, operands, preds)
        if n in self.ordered:  # copied as it is, below: the branches between see no
            perms = set()      # control edges (nor need ``ids`` to name a node of theirs)
        if node.prim == "transpose" and perms:
            new, inner = carried[0]
            perm = tuple(inner[i] for i in node.kwargs["permutation"])
            return [(new, None if _is_identity(perm) else perm)]
        if len(perms) == 1 and (node.prim in ELEMENTWISE or node.prim == "stop_gradient") \
                and all(g.type_of(v).shape == node.out_types[0].shape for v in operands):
            (perm,) = perms
            back = _inverse(perm)
            args = [new if p == perm else self.transpose(self.plain(v, node.provenance), back,
                                                          node.provenance)
                    for v, (new, p) in zip(operands, carried)]
            types = [attrs.evolve(t, shape=tuple(t.shape[i] for i in back))
                     for t in node.out_types]
            outs = b.add_node(node.prim, args, node.kwargs, types, node.provenance)
            return [(v, perm) for v in outs]
        if node.prim in REDUCTIONS and perms:
            return [self._reduction(node, *carried[0])]
        if node.prim in _BOUNDED and perms:
            return [self._bounded(node, *carried[0])]
        if node.prim == "custom_vjp" and len(perms) == 1 and carried[-1][1] is not None \
                and hasattr(node.kwargs["rule"], "permuted"):
            return self._custom(node, operands, carried)
        return self._copied(node, operands, preds)

    def _copied(self, node, operands, preds=()) -> list:
        """The node as it was, on its operands untransposed."""
        args = [self.plain(v, node.provenance) for v in operands]
        return [(v, None) for v in self.b.add_node(node.prim, args, node.kwargs,
                                                     node.out_types, node.provenance,
                                                     after=preds)]

    def _conv(self, node, operands, preds) -> list:
        lhs, rhs = operands
        nd = node.out_types[0].ndim
        to_last = (0, *range(2, nd), 1)  # [N, C, *S] -> [N, *S, C]
        new, perm = self.values[lhs]
        x = new if perm == _inverse(to_last) else self.transpose(
            self.plain(lhs, node.provenance), to_last, node.provenance)
        t = node.out_types[0]
        (out,) = self.b.add_node("conv", (x, self.plain(rhs, node.provenance)),
                                 {**node.kwargs, "channels_last": True},
                                 (attrs.evolve(t, shape=tuple(t.shape[i] for i in to_last)),),
                                 node.provenance, after=preds)
        return [(out, _inverse(to_last))]

    def _custom(self, node, operands, carried) -> list:
        """A custom VJP whose rule follows its operands' layout (BatchNorm's and max
        pooling's: ``permuted``): its operands of the result's rank untransposed, the rule
        told the permutation."""
        perm = carried[-1][1]
        ndim = node.out_types[0].ndim
        if any(p != (perm if self.graph.type_of(v).ndim == ndim else None)
               for v, (_, p) in zip(operands, carried)):
            return self._copied(node, operands)
        t = node.out_types[0]
        (out,) = self.b.add_node(
            node.prim, [new for new, _ in carried],
            {**node.kwargs, "rule": node.kwargs["rule"].permuted(perm)},
            (attrs.evolve(t, shape=tuple(t.shape[i] for i in _inverse(perm))),),
            node.provenance)
        return [(out, perm)]

    def _bounded(self, node, new: Value, perm: tuple[int, ...]):
        """slice(transpose(x, perm)) = transpose(slice(x), perm), the bounds of dim d moved
        to dim perm[d] (a one-pass variance's shift: a BatchNorm input's first element per
        channel); pad likewise (max pooling's windows, NOTE [strided max pooling])."""
        back = _inverse(perm)
        kwargs = {k: tuple(v[back[i]] for i in range(len(perm))) if k in _BOUNDED[node.prim]
                  else v for k, v in node.kwargs.items()}
        t = node.out_types[0]
        (out,) = self.b.add_node(node.prim, (new,), kwargs, (attrs.evolve(
            t, shape=tuple(t.shape[back[i]] for i in range(len(perm)))),), node.provenance)
        return out, perm

    def _reduction(self, node, new: Value, perm: tuple[int, ...]):
        """reduce(transpose(x, perm), dims) = transpose(reduce(x, perm[dims]), q), where q
        orders the kept dims as the old result had them."""
        dims = tuple(sorted(perm[d] for d in node.kwargs["dims"]))
        kept_old = [perm[d] for d in range(len(perm)) if d not in node.kwargs["dims"]]
        kept_new = sorted(kept_old)
        q = tuple(kept_new.index(d) for d in kept_old)
        t = node.out_types[0]
        shape = tuple(self.b.type_of(new).shape[d] for d in kept_new)
        (out,) = self.b.add_node(node.prim, (new,), {**node.kwargs, "dims": dims},
                                 (attrs.evolve(t, shape=shape),), node.provenance)
        return out, None if _is_identity(q) else q
