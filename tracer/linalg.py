"""Linear algebra: a few library-call primitives (as jax.lax.linalg) and the ATen linalg ops
composed from them.

NOTE [linalg primitives]
Factorizations cannot be written with plait's other primitives, so each is one primitive
whose ``impl`` is the LAPACK (or cuSOLVER) call eager PyTorch makes: ``cholesky``, ``lu``
(with ``lu_pivots_to_permutation``), ``triangular_solve``, ``geqrf`` (QR as Householder
reflectors), ``householder_product`` (their product), ``qr`` (geqrf then householder_product,
as in eager: one primitive since eager differentiates qr through q and r, never through
geqrf, which is not differentiable), ``eigh`` and ``svd``. ``linalg_check`` is an effectful
primitive with no result: it raises ``plait.errors.LinAlgError`` (a
``torch.linalg.LinAlgError``) at run time wherever eager would (a singular or indefinite
matrix). Every other linalg op is composed from these and
ordinary primitives (inv and solve from LU and two triangular solves, det from LU's
diagonal, pinv from svd or eigh, lstsq from geqrf or svd, ...). The set is kept small
because each primitive needs its own differentiation and batching rules; the compositions
get theirs for free. Eigen- and singular vectors are only defined up to sign, so they always
come from the very LAPACK call eager uses, never from a different route.

Each derivative rule is eager's backward formula (FunctionsManual.cpp), written with torch
ops so that it is differentiable again; like eager's, eigh's and cholesky's gradients are
symmetric rather than confined to the triangle read, and eigh's and svd's skip the
eigenvector terms when those outputs got no cotangent.

Handlers first run the op's meta kernel (or, for an op without one, a copy of its checks),
so invalid arguments raise eager's own message while tracing. Complex operands go to an
opaque node: the compositions use transposes where a complex matrix needs the conjugate
transpose. ``linalg.matrix_exp`` (its Taylor degree and number of squarings depend on the
matrix norm) and ``linalg.ldl_*`` (Bunch-Kaufman pivots interleave 1x1 and 2x2 blocks by
value) stay opaque.
"""
from __future__ import annotations

import functools

import torch
from torch.utils import _pytree as pytree

from ..errors import CheckError, LinAlgError, ShapeError, UnsupportedOpError
from ..graph import TensorType
from .aten import broadcast_shapes, full, handles, type_of
from .primitives import _check
from .registry import define, jvp_rule, vjp_rule
from .trace import bind, current_trace

