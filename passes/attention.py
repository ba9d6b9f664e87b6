"""Attention fusion: softmax(q @ kᵀ * scale) @ v becomes one ``attention`` node.

NOTE [attention fusion]
Written out, attention stores its [..., M, N] scores and probabilities: at 16 heads of 2048
tokens that is 64 MiB per batch item, written and read back twice. A fused attention
kernel (FlashAttention, which ``attention``'s implementation reaches through torch's
``scaled_dot_product_attention``) streams over blocks of keys with an online softmax and
stores nothing of size M x N. This pass finds the pattern in a traced graph, as
torch.compile's attention patterns do, and replaces it:

    dot_general(P, v)  with  P = softmax(S) over the last dim, as traced (amax, sub, exp,
                             sum, div), S = (q @ kᵀ) times or divided by scalar fills, then
                             optionally plus an additive mask (``attention``'s fourth
                             operand, any value: a padding mask, T5's position bias) or
                             masked causally: masked_fill(~tril, -inf), the boolean tril a
                             constant (``attention``'s ``causal``).

Converts between floating dtypes and reshapes that keep the last two dims may sit anywhere
on the path (bf16 attention converts to f32 for the softmax and back; matmuls of 4-D
operands are traced as 3-D bmms). A transposed k or v is read through its transpose.
Every node inside the pattern must have no user outside it (and be no output, and no end of
a control edge): where the scores are needed anyway, fusing would compute them twice.

Float32 attention on CUDA over at most ``FLOAT32_WRITTEN_MAX_KEYS`` keys (tracer/nn.py) stays
written out, and ``scaled_dot_product_attention`` traces torch's math form there:
torch's fused kernels for float32 (memory-efficient attention; flash takes half precision
only) run on CUDA cores, and lose to the library's products and plait's softmax kernels
where the scores are small. ViT-B/16's [64, 12, 197, 197] attention on an H100, forward and
backward: 15.8 ms fused, 15.3 written out, its training step 170.4 -> 169.5 ms; the
probabilities it then saves for the backward (1.4 GB over its 12 blocks) leave its peak
below torch.compile's, which writes the same attention out.

The fused kernel does not round the scores and probabilities to bf16/fp16 between steps as
eager does, so it is slightly more accurate than the code it replaces. The pass runs in
jit's simplify pipeline and, on the graph being differentiated, before reverse-mode
differentiation (``autodiff.joint``): a training step's attention then differentiates by
the primitive's own rule, torch's fused backward (tracer/nn.py), and neither pass stores
the scores. Its second derivatives differentiate the written-out form (``attention_scores``
then softmax and the product with v; passes/autodiff.py).
"""
from __future__ import annotations

import itertools

import attrs
import torch

from ..config import device_kinds
from ..graph import Graph, GraphBuilder, TensorType, Value, rewrite
from ..tracer.aten import SoftmaxRule
from ..tracer.nn import stays_written
from ..tracer.registry import get_primitive, is_effectful


def _batch_view(g, v: Value, members: set | None = None) -> Value:
    """``v`` with reshapes that keep its last two dims (and, where ``members`` is given,
    converts between floating dtypes and softmax's derivative marker) skipped; skipped nodes
    join ``members``."""
    while True:
        node = g.node(v.node)
        if node.prim == "custom_vjp" and members is not None and \
                isinstance(node.kwargs["rule"], SoftmaxRule):
            members.add(v.node)
            v = g.operands(v.node)[-1]
            continue
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
    """x, where ``v`` is ``prim`` of x over its last dim broadcast back along it (softmax's
    max through the derivative marker it has until simplification erases it)."""
    while g.node(v.node).prim in ("broadcast_in_dim", "stop_gradient"):
        (x,) = g.operands(v.node)
        if g.node(v.node).prim == "broadcast_in_dim" and \
                g.node(v.node).kwargs["broadcast_dimensions"] != tuple(range(g.type_of(x).ndim)):
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


