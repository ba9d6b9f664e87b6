"""What a traced function reads besides its arguments: the tensors and modules it captures.

NOTE [live state]
A function's closure, its globals, a bound method's object and a module's parameters,
buffers and attributes are state the caller may change between calls: an optimizer steps
the weights in place, ``model.eval()`` flips ``training``, a training loop rebinds a global
tensor. None of it may be baked into a compilation as a constant. ``reach`` walks the
function's Python objects once per trace and names each tensor and module it finds by a
*path* from a root (attributes and items: ``fn.__closure__[0].cell_contents._modules['fc']``).

* A module found that way is read whole: every parameter and buffer of its tree becomes an
  input of the graph (a tensor tied under two names, one input), and the function is traced
  with the module reparametrized to those inputs' tracers, so functionalization records the
  writes of, say, BatchNorm's running statistics as write-back outputs, exactly as for a
  mutated argument.
* Any other tensor found (a closure or global tensor, a plain attribute) becomes an input
  when the function first reads it (``Trace.constant`` asks ``lift``).
* A *slot* the caller may rebind outside a module (a function's global or closure cell,
  a dict's or list's item, a plain object's attribute: ``scale = 2.0``, ``cfg["p"] = 0.1``,
  ``config.eps = 1e-6``, ``act = torch.tanh``) is read back at each call: a number,
  string, dtype or device by value, as part of the signature; anything else but a tensor or
  module (which have their own guards) by identity, and another object there retraces.
  Each container read from is itself a slot of its holder, so rebinding ``cfg`` is seen
  too, and the length of a list or dict of such values (``scales = [1.0, 2.0]``) is read
  by value: an item added to a list the code iterates, or a key its ``.get`` finds. What
  is reached through an attribute or string key that no code the walk passed names (its
  functions' and its modules' classes' names and string constants) is left out: the code
  cannot read it but through ``getattr`` with a computed name, and guarding it would
  retrace on every change of, say, a trainer's step counter or its list of losses. The
  first ``_GUARDED_SLOTS`` slots are guarded; what lies beyond is baked.
* A tensor the walk does not find (one made inside the function, or reached through a path
  it does not follow) is baked as a constant, and its version counter is kept: an in-place
  write to it retraces. So is a live tensor whose value the trace read (``.item()``, split
  sizes given as a tensor): it is *pinned*, and rebinding its path retraces too.

Each call reads the state again through the same paths (``State.read``): the values are the
caller's current tensors, with no copy and no retrace; what the compiled code depends on,
the ``signature`` (each module's identity, its tree's parameter names and their ties, its
attributes, scalars such as ``training`` and ``p`` and tuples such as ``padding`` by value,
other objects by identity, its forward hooks and torch's global ones, the shape, dtype,
device and layout of each tensor read), is compared with the one traced, and a change
retraces. A module tree is walked again only where one of the dicts it was read from holds
something else since the last call (``ModuleState.current``, a comparison in C): a
ResNet's walk costs 160 us, the comparison 14.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import sys
import threading
import types
from typing import Any, Callable, Iterator, Sequence

import attrs
import torch

from ..errors import DistributedError, TraceError
from .strided import passed
from .trace import is_dense

Path = tuple  # steps from a root: (True, attribute name) or (False, item key)
_SCALARS = frozenset({bool, int, float, str, type(None)})
_VALUES = _SCALARS | {torch.dtype, torch.device, torch.layout, torch.memory_format}
_WALK_BUDGET = 20_000  # objects visited per walk; what lies beyond is baked, version-guarded
_GUARDED_SLOTS = 512  # captured slots read back at each call
_ITEMS = 1000  # items followed per container
_LIBRARIES = ("torch", "plait")  # their functions' globals are not user state
_MODULE_DICTS = ("_parameters", "_buffers", "_modules")
_HOOK_NAMES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_BACKWARD_HOOKS = ("_backward_pre_hooks", "_backward_hooks")
_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_hooks")
_GLOBAL_HOOKS = tuple(getattr(torch.nn.modules.module, "_global" + name)
                      for name in _HOOK_NAMES)  # torch's registries: mutated, never rebound
# a module's attributes its structure leaves out: read apart, or torch's bookkeeping of
# hooks (the handles' ids in the dicts of _HOOK_NAMES cover their variants)
_NOT_DESCRIBED = frozenset(_MODULE_DICTS) | {
    k for k in vars(torch.nn.Module()) if k.endswith(("_hooks", "_hooks_with_kwargs",
                                                       "_hooks_always_called"))}
# a module's attributes the walk does not follow: read apart, or hooks its call never runs
_UNWALKED = frozenset(_MODULE_DICTS) | {k for k in _NOT_DESCRIBED if "state_dict" in k}
_SKIPPED = (types.ModuleType, type, types.BuiltinFunctionType, types.CodeType, str, bytes,
            torch.device, torch.dtype)
_UNGUARDED = (torch.Tensor, torch.nn.Module, types.ModuleType)  # guarded apart, or never rebound
_CELL, _LENGTH = object(), object()  # slots' keys: a closure cell's contents, a length
_READERS = {_CELL: operator.attrgetter("cell_contents"), _LENGTH: len}
# Held by jit's traces, during which a module's parameters and buffers are its tracers, and
# by the reads of modules' state for a call (NOTE [threads] in tracer/trace.py).
STATE_LOCK = threading.RLock()


def _reader(key: Any) -> Callable[[Any], Any]:
    """What reads a slot with ``key`` from its place (a dict, list or cell)."""
    return _READERS.get(key) or operator.itemgetter(key)


def follow(root: Any, path: Path) -> Any:
    obj = root
    for is_attr, key in path:
        obj = getattr(obj, key) if is_attr else obj[key]
    return obj


@attrs.frozen
class Reachable:
    """What ``reach`` found: module roots, other tensors, each with its (root, path), and
    the slots the caller may rebind (NOTE [live state])."""

    modules: tuple[tuple[int, Path], ...]
    tensors: dict[int, tuple[int, Path]]  # id(tensor) -> (root, path)
    # (dict or list, key), (closure cell, _CELL) or (dict or list, _LENGTH)
    slots: tuple[tuple[Any, Any], ...] = ()


def _code_names(code: types.CodeType, strings: bool = False) -> Iterator[str]:
    """The names ``code`` and the code nested in it use (its globals and attributes), and
    with ``strings`` its string constants too: the attributes and keys it may read
    (``cfg.eps``, ``cfg["p"]``)."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const, strings)
        elif strings and isinstance(const, str):
            yield const


