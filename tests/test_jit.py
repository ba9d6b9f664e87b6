"""plait.jit end to end: results against eager, pytrees, the compilation cache, static
arguments, config, and write-back of mutated inputs."""
from __future__ import annotations

import collections
import copy
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import plait
from plait.errors import PlaitError, TraceError


def prim_count(graph, prim: str) -> int:
    return sum(1 for n in graph.nx.nodes if graph.node(n).prim == prim)


# ---------------------------------------------------------------------------------------
# Results equal eager
# ---------------------------------------------------------------------------------------
def _pointwise(x, y):
    return torch.tanh(x * y + 1.5).exp() - torch.sigmoid(y) / (x.abs() + 1)


def _softmax(x, y):
    return torch.softmax(x, dim=-1), F.log_softmax(y, dim=0)


def _layer_norm(x, y):
    w, b = y[0], y[1]
    return F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)


def _matmul(x, y):
    return x @ y.T, torch.mm(x, y.T), torch.matmul(x.unsqueeze(0), y.T)


def _reductions(x, y):
    return (x.sum(), x.sum(0), x.mean(-1, keepdim=True), x.amax(1), x.min(0).values,
            x.argmax(1), y.prod(1), x.var(1), x.std(0), torch.logsumexp(x, 1), x.norm())


def _index(x, y):
    idx = torch.tensor([3, 0, 2, 2])
    return x[idx], x[:, 1:3], x[1], x[-1, ::2], x[idx, idx[:2, None]], y[..., -2:]


def _where(x, y):
    return torch.where(x > 0, x, y), torch.where(y < 0.5, 0.0, y), x.clamp(-0.5, 0.5)


def _cat(x, y):
    return torch.cat([x, y], 0), torch.cat([x, y, x], 1), torch.stack([x, y], -1)


def _sort(x, y):
    v, i = torch.sort(x, dim=1)
    vd, idd = torch.sort(y, dim=0, descending=True)
    tv, ti = torch.topk(x, 2, dim=1)
    sv, si = torch.topk(y, 3, dim=0, largest=False)
    return v, i, vd, idd, tv, ti, sv, si


def _cumsum(x, y):
    return torch.cumsum(x, 1), y.cumsum(0), torch.cumprod(x, 0), torch.cummax(y, 1)


def _shapes(x, y):
    return (x.reshape(2, -1).T, x.permute(1, 0).contiguous(), x.unsqueeze(1).expand(4, 3, 6),
            x.flip(0), F.pad(x, (1, 2)), x.chunk(2, 1)[1])


CASES = [_pointwise, _softmax, _layer_norm, _matmul, _reductions, _index, _where, _cat,
         _sort, _cumsum, _shapes]


@pytest.mark.parametrize("fn", CASES, ids=lambda f: f.__name__.strip("_"))
def test_matches_eager(fn):
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    want = fn(x, y)
    got = plait.jit(fn)(x, y)
    assert_close(got, want)
    # a second call runs the cached compilation and still agrees
    x2, y2 = torch.randn(4, 6), torch.randn(4, 6)
    assert_close(plait.jit(fn)(x2, y2), fn(x2, y2))


def test_matches_eager_other_dtypes():
    def f(a, b):
        return (a * 3 + b) // 2, (a < b).sum(1), a.to(torch.float32) / 3, a.cumsum(0), \
            b.int().cumsum(0, dtype=torch.int32), b.int().cumprod(1) + 1

    a = torch.randint(-10, 10, (5, 4))
    b = torch.randint(-10, 10, (5, 4))
    assert_close(plait.jit(f)(a, b), f(a, b))
    h = torch.randn(3, 4, dtype=torch.float64)
    assert_close(plait.jit(torch.softmax, static_argnums=1)(h, 1), torch.softmax(h, 1))


def test_a_cube_is_multiplied_out_as_eager_computes_it():
    """Eager's kernels compute ``x ** 3`` as ``x * x * x`` (GELU's tanh form cubes): so does
    plait, exactly, with no ``pow`` left in the graph or in the C++ kernel."""
    x = torch.randn(64, 256) * 3

    def f(x):
        return x ** 3, torch.pow(x, 3.0), x.pow(2) * 0.5

    jitted = plait.jit(f)
    assert "pow" not in [jitted.lower(x).graph.node(n).prim for n in jitted.lower(x).graph.order]
    for got, want in zip(jitted(x), f(x)):
        assert torch.equal(got, want)
    i = torch.randint(-5, 5, (8,))
    assert_close(plait.jit(lambda i: (i ** 3, i ** 3.0))(i), (i ** 3, i ** 3.0))


def test_libraries_see_a_compiler_while_plait_traces():
    """Libraries keep their data-dependent shortcuts out of compiled code by asking
    ``torch.compiler.is_compiling()`` (transformers skips a padding mask that masks nothing
    by reading it): true while plait traces, false again after."""

    def masked(x, mask):
        if not torch.compiler.is_compiling() and bool(mask.all()):
            return x
        return x * mask

    x, mask = torch.randn(4), torch.tensor([1.0, 1.0, 0.0, 1.0])
    assert_close(plait.jit(masked)(x, mask), masked(x, mask))
    assert_close(plait.grad(lambda x: masked(x, mask).sum())(x), mask)
    assert not torch.compiler.is_compiling()


def test_decorator_forms():
    @plait.jit
    def f(x):
        return x * 2

    @plait.jit(backend="eager")
    def g(x):
        return x + 2

    x = torch.randn(3)
    assert isinstance(f, plait.Jitted) and isinstance(g, plait.Jitted)
    assert_close(f(x), x * 2)
    assert_close(g(x), x + 2)
    assert f.__name__ == "f"


# ---------------------------------------------------------------------------------------
# Pytrees
# ---------------------------------------------------------------------------------------
Pair = collections.namedtuple("Pair", ["a", "b"])


def test_pytree_inputs_and_outputs_round_trip():
    def f(t, l, d, p):
        return {
            "tuple": (t[0] + t[1], t[1]),
            "list": [l[0] * 2, [l[1].sum()]],
            "dict": {"y": d["x"].exp(), "n": d["n"]},
            "pair": Pair(p.a - p.b, p.b * 3),
            "none": None,
            "const": 7,
        }

    args = ((torch.randn(3), torch.randn(3)), [torch.randn(2, 2), torch.randn(4)],
            {"x": torch.randn(5), "n": 3}, Pair(torch.randn(2), torch.randn(2)))
    want = f(*args)
    got = plait.jit(f)(*args)
    assert type(got) is dict and list(got) == list(want)
    assert type(got["tuple"]) is tuple and len(got["tuple"]) == 2
    assert type(got["list"]) is list and type(got["list"][1]) is list
    assert type(got["dict"]) is dict and sorted(got["dict"]) == ["n", "y"]
    assert type(got["pair"]) is Pair
    assert got["none"] is None and got["const"] == 7 and got["dict"]["n"] == 3
    assert_close(got, want)


