"""``plait.custom_vjp`` and ``plait.custom_jvp``: functions with derivative rules of their own,
with JAX's contract.

NOTE [custom derivative rules]
Both become a ``torch.autograd.Function`` made for the function, so one mechanism serves
every caller: eager torch.autograd runs its ``backward``, and under plait's transforms and
``jit`` its ``apply`` is traced (NOTE [custom functions], tracer/custom.py): the forward's
ops land in the graph and its outputs pass through a ``custom_vjp`` node whose VJP rule is
that ``backward``, forward mode derived from it. For ``custom_vjp`` the backward is the
user's ``bwd(residuals, cotangents)``; the residuals ``fwd`` returns are saved tensors (a
pytree of them and other values). For ``custom_jvp`` the backward is the transpose of the
user's rule: the VJP of the linear map ``tangents -> jvp(primals, tangents)[1]`` (plait's
own ``vjp`` of it, so it is traced like the rest), as JAX derives reverse mode by
transposing a custom JVP; eager forward-mode AD calls the user's rule itself.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from . import transforms
from .errors import TraceError
from .tracer.trace import tracing_active


class _Rule:
    """What the two share: the wrapped function, its rule, and its autograd.Function."""

    def __init__(self, fun: Callable):
        functools.update_wrapper(self, fun)
        self.fun = fun
        self._function: type | None = None

    def __call__(self, *args):
        if self._function is None:
            raise TraceError(f"{self.__class__.__name__} function {self.__name__} has no rule "
                             f"yet: call {self.__name__}.{self._define}(...) first")
        out_spec = []
        flat = self._function.apply(out_spec, *args)
        return pytree.tree_unflatten(list(flat), out_spec[0])

    def _flat(self, out, out_spec: list) -> tuple:
        leaves, spec = pytree.tree_flatten(out)
        if not all(isinstance(x, torch.Tensor) for x in leaves):
            raise TraceError(f"{self.__name__}: a {self.__class__.__name__} function returns "
                             "tensors (or pytrees of them)")
        out_spec[:] = [spec]
        return tuple(leaves)


class custom_vjp(_Rule):
    """``f = plait.custom_vjp(fun)``, then ``f.defvjp(fwd, bwd)``: ``fwd(*args) -> (out,
    residuals)``, ``bwd(residuals, out_cotangent) -> one cotangent per argument`` (None for
    an argument that gets none)."""

    _define = "defvjp"

    def defvjp(self, fwd: Callable, bwd: Callable) -> None:
        rule = self

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, out_spec, *args):
                out, residuals = fwd(*args)
                leaves, ctx.spec = pytree.tree_flatten(residuals)
                ctx.tensors = [isinstance(x, torch.Tensor) for x in leaves]
                ctx.others = [None if t else x for x, t in zip(leaves, ctx.tensors)]
                ctx.save_for_backward(*[x for x, t in zip(leaves, ctx.tensors) if t])
                ctx.n_args, ctx.out_spec = len(args), out_spec
                return rule._flat(out, out_spec)

            @staticmethod
            def backward(ctx, *cts):
                saved = iter(ctx.saved_tensors)
                residuals = pytree.tree_unflatten(
                    [next(saved) if t else x for x, t in zip(ctx.others, ctx.tensors)], ctx.spec)
                grads = bwd(residuals, pytree.tree_unflatten(list(cts), ctx.out_spec[0]))
                grads = tuple(grads) if isinstance(grads, (tuple, list)) else (grads,)
                if len(grads) != ctx.n_args:
                    raise TraceError(f"{rule.__name__}: bwd returned {len(grads)} cotangents "
                                     f"for {ctx.n_args} arguments")
                return (None, *grads)

        Function.__qualname__ = f"custom_vjp({self.__name__})"
        self._function = Function


class custom_jvp(_Rule):
    """``f = plait.custom_jvp(fun)``, then ``f.defjvp(jvp)``: ``jvp(primals, tangents) ->
    (out, out_tangent)``, linear in the tangents; reverse mode transposes it."""

    _define = "defjvp"

    def defjvp(self, jvp: Callable) -> Callable:
        rule = self

        def transpose(primals: tuple, cts: list) -> tuple:
            """The VJP of ``tangents -> jvp(primals, tangents)[1]`` at ``cts``: plait's
            vjp while tracing (inlined into the trace), torch.autograd's otherwise."""
            if tracing_active():
                _, pullback = transforms.vjp(lambda *t: jvp(primals, t)[1],
                                             *map(torch.zeros_like, primals))
                return pullback(cts)
            with torch.enable_grad():
                tangents = [torch.zeros_like(p).requires_grad_() for p in primals]
                out = pytree.tree_leaves(jvp(primals, tuple(tangents))[1])
                return torch.autograd.grad(out, tangents, list(cts), allow_unused=True,
                                           create_graph=torch.is_grad_enabled())

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, out_spec, *args):
                if not all(isinstance(a, torch.Tensor) for a in args):
                    raise TraceError(f"{rule.__name__}: a custom_jvp function takes tensors; "
                                     "close over other values (functools.partial)")
                ctx.save_for_backward(*args)
                ctx.save_for_forward(*args)
                ctx.out_spec = out_spec
                return rule._flat(rule.fun(*args), out_spec)

            @staticmethod
            def backward(ctx, *cts):
                primals = ctx.saved_tensors
                if tracing_active():
                    cts = pytree.tree_unflatten(list(cts), ctx.out_spec[0])
                return (None, *transpose(primals, cts))

            @staticmethod
            def jvp(ctx, _, *tangents):
                return rule._flat(jvp(ctx.saved_tensors, tangents)[1], [])

        Function.__qualname__ = f"custom_jvp({self.__name__})"
        self._function = Function
        return jvp  # as JAX's: ``@f.defjvp`` keeps the rule's name