def _method_strings(module_class: type) -> Iterator[str]:
    """``_code_names`` (with strings) of the functions a module class defines (its
    forward's helpers), torch's own classes left out."""
    for cls in module_class.__mro__:
        if not str(cls.__module__).startswith(_LIBRARIES):
            for f in vars(cls).values():
                if isinstance(f, types.FunctionType):
                    yield from _code_names(f.__code__, strings=True)


def _under(path: Path, name: str) -> Path:
    """The path of submodule ``name`` (dotted) of the module at ``path``."""
    for part in name.split(".") if name else ():
        path += ((True, "_modules"), (False, part))
    return path


def _children(obj: Any) -> list[tuple[Path, Any, tuple | None]]:
    """The objects ``obj`` holds that the walk follows, each with its path from ``obj`` and
    the slot it is read from where the caller may rebind it, else None."""
    if isinstance(obj, types.FunctionType):
        found = [(((True, "__closure__"), (False, i), (True, "cell_contents")),
                  cell.cell_contents, (cell, _CELL))
                 for i, cell in enumerate(obj.__closure__ or ()) if _filled(cell)]
        found += [(((True, "__defaults__"), (False, i)), v, None)
                  for i, v in enumerate(obj.__defaults__ or ())]
        found += [(((True, "__kwdefaults__"), (False, k)), v, None)
                  for k, v in (obj.__kwdefaults__ or {}).items()]
        names = obj.__globals__
        if not str(names.get("__name__")).startswith(_LIBRARIES):
            found += [(((True, "__globals__"), (False, n)), names[n], (names, n))
                      for n in dict.fromkeys(_code_names(obj.__code__)) if n in names]
        return found
    if isinstance(obj, types.MethodType):
        return [(((True, "__self__"),), obj.__self__, None),
                (((True, "__func__"),), obj.__func__, None)]
    if isinstance(obj, functools.partial):
        return [(((True, "func"),), obj.func, None), (((True, "args"),), obj.args, None),
                (((True, "keywords"),), obj.keywords, None)]
    if isinstance(obj, tuple):
        return [(((False, i),), v, None) for i, v in enumerate(obj[:_ITEMS])]
    if isinstance(obj, list):
        return [(((False, i),), v, (obj, i)) for i, v in enumerate(obj[:_ITEMS])]
    if isinstance(obj, dict):
        return [(((False, k),), v, (obj, k)) for k, v in list(obj.items())[:_ITEMS]
                if type(k) in _SCALARS]
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict):  # a plain object, or a callable one (a jitted function)
        return [(((True, "__dict__"), (False, k)), v, (attributes, k))
                for k, v in attributes.items()]
    return []


