"""The tiny value types every stage shares: tensor types, values, node payloads."""
from __future__ import annotations

import functools
import hashlib
import math
from typing import Any, Callable

import attrs
import sympy
import torch
from sympy.printing.pycode import PythonCodePrinter

_DTYPE_NAMES = {
    torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPE_NAMES[getattr(torch, _name)] = _name.replace("float", "f").replace("uint", "u")


# the kinds of a graph's edges: a value flows, or a node must run after another
DATA, CONTROL = "data", "control"


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def normalize_device(device) -> str:
    """'cuda' and 'cuda:0' name one device; types must compare equal for both."""
    d = torch.device(device)
    if d.index is None and d.type == "cuda" and torch.cuda.is_available():
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def contiguous_strides(shape) -> tuple[int, ...]:
    """Row-major element strides of ``shape`` (the layout of every graph value)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


# NOTE [symbolic sizes]
# A dimension is an int, or a sympy expression over size symbols (``s0, s1, ..``: integers
# >= 2, made by torch's ShapeEnv while a jit traces a call whose dimension varies: NOTE
# [dynamic dimensions] in tracer/sizes.py). A symbolic dimension compares by its expression,
# and arithmetic on it stays symbolic; a question it cannot answer (``int()``, ``<`` with an
# undecided result, ``range``) raises TypeError, so a stage that needs a number fails loudly
# rather than deciding for one size. ``==`` is structural: unequal expressions may be equal
# at some size, so a stage takes its general path on False (a tracer's SymInt sizes, and
# ``tracer.sizes.holds``/``is_one``, decide such questions with a guard instead).
# Heuristics read ``size_hint`` (the size it was traced at), never correctness.
def dimension(d) -> "int | sympy.Expr":
    """An int, or the sympy expression of a symbolic size (a SymInt's or an expression)."""
    if isinstance(d, int):
        return int(d)
    if isinstance(d, torch.SymInt):
        n = d.node.maybe_as_int()
        return n if n is not None else dimension(d.node.expr)
    if isinstance(d, sympy.Basic):
        return int(d) if d.is_Integer else standard(d)
    return int(d)


# torch's own sympy functions of sizes (ShapeEnv's) -> sympy's: what the code generators and
# ``concrete`` print. Any other (a bitwise op of sizes) stays, and fails to print: the dynamic
# compilation falls back (NOTE [automatic dynamic]).
_STANDARD = {
    "FloorDiv": lambda a, b: sympy.floor(a / b), "CleanDiv": lambda a, b: sympy.floor(a / b),
    "CeilDiv": lambda a, b: sympy.ceiling(a / b), "IntTrueDiv": lambda a, b: a / b,
    "PythonMod": sympy.Mod, "Mod": sympy.Mod, "FloorToInt": sympy.floor,
    "CeilToInt": sympy.ceiling, "PowByNatural": sympy.Pow, "Max": sympy.Max, "Min": sympy.Min,
    "ModularIndexing": lambda a, b, n: sympy.Mod(sympy.floor(a / b), n),
}


def standard(expr):
    """``expr`` in sympy's own functions (NOTE [symbolic sizes])."""
    return expr.replace(lambda e: isinstance(e, sympy.Function) and type(e).__module__.startswith(
        "torch") and type(e).__name__ in _STANDARD, lambda e: _STANDARD[type(e).__name__](*e.args))


def is_static(shape) -> bool:
    return all(isinstance(d, int) for d in shape)


# size symbol -> its size at the latest trace that made it (symbols of one name are one
# object: a hint is only ever a heuristic's guess)
_HINTS: dict = {}


def set_size_hint(symbol: sympy.Symbol, size: int) -> None:
    _HINTS[symbol] = size


def size_hint(d) -> int:
    """A dimension's size at the trace that made it: for heuristics only (NOTE [symbolic
    sizes])."""
    if isinstance(d, int):
        return d
    return int(sympy.sympify(d).xreplace({s: _HINTS[s] for s in d.free_symbols}))


def hints(value) -> dict:
    """Each size symbol in ``value`` (a param, a shape) -> its hint: ``concrete(value,
    hints(value))`` is ``value`` at the traced sizes."""
    if isinstance(value, sympy.Basic):
        return {s: _HINTS[s] for s in value.free_symbols}
    if isinstance(value, (tuple, list)):
        return {s: n for v in value for s, n in hints(v).items()}
    return {}


def equal_sizes(a, b) -> bool:
    """Are two sizes (ints or expressions) equal at every size? Structurally, or once
    expanded: ``(2*s - 1)*8*s`` is ``16*s**2 - 8*s``."""
    return a == b or (isinstance(a, sympy.Expr) or isinstance(b, sympy.Expr)) \
        and sympy.expand(a - b) == 0


def hinted(index):
    """An index expression with its size symbols at their hints and its loop variables left
    (NOTE [symbolic sizes]): for heuristics that sample or compare strides."""
    if not isinstance(index, sympy.Basic):
        return index
    return index.xreplace({s: _HINTS[s] for s in index.free_symbols if s in _HINTS})


def numel_hint(shape) -> int:
    return math.prod(map(size_hint, shape))


def size_bindings(input_types) -> tuple:
    """(input, dim, symbol) for each size symbol that is a dimension of an input (a dynamic
    program's arguments: NOTE [dynamic dimensions]), where a call reads its value."""
    seen = {}
    for j, t in enumerate(input_types):
        for d, n in enumerate(t.shape):
            if isinstance(n, sympy.Symbol):
                seen.setdefault(n, (j, d, n))
    return tuple(seen.values())


def unbound_symbols(bindings: tuple, types) -> set:
    """The size symbols of ``types`` that no input binds (a backward program whose inputs
    are a scalar's seed): such a program cannot read its sizes from a call."""
    return {s for t in types for d in t.shape if isinstance(d, sympy.Basic)
            for s in d.free_symbols} - {s for _, _, s in bindings}


def size_values(bindings: tuple, tensors) -> dict:
    """Each size symbol's value in a call (``size_bindings``)."""
    return {s: tensors[j].shape[d] for j, d, s in bindings}


def concrete(value, values: dict):
    """``value`` (a param, a shape) with its size expressions evaluated at ``values`` (size
    symbol -> int, and values evaluated already: ``evaluated``): a compiled program's sizes
    at one call."""
    try:
        return values[value]
    except (KeyError, TypeError):  # not evaluated already, or unhashable
        pass
    if isinstance(value, sympy.Basic) or isinstance(value, tuple) and all(
            isinstance(v, (int, sympy.Basic)) for v in value):
        symbols, fn = _evaluator(value)
        return fn(*[values[s] for s in symbols])
    if isinstance(value, tuple):
        items = (concrete(v, values) for v in value)
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [concrete(v, values) for v in value]
    return value


def numeric(value) -> bool:
    """Is ``value`` numbers and size expressions, in tuples (a shape, an op's sizes)?"""
    if isinstance(value, (tuple, list)):
        return all(map(numeric, value))
    return isinstance(value, (int, float, sympy.Basic)) and not isinstance(value, bool)


def evaluated(exprs: tuple) -> Callable[[dict], dict]:
    """A function of a call's size symbols' values (``size_values``) returning them with
    each of ``exprs`` (``numeric`` values) evaluated, in one compiled call: what a program
    reads through ``concrete`` at each call."""
    symbols, fn = _evaluator(tuple(exprs)) if exprs else ((), None)

    def evaluate(values: dict) -> dict:
        if fn is None:
            return values
        return values | dict(zip(exprs, fn(*[values[s] for s in symbols])))

    return evaluate


class _SizePrinter(PythonCodePrinter):
    """Python code of size expressions in integer arithmetic (floor division, not float)."""

    def _print_floor(self, e):
        num, den = e.args[0].as_numer_denom()
        return f"(({self._print(num)}) // ({self._print(den)}))"

    def _print_ceiling(self, e):
        num, den = e.args[0].as_numer_denom()
        return f"(-((-({self._print(num)})) // ({self._print(den)})))"

    def _print_Function(self, e):  # torch's ToFloat: a size as a float
        if type(e).__name__ == "ToFloat":
            return f"float({self._print(e.args[0])})"
        return super()._print_Function(e)


@functools.lru_cache(maxsize=1 << 12)
def _evaluator(value):
    """(the symbols of ``value``, a function of their values giving ``value``'s numbers)."""
    return _symbols_of(value), sympy.lambdify(_symbols_of(value), value, printer=_SizePrinter)


def _symbols_of(value) -> tuple:
    if isinstance(value, (tuple, list)):
        return tuple(sorted({s for v in value for s in _symbols_of(v)}, key=str))
    return tuple(value.free_symbols) if isinstance(value, sympy.Basic) else ()


def is_symbolic(value) -> bool:
    """Does ``value`` (a param, a type, a shape) hold a size expression?"""
    if isinstance(value, sympy.Basic):
        return True
    if isinstance(value, (tuple, list)):
        return any(map(is_symbolic, value))
    if isinstance(value, TensorType):
        return not is_static(value.shape)
    return False


@attrs.frozen
class TensorType:
    """Static type of a traced tensor: shape, dtype and device (always dense and contiguous).
    A dimension may be symbolic (NOTE [symbolic sizes])."""

    shape: tuple = attrs.field(converter=lambda s: tuple(map(dimension, s)))
    dtype: torch.dtype
    device: str = attrs.field(default="cpu", converter=lambda d: normalize_device(d))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def numel_hint(self) -> int:
        """``numel`` at the size the trace saw: for heuristics (NOTE [symbolic sizes])."""
        return numel_hint(self.shape)

    @property
    def nbytes_hint(self) -> int:
        return self.numel_hint * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{dtype_name(self.dtype)}[{','.join(map(str, self.shape))}]"

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorType":
        return cls(tuple(tensor.shape), tensor.dtype, str(tensor.device))


@attrs.frozen
class Value:
    """One output of one node: the thing an operand refers to."""

    node: int
    index: int = 0


@attrs.frozen
class Provenance:
    """Where a node came from: the ATen op the user's code called, and the user's source line."""

    aten: str | None = None
    source: str | None = None


class Constant:
    """A tensor baked into a graph (one made while tracing, or a folded result).

    Equality and hashing go by content, so equal constants hash equally across processes.
    """

    __slots__ = ("tensor", "_digest")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor.detach()
        self._digest: str | None = None

    @property
    def digest(self) -> str:
        if self._digest is None:
            t = self.tensor
            h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}{t.device}".encode())
            if t.numel():  # a fresh dense copy: views and 1-element tensors have odd strides
                flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1).cpu())
                h.update(flat.view(torch.uint8).numpy().tobytes())
            self._digest = h.hexdigest()
        return self._digest

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Constant) and self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        t = self.tensor
        if t.numel() <= 6:
            return f"const({t.tolist()})"
        return f"const<{self.digest[:8]}>"


@attrs.frozen
class Node:
    """Payload of one graph node: a primitive applied with static params.

    ``params`` is a tuple of (name, value) pairs sorted by name, so nodes are hashable and
    print the same everywhere.
    """

    prim: str
    params: tuple[tuple[str, Any], ...]
    out_types: tuple[TensorType, ...]
    provenance: Provenance = Provenance()

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)

    @staticmethod
    def make_params(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
        return tuple(sorted((k, _freeze(v)) for k, v in params.items()))


def _freeze(value: Any) -> Any:
    """Make a param value hashable: lists become tuples, tensors become Constants."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, torch.Tensor):
        return Constant(value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value
