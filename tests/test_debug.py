"""Drawing, stages, the debug report (checked in a real headless Chromium) and logging."""
from __future__ import annotations

import collections
import html
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import plait
from plait.debug import DebugError, Section, stages, write_report
from plait.graph import CONTROL, Constant, Graph, GraphBuilder, TensorType, Value
from plait.graph.draw import to_svg
from plait.passes import memory
from plait.passes.memory import liveness
from plait.compiler import GRAPH_STAGES, simplified, snapshot
from plait.tracer import get_primitive

SVG = "{http://www.w3.org/2000/svg}"
ARTIFACTS = Path(__file__).parent / "artifacts"


def _node(b: GraphBuilder, prim: str, *operands: Value, after=(), **params) -> Value:
    out_types = get_primitive(prim).infer(*[b.type_of(v) for v in operands], **params)
    (v,) = b.add_node(prim, operands, params, out_types, after=after)
    return v


def _control_graph() -> Graph:
    """x, a constant, exp(x), mul(e, e) (two edges from one value), neg ordered after the exp
    by a control edge only, and add(x, constant) spanning rows; two outputs."""
    b = GraphBuilder()
    x = b.add_input(TensorType((4,), torch.float32))
    c = _node(b, "constant", value=Constant(torch.arange(4.0)))
    e = _node(b, "exp", x)
    m = _node(b, "mul", e, e)
    n = _node(b, "neg", m)
    a = _node(b, "add", x, c)
    b.add_control_edge(e.node, a.node)
    return b.build([n, a]).validate()


def _parse_svg(svg: str):
    root = ET.fromstring(svg)
    groups = root.iter(f"{SVG}g")
    nodes, edges, clusters = {}, [], {}
    for g in groups:
        cls = g.get("class").split()
        if cls[0] == "node":
            nodes[int(g.get("data-node"))] = g
        elif cls[0] == "edge":
            edges.append(g)
        else:
            clusters[g.get("data-cluster")] = g
    return root, nodes, edges, clusters


def _check_svg(graph: Graph, svg: str):
    """Every node is one box labelled with its primitive and types; every edge one path,
    control edges dashed and data edges solid."""
    root, nodes, edges, _ = _parse_svg(svg)
    assert set(nodes) == set(graph.nx.nodes)
    for n, g in nodes.items():
        node = graph.node(n)
        text = " ".join(t.text for t in g.iter(f"{SVG}text"))
        assert node.prim in text and all(str(t) in text for t in node.out_types)
        assert (node.prim == "input") == ("input" in g.get("class").split())
        assert (node.prim == "constant") == ("constant" in g.get("class").split())
        assert (n in {v.node for v in graph.outputs}) == ("output" in g.get("class").split())
    drawn = collections.Counter((int(g.get("data-src")), int(g.get("data-dst")),
                                 g.get("class").split()[1], g.get("data-operand"))
                                for g in edges)
    expected = collections.Counter(
        (u, v, d["kind"], None if d["kind"] == CONTROL else str(d["operand"]))
        for u, v, d in graph.nx.edges(data=True))
    assert drawn == expected
    for g in edges:
        dashed = g.find(f"{SVG}path").get("stroke-dasharray") is not None
        assert dashed == (g.get("class").split()[1] == CONTROL)
    return root, nodes


def _rect(g) -> tuple[float, float, float, float]:
    r = g.find(f"{SVG}rect")
    x, y = float(r.get("x")), float(r.get("y"))
    return x, y, x + float(r.get("width")), y + float(r.get("height"))


def test_svg_has_every_node_and_edge(tmp_path):
    graph = _control_graph()
    path = graph.draw(tmp_path / "g.svg", engine="python")
    root, nodes = _check_svg(graph, path.read_text())
    assert float(root.get("width")) > 0 and float(root.get("height")) > 0
    # layered: every edge points down the page, and no two boxes overlap
    for u, v in graph.nx.edges():
        assert _rect(nodes[u])[3] < _rect(nodes[v])[1]
    boxes = [_rect(g) for g in nodes.values()]
    for i, (ax0, ay0, ax1, ay1) in enumerate(boxes):
        for bx0, by0, bx1, by1 in boxes[i + 1:]:
            assert ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0


def test_svg_of_traced_functions():
    def f(x, w):
        top = torch.topk(x @ w, 2)  # a node with two outputs
        return torch.softmax(top.values, -1) * top.indices + x.sum()

    lowered = plait.jit(f).lower(torch.randn(4, 8), torch.randn(8, 5))
    for s in stages(lowered):
        _check_svg(s.graph, to_svg(s.graph, engine="python"))


