"""plait.jit in an ordinary PyTorch training loop: live captured state, guards, modules,
torch.autograd through compiled code, traced floats, and data escapes refused. Every result
is checked against eager PyTorch running the same loop."""
import copy
import logging
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.testing import assert_close

import plait
from plait.errors import ConcretizationError, TraceError


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))


def _cnn():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False),
        torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 9, 4))


def _batch(model, step: int):
    g = torch.Generator().manual_seed(step)
    if isinstance(model[0], torch.nn.Conv2d):
        return torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 4, (4,), generator=g)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


# ---------------------------------------------------------------------------------------
# Live captured state
# ---------------------------------------------------------------------------------------
def test_in_place_update_of_a_closure_tensor_is_seen_without_retracing():
    w = torch.randn(4, 4)
    f = plait.jit(lambda x: torch.tanh(x @ w))
    x = torch.randn(2, 4)
    assert_close(f(x), torch.tanh(x @ w))
    w.add_(1.0)
    assert_close(f(x), torch.tanh(x @ w))
    assert f.trace_count == 1


GLOBAL_SCALE = torch.tensor([1.0, 2.0, 3.0])


def _scaled(x):
    return x * GLOBAL_SCALE


def test_a_rebound_global_tensor_is_read_at_each_call():
    global GLOBAL_SCALE
    f = plait.jit(_scaled)
    x = torch.randn(3)
    saved = GLOBAL_SCALE
    try:
        assert_close(f(x), x * GLOBAL_SCALE)
        GLOBAL_SCALE = torch.tensor([-1.0, 5.0, 0.5])
        assert_close(f(x), x * GLOBAL_SCALE)
        GLOBAL_SCALE = torch.ones(2, 3)  # a new shape: retraced, not misread
        assert_close(f(x), x * GLOBAL_SCALE)
        assert f.trace_count == 2
    finally:
        GLOBAL_SCALE = saved


def test_module_parameters_updated_in_place_and_reassigned_are_seen():
    model = _mlp()
    jitted = plait.jit(model)
    x = torch.randn(5, 6)
    with torch.no_grad():
        assert_close(jitted(x), model(x))
        model[0].weight.mul_(2.0)
        assert_close(jitted(x), model(x))
        model[2].bias = torch.nn.Parameter(torch.randn(3))
        assert_close(jitted(x), model(x))
    assert jitted.trace_count == 1


def test_a_tensor_value_the_trace_reads_is_guarded():
    start = torch.tensor(1)
    f = plait.jit(lambda x: torch.narrow(x, 0, start, 2))
    x = torch.randn(5, 3)
    assert_close(f(x), x[1:3])
    start.fill_(2)
    assert_close(f(x), x[2:4])
    assert f.trace_count == 2


SCALE = 2.0


def test_a_number_a_function_captures_is_read_at_each_call():
    """A global or closure number the trace reads as a constant retraces when rebound; each
    value's compilation is kept."""
    offset = 1.0

    def f(x):
        return x * SCALE + offset

    jitted, x = plait.jit(f), torch.ones(3)
    global SCALE
    try:
        for SCALE, offset in ((2.0, 1.0), (3.0, 1.0), (3.0, -1.0), (2.0, 1.0)):
            assert_close(jitted(x), f(x))
    finally:
        SCALE = 2.0
    assert jitted.trace_count == 3  # the first values' compilation served again


CONFIG = {"p": 2.0, "inner": {"shift": 1.0}}
ACTIVATION = torch.relu


def test_numbers_held_in_captured_containers_and_objects_are_read_at_each_call():
    """A dict's item, a list's item, a plain object's attribute (also one a module holds)
    and a rebound container retrace; values seen before are served from the cache."""
    class Config:
        eps = None

        def __init__(self):
            self.scale = 3.0

    config, sizes = Config(), [2, 2]
    block = torch.nn.Linear(4, 4)
    block.config = config

    def f(x):
        y = block(x).reshape(sizes) * CONFIG["p"] + CONFIG["inner"]["shift"]
        return y * block.config.scale

    jitted, x = plait.jit(f), torch.randn(4)
    global CONFIG
    try:
        for change in (lambda: None, lambda: CONFIG.update(p=5.0),
                       lambda: CONFIG["inner"].update(shift=-1.0),
                       lambda: setattr(config, "scale", 0.5),
                       lambda: sizes.__setitem__(slice(None), [4, 1]),
                       lambda: globals().update(CONFIG={"p": 7.0, "inner": {"shift": 0.0}})):
            change()
            assert_close(jitted(x), f(x))
        CONFIG["p"] = 2.0
        assert_close(jitted(x), f(x))
        CONFIG["p"] = 7.0  # seen before under this state: served from the cache
        assert_close(jitted(x), f(x))
        assert jitted.trace_count == 7
    finally:
        CONFIG = {"p": 2.0, "inner": {"shift": 1.0}}


