"""Simplify passes: dead-code elimination, common-subexpression elimination, constant folding,
algebraic identities.

Each is a pure function Graph -> Graph. They keep every control edge whose ends survive (a
merged node inherits the control edges of the nodes merged into it), and never remove, merge
or fold an effectful node.
"""
from __future__ import annotations

import attrs
import torch

from ..graph import Constant, Graph, GraphBuilder, Node, TensorType, Value, extract, rewrite
from ..graph.types import is_symbolic
from ..tracer.primitives import ELEMENTWISE
from ..tracer.registry import get_primitive, is_effectful


# each the identity of its last operand (the others, a custom VJP's, are for its rule alone)
MARKERS = frozenset({"stop_gradient", "no_grad", "no_fwd_grad", "custom_vjp"})


def erase_markers(graph: Graph) -> Graph:
    """The identities that only stop derivatives or carry a custom one (``custom_vjp``, the
    identity of its last operand) go: every derivative is taken before a graph is simplified
    (a transform differentiates its traced graph, jit's autograd path the one it traced), and
    patterns then see through them (attention under torch.no_grad()); a training step's
    backward program redoes the elementwise values behind them rather than save them (a
    BatchNorm's output: NOTE [forward and backward programs])."""
    if not any(graph.node(n).prim in MARKERS for n in graph.order):
        return graph
    return rewrite(graph, lambda b, n, operands, preds: [operands[-1]] if graph.node(n).prim
                   in MARKERS and not preds else None)


def dce(graph: Graph) -> Graph:
    """Drop nodes that no output, effect or control successor needs."""
    roots = {v.node for v in graph.outputs}
    roots |= {n for n in graph.nx.nodes if is_effectful(graph.node(n))}
    live, todo = set(roots), list(roots)  # one walk up from all roots: linear in the graph
    while todo:
        for u in graph.nx.predecessors(todo.pop()):
            if u not in live:
                live.add(u)
                todo.append(u)
    if len(live | set(graph.inputs)) == len(graph):
        return graph
    return rewrite(graph, keep=live)


def unread_ys(graph: Graph) -> Graph:
    """Scans without the per-step outputs that nothing reads, nor what their bodies compute
    for those alone: a scan's VJP computes the cotangent of every x (an RNN's inputs too),
    which a step's gradients rarely use. After ``cse``, which merges a scan into the one its
    VJP runs (with the carry history) only while both compute the same ys."""
    read = {*graph.outputs, *(v for n in graph.order for v in graph.operands(n))}
    unread = {n: [i for i in range(node.kwargs["n_carry"], len(node.out_types))
                  if Value(n, i) not in read]
              for n in graph.order if (node := graph.node(n)).prim == "scan"}
    if not any(unread.values()):
        return graph

    def visit(b, n, operands, preds):
        if not unread.get(n):
            return None
        node, dropped = graph.node(n), set(unread[n])
        body = node.kwargs["body"]
        kept = [i for i in range(len(node.out_types)) if i not in dropped]
        body = dce(extract(body, body.order, [Value(i, 0) for i in body.inputs],
                           [body.outputs[i] for i in kept]))
        new = iter(b.add_node("scan", operands, node.kwargs | {"body": body},
                              [node.out_types[i] for i in kept], node.provenance, after=preds))
        return [None if i in dropped else next(new) for i in range(len(node.out_types))]

    return rewrite(graph, visit)


def unread_input_grads(graph: Graph) -> Graph:
    """A ``conv_backward`` whose input gradient nothing reads computes the kernel's alone
    (NOTE [convolution backward])."""
    read = {*graph.outputs, *(v for n in graph.order for v in graph.operands(n))}
    pruned = {n for n in graph.order if graph.node(n).prim == "conv_backward"
              and graph.node(n).kwargs.get("lhs_grad", True) and Value(n, 0) not in read}
    if not pruned:
        return graph

    def visit(b, n, operands, preds):
        if n not in pruned:
            return None
        node = graph.node(n)
        return [None, *b.add_node("conv_backward", operands, node.kwargs | {"lhs_grad": False},
                                  node.out_types[1:], node.provenance, after=preds)]

    return rewrite(graph, visit)


def with_carry_history(body: Graph, n_carry: int) -> Graph:
    """A scan body that also returns, as extra per-step outputs, the carry it was given."""
    return extract(body, body.order, [Value(n, 0) for n in body.inputs],
                   [*body.outputs, *(Value(n, 0) for n in body.inputs[:n_carry])])