def _mask(g, v: Value) -> torch.Tensor | None:
    """The [M, N] boolean constant that ``v`` is, repeated over its leading dims (through
    broadcasts and negations), if it is one."""
    node, negated = g.node(v.node), False
    while node.prim in ("bitwise_not", "broadcast_in_dim"):
        if node.prim == "broadcast_in_dim":
            (x,) = g.operands(v.node)
            nd = g.type_of(v).ndim
            if g.type_of(x).ndim != 2 or node.kwargs["broadcast_dimensions"] != (nd - 2, nd - 1):
                return None
        negated ^= node.prim == "bitwise_not"
        v = g.operands(v.node)[0]
        node = g.node(v.node)
    if node.prim != "constant" or node.out_types[0].dtype != torch.bool \
            or node.out_types[0].ndim < 2:
        return None
    mask = node.kwargs["value"].tensor  # folded broadcasts: one [M, N] mask, repeated
    first = mask.reshape(-1, *mask.shape[-2:])[0]
    if not torch.equal(mask, first.expand(mask.shape)):
        return None
    return ~first if negated else first


def _causal(g, s: Value, members: set) -> tuple[Value, bool]:
    """(x, True) where ``s`` is x with the entries above the diagonal set to -inf
    (``masked_fill(~tril, -inf)`` as traced), else (s, False)."""
    node = g.node(s.node)
    if node.prim != "where":
        return s, False
    c, a, b = g.operands(s.node)
    for fill, x, keep_where_true in ((a, b, False), (b, a, True)):
        mask = _mask(g, c)
        if _scalar(g, fill) == float("-inf") and mask is not None:
            keep = mask if keep_where_true else ~mask
            if torch.equal(keep.cpu(), torch.ones(keep.shape, dtype=torch.bool).tril()):
                members.add(s.node)
                return x, True
    return s, False


def _biased(g, s: Value, members: set) -> tuple[Value, Value | None]:
    """(x, b) where ``s`` is x + b, x a product of scores (through scalings) and b anything
    else (an additive mask), else (s, None)."""
    if g.node(s.node).prim != "add":
        return s, None
    for x, bias in itertools.permutations(g.operands(s.node)):
        if g.node(_scaled(g, _batch_view(g, x, set()), set())[0].node).prim == "dot_general":
            members.add(s.node)
            return x, bias
    return s, None


def match(g, kwargs: dict, p: Value, v: Value):
    """For ``dot_general(p, v, **kwargs)`` that is attention: (q, k, v, scale, causal, the
    additive bias (the value added to the scores, or None), the nodes inside the pattern),
    with k and v each as (value, whether its last two dims are still to be swapped to make
    it [..., N, E] and [..., N, Ev]); else None."""
    v_contracts_last = _matmul(g, kwargs, p, v)
    if v_contracts_last is None:
        return None
    members: set[int] = set()
    s = _softmax_input(g, _batch_view(g, p, members), members)
    if s is None:
        return None
    s, causal = _causal(g, _batch_view(g, s, members), members)
    s, bias = _biased(g, _batch_view(g, s, members), members)
    s, scale = _scaled(g, _batch_view(g, s, members), members)
    if g.node(s.node).prim != "dot_general" or causal and bias is not None:
        return None
    q, k = g.operands(s.node)
    k_contracts_last = _matmul(g, g.node(s.node).kwargs, q, k)
    if k_contracts_last is None or len({g.type_of(x).dtype for x in (q, k, v)}) != 1:
        return None
    members.add(s.node)
    return q, (k, not k_contracts_last), (v, v_contracts_last), scale, causal, bias, members


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


