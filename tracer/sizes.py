"""Symbolic sizes while tracing: the size symbols of a call's varying dimensions, and the
guards a trace's Python made on them.

NOTE [dynamic dimensions]
A jit traces a call whose argument dimensions vary with those dimensions as size symbols
(``plait.jit(dynamic=...)``, ``plait.mark_dynamic``; NOTE [automatic dynamic] in api.py).
The symbols are torch's own: a ``ShapeEnv`` (as dynamo's) makes one per dimension, ranging
over [2, inf) (a 0 or 1 traces static: broadcasting and empty tensors branch on them), with
no duck sizing (two dimensions equal at this call are still two symbols). A tracer reports
``SymInt`` sizes, so the user's Python arithmetic on them stays symbolic, and a branch on a
size (``if x.shape[0] > 8``) or a size made a number (``int(n)``) is decided at the traced
size and recorded as a guard. Graph types hold the symbols' sympy expressions (NOTE [symbolic
sizes] in graph/types.py). A trace that specialized a symbol to one number (a guard
``s0 == 8``) was no use as a dynamic one: ``Sizes.check`` raises ``Specialized`` and the jit
traces that call static. Each call of a dynamic compilation binds the symbols from its
arguments' shapes and runs only where every guard holds (``Sizes.values``); another call of
the same signature compiles another variant. The compiler's later traces of the graph (the
training step's derivative) run with the symbols current again (``reopened``), and a guard
made there fails the dynamic compilation too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

import sympy
import torch

from ..errors import PlaitError
from ..graph.types import TensorType, dimension, equal_sizes, set_size_hint, standard


class Specialized(PlaitError):
    """A dynamic trace decided a size symbol's value; the call is traced static instead."""


class _PerThread(threading.local):
    def __init__(self):
        self.sizes: Sizes | None = None


_THREAD = _PerThread()


class Sizes:
    """The size symbols of one trace (a jit's root trace and the traces nested in it)."""

    def __init__(self):
        # imported here: symbolic_shapes takes most of a second to import, and only a
        # dynamic trace needs it
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
        self.env = ShapeEnv(duck_shape=False, specialize_zero_one=True)
        self.bindings: list[tuple[int, int, sympy.Symbol]] = []  # (input, dim, symbol)

    def symbolic(self, tensor: torch.Tensor, input_index: int, dims) -> TensorType:
        """``tensor``'s type with ``dims`` made size symbols (sizes 0 and 1 stay numbers)."""
        shape: list = list(tensor.shape)
        for d in dims:
            if d >= len(shape) or shape[d] < 2:  # (another call's dims: not this tensor's)
                continue
            symbol = self.env.create_symbol(shape[d], _source(input_index, d),
                                            dynamic_dim=_dynamic())
            set_size_hint(symbol, shape[d])
            self.bindings.append((input_index, d, symbol))
            shape[d] = symbol
        return TensorType(shape, tensor.dtype, str(tensor.device))

    def symint(self, d) -> int | torch.SymInt:
        """A graph dimension as a tracer reports it."""
        if isinstance(d, (int, torch.SymInt)):
            return d
        return self.env.create_symintnode(d, hint=self._hint(d))

    def _hint(self, expr) -> int:
        """``expr`` at the sizes of this trace (torch 2.13 renamed ShapeEnv's size_hint)."""
        hint = getattr(self.env, "guarding_hint_or_throw", None) or self.env.size_hint
        return int(hint(expr))

    def check(self) -> "Sizes":
        """Closes the trace: its guards are kept (raises ``Specialized`` where one fixed a
        symbol to a number). Returns itself."""
        symbols = self.symbols
        fixed = [s for s in symbols if s in self.env.replacements
                 and not self.env.replacements[s].free_symbols]
        if fixed:
            raise Specialized(f"the trace decided the size {fixed[0]} as a number")
        # the guards as recorded (ShapeEnv's simplification would turn a decided equality of
        # two sizes into true, having replaced one by the other), and those replacements
        guards = [g.expr for g in self.env.guards] + [
            sympy.Eq(s, self.env.replacements[s]) for s in symbols
            if s in self.env.replacements and self.env.replacements[s] != s]
        self.guards = tuple(g for g in map(standard, guards) if g is not sympy.true)
        self._closed_at = len(self.env.guards)
        self._decided: dict = {}  # sizes -> do the guards hold (a few hundred at most)
        hints = tuple(map(self._hint, symbols))
        if self.values_hold(hints) is not True:  # evaluates at all: else it falls back here
            raise Specialized(f"the trace's guards {self.guards} fail at its own sizes")
        return self

    def values_hold(self, sizes: tuple) -> bool:
        """Do the guards hold at these sizes of the symbols? (Substituted: ShapeEnv's guards
        use torch's own sympy functions, which evaluate on numbers.)"""
        held = self._decided.get(sizes)
        if held is None:
            at = dict(zip(self.symbols, map(sympy.Integer, sizes)))
            held = all(bool(g.xreplace(at)) for g in self.guards)
            if len(self._decided) < 512:
                self._decided[sizes] = held
        return held

    @property
    def symbols(self) -> tuple:
        return tuple(s for _, _, s in self.bindings)

    @contextlib.contextmanager
    def reopened(self):
        """The symbols current again, for the compiler's later traces of the graph (the
        training step's derivative); a decision on a size there (a new guard) raises
        ``Specialized``: its compilation would hold for this size only."""
        with symbolic_sizes(self):
            yield
        if len(self.env.guards) > self._closed_at:
            raise Specialized(f"the compiler decided {self.env.guards[-1].expr} on a size")

    def values(self, tensors) -> tuple[int, ...] | None:
        """Each symbol's size in ``tensors`` (the compilation's inputs), or None where one is
        below 2 or a guard fails."""
        sizes = tuple(tensors[i].shape[d] for i, d, _ in self.bindings)
        if any(n < 2 for n in sizes):
            return None
        return sizes if self.values_hold(sizes) else None

    def __str__(self) -> str:
        return ", ".join(f"{s} = input {i}'s dim {d}" for i, d, s in self.bindings) + (
            "; guards: " + ", ".join(map(str, self.guards)) if self.guards else "")