def cse(graph: Graph) -> Graph:
    """Merge nodes computing the same primitive with the same params on the same values.

    A scan is also merged into a later one that computes the same and more: the same body
    with its carry history as well, on the same operands (a scan's VJP runs its forward again
    for that history, NOTE [control-flow primitives]): the first's results are the second's
    first results."""
    seen: dict[tuple, list[Value]] = {}
    scans = {(graph.node(n).params, graph.operands(n)) for n in graph.order
             if graph.node(n).prim == "scan"}

    def visit(b, n, operands, preds):
        node = graph.node(n)
        if is_effectful(node):
            return None
        if node.prim == "scan":
            longer = node.kwargs | {"body": with_carry_history(node.kwargs["body"],
                                                               node.kwargs["n_carry"])}
            if (Node.make_params(longer), graph.operands(n)) in scans:
                key = (node.prim, Node.make_params(longer), operands, preds)
                if key not in seen:
                    length, types = node.kwargs["length"], longer["body"].output_types
                    history = [attrs.evolve(t, shape=(length, *t.shape))
                               for t in types[len(node.out_types):]]
                    seen[key] = b.add_node("scan", operands, longer,
                                           (*node.out_types, *history), node.provenance,
                                           after=preds)
                return seen[key][:len(node.out_types)]
        key = (node.prim, node.params, operands, preds)
        if key not in seen:
            seen[key] = b.add_node(node.prim, operands, node.kwargs, node.out_types,
                                   node.provenance, after=preds)
        return seen[key]

    return rewrite(graph, visit)


_SOURCES = ("constant", "full", "iota")


def fold_constants(graph: Graph, max_numel: int = 4096) -> Graph:
    """Evaluate small nodes (at most ``max_numel`` elements each result: the limit on what a
    compiled program holds as constants) whose operands are all known at compile time."""
    known: dict[Value, torch.Tensor] = {}  # new-graph value -> its tensor

    def visit(b, n, operands, preds):
        node = graph.node(n)
        if is_symbolic(node.params) or is_symbolic(node.out_types):  # of a size: not known
            return None  # at compile time
        small = all(t.numel <= max_numel for t in node.out_types)
        if preds or not small or is_effectful(node) or node.prim == "opaque" or any(
                isinstance(v, Graph) for _, v in node.params):  # loops run when called
            return None
        if node.prim not in _SOURCES and not (operands and all(v in known for v in operands)):
            return None
        if node.prim == "constant":
            out = [node.kwargs["value"].tensor]
        else:
            result = get_primitive(node.prim).impl(*[known[v] for v in operands], **node.kwargs)
            out = list(result) if get_primitive(node.prim).multiple_results else [result]
        if node.prim in _SOURCES:  # keep the cheap generators as they are
            new = b.add_node(node.prim, operands, node.kwargs, node.out_types, node.provenance)
        else:
            new = [_folded(b, t, ty, node.provenance) for t, ty in zip(out, node.out_types)]
        known.update(zip(new, out))
        return new

    return rewrite(graph, visit)


def _folded(b: GraphBuilder, t: torch.Tensor, type: TensorType, provenance) -> Value:
    """A folded value: a fill where every element is the same number, signed zeros told
    apart (a broadcast scalar stays one number, which later passes recognize), else a
    constant."""
    t = t.contiguous()
    if t.numel() and not t.is_complex():
        value = t.reshape(-1)[0].item()
        fill = torch.full_like(t, value)
        if torch.equal(t, fill) and (not t.is_floating_point()
                                     or torch.equal(t.signbit(), fill.signbit())):
            return b.add_node("full", (), {"shape": type.shape, "dtype": type.dtype,
                                           "device": type.device, "value": value}, (type,),
                              provenance)[0]
    return b.add_node("constant", (), {"value": Constant(t)}, (type,), provenance)[0]


_NEUTRAL_RIGHT = {"div": 1, "sub": 0}  # x / 1 and x - 0 are x (x + 0 is not: -0.0 + 0.0)


def _is_full(b: GraphBuilder, v: Value, value) -> bool:
    node = b.node(v.node)
    return node.prim == "full" and node.kwargs["value"] == value


