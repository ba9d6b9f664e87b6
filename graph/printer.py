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


def _format_param(value, canonical: bool) -> str:
    from .graph import Graph

    if isinstance(value, Graph):  # printed in full below its node's line
        return "{...}"
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, Constant):
        return f"const<{value.digest}>" if canonical else repr(value)
    if isinstance(value, tuple):
        inner = ", ".join(_format_param(v, canonical) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def graph_to_text(graph, provenance: bool = True, canonical: bool = False) -> str:
    """``canonical`` is the hashed form: no provenance, devices on types, full constant
    digests."""
    from .graph import Graph

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
        params = ", ".join(f"{k}={_format_param(v, canonical)}" for k, v in node.params)
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
            if isinstance(sub, Graph):
                text = graph_to_text(sub, provenance, canonical).split("\n")
                lines += [f"    {k}: {text[0]}"] + [f"    {t}" for t in text[1:]]
    lines.append("  return (" + ", ".join(name(v) for v in graph.outputs) + ")")
    lines.append("}")
    return "\n".join(lines)


def program_to_text(program) -> str:
    """A loop program (graph/loops.py) as text: each step in order, a kernel with its loops,
    its values (``t..``, operands first), its stores and the source lines it computes.

        program(in0: f32[4,8], in1: f32[8,8]) {
          buf2: f32[4,8] = extern0 dot_general(in0, in1)
          kernel3 for x0 < 4, reduce r0 < 8 {  # aten._softmax.default  model.py:3
            t0: f32 = amax[r](buf2[r0 + 8*x0])
            ...
            buf5[r0 + 8*x0] = t5
          }
          return (buf5)
        }
    """
    from .loops import Apply, Constant as Literal, IndexValue, Kernel, Load, Reduce, Wait, walk

    def typed(b: str) -> str:
        return f"{b}: {program.buffers[b].type}"

    def kernel_lines(k: Kernel) -> list[str]:
        names: dict = {}

        def value(e) -> str:
            if isinstance(e, Load):
                where = "".join(f", i{j}={value(p)} in [0,{n})" for j, (p, n) in
                                enumerate(e.indirect))
                return f"{e.buffer}[{e.index}{where}]"
            if isinstance(e, Literal):
                return repr(e.value)
            if isinstance(e, IndexValue):
                return f"index({e.expr})"
            return names[e]

        loops = [f"x{i} < {n}" for i, n in enumerate(k.sizes)]
        if k.reduction_sizes:
            loops.append("reduce " + ", ".join(f"r{i} < {n}"
                                               for i, n in enumerate(k.reduction_sizes)))
        where = dict.fromkeys(line.split("  ", 1)[-1] for line in program.describe(k))
        comment = f"  # {'; '.join(where)}" if where else ""
        lines = [f"  {k.name} for {', '.join(loops) or '()'} {{{comment}"]
        for e in walk(*(s.value for s in k.stores)):
            if isinstance(e, Apply):
                params = ", ".join(f"{n}={_format_param(v, False)}" for n, v in e.params)
                rhs = f"{e.op}{f'[{params}]' if params else ''}(" \
                      f"{', '.join(value(a) for a in e.args)})"
            elif isinstance(e, Reduce):
                rhs = f"{e.op}[r]({value(e.body)})"
            else:
                continue
            names[e] = f"t{len(names)}"
            lines.append(f"    {names[e]}: {dtype_name(e.dtype)} = {rhs}")
        lines += [f"    {s.buffer}[{s.index}] = {value(s.value)}" for s in k.stores]
        return lines + ["  }"]

    lines = [f"program({', '.join(typed(b) for b in program.inputs)}) {{"]
    lines += [f"  {typed(b)} = constant" for b in program.constants]
    for k in program.kernels:
        if isinstance(k, Kernel):
            lines += kernel_lines(k)
            continue
        outs = ", ".join(typed(b) for b in k.outputs) or "()"
        what = f"wait({k.start})" if isinstance(k, Wait) else f"{k.label}"
        lines.append(f"  {outs} = {k.name} {what}({', '.join(k.inputs)})")
    taken = {o: b for o, b in program.aliases.items()}
    if taken:
        lines.append("  # in place: " + ", ".join(f"{o} in {b}" for o, b in taken.items()))
    lines.append(f"  return ({', '.join(program.outputs)})")
    return "\n".join(lines + ["}"])