def test_to_dot():
    graph = _control_graph()
    dot = graph.to_dot()
    assert dot.startswith("digraph plait {") and dot.rstrip().endswith("}")
    for n in graph.nx.nodes:
        assert re.search(rf"^  n{n} \[label=\"%\d+ {graph.node(n).prim}", dot, re.MULTILINE)
    (u, v), = graph.control_edges()
    assert f"n{u} -> n{v} [style=dashed" in dot
    assert dot.count(" -> ") == graph.nx.number_of_edges()
    clustered = graph.to_dot({u: 'kernel "0"', v: 'kernel "0"'})
    assert 'subgraph cluster_0 {\n    label="kernel \\"0\\"";' in clustered


def test_groups_are_drawn_as_clusters():
    graph = _control_graph()
    by_prim = {graph.node(n).prim: n for n in graph.nx.nodes}
    groups = {by_prim["exp"]: "kernel 0", by_prim["mul"]: "kernel 0",
              by_prim["neg"]: "kernel 0", by_prim["add"]: "kernel 1"}
    svg = to_svg(graph, groups, engine="python")
    _check_svg(graph, svg)
    _, nodes, _, clusters = _parse_svg(svg)
    assert set(clusters) == {"kernel 0", "kernel 1"}
    for n, name in groups.items():  # each cluster's box holds its members' boxes
        cx0, cy0, cx1, cy1 = _rect(clusters[name])
        x0, y0, x1, y1 = _rect(nodes[n])
        assert cx0 < x0 and cy0 < y0 and x1 < cx1 and y1 < cy1


def test_dot_engine_is_used_when_on_path(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "dot"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ncat > {tmp_path}/in.dot\necho '<svg from=\"dot\"/>'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    graph = _control_graph()
    assert graph.draw(tmp_path / "a.svg").read_text().strip() == '<svg from="dot"/>'
    assert (tmp_path / "in.dot").read_text() == graph.to_dot()
    assert "data-node" in graph.draw(tmp_path / "b.svg", engine="python").read_text()
    with pytest.raises(DebugError, match="engine"):
        graph.draw(tmp_path / "c.svg", engine="neato")


def _cse_me(x):
    return torch.exp(x) + torch.exp(x) * 0 + torch.ones(3) * 2


def test_stages():
    lowered = plait.jit(_cse_me).lower(torch.randn(3))
    names = [s.name for s in stages(lowered)]
    assert names == ["traced", "erase_markers", "dce", "fold_constants", "fuse_attention",
                     "attention_layout", "channels_last", "algebra", "pad_products", "cse",
                     "dce.2", "unread_ys", "unread_input_grads"]
    by_name = {s.name: s.graph for s in stages(lowered)}
    exps = {name: sum(g.node(n).prim == "exp" for n in g.nx.nodes) for name, g in by_name.items()}
    assert exps["traced"] == 2 and exps["cse"] == 1
    assert by_name["dce.2"] is lowered.graph
    # simplification reports each pass without changing its result
    seen = []
    assert simplified(lowered.traced_graph, snapshot(),
                      on_pass=lambda *p: seen.append(p)) == lowered.graph
    assert [name for name, _ in seen] == [stage.name for stage in GRAPH_STAGES]


def test_lowered_draw(tmp_path):
    lowered = plait.jit(_cse_me).lower(torch.randn(3))
    for stage, graph in [("traced", lowered.traced_graph), ("simplified", lowered.graph),
                         ("cse", dict(lowered.passes)["cse"])]:
        svg = lowered.draw(tmp_path / f"{stage}.svg", stage, engine="python").read_text()
        _check_svg(graph, svg)
    with pytest.raises(DebugError, match="traced, erase_markers, dce, fold_constants, "
                                         "fuse_attention, attention_layout, channels_last, "
                                         "algebra, "
                                         "pad_products, cse, dce.2, unread_ys, unread_input_grads, simplified"):
        lowered.draw(tmp_path / "x.svg", stage="kernels")
    assert issubclass(DebugError, plait.PlaitError)
    with plait.config.patch(simplify=False):
        lowered = plait.jit(_cse_me).lower(torch.randn(3))
    assert [s.name for s in stages(lowered)] == ["traced"]
    with pytest.raises(DebugError, match="stages are traced, simplified$"):
        lowered.draw(tmp_path / "x.svg", stage="cse")


def _block(x, w, b):
    return F.layer_norm(F.gelu(x @ w + b), (w.shape[1],))


def _args():
    return torch.randn(4, 8), torch.randn(8, 6), torch.randn(6)


def _report(tmp_path, backend: str = "eager") -> Path:
    with plait.config.patch(debug_dir=str(tmp_path)):
        plait.jit(_block, backend=backend)(*_args())
    (folder,) = tmp_path.iterdir()
    return folder


def test_debug_dump(tmp_path):
    folder = _report(tmp_path)
    lowered = plait.jit(_block).lower(*_args())
    assert folder.name == f"_block-{lowered.traced_graph.digest[:12]}"
    names = [f"{i:02d}-{s.name}" for i, s in enumerate(stages(lowered))]
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["index.html", *(n + ".txt" for n in names), *(n + ".svg" for n in names)])
    assert (folder / "00-traced.txt").read_text() == lowered.traced_graph.as_text() + "\n"
    _check_svg(lowered.graph, (folder / f"{names[-1]}.svg").read_text())
    page = (folder / "index.html").read_text()
    links = set(re.findall(r'href="([^"#]+)"', page))
    assert links == {n + ext for n in names for ext in (".txt", ".svg")}
    assert page.count("<svg ") == len(names)
    assert not re.search(r"(src|href)=\"(https?:)?//|<script|<link", page)  # self-contained
    # the provenance table: a row per value, with the ATen op and this file's source line
    line = _block.__code__.co_firstlineno + 1
    assert f"<td>aten.gelu.default</td><td>test_debug.py:{line}</td>" in page
    assert page.count("<tr><td>%") == len(lowered.graph)


