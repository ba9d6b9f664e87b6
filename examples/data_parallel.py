"""Data-parallel training: each rank computes gradients on its shard of the batch inside one
jitted step, and plait.distributed averages them over the ranks.

    torchrun --nproc-per-node 2 examples/data_parallel.py

On CPUs the processes talk through gloo; with CUDA, through NCCL, one GPU per rank
(``PLAIT_BACKEND=cpp`` or ``triton`` picks the compiler, as for any plait program). After
training, every rank checks its loss and weights against single-process training on the
whole batch (eager torch, recomputed on each rank) and prints whether they match.
"""
import os

import torch
import torch.distributed as dist

import plait
from train_mlp import init, loss  # the model of examples/train_mlp.py

STEPS, LR, BATCH = 20, 0.1, 64


@plait.jit
def train_step(params, x, y):
    """One SGD step on this rank's shard. Shards are equal, so the average of the shards'
    mean losses (and of their gradients) is the whole batch's."""
    grads, value = plait.grad_and_value(loss)(params, x, y)
    grads = {k: plait.distributed.all_reduce(g, op="avg") for k, g in grads.items()}
    new = {k: p - LR * grads[k] for k, p in params.items()}
    return new, plait.distributed.all_reduce(value, op="avg")


def reference(params, x, y):
    """Single-process training on the whole batch with eager torch.autograd."""
    params, losses = {k: p.clone().requires_grad_() for k, p in params.items()}, []
    for _ in range(STEPS):
        value = loss(params, x, y)
        grads = torch.autograd.grad(value, list(params.values()))
        with torch.no_grad():
            params = {k: (p - LR * g).requires_grad_() for (k, p), g in zip(params.items(), grads)}
        losses.append(value.detach())
    return {k: p.detach() for k, p in params.items()}, torch.stack(losses)


def main():
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)

    # every rank builds the same global batch and initial weights, then takes its shard
    generator = torch.Generator().manual_seed(0)
    x = torch.linspace(-2, 2, BATCH).unsqueeze(1)
    y = (torch.sin(2 * x) + 0.05 * torch.randn(x.shape, generator=generator)).to(device)
    x = x.to(device)
    params = {k: p.to(device) for k, p in init([1, 32, 32, 1], generator).items()}
    assert BATCH % world == 0, f"the batch of {BATCH} does not split over {world} ranks"
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)

    start, losses = params, []
    for step in range(STEPS):
        params, value = train_step(params, x[shard], y[shard])
        losses.append(value)
        if step % 5 == 0 and rank == 0:
            print(f"step {step:2d}  loss {value.item():.5f}")

    expected, expected_losses = reference(start, x, y)
    try:
        torch.testing.assert_close(torch.stack(losses), expected_losses, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(params, expected, rtol=1e-4, atol=1e-5)
    except AssertionError as e:
        raise SystemExit(f"rank {rank}: MISMATCH with single-process training:\n{e}")
    worst = max((params[k] - expected[k]).abs().max().item() for k in params)
    print(f"rank {rank}: loss and weights match single-process training on the full batch "
          f"(final loss {losses[-1].item():.5f}, max weight difference {worst:.1e})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
