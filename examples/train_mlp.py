"""Train a small MLP with plait's transforms, then take per-example gradients.

    .venv/bin/python examples/train_mlp.py

The training step is `plait.jit(plait.grad_and_value(loss))`: one traced graph holding the
forward and backward passes. Per-example gradients are `plait.vmap(plait.grad(loss))`.
Both are checked against torch.func.
"""
import torch

import plait


def init(sizes, generator):
    return {f"w{i}": torch.randn(a, b, generator=generator) / a ** 0.5
            for i, (a, b) in enumerate(zip(sizes, sizes[1:]))} | {
        f"b{i}": torch.zeros(b) for i, b in enumerate(sizes[1:])}


def predict(params, x):
    layers = len(params) // 2
    for i in range(layers):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        x = torch.tanh(x) if i < layers - 1 else x
    return x


def loss(params, x, y):
    return torch.nn.functional.mse_loss(predict(params, x), y)


def main():
    generator = torch.Generator().manual_seed(0)
    x = torch.linspace(-2, 2, 64).unsqueeze(1)
    y = torch.sin(2 * x) + 0.05 * torch.randn(x.shape, generator=generator)
    params = init([1, 32, 32, 1], generator)

    step = plait.jit(plait.grad_and_value(loss))
    print(plait.make_graph(plait.grad_and_value(loss))(params, x, y).as_text()[:1200], "...\n")
    for epoch in range(301):
        grads, value = step(params, x, y)
        params = {k: p - 0.1 * grads[k] for k, p in params.items()}
        if epoch % 100 == 0:
            print(f"epoch {epoch:3d}  loss {value.item():.4f}")
    reference, _ = torch.func.grad_and_value(loss)(params, x, y)
    torch.testing.assert_close(step(params, x, y)[0], reference)

    per_example = plait.vmap(plait.grad(lambda p, xi, yi: loss(p, xi[None], yi[None])),
                             in_dims=(None, 0, 0))(params, x, y)
    expected = torch.func.vmap(torch.func.grad(lambda p, xi, yi: loss(p, xi[None], yi[None])),
                               in_dims=(None, 0, 0))(params, x, y)
    torch.testing.assert_close(per_example, expected)
    print("per-example gradients:", {k: tuple(v.shape) for k, v in per_example.items()},
          "(match torch.func)")


if __name__ == "__main__":
    main()