def _bias_operand(b: GraphBuilder, bias: Value, q: TensorType, provenance) -> Value | None:
    """The added scores' bias as ``attention`` takes it: of q's rank and dtype, a broadcast
    into the scores undone into dims of size 1 (a mask over keys is read as [B, 1, 1, N], not
    repeated over heads and rows); None where its batch dims are not q's."""
    t = b.type_of(bias)
    if t.shape[:-2] != q.shape[:-2]:
        return None
    node = b.node(bias.node)
    dims = node.kwargs["broadcast_dimensions"] if node.prim == "broadcast_in_dim" else None
    if dims is not None and list(dims) == sorted(dims):
        (source,) = b.operands(bias.node)
        shape = [1] * t.ndim
        for d, n in zip(dims, b.type_of(source).shape):
            shape[d] = n
        bias = source if b.type_of(source).shape == tuple(shape) else b.add_node(
            "reshape", (source,), {"shape": tuple(shape)},
            (attrs.evolve(t, shape=tuple(shape)),), provenance)[0]
    if b.type_of(bias).dtype != q.dtype:
        bias = b.add_node("convert", (bias,), {"dtype": q.dtype},
                          (attrs.evolve(b.type_of(bias), dtype=q.dtype),), provenance)[0]
    return bias


# NOTE [masks known when compiling]
# A library that builds its attention mask from index comparisons hands
# ``scaled_dot_product_attention`` a tensor: transformers does while a compiler traces it
# (its shortcut to ``is_causal=True`` reads the padding mask's values), so every decoder
# of the suite passed a bias, and a bias rules out flash and cuDNN, whose fused kernels
# are 2.7x faster than the memory-efficient one on an H100 (GPT-2's attention, training
# step: 12.0 ms against 4.5). Folded, such a mask is a constant: one that is 0 where
# ``causal`` keeps a score and -inf (or the dtype's lowest: exp gives 0 either way, where
# a row keeps its diagonal) where it does not, the same over every batch and head, is
# ``causal`` itself; an all-zero one is no bias.
def _known_mask(g, bias: Value) -> str | None:
    """"causal" or "none" where the attention ``bias`` is a constant that masks causally or
    not at all (NOTE [masks known when compiling]), else None."""
    node = g.node(bias.node)
    if node.prim != "constant":
        return None
    mask = node.kwargs["value"].tensor
    first = mask.reshape(-1, *mask.shape[-2:])[0]
    if not torch.equal(mask, first.expand(mask.shape)):
        return None
    if not first.any():
        return "none"
    keep = torch.ones(first.shape, dtype=torch.bool, device=first.device).tril()
    masked = first[~keep]
    lowest = torch.finfo(first.dtype).min
    if first.shape[-2] == first.shape[-1] and not first[keep].any() \
            and bool(((masked == float("-inf")) | (masked == lowest)).all()):
        return "causal"
    return None


def _unmasked(b: GraphBuilder, node, operands) -> list[Value] | None:
    """``attention`` with a bias that ``_known_mask`` names, without it."""
    known = None if len(operands) != 4 or node.kwargs.get("dropout") \
        else _known_mask(b, operands[3])
    if known is None:
        return None
    return b.add_node("attention", operands[:3],
                      {**node.kwargs, "causal": known == "causal"}, node.out_types,
                      node.provenance)


def fuse_attention(graph: Graph) -> Graph:
    """NOTE [attention fusion]; NOTE [masks known when compiling]."""
    pinned = {v.node for v in graph.outputs} | {u for edge in graph.control_edges() for u in edge}

    def visit(b, n, operands, preds):
        node = graph.node(n)
        if not preds and node.prim == "attention":
            return _unmasked(b, node, operands)
        if preds or node.prim != "dot_general":
            return None
        found = match(graph, node.kwargs, *graph.operands(n))
        t = node.out_types[0]
        if found is None or not _exclusive(graph, n, found[-1], pinned) or stays_written(
                t.dtype, t.device, graph.type_of(graph.operands(n)[0]).shape[-1]):
            return None
        # the same pattern among the new nodes, unless a node of it was fused already
        # (an attention whose output is matmul'd again inside this one)
        found = match(b, node.kwargs, *operands)
        if found is None:
            return None
        q, (k, k_swap), (v, v_swap), scale, causal, bias, _ = found
        t, provenance = node.out_types[0], node.provenance
        q, k, v = _batched(b, [q, _unswapped(b, k, k_swap, provenance),
                               _unswapped(b, v, v_swap, provenance)], t.shape[:-2], provenance)
        biases = () if bias is None else (_bias_operand(b, bias, b.type_of(q), provenance),)
        if None in biases:
            return None
        shape = (*b.type_of(q).shape[:-1], b.type_of(v).shape[-1])
        statistic = get_primitive("attention").infer(
            *(b.type_of(x) for x in (q, k, v, *biases)), scale=scale, causal=causal)[1]
        result, _ = b.add_node("attention", (q, k, v, *biases),
                               {"scale": scale, "causal": causal},
                               (attrs.evolve(t, shape=shape), statistic), provenance)
        if shape == t.shape:
            return [result]
        return b.add_node("reshape", (result,), {"shape": t.shape}, (t,), provenance)

    return rewrite(graph, visit)


