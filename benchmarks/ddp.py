"""Data parallel training on every rank of a torchrun launch: suite models under
DistributedDataParallel or FSDP2 (``fully_shard``), eager, torch.compile and plait, in one
process per GPU:

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/ddp.py [--models GPT2LMHeadModel]
        [--wrapper ddp|fsdp] [--dtype bfloat16] [--steps 10] [--repeat 5] [--columns ...]
        [--csv FILE]

Each rank trains the suite's full-size model on its own batch of the suite's size (the
ordinary loop: ``zero_grad; loss.backward(); step`` of SGD with learning rate 0, so every
step computes the gradients of the same weights). DDP's columns: ``eager`` (``DDP(model)``),
``torch.compile`` (``torch.compile(DDP(model))``, its DDPOptimizer splitting the graph at
buckets), ``plait.jit(DDP)`` (DDP's bookkeeping around the compiled call, the gradients
averaged bucket by bucket inside the compiled backward: NOTE [gradients averaged in the
backward]) and ``DDP(plait.jit)`` (averaged by DDP's reducer as the compiled backward hands
it the gradients, at its end). FSDP2's: ``eager`` (``fully_shard`` of each block, the
largest ``ModuleList``'s items, then of the model), ``torch.compile`` (``fully_shard(
torch.compile(block))``) and ``plait`` (``fully_shard(plait.jit(block))``). Each also runs
on one GPU without the wrapper, the same batch per GPU, for the scaling. Rank 0 prints, per
column: the step (median ms over ``--repeat`` runs of ``--steps`` steps, synchronized and
behind a barrier), the single-GPU step, the scaling efficiency (single over data parallel:
100% is communication costing nothing), from the timeline (torch.profiler) the NCCL
kernels' time per step (waits for the other rank included) and the share of it that other
kernels overlapped (hidden behind compute), peak memory per GPU (MB) and the largest
relative error of a gradient against the eager column's.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plait  # noqa: E402
from models import peak_bytes  # noqa: E402
from plait.backends.cuda_graphs import held_bytes  # noqa: E402
from distributed import init_ranks  # noqa: E402
from suite import PRECISION, _rms, append_csv, relative_error, without_dropout  # noqa: E402
from suite_models import SUITE  # noqa: E402

COLUMNS = {"ddp": ("eager", "torch.compile", "plait.jit(DDP)", "DDP(plait.jit)"),
           "fsdp": ("eager", "torch.compile", "plait")}


def wrapped(column: str, module: torch.nn.Module, data_parallel: bool):
    """What the loop calls: ``module`` under DDP's ``column``, with DDP or alone."""
    ddp = (lambda m: DDP(m)) if data_parallel else (lambda m: m)
    if column == "eager":
        return ddp(module)
    if column == "torch.compile":
        return torch.compile(ddp(module))
    if column == "plait.jit(DDP)":
        return plait.jit(ddp(module))
    return ddp(plait.jit(module))


def sharded(column: str, module: torch.nn.Module, data_parallel: bool):
    """What the loop calls: ``module`` under FSDP2's ``column``: each block compiled (and
    sharded), then the model sharded, or its blocks compiled alone."""
    from torch.distributed.fsdp import fully_shard

    blocks = max((m for m in module.modules() if isinstance(m, torch.nn.ModuleList)),
                 key=lambda m: sum(p.numel() for p in m.parameters()))
    compile = {"eager": lambda m: m, "torch.compile": torch.compile, "plait": plait.jit}[column]
    for i, block in enumerate(blocks):
        blocks[i] = compile(block)
        if data_parallel:
            fully_shard(blocks[i])
    if data_parallel:
        fully_shard(module)
    return module


