"""plait.distributed and the collective primitives, on two gloo processes (CPU).

One torchrun launch of this file (``python -m torch.distributed.run ... test_distributed.py
DIR``) runs every check in ``CHECKS`` on both ranks; each rank writes check name -> "ok" or the
failure to ``DIR/rank<r>.json`` after every check, and ``test_collectives[<check>]`` asserts
that both ranks passed it. References: eager torch.distributed for values, and the
single-process math of each collective (every rank rebuilds every rank's input) for
torch.autograd gradients, torch.func JVPs and per-example loops.
"""
from __future__ import annotations

import datetime
import faulthandler
import itertools
import json
import os
import subprocess
import sys
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist

import plait
from plait.errors import DistributedError
from plait.graph.loops import Extern, Wait

W = 2  # ranks
CHECKS: dict = {}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (collective, options) pairs, each checked on every spelling, backend and transform.
CASES = [("all_reduce", {"op": op}) for op in ("sum", "avg", "max", "min")] + [
    ("all_gather", {"dim": 0}), ("all_gather", {"dim": 1}),
    ("reduce_scatter", {"op": "sum", "dim": 0}), ("reduce_scatter", {"op": "avg", "dim": 1}),
    ("all_to_all", {"dim": 0}), ("all_to_all", {"dim": 1}), ("broadcast", {"src": 1})]


def case_name(name, options) -> str:
    return name + "".join(f"-{k}={v}" for k, v in options.items())


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def make_input(rank: int, *batch: int) -> torch.Tensor:
    """Rank ``rank``'s input: float64, ties across ranks in its first row (max/min split
    their gradient there), dims 4 and 6 that two ranks divide."""
    x = torch.randn(*batch, 4, 6, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(100 + rank))
    x[..., 0, :3] = torch.arange(3.0)
    return x


# ---------------------------------------------------------------------------------------
# Three ways to compute a collective on this rank, and its single-process math
# ---------------------------------------------------------------------------------------
def plait_collective(x, name, options):
    return getattr(plait.distributed, name)(x, **options)


def torch_functional(x, name, options):
    """The same collective through torch.distributed._functional_collectives."""
    import torch.distributed._functional_collectives as fc

    group, dim = dist.group.WORLD, options.get("dim", 0)
    if name == "all_reduce":
        return fc.all_reduce(x, options["op"], group)
    if name == "all_gather":
        return fc.all_gather_tensor(x, dim, group)
    if name == "reduce_scatter":
        return fc.reduce_scatter_tensor(x, options["op"], dim, group)
    if name == "all_to_all":  # along dim 0 only
        return fc.all_to_all_single(x.movedim(dim, 0).contiguous(), None, None,
                                    group).movedim(0, dim)
    return fc.broadcast(x, options["src"], group)


def torch_distributed(x, name, options):
    """Eager torch.distributed (the in-place, non-functional API): the reference."""
    dim = options.get("dim", 0)
    op = getattr(dist.ReduceOp, options.get("op", "sum").upper())
    if name in ("all_reduce", "broadcast"):
        y = x.clone()
        if name == "all_reduce":
            dist.all_reduce(y, op=op)
        else:
            dist.broadcast(y, options["src"])
        return y
    if name == "all_gather":
        parts = [torch.empty_like(x) for _ in range(W)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim)
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // W if name == "reduce_scatter" else moved.shape[0],
                       *moved.shape[1:]), dtype=x.dtype)
    if name == "reduce_scatter":
        dist.reduce_scatter_tensor(out, moved, op=op)
    else:
        dist.all_to_all_single(out, moved)
    return out.movedim(0, dim)


def single_process(xs, rank, name, options):
    """What rank ``rank`` gets, from every rank's input ``xs``, in one process
    (differentiable by torch.autograd and torch.func)."""
    dim = options.get("dim", 0)
    if name == "all_reduce":
        stacked = torch.stack(xs)
        return {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.amax(0),
                "min": stacked.amin(0)}[options["op"]]
    if name == "all_gather":
        return torch.cat(xs, dim)
    if name == "reduce_scatter":
        total = torch.stack(xs).sum(0) / (W if options["op"] == "avg" else 1)
        return total.chunk(W, dim)[rank]
    if name == "all_to_all":
        return torch.cat([x.chunk(W, dim)[rank] for x in xs], dim)
    return xs[options["src"]]


