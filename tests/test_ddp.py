"""plait.jit composed with torch.distributed's wrappers (DDP, FSDP, tensor parallelism,
DTensor), on two gloo processes (CPU).

Each torchrun launch of this file (``python -m torch.distributed.run ... test_ddp.py DIR
GROUP``) runs the checks of one group on both ranks and writes check name -> "ok" or the
failure to ``DIR/rank<r>.json``; ``test_fast[<check>]`` and ``test_slow[<check>]`` assert
that both ranks passed it. A composition plait supports trains a small float64 MLP for
three SGD steps, each rank on half the batch, to the weights of one process training on the
whole batch (where batch statistics or a comm hook change the numbers, to eager DDP's);
one it refuses raises plait.errors.DistributedError naming the order that works.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close
from torch.nn.parallel import DistributedDataParallel as DDP

import plait
from plait.errors import DistributedError
from test_distributed import W, assert_passed, launch, run_checks

GROUPS: dict[str, dict] = {"fast": {}, "slow": {}}
BATCH, STEPS, LR = 8, 3, 0.1
X = torch.randn(BATCH, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
Y = torch.randn(BATCH, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))


def check(group: str):
    def register(fn):
        GROUPS[group][fn.__name__] = fn
        return fn
    return register


def mlp(*extra: torch.nn.Module) -> torch.nn.Sequential:
    """The same weights on every rank and in the reference."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), *extra, torch.nn.Tanh(),
                               torch.nn.Linear(8, 2)).double()


class Unused(torch.nn.Module):
    """An MLP holding a layer its forward never calls (find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.net, self.unused = mlp(), torch.nn.Linear(2, 2).double()

    def forward(self, x):
        return self.net(x)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """This rank's share of the whole batch's mean squared error: DDP averages the ranks'
    gradients, and micro-batches' gradients add up."""
    return ((out - y) ** 2).sum() * dist.get_world_size() / Y.numel()


def train(model, parameters, micro_batches: int = 1, no_sync=None) -> None:
    """STEPS SGD steps on this rank's half of the batch, in ``micro_batches`` (all but the
    last under ``no_sync``, DDP's gradient accumulation)."""
    rank = dist.get_rank()
    x, y = X.chunk(W)[rank], Y.chunk(W)[rank]
    optimizer = torch.optim.SGD(list(parameters), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        for k, (xs, ys) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            with no_sync() if k < micro_batches - 1 else contextlib.nullcontext():
                loss_of(model(xs.clone()), ys).backward()  # dense: one compilation
        optimizer.step()


@functools.cache
def single_process() -> list[torch.Tensor]:
    """The MLP's weights after STEPS SGD steps of one process on the whole batch."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        ((model(X) - Y) ** 2).mean().backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def assert_trained(parameters) -> None:
    """``parameters`` (DTensors gathered) are the single process's after training."""
    got = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in parameters]
    for g, e in zip(got, single_process(), strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-5)


def assert_refused(call, words: str) -> None:
    with pytest.raises(DistributedError) as error:
        call()
    assert words in str(error.value), str(error.value)


# ---------------------------------------------------------------------------------------
# DDP, in both orders
# ---------------------------------------------------------------------------------------
@check("fast")
def jit_of_ddp():
    """plait.jit(DDP(model)): DDP's bookkeeping runs around every compiled call, so every
    step all-reduces (not only the traced one); the names are DDP's."""
    model = mlp()
    ddp = DDP(model)
    jitted = plait.jit(ddp, backend="eager")
    assert [n for n, _ in jitted.named_parameters()] == [n for n, _ in ddp.named_parameters()]
    assert list(jitted.state_dict()) == list(ddp.state_dict())
    train(jitted, jitted.parameters())
    assert jitted.trace_count == 1
    assert_trained(model.parameters())


@check("fast")
def ddp_of_jit():
    model = mlp()
    train(DDP(plait.jit(model, backend="eager")), model.parameters())
    assert_trained(model.parameters())