def test_single_tensor_and_nested_outputs():
    def f(x):
        return x + 1

    def g(x):
        return ((x,), [x * 2, (x * 3,)])

    x = torch.randn(3)
    out = plait.jit(f)(x)
    assert isinstance(out, torch.Tensor)
    assert_close(out, f(x))
    got = plait.jit(g)(x)
    assert_close(got, g(x))
    assert type(got) is tuple and type(got[1]) is list and type(got[1][1]) is tuple


def test_kwargs_inputs():
    def f(x, *, scale, bias):
        return x * scale + bias

    x, b = torch.randn(3), torch.randn(3)
    assert_close(plait.jit(f)(x, scale=2.0, bias=b), f(x, scale=2.0, bias=b))


# ---------------------------------------------------------------------------------------
# The compilation cache
# ---------------------------------------------------------------------------------------
def test_cache_hits_and_retraces():
    def f(x):
        return x.sum(0) * 2

    jf = plait.jit(f)
    assert jf.trace_count == 0
    a = torch.randn(3, 4)
    assert_close(jf(a), f(a))
    assert jf.trace_count == 1
    b = torch.randn(3, 4)
    assert_close(jf(b), f(b))                 # same shape and dtype: a cache hit
    assert jf.trace_count == 1
    c = torch.randn(5, 4)
    assert_close(jf(c), f(c))                 # new shape
    assert jf.trace_count == 2
    d = torch.randn(3, 4, dtype=torch.float64)
    assert_close(jf(d), f(d))                 # new dtype
    assert jf.trace_count == 3
    assert_close(jf(b), f(b))                 # the first signature is still cached
    assert jf.trace_count == 3
    jf.clear_cache()
    assert_close(jf(b), f(b))
    assert jf.trace_count == 4
    with torch.no_grad():  # a tensor subclass of one signature: the same compilation
        assert_close(jf(torch.nn.Parameter(b)), f(b))
    assert jf.trace_count == 4
    assert_close(jf(x=b), f(b))               # the same call through a keyword: keyed apart
    assert jf.trace_count == 5


def test_retrace_on_new_pytree_structure():
    def f(xs):
        return sum(x.sum() for x in xs)

    jf = plait.jit(f)
    a, b, c = torch.randn(2), torch.randn(2), torch.randn(2)
    assert_close(jf([a, b]), f([a, b]))
    assert jf.trace_count == 1
    assert_close(jf([b, a]), f([b, a]))
    assert jf.trace_count == 1
    assert_close(jf([a, b, c]), f([a, b, c]))  # longer list
    assert jf.trace_count == 2
    assert_close(jf((a, b)), f((a, b)))        # tuple, not list
    assert jf.trace_count == 3


def test_retrace_on_new_dict_keys():
    def f(d):
        return {k: v * 2 for k, v in d.items()}

    jf = plait.jit(f)
    x = torch.randn(2)
    assert_close(jf({"a": x}), f({"a": x}))
    assert_close(jf({"b": x}), f({"b": x}))
    assert jf.trace_count == 2


def test_static_argnums_loop_count():
    def f(x, n):
        for _ in range(n):
            x = x * 2 + 1
        return x

    jf = plait.jit(f, static_argnums=1)
    x = torch.randn(3)
    assert_close(jf(x, 2), f(x, 2))
    assert jf.trace_count == 1
    assert_close(jf(x, 2), f(x, 2))
    assert jf.trace_count == 1
    assert_close(jf(x, 5), f(x, 5))
    assert jf.trace_count == 2
    assert prim_count(jf.lower(x, 5).graph, "mul") == 5


def test_static_argnums_dim():
    def f(x, dim):
        return torch.softmax(x, dim) * x.sum(dim, keepdim=True)

    jf = plait.jit(f, static_argnums=(1,))
    x = torch.randn(3, 4)
    assert_close(jf(x, 0), f(x, 0))
    assert_close(jf(x, 1), f(x, 1))
    assert_close(jf(x, -1), f(x, -1))
    assert jf.trace_count == 3
    assert_close(jf(x, 0), f(x, 0))
    assert jf.trace_count == 3


def test_static_argnums_negative_index():
    def f(x, n):
        return x * n

    jf = plait.jit(f, static_argnums=-1)
    x = torch.randn(3)
    assert_close(jf(x, 3), f(x, 3))
    assert_close(jf(x, 4), f(x, 4))
    assert jf.trace_count == 2


def test_non_tensor_kwargs_are_static():
    def f(x, *, mode, scale=1.0):
        return x.amax(0) * scale if mode == "max" else x.amin(0) * scale

    jf = plait.jit(f)
    x = torch.randn(3, 4)
    assert_close(jf(x, mode="max"), f(x, mode="max"))
    assert_close(jf(x, mode="min"), f(x, mode="min"))
    assert jf.trace_count == 2
    assert_close(jf(x, mode="max", scale=3.0), f(x, mode="max", scale=3.0))
    assert jf.trace_count == 3
    assert_close(jf(x, mode="max"), f(x, mode="max"))
    assert jf.trace_count == 3


def test_non_tensor_positional_args_are_static():
    def f(x, k):
        return x * k

    jf = plait.jit(f)
    x = torch.randn(3)
    assert_close(jf(x, 2), f(x, 2))
    assert_close(jf(x, 3), f(x, 3))
    assert jf.trace_count == 2
    # 2 and 2.0 are equal but compute different dtypes for int tensors: they must not share
    i = torch.arange(3)
    assert_close(jf(i, 2), f(i, 2))
    assert_close(jf(i, 2.0), f(i, 2.0))
    assert jf.trace_count == 4


def test_unhashable_argument_raises_trace_error():
    def f(x, opts):
        return x * len(opts)

    with pytest.raises(TraceError, match="hashable"):
        plait.jit(f)(torch.randn(3), {1, 2})

    class Unhashable:
        __hash__ = None

    with pytest.raises(TraceError):
        plait.jit(f, static_argnums=1)(torch.randn(3), Unhashable())


def test_lower_returns_inspectable_compilation():
    def f(x):
        return torch.exp(x) + torch.exp(x)

    jf = plait.jit(f)
    x = torch.randn(2, 3)
    lowered = jf.lower(x)
    assert isinstance(lowered, plait.Lowered)
    assert isinstance(lowered.graph, plait.Graph)
    text = lowered.as_text()
    assert text == lowered.graph.as_text()
    assert "f32[2,3]" in text and "exp" in text and "return (" in text
    assert prim_count(lowered.traced_graph, "exp") == 2
    assert prim_count(lowered.graph, "exp") == 1
    assert lowered.backend == "eager"
    assert "plait.Lowered" in repr(lowered)
    lowered.graph.validate()