def test_an_attribute_the_code_never_names_is_not_guarded():
    """A captured object's attribute that no code walked names (a trainer's step counter,
    and the list of losses it appends to, beside the model the function calls) changes every
    call without a retrace; one the module's own methods read (through a helper of forward)
    is guarded."""
    class Block(torch.nn.Module):
        def __init__(self, settings):
            super().__init__()
            self.linear, self.settings = torch.nn.Linear(4, 4), settings

        def forward(self, x):
            return self._scaled(self.linear(x))

        def _scaled(self, y):
            return y * self.settings.gain

    class Trainer:
        def __init__(self):
            self.step, self.losses, self.settings = 0, [], type("Settings", (), {})()
            self.settings.gain = 2.0
            self.model = Block(self.settings)

    trainer, x = Trainer(), torch.randn(4)

    def f(x):
        return trainer.model(x)

    jitted = plait.jit(f)
    for _ in range(3):
        trainer.step += 1
        trainer.losses.append(float(trainer.step))
        assert_close(jitted(x), f(x))
    assert jitted.trace_count == 1
    trainer.settings.gain = -1.0
    assert_close(jitted(x), f(x))
    assert jitted.trace_count == 2


SCALES = [1.0, 2.0]
SETTINGS = {"gain": 2.0}


def test_an_item_added_to_a_captured_list_or_dict_of_values_retraces():
    """The code iterates a list and looks a key up with a default: an item appended, or the
    key added, changes what it computes."""
    def f(x):
        return sum(x * s for s in SCALES) + SETTINGS.get("bias", 0.0) * SETTINGS["gain"]

    jitted, x = plait.jit(f), torch.randn(3)
    try:
        for change in (lambda: None, lambda: SCALES.append(3.0),
                       lambda: SETTINGS.update(bias=1.5)):
            change()
            assert_close(jitted(x), f(x))
    finally:
        del SCALES[2:]
        SETTINGS.pop("bias", None)
    assert jitted.trace_count == 3


def test_a_rebound_captured_function_retraces():
    def f(x):
        return ACTIVATION(x) + 1

    jitted, x = plait.jit(f), torch.randn(5)
    global ACTIVATION
    try:
        assert_close(jitted(x), f(x))
        ACTIVATION = torch.tanh
        assert_close(jitted(x), f(x))
    finally:
        ACTIVATION = torch.relu
    assert_close(jitted(x), f(x))
    assert jitted.trace_count == 3  # another object at a slot retraces: identities are not kept


def test_compilations_under_a_replaced_state_are_not_served_again():
    """A retrace for another object at a slot drops what was compiled under the old one: a
    signature seen before (train mode) under the old activation is compiled again."""
    model = torch.nn.Linear(3, 3)

    def f(x):
        return ACTIVATION(model(x)) * (2.0 if model.training else 1.0)

    jitted, x = plait.jit(f), torch.randn(3)
    global ACTIVATION
    try:
        for change in (model.train, model.eval, lambda: globals().update(ACTIVATION=torch.tanh),
                       model.train):
            change()
            assert_close(jitted(x), f(x))
    finally:
        ACTIVATION = torch.relu
    assert jitted.trace_count == 4


def test_the_default_dtype_and_autocast_are_read_at_each_call():
    """A factory without a dtype takes torch's default, and autocast casts a product's
    operands, as they are when the function traces: a change of either retraces."""
    w = torch.randn(8, 8)
    f = plait.jit(lambda x: (x @ w).sum(-1) + torch.ones(4))
    x = torch.randn(4, 8)
    previous = torch.get_default_dtype()
    try:
        for dtype in (torch.float64, torch.float32):
            torch.set_default_dtype(dtype)
            assert f(x).dtype == (x @ w).sum(-1).add(torch.ones(4)).dtype == dtype
    finally:
        torch.set_default_dtype(previous)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the product in bfloat16
        assert_close(f(x), (x @ w).sum(-1) + torch.ones(4))
    assert_close(f(x), (x @ w).sum(-1) + torch.ones(4))
    assert f.trace_count == 3


