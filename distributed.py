"""Collectives across processes, for functions under ``plait.jit`` and its transforms (and for
eager code)::

    grads = {k: plait.distributed.all_reduce(g, op="avg") for k, g in grads.items()}

Each means what its namesake in ``torch.distributed._functional_collectives`` means: it
returns a new tensor and leaves its argument alone. ``group`` is None (the default process
group), a ``torch.distributed.ProcessGroup`` or a group name; ranks (``src``) count within the
group. In a traced function each call is one effectful primitive (NOTE [collectives] in
tracer/collectives.py): kept in program order on every rank, differentiable, batched by
``vmap``. Outside one it runs at once, after the same checks. Bad arguments raise
``plait.errors.DistributedError``.

``enable_symmetric_memory(group)`` lets compiled functions run small sum all-reduces over
``group`` as one-shot all-reduces in symmetric memory (NOTE [comm buffers]).

``plait.jit(DistributedDataParallel(model))`` compiles ``model`` and runs DDP's own
bookkeeping around each compiled call (NOTE [jit of DDP]); other torch.distributed wrappers
are refused inside a traced function (NOTE [distributed wrappers] in tracer/state.py).
"""
from __future__ import annotations

import warnings

import torch

from .errors import DistributedError
from .graph import TensorType
from .tracer.collectives import group_params, normalize_dim, process_group
from .tracer.registry import get_primitive
from .tracer.trace import bind, on_tracers, tracing_active


def all_reduce(x: torch.Tensor, op="sum", group=None) -> torch.Tensor:
    """The elementwise reduction of ``x`` over the ranks (``op``: "sum", "avg", "max",
    "min", or a ``torch.distributed.ReduceOp``), on every rank."""
    return _collective("all_reduce", x, group, op=_op_name(op))


def all_gather(x: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim``, in rank order, on every rank."""
    return _collective("all_gather", x, group, dim=dim)


def reduce_scatter(x: torch.Tensor, op="sum", dim: int = 0, group=None) -> torch.Tensor:
    """The reduction ("sum" or "avg") of ``x`` over the ranks, split into equal chunks
    along ``dim``: rank r gets chunk r."""
    return _collective("reduce_scatter", x, group, op=_op_name(op), dim=dim)


def all_to_all(x: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    """``x`` split into equal chunks along ``dim``, chunk j sent to rank j; each rank
    concatenates the chunks it receives along ``dim``, in rank order."""
    return _collective("all_to_all", x, group, dim=dim)


def broadcast(x: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """Rank ``src``'s ``x``, on every rank."""
    return _collective("broadcast", x, group, src=src)


def enable_symmetric_memory(group=None) -> None:
    """Let functions compiled from now on compute each sum ``all_reduce`` over ``group`` of
    a CUDA float32 or bfloat16 tensor of at most ``plait.config.symm_mem_max_bytes`` straight
    into a communication buffer in symmetric memory (``torch.distributed._symmetric_memory``)
    and run it as a one-shot all-reduce there, where its operand is computed by plait (NOTE
    [comm buffers] in tracer/collectives.py). Call it on every rank. Elsewhere (CPU tensors,
    gloo, other ops, larger tensors, operands that are arguments) the regular collective
    runs."""
    name = process_group(group).group_name
    try:
        from torch.distributed import _symmetric_memory as symm
    except ImportError as e:
        raise DistributedError(f"this torch build has no symmetric memory ({e}); leave "
                               "plait.distributed.enable_symmetric_memory out") from None
    with warnings.catch_warnings():  # newer torch deprecates it, yet still reads it
        warnings.simplefilter("ignore", FutureWarning)  # in is_symm_mem_enabled_for_group
        symm.enable_symm_mem_for_group(name)


# NOTE [jit of DDP]
# DistributedDataParallel's forward is bookkeeping around the call of the module it wraps.
# ``_pre_forward`` readies the reducer (``prepare_for_forward``), broadcasts rank 0's
# buffers (``broadcast_buffers``), rebuilds the buckets once and moves the inputs to
# ``device_ids``; ``_post_forward`` tells the reducer to expect gradients (for every
# parameter, or with ``find_unused_parameters`` for those the outputs' autograd graph
# reaches) and passes the outputs through ``_DDPSink`` (``static_graph``'s first step). The
# reducer's hooks on the parameters' gradient accumulators then all-reduce each bucket as
# its gradients arrive. ``plait.jit(ddp)`` compiles ``ddp.module`` and runs those two steps
# around each compiled call, as DDP's forward does: the compiled call is one torch.autograd
# node whose gradients flow into the parameters' accumulators, so the reducer's hooks fire
# as in eager, and ``no_sync()``, ``gradient_as_bucket_view``, ``static_graph`` and comm
# hooks are the reducer's business. (Traced, DDP's forward would ready the reducer once,
# while tracing, and later steps would not synchronize: a call inside a trace is refused.)
# Hooks on the DDP module itself would not run, DDP's own ``nn.Module`` call not being made:
# refused. The compiled backward being one node, every gradient reaches the reducer when
# it ends: the buckets are all-reduced after the backward, not during it (so too for
# ``DDP(plait.jit(model))``).
def ddp_call(ddp: torch.nn.parallel.DistributedDataParallel, compiled, args: tuple,
             kwargs: dict):
    """DDP's forward, ``compiled`` (the jitted ``ddp.module``) in place of its module's call
    (NOTE [jit of DDP])."""
    if tracing_active():
        raise DistributedError(
            "a plait.jit of a DistributedDataParallel module was called inside a traced "
            "function, where DDP's gradient synchronization would be readied only while "
            "tracing; call it outside, or compile the whole step with plait.distributed's "
            "all_reduce of the gradients inside it.")
    if hooked := [k for k in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
                              "_backward_hooks") if getattr(ddp, k)]:
        raise DistributedError(
            f"the DistributedDataParallel module compiled by plait.jit has hooks ({hooked[0]}),"
            " which plait.jit(ddp) does not run: register them on the module it wraps "
            "(ddp.module), whose call is the one compiled.")
    args, kwargs = ddp._pre_forward(*args, **kwargs)
    return ddp._post_forward(compiled(*args, **kwargs))


def _op_name(op) -> str:
    name = getattr(op, "name", op)  # a torch.distributed.ReduceOp member, or a string
    return name.lower() if isinstance(name, str) else name


def _collective(name: str, x, group, **options):
    if not isinstance(x, torch.Tensor):
        raise DistributedError(f"plait.distributed.{name} takes a tensor, not "
                               f"{type(x).__name__}")
    if "dim" in options:
        options["dim"] = normalize_dim(name, options["dim"], x.dim())
    params = group_params(group) | options
    if tracing_active():
        return on_tracers(lambda t: bind(name, t, **params))(x)
    prim = get_primitive(name)
    prim.infer(TensorType.of(x), **params)  # the checks a trace makes
    return prim.impl(x, **params)