def test_dump_only_when_compiling(tmp_path):
    jitted = plait.jit(_block)
    jitted(*_args())  # compiled before the knob is set: a later cache hit dumps nothing
    with plait.config.patch(debug_dir=str(tmp_path)):
        jitted(*_args())
        assert not any(tmp_path.iterdir())
        jitted.lower(*_args())  # lower() compiles, so it writes the report
        assert len(list(tmp_path.iterdir())) == 1
    blocker = tmp_path / "file"
    blocker.write_text("")
    with plait.config.patch(debug_dir=str(blocker)), pytest.raises(DebugError, match="writable"):
        jitted.lower(*_args())


def test_report_extra_sections(tmp_path):
    """The extension point the kernel stage will use: sections with their own files."""
    lowered = plait.jit(_block).lower(*_args())
    extra = Section("Kernels", '<a href="kernels.cpp">kernels.cpp</a>', {"kernels.cpp": "//"})
    index = write_report(lowered, tmp_path, "block", [extra])
    assert (tmp_path / "kernels.cpp").read_text() == "//"
    page = index.read_text()
    assert page.index("<h2>Provenance</h2>") < page.index("<h2>Kernels</h2>")


def test_logging(caplog):
    caplog.handler.setLevel(logging.DEBUG)  # the knob alone enables the loggers
    jitted = plait.jit(_block, dynamic=False)  # the second size retraces
    jitted(*_args())
    assert not [r for r in caplog.records if r.name.startswith("plait")]
    with plait.config.patch(log="graph, cache"):
        jitted(*_args())
        jitted(torch.randn(5, 8), *_args()[1:])
        jitted.clear_cache()
        plait.jit(_block)(*_args())
    messages = [(r.name, r.getMessage().split()[0]) for r in caplog.records]
    assert messages == [("plait.cache", "hit"), ("plait.cache", "retrace"),
                        ("plait.graph", "traced"), ("plait.graph", "simplified"),
                        ("plait.cache", "miss"), ("plait.graph", "traced"),
                        ("plait.graph", "simplified")]
    assert "f32[5,8]" in caplog.records[1].getMessage()
    assert "= erf(" in caplog.records[2].getMessage()
    caplog.clear()
    jitted(*_args())
    assert not caplog.records  # patch restored the knob
    with pytest.raises(plait.PlaitError, match="known: graph, fusion, cache, kernels"):
        plait.config.log = "graph,nope"


def _pooled(x, w):
    """Three kernels and two matmul externs on the cpp backend: exp(x) and the column sums of
    exp(x) @ w share a pool slot; the final exp writes in place into the second matmul's
    result."""
    return ((x.exp() @ w).sum(0, keepdim=True) @ w.t()).exp()


def _pooled_args():
    return torch.randn(4, 8), torch.randn(8, 8)