def reach(roots: Sequence[Any]) -> Reachable:
    """Walk the objects ``roots`` hold (closures, the globals a function's code names,
    defaults, bound objects, partials, containers, objects' attributes, modules) for tensors,
    modules and rebindable slots. The modules inside a module found are read with it, and
    their attributes are its structure's (``module_state``), not slots."""
    modules: dict[int, tuple[int, Path, torch.nn.Module]] = {}
    tensors: dict[int, tuple[int, Path]] = {}
    seen: set[int] = set()
    # (root, path, object, its slot, the names and string keys of the slots it was reached
    # through)
    stack = [(r, (), root, None, ()) for r, root in enumerate(roots)][::-1]
    # one each, by (id(place), key): (place, key, the names it was reached through)
    slots: dict[tuple[int, Any], tuple[Any, Any, tuple]] = {}
    read: set[str] = set()  # the names and strings of the code walked (``_code_names``)
    classes: set[type] = set()
    while stack and len(seen) < _WALK_BUDGET:
        r, path, obj, slot, names = stack.pop()
        if slot is not None and not isinstance(obj, _UNGUARDED):
            slots.setdefault((id(slot[0]), slot[1]), (*slot, names))
        if id(obj) in seen or isinstance(obj, _SKIPPED) or type(obj) in _SCALARS:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            refuse_dtensor(obj, "a tensor the function captures")
            tensors.setdefault(id(obj), (r, path))
            continue
        if slot is not None and _of_values(obj):
            slots.setdefault((id(obj), _LENGTH), (obj, _LENGTH, names))
        if not isinstance(obj, torch.nn.Module):
            children = _children(obj)
            if isinstance(obj, types.FunctionType):
                read.update(_code_names(obj.__code__, strings=True))
        else:  # its tree's plain attributes and forward functions
            modules[id(obj)] = (r, path, obj)
            children = []
            for name, m in obj.named_modules():
                if type(m) not in classes:
                    classes.add(type(m))
                    read.update(_method_strings(type(m)))
                seen.add(id(m))
                refuse_distributed(name, m)
                sub = _under((), name)
                around = _hooks_outside(m)  # its hooks run outside the trace
                children += [(sub + ((True, "__dict__"), (False, k)), v, None)
                             for k, v in vars(m).items()
                             if k not in _UNWALKED and not (around and k in _NOT_DESCRIBED)]
                forward = getattr(type(m), "forward", None)
                if isinstance(forward, types.FunctionType):
                    children.append((sub + ((True, "__class__"), (True, "forward")), forward,
                                     None))
        for step, child, child_slot in reversed(children):
            key = child_slot[1] if child_slot is not None else None
            stack.append((r, path + step, child, child_slot,
                          names + (key,) if isinstance(key, str) else names))
    inner = {id(m) for _, _, root in modules.values() for m in root.modules() if m is not root}
    # what is reached through an attribute or string key that no code walked names is not
    # read by it: left unguarded (a trainer's step counter, or the losses it appends to,
    # beside the model a function calls retrace nothing)
    guarded = [(place, key) for place, key, names in slots.values()
               if read.issuperset(names)][:_GUARDED_SLOTS]
    return Reachable(tuple((r, p) for key, (r, p, _) in modules.items() if key not in inner),
                     tensors, tuple(guarded))


def slot_guards(slots: Sequence[tuple[Any, Any]]) -> tuple[Slots, Slots]:
    """The slots as a ``State`` reads them, from what they hold now (after the trace, which
    may have written some): (those read by value, those read by identity). A slot emptied
    or now holding a tensor or module is left to those guards."""
    by_value, by_identity = [], []
    for place, key in slots:
        try:
            value = _reader(key)(place)
        except (KeyError, IndexError, ValueError):
            continue
        if type(value) in _VALUES:
            by_value.append((place, key))
        elif not isinstance(value, _UNGUARDED):
            by_identity.append((place, key))
    return Slots(by_value), Slots(by_identity, by_identity=True)