@contextlib.contextmanager
def reopened(sizes: "Sizes | None"):
    """``sizes.reopened()``, or nothing for a static compilation."""
    if sizes is None:
        yield
    else:
        with sizes.reopened():
            yield


def _dynamic():
    from torch.fx.experimental.symbolic_shapes import DimDynamic
    return DimDynamic.DYNAMIC


def _source(input_index: int, dim: int):
    """Where a size symbol's value comes from, as ShapeEnv names it in guards."""
    from torch._guards import GuardSource, Source

    @dataclasses.dataclass(frozen=True)
    class InputSize(Source):
        input: int
        dim: int

        @property
        def _name_template(self) -> str:
            return f"input{self.input}.size({self.dim})"

        @property
        def guard_source(self):
            return GuardSource.LOCAL

    return InputSize(input_index, dim)


def holds(relation) -> bool:
    """A comparison of sizes, decided by their expressions, else by the trace's guards (a
    guard made now if need be: NOTE [dynamic dimensions]); TypeError outside a trace."""
    if isinstance(relation, bool):  # of numbers: every slice a static trace makes
        return relation
    decided = sympy.sympify(relation)
    if decided is sympy.true or decided is sympy.false:
        return bool(decided)
    sizes = current()
    if sizes is None:
        raise TypeError(f"cannot decide {relation} outside the trace of its size symbols")
    return bool(sizes.env.evaluate_expr(decided))


def same_size(a, b) -> bool:
    """Are two sizes equal: at every size (``equal_sizes``), or at these sizes, with a guard
    that they stay so (two arguments' dimensions that meet in a broadcast, such as a
    model's input ids and labels, which torch's duck sizing would have made one symbol)?"""
    return equal_sizes(a, b) or holds(sympy.Eq(a, b))


def is_one(n) -> bool:
    """Is a dimension 1? A graph dimension's expression (``s0 - 1``) may be at some sizes: it
    is decided by the trace's guards, as a tracer's SymInt size is (NOTE [dynamic
    dimensions])."""
    if isinstance(n, (int, torch.SymInt)):
        return n == 1
    return holds(sympy.Eq(n, 1))


def current() -> Sizes | None:
    return _THREAD.sizes


@contextlib.contextmanager
def symbolic_sizes(sizes: Sizes | None):
    """The size symbols tracers report while a dynamic trace runs."""
    before, _THREAD.sizes = _THREAD.sizes, sizes
    try:
        yield sizes
    finally:
        _THREAD.sizes = before


def reported(shape) -> tuple:
    """A graph shape as a tracer reports it: SymInts for its symbolic dimensions."""
    if all(isinstance(d, int) for d in shape):
        return tuple(shape)
    sizes = current()
    if sizes is None:
        raise PlaitError(f"a tracer of symbolic shape {tuple(map(str, shape))} was made "
                         "outside the trace that made its size symbols")
    return tuple(map(sizes.symint, shape))


def params_dimensions(value):
    """A primitive's param with each SymInt made its graph dimension (sympy or int)."""
    if isinstance(value, torch.SymInt):
        return dimension(value)
    if isinstance(value, torch.SymFloat):  # a size as a number (layer norm's row length)
        n = value.node.maybe_as_float()
        return n if n is not None else value.node.expr
    if isinstance(value, (list, tuple)) and any(isinstance(v, (torch.SymInt, list, tuple))
                                                for v in value):
        return type(value)(map(params_dimensions, value)) if isinstance(value, tuple) else \
            [params_dimensions(v) for v in value]
    return value
