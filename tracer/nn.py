"""Neural-network ops: convolution as a primitive, and pooling, normalization and friends
composed from primitives.

NOTE [nn ops]
Convolution is one primitive, ``conv``, shaped like ``jax.lax.conv_general_dilated`` with a
fixed (N, C, spatial...) layout: window strides, explicit (low, high) padding that may be
negative, lhs (input) and rhs (kernel) dilation, and feature groups. A transposed
convolution is a ``conv`` with lhs dilation = stride and a flipped, in/out-swapped kernel,
as JAX expresses it, so later stages see a single rule.

Everything else is composed from existing primitives. Pooling windows are gathered with
index tables computed at trace time (plain tensors, so they become graph constants): per
spatial dim, an (out, k) table of input positions plus a mask of the positions that lie in
the input. One gather path thus serves strided/padded/dilated pooling, ceil_mode and
adaptive pooling alike, except strided max pooling of small windows, scanned entry by
entry over strided slices (NOTE [strided max pooling]). Max pooling reproduces eager's scan
exactly: the first position that attains the max, except that a NaN wins and the last NaN
is kept.
"""
from __future__ import annotations

import functools
import itertools
import math
from contextlib import nullcontext

import attrs

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import ShapeError, UnsupportedOpError
from ..graph import TensorType
from .aten import handles, matmul, type_of
from .primitives import _check, pad_dim, spread_strided
from .registry import define, vjp_rule
from ..config import config
from .trace import FUNCTION_HANDLERS, HANDLERS, TracerTensor, bind, current_trace, on_tracers

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------
# The conv primitive
# ---------------------------------------------------------------------------------------
def _to_channels_first(t: TensorType) -> TensorType:
    return attrs.evolve(t, shape=(t.shape[0], t.shape[-1], *t.shape[1:-1]))


def _conv_infer(lhs, rhs, *, window_strides, padding, lhs_dilation, rhs_dilation,
                feature_group_count, channels_last=False):
    if channels_last:  # lhs and result [N, *spatial, C] (NOTE [channels-last convolutions])
        (out,) = _conv_infer(_to_channels_first(lhs), rhs, window_strides=window_strides,
                             padding=padding, lhs_dilation=lhs_dilation,
                             rhs_dilation=rhs_dilation, feature_group_count=feature_group_count)
        return (attrs.evolve(out, shape=(out.shape[0], *out.shape[2:], out.shape[1])),)
    nd, g = lhs.ndim - 2, feature_group_count
    ok = (nd >= 1 and rhs.ndim == lhs.ndim and lhs.dtype == rhs.dtype and g >= 1
          and len(window_strides) == len(padding) == len(lhs_dilation) == len(rhs_dilation)
          == nd and lhs.shape[1] == rhs.shape[1] * g and rhs.shape[0] % g == 0
          and min(window_strides + lhs_dilation + rhs_dilation) >= 1)
    _check(ok, "conv", f"operands and params do not fit (groups={g})", lhs, rhs)
    spatial = []
    for n, k, s, (lo, hi), ld, rd in zip(lhs.shape[2:], rhs.shape[2:], window_strides,
                                         padding, lhs_dilation, rhs_dilation):
        span = (n - 1) * ld + 1 + lo + hi - ((k - 1) * rd + 1)
        _check(n > 0 and span >= 0, "conv", "the padded input is smaller than the kernel",
               lhs, rhs)
        spatial.append(span // s + 1)
    return (TensorType((lhs.shape[0], rhs.shape[0], *spatial), lhs.dtype, lhs.device),)


def _conv_impl(lhs, rhs, *, window_strides, padding, lhs_dilation, rhs_dilation,
               feature_group_count, channels_last=False):
    if channels_last:  # the library's channels-last kernels, on a channels-last view
        return _conv_impl(lhs.movedim(-1, 1), rhs, window_strides=window_strides,
                          padding=padding, lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
                          feature_group_count=feature_group_count).movedim(1, -1).contiguous()
    if max(lhs_dilation) > 1:  # interleave zeros between input elements
        dilated = lhs.new_zeros(lhs.shape[:2] + tuple(
            (n - 1) * d + 1 for n, d in zip(lhs.shape[2:], lhs_dilation)))
        dilated[(..., *(slice(None, None, d) for d in lhs_dilation))] = lhs
        lhs = dilated
    zeros = [0] * len(window_strides)
    if all(lo == hi >= 0 for lo, hi in padding):  # the library pads (F.pad would copy)
        return torch.convolution(lhs, rhs, None, window_strides, [lo for lo, _ in padding],
                                 rhs_dilation, False, zeros, feature_group_count)
    # Negative padding crops (as in some transposed convolutions and in the VJP), possibly
    # into the other side's padding, which F.pad cannot: pad first, then crop.
    lhs = torch.nn.functional.pad(lhs, [max(p, 0) for lo, hi in reversed(padding)
                                        for p in (lo, hi)])
    lhs = lhs[(..., *(slice(max(-lo, 0), n - max(-hi, 0))
                      for n, (lo, hi) in zip(lhs.shape[2:], padding)))]
    return torch.convolution(lhs, rhs, None, window_strides, zeros, rhs_dilation, False,
                             zeros, feature_group_count)


def _conv_batch(operands, batched, axis_size, *, feature_group_count, channels_last=False,
                **params):
    """The batch joins the examples (a batched input alone) or, with a batched kernel, the
    channels: example b's channels and kernels form groups of their own."""
    (lhs, rhs), b = operands, axis_size
    if channels_last:  # as a channels-first convolution, moved back
        (out,), _ = _conv_batch((lhs.movedim(-1, 2 if batched[0] else 1), rhs), batched,
                                axis_size, feature_group_count=feature_group_count, **params)
        return [out.movedim(2, -1)], [True]
    if not batched[1]:
        out = bind("conv", lhs.flatten(0, 1), rhs, feature_group_count=feature_group_count,
                   **params)
        return [out.unflatten(0, (b, lhs.shape[1]))], [True]
    n, c, *size = lhs.shape[1:] if batched[0] else lhs.shape
    lhs = lhs.movedim(0, 1).reshape(n, b * c, *size) if batched[0] else \
        lhs.unsqueeze(1).expand(n, b, c, *size).reshape(n, b * c, *size)
    out = bind("conv", lhs, rhs.flatten(0, 1), feature_group_count=b * feature_group_count,
               **params)
    return [out.unflatten(1, (b, rhs.shape[1])).movedim(1, 0)], [True]


define("conv", _conv_infer, _conv_impl, batch=_conv_batch)


# ---------------------------------------------------------------------------------------
# The attention primitive (NOTE [attention fusion], passes/attention.py)
# ---------------------------------------------------------------------------------------
# softmax(q @ kᵀ * scale + bias, causally masked where ``causal``) @ v over the last two dims,
# every leading dim a batch dim. The optional fourth operand ``bias`` is an additive mask of
# q's rank and dtype that broadcasts to the scores' [..., M, N] (a boolean mask becomes one:
# 0 where kept, -inf where not); it never comes with ``causal``. ``scaled_dot_product_attention``
# traces to the primitive, and the attention fusion pass makes it from the written-out forms,
# before differentiation, so a training step's forward and backward both run torch's fused
# kernels and never store the scores. Its second result is each row's log-sum-exp of the
# scaled scores (float32; float64 for float64 operands), which the fused kernels compute
# anyway: ``attention_backward`` reads it with the output, so the backward runs torch's fused
# backward alone, not the forward again (on the CPU, and on CUDA for flash and the
# memory-efficient kernel: ``_attention_backward``). The bias's gradient is the scores'
# gradient summed over its broadcast dims, which no fused kernel of torch's gives on the CPU:
# it is written out (``_bias_gradient``), and left to dead-code elimination where nothing
# differentiates the bias (a padding mask). Its JVP is written out (forward mode stores the
# scores). ``attention_backward``'s own derivatives differentiate the written-out form
# (passes/attention.py: they need the graph passes).
#
# NOTE [attention dropout]
# With ``dropout`` (a probability), the softmax's entries are zeroed with that probability and
# the rest scaled by 1 / (1 - dropout) before the product with v. Only CUDA's kernels run it
# fused: flash's or cuDNN's, where torch picks one of them for 4-D operands
# (``_dropout_kernel``, chosen when tracing and kept as the param ``kernel``, so that the
# backward replays the mask with the kernel that drew it); elsewhere
# ``scaled_dot_product_attention`` traces its written-out form, which stores the scores and
# the mask, as eager's math path does (torch's CPU kernel takes no dropout), with eager's
# draw: ``empty_like(probabilities).bernoulli_(1 - p)``, which that C++ composite issues out
# of functionalization's sight, into a tensor it made; so ``empty_like`` makes a traced value
# and ``bernoulli_`` draws into it (tracer/aten.py: left to torch's reference, the mask would
# be an untraced tensor, baked as a constant, and the draw lost). The kernel draws
# the mask inside, from torch's CUDA generator where eager's call draws (the same seed gives
# eager's mask where eager runs the same kernel), and returns the generator state it drew
# with, which its backward is handed to replay the same mask. So the primitive draws
# (effectful: never merged, removed or recomputed, and saved by a checkpoint), its third
# result is that state (``_generator_state``: on the device, where a CUDA graph's replay
# writes it anew), ``attention_backward`` takes it in the bias's place (dropout never comes
# with a bias), vmap runs each example's call of its own, and forward-mode and second
# derivatives, which would need the mask itself, are refused.
#
# With ``bshd`` (NOTE [attention in the kernels' layout], passes/attention.py), q, k, v and
# the output (and ``attention_backward``'s cotangent, output and gradients) are 4-D and
# stored [batch, rows, heads, head dim]: each rule swaps dims 1 and 2 (a view), and the
# statistics stay [batch, heads, rows].
def heads_first(bshd: bool, *xs):
    """Operands in [B, H, M, E] where ``bshd`` stores them [B, M, H, E] (views, or types)."""
    if not bshd:
        return xs
    return tuple(x if x is None else attrs.evolve(x, shape=_swapped(x.shape))
                 if isinstance(x, TensorType) else x.transpose(1, 2) for x in xs)


def _swapped(shape) -> tuple:
    return (shape[0], shape[2], shape[1], *shape[3:])


def _attention_infer(q, k, v, bias=None, *, scale, causal=False, dropout=0.0, kernel=None,
                     bshd=False):
    if bshd:
        _check(q.ndim == k.ndim == v.ndim == 4, "attention", "expected 4-D operands stored "
               "[batch, rows, heads, head dim] (bshd)", q, k, v)
        out, *rest = _attention_infer(*heads_first(True, q, k, v), bias, scale=scale,
                                      causal=causal, dropout=dropout, kernel=kernel)
        return (*heads_first(True, out), *rest)
    ok = (q.ndim == k.ndim == v.ndim >= 2 and q.dtype == k.dtype == v.dtype
          and q.dtype.is_floating_point and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
          and q.shape[-1] == k.shape[-1] and k.shape[-2] == v.shape[-2])
    _check(ok, "attention", "expected q [..., M, E], k [..., N, E], v [..., N, Ev]", q, k, v)
    if bias is not None:
        scores = (*q.shape[:-1], k.shape[-2])
        _check(bias.dtype == q.dtype and bias.ndim == q.ndim and not causal
               and all(b in (1, s) for b, s in zip(bias.shape, scores)), "attention",
               f"expected a bias of q's dtype broadcasting to the scores' {scores}, and no "
               "causal mask with it", q, k, v, bias)
    state = (TensorType((2,), torch.int64, q.device),) if dropout else ()
    return (TensorType((*q.shape[:-1], v.shape[-1]), q.dtype, q.device),
            TensorType(q.shape[:-1], _row_statistic_dtype(q.dtype), q.device), *state)


def _dropout_kernel(query, key, value, attn_mask, dropout_p: float, is_causal: bool,
                    scale: float | None) -> str | None:
    """The fused kernel that runs ``scaled_dot_product_attention`` with dropout as the
    primitive (NOTE [attention dropout]), or None: CUDA's flash or cuDNN kernel where torch
    picks one of them for these operands (under the settings in force as the call is traced,
    an ``sdpa_kernel`` block's), for 16-bit floats, no mask besides the causal one (aligned
    top-left, as the call's is, only where rows and keys are as many) and one head dim for
    q, k and v. Chosen once, when tracing: the backward must replay the mask with the kernel
    that drew it, whatever the settings are when it runs. (A probability of 1 drops
    everything: written out.)"""
    if not (0 < dropout_p < 1 and attn_mask is None and query.device.type == "cuda"
            and query.dtype in (torch.float16, torch.bfloat16) and query.ndim == 4
            and query.shape[-1] == key.shape[-1] == value.shape[-1]
            and (not is_causal or query.shape[-2] == key.shape[-2])):
        return None
    # torch's choice reads the operands' dims, dtype, device and layout, not their number:
    # one batch of one head stands for them (real tensors, not traced)
    with _disable_current_modes():
        alike = [torch.empty(1, 1, *x.shape[-2:], dtype=x.dtype, device=x.device)
                 for x in (query, key, value)]
        choice = torch._fused_sdp_choice(*alike, None, dropout_p, is_causal, scale=scale)
    return {1: "flash", 3: "cudnn"}.get(choice)


def refuse_dropout_derivative(what: str):
    raise UnsupportedOpError(
        f"{what} of scaled_dot_product_attention with dropout_p > 0: its fused kernel draws "
        "the dropout mask inside and never returns it (NOTE [attention dropout]); use "
        "dropout_p=0 (model.eval()) there, or plait.config.fuse_attention = False to trace "
        "the written-out attention, which stores the mask")


# float32 attention on CUDA over at most this many keys is faster written out (NOTE
# [attention fusion])
FLOAT32_WRITTEN_MAX_KEYS = 512


def stays_written(dtype: torch.dtype, device, keys: int) -> bool:
    """Is attention of ``dtype`` on ``device`` over ``keys`` keys faster written out?"""
    return dtype == torch.float32 and str(device).startswith("cuda") \
        and keys <= FLOAT32_WRITTEN_MAX_KEYS


def _row_statistic_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _four_d(x):
    """torch's fused kernels take only 4-D operands (others silently take its path that
    stores the scores): the batch dims become one, heads one."""
    return x if x.ndim == 4 else x.reshape(-1, 1, *x.shape[-2:])


def _four_d_bias(bias, q, k):
    """The bias as ``_four_d`` folds q's batch dims (broadcast dims kept where q is 4-D)."""
    if bias is None or q.ndim == 4:
        return bias
    return bias.expand(*q.shape[:-1], k.shape[-2]).reshape(-1, 1, q.shape[-2], k.shape[-2])


def attention_scores(q, k, scale: float, causal: bool, bias=None):
    """q @ kᵀ * scale + bias, causally masked where ``causal``: the written-out form's."""
    s = matmul(q, k.mT) * scale
    if bias is not None:
        s = s + bias
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _fused_kernel(q, k, v, bias, causal: bool, scale: float) -> str:
    """Which of torch's fused attention kernels runs these 4-D operands, as
    ``scaled_dot_product_attention`` would pick it: "cpu" (the CPU's), or CUDA's "flash",
    "efficient" or "cudnn", else "math" (whose row statistics plait computes itself). With a
    bias, never cuDNN's (which torch prefers for bf16 on Hopper), whose backward with one
    plait does not call: the memory-efficient kernel's takes the bias too. (With dropout,
    the kernel chosen when tracing: ``_dropout_kernel``.)"""
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]) \
            if q.device.type == "cuda" and bias is not None else nullcontext():
        choice = torch._fused_sdp_choice(q, k, v, bias, 0.0, causal, scale=scale)
    if q.device.type == "cuda":
        return {1: "flash", 2: "efficient", 3: "cudnn"}.get(choice, "math")
    return "cpu" if q.device.type == "cpu" and choice == 1 else "math"


