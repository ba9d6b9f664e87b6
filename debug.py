"""Looking at a compilation: its stages, the debug report folder, the compile-time logs.

NOTE [debug report]
With ``config.debug_dir`` set, every compilation (``Jitted._lower``: a cache miss, or
``lower()``) writes ``<debug_dir>/<function>-<traced graph digest[:12]>/``: for each stage
``NN-<stage>.txt`` and ``NN-<stage>.svg``, and ``index.html``, one self-contained page (inline
CSS and SVGs, no script, no network) with the stage table, every drawing and a provenance
table. A cache hit compiles nothing and writes nothing. Stages are the traced graph, then the
graph after each simplify pass (a pass that runs again is ``<name>.2``); ``simplified`` names
the graph the backend gets. A backend that lowers to loops (cpp, triton, loops) adds:
- the ``kernels`` stage: the graph with one cluster per fused kernel (``Stage.groups``);
- a "Kernels" section: per kernel its reads, writes and what it computes (primitive, ATen op,
  source line), and the generated source (``source.txt``), for a backend that generates code;
- a "Memory" section: the memory timeline chart (``memory.svg``, inlined; NOTE [memory
  timeline] in graph/timeline.py) and a table of its buffers, from ``passes.memory.report``
  of the backend's memory plan (what ``Lowered.memory`` returns), or, for a backend without
  one, of the plan that allocates every storage on its own (``stats["peak_bytes"]``'s).
Sections are ``Section``s passed to ``write_report(..., extra=)``, each with the files it
links written beside ``index.html``.

``on_compile`` also logs each compilation (``config.log``, loggers ``plait.<channel>``, debug
level), debug_dir or not: ``graph`` the traced and simplified graphs, ``fusion`` the fused
kernel program (each kernel's name, reads, writes and what it computes, with the program's
stats), ``kernels`` the generated source. An enabled ``fusion`` or ``kernels`` channel
compiles the program at ``lower()`` rather than at first use.
"""
from __future__ import annotations

import collections
import html
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from .config import config
from .errors import DebugError
from .graph import Graph, timeline
from .graph.draw import node_names, to_svg
from .passes import memory

__all__ = ["DebugError", "Section", "Stage", "function_name", "on_compile", "stage", "stages",
           "write_report"]

_graph_log, _fusion_log, _kernels_log = (logging.getLogger(f"plait.{channel}")
                                          for channel in ("graph", "fusion", "kernels"))


@attrs.frozen
class Stage:
    """One drawable stage of a compilation; ``groups`` (node -> name) are drawn as clusters."""

    name: str
    graph: Graph
    groups: Mapping[int, str] | None = None

    def draw(self, path, engine: str = "auto") -> Path:
        return self.graph.draw(path, self.groups, engine)


@attrs.frozen
class Section:
    """An extra part of the report: an HTML fragment (trusted, already escaped) and the files
    it links, written next to ``index.html`` (name -> text or bytes)."""

    title: str
    html: str
    files: Mapping[str, str | bytes] = attrs.field(factory=dict)


def stages(lowered) -> list[Stage]:
    """The traced graph, then the graph after each pass, in the order they ran."""
    runs: collections.Counter = collections.Counter()
    out = [Stage("traced", lowered.traced_graph)]
    for name, graph in lowered.passes:
        runs[name] += 1
        out.append(Stage(name if runs[name] == 1 else f"{name}.{runs[name]}", graph))
    program = _program(lowered)
    if program is not None:  # the kernel graph: each kernel a cluster of what it computes
        out.append(Stage("kernels", lowered.graph, groups={
            n: k.name for k in program.kernels for n in k.origins}))
    return out


def stage(lowered, name: str) -> Stage:
    """The stage called ``name``; ``simplified`` is the graph the backend compiles."""
    if name == "simplified":
        return Stage(name, lowered.graph)
    found = {s.name: s for s in stages(lowered)}
    if name not in found:
        raise DebugError(f"no stage {name!r} in this compilation; the stages are "
                         f"{', '.join([*found, 'simplified'])}")
    return found[name]


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px;
       padding: 0 1em; color: #1e293b; }