def test_cache_size_evicts_oldest():
    def f(x):
        return x + 1

    jf = plait.jit(f, dynamic=False)  # a signature per size
    with plait.config.patch(cache_size=2):
        for n in (1, 2, 3):
            jf(torch.randn(n))
        assert jf.trace_count == 3
        jf(torch.randn(3))
        jf(torch.randn(2))
        assert jf.trace_count == 3
        jf(torch.randn(1))  # evicted
        assert jf.trace_count == 4


# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------
def test_config_patch_restores_values():
    before = (plait.config.fold_max_numel, plait.config.simplify)
    with plait.config.patch(fold_max_numel=7, simplify=False) as cfg:
        assert cfg is plait.config
        assert plait.config.fold_max_numel == 7
        assert plait.config.simplify is False
        with plait.config.patch(fold_max_numel=9):
            assert plait.config.fold_max_numel == 9
        assert plait.config.fold_max_numel == 7
    assert (plait.config.fold_max_numel, plait.config.simplify) == before


def test_config_patch_restores_after_exception():
    before = plait.config.fold_max_numel
    with pytest.raises(ZeroDivisionError):
        with plait.config.patch(fold_max_numel=1):
            1 / 0
    assert plait.config.fold_max_numel == before


def test_config_patch_as_decorator():
    before = plait.config.simplify

    @plait.config.patch(simplify=False)
    def inside():
        return plait.config.simplify

    assert inside() is False
    assert plait.config.simplify == before
    assert inside() is False  # reusable
    assert plait.config.simplify == before


def test_config_patch_decorator_changes_compilation():
    def f(x):
        return torch.exp(x) + torch.exp(x)

    @plait.config.patch(simplify=False)
    def lower(x):
        return plait.jit(f).lower(x).graph

    x = torch.randn(3)
    assert prim_count(lower(x), "exp") == 2
    assert prim_count(plait.jit(f).lower(x).graph, "exp") == 1


def _env_probe(env: dict, expr: str) -> str:
    full_env = dict(os.environ)
    full_env.update(env)
    out = subprocess.run([sys.executable, "-c", f"import plait; print(repr({expr}))"],
                         env=full_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_env_overrides_read_at_import():
    got = _env_probe({"PLAIT_BACKEND": "my_backend", "PLAIT_FOLD_MAX_NUMEL": "17",
                      "PLAIT_SIMPLIFY": "0", "PLAIT_PROVENANCE": "off"},
                     "(plait.config.backend, plait.config.fold_max_numel, "
                     "plait.config.simplify, plait.config.provenance)")
    assert got == repr(("my_backend", 17, False, False))


def test_env_defaults():
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}
    out = subprocess.run([sys.executable, "-c", "import plait; c = plait.config; "
                          "print(repr((c.backend, c.simplify, c.fold_max_numel)))"],
                         env=full_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(("auto", True, 4096))


def test_backend_from_config_and_argument():
    calls = []

    def factory(graph):
        run = plait.backends.get_backend("eager").factory(graph)

        def counted(inputs):
            calls.append(graph.digest)
            return run(inputs)

        return counted

    plait.backends.register_backend("counting_for_tests", factory)

    def f(x):
        return x * 3

    x = torch.randn(3)
    assert_close(plait.jit(f, backend="counting_for_tests")(x), f(x))
    assert len(calls) == 1
    with plait.config.patch(backend="counting_for_tests"):
        assert_close(plait.jit(f)(x), f(x))
    assert len(calls) == 2
    assert_close(plait.jit(f)(x), f(x))
    assert len(calls) == 2


# ---------------------------------------------------------------------------------------
# Mutation of inputs: write-back
# ---------------------------------------------------------------------------------------
def _check_mutation(fn, *make_args):
    """Run fn eagerly and jitted on equal copies; compare results and mutated arguments."""
    eager_args = [a() if callable(a) else a for a in make_args]
    jit_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in eager_args]
    want = fn(*eager_args)
    got = plait.jit(fn)(*jit_args)
    assert_close(got, want)
    for e, j in zip(eager_args, jit_args):
        if isinstance(e, torch.Tensor):
            assert_close(j, e)
    return eager_args, jit_args


def test_inplace_mutation_written_back():
    def f(x):
        x.add_(1)
        return x * 2

    a = torch.randn(4)
    original = a.clone()
    eager, jitted = _check_mutation(f, a)
    assert_close(jitted[0], original + 1)
    # the lowered graph returns the new value of the input as an extra output
    lowered = plait.jit(f).lower(torch.randn(4))
    assert lowered.traced.mutated_inputs == (0,)
    assert len(lowered.graph.outputs) == 2


def test_mutation_keeps_argument_identity():
    def f(x):
        x.mul_(3)
        return x.sum()

    a = torch.randn(5)
    b = a.clone()
    want = f(b)
    ptr = a.data_ptr()
    out = plait.jit(f)(a)
    assert a.data_ptr() == ptr  # written back in place, not rebound
    assert_close(a, b)
    assert_close(out, want)


def test_mutation_repeated_calls():
    def f(x):
        x.add_(1)
        return x

    jf = plait.jit(f)
    a = torch.randn(3)
    b = a.clone()
    for _ in range(3):
        assert_close(jf(a), f(b))
    assert_close(a, b)
    assert jf.trace_count == 1


def test_mutation_through_view():
    def f(x):
        x[0].mul_(3)
        return x.sum(0)

    _check_mutation(f, torch.randn(3, 4))


def test_mutation_through_view_chain():
    def f(x, y):
        v = x[:, 1:3]
        v.add_(y)
        x.T[0].zero_()
        return v * 1

    _check_mutation(f, torch.randn(4, 5), torch.randn(4, 2))


def test_index_put_mutation():
    def f(x, idx, v):
        x[idx] = v
        return x.sum()

    idx = torch.tensor([2, 0])
    _check_mutation(f, torch.randn(4, 3), idx, torch.randn(2, 3))


def test_index_put_accumulate_and_scalar_assign():
    def f(x, idx, v):
        x.index_put_((idx,), v, accumulate=True)
        x[1, 1:] = 5.0
        return x

    idx = torch.tensor([1, 1, 3])
    _check_mutation(f, torch.randn(4, 3), idx, torch.randn(3, 3))


def test_out_argument_mutation():
    def f(x, y, z):
        torch.add(x, y, out=z)
        return z * 2

    _check_mutation(f, torch.randn(3), torch.randn(3), torch.zeros(3))


def test_only_mutated_inputs_written_back():
    def f(x, y):
        y.sub_(x)
        return x + y

    eager, jitted = _check_mutation(f, torch.randn(3), torch.randn(3))
    assert plait.jit(f).lower(torch.randn(3), torch.randn(3)).traced.mutated_inputs == (1,)


def test_aliased_mutated_inputs():
    """One tensor passed twice, mutated through one name and read through the other: the
    result must match eager, or plait must refuse with a PlaitError (never a wrong answer)."""
    def f(x, y):
        x.add_(1)
        return y * 2

    a, b = torch.zeros(3), torch.zeros(3)
    want = f(b, b)
    try:
        got = plait.jit(f)(a, a)
    except PlaitError:
        return
    assert_close(got, want)
    assert_close(a, b)


