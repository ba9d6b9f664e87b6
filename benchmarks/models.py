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


def gpt_logits(p: dict, tokens: torch.Tensor, heads: int, dropout: float = 0.0):
    """The logits; with ``dropout``, nanoGPT's in training: of the embeddings, the attention
    (``scaled_dot_product_attention``'s, else written out) and each residual branch."""
    b, t = tokens.shape
    d = p["wte"].shape[1]
    x = F.dropout(p["wte"][tokens] + p["wpe"][:t], dropout)
    causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
    for i in range(gpt_blocks(p)):
        h = F.layer_norm(x, (d,), p[f"h{i}.ln1.w"], p[f"h{i}.ln1.b"])
        q, k, v = F.linear(h, p[f"h{i}.qkv.w"], p[f"h{i}.qkv.b"]).split(d, dim=-1)
        q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
        if dropout:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // heads))
            y = att.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        y = y.transpose(1, 2).reshape(b, t, d)
        x = x + F.dropout(F.linear(y, p[f"h{i}.proj.w"], p[f"h{i}.proj.b"]), dropout)
        h = F.layer_norm(x, (d,), p[f"h{i}.ln2.w"], p[f"h{i}.ln2.b"])
        x = x + F.dropout(F.linear(F.gelu(F.linear(h, p[f"h{i}.fc.w"], p[f"h{i}.fc.b"])),
                                   p[f"h{i}.out.w"], p[f"h{i}.out.b"]), dropout)
    x = F.layer_norm(x, (d,), p["lnf.w"], p["lnf.b"])
    return F.linear(x, p["head.w"])


def gpt_loss(p: dict, tokens: torch.Tensor, targets: torch.Tensor, heads: int = 4,
             dropout: float = 0.0):
    logits = gpt_logits(p, tokens, heads, dropout)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class GPT(torch.nn.Module):
    """The same GPT as a module (its parameters ``gpt_params``'), returning the loss: for a
    training loop written the ordinary way (``loss.backward()``, an optimizer)."""

    def __init__(self, params: dict[str, torch.Tensor], heads: int):
        super().__init__()
        self.heads, self.names = heads, list(params)
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(v.clone())
                                              for v in params.values())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return gpt_loss(dict(zip(self.names, self.weights)), tokens, targets, self.heads)


def gpt_batch(batch: int, seq: int, vocab: int, *, device="cpu", seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (batch, seq + 1), generator=g).to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# -- the benchmark -------------------------------------------------------------------------
def gpt_sizes(device: str) -> tuple[int, int, int, int, int]:
    """dim, heads, vocab, batch, sequence: GPT-2 small's on a GPU, a small model's on the CPU."""
    return (768, 12, 50304, 8, 1024) if device == "cuda" else (128, 2, 512, 4, 64)


def gpt_steps(blocks: int, device: str, dtype=torch.float32, dropout: float = 0.0):
    """The training step (the loss and every parameter's gradient) three ways: eager,
    ``torch.compile(gpt_loss)`` with autograd, ``plait.jit(plait.grad_and_value(gpt_loss))``;
    and the plait step's arguments."""
    import plait

    dim, heads, vocab, batch, seq = gpt_sizes(device)
    params = gpt_params(blocks, dim, vocab, seq, device=device, dtype=dtype)
    tokens, targets = gpt_batch(batch, seq, vocab, device=device)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    compiled_loss = torch.compile(gpt_loss)
    plait_step = plait.jit(plait.grad_and_value(gpt_loss), static_argnums=(3, 4))
    steps = {
        "eager": lambda: torch.autograd.grad(gpt_loss(leaves, tokens, targets, heads, dropout),
                                             list(leaves.values())),
        "torch.compile": lambda: torch.autograd.grad(
            compiled_loss(leaves, tokens, targets, heads, dropout), list(leaves.values())),
        "plait": lambda: list(plait_step(params, tokens, targets, heads, dropout)[0].values()),
    }
    return steps, plait_step, (params, tokens, targets, heads, dropout)


def _timer(device: str):
    """Seconds per call of ``fn``: warmed up, then the median of ``repeat`` timed batches."""
    import statistics
    import time

    def measure(fn, repeat: int = 5, number: int = 3) -> float:
        for _ in range(2):
            fn()
        times = []
        for _ in range(repeat):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                for _ in range(number):
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / number)
            else:
                t = time.perf_counter()
                for _ in range(number):
                    fn()
                times.append((time.perf_counter() - t) / number)
        return statistics.median(times)

    return measure


