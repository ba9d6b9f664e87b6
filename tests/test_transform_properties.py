"""Random stacks of transforms against torch.func (hypothesis).

A stack is 1 to 3 of grad (or grad_and_value), vjp, jvp, vmap, jacrev and jacfwd, each with
random argnums, in_dims/out_dims and has_aux, over a function of a small pool. It is built
alike from plait's transforms and from torch.func's and run on the same float64 inputs: the
results must agree. About one layer in eight is given a fault that torch.func refuses (an
argnums out of range, a non-scalar under grad, has_aux on a function returning no pair, a
tangent or cotangent of the wrong shape, bad in_dims, out_dims or batch sizes): wherever
torch.func raises, plait must raise a PlaitError.

CI (the CI environment variable set) runs 500 examples; a developer's run 60. The examples
are derandomized, so each run checks the same stacks.
"""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from torch.testing import assert_close
from torch.utils import _pytree as pytree

import plait

F = torch.nn.functional


# ---------------------------------------------------------------------------------------
# The pool: name -> (function, the shape of each argument: a tuple, or a dict of tuples)
# ---------------------------------------------------------------------------------------
def _elementwise(x):
    return torch.sin(x) * torch.exp(0.5 * x) + torch.tanh(x) ** 2 + torch.sigmoid(x)


def _where_clamp(x):
    return torch.where(x > 0, x * x, torch.sigmoid(x)) + x.clamp(-0.5, 0.5) * x


def _reductions(x):  # random inputs: no ties for amax
    # two results, not four: plait's jacrev traces one backward per result, so nested
    # Jacobians cost (results) ** depth
    return x.pow(2).sum(-1) + x.amax(1), x.logsumexp(0) * x.mean() * x.prod()


def _indexing(x):
    return x[1:, ::2] * x[0, None, :2] + x[[2, 0]][:, 1:3] - x.flip(0)[:2, -2:]


def _broadcasting(x, y):
    return torch.cos(x.unsqueeze(1) - y.view(3, 1)).sum(0) + x.sum(0) * y


def _two_args(x, y):
    return (x * y).sin() + x / (1 + y * y)


def _loss_and_aux(x):
    return (x.sin() ** 2).sum(), x.exp().mean(0)


def _a_tuple(x, y):
    return y @ x, (x.unsqueeze(0) * y).sum()


def _dict_arg(p, x):
    return torch.tanh(x @ p["w"] + p["b"])


def _reshapes(x):
    return x.t().reshape(-1).cumsum(0) * x.flatten().flip(0)


def _scalar_arg(s, y):
    return s * y.exp() + s.sin()


def _gather_cat(x, y):
    picked = x.gather(1, torch.tensor([[2, 0], [1, 1]])) * y.index_select(0, torch.tensor([1, 0]))
    return torch.cat([picked, torch.stack([x[:, 0], y[:2]], 1)], 0)


def _sort_topk(x):
    return x.sort(-1).values * 2 + x.topk(2, 0).values.sum(0)


def _einsum(a, b):
    return torch.einsum("ij,kj->ik", a, b) + torch.bmm(a[None], b.t()[None])[0]


def _losses(x, y):
    targets = torch.tensor([2, 0])
    return F.cross_entropy(x, targets) + F.mse_loss(x.tanh(), y)


def _losses_written_out(x, y):
    """torch.func's reference for ``_losses``: jvp over the vjp of torch's mse_loss raises
    "ZeroTensors are immutable" (torch 2.13)."""
    return F.cross_entropy(x, torch.tensor([2, 0])) + ((x.tanh() - y) ** 2).mean()


def _norms(x):
    return torch.linalg.vector_norm(x, dim=-1) + x.std(0).sum() + x.norm()


def _norms_written_out(x):
    """torch.func's reference for ``_norms``: grad of a jvp of a vjp through torch's norm and
    std raises "modified by an inplace operation" (torch 2.13)."""
    centered = x - x.mean(0)
    return (x * x).sum(-1).sqrt() + ((centered * centered).sum(0) / (x.shape[0] - 1)).sqrt().sum() \
        + (x * x).sum().sqrt()


