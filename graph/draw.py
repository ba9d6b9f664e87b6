"""Drawing a graph: a layered layout computed in Python and written as SVG, or DOT text.

NOTE [drawing]
Nothing here needs a system package. Rows come from the longest path (a node with no user
sits one row below its deepest operand), then every other node sinks to the row just above
its first user, so a weight or a side computation is drawn next to where it is used. An
edge spanning several rows passes through a dummy point on every row in between, so it runs
beside the boxes rather than through them. Within a row, items are
ordered by barycentre sweeps (each moves towards the mean position of its neighbours in the
row above, then below), the classic heuristic against crossings; then each row is placed
left to right, every item as close as it fits below the mean of its upper neighbours, so
chains run straight down. ``groups`` (node -> cluster name) keeps a cluster's nodes adjacent
in every row and draws a labelled box around them: the kernel stage will draw each fused
kernel that way. With ``engine="auto"``, Graphviz's ``dot`` lays out the DOT text instead
when it is on PATH.

Boxes are labelled with the printer's value names (``%3``), so a picture reads against the
graph's text. A control-flow node's box names its bodies (``body: 7 nodes``) and its tooltip
holds their text. The SVG uses presentation attributes and no ids, so several drawings can be
inlined into one HTML page without their styles or ids clashing.
"""
from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

import attrs
import networkx as nx

from ..errors import DebugError
from .types import CONTROL

ENGINES = ("auto", "python", "dot")
_FILL = {"input": "#dbeafe", "constant": "#e5e7eb", "op": "#fef9c3"}
_CHAR_W, _LINE_H, _PAD, _GAP, _ROW_GAP, _MARGIN, _CLUSTER_PAD = 7.2, 15, 6, 16, 44, 20, 12


@attrs.frozen
class _Box:
    """One node as drawn: its label lines, kind (fill colour), and tooltip."""

    lines: tuple[str, ...]
    kind: str
    is_output: bool
    title: str

    @property
    def size(self) -> tuple[float, float]:
        return (max(map(text_width, self.lines)) + 2 * _PAD,
                len(self.lines) * _LINE_H + 2 * _PAD)


def text_width(text: str) -> float:
    """The drawn width of a line of text in the 12px monospace of ``svg_open``."""
    return len(text) * _CHAR_W


def svg_open(width: float, height: float, css_class: str | None = None) -> str:
    """The ``<svg>`` tag every drawing starts with: its size, no id (drawings are inlined side
    by side into one page), 12px monospace text."""
    named = f" class={quoteattr(css_class)}" if css_class else ""
    return (f'<svg xmlns="http://www.w3.org/2000/svg"{named} width="{width:.0f}" '
            f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" '
            'font-family="monospace" font-size="12">')


def node_names(graph) -> dict[int, str]:
    """Each node's first value name as ``graph.as_text()`` prints it (``%0`` ...).

    Read off the printed text, whose body lines follow ``graph.order`` less the inputs, so
    there is one numbering rule, the printer's."""
    lines = graph.as_text(provenance=False).splitlines()
    names = dict(zip(graph.inputs, re.findall(r"%\d+", lines[0])))
    body = [n for n in graph.order if graph.node(n).prim != "input"]
    own = [line for line in lines[1:-2] if line.startswith("  %")]  # not a nested body's
    names.update((n, line.split(":", 1)[0].strip()) for n, line in zip(body, own))
    return names


def _boxes(graph) -> dict[int, _Box]:
    names = node_names(graph)
    outs: dict[int, list[int]] = {}
    for k, v in enumerate(graph.outputs):
        outs.setdefault(v.node, []).append(k)
    boxes = {}
    for n in graph.order:
        node = graph.node(n)
        head = f"{names[n]} {node.prim}"
        if node.prim == "input":
            head += f" {node.kwargs['index']}"
        lines = [head, ", ".join(map(str, node.out_types)) or "()"]
        if n in outs:
            lines.append("-> out " + ", ".join(map(str, outs[n])))
        bodies = [(k, v) for k, v in node.params if isinstance(v, type(graph))]  # control flow's
        lines += [f"{k}: {len(v) - len(v.inputs)} nodes" for k, v in bodies]
        where = "  ".join(filter(None, (node.provenance.aten, node.provenance.source)))
        params = ", ".join(f"{k}={v!r}" for k, v in node.params
                           if node.prim != "constant" and not isinstance(v, type(graph)))
        title = "\n".join(filter(None, (f"{head}[{params}]" if params else head, where,
                                         *(f"{k}: {v.as_text()}" for k, v in bodies))))
        kind = node.prim if node.prim in _FILL else "op"
        boxes[n] = _Box(tuple(lines), kind, n in outs, title)
    return boxes


def _rows(graph) -> dict[int, int]:
    g = graph.nx
    rank = {n: r for r, gen in enumerate(nx.topological_generations(g)) for n in gen}
    for n in reversed(graph.order):  # sink each node to just above its first user
        if g.out_degree(n):
            rank[n] = min(rank[s] for s in g.successors(n)) - 1
    return rank