class Slots:
    """Slots read at every call, grouped by their dict, list or cell so that ``read`` is
    two sweeps in C; ``by_identity``, the objects they hold now, which ``same`` compares."""

    __slots__ = ("_places", "_getters", "_groups", "_group_getters", "objects")

    def __init__(self, slots: Sequence[tuple[Any, Any]], by_identity: bool = False):
        keys: dict[int, tuple[Any, list]] = {}
        alone = []  # (place, its slot's reader)
        for place, key in slots:
            if key in _READERS:
                alone.append((place, _READERS[key]))
            else:
                keys.setdefault(id(place), (place, []))[1].append(key)
        alone += [(place, _reader(k[0])) for place, k in keys.values() if len(k) == 1]
        together = [(place, k) for place, k in keys.values() if len(k) > 1]
        self._places = [place for place, _ in alone]
        self._getters = [getter for _, getter in alone]
        self._groups = [place for place, _ in together]
        self._group_getters = [operator.itemgetter(*k) for _, k in together]
        self.objects = tuple(self.read()) if by_identity else ()

    def read(self) -> list:
        """What the slots hold (raises KeyError, IndexError or ValueError for an emptied
        one)."""
        return [*map(operator.call, self._getters, self._places),
                *itertools.chain.from_iterable(
                    map(operator.call, self._group_getters, self._groups))]

    def same(self) -> bool:
        return all(map(operator.is_, self.read(), self.objects))


def _of_values(obj) -> bool:
    """Is ``obj`` a list of numbers, strings and their tuples, or a dict of them by such
    keys (settings the code may iterate or look up with a default), whose length is then
    guarded? A registry (``sys.modules``, flags by logger) grows as libraries load: not
    guarded."""
    if not isinstance(obj, (list, dict)) or len(obj) > _ITEMS:
        return False
    if isinstance(obj, dict) and not all(type(k) in _SCALARS for k in obj):
        return False
    items = obj.values() if isinstance(obj, dict) else obj
    return all(type(v) in _VALUES or isinstance(v, tuple) and all(
        type(u) in _VALUES for u in v) for v in items)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell not assigned yet
        return False
    return True


# NOTE [distributed wrappers]
# torch.distributed's wrappers act around each call of the module they manage: DDP's forward
# readies its reducer, whose autograd hooks then all-reduce the gradients; FSDP's hooks
# gather the parameters before the call and free them after; tensor parallelism's hooks
# redistribute inputs and outputs, and its parameters are DTensors, global views of shards.
# Traced, that bookkeeping would run once, while tracing, and no compiled call would repeat
# it: the ranks would silently train apart, or the trace would meet DTensor internals. So
# ``reach`` refuses a module tree holding one, and a function refuses DTensor arguments,
# each error naming the order that works: ``plait.jit(ddp)`` (``api.py`` compiles the module
# DDP wraps and runs DDP's bookkeeping around each compiled call),
# ``DistributedDataParallel(plait.jit(model))``, ``FullyShardedDataParallel(plait.jit(
# model))``, ``fully_shard(plait.jit(block))`` (the hooks FSDP registers on the jitted block
# stay on the wrapper, which runs them around each compiled call, and FSDP finds each
# parameter on the module that holds it: ``JittedModule`` in api.py), ``plait.jit`` of a
# module ``fully_shard`` manages, none of whose submodules it manages (its forward alone is
# traced, and every forward hook of the module itself, FSDP's and the user's, runs around
# each compiled call: ``hooks_outside``), and under ``fully_shard`` a block whose forward
# calls a jitted inner computation: the block's hooks run around that call. Either way the
# compiled call sees the gathered parameters as plain tensors, and its gradients reach them,
# whence FSDP reduce-scatters them. Whether a tensor's class dispatches its ops itself (a
# DTensor, unlike a Parameter) is part of its key, so a DTensor where a plain tensor was
# traced retraces, and is refused.
_SHARD_LOCALLY = ("plait traces plain tensors: compute on each rank's shards "
                  "(dtensor.to_local()) and combine them with plait.distributed's "
                  "collectives inside the jitted function, or keep this part outside plait.jit")