def _layer_norm(x, w, b):
    return F.layer_norm(x, (3,), w, b)


def _layer_norm_written_out(x, w, b):
    """torch.func's reference for ``_layer_norm``: torch's own layer norm has wrong second
    derivatives through its forward-mode formula (jacfwd(jacfwd(...)), grad of a jvp)."""
    var, mean = torch.var_mean(x, -1, correction=0, keepdim=True)
    return (x - mean) * torch.rsqrt(var + 1e-5) * w + b


POOL = {
    "elementwise": (_elementwise, [(3,)]),
    "where_clamp": (_where_clamp, [(2, 3)]),
    "reductions": (_reductions, [(2, 3)]),
    "matmul": (torch.matmul, [(2, 3), (3, 2)]),
    # a 2-D input: on a 1-D one, F.linear adds the bias in place (add_) into the product of
    # input and weight, which plait refuses when both are closed over and only the bias is
    # traced (a plait bug: "writes into a tensor it did not receive as an argument")
    "linear": (lambda x, w, b: F.linear(x, w, b).tanh(), [(2, 3), (2, 3), (2,)]),
    "softmax": (lambda x: torch.softmax(x, -1), [(2, 3)]),
    "log_softmax": (lambda x: torch.log_softmax(x, 0), [(3, 2)]),
    "layer_norm": (_layer_norm, [(2, 3), (3,), (3,)]),
    "indexing": (_indexing, [(3, 4)]),
    "broadcasting": (_broadcasting, [(2, 3), (3,)]),
    "two_args": (_two_args, [(3,), (3,)]),
    "loss_and_aux": (_loss_and_aux, [(2, 2)]),
    "a_tuple": (_a_tuple, [(3,), (2, 3)]),
    "dict_arg": (_dict_arg, [{"w": (3, 2), "b": (2,)}, (3,)]),
    "reshapes": (_reshapes, [(2, 3)]),
    "scalar_arg": (_scalar_arg, [(), (3,)]),
    "gather_cat": (_gather_cat, [(2, 3), (3,)]),
    "sort_topk": (_sort_topk, [(2, 3)]),
    "einsum": (_einsum, [(2, 3), (2, 3)]),
    "losses": (_losses, [(2, 3), (2, 3)]),
    "norms": (_norms, [(2, 3)]),
}
# what torch.func runs instead (the same function, written around a bug of torch's)
REFERENCE = {_layer_norm: _layer_norm_written_out, _losses: _losses_written_out,
             _norms: _norms_written_out}


# ---------------------------------------------------------------------------------------
# Layers, and how each is built from either library
# ---------------------------------------------------------------------------------------
class Layer(NamedTuple):
    kind: str
    argnums: int | tuple = 0  # vjp/jvp: the positions given as primals (the rest are closed over)
    has_aux: bool = False
    in_dims: object = ()  # an int, None, or a tuple of them (or of dicts of them) per argument
    out_dims: int = 0
    value: bool = False  # grad_and_value rather than grad
    fault: str | None = None  # what is wrong with this layer (torch.func raises), if anything


def _weights(x):
    """A fixed tensor of x's shape and dtype (a constant made inside the traced function)."""
    return torch.cos(torch.arange(x.numel(), dtype=x.dtype) * 1.3 + 0.4).reshape(x.shape)


def _readout(out):
    """A scalar that weighs every element of every leaf differently (a plain sum would not
    see, e.g., softmax's gradient)."""
    return sum((leaf * _weights(leaf)).sum() for leaf in pytree.tree_leaves(out))


def _pair(out):
    """``out`` as (output, aux): a pair as it is, anything else with a made-up aux."""
    if isinstance(out, tuple) and len(out) == 2:
        return out
    return out, pytree.tree_leaves(out)[0].cos()


def _wrong_shape(x):
    return torch.ones(*x.shape, 2, dtype=x.dtype)


def _positions(argnums, n):
    return [a % n for a in ((argnums,) if isinstance(argnums, int) else argnums)]


