"""Gathers as indirect loads inside fused kernels (NOTE [loop IR], NOTE [lowering]): results
against eager on every loop backend, the cross-entropy program's structure and memory, range
checks (NOTE [kernel errors]) and in-place reuse around indirect reads."""
from __future__ import annotations

import plait
import pytest
import torch
import torch.nn.functional as F
from plait.errors import CheckError, ShapeError
from plait.graph.loops import Extern, Kernel, Load, walk

BACKENDS = ["cpp", "triton", "loops"]


def run(fn, backend, *args):
    return plait.jit(fn, backend=backend)(*args)


def indirect_loads(lowered) -> list[Load]:
    return [e for k in lowered.compiled.program.kernels if isinstance(k, Kernel)
            for s in k.stores for e in walk(s.value) if isinstance(e, Load) and e.indirect]


def lower(fn, *args, backend="cpp"):
    return plait.jit(fn, backend=backend).lower(*args)


# ---------------------------------------------------------------------------------------
# Results against eager
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(5, 7), (3, 4, 6)])
def test_gather_along_each_dim(backend, shape):
    x = torch.randn(shape)
    for dim in range(len(shape)):
        index_shape = [max(1, n - 1) for n in shape]  # smaller than x along every dim
        index_shape[dim] = shape[dim] + 2  # and more positions than x has along dim
        index = torch.randint(0, shape[dim], index_shape)
        out = run(lambda x, i: torch.gather(x, dim, i), backend, x, index)
        torch.testing.assert_close(out, torch.gather(x, dim, index))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_along_a_dim_of_size_one(backend):
    """The index has no position in it (the only one is 0), which is still checked."""
    x, i = torch.randn(5, 1), torch.zeros(5, 3, dtype=torch.int64)
    jitted = plait.jit(lambda x, i: x.gather(1, i), backend=backend)
    torch.testing.assert_close(jitted(x, i), x.gather(1, i))
    with pytest.raises(CheckError, match="out of range for gather"):
        jitted(x, i + 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_index_longer_than_the_operand_off_the_gathered_dim_is_refused(backend):
    """As eager refuses it: the indirect load checks only the positions it gathers along."""
    x, i = torch.randn(2, 3), torch.zeros(4, 3, dtype=torch.int64)
    with pytest.raises(RuntimeError):
        torch.gather(x, 1, i)
    with pytest.raises(ShapeError, match="no longer than it in every dim but dim=1"):
        run(lambda x, i: torch.gather(x, 1, i) * 2, backend, x, i)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_is_an_indirect_load_in_the_consuming_kernel(backend):
    def f(x, i):
        return (x.gather(1, i) * 3).sum(1)

    x, i = torch.randn(9, 11), torch.randint(0, 11, (9, 4))
    torch.testing.assert_close(run(f, backend, x, i), f(x, i))
    lowered = lower(f, x, i, backend=backend)
    assert not any(isinstance(k, Extern) for k in lowered.compiled.program.kernels)
    assert lowered.stats["kernels"] == 1 and len(indirect_loads(lowered)) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_of_a_computed_operand(backend):
    def f(x, i):
        return (x * 2 + 1).gather(0, i)

    x, i = torch.randn(6, 5), torch.randint(0, 6, (4, 5))
    torch.testing.assert_close(run(f, backend, x, i), f(x, i))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_of_a_slice_of_a_buffer_reads_the_buffer(backend):
    """A slice (a padded product's result cut back: NOTE [padded products]) is gathered
    where it lies in its buffer, not copied out first: a cross-entropy over logits of 50257
    tokens would otherwise copy them whole."""
    def f(a, b, i):
        return (a @ b)[:, 1:10].gather(1, i) * 2

    a, b, i = torch.randn(6, 4), torch.randn(4, 12), torch.randint(0, 9, (6, 3))
    torch.testing.assert_close(run(f, backend, a, b, i), f(a, b, i))
    program = lower(f, a, b, i, backend=backend).compiled.program
    assert [type(k) for k in program.kernels] == [Extern, Kernel]
    assert {b.type.shape for b in program.buffers.values()} == {(6, 4), (4, 12), (6, 3),
                                                                 (6, 12)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_of_a_biased_product_computes_the_gathered_points_alone(backend):
    """A cross-entropy's target logit out of a Linear with a bias (BERT's LM head): the
    gather reads the product's buffer and the bias at the gathered points, and stores
    nothing of the logits' size besides the product (the bias broadcast over every row, in
    float32, was a buffer of its own: 2 GB of BERT's inference at 32x512 tokens)."""
    def f(x, w, bias, i):
        logits = torch.nn.functional.linear(x, w, bias)
        return logits.float().gather(1, i), bias.float().expand(6, 12).gather(1, i) * 2

    g = torch.Generator().manual_seed(0)
    x, w, bias = (torch.randn(*shape, generator=g).bfloat16() for shape in ((6, 4), (12, 4), (12,)))
    i = torch.randint(0, 12, (6, 3), generator=g)
    torch.testing.assert_close(run(f, backend, x, w, bias, i), f(x, w, bias, i), atol=0.05,
                               rtol=1e-2)  # (bf16: the bias added after the product's rounding)
    program = lower(f, x, w, bias, i, backend=backend).compiled.program
    assert sum(b.type.shape == (6, 12) for b in program.buffers.values()) == 1  # the product


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_at_a_computed_index(backend):
    def f(x, t):
        best = torch.argmax(x, 1, keepdim=True)  # a reduction's result as the index
        shifted = (t % x.shape[1]).unsqueeze(1)  # an elementwise index, inlined
        return x.gather(1, best) + x.gather(1, shifted) * 2

    x, t = torch.randn(7, 13), torch.randint(-50, 50, (7,))
    torch.testing.assert_close(run(f, backend, x, t), f(x, t))


@pytest.mark.parametrize("backend", BACKENDS)
def test_take_along_dim_index_select_and_embedding_lookups(backend):
    def f(x, i, j):
        # x[j] counts negative positions from the end, index_select does not take them
        return torch.take_along_dim(x, i, dim=1), x.index_select(0, j.abs()), x[j], x[:, j]

    x, i, j = torch.randn(6, 8), torch.randint(0, 8, (6, 3)), torch.tensor([5, 0, 2, 2, -1])
    for got, want in zip(run(f, backend, x, i, j), f(x, i, j)):
        torch.testing.assert_close(got, want)
    assert not any(isinstance(k, Extern) for k in lower(f, x, i, j, backend=backend).compiled.program.kernels)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(backend, reduction):
    def f(logits, target):
        return F.cross_entropy(logits, target, reduction=reduction)

    logits, target = torch.randn(37, 21), torch.randint(0, 21, (37,))
    torch.testing.assert_close(run(f, backend, logits, target), f(logits, target))
    target[::3] = -100  # ignore_index hits
    torch.testing.assert_close(run(f, backend, logits, target), f(logits, target))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_gradient(backend):
    def loss(logits, target):
        return F.cross_entropy(logits, target)

    logits, target = torch.randn(16, 10), torch.randint(0, 10, (16,))
    target[3] = -100
    grad = plait.jit(plait.grad(loss), backend=backend)
    torch.testing.assert_close(grad(logits, target), torch.func.grad(loss)(logits, target))


# ---------------------------------------------------------------------------------------
# The cross-entropy program
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_cross_entropy_keeps_no_index_nor_gathered_buffer(backend):
    rows, classes = 64, 1000
    logits, target = torch.empty(rows, classes), torch.zeros(rows, dtype=torch.int64)
    lowered = lower(lambda x, t: F.cross_entropy(x, t), logits, target, backend=backend)
    program = lowered.compiled.program
    assert all(isinstance(k, Kernel) for k in program.kernels)
    # the row statistics (max, sum of exp), then the loss reading logits[row, target[row]]
    assert lowered.stats["kernels"] == 2
    (gathered,) = indirect_loads(lowered)
    assert gathered.buffer == program.inputs[0]
    intermediates = set(program.buffers) - {*program.inputs, *program.outputs}
    assert {program.buffers[b].type.nbytes for b in intermediates} == {rows * 4}
    assert len(intermediates) == 2  # two per-row float32 statistics, nothing else
    inputs = logits.numel() * 4 + target.numel() * 8
    assert lowered.stats["peak_bytes"] == lowered.memory["peak_bytes"] == \
        inputs + 2 * rows * 4 + 4  # (before: an int64 index and a gathered row as well)
    # logits and the target once, the statistics once, one logit per row
    assert lowered.stats["bytes_read"] == inputs + 2 * rows * 4 + rows * 4


# ---------------------------------------------------------------------------------------
# Range checks
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [5, -1, 1000])
def test_an_index_out_of_range_raises(backend, bad):
    def f(x, i):
        return x.gather(1, i).sum(1)

    x, i = torch.randn(4, 5), torch.randint(0, 5, (4, 2))
    with pytest.raises(RuntimeError, match="out of bounds"):
        f(x, i.index_fill(0, torch.tensor([2]), bad))  # eager raises too
    jitted = plait.jit(f, backend=backend)
    with pytest.raises(CheckError, match="out of range for gather"):
        jitted(x, i.index_fill(0, torch.tensor([2]), bad))
    torch.testing.assert_close(jitted(x, i), f(x, i))  # the flag was cleared


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_division_by_zero_keeps_its_own_message(backend):
    def f(x, i, d):
        return x.gather(1, i // d)

    x, i = torch.randn(4, 5), torch.randint(0, 5, (4, 2))
    jitted = plait.jit(f, backend=backend)
    with pytest.raises(CheckError, match="ZeroDivisionError"):
        jitted(x, i, torch.zeros(4, 2, dtype=torch.int64))
    torch.testing.assert_close(jitted(x, i, torch.ones(4, 2, dtype=torch.int64)), f(x, i, 1))


# ---------------------------------------------------------------------------------------
# In-place reuse
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_a_buffer_read_indirectly_is_not_taken_over(backend):
    def f(x, i):
        return x.gather(1, i) + x  # same shape as x: x's storage would fit the result

    def g(x, i):
        return x * 2 + x

    x, i = torch.randn(6, 9), torch.randint(0, 9, (6, 9))
    expected = f(x, i)
    jitted = plait.jit(f, backend=backend, donate_argnums=0)
    assert not jitted.lower(x, i).memory["inplace"]
    # without the indirect read, the donated x is taken over
    assert plait.jit(g, backend=backend, donate_argnums=0).lower(x, i).memory["inplace"]
    torch.testing.assert_close(jitted(x.clone(), i), expected)