def fp16_hooked(model) -> DDP:
    """DDP communicating float16 gradients: a comm hook, which changes the numbers."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    ddp = DDP(model)
    ddp.register_comm_hook(None, fp16_compress_hook)
    return ddp


@check("slow")
def jit_of_ddp_options():
    """DDP's options, under plait.jit(DDP(...)) on the cpp backend, train as eager DDP
    and, where neither batch statistics nor a comm hook changes the numbers, as one
    process."""
    cases = {  # name: (model, micro-batches, DDP of the model)
        "find_unused_parameters": (Unused, 1, functools.partial(
            DDP, find_unused_parameters=True)),
        "static_graph": (mlp, 1, functools.partial(DDP, static_graph=True)),
        "gradient_as_bucket_view": (mlp, 1, functools.partial(
            DDP, gradient_as_bucket_view=True)),
        "no_sync": (mlp, 2, DDP),
        "broadcast_buffers": (lambda: mlp(torch.nn.BatchNorm1d(8).double()), 1,
                              functools.partial(DDP, broadcast_buffers=True)),
        "comm_hook": (mlp, 1, fp16_hooked),
    }
    for name, (make, micro_batches, wrap) in cases.items():
        state = []
        for compile in (True, False):
            model = make()
            ddp = wrap(model)
            run = plait.jit(ddp, backend="cpp") if compile else ddp
            train(run, run.parameters(), micro_batches, run.no_sync)
            state.append([t.detach() for t in (*model.parameters(), *model.buffers())])
            if compile:
                assert run.trace_count == 1, name
                if name not in ("broadcast_buffers", "comm_hook"):
                    assert_trained((model.net if name == "find_unused_parameters"
                                    else model).parameters())
        for got, expected in zip(*state, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=name)


@check("slow")
def ddp_of_jit_cpp():
    model = mlp()
    train(DDP(plait.jit(model, backend="cpp")), model.parameters())
    assert_trained(model.parameters())


@check("slow")
def ddp_inside_a_jitted_function_refused():
    ddp = DDP(mlp())
    assert_refused(lambda: plait.jit(lambda x: ddp(x).sum())(X), "plait.jit(ddp_model)")
    global hidden  # reached only through sys.modules, which the trace's walk skips
    hidden = plait.jit(DDP(mlp()))
    assert_refused(lambda: plait.jit(lambda x: sys.modules[__name__].hidden(x))(X),
                   "called inside a traced function")
    jitted = plait.jit(DDP(mlp()))
    jitted.register_forward_hook(lambda *_: None)
    assert_refused(lambda: jitted(X), "register them on the module it wraps (ddp.module)")


# ---------------------------------------------------------------------------------------
# FSDP
# ---------------------------------------------------------------------------------------
class Block(torch.nn.Module):
    """A block fully_shard manages, whose forward calls the jitted computation it holds:
    FSDP's hooks run around that call."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.compiled = inner, plait.jit(inner)

    def forward(self, x):
        return self.compiled(x)


@check("slow")
def fully_shard_blocks_of_jitted_inner_computations():
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    blocks = torch.nn.Sequential(*[Block(layer) for layer in model])
    for block in blocks:
        fully_shard(block)
    fully_shard(blocks)
    train(blocks, blocks.parameters())
    assert_trained(model.parameters())