@pytest.mark.parametrize("name, fn", [
    ("numpy", lambda x: torch.from_numpy(x.numpy() * 2)),
    ("__array__", lambda x: torch.from_numpy(np.asarray(x) * 2)),
    ("data_ptr", lambda x: x + x.data_ptr()),
    ("tolist", lambda x: torch.tensor(x.tolist())),
])
def test_data_escapes_are_refused(name, fn):
    with pytest.raises(ConcretizationError, match=re.escape(f".{name}()")):
        plait.jit(fn)(torch.randn(3))


# ---------------------------------------------------------------------------------------
# Modules and methods
# ---------------------------------------------------------------------------------------
def test_jitted_module_passes_its_state_through():
    model = _mlp()
    jitted = plait.jit(model)
    assert isinstance(jitted, torch.nn.Module)
    assert [p is q for p, q in zip(jitted.parameters(), model.parameters())] == [True] * 4
    assert jitted.state_dict().keys() == model.state_dict().keys()
    assert dict(jitted.named_parameters()).keys() == dict(model.named_parameters()).keys()
    jitted.eval()
    assert not model.training and not model[0].training
    jitted.train()
    assert model.training
    model.note = "kept"
    assert jitted.note == "kept"  # attributes reach the original module


def test_a_module_holding_a_jitted_one_names_its_state_as_the_original():
    """The names of a module holding jitted blocks are the original model's, with no
    ``_orig_mod`` in them; a state dict saved from one loads into the other, both ways."""
    model = torch.nn.Sequential(_mlp(), torch.nn.Linear(3, 2))
    holder = torch.nn.Sequential(plait.jit(_mlp()), model[1])
    assert [n for n, _ in holder.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(holder.state_dict()) == list(model.state_dict())
    holder.load_state_dict(model.state_dict())
    x = torch.randn(5, 6)
    assert_close(holder(x), model(x))
    with torch.no_grad():
        holder[0]._orig_mod[0].weight.mul_(2)
    model.load_state_dict(holder.state_dict())
    assert_close(model(x), holder(x))


def test_train_eval_switching_with_dropout():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.5))
    jitted = plait.jit(model)
    x = torch.randn(32, 64)
    with torch.no_grad():
        model.eval()
        assert_close(jitted(x), model(x))
        model.train()
        a, b = jitted(x), jitted(x)
        full = F.linear(x, model[0].weight, model[0].bias)
        for out in (a, b):  # each element dropped, or kept and scaled by 1 / (1 - p)
            kept = out != 0
            assert 0.35 < kept.float().mean() < 0.65
            assert_close(out[kept], 2 * full[kept])
        assert not torch.equal(a, b)  # a fresh mask per call
        model.eval()
        assert_close(jitted(x), model(x))
    assert jitted.trace_count == 2  # one per mode, each reused


def test_hooks_registered_after_the_first_call_are_traced_and_removed_ones_dropped():
    model = _mlp()
    jitted = plait.jit(model)
    x = torch.randn(5, 6)
    with torch.no_grad():
        jitted(x)
        handles = [model[0].register_forward_hook(lambda m, i, out: out * 0.5),
                   model[2].register_forward_pre_hook(lambda m, i: (i[0] + 1,)),
                   jitted.register_forward_hook(lambda m, i, out: out - 3)]  # the model's
        assert_close(jitted(x), model(x))
        handles.pop(1).remove()
        assert_close(jitted(x), model(x))
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, i, out: out + 1)
        try:
            assert_close(jitted(x), model(x))  # each module's call once, not the wrapper's
        finally:
            handle.remove()
        assert_close(jitted(x), model(x))
    for h in handles:
        h.remove()


def test_a_module_backward_hook_is_refused_with_the_way_out():
    model = _mlp()
    jitted = plait.jit(model)
    x = torch.randn(5, 6)
    jitted(x)
    model[0].register_full_backward_hook(lambda m, grad_in, grad_out: None)
    with pytest.raises(TraceError, match="backward hook.*tensor.register_hook"):
        jitted(x)


