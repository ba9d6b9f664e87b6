"""Train a small GPT the ordinary PyTorch way, with the model compiled by `plait.jit(model)`.

    .venv/bin/python examples/train_gpt.py [--steps 30]

The loop is unchanged from eager PyTorch: `loss = model(x, y)`, `loss.backward()`,
`torch.optim.AdamW`. plait reads the parameters at every call (the optimizer updates them in
place), and torch.autograd records each call as one node whose backward is plait's own
compiled gradient. The same loop runs in eager PyTorch from the same weights and data, and
the two loss curves are checked to agree.
"""
import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "benchmarks"))
from models import GPT, gpt_batch, gpt_params  # noqa: E402

import plait  # noqa: E402


def train(model, steps: int, vocab: int, seq: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        tokens, targets = gpt_batch(8, seq, vocab, seed=step % 4)  # a few batches, revisited
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main():
    parser = argparse.ArgumentParser(description="train a small GPT with plait.jit(model)")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    vocab, seq = 64, 32
    eager = GPT(gpt_params(2, 64, vocab, seq), heads=2)
    model = copy.deepcopy(eager)
    compiled = plait.jit(model)

    start = time.perf_counter()
    plait_losses = train(compiled, args.steps, vocab, seq)
    plait_seconds = time.perf_counter() - start
    start = time.perf_counter()
    eager_losses = train(eager, args.steps, vocab, seq)
    eager_seconds = time.perf_counter() - start

    for step in range(0, args.steps, max(1, args.steps // 6)):
        print(f"step {step:3d}  loss eager {eager_losses[step]:.4f}  plait "
              f"{plait_losses[step]:.4f}")
    print(f"{args.steps} steps: eager {eager_seconds:.2f} s, plait {plait_seconds:.2f} s "
          f"(with its one compilation; traced {compiled.trace_count} time)")
    torch.testing.assert_close(plait_losses, eager_losses, rtol=1e-3, atol=1e-4)
    # Whole-model distance: AdamW moves a parameter whose gradient is zero in exact arithmetic
    # (the key bias: softmax ignores it) by +-lr per step on rounding noise, in eager too.
    ours, theirs = (torch.nn.utils.parameters_to_vector(m.parameters()) for m in (model, eager))
    assert (ours - theirs).norm() < 1e-3 * theirs.norm(), "weights differ from eager's"
    assert eager_losses[-1] < eager_losses[0] - 0.5, "the model did not learn"
    print("loss curve and weights match eager PyTorch")


if __name__ == "__main__":
    main()
