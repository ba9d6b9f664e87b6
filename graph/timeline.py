"""The memory timeline: a loop program's buffers against kernel order, drawn as SVG.

NOTE [memory timeline]
Drawn from ``passes.memory.report`` (what ``Lowered.memory`` returns) and the plan's live
bytes during each kernel, recomputing nothing. Columns are the kernels, externs and waits in
execution order, each labelled at the top. Each buffer some kernel uses is one bar, from the
first to the last kernel using it, labelled with its size. Colour is memory: a bar takes the
colour of its storage, one per pool slot (buffers of one colour in one slot reuse its memory
over time), grey for inputs and constants, blue for other allocations of their own. A buffer
written in place into the storage of one it took over has a dashed outline and a connector to
that buffer at the kernel where it takes over: it adds no bytes. Inputs and constants are held
for the whole call and outputs (red outline) kept to the end, drawn as thin lines to the
edges. Above the bars, the live bytes during each kernel as a step curve: each storage once,
pool slots while held, as the memory plan counts them. The peak kernel is marked across the
chart with its byte count, ``report["peak_bytes"]``. A row per buffer and a column per kernel,
built in O(buffers + kernels): hundreds of buffers stay readable in a scrolling box.
"""
from __future__ import annotations

from collections.abc import Sequence
from xml.sax.saxutils import escape, quoteattr

import attrs

from .draw import svg_open, text_width
from .loops import Extern

_MARGIN, _GAP, _COL, _ROW, _BAR, _CURVE = 16, 12, 26, 16, 11, 96
_SLOT_FILLS = ("#fde68a", "#a7f3d0", "#c4b5fd", "#fbcfe8", "#99f6e4", "#fed7aa", "#d9f99d",
               "#fca5a5")
_HELD_FILL, _OWN_FILL, _LINE = "#cbd5e1", "#bfdbfe", "#334155"
_OUTLINE, _OUTPUT, _DASHED = (f'stroke="{_LINE}"', 'stroke="#b91c1c" stroke-width="2"',
                              ' stroke-dasharray="3 2"')
_LEGEND = (("input or constant (held for the whole call)", _HELD_FILL, _OUTLINE),
           ("own allocation", _OWN_FILL, _OUTLINE),
           ("pool slot (a colour per slot)", _SLOT_FILLS[0], _OUTLINE),
           ("dashed: written in place into the storage it is joined to (no bytes of its own)",
            _OWN_FILL, _OUTLINE + _DASHED),
           ("red outline: output (kept to the end)", _OWN_FILL, _OUTPUT))


def size_text(nbytes: int) -> str:
    """``512 B``, ``16.8 KiB``, ``2.0 MiB``, ..."""
    if nbytes < 1024:
        return f"{nbytes} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}"


@attrs.frozen
class Bar:
    """One buffer of the report as drawn (and tabulated): its storage, pool slot and, for an
    in-place buffer, the buffer it took over."""

    buffer: str
    nbytes: int
    first: int
    last: int
    storage: str
    slot: int | None
    origin: str | None


def bars(report: dict) -> list[Bar]:
    """The report's buffers top to bottom: storages in order of first use, each storage's
    buffers together (an in-place chain reads down)."""
    slot = {s: j for j, p in enumerate(report["pool"]) for s in p["storages"]}
    origin = dict(report["inplace"])
    out = [Bar(b, u["bytes"], u["first"], u["last"], u["storage"], slot.get(u["storage"]),
               origin.get(b)) for b, u in report["buffers"].items()]
    start: dict = {}
    for bar in out:
        start[bar.storage] = min(start.get(bar.storage, bar.first), bar.first)
    return sorted(out, key=lambda bar: (start[bar.storage], bar.storage, bar.first, bar.last))


