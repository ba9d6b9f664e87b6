"""Models in plain torch, written the ordinary way (``nn.Module``s): a Llama-style decoder
(RMSNorm, rotary embeddings, SwiGLU, grouped-query attention), a ViT, a ResNet with
BatchNorm and a ConvNeXt. ``MODELS`` maps a name to ``(make_model, make_batch)`` at a size
given by ``small`` (the tests') or not (the benchmark's); ``main`` times a training step
(``loss.backward()`` and SGD) eager, under ``torch.compile(model)`` and under
``plait.jit(model)``, and checks every parameter's gradient against eager's; with
``--forward``, the forward alone (the loss, under ``torch.no_grad``), checked likewise.

    .venv/bin/python benchmarks/zoo.py [--models llama,vit,resnet,convnext] [--device cuda]
                                       [--forward]
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------
# Llama-style decoder
# ---------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x, cos, sin):
    """Rotary position embedding of [B, H, T, D] by the angles' cos and sin [T, D / 2]."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int,
                 hidden: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(LlamaBlock(dim, heads, kv_heads, hidden)
                                    for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        half = dim // heads // 2
        angles = torch.outer(torch.arange(seq).float(),
                             10000.0 ** (-torch.arange(half).float() / half))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        t = tokens.shape[1]
        for block in self.blocks:
            x = block(x, self.cos[:t], self.sin[:t])
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------------------------------
# ViT
# ---------------------------------------------------------------------------------------
class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, image: int, patch: int, dim: int, depth: int, heads: int,
                 classes: int):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[ViTBlock(dim, heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, images, labels):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        x = self.norm(self.blocks(x))
        return F.cross_entropy(self.head(x[:, 0]), labels)


# ---------------------------------------------------------------------------------------
# ResNet (bottleneck blocks, BatchNorm in training mode)
# ---------------------------------------------------------------------------------------
class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.convs = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.short = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return F.relu(self.convs(x) + self.short(x))


class ResNet(nn.Module):
    def __init__(self, layers: tuple, widths: tuple, classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 7, 2, 3, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], widths[0]
        for i, (n, w) in enumerate(zip(layers, widths)):
            for j in range(n):
                blocks.append(Bottleneck(cin, w, 2 if j == 0 and i else 1))
                cin = 4 * w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, images, labels):
        x = self.blocks(self.stem(images)).mean((2, 3))
        return F.cross_entropy(self.head(x), labels)


# ---------------------------------------------------------------------------------------
# ConvNeXt
# ---------------------------------------------------------------------------------------
class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6 * 1e5))

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        return x + (self.gamma * self.mlp(self.norm(y))).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, depths: tuple, dims: tuple, classes: int):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, dims[0], 4, 4)]
        for i, (depth, dim) in enumerate(zip(depths, dims)):
            if i:
                layers += [LayerNorm2d(dims[i - 1]), nn.Conv2d(dims[i - 1], dim, 2, 2)]
            layers += [ConvNeXtBlock(dim) for _ in range(depth)]
        self.features = nn.Sequential(*layers)
        self.norm, self.head = nn.LayerNorm(dims[-1]), nn.Linear(dims[-1], classes)

    def forward(self, images, labels):
        x = self.norm(self.features(images).mean((2, 3)))
        return F.cross_entropy(self.head(x), labels)


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


# ---------------------------------------------------------------------------------------
# sizes
# ---------------------------------------------------------------------------------------
def tokens(vocab: int, batch: int, seq: int, device):
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(2))


def images(size: int, batch: int, classes: int, device):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, 3, size, size, generator=g).to(device),
            torch.randint(0, classes, (batch,), generator=g).to(device))