def fresh_caches(device: str) -> None:
    """Point plait, inductor and triton at empty caches of this process's own (cold compiles
    are cold), before the compilers load. On the CPU, build plait's C++ runtime there first:
    it is built once per torch version and machine (NOTE [C++ wrapper]), and a build in the
    background while steps are timed slows them."""
    import os
    import tempfile

    cache = tempfile.mkdtemp()
    os.environ.update(PLAIT_CACHE_DIR=os.path.join(cache, "plait"),
                      TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                      TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    from plait.config import config

    if device == "cpu" and config.cpp_wrapper:
        import warnings

        from plait.backends import cpp_wrapper

        try:
            cpp_wrapper.runtime_future().result()
        except Exception as e:  # noqa: BLE001 - plait runs its Python wrapper instead
            warnings.warn(f"plait's C++ runtime did not build ({e}); timing the Python "
                          "wrapper")


def peak_bytes(fn, device: str, graphs: int = 0) -> int | None:
    """Bytes one call allocates at its peak above what was allocated before it (CUDA), plus
    ``graphs``: the bytes the CUDA graphs it replays hold (a replay allocates nothing: its
    memory was set aside when it was captured, NOTE [CUDA graphs])."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before + graphs


def main() -> None:
    """A GPT training step (loss and the gradients of every parameter) three ways, timed the
    same way in one process: eager autograd, torch.compile of the loss with autograd, and
    ``plait.jit(plait.grad_and_value(gpt_loss))``; with each one's first call (cold compile
    with empty caches of this process's own), step time, peak memory above the inputs
    (CUDA) and largest relative error of a gradient against eager's (none with
    ``--dropout``: each column draws its own masks)."""
    import argparse
    import time

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--blocks", type=int, default=None, help="default 2 (cpu), 12 (cuda)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--no-loop", action="store_true", help="skip the AdamW loop's table")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="nanoGPT's dropout in the step (not the loop's)")
    args = parser.parse_args()
    fresh_caches(args.device)
    from plait.backends.cuda_graphs import held_bytes

    device = args.device
    dim, heads, vocab, batch, seq = gpt_sizes(device)
    blocks = args.blocks or (12 if device == "cuda" else 2)
    steps, _, (params, tokens, targets, heads, _) = gpt_steps(
        blocks, device, getattr(torch, args.dtype), args.dropout)
    measure = _timer(device)
    reference = None
    print(f"GPT training step: {blocks} blocks, d={dim}, {heads} heads, vocab {vocab}, "
          f"{batch}x{seq} tokens, {args.dtype}, dropout {args.dropout}, {device}")
    print(f"{'':>14} {'first call s':>12} {'step ms':>9} {'peak MB':>9} {'grad err':>9}")
    for name, step in steps.items():
        graphs = held_bytes()
        start = time.perf_counter()
        grads = step()
        if device == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - start
        seconds = measure(step)
        peak = peak_bytes(step, device, held_bytes() - graphs)
        grads = [g.clone() for g in step()]  # a warm call's: replayed, where it is a graph
        reference = reference or grads
        error = float("nan") if args.dropout else max(
            ((g.float() - r.float()).norm() / r.float().norm()).item()
            for g, r in zip(grads, reference))
        print(f"{name:>14} {first:>12.2f} {seconds * 1e3:>9.2f} "
              f"{'-' if peak is None else f'{peak / 2**20:.0f}':>9} {error:>9.1e}", flush=True)
    if not args.no_loop:
        _training_loop(params, tokens, targets, heads, device, measure)


def _training_loop(params, tokens, targets, heads: int, device: str, measure) -> None:
    """The training step written the ordinary way (a module, ``loss.backward()``, AdamW),
    four ways: eager, ``torch.compile(model)``, ``plait.jit(model)``, and
    ``plait.jit(plait.grad_and_value(gpt_loss))`` with the same optimizer; with the loss
    after the timed steps against eager's (each starts from the same weights)."""
    import time

    import plait
    from plait.backends.cuda_graphs import held_bytes

    def ordinary(model, call):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            loss = call(tokens, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return step

    def functional(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        grad_step = plait.jit(plait.grad_and_value(gpt_loss), static_argnums=3)
        names = model.names

        def step():
            with torch.no_grad():  # the gradient program itself is not to be differentiated
                grads, loss = grad_step(dict(zip(names, model.weights)), tokens, targets,
                                        heads)
            for p, g in zip(model.weights, grads.values()):
                p.grad = g
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return step

    models = {name: GPT(params, heads) for name in ("eager", "torch.compile", "plait.jit",
                                                    "plait grad")}
    steps = {"eager": ordinary(models["eager"], models["eager"]),
             "torch.compile": ordinary(models["torch.compile"],
                                       torch.compile(models["torch.compile"])),
             "plait.jit": ordinary(models["plait.jit"], plait.jit(models["plait.jit"])),
             "plait grad": functional(models["plait grad"])}
    print(f"\nTraining step with AdamW, written the ordinary way ({device})")
    print(f"{'':>14} {'first call s':>12} {'step ms':>9} {'peak MB':>9} {'loss':>12}")
    for name, step in steps.items():
        graphs = held_bytes()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - start
        seconds = measure(step)
        peak = peak_bytes(step, device, held_bytes() - graphs)
        loss = step().item()  # after the same number of steps from the same weights
        print(f"{name:>14} {first:>12.2f} {seconds * 1e3:>9.2f} "
              f"{'-' if peak is None else f'{peak / 2**20:.0f}':>9} {loss:>12.6f}", flush=True)


if __name__ == "__main__":
    main()