def test_a_changed_tuple_attribute_retraces():
    conv = torch.nn.Conv2d(2, 3, 3, padding=1)
    jitted = plait.jit(conv)
    x = torch.randn(1, 2, 7, 7)
    with torch.no_grad():
        assert jitted(x).shape == (1, 3, 7, 7)
        conv.padding = (0, 2)
        assert_close(jitted(x), conv(x))
        conv.padding = (1, 1)
        assert_close(jitted(x), conv(x))
    assert jitted.trace_count == 2


def test_a_module_whose_class_is_swapped_retraces():
    class Doubled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    jitted = plait.jit(model)
    x = torch.randn(4, 3)
    with torch.no_grad():
        jitted(x)
        model[0].__class__ = Doubled
        assert_close(jitted(x), model(x))


def test_an_attribute_replaced_by_an_uncomparable_object_is_read_again():
    model = torch.nn.Linear(3, 2)
    model.table = np.arange(3.0)  # an array: == of two of them is elementwise
    model.forward = lambda x: torch.nn.Linear.forward(model, x) * float(model.table.sum())
    jitted = plait.jit(model)
    x = torch.randn(4, 3)
    with torch.no_grad():
        assert_close(jitted(x), model(x))
        model.table = np.arange(3.0) * 2
        assert_close(jitted(x), model(x))


def test_a_parameter_whose_data_changes_shape_or_dtype_retraces():
    model = torch.nn.Linear(3, 2)
    jitted = plait.jit(model)
    with torch.no_grad():
        jitted(torch.randn(4, 3))
        model.weight.data = torch.randn(5, 3)  # the same Parameter object, new data
        model.bias.data = torch.randn(5)
        x = torch.randn(4, 3)
        assert_close(jitted(x), model(x))
        model.double()  # torch's _apply: .data replaced again
        x = x.double()
        assert_close(jitted(x), model(x))
    assert jitted.trace_count == 3


def test_a_parameter_replaced_by_an_equal_one_gets_the_gradient():
    model = torch.nn.Linear(3, 1)
    model.scale = torch.nn.Parameter(torch.tensor(2.0))
    model.forward = lambda x: torch.nn.Linear.forward(model, x) * model.scale
    jitted = plait.jit(model)
    x = torch.randn(4, 3)
    jitted(x).sum().backward()
    old, model.scale = model.scale, torch.nn.Parameter(torch.tensor(2.0))
    jitted(x).sum().backward()
    assert model.scale.grad is not None
    assert_close(model.scale.grad, old.grad)


def test_jit_on_a_method():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        @plait.jit
        def forward(self, x):
            return torch.relu(self.fc(x))

    a, b = Block(), Block()
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert_close(a(x), torch.relu(a.fc(x)))
        assert_close(b(x), torch.relu(b.fc(x)))
        a.fc.weight.add_(0.5)
        assert_close(a(x), torch.relu(a.fc(x)))


# ---------------------------------------------------------------------------------------
# torch.autograd through compiled code
# ---------------------------------------------------------------------------------------
def test_backward_and_autograd_grad_through_a_jitted_function_of_leaves():
    def f(x, w):
        return (torch.sin(x @ w) * x.sum()).square().mean()

    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 5, requires_grad=True)
    jitted = plait.jit(f)
    loss = jitted(x, w)
    assert loss.grad_fn is not None
    loss.backward()
    got = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    f(x, w).backward()
    assert_close(got, (x.grad, w.grad))
    assert_close(torch.autograd.grad(jitted(x, w), w), torch.autograd.grad(f(x, w), w))


def test_gradient_accumulation_retain_graph_and_partial_requires_grad():
    x = torch.randn(3, 4)
    w = torch.randn(4, 4, requires_grad=True)
    jitted = plait.jit(lambda x, w: torch.tanh(x @ w).sum())
    loss = jitted(x, w)
    loss.backward(retain_graph=True)
    loss.backward()
    want = torch.autograd.grad(torch.tanh(x @ w).sum(), w)[0]
    assert_close(w.grad, 2 * want)
    assert x.grad is None


def test_no_grad_call_is_forward_only_and_unused_parameters_get_no_grad():
    model = _mlp()
    jitted = plait.jit(lambda x: model[0](x).sum())  # model[2] is never read
    x = torch.randn(2, 6)
    with torch.no_grad():
        assert jitted(x).grad_fn is None
    jitted(x).backward()
    assert model[0].weight.grad is not None and model[2].weight.grad is None