@check("fast")
def fully_shard_of_jitted_blocks():
    """fully_shard(plait.jit(block)) for each block, then over the model: FSDP's hooks run
    around each compiled call; the names are the model's."""
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    blocks = torch.nn.Sequential(*[plait.jit(layer, backend="cpp") for layer in model])
    assert [n for n, _ in blocks.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(blocks.state_dict()) == list(model.state_dict())
    for block in blocks:
        fully_shard(block)
    fully_shard(blocks)
    train(blocks, blocks.parameters())
    assert_trained(model.parameters())
    assert [block.trace_count for block in blocks] == [1, 1, 1]


@check("fast")
def jit_of_a_fully_sharded_model():
    """plait.jit of a model fully_shard manages (its blocks not sharded apart): its forward
    is traced, FSDP's hooks and the user's run around each compiled call."""
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    fully_shard(model)
    calls = []
    jitted = plait.jit(model, backend="cpp")
    assert [n for n, _ in jitted.named_parameters()] == [n for n, _ in mlp().named_parameters()]
    train(jitted, jitted.parameters())
    assert_trained(model.parameters())
    model.register_forward_hook(lambda m, args, out: calls.append(out.shape))
    x = X.chunk(W)[dist.get_rank()].clone()  # the batch trained on, dense
    with torch.no_grad():  # a hook registered after the first call runs, and retraces nothing
        assert_close(jitted(x), model(x))
    assert jitted.trace_count == 1 and len(calls) == 2
    # another function holding the model traces its hooks: refused, as before
    assert_refused(lambda: plait.jit(lambda x: model(x) * 2)(X), "managed by FSDP")


@check("slow")
def fully_shard_of_jitted_blocks_together():
    """fully_shard([a, b]) of two jitted blocks: one group, its hooks (always_call among
    their options) run around each block's compiled call."""
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    blocks = torch.nn.Sequential(*[plait.jit(layer, backend="cpp") for layer in model])
    fully_shard([blocks[0], blocks[2]])
    fully_shard(blocks)
    train(blocks, blocks.parameters())
    assert_trained(model.parameters())


@check("slow")
def fsdp1_of_jit():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for use_orig_params in (False, True):
        model = mlp()
        fsdp = FSDP(plait.jit(model), device_id=torch.device("cpu"),
                    use_orig_params=use_orig_params)
        train(fsdp, fsdp.parameters())
        with FSDP.summon_full_params(fsdp):
            assert_trained(model.parameters())


@check("slow")
def fsdp_inside_jit_refused():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    sharded = mlp()
    for layer in sharded[::2]:
        fully_shard(layer)
    fully_shard(sharded)
    assert_refused(lambda: plait.jit(sharded)(X), "fully_shard(plait.jit(block)) for each")
    hooked = mlp()
    fully_shard(hooked)
    hooked.register_full_backward_hook(lambda *_: None)
    assert_refused(lambda: plait.jit(hooked)(X), "_backward_hooks, which would not run")
    blocks = [plait.jit(layer) for layer in mlp()]
    for block in blocks:
        fully_shard(block)
    assert_refused(lambda: plait.jit(torch.nn.Sequential(*blocks))(X),
                   "managed by FSDP (FSDPState")
    fsdp1 = FSDP(mlp(), device_id=torch.device("cpu"))
    assert_refused(lambda: plait.jit(fsdp1)(X), "FullyShardedDataParallel(plait.jit(model))")


# ---------------------------------------------------------------------------------------
# Tensor parallelism and DTensor
# ---------------------------------------------------------------------------------------
@check("slow")
def dtensors_refused():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (W,))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    assert_refused(lambda: plait.jit(parallelize_module(mlp(), mesh, plan))(X),
                   "parameter 'weight' of the Linear module '0' is a DTensor")
    # parallelized after a compiled call: the DTensor parameters retrace, and are refused
    model = mlp()
    jitted = plait.jit(model)
    torch.testing.assert_close(jitted(X), model(X))
    parallelize_module(model, mesh, plan)
    assert_refused(lambda: jitted(X), "is a DTensor")
    x = distribute_tensor(X, mesh, [Shard(0)])
    for backend in ("eager", "cpp"):
        assert_refused(lambda: plait.jit(lambda a: a * 2, backend=backend)(x),
                       "a function argument is a DTensor")
    assert_refused(lambda: plait.jit(lambda a: a * x)(X), "a tensor the function captures")


# ---------------------------------------------------------------------------------------
# The launch (torchrun runs this file) and the tests
# ---------------------------------------------------------------------------------------
def worker(out_dir: str, group: str) -> None:
    warnings.simplefilter("ignore")  # FSDP's and DDP's notes on a CPU-only gloo setup
    run_checks(out_dir, GROUPS[group])


def _run(group: str, tmp_path_factory):
    return launch(os.path.abspath(__file__), tmp_path_factory.mktemp(f"ddp-{group}"), group)


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    return _run("fast", tmp_path_factory)


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    return _run("slow", tmp_path_factory)


@pytest.mark.parametrize("name", list(GROUPS["fast"]))
def test_fast(fast, name):
    assert_passed(fast, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GROUPS["slow"]))
def test_slow(slow, name):
    assert_passed(slow, name)


def test_a_module_held_twice_is_traced_once():
    """A module under two names in one tree (a Block holding a layer and its plait.jit) is
    reparametrized once: the trace leaves the layer's own parameters in place."""
    layer = torch.nn.Linear(4, 8).double()
    weight = layer.weight
    block = plait.jit(Block(layer))
    for _ in range(2):
        torch.testing.assert_close(block(X), layer(X))
    assert layer.weight is weight


if __name__ == "__main__":
    worker(*sys.argv[1:])
