"""CUDA graph replay of compiled programs (NOTE [CUDA graphs], backends/cuda_graphs.py).

The bookkeeping (static and dynamic inputs, lent and copied outputs, captures again, refusals)
is tested on the CPU with a recorder whose replay reruns the program and writes its results
into the captured outputs' memory, as a graph's replay does. The tests at the end run real
graphs and need a CUDA GPU."""
from __future__ import annotations

import weakref

import pytest
import torch

import plait
from plait.backends import cuda_graphs

CPU = torch.device("cpu")


class _Rerun:
    """A stand-in for CUDA graphs: a capture runs the program once on its buffers, a replay
    runs it again on the graph's buffers and the static inputs where they are (the caller's,
    at the addresses the graph read) and copies the results into the captured outputs. A
    replay writes NaN over the outputs of the graphs captured after it into its pool (whose
    memory its temporaries had)."""

    def __init__(self, fail: bool = False, synchronizes: bool = False):
        self.fail, self.syncs, self.captures, self.replays, self.checks = \
            fail, synchronizes, 0, 0, 0
        self.pools: dict[int, list] = {}  # pool -> each capture's (graph, outputs) in order

    @staticmethod
    def reserved(device) -> int:
        return 0

    def synchronizes(self, run, inputs, device):
        self.checks += 1
        return run(inputs, device), self.syncs

    def capture(self, run, buffers, device, pool=None):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        outputs = run(buffers, device)
        graph = (run, device, len(self.pools) if pool is None else pool)
        # (weakly: a reference here would count as the caller's)
        self.pools.setdefault(graph[2], []).append((graph, [weakref.ref(o) for o in outputs]))
        return graph, outputs

    @staticmethod
    def pool(graph):
        return graph[2]

    def replay(self, capture, inputs) -> None:
        self.replays += 1
        run, device, pool = capture.graph
        members = [g for g, _ in self.pools[pool]]
        for _, outputs in self.pools[pool][members.index(capture.graph) + 1:]:
            for o in outputs:
                if o() is not None:
                    o().fill_(float("nan"))
        buffers = [x if b is None else b for b, x in zip(capture.buffers, inputs)]
        for o, n in zip(capture.outputs, run(buffers, device)):
            if o is not None:  # None: an output on a static input, rebuilt on it
                o.copy_(n)


def _graphed(fn, recorder, constants=(), sized=False):
    calls = []

    def run(inputs, device):
        calls.append(1)
        return [fn(*inputs)]

    return cuda_graphs.Graphed(run, lambda device: list(constants), recorder, sized), calls


def test_static_inputs_are_read_in_place_and_dynamic_ones_copied():
    recorder = _Rerun()
    graphed, _ = _graphed(lambda w, x: w * 2 + x, recorder)
    w = torch.randn(4)
    for step in range(6):
        x = torch.randn(4)  # a new tensor every call: dynamic
        out = graphed([w, x], CPU)[0]
        assert torch.equal(out, w * 2 + x)
        del out  # the caller drops its result: the next replay may reuse its memory
        w.add_(1.0)  # an optimizer's in-place update: the graph sees it
    assert recorder.captures == 1 and recorder.replays == 4


@pytest.mark.parametrize("fn, captures, replays", [
    # the first replay's result is held for good: the next call captures again, with the
    # result copied out of the graph's memory from then on
    (torch.sin, 2, 6),
    # the program returns its input (a buffer of the graph's own): copied from the start
    (lambda x: x, 1, 6),
])
def test_results_kept_by_the_caller_are_never_overwritten(fn, captures, replays):
    recorder = _Rerun()
    graphed, _ = _graphed(fn, recorder)
    kept = []
    for _ in range(8):
        x = torch.randn(5)
        kept.append((graphed([x], CPU)[0], fn(x).clone()))
    for out, want in kept:
        assert torch.equal(out, want)
    assert (recorder.captures, recorder.replays) == (captures, replays)


def test_the_last_result_held_while_the_next_call_runs():
    """``out = f(x)``: the old result is alive while the next call runs; it is left intact,
    and from then on results are copied out of the graph's memory."""
    recorder = _Rerun()
    graphed, calls = _graphed(lambda x: x.sin(), recorder)
    out = want = None
    for _ in range(8):
        x = torch.randn(5)
        new = graphed([x], CPU)[0]
        if out is not None:
            assert torch.equal(out, want)
        out, want = new, x.sin()
        assert torch.equal(out, want)
    # calls 1-2 warm, 3 captured and replayed, 4 captured again (3's result alive) and
    # replayed, copying out as 5-8 do
    assert recorder.replays == 6 and len(calls) == 2 + 2 + 2 + 4


