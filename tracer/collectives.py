"""Collectives across processes: effectful primitives bound to a process group, their rules
side by side, and the handlers that trace torch's functional collectives.

NOTE [collectives]
``all_reduce`` (op sum, avg, max, min), ``all_gather``, ``reduce_scatter`` (sum, avg),
``all_to_all`` (equal splits) and ``broadcast`` mean what torch's functional collectives
(``torch.distributed._functional_collectives``) mean; ``reduce`` (the sum on rank ``dst``,
zeros elsewhere) exists as broadcast's transpose. Every one takes one tensor, and its params
name its process group (``group_name``, as the ``torch.ops._c10d_functional`` ops take it, and
``group_size``, so shapes are inferred without a live group) and its options (``op``,
``dim``: the functional ops work along dim 0 and the impl moves ``dim`` there and back,
``src``/``dst``: ranks within the group). Each has a ``start`` (issue the functional op along
dim 0: its pending result) and a ``wait`` (complete it), in ``SPLIT``; the impl runs both, so
every backend runs a collective as it runs any library call (an extern, when lowered), and
the compiled wrappers run compute between the two (NOTE [overlap] in passes/memory.py).

Order. Every rank must issue the same collectives in the same order, or they deadlock or
mix up data. Collectives are effectful: ``Trace._chain_effect`` chains each to the one before
by a control edge (so the eager backend's topological order keeps program order), simplify
never removes, merges or folds one (an unused result still communicates: the other ranks
wait for it), fusion never merges an extern, and the memory passes keep collectives in their
order (compute may move across them, never one collective past another). Ranks trace the
same program, so they get the same chain as long as no
rule depends on the rank: broadcast's transpose is the ``reduce`` primitive, which zeroes the
other ranks' results when it runs, and every rule below returns a cotangent, never None.

Derivatives follow the SPMD convention of torch's autograd for these ops: each rank gets the
derivative of the sum of every rank's loss. all_reduce sum/avg and all_to_all are their own
transposes, all_gather and reduce_scatter sum are each other's (avg: divided by the group
size), broadcast and reduce are each other's; being linear, each maps a tangent through
itself. all_reduce max/min passes the cotangent, summed over ranks, to the elements equal to
the result, split evenly among ties across ranks (as torch's amax). Every collective has its
own JVP rule: one derived from the VJP (passes/autodiff.py) would replay the forward
collective, which, being effectful, would stay in the graph and communicate again. Batching:
batch dims are leading, so ``dim`` moves one to the right.

Tracing: the ``_c10d_functional`` ops (single and ``_coalesced``) map to these primitives;
``wait_tensor`` and ``_wrap_tensor_autograd`` are identities (the impl has waited). Every
other c10d op reaching a tracer (in place, such as ``torch.distributed.all_reduce(t)``, or
point-to-point) raises ``DistributedError`` naming the functional form to use.

NOTE [comm buffers]
Communication libraries copy user data into buffers of their own that peers can reach;
kernels that read peers' memory directly (a one-shot all-reduce over symmetric memory) avoid
the copy, but every rank must use the same allocation, at the same offset, in every call.
plait meets that at lowering time: a ``CommBufferType`` (``COMM_BUFFER_TYPES``; the real one
is ``symm_mem``) says when a sum all_reduce may use it (``usable``: for ``symm_mem``, a CUDA
float32/bfloat16 operand of at most ``config.symm_mem_max_bytes`` over a group that
``plait.distributed.enable_symmetric_memory`` enabled), how to allocate a pool
(``allocate``) and the all-reduce that reads it. Lowering then computes the operand straight
into a buffer marked ``CommKind(type, group)`` and calls that all-reduce (NOTE [lowering
collectives] in passes/lowering.py); everywhere else (CPU tensors and gloo, other ops,
larger operands, operands that are arguments) the regular collective runs. The memory plan
puts each (type, group)'s comm buffers at offsets of one pool, the same on every rank (NOTE
[memory passes]); the wrapper allocates it with an id derived from the program, which
``symm_mem`` uses to hand back the same memory (and its rendezvous) every call, and releases
it before returning. The one-shot kernel synchronizes the ranks before it reads and after,
so a comm buffer's offset is free for another once it has run.
"""
from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.distributed as dist

