"""Linear algebra: the library-call primitives and the ops composed from them equal eager
(batched too), trace without opaque nodes, and raise where eager raises."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.testing import assert_close

import plait
from plait.errors import PlaitError, ShapeError, UnsupportedOpError

RTOL, ATOL = 1e-4, 1e-5


def _matrix(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _spd(*shape, dtype=torch.float32):
    a = torch.randn(*shape, dtype=dtype)
    return a @ a.mT + shape[-1] * torch.eye(shape[-1], dtype=dtype)


def prims(fn, *args) -> set[str]:
    graph = plait.jit(fn).lower(*args).graph
    return {graph.node(n).prim for n in graph.nx.nodes}


def check(fn, *args):
    """fn under plait.jit equals eager (structure, dtypes, values) and has no opaque node."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation notes for the legacy APIs
        expected = fn(*args)
        actual = plait.jit(fn)(*args)
        used = prims(fn, *args)
    assert type(actual) is type(expected)
    assert_close(actual, expected, rtol=RTOL, atol=ATOL, equal_nan=True)
    assert "opaque" not in used, used
    return used


# ---------------------------------------------------------------------------------------
# Factorizations: one primitive each
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(4, 4), (3, 5, 5), (2, 0, 0)])
@pytest.mark.parametrize("upper", [False, True])
def test_cholesky(shape, upper):
    a = _spd(*shape)
    assert "cholesky" in check(lambda a: torch.linalg.cholesky(a, upper=upper), a)
    check(lambda a: torch.linalg.cholesky_ex(a, upper=upper), a)
    check(lambda a: torch.cholesky(a, upper=upper), a)


@pytest.mark.parametrize("shape", [(4, 4), (3, 4, 6), (2, 6, 3)])
def test_lu_family(shape):
    a = _matrix(*shape)
    assert "lu" in check(torch.linalg.lu_factor, a)
    check(torch.linalg.lu_factor_ex, a)
    check(torch.linalg.lu, a)
    check(lambda a: torch.lu(a, get_infos=True), a)
    lu, pivots = torch.linalg.lu_factor(a)
    check(torch.lu_unpack, lu, pivots)
    check(lambda lu, p: torch.lu_unpack(lu, p, unpack_data=False), lu, pivots)
    check(lambda lu, p: torch.lu_unpack(lu, p, unpack_pivots=False), lu, pivots)


def test_lu_permutation_reorders_rows_into_l_times_u():
    a = _matrix(3, 6, 6)
    perm = plait.tracer.registry.get_primitive("lu_pivots_to_permutation").impl(
        torch.linalg.lu_factor(a).pivots, size=6)
    _, l, u = torch.linalg.lu(a)
    assert_close(torch.gather(a, -2, perm.unsqueeze(-1).expand(a.shape)), l @ u)


@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("adjoint", [True, False])
def test_lu_solve(left, adjoint):
    a = _matrix(2, 5, 5)
    lu, pivots = torch.linalg.lu_factor(a)
    b = _matrix(3, 1, 5, 2) if left else _matrix(3, 1, 2, 5)  # batch dims broadcast
    check(lambda lu, p, b: torch.linalg.lu_solve(lu, p, b, left=left, adjoint=adjoint),
          lu, pivots, b)
    if left:
        check(lambda lu, p, b: torch.lu_solve(b, lu, p), lu, pivots, b[0])


@pytest.mark.parametrize("upper", [True, False])
@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("unit", [True, False])
def test_solve_triangular(upper, left, unit):
    a = _matrix(2, 4, 4) + 4 * torch.eye(4)  # the other triangle must be ignored
    b = _matrix(3, 1, 4, 2) if left else _matrix(2, 3, 4)
    used = check(lambda a, b: torch.linalg.solve_triangular(
        a, b, upper=upper, left=left, unitriangular=unit), a, b)
    assert "triangular_solve" in used