def _apply(lib, h, layer: Layer):
    kind, fault = layer.kind, layer.fault
    aux = layer.has_aux and fault != "aux"  # the "aux" fault: has_aux=True, no pair returned

    if kind in ("grad", "jacrev", "jacfwd"):
        def inner(*a):
            out = h(*a)
            main, extra = _pair(out) if aux else (out, None)
            if kind == "grad" and fault != "scalar":
                main = _readout(main)
            return (main, extra) if aux else main

        if kind == "grad":
            make = lib.grad_and_value if layer.value else lib.grad
            return make(inner, argnums=layer.argnums, has_aux=layer.has_aux)
        if lib is torch.func and kind == "jacfwd" and fault != "argnums":
            # torch.func.jacfwd returns zeros for a negative argnums (torch 2.13): give it the
            # same argnums counted from the front
            def run_jacfwd(*a):
                nums = _positions(layer.argnums, len(a))
                nums = nums[0] if isinstance(layer.argnums, int) else tuple(nums)
                return lib.jacfwd(inner, argnums=nums, has_aux=layer.has_aux)(*a)

            return run_jacfwd
        return getattr(lib, kind)(inner, argnums=layer.argnums, has_aux=layer.has_aux)

    if kind == "vmap":
        if lib is torch.func and layer.out_dims != 0:
            # torch.func.vmap fails to place an output that does not depend on the mapped
            # inputs at an out_dims other than 0 (torch 2.13): move the batch dim after it
            mapped = lib.vmap(h, in_dims=layer.in_dims)
            return lambda *a: pytree.tree_map(lambda r: r.movedim(0, layer.out_dims), mapped(*a))
        return lib.vmap(h, in_dims=layer.in_dims, out_dims=layer.out_dims)

    def differentiated(a):
        """h as a function of the chosen arguments (the others closed over), and their values."""
        chosen = _positions(layer.argnums, len(a))

        def of_chosen(*c):
            full = list(a)
            for i, v in zip(chosen, c):
                full[i] = v
            out = h(*full)
            return _pair(out) if aux else out

        return of_chosen, tuple(a[i] for i in chosen)

    if kind == "vjp":
        def run_vjp(*a):
            f, primals = differentiated(a)
            out, vjp_fn, *extra = lib.vjp(f, *primals, has_aux=layer.has_aux)
            make = _wrong_shape if fault == "cotangent" else lambda o: _weights(o) + 0.5 * o
            return (out, vjp_fn(pytree.tree_map(make, out)), *extra)

        return run_vjp

    def run_jvp(*a):
        f, primals = differentiated(a)
        make = _wrong_shape if fault == "tangent" else lambda p: _weights(p) + 0.5 * p
        return lib.jvp(f, primals, pytree.tree_map(make, primals), has_aux=layer.has_aux)

    return run_jvp


def build(lib, fn, layers):
    for layer in layers:
        fn = _apply(lib, fn, layer)
    return fn


# ---------------------------------------------------------------------------------------
# Drawing stacks
# ---------------------------------------------------------------------------------------
KINDS = ("grad", "vjp", "jvp", "vmap", "jacrev", "jacfwd")
FAULTS = {"grad": ("argnums", "scalar", "aux"), "jacrev": ("argnums", "aux"),
          "jacfwd": ("argnums", "aux"), "vjp": ("aux", "cotangent"), "jvp": ("aux", "tangent"),
          "vmap": ("in_dims", "no_mapped_dim", "sizes", "out_dims")}


def _is_shape(x):
    return isinstance(x, tuple)


def _insert(shape, d, size):
    d = d if d >= 0 else d + len(shape) + 1
    return shape[:d] + (size,) + shape[d:]


@st.composite
def _argnums(draw, n, fault):
    if fault == "argnums":
        return draw(st.sampled_from([n, -n - 1, (0, 0), (0, n)]))
    nums = draw(st.permutations(range(n)).flatmap(
        lambda p: st.integers(1, n).map(lambda k: tuple(p[:k]))))
    if len(nums) == 1 and draw(st.booleans()):
        return draw(st.sampled_from([nums[0], nums[0] - n]))  # an int, maybe negative
    return nums


