"""Small all-reduces inside a jitted function, on every rank of a torchrun launch:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
        torchrun --nproc-per-node 2 benchmarks/distributed.py [--sizes 4096,65536] [--repeat 7]

The function is ``all_reduce(x + 1) * 2`` over float32 tensors of each size. Rows compare:

- plait one-shot: symmetric memory enabled for the group (``enable_symmetric_memory``) and
  ``config.symm_mem_max_bytes`` above the size, so ``x + 1`` is computed into a comm buffer
  and reduced by ``symm_mem.one_shot_all_reduce`` (the lowered program is checked for it);
- plait NCCL: the same function with the symmetric path off (``symm_mem_max_bytes=0``): the
  regular functional all-reduce, started and waited for apart;
- eager: ``y = x + 1; torch.distributed.all_reduce(y); y * 2``;
- torch.compile: the same with ``torch.distributed._functional_collectives.all_reduce``.

Before timing, a function with two small sum all-reduces checks the comm pool: both operands
in one pool at distinct offsets (they are live together), the results eager's.

Each cell is microseconds per call: the median over ``--repeat`` timed runs of ``--calls``
back-to-back calls (after warm-up), synchronized and behind a barrier at both ends, so it
includes each system's launch overhead; on CUDA, after it in parentheses, the GPU time of one
all-reduce kernel (NCCL's or the one-shot kernel, from torch.profiler: the median over the
calls on the rank that waits least for the other). Every variant's result is checked against eager first. On CPUs
(gloo) it runs too, without the one-shot path (a smoke test).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import warnings

import plait
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from plait.graph.loops import Extern


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4096,16384,65536,262144,1048576",
                   help="bytes of each all-reduced tensor, comma-separated")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--no-profile", action="store_true",
                   help="skip the all-reduce kernels' GPU time (torch.profiler)")
    return p.parse_args()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call_us(fn, x, calls: int, repeat: int) -> float:
    for _ in range(10):
        fn(x)
    samples = []
    for _ in range(repeat):
        sync(x.device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        sync(x.device)
        samples.append((time.perf_counter() - start) / calls * 1e6)
        dist.barrier()
    return statistics.median(samples)


def kernel_us(fn, x, calls: int) -> float:
    """GPU microseconds of one all-reduce kernel: the median over the calls on each rank, the
    least over the ranks (a kernel starts when its rank gets there and runs until the other
    rank has too: the rank that gets there last measures the transfer without the wait)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(x.device)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(x)
        sync(x.device)
    times = [e.time_range.elapsed_us() for e in prof.events()
             if e.device_type == DeviceType.CUDA and "allreduce" in e.name.lower().replace("_", "")]
    least = torch.tensor([statistics.median(times) if times else math.nan], device=x.device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    return least.item()


def plait_fn(x):
    return plait.distributed.all_reduce(x + 1) * 2


def eager_fn(x):
    y = x + 1
    dist.all_reduce(y)
    return y * 2


def compile_fn(x):
    return funcol.all_reduce(x + 1, "sum", dist.group.WORLD) * 2


def one_shot_taken(jitted, x) -> bool:
    """Did lowering realize x + 1 as a comm buffer and call the one-shot all-reduce?"""
    lowered = jitted.lower(x)
    labels = [k.label for k in lowered.compiled.program.kernels if isinstance(k, Extern)]
    return bool(lowered.memory["comm_pools"]) and labels == ["symm_mem.one_shot_all_reduce"]


def check_pool(device) -> dict:
    """Two comm buffers live together in one pool: the one-shot all-reduce reads each at its
    offset (the lowered program's pool, for the report)."""
    def two(x):
        pd = plait.distributed
        return pd.all_reduce(x + 1) + pd.all_reduce(x * 3)

    x = torch.randn(4096, generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    y1, y3 = x + 1, x * 3
    dist.all_reduce(y1)
    dist.all_reduce(y3)
    with plait.config.patch(symm_mem_max_bytes=1 << 20):
        jitted = plait.jit(two)
        torch.testing.assert_close(jitted(x), y1 + y3, rtol=1e-5, atol=1e-5)
        (pool,) = jitted.lower(x).memory["comm_pools"] or [None]
    return pool


def init_ranks() -> tuple[int, int, torch.device]:
    """This rank's process group (NCCL on GPUs, else gloo): its rank, the world size and
    its device."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def main():
    args = parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    rank, world, device = init_ranks()
    cuda = device.type == "cuda"
    plait.distributed.enable_symmetric_memory()
    pool = check_pool(device)
    if cuda:
        assert pool is not None and len(set(pool["offsets"].values())) == 2, pool
    sizes = [int(s) for s in args.sizes.split(",")]
    largest = max(sizes)
    one_shot = plait.jit(plait_fn)  # each variant its own jitted function (its own cache)
    regular = plait.jit(plait_fn)
    compiled = None if args.no_compile else torch.compile(compile_fn, dynamic=False)
    variants = {
        "plait one-shot": (lambda x: one_shot(x), {"symm_mem_max_bytes": largest}),
        "plait NCCL": (lambda x: regular(x), {"symm_mem_max_bytes": 0}),
        "eager": (eager_fn, {}),
    }
    if compiled is not None:
        variants["torch.compile"] = (compiled, {})
    rows, taken = [], {}
    for nbytes in sizes:
        x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank)).to(device)
        expected = eager_fn(x)
        row = {"size": nbytes}
        for name, (fn, knobs) in variants.items():
            with plait.config.patch(**knobs):
                torch.testing.assert_close(fn(x), expected, rtol=1e-5, atol=1e-5)
                if name == "plait one-shot":
                    taken[nbytes] = one_shot_taken(one_shot, x)
                    assert taken[nbytes] or not cuda, f"{nbytes} B: no one-shot all-reduce"
                if name == "plait NCCL":
                    assert not one_shot_taken(regular, x)
                row[name] = f"{per_call_us(fn, x, args.calls, args.repeat):.1f}"
                if cuda and not args.no_profile:
                    row[name] += f" ({kernel_us(fn, x, args.calls):.1f})"
        rows.append(row)
    if rank == 0:
        backend = dist.get_backend()
        where = torch.cuda.get_device_name(device) if cuda else "CPU"
        print(f"\nall_reduce(x + 1) * 2, float32, {world} ranks ({backend}, {where}), torch "
              f"{torch.__version__}; microseconds per call, median of {args.repeat} x "
              f"{args.calls} calls" + ("; (one all-reduce kernel's GPU microseconds)"
                                       if cuda and not args.no_profile else ""))
        names = list(variants)
        print("| size | " + " | ".join(names) + " |")
        print("|---:|" + "---:|" * len(names))
        for row in rows:
            size = row["size"]
            label = f"{size // 1024} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
            print(f"| {label} | " + " | ".join(row[n] for n in names) + " |")
        if pool is not None:
            print(f"comm pool of the two-all-reduce check: {pool}")
        if not all(taken.values()):
            print("(the one-shot path was not taken: symmetric memory needs CUDA; its row is "
                  "the regular collective)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