@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_empty_arguments_share_no_memory_a_write_could_show_through(backend):
    """Two empty tensors both report storage address 0: a write into one is no alias of the
    other (a generated program found plait refusing it)."""
    def f(x, y):
        x.mul_(2)
        return x * 3, y.abs()

    x, y = torch.zeros(5, 0, dtype=torch.int64).t(), torch.zeros(0, 1, dtype=torch.int64)
    got, want = plait.jit(f, backend=backend)(x, y), f(x.clone(), y)
    assert_close(got, want)


def test_captured_tensor_is_an_input_and_one_made_inside_a_constant():
    c = torch.randn(3, 3) + 10

    def f(x):
        return x @ c + torch.tensor([1.0, 2.0, 3.0])

    x = torch.randn(2, 3)
    g = plait.make_graph(f)(x)
    consts = [g.node(n) for n in g.nx.nodes if g.node(n).prim == "constant"]
    assert len(consts) == 1  # [1, 2, 3], as made or broadcast by folding
    assert (consts[0].kwargs["value"].tensor == torch.tensor([1.0, 2.0, 3.0])).all()
    assert len(g.inputs) == 2  # x, then the captured c
    assert_close(plait.jit(f)(x), f(x))


def test_write_into_captured_tensor_raises():
    c = torch.zeros(3)
    before = c.clone()

    def f(x):
        c.add_(x)
        return x * 2

    with pytest.raises(PlaitError):
        plait.jit(f)(torch.randn(3))
    assert_close(c, before)


def test_random_factory_draws_anew_each_call():
    """torch.rand with no tensor operand must not be baked into the graph as a constant."""
    def f(x):
        return x + torch.rand(3)

    jf = plait.jit(f)
    x = torch.zeros(3)
    a, b = jf(x), jf(x)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_outputs_never_alias_where_eager_s_do_not(backend):
    def f(x):
        z = x / 10.0
        return z, z.t().contiguous().t(), x.reshape(-1)

    x = torch.randn(4, 5)
    z, z_t, flat = plait.jit(f, backend=backend)(x)
    z.add_(1.0)  # a write into one result shows through no other
    torch.testing.assert_close(z_t, x / 10.0)
    assert flat.data_ptr() != x.data_ptr()
    a = torch.randn(3)
    assert plait.jit(lambda v: v, backend=backend)(a) is a  # an argument returned as is


def test_the_default_backend_follows_the_device():
    from plait.backends import resolve_backend

    cpu, meta = torch.zeros(2), torch.zeros(2, device="meta")
    with plait.config.patch(backend="auto"):
        jitted = plait.jit(lambda x: x.exp() * 2)
        assert jitted.lower(cpu).backend == "cpp"
        assert_close(jitted(cpu), cpu.exp() * 2)
    assert resolve_backend("auto", [cpu]) == "cpp"
    assert resolve_backend("auto", []) == "cpp"
    assert resolve_backend("auto", [meta]) == "eager"
    assert resolve_backend("triton", [cpu]) == "triton"  # a named backend is kept
    assert plait.jit(lambda x: x, backend="loops").lower(cpu).backend == "loops"


def test_compiling_does_not_import_dynamo_or_dtensor():
    """NOTE [dynamo import]: tracing, folding and compiling leave torch._dynamo unimported
    (most of a second per process), and leave torch's dynamo-disabled wrappers as they were;
    NOTE [tracing through a mode]: nor is torch.distributed.tensor imported."""
    code = ("import sys, torch, plait\n"
            "from plait.tracer.trace import _dynamo_layers\n"
            "f = lambda w, x: torch.nn.functional.gelu(x @ w).div(3).softmax(-1).sum()\n"
            "w, x = torch.randn(4, 4), torch.randn(2, 4)\n"
            "got = plait.jit(plait.grad(f), backend='cpp')(w, x)\n"
            "assert 'torch._dynamo' not in sys.modules, 'imported'\n"
            "assert 'torch.distributed.tensor' not in sys.modules, 'DTensor imported'\n"
            "assert not any(hasattr(l, '__dynamo_disable') for l in _dynamo_layers())\n"
            "torch.testing.assert_close(got, torch.func.grad(f)(w, x))\n"
            "print(len(_dynamo_layers()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PLAIT_BACKEND": "auto"})
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 100  # the layers are found at all


@pytest.mark.parametrize("outer", ["grad", "vmap", "jit", "jvp"])
def test_a_jitted_function_inside_a_trace_is_traced_into_it(outer):
    """A nested jit is inlined, as in JAX (its compiled kernels once ran on tracers: a
    segfault)."""
    inner = plait.jit(lambda x: x.sin() * x, backend="cpp")
    f = lambda x: (x.sin() * x).sum()  # noqa: E731
    jitted_f = lambda x: inner(x).sum()  # noqa: E731
    x = torch.randn(3, 4, dtype=torch.float64)
    if outer == "grad":
        torch.testing.assert_close(plait.grad(jitted_f)(x), torch.func.grad(f)(x))
    elif outer == "vmap":
        torch.testing.assert_close(plait.vmap(jitted_f)(x), torch.func.vmap(f)(x))
    elif outer == "jvp":
        for got, want in zip(plait.jvp(jitted_f, (x,), (x,)), torch.func.jvp(f, (x,), (x,))):
            torch.testing.assert_close(got, want)
    else:
        torch.testing.assert_close(plait.jit(lambda x: jitted_f(x) * 2, backend="cpp")(x),
                                   f(x) * 2)
    assert inner.trace_count == 0


@pytest.mark.parametrize("transform", ["grad", "vmap", "jacrev", "hessian"])
def test_jit_of_a_transform_of_a_jitted_function(transform):
    """jit(grad(jit(f))): the transform copies the jitted function's attributes (as
    functools.wraps does), and the outer jit must not take them: it returned f's value, from
    the inner one's cache, rather than the gradient."""
    f = lambda x: (x.sin() * x).sum(-1 if transform == "vmap" else None)  # noqa: E731
    inner = plait.jit(f, backend="cpp")
    x = torch.randn(3, 4, dtype=torch.float64)
    inner(x)  # compiled and cached first
    outer = plait.jit(getattr(plait, transform)(inner), backend="cpp")
    torch.testing.assert_close(outer(x), getattr(torch.func, transform)(f)(x))
    assert outer.fn is not inner.fn