def _does_nothing(prim: str, params: dict, source: TensorType, result: TensorType) -> bool:
    """Is this view or conversion of a ``source`` value that value itself?"""
    if prim not in ("reshape", "transpose", "broadcast_in_dim", "convert") or source != result:
        return False
    identity = tuple(range(result.ndim))
    return (prim != "transpose" or params["permutation"] == identity) and (
        prim != "broadcast_in_dim" or params["broadcast_dimensions"] == identity)


def _compose(outer: tuple, inner: tuple) -> tuple:
    """transpose(transpose(x, inner), outer) is transpose(x, _compose(outer, inner))."""
    return tuple(inner[i] for i in outer)


def _reshape_before_transpose(b: GraphBuilder, v: Value, node) -> list | None:
    """reshape(transpose(x)) as transpose(reshape(x)), where the transpose keeps x's leading
    dims in place and the reshape changes only those (batched matmuls of transposed 4-D
    operands are traced so; dot_general then absorbs the transpose)."""
    (x,), p = b.operands(v.node), b.node(v.node).kwargs["permutation"]
    moved = [d for d in range(len(p)) if p[d] != d]
    kept = moved[0] if moved else len(p)  # p keeps dims [0, kept) in place
    tail, shape = b.type_of(v).shape[kept:], node.out_types[0].shape
    lead = len(shape) - len(tail)
    if not moved or lead < 0 or tuple(shape[lead:]) != tuple(tail):
        return None
    t = node.out_types[0]
    source_shape = (*shape[:lead], *b.type_of(x).shape[kept:])
    (reshaped,) = b.add_node("reshape", (x,), {"shape": source_shape},
                             (attrs.evolve(t, shape=source_shape),), node.provenance)
    permutation = (*range(lead), *(lead + p[d] - kept for d in range(kept, len(p))))
    return b.add_node("transpose", (reshaped,), {"permutation": permutation}, node.out_types,
                      node.provenance)


def _swapped_dot(b: GraphBuilder, dot: Value, permutation: tuple, node) -> list | None:
    """transpose(dot_general(l, r)) as dot_general(r, l), when the transpose keeps the batch
    dims and swaps the block of l's free dims with the block of r's."""
    d = b.node(dot.node)
    (lc, rc), (lb, rb) = d.kwargs["contracting"], d.kwargs["batch"]
    lhs, rhs = b.operands(dot.node)
    nb = len(lb)
    nl = b.type_of(lhs).ndim - len(lc) - nb
    nr = b.type_of(rhs).ndim - len(rc) - nb
    swap = (*range(nb), *range(nb + nl, nb + nl + nr), *range(nb, nb + nl))
    if permutation != swap:
        return None
    return b.add_node("dot_general", (rhs, lhs), {"contracting": (rc, lc), "batch": (rb, lb)},
                      node.out_types, node.provenance)


def _absorb_transposes(b: GraphBuilder, operands, node) -> list | None:
    """dot_general of transposed operands reads their sources with the dims renamed, where a
    transpose keeps its operand's free dims in order (so the output's layout is the same)."""
    (contracting, batch), changed = (list(node.kwargs["contracting"]),
                                     list(node.kwargs["batch"])), False
    operands = list(operands)
    for side, v in enumerate(operands):
        t = b.node(v.node)
        if t.prim != "transpose":
            continue
        p = t.kwargs["permutation"]
        free = [p[d] for d in range(len(p)) if d not in contracting[side] + batch[side]]
        if free == sorted(free):
            (operands[side],) = b.operands(v.node)
            contracting[side] = tuple(p[d] for d in contracting[side])
            batch[side] = tuple(p[d] for d in batch[side])
            changed = True
    if not changed:
        return None
    return b.add_node("dot_general", operands, {"contracting": tuple(contracting),
                                                "batch": tuple(batch)},
                      node.out_types, node.provenance)