def test_fusion_and_kernels_logs(caplog):
    caplog.handler.setLevel(logging.DEBUG)
    jitted = plait.jit(_pooled, backend="cpp")
    with plait.config.patch(log="fusion,kernels"):
        jitted(*_pooled_args())  # a miss: the fused program and its source
        lowered = jitted.lower(*_pooled_args())  # lower() compiles too
        records = [r for r in caplog.records if r.name.startswith("plait")]
        assert [r.name for r in records] == ["plait.fusion", "plait.kernels"] * 2
        assert [r.getMessage() for r in records[:2]] == [r.getMessage() for r in records[2:]]
        fusion, kernels = records[:2]
        caplog.clear()
        jitted(*_pooled_args())  # a hit compiles nothing, so logs nothing
        assert not caplog.records
        plait.jit(_pooled)(*_pooled_args())  # eager: no loop program, no generated code
        assert [r.name for r in caplog.records if r.name.startswith("plait")] == []
    program = lowered.compiled.program
    assert fusion.levelno == kernels.levelno == logging.DEBUG
    text = fusion.getMessage()
    assert text.startswith(f"fused program of _pooled (kernels=3, externs=2, "
                           f"bytes_read={lowered.stats['bytes_read']},")
    for k in program.kernels:  # each kernel: name, reads, writes, then what it computes
        head = f"\n{k.name}: reads {', '.join(k.reads)}; writes {', '.join(k.writes)}"
        assert head + "".join("\n    " + line for line in program.describe(k)) in text
    assert "    exp  aten.exp.default  test_debug.py:" in text
    assert kernels.getMessage() == f"generated source of _pooled:\n{lowered.source}"
    assert "extern \"C\"" in lowered.source


def test_env_knobs(tmp_path):
    """PLAIT_LOG prints to stderr where the program set up no logging; PLAIT_DEBUG_DIR dumps."""
    env = dict(os.environ, PLAIT_LOG="cache", PLAIT_DEBUG_DIR=str(tmp_path / "debug"),
               PLAIT_CACHE_DIR=str(tmp_path / "cache"))
    code = "import torch, plait\ndef f(x):\n    return x.exp()\nj = plait.jit(f)\n" \
           "j(torch.ones(2)); j(torch.ones(2))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert "[plait.cache] miss f for inputs ['f32[2]']\n[plait.cache] hit f\n" in out.stderr
    (folder,) = (tmp_path / "debug").iterdir()
    assert folder.name.startswith("f-") and (folder / "index.html").exists()


# -- the report in a real browser ------------------------------------------------------------
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--enable-logging=stderr",
                  "--v=0"]
# Injected first into a copy of the page: records load errors (capture phase catches failed
# images and links too) and, once loaded, writes them and every <svg>'s rendered size into
# the DOM, which --dump-dom prints.
PROBE = """<script>
window.__errors = [];
addEventListener("error", e => __errors.push(e.message || "failed to load " +
                 (e.target.src || e.target.href)), true);
addEventListener("load", () => {
  const sizes = [...document.querySelectorAll("svg")].map(s => {
    const r = s.getBoundingClientRect(); return [s.getAttribute("class"), r.width, r.height]; });
  const out = document.createElement("pre");
  out.id = "plait-probe";
  out.textContent = JSON.stringify({errors: __errors, sizes});
  document.body.append(out);
});
</script>"""


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and os.access("/usr/bin/chromium", os.X_OK):
        found = "/usr/bin/chromium"
    if found is None:
        reason = "no Chromium found (/usr/bin/chromium; .ci/run installs Debian's chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason + ", and CI=true: the browser test must run in CI")
        pytest.skip(reason)
    return found