def test_make_fx_and_fake_tensors_see_the_graphs_torch_ops():
    """Under a foreign dispatch mode a jitted function runs its graph op by op with torch
    (its compiled kernels would hide the computation: make_fx recorded only aten.empty)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        return (x.sin() * 2).sum(0)

    x = torch.randn(3, 4)
    for transformed, reference in ((plait.jit(f), f),
                                   (plait.vmap(f), torch.func.vmap(f))):
        traced = make_fx(transformed)(x)
        assert "aten.sin" in traced.code
        assert_close(traced(x), reference(x))
    with FakeTensorMode() as mode:
        out = plait.jit(f)(mode.from_tensor(x))
    assert out.shape == (4,) and type(out).__name__ == "FakeTensor"


def test_make_fx_and_torch_func_see_a_vjp_fns_ops():
    """vjp_fn called under make_fx or a torch.func transform runs the call's backward op by
    op (a compiled backward made the result a constant of the first cotangent), and takes
    torch.func's retain_graph and create_graph positionally."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        return (x.sin() * x).sum()

    x = torch.randn(3)
    _, vjp_fn = plait.vjp(f, x)
    _, expected_fn = torch.func.vjp(f, x)
    traced = make_fx(vjp_fn)(torch.randn(()), True, True)
    for ct in torch.randn(2):
        assert_close(traced(ct, True, True), expected_fn(ct))
    cts = torch.randn(4)
    assert_close(torch.func.vmap(vjp_fn)(cts), torch.func.vmap(expected_fn)(cts))


@pytest.mark.parametrize("transform", ["vmap", "grad", "jvp", "functionalize", "jacrev"])
def test_torch_func_transforms_of_a_jitted_function(transform):
    """Under a torch.func transform the arguments are wrapped tensors with no storage a
    kernel could read: the jitted function runs its graph op by op with torch, which the
    transform records."""
    x = torch.randn(4, 3)
    f = lambda a: (a.sin() * a).sum(-1)  # noqa: E731
    jitted = plait.jit(f, backend="cpp")
    apply = {"vmap": lambda g: torch.func.vmap(g)(x),
             "grad": lambda g: torch.func.grad(lambda a: g(a).sum())(x),
             "jvp": lambda g: torch.func.jvp(g, (x,), (torch.ones_like(x),)),
             "functionalize": lambda g: torch.func.functionalize(g)(x),
             "jacrev": lambda g: torch.func.jacrev(g)(x)}[transform]
    assert_close(apply(jitted), apply(f))


def test_functionalize_and_plait_compose():
    def mutating(a):
        b = a.clone()
        b.add_(1)
        b.view(-1).mul_(2)
        return b

    x = torch.randn(4, 3)
    loss = lambda a: mutating(a).pow(2).sum()  # noqa: E731
    assert_close(plait.jit(torch.func.functionalize(mutating), backend="cpp")(x), mutating(x))
    assert_close(plait.grad(torch.func.functionalize(loss))(x), torch.func.grad(loss)(x))
    assert_close(torch.func.functionalize(plait.grad(loss))(x), torch.func.grad(loss)(x))
    with pytest.raises(plait.errors.TraceError, match="cannot nest functionalize"):
        plait.grad(lambda a: torch.func.functionalize(loss)(a))(x)


@pytest.mark.parametrize("argnums", [dict(static_argnums=(3,)), dict(donate_argnums=-2),
                                     dict(static_argnums=("x",))])
def test_argnums_naming_no_parameter_are_refused(argnums):
    """As JAX checks them: a position the function does not take would be silently
    ignored (the argument traced, or not donated)."""
    with pytest.raises(plait.errors.TraceError, match="argnums"):
        plait.jit(lambda x: x + 1, **argnums)
    # a function of *args, or with a default at that position, takes them
    plait.jit(lambda *a: a[0], static_argnums=3)
    assert_close(plait.jit(lambda x, n=2: x * n, static_argnums=1)(torch.ones(2), 3),
                 torch.full((2,), 3.0))


