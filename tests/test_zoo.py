"""Whole models written the ordinary way (benchmarks/zoo.py: a Llama-style decoder, a ViT, a
ResNet with BatchNorm, a ConvNeXt), trained through ``plait.jit(model)`` and
``loss.backward()`` at small sizes: every gradient, the loss and BatchNorm's running
statistics against eager's, over two steps of SGD."""
import math
import os
import sys

import pytest
import torch
from torch.testing import assert_close

import plait

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from zoo import MODELS  # noqa: E402


def _train(model, call, inputs, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = call(*inputs)
        loss.backward()
        losses.append(loss.detach())
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
    return losses, grads


# the heaviest three in the slow tier (the model suite trains such models too)
_SLOW = {("resnet", "all"), ("convnext", "none"), ("llama", "none")}


@pytest.mark.parametrize("name,layout", [
    pytest.param(*case, marks=pytest.mark.slow) if case in _SLOW else case
    for case in [(name, "none") for name in sorted(MODELS)] +
    [(name, "all") for name in ("convnext", "resnet", "vit")]])
def test_model_trains_as_in_eager(name, layout):
    """layout "all" (the default): the convolutions channels-last (NOTE [channels-last
    convolutions]); "none": channels-first."""
    plait.config.backend = "cpp"  # the autouse fixture restores it
    plait.config.channels_last = layout
    make, batch = MODELS[name](small=True)
    inputs = batch("cpu")
    torch.manual_seed(0)
    eager = make()
    torch.manual_seed(0)
    model = make()
    want_losses, want_grads = _train(eager, eager, inputs)
    losses, grads = _train(model, plait.jit(model), inputs)
    assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-5, atol=1e-5)
    for step, (got, want) in enumerate(zip(grads, want_grads)):
        for k in want:
            assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=f"step {step}: {k}")
    for (k, got), want in zip(model.named_buffers(), eager.buffers()):
        assert_close(got, want, rtol=1e-5, atol=1e-6, msg=k)  # BatchNorm's statistics


def test_heads_a_product_reads_are_saved_rather_than_redone(monkeypatch):
    """A ViT block with its attention written out: the query, key and value heads (and the
    heads' merged output, and the probabilities) are stored by the forward for its products
    anyway, in no more bytes than the projections and scores they are made from, which only
    their recomputation would read. They are saved (NOTE [saved instead of redone]), the
    projections and scores are not, and the gradients are eager's."""
    from zoo import ViTBlock

    def saved_by(make_block, x):
        torch.manual_seed(0)
        block = make_block()
        jitted = plait.jit(block)
        jitted(x).square().sum().backward()
        want = torch.autograd.grad(block(x).square().sum(), list(block.parameters()))
        for p, w in zip(block.parameters(), want):
            assert_close(p.grad, w, rtol=1e-4, atol=1e-5)
        (compiled,) = jitted.jitted._cache.values()
        (program,) = compiled._programs.values()
        forward = program._forward.graph
        return sorted(forward.type_of(v).shape for v in forward.outputs[program.n_outputs:])

    monkeypatch.setattr(plait.config, "fuse_attention", False)
    x = torch.randn(4, 32, 64)
    saved = saved_by(lambda: ViTBlock(64, 4), x)
    assert saved.count((16, 32, 16)) == 3 and (128, 192) not in saved, saved
    monkeypatch.setattr(plait.passes.autodiff, "_stored_instead", lambda *args: set())
    redone = saved_by(lambda: ViTBlock(64, 4), x)
    assert (128, 192) in redone and saved != redone
    # softmax's probabilities too (its VJP reads them alone), not the scores and statistics
    assert (4, 4, 32, 32) in saved and (16, 32, 32) in redone and (16, 32, 32) not in saved
    assert sum(map(math.prod, saved)) <= sum(map(math.prod, redone))  # no more bytes