def compare(results: dict) -> None:
    """``results``: case -> (got, expected); raises listing every mismatch."""
    bad = []
    for case, (got, want) in results.items():
        try:
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        except AssertionError as e:
            bad.append(f"{case}: {str(e).splitlines()[0]}\n  got {got}\n  expected {want}")
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------
# Checks (run on both ranks, in this order)
# ---------------------------------------------------------------------------------------
def _jit_matches_torch_distributed(spelling, backend):
    """Every case in one jitted function (so one graph issues eleven collectives in order)."""
    rank = dist.get_rank()
    x = make_input(rank)
    fn = plait.jit(lambda x: [spelling(x, n, o) for n, o in CASES], backend=backend)
    got = fn(x)
    compare({case_name(n, o): (g, torch_distributed(x, n, o)) for g, (n, o) in zip(got, CASES)})
    _assert_chained(fn.lower(x).graph, [n for n, _ in CASES])


for _spelling in (plait_collective, torch_functional):
    for _backend in ("eager", "cpp"):
        CHECKS[f"jit-{_backend}-{_spelling.__name__}"] = (
            lambda s=_spelling, b=_backend: _jit_matches_torch_distributed(s, b))


@check
def eager_plait_matches_torch_distributed():
    """Outside a trace plait.distributed runs at once; the single-process math agrees."""
    rank = dist.get_rank()
    x, xs = make_input(rank), [make_input(r) for r in range(W)]
    compare({case_name(n, o): (plait_collective(x, n, o), torch_distributed(x, n, o))
             for n, o in CASES})
    compare({case_name(n, o): (single_process(xs, rank, n, o), torch_distributed(x, n, o))
             for n, o in CASES})


@check
def coalesced_ops_trace():
    """The _coalesced functional collectives trace as one collective per tensor."""
    import torch.distributed._functional_collectives as fc

    group, x = dist.group.WORLD, make_input(dist.get_rank())
    y = plait.jit(lambda x: fc.all_reduce_coalesced([x, 2 * x], "max", group)
                  + fc.all_gather_into_tensor_coalesced([x, x[:2]], group)
                  + fc.reduce_scatter_tensor_coalesced([x, 3 * x], "avg", [0, 1], group))(x)
    expected = [torch_distributed(x, "all_reduce", {"op": "max"}),
                torch_distributed(2 * x, "all_reduce", {"op": "max"}),
                torch_distributed(x, "all_gather", {"dim": 0}),
                torch_distributed(x[:2], "all_gather", {"dim": 0}),
                torch_distributed(x, "reduce_scatter", {"op": "avg", "dim": 0}),
                torch_distributed(3 * x, "reduce_scatter", {"op": "avg", "dim": 1})]
    compare({str(i): pair for i, pair in enumerate(zip(y, expected, strict=True))})


def _weight(rank, like):
    """A rank-dependent weight, so that each rank's cotangent differs."""
    return torch.linspace(-1, 2, like.numel(), dtype=like.dtype).reshape(like.shape) * (rank + 1)


@check
def grad_matches_torch_autograd():
    """grad of each rank's loss (SPMD: the derivative of the sum of every rank's loss) ==
    torch.autograd through the single-process math, on both backends."""
    rank = dist.get_rank()
    xs = [make_input(r).requires_grad_() for r in range(W)]
    results = {}
    for name, options in CASES:
        outs = [single_process(xs, r, name, options) for r in range(W)]
        total = sum((torch.sin(y) * _weight(r, y)).sum() for r, y in enumerate(outs))
        expected = torch.autograd.grad(total, xs, materialize_grads=True)[rank]
        x = xs[rank].detach()

        def loss(x, name=name, options=options):
            y = plait_collective(x, name, options)
            return (torch.sin(y) * _weight(rank, y)).sum()

        for backend in ("eager", "cpp"):
            results[f"{case_name(name, options)} [{backend}]"] = (
                plait.jit(plait.grad(loss), backend=backend)(x), expected)
    compare(results)


