"""Where a training step's time goes, kernel by kernel: eager, torch.compile and plait on one
model, in one process, each step timed the same way.

    python benchmarks/profile_step.py --model gpt --blocks 12 --dtype bfloat16   # on a GPU
    python benchmarks/profile_step.py --model resnet
    python benchmarks/profile_step.py --suite GPT2LMHeadModel --dtype bfloat16
    python benchmarks/profile_step.py --suite timm_resnet50 --mode infer --channels-last
    .venv/bin/python benchmarks/profile_step.py --model gpt --device cpu --blocks 2

Per compiler: the step (median of CUDA-event timings over batches of steps), the host time
of one step's call (from the call to its return, the GPU idle before it), the device time of
its kernels and how many it launches, split into matrix products, attention, copies and the
rest; then the kernels that take the most device time, with plait's described by the ops
they compute and their source lines. ``gpt`` is ``benchmarks/models.py``'s functional step
(``plait.jit(plait.grad_and_value(gpt_loss))``); the others are ``benchmarks/zoo.py``'s
modules trained with ``loss.backward()``.
"""
from __future__ import annotations

import argparse
import collections
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CATEGORIES = (("attention", ("flash", "fmha", "attention", "efficient_attention")),
              ("matmul", ("gemm", "cutlass", "cublas", "nvjet", "sm90_xmma", "matmul",
                          "aten::mm", "aten::addmm", "aten::bmm", "aten::linear")),
              ("conv", ("conv", "wgrad", "dgrad", "implicit_convolve", "winograd")),
              ("copy", ("memcpy", "memset", "copy")))


def category(name: str) -> str:
    low = name.lower()
    for label, needles in CATEGORIES:
        if any(n in low for n in needles):
            return label
    return "other"


def gpt_function_steps(args, device, dtype):
    from models import gpt_sizes, gpt_steps

    steps, plait_step, arguments = gpt_steps(args.blocks, device, dtype, args.dropout)
    dim, heads, vocab, batch, seq = gpt_sizes(device)
    title = (f"GPT training step: {args.blocks} blocks, d={dim}, {heads} heads, vocab "
             f"{vocab}, {batch}x{seq} tokens, {dtype}, dropout {args.dropout}, {device}")
    return title, steps, lambda: [plait_step.lower(*arguments)]


def gpt_module_steps(args, device, dtype):
    """The GPT as a module trained with ``loss.backward()``: plait.jit(model) runs a forward
    and a backward program under torch.autograd."""
    import plait
    from models import GPT, gpt_batch, gpt_params, gpt_sizes

    dim, heads, vocab, batch, seq = gpt_sizes(device)
    params = gpt_params(args.blocks, dim, vocab, seq, device=device, dtype=dtype)
    tokens, targets = gpt_batch(batch, seq, vocab, device=device)
    steps, jitted = {}, {}
    for label, wrap in (("eager", lambda m: m), ("torch.compile", torch.compile),
                        ("plait", plait.jit)):
        model = GPT(params, heads)
        run = jitted[label] = wrap(model)

        def step(run=run, model=model):
            run(tokens, targets).backward()
            for p in model.parameters():
                p.grad = None
        steps[label] = step
    title = (f"GPT module, loss.backward(): {args.blocks} blocks, d={dim}, vocab {vocab}, "
             f"{batch}x{seq} tokens, {dtype}, {device}")
    return title, steps, lambda: autograd_programs(jitted["plait"])


def zoo_steps(args, device, dtype):
    import plait
    from zoo import MODELS

    make, batch = MODELS[args.model](small=device != "cuda")
    inputs = batch(device)
    steps, jitted = {}, {}
    for label, wrap in (("eager", lambda m: m), ("torch.compile", torch.compile),
                        ("plait", plait.jit)):
        torch.manual_seed(0)
        model = make().to(device=device, dtype=dtype)
        run = wrap(model)
        if label == "plait":
            jitted["plait"] = run
        xs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)

        def step(run=run, model=model, xs=xs):
            run(*xs).backward()
            grads = [p.grad for p in model.parameters()]
            for p in model.parameters():
                p.grad = None
            return grads
        steps[label] = step
    return (f"{args.model} training step, {dtype}, {device}", steps,
            lambda: autograd_programs(jitted["plait"]))


def suite_steps(args, device, dtype):
    """A model of the suite (``benchmarks/suite_models.py``), trained (or run, ``--mode
    infer``) as ``suite.py`` runs it, at its full size on a GPU and its tiny one on the CPU,
    in channels-last memory with ``--channels-last``."""
    from suite import Step, in_channels_last, without_dropout
    from suite_models import SUITE

    spec, tiny = SUITE[args.suite], device != "cuda"
    torch.manual_seed(0)
    base = spec.build(tiny).to(device)
    base.train(args.mode == "train")
    without_dropout(base)
    inputs = spec.inputs(base, spec.tiny_batch if tiny else spec.batch, tiny, device,
                         torch.Generator().manual_seed(0))
    if args.channels_last:
        base, inputs = in_channels_last(base, inputs)
    steps = {label: Step(copy.deepcopy(base), label, args.mode, args.dtype, inputs, device)
             for label in ("eager", "torch.compile", "plait")}
    jitted = steps["plait"].run
    what = "training step" if args.mode == "train" else "inference"
    layout = ", channels-last" if args.channels_last else ""
    return (f"{args.suite} {what}, {dtype}{layout}, {device}", steps,
            lambda: autograd_programs(jitted) if args.mode == "train" else
            [compiled.lowered for compiled in jitted.jitted._cache.values()])