from ..config import config
from ..errors import DistributedError
from ..graph import TensorType
from .aten import alias, handles, type_of
from .primitives import _attach_shifted, _linear_jvp
from .registry import define, jvp_rule, vjp_rule
from .trace import HANDLERS, bind

_c10d = torch.ops._c10d_functional
OPS = {"all_reduce": ("sum", "avg", "max", "min"), "reduce_scatter": ("sum", "avg")}


# ---------------------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------------------
def process_group(group=None):
    """The ProcessGroup ``group`` names: None (the default group), a ProcessGroup, or a
    group name (as the ``_c10d_functional`` ops take it)."""
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError(
            "no process group is initialized: call torch.distributed.init_process_group() "
            "first (backend 'gloo' on CPUs, 'nccl' on GPUs; torchrun sets the environment "
            "it reads)")
    if group is None:
        return dist.distributed_c10d._get_default_group()
    if isinstance(group, str):
        try:
            return dist.distributed_c10d._resolve_process_group(group)
        except RuntimeError:
            raise DistributedError(f"no process group is named {group!r}: pass None (the "
                                   "default group), a ProcessGroup, or the group_name of "
                                   "one") from None
    if not isinstance(group, dist.ProcessGroup):
        raise DistributedError(f"group must be None, a torch.distributed.ProcessGroup or a "
                               f"group name, not {type(group).__name__}")
    return group


def group_params(group=None, size: int | None = None) -> dict:
    """The params naming ``group`` in a collective (``size``: the size a caller assumed)."""
    pg = process_group(group)
    if size is not None and size != pg.size():
        raise DistributedError(f"group_size={size}, but group {pg.group_name!r} has "
                               f"{pg.size()} ranks; pass the group's size")
    return {"group_name": pg.group_name, "group_size": pg.size()}


def graphable(group_name: str) -> bool:
    """Can a CUDA graph hold this group's collectives (NCCL's can: NOTE [CUDA graphs])?"""
    return dist.get_backend(process_group(group_name)) == "nccl"


def normalize_dim(name: str, dim: int, ndim: int) -> int:
    """``dim`` counted from 0 (the form the primitives' params take)."""
    if not -ndim <= dim < ndim:
        raise DistributedError(f"{name}: dim={dim} is out of range for a tensor of {ndim} "
                               f"dims; pass a dim from {-ndim} to {ndim - 1} (a 0-dim tensor "
                               "has none to split or join: reshape it to [1])")
    return dim % ndim


# ---------------------------------------------------------------------------------------
# Primitives
# ---------------------------------------------------------------------------------------
def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise DistributedError(f"{name}: {message}")


def _infer(name: str, resize=None, divides: bool = False):
    """``resize(length, group_size)``: the result's length along ``dim``; ``divides``: the
    group size must divide that length (the tensor is split into equal chunks)."""
    def infer(x: TensorType, *, group_name, group_size, **options):
        op, dim = options.get("op"), options.get("dim")
        if op is not None:
            _require(op in OPS[name], name, f"unknown reduce op {op!r}; it takes "
                     f"{', '.join(map(repr, OPS[name]))}")
            _require(op != "avg" or x.dtype.is_floating_point or x.dtype.is_complex, name,
                     f"op='avg' needs a floating-point tensor, not {x}; convert it first, "
                     "or use op='sum' and divide")
        for root in ("src", "dst"):
            _require(0 <= options.get(root, 0) < group_size, name, f"{root}="
                     f"{options.get(root)} is not a rank of the group; pass a rank from 0 to "
                     f"{group_size - 1} (ranks count within the group)")
        if dim is None:
            return (x,)
        _require(0 <= dim < x.ndim, name, f"dim={dim} is out of range for {x}; pass a dim "
                 f"from 0 to {x.ndim - 1} (a 0-dim tensor has none: reshape it to [1])")
        _require(not divides or x.shape[dim] % group_size == 0, name,
                 f"the length {x.shape[dim]} of dim {dim} of {x} is not divisible by the "
                 f"group size {group_size}; pad the tensor to a multiple of it")
        shape = list(x.shape)
        shape[dim] = resize(x.shape[dim], group_size)
        return (TensorType(shape, x.dtype, x.device),)

    return infer