def _layout(graph, boxes: dict[int, _Box], groups: Mapping[int, str]):
    """Item positions (x, y of the top-left corner) and each edge's chain of items.

    Items are node ids and dummy points ``(u, v, key, row)`` of long edges."""
    rank = _rows(graph)
    rows: list[list] = [[] for _ in range(max(rank.values(), default=-1) + 1)]
    for n in graph.order:
        rows[rank[n]].append(n)
    up: dict = {item: [] for item in graph.order}
    down: dict = {item: [] for item in graph.order}
    chains = {}
    for u, v, key in sorted(graph.nx.edges(keys=True)):
        chain = [u, *((u, v, key, r) for r in range(rank[u] + 1, rank[v])), v]
        for a, b in itertools.pairwise(chain):
            if b not in up:  # a dummy
                up[b], down[b] = [], []
                rows[b[3]].append(b)
            down[a].append(b)
            up[b].append(a)
        chains[(u, v, key)] = chain

    pos = {item: i for row in rows for i, item in enumerate(row)}
    group = {item: groups.get(item) if isinstance(item, int) else None for item in pos}
    for sweep in range(6):
        downward = sweep % 2 == 0
        neighbours = up if downward else down
        for r in (range(1, len(rows)) if downward else range(len(rows) - 2, -1, -1)):
            bary = {item: sum(pos[x] for x in neighbours[item]) / len(neighbours[item])
                    if neighbours[item] else pos[item] for item in rows[r]}
            members: dict = {}
            for item in rows[r]:
                members.setdefault(group[item], []).append(bary[item])
            cluster = {c: sum(b) / len(b) for c, b in members.items()}
            rows[r].sort(key=lambda item: (bary[item] if group[item] is None
                                           else cluster[group[item]], group[item] or "",
                                           bary[item]))
            pos.update((item, i) for i, item in enumerate(rows[r]))

    size = {n: boxes[n].size for n in graph.order}
    xy, y = {}, _MARGIN + (_CLUSTER_PAD + _LINE_H if groups else 0)
    for row in rows:
        height = max((size[item][1] for item in row if isinstance(item, int)), default=_LINE_H)
        right, previous = _MARGIN, None
        for item in row:
            if not isinstance(item, int):  # a dummy: no width, the row's height
                size[item] = (0.0, height)
            w = size[item][0]
            if previous is not None:
                right += _GAP if group[item] == group[previous] else _GAP + 2 * _CLUSTER_PAD
            uppers = [xy[p][0] + size[p][0] / 2 for p in up[item]]
            x = max(right, sum(uppers) / len(uppers) - w / 2) if uppers else right
            xy[item] = (x, y)
            right, previous = x + w, item
        y += height + _ROW_GAP
    return xy, size, chains


def _edge_path(graph, chain, data, xy, size) -> tuple[str, float, float]:
    """An SVG path through the chain with vertical tangents, ending above the target."""
    u, v = chain[0], chain[-1]
    (ux, uy), (uw, uh) = xy[u], size[u]
    (vx, vy), (vw, _) = xy[v], size[v]
    if data["kind"] == CONTROL:
        start, end = (ux + uw / 2, uy + uh), (vx + vw / 2, vy)
    else:  # spread outputs along the bottom and operands along the top, in order
        n_out = max(len(graph.node(u).out_types), 1)
        n_in = len(graph.operands(v))
        start = (ux + uw * (data["index"] + 1) / (n_out + 1), uy + uh)
        end = (vx + vw * (data["operand"] + 1) / (n_in + 1), vy)
    points = [start]
    for d in chain[1:-1]:  # a dummy crosses its row straight down
        points += [xy[d], (xy[d][0], xy[d][1] + size[d][1])]
    points.append((end[0], end[1] - 6))
    path = [f"M{points[0][0]:.1f},{points[0][1]:.1f}"]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        mid = (y0 + y1) / 2
        path.append(f"C{x0:.1f},{mid:.1f} {x1:.1f},{mid:.1f} {x1:.1f},{y1:.1f}")
    return " ".join(path), end[0], end[1]


