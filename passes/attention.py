"""Attention fusion: softmax(q @ kᵀ * scale) @ v becomes one ``attention`` node.

NOTE [attention fusion]
Written out, attention stores its [..., M, N] scores and probabilities: at 16 heads of 2048
tokens that is 64 MiB per batch item, written and read back twice. A fused attention
kernel (FlashAttention, which ``attention``'s implementation reaches through torch's
``scaled_dot_product_attention``) streams over blocks of keys with an online softmax and
stores nothing of size M x N. This pass finds the pattern in a traced graph, as
torch.compile's attention patterns do, and replaces it:

    dot_general(P, v)  with  P = softmax(S) over the last dim, as traced (amax, sub, exp,
                             sum, div), and S = (q @ kᵀ) times or divided by scalar fills.

Converts between floating dtypes and reshapes that keep the last two dims may sit anywhere
on the path (bf16 attention converts to f32 for the softmax and back; matmuls of 4-D
operands are traced as 3-D bmms). A transposed k or v is read through its transpose.
Every node inside the pattern must have no user outside it (and be no output, and no end of
a control edge): where the scores are needed anyway, fusing would compute them twice.

The fused kernel does not round the scores and probabilities to bf16/fp16 between steps as
eager does, so it is slightly more accurate than the code it replaces. The pass runs in
jit's simplify pipeline, after every transform, so ``attention`` needs no derivative or
batching rules.
"""
from __future__ import annotations

import attrs

from ..config import config
from ..graph import Graph, GraphBuilder, Value, rewrite
from ..tracer.primitives import is_effectful


def _batch_view(g, v: Value, members: set | None = None) -> Value:
    """``v`` with reshapes that keep its last two dims (and, where ``members`` is given,
    converts between floating dtypes) skipped; skipped nodes join ``members``."""
    while True:
        node = g.node(v.node)
        if node.prim not in ("reshape", "convert") or (node.prim == "convert" and members is None):
            return v
        (x,) = g.operands(v.node)
        source, result = g.type_of(x), node.out_types[0]
        if node.prim == "reshape" and (source.ndim < 2 or result.ndim < 2
                                       or source.shape[-2:] != result.shape[-2:]):
            return v
        if node.prim == "convert" and not (source.dtype.is_floating_point
                                           and result.dtype.is_floating_point):
            return v
        if members is not None:
            members.add(v.node)
        v = x


def _row_statistic(g, v: Value, prim: str, members: set) -> Value | None:
    """x, where ``v`` is ``prim`` of x over its last dim broadcast back along it."""
    while g.node(v.node).prim == "broadcast_in_dim":
        (x,) = g.operands(v.node)
        if g.node(v.node).kwargs["broadcast_dimensions"] != tuple(range(g.type_of(x).ndim)):
            return None
        members.add(v.node)
        v = x
    node = g.node(v.node)
    (x,) = g.operands(v.node) if node.prim == prim else (None,)
    if x is None or node.kwargs["dims"] != (g.type_of(x).ndim - 1,):
        return None
    members.add(v.node)
    return x


def _softmax_input(g, p: Value, members: set) -> Value | None:
    """s, where ``p`` is softmax(s) over the last dim as torch.softmax traces."""
    if g.node(p.node).prim != "div":
        return None
    e, denominator = g.operands(p.node)
    if g.node(e.node).prim != "exp" or _row_statistic(g, denominator, "sum", members) != e:
        return None
    (d,) = g.operands(e.node)
    if g.node(d.node).prim != "sub":
        return None
    s, top = g.operands(d.node)
    if _row_statistic(g, top, "amax", members) != s:
        return None
    members.update((p.node, e.node, d.node))
    return s


def _scalar(g, v: Value) -> float | None:
    node = g.node(v.node)
    value = node.kwargs.get("value") if node.prim == "full" else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def _scaled(g, s: Value, members: set) -> tuple[Value, float]:
    """(x, c) where ``s`` is x times c, through multiplications and divisions by fills."""
    scale = 1.0
    while g.node(s.node).prim in ("mul", "div"):
        x, c = g.operands(s.node)
        if g.node(s.node).prim == "mul" and _scalar(g, c) is None:
            x, c = c, x
        factor = _scalar(g, c)
        if factor is None or factor == 0 and g.node(s.node).prim == "div":
            break
        scale = scale * factor if g.node(s.node).prim == "mul" else scale / factor
        members.add(s.node)
        s = _batch_view(g, x, members)
    return s, scale


def _matmul(g, kwargs: dict, lhs: Value, rhs: Value) -> bool | None:
    """For a batched matmul [..., M, K] x [..., K, N] (False) or [..., M, K] x [..., N, K]
    (True), batch dims leading: whether rhs contracts its last dim; None for any other."""
    nd = g.type_of(lhs).ndim
    batch = tuple(range(nd - 2))
    (lc, rc), (lb, rb) = kwargs["contracting"], kwargs["batch"]
    if g.type_of(rhs).ndim != nd or lb != batch or rb != batch or lc != (nd - 1,) \
            or rc not in ((nd - 2,), (nd - 1,)):
        return None
    return rc == (nd - 1,)