def test_lent_outputs_are_the_graphs_memory():
    recorder = _Rerun()
    graphed, _ = _graphed(lambda x: x + 1, recorder)
    x = torch.randn(3)
    pointers = []
    for _ in range(6):
        out = graphed([x], CPU)[0]
        assert torch.equal(out, x + 1)
        pointers.append(out.data_ptr())
        del out  # dropped before the next call: lent again, no copy
    assert recorder.replays == 4 and len(set(pointers[2:])) == 1


def test_each_shape_of_the_inputs_replays_its_own_graph():
    """A program of symbolic sizes: inputs of another shape never replay a graph captured at
    one shape; each recurring shape gets its own, the least recently used dropped."""
    recorder = _Rerun()
    graphed, calls = _graphed(lambda x: x * 2, recorder, sized=True)
    shapes = [3, 5, 3, 5, 3, 5, 3, 5] + list(range(6, 6 + cuda_graphs.SHAPES_KEPT)) + [3, 3, 3]
    for n in shapes:
        x = torch.randn(n)
        out = graphed([x], CPU)[0]
        assert torch.equal(out, x * 2)
        del out
    # 3 and 5: two warm calls, a capture at the third (replayed at the fourth); the new
    # shapes pushed 3's graph out: its next three calls warm and capture again
    assert recorder.captures == 3 and len(graphed._state) == cuda_graphs.SHAPES_KEPT


def test_an_output_on_a_static_input_is_lent():
    """A view of a parameter (read where it is, never written by a replay) is returned as a
    view of it, and sees the caller's in-place updates."""
    recorder = _Rerun()
    graphed, _ = _graphed(lambda w, x: w, recorder)
    w = torch.randn(3)
    kept = []
    for _ in range(6):
        kept.append(graphed([w, torch.randn(3)], CPU)[0])
    w.add_(1.0)
    assert all(torch.equal(out, w) for out in kept) and recorder.captures == 1


def test_moved_static_inputs_are_copied_in_after_a_new_capture():
    recorder = _Rerun()
    graphed, _ = _graphed(lambda w, x: w @ x, recorder)
    w, x = torch.randn(3, 3), torch.randn(3)
    for step in range(10):
        if step >= 4:
            w = torch.randn(3, 3)  # w moves from the fifth call, x at the seventh
        if step == 6:
            x = torch.randn(3)
        out = graphed([w, x], CPU)[0]
        assert torch.allclose(out, w @ x)
        del out
    # captured at the third call; again when w moved (read at its new address), again when
    # it moved a second time (copied in from then on), and again when x moved (read in place
    # at its new address, where it stays)
    assert recorder.captures == 4 and graphed._latest[CPU].dynamic == {0}


def test_a_residual_lent_by_one_graph_is_read_in_place_by_the_next():
    """A forward program's residual reaches the backward program at a new address while
    the forward runs launch by launch, then at its graph's one address: the backward reads
    it in place once it has stayed put."""
    forward, _ = _graphed(lambda x: x.exp(), _Rerun())
    backward, _ = _graphed(lambda r, g: r * g, _Rerun())
    for _ in range(10):
        x, g = torch.randn(4), torch.randn(4)
        r = forward([x], CPU)[0]
        assert torch.equal(backward([r, g], CPU)[0], x.exp() * g)
        del r
    assert backward._latest[CPU].dynamic == {1}


def test_a_backward_viewing_its_residual_leaves_the_forward_graph_alone():
    """A backward whose result is a view of a residual it reads in place (a gradient that is
    a reshape of a saved value) does not keep that residual alive: the forward does not
    find its output held and captures once, and the backward reads the residual in place."""
    forward_recorder, backward_recorder = _Rerun(), _Rerun()
    forward, _ = _graphed(lambda x: x.exp(), forward_recorder)
    backward, _ = _graphed(lambda r, g: r.view(2, 2), backward_recorder)
    for _ in range(10):
        x = torch.randn(4)
        r = forward([x], CPU)[0]
        grad = backward([r, torch.randn(4)], CPU)[0]
        assert torch.equal(grad, x.exp().view(2, 2))
        del r, grad
    assert forward_recorder.captures == 1 and not forward._latest[CPU].copied
    assert 0 not in backward._latest[CPU].dynamic