def _wait(out, **params):
    return _c10d.wait_tensor(out)


def _reduce_wait(out, *, group_name, dst, **params):
    """Every rank takes part in the sum; the rank is read when it runs, so all ranks trace
    one graph."""
    out = _c10d.wait_tensor(out)
    return out if process_group(group_name).rank() == dst else out.zero_()


# name -> (start, wait): ``start(x, **params)`` issues the collective along dim 0 (lowering
# moves ``dim`` there by views) and returns its pending result; ``wait(pending, **params)``
# completes it. The impl runs both; the compiled wrappers may run compute between them
# (NOTE [overlap] in passes/memory.py).
SPLIT: dict = {}


def _define(name: str, run, wait=_wait, **shape) -> None:
    def start(x, *, group_name, group_size, dim=0, **options):
        assert not dim, "a collective starts along dim 0"
        return run(x.contiguous(), group_name, group_size, **options)

    def impl(x, *, dim=None, **params):
        x = x if dim is None else x.movedim(dim, 0)
        out = wait(start(x, **params), **params)
        return out if dim is None else out.movedim(0, dim)

    define(name, _infer(name, **shape), impl, effectful=True)
    SPLIT[name] = (start, wait)


_define("all_reduce", lambda x, name, size, *, op: _c10d.all_reduce(x, op, name))
_define("all_gather", lambda x, name, size: _c10d.all_gather_into_tensor(x, size, name),
        resize=lambda n, size: n * size)