# -- as_strided on intermediate results (NOTE [eager layouts]) ----------------------------
def _overlapping_chunks(h, w):
    """Longformer's chunking: windows of 2w rows overlapping by w, read through the strides
    of a view of a reshaped projection."""
    h = h.view(h.size(0), h.size(1) // (2 * w), 2 * w, h.size(2))
    size, stride = list(h.size()), list(h.stride())
    size[1], stride[1] = size[1] * 2 - 1, stride[1] // 2
    return h.as_strided(size=size, stride=stride)


def test_as_strided_reads_an_intermediate_laid_out_as_eager_lays_it_out():
    def f(x, proj):
        batch, seq, _ = x.shape
        q = proj(x).view(batch, seq, 2, 3)  # (B, S, H, D)
        q = q.transpose(1, 2).reshape(batch * 2, seq, 3)  # eager copies: contiguous
        padded = F.pad(q, (0, 0, 2, 2), value=-1)
        st = padded.stride()
        windows = padded.as_strided((batch * 2, 3, 6, 3), (st[0], 2 * st[1], st[1], st[2]))
        return _overlapping_chunks(q, 2) * 2, windows.sum(2)

    x, proj = torch.randn(3, 8, 6), torch.nn.Linear(6, 6)
    assert_close(plait.jit(f)(x, proj), f(x, proj))
    grads = torch.autograd.grad(plait.jit(f)(x, proj)[0].sum(), proj.weight)
    assert_close(grads, torch.autograd.grad(f(x, proj)[0].sum(), proj.weight))


def test_as_strided_on_an_intermediate_eager_lays_out_otherwise_is_refused():
    """Eager's ``x.t() + 1`` keeps x.t()'s strides, which plait does not report: the strides
    the user passes would address other elements."""
    f = lambda x: (x.t() + 1).as_strided((2, 2), (1, 2))  # noqa: E731
    with pytest.raises(PlaitError, match="otherwise than plait reports it"):
        plait.jit(f)(torch.randn(3, 3))
    g = lambda x: (x.t() + 1).clone(memory_format=torch.contiguous_format).as_strided(  # noqa
        (2, 2), (1, 2))
    x = torch.randn(3, 3)
    assert_close(plait.jit(g)(x), g(x))


def test_as_strided_sees_eager_layouts_through_a_conversion_naming_its_device():
    """``x.to(device=..., dtype=...)`` (Longformer's mask) reaches ATen as a ``_to_copy``
    given a device, which would copy a meta tensor there: its layout is derived on the meta
    device, where it is the same (the transposed product keeps its strides through it)."""
    f = lambda x: (x * 2).to(device=x.device, dtype=torch.float64).as_strided(  # noqa: E731
        (3, 2), (1, 3))
    g = lambda x: (x.t() * 2).to(device=x.device, dtype=torch.float32).t().as_strided(  # noqa
        (3, 2), (1, 3))
    x = torch.randn(2, 3)
    assert_close(plait.jit(f)(x), f(x))
    # the view of a result whose eager layout was never derived reports the view of
    # plait's report (here transposed, where eager's is contiguous): refused, not misread
    with pytest.raises(PlaitError, match="otherwise than plait reports it"):
        plait.jit(g)(x.double())


def test_as_strided_reads_a_views_strides_as_eager_lays_it_out():
    """Longformer's chunking: heads cut from a projection (divided in place) by views, a
    reshape that is a view in eager, overlapping chunks made by as_strided from the strides
    the view reports. Views report eager's strides of their base, so the chunks are
    eager's, through functionalization's regenerated views as well; so are the gradients."""
    def chunks(x, w):
        q = x @ w  # (seq, batch, heads * d)
        q /= 2
        seq, b = q.shape[:2]
        q = q.view(seq, b, 2, 3).transpose(0, 1).transpose(1, 2).reshape(b * 2, seq, 3)
        q = q.view(b * 2, seq // 4, 4, 3)
        size, stride = list(q.size()), list(q.stride())
        size[1], stride[1] = size[1] * 2 - 1, stride[1] // 2
        return q.as_strided(size=size, stride=stride)

    x, w = torch.randn(8, 2, 5), torch.randn(5, 6, requires_grad=True)
    for backend in ("eager", "cpp"):
        assert_close(plait.jit(chunks, backend=backend)(x, w), chunks(x, w))
    got = torch.autograd.grad(plait.jit(chunks)(x, w).square().sum(), w)
    assert_close(got, torch.autograd.grad(chunks(x, w).square().sum(), w))


def test_results_take_eagers_layout_of_each_operand_layout_derived_once_per_layout():
    """Eager's layout of a result is derived from its ops' meta kernels, each derivation once
    per operand types and layouts (a model's repeated blocks share them): one function
    compiled for a transposed and a contiguous argument returns each in eager's layout."""
    f = plait.jit(lambda a: (a + 1).relu())
    x = torch.randn(3, 4)
    for arg in (x.t(), x.t().contiguous(), x.t()):
        got, want = f(arg), (arg + 1).relu()
        assert_close(got, want)
        assert got.stride() == want.stride()


def test_as_strided_reads_the_strides_of_views_of_what_dropout_made():
    """Longformer in training: its chunking (as_strided from a view's strides) reads what
    passed through dropout, whose mask torch's C++ draws as bernoulli of empty_like(x):
    eager's layout of the draw is derived from its operand's, so the views' strides are
    known, and with one seed the chunks are eager's."""
    def chunks(x):
        h = torch.nn.functional.dropout(x, 0.5, training=True)  # (seq, batch, heads * d)
        q = h.view(8, 2, 2, 3).transpose(0, 1).transpose(1, 2).reshape(4, 8, 3)
        q = q.view(4, 2, 4, 3)
        size, stride = list(q.size()), list(q.stride())
        size[1], stride[1] = size[1] * 2 - 1, stride[1] // 2
        return q.as_strided(size=size, stride=stride)

    x = torch.randn(8, 2, 6)
    torch.manual_seed(0)
    got = plait.jit(chunks)(x)
    torch.manual_seed(0)
    assert_close(got, chunks(x))


def test_a_mean_pooled_channels_last_view_is_restrided_in_place_as_eager_does():
    """ATen pools a channels-last input to 1x1 as a mean and restrides the result in place
    (as_strided_ on dims of size 1): a permuted view reports eager's channels-last strides,
    so the restride reaches the trace, and changes no element (Swin's head)."""
    def head(x, w):
        y = torch.nn.functional.adaptive_avg_pool2d((x * w).permute(0, 3, 1, 2), 1)
        return y.flatten(1)

    x, w = torch.randn(2, 4, 4, 3), torch.randn(3, requires_grad=True)
    assert_close(plait.jit(head)(x, w), head(x, w))
    got = torch.autograd.grad(plait.jit(head)(x, w).square().sum(), w)
    assert_close(got, torch.autograd.grad(head(x, w).square().sum(), w))


def test_as_strided_on_a_convolution_of_a_channels_last_image_is_refused():
    """Eager's convolution of a channels-last image is channels-last (its kernel picks the
    layout on its device, which a meta kernel cannot tell): raw strides that assume
    plait's contiguous report would address other elements, so they are refused."""
    image = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    w = torch.randn(4, 3, 3, 3)
    f = lambda image: F.conv2d(image, w).as_strided([2, 4, 36], [144, 36, 1])  # noqa: E731
    assert not F.conv2d(image, w).is_contiguous()
    with pytest.raises(PlaitError, match="otherwise than plait reports it"):
        plait.jit(f)(image)
    g = lambda image: F.conv2d(image, w).relu().as_strided([2, 4, 36], [144, 1, 4])  # noqa
    assert_close(plait.jit(g)(image.contiguous()), g(image.contiguous()))


# -- arguments that repeat their elements (NOTE [strided arguments]) -----------------------
def test_a_broadcast_argument_is_read_where_it_is_never_repeated_in_memory():
    x = torch.randn(1, 3000).expand(3000, 3000)
    f = lambda x: x.amax(0) + x.sum(1)  # noqa: E731
    jitted = plait.jit(f, backend="cpp")
    assert_close(jitted(x), f(x))
    lowered = jitted.lower(x)
    assert [t.shape for t in lowered.graph.input_types] == [(1, 3000)]
    assert lowered.stats["bytes_read"] == 3000 * 4  # the row it repeats, not 36 MB


@pytest.mark.parametrize("backend", ["cpp", "eager", "loops"])
def test_broadcast_arguments_along_any_dim_train_and_guard_as_eager(backend):
    w = torch.randn(2, 1, 3, requires_grad=True)
    mask = torch.ones(1, 4, 1).expand(2, 4, 3)

    def f(w, mask):
        y = (w * mask).cumsum(1) * torch.arange(3.0)
        return y.sum() if (mask > 0).any() else -y.sum()

    jitted = plait.jit(f, backend=backend)
    for m in (mask, -mask, mask):
        want = torch.autograd.grad(f(w.expand(2, 4, 3), m), w)
        got = torch.autograd.grad(jitted(w.expand(2, 4, 3), m), w)
        assert_close(got, want)
    assert jitted.trace_count == 2  # one per branch: the broadcast dims are one signature


def test_writing_into_a_broadcast_argument_is_refused_as_eager_refuses_it():
    x = torch.randn(1, 3).expand(2, 3)
    with pytest.raises(RuntimeError, match="single memory location"):
        torch.randn(1, 3).expand(2, 3).add_(1)
    with pytest.raises(TraceError, match="repeats its elements"):
        plait.jit(lambda x: x.add_(1))(x)


def test_a_permuted_argument_is_read_in_place_in_the_order_of_its_addresses():
    x = torch.randn(300, 200).T
    image = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    w = torch.randn(4, 3, 3, 3)
    f = lambda x, image: (x.cumsum(0), torch.nn.functional.conv2d(image, w))  # noqa: E731
    jitted = plait.jit(f, backend="cpp")
    assert_close(jitted(x, image), f(x, image))
    assert_close(jitted(x.contiguous(), image), f(x, image))  # another signature
    assert jitted.trace_count == 2
    lowered = jitted.lower(x, image)
    # what the program reads is the arguments' memory as it lies: no copy per call
    assert [t.shape for t in lowered.graph.input_types][:2] == [(300, 200), (2, 8, 8, 3)]


@pytest.mark.parametrize("backend", ["cpp", "eager"])
def test_writing_into_a_permuted_argument_writes_it_as_eager(backend):
    def f(x, y):
        x[0] += 1
        y.mul_(2)
        return x.sum(1)

    def arguments():
        torch.manual_seed(0)
        return torch.randn(4, 3).T, torch.randn(2, 3, 4).permute(2, 0, 1)

    want_args, got_args = arguments(), arguments()
    want, got = f(*want_args), plait.jit(f, backend=backend)(*got_args)
    assert_close(got, want)
    assert_close(got_args, want_args)
    assert got_args[0].stride() == want_args[0].stride()


def test_gradients_of_permuted_and_sliced_arguments_are_eagers():
    leaf = torch.randn(4, 3).T.detach().requires_grad_()  # a leaf that is not contiguous
    base = torch.randn(5, 6, requires_grad=True)
    f = lambda a, b: (a.T @ b[::2, 1:4]).tanh().sum()  # noqa: E731
    want = torch.autograd.grad(f(leaf, base), (leaf, base))
    got = torch.autograd.grad(plait.jit(f, backend="cpp")(leaf, base), (leaf, base))
    assert_close(got, want)
    assert got[0].shape == leaf.shape


def test_strided_arguments_under_torch_func_transforms_are_passed_as_they_are():
    f = lambda x: (x * 2).cumsum(0)  # noqa: E731
    jitted = plait.jit(f)
    transposed = torch.randn(5, 3, 4).transpose(1, 2)  # each example [4, 3], transposed
    repeated = torch.randn(2, 1, 3).expand(2, 4, 3)
    for x in (transposed, repeated):
        assert_close(torch.func.vmap(jitted)(x), torch.func.vmap(f)(x))
    leaf = torch.randn(4, 3).T
    assert_close(torch.func.grad(lambda t: jitted(t).sum())(leaf),
                 torch.func.grad(lambda t: f(t).sum())(leaf))


def test_vjp_fn_of_a_permuted_primal_under_vmap_and_recorded_is_torch_funcs():
    f = lambda x: (x.sin() * torch.arange(3.0)).cumsum(1)  # noqa: E731
    x = torch.randn(3, 4).T
    _, want_fn = torch.func.vjp(f, x)
    _, vjp_fn = plait.vjp(f, x)
    cts = torch.randn(5, 4, 3)
    assert_close(plait.vmap(vjp_fn)(cts), torch.func.vmap(want_fn)(cts))
    with torch.no_grad():  # recorded when called with grad on
        _, vjp_fn = plait.vjp(f, x.requires_grad_())
    assert_close(vjp_fn(cts[0]), want_fn(cts[0]))


@pytest.mark.parametrize("backend", ["cpp", "eager",
                                     pytest.param("triton", marks=pytest.mark.slow)])
def test_a_channels_last_models_weights_are_read_where_they_lie(backend):
    """model.to(memory_format=torch.channels_last): its convolutions' weights are passed as
    views of their memory and the convolution reads them so (no kernel copies them per
    call); trained, its gradients are eager's; the same model made contiguous again is
    another signature, not a wrong reading of the old one's memory."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 2), torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3, groups=2))
    model = model.to(memory_format=torch.channels_last)
    reference = copy.deepcopy(model)
    image = torch.randn(2, 3, 10, 10).to(memory_format=torch.channels_last)
    jitted = plait.jit(model, backend=backend)
    for _ in range(2):  # (BatchNorm's running statistics written back each step)
        jitted(image).square().sum().backward()
        reference(image).square().sum().backward()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert_close(got.grad, want.grad, atol=1e-4, rtol=1e-4, msg=name)
    assert_close(model[1].running_var, reference[1].running_var)
    with torch.no_grad():
        lowered = jitted.lower(image)
        weights = [i for i, t in enumerate(lowered.graph.input_types) if len(t.shape) == 4][1:]
        assert [lowered.graph.input_types[i].shape for i in weights] == [(8, 2, 2, 3),
                                                                        (4, 3, 3, 4)]
        if backend != "eager":
            assert not any(f"in{i}" in k.reads for k in lowered.kernels for i in weights
                           if "extern" not in k.name)
    model.to(memory_format=torch.contiguous_format)
    reference.to(memory_format=torch.contiguous_format)
    with torch.no_grad():
        assert_close(jitted(image), reference(image))
    assert jitted.trace_count == 3  # training, inference, and contiguous weights


@pytest.mark.parametrize("native", [True, False])
def test_a_parameter_given_other_data_in_place_is_keyed_again(native, monkeypatch):
    """The same Parameter object with new data of another layout, offset or shape: the
    keys of the module's tensors, checked natively at each call (or, on a torch without
    that check, keyed at each call), see it (NOTE [native tensor checks])."""
    from plait.tracer import state

    if not native:
        monkeypatch.setattr(state, "_TensorGuards", None)
    model = torch.nn.Linear(4, 3)
    jitted = plait.jit(model, backend="cpp")
    x = torch.randn(2, 4)
    for data in (torch.randn(3, 4), torch.randn(4, 3).t(), torch.randn(20)[2:14].view(3, 4),
                 torch.randn(3, 4), torch.randn(5, 4)):
        model.weight.data = data
        if data.shape[0] == 5:
            model.bias.data = torch.randn(5)
        with torch.no_grad():
            assert_close(jitted(x), model(x))
    assert jitted.trace_count == 4  # the second contiguous weight is the first's signature


# -- eager's layouts of results (NOTE [eager's layouts of results]) --------------------------
PERMUTED_RESULTS = {
    "transpose of an argument": lambda a: a.t(),
    "transpose of a product": lambda a: (a * 2).t(),
    "permuted, then added to": lambda a: a.reshape(3, 2, 2).permute(2, 0, 1) + 1,
    "two, one permuted": lambda a: (a.sin(), a.cos().t()),
    # eager copies where .contiguous() meets another layout, though tracers report theirs
    # contiguous (these come back contiguous, and transposed)
    "a transpose made contiguous": lambda a: a.t().contiguous(),
    "made contiguous, transposed back": lambda a: (a.t() * 2).contiguous().t(),
    "channels-last made contiguous": lambda a: a.reshape(1, 3, 2, 2).contiguous(
        memory_format=torch.channels_last).contiguous() + 1,
}


@pytest.mark.parametrize("name, backend", [(name, backend) for name in PERMUTED_RESULTS
                                           for backend in ("eager", "cpp")]
                         + [("transpose of a product", "triton")])
def test_a_result_eager_lays_out_permuted_comes_back_with_eagers_strides(name, backend):
    f, a = PERMUTED_RESULTS[name], torch.randn(3, 4)
    got, want = plait.jit(f, backend=backend)(a), f(a)
    for g, w in zip(*map(torch.utils._pytree.tree_leaves, (got, want))):
        assert_close(g, w)
        assert g.stride() == w.stride()


@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_a_transposed_argument_comes_back_as_a_view_of_it(backend):
    a = torch.randn(3, 4)
    got = plait.jit(lambda a: a.t(), backend=backend)(a)
    assert got.data_ptr() == a.data_ptr() and got.stride() == (1, 4)


@pytest.mark.parametrize("backend", ["eager", "cpp"])
@pytest.mark.parametrize("layout", ["all", "none"])
def test_a_channels_last_convolutions_result_is_channels_last(layout, backend):
    """As eager's: and with the convolutions channels-last in the graph, the result is the
    convolution's output as it lies (no transpose copies it back and forth). Its gradients
    flow back through the view."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)
    image = torch.randn(2, 3, 10, 10).to(memory_format=torch.channels_last)
    reference = copy.deepcopy(model)
    with plait.config.patch(channels_last=layout):
        jitted = plait.jit(model, backend=backend)
        got, want = jitted(image), reference(image)
        assert got.stride() == want.stride() and got.is_contiguous(
            memory_format=torch.channels_last)
        assert_close(got, want, atol=1e-5, rtol=1e-5)
        (got * torch.arange(4.).view(4, 1, 1)).sum().backward()
        (want * torch.arange(4.).view(4, 1, 1)).sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)
        if layout == "all":
            with torch.no_grad():
                graph = jitted.lower(image).graph
            # the image and the weights are read where they lie, and the result is
            # computed where it lies: only weights, biases and constants are transposed
            assert graph.output_types[0].shape == (2, 6, 6, 4)
            moved = [graph.operands(n)[0].node for n in graph.order
                     if graph.node(n).prim == "transpose"]
            assert {graph.node(n).prim for n in moved} <= {"input", "broadcast_in_dim", "full"}


