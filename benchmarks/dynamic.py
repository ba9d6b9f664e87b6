"""Sizes that vary: the suite's transformers models in inference over sequences of random
lengths, eager, torch.compile (its automatic dynamic shapes) and plait.jit (NOTE [automatic
dynamic] in api.py), every column in one process.

For each model: the workload's wall time end to end (``--calls`` batches, each of a random
length up to the config's sequence length, compilations included) and the compilations it
took; then, at ``--sizes``, the median step of plait's dynamic program against a static
compilation of that size (plait.jit(dynamic=False)), after warm-up. Every compiled result is
checked against eager. ``--device cuda`` runs the suite's full configurations there
(plait's Triton kernels; ``--tiny`` the tiny ones). ``--coverage``
instead runs every transformers model of the suite (or ``--models``) at three lengths and
says which compile once for all of them.

    python benchmarks/dynamic.py [--models GPT2LMHeadModel,BertForMaskedLM] [--calls 200]
    python benchmarks/dynamic.py --coverage
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch
import torch._dynamo
import torch.utils._pytree as pytree

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import plait  # noqa: E402
from suite_models import SUITE  # noqa: E402

MODELS = "GPT2LMHeadModel,BertForMaskedLM,Llama-12x768,T5Small"


def _batch(spec, module, tiny: bool, device: str, length: int, seed: int) -> dict:
    """The suite's inputs for ``module`` cut to ``length`` tokens."""
    args = spec.inputs(module, spec.tiny_batch if tiny else spec.batch, tiny, device,
                       torch.Generator().manual_seed(seed))
    return {k: v[:, :length].contiguous() if v.dim() == 2 and v.dtype == torch.long else v
            for k, v in args.items()}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _check(got, want, what: str) -> None:
    got, want = pytree.tree_leaves(got), pytree.tree_leaves(want)
    assert len(got) == len(want), f"{what}: {len(got)} results, eager {len(want)}"
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3, equal_nan=True,
                                   msg=lambda m: f"{what}: {m}")


CHECK_EVERY = 25  # the workload's calls whose results are checked against eager's


def _workload(fn, batches, device: str) -> tuple[float, dict]:
    """Seconds for the calls, and the results of every CHECK_EVERY-th (kept, not all: a
    large model's logits at 200 calls would not fit)."""
    kept = {}
    start = time.perf_counter()
    with torch.no_grad():
        for i, args in enumerate(batches):
            out = fn(**args)
            if i % CHECK_EVERY == 0:
                kept[i] = out
    _sync(device)
    return time.perf_counter() - start, kept


def _check_all(got: dict, want: dict, what: str) -> None:
    for i, out in got.items():
        _check(out, want[i], f"{what}, call {i}")


def _step(fn, args, device: str, repeat: int = 20) -> float:
    with torch.no_grad():
        for _ in range(3):
            fn(**args)
        times = []
        for _ in range(repeat):
            _sync(device)
            start = time.perf_counter()
            fn(**args)
            _sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def coverage(names: list, device: str, tiny: bool) -> None:
    """Each model at three lengths: does one compilation serve them all (NOTE [automatic
    dynamic]), and why not where it does not."""
    once = 0
    for name in names:
        spec = SUITE[name]
        torch.manual_seed(0)
        model = spec.build(tiny).to(device).eval()
        jitted = plait.jit(model)
        for n in (8, 13, 21):
            args = _batch(spec, model, tiny, device, n, n)
            _check(jitted(**args), model(**args), name)
        failure = jitted.jitted.dynamic_failure
        once += failure is None
        print(f"{name}: {jitted.jitted.trace_count} compilations"
              + (f", each size: {failure[:160]}" if failure else ""), flush=True)
    print(f"{once} of {len(names)} compile once for every length")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=MODELS)
    p.add_argument("--device", default="cpu")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--sizes", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--coverage", action="store_true")
    p.add_argument("--tiny", action="store_true", help="tiny configurations on cuda too")
    a = p.parse_args()
    tiny = a.device == "cpu" or a.tiny
    torch.set_grad_enabled(False)
    if a.coverage:
        models = a.models if a.models != MODELS else ",".join(
            n for n, s in SUITE.items() if s.source == "transformers")
        return coverage(models.split(","), a.device, tiny)
    print(f"# torch {torch.__version__}, {a.device}, {torch.get_num_threads()} threads, "
          f"{a.calls} calls of random lengths")
    print("| model | lengths | eager s | torch.compile s (compiles) | plait s (compiles) | "
          "plait vs tc | static / dynamic ms at each size |")
    print("|---|---|--:|--:|--:|--:|---|")
    for name in a.models.split(","):
        spec = SUITE[name]
        torch.manual_seed(a.seed)
        model = spec.build(tiny).to(a.device).eval()
        longest = _batch(spec, model, tiny, a.device, 10 ** 9, 0)["input_ids"].shape[1]
        rng = random.Random(a.seed)
        lengths = [rng.randint(2, longest) for _ in range(a.calls)]
        batches = [_batch(spec, model, tiny, a.device, n, i) for i, n in enumerate(lengths)]
        eager, reference = _workload(model, batches, a.device)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(model)
        tc, got = _workload(compiled, batches, a.device)
        _check_all(got, reference, "torch.compile")
        del got
        tc_compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        jitted = plait.jit(model)
        pl, got = _workload(jitted, batches, a.device)
        _check_all(got, reference, "plait")
        del got, reference
        sizes = [int(s) for s in a.sizes.split(",") if s] or sorted({longest // 4, longest})
        steps = []
        for n in sizes:
            args = _batch(spec, model, tiny, a.device, n, 0)
            static = plait.jit(model, dynamic=False)
            _check(static(**args), model(**args), "static")
            steps.append(f"{n}: {_step(static, args, a.device):.2f} / "
                         f"{_step(jitted, args, a.device):.2f}")
        print(f"| {name} | 2..{longest} | {eager:.2f} | {tc:.2f} ({tc_compiles}) | {pl:.2f} "
              f"({jitted.jitted.trace_count}) | {tc / pl:.2f}x | {'; '.join(steps)} |",
              flush=True)
        if jitted.jitted.dynamic_failure:
            print(f"  plait compiled each size: {jitted.jitted.dynamic_failure[:200]}")


if __name__ == "__main__":
    main()
