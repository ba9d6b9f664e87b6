"""torch.autograd.Function while tracing: its forward traced, its backward a custom VJP rule.

NOTE [custom functions]
While a trace runs, ``Function.apply`` (``traced_apply``) runs the function's ``forward``
on the tracers (grad mode off, as eager runs it), so its ops land in the graph like any
other, then passes each tensor result through a ``custom_vjp`` node: the identity of its last
operand, whose operands are also the function's tensor inputs and every tensor the forward
saved (``ctx.save_for_backward``, or tensors kept as ``ctx`` attributes). Its VJP rule calls
the user's ``backward`` on the replayed operands, so the derivative is the user's, and the
forward's own ops get none. Forward mode derives its rule from that VJP (NOTE [autodiff]);
``vmap`` runs it once per example, unless the rule batches (plait's own softmax rule:
``batched``). Lowering treats ``custom_vjp`` as the value itself. A forward that writes into
an input (``ctx.mark_dirty``) returns that input: its operand is the input's value before
the write, and the input is then written with the ``custom_vjp``'s result, so what reads it
afterwards is differentiated through the user's backward, as in eager.

An op defined with ``torch.library.custom_op`` and given a derivative with
``register_autograd`` (transformers' grouped matmul of mixture-of-experts layers) is traced
the same way: its call an opaque node, its ``setup_context`` and ``backward`` those of a
custom function (``custom_op_handler``).
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.autograd.function import Function
from torch.utils import _pytree as pytree

from ..errors import OpError, UnsupportedOpError
from .registry import define
from .trace import (HANDLER_FINDERS, HANDLERS, TRACING_CONTEXTS, TracerTensor, bind,
                    current_trace, on_tracers, tracing_active, unwrap_functional)

aten = torch.ops.aten

_ORIGINAL_APPLY = Function.apply.__func__


class _Context:
    """The ``ctx`` a custom function's forward and backward see while tracing."""

    def __init__(self, needs_input_grad: tuple):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple = ()
        self.saved_for_forward: tuple = ()
        self.materialize_grads = True
        self.non_differentiable: tuple = ()
        self.dirty: tuple = ()  # inputs the forward wrote into (ctx.mark_dirty)

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors):  # for a jvp staticmethod, which plait does not use
        self.saved_for_forward = tensors

    def mark_non_differentiable(self, *tensors):
        self.non_differentiable = tensors

    def set_materialize_grads(self, value: bool):
        self.materialize_grads = value

    def mark_dirty(self, *tensors):
        self.dirty = tensors


class CustomRule:
    """One traced call of a custom function: what its backward needs besides the operands."""

    def __init__(self, cls, ctx: _Context, inputs: list, saved_names: list[str],
                 out_types: list):
        self.cls = cls
        self.attributes = {k: v for k, v in vars(ctx).items() if k not in saved_names
                           and k != "saved_tensors"}
        self.input_slots = inputs  # argument position of each tensor operand
        # tensors saved for backward, less the Nones among them (no operands): where they were
        self.nones = tuple(i for i, t in enumerate(ctx.saved_tensors) if t is None)
        self.saved_names = saved_names
        self.n_saved = len(ctx.saved_tensors) - len(self.nones)
        self.out_types = out_types

    def __repr__(self) -> str:
        return f"{self.cls.__qualname__}.backward"

    def backward(self, ct, output: int, operands: tuple, needed: tuple | None = None) -> list:
        """The user's backward on the replayed operands, for the cotangent of one output;
        ``needed``: which operands need a cotangent (``ctx.needs_input_grad``)."""
        n_in = len(self.input_slots)
        saved = list(operands[n_in:n_in + self.n_saved])
        for i in self.nones:
            saved.insert(i, None)
        named = operands[n_in + self.n_saved:len(operands) - 1]
        needs = list(self.attributes["needs_input_grad"])
        for k, p in enumerate(self.input_slots if needed is not None else ()):
            needs[p] = needs[p] and needed[k]
        ctx = _Context(())
        vars(ctx).update(self.attributes)
        ctx.needs_input_grad, ctx.saved_tensors = tuple(needs), tuple(saved)
        vars(ctx).update(zip(self.saved_names, named))
        # the other outputs' cotangents: zeros, or None after ctx.set_materialize_grads(False)
        cts = [ct if k == output else torch.zeros(t.shape, dtype=t.dtype, device=t.device)
               if self.attributes.get("materialize_grads", True) else None
               for k, t in enumerate(self.out_types)]
        with torch.enable_grad():
            grads = self.cls.backward(ctx, *cts)
        grads = grads if isinstance(grads, tuple) else (grads,)
        in_grads = [grads[p] if p < len(grads) else None for p in self.input_slots]
        # as torch.autograd's engine: a gradient broadcast over its input is summed back
        in_grads = [g.sum_to_size(x.shape) if isinstance(g, torch.Tensor) and g.shape != x.shape
                    else g for g, x in zip(in_grads, operands)]
        return in_grads + [None] * (len(operands) - n_in)