def test_vjp_fn_of_a_permuted_result_called_inside_a_trace():
    """torch.func's vjp_fn, given a cotangent of the result's shape, inside vmap."""
    f, x = (lambda x: (x * x).t()), torch.randn(3, 4)
    cts = torch.randn(5, 4, 3)
    got = plait.vmap(plait.vjp(f, x)[1])(cts)
    want = torch.func.vmap(torch.func.vjp(f, x)[1])(cts)
    assert_close(got, want)


# -- branches on values (NOTE [value guards]) ------------------------------------------------
def test_a_branch_on_a_bool_of_the_arguments_compiles_each_branch_once():
    def f(x, mask):
        if (mask > 0).any():
            return x * 2
        return x - 1

    jitted, x = plait.jit(f), torch.randn(4)
    for mask in [torch.zeros(4), torch.ones(4), torch.zeros(4), torch.tensor([0., 1, 0, 0])]:
        assert_close(jitted(x, mask), f(x, mask))
    assert jitted.trace_count == 2


def test_a_branch_on_a_bool_trains_through_each_branch():
    model = torch.nn.Linear(3, 3)

    def loss(model, x):
        y = model(x)
        return (y.sin() if y.sum() > 0 else y.cos()).sum()

    jitted = plait.jit(loss)
    for sign in (1, -1, 1):
        x = sign * torch.ones(2, 3) * 10
        want = torch.autograd.grad(loss(model, x), model.weight)
        got = torch.autograd.grad(jitted(model, x), model.weight)
        assert_close(got, want)
    assert jitted.trace_count == 2