code, pre, td { font-family: ui-monospace, monospace; font-size: 12px; }
h1 code { font-size: inherit; }
table { border-collapse: collapse; margin: .5em 0 1.5em; }
th, td { border: 1px solid #cbd5e1; padding: 2px 8px; text-align: left; vertical-align: top; }
th { background: #f1f5f9; }
.graph { overflow: auto; max-height: 85vh; border: 1px solid #cbd5e1; margin-bottom: 1.5em; }
.graph svg { display: block; }
"""


def _cell(value) -> str:
    return f"<td>{html.escape(str(value)) if value else '&mdash;'}</td>"


def _provenance_table(graph: Graph) -> str:
    names = node_names(graph)
    rows = []
    for n in graph.order:
        node = graph.node(n)
        types = ", ".join(map(str, node.out_types))
        rows.append("<tr>" + "".join(_cell(v) for v in (
            names[n], node.prim, types, node.provenance.aten, node.provenance.source)) + "</tr>")
    return ("<table><tr><th>value</th><th>primitive</th><th>type</th><th>ATen op</th>"
            "<th>source</th></tr>\n" + "\n".join(rows) + "</table>")


def write_report(lowered, folder, title: str, extra: Sequence[Section] = ()) -> Path:
    """Write the report folder (see NOTE [debug report]) and return the path of index.html."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        files: dict[str, str | bytes] = {}
        table, drawings = [], []
        for i, s in enumerate(stages(lowered)):
            base = f"{i:02d}-{s.name}"
            svg = to_svg(s.graph, s.groups, engine="python")  # ids and data-* of our own
            files[f"{base}.txt"], files[f"{base}.svg"] = s.graph.as_text() + "\n", svg
            table.append(f'<tr><td><a href="#{base}">{html.escape(s.name)}</a></td>'
                         f"<td>{len(s.graph)}</td><td><a href=\"{base}.txt\">text</a></td>"
                         f'<td><a href="{base}.svg">svg</a></td></tr>')
            drawings.append(f'<h3 id="{base}">{html.escape(s.name)}</h3>\n'
                            f'<div class="graph">{svg[svg.index("<svg"):]}</div>')
        for section in extra:
            files.update(section.files)
        g = lowered.graph
        page = [
            (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
             f"<title>plait: {html.escape(title)}</title><style>{_CSS}</style></head><body>"),
            f"<h1>plait report: <code>{html.escape(title)}</code></h1>",
            (f"<p>inputs <code>{html.escape(', '.join(map(str, g.input_types)))}</code>; "
             f"outputs <code>{html.escape(', '.join(map(str, g.output_types)))}</code>; "
             f"backend <code>{html.escape(lowered.backend)}</code>; traced graph digest "
             f"<code>{lowered.traced_graph.digest[:12]}</code></p>"),
            ("<h2>Stages</h2><table><tr><th>stage</th><th>nodes</th><th colspan=\"2\">files"
             "</th></tr>"), *table, "</table>",
            *drawings,
            ("<h2>Provenance</h2><p>Each value of the compiled graph, with the ATen op and "
             "the line of user code it came from.</p>"), _provenance_table(g),
            *(f"<h2>{html.escape(s.title)}</h2>\n{s.html}" for s in extra),
            "</body></html>\n",
        ]
        files["index.html"] = "\n".join(page)
        for name, content in files.items():
            (folder / name).write_bytes(content if isinstance(content, bytes)
                                        else content.encode())
    except OSError as e:
        raise DebugError(f"cannot write the debug report to {folder}: {e}. Point "
                         "PLAIT_DEBUG_DIR (config.debug_dir) at a writable folder.") from e
    return folder / "index.html"


def function_name(fn) -> str:
    """How logs and reports name a function."""
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def on_compile(fn, lowered) -> Path | None:
    """Hook of every compilation: log the graphs, write the report when ``debug_dir`` is set.
    Returns the report folder, if one was written."""
    name = function_name(fn)
    if _graph_log.isEnabledFor(logging.DEBUG):  # simplifying is skipped where not needed
        _graph_log.debug("traced %s:\n%s", name, lowered.traced_graph)
        _graph_log.debug("simplified %s:\n%s", name, lowered.graph)
    # Only an enabled channel compiles here (lower() compiles lazily otherwise).
    if _fusion_log.isEnabledFor(logging.DEBUG) and (program := _program(lowered)) is not None:
        stats = ", ".join(f"{k}={v}" for k, v in lowered.stats.items())
        _fusion_log.debug("fused program of %s (%s):\n%s", name, stats, _program_text(program))
    if _kernels_log.isEnabledFor(logging.DEBUG) and _program(lowered) is not None and \
            lowered.kernels:
        _kernels_log.debug("generated source of %s:\n%s", name, lowered.source)
    if config.debug_dir is None:
        return None
    folder = Path(config.debug_dir) / (re.sub(r"[^\w.-]+", "_", name) + "-"
                                       + lowered.traced_graph.digest[:12])
    write_report(lowered, folder, name,
                 extra=_kernel_sections(lowered) + _memory_sections(lowered))
    _graph_log.debug("debug report of %s: %s", name, folder / "index.html")
    return folder


def _program(lowered):
    """The scheduled loop program of a backend that generates code; None for one that
    interprets the graph."""
    return None if lowered.scheduled is None else lowered.scheduled[0]


def _program_text(program) -> str:
    """The fused program for the ``fusion`` log: per kernel its name, reads and writes, then
    what it computes (primitive, ATen op, source line)."""
    return "\n".join(
        f"{k.name}: reads {', '.join(k.reads) or '-'}; writes {', '.join(k.writes) or '-'}"
        + "".join("\n    " + line for line in program.describe(k)) for k in program.kernels)


def _kernel_sections(lowered) -> list[Section]:
    """The generated source, and per kernel what it computes and where that came from."""
    program = _program(lowered)
    if program is None or not lowered.kernels:
        return []
    rows = "".join(
        f"<tr><td>{html.escape(k.name)}</td><td>{html.escape(', '.join(k.reads))}</td>"
        f"<td>{html.escape(', '.join(k.writes))}</td><td><pre>"
        f"{html.escape(chr(10).join(program.describe(k)))}</pre></td></tr>"
        for k in program.kernels)
    table = ("<table><tr><th>kernel</th><th>reads</th><th>writes</th><th>computes (primitive, "
             f"ATen op, source)</th></tr>{rows}</table>"
             '<p><a href="source.txt">generated source</a></p>')
    return [Section("Kernels", table, {"source.txt": lowered.source})]


def _memory_sections(lowered) -> list[Section]:
    """The memory timeline (NOTE [memory timeline]) and a table of its buffers. A backend
    without a memory plan (loops) allocates every storage on its own: the plan
    without a pool, which is what ``stats["peak_bytes"]`` estimates."""
    program = _program(lowered)
    if program is None or not program.kernels:
        return []
    plan = getattr(lowered.compiled, "plan", None) or memory.plan(program, pool=False)
    report = memory.report(program, plan)
    svg = timeline.to_svg(program, report, plan.live)
    names = [k.name for k in program.kernels]
    rows = "".join("<tr>" + "".join(_cell(v) for v in (
        b.buffer, str(b.nbytes), f"{b.first} {names[b.first]}", f"{b.last} {names[b.last]}",
        b.storage, None if b.slot is None else f"pool {b.slot}", b.origin)) + "</tr>\n"
        for b in timeline.bars(report))
    peak = report["peak_bytes"]
    body = (f"<p>Estimated peak {timeline.size_text(peak)} ({peak} B), {len(report['buffers'])}"
            f" buffers, {len(report['inplace'])} written in place, {len(report['pool'])} pool "
            'slots (<a href="memory.svg">memory.svg</a>; hover a bar or a kernel for details)'
            f'.</p>\n<div class="graph">{svg}</div>\n<table><tr><th>buffer</th><th>bytes</th>'
            "<th>first kernel</th><th>last kernel</th><th>storage</th><th>pool slot</th>"
            f"<th>in place of</th></tr>\n{rows}</table>")
    return [Section("Memory", body, {"memory.svg": svg})]
