"""Sweep PyTorch's OpInfo database through plait.jit and compare with eager.

Run directly for a full report:  python tests/opinfo_sweep.py [--backend eager] [--ops a,b]
The test suite (tests/test_opinfo.py) runs the same sweep and asserts its numbers.

Per sample the outcome is one of:
  match        plait's result equals eager's (same structure, dtypes, shapes, values)
  plait_error  plait raised a PlaitError (an honest "cannot do this")
  wrong        plait returned something else, or crashed with a non-PlaitError
Samples on which eager itself raises are not counted. Ops whose output is not deterministic
(random ops, uninitialized memory) are left out of the sweep.
"""
from __future__ import annotations

import argparse
import warnings

import attrs
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import plait

_UNINITIALIZED = ("empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                  "new_empty_strided")
SAMPLES_PER_OP = 2
RTOL, ATOL = 1e-4, 1e-5
# plait runs torch's fused attention kernels (forward and backward) where eager runs the
# written-out math for 3-D operands: another summation order, ~1e-5 apart in float32
_ATOL = {"nn.functional.scaled_dot_product_attention": 5e-5}


@attrs.define
class SweepResult:
    outcomes: dict = attrs.field(factory=dict)      # (op name, sample index) -> outcome
    details: dict = attrs.field(factory=dict)       # (op name, sample index) -> message
    opaque_ops: set = attrs.field(factory=set)      # ops whose graph needed an opaque node
    ops: list = attrs.field(factory=list)           # ops swept

    def count(self, outcome: str) -> int:
        return sum(1 for o in self.outcomes.values() if o == outcome)

    @property
    def total(self) -> int:
        return len(self.outcomes)

    def summary(self) -> str:
        lines = [f"ops swept: {len(self.ops)}, samples: {self.total}",
                 f"match: {self.count('match')} ({100 * self.count('match') / max(1, self.total):.1f}%)",
                 f"plait_error: {self.count('plait_error')}",
                 f"wrong: {self.count('wrong')}",
                 f"ops needing an opaque node: {len(self.opaque_ops)} "
                 f"({100 * len(self.opaque_ops) / max(1, len(self.ops)):.1f}%)"]
        for outcome in ("wrong", "plait_error"):
            for key, o in sorted(self.outcomes.items()):
                if o == outcome:
                    lines.append(f"  {outcome:12s} {key[0]}[{key[1]}]: {self.details[key][:300]}")
        lines.append("  opaque: " + ", ".join(sorted(self.opaque_ops)))
        return "\n".join(lines)


class _RandomOps(TorchDispatchMode):
    """Notes whether any ATen op tagged as random runs (seeded ops are not deterministic)."""

    seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen |= torch.Tag.nondeterministic_seeded in func.tags
        return func(*args, **(kwargs or {}))


def _deterministic(op, sample) -> bool:
    if op.name in _UNINITIALIZED or op.name.split(".")[-1] in _UNINITIALIZED:
        return False
    try:  # two calls on fresh copies of the inputs agree, and no random op runs
        args = (sample.input, *sample.args)
        with _RandomOps() as random_ops:
            a = op(*_clone(args), **_clone(sample.kwargs))
        b = op(*_clone(args), **_clone(sample.kwargs))
        _compare(a, b)
        if random_ops.seen:
            return False
        return True
    except Exception:
        return False


def _compare(actual, expected, atol: float = ATOL) -> None:
    a_leaves, a_tree = pytree.tree_flatten(actual)
    e_leaves, e_tree = pytree.tree_flatten(expected)
    if a_tree != e_tree:
        raise AssertionError(f"structure {a_tree} != {e_tree}")
    for a, e in zip(a_leaves, e_leaves):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(a, e, rtol=RTOL, atol=atol, equal_nan=True)
        elif a != e and not (a != a and e != e):
            raise AssertionError(f"{a!r} != {e!r}")


def _clone(x):
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)