def test_double_backward_is_refused_with_the_way_out():
    x = torch.randn(3, requires_grad=True)
    y = plait.jit(lambda x: x.pow(3).sum())(x)
    with pytest.raises(TraceError, match=r"plait\.grad\(plait\.grad"):
        torch.autograd.grad(y, x, create_graph=True)
    assert_close(torch.autograd.grad(y, x)[0], 3 * x.detach() ** 2)


@pytest.mark.parametrize("make", [_mlp, _cnn], ids=["mlp", "cnn_batchnorm"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_training_trajectory_matches_eager(make, optimizer):
    torch.manual_seed(0)
    eager = make()
    model = copy.deepcopy(eager)
    jitted = plait.jit(model)

    def opt(m):
        if optimizer == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(m.parameters(), lr=1e-2)

    opt_eager, opt_jit = opt(eager), opt(model)
    for step in range(5):
        x, y = _batch(eager, step)
        for m, o in ((eager, opt_eager), (jitted, opt_jit)):
            loss = F.cross_entropy(m(x), y)
            o.zero_grad()
            loss.backward()
            o.step()
    for (name, a), b in zip(eager.state_dict().items(), model.state_dict().values()):
        assert_close(b, a, atol=2e-5, rtol=1e-4, msg=name)
    assert jitted.trace_count == 1
    eager.eval()
    jitted.eval()
    x, _ = _batch(eager, 99)
    with torch.no_grad():
        assert_close(jitted(x), eager(x), atol=2e-5, rtol=1e-4)


def test_batchnorm_buffers_passed_to_a_transform_are_updated_as_in_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6),
                                torch.nn.ReLU(), torch.nn.Linear(6, 1))
    eager = copy.deepcopy(model)
    x = torch.randn(8, 4)
    eager(x).pow(2).mean().backward()
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}

    def loss(p, b, x):
        return functional_call(model, (p, b), (x,)).pow(2).mean()

    grads = plait.grad(loss)(params, buffers, x)
    assert_close(grads, {k: p.grad for k, p in eager.named_parameters()})
    assert_close(buffers, dict(eager.named_buffers()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("how", ["grad", "jit of grad", "vjp in jit", "grad of grad"])
def test_a_batchnorm_module_under_a_transform_updates_its_running_stats(how, dtype):
    """A training-mode BatchNorm the differentiated function holds (not passed as buffers)
    writes its running statistics once per call, as the eager forward does (NOTE [writes to
    captured tracers]); the second call reads the first one's statistics."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                torch.nn.ReLU()).to(dtype)
    eager = copy.deepcopy(model)
    loss = lambda x: model(x).float().pow(2).sum()  # noqa: E731
    run = {"grad": plait.grad(loss),
           "jit of grad": plait.jit(plait.grad(loss)),
           "vjp in jit": plait.jit(lambda x: plait.vjp(loss, x)[1](torch.ones(()))[0]),
           "grad of grad": plait.grad(lambda x: plait.grad(loss)(x).sum())}[how]
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=4e-3, rtol=1e-2)
    for step in range(2):
        x = torch.randn(2, 3, 6, 6, dtype=dtype)
        xe = x.clone().requires_grad_()
        expected = torch.autograd.grad(eager(xe).float().pow(2).sum(), xe)[0]
        got = run(x)
        if how != "grad of grad":
            assert_close(got, expected, **tol)
        assert_close(dict(model.named_buffers()), dict(eager.named_buffers()), **tol)
    assert model[1].num_batches_tracked.item() == 2


def test_a_batchnorm_module_under_vmap_or_jvp_is_refused_in_training_mode():
    bn, x = torch.nn.BatchNorm1d(3), torch.randn(4, 3)
    with pytest.raises(TraceError, match="running statistics.*model.eval"):
        plait.jvp(lambda x: bn(x).sum(), (x,), (x,))
    with pytest.raises(TraceError, match="running statistics.*model.eval"):
        plait.vmap(lambda x: bn(x).sum())(torch.randn(2, 4, 3))
    assert bn.num_batches_tracked.item() == 0
    bn.eval()
    assert plait.vmap(lambda x: bn(x).sum())(torch.randn(2, 4, 3)).shape == (2,)


def test_a_cumulative_batchnorm_is_refused_with_the_way_out():
    """momentum=None reads 1 / num_batches_tracked as a Python float at every call."""
    bn, x = torch.nn.BatchNorm2d(3, momentum=None), torch.randn(4, 3, 5, 5)
    with pytest.raises(ConcretizationError, match="momentum=None.*momentum=0.1"):
        plait.jit(bn)(x)
    bn.eval()
    assert_close(plait.jit(bn)(x), bn(x))


# ---------------------------------------------------------------------------------------
# Traced floats and the retrace warning
# ---------------------------------------------------------------------------------------
def test_twenty_learning_rates_trace_once():
    f = plait.jit(lambda w, g, lr: w - lr * g)
    w, g = torch.randn(8), torch.randn(8)
    for i in range(20):
        lr = 0.01 * (i + 1)
        assert_close(f(w, g, lr), w - lr * g)
    assert f.trace_count <= 2


def test_a_traced_float_keeps_eager_promotion_and_precision():
    f = plait.jit(lambda x, s: x * s)
    for x in (torch.ones(3, dtype=torch.bfloat16), torch.arange(3), torch.ones(3),
              torch.randn(3, dtype=torch.float64)):
        assert f(x, 0.1).dtype == (x * 0.1).dtype
        assert_close(f(x, 0.1), x * 0.1, rtol=0, atol=0)


def test_a_float_used_as_a_python_number_is_static_and_warned_about(caplog):
    f = plait.jit(lambda x, p: x * math.sqrt(p))  # float(p): a traced float cannot be
    x = torch.randn(3)
    with caplog.at_level(logging.WARNING, logger="plait.cache"):
        for i in range(12):
            p = i / 11
            assert_close(f(x, p), x * math.sqrt(p))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "argument 1" in warnings[0]


# ---------------------------------------------------------------------------------------
# The forward and backward programs
# ---------------------------------------------------------------------------------------
def _programs(jitted):
    (compiled,) = jitted._cache.values()
    (program,) = compiled._programs.values()
    return program


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_backward_recomputes_elementwise_values_instead_of_saving_them(dtype, approximate):
    """GELU, written out as several elementwise ops (in float32 for bfloat16 operands, the
    tanh form reading x three times), after a bias: redone in the backward program from the
    matrix product it reads, so only inputs and the product are saved (not float32
    intermediates twice the activation's size)."""
    w = torch.randn(16, 32, dtype=dtype, requires_grad=True)
    b = torch.randn(32, dtype=dtype, requires_grad=True)

    def loss(x):
        return F.gelu(F.linear(x, w.mT, b), approximate=approximate).float().square().sum()
    x = torch.randn(8, 16, dtype=dtype)
    jitted = plait.jit(loss)
    jitted(x).backward()
    for got, want in zip((w.grad, b.grad), torch.autograd.grad(loss(x), (w, b))):
        if dtype == torch.bfloat16:  # eager rounds each op's result to bfloat16; plait not
            assert ((got - want).float().norm() / want.float().norm()) < 1e-2
        else:
            assert_close(got, want)
    forward = _programs(jitted)._forward.graph
    saved = [forward.node(v.node).prim for v in forward.outputs[1:]]
    assert set(saved) <= {"input", "dot_general"}, saved


def _trained_like_eager(make, x):
    """One ``loss.backward()`` through ``plait.jit(make())``, its gradients checked against
    eager's; the autograd program it ran."""
    torch.manual_seed(0)
    eager, model = make(), make()
    model.load_state_dict(eager.state_dict())
    jitted = plait.jit(model)
    jitted(x).square().sum().backward()
    eager(x).square().sum().backward()
    for got, want in zip(model.parameters(), eager.parameters()):
        assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-4)
    return _programs(jitted.jitted)


def test_a_batch_norms_output_is_redone_in_the_backward():
    """A BatchNorm's output (through its custom VJP's marker) feeding a ReLU and the next
    convolution is recomputed by the backward program from the convolution's output and the
    batch statistics, as torch.compile does: one activation saved per layer, not two."""
    program = _trained_like_eager(lambda: torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3, padding=1)), torch.randn(2, 3, 8, 8))
    forward = program._forward.graph  # (its first outputs: the loss and the running stats)
    saved = [(forward.node(v.node).prim, forward.type_of(v).numel)
             for v in forward.outputs[program.n_outputs:]]
    # the convolution's output, and per-channel statistics
    assert [prim for prim, numel in saved if numel > 8] == ["conv"], saved