def _distributed() -> tuple:
    """(DTensor, torch's lookup of the composable API managing a module), each None until
    torch imports it (until then none can exist; tracing imports neither)."""
    tensor = sys.modules.get("torch.distributed.tensor")
    composable = sys.modules.get("torch.distributed._composable_state")
    return getattr(tensor, "DTensor", None), getattr(composable, "_get_module_state", None)


def hook_module(hook) -> str:
    """The Python module that defines ``hook`` (a function, bound method or partial)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    return getattr(hook, "__module__", None) or ""


def refuse_dtensor(x: torch.Tensor, what: str) -> None:
    dtensor = _distributed()[0]
    if dtensor is not None and isinstance(x, dtensor):
        raise DistributedError(f"{what} is a DTensor ({x.placements} on {x.device_mesh}); "
                               f"{_SHARD_LOCALLY}.")


def fully_sharded(module: torch.nn.Module) -> bool:
    """Does ``fully_shard`` manage ``module`` (it swaps in a subclass of FSDPModule)?"""
    return any(c.__name__ == "FSDPModule" and c.__module__.startswith("torch.distributed.fsdp")
               for c in type(module).__mro__)


class _HooksOutside(threading.local):
    def __init__(self):
        self.modules: tuple = ()


_OUTSIDE = _HooksOutside()


@contextlib.contextmanager
def hooks_outside(module: torch.nn.Module):
    """While this thread's JittedModule of a fully-sharded ``module`` calls its compiled
    forward, around which it runs the module's forward hooks (NOTE [distributed wrappers]):
    the state walk neither refuses the module nor follows or keys those hooks."""
    before = _OUTSIDE.modules
    _OUTSIDE.modules = (*before, module)
    try:
        yield
    finally:
        _OUTSIDE.modules = before


def _hooks_outside(module: torch.nn.Module) -> bool:
    modules = _OUTSIDE.modules  # none, but within a fully-sharded model's call
    return bool(modules) and any(m is module for m in modules)


def refuse_distributed(name: str, module: torch.nn.Module) -> None:
    """Refuse a module that torch.distributed manages, in a traced function's state (NOTE
    [distributed wrappers])."""
    if _hooks_outside(module):
        return
    where = f"the {type(module).__name__} module" + (f" {name!r}" if name else "")
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        raise DistributedError(
            f"{where} is a DistributedDataParallel called inside a traced function: its "
            "gradient synchronization is readied around each call, and traced it would be "
            "readied only while tracing. Compile the DDP module itself, plait.jit(ddp_model), "
            "or wrap the compiled model: DistributedDataParallel(plait.jit(model)).")
    dtensor, managing = _distributed()
    hooks = [h for h in map(hook_module, itertools.chain(
        vars(module)["_forward_pre_hooks"].values(), vars(module)["_forward_hooks"].values()))
             if h.startswith("torch.distributed")]
    state = managing(module) if managing is not None else None
    if state is not None or any(".fsdp." in h for h in hooks):
        raise DistributedError(
            f"{where} is managed by FSDP ({type(state).__name__ if state else hooks[0]}), "
            "whose hooks gather and free its parameters around each call of it; traced, "
            "they would act only while tracing. Put plait.jit inside the wrapper: "
            "fully_shard(plait.jit(block)) for each block (and fully_shard(model) around "
            "them), or FullyShardedDataParallel(plait.jit(model)).")
    for kind in ("_parameters", "_buffers") if dtensor is not None else ():
        for key, t in vars(module)[kind].items():
            if isinstance(t, dtensor):
                refuse_dtensor(t, f"{kind[1:-1]} {key!r} of {where}")
    if hooks:
        raise DistributedError(
            f"{where} has a forward hook of torch.distributed ({hooks[0]}); traced, it "
            "would act only while tracing. Call plait.jit on the computation inside the "
            "hooked module, or keep the module outside plait.jit.")


def tensor_key(x: torch.Tensor) -> tuple:
    """What compiling code for a tensor depends on (NOTE [distributed wrappers] for the
    last)."""
    return (x.shape, x.dtype, x.device, x.layout, is_dense(x) or (
        layout_key(x), x.requires_grad and x.grad_fn is None),  # NOTE [strided arguments]
        type(x).__torch_dispatch__ is _PLAIN_DISPATCH)


def layout_key(x: torch.Tensor) -> tuple | None:
    """What a trace knows of a tensor's memory layout that is not dense (NOTE [eager
    layouts] in tracer/aten.py): its strides, and its storage offset where that is 0 (any
    other offset is left out, unknown to the trace: the slices of a batch, ``x[:, t]`` for
    each ``t``, share a compilation)."""
    if x.layout != torch.strided:
        return None
    return x.stride(), 0 if x.storage_offset() == 0 else None


_META = operator.attrgetter("shape", "dtype", "device", "layout")
_DISPATCH, _PLAIN_DISPATCH = operator.attrgetter("__torch_dispatch__"), \
    torch.Tensor.__torch_dispatch__


def tensor_keys(tensors: list[torch.Tensor], contiguous: tuple[bool, ...]) -> tuple:
    """What compiling code for each of ``tensors`` depends on (``tensor_key``'s facts, with
    density as contiguity, given, and a zero offset; the strides of those not contiguous:
    NOTE [strided arguments]), in sweeps of torch's own methods over the list: the state's
    tensors are keyed at every call. Raises RuntimeError for a sparse one."""
    return (tuple(zip(map(_META, tensors), contiguous,
                      map(operator.not_, map(torch.Tensor.storage_offset, tensors)),
                      map(operator.is_, map(_DISPATCH, map(type, tensors)),
                          itertools.repeat(_PLAIN_DISPATCH)))),
            tuple(map(torch.Tensor.stride, itertools.compress(
                tensors, map(operator.not_, contiguous)))))


# NOTE [native tensor checks]
# A module's state is keyed at every call (``tensor_keys``: hundreds of parameters, a
# microsecond each in Python, more than a CUDA graph's replay takes to launch). The last
# keys are kept with torch's own C++ check of tensors (dynamo's ``TensorGuards``: dispatch
# keys, dtype, device, requires_grad, sizes and strides), which tells in a tenth of the time
# that another list of tensors has those keys too: what ``tensor_key`` depends on is all
# in it but the storage offset's being 0, compared besides. It checks more than the keys
# hold (requires_grad of every tensor, the thread's dispatch state), so a failed check
# only keys the tensors again. A torch without it keys every call.
try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - torch without dynamo's guards
    _TensorGuards = None


@attrs.frozen
class KeyedTensors:
    """``tensor_keys`` of a list of tensors, their contiguity, and the native check that
    another list has the same keys (NOTE [native tensor checks])."""

    keys: tuple
    contiguous: tuple[bool, ...]
    at_zero: tuple[bool, ...]  # storage offset 0
    check: Callable | None

    @staticmethod
    def of(tensors: list[torch.Tensor]) -> "KeyedTensors":
        contiguous = tuple(map(torch.Tensor.is_contiguous, tensors))
        keys = tensor_keys(tensors, contiguous)
        return KeyedTensors(keys, contiguous, _at_zero(tensors), _native_check(tensors))

    def holds(self, tensors: list[torch.Tensor]) -> bool:
        return self.check is not None and len(tensors) == len(self.contiguous) and \
            self.check(*tensors) and _at_zero(tensors) == self.at_zero


def _native_check(tensors: list[torch.Tensor]) -> Callable | None:
    """torch's C++ check that tensors have ``tensors``' metadata, or None where this torch
    has none (NOTE [native tensor checks]); one that refuses to build is not tried again."""
    global _TensorGuards
    if _TensorGuards is None:
        return None
    try:  # every size and stride as it is (a None there would leave it unchecked)
        return _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                             dynamic_dims_strides=[list(t.stride()) for t in tensors]).check
    except Exception:  # noqa: BLE001 - another torch's signature: key every call
        _TensorGuards = None
        return None


def _at_zero(tensors: list[torch.Tensor]) -> tuple[bool, ...]:
    return tuple(map(operator.not_, map(torch.Tensor.storage_offset, tensors)))


class _Same:
    """A module attribute plait cannot compare by value (a function, a config object, a
    list), held in a structure by identity: another object there retraces. Holding it keeps
    its id from being reused while the structure is a cache key."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _described(value):
    """A module attribute as its module's structure holds it: a scalar by value and type
    (``1``, ``1.0`` and ``True`` trace differently), a tuple item by item (a convolution's
    padding), a tensor not at all (read through its path: NOTE [live state]), anything else
    by identity."""
    if type(value) in _VALUES:
        return type(value), value
    if isinstance(value, tuple):
        return tuple(map(_described, value))
    return None if isinstance(value, torch.Tensor) else _Same(value)