def _gathered(b: GraphBuilder, v: Value, index: Value, dim: int, provenance) -> Value:
    """gather(v, dim, index), computed from gathers of v's operands where v is elementwise
    (or a broadcast along ``dim``, or a fill): only the gathered elements are computed, and
    v itself need not exist in full (NOTE [gather sinking])."""
    node, shape = b.node(v.node), b.type_of(index).shape
    out = attrs.evolve(node.out_types[0], shape=shape)
    if not b.ordered(v.node) and not is_effectful(node):
        if node.prim in ELEMENTWISE:
            args = [_gathered(b, o, index, dim, provenance) for o in b.operands(v.node)]
            return b.add_node(node.prim, args, node.kwargs, (out,), node.provenance)[0]
        if node.prim == "full":
            return b.add_node("full", (), node.kwargs | {"shape": shape}, (out,),
                              node.provenance)[0]
        if node.prim == "broadcast_in_dim":
            (y,), dims = b.operands(v.node), node.kwargs["broadcast_dimensions"]
            sizes = dict(zip(dims, b.type_of(y).shape))
            full = node.out_types[0].shape
            if sizes.get(dim, 1) == 1 and all(shape[d] == full[d] or n == 1
                                              for d, n in sizes.items() if d != dim):
                params = node.kwargs | {"shape": shape}
                if _does_nothing("broadcast_in_dim", params, b.type_of(y), out):
                    return y
                return b.add_node("broadcast_in_dim", (y,), params, (out,), node.provenance)[0]
    return b.add_node("gather", (v, index), {"dim": dim}, (out,), provenance)[0]


def algebra(graph: Graph) -> Graph:
    """Algebraic identities that leave fewer nodes and fewer copies for the compiler: x*1,
    x/1, x-0, conj(conj(x)); reshapes and transposes that do nothing or compose; a reshape
    of the leading dims moves before a transpose of the others; a dot_general absorbs
    transposed operands into its dimension numbers, and a transpose of a single-use
    dot_general that swaps its free dims swaps its operands instead. Every rule is exact in
    floating point (x+0 is not: -0.0 + 0.0 is +0.0).

    NOTE [gather sinking]: a gather that picks fewer elements than its operand has moves into
    the operand when that is elementwise (or a fill, or a broadcast along the gathered dim):
    gather(f(a, b)) = f(gather(a), gather(b)). Cross-entropy's gather of the target's
    log-probability then reads the logits and the row statistics, and the full
    log-softmax is never stored. Where the operand has other users it is still computed for
    them; the gathered copy is small."""
    outputs = set(graph.outputs)

    def visit(b, n, operands, preds):
        node = graph.node(n)
        if preds or is_effectful(node):
            return None
        same = lambda v: b.type_of(v) == node.out_types[0]  # noqa: E731
        kw = node.kwargs
        if node.prim == "mul":
            for x, one in (operands, operands[::-1]):
                if _is_full(b, one, 1) and same(x):
                    return [x]
        if node.prim in _NEUTRAL_RIGHT and _is_full(b, operands[1], _NEUTRAL_RIGHT[node.prim]) \
                and same(operands[0]):
            return [operands[0]]
        if operands and _does_nothing(node.prim, kw, b.type_of(operands[0]), node.out_types[0]):
            return [operands[0]]
        inner = b.node(operands[0].node) if operands else None
        if node.prim == "conj" and inner.prim == "conj":  # complex VJPs conjugate twice
            return [b.operands(operands[0].node)[0]]
        if node.prim == "reshape" and inner.prim == "reshape":
            (source,) = b.operands(operands[0].node)
            return [source] if same(source) else b.add_node("reshape", (source,), kw,
                                                            node.out_types, node.provenance)
        if node.prim == "reshape" and inner.prim == "transpose":
            return _reshape_before_transpose(b, operands[0], node)
        if node.prim == "transpose" and inner.prim == "transpose":
            p = _compose(kw["permutation"], inner.kwargs["permutation"])
            (source,) = b.operands(operands[0].node)
            if p == tuple(range(len(p))):
                return [source]
            return b.add_node("transpose", (source,), {"permutation": p}, node.out_types,
                              node.provenance)
        if node.prim == "transpose" and inner.prim == "dot_general" \
                and len(graph.users(graph.operands(n)[0].node)) == 1 \
                and graph.operands(n)[0] not in outputs:
            swapped = _swapped_dot(b, operands[0], kw["permutation"], node)
            if swapped is not None:
                return swapped
        if node.prim == "dot_general":
            return _absorb_transposes(b, operands, node)
        if node.prim == "gather" and \
                b.type_of(operands[1]).numel_hint < b.type_of(operands[0]).numel_hint:
            x, index = operands
            inner_node = b.node(x.node)
            if inner_node.prim in (*ELEMENTWISE, "full", "broadcast_in_dim"):
                return [_gathered(b, x, index, kw["dim"], node.provenance)]
        return None

    return rewrite(graph, visit)