def traced_apply(cls, *args, **kwargs):
    """``Function.apply`` (NOTE [custom functions]): traced on tracers, eager otherwise."""
    flat = pytree.tree_leaves((args, kwargs))
    if not tracing_active() or not any(
            isinstance(unwrap_functional(x), TracerTensor) for x in flat
            if isinstance(x, torch.Tensor)):
        return _ORIGINAL_APPLY(cls, *args, **kwargs)
    if kwargs:
        raise UnsupportedOpError(f"{cls.__qualname__}.apply with keyword arguments (kwarg-only "
                                 "Tensor args among them) is not supported under plait, nor "
                                 "by torch.func's vmap; pass them positionally.")
    inputs = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    ctx = _Context(tuple(isinstance(a, torch.Tensor) and a.dtype.is_floating_point
                         for a in args))
    # an input the forward writes into (ctx.mark_dirty) is differentiated at its value
    # before the write: the functional value under the argument, which the write replaces
    before = {i: unwrap_functional(args[i]) for i in inputs}
    with torch.no_grad():
        if _has_setup_context(cls):
            out = cls.forward(*args)
            cls.setup_context(ctx, args, out)
        else:
            out = cls.forward(ctx, *args)
    outs = out if isinstance(out, tuple) else (out,)
    if _has_setup_context(cls):
        _check_saved_inputs(cls, ctx, [args[i] for i in inputs], outs)
    saved_names = [k for k, v in vars(ctx).items()
                   if isinstance(v, torch.Tensor) and k not in ("saved_tensors", "dirty")]
    rule = CustomRule(cls, ctx, inputs, saved_names,
                      [_type_of(o) for o in outs if isinstance(o, torch.Tensor)])
    dirty = {id(t) for t in ctx.dirty}
    operands = [before[i] if id(args[i]) in dirty else args[i] for i in inputs] + \
        [t for t in ctx.saved_tensors if t is not None] + [getattr(ctx, k) for k in saved_names]
    frozen = {id(t) for t in ctx.non_differentiable}
    results, k = [], 0
    for o in outs:
        if isinstance(o, torch.Tensor) and id(o) not in frozen:
            bound = on_tracers(_bind_custom)(operands, o, rule, k)
            if id(o) in dirty:  # returned as the input itself, as eager returns it
                o.copy_(bound)
            else:
                o = bound
        k += isinstance(o, torch.Tensor)
        results.append(o)
    return tuple(results) if isinstance(out, tuple) else results[0]


def _check_saved_inputs(cls, ctx: _Context, inputs: list, outs: tuple) -> None:
    """torch.autograd's rule for a function with ``setup_context``: an input returned as it is
    (not written: no ``mark_dirty``) may not be saved, as itself or as the output."""
    returned = {id(o) for o in outs if any(o is x for x in inputs)} - {id(t) for t in ctx.dirty}
    if returned & {id(t) for t in (*ctx.saved_tensors, *ctx.saved_for_forward)}:
        raise OpError(
            f"{cls.__qualname__}: An input that has been returned as-is as output is being "
            "saved for backward. This is not supported if you override setup_context (eager "
            "PyTorch refuses it too). Return and save a view of the input (x.view_as(x)), or "
            "return a clone of the input and save that instead.")


def traceable_apply(fn):
    """``fn`` itself, or, where it is a custom function's ``apply`` taken before tracing began
    (``plait.vmap(MyFunction.apply)``, torch's own), the traced apply bound to its class."""
    if getattr(fn, "__func__", None) is _ORIGINAL_APPLY:
        return functools.partial(traced_apply, fn.__self__)
    return fn


def _bind_custom(operands, out, rule, output):
    return bind("custom_vjp", *operands, out, rule=rule, output=output)


def _type_of(t: torch.Tensor):
    return current_trace().type_of(unwrap_functional(t))


def _has_setup_context(cls) -> bool:
    return getattr(cls.setup_context, "__func__", cls.setup_context) is not \
        getattr(Function.setup_context, "__func__", Function.setup_context)


@contextlib.contextmanager
def _custom_functions_traced():
    """While tracing, ``Function.apply`` is ``traced_apply`` (calls outside a trace, or with
    no traced tensor, run as usual)."""
    previous = Function.__dict__["apply"]
    Function.apply = classmethod(traced_apply)
    try:
        yield
    finally:
        Function.apply = previous


TRACING_CONTEXTS.append(_custom_functions_traced)


