"""Trace a whole Python function: pytree arguments in, a graph plus output structure out."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import torch
from torch.utils import _pytree as pytree

from ..errors import ConcretizationError, OpError, PlaitError
from ..graph import Graph, TensorType
from . import aten as _aten  # noqa: F401  (registers the handlers)
from . import collectives as _collectives  # noqa: F401
from . import linalg as _linalg  # noqa: F401
from . import nn as _nn  # noqa: F401
from .trace import Trace, captured_write_error, check_dtype, is_dense, tracing


@attrs.frozen
class Static:
    """An argument that is part of the compilation key rather than a traced input."""

    value: Any


@attrs.frozen
class TracedFunction:
    """A traced function: its graph, and how graph values map back to Python values.

    Graph outputs are the tensor leaves of the result, in ``out_tree`` order, followed by the
    new values of the inputs the function mutated (``mutated_inputs`` indexes tensor inputs).
    ``out_leaves`` holds each result leaf: an int (position among graph outputs) for a tensor
    leaf, or ``Static(value)`` for a non-tensor leaf returned as is.
    """

    graph: Graph
    out_tree: pytree.TreeSpec
    out_leaves: tuple
    mutated_inputs: tuple[int, ...]
    # Tracers of enclosing traces the function captured: the graph's last inputs, in order.
    captured: tuple = ()


def _as_plait_error(e: RuntimeError) -> PlaitError | None:
    """Some misuses surface as torch's own RuntimeErrors, before plait's dispatch sees them."""
    message = str(e)
    if "mutating a non-functional tensor" in message:  # functionalize's check, in C++
        return captured_write_error()
    if "not allocated" in message or "unallocated storage" in message:
        return ConcretizationError(
            "an operation read the data of a traced tensor directly (.tolist(), or a tensor "
            "of split sizes or indices given to an op that needs Python numbers), but under "
            "plait.jit its value is only known when the compiled function runs. Use "
            "torch.where (or plait.cond once available) instead of a Python choice, or pass "
            "such values as a static argument (static_argnums)")
    return None


def _is_size(x) -> bool:
    return isinstance(x, torch.Size)  # a static leaf: torch's pytree would rebuild a tuple


def trace_function(fn: Callable, leaves: Sequence[Any], in_tree: pytree.TreeSpec) -> TracedFunction:
    """Trace ``fn(*args, **kwargs)`` where ``(args, kwargs) = unflatten(leaves, in_tree)``.

    Tensor leaves become graph inputs (in order); ``Static`` leaves are passed unwrapped.
    """
    trace = Trace()
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    with tracing(trace):
        inputs = []
        for i in tensor_pos:
            check_dtype(leaves[i], "a function argument")
            inputs.append(trace.new_input(TensorType.of(leaves[i]), is_dense(leaves[i])))
        originals = [t._value for t in inputs]

        def flat_fn(*tracers):
            filled = list(leaves)
            for i, t in zip(tensor_pos, tracers):
                filled[i] = t
            filled = [x.value if isinstance(x, Static) else x for x in filled]
            args, kwargs = pytree.tree_unflatten(filled, in_tree)
            result = fn(*args, **kwargs)
            raw.append(pytree.tree_flatten(result, is_leaf=_is_size))  # before functionalize
            return result

        raw = []
        try:
            out = torch.func.functionalize(flat_fn, remove="mutations")(*inputs)
        except PlaitError:
            raise
        except RuntimeError as e:  # torch's own checks (in C++ composites) land here
            raise _as_plait_error(e) or OpError(
                f"PyTorch raised while tracing: {e}. Eager PyTorch raises this too for these "
                "arguments; fix the arguments.") from None
        # functionalize unwraps the result's tensors in order, but may rebuild containers
        # (torch.Size becomes a tuple): take the structure and non-tensor leaves from the raw
        # result, and the tensors from functionalize's.
        results = iter([x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)])
        raw_leaves, out_tree = raw[0]
        outputs, out_leaves = [], []
        for leaf in raw_leaves:
            if isinstance(leaf, torch.Tensor):
                out_leaves.append(len(outputs))
                outputs.append(trace.value_of(next(results)))
            else:
                out_leaves.append(Static(leaf))
        mutated = [i for i, (t, v) in enumerate(zip(inputs, originals)) if t._value != v]
        outputs += [inputs[i]._value for i in mutated]
    graph = trace.builder.build(outputs)
    return TracedFunction(graph, out_tree, tuple(out_leaves), tuple(mutated),
                          tuple(trace.captured))


