"""Whole models written in plain torch, for the benchmarks and the tests.

``gpt(blocks, dim, ...)`` is a nanoGPT-style decoder (pre-norm blocks, causal attention
written out with ``masked_fill``, a GELU MLP, tied nothing) as a function of a flat dict of
parameters, so that ``plait.grad_and_value(gpt_loss)`` differentiates every parameter.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def gpt_params(blocks: int, dim: int, vocab: int, seq: int, *, device="cpu",
               dtype=torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    def const(value, *shape):
        return torch.full(shape, value, device=device, dtype=dtype)

    p = {"wte": rand(vocab, dim, scale=0.02), "wpe": rand(seq, dim, scale=0.02)}
    for i in range(blocks):
        p |= {f"h{i}.ln1.w": const(1.0, dim), f"h{i}.ln1.b": const(0.0, dim),
              f"h{i}.qkv.w": rand(3 * dim, dim, scale=0.02), f"h{i}.qkv.b": const(0.0, 3 * dim),
              f"h{i}.proj.w": rand(dim, dim, scale=0.02 / math.sqrt(2 * blocks)),
              f"h{i}.proj.b": const(0.0, dim),
              f"h{i}.ln2.w": const(1.0, dim), f"h{i}.ln2.b": const(0.0, dim),
              f"h{i}.fc.w": rand(4 * dim, dim, scale=0.02), f"h{i}.fc.b": const(0.0, 4 * dim),
              f"h{i}.out.w": rand(dim, 4 * dim, scale=0.02 / math.sqrt(2 * blocks)),
              f"h{i}.out.b": const(0.0, dim)}
    p |= {"lnf.w": const(1.0, dim), "lnf.b": const(0.0, dim), "head.w": rand(vocab, dim, scale=0.02)}
    return p


def gpt_blocks(p: dict) -> int:
    return sum(1 for k in p if k.endswith(".ln1.w"))


def gpt_logits(p: dict, tokens: torch.Tensor, heads: int) -> torch.Tensor:
    b, t = tokens.shape
    d = p["wte"].shape[1]
    x = p["wte"][tokens] + p["wpe"][:t]
    causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
    for i in range(gpt_blocks(p)):
        h = F.layer_norm(x, (d,), p[f"h{i}.ln1.w"], p[f"h{i}.ln1.b"])
        q, k, v = F.linear(h, p[f"h{i}.qkv.w"], p[f"h{i}.qkv.b"]).split(d, dim=-1)
        q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // heads))
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + F.linear(y, p[f"h{i}.proj.w"], p[f"h{i}.proj.b"])
        h = F.layer_norm(x, (d,), p[f"h{i}.ln2.w"], p[f"h{i}.ln2.b"])
        x = x + F.linear(F.gelu(F.linear(h, p[f"h{i}.fc.w"], p[f"h{i}.fc.b"])),
                         p[f"h{i}.out.w"], p[f"h{i}.out.b"])
    x = F.layer_norm(x, (d,), p["lnf.w"], p["lnf.b"])
    return F.linear(x, p["head.w"])


def gpt_loss(p: dict, tokens: torch.Tensor, targets: torch.Tensor, heads: int = 4):
    logits = gpt_logits(p, tokens, heads)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def gpt_batch(batch: int, seq: int, vocab: int, *, device="cpu", seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (batch, seq + 1), generator=g).to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