def test_a_max_pool_saves_the_entry_each_window_chose_and_spreads_its_gradient_back(
        monkeypatch):
    """Max pooling's backward (NOTE [strided max pooling]) reads the entry each window chose,
    one byte per window, the only thing the forward saves for it: no indices (eight times
    their size), no gather, no scatter. (Sizes past the backward's free recompute of small
    values; the scan, as on CUDA.)"""
    monkeypatch.setattr(plait.tracer.nn, "SCANNED_MAX_POOL_DEVICES", frozenset({"cpu"}))
    x = torch.randint(-2, 3, (4, 3, 24, 24)).float()  # ties within windows
    program = _trained_like_eager(lambda: torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1),
        torch.nn.Conv2d(16, 4, 3)), x)
    forward, backward = program._forward.graph, program._backward.graph
    saved = [forward.type_of(v) for v in forward.outputs[program.n_outputs:]]
    assert max(t.numel for t in saved) <= 4 * 16 * 24 * 24, saved  # none above an activation
    assert [(t.numel, t.dtype) for t in saved if not t.dtype.is_floating_point] == \
        [(4 * 16 * 12 * 12, torch.uint8)], saved
    assert not {"scatter", "gather"} & {backward.node(n).prim for n in backward.order}


def test_a_dropout_mask_is_drawn_once_and_saved_for_backward():
    x = torch.randn(64, 64, requires_grad=True)
    jitted = plait.jit(lambda x: F.dropout(x, 0.5, training=True) * 3.0)
    y = jitted(x)
    y.sum().backward()
    assert_close(x.grad, (y != 0).float() * 6.0)