def full(t: torch.Tensor) -> torch.Tensor:
    """``t``, gathered whole where it is a DTensor (FSDP's sharded gradient)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def make_step(run, module, inputs):
    optimizer = torch.optim.SGD(module.parameters(), lr=0.0)

    def step():
        optimizer.zero_grad(set_to_none=True)
        _, loss = run(**inputs)
        loss.backward()
        optimizer.step()

    return step


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()


def step_ms(step, steps: int, repeat: int, cuda: bool) -> float:
    times = []
    for _ in range(repeat):
        _sync(cuda)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(cuda)
        times.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(times)


def communication(step, steps: int = 3) -> tuple[float, float]:
    """From the timeline of ``steps`` steps (torch.profiler): the NCCL kernels' time per
    step (ms, their waits for the other rank included) and the share of it during which
    another kernel computed (the communication hidden behind compute)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [(e.time_range.start, e.time_range.end, "nccl" in e.name.lower())
               for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy: list[list[float]] = []  # the compute kernels' time, merged into intervals
    for start, end, _ in sorted(k for k in kernels if not k[2]):
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end])
    total = hidden = 0.0
    for start, end, nccl in kernels:
        if nccl:
            total += end - start
            hidden += sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy
                          if a < end and b > start)
    return total / steps / 1e3, hidden / total if total else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="GPT2LMHeadModel")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--wrapper", default="ddp", choices=tuple(COLUMNS))
    parser.add_argument("--columns", default=None, help="default: all of the wrapper's")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--csv", default=None, help="rank 0 appends its rows here")
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    rank, world, device = init_ranks()
    cuda = device.type == "cuda"  # on CPUs (gloo, tiny models, no profile): a smoke test
    card = torch.cuda.get_device_name(device) if cuda else "cpu"
    rows = []
    for name in args.models.split(","):
        spec = SUITE[name]
        torch.manual_seed(0)
        base = spec.build(not cuda).to(device, PRECISION[args.dtype]).train()
        without_dropout(base)
        inputs = spec.inputs(base, spec.batch if cuda else spec.tiny_batch, not cuda, device,
                             torch.Generator().manual_seed(rank))
        inputs = {k: v.to(PRECISION[args.dtype]) if v.is_floating_point() else v
                  for k, v in inputs.items()}
        grads = {}
        for column in (args.columns or ",".join(COLUMNS[args.wrapper])).split(","):
            row = {"model": name, "wrapper": args.wrapper, "column": column, "gpus": world,
                   "card": card}
            times, comm, hidden = {}, 0.0, 0.0
            for data_parallel in (False, True):
                module = copy.deepcopy(base)
                gc.collect()  # the last column's CUDA graphs freed before counting
                held = held_bytes() if cuda else 0
                wrap = wrapped if args.wrapper == "ddp" else sharded
                step = make_step(wrap(column, module, data_parallel), module, inputs)
                for _ in range(3):  # compile, warm (plait captures CUDA graphs at its third)
                    step()
                times[data_parallel] = step_ms(step, args.steps, args.repeat, cuda)
                if data_parallel:
                    grads[column] = {k.replace("_orig_mod.", ""): full(p.grad).float()
                                     for k, p in module.named_parameters()
                                     if p.grad is not None}
                    if cuda:  # with the memory plait's CUDA graphs hold (NOTE [CUDA graphs])
                        row["peak_mb"] = round(peak_bytes(step, "cuda", held_bytes() - held)
                                               / 2 ** 20)
                        comm, hidden = communication(step)
                del module, step
                if cuda:
                    torch.cuda.empty_cache()
            # relative to a thousandth of the largest gradient's scale where one is zero in
            # exact arithmetic, as the suite's accuracy check has it
            reference = grads.get("eager", {})
            floor = 1e-3 * max((_rms(g) for g in reference.values()), default=0.0)
            errors = [relative_error(grads[column][k], g, floor) for k, g in reference.items()]
            row.update(step_ms=round(times[True], 2), single_ms=round(times[False], 2),
                       scaling=f"{times[False] / times[True]:.0%}",
                       comm_ms=round(comm, 2), hidden=f"{hidden:.0%}" if comm else "",
                       grad_error=f"{max(errors):.1e}" if errors else "")
            rows.append(row)
            if rank == 0:
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if rank == 0 and args.csv:
        append_csv(args.csv, rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