@check
def jvp_matches_torch_func():
    """plait.jvp == torch.func.jvp through the single-process math; the tangent costs one
    more collective (max/min: two, counting the ties), not a derived VJP's several."""
    rank = dist.get_rank()
    xs = [make_input(r) for r in range(W)]
    ts = [make_input(r + W) for r in range(W)]
    ts[1][..., 0, :2] = 5.0  # tied elements with different tangents
    results, counts = {}, []
    for name, options in CASES:
        _, expected = torch.func.jvp(
            lambda *xs, n=name, o=options: single_process(list(xs), rank, n, o),
            tuple(xs), tuple(ts))

        def jvp(x, t, name=name, options=options):
            return plait.jvp(lambda x: plait_collective(x, name, options), (x,), (t,))

        results[case_name(name, options)] = (jvp(xs[rank], ts[rank])[1], expected)
        issued = len(_collective_nodes(plait.make_graph(jvp)(xs[rank], ts[rank])))
        if issued != (3 if options.get("op") in ("max", "min") else 2):
            counts.append(f"{case_name(name, options)}: {issued} collectives")
    compare(results)
    assert not counts, counts


@check
def vmap_matches_a_loop():
    rank = dist.get_rank()
    xb = make_input(rank, 3)
    compare({case_name(n, o): (
        plait.vmap(lambda x, n=n, o=o: plait_collective(x, n, o))(xb),
        torch.stack([plait_collective(x, n, o) for x in xb])) for n, o in CASES})


def _collective_nodes(graph):
    names = {n for n, _ in CASES} | {"reduce"}
    return [n for n in graph.order if graph.node(n).prim in names]


def _assert_chained(graph, expected):
    """The collectives, in graph order, are ``expected``, each ordered after the one before
    by a control edge."""
    nodes = _collective_nodes(graph)
    assert [graph.node(n).prim for n in nodes] == expected, graph.as_text()
    edges = set(graph.control_edges())
    missing = [(a, b) for a, b in itertools.pairwise(nodes) if (a, b) not in edges]
    assert not missing, f"no control edge for {missing} in\n{graph.as_text()}"


@check
def collectives_keep_program_order():
    """Independent collectives keep program order: a control edge from each to the next, in
    the traced, simplified, differentiated and lowered programs; an unused result still
    communicates (simplify keeps it)."""
    pd = plait.distributed

    def f(x, y):
        a = pd.all_reduce(y)        # independent of b: only the control edge orders them
        b = pd.all_gather(x)
        pd.broadcast(x, src=0)      # result unused
        return b.sum() + a.sum()

    x, y = make_input(dist.get_rank()), make_input(dist.get_rank() + W)
    expected = ["all_reduce", "all_gather", "broadcast"]
    _assert_chained(plait.make_graph(f)(x, y), expected)
    lowered = plait.jit(f, backend="cpp").lower(x, y)
    _assert_chained(lowered.traced_graph, expected)
    _assert_chained(lowered.graph, expected)
    # backward: the transposes run in reverse order, after the forward collectives (the
    # broadcast's result gets no cotangent: no transpose)
    _assert_chained(plait.make_graph(plait.grad(f, argnums=(0, 1)))(x, y),
                    expected + ["reduce_scatter", "all_reduce"])
    externs = [k.source.split(" = ")[1].split("(")[0] for k in lowered.kernels
               if k.name.startswith("extern")]  # after fusion and the memory passes
    assert externs == expected, lowered.source
    got = plait.jit(f, backend="cpp")(x, y)
    torch.testing.assert_close(got, f(x, y))


def _overlapped(x, w):
    """Collectives with compute that needs none of their results in between."""
    pd = plait.distributed
    a = pd.all_reduce(x * 2)
    g = pd.all_gather(x.exp(), dim=1)
    h = torch.sin(w @ w).sum()
    return a + h, g * 2, pd.reduce_scatter(a, op="avg")


@check
def compute_runs_between_a_collectives_start_and_wait():
    """Compiled, each collective starts before, and is waited for after, compute that does
    not need it; the results are eager's, on both compiling backends."""
    rank = dist.get_rank()
    x, w = make_input(rank), make_input(rank + W)[:, :4]
    a = torch_distributed(x * 2, "all_reduce", {"op": "sum"})
    h = torch.sin(w @ w).sum()
    expected = [a + h, torch_distributed(x.exp(), "all_gather", {"dim": 1}) * 2,
                torch_distributed(a, "reduce_scatter", {"op": "avg", "dim": 0})]
    for backend in ("cpp", "triton"):
        lowered = plait.jit(_overlapped, backend=backend).lower(x, w)
        kernels = lowered.compiled.program.kernels
        starts = {k.name: i for i, k in enumerate(kernels) if getattr(k, "collective", False)}
        waits = {k.start: i for i, k in enumerate(kernels) if isinstance(k, Wait)}
        assert set(starts) == set(waits) and len(starts) == 3, lowered.compiled.wrapper_source
        overlapped = [n for n in starts if any(  # compute while it communicates
            not isinstance(k, Wait) and not getattr(k, "collective", False)
            for k in kernels[starts[n] + 1:waits[n]])]
        assert len(overlapped) >= 2, lowered.compiled.wrapper_source
        compare({f"{backend} {i}": (g, e) for i, (g, e) in enumerate(
            zip(plait.jit(_overlapped, backend=backend)(x, w), expected, strict=True))})