class _Skip(Exception):
    """The sample does not apply to this mode (eager itself cannot compute the reference)."""


def _jit_case(op, args, kwargs, backend):
    expected = op(*_clone(args), **_clone(kwargs))
    fn = plait.jit(lambda *a, **k: op.op(*a, **k), backend=backend)
    graph = fn.lower(*_clone(args), **_clone(kwargs)).graph
    opaque = any(graph.node(n).prim == "opaque" for n in graph.nx.nodes)
    return lambda: fn(*_clone(args), **_clone(kwargs)), expected, opaque


def _float_leaves(args):
    leaves, tree = pytree.tree_flatten(args)
    return leaves, tree, [i for i, x in enumerate(leaves)
                          if isinstance(x, torch.Tensor) and x.dtype.is_floating_point]


# Ops whose eager derivative is itself wrong, so autograd is no reference for them.
_EAGER_GRAD_BUGS = {
    # d/dx as_strided_scatter(x, s, (2,), (1,), 1) for a cotangent of 2 is [2, 0, 0, 2];
    # eager gives [0, 2, 2, 0] (the scattered positions, which no longer depend on x).
    "as_strided_scatter",
}


def _grad_case(op, args, kwargs, backend):
    """d/d(float tensor leaves) of sum(output * fixed random cotangent), against autograd."""
    leaves, tree, diff = _float_leaves((args, kwargs))
    if not diff or op.name in _EAGER_GRAD_BUGS:
        raise _Skip
    generator = torch.Generator().manual_seed(0)

    def scalar(*diff_values, cotangents=None):
        filled = list(leaves)
        for i, v in zip(diff, diff_values):
            filled[i] = v
        a, k = pytree.tree_unflatten(filled, tree)
        outs = [o for o in pytree.tree_leaves(op.op(*a, **k))
                if isinstance(o, torch.Tensor) and o.dtype.is_floating_point]
        return sum((o * c).sum() for o, c in zip(outs, cotangents)) if outs else None

    primals = [leaves[i].clone().requires_grad_() for i in diff]
    try:
        outs = [o for o in pytree.tree_leaves(op.op(*pytree.tree_unflatten(
            [primals[diff.index(i)] if i in diff else x for i, x in enumerate(leaves)],
            tree)[0], **kwargs)) if isinstance(o, torch.Tensor) and o.dtype.is_floating_point]
        cotangents = [torch.randn(o.shape, generator=generator) for o in outs]
        total = scalar(*primals, cotangents=cotangents)
        if total is None or not total.requires_grad:
            raise _Skip
        expected = torch.autograd.grad(total, primals, allow_unused=True)
    except _Skip:
        raise
    except Exception:
        raise _Skip from None
    expected = tuple(torch.zeros_like(p) if g is None else g for p, g in zip(primals, expected))
    fn = plait.grad(lambda *d: scalar(*d, cotangents=cotangents), argnums=tuple(range(len(diff))))
    return lambda: fn(*[leaves[i].clone() for i in diff]), expected, False


# Ops whose eager forward-mode derivative disagrees with float64 central differences on
# their samples, where plait's agrees (checked when these were listed), so torch.func.jvp is
# no reference for them.
_EAGER_JVP_BUGS = {"triangular_solve", "scatter_reduce.prod", "nn.functional.nll_loss",
                   "as_strided.partial_views"}


def _full_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _jvp_case(op, args, kwargs, backend):
    """Forward mode along a fixed random tangent of the float tensor leaves, against
    torch.func.jvp (samples torch.func cannot differentiate forward are skipped)."""
    leaves, tree, diff = _float_leaves((args, kwargs))
    if not diff or _full_name(op) in _EAGER_JVP_BUGS:
        raise _Skip
    generator = torch.Generator().manual_seed(0)
    primals = tuple(leaves[i] for i in diff)
    tangents = tuple(torch.randn(p.shape, generator=generator) for p in primals)

    def fn(*values):
        filled = list(leaves)
        for i, v in zip(diff, values):
            filled[i] = v
        a, k = pytree.tree_unflatten(filled, tree)
        return [o for o in pytree.tree_leaves(op.op(*a, **k))
                if isinstance(o, torch.Tensor) and o.dtype.is_floating_point]

    try:
        expected = torch.func.jvp(fn, primals, tangents)
    except Exception:
        raise _Skip from None
    if not expected[0]:
        raise _Skip
    return lambda: plait.jvp(fn, primals, tangents), expected, False