def to_svg(program, report: dict, live: Sequence[int]) -> str:
    """The chart of NOTE [memory timeline] for ``program`` (a ``LoopProgram`` with kernels),
    ``report`` (``passes.memory.report``) and the plan's live bytes per kernel."""
    kernels, rows = program.kernels, bars(report)
    held, kept = {*program.inputs, *program.constants}, set(program.outputs)
    peak = report["peak_bytes"]
    at = live.index(peak)  # the first kernel at the peak
    peak_label = f"peak {size_text(peak)} ({peak} B) at {kernels[at].name}"
    labels = [f"{bar.buffer} {size_text(bar.nbytes)}" for bar in rows]
    left = _MARGIN + max(map(text_width, [*labels, "live bytes"])) + _GAP
    curve = _MARGIN + max(text_width(k.name) for k in kernels) + _GAP  # top of the curve
    top = curve + _CURVE + _GAP  # the first bar
    bottom = top + len(rows) * _ROW
    right = left + len(kernels) * _COL

    def x(i: int) -> float:
        return left + i * _COL

    def y(nbytes: int) -> float:  # in the curve's panel, the peak near its top
        return curve + _CURVE - nbytes / max(peak, 1) * (_CURVE - 2 * _GAP)

    px, py = x(at) + _COL / 2, y(peak)
    width = max(right, px + 6 + text_width(peak_label),
                _MARGIN + 14 + max(text_width(text) for text, *_ in _LEGEND)) + _MARGIN
    out = [svg_open(width, bottom + _GAP + len(_LEGEND) * _ROW + _MARGIN, "memory-timeline")]
    for i, k in enumerate(kernels):  # columns: a stripe, the name on top, a tooltip
        extern = isinstance(k, Extern)
        stripe = "#f5f3ff" if extern else ("#f8fafc", "#ffffff")[i % 2]
        name_fill = ' fill="#6d28d9"' if extern else ""
        what = "\n".join([k.name, *program.describe(k)])
        out.append(f'<g class="kernel" data-kernel="{i}" data-name={quoteattr(k.name)}>'
                   f'<title>{escape(what)}</title><rect x="{x(i)}" y="{curve}" '
                   f'width="{_COL}" height="{bottom - curve}" fill="{stripe}"/><text '
                   f'transform="translate({x(i) + _COL / 2 + 4},{curve - 4}) rotate(-90)"'
                   f"{name_fill}>{escape(k.name)}</text></g>")
    steps = " ".join(f"{x(i)},{y(v):.1f} {x(i + 1)},{y(v):.1f}" for i, v in enumerate(live))
    base = curve + _CURVE
    out.append(f'<g class="live" data-live="{" ".join(map(str, live))}">'
               f'<text x="{_MARGIN}" y="{base - _CURVE / 2:.1f}">live bytes</text>'
               f'<text x="{left - 4}" y="{base}" text-anchor="end">0</text>'
               f'<polygon points="{left},{base} {steps} {right},{base}" fill="#e0e7ff"/>'
               f'<polyline points="{steps}" fill="none" stroke="#4338ca" stroke-width="1.5"/>'
               f'<line x1="{left}" y1="{base}" x2="{right}" y2="{base}" stroke="{_LINE}"/></g>')
    out.append(f'<g class="peak" data-peak-bytes="{peak}" data-kernel="{at}">'
               f'<line x1="{px}" y1="{py:.1f}" x2="{px}" y2="{bottom}" stroke="#dc2626" '
               f'stroke-dasharray="4 3"/><circle cx="{px}" cy="{py:.1f}" r="3.5" '
               f'fill="#dc2626"/><text x="{px + 6}" y="{py - 5:.1f}" fill="#b91c1c" '
               f'font-weight="bold">{escape(peak_label)}</text></g>')
    row = {bar.buffer: top + r * _ROW + (_ROW - _BAR) / 2 for r, bar in enumerate(rows)}
    for bar, text in zip(rows, labels):
        x0, x1, y0 = x(bar.first) + 2, x(bar.last + 1) - 2, row[bar.buffer]
        fill = _HELD_FILL if bar.storage in held else _OWN_FILL if bar.slot is None else \
            _SLOT_FILLS[bar.slot % len(_SLOT_FILLS)]
        outline = (_OUTPUT if bar.buffer in kept else _OUTLINE) + (_DASHED if bar.origin else "")
        ends = [(left, x0)] if bar.buffer in held else []
        ends += [(x1, right)] if bar.buffer in held | kept else []
        tip = (f"{bar.buffer}: {bar.nbytes} B, kernels {bar.first} ({kernels[bar.first].name})"
               f" to {bar.last} ({kernels[bar.last].name}), storage {bar.storage}"
               + (f", pool slot {bar.slot}" if bar.slot is not None else "")
               + (f", in place of {bar.origin}" if bar.origin else ""))
        slot = f' data-slot="{bar.slot}"' if bar.slot is not None else ""
        out.append(f'<g class="buffer" data-buffer={quoteattr(bar.buffer)} '
                   f'data-bytes="{bar.nbytes}" data-first="{bar.first}" data-last="{bar.last}" '
                   f"data-storage={quoteattr(bar.storage)}{slot}><title>{escape(tip)}</title>"
                   f'<text x="{_MARGIN}" y="{y0 + _BAR - 1}">{escape(text)}</text>'
                   + "".join(f'<line x1="{a}" y1="{y0 + _BAR / 2}" x2="{b}" y2="{y0 + _BAR / 2}"'
                             ' stroke="#94a3b8"/>' for a, b in ends)
                   + f'<rect x="{x0}" y="{y0}" width="{x1 - x0}" height="{_BAR}" rx="2" '
                   f'fill="{fill}" {outline}/></g>')
    for bar in rows:  # connectors after the bars, so they draw on top
        if bar.origin:
            cx, (y0, y1) = x(bar.first) + _COL / 2, sorted((row[bar.origin], row[bar.buffer]))
            out.append(f'<g class="inplace" data-buffer={quoteattr(bar.buffer)} '
                       f'data-origin={quoteattr(bar.origin)}><line x1="{cx}" y1="{y0 + _BAR}" '
                       f'x2="{cx}" y2="{y1}" stroke="{_LINE}" stroke-width="2"/></g>')
    for i, (text, fill, outline) in enumerate(_LEGEND):
        ly = bottom + _GAP + i * _ROW
        out.append(f'<g class="legend"><rect x="{_MARGIN}" y="{ly}" width="10" height="{_BAR}" '
                   f'fill="{fill}" {outline}/><text x="{_MARGIN + 14}" y="{ly + _BAR - 1}">'
                   f"{escape(text)}</text></g>")
    out.append("</svg>")
    return "\n".join(out)
