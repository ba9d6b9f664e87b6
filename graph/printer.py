"""Graph -> readable text, in the spirit of a jaxpr.

    graph(%0: f32[4,8], %1: f32[8] donated) {
      %2: f32[4,8] = broadcast_in_dim[broadcast_dimensions=(1,), shape=(4, 8)](%1)  # aten.add.Tensor  f.py:3
      %3: f32[4,8] = add(%0, %2)
      %4: f32[4,8] = mul(%3, %3) after(%2)
      return (%3, %4)
    }

A node whose params hold graphs (a ``cond``'s branches, a ``scan``'s body) prints each below
its line, indented. Values are renumbered in topological order, so two graphs that differ only in how their nodes
were created print (and hash) the same. ``after(...)`` lists control predecessors; a donated
input (``jit(..., donate_argnums=...)``) says so, as its memory may hold a result, and so does
a mutated input, ``updated by output k``, whose memory may hold its new value.
"""
from __future__ import annotations

import torch

from .types import Constant, dtype_name


def format_param(value, canonical: bool = False, graph_type: type | tuple = ()) -> str:
    """A node's param as text; one of ``graph_type`` (a body) is printed below its node."""
    if isinstance(value, graph_type):
        return "{...}"
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, Constant):
        return f"const<{value.digest}>" if canonical else repr(value)
    if isinstance(value, tuple):
        inner = ", ".join(format_param(v, canonical, graph_type) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def graph_to_text(graph, provenance: bool = True, canonical: bool = False) -> str:
    """``canonical`` is the hashed form: no provenance, devices on types, full constant
    digests."""
    provenance = provenance and not canonical
    names: dict[tuple[int, int], str] = {}

    def name(v) -> str:
        return names[(v.node, v.index)]

    def define(n: int) -> str:
        node = graph.node(n)
        outs = []
        for i, t in enumerate(node.out_types):
            names[(n, i)] = f"%{len(names)}"
            outs.append(f"{names[(n, i)]}: {t}" + (f"@{t.device}" if canonical else ""))
        if not outs:  # an effect with no result still needs a name for after(...)
            names[(n, 0)] = f"%{len(names)}"
            return f"{names[(n, 0)]}: ()"
        return ", ".join(outs)

    def marked(n: int) -> str:
        kwargs = graph.node(n).kwargs
        return define(n) + " donated" * bool(kwargs.get("donated")) + (
            f" updated by output {kwargs['updated_by']}" if "updated_by" in kwargs else "")

    header = ", ".join(map(marked, graph.inputs))
    lines = [f"graph({header}) {{"]
    for n in graph.order:
        node = graph.node(n)
        if node.prim == "input":
            continue
        lhs = define(n)
        params = ", ".join(f"{k}={format_param(v, canonical, type(graph))}"
                           for k, v in node.params)
        args = ", ".join(name(v) for v in graph.operands(n))
        line = f"  {lhs} = {node.prim}{f'[{params}]' if params else ''}({args})"
        preds = graph.control_preds(n)
        if preds:
            line += " after(" + ", ".join(names[(p, 0)] for p in preds) + ")"
        if provenance and (node.provenance.aten or node.provenance.source):
            where = "  ".join(filter(None, (node.provenance.aten, node.provenance.source)))
            line += f"  # {where}"
        lines.append(line)
        for k, sub in node.params:  # a control-flow node's bodies, nested below it
            if isinstance(sub, type(graph)):
                text = graph_to_text(sub, provenance, canonical).split("\n")
                lines += [f"    {k}: {text[0]}"] + [f"    {t}" for t in text[1:]]
    lines.append("  return (" + ", ".join(name(v) for v in graph.outputs) + ")")
    lines.append("}")
    return "\n".join(lines)