def _cudnn_backward_holds(q, k, v, causal: bool) -> bool:
    """Does cuDNN's backward give these operands' gradients? Not for causal attention of
    more or fewer rows than keys, nor for v's head dim not q's (its results were wrong)."""
    return (not causal or q.shape[-2] == k.shape[-2]) and q.shape[-1] == v.shape[-1]


def _padded(x, multiple: int):
    """``x`` with its last dim padded with zeros to a multiple of ``multiple`` (as it is where
    it is one already: torch's pad copies even by nothing)."""
    pad = -x.shape[-1] % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def _cuda_flash(q, k, v, causal: bool, scale: float, dropout: float = 0.0):
    """torch's CUDA flash kernel, whose head dims must be multiples of 8: padded with zeros
    as ``scaled_dot_product_attention`` pads them (a zero column changes no score and adds
    a zero column to the result, which is cut off). The output, the row statistics and the
    generator state its dropout drew with (NOTE [attention dropout])."""
    size = v.shape[-1]
    q, k, v = (_padded(x, 8) for x in (q, k, v))
    out, lse, *_, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout, causal, False, scale=scale)
    return out[..., :size], lse, seed, offset


def _generator_state(kernel: str, seed, offset, device):
    """A fused kernel's dropout state as the primitive returns it: its philox seed and
    offset, an int64 [2] on the device (where a CUDA graph's replay writes them anew):
    flash's own (uint64, its ``offset`` a placeholder), cuDNN's two scalars stacked. A torch
    that keeps them elsewhere (on the host, outside a capture) would be misread: refused."""
    expected = ((2,), torch.uint64) if kernel == "flash" else ((), torch.int64)
    if seed.device != device or (seed.shape, seed.dtype) != expected:
        raise UnsupportedOpError(
            f"attention with dropout: this torch's {kernel} kernel returns its generator "
            f"state as {tuple(seed.shape)} {seed.dtype} on {seed.device}, not the device's "
            f"{expected} plait reads; set plait.config.fuse_attention = False to trace the "
            "written-out attention")
    return seed.view(torch.int64) if kernel == "flash" else torch.stack([seed, offset])


def _dropout_seed(kernel: str, state) -> tuple:
    """The seed and offset the kernel's backward takes, from ``_generator_state``'s."""
    if kernel == "flash":
        return state.view(torch.uint64), torch.zeros((), dtype=torch.uint64,
                                                      device=state.device)
    return state[0], state[1]


def _efficient_bias(bias, q, k):
    """The bias as torch's CUDA memory-efficient kernel reads it, as
    ``scaled_dot_product_attention`` hands it over: rows 16-element aligned (padded, the
    padding cut off again) and expanded to [B, H, M, N]."""
    if bias is None:
        return None
    if any(s % 16 for s in bias.stride()[:-1]):
        bias = torch.nn.functional.pad(bias, (0, 16 - bias.shape[-1] % 16))[..., :k.shape[-2]]
    return bias.expand(*q.shape[:-1], k.shape[-2])


