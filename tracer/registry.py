"""The ``Primitive`` type and the registry of primitives by name: what a graph's nodes are.

The primitives themselves, each with its rules, are defined in ``primitives.py`` (and the
modules beside it); the tracer and the passes look them up here by name.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import attrs
import torch

from ..errors import GraphError
from ..graph.graph import TYPE_RULES, Graph
from ..graph.types import TensorType


@attrs.define(eq=False)
class Primitive:
    name: str
    infer: Callable[..., tuple[TensorType, ...]] | None
    impl: Callable[..., Any]
    multiple_results: bool = False
    # Effectful primitives are never removed, merged, folded or reordered.
    effectful: bool = False
    # Does a node of these params draw from torch's random generator (so is effectful)?
    draws: Callable[..., bool] | None = None
    vjp: Callable | None = None    # reverse-mode rule (NOTE [autodiff], passes/autodiff.py)
    jvp: Callable | None = None    # forward-mode rule (derived from vjp where missing)
    batch: Callable | None = None  # vmap rule (NOTE [batching], tracer/batching.py)

    def __repr__(self) -> str:
        return f"<primitive {self.name}>"


PRIMITIVES: dict[str, Primitive] = {}


def get_primitive(name: str) -> Primitive:
    try:
        return PRIMITIVES[name]
    except KeyError:
        raise GraphError(f"unknown primitive {name!r}") from None


@attrs.frozen
class Impl:
    """``prim``'s eager implementation by name, always returning a tuple: what a compiled
    program calls for an extern (a name, not a closure, so programs pickle: NOTE [program
    cache]). Each operand first becomes the view of it that its steps in ``views`` make
    (``((tensor method, *arguments), ...)``, one tuple per operand, or none at all)."""

    prim: str
    views: tuple = ()

    def __call__(self, *tensors, **params):
        prim = PRIMITIVES[self.prim]
        tensors = [functools.reduce(lambda t, step: getattr(t, step[0])(*step[1:]), steps, t)
                   for t, steps in zip(tensors, self.views)] or tensors
        out = prim.impl(*tensors, **params)
        return tuple(out) if prim.multiple_results else (out,)


def define(name: str, infer, impl, **kwargs) -> Primitive:
    assert name not in PRIMITIVES, name
    PRIMITIVES[name] = prim = Primitive(name, infer, impl, **kwargs)
    TYPE_RULES[name] = infer
    return prim


def vjp_rule(*names: str):
    """Attach the decorated function as the VJP rule of the named primitives (see
    ``NOTE [autodiff]`` in passes/autodiff.py for the signature)."""
    def attach(rule):
        for name in names:
            PRIMITIVES[name].vjp = rule
        return rule

    return attach


def jvp_rule(*names: str):
    """Attach the decorated function as the JVP rule of the named primitives:
    ``rule(operands, tangents, outs, **params) -> one tangent per output`` (None: zero)."""
    def attach(rule):
        for name in names:
            PRIMITIVES[name].jvp = rule
        return rule

    return attach


@attrs.frozen
class OperandSlot:
    """Marks where the i-th tensor operand goes in an opaque op's argument template."""

    index: int

    def __repr__(self) -> str:
        return f"${self.index}"


def batch_rule(*names: str):
    def attach(rule):
        for name in names:
            PRIMITIVES[name].batch = rule
        return rule

    return attach


def is_effectful(node) -> bool:
    """Must this node run exactly as traced (never removed, merged, folded or moved)?

    True for effectful primitives, for random draws (each call draws anew), for opaque ops
    with no result (checks such as aten._linalg_check_errors), and for a node whose body (a
    graph among its params: control flow) has such a node.
    """
    if get_primitive(node.prim).effectful or draws_random(node):
        return True
    if any(is_effectful(g.node(n)) for g in bodies(node) for n in g.order):
        return True
    return node.prim == "opaque" and not node.out_types


def bodies(node) -> list[Graph]:
    """The graphs among a node's params: a control-flow node's bodies."""
    return [g for _, g in node.params if isinstance(g, Graph)]


def draws_random(node) -> bool:
    """Does this node draw from torch's random generator: an opaque call to a random op, or
    a primitive whose ``draws`` says so for its params (attention with dropout)?"""
    if node.prim == "opaque":
        return bool(node.out_types) and \
            torch.Tag.nondeterministic_seeded in node.kwargs["op"].tags
    draws = get_primitive(node.prim).draws
    return draws is not None and draws(**node.kwargs)