@check
def comm_buffers_are_planned_alike_on_every_rank():
    """A comm buffer type that runs on gloo (a plain allocation, the regular all-reduce)
    stands in for symmetric memory: the operand is computed into the pool, every rank plans
    the same pools and offsets, and the results are eager's."""
    from plait.tracer import collectives

    def all_reduce(x, group_name):
        return torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_reduce(x, "sum", group_name))

    def f(x):
        pd = plait.distributed
        return pd.all_reduce(x * 2), pd.all_reduce(x.sum(0)), pd.all_reduce(x, op="max")

    x = make_input(dist.get_rank())
    collectives.COMM_BUFFER_TYPES["fake"] = collectives.CommBufferType(
        "fake", lambda group, t: True,
        lambda nbytes, device, group, alloc_id: torch.empty(nbytes, dtype=torch.uint8),
        all_reduce, "fake_all_reduce")
    try:
        lowered = plait.jit(f, backend="cpp").lower(x)
        got = lowered.compiled([x])  # compiled while the type is there
    finally:
        del collectives.COMM_BUFFER_TYPES["fake"]
    (pool,) = lowered.memory["comm_pools"]
    assert len(pool["comm"]) == 2 and pool["type"] == "fake", pool
    plans = [None] * W
    dist.all_gather_object(plans, (lowered.compiled.wrapper_source, pool))
    assert plans[0] == plans[1]
    compare({str(i): (g, torch_distributed(e, "all_reduce", {"op": op})) for i, (g, e, op) in
             enumerate(zip(got, (x * 2, x.sum(0), x), ("sum", "sum", "max")))})


@check
def symmetric_memory_falls_back_on_gloo():
    """Symmetric memory enabled for the group: on CPU tensors the regular collective runs."""
    plait.distributed.enable_symmetric_memory()
    x = make_input(dist.get_rank())
    lowered = plait.jit(lambda x: plait.distributed.all_reduce(x * 2), backend="cpp").lower(x)
    assert lowered.memory["comm_pools"] == ()
    assert [k.label for k in lowered.compiled.program.kernels if isinstance(k, Extern)] == \
        ["all_reduce"]
    compare({"sum": (lowered.compiled([x])[0], torch_distributed(x * 2, "all_reduce",
                                                                  {"op": "sum"}))})