@pytest.mark.parametrize("case", ["random", "number", "transform"])
def test_a_branch_plait_cannot_guard_is_refused(case):
    x = torch.randn(4)
    if case == "random":  # a draw is made anew at each call: no value to guard
        fn = plait.jit(lambda x: x * 2 if torch.rand(()) > 0.5 else x)
    elif case == "number":  # a guard on a float would compile once per value
        fn = plait.jit(lambda x: x / x.abs().max().item())
    else:  # under a transform no call tensors exist
        fn = plait.grad(lambda x: (x.sin() if x.sum() > 0 else x.cos()).sum())
    with pytest.raises(plait.errors.ConcretizationError,
                       match="random draw" if case == "random" else "concrete value"):
        fn(x)


class _LayerDrop(torch.nn.Module):
    """transformers' LayerDrop as versions before 5.20 write it: a draw every training step,
    then a branch on it, followed by dropout (which reads the generator after the draw)."""

    def __init__(self, layerdrop: float):
        super().__init__()
        self.layers, self.layerdrop = torch.nn.ModuleList(
            torch.nn.Linear(6, 6) for _ in range(3)), layerdrop
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x):
        for layer in self.layers:
            if self.training:
                if torch.rand([]) < self.layerdrop:  # skip the layer
                    continue
            x = self.dropout(layer(x).relu())
        return x.sum()


def test_a_branch_on_a_draw_that_its_range_decides_traces_and_draws_as_eager():
    """NOTE [values decided by ranges]: with layerdrop 0 no draw is below it; the draws stay,
    so the dropout masks after them are eager's under the same seed."""
    model, x = _LayerDrop(0.0), torch.randn(4, 6)
    jitted = plait.jit(model)
    for seed in range(3):
        torch.manual_seed(seed)
        want = torch.autograd.grad(model(x), model.layers[0].weight)
        torch.manual_seed(seed)
        got = torch.autograd.grad(jitted(x), model.layers[0].weight)
        assert_close(got, want)
    assert jitted.trace_count == 1
    # decided under a transform too (no call tensors), and from either side of the comparison
    grad = plait.grad(lambda x: x.sin().sum() if 0.0 <= torch.rand(()) else x.sum())
    assert_close(grad(x), x.cos())


def test_a_branch_on_a_draw_its_range_does_not_decide_is_refused():
    with pytest.raises(plait.errors.ConcretizationError, match="LayerDrop"):
        plait.jit(_LayerDrop(0.1))(torch.randn(4, 6))


# -- the retrace warning ---------------------------------------------------------------------
@pytest.mark.parametrize("case", ["shape", "int", "layout"])
def test_the_retrace_warning_names_the_argument_what_changes_and_the_fix(case, caplog):
    # sizes that vary compile once unless told not to (tests/test_dynamic.py)
    f = plait.jit(lambda x, n: x * n, dynamic=False if case == "shape" else None)
    with caplog.at_level(logging.WARNING, logger="plait.cache"):
        for i in range(1, 12):
            if case == "shape":
                f(torch.randn(4, i), 2.0)
            elif case == "int":
                f(torch.randn(4), i)
            else:  # the same shape, other strides
                f(torch.randn(4, 4 * i)[:, ::i], 2.0)
    (message,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    want = {"shape": ("argument 0", "dim 1: 8, then 9", "Leave dynamic unset"),
            "int": ("argument 1", "8, then 9", "Pass a tensor"),
            "layout": ("argument 0", "memory layout", "x.contiguous()")}[case]
    assert all(w in message for w in want), message
