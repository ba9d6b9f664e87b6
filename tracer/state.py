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
* A tensor the walk does not find (one made inside the function, or reached through a path
  it does not follow) is baked as a constant, and its version counter is kept: an in-place
  write to it retraces. So is a live tensor whose value the trace read (``.item()``, split
  sizes given as a tensor): it is *pinned*, and rebinding its path retraces too.

Each call reads the state again through the same paths (``State.read``): the values are the
caller's current tensors, with no copy and no retrace; what the compiled code depends on,
the ``signature`` (each module's identity, its tree's parameter names and their ties, its
scalar attributes such as ``training`` and ``p``, the shape, dtype, device and layout of each
tensor read), is compared with the one traced, and a change retraces.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Iterator, Sequence

import attrs
import torch

from .trace import is_dense

Path = tuple  # steps from a root: (True, attribute name) or (False, item key)
_SCALARS = frozenset({bool, int, float, str, type(None)})  # (read per module at every call)
_WALK_BUDGET = 20_000  # objects visited per walk; what lies beyond is baked, version-guarded
_ITEMS = 1000  # items followed per container
_LIBRARIES = ("torch", "plait")  # their functions' globals are not user state
_MODULE_DICTS = ("_parameters", "_buffers", "_modules")
_SKIPPED = (types.ModuleType, type, types.BuiltinFunctionType, types.CodeType, str, bytes,
            torch.device, torch.dtype)


def follow(root: Any, path: Path) -> Any:
    obj = root
    for is_attr, key in path:
        obj = getattr(obj, key) if is_attr else obj[key]
    return obj


@attrs.frozen
class Reachable:
    """What ``reach`` found: module roots and other tensors, each with its (root, path)."""

    modules: tuple[tuple[int, Path], ...]
    tensors: dict[int, tuple[int, Path]]  # id(tensor) -> (root, path)


def _global_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _under(path: Path, name: str) -> Path:
    """The path of submodule ``name`` (dotted) of the module at ``path``."""
    for part in name.split(".") if name else ():
        path += ((True, "_modules"), (False, part))
    return path


def _children(obj: Any) -> list[tuple[Path, Any]]:
    """The objects ``obj`` holds that the walk follows, each with its path from ``obj``."""
    if isinstance(obj, types.FunctionType):
        found = [(((True, "__closure__"), (False, i), (True, "cell_contents")), cell.cell_contents)
                 for i, cell in enumerate(obj.__closure__ or ()) if _filled(cell)]
        found += [(((True, "__defaults__"), (False, i)), v)
                  for i, v in enumerate(obj.__defaults__ or ())]
        found += [(((True, "__kwdefaults__"), (False, k)), v)
                  for k, v in (obj.__kwdefaults__ or {}).items()]
        if not str(obj.__globals__.get("__name__")).startswith(_LIBRARIES):
            found += [(((True, "__globals__"), (False, n)), obj.__globals__[n])
                      for n in dict.fromkeys(_global_names(obj.__code__))
                      if n in obj.__globals__]
        return found
    if isinstance(obj, types.MethodType):
        return [(((True, "__self__"),), obj.__self__), (((True, "__func__"),), obj.__func__)]
    if isinstance(obj, functools.partial):
        return [(((True, "func"),), obj.func), (((True, "args"),), obj.args),
                (((True, "keywords"),), obj.keywords)]
    if isinstance(obj, (list, tuple)):
        return [(((False, i),), v) for i, v in enumerate(obj[:_ITEMS])]
    if isinstance(obj, dict):
        return [(((False, k),), v) for k, v in list(obj.items())[:_ITEMS] if type(k) in _SCALARS]
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict):  # a plain object, or a callable one (a jitted function)
        return [(((True, "__dict__"), (False, k)), v) for k, v in attributes.items()]
    return []