def _open(chromium: str, page: Path, profile: Path, *action: str) -> str:
    """Run one headless Chromium action on ``page``; fail on console messages (the report
    has no script of its own, so any message is an error)."""
    out = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *action,
                          page.as_uri()], capture_output=True, text=True, timeout=120,
                          check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    console = [line for line in out.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console
    return out.stdout


def _probe(chromium: str, page: Path, profile: Path) -> dict:
    probed = page.with_name("probe-" + page.name)
    probed.write_text(page.read_text().replace("<head>", "<head>" + PROBE, 1))
    dom = _open(chromium, probed, profile, "--dump-dom")
    found = re.search(r'<pre id="plait-probe">(.*?)</pre>', dom, re.DOTALL)
    assert found, dom[-2000:]
    return json.loads(html.unescape(found.group(1)))


def test_report_in_chromium(tmp_path):
    chromium = _chromium()
    folder = _report(tmp_path / "dump", backend="cpp")  # every section: kernels, memory
    index = folder / "index.html"
    probe = _probe(chromium, index, tmp_path / "profile")
    assert probe["errors"] == []
    assert len(probe["sizes"]) == len(list(folder.glob("*.svg")))
    assert all(w > 0 and h > 0 for _, w, h in probe["sizes"]), probe["sizes"]
    (chart,) = [size for size in probe["sizes"] if size[0] == "memory-timeline"]
    svg = ET.parse(folder / "memory.svg").getroot()
    assert chart[1:] == [float(svg.get("width")), float(svg.get("height"))]
    # the probe itself notices a broken page
    broken = tmp_path / "broken.html"
    broken.write_text('<!DOCTYPE html><html><head></head><body><img src="nope.png"></body>'
                      "</html>")
    missing = (tmp_path / "nope.png").as_uri()
    assert _probe(chromium, broken, tmp_path / "profile")["errors"] == [f"failed to load {missing}"]
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "debug_report.png"
    shot.unlink(missing_ok=True)
    _open(chromium, index, tmp_path / "profile", f"--screenshot={shot}",
          "--window-size=1280,1600")
    assert shot.stat().st_size > 10_000
    print(f"screenshot of the debug report: {shot}")


def test_kernel_stage_and_report_for_the_cpu_compiler(tmp_path):
    fn = plait.jit(lambda x: torch.softmax(x.exp(), -1) @ x.t(), backend="cpp")
    x = torch.randn(4, 5)
    lowered = fn.lower(x)
    (kernels,) = [s for s in stages(lowered) if s.name == "kernels"]
    assert set(kernels.groups.values()) == {k.name for k in lowered.compiled.program.kernels}
    svg = ET.parse(lowered.draw(tmp_path / "k.svg", stage="kernels", engine="python"))
    clusters = {g.get("data-cluster") for g in svg.iter(f"{SVG}g") if g.get("data-cluster")}
    assert clusters == set(kernels.groups.values())
    assert "// exp  aten.exp.default" in lowered.source  # provenance above each call
    with plait.config.patch(debug_dir=str(tmp_path / "dump")):
        plait.jit(lambda x: torch.softmax(x.exp(), -1) @ x.t(), backend="cpp")(x)
    (folder,) = (tmp_path / "dump").iterdir()
    kernels = lowered.compiled.cpp_source.split("// The C++ wrapper")[0]  # not the provenance
    assert kernels in (folder / "source.txt").read_text()
    assert "aten._softmax.default" in (folder / "index.html").read_text()


# -- the memory timeline ---------------------------------------------------------------------
def _classes(root, name: str) -> list:
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == name]