@pytest.mark.parametrize("transpose", [True, False])
def test_triangular_solve_legacy(transpose):
    a, b = _matrix(2, 4, 4) + 4 * torch.eye(4), _matrix(3, 1, 4, 2)
    check(lambda b, a: torch.triangular_solve(b, a, upper=False, transpose=transpose), b, a)


@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (2, 4, 4), (0, 3), (3, 0)])
def test_geqrf(shape):
    assert "geqrf" in check(torch.geqrf, _matrix(*shape))


@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (2, 4, 4), (0, 3), (2, 6, 1)])
@pytest.mark.parametrize("mode", ["reduced", "complete", "r"])
def test_qr(shape, mode):
    """Eager's geqrf and householder_product (the qr primitive): signs are eager's exactly."""
    a = _matrix(*shape)
    used = check(lambda a: torch.linalg.qr(a, mode=mode), a)
    assert ("geqrf" if mode == "r" else "qr") in used
    for x, y in zip(plait.jit(torch.linalg.qr)(a), torch.linalg.qr(a)):
        assert torch.equal(x.sign(), y.sign())


def test_qr_legacy_and_householder():
    a = _matrix(2, 6, 4)
    check(torch.qr, a)
    check(lambda a: torch.qr(a, some=False), a)
    geqrf, tau = torch.geqrf(a)
    assert "householder_product" in check(torch.linalg.householder_product, geqrf, tau)
    check(torch.linalg.householder_product, geqrf, tau[..., :2])


@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("transpose", [True, False])
def test_ormqr(left, transpose):
    geqrf, tau = torch.geqrf(_matrix(2, 5, 3))
    c = _matrix(2, 5, 4) if left else _matrix(2, 4, 5)
    check(lambda a, t, c: torch.ormqr(a, t, c, left=left, transpose=transpose), geqrf, tau, c)


@pytest.mark.parametrize("uplo", ["L", "U"])
def test_eigh(uplo):
    a = _matrix(3, 5, 5)  # not symmetric: only the UPLO triangle may be read
    assert "eigh" in check(lambda a: torch.linalg.eigh(a, UPLO=uplo), a)
    check(lambda a: torch.linalg.eigvalsh(a, UPLO=uplo), a)


@pytest.mark.parametrize("shape", [(5, 3), (2, 3, 5), (0, 0)])
@pytest.mark.parametrize("full_matrices", [True, False])
def test_svd(shape, full_matrices):
    a = _matrix(*shape)
    assert "svd" in check(lambda a: torch.linalg.svd(a, full_matrices=full_matrices), a)
    check(torch.linalg.svdvals, a)
    check(lambda a: torch.svd(a, some=not full_matrices), a)
    check(lambda a: torch.svd(a, compute_uv=False), a)


# ---------------------------------------------------------------------------------------
# Composed ops
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inverse_and_solve(dtype):
    a = _matrix(3, 4, 4, dtype=dtype)
    assert {"lu", "lu_pivots_to_permutation", "triangular_solve"} <= check(torch.linalg.inv, a)
    check(torch.linalg.inv_ex, a)
    check(torch.inverse, a[0])
    check(torch.linalg.solve, a, _matrix(3, 4, 2, dtype=dtype))
    check(torch.linalg.solve, a, _matrix(4, dtype=dtype))  # vector right-hand side
    check(torch.linalg.solve, a, _matrix(3, 4, dtype=dtype))  # batch of vectors
    check(lambda a, b: torch.linalg.solve(a, b, left=False), a, _matrix(2, 1, 3, 4, dtype=dtype))
    check(torch.linalg.solve_ex, a, _matrix(4, 2, dtype=dtype))
    check(lambda a: torch.linalg.matrix_power(a, -3), a)


@pytest.mark.parametrize("shape", [(4, 4), (2, 3, 3), (0, 0), (1, 1)])
def test_determinants(shape):
    a = _matrix(*shape)
    check(torch.linalg.det, a)
    check(torch.linalg.slogdet, a)
    check(torch.logdet, a)  # nan for a negative determinant
    check(torch.logdet, _spd(*shape))
    singular = torch.ones(3, 3)
    check(torch.linalg.det, singular)
    check(torch.linalg.slogdet, singular)