def test_a_backward_shares_its_forwards_memory_and_lends_none_of_it():
    """replays_after: the backward captures into the forward's pool, where the forward's
    next replay writes over the backward's memory; the gradients it returns (kept step after
    step here, as accumulated gradients are) are copies, and stay right. A forward captured
    again (its weight replaced) goes to a pool of its own, and the backward follows it."""
    recorder = _Rerun()
    forward, _ = _graphed(lambda w, x: (w * x).exp(), recorder)
    backward, _ = _graphed(lambda r, g: r * g, recorder)
    backward.replays_after(forward)
    w, kept, pools = torch.randn(4), [], []
    for step in range(12):
        if step == 7:
            w = torch.randn(4)  # moved: the forward captures again
        x, g = torch.randn(4), torch.randn(4)
        r = forward([w, x], CPU)[0]
        kept.append((backward([r, g], CPU)[0], (w * x).exp() * g))
        del r
        if backward._latest[CPU].capture is not None:
            pools.append((forward._latest[CPU].capture.pool, backward._latest[CPU].capture.pool))
    for got, want in kept:
        assert torch.equal(got, want)
    assert pools and all(f == b for f, b in pools)
    assert len({f for f, _ in pools}) == 2  # the forward's second capture: a pool of its own


def test_an_output_within_a_static_input_follows_the_input_at_its_address():
    """An output viewing a static input is rebuilt on the input of each call, counted from
    that input's own first element: another tensor at the same address (another storage, or
    another offset in its storage) gives the same elements."""
    graphed, _ = _graphed(lambda r: r.view(2, 2), _Rerun())
    base = torch.arange(16.0)
    for _ in range(5):
        assert torch.equal(graphed([base[4:8]], CPU)[0], base[4:8].view(2, 2))
    other = torch.from_numpy(base.numpy()[4:])[:4]  # base[4:8]'s address, another storage
    assert other.data_ptr() == base[4:8].data_ptr() and other.storage_offset() == 0
    assert torch.equal(graphed([other], CPU)[0], base[4:8].view(2, 2))


def test_an_input_that_settles_and_moves_by_turns_is_copied_for_good():
    """A seed of loss.backward() keeps its address while the loop runs alone and takes
    another after other work ran between two steps (another model's step, an evaluation):
    read in place once settled, at its new address once, then copied in for good, not
    captured again at every turn until the program gives up its graph."""
    recorder = _Rerun()
    graphed, _ = _graphed(lambda w, g: w * g, recorder)
    w = torch.randn(4)
    places = [torch.randn(()) for _ in range(3)]
    for step in range(40):
        g = places[(step // 4) % 3]  # 4 calls at one address, then the next
        g.fill_(float(step))
        assert torch.equal(graphed([w, g], CPU)[0], w * step)
    state = graphed._latest[CPU]
    assert not state.refused and recorder.captures <= 4 and state.dynamic == {1}


def test_inputs_that_keep_moving_are_copied_in_once_the_captures_reach_their_limit():
    """Each input moves every 5 calls (chained programs capturing again by turns): past
    MAX_CAPTURES every input that moves is copied in, and the captures end."""
    recorder = _Rerun()
    graphed, _ = _graphed(lambda *ws: sum(ws), recorder)
    ws = [torch.randn(2) for _ in range(5)]
    for step in range(40):
        if step >= 3:
            ws[step % 5] = torch.randn(2)  # an input moves at each call, each every 5 calls
        out = graphed(ws, CPU)[0]
        assert torch.allclose(out, sum(ws))
        del out
    state = graphed._latest[CPU]
    assert not state.refused and state.dynamic == set(range(5))
    captures, replays = recorder.captures, recorder.replays
    assert captures <= cuda_graphs.MAX_CAPTURES + 5
    for step in range(5):  # replayed, each input copied in
        ws[step] = torch.randn(2)
        assert torch.allclose(graphed(ws, CPU)[0], sum(ws))
    assert (recorder.captures, recorder.replays) == (captures, replays + 5)


@pytest.mark.parametrize("why", ["synchronizes", "capture fails"])
def test_a_refused_capture_runs_launch_by_launch(why):
    recorder = _Rerun(fail=why == "capture fails", synchronizes=why == "synchronizes")
    graphed, calls = _graphed(lambda x: x * 3, recorder)
    for _ in range(5):
        x = torch.randn(2)
        assert torch.equal(graphed([x], CPU)[0], x * 3)
    assert graphed._latest[CPU].refused and len(calls) == 5 and recorder.captures == 0


def test_a_call_that_raises_is_no_answer_to_the_synchronization_check():
    recorder = _Rerun()

    def fn(x):
        if x.isnan().any():  # (the rerun recorder runs Python: a stand-in for a CheckError)
            raise ValueError("bad input")
        return x * 2

    graphed, _ = _graphed(fn, recorder)
    x = torch.randn(3)
    graphed([x], CPU)
    with pytest.raises(ValueError):
        graphed([torch.full((3,), float("nan"))], CPU)
    assert recorder.checks == 1 and recorder.captures == 0
    for _ in range(3):
        assert torch.equal(graphed([x], CPU)[0], x * 2)
    assert recorder.checks == 2 and recorder.captures == 1


def test_config_off_never_captures():
    recorder = _Rerun()
    graphed, calls = _graphed(lambda x: x * 3, recorder)
    with plait.config.patch(cuda_graphs=False):
        for _ in range(5):
            x = torch.randn(2)
            assert torch.equal(graphed([x], CPU)[0], x * 3)
    assert recorder.captures == 0 and len(calls) == 5


# -- on a GPU ----------------------------------------------------------------------------
cuda = pytest.mark.cuda


@cuda
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_training_loop_replays_graphs(micro_batches):
    """plait.jit(model) under loss.backward() and an optimizer: forward and backward programs
    replayed as graphs, the backward's in the forward's memory, the same losses as eager step
    after step; with gradients accumulated over micro-batches and zeroed in place, too."""
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),  # noqa: E731
                                       torch.nn.Linear(64, 8)).cuda()
    eager, compiled = make(), make()
    compiled.load_state_dict(eager.state_dict())
    run = plait.jit(compiled, backend="triton")
    losses = {"eager": [], "plait": []}
    for model, call, name in ((eager, eager, "eager"), (compiled, run, "plait")):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(8):
            for _ in range(micro_batches):
                x = torch.randn(16, 32, device="cuda", generator=g)
                loss = call(x).square().mean()
                loss.backward()
                losses[name].append(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=micro_batches == 1)
    torch.testing.assert_close(torch.stack(losses["plait"]), torch.stack(losses["eager"]))
    for got, want in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(got, want)
    assert cuda_graphs.held_bytes() > 0
    pools = [c.pool for c in list(cuda_graphs._live)]
    assert len(set(pools)) < len(pools)  # the backward's graph in the forward's pool