def test_the_training_example_matches_eager():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
    run = subprocess.run([sys.executable, str(script)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "loss curve and weights match eager PyTorch" in run.stdout


def test_no_grad_inside_a_jitted_function_stops_torch_autograd():
    """NOTE [grad mode while tracing]: the outermost trace marks what runs under no_grad,
    since jit's path under torch.autograd differentiates its graph."""
    def f(x):
        with torch.no_grad():
            c = x ** 2
        return x - c

    x = torch.tensor([1.0, 2.0, 3.0])
    leaf = x.clone().requires_grad_()
    plait.jit(f, backend="cpp")(leaf).sum().backward()
    assert_close(leaf.grad, torch.ones(3))
    assert_close(plait.vjp(f, x)[1](torch.ones(3)), torch.func.vjp(f, x)[1](torch.ones(3)))


class _Branches(torch.nn.Module):
    """A loss from ``a``, a second output from ``c``, and ``b`` computed and dropped."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        self.b(x)
        return self.a(x).sum(), self.c(x), (self.a.weight > 0).sum()


@pytest.mark.parametrize("both", [False, True])
def test_parameters_no_gradient_reaches_get_none_as_in_eager(both):
    """A parameter only an ignored output or a dropped value depends on, or one read only
    through an integer, gets ``grad`` None after ``backward``, as in eager (an optimizer
    with weight decay skips it then, and would not skip zeros)."""
    grads = []
    for wrap in (lambda m: m, plait.jit):
        torch.manual_seed(0)
        model = _Branches()
        loss, other, _ = wrap(model)(torch.randn(2, 4))
        (loss + other.sum() if both else loss).backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    assert {k for k, g in grads[0].items() if g is None} == \
        {k for k, g in grads[1].items() if g is None} == \
        ({"b.weight", "b.bias"} | (set() if both else {"c.weight", "c.bias"}))
    for k, g in grads[0].items():
        if g is not None:
            assert_close(grads[1][k], g)


def _thrice_plus_one(x):
    return x * 3 + 1


@pytest.mark.parametrize("calls", [0, 1])
def test_jitted_modules_and_functions_pickle_in_every_state(calls):
    """pickle, torch.save and copy.deepcopy keep the module (its weights, its mode) and the
    jit's settings; what was compiled is compiled again after loading."""
    import io
    import pickle

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    jitted, x = plait.jit(model), torch.randn(2, 4)
    for _ in range(calls):
        jitted(x)
    buffer = io.BytesIO()
    torch.save(jitted, buffer)
    buffer.seek(0)
    copies = [pickle.loads(pickle.dumps(jitted)), copy.deepcopy(jitted),
              torch.load(buffer, weights_only=False)]
    for loaded in copies:
        assert isinstance(loaded, type(jitted)) and loaded.trace_count == 0
        loaded.eval()
        assert_close(loaded(x), model.eval()(x))
        model.train()
    f = pickle.loads(pickle.dumps(plait.jit(_thrice_plus_one, backend="eager")))
    assert f.backend == "eager"
    assert_close(f(x), _thrice_plus_one(x))
