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
bookkeeping around each compiled call (NOTE [jit of DDP]), its gradients averaged by the
compiled backward itself where DDP's options allow (NOTE [gradients averaged in the
backward]); other torch.distributed wrappers are refused inside a traced function (NOTE
[distributed wrappers] in tracer/state.py).
"""
from __future__ import annotations

import warnings

import attrs
import torch

from .errors import DistributedError
from .graph import Graph, TensorType
from .tracer.collectives import group_params, normalize_dim, process_group
from .tracer.interpret import graph_of, inline
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
# refused. The compiled backward being one node, every gradient would reach the reducer
# when it ends, and the buckets would be all-reduced after the backward, not during it (so
# it is for ``DDP(plait.jit(model))``); so where it can, ``plait.jit(ddp)`` leaves the
# reducer out of the backward and averages the gradients in the compiled backward (NOTE
# [gradients averaged in the backward]).
def ddp_call(ddp: torch.nn.parallel.DistributedDataParallel, jitted,
             sync: "GradientSync | None", args: tuple, kwargs: dict):
    """DDP's forward, ``jitted`` (the ``Jitted`` of ``ddp.module``) in place of its module's
    call (NOTE [jit of DDP]), averaging the gradients by ``sync`` where it can (None: a call
    under a foreign mode, whose autograd records torch's ops: the reducer's)."""
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
    if sync is not None and sync.applies(ddp):  # the reducer readied for the forward only: its hooks stay idle
        return jitted.call(args, kwargs, sync)
    return ddp._post_forward(jitted(*args, **kwargs))


# NOTE [gradients averaged in the backward]
# Under ``plait.jit(ddp)``, a call whose gradients DDP would average (grad mode on, outside
# ``no_sync()``) is compiled with the averaging in its backward program: DDP's parameters
# are cut into buckets as its reducer cuts them (reverse registration order, one dtype and
# device per bucket, each up to ``bucket_cap_mb``, the first up to 1 MiB where that is the
# default), and the backward joins each bucket's gradients into one flat tensor, averages it
# over DDP's process group with the ``all_reduce`` primitive and splits it back
# (``averaged``). The overlap pass starts each bucket's all-reduce as soon as its last
# gradient is computed and waits for it at the end (NOTE [overlap] in passes/memory.py), so
# the communication runs behind the rest of the backward, as DDP's reducer has it in eager.
# ``_post_forward`` is not called, so the reducer expects no gradients and its hooks do
# nothing. The average is over this backward's gradients only, so a call made while a
# parameter holds a gradient (one accumulated under ``no_sync()``, or
# ``zero_grad(set_to_none=False)``), which eager DDP averages together with it, keeps the
# reducer; so do the options whose meaning lives in the reducer: comm hooks,
# ``find_unused_parameters``, ``mixed_precision``, joins (``GradientSync.applies``).
# Backward programs are cached per set of differentiated inputs and their buckets
# (``_Compiled`` in api.py).
@attrs.frozen(eq=False)
class GradientSync:
    """DDP's parameters in buckets (in the order their gradients are averaged), and the
    params naming its process group in a collective."""
    buckets: tuple[tuple[torch.Tensor, ...], ...]
    group: dict

    @classmethod
    def of(cls, ddp: torch.nn.parallel.DistributedDataParallel) -> "GradientSync":
        ignored = ddp.parameters_to_ignore
        params = [p for n, p in ddp.module.named_parameters()
                  if n not in ignored and p.requires_grad]
        first = torch.distributed._DEFAULT_FIRST_BUCKET_BYTES \
            if getattr(ddp, "bucket_bytes_cap_default", True) else ddp.bucket_bytes_cap
        buckets, filling = [], {}  # (dtype, device) -> [its open bucket, its bytes]
        for p in reversed(params):
            bucket = filling.setdefault((p.dtype, p.device), [[], 0])
            bucket[0].append(p)
            bucket[1] += p.numel() * p.element_size()
            if bucket[1] >= (first if not buckets else ddp.bucket_bytes_cap):
                buckets.append(tuple(bucket[0]))
                del filling[p.dtype, p.device]
        buckets += [tuple(b) for b, _ in filling.values()]
        return cls(tuple(buckets), group_params(ddp.process_group))

    def applies(self, ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
        """Does this call average its gradients in its backward (rather than by DDP's
        reducer)?"""
        return (torch.is_grad_enabled() and ddp.require_backward_grad_sync
                and not (ddp._comm_hooks or ddp.find_unused_parameters
                         or ddp.mixed_precision is not None or ddp._join_config.enable
                         or getattr(ddp, "_use_python_reducer", False)
                         or getattr(ddp, "_delay_all_reduce_all_params", False))
                and all(p.grad is None for b in self.buckets for p in b))

    def positions(self, tensors: list[torch.Tensor], wrt: tuple[int, ...]) -> tuple:
        """Each bucket as the positions among ``wrt`` (the differentiated inputs) of its
        parameters that a call's ``tensors`` hold there."""
        where = {id(tensors[i]): k for k, i in enumerate(wrt)}
        buckets = (tuple(where[id(p)] for p in b if id(p) in where) for b in self.buckets)
        return tuple(b for b in buckets if b)


def averaged(backward: Graph, buckets: tuple, group: dict) -> Graph:
    """``backward`` with its outputs at each of ``buckets``' positions averaged over
    ``group``, a bucket at a time (NOTE [gradients averaged in the backward])."""
    def body(*inputs):
        grads = inline(backward, inputs)
        for bucket in buckets:
            flat = bind("all_reduce", torch.cat([grads[k].reshape(-1) for k in bucket]),
                        op="avg", **group)
            for k, part in zip(bucket, flat.split([grads[k].numel() for k in bucket])):
                grads[k] = part.view(grads[k].shape)
        return grads
    return graph_of(body, backward.input_types)


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