def _attention(q, k, v, bias=None, *, scale, causal=False, dropout=0.0, kernel=None,
               bshd=False):
    if bshd:
        out, *rest = _attention(*heads_first(True, q, k, v), bias, scale=scale,
                                causal=causal, dropout=dropout, kernel=kernel)
        return (*heads_first(True, out), *rest)
    q4, k4, v4 = (_four_d(x) for x in (q, k, v))
    bias4 = _four_d_bias(bias, q, k)
    kernel = kernel or _fused_kernel(q4, k4, v4, bias4, causal, scale)
    state = ()  # the generator state a dropout drew with (NOTE [attention dropout])
    if kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k4, v4, 0.0, causal, attn_mask=bias4, scale=scale)
    elif kernel == "flash":  # (CUDA's flash takes no bias)
        out, lse, *state = _cuda_flash(q4, k4, v4, causal, scale, dropout)
    elif kernel == "efficient":  # its statistics are padded to a multiple of 32 rows
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q4, k4, v4, _efficient_bias(bias4, q4, k4), True, 0.0, causal, scale=scale)[:2]
        lse = lse[..., :q4.shape[-2]]
    elif kernel == "cudnn":  # its statistics are [..., M, 1]
        out, lse, *_, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q4, k4, v4, None, True, dropout, causal, False, scale=scale)
        state = seed, offset
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=bias4, scale=scale, is_causal=causal)
        wide = _row_statistic_dtype(q.dtype)
        lse = attention_scores(q4.to(wide), k4.to(wide), scale, causal,
                               None if bias4 is None else bias4.to(wide)).logsumexp(-1)
    result = (out.reshape(*q.shape[:-1], v.shape[-1]),
              lse.to(_row_statistic_dtype(q.dtype)).reshape(q.shape[:-1]))
    return (*result, _generator_state(kernel, *state, q.device)) if dropout else result


def _as_left_by_cuda_kernels(x):
    """[B, H, M, E] stored as torch's CUDA forwards (flash, memory-efficient, cuDNN for q so
    stored) leave their output: [B, M, H, E] in memory. Their backward reads the output and
    its cotangent so, whatever the strides it is given: a compiled program stores both
    [B, H, M, E]. cuDNN's is given q, k and v so stored too: torch caches the plan cuDNN
    builds, per thread, by q's, k's and v's strides alone, and runs a later call of the same
    key with the output and cotangent strides of the first. That is eager's call for
    operands laid out as a projection leaves them (output and cotangent [B, M, H, E]); q, k
    and v contiguous, an eager call's output is laid out otherwise, and whichever ran second
    got wrong gradients (whisper's attention, trained by plait after an eager step)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _no_dropout_seed(q) -> tuple:
    """The dropout seed and offset a CUDA backward takes, unread without dropout."""
    unused = torch.empty((), dtype=torch.int64, device=q.device)
    return unused, unused


def _cuda_flash_backward(ct, q, k, v, out, rows, causal: bool, scale: float,
                         dropout: float, state) -> list:
    """torch's CUDA flash backward, every head dim padded to a multiple of 8 as
    ``_cuda_flash`` pads them, replaying the dropout mask the generator ``state`` draws."""
    size = [x.shape[-1] for x in (q, k, v)]
    q, k, v, ct, out = (_padded(x, 8) for x in (q, k, v, ct, out))
    grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        _as_left_by_cuda_kernels(ct), q, k, v, _as_left_by_cuda_kernels(out), rows,
        None, None, q.shape[-2], k.shape[-2], dropout, causal, *state, scale=scale)
    return [g[..., :n] for g, n in zip(grads, size)]


def _attention_backward(ct, q, k, v, out, lse, *rest, scale, causal=False, dropout=0.0,
                        kernel=None, bshd=False):
    """torch's fused backward of the kernel the forward ran, reading the forward's output and
    statistics: the fused CPU kernel's, and on CUDA flash's, the memory-efficient kernel's
    and cuDNN's, given the output and its cotangent laid out as their forward leaves them
    (any other layout gave wrong gradients), the statistics as their forward shapes them,
    and for flash every head dim padded to a multiple of 8 as its forward was. Elsewhere
    (cuDNN where ``_cudnn_backward_holds`` says not, the math path) autograd's backward of
    the forward run again. With dropout, ``rest`` is the generator state the forward drew
    with, from which the kernel replays its mask (NOTE [attention dropout]); else the bias,
    if any. The gradients of q, k and v (the bias's: ``_bias_gradient``)."""
    if bshd:
        return heads_first(True, *_attention_backward(
            *heads_first(True, ct, q, k, v, out), lse, *rest, scale=scale, causal=causal,
            dropout=dropout, kernel=kernel))
    q4, k4, v4, ct4, out4 = (_four_d(x) for x in (q, k, v, ct, out))
    rows = lse.reshape(q4.shape[:-1])
    bias4 = _four_d_bias(rest[0] if rest and not dropout else None, q, k)
    kernel = kernel or _fused_kernel(q4, k4, v4, bias4, causal, scale)
    seed = _dropout_seed(kernel, *rest) if dropout else _no_dropout_seed(q)
    if kernel == "cpu":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            ct4, q4, k4, v4, out4, rows, 0.0, causal, attn_mask=bias4, scale=scale)
    elif kernel == "flash":
        grads = _cuda_flash_backward(ct4, q4, k4, v4, out4, rows, causal, scale, dropout, seed)
    elif kernel == "efficient":
        grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            _as_left_by_cuda_kernels(ct4), q4, k4, v4, _efficient_bias(bias4, q4, k4),
            _as_left_by_cuda_kernels(out4), _padded(rows, 32), *seed, 0.0,
            [True, True, True, False], causal, scale=scale)[:3]
    elif kernel == "cudnn" and _cudnn_backward_holds(q4, k4, v4, causal):
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            *map(_as_left_by_cuda_kernels, (ct4, q4, k4, v4, out4)),
            rows.unsqueeze(-1), *seed, None, None, None, q4.shape[-2], k4.shape[-2], dropout,
            causal, scale=scale)[:3]
    else:
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q4, k4, v4)]
            again = torch.nn.functional.scaled_dot_product_attention(
                *leaves, attn_mask=bias4, scale=scale, is_causal=causal)
            grads = torch.autograd.grad(again, leaves, ct4)
    return tuple(g.reshape(x.shape) for g, x in zip(grads, (q, k, v)))


def _batched_attention(prim: str):
    """Every operand batched (broadcast where it is not): a leading batch dim more, or with
    ``bshd`` (4-D operands only) the examples joined with the batch dim. With dropout,
    none: each example's own call (its generator state is one example's)."""
    def rule(operands, batched, axis_size, **params):
        if params.get("dropout"):
            return NotImplemented
        xs = [x if b else x.expand(axis_size, *x.shape) for x, b in zip(operands, batched)]
        if params.get("bshd"):  # (every operand's dim 0 is the batch, or broadcasts to it)
            n = xs[0].shape[1]
            xs = [x.expand(axis_size, n, *x.shape[2:]).flatten(0, 1) for x in xs]
        out = bind(prim, *xs, **params)
        outs = list(out) if isinstance(out, tuple) else [out]
        if params.get("bshd"):
            outs = [o.unflatten(0, (axis_size, n)) for o in outs]
        return outs, [True] * len(outs)

    return rule


def _attention_jvp(operands, tangents, outs, *, scale, causal=False, dropout=0.0,
                   kernel=None, bshd=False):
    if dropout:
        refuse_dropout_derivative("forward-mode differentiation (jvp, jacfwd)")
    q, k, v = heads_first(bshd, *operands[:3])
    bias = operands[3:]
    dq, dk, dv = heads_first(bshd, *(t if t is not None else torch.zeros_like(x)
                                      for t, x in zip(tangents[:3], operands)))
    p = attention_scores(q, k, scale, causal, *bias).softmax(-1)
    ds = (dq @ k.mT + q @ dk.mT) * scale
    if bias and tangents[3] is not None:
        ds = ds + tangents[3]
    dp = p * (ds - (p * ds).sum(-1, keepdim=True))
    # (the statistics carry no derivative: _attention_vjp)
    return [*heads_first(bshd, dp @ v + p @ dv), None]


define("attention", _attention_infer, _attention, jvp=_attention_jvp, multiple_results=True,
       batch=_batched_attention("attention"), draws=lambda dropout=0.0, **_: dropout > 0)
define("attention_backward", lambda ct, q, k, v, out, lse, *rest, **_: (q, k, v),
       _attention_backward, multiple_results=True, batch=_batched_attention("attention_backward"))


def _bias_gradient(ct, q, k, v, bias, out, scale: float):
    """The scores' gradient P * (ct @ vᵀ - rowsum(ct * out)), summed over the dims ``bias``
    is broadcast along: written out, in the statistics' precision. P is the softmax taken
    again (not exp(scores - lse)): the statistics carry no derivative, and these ops are
    differentiated again by a second derivative."""
    wide = _row_statistic_dtype(q.dtype)
    q, k, v, bias, ct, out = (x.to(wide) for x in (q, k, v, bias, ct, out))
    p = attention_scores(q, k, scale, False, bias).softmax(-1)
    ds = p * (ct @ v.mT - (ct * out).sum(-1, keepdim=True))
    spread = [d for d, (b, s) in enumerate(zip(bias.shape, ds.shape)) if b == 1 and s != 1]
    return ds.sum(spread, keepdim=True) if spread else ds