def llama(small: bool):
    vocab, dim, layers, seq, batch = (256, 64, 2, 32, 2) if small else (32000, 1024, 8, 1024, 4)
    return (lambda: Llama(vocab, dim, layers, dim // 16, dim // 64, 4 * dim, seq),
            lambda device: tokens(vocab, batch, seq, device))


def vit(small: bool):
    image, patch, dim, depth, batch = (32, 8, 64, 2, 2) if small else (224, 16, 768, 12, 64)
    return (lambda: ViT(image, patch, dim, depth, dim // 32 if small else 12, 10),
            lambda device: images(image, batch, 10, device))


def resnet(small: bool):
    layers, widths, image, batch = ((1, 1), (8, 16), 32, 4) if small else \
        ((3, 4, 6, 3), (64, 128, 256, 512), 224, 64)
    return (lambda: ResNet(layers, widths, 10), lambda device: images(image, batch, 10, device))


def convnext(small: bool):
    depths, dims, image, batch = ((1, 1), (16, 32), 32, 2) if small else \
        ((3, 3, 9, 3), (96, 192, 384, 768), 224, 64)
    return (lambda: ConvNeXt(depths, dims, 10), lambda device: images(image, batch, 10, device))


MODELS = {"llama": llama, "vit": vit, "resnet": resnet, "convnext": convnext}


def main(registry: dict = MODELS, description: str = __doc__) -> None:
    """Time ``registry``'s models (name -> ``(make_model, make_batch)`` by ``small``), as
    the command line asks."""
    import argparse
    import gc
    import statistics
    import time

    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--models", default=",".join(registry))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of timed steps (default 3 on a GPU, 10 on the CPU)")
    parser.add_argument("--forward", action="store_true",
                        help="time the forward alone (the loss, under torch.no_grad)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="timed steps of each column per round (default 3 on a GPU, 10 "
                             "on the CPU)")
    args = parser.parse_args()
    from models import fresh_caches, peak_bytes

    fresh_caches(args.device)
    import plait
    from plait.backends.cuda_graphs import held_bytes

    cuda = args.device == "cuda"
    rounds = args.rounds or (3 if cuda else 10)
    repeat = args.repeat or (3 if cuda else 10)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    what = "forward (torch.no_grad)" if args.forward else "training step (loss.backward(), SGD)"
    print(f"{what}, {args.device}: the median of {rounds} rounds of {repeat} steps of each "
          "column in turn")
    error_of = "loss err" if args.forward else "grad err"
    print(f"{'model':>9} {'':>14} {'first s':>8} {'step ms':>9} {'peak MB':>8} {error_of:>9}")
    for name in args.models.split(","):
        make, batch = registry[name](small=not cuda)
        torch._dynamo.reset()  # a fresh recompile budget (hub.py's models share one forward)
        torch.manual_seed(0)
        reference = make().to(args.device)
        inputs = batch(args.device)
        loss = reference(*inputs)
        loss.backward()
        want = {"loss": loss.detach()} if args.forward else {
            k: p.grad for k, p in reference.named_parameters() if p.grad is not None}
        # each gradient's error relative to its largest entry, or to a thousandth of the
        # model's largest where it is zero in exact arithmetic (a key projection's bias:
        # softmax ignores what it adds along a row)
        floor = 1e-3 * max(w.abs().max() for w in want.values())
        columns = []
        for label, wrap in (("eager", lambda m: m), ("torch.compile", torch.compile),
                            ("plait.jit", plait.jit)):
            torch.manual_seed(0)
            model = make().to(args.device)
            run = wrap(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.0)

            def step(run=run, opt=opt):
                if args.forward:
                    with torch.no_grad():
                        return run(*inputs)
                opt.zero_grad(set_to_none=True)
                run(*inputs).backward()
                opt.step()

            start = time.perf_counter()
            try:
                step()
            except plait.errors.PlaitError as e:  # a refusal: the model's other columns run
                print(f"{name:>9} {label:>14} refused: {str(e).splitlines()[0][:160]}")
                continue
            sync()
            first = time.perf_counter() - start
            for _ in range(6):  # warm: plait captures its CUDA graphs from the third call,
                # again once the backward's residuals settle (NOTE [CUDA graphs])
                step()
            sync()
            columns.append((label, model, opt, step, first, []))
        # each column's steps in turn, round after round: a machine's drift (another tenant,
        # its clock) reaches every column alike
        for _ in range(rounds):
            for *_, step, _, times in columns:
                for _ in range(repeat):
                    start = time.perf_counter()
                    step()
                    sync()
                    times.append((time.perf_counter() - start) * 1e3)
        for label, model, opt, step, first, times in columns:
            # the loss or the gradients of a warm step (replayed, where plait captured a graph)
            got = {"loss": step()} if args.forward else {
                k: p.grad for k, p in model.named_parameters() if p.grad is not None}
            error = max(((g - want[k]).abs().max() / want[k].abs().max().clamp_min(floor))
                        .item() for k, g in got.items()) \
                if got.keys() == want.keys() else float("inf")  # a gradient given or not
            opt.zero_grad(set_to_none=True)  # above the model's and the batch's memory
            graphs = held_bytes() if label == "plait.jit" else 0
            peak = peak_bytes(step, args.device, graphs)
            peak = float("nan") if peak is None else peak / 2 ** 20
            print(f"{name:>9} {label:>14} {first:>8.2f} {statistics.median(times):>9.2f} "
                  f"{peak:>8.0f} {error:>9.1e}", flush=True)
        del columns, model, opt, step, run, got
        gc.collect()  # the compiled programs (and CUDA graphs: held_bytes counts every live
        # one) are gone before the next model


if __name__ == "__main__":
    main()