def to_svg(graph, groups: Mapping[int, str] | None = None, engine: str = "auto") -> str:
    """The drawing as SVG text (see NOTE [drawing])."""
    if engine not in ENGINES:
        raise DebugError(f"unknown drawing engine {engine!r}; choose one of {ENGINES}")
    if engine == "dot" or (engine == "auto" and shutil.which("dot")):
        return _run_dot(to_dot(graph, groups))
    groups = dict(groups or {})
    boxes = _boxes(graph)
    xy, size, chains = _layout(graph, boxes, groups)
    width = max((xy[i][0] + size[i][0] for i in xy), default=0) + _MARGIN + _CLUSTER_PAD
    height = max((xy[i][1] + size[i][1] for i in xy), default=0) + _MARGIN + _CLUSTER_PAD
    out = [svg_open(width, height)]
    clusters: dict[str, list[int]] = {}
    for n in graph.order:
        if n in groups:
            clusters.setdefault(groups[n], []).append(n)
    for name, members in clusters.items():
        x0 = min(xy[n][0] for n in members) - _CLUSTER_PAD
        y0 = min(xy[n][1] for n in members) - _CLUSTER_PAD - _LINE_H
        x1 = max(xy[n][0] + size[n][0] for n in members) + _CLUSTER_PAD
        y1 = max(xy[n][1] + size[n][1] for n in members) + _CLUSTER_PAD
        out.append(f'<g class="cluster" data-cluster={quoteattr(name)}><rect x="{x0:.1f}" '
                   f'y="{y0:.1f}" width="{x1 - x0:.1f}" height="{y1 - y0:.1f}" rx="8" '
                   f'fill="#f0fdf4" stroke="#16a34a"/><text x="{x0 + 6:.1f}" '
                   f'y="{y0 + _LINE_H - 2:.1f}" fill="#166534">{escape(name)}</text></g>')
    for (u, v, key), chain in chains.items():
        data = graph.nx.edges[u, v, key]
        d, x, y = _edge_path(graph, chain, data, xy, size)
        control = data["kind"] == CONTROL
        colour, dash = ("#9333ea", ' stroke-dasharray="6 4"') if control else ("#475569", "")
        operand = "" if control else f' data-operand="{data["operand"]}"'
        out.append(f'<g class="edge {data["kind"]}" data-src="{u}" data-dst="{v}"{operand}>'
                   f'<path d="{d}" fill="none" stroke="{colour}" stroke-width="1.2"{dash}/>'
                   f'<polygon points="{x - 4:.1f},{y - 7:.1f} {x + 4:.1f},{y - 7:.1f} '
                   f'{x:.1f},{y:.1f}" fill="{colour}"/></g>')
    for n, box in boxes.items():
        (x, y), (w, h) = xy[n], size[n]
        kind = box.kind + (" output" if box.is_output else "")
        border = ' stroke="#b91c1c" stroke-width="2.5"' if box.is_output else ' stroke="#334155"'
        out.append(f'<g class="node {kind}" data-node="{n}"><title>{escape(box.title)}</title>'
                   f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="4" '
                   f'fill="{_FILL[box.kind]}"{border}/>')
        for i, line in enumerate(box.lines):
            weight = ' font-weight="bold"' if i == 0 else ""
            out.append(f'<text x="{x + _PAD:.1f}" y="{y + _PAD + (i + 1) * _LINE_H - 4:.1f}"'
                       f'{weight}>{escape(line)}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _run_dot(dot: str) -> str:
    try:
        done = subprocess.run(["dot", "-Tsvg"], input=dot, capture_output=True, text=True,
                              timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DebugError(f"Graphviz's dot failed to run ({e}); draw with engine='python'") from e
    if done.returncode:
        raise DebugError(f"Graphviz's dot failed: {done.stderr.strip()}; draw with "
                        "engine='python'")
    return done.stdout


def _dot_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(graph, groups: Mapping[int, str] | None = None) -> str:
    """The graph as Graphviz DOT text: the same boxes, control edges dashed, each group a
    ``cluster`` subgraph."""
    groups = dict(groups or {})
    boxes = _boxes(graph)

    def node_line(n: int) -> str:
        box = boxes[n]
        extra = ', color="#b91c1c", penwidth=2.5' if box.is_output else ""
        return (f"n{n} [label={_dot_str(chr(10).join(box.lines))}, "
                f"tooltip={_dot_str(box.title)}, fillcolor=\"{_FILL[box.kind]}\"{extra}];")

    lines = ["digraph plait {",
             '  node [shape=box, style="rounded,filled", fontname="monospace", fontsize=10];']
    clusters: dict[str, list[int]] = {}
    for n in graph.order:
        if n in groups:
            clusters.setdefault(groups[n], []).append(n)
        else:
            lines.append("  " + node_line(n))
    for i, (name, members) in enumerate(clusters.items()):
        lines += [f"  subgraph cluster_{i} {{", f"    label={_dot_str(name)};",
                  *("    " + node_line(n) for n in members), "  }"]
    for u, v, key in sorted(graph.nx.edges(keys=True)):
        data = graph.nx.edges[u, v, key]
        style = ' [style=dashed, color="#9333ea"]' if data["kind"] == CONTROL else ""
        lines.append(f"  n{u} -> n{v}{style};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def draw(graph, path, groups: Mapping[int, str] | None = None, engine: str = "auto") -> Path:
    """Write the drawing to ``path`` (SVG) and return the path."""
    path = Path(path)
    path.write_text(to_svg(graph, groups, engine))
    return path