@cuda
def test_running_statistics_written_in_place_under_replays():
    """A training-mode BatchNorm's running statistics (mutated inputs, whose new values the
    programs write into them) match eager's after every replayed step, as do the weights."""
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(  # noqa: E731
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 4, 1)).cuda()
    eager, compiled = make(), make()
    compiled.load_state_dict(eager.state_dict())
    run = plait.jit(compiled, backend="triton")
    for model, call in ((eager, eager), (compiled, run)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(6):
            call(torch.randn(4, 3, 8, 8, device="cuda", generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for (name, got), want in zip(compiled.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(got, want, msg=name)


@cuda
def test_held_results_survive_later_replays_on_the_gpu():
    f = plait.jit(lambda x, w: torch.softmax(x @ w, -1), backend="triton")
    w = torch.randn(64, 64, device="cuda")
    kept = []
    for _ in range(8):
        x = torch.randn(32, 64, device="cuda")
        kept.append((f(x, w), torch.softmax(x @ w, -1)))
    for out, want in kept:
        torch.testing.assert_close(out, want)


@cuda
def test_a_program_that_synchronizes_is_not_captured():
    """cholesky checks its input on the host: no capture is tried (a failed one would leave
    torch's CUDA generator unusable), and random draws afterwards still work."""
    f = plait.jit(lambda x: torch.linalg.cholesky(x @ x.mT + torch.eye(8, device=x.device)),
                  backend="triton")
    for _ in range(5):
        x = torch.randn(8, 8, device="cuda")
        torch.testing.assert_close(f(x), torch.linalg.cholesky(x @ x.mT + torch.eye(
            8, device="cuda")))
    torch.randn(3, device="cuda")


@cuda
def test_random_draws_under_a_graph_follow_the_generator():
    """A replay draws what a launch-by-launch call draws from the generator's state, and
    advances it: fresh numbers every call, the same ones after the same seed."""
    def fn(x):
        return torch.nn.functional.dropout(x, 0.5) * 2 + torch.rand_like(x)

    graphed, plain = plait.jit(fn, backend="triton"), plait.jit(fn, backend="triton")
    x = torch.randn(1000, device="cuda")
    seen = []
    for step in range(6):
        torch.manual_seed(step)
        got = graphed(x)
        torch.manual_seed(step)
        with plait.config.patch(cuda_graphs=False):
            torch.testing.assert_close(got, plain(x))
        seen.append(got)
    assert not torch.equal(seen[-1], seen[-2])