_define("reduce_scatter", lambda x, name, size, *, op: _c10d.reduce_scatter_tensor(
    x, op, size, name), resize=lambda n, size: n // size, divides=True)
_define("all_to_all", lambda x, name, size: _c10d.all_to_all_single(
    x, _equal_split(x, size), _equal_split(x, size), name),
        resize=lambda n, size: n, divides=True)
_define("broadcast", lambda x, name, size, *, src: _c10d.broadcast(x, src, name))
_define("reduce", lambda x, name, size, *, dst: _c10d.all_reduce(x, "sum", name), _reduce_wait)


def _equal_split(x, group_size):
    return [x.shape[0] // group_size] * group_size


def _group(params: dict) -> dict:
    return {"group_name": params["group_name"], "group_size": params["group_size"]}


def _reduce_scatter_transpose(ct, params):
    out = bind("all_gather", ct, dim=params["dim"], **_group(params))
    return out / params["group_size"] if params["op"] == "avg" else out


# The linear collectives' transposes: (cotangent of the result, params) -> the operand's.
TRANSPOSES = {
    "all_gather": lambda ct, p: bind("reduce_scatter", ct, **p, op="sum"),
    "reduce_scatter": _reduce_scatter_transpose,
    "all_to_all": lambda ct, p: bind("all_to_all", ct, **p),
    "broadcast": lambda ct, p: bind("reduce", ct, dst=p["src"], **_group(p)),
    "reduce": lambda ct, p: bind("broadcast", ct, src=p["dst"], **_group(p)),
}


def _transpose_vjp(name):
    return lambda cts, x, *, outs, **params: (TRANSPOSES[name](cts[0], params),)


for _name in TRANSPOSES:
    vjp_rule(_name)(_transpose_vjp(_name))
    jvp_rule(_name)(_linear_jvp(_name))


def _extremum_share(x, y, group):
    """all_reduce max/min: each element's share of the result's derivative (1 / the number
    of ranks holding the result there, 0 where this rank does not)."""
    hit = (x == y).to(x.dtype)
    return hit / torch.clamp(bind("all_reduce", hit, op="sum", **group), min=1)


@vjp_rule("all_reduce")
def _all_reduce_vjp(cts, x, *, outs, op, **group):
    """sum and avg are their own transposes; max/min: the cotangent, summed over ranks,
    shared among the elements equal to the result."""
    if op in ("max", "min"):
        return (bind("all_reduce", cts[0], op="sum", **group) * _extremum_share(
            x, outs[0], group),)
    return (bind("all_reduce", cts[0], op=op, **group),)


@jvp_rule("all_reduce")
def _all_reduce_jvp(operands, tangents, outs, *, op, **group):
    t = tangents[0]
    if op in ("max", "min"):
        t, op = t * _extremum_share(operands[0], outs[0], group), "sum"
    return (bind("all_reduce", t, op=op, **group),)


_attach_shifted(["all_reduce", "broadcast", "reduce"])
_attach_shifted(["all_gather", "reduce_scatter", "all_to_all"], "dim")


# ---------------------------------------------------------------------------------------
# Communication buffers
# ---------------------------------------------------------------------------------------
@attrs.frozen
class CommBufferType:
    """A kind of communication buffer and the all-reduce that reads one (NOTE [comm
    buffers])."""

    name: str
    # (group name, the sum all-reduce's operand) -> may it take this path?
    usable: Callable[[str, TensorType], bool]
    # (bytes, device, group name, allocation id) -> a uint8 pool; every rank makes the same
    # calls, so every rank gets the same allocation
    allocate: Callable[[int, torch.device, str, int], torch.Tensor]
    # (operand: a view of a pool, group name) -> the sum over the group's ranks, a new tensor
    all_reduce: Callable[[torch.Tensor, str], torch.Tensor]
    label: str  # what ``all_reduce`` calls, for printing


def _symm_mem_usable(group_name: str, t: TensorType) -> bool:
    # one_shot_all_reduce dispatches on float32 and bfloat16
    if not (t.device.startswith("cuda") and t.dtype in (torch.float32, torch.bfloat16)
            and 0 < t.nbytes <= config.symm_mem_max_bytes
            and hasattr(torch.ops.symm_mem, "one_shot_all_reduce")):
        return False
    try:  # a torch build without it has none enabled
        from torch.distributed import _symmetric_memory as symm
    except ImportError:
        return False
    return symm.is_symm_mem_enabled_for_group(group_name)


def _symm_mem_allocate(nbytes: int, device, group_name: str, alloc_id: int) -> torch.Tensor:
    from torch._C._distributed_c10d import _SymmetricMemory

    device = torch.device(device)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    # an allocation id makes it persistent: the same memory (and its rendezvous) each call
    return _SymmetricMemory.empty_strided_p2p((nbytes,), (1,), torch.uint8, device, group_name,
                                              alloc_id)


# The types lowering may choose from, first usable first.
COMM_BUFFER_TYPES: dict[str, CommBufferType] = {"symm_mem": CommBufferType(
    "symm_mem", _symm_mem_usable, _symm_mem_allocate,
    lambda x, group_name: torch.ops.symm_mem.one_shot_all_reduce(x, "sum", group_name),
    "symm_mem.one_shot_all_reduce")}


def comm_buffer_type(node_prim: str, params: dict, operand: TensorType) -> str | None:
    """The comm buffer type a collective's operand may become (NOTE [comm buffers]): for a
    sum all_reduce, the first type usable for its group and operand; else None."""
    if node_prim != "all_reduce" or params["op"] != "sum":
        return None
    return next((name for name, kind in COMM_BUFFER_TYPES.items()
                 if kind.usable(params["group_name"], operand)), None)


# ---------------------------------------------------------------------------------------
# Tracing torch.ops._c10d_functional
# ---------------------------------------------------------------------------------------
# How the in-place c10d ops (names without underscores) are spelled functionally: plait's
# name and torch._functional_collectives'.
_FUNCTIONAL_FORMS = {"allreduce": ("all_reduce", "all_reduce"),
                     "allgather": ("all_gather", "all_gather_tensor"),
                     "reducescatter": ("reduce_scatter", "reduce_scatter_tensor"),
                     "alltoall": ("all_to_all", "all_to_all_single"),
                     "broadcast": ("broadcast", "broadcast")}


def _refuse(func):
    def handler(*args, **kwargs):
        key = func.overloadpacket.__name__.replace("_", "")
        form = next((f for k, f in _FUNCTIONAL_FORMS.items() if key.startswith(k)), None)
        fix = (f"y = plait.distributed.{form[0]}(x, ...) or torch.distributed."
               f"_functional_collectives.{form[1]}" if form else
               "plait.distributed's collectives (all_reduce, all_gather, reduce_scatter, "
               "all_to_all, broadcast)")
        raise DistributedError(
            f"{func} on a traced tensor: plait traces collectives that return their result, "
            "and this one writes into its arguments (as torch.distributed.all_reduce(t) "
            f"does) or is point-to-point. Use {fix}, which returns a new tensor.")

    return handler


def _op(name: str):
    """``_c10d_functional.<name>.default``, or None where this torch version lacks it."""
    return getattr(getattr(_c10d, name, None), "default", None)


def _register_handlers() -> None:
    import torch.distributed._functional_collectives  # defines _wrap_tensor_autograd

    @handles(_op("all_reduce"))
    def all_reduce(x, reduce_op, group_name):
        return bind("all_reduce", x, op=reduce_op, **group_params(group_name))

    @handles(_op("all_gather_into_tensor"))
    def all_gather(x, group_size, group_name):
        return bind("all_gather", x, dim=0, **group_params(group_name, group_size))

    @handles(_op("reduce_scatter_tensor"))
    def reduce_scatter(x, reduce_op, group_size, group_name):
        return bind("reduce_scatter", x, op=reduce_op, dim=0,
                    **group_params(group_name, group_size))

    @handles(_op("all_to_all_single"))
    def all_to_all(x, output_split_sizes, input_split_sizes, group_name):
        params = group_params(group_name)
        t = type_of(x)
        equal = [t.shape[0] // params["group_size"] if t.ndim else 0] * params["group_size"]
        if [list(map(int, s)) for s in (output_split_sizes, input_split_sizes)] != [equal] * 2:
            raise DistributedError(
                f"all_to_all_single with splits {list(input_split_sizes)} -> "
                f"{list(output_split_sizes)}: plait supports equal splits only (pass None "
                "for both split sizes, with a first dim the group size divides)")
        return bind("all_to_all", x, dim=0, **params)

    @handles(_op("broadcast"))
    def broadcast(x, src, group_name):
        return bind("broadcast", x, src=src, **group_params(group_name))

    for name, single in (("all_reduce", all_reduce), ("all_gather_into_tensor", all_gather),
                         ("reduce_scatter_tensor", reduce_scatter)):
        handles(_op(f"{name}_coalesced"))(
            lambda xs, *args, one=single: [one(x, *args) for x in xs])
    handles(_op("wait_tensor"), _op("_wrap_tensor_autograd"))(alias)
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, name = qualified.partition("::")
        if namespace in ("c10d", "_c10d_functional"):
            packet = getattr(getattr(torch.ops, namespace), name)
            for overload in packet.overloads():
                op = getattr(packet, overload)
                HANDLERS.setdefault(op, _refuse(op))


if dist.is_available():
    _register_handlers()
