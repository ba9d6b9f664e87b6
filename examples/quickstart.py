"""plait quickstart: trace a small PyTorch function, look at its graph, run it compiled.

Run from the repository root:  .venv/bin/python examples/quickstart.py  (or `make demo`)
"""
import torch
import torch.nn.functional as F

import plait


def mlp_block(x, w_in, w_out):
    """A GELU MLP with a residual connection, then layer norm (weights as arguments)."""
    h = F.gelu(F.linear(x, w_in))            # [tokens, dim] -> [tokens, hidden]
    y = x + F.linear(h, w_out)               # back to [tokens, dim], plus the residual
    return F.layer_norm(y, (y.shape[-1],))


torch.manual_seed(0)
tokens, dim, hidden = 4, 8, 16
x = torch.randn(tokens, dim)
w_in = torch.randn(hidden, dim) / dim**0.5
w_out = torch.randn(dim, hidden) / hidden**0.5

# 1. make_graph traces the function once and returns its (simplified) primitive graph.
#    Each line is one primitive; the trailing comment names the ATen op it came from.
print("== the traced graph ==")
print(plait.make_graph(mlp_block)(x, w_in, w_out))

# 2. jit compiles the function the first time it sees a new input signature.
jitted = plait.jit(mlp_block)
out = jitted(x, w_in, w_out)
print("\n== running plait.jit(mlp_block) ==")
print("output shape:", tuple(out.shape))
print("out[0, :4]:  ", [round(v, 4) for v in out[0, :4].tolist()])
torch.testing.assert_close(out, mlp_block(x, w_in, w_out))
print("matches eager PyTorch")

# 3. Calling again with the same shapes/dtypes/devices reuses the compiled graph...
jitted(x, w_in, w_out)
print("\n== caching ==")
print("same shapes again -> trace_count =", jitted.trace_count)
assert jitted.trace_count == 1

# 4. ...while a new shape (here 6 tokens instead of 4) traces and compiles once more.
x6 = torch.randn(6, dim)
out6 = jitted(x6, w_in, w_out)
torch.testing.assert_close(out6, mlp_block(x6, w_in, w_out))
print(f"new shape {tuple(x6.shape)}     -> trace_count =", jitted.trace_count,
      "(retraced; result matches eager)")
assert jitted.trace_count == 2
