"""Every error plait raises at a user: its class and what its message says."""
from __future__ import annotations

import inspect

import pytest
import torch

import plait
from plait import errors
from plait.errors import (BackendError, ConcretizationError, GraphError, OpError, PlaitError,
                          ShapeError, TraceError, UnsupportedDtypeError, UnsupportedOpError)


def test_every_error_class_is_a_plait_error():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, BaseException)]
    assert {c.__name__ for c in classes} >= {
        "PlaitError", "ConcretizationError", "UnsupportedOpError", "UnsupportedDtypeError",
        "OpError", "ShapeError", "TraceError", "GraphError", "BackendError"}
    for cls in classes:
        assert issubclass(cls, PlaitError), cls
        assert issubclass(cls, Exception)
    assert issubclass(ShapeError, OpError)
    assert plait.PlaitError is PlaitError


# ---------------------------------------------------------------------------------------
# Concretization
# ---------------------------------------------------------------------------------------
def _branch(x):
    if x.sum() > 0:
        return x
    return -x


def _bool(x):
    return x * 2 if bool(x.sum()) else x


def _item(x):
    return x * x.sum().item()


def _tolist(x):
    return x * len([v for v in x.tolist() if v > 0])


def _float(x):
    return x * float(x.sum())


def _int(x):
    return x * int(x.amax())


def _range(x):
    return sum(x * i for i in range(x.sum().long()))


@pytest.mark.parametrize("transform", ["jit", "vmap"])
@pytest.mark.parametrize("fn", [_branch, _bool, _item, _tolist, _float, _int, _range],
                         ids=lambda f: f.__name__.strip("_"))
def test_concretization_errors(fn, transform):
    if transform == "jit" and fn is _branch:
        # jit takes the branch its call's tensors take (NOTE [value guards])
        for x in (torch.ones(4), -torch.ones(4)):
            torch.testing.assert_close(plait.jit(fn)(x), fn(x))
        return
    with pytest.raises(ConcretizationError) as info:
        getattr(plait, transform)(fn)(torch.randn(3, 4) if transform == "vmap" else
                                      torch.randn(4))
    message = str(info.value)
    assert "torch.where" in message and "static" in message
    assert "once available" not in message  # points only to what exists


def test_static_argument_is_the_fix_for_concretization():
    def f(x, flag):
        return x * 2 if flag else x

    jf = plait.jit(f, static_argnums=1)
    x = torch.randn(3)
    torch.testing.assert_close(jf(x, True), f(x, True))
    torch.testing.assert_close(jf(x, False), f(x, False))


# ---------------------------------------------------------------------------------------
# Dtypes and layouts
# ---------------------------------------------------------------------------------------
def test_sparse_input_raises():
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(UnsupportedDtypeError) as info:
        plait.jit(lambda x: x * 2)(sparse)
    assert "sparse" in str(info.value)


# ---------------------------------------------------------------------------------------
# Data-dependent shapes
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [
    lambda x: torch.nonzero(x),
    lambda x: x[x > 0],
    lambda x: torch.masked_select(x, x > 0),
    lambda x: torch.unique(x),
], ids=["nonzero", "mask_index", "masked_select", "unique"])
def test_data_dependent_shape_raises(fn):
    with pytest.raises(UnsupportedOpError):
        plait.jit(fn)(torch.randn(5))


def test_mask_assign_scalar_is_supported():
    def f(x):
        x = x.clone()
        x[x > 0] = 0.0
        return x

    x = torch.randn(6)
    torch.testing.assert_close(plait.jit(f)(x), f(x))


# ---------------------------------------------------------------------------------------
# Op errors name the op and the operand types
# ---------------------------------------------------------------------------------------
def test_broadcast_mismatch_names_op_and_shapes():
    with pytest.raises((OpError, ShapeError)) as info:
        plait.jit(torch.add)(torch.randn(3, 4), torch.randn(5))
    message = str(info.value)
    assert "aten.add" in message
    assert "f32[3,4]" in message and "f32[5]" in message