@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_solve_and_inverse(upper):
    factor = torch.linalg.cholesky(_spd(2, 4, 4), upper=upper)
    check(lambda b, l: torch.cholesky_solve(b, l, upper=upper), _matrix(3, 1, 4, 2), factor)
    check(lambda l: torch.cholesky_inverse(l, upper=upper), factor)
    check(lambda l: torch.cholesky_inverse(l, upper=upper), factor[0])


@pytest.mark.parametrize("hermitian", [False, True])
def test_pinv_and_rank(hermitian):
    a = _spd(2, 5, 5) if hermitian else _matrix(2, 5, 3)
    low_rank = a[..., :, :1] @ a[..., :1, :]  # rank 1: the tolerance cuts the rest
    for x in (a, low_rank):
        check(lambda x: torch.linalg.pinv(x, hermitian=hermitian), x)
        check(lambda x: torch.linalg.pinv(x, atol=0.5, hermitian=hermitian), x)
        check(lambda x: torch.linalg.pinv(x, rtol=0.3, hermitian=hermitian), x)
        check(lambda x: torch.linalg.matrix_rank(x, hermitian=hermitian), x)
    check(torch.pinverse, a)
    check(lambda x: torch.linalg.pinv(x, rcond=0.2), a)  # the legacy overloads
    check(lambda x: torch.linalg.matrix_rank(x, tol=0.5), a)
    check(torch.linalg.pinv, _matrix(3, 0))


def test_norms_and_tensor_ops():
    a = _matrix(2, 4, 4)
    for p in (None, 2, -2, "nuc", "fro", 1, float("inf")):
        check(lambda a, p=p: torch.linalg.cond(a, p), a)
    check(lambda a: torch.linalg.matrix_norm(a, "nuc"), a)
    check(lambda a: torch.linalg.matrix_norm(a, -2), a)
    check(lambda a: torch.norm(a, "nuc", dim=(0, 2)), a)
    check(lambda a: torch.linalg.tensorinv(a, ind=1), _matrix(8, 2, 4))
    check(lambda a, b: torch.linalg.tensorsolve(a, b), _matrix(2, 3, 6), _matrix(2, 3))


def _rank_deficient(*shape, rank, dtype=torch.float32):
    return _matrix(*shape[:-1], rank, dtype=dtype) @ _matrix(*shape[:-2], rank, shape[-1],
                                                             dtype=dtype)


def _lstsq(driver, rcond=None):
    return lambda a, b: torch.linalg.lstsq(a, b, rcond=rcond, driver=driver)


DRIVERS = ["gels", "gelsy", "gelsd", "gelss", None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (5, 5), (2, 3, 6, 4), (3, 4, 6), (0, 3),
                                   (3, 0)])