VMAP_SCALES = (1.0, 0.5, 0.25)  # examples: the float inputs scaled (keeps signs and ranges)


def _vmap_case(op, args, kwargs, backend):
    """A batch of 3 examples (float tensor inputs scaled, the rest shared) through
    plait.vmap, against eager per example, stacked."""
    leaves, tree, mapped = _float_leaves((args, kwargs))
    if not mapped:
        raise _Skip

    def example(k):
        filled = [x * VMAP_SCALES[k] if i in mapped else x for i, x in enumerate(leaves)]
        return pytree.tree_unflatten(filled, tree)

    try:
        per_example = [op.op(*a, **kw) for a, kw in map(example, range(len(VMAP_SCALES)))]
        out_leaves = [pytree.tree_leaves(r) for r in per_example]
        if not all(isinstance(x, torch.Tensor) for x in out_leaves[0]):
            raise _Skip
        expected = pytree.tree_unflatten([torch.stack(xs) for xs in zip(*out_leaves)],
                                         pytree.tree_structure(per_example[0]))
        stacked = [torch.stack([x * c for c in VMAP_SCALES]) if i in mapped else x
                   for i, x in enumerate(leaves)]
    except _Skip:
        raise
    except Exception:
        raise _Skip from None
    in_dims = [0 if i in mapped else None for i in range(len(leaves))]

    def flat_fn(*flat):
        a, kw = pytree.tree_unflatten(list(flat), tree)
        return op.op(*a, **kw)

    fn = plait.vmap(flat_fn, in_dims=tuple(in_dims))
    return lambda: fn(*stacked), expected, False


MODES = {"jit": _jit_case, "grad": _grad_case, "jvp": _jvp_case, "vmap": _vmap_case}


def sweep(mode: str = "jit", names: set[str] | None = None, backend: str = "eager") -> SweepResult:
    from torch.testing._internal.common_methods_invocations import op_db

    result = SweepResult()
    for op in op_db:
        if names is not None and op.name not in names and op.variant_test_name not in names:
            continue
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        if mode in ("grad", "jvp") and not op.supports_autograd:
            continue
        name = _full_name(op)
        try:
            samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))
        except Exception:
            continue
        samples = samples[:SAMPLES_PER_OP]
        if not samples or not all(_deterministic(op, s) for s in samples):
            continue
        result.ops.append(name)
        for i, sample in enumerate(samples):
            key = (name, i)
            args = (sample.input, *sample.args)
            try:
                op(*_clone(args), **_clone(sample.kwargs))
            except Exception:
                continue  # eager rejects the sample
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    run, expected, opaque = MODES[mode](op, args, sample.kwargs, backend)
                    actual = run()
                if opaque:
                    result.opaque_ops.add(name)
                _compare(actual, expected, _ATOL.get(name, ATOL))
                result.outcomes[key] = "match"
                result.details[key] = ""
            except _Skip:
                continue
            except plait.PlaitError as e:
                result.outcomes[key], result.details[key] = "plait_error", f"{type(e).__name__}: {e}"
            except Exception as e:
                result.outcomes[key], result.details[key] = "wrong", f"{type(e).__name__}: {e}"
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="jit", choices=sorted(MODES))
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--ops", default=None, help="comma-separated op names")
    opts = parser.parse_args()
    print(sweep(opts.mode, set(opts.ops.split(",")) if opts.ops else None,
                opts.backend).summary())