def _hooks(name: str, hooks: dict) -> tuple:
    """A module's hooks of one kind (``_forward_hooks``...) as its structure holds them: the
    handles' ids, unique per registration. A forward hook is traced with the module's call;
    a backward hook would not run (the traced call records no autograd nodes): refused."""
    if hooks and name in _BACKWARD_HOOKS:
        raise TraceError(
            f"a module backward hook ({name}, from register_full_backward_hook or "
            "register_backward_hook) does not run inside plait.jit. Remove it, or hook the "
            "tensors instead (tensor.register_hook on the module's output or parameters).")
    return tuple(hooks)


@attrs.frozen(eq=False)
class ModuleState:
    """A module tree as read at one call (``module_state``): its ``structure`` and distinct
    ``tensors``, and the dicts they were read from with copies of what those held then: each
    module's attributes, submodules and hooks and torch's global module hooks (``dicts``,
    ``copies``), and its parameters and buffers (``tensor_dicts``, their keys and tensors)."""

    structure: tuple
    tensors: list[torch.Tensor]
    dicts: list[dict]
    tensor_dicts: list[dict]
    modules: list[torch.nn.Module]
    classes: list[type] = attrs.field(init=False)  # a class swapped in place retraces too
    copies: list[dict] = attrs.field(init=False)
    names: list = attrs.field(init=False)
    held: list = attrs.field(init=False)

    def __attrs_post_init__(self):
        object.__setattr__(self, "classes", list(map(type, self.modules)))
        object.__setattr__(self, "copies", list(map(dict, self.dicts)))
        object.__setattr__(self, "names", list(itertools.chain.from_iterable(self.tensor_dicts)))
        object.__setattr__(self, "held", list(itertools.chain.from_iterable(
            map(dict.values, self.tensor_dicts))))

    def current(self) -> bool:
        """Do its dicts hold what they held? Then its structure and tensors are the tree's.
        Read at every call, so compared in C: the attributes by equality (an equal value
        traces alike; the copies hold the objects, so a replaced one's id is not reused),
        the tensors by identity (an equal tensor is not the same parameter). An attribute
        replaced by one that cannot be compared (an array, whose ``==`` is elementwise) makes
        the tree read again."""
        try:
            return (self.dicts == self.copies and list(map(type, self.modules)) == self.classes
                    and list(itertools.chain.from_iterable(self.tensor_dicts)) == self.names
                    and all(map(operator.is_, itertools.chain.from_iterable(
                        map(dict.values, self.tensor_dicts)), self.held)))
        except Exception:  # noqa: BLE001 - a user object's __eq__ may raise anything
            return False


