"""plait debugging: draw a compiled function's graphs and write its debug report.

The report (index.html) shows every stage's graph, the provenance of each value, the fused
kernels with their generated C++ and the memory timeline: buffer lifetimes against kernel
order, pool slots, in-place writes and the estimated peak.

Run from the repository root:  .venv/bin/python examples/debugging.py [report-folder]
then open the printed index.html in a browser (it needs no network).
"""
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import plait


def transformer_block(x, p, heads: int):
    """Pre-norm self-attention and GELU MLP, each with a residual: x is [tokens, dim]."""
    tokens, dim = x.shape
    h = F.layer_norm(x, (dim,), p["ln1_w"], p["ln1_b"])
    q, k, v = F.linear(h, p["w_qkv"]).view(tokens, 3, heads, dim // heads).unbind(1)
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), is_causal=True)
    x = x + F.linear(att.transpose(0, 1).reshape(tokens, dim), p["w_out"])
    h = F.layer_norm(x, (dim,), p["ln2_w"], p["ln2_b"])
    return x + F.linear(F.gelu(F.linear(h, p["w_up"])), p["w_down"])


torch.manual_seed(0)
tokens, dim, heads = 8, 16, 2
params = {"ln1_w": torch.ones(dim), "ln1_b": torch.zeros(dim), "w_qkv": torch.randn(3 * dim, dim),
          "w_out": torch.randn(dim, dim), "ln2_w": torch.ones(dim), "ln2_b": torch.zeros(dim),
          "w_up": torch.randn(4 * dim, dim), "w_down": torch.randn(dim, 4 * dim)}
x = torch.randn(tokens, dim)
out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="plait-debug-"))

# 1. With debug_dir set (or PLAIT_DEBUG_DIR), every compilation writes a report folder; with
#    log="cache" (or PLAIT_LOG=cache) plait logs each cache miss and hit. The other channels,
#    graph, fusion (the fused kernel program) and kernels (the generated source), log each
#    compilation as it happens, without a report folder.
block = plait.jit(transformer_block, static_argnums=2, backend="cpp")
with plait.config.patch(debug_dir=str(out), log="cache"):
    y = block(x, params, heads)   # compiles: writes the report
    y = block(x, params, heads)   # cache hit: writes nothing
torch.testing.assert_close(y, transformer_block(x, params, heads), rtol=1e-4, atol=1e-4)

# 2. Any stage draws on its own: the traced graph, the graph after a named pass, the result.
lowered = block.lower(x, params, heads)
print("stages:", ", ".join(s.name for s in plait.debug.stages(lowered)), "+ simplified")
print("estimated peak memory: {peak_bytes} B over {kernels} kernels and {externs} externs"
      .format(**lowered.stats))
lowered.draw(out / "traced.svg", stage="traced")

for index in sorted(out.glob("*/index.html")):
    print("report:", index)
print("traced graph drawing:", out / "traced.svg")