@st.composite
def _vmap_layer(draw, shapes, fault):
    """A vmap layer over arguments of ``shapes`` and the shapes it then takes."""
    size = draw(st.integers(1, 3))
    n = len(shapes)
    mapped = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    if fault == "no_mapped_dim":
        mapped = [False] * n
    elif not any(mapped):
        mapped[draw(st.integers(0, n - 1))] = True
    if fault == "sizes" and sum(mapped) < 2:
        fault = "in_dims"  # one mapped argument cannot disagree with another
    in_dims, new_shapes, first = [], [], True
    for shape, m in zip(shapes, mapped):
        if not m:
            in_dims.append(None)
            new_shapes.append(shape)
            continue
        leaves, spec = pytree.tree_flatten(shape, is_leaf=_is_shape)
        per_leaf = isinstance(shape, dict) and draw(st.booleans())
        if fault == "in_dims" and first:
            dims = [max(map(len, leaves)) + 1] * len(leaves)  # out of range
        elif per_leaf:  # some leaves may be unmapped, not all
            dims = [draw(st.none() | st.integers(-len(s) - 1, len(s))) for s in leaves]
            dims[0] = 0 if all(d is None for d in dims) else dims[0]
        else:
            dims = [draw(st.integers(-min(map(len, leaves)) - 1, min(map(len, leaves))))]
            dims = dims * len(leaves)
        sz = size + 1 if fault == "sizes" and not first else size
        new_shapes.append(pytree.tree_unflatten(
            [_insert(s, d, sz) if d is not None and (fault != "in_dims" or not first) else s
             for s, d in zip(leaves, dims)], spec))
        in_dims.append(pytree.tree_unflatten(dims, spec) if per_leaf else dims[0])
        first = False
    out_dims = 20 if fault == "out_dims" else draw(st.sampled_from([0, 0, -1, 1]))
    in_dims = in_dims[0] if n == 1 and draw(st.booleans()) else tuple(in_dims)
    return Layer("vmap", in_dims=in_dims, out_dims=out_dims, fault=fault), new_shapes


@st.composite
def stacks(draw):
    """(pool name, layers innermost first, the shapes of the outermost function's args)."""
    name = draw(st.sampled_from(sorted(POOL)))
    shapes = list(POOL[name][1])
    layers = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(KINDS))
        faults = FAULTS[kind]
        fault = draw(st.sampled_from((None,) * 7 * len(faults) + faults))  # 1 in 8 at fault
        if kind == "vmap":
            layer, shapes = draw(_vmap_layer(shapes, fault))
        else:
            has_aux = draw(st.booleans()) or fault == "aux"
            layer = Layer(kind, draw(_argnums(len(shapes), fault)), has_aux,
                          value=kind == "grad" and draw(st.booleans()), fault=fault)
        layers.append(layer)
    return name, tuple(layers), shapes


def _inputs(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return pytree.tree_map(lambda s: torch.randn(s, generator=gen, dtype=torch.float64),
                           shapes, is_leaf=_is_shape)


# ---------------------------------------------------------------------------------------
# The property
# ---------------------------------------------------------------------------------------
def _matches_torch_func(stack, seed, jit):
    name, layers, shapes = stack
    fn = POOL[name][0]
    args = _inputs(shapes, seed)
    ours = build(plait, fn, layers)
    ours = plait.jit(ours) if jit else ours
    try:
        want = build(torch.func, REFERENCE.get(fn, fn), layers)(*args)
    except Exception as e:  # noqa: BLE001 (any refusal of torch.func's)
        note(f"torch.func raised {type(e).__name__}: {e}")
        with pytest.raises(plait.PlaitError):
            ours(*args)
        return
    assert_close(ours(*args), want)


_PROPERTY = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
_STACKS = given(stack=stacks(), seed=st.integers(0, 2 ** 16), jit=st.booleans())
# 60 stacks in every run, 500 in the slow tier (three minutes on two cores)
test_a_stack_of_transforms_matches_torch_func = settings(max_examples=60, **_PROPERTY)(
    _STACKS(_matches_torch_func))
test_500_stacks_of_transforms_match_torch_func = pytest.mark.slow(settings(
    max_examples=500, **_PROPERTY)(_STACKS(_matches_torch_func)))