def module_state(module: torch.nn.Module) -> ModuleState:
    """A module tree's structure (each module's identity, class, attributes
    (``_described``) and hooks, each parameter and buffer's name and, for tied ones, which
    tensor it shares, and torch's global module hooks) and its distinct tensors, in
    ``named_modules(remove_duplicate=False)``'s order: walked here, as torch's generators
    cost a fifth more."""
    structure: list = [tuple(map(_hooks, _HOOK_NAMES, _GLOBAL_HOOKS))]
    tensors: list[torch.Tensor] = []
    dicts: list[dict] = list(_GLOBAL_HOOKS)
    tensor_dicts: list[dict] = []
    modules: list[torch.nn.Module] = []
    index: dict[int, int] = {}
    stack = [("", module)]
    while stack:
        name, m = stack.pop()
        attrs_ = vars(m)
        hooks = [attrs_[k] for k in _HOOK_NAMES]
        dicts += [attrs_, attrs_["_modules"], *hooks]
        tensor_dicts += [attrs_["_parameters"], attrs_["_buffers"]]
        modules.append(m)
        outside = _hooks_outside(m)  # its forward hooks run outside the trace
        keyed = [{} if outside and k in _FORWARD_HOOKS else h for k, h in zip(_HOOK_NAMES, hooks)]
        structure.append((name, _Same(m), _Same(type(m)), tuple(
            [(k, _described(v)) for k, v in attrs_.items() if k not in _NOT_DESCRIBED]),
            tuple(map(_hooks, _HOOK_NAMES, keyed))))
        for kind in ("_parameters", "_buffers"):
            for key, t in attrs_[kind].items():
                if t is None:
                    continue
                i = index.setdefault(id(t), len(tensors))
                if i == len(tensors):
                    tensors.append(t)
                structure.append((name, key, i))
        if children := attrs_["_modules"]:
            prefix = name + "." if name else ""
            stack += reversed([(prefix + k, c) for k, c in children.items() if c is not None])
    return ModuleState(tuple(structure), tensors, dicts, tensor_dicts, modules)