def _swapped(g, v: Value) -> Value | None:
    """x, where ``v`` is x with its last two dims swapped (through batch reshapes)."""
    x = _batch_view(g, v)
    node, nd = g.node(x.node), g.type_of(x).ndim
    if node.prim == "transpose" and node.kwargs["permutation"] == (*range(nd - 2), nd - 1, nd - 2):
        return g.operands(x.node)[0]
    return None


def match(g, kwargs: dict, p: Value, v: Value):
    """For ``dot_general(p, v, **kwargs)`` that is attention: (q, k, v, scale, the nodes
    inside the pattern), with k and v each as (value, whether its last two dims are still
    to be swapped to make it [..., N, E] and [..., N, Ev]); else None."""
    v_contracts_last = _matmul(g, kwargs, p, v)
    if v_contracts_last is None:
        return None
    members: set[int] = set()
    s = _softmax_input(g, _batch_view(g, p, members), members)
    if s is None:
        return None
    s, scale = _scaled(g, _batch_view(g, s, members), members)
    if g.node(s.node).prim != "dot_general":
        return None
    q, k = g.operands(s.node)
    k_contracts_last = _matmul(g, g.node(s.node).kwargs, q, k)
    if k_contracts_last is None or len({g.type_of(x).dtype for x in (q, k, v)}) != 1:
        return None
    members.add(s.node)
    return q, (k, not k_contracts_last), (v, v_contracts_last), scale, members


def _exclusive(graph: Graph, n: int, members: set[int], pinned: set[int]) -> bool:
    """Is every node inside the pattern used only inside it (and by ``n``), and none of them
    ``pinned`` (an output, or an end of a control edge)?"""
    return all(m not in pinned and not is_effectful(graph.node(m))
               and set(graph.users(m)) <= members | {n} for m in members)


def _unswapped(b: GraphBuilder, v: Value, swap: bool, provenance) -> Value:
    """``v`` with its last two dims swapped where ``swap`` (a transpose it came from undone)."""
    if not swap:
        return v
    source = _swapped(b, v)
    if source is not None:
        return source
    # batch reshapes keep the last two dims: swap them before those, so that the operands
    # keep the batch dims they share (the library's fused kernels take only 4-D ones)
    v = _batch_view(b, v)
    t, nd = b.type_of(v), b.type_of(v).ndim
    return b.add_node("transpose", (v,), {"permutation": (*range(nd - 2), nd - 1, nd - 2)},
                      (attrs.evolve(t, shape=(*t.shape[:-2], t.shape[-1], t.shape[-2])),),
                      provenance)[0]


def _batched(b: GraphBuilder, xs: list[Value], batch: tuple, provenance) -> list[Value]:
    """``xs`` with one batch shape: the shape they were reshaped from where they all agree
    (the 4-D tensors of multi-head attention), else ``batch``."""
    sources = [_batch_view(b, x) for x in xs]
    if len({b.type_of(x).shape[:-2] for x in sources}) == 1:
        return sources
    out = []
    for x in xs:
        t = b.type_of(x)
        shape = (*batch, *t.shape[-2:])
        out.append(x if t.shape == shape else b.add_node(
            "reshape", (x,), {"shape": shape}, (attrs.evolve(t, shape=shape),), provenance)[0])
    return out


def fuse_attention(graph: Graph) -> Graph:
    """NOTE [attention fusion]."""
    if not config.fuse_attention:
        return graph
    pinned = {v.node for v in graph.outputs} | {u for edge in graph.control_edges() for u in edge}

    def visit(b, n, operands, preds):
        node = graph.node(n)
        if preds or node.prim != "dot_general":
            return None
        found = match(graph, node.kwargs, *graph.operands(n))
        if found is None or not _exclusive(graph, n, found[-1], pinned):
            return None
        # the same pattern among the new nodes, unless a node of it was fused already
        # (an attention whose output is matmul'd again inside this one)
        found = match(b, node.kwargs, *operands)
        if found is None:
            return None
        q, (k, k_swap), (v, v_swap), scale, _ = found
        t, provenance = node.out_types[0], node.provenance
        q, k, v = _batched(b, [q, _unswapped(b, k, k_swap, provenance),
                               _unswapped(b, v, v_swap, provenance)], t.shape[:-2], provenance)
        shape = (*b.type_of(q).shape[:-1], b.type_of(v).shape[-1])
        (result,) = b.add_node("attention", (q, k, v), {"scale": scale},
                               (attrs.evolve(t, shape=shape),), provenance)
        if shape == t.shape:
            return [result]
        return b.add_node("reshape", (result,), {"shape": t.shape}, (t,), provenance)

    return rewrite(graph, visit)