def test_operator_mismatch_names_op_and_shapes():
    with pytest.raises((OpError, ShapeError)) as info:
        plait.jit(lambda a, b: a + b)(torch.randn(3, 4), torch.randn(5))
    message = str(info.value)
    assert "aten.add" in message
    assert "f32[3,4]" in message and "f32[5]" in message


def test_mm_mismatch_names_op_and_shapes():
    with pytest.raises((OpError, ShapeError)) as info:
        plait.jit(torch.mm)(torch.randn(3, 4), torch.randn(5, 6))
    message = str(info.value)
    assert "aten.mm" in message
    assert "f32[3,4]" in message and "f32[5,6]" in message


def test_matmul_mismatch_names_shapes():
    with pytest.raises((OpError, ShapeError)) as info:
        plait.jit(lambda a, b: a @ b)(torch.randn(3, 4), torch.randn(5, 6))
    message = str(info.value)
    assert "f32[3,4]" in message and "f32[5,6]" in message


def test_eager_raises_on_the_same_mismatches():
    """The mismatches above are errors in eager PyTorch too (plait does not invent them)."""
    with pytest.raises(RuntimeError):
        torch.add(torch.randn(3, 4), torch.randn(5))
    with pytest.raises(RuntimeError):
        torch.mm(torch.randn(3, 4), torch.randn(5, 6))


def test_bad_reshape_raises_plait_error():
    with pytest.raises(PlaitError) as info:
        plait.jit(lambda x: x.reshape(5, 3))(torch.randn(4, 4))
    assert "f32[4,4]" in str(info.value)


# ---------------------------------------------------------------------------------------
# Tracing rules, backends, config
# ---------------------------------------------------------------------------------------
def test_unhashable_argument_raises():
    with pytest.raises(TraceError):
        plait.jit(lambda x, s: x * len(s))(torch.randn(3), {1, 2})


def test_escaped_tracer_raises():
    leaked = []

    def f(x):
        y = x * 2
        leaked.append(y)
        return y

    plait.jit(f)(torch.randn(3))
    with pytest.raises(PlaitError):
        leaked[0] + 1


def test_unknown_backend_raises():
    with pytest.raises(BackendError, match="no_such_backend"):
        plait.jit(lambda x: x, backend="no_such_backend")(torch.randn(2))
    with plait.config.patch(backend="no_such_backend"):
        with pytest.raises(BackendError):
            plait.jit(lambda x: x)(torch.randn(2))
    with pytest.raises(BackendError):
        plait.backends.get_backend("no_such_backend")


def test_unknown_config_option_raises():
    with pytest.raises(PlaitError, match="no_such_option"):
        with plait.config.patch(no_such_option=1):
            pass
    assert not hasattr(plait.config, "no_such_option")

    @plait.config.patch(no_such_option=1)
    def decorated():
        return 1

    with pytest.raises(PlaitError):
        decorated()


def test_unknown_config_option_with_known_one_changes_nothing():
    before = plait.config.fold_max_numel
    with pytest.raises(PlaitError):
        with plait.config.patch(fold_max_numel=1, no_such_option=1):
            pass
    assert plait.config.fold_max_numel == before


def test_graph_error_for_unknown_primitive():
    from plait.graph import GraphBuilder, TensorType

    b = GraphBuilder()
    x = b.add_input(TensorType((2,), torch.float32))
    (y,) = b.add_node("no_such_prim", [x], {}, [TensorType((2,), torch.float32)])
    with pytest.raises(GraphError, match="no_such_prim"):
        b.build([y]).validate()


def test_opaque_disabled_raises():
    def f(x):
        return torch.special.i1(x) + torch.rand_like(x)  # rand_like has no decomposition

    with plait.config.patch(allow_opaque=False):
        with pytest.raises(UnsupportedOpError, match="opaque"):
            plait.jit(f)(torch.randn(3))