def bindings(structure: tuple) -> dict[str, int]:
    """Dotted parameter and buffer name -> position among ``module_state``'s tensors, a
    module held twice in the tree (``self.b = self.a``) under its first name alone:
    reparametrized twice, its second swap would keep the first one's tracers, and put them
    back for good."""
    names, modules, first = {}, set(), False
    for entry in structure:
        if len(entry) == 5:  # a module; its parameters and buffers follow it
            first = entry[1] not in modules
            modules.add(entry[1])
        elif first and len(entry) == 3:
            names[f"{entry[0]}.{entry[1]}" if entry[0] else entry[1]] = entry[2]
    return names


@attrs.frozen
class State:
    """How to read, at each call, the state one compilation depends on (NOTE [live state]):
    the module roots' and the lifted tensors' paths, and the baked tensors' versions."""

    roots: tuple  # the objects the paths start from (the function, module arguments)
    modules: tuple[tuple[int, Path], ...] = ()
    tensors: tuple[tuple[int, Path], ...] = ()  # lifted, in input order
    baked: tuple[tuple[torch.Tensor, int], ...] = ()
    pinned: tuple[tuple[int, Path, torch.Tensor], ...] = ()  # live tensors whose value was read
    values: Slots = Slots(())  # the slots read by value (``slot_guards``)
    held: Slots = Slots(())  # and by identity
    _last: _LastRead = attrs.field(factory=lambda: _LastRead(), init=False, eq=False,
                                   repr=False)

    def read(self) -> tuple[tuple, list[torch.Tensor]] | None:
        """(signature, tensors: the modules', those not contiguous as the views their
        program reads (NOTE [strided arguments]), then the lifted ones), or None where a path no
        longer leads to a module or tensor, a tensor is sparse, or a baked tensor was written.
        A module tree whose dicts hold what they held at the last read is not walked again,
        and a signature equal to the last is that object (``Jitted`` then needs no hash)."""
        if not self.modules:
            return self._read()
        with STATE_LOCK:
            return self._read()

    def _read(self):
        structures: list = []
        tensors: list[torch.Tensor] = []
        trees = self._last.trees
        try:
            for i, (r, path) in enumerate(self.modules):
                module = follow(self.roots[r], path)
                if not isinstance(module, torch.nn.Module):
                    return None
                tree = trees.get(i)
                if tree is None or tree.modules[0] is not module or not tree.current():
                    tree = trees[i] = module_state(module)
                structures.append(tree.structure)
                tensors += tree.tensors
            held = len(tensors)  # the modules' (NOTE [strided arguments]: passed as views)
            for r, path in self.tensors:
                t = follow(self.roots[r], path)
                if not isinstance(t, torch.Tensor):
                    return None
                tensors.append(t)
            if any(follow(self.roots[r], path) is not t for r, path, t in self.pinned):
                return None
            if not self.held.same():
                return None
            values = self.values.read()  # 1, 1.0 and True trace differently: typed
            keyed = self._last.keyed  # once: another thread may set it meanwhile
            if keyed is None or not keyed.holds(tensors):
                keyed = self._last.keyed = KeyedTensors.of(tensors)
            contiguous = keyed.contiguous
            signature = (tuple(structures), keyed.keys, tuple(values),
                         tuple(map(type, values)))
        except (AttributeError, KeyError, IndexError, TypeError, ValueError, RuntimeError):
            return None
        if any(t._version != version for t, version in self.baked):
            return None
        last = self._last.signature  # once: another thread may set it meanwhile
        if signature == last:
            signature = last
        self._last.signature = signature
        if not all(contiguous[:held]):
            tensors = list(tensors)
            for i in itertools.compress(range(held), map(operator.not_, contiguous)):
                tensors[i] = passed(tensors[i])
        return signature, tensors


class _LastRead:
    """``State.read``'s memo: each module root's state as last read, the keys of the tensors
    read and the signature."""

    __slots__ = ("trees", "keyed", "signature")

    def __init__(self):
        self.trees: dict[int, ModuleState] = {}
        self.keyed: KeyedTensors | None = None
        self.signature: tuple | None = None