# NOTE [attention in the kernels' layout]
# Every graph value is stored row-major in its logical shape, so attention's [B, H, M, E]
# operands are stored heads first. CUDA's fused kernels (flash, cuDNN, memory-efficient) store
# their output [B, M, H, E], rows first, as a projection leaves q, k and v, and their
# backward reads the output and its cotangent so laid out (cuDNN's, q, k and v too:
# ``_as_left_by_cuda_kernels``, tracer/nn.py): heads first, each call copied eight tensors
# a layer forward and backward (ViT-B/16's training step: 96 copies, 2.8 ms of 22.6 on an
# H200). This pass gives every 4-D ``attention`` and ``attention_backward`` on the devices
# ``config.attention_layout`` names the param ``bshd``: their q, k, v, output, cotangent and
# gradients are stored [batch, rows, heads, head dim] (the statistics stay [B, H, M]), between
# transposes of dims 1 and 2. ``algebra`` then composes those transposes with the model's
# own (``q.view(B, M, H, E).transpose(1, 2)``, ``out.transpose(1, 2).reshape(B, M, H * E)``),
# and they cancel; what stays is computed by the kernel that writes the operand (RoPE's,
# the split of a fused qkv projection). The rules swap dims 1 and 2 back as views, so
# the library is handed exactly what an eager call from a projection hands it. Run before
# differentiation (``autodiff.joint``), so a training step's backward is in this layout too.
_HEADS_SWAP = (0, 2, 1, 3)
# primitive -> how many of its leading operands, and of its leading results, are so stored
_LAID_OUT = {"attention": (3, 1), "attention_backward": (5, 3)}


def attention_layout(graph: Graph, devices: str = "cuda") -> Graph:
    """NOTE [attention in the kernels' layout]; ``devices``: one of
    ``config.DEVICE_CHOICES`` (``config.attention_layout``)."""
    kinds = device_kinds("attention_layout", devices)

    def swapped(b, v: Value, provenance) -> Value:
        t = b.type_of(v)
        return b.add_node("transpose", (v,), {"permutation": _HEADS_SWAP},
                          (_swapped_type(t),), provenance)[0]

    def visit(b, n, operands, preds):
        node = graph.node(n)
        if node.prim not in _LAID_OUT or node.kwargs.get("bshd"):
            return None
        laid_operands, laid_results = _LAID_OUT[node.prim]
        first = graph.type_of(graph.operands(n)[0])  # (q, or the cotangent: q's batch dims)
        if first.ndim != 4 or torch.device(first.device).type not in kinds:
            return None
        p = node.provenance
        args = [swapped(b, x, p) if i < laid_operands else x for i, x in enumerate(operands)]
        types = [_swapped_type(t) if i < laid_results else t
                 for i, t in enumerate(node.out_types)]
        outs = b.add_node(node.prim, args, {**node.kwargs, "bshd": True}, types, p,
                          after=preds)
        return [swapped(b, v, p) if i < laid_results else v for i, v in enumerate(outs)]

    return rewrite(graph, visit)


def _swapped_type(t: TensorType) -> TensorType:
    return attrs.evolve(t, shape=tuple(t.shape[i] for i in _HEADS_SWAP))