@check
def bad_arguments_raise_distributed_error():
    pd, x = plait.distributed, make_input(dist.get_rank())
    cases = {
        "unknown reduce op": (lambda: pd.all_reduce(x, op="median"), "unknown reduce op"),
        "avg of integers": (lambda: pd.all_reduce(x.long(), op="avg"), "floating-point"),
        "not divisible": (lambda: pd.reduce_scatter(x[:3]), "not divisible by the group"),
        "all_to_all not divisible": (lambda: pd.all_to_all(x[:, :5], dim=1), "not divisible"),
        "src out of range": (lambda: pd.broadcast(x, src=2), "src=2 is not a rank"),
        "dim out of range": (lambda: pd.all_gather(x, dim=2), "dim=2 is out of range"),
        "unknown group": (lambda: pd.all_reduce(x, group="no-such-group"), "no process group"),
        "not a tensor": (lambda: pd.all_reduce([1.0]), "takes a tensor"),
        "traced, unknown op": (lambda: plait.jit(lambda x: pd.all_reduce(x, "prod"))(x),
                               "unknown reduce op"),
        "traced op, not divisible": (lambda: plait.jit(
            lambda x: torch.ops._c10d_functional.reduce_scatter_tensor(x[:3], "sum", W, "0"))(x),
            "not divisible"),
        "in-place torch.distributed.all_reduce": (
            lambda: plait.jit(lambda x: (dist.all_reduce(x), x)[1])(x.clone()),
            "plait.distributed.all_reduce"),
        "unequal all_to_all splits": (lambda: plait.jit(lambda x: __import__(
            "torch.distributed._functional_collectives", fromlist=["x"]).all_to_all_single(
            x, [1, 3], [3, 1], dist.group.WORLD))(x), "equal splits"),
    }
    failures = []
    for what, (call, words) in cases.items():
        try:
            call()
            failures.append(f"{what}: no error")
        except DistributedError as e:
            if words not in str(e):
                failures.append(f"{what}: {e!r} does not say {words!r}")
        except Exception as e:  # noqa: BLE001 (any other error is a failure to report)
            failures.append(f"{what}: {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------
# The launch (torchrun runs this file) and the tests
# ---------------------------------------------------------------------------------------
def run_checks(out_dir: str, checks: dict) -> None:
    """On each rank of a gloo group: every check in turn, its outcome ("ok" or the end of its
    traceback) written to ``rank<r>.json`` in ``out_dir`` as it ends."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, results = dist.get_rank(), {}
    fault = open(os.path.join(out_dir, f"rank{rank}.fault"), "w")  # noqa: SIM115 (to exit)
    faulthandler.enable(fault, all_threads=True)  # a crash's Python stacks, for the test
    try:
        for name, fn in checks.items():
            try:
                fn()
                results[name] = "ok"
            except Exception:  # noqa: BLE001 (reported to the test)
                results[name] = traceback.format_exc(limit=-6)
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(results, f)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def worker(out_dir: str) -> None:
    warnings.simplefilter("ignore", FutureWarning)  # torch's deprecated functional names
    run_checks(out_dir, CHECKS)


def torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``W`` ranks of ``args``, compiling into the test session's cache (conftest.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PLAIT_CACHE_DIR=plait.config.cache_dir)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={W}", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT, check=False)


def launch(script: str, out, *args: str) -> tuple:
    """torchrun of ``script`` with ``out`` and ``args``, whose ranks report through
    ``run_checks``: the run, and each rank's outcomes. A launch where a rank died of a signal
    (faulthandler wrote its stacks) runs once more, in a folder of its own, with a warning
    that shows the stacks: a crash on a loaded machine (seen once, never reproduced) must be
    seen, and the checks of the run that completes still decide."""
    run, per_rank, faults = _launch_once(script, out / "first", *args)
    if faults:
        warnings.warn(f"a rank of {os.path.basename(script)} crashed; launched again:\n"
                      f"{faults}")
        run, per_rank, again = _launch_once(script, out / "again", *args)
        if again:
            run.stderr += f"\n{again}"
    return run, per_rank


def _launch_once(script: str, out, *args: str) -> tuple:
    out.mkdir()
    run = torchrun(script, str(out), *args)
    faults = "\n".join(f"rank {r}:\n{text}" for r in range(W)
                       if (path := out / f"rank{r}.fault").exists()
                       and (text := path.read_text()))
    return run, [json.loads(path.read_text()) if (path := out / f"rank{r}.json").exists()
                 else {} for r in range(W)], faults


def assert_passed(results, name: str) -> None:
    run, per_rank = results
    for rank, result in enumerate(per_rank):
        assert name in result, (f"rank {rank} did not report {name!r}; torchrun exited "
                                f"{run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
        assert result[name] == "ok", f"rank {rank} failed {name}:\n{result[name]}"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(os.path.abspath(__file__), tmp_path_factory.mktemp("distributed"))


@pytest.mark.parametrize("name", list(CHECKS))
def test_collectives(results, name):
    assert_passed(results, name)


def test_data_parallel_example_matches_single_process_training():
    run = torchrun(os.path.join(ROOT, "examples", "data_parallel.py"))
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    for rank in range(W):
        assert f"rank {rank}: loss and weights match" in run.stdout, run.stdout


def test_no_process_group_raises():
    """In this (pytest) process no process group exists: eager and traced calls say so."""
    assert not (dist.is_available() and dist.is_initialized())
    x = torch.ones(4)
    for call in (lambda: plait.distributed.all_reduce(x),
                 lambda: plait.jit(lambda x: plait.distributed.all_gather(x))(x)):
        with pytest.raises(DistributedError, match="no process group is initialized"):
            call()


if __name__ == "__main__":
    worker(sys.argv[1])