def test_lstsq(shape, driver, dtype):
    """Every output as eager's: residuals only where the driver and shape give them, rank and
    singular values only from the drivers that compute them."""
    a = _matrix(*shape, dtype=dtype)
    used = check(_lstsq(driver), a, _matrix(*shape[:-1], 2, dtype=dtype))
    assert ("geqrf" if driver == "gels" else "svd") in used
    check(_lstsq(driver), a, _matrix(*shape[:-1], dtype=dtype))  # vector right-hand side
    if len(shape) > 2:  # batch dims broadcast; rank and singular values keep a's
        check(_lstsq(driver), a[:1], _matrix(2, *shape[1:-1], 2, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("driver", ["gelsy", "gelsd", "gelss"])
@pytest.mark.parametrize("shape", [(4, 6), (5, 5), (3, 4, 7)])
def test_lstsq_rank_deficient(shape, driver, dtype):
    """The rank (and minimum-norm solution) from the singular values above rcond."""
    a = _rank_deficient(*shape, rank=2, dtype=dtype)
    b = _matrix(*shape[:-1], 2, dtype=dtype)
    assert (plait.jit(_lstsq(driver))(a, b).rank == 2).all()
    check(_lstsq(driver), a, b)
    check(_lstsq(driver), torch.zeros_like(a), b)
    if driver != "gelsy":  # a cutoff that drops real singular values
        a = _matrix(*shape, dtype=dtype) * torch.logspace(0, -3, shape[-1], dtype=dtype)
        check(_lstsq(driver, rcond=1e-2), a, b)


def test_lstsq_gels():
    """gels assumes full rank: an exact zero on r's diagonal raises as eager; its residuals
    are LAPACK's even for a numerically singular a; an all-zero a gives zeros."""
    singular = _matrix(2, 5, 3)
    singular[1, :, 1] = 0
    _same_error(_lstsq("gels"), singular, _matrix(2, 5, 2))
    _same_error(_lstsq("gels"), singular.mT, _matrix(2, 3, 2))
    check(_lstsq("gels"), _rank_deficient(5, 3, rank=2), _matrix(5, 2))
    check(_lstsq("gels"), torch.zeros(2, 5, 3), _matrix(2, 5, 2))


def test_lstsq_unsupported_cases_raise():
    """Where plait cannot give eager's answer it raises instead."""
    tall = _rank_deficient(6, 4, rank=2)
    b = _matrix(6, 2)
    for driver in ("gelsd", "gelss"):  # eager's residuals are empty here: a data-dependent shape
        with pytest.raises(PlaitError, match="rank-deficient tall"):
            plait.jit(_lstsq(driver))(tall, b)
        check(_lstsq(driver), _matrix(6, 4), b)  # the same shapes, full rank: fine
    with pytest.raises(PlaitError, match="rounding noise"):
        plait.jit(_lstsq("gelsd", rcond=1e-20))(tall, b)
    for driver, rcond in (("gelsy", 1e-2), ("gelsd", 0.0), ("gelss", -1.0)):
        with pytest.raises(UnsupportedOpError, match="rcond"):
            plait.jit(_lstsq(driver, rcond)).lower(tall, b)


def test_lstsq_invalid_arguments_raise_while_tracing():
    for a, b, words in ((_matrix(3), _matrix(3), "at least 2 dimensions"),
                        (_matrix(5, 3), _matrix(4, 2), r"other.size\(-2\)"),
                        (_matrix(5, 3), _matrix(4), r"other.size\(-1\)"),
                        (_matrix(5, 3), _matrix(2, 5, 2), "other.dim"),
                        (_matrix(5, 3), _matrix(5, 2, dtype=torch.float64), "same dtype")):
        with pytest.raises(RuntimeError):
            torch.linalg.lstsq(a, b)
        with pytest.raises(ShapeError, match=words):
            plait.jit(torch.linalg.lstsq).lower(a, b)
    with pytest.raises(ShapeError, match="driver"):
        plait.jit(_lstsq("gelsx")).lower(_matrix(5, 3), _matrix(5, 2))


@pytest.mark.parametrize("offset", [0, 1, -2, 7])
@pytest.mark.parametrize("dims", [(-2, -1), (0, 2), (2, 0)])
def test_diagonal(offset, dims):
    check(lambda x: torch.diagonal(x, offset, *dims), _matrix(3, 4, 5))
    check(lambda x: torch.linalg.diagonal(x, offset=offset), _matrix(2, 5, 4))


# ---------------------------------------------------------------------------------------
# Errors: eager's, where eager raises them
# ---------------------------------------------------------------------------------------
def _same_error(fn, *args):
    with pytest.raises(Exception) as eager:
        fn(*args)
    with pytest.raises(type(eager.value)) as traced:
        plait.jit(fn)(*args)
    assert str(eager.value) in str(traced.value)  # plait may add advice around it
    return traced.value


SINGULAR = torch.tensor([[1., 2., 3.], [2., 4., 6.], [0., 1., 5.]])


@pytest.mark.parametrize("fn", [
    torch.linalg.inv,
    lambda a: torch.linalg.solve(a, torch.ones(3)),
    torch.linalg.lu_factor,
    lambda a: torch.linalg.inv_ex(a, check_errors=True),
    lambda a: torch.linalg.lu_factor_ex(a, check_errors=True),
    lambda a: torch.linalg.matrix_power(a, -1),
    lambda a: torch.linalg.tensorinv(a, ind=1),
])
def test_singular_matrix_raises_at_run_time(fn):
    _same_error(fn, SINGULAR)
    _same_error(fn, torch.stack([torch.eye(3), SINGULAR]))  # names the batch element
    assert_close(plait.jit(fn)(torch.eye(3)), fn(torch.eye(3)))  # the same trace runs fine


@pytest.mark.parametrize("fn", [
    torch.linalg.cholesky, torch.cholesky,
    lambda a: torch.linalg.cholesky_ex(a, check_errors=True),
    lambda a: torch.cholesky_inverse(torch.triu(a)),
])
def test_indefinite_or_singular_factor_raises(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _same_error(fn, torch.diag(torch.tensor([1., 0., 2.])))


def test_ex_variants_report_info_instead_of_raising():
    for fn in (torch.linalg.inv_ex, torch.linalg.lu_factor_ex, torch.linalg.cholesky_ex):
        assert_close(plait.jit(fn)(SINGULAR - 3 * torch.eye(3)).info,
                     fn(SINGULAR - 3 * torch.eye(3)).info)
    assert plait.jit(torch.linalg.inv_ex)(SINGULAR).info == 3


def test_invalid_arguments_raise_while_tracing():
    """The op's meta kernel checks the arguments, so the message is (nearly) eager's."""
    for fn, x, words in ((torch.linalg.inv, _matrix(3, 4), "square matrices"),
                         (torch.linalg.cholesky, _matrix(4), "at least 2 dimensions"),
                         (lambda a: torch.linalg.eigh(a, UPLO="X"), _matrix(3, 3), "UPLO")):
        with pytest.raises(RuntimeError):
            fn(x)
        with pytest.raises(ShapeError, match=words):
            plait.jit(fn).lower(x)
    with pytest.raises(PlaitError):
        plait.jit(torch.linalg.solve).lower(_matrix(3, 3), _matrix(4))


# ---------------------------------------------------------------------------------------
# Derivatives: plait.grad equals torch.func.grad (each primitive's rule, batched)
# ---------------------------------------------------------------------------------------
def _weighted(fn):
    """A scalar of all of fn's float outputs, each weighted by a fixed pattern (so that no
    output's cotangent is uniform)."""
    def loss(*args):
        outs = fn(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum((o * torch.cos(torch.arange(o.numel(), dtype=o.dtype)).reshape(o.shape)).sum()
                   for o in outs if o.dtype.is_floating_point)
    return loss


def check_grad(fn, *args):
    argnums = tuple(range(len(args)))
    expected = torch.func.grad(_weighted(fn), argnums)(*args)
    assert_close(plait.grad(_weighted(fn), argnums)(*args), expected, rtol=1e-6, atol=1e-8)


_D = torch.float64
_SQ, _TALL, _WIDE = (_matrix(2, 4, 4, dtype=_D), _matrix(2, 5, 3, dtype=_D),
                     _matrix(2, 3, 5, dtype=_D))


@pytest.mark.parametrize("fn, args", [
    (lambda a: torch.linalg.cholesky(a), (_spd(2, 4, 4, dtype=_D),)),
    (lambda a: torch.linalg.cholesky(a, upper=True), (_spd(2, 4, 4, dtype=_D),)),
    (lambda a, b: torch.linalg.solve_triangular(a, b, upper=False), (_SQ, _TALL[..., :4, :])),
    (lambda a, b: torch.linalg.solve_triangular(a, b, upper=True, left=False,
                                                unitriangular=True), (_SQ, _WIDE[..., :4])),
    (lambda a: torch.linalg.lu_factor(a)[0], (_SQ,)),
    (lambda a: torch.linalg.lu(a)[1:], (_TALL,)),
    (lambda a: torch.linalg.lu(a)[1:], (_WIDE,)),
    (torch.linalg.inv, (_SQ,)),
    (torch.linalg.det, (_SQ,)),
    (torch.linalg.solve, (_SQ, _TALL[..., :4, :])),
    (lambda a: torch.linalg.qr(a), (_TALL,)),
    (lambda a: torch.linalg.qr(a, mode="complete"), (_WIDE,)),
    (torch.linalg.householder_product, (_TALL, _matrix(2, 2, dtype=_D))),
    (lambda a, t, c: torch.ormqr(a, t, c, transpose=True), (_TALL, _matrix(2, 3, dtype=_D),
                                                             _matrix(2, 5, 2, dtype=_D))),
    (lambda a: torch.linalg.eigh(a), (_SQ,)),
    (lambda a: torch.linalg.eigh(a, UPLO="U"), (_SQ,)),
    (torch.linalg.eigvalsh, (_SQ,)),
    (lambda a: torch.linalg.svd(a, full_matrices=False), (_TALL,)),
    (lambda a: torch.linalg.svd(a, full_matrices=True), (_WIDE,)),
    (torch.linalg.svdvals, (_TALL,)),
    (torch.linalg.pinv, (_WIDE,)),
    (lambda a: torch.linalg.pinv(a, hermitian=True), (_SQ,)),  # eager's formula, any a
])
def test_grad_matches_eager(fn, args):
    check_grad(fn, *args)


def test_unused_eigen_and_singular_vectors_give_no_nan():
    """Eager skips the vector terms when they got no cotangent; their gap division would turn
    a repeated eigen- or singular value into NaN."""
    eye = torch.eye(3, dtype=_D)
    check_grad(lambda a: torch.linalg.eigh(a)[0], eye)
    check_grad(lambda a: torch.linalg.svd(a)[1], eye)


@pytest.mark.parametrize("fn", [
    torch.linalg.det,
    lambda a: torch.linalg.inv(a).sin().sum(),
    lambda a: torch.linalg.eigvalsh(a @ a.mT).prod(),
    lambda a: torch.linalg.svd(a)[0].cos().sum(),
])
def test_grad_of_grad_matches_eager(fn):
    a = _SQ[0]
    expected = torch.func.grad(lambda x: torch.func.grad(fn)(x).square().sum())(a)
    actual = plait.grad(lambda x: plait.grad(fn)(x).square().sum())(a)
    assert_close(actual, expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("fn", [
    lambda a: torch.linalg.qr(a, mode="r")[1],         # eager: needs q
    lambda a: torch.linalg.qr(a, mode="complete")[0],  # eager: not differentiable if tall
    lambda a: torch.geqrf(a)[0],                       # eager: not implemented
])
def test_nondifferentiable_factorizations_raise(fn):
    with pytest.raises(UnsupportedOpError):
        plait.grad(lambda a: fn(a).sum())(_TALL[0])


def test_pinv_gradient_at_repeated_singular_values_matches_eager():
    """pinv is differentiated by eager's own formula, defined at the identity too (svd's
    derivative divides by the gap between singular values there)."""
    weights = torch.arange(9.0).reshape(3, 3)
    f = lambda x: (torch.linalg.pinv(x) * weights).sum()  # noqa: E731
    for a in (torch.eye(3), torch.diag(torch.tensor([1.0, 1.0, 0.0]))):
        assert_close(plait.grad(f)(a), torch.func.grad(f)(a))
        assert_close(plait.grad(lambda x: plait.grad(f)(x).sum())(a),
                     torch.func.grad(lambda x: torch.func.grad(f)(x).sum())(a))


def test_derivative_through_a_singular_lu_raises():
    singular = torch.tensor([[1.0, 2.0], [2.0, 4.0]])
    with pytest.raises(plait.errors.CheckError, match="singular"):
        plait.grad(torch.linalg.det)(singular)