@vjp_rule("attention")
def _attention_vjp(cts, q, k, v, *bias, outs, **params):
    # the statistics carry no derivative (as normalizations' saved statistics do not): their
    # one reader, attention_backward, differentiates as the written-out form of q, k and v
    grads = bind("attention_backward", cts[0], q, k, v, *outs, *bias, **params)
    if not bias:
        return grads
    ct, q, k, v, out = heads_first(params.get("bshd", False), cts[0], q, k, v, outs[0])
    return [*grads, _bias_gradient(ct, q, k, v, bias[0], out, params["scale"])]


def _additive(mask, query):
    """An attention mask as the additive bias the primitive takes: a boolean one 0 where it
    keeps a score and -inf where not (as torch's call converts it), of query's rank."""
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device) \
            .masked_fill(mask.logical_not(), float("-inf"))
    return mask.reshape((1,) * (query.ndim - mask.ndim) + mask.shape)


def _scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                  is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` with or without a mask, and with dropout where
    ``_dropout_kernel`` names a kernel: the attention primitive (grouped-query attention's
    key and value heads repeated by broadcasting). Anything else, and attention faster
    written out (``stays_written``), traces torch's math form: left to torch, the call would
    pick a fused kernel by device, which plait does not differentiate."""
    tensors = (query, key, value)
    if not any(isinstance(x, TracerTensor) or torch._is_functional_tensor(x) for x in tensors):
        return NotImplemented
    masked, kernel = attn_mask is not None, None
    if not config.fuse_attention \
            or len({x.dtype for x in tensors}) != 1 or not query.dtype.is_floating_point \
            or not query.ndim == key.ndim == value.ndim >= 2 \
            or dropout_p and (kernel := _dropout_kernel(
                query, key, value, attn_mask, dropout_p, is_causal, scale)) is None \
            or stays_written(query.dtype, query.device, key.shape[-2]) \
            or masked and (attn_mask.dtype not in (torch.bool, query.dtype)
                           or attn_mask.ndim > query.ndim):
        if masked and attn_mask.dtype == torch.bool:  # as the call converts it
            attn_mask = _additive(attn_mask, query)
        if not dropout_p and query.ndim >= 3 and any(
                isinstance(n, torch.SymInt) for x in tensors for n in x.shape):
            # ATen's math form asks for sizes as numbers (torch 2.11's matmul): the same
            # ops, written here, keep them symbolic
            if enable_gqa and query.shape[-3] != key.shape[-3]:
                key, value = (x.repeat_interleave(query.shape[-3] // key.shape[-3], -3)
                              for x in (key, value))
            scores = attention_scores(query, key, scale if scale is not None else
                                      1 / math.sqrt(query.shape[-1]), is_causal, attn_mask)
            return matmul(torch.ops.aten._safe_softmax(scores, -1), value)
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
            enable_gqa=enable_gqa)[0]
    heads, kv_heads = (query.shape[-3], key.shape[-3]) if query.ndim > 2 else (1, 1)
    groups = heads // kv_heads if enable_gqa and kv_heads and heads % kv_heads == 0 else 1
    batch = (*key.shape[:-3], kv_heads * groups, *key.shape[-2:]) if groups > 1 else None
    scores = (*query.shape[:-1], key.shape[-2])
    if (query.shape[:-2] != (batch or key.shape)[:-2] or key.shape[:-2] != value.shape[:-2]
            or query.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2]
            or masked and torch.broadcast_shapes(attn_mask.shape, scores) != scores):
        return NotImplemented
    scale = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
    if not masked:
        return _attention_traced(query, key, value, groups=groups, scale=scale,
                                 causal=is_causal, dropout=dropout_p, kernel=kernel)
    bias = _additive(attn_mask, query)
    if is_causal:  # both masks: the causal one joins the bias
        keep = torch.ones(scores[-2:], dtype=torch.bool, device=query.device).tril()
        bias = bias.masked_fill(keep.logical_not(), float("-inf"))
    return _attention_traced(query, key, value, bias, groups=groups, scale=scale, causal=False)


@on_tracers
def _attention_traced(q, k, v, *bias, groups: int, dropout: float = 0.0, kernel=None,
                      **params):
    if dropout:  # (params only where set, as the attention fusion pass binds neither)
        params.update(dropout=dropout, kernel=kernel)
    if groups > 1:  # key and value head j serves query heads j * groups ... (j+1) * groups - 1
        k, v = (x.unsqueeze(-3).expand(*x.shape[:-2], groups, *x.shape[-2:]).reshape(
            *x.shape[:-3], x.shape[-3] * groups, *x.shape[-2:]) for x in (k, v))
    return bind("attention", q, k, v, *bias, **params)[0]


FUNCTION_HANDLERS[torch.nn.functional.scaled_dot_product_attention] = \
    _scaled_dot_product_attention


def _fused_attention_issued_by_torch(op):
    """A CUDA attention kernel that torch's own ``scaled_dot_product_attention`` picked
    (called from Python code that plait's function handler does not see: inside
    ``F.multi_head_attention_forward``, which a function mode runs as a whole): traced as
    ``_scaled_dot_product_attention`` is. torch's composite keeps only the output, so the
    kernel's other results are placeholders of their types (NaN where floating point); a
    call of the kernel from the user's own code stays an opaque call of it."""
    names = [a.name for a in op._schema.arguments]
    defaults = {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}

    def handler(*args, **kwargs):
        if not current_trace().issued_by_torch:
            return NotImplemented
        given = {**defaults, **dict(zip(names, args)), **kwargs}
        out = _scaled_dot_product_attention(
            given["query"], given["key"], given["value"], given.get("attn_bias"),
            given["dropout_p"], given["is_causal"], given["scale"])
        if out is NotImplemented:
            return NotImplemented
        with _disable_current_modes():
            metas = op(*[torch.empty(type_of(a).shape, dtype=type_of(a).dtype, device="meta")
                         if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
        device = type_of(given["query"]).device
        rest = [torch.full(m.shape, math.nan if m.dtype.is_floating_point else 0,
                           dtype=m.dtype, device=device) if isinstance(m, torch.Tensor) else m
                for m in metas[1:]]
        return (out, *rest)

    return handler


for _op in (aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default):
    HANDLERS[_op] = _fused_attention_issued_by_torch(_op)


def _flipped_transpose(w, groups: int):
    """Kernel [groups * a, b, k...] -> [groups * b, a, k...], spatially flipped: within each
    group, inputs and outputs swap, which runs the convolution backwards."""
    ga, b, *k = type_of(w).shape
    return w.reshape(groups, ga // groups, b, *k).transpose(1, 2).reshape(
        groups * b, ga // groups, *k).flip(list(range(2, len(k) + 2)))


# NOTE [convolution backward]
# The VJP of a convolution is two convolutions (``conv_vjp_written``), but the one for the
# kernel correlates the input with the whole output-sized cotangent as a kernel: for a
# depthwise 7x7 convolution over 56x56 the library runs a 56x56-kernel convolution, many
# times slower than its own weight-gradient kernels. Where ATen's ``convolution_backward``
# takes the convolution (symmetric padding, no input dilation), the VJP is the primitive
# ``conv_backward``: (ct, lhs, rhs) -> (d_lhs, d_rhs), which calls it. Its derivatives need
# no formula of their own: d_lhs = A(ct, rhs) and d_rhs = B(lhs, ct) are bilinear, A and B
# being conv's adjoints in each operand, so its JVP is conv_backward(t_ct, lhs, rhs) +
# conv_backward(ct, t_lhs, t_rhs), and its VJP for cotangents (g_l, g_r) is conv(g_l, rhs) +
# conv(lhs, g_r) for ct, and conv_backward(ct, g_l, g_r) for (lhs, rhs). vmap batches the
# written-out form (tracer/batching.py). Where nothing reads d_lhs (the gradient of a first
# layer's images), simplification sets ``lhs_grad=False`` and the node computes d_rhs alone
# (``passes.simplify.unread_input_grads``): ResNet-50's stem spent 1 ms a step on it.
def _library_backward(padding, lhs_dilation) -> bool:
    return all(lo == hi for lo, hi in padding) and all(d == 1 for d in lhs_dilation)


def _conv_backward_impl(ct, lhs, rhs, *, window_strides, padding, lhs_dilation, rhs_dilation,
                        feature_group_count, channels_last=False, lhs_grad=True):
    nd = len(window_strides)
    if channels_last:  # ct, lhs and d_lhs [N, *spatial, C]: channels-last views
        ct, lhs = ct.movedim(-1, 1), lhs.movedim(-1, 1)
    d_lhs, d_rhs, _ = torch.ops.aten.convolution_backward(
        ct, lhs, rhs, None, list(window_strides), [lo for lo, _ in padding],
        list(rhs_dilation), False, [0] * nd, feature_group_count, [lhs_grad, True, False])
    if not lhs_grad:
        return (d_rhs.contiguous(),)
    if channels_last:
        return d_lhs.movedim(1, -1).contiguous(), d_rhs.contiguous()
    return d_lhs, d_rhs


def _conv_backward_jvp(operands, tangents, outs, **params):
    zeros = [t if t is not None else torch.zeros_like(x) for t, x in zip(tangents, operands)]
    (t_ct, t_lhs, t_rhs), (ct, lhs, rhs) = zeros, operands
    first = bind("conv_backward", t_ct, lhs, rhs, **params)
    second = bind("conv_backward", ct, t_lhs, t_rhs, **params)
    return [a + b for a, b in zip(first, second)]


def _conv_backward_vjp(cts, ct, lhs, rhs, *, outs, lhs_grad=True, **params):
    if not lhs_grad:  # the full node's, with no cotangent for the input's gradient
        cts, outs = [None, *cts], [lhs, *outs]
    g_lhs, g_rhs = (c if c is not None else torch.zeros_like(o) for c, o in zip(cts, outs))
    d_ct = bind("conv", g_lhs, rhs, **params) + bind("conv", lhs, g_rhs, **params)
    return [d_ct, *bind("conv_backward", ct, g_lhs, g_rhs, **params)]


define("conv_backward", lambda ct, lhs, rhs, *, lhs_grad=True, **_: (lhs, rhs)[not lhs_grad:],
       _conv_backward_impl, multiple_results=True, jvp=_conv_backward_jvp,
       vjp=_conv_backward_vjp)


@vjp_rule("conv")
def _conv_vjp(cts, lhs, rhs, *, outs, **params):
    """NOTE [convolution backward]."""
    if _library_backward(params["padding"], params["lhs_dilation"]):
        return bind("conv_backward", cts[0], lhs, rhs, **params)
    return conv_vjp_written(cts, lhs, rhs, **params)


def conv_vjp_written(cts, lhs, rhs, *, window_strides, padding, lhs_dilation, rhs_dilation,
                      feature_group_count, channels_last=False):
    """Per spatial dim, output o reads padded input position o*s + j*rd through kernel tap j,
    where the padded input holds input i at lo + i*ld. Both cotangents are convolutions:
    - input: the cotangent dilated by s and correlated with the flipped kernel (span K) sees
      position p when padded by K-1 low; stepping by ld from lo reads the input positions;
    - kernel: the input (channels as batch, batch as features, kept apart per group)
      correlated with the cotangent dilated by s, stepping by rd over the taps.
    r is the high padding no window reaches (it is cropped from both). Channels-last
    operands are moved channels-first, and the input's cotangent back."""
    ct, g = cts[0], feature_group_count
    if channels_last:
        d_lhs, d_rhs = conv_vjp_written(
            [ct.movedim(-1, 1)], lhs.movedim(-1, 1), rhs, window_strides=window_strides,
            padding=padding, lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
            feature_group_count=g)
        return d_lhs.movedim(1, -1), d_rhs
    (n, c, *size), (_, _, *k) = type_of(lhs).shape, type_of(rhs).shape
    span = [(kk - 1) * rd + 1 for kk, rd in zip(k, rhs_dilation)]
    r = [((nn - 1) * ld + 1 + lo + hi - kk) % s for nn, ld, (lo, hi), kk, s in zip(
        size, lhs_dilation, padding, span, window_strides)]
    d_lhs = bind("conv", ct, _flipped_transpose(rhs, g), window_strides=lhs_dilation,
                 padding=tuple((kk - 1 - lo, rr + kk - 1 - hi)
                               for kk, (lo, hi), rr in zip(span, padding, r)),
                 lhs_dilation=window_strides, rhs_dilation=rhs_dilation,
                 feature_group_count=g)
    grouped = lhs.reshape(n, g, c // g, *size).transpose(0, 2).reshape(c // g, g * n, *size)
    d_rhs = bind("conv", grouped, ct.transpose(0, 1), window_strides=rhs_dilation,
                 padding=tuple((lo, hi - rr) for (lo, hi), rr in zip(padding, r)),
                 lhs_dilation=lhs_dilation, rhs_dilation=window_strides,
                 feature_group_count=g).transpose(0, 1)
    return d_lhs, d_rhs


def _per_dim(v, nd: int) -> tuple[int, ...]:
    """ATen's int[N] arguments may come as one int or a one-element list."""
    v = (v,) * nd if isinstance(v, int) else tuple(v)
    return v * nd if len(v) == 1 else v


@handles(aten.convolution.default)
def _convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    nd = type_of(w).ndim - 2
    if type_of(x).ndim == nd + 1:  # unbatched
        return _convolution(x.unsqueeze(0), w, bias, stride, padding, dilation, transposed,
                            output_padding, groups).squeeze(0)
    stride, padding, dilation, output_padding = (
        _per_dim(v, nd) for v in (stride, padding, dilation, output_padding))
    if transposed:
        cin, _, *k = type_of(w).shape
        _check(cin % groups == 0, "conv_transpose", f"groups={groups} do not divide the "
               "kernel's input channels", type_of(x), type_of(w))
        w = _flipped_transpose(w, groups)
        span = [d * (n - 1) for d, n in zip(dilation, k)]
        out = bind("conv", x, w, window_strides=(1,) * nd, padding=tuple(
            (s - p, s - p + op) for s, p, op in zip(span, padding, output_padding)),
                   lhs_dilation=stride, rhs_dilation=dilation, feature_group_count=groups)
    elif _is_product(type_of(x).shape[2:], type_of(w).shape[2:], stride, padding, dilation,
                     groups) and torch.device(type_of(x).device).type in CONV_AS_PRODUCT_DEVICES:
        out = _conv_as_product(x, w, stride)
    else:
        out = bind("conv", x, w, window_strides=stride, padding=tuple((p, p) for p in padding),
                   lhs_dilation=(1,) * nd, rhs_dilation=dilation, feature_group_count=groups)
    return out if bias is None else out + bias.reshape((-1,) + (1,) * nd)


# NOTE [convolutions as products]
# An ungrouped, unpadded convolution whose windows are single pixels (a 1x1 kernel: a
# bottleneck's first and last, a downsampling shortcut, strided first) or tile the input
# (kernel = stride: a ViT's patch embedding, a ConvNeXt's stem and downsampling) is a matrix
# product over channels or patches: [N, *S, C * prod(k)] @ [C * prod(k), C_out]. On the CPU
# the library's convolution costs a small ResNet 20-35 us a call forward and 50-65 backward
# at its sizes, where the products take 4-9 and 7-20; the channels-last layout (NOTE
# [channels-last convolutions]) cancels the transposes around a 1x1 product with its
# neighbours'. On CUDA cuDNN's convolutions stay: as products, ResNet-50's training step
# took 44.6 ms on an H200 against 26.1 (cuDNN runs float32 convolutions in TF32, where
# float32 products are not).
CONV_AS_PRODUCT_DEVICES = frozenset({"cpu"})


def _is_product(size, kernel, stride, padding, dilation, groups: int) -> bool:
    """Is the convolution a product (NOTE [convolutions as products])? Not where its input
    is smaller than its kernel, or empty: the convolution refuses those, as eager does."""
    pixels = all(k == 1 for k in kernel)
    return groups == 1 and not any(padding) and all(n >= k > 0 for n, k in zip(size, kernel)) \
        and (pixels or (tuple(kernel) == tuple(stride) and all(d == 1 for d in dilation)))


def _conv_as_product(x, w, stride):
    """NOTE [convolutions as products]."""
    kernel = type_of(w).shape[2:]
    if all(k == 1 for k in kernel):
        x = x[(..., *(slice(None, None, s) for s in stride))].movedim(1, -1)
    else:  # [N, C, *S] -> [N, *S / k, C * prod(k)], a remainder left out as the windows do
        n, c, *size = type_of(x).shape
        out = [m // k for m, k in zip(size, kernel)]
        x = x[(..., *(slice(0, o * k) for o, k in zip(out, kernel)))]
        x = x.reshape(n, c, *[v for o, k in zip(out, kernel) for v in (o, k)])
        nd = len(kernel)
        x = x.permute(0, *range(2, 2 + 2 * nd, 2), 1, *range(3, 3 + 2 * nd, 2))
        x = x.reshape(n, *out, c * math.prod(kernel))
    return torch.matmul(x, w.flatten(1).t()).movedim(-1, 1)


# ---------------------------------------------------------------------------------------
# Pooling: windows gathered through trace-time index tables, or strided slices (NOTE [nn ops])
# ---------------------------------------------------------------------------------------
def _spatial(x, nd: int, op: str) -> tuple[int, ...]:
    t = type_of(x)
    if t.ndim not in (nd + 1, nd + 2) or 0 in t.shape[-nd:]:
        raise ShapeError(f"{op}: expected a {nd + 1}-d or {nd + 2}-d input with non-empty "
                         f"spatial dims, got {t}")
    return t.shape[-nd:]


def _strided_tables(x, nd, op, kernel, stride, padding, dilation, ceil_mode):
    """Per spatial dim: the input positions of each window ([out, k]), and which of them lie
    in the input. Output sizes as eager's pooling_output_shape."""
    kernel, padding, dilation = (_per_dim(v, nd) for v in (kernel, padding, dilation))
    stride = _per_dim(stride, nd) if stride else kernel
    tables = []
    for n, k, s, p, d in zip(_spatial(x, nd, op), kernel, stride, padding, dilation):
        out = (n + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
        if ceil_mode and (out - 1) * s >= n + p:  # the last window must start in the input
            out -= 1
        if not (k > 0 and s > 0 and d > 0 and 0 <= p <= k // 2 and out > 0):
            raise ShapeError(f"{op}: kernel {k}, stride {s}, padding {p}, dilation {d} do not "
                             f"fit an input of size {n}")
        pos = torch.arange(out)[:, None] * s + torch.arange(k) * d - p
        tables.append((pos, (pos >= 0) & (pos < n)))
    return tables


def _adaptive_tables(x, nd, op, output_size):
    """Window i covers [floor(i n / out), ceil((i + 1) n / out)): lengths may differ, so
    positions past a window's end are masked out."""
    tables = []
    for n, out in zip(_spatial(x, nd, op), _per_dim(output_size, nd)):
        i = torch.arange(out)
        start, end = i * n // out, ((i + 1) * n + out - 1) // out
        pos = start[:, None] + torch.arange(int((end - start).max()) if out else 0)
        tables.append((pos, pos < end[:, None]))
    return tables


def _windows(x, tables):
    """x [..., n_0, .., n_d] -> windows [..., o_0, .., o_d, K] (K = k_0 * .. * k_d), the
    mask [o_0, .., o_d, K] of the entries inside the input, and each entry's flat position in
    the input's spatial plane (as the max-pool indices count it). K runs over the window in
    row-major order, the order in which eager scans it. One gather from the flattened plane:
    a gather of a gather would be stored between the two."""
    shape = type_of(x).shape
    nd = len(tables)
    lead, spatial = shape[:-nd], shape[-nd:]
    outs, ks = tuple(p.shape[0] for p, _ in tables), tuple(p.shape[1] for p, _ in tables)

    def place(table, d):  # [o_d, k_d] -> broadcastable to [o_0, .., o_d, k_0, .., k_d]
        view = [1] * 2 * nd
        view[d], view[nd + d] = table.shape
        return table.reshape(view)

    def plane(positions):  # per-dim positions -> flat positions in the spatial plane
        return sum(place(p, d) * math.prod(spatial[d + 1:]) for d, p in enumerate(positions))

    mask = functools.reduce(torch.logical_and, [place(m, d) for d, (_, m) in enumerate(tables)])
    flat = plane([p for p, _ in tables])
    read = plane([p.clamp(0, n - 1) for (p, _), n in zip(tables, spatial)])
    # the tables as constants on x's device (a CUDA tracer with a CPU operand traces to an
    # opaque ATen call)
    windows = lambda t: t.expand(outs + ks).reshape(outs + (-1,)).to(type_of(x).device)
    x = x.flatten(-nd) if nd > 1 else x
    return x.index_select(-1, windows(read).flatten()).reshape(
        lead + outs + (math.prod(ks),)), windows(mask), windows(flat)


def _max_pool(x, tables):
    windows, mask, flat = _windows(x, tables)
    dtype = type_of(x).dtype
    lowest = _lowest(dtype)
    filled = torch.where(mask, windows, lowest)
    # Eager keeps the first position that attains the max among those in the input (the
    # first inside it, where all are the lowest value), but any NaN replaces the running max,
    # so the last NaN wins. Three reductions of the windows, none reading another's result,
    # so one kernel computes them.
    values, first = filled.amax(-1), filled.argmax(-1)
    first = torch.where(values == lowest, mask.to(torch.uint8).argmax(-1), first)
    if dtype.is_floating_point:
        k = torch.arange(mask.shape[-1], device=mask.device)
        last_nan = torch.where(filled.isnan(), k, -1).amax(-1)
        first = torch.where(last_nan >= 0, last_nan, first)
    # the chosen entry's position, read from the [windows * K] table (an expand of the table
    # to the windows' shape would be stored: K int64s per window)
    *outs, k = flat.shape
    entry = torch.arange(0, flat.numel(), k, device=flat.device).reshape(outs) + first
    index = flat.flatten().index_select(0, entry.flatten()).reshape(first.shape)
    if not dtype.is_floating_point:
        return values, index
    nd = len(tables)
    rule = MaxPoolRule(tuple(tuple(map(tuple, torch.where(m, p, -1).tolist()))
                             for p, m in tables), tuple(range(x.ndim - nd, x.ndim)))
    return bind("custom_vjp", x, index, values, rule=rule, output=0), index


def _permuted_pooling(rule, perm: tuple[int, ...]):
    """A pooling rule's ``permuted`` (the layout pass's, passes/layout.py): the rule of the
    same pooling of transpose(x, perm)'s data laid out as x."""
    return attrs.evolve(rule, dims=tuple(perm[d] for d in rule.dims))


@attrs.frozen
class MaxPoolRule:
    """The VJP of max pooling's values (a ``custom_vjp`` rule, NOTE [custom functions]): each
    window's cotangent goes to the one input position its index names, the first of tied
    maxima as in eager (amax's derivative would share it among them). Computed as a gather,
    as torch.compile computes it, not a scatter: each input position sums the cotangents of
    the few windows that hold it (at most ceil(k / stride) per dim) and chose it."""

    windows: tuple  # per spatial dim: each window's input positions, -1 outside the input
    dims: tuple[int, ...]  # the input's spatial dims, in ``windows``' order

    permuted = _permuted_pooling

    def backward(self, ct, output: int, operands: tuple) -> list:
        x, index, _ = operands
        nd, at = len(self.dims), min(self.dims)
        if self.dims != tuple(range(at, at + nd)):  # not in order: gather with them last
            moved = attrs.evolve(self, dims=tuple(range(x.ndim - nd, x.ndim)))
            last = lambda t: t.movedim(self.dims, moved.dims)  # noqa: E731
            dx, *_ = moved.backward(last(ct), output, tuple(map(last, operands)))
            return [dx.movedim(moved.dims, self.dims), None, None]
        spatial = x.shape[at:at + nd]
        outs = index.shape[at:at + nd]
        holders = [self._holders(j, n) for j, n in enumerate(spatial)]

        def place(table, j):  # [n_j, m_j] -> broadcastable to [n_0, .., n_d, m_0, .., m_d]
            return table.reshape([table.shape[0] if i == j else 1 for i in range(nd)]
                                 + [table.shape[1] if i == j else 1 for i in range(nd)])

        # per input position (flat in the input plane), the flat positions in the output
        # plane of the windows that hold it, and which of those are real: [plane, m]
        m = math.prod(t.shape[1] for t, _ in holders)
        read = sum(place(t, j) * math.prod(outs[j + 1:]) for j, (t, _) in enumerate(holders))
        real = functools.reduce(torch.logical_and, [place(r, j) for j, (_, r) in
                                                    enumerate(holders)])
        device = ct.device  # constants on the cotangent's device, as ``_windows``' tables
        read = read.expand(*spatial, *read.shape[nd:]).reshape(-1).to(device)
        real = real.expand(*spatial, *real.shape[nd:]).reshape(-1, m).to(device)
        position = torch.arange(math.prod(spatial), device=device)[:, None]
        g, chosen = (t.flatten(at, at + nd - 1).index_select(at, read).unflatten(at, (-1, m))
                     for t in (ct, index))
        tail = (1,) * (x.ndim - at - nd)
        pick = real.reshape(real.shape + tail) & (chosen == position.reshape((-1, 1) + tail))
        wide = torch.promote_types(ct.dtype, torch.float32)
        dx = torch.where(pick, g.to(wide), 0).sum(at + 1).unflatten(at, spatial)
        return [dx.to(x.dtype), None, None]

    def _holders(self, j: int, n: int):
        """[n, m] windows along spatial dim j that hold each input position, and which of
        them are real (m: the most windows any position is in)."""
        held = [[] for _ in range(n)]
        for o, row in enumerate(self.windows[j]):
            for p in row:
                if p >= 0:
                    held[p].append(o)
        m = max(1, max(map(len, held)))
        table = torch.tensor([h + [0] * (m - len(h)) for h in held], dtype=torch.int64)
        real = torch.tensor([[True] * len(h) + [False] * (m - len(h)) for h in held])
        return table, real


# NOTE [strided max pooling]
# A window of up to MAX_UNROLLED_WINDOW entries is scanned entry by entry: entry j of every
# window is a strided slice of the input padded with the lowest value, so the forward is one
# elementwise kernel whose loads are affine in the output position (a table gather loads
# through an index a kernel cannot see as contiguous: ResNet-50's pooling took 0.60 ms
# forward and 0.77 backward on an H200, and its step's device time fell 22.2 -> 20.7 ms
# with the scan). The scan keeps eager's choice (the first maximum among the entries in
# the input, the last NaN) and the entry it chose, one byte per window, which the backward
# reads: the input's gradient sums, per entry j, the windows' cotangents where they chose j,
# spread back to the positions entry j reads (a strided slice's transpose: pads and
# reshapes, affine again). Larger windows and adaptive pooling gather through tables, as
# does the CPU, where the gather measured faster (a small ResNet's training step on one
# thread: 1.78 ms against 2.37 with the scan, which redoes its producer per window entry).
MAX_UNROLLED_WINDOW = 32
SCANNED_MAX_POOL_DEVICES = frozenset({"cuda"})


def _strided_max_pool(x, tables):
    """Max pooling of ``_strided_tables``' windows, scanned entry by entry (NOTE [strided max
    pooling]): (values, indices in the input's spatial plane)."""
    t, nd = type_of(x), len(tables)
    spatial, lowest = t.shape[-nd:], _lowest(t.dtype)
    dims = tuple(range(t.ndim - nd, t.ndim))
    # per spatial dim (size, kernel, stride, padding, dilation): window o's entry j reads
    # o * stride + j * dilation - padding
    windows = tuple((n, pos.shape[1], int(pos[1, 0] - pos[0, 0]) if pos.shape[0] > 1 else 1,
                     int(-pos[0, 0]), int(pos[0, 1] - pos[0, 0]) if pos.shape[1] > 1 else 1)
                    for (pos, _), n in zip(tables, spatial))
    padded = x
    for dim, (pos, _), (n, _, _, padding, _) in zip(dims, tables, windows):
        padded = pad_dim(padded, dim, padding, max(0, int(pos.max()) + 1 - n), lowest)
    best = which = real = None
    for k, js in enumerate(itertools.product(*(range(w[1]) for w in windows))):
        value = padded[(...,) + tuple(slice(j * d, j * d + (pos.shape[0] - 1) * s + 1, s)
                                      for (pos, _), j, (_, _, s, _, d) in
                                      zip(tables, js, windows))]
        inside = _window_mask([m[:, j] for (_, m), j in zip(tables, js)], t.device)
        if best is None:
            best, which, real = value, torch.zeros_like(value, dtype=torch.uint8), inside
            continue
        take = value > best
        if t.dtype.is_floating_point:
            take = take | value.isnan()  # any NaN replaces the running max: the last wins
        if real is not None:  # no entry in the input yet: the first one is taken
            take = take | ~real
        if inside is not None:
            take = take & inside
        best, which = torch.where(take, value, best), torch.where(take, k, which)
        real = None if real is None or inside is None else real | inside
    index = sum(_entry_position(which, tables[i][0], windows, i) * math.prod(spatial[i + 1:])
                for i in range(nd))
    if not t.dtype.is_floating_point:
        return best, index
    rule = StridedMaxPoolRule(windows, dims)
    return bind("custom_vjp", x, which, best, rule=rule, output=0), index


def _lowest(dtype: torch.dtype):
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


def _window_mask(masks: list, device):
    """Which windows' entry lies in the input ([o_0, .., o_d], a constant), from each dim's
    [o_i] mask; None where every window's does."""
    if all(bool(m.all()) for m in masks):
        return None
    return functools.reduce(torch.logical_and, [_along(m, d, len(masks))
                                                 for d, m in enumerate(masks)]).to(device)


def _along(v, d: int, nd: int):
    """A vector shaped to broadcast along dim d of nd."""
    return v.reshape([-1 if i == d else 1 for i in range(nd)])


def _entry_position(which, pos, windows: tuple, i: int):
    """Spatial dim i's input position of the entry ``which`` chose, in each window (``pos``:
    the dim's window table)."""
    kernel, dilation = windows[i][1], windows[i][4]
    j = (which.to(torch.int64) // math.prod(w[1] for w in windows[i + 1:])) % kernel
    return _along(pos[:, 0], i, len(windows)).to(type_of(which).device) + j * dilation


@attrs.frozen
class StridedMaxPoolRule:
    """The VJP of strided max pooling's values (a ``custom_vjp`` rule, NOTE [custom
    functions], NOTE [strided max pooling]): for each window entry j, the cotangents of the
    windows that chose j, spread to the input positions entry j reads."""

    windows: tuple  # per spatial dim: (size, kernel, stride, padding, dilation)
    dims: tuple[int, ...]  # the input's spatial dims, in ``windows``' order

    permuted = _permuted_pooling

    def backward(self, ct, output: int, operands: tuple) -> list:
        x, which, _ = operands
        g = ct.to(torch.promote_types(ct.dtype, torch.float32))
        dx = None
        for k, js in enumerate(itertools.product(*(range(w[1]) for w in self.windows))):
            term = torch.where(which == k, g, 0)
            for dim, j, (n, _, stride, padding, dilation) in zip(self.dims, js, self.windows):
                term = spread_strided(term, dim, stride, j * dilation - padding, n)
            dx = term if dx is None else dx + term
        return [dx.to(type_of(x).dtype), None, None]


def _mean_pool(x, tables, counts, divisor_override=None):
    """Window sums over a divisor: ``divisor_override``, else the product of per-dim window
    sizes ``counts`` (an empty window sums to 0, whatever it is divided by)."""
    windows, mask, _ = _windows(x, tables)
    dtype = type_of(x).dtype
    total = torch.where(mask, windows, 0).sum(-1, dtype=dtype)
    divisor = divisor_override or functools.reduce(
        lambda a, b: a[..., None] * b, counts).clamp(min=1).to(dtype=dtype, device=mask.device)
    return total / divisor if dtype.is_floating_point else torch.div(
        total, divisor, rounding_mode="trunc")


def _max_pool_handler(nd):
    def handler(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        tables = _strided_tables(x, nd, f"max_pool{nd}d", kernel_size, stride, padding,
                                 dilation, ceil_mode)
        if math.prod(pos.shape[1] for pos, _ in tables) > MAX_UNROLLED_WINDOW or \
                torch.device(type_of(x).device).type not in SCANNED_MAX_POOL_DEVICES:
            return _max_pool(x, tables)
        return _strided_max_pool(x, tables)

    return handler


def _avg_pool_handler(nd):
    def handler(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
        padding = _per_dim(padding, nd)
        tables = _strided_tables(x, nd, f"avg_pool{nd}d", kernel_size, stride, padding, 1,
                                 ceil_mode)
        if count_include_pad:  # the window clipped to the padded input, not to the input
            counts = [(pos[:, -1] + 1).clamp(max=n + p) - pos[:, 0] for (pos, _), n, p in zip(
                tables, type_of(x).shape[-nd:], padding)]
        else:
            counts = [mask.sum(1) for _, mask in tables]
        return _mean_pool(x, tables, counts, divisor_override)

    return handler


def _adaptive_max_handler(nd):
    return lambda x, output_size: _max_pool(x, _adaptive_tables(
        x, nd, f"adaptive_max_pool{nd}d", output_size))


def _adaptive_avg_handler(nd):
    def handler(x, output_size):
        tables = _adaptive_tables(x, nd, f"adaptive_avg_pool{nd}d", output_size)
        return _mean_pool(x, tables, [mask.sum(1) for _, mask in tables])

    return handler


def _fractional_max_handler(nd):
    """Fractional max pooling, its windows placed by ``random_samples`` (drawn by the caller:
    torch.rand in F.fractional_max_pool*d, NOTE [random draws]): torch's kernel picks each
    window's maximum, whose value is read back by a gather of its index, so it differentiates
    as eager's backward does (each cotangent added at the position its window chose)."""
    op = getattr(aten, f"fractional_max_pool{nd}d").default

    def handler(x, kernel_size, output_size, random_samples):
        _, index = current_trace().opaque(
            op, (bind("stop_gradient", x), kernel_size, output_size, random_samples), {})
        out = x.flatten(-nd).gather(-1, index.flatten(-nd)).view(index.shape)
        return out, index

    return handler


for _nd in (2, 3):
    handles(getattr(aten, f"max_pool{_nd}d_with_indices").default)(_max_pool_handler(_nd))
    handles(getattr(aten, f"fractional_max_pool{_nd}d").default)(_fractional_max_handler(_nd))
    handles(getattr(aten, f"avg_pool{_nd}d").default)(_avg_pool_handler(_nd))
    handles(getattr(aten, f"adaptive_max_pool{_nd}d").default)(_adaptive_max_handler(_nd))
    handles(getattr(aten, f"_adaptive_avg_pool{_nd}d").default)(_adaptive_avg_handler(_nd))


# ---------------------------------------------------------------------------------------
# Normalization
# ---------------------------------------------------------------------------------------
def _native_group_norm(x, weight, bias, N, C, HxW, group, eps):
    """Statistics per (sample, group) over the group's channels and spatial positions, in
    float32 for reduced-precision inputs (as eager); mean and rstd come back as [N, group]."""
    if group <= 0 or C % group:
        raise ShapeError(f"group_norm: {C} channels do not split into {group} groups")
    dtype = type_of(x).dtype
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    grouped = x.reshape(N, group, -1).to(acc)
    var, mean = torch.var_mean(grouped, -1, correction=0)
    rstd = torch.rsqrt(var + eps)
    out = ((grouped - mean[..., None]) * rstd[..., None]).reshape(N, C, HxW)
    if weight is not None:
        out = out * weight.reshape(C, 1)
    if bias is not None:
        out = out + bias.reshape(C, 1)
    return out.reshape(x.shape).to(dtype), mean.to(dtype), rstd.to(dtype)


# PyTorch differentiates group norm's mean and rstd outputs (unlike layer norm's).
HANDLERS[aten.native_group_norm.default] = _native_group_norm


# ---------------------------------------------------------------------------------------
# Contractions
# ---------------------------------------------------------------------------------------
@handles(aten._trilinear.default)
def _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """Each operand, unsqueezed at its expand dims, multiplied together and summed over
    sumdim: one einsum, with a letter per dim of the common rank."""
    rank = type_of(i1).ndim + len(expand1)
    letters = [chr(ord("a") + d) for d in range(rank)]
    subscripts = ["".join(letters[d] for d in range(rank) if d not in expand)
                  for expand in (expand1, expand2, expand3)]
    sizes = {}
    for operand, sub in zip((i1, i2, i3), subscripts):
        sizes.update(zip(sub, type_of(operand).shape))
    kept = [letters[d] for d in range(rank) if d not in sumdim]
    out = torch.einsum(",".join(subscripts) + "->" + "".join(c for c in kept if c in sizes),
                       i1, i2, i3)
    return out.reshape([sizes.get(c, 1) for c in kept])  # dims no operand has are size 1


@handles(aten.addbmm.default)
def _addbmm(x, batch1, batch2, *, beta=1, alpha=1):
    """sum_b batch1[b] @ batch2[b] is one matmul with the batch folded into the contraction;
    addmm then supplies beta/alpha semantics (beta=0 ignores x, NaN included)."""
    b, n, k = type_of(batch1).shape
    lhs = batch1.permute(1, 0, 2).reshape(n, b * k)
    return torch.addmm(x, lhs, batch2.reshape(b * k, -1), beta=beta, alpha=alpha)


# ---------------------------------------------------------------------------------------
# Distances
# ---------------------------------------------------------------------------------------
def _norm_of_difference(a, b, p):
    diff = a - b
    if type_of(diff).numel == 0:  # eager gives zeros; vector_norm rejects an empty inf norm
        return diff.new_zeros(type_of(diff).shape[:-1])
    return torch.linalg.vector_norm(diff, p, dim=-1)


@handles(aten._cdist_forward.default)
def _cdist_forward(x1, x2, p, compute_mode):
    """Eager switches p=2 to a matmul formula for more than 25 rows (or when asked to):
    follow the same switch, so results agree to rounding."""
    rows = type_of(x1).shape[-2], type_of(x2).shape[-2]
    mode = compute_mode or 0
    if p == 2 and (mode == 1 or (mode == 0 and max(rows) > 25)):
        return aten._euclidean_dist(x1, x2)
    return _norm_of_difference(x1[..., :, None, :], x2[..., None, :, :], p)


@handles(aten._pdist_forward.default)
def _pdist_forward(x, p=2.0):
    """Distances of all row pairs i < j, in row-major order: the pairs are a constant."""
    n = type_of(x).shape[0]
    i, j = torch.triu_indices(n, n, 1)
    return _norm_of_difference(x.index_select(0, i), x.index_select(0, j), p)


# ---------------------------------------------------------------------------------------
# Embeddings
# ---------------------------------------------------------------------------------------
# Looked-up rows as the forward sees them (zero where not ``kept``), with the derivative that
# eager's embedding backward gives them instead: it scales a row's cotangent (``scale``: 0
# for padding rows, or one over a frequency), passes it to rows that embedding_bag's fast
# path leaves out of its sum, and with ``sparse`` makes a sparse gradient, which plait
# cannot, so it refuses rather than hand back a dense one.
define("embedding_rows", lambda rows, scale, kept, *, sparse: (rows,),
       lambda rows, scale, kept, *, sparse: torch.where(kept, rows, 0),
       vjp=lambda cts, rows, scale, kept, *, outs, sparse: (
           _refuse_sparse() if sparse else cts[0] * scale, None, None))


def _refuse_sparse():
    raise UnsupportedOpError("embedding with sparse=True has a sparse gradient in eager, "
                             "which plait cannot produce; pass sparse=False")


def _lookup_frequency(indices, num_embeddings):
    """How often each index is looked up."""
    return indices.new_zeros(num_embeddings).scatter_add(0, indices, torch.ones_like(indices))


@handles(aten.embedding.default)
def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    flat, dtype = indices.flatten(), type_of(weight).dtype
    rows = weight.index_select(0, flat)
    if padding_idx >= 0 or scale_grad_by_freq or sparse:
        scale = (flat != padding_idx).to(dtype)
        if scale_grad_by_freq:
            scale = scale / _lookup_frequency(flat, type_of(weight).shape[0])[flat].to(dtype)
        rows = bind("embedding_rows", rows, scale[:, None], torch.tensor(
            [[True]], device=type_of(weight).device), sparse=sparse)
    return rows.reshape(*indices.shape, *weight.shape[1:])


def _embedding_bag(forward_only: bool):
    """Bags are data (offsets), but every bag's size is bounded by the number of indices, so
    rows scatter into their bag: [bags + 1, dim], the extra bag collecting padding rows.
    Results and extra outputs follow eager's CPU kernel, quirks included: with
    include_last_offset the last bag still runs to the end of indices in bag_size and
    offset2bag, and in the values except on the fast path (float weights, no padding_idx,
    'sum' or 'mean'; yet 'mean' divides by that bag_size); fast 'sum' leaves offset2bag
    empty; bag_size is zero for 'sum' (sized by offsets in the forward-only op); max_indices
    is bag_size except in 'max' mode."""
    def handler(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                per_sample_weights=None, include_last_offset=False, padding_idx=-1):
        length, dim = type_of(indices).shape[0], type_of(weight).shape[1]
        bags = type_of(offsets).shape[0] - include_last_offset
        device = type_of(weight).device  # of the constants, too
        position = torch.arange(length, device=device)
        bag = (offsets[:bags][None, :] <= position[:, None]).sum(1) - 1
        kept = indices != padding_idx
        sizes = bag.new_zeros(bags + 1).scatter_add(0, torch.where(kept, bag, bags),
                                                    torch.ones_like(bag))[:bags]
        # The fast sum/mean path stops at the last offset; the other paths do not.
        fast = padding_idx < 0 and type_of(weight).dtype in (torch.float32, torch.float16,
                                                            torch.bfloat16)
        target = torch.where(kept, bag, bags)
        rows = weight.index_select(0, indices)
        if scale_grad_by_freq:  # eager divides the rows of the u-th smallest distinct index
            # by the frequency of the u-th smallest index (repeats counted)
            freq = _lookup_frequency(indices, type_of(weight).shape[0])
            ordinal = freq.clamp(max=1).cumsum(0)[indices] - 1
            rows = bind("embedding_rows", rows, 1 / freq[torch.sort(indices).values[ordinal]][
                :, None].to(type_of(weight).dtype), torch.tensor([[True]], device=device),
                sparse=False)
        if per_sample_weights is not None:
            rows = rows * per_sample_weights[:, None]
        # Rows past the last offset are out of the fast path's sums, yet eager's 'mean'
        # backward passes them the last bag's cotangent ('sum' reads an offset2bag it never
        # filled there: plait gives them the derivative, zero).
        past_fast = include_last_offset and fast and mode != 2
        if past_fast or sparse:
            summed = (position < offsets[bags] if past_fast else
                      torch.ones(length, dtype=torch.bool, device=device))
            rows = bind("embedding_rows", rows, (summed | (mode == 1)).to(
                type_of(weight).dtype)[:, None], summed[:, None], sparse=sparse)
        spread = target[:, None].expand(length, dim)
        if mode == 2:  # eager keeps a bag's first row, then any strictly greater one
            first = target.new_full((bags + 1,), length).scatter_reduce(0, target, position,
                                                                         "amin")
            leading = first[target] == position
            rows = torch.where(rows.isnan() & ~leading[:, None], -math.inf, rows)
            out = rows.new_zeros(bags + 1, dim).scatter_reduce(0, spread, rows, "amax",
                                                               include_self=False)
            best = out[target]
            hits = torch.where((rows == best) | best.isnan(), position[:, None], length)
            winner = hits.new_full((bags + 1, dim), length).scatter_reduce(0, spread, hits,
                                                                           "amin")[:bags]
            max_indices = torch.where(winner < length, indices[winner.clamp(max=length - 1)], 0)
            out = out[:bags]
        else:
            out = rows.new_zeros(bags + 1, dim).scatter_add(0, spread, rows)[:bags]
            if mode == 1:
                out = out / sizes.clamp(min=1)[:, None].to(out.dtype)
            else:
                sizes = sizes.new_zeros(type_of(offsets).shape[0] if forward_only else bags)
            max_indices = sizes
        return out, bag[:0] if fast and mode == 0 else bag, sizes, max_indices

    return handler


handles(aten._embedding_bag.default)(_embedding_bag(forward_only=False))
handles(aten._embedding_bag_forward_only.default)(_embedding_bag(forward_only=True))


@handles(aten.embedding_renorm.default)
def _embedding_renorm(weight, indices, max_norm, norm_type):
    """Rows that are looked up and whose norm exceeds max_norm are scaled down to it."""
    norms = torch.linalg.vector_norm(weight, norm_type, dim=-1)
    used = norms.new_zeros(norms.shape, dtype=torch.bool).scatter(0, indices.flatten(), True)
    scale = torch.where(used & (norms > max_norm), max_norm / (norms + 1e-7), 1.0)
    return weight * scale[:, None].to(weight.dtype)


# ---------------------------------------------------------------------------------------
# Anti-aliased resampling
# ---------------------------------------------------------------------------------------
def _upsample_aa(op):
    """The op is linear and separable, so it is a constant matrix on each side of x; each
    matrix comes from running the op itself, at trace time, on an identity (two columns
    wide, constant along the rows: eager treats a width of one specially)."""
    def matrix(n, out, align_corners, scale, dtype):
        eye = torch.eye(n, dtype=torch.float64).reshape(n, 1, n, 1).expand(n, 1, n, 2)
        return op(eye, (out, 2), align_corners, scale, None)[..., 0].reshape(n, out).T.to(dtype)

    def handler(x, output_size, align_corners, scales_h=None, scales_w=None):
        (h, w), (out_h, out_w), dtype = type_of(x).shape[-2:], output_size, type_of(x).dtype
        return matrix(h, out_h, align_corners, scales_h, dtype) @ x @ matrix(
            w, out_w, align_corners, scales_w, dtype).T

    return handler


handles(aten._upsample_bilinear2d_aa.default)(_upsample_aa(aten._upsample_bilinear2d_aa.default))
handles(aten._upsample_bicubic2d_aa.default)(_upsample_aa(aten._upsample_bicubic2d_aa.default))