@functools.cache
def custom_op_handler(op):
    """For a ``torch.library.custom_op`` with a ``register_autograd`` derivative: a handler
    tracing its calls as a custom function's (NOTE [custom functions]), else None."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace in ("aten", "prims"):
        return None
    from torch._library.custom_ops import OPDEFS

    definition = OPDEFS.get(op._name)
    if getattr(definition, "_backward_fn", None) is None:
        return None
    setup = definition._setup_context_fn or (lambda ctx, inputs, output: None)
    names = [a.name for a in op._schema.arguments]

    def backward(ctx, *cts):
        grads = definition._backward_fn(ctx, *cts)
        grads = grads if isinstance(grads, tuple) else (grads,)
        # NOTE [custom op gradients]: a caller that chose what the op computes from its
        # arguments' requires_grad (torch's linear_cross_entropy computes its gradients in
        # the forward, only for arguments that require grad) saw plait's tracers, which do
        # not: the registered backward then has no gradient at all to give, and zero would
        # be a wrong answer (one that gives some, and None for an argument it does not
        # differentiate, is taken at its word)
        missing = [names[i] for i, (needed, g) in enumerate(zip(ctx.needs_input_grad, grads))
                   if needed and g is None]
        if missing and all(g is None for g in grads):
            raise UnsupportedOpError(
                f"the derivative registered for {op} gave no gradient for its floating-point "
                f"argument(s) {missing}; its caller may have decided what to compute from "
                "requires_grad, which plait's traced tensors do not set. Differentiate it "
                "outside plait, or call the op where its gradients are not needed.")
        return grads

    function = _opaque_function(op, lambda ctx, inputs, output: setup(
        ctx=ctx, inputs=inputs, output=output), backward)

    def handler(*args, **kwargs):
        args, kwargs = torch._library.utils.fill_defaults(op._schema, args, kwargs)
        if kwargs:  # keyword-only arguments: a plain opaque call, with no derivative
            return NotImplemented
        return traced_apply(function, *args)

    return handler


HANDLER_FINDERS.append(custom_op_handler)


def _opaque_function(op, setup_context, backward) -> type:
    """A ``Function`` whose forward is an opaque call of ``op`` and whose derivative is
    ``backward``, traced as a custom function's (NOTE [custom functions])."""
    return type(f"{op._name}.autograd", (Function,), {
        "forward": staticmethod(lambda *args: current_trace().opaque(op, args, {})),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward)})


# NOTE [grouped products]
# ``torch._grouped_mm(a, b, offs)`` (transformers' mixture-of-experts layers on CUDA: each
# expert's tokens times that expert's weights) runs as an opaque call whose derivative is two
# grouped products, as torch's own is: for [S, K] x [G, K, N] with the groups of rows ending
# at ``offs``, a's gradient is ct [S, N] x bᵀ [G, N, K] over the same groups, and b's is
# aᵀ [K, S] x ct [S, N] with the groups splitting the contracted dim: [G, K, N]. Only that
# form (no bias, a's dtype out) is differentiated; others stay plain opaque calls. b's
# gradient is one opaque call of ``grouped_mm_of_transposed``, which hands CUDA's kernel aᵀ
# as a view of a, as torch's derivative does: a graph value is stored row-major, and aᵀ so
# stored would have the groups split its contiguous dim, which CUDA's kernel takes only
# where every group's bytes are a multiple of 16 (else a device-side assert that ends the
# process's use of the GPU: gpt-oss's experts get any number of tokens).
@torch.library.custom_op("plait::grouped_mm_of_transposed", mutates_args=())
def grouped_mm_of_transposed(a: torch.Tensor, ct: torch.Tensor,
                             offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a.t(), ct, offs=offs)``: NOTE [grouped products]."""
    return torch._grouped_mm(a.t(), ct, offs=offs)


@grouped_mm_of_transposed.register_fake
def _(a, ct, offs):
    return a.new_empty((offs.shape[0], a.shape[1], ct.shape[1]))


def _grouped_mm_backward(ctx, ct):
    a, b, offs = ctx.saved_tensors
    return (torch._grouped_mm(ct, b.transpose(-2, -1), offs=offs) if ctx.needs_input_grad[0]
            else None,
            grouped_mm_of_transposed(a, ct, offs) if ctx.needs_input_grad[1] else None, None)


if hasattr(aten, "_grouped_mm"):
    _GROUPED_MM = _opaque_function(
        aten._grouped_mm.default,
        lambda ctx, inputs, output: ctx.save_for_backward(*inputs), _grouped_mm_backward)

    def _grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
        """NOTE [grouped products]."""
        if offs is None or bias is not None or out_dtype not in (None, a.dtype) \
                or (a.ndim, b.ndim) != (2, 3):
            return NotImplemented
        return traced_apply(_GROUPED_MM, a, b, offs)

    HANDLERS[aten._grouped_mm.default] = _grouped_mm


def _batched_custom(operands, batched, axis_size, rule, output):
    """A rule that batches (``rule.batched()``: its dims moved past a leading batch dim, as
    softmax's) keeps its node, every operand batched; any other runs once per example."""
    if not hasattr(rule, "batched"):
        return NotImplemented
    operands = [x if b else x.expand(axis_size, *x.shape) for x, b in zip(operands, batched)]
    return bind("custom_vjp", *operands, rule=rule.batched(), output=output), [True]


def _custom_vjp(cts, *operands, outs, rule, output, needed):
    """A user's backward (``CustomRule``) learns which inputs need a gradient; plait's own
    rules built on the node (softmax's, ...) compute them all."""
    if isinstance(rule, CustomRule):
        return rule.backward(cts[0], output, operands, needed)
    return rule.backward(cts[0], output, operands)


define("custom_vjp", lambda *types, rule, output: (types[-1],),
       lambda *operands, rule, output: operands[-1], vjp=_custom_vjp, batch=_batched_custom)