def test_memory_timeline(tmp_path):
    jitted = plait.jit(_pooled, backend="cpp")
    with plait.config.patch(debug_dir=str(tmp_path)):
        jitted(*_pooled_args())
    lowered = jitted.lower(*_pooled_args())
    memory, program = lowered.memory, lowered.compiled.program
    (folder,) = tmp_path.iterdir()
    svg = (folder / "memory.svg").read_text()
    page = (folder / "index.html").read_text()
    assert svg in page and 'href="memory.svg"' in page
    assert page.index("<h2>Kernels</h2>") < page.index("<h2>Memory</h2>")
    root = ET.fromstring(svg)
    assert root.get("class") == "memory-timeline"
    # the program this test means: a pool slot shared by two buffers, one in-place pair
    assert [len(p["storages"]) for p in memory["pool"]] == [2] and len(memory["inplace"]) == 1

    columns = {int(g.get("data-kernel")): g for g in _classes(root, "kernel")}
    assert [columns[i].get("data-name") for i in range(len(columns))] == [
        k.name for k in program.kernels]
    assert all(columns[i].find(f"{SVG}text").text == k.name
               for i, k in enumerate(program.kernels))
    slot_of = {s: j for j, p in enumerate(memory["pool"]) for s in p["storages"]}
    bars = {g.get("data-buffer"): g for g in _classes(root, "buffer")}
    assert len(bars) == len(_classes(root, "buffer")) and set(bars) == set(memory["buffers"])
    fills = {}
    for b, g in bars.items():  # each bar: the buffer's size and storage, its lifetime's columns
        m = memory["buffers"][b]
        assert (int(g.get("data-bytes")), int(g.get("data-first")), int(g.get("data-last")),
                g.get("data-storage")) == (m["bytes"], m["first"], m["last"], m["storage"])
        assert g.get("data-slot") == (str(slot_of[m["storage"]]) if m["storage"] in slot_of
                                      else None)
        assert g.find(f"{SVG}text").text.startswith(f"{b} ")
        x0, _, x1, _ = _rect(g)
        assert _rect(columns[m["first"]])[0] < x0 < x1 < _rect(columns[m["last"]])[2]
        fills[b] = g.find(f"{SVG}rect").get("fill")
    (pooled,) = [p["storages"] for p in memory["pool"]]
    assert fills[pooled[0]] == fills[pooled[1]]  # one slot, one colour
    (new, origin), = memory["inplace"]
    connector, = _classes(root, "inplace")
    assert (connector.get("data-buffer"), connector.get("data-origin")) == (new, origin)
    assert fills[new] == fills[origin]  # one storage, drawn dashed, counted once
    assert bars[new].find(f"{SVG}rect").get("stroke-dasharray")
    assert not bars[origin].find(f"{SVG}rect").get("stroke-dasharray")

    (live,) = _classes(root, "live")
    steps = [int(v) for v in live.get("data-live").split()]
    (peak,) = _classes(root, "peak")
    assert int(peak.get("data-peak-bytes")) == max(steps) == memory["peak_bytes"] \
        == lowered.stats["peak_bytes"]
    assert int(peak.get("data-kernel")) == steps.index(max(steps))
    label = peak.find(f"{SVG}text").text
    assert f"({memory['peak_bytes']} B) at {program.kernels[steps.index(max(steps))].name}" \
        in label
    # the table beside it: a row per buffer with its storage, pool slot and in-place origin
    table = page[page.index("<h2>Memory</h2>"):]
    assert table.count("<tr><td>") == len(memory["buffers"])
    j = slot_of[pooled[1]]
    assert f"<tr><td>{pooled[1]}</td><td>{memory['buffers'][pooled[1]]['bytes']}</td>" in table
    assert f"<td>{pooled[1]}</td><td>pool {j}</td><td>&mdash;</td></tr>" in table
    assert f"<td>{origin}</td><td>&mdash;</td><td>{origin}</td></tr>" in table


def test_memory_timeline_without_a_memory_plan(tmp_path):
    """A backend that plans no memory (loops) allocates each storage on its own: the
    chart is the program's liveness (with the in-place pairs its reuse pass made) and no
    pool, its peak stats["peak_bytes"]."""
    with plait.config.patch(debug_dir=str(tmp_path)):
        plait.jit(_pooled, backend="loops")(*_pooled_args())
    lowered = plait.jit(_pooled, backend="loops").lower(*_pooled_args())
    assert lowered.memory == {}
    root = ET.parse(next(tmp_path.iterdir()) / "memory.svg").getroot()
    lv = liveness(lowered.compiled.program)
    bars = {g.get("data-buffer"): g for g in _classes(root, "buffer")}
    assert {b: (int(g.get("data-first")), int(g.get("data-last"))) for b, g in bars.items()} \
        == lv.uses
    inplace = dict(memory.report(lowered.compiled.program, memory.plan(
        lowered.compiled.program, pool=False))["inplace"])
    assert {g.get("data-buffer"): g.get("data-origin") for g in _classes(root, "inplace")} \
        == inplace
    assert not any(g.get("data-slot") for g in bars.values())
    (peak,) = _classes(root, "peak")
    assert int(peak.get("data-peak-bytes")) == lowered.stats["peak_bytes"] == lv.peak


def test_memory_timeline_scales(tmp_path):
    """A chart of ~100 buffers: every bar in its own row, inside the drawing."""
    def layers(x, ws):
        for w in ws:
            x = torch.tanh(x @ w).t()
        return x

    ws = [torch.randn(8, 8) for _ in range(50)]
    lowered = plait.jit(layers, backend="loops").lower(torch.randn(8, 8), ws)
    (section,) = plait.debug._memory_sections(lowered)
    root = ET.fromstring(section.files["memory.svg"])
    bars = [_rect(g) for g in _classes(root, "buffer")]
    assert len(bars) >= 100
    tops = sorted(y0 for _, y0, _, _ in bars)
    assert all(b - a >= 11 for a, b in itertools.pairwise(tops))  # rows never overlap
    width, height = float(root.get("width")), float(root.get("height"))
    assert all(0 < x0 < x1 <= width and 0 < y1 <= height for x0, _, x1, y1 in bars)
