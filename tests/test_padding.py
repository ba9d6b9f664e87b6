"""Padded matrix products (NOTE [padded products], passes/padding.py): on the CPU with
``pad_products="all"`` (the default pads CUDA's alone), against eager and torch.func."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import plait
from plait.passes import padding

BF16 = dict(atol=2e-2, rtol=2e-2)


def _products(graph) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The operand shapes of every product of ``graph``."""
    return [tuple(graph.type_of(v).shape for v in graph.operands(n))
            for n in graph.order if graph.node(n).prim == "dot_general"]


def _aligned(shape) -> bool:
    return all(n % padding.ALIGNMENT == 0 or n <= padding.ALIGNMENT for n in shape)


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


# [256, 512] x [512, 4099] is just over PAD_MIN_FLOPS: the vocabulary of a language model's head
PRODUCTS = {
    "free_dim": (lambda x, w: x @ w.T, (256, 512), (4099, 512)),
    "contracting_dim": (lambda g, w: g @ w, (256, 4099), (4099, 512)),
    "batched": (lambda a, b: a @ b, (2, 128, 1029), (2, 1029, 2048)),
}


@pytest.mark.parametrize("name", sorted(PRODUCTS))
@pytest.mark.parametrize("backend", ["eager", "cpp",
                                     pytest.param("triton", marks=pytest.mark.slow)])
def test_unaligned_dims_are_padded_and_the_result_is_eagers(name, backend):
    fn, *shapes = PRODUCTS[name]
    args = [_bf16(*s, seed=i) for i, s in enumerate(shapes)]
    with plait.config.patch(pad_products="all"):
        jitted = plait.jit(fn, backend=backend)
        graph = jitted.lower(*args).graph
        got = jitted(*args)
    assert all(_aligned(s) for pair in _products(graph) for s in pair), _products(graph)
    assert got.shape == fn(*args).shape
    assert_close(got, fn(*args), **BF16)


def test_the_gradients_of_a_padded_product_are_padded_products_and_eagers():
    """Padded before differentiation: the backward's products are aligned too."""
    head = torch.nn.Linear(512, 4099).bfloat16()
    x = _bf16(256, 512)
    target = torch.randint(0, 4099, (256,))
    loss = lambda x: torch.nn.functional.cross_entropy(head(x).float(), target)  # noqa
    with plait.config.patch(pad_products="all"):
        jitted = plait.jit(head)
        out = jitted(x)
        torch.nn.functional.cross_entropy(out.float(), target).backward()
        grad_step = plait.jit(plait.grad(loss))
        graph = grad_step.lower(x).graph
        got = grad_step(x)
    products = _products(graph)
    assert len(products) == 2 and all(_aligned(s) for pair in products for s in pair)
    theirs = [p.grad for p in head.parameters()]
    for p in head.parameters():
        p.grad = None
    loss(x).backward()
    assert_close(out, head(x), **BF16)
    for mine, eager in zip(theirs, [p.grad for p in head.parameters()]):
        assert_close(mine, eager, **BF16)
    assert_close(got, torch.func.grad(loss)(x), **BF16)


@pytest.mark.parametrize("setting, dtype, shapes", [
    ("cuda", torch.bfloat16, ((256, 512), (4099, 512))),  # the default: the CPU's stay
    ("all", torch.float32, ((256, 512), (4099, 512))),  # 16-bit floats alone
    ("all", torch.bfloat16, ((16, 512), (4099, 512))),  # too small to pay
])
def test_products_left_alone(setting, dtype, shapes):
    x, w = (_bf16(*s).to(dtype) for s in shapes)
    with plait.config.patch(pad_products=setting):
        graph = plait.jit(lambda x, w: x @ w.T).lower(x, w).graph
    assert _products(graph) == [(shapes[0], shapes[1][::-1])] or \
        _products(graph) == [shapes]
    assert not any(graph.node(n).prim in ("pad", "slice") for n in graph.order)


def test_an_unknown_setting_is_refused():
    x = _bf16(4, 4)
    with plait.config.patch(pad_products="gpu"), \
            pytest.raises(plait.PlaitError, match="pad_products='gpu': expected one of all"):
        plait.jit(lambda x: x @ x).lower(x).graph


@pytest.mark.cuda
def test_a_language_models_head_on_cuda_is_padded_by_default():
    """GPT-2's vocabulary of 50257 (NOTE [padded products]): trained through loss.backward(),
    its products run padded, with eager's logits and gradients."""
    head = torch.nn.Linear(768, 50257, bias=False).cuda().bfloat16()
    x = torch.randn(1024, 768, device="cuda").bfloat16()
    target = torch.randint(0, 50257, (1024,), device="cuda")
    jitted = plait.jit(head)
    graph = jitted.lower(x).graph
    assert all(_aligned(s) for pair in _products(graph) for s in pair)
    out = jitted(x)
    torch.nn.functional.cross_entropy(out.float(), target).backward()
    mine = head.weight.grad
    head.weight.grad = None
    eager = head(x)
    torch.nn.functional.cross_entropy(eager.float(), target).backward()
    assert_close(out, eager, **BF16)
    assert_close(mine, head.weight.grad, **BF16)