aten = torch.ops.aten
_FLOATS = (torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------
# Primitives
# ---------------------------------------------------------------------------------------
def _check_matrices(prim: str, *types: TensorType, square: bool = False) -> None:
    for t in types:
        _check(t.ndim >= 2 and t.dtype == types[0].dtype in _FLOATS, prim,
               "expected float32 or float64 matrices of one dtype", *types)
        _check(t.shape[:-2] == types[0].shape[:-2], prim, "batch dims must match", *types)
    _check(not square or types[0].shape[-1] == types[0].shape[-2], prim,
           "expected a square matrix", *types)


def _like(t: TensorType, shape, dtype=None) -> TensorType:
    return TensorType(tuple(shape), dtype or t.dtype, t.device)


def _batch(t: TensorType, *trailing) -> TensorType:
    """A result with ``t``'s batch dims and the given trailing dims."""
    return _like(t, t.shape[:-2] + trailing)


def _cholesky_infer(a):
    _check_matrices("cholesky", a, square=True)
    return a, _like(a, a.shape[:-2], torch.int32)


# Lower triangular only (reads the lower triangle, as LAPACK's potrf('L')); info > 0 marks
# the first minor that is not positive-definite.
define("cholesky", _cholesky_infer, lambda a: tuple(torch.linalg.cholesky_ex(a)),
       multiple_results=True)


@jvp_rule("cholesky")
def _cholesky_jvp(operands, tangents, outs):
    """Eager's forward formula on the whole tangent: dl = l phi(l^-1 da l^-T), phi taking
    the lower triangle with the diagonal halved (not the transpose of the symmetrized VJP)."""
    l = outs[0]
    inner = torch.linalg.solve_triangular(
        l.mT, torch.linalg.solve_triangular(l, tangents[0], upper=False), upper=True,
        left=False)
    phi = inner.tril() - 0.5 * torch.diag_embed(torch.diagonal(inner, 0, -2, -1))
    return l @ phi, None


@vjp_rule("cholesky")
def _cholesky_vjp(cts, a, *, outs):
    """Eager's: l^-T phi(l^T gl) l^-1, phi keeping the lower triangle with the diagonal
    halved, mirrored into a symmetric matrix (eager's gradient is not masked to the triangle
    that is read)."""
    l = outs[0]
    g = (l.mT @ cts[0]).tril()
    g = 0.5 * (g + g.tril(-1).mT)
    g = solve_triangular(l, g, lower=True, transpose=True)
    return (solve_triangular(l, g, lower=True, left=False),)


def _triangular_solve_infer(a, b, *, lower, unit_diagonal):
    _check_matrices("triangular_solve", a, b)
    _check(a.shape[-1] == a.shape[-2] == b.shape[-2], "triangular_solve",
           "expected a square a with as many rows as b", a, b)
    return (b,)


# Solves a @ x = b, reading only a's lower (or upper) triangle.
define("triangular_solve", _triangular_solve_infer,
       lambda a, b, *, lower, unit_diagonal: torch.linalg.solve_triangular(
           a, b, upper=not lower, unitriangular=unit_diagonal))


@vjp_rule("triangular_solve")
def _triangular_solve_vjp(cts, a, b, *, outs, lower, unit_diagonal):
    """gb solves with a.mT; ga = -gb x^T, masked to the entries of a that are read."""
    gb = solve_triangular(a, cts[0], lower=lower, unit=unit_diagonal, transpose=True)
    ga = -(gb @ outs[0].mT)
    unit = int(unit_diagonal)
    return (ga.tril(-unit) if lower else ga.triu(unit)), gb


def _lu_infer(a, *, pivot):
    _check_matrices("lu", a)
    k = min(a.shape[-2:])
    return a, _like(a, a.shape[:-2] + (k,), torch.int32), _like(a, a.shape[:-2], torch.int32)


# LU, 1-based LAPACK row pivots (int32) and info (> 0: U has a zero on its diagonal).
define("lu", _lu_infer, lambda a, *, pivot: tuple(torch.linalg.lu_factor_ex(a, pivot=pivot)),
       multiple_results=True)


@vjp_rule("lu")
def _lu_vjp(cts, a, *, outs, pivot):
    """Eager's linalg_lu_backward, with gl and gu the packed cotangent's strict lower (unit l)
    and upper parts. p @ l @ u = a, l (m, k), u (k, n); for a wide (or square) a with
    u = [u1 | u2]: ga = p l^-T [(l^T gl - gu u^T).tril(-1) u1^-T + gu1 | gu2]; for a tall
    one with l = [l1; l2], the same with the roles of l and u exchanged."""
    m, n = a.shape[-2:]
    k = min(m, n)
    p, l, u = _lu_unpack(*outs[:2])
    # The rule solves with U: at a zero pivot it would give inf/NaN, where eager has special
    # formulas for some ops (det); refuse rather than answer differently.
    bind("check", torch.any(torch.diagonal(u[..., :k, :k], 0, -2, -1) == 0),
         message="plait cannot differentiate through the LU factorization of a singular "
                 "matrix (det, slogdet, inv or solve at a singular matrix)")
    gl, gu = cts[0][..., :, :k].tril(-1), cts[0][..., :k, :].triu()
    if m <= n:
        g = solve_triangular(u[..., :k], (l.mT @ gl - gu @ u.mT).tril(-1), lower=False,
                             left=False, transpose=True)
        g = torch.cat([g + gu[..., :k], gu[..., k:]], -1)
        g = solve_triangular(l, g, lower=True, unit=True, transpose=True)
    else:
        g = solve_triangular(l[..., :k, :], (gu @ u.mT - l.mT @ gl).triu(), lower=True,
                             unit=True, transpose=True)
        g = torch.cat([g + gl[..., :k, :], gl[..., k:, :]], -2)
        g = solve_triangular(u, g, lower=False, left=False, transpose=True)
    return (p @ g if pivot else g,)


def _pivots_infer(pivots, *, size):
    _check(pivots.ndim >= 1 and pivots.dtype == torch.int32 and pivots.shape[-1] <= size,
           "lu_pivots_to_permutation", f"expected int32 pivots, at most {size} of them",
           pivots)
    return (_like(pivots, pivots.shape[:-1] + (size,), torch.int64),)


def _pivots_impl(pivots, *, size):
    """Apply the row swaps in order: a[perm] == l @ u."""
    perm = torch.arange(size, device=pivots.device).expand(*pivots.shape[:-1], size).clone()
    swaps = pivots.long() - 1
    for i in range(pivots.shape[-1]):
        j = swaps[..., i:i + 1]
        here, there = perm[..., i:i + 1].clone(), perm.gather(-1, j)
        perm[..., i:i + 1] = there
        perm.scatter_(-1, j, here)
    return perm


define("lu_pivots_to_permutation", _pivots_infer, _pivots_impl)


def _geqrf_infer(a):
    _check_matrices("geqrf", a)
    return a, _like(a, a.shape[:-2] + (min(a.shape[-2:]),))


# Householder QR (LAPACK's geqrf): r in the upper triangle, each reflector's vector below the
# diagonal and its scale in tau, as householder_product takes them.
define("geqrf", _geqrf_infer, lambda a: tuple(torch.geqrf(a)), multiple_results=True)


@vjp_rule("geqrf")
def _geqrf_vjp(cts, a, *, outs):
    raise UnsupportedOpError(
        "geqrf is not differentiable, as in eager PyTorch, nor is linalg.qr with mode='r' "
        "(use mode='reduced'). plait's linalg.lstsq with driver 'gels' is built on geqrf, so "
        "it cannot be differentiated yet either (eager can): use driver 'gelsd' instead")


def _householder_infer(a, tau):
    _check_matrices("householder_product", a)
    ok = (tau.shape == a.shape[:-2] + tau.shape[-1:] and tau.dtype == a.dtype
          and a.shape[-1] <= a.shape[-2] and tau.shape[-1] <= a.shape[-1])
    _check(ok, "householder_product", "expected a (..., m, n) with m >= n and tau (..., k) "
           "with k <= n", a, tau)
    return (a,)


# The first n columns of the product of the k Householder reflectors (LAPACK's orgqr).
define("householder_product", _householder_infer, torch.linalg.householder_product)


@vjp_rule("householder_product")
def _householder_product_vjp(cts, a, tau, *, outs):
    """q = h_1 ... h_k e (e: the first n columns of the identity), h_i = I - tau_i v_i v_i^T
    with v_i column i of a below the diagonal and 1 on it; tau is independent of a, as in
    eager. With q = l_i h_i r_i (l_i the reflectors before i, r_i those after, times e):
    g(h_i) = l_i^T g r_i^T, so g(tau_i) = -(l_i v)^T g (r_i^T v) and
    g(v_i) = -tau_i (l_i^T g r_i^T v + r_i g^T l_i v), of which a gets the part below the
    diagonal (the rest of a is never read)."""
    m, n = a.shape[-2:]
    k = tau.shape[-1]
    if k == 0:  # q is e
        return None, None
    g = cts[0]
    vs = a[..., :, :k].tril(-1) + _eye(m, a, k)
    v, t = [vs[..., :, i:i + 1] for i in range(k)], [tau[..., i, None, None] for i in range(k)]
    rs = [_eye(m, a, n)]  # r_{k-1}, ..., r_0
    for i in reversed(range(1, k)):
        rs.append(rs[-1] - t[i] * v[i] @ (v[i].mT @ rs[-1]))
    l, gv, gtau = _eye(m, a), [], []
    for i, r in zip(range(k), reversed(rs)):
        lv, gb = l @ v[i], g @ (r.mT @ v[i])
        gtau.append(-(lv.mT @ gb)[..., 0, 0])
        gv.append(-t[i] * (l.mT @ gb + r @ (g.mT @ lv)))
        l = l - t[i] * lv @ v[i].mT
    return torch.nn.functional.pad(torch.cat(gv, -1).tril(-1), (0, n - k)), torch.stack(gtau, -1)


def _qr_infer(a, *, complete):
    _check_matrices("qr", a)
    m, n = a.shape[-2:]
    k = m if complete else min(m, n)
    return _batch(a, m, k), _batch(a, k, n)


# q and r of linalg.qr: eager's geqrf and householder_product, as one primitive because eager
# differentiates qr through q and r (geqrf itself is not differentiable).
define("qr", _qr_infer, lambda a, *, complete: tuple(torch.linalg.qr(
    a, "complete" if complete else "reduced")), multiple_results=True)


@vjp_rule("qr")
def _qr_vjp(cts, a, *, outs, complete):
    """Eager's linalg_qr_backward. For m >= n: ga = (gq + q sym(m)) r^-T, m = r gr^T - gq^T q
    and sym(m) the symmetric matrix with m's lower triangle. For m < n, a = [x | y] with
    x = q r1 square and y = q r2: gy = q gr2, and x's rule sees gq + y gr2^T."""
    m, n = a.shape[-2:]
    if complete and m > n:
        raise UnsupportedOpError("qr: the QR decomposition is not differentiable with "
                                 "mode='complete' and more rows than columns, as in eager")
    q, r = outs
    k = min(m, n)
    gq, gr = cts
    if m < n:
        gq = gq + a[..., k:] @ gr[..., k:].mT
    sym = (r[..., :k] @ gr[..., :k].mT - gq.mT @ q).tril()
    sym = sym + sym.tril(-1).mT
    gx = solve_triangular(r[..., :k], gq + q @ sym, lower=False, left=False, transpose=True)
    return (torch.cat([gx, q @ gr[..., k:]], -1),)


def _eigh_infer(a, *, lower, compute_v):
    _check_matrices("eigh", a, square=True)
    w = _like(a, a.shape[:-1])
    return (w, a) if compute_v else (w,)


def _eigh_impl(a, *, lower, compute_v):
    w, v = aten._linalg_eigh(a, "L" if lower else "U", compute_v)
    return (w, v) if compute_v else (w,)


# Ascending eigenvalues of the symmetric matrix in a's lower (or upper) triangle.
define("eigh", _eigh_infer, _eigh_impl, multiple_results=True)


@jvp_rule("eigh")
def _eigh_jvp(operands, tangents, outs, *, lower, compute_v):
    """Eager's forward formula, on the whole tangent (as eager reads it): with
    p = v^T da v, dw = diag(p) and dv = v (p / e), e_ij = w_j - w_i, zero on the diagonal.
    It is not the transpose of the (symmetrized) VJP, so it is written out."""
    w, v = outs if compute_v else torch.linalg.eigh(operands[0], "L" if lower else "U")
    p = v.mT @ tangents[0] @ v
    dw = torch.diagonal(p, 0, -2, -1)
    if not compute_v:
        return dw, None
    gap = w.unsqueeze(-2) - w.unsqueeze(-1)
    off = torch.where(_eye(gap.shape[-1], p).to(torch.bool), 0.0,
                      p / (gap + _eye(gap.shape[-1], p)))
    return dw, v @ off


def _no_cotangent(ct) -> bool:
    """Is ``ct`` the zeros the engine passes for an output that got no cotangent? Eager skips
    an undefined gradient's terms; computing them from zeros would give 0/0 = NaN where they
    divide by the gap between two equal eigen- or singular values."""
    node = ct._trace.builder.node(ct._value.node)
    return node.prim == "full" and node.kwargs.get("value") == 0


@vjp_rule("eigh")
def _eigh_vjp(cts, a, *, outs, lower, compute_v):
    """Eager's: ga = v (diag(gw) + skew(v^T gv) / e) v^T, e_ij = w_j - w_i; symmetric, not
    masked to the triangle read. eigvalsh computes v here, as eager does when differentiating."""
    w, v = outs if compute_v else torch.linalg.eigh(a, "L" if lower else "U")
    gw = cts[0]
    if not compute_v or _no_cotangent(cts[1]):
        return ((v * gw.unsqueeze(-2)) @ v.mT,)
    vtgv = v.mT @ cts[1]
    e = w.unsqueeze(-2) - w.unsqueeze(-1) + _eye(w.shape[-1], a)
    return (v @ (0.5 * (vtgv - vtgv.mT) / e + torch.diag_embed(gw)) @ v.mT,)


def _svd_infer(a, *, full_matrices, compute_uv, driver):
    _check_matrices("svd", a)
    m, n = a.shape[-2:]
    k = min(m, n)
    s = _like(a, a.shape[:-2] + (k,))
    if not compute_uv:
        return (s,)
    return _batch(a, m, m if full_matrices else k), s, _batch(a, n if full_matrices else k, n)


def _svd_impl(a, *, full_matrices, compute_uv, driver):
    u, s, vh = aten._linalg_svd(a, full_matrices, compute_uv, driver=driver)
    return (u, s, vh) if compute_uv else (s,)


# Descending singular values; u and vh as eager's (the driver only matters on CUDA).
define("svd", _svd_infer, _svd_impl, multiple_results=True)


@vjp_rule("svd")
def _svd_vjp(cts, a, *, outs, full_matrices, compute_uv, driver):
    """Eager's svd_backward, on the first k = min(m, n) singular vectors (eager drops the rest
    of full_matrices' too): ga = u (diag(gs) + (skew(u^T gu) s + s skew(v^T gv)) / e) v^T,
    e_ij = s_j^2 - s_i^2, plus the part of gu outside u's span (tall a) or of gv outside v's
    (wide a). svdvals computes u and v here, as eager does when differentiating."""
    m, n = a.shape[-2:]
    k = min(m, n)
    if compute_uv:
        (u, s, vh), (gu, gs, gvh) = outs, cts
        u, vh = u[..., :k], vh[..., :k, :]
        gu = None if _no_cotangent(gu) else gu[..., :k]
        gvh = None if _no_cotangent(gvh) else gvh[..., :k, :]
    else:
        (u, s, vh), (gs,), gu, gvh = torch.linalg.svd(a, False, driver=driver), cts, None, None
    if gu is None and gvh is None:
        return ((u * gs.unsqueeze(-2)) @ vh,)
    s2 = s * s
    inner = 0
    if gu is not None:
        inner = (u.mT @ gu - gu.mT @ u) * s.unsqueeze(-2)
    if gvh is not None:
        inner = inner + s.unsqueeze(-1) * (vh @ gvh.mT - gvh @ vh.mT)
    inner = inner / (s2.unsqueeze(-2) - s2.unsqueeze(-1) + _eye(k, a)) + torch.diag_embed(gs)
    if m > n and gu is not None:
        gus = gu / s.unsqueeze(-2)
        return ((u @ inner + gus - u @ (u.mT @ gus)) @ vh,)
    if m < n and gvh is not None:
        gvs = gvh / s.unsqueeze(-1)
        return (u @ (inner @ vh + gvs - (gvs @ vh.mT) @ vh),)
    return (u @ inner @ vh,)


# pinv is a primitive of its own because eager differentiates it by a formula in the
# pseudo-inverse itself, which is defined where svd's derivative is not (repeated singular
# values, e.g. at the identity); the rule reads the output, so it differentiates again.
def _pinv_infer(a, atol, rtol, *, hermitian):
    _check_matrices("pinv", a)
    return (_batch(a, a.shape[-1], a.shape[-2]),)


define("pinv", _pinv_infer, lambda a, atol, rtol, *, hermitian: torch.linalg.pinv(
    a, atol=atol, rtol=rtol, hermitian=hermitian))


@vjp_rule("pinv")
def _pinv_vjp(cts, a, atol, rtol, *, outs, hermitian):
    """Eager's pinv_backward, arranged so the products stay small."""
    p, gh = outs[0], cts[0].mT
    ph = p.mT
    if a.shape[-2] <= a.shape[-1]:
        k = gh @ p
        kph = k @ ph
        return -(p @ k).mT + kph - (a @ p) @ kph + (ph @ p) @ (gh - k @ a), None, None
    k = p @ gh
    phk = ph @ k
    return -(k @ p).mT + (gh - a @ k) @ p @ ph + phk - phk @ p @ a, None, None


def _linalg_check_infer(info, *, api, is_matrix):
    _check(info.dtype == torch.int32, "linalg_check", "info must be int32", info)
    return ()


def _linalg_check_impl(info, *, api, is_matrix):
    try:
        torch._linalg_check_errors(info, api, is_matrix=is_matrix)
    except torch.linalg.LinAlgError as e:
        raise LinAlgError(str(e)) from None
    except RuntimeError as e:
        raise CheckError(str(e)) from None
    return ()


define("linalg_check", _linalg_check_infer, _linalg_check_impl, multiple_results=True,
       effectful=True)


# ---------------------------------------------------------------------------------------
# Shared compositions
# ---------------------------------------------------------------------------------------
def _meta(x):
    if isinstance(x, torch.Tensor):
        t = type_of(x)
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    return torch.device("meta") if isinstance(x, torch.device) else x


def linalg_op(op, real_only: bool = True, check=None):
    """Register a handler for ``op`` that checks the arguments with the op's meta kernel
    (or ``check``, on meta tensors, for an op without one) first, so errors read as eager's,
    and, if ``real_only``, hands complex operands to an opaque node."""
    def register(fn):
        def handler(*args, **kwargs):
            tensors = [x for x in pytree.tree_leaves((args, kwargs))
                       if isinstance(x, torch.Tensor)]
            if real_only and any(type_of(x).dtype.is_complex for x in tensors):
                return current_trace().opaque(op, args, kwargs)
            meta_args, meta_kwargs = pytree.tree_map(_meta, (args, kwargs))
            try:
                (check or op)(*meta_args, **meta_kwargs)
            except Exception as e:  # torch._check raises several types
                raise ShapeError(f"{op}: {e}") from None
            return fn(*args, **kwargs)

        handles(op)(functools.update_wrapper(handler, fn))
        return fn

    return register


def _empty(like, dtype=None):
    """The 0-element placeholder eager returns for an output it was told not to compute."""
    t = type_of(like)
    return full((0,), 0, dtype or t.dtype, t.device)


def _check_info(info, api: str, a) -> None:
    bind("linalg_check", info, api=api, is_matrix=type_of(a).ndim == 2)


def _eye(n: int, like, cols: int | None = None):
    t = type_of(like)
    return torch.eye(n, cols if cols is not None else n, dtype=t.dtype, device=t.device)


def _broadcast_batch(*xs):
    """Expand the batch dims (all but the last ``ndim`` of each pair) to a common shape."""
    batch = broadcast_shapes(*[type_of(x).shape[:-k] for x, k in xs])
    return [x.expand(*batch, *type_of(x).shape[type_of(x).ndim - k:]) for x, k in xs]


def solve_triangular(a, b, *, lower, unit=False, left=True, transpose=False):
    """Solve op(a) @ x = b (or x @ op(a) = b if not left), op(a) = a.mT if transpose, with
    batch dims broadcast. Only the triangle of op(a) named by ``lower`` is read."""
    if transpose:
        a, lower = a.mT, not lower
    if not left:
        return solve_triangular(a, b.mT, lower=lower, unit=unit, transpose=True).mT
    a, b = _broadcast_batch((a, 2), (b, 2))
    return bind("triangular_solve", a, b, lower=lower, unit_diagonal=unit)


def _permutation(pivots, n: int):
    return bind("lu_pivots_to_permutation", pivots, size=n)


def _take_rows(b, perm):
    return torch.gather(b, -2, perm.unsqueeze(-1).expand(type_of(b).shape))


def lu_solve(lu, pivots, b, *, left=True, adjoint=False):
    """Solve a @ x = b (a.mT if adjoint; x @ a = b if not left) from a's LU factorization
    p @ l @ u = a, where b[perm] == p.mT @ b."""
    if not left:
        return lu_solve(lu, pivots, b.mT, adjoint=not adjoint).mT
    n = type_of(lu).shape[-1]
    lu, perm, b = _broadcast_batch((lu, 2), (_permutation(pivots, n), 1), (b, 2))
    if not adjoint:
        y = solve_triangular(lu, _take_rows(b, perm), lower=True, unit=True)
        return solve_triangular(lu, y, lower=False)
    z = solve_triangular(lu, b, lower=False, transpose=True)
    w = solve_triangular(lu, z, lower=True, unit=True, transpose=True)
    return _take_rows(w, torch.argsort(perm, dim=-1))


def _diagonal_of(x):
    return torch.diagonal(x, 0, -2, -1)


def _zero_pivot_info(diag):
    """LAPACK's info for a triangular factor: the 1-based index of its first zero on the
    diagonal, 0 if none."""
    n = type_of(diag).shape[-1]
    leading = (diag != 0).to(torch.int32).cumprod(-1).sum(-1)  # nonzeros before it
    return torch.where(leading == n, 0, leading + 1).to(torch.int32)


def _is_vector_rhs(a_shape, b_shape) -> bool:
    """Whether b is a (batch of) vector(s) rather than matrices, as eager's solvers decide."""
    return len(b_shape) == 1 or (len(b_shape) == len(a_shape) - 1
                                 and tuple(b_shape) == tuple(a_shape[:-1]))


def _householder_q(h, tau, cols: int):
    """The first ``cols`` columns of q = the (m, m) product of geqrf's reflectors in h."""
    k = min(type_of(h).shape[-1], cols)
    return bind("householder_product", torch.nn.functional.pad(h[..., :, :k], (0, cols - k)),
                tau)


def _pivot_sign(pivots, dtype):
    """det of the permutation: -1 per row swap (a pivot that is not its own row)."""
    k = type_of(pivots).shape[-1]
    rows = torch.arange(1, k + 1, dtype=torch.int32, device=type_of(pivots).device)
    swaps = (pivots != rows).sum(-1)
    return (1 - 2 * (swaps % 2)).to(dtype)


def _lu(a, pivot=True):
    return bind("lu", a, pivot=pivot)


# ---------------------------------------------------------------------------------------
# ATen ops
# ---------------------------------------------------------------------------------------
@handles(aten._linalg_check_errors.default)
def _linalg_check_errors(info, api_name, *, is_matrix):
    bind("linalg_check", info, api=api_name, is_matrix=is_matrix)


def _cholesky(a, upper):
    """The upper factor of a is the transpose of the lower factor of a.mT (same triangle).
    Eager's forward derivative of the upper factor takes the tangent untransposed, so a.mT's
    value is passed with a's own derivative (the reverse rule is symmetric either way)."""
    if upper:
        a = bind("stop_gradient", a.mT) + (a - bind("stop_gradient", a))
    l, info = bind("cholesky", a)
    return (l.mT if upper else l), info


@linalg_op(aten.linalg_cholesky_ex.default)
def _linalg_cholesky_ex(a, upper=False, check_errors=False):
    l, info = _cholesky(a, upper)
    if check_errors:
        _check_info(info, "linalg.cholesky_ex", a)
    return l, info


@linalg_op(aten.cholesky.default)
def _cholesky_legacy(a, upper=False):
    l, info = _cholesky(a, upper)
    _check_info(info, "cholesky", a)
    return l


@linalg_op(aten.cholesky_solve.default)
def _cholesky_solve(b, l, upper=False):
    # a = c.mT @ c with c = l (upper) or l.mT (lower): solve with c.mT, then with c.
    y = solve_triangular(l, b, lower=not upper, transpose=upper)
    return solve_triangular(l, y, lower=not upper, transpose=not upper)


@linalg_op(aten.cholesky_inverse.default)
def _cholesky_inverse(l, upper=False):
    # Eager (LAPACK potri) raises for a zero on the diagonal.
    n = type_of(l).shape[-1]
    _check_info(_zero_pivot_info(_diagonal_of(l)), "cholesky_inverse", l)
    c_inv = solve_triangular(l, _eye(n, l), lower=not upper)  # l^-1
    return c_inv @ c_inv.mT if upper else c_inv.mT @ c_inv


@linalg_op(aten.linalg_solve_triangular.default)
def _linalg_solve_triangular(a, b, *, upper, left=True, unitriangular=False):
    return solve_triangular(a, b, lower=not upper, unit=unitriangular, left=left)


@linalg_op(aten.triangular_solve.default)
def _triangular_solve_legacy(b, a, upper=True, transpose=False, unitriangular=False):
    x = solve_triangular(a, b, lower=not upper, unit=unitriangular, transpose=transpose)
    batch = type_of(x).shape[:-2]
    return x, a.expand(*batch, *type_of(a).shape[-2:])


@linalg_op(aten.linalg_lu_factor_ex.default)
def _linalg_lu_factor_ex(a, *, pivot=True, check_errors=False):
    lu, pivots, info = _lu(a, pivot)
    if check_errors:
        _check_info(info, "torch.linalg.lu_factor_ex", a)
    return lu, pivots, info


@linalg_op(aten.lu_unpack.default)
def _lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    """p, l, u with p @ l @ u == a; a placeholder for each part not asked for."""
    m, n = type_of(lu).shape[-2:]
    k = min(m, n)
    if unpack_pivots:
        perm = _permutation(pivots, m)
        rows = torch.arange(m, device=type_of(lu).device)
        p = (rows.unsqueeze(-1) == perm.unsqueeze(-2)).to(type_of(lu).dtype)
    else:
        p = _empty(lu)
    if not unpack_data:
        return p, _empty(lu), _empty(lu)
    l = lu[..., :, :k].tril(-1) + _eye(m, lu, k)
    return p, l, lu[..., :k, :].triu()


@linalg_op(aten.linalg_lu.default)
def _linalg_lu(a, *, pivot=True):
    lu, pivots, _ = _lu(a, pivot)
    return _lu_unpack(lu, pivots, unpack_pivots=pivot)


@linalg_op(aten.linalg_lu_solve.default)
def _linalg_lu_solve(lu, pivots, b, *, left=True, adjoint=False):
    return lu_solve(lu, pivots, b, left=left, adjoint=adjoint)


@linalg_op(aten._linalg_solve_ex.default)
def _linalg_solve_ex(a, b, *, left=True, check_errors=False):
    vector = _is_vector_rhs(type_of(a).shape, type_of(b).shape)
    lu, pivots, info = _lu(a)
    x = lu_solve(lu, pivots, b.unsqueeze(-1) if vector else b, left=left)
    if check_errors:
        _check_info(info, "torch.linalg.solve_ex", a)
    return x.squeeze(-1) if vector else x, lu, pivots, info


@linalg_op(aten.linalg_inv_ex.default)
def _linalg_inv_ex(a, *, check_errors=False):
    lu, pivots, info = _lu(a)
    if check_errors:
        _check_info(info, "linalg.inv_ex", a)
    return lu_solve(lu, pivots, _eye(type_of(a).shape[-1], a)), info


# det and slogdet factor a.mT, as eager does for a contiguous a (det(a.mT) == det(a)).
@linalg_op(aten._linalg_det.default)
def _linalg_det(a):
    lu, pivots, _ = _lu(a.mT)
    return _diagonal_of(lu).prod(-1) * _pivot_sign(pivots, type_of(a).dtype), lu, pivots


@linalg_op(aten._linalg_slogdet.default)
def _linalg_slogdet(a):
    lu, pivots, _ = _lu(a.mT)
    diag = _diagonal_of(lu)
    sign = diag.sign().prod(-1) * _pivot_sign(pivots, type_of(a).dtype)
    return sign, diag.abs().log().sum(-1), lu, pivots


def _geqrf_check(a):
    torch._check(a.ndim >= 2, lambda: "torch.geqrf: input must have at least 2 dimensions.")


@linalg_op(aten.geqrf.default, check=_geqrf_check)
def _geqrf(a):
    return bind("geqrf", a)


@linalg_op(aten.linalg_qr.default)
def _linalg_qr(a, mode="reduced"):
    """The qr primitive; r alone from geqrf, as eager."""
    m, n = type_of(a).shape[-2:]
    if mode != "r":
        return bind("qr", a, complete=mode == "complete")
    h, _ = bind("geqrf", a)
    return _empty(a), h[..., :min(m, n), :].triu()


@linalg_op(aten.linalg_householder_product.default)
def _linalg_householder_product(a, tau):
    return bind("householder_product", a, tau)


@linalg_op(aten.ormqr.default)
def _ormqr(a, tau, c, left=True, transpose=False):
    """q (the square product of all reflectors) applied to c by a matmul."""
    q = _householder_q(a, tau, type_of(a).shape[-2])
    q = q.mT if transpose else q
    return q @ c if left else c @ q


@linalg_op(aten._linalg_eigh.default)
def _linalg_eigh(a, UPLO="L", compute_v=True):
    out = bind("eigh", a, lower=UPLO.upper() == "L", compute_v=compute_v)
    return out if compute_v else (out[0], _empty(a))


@linalg_op(aten._linalg_svd.default)
def _linalg_svd(a, full_matrices=False, compute_uv=True, *, driver=None):
    out = bind("svd", a, full_matrices=full_matrices, compute_uv=compute_uv, driver=driver)
    return out if compute_uv else (_empty(a), out[0], _empty(a))


@linalg_op(aten.linalg_pinv.atol_rtol_tensor)
def _linalg_pinv(a, *, atol=None, rtol=None, hermitian=False):
    """The pinv primitive, with eager's tolerances made explicit: singular values above
    max(atol, rtol * largest) are inverted, the rest zeroed."""
    t = type_of(a)
    m, n = t.shape[-2:]
    if t.numel == 0:
        return full(t.shape[:-2] + (n, m), 0, t.dtype, t.device)
    f64 = {"dtype": torch.float64, "device": t.device}
    if rtol is None:
        default = torch.full((), torch.finfo(t.dtype).eps * max(m, n), **f64)
        rtol = default if atol is None else torch.where(atol > 0, torch.zeros((), **f64),
                                                          default)
    atol = torch.zeros((), **f64) if atol is None else atol
    return bind("pinv", a, atol, rtol, hermitian=hermitian)


_LSTSQ = "torch.linalg.lstsq"


def _lstsq_check(a, b, rcond=None, *, driver=None):
    """Eager's argument checks, in its order (linalg_lstsq has no meta kernel)."""
    def need(ok, message):
        torch._check(ok, lambda: f"{_LSTSQ}: {message}")

    need(a.ndim >= 2, "input must have at least 2 dimensions.")
    need(b.ndim >= 1, "other must have at least 1 dimension.")
    need(a.dtype == b.dtype, "Expected input and other to have the same dtype, but got "
         f"input's dtype {a.dtype} and other's dtype {b.dtype}")
    torch._check(a.dtype in _FLOATS,  # complex operands never get here (an opaque node)
                 lambda: "This function doesn't handle types other than float and double")
    need(0 <= a.ndim - b.ndim <= 1, "input.dim() must be greater or equal to other.dim() and "
         "(input.dim() - other.dim()) <= 1")
    vector = _is_vector_rhs(a.shape, b.shape)
    need(a.shape[-2] == b.shape[-1 if vector else -2],
         f"input.size(-2) should match other.size({-1 if vector else -2})")
    need(driver in (None, "gels", "gelsy", "gelsd", "gelss"),
         "parameter `driver` should be one of (gels, gelsy, gelsd, gelss)")
    broadcast_shapes(a.shape[:-2], b.shape[:-1 if vector else -2])


def _lstsq_gels(a, b):
    """LAPACK's gels: QR of a (of a.mT, an LQ, for a wide a), assuming full rank; an exact zero
    on r's diagonal raises. The residuals are those of q.mT @ b's rows past n, whatever the
    solution. An all-zero a gives gels' quick return: zero solution and residuals."""
    m, n = type_of(a).shape[-2:]
    a, b = _broadcast_batch((a, 2), (b, 2))  # eager's errors name the broadcast batch element
    h, tau = bind("geqrf", a if m >= n else a.mT)
    r, q = h[..., :min(m, n), :min(m, n)], _householder_q(h, tau, m)  # q: square if m >= n
    if m >= n:
        qtb = q.mT @ b
        x = solve_triangular(r, qtb[..., :n, :], lower=False)
    else:  # a = r.mT @ q.mT
        x = q @ solve_triangular(r, b, lower=False, transpose=True)
    zero = (a == 0).all(-1).all(-1)
    _check_info(torch.where(zero, 0, _zero_pivot_info(_diagonal_of(r))).to(torch.int32),
                _LSTSQ, a)
    x = torch.where(zero[..., None, None], 0.0, x)
    if m <= n:
        return x, _empty(a)
    return x, torch.where(zero[..., None], 0.0, qtb[..., n:, :].square().sum(-2))


def _lstsq_rank_revealing(a, b, rcond, driver):
    """gelsy, gelsd, gelss: the minimum-norm solution from the singular values above rcond times
    the largest (their number is the rank). gelsy drops the trailing part of a pivoted QR
    instead, by a condition estimate: the same where what it drops is rounding noise."""
    t = type_of(a)
    m, n = t.shape[-2:]
    noise = torch.finfo(t.dtype).eps * max(m, n)  # eager's default rcond
    rcond = noise if rcond is None else rcond
    # Out of (0, 1) LAPACK's drivers each substitute their own epsilon.
    if not (0 < rcond < 1 and (driver != "gelsy" or rcond <= noise)):
        raise UnsupportedOpError(
            f"{_LSTSQ}: plait supports rcond={rcond} only for driver 'gelsd' or 'gelss' (in "
            f"(0, 1)); for 'gelsy' in (0, {noise}], where its pivoted QR agrees with an SVD")
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    keep = s > rcond * s[..., :1]
    if rcond < noise:
        bind("check", (keep & (s <= noise * s[..., :1])).any(), message=(
            f"{_LSTSQ}: rcond={rcond} keeps a singular value at rounding noise, which makes "
            "the solution rounding error that differs between algorithms; raise rcond"))
    s_inv = torch.where(keep, s.reciprocal(), 0.0)
    x = vh.mT @ (s_inv.unsqueeze(-1) * (u.mT @ b))
    rank = keep.sum(-1)
    if driver == "gelsy":
        return x, _empty(a), rank, _empty(a)
    residuals = _empty(a)
    if m > n:  # eager gives residuals only if every matrix has full rank: a data-dependent shape
        bind("check", (rank != n).any(), message=(
            f"{_LSTSQ}: with driver {driver!r} and a rank-deficient tall matrix eager returns no "
            "residuals, an output shape that depends on the data, which plait cannot trace; "
            "compute the residuals from the solution instead"))
        residuals = (a @ x - b).square().sum(-2)
    return x, residuals, rank, s


@linalg_op(aten.linalg_lstsq.default, check=_lstsq_check)
def _linalg_lstsq(a, b, rcond=None, *, driver=None):
    if type_of(a).device != "cpu" and driver not in (None, "gels"):
        raise UnsupportedOpError(f"{_LSTSQ}: only driver 'gels' is supported off the CPU")
    driver = driver or ("gelsy" if type_of(a).device == "cpu" else "gels")
    vector = _is_vector_rhs(type_of(a).shape, type_of(b).shape)
    b2 = b.unsqueeze(-1) if vector else b
    if driver == "gels":
        x, residuals = _lstsq_gels(a, b2)
        rank, s = _empty(a, torch.int64), _empty(a)
    else:
        x, residuals, rank, s = _lstsq_rank_revealing(a, b2, rcond, driver)
    return (x.squeeze(-1) if vector else x), residuals, rank, s