def autograd_programs(module) -> list:
    """The forward and backward programs ``plait.jit(module)`` runs under torch.autograd
    (NOTE [jit under torch.autograd])."""
    return [p for compiled in module.jitted._cache.values()
            for d in compiled._programs.values() for p in (d._forward, d._backward)]


def kernel_descriptions(lowered: list) -> dict[str, tuple[str, object]]:
    """plait's generated kernels' names -> (the ops the first step running it computes, its
    Triton writer)."""
    out = {}
    for low in lowered:
        compiled = low.compiled
        for i, w in getattr(compiled, "writers", {}).items():
            if w.name not in out:
                lines = compiled.program.describe(compiled.program.kernels[i])
                out[w.name] = "; ".join(dict.fromkeys(lines))[:150], w
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt", choices=("gpt", "gpt-module", "llama", "vit",
                                                           "resnet", "convnext"))
    parser.add_argument("--suite", metavar="NAME", help="a model of benchmarks/suite.py's "
                        "suite instead (trained as the suite trains it)")
    parser.add_argument("--mode", default="train", choices=("train", "infer"),
                        help="--suite's: a training step, or inference under no_grad")
    parser.add_argument("--channels-last", action="store_true",
                        help="--suite's model and images in channels-last memory")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--dropout", type=float, default=0.0, help="gpt's (benchmarks/models.py)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--only", default="eager,torch.compile,plait")
    parser.add_argument("--launched-by", metavar="TEXT",
                        help="also list the ops (with their callers) that launch the kernels "
                             "whose name contains TEXT")
    parser.add_argument("--sources", metavar="DIR",
                        help="write the source of each of plait's kernels listed into DIR")
    args = parser.parse_args()
    from models import fresh_caches

    fresh_caches(args.device)
    device, dtype = args.device, getattr(torch, args.dtype)
    make = suite_steps if args.suite else {
        "gpt": gpt_function_steps, "gpt-module": gpt_module_steps}.get(args.model, zoo_steps)
    title, steps, lowered = make(args, device, dtype)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    print(title)
    summary, tops = [], {}
    for name in args.only.split(","):
        step = steps[name]
        start = time.perf_counter()
        step()
        sync()
        first = time.perf_counter() - start
        for _ in range(3):
            step()
        sync()
        times = []
        for _ in range(7):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(3):
                    step()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 3)
            else:
                t = time.perf_counter()
                for _ in range(3):
                    step()
                times.append((time.perf_counter() - t) * 1e3 / 3)
        hosts = []
        for _ in range(5):
            sync()
            t = time.perf_counter()
            step()
            hosts.append((time.perf_counter() - t) * 1e3)
            sync()
        activities = [torch.profiler.ProfilerActivity.CPU] + \
            [torch.profiler.ProfilerActivity.CUDA] * cuda
        with torch.profiler.profile(activities=activities) as prof:
            step()
            sync()
        if args.launched_by:
            callers = collections.Counter()
            for e in prof.events():
                launched = [k for k in getattr(e, "kernels", []) if args.launched_by in k.name]
                if launched and e.device_type == torch.autograd.DeviceType.CPU:
                    chain, up = [], e
                    while up is not None and len(chain) < 5:
                        chain.append(up.name)
                        up = up.cpu_parent
                    callers[" < ".join(chain)] += len(launched)
            print(f"  {name}: kernels matching {args.launched_by!r}, by launching op:")
            for chain, n in callers.most_common(15):
                print(f"    {n:5d}  {chain}")
        kernels = collections.defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            if not cuda and (e.cpu_parent is not None or not e.name.startswith("aten::")):
                continue
            kernels[e.name][0] += 1
            kernels[e.name][1] += e.time_range.elapsed_us() / 1e3
        split = collections.Counter()
        for k, (n, ms) in kernels.items():
            split[category(k)] += ms
        summary.append((name, first, statistics.median(times), statistics.median(hosts),
                        sum(ms for _, ms in kernels.values()),
                        sum(n for n, _ in kernels.values()), split))
        tops[name] = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:args.top]
        print(f"  {name}: done", flush=True)
    labels = [c for c, _ in CATEGORIES] + ["other"]
    print("\n| | first s | step ms | host ms | device ms | launches | "
          + " | ".join(f"{c} ms" for c in labels) + " |")
    print("|---|" + "--:|" * (5 + len(labels)))
    for name, first, step_ms, host, busy, count, split in summary:
        print(f"| {name} | {first:.2f} | {step_ms:.2f} | {host:.2f} | {busy:.2f} | {count} | "
              + " | ".join(f"{split[c]:.2f}" for c in labels) + " |")
    described = kernel_descriptions(lowered()) if "plait" in tops else {}
    for name, top in tops.items():
        print(f"\n{name}: the {len(top)} kernels with the most device time")
        print("| ms | calls | kernel |\n|--:|--:|---|")
        for k, (n, ms) in top:
            text = k if len(k) < 90 else k[:87] + "..."
            if k in described:
                text += f" ({described[k][0]})"
                if args.sources and device == "cuda":
                    os.makedirs(args.sources, exist_ok=True)
                    with open(os.path.join(args.sources, k + ".py"), "w") as f:
                        f.write(described[k][1].source())
            print(f"| {ms:.3f} | {n} | {text} |")


if __name__ == "__main__":
    main()