def reach(roots: Sequence[Any]) -> Reachable:
    """Walk the objects ``roots`` hold (closures, the globals a function's code names,
    defaults, bound objects, partials, containers, objects' attributes, modules) for tensors
    and modules. The modules inside a module found are read with it."""
    modules: dict[int, tuple[int, Path, torch.nn.Module]] = {}
    tensors: dict[int, tuple[int, Path]] = {}
    seen: set[int] = set()
    stack = [(r, (), root) for r, root in enumerate(roots)][::-1]
    while stack and len(seen) < _WALK_BUDGET:
        r, path, obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SKIPPED) or type(obj) in _SCALARS:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensors.setdefault(id(obj), (r, path))
            continue
        if not isinstance(obj, torch.nn.Module):
            children = _children(obj)
        else:  # its tree's plain attributes and forward functions
            modules[id(obj)] = (r, path, obj)
            children = []
            for name, m in obj.named_modules():
                seen.add(id(m))
                sub = _under((), name)
                children += [(sub + ((True, "__dict__"), (False, k)), v)
                             for k, v in vars(m).items() if k not in _MODULE_DICTS]
                forward = getattr(type(m), "forward", None)
                if isinstance(forward, types.FunctionType):
                    children.append((sub + ((True, "__class__"), (True, "forward")), forward))
        for step, child in reversed(children):
            stack.append((r, path + step, child))
    inner = {id(m) for _, _, root in modules.values() for m in root.modules() if m is not root}
    return Reachable(tuple((r, p) for key, (r, p, _) in modules.items() if key not in inner),
                     tensors)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell not assigned yet
        return False
    return True


def tensor_key(x: torch.Tensor) -> tuple:
    """What compiling code for a tensor depends on."""
    return x.shape, x.dtype, x.device, x.layout, is_dense(x)


def module_state(module: torch.nn.Module) -> tuple[tuple, list[torch.Tensor]]:
    """A module tree's structure (each module's identity and scalar attributes, each
    parameter and buffer's name and, for tied ones, which tensor it shares) and its distinct
    tensors, in ``named_modules(remove_duplicate=False)``'s order: walked here, as it runs at
    every call and torch's generators cost a fifth more."""
    structure: list = []
    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}
    stack = [("", module)]
    while stack:
        name, m = stack.pop()
        attrs_ = vars(m)
        structure.append((name, id(m), tuple([(k, v) for k, v in attrs_.items()
                                              if type(v) in _SCALARS])))
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
    return tuple(structure), tensors


def bindings(structure: tuple) -> dict[str, int]:
    """Dotted parameter and buffer name -> position among ``module_state``'s tensors."""
    return {f"{entry[0]}.{entry[1]}" if entry[0] else entry[1]: entry[2]
            for entry in structure if len(entry) == 3 and isinstance(entry[2], int)
            and isinstance(entry[1], str)}


@attrs.frozen
class State:
    """How to read, at each call, the state one compilation depends on (NOTE [live state]):
    the module roots' and the lifted tensors' paths, and the baked tensors' versions."""

    roots: tuple  # the objects the paths start from (the function, module arguments)
    modules: tuple[tuple[int, Path], ...] = ()
    tensors: tuple[tuple[int, Path], ...] = ()  # lifted, in input order
    baked: tuple[tuple[torch.Tensor, int], ...] = ()
    pinned: tuple[tuple[int, Path, torch.Tensor], ...] = ()  # live tensors whose value was read

    def read(self) -> tuple[tuple, list[torch.Tensor]] | None:
        """(signature, tensors: the modules' then the lifted ones), or None where a path no
        longer leads to a module or tensor, or a baked tensor was written."""
        structures: list = []
        tensors: list[torch.Tensor] = []
        try:
            for r, path in self.modules:
                module = follow(self.roots[r], path)
                if not isinstance(module, torch.nn.Module):
                    return None
                structure, found = module_state(module)
                structures.append(structure)
                tensors += found
            for r, path in self.tensors:
                t = follow(self.roots[r], path)
                if not isinstance(t, torch.Tensor):
                    return None
                tensors.append(t)
            if any(follow(self.roots[r], path) is not t for r, path, t in self.pinned):
                return None
        except (AttributeError, KeyError, IndexError, TypeError, ValueError):
            return None
        if any(t._version != version for t, version in self.baked):
            return None
        return (tuple(structures), tuple(map(tensor_key, tensors))), tensors
