"""The C++ backend's wrapper written in C++: one native call runs a whole program.

NOTE [C++ wrapper]
The Python wrapper (codegen.Wrapper) steps through a program, one ctypes call per kernel; on a
small training step that stepping is most of the time (tens of microseconds a step). Here the
wrapper is generated as one C++ function, ``plait_program(args, table, results, S)``, compiled
into the program's first kernel library, that follows the same memory plan (NOTE [wrapper
memory]) with pointers:

* ``args`` holds the inputs and the constants. Memory comes from torch's CPU allocator (so
  torch's profiler sees it, as it sees the Python wrapper's) through ``MEMORY``, a tiny
  library built once per torch version: each storage before its first step and back after
  its last, a pool slot before its first user and after its last, an in-place alias its
  storage's pointer. A storage holding an output is allocated at its first step too and
  handed over in ``results`` as a DLPack tensor of its dtype and shape, which Python takes
  over (two views of bytes cost 1.7 us a result, 0.16 ms of a small ResNet's step).
* ``table`` holds what the function calls, by position: the allocation functions first, then
  the kernels (their libraries stay as they are), their libraries' error flags, the runtime's
  externs, the Python steps and the loop bodies (NOTE [native loops]). Nothing is linked, so
  the wrapper adds a fraction of a second to its library's build.
* Externs run natively where the runtime has them (``NATIVE``: matrix products,
  convolutions and their backward, attention and its backward, scatters without a reduction
  or adding into their operand). The runtime (``RUNTIME``) is
  built once per torch version against torch's headers and libraries (8 s on 2 cores), by a
  process started when a program first needs it (``runtime_future``): until it is built,
  such a program runs through its Python wrapper, so no compilation waits for it. Found
  built, it is loaded at once, with no process. It calls the ATen operators the extern's Python implementation
  calls, on ``from_blob`` views of the buffers (an operand's view steps become its strides),
  and writes into the step's own output buffers. Any other extern is a Python step: the
  wrapper calls back into Python with the step's pointers, and the callback runs the extern
  on tensors over that memory and copies its results into the outputs.
* A failed step stops the call: a kernel's error flag (NOTE [kernel errors]), an ATen error
  (the runtime keeps its message), a Python step's exception (kept and raised again) or a
  failed allocation. Everything allocated so far is given back on the way out.
* The compiled source carries no provenance, so a program traced from other lines builds the
  same library; the listing (``wrapper_source``) has each step's user lines above it.

* A program of symbolic sizes (NOTE [symbolic sizes]) reads each number that depends on them
  from ``S``, a fourth argument: allocation sizes, results' shapes, kernels' size
  parameters, and the sizes, strides and offsets of native externs' operand views. Python
  fills ``S`` from the inputs' shapes once per distinct sizes (``_size_array``, kept); a
  Python step sees its types at the call's sizes. Such a program with control flow keeps
  the Python wrapper (its sub-programs are called with concrete sizes).

A program with collectives keeps the Python wrapper (its comm pools and waits are Python's),
as does every call under ``config.check_memory_plan`` (its tracker follows the Python
wrapper's tensors). ``config.cpp_wrapper = False`` turns the C++ wrapper off.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Sequence

import attrs
import sympy
import torch

from ..config import config
from ..errors import BackendError
from ..graph.loops import Extern, Kernel, Wait
from ..graph.types import TensorType, concrete, hints, is_symbolic, size_values
from ..tracer.registry import Impl
from .codegen import entry_pointers, extern_at, extern_results, extern_text, kernel_error
from .toolchain import CPP_DTYPES, build, ctype

# ---------------------------------------------------------------------------------------
# The runtime: native externs, through ATen
# ---------------------------------------------------------------------------------------
MEMORY = r"""// plait's C++ wrapper's memory (backends/cpp_wrapper.py, NOTE [C++ wrapper]).
#include <ATen/dlpack.h>
#include <c10/core/CPUAllocator.h>

// From torch's CPU allocator (its profiler sees it). An intermediate is raw memory; a result
// is also handed to Python as a DLPack tensor of its type, whose deleter gives the memory back.
#include <vector>
extern "C" void* plait_alloc(int64_t n) {
  try { return c10::GetCPUAllocator()->raw_allocate(n ? n : 1); } catch (...) { return nullptr; }
}

extern "C" void plait_free(void* p) { if (p) c10::GetCPUAllocator()->raw_deallocate(p); }

struct plait_result { DLManagedTensor managed; std::vector<int64_t> shape; };

static void plait_delete(DLManagedTensor* m) {
  plait_free(m->dl_tensor.data);
  delete static_cast<plait_result*>(m->manager_ctx);
}

// n bytes for a result of ``ndim`` dims ``shape`` and DLPack type (``code``, ``bits``).
extern "C" void* plait_alloc_result(int64_t n, void** handle, int64_t ndim, const int64_t* shape,
                                    int64_t code, int64_t bits) {
  void* data = plait_alloc(n);
  if (!data) return nullptr;
  auto* r = new plait_result{};
  r->shape.assign(shape, shape + ndim);
  r->managed.dl_tensor = {data, {kDLCPU, 0}, static_cast<int32_t>(ndim),
                          {static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1},
                          r->shape.data(), nullptr, 0};
  r->managed.manager_ctx = r;
  r->managed.deleter = plait_delete;
  *handle = &r->managed;
  return data;
}

extern "C" void plait_drop_result(void* handle) { plait_delete(static_cast<DLManagedTensor*>(handle)); }
"""

RUNTIME = r"""// plait's C++ runtime: externs through ATen (backends/cpp_wrapper.py, NOTE [C++ wrapper]).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <limits>
#include <string>

struct plait_view { void* data; int64_t ndim; const int64_t* sizes; const int64_t* strides;
                    int64_t dtype; };

static thread_local std::string plait_message;

static at::Tensor tensor(const plait_view* v) {
  return at::from_blob(v->data, at::IntArrayRef(v->sizes, v->ndim),
                       at::IntArrayRef(v->strides, v->ndim),
                       at::TensorOptions().dtype(static_cast<at::ScalarType>(v->dtype)));
}

static std::vector<int64_t> take(const int64_t*& p) {  // a count, then that many values
  int64_t n = *p++;
  std::vector<int64_t> out(p, p + n);
  p += n;
  return out;
}

template <class F> static int guarded(F f) {
  try { f(); return 0; }
  catch (const std::exception& e) { plait_message = e.what(); return -1; }
}

extern "C" const char* plait_runtime_error() { return plait_message.c_str(); }

// Each extern takes its operands' and results' views (operands first) and its params as
// integers and doubles, and computes what the primitive's Python implementation computes.

// dot_general: batch dims first, then lhs free dims, then rhs free dims; a matrix product is
// one mm, anything else one bmm. ints: the contracting and batch dims of each side, each
// list as its length and then its elements.
extern "C" int plait_dot_general(const plait_view* v, const int64_t* p, const double*) {
  return guarded([&] {
    auto lc = take(p), rc = take(p), lb = take(p), rb = take(p);
    at::Tensor l = tensor(&v[0]), r = tensor(&v[1]), o = tensor(&v[2]);
    if (lb.empty() && l.dim() == 2 && r.dim() == 2 && lc.size() == 1) {
      at::mm_out(o, lc[0] == 1 ? l : l.t(), rc[0] == 0 ? r : r.t());
      return;
    }
    auto rest = [](const at::Tensor& t, const std::vector<int64_t>& a,
                   const std::vector<int64_t>& b) {
      std::vector<int64_t> free;
      for (int64_t i = 0; i < t.dim(); ++i)
        if (std::find(a.begin(), a.end(), i) == a.end() &&
            std::find(b.begin(), b.end(), i) == b.end()) free.push_back(i);
      return free;
    };
    auto size = [](const at::Tensor& t, const std::vector<int64_t>& d) {
      int64_t n = 1;
      for (auto i : d) n *= t.size(i);
      return n;
    };
    auto lf = rest(l, lc, lb), rf = rest(r, rc, rb);
    std::vector<int64_t> lp(lb), rp(rb);
    lp.insert(lp.end(), lf.begin(), lf.end()); lp.insert(lp.end(), lc.begin(), lc.end());
    rp.insert(rp.end(), rc.begin(), rc.end()); rp.insert(rp.end(), rf.begin(), rf.end());
    auto a = l.permute(lp).reshape({size(l, lb), size(l, lf), size(l, lc)});
    auto b = r.permute(rp).reshape({size(r, rb), size(r, rc), size(r, rf)});
    auto o3 = o.view({a.size(0), a.size(1), b.size(2)});
    at::bmm_out(o3, a, b);
  });
}

// conv and conv_backward with symmetric padding and no input dilation, as ATen's own
// convolution takes them. ints: window strides, padding, kernel dilation (each a list),
// groups, whether the input, the output and their gradients are channels-last ([N, *spatial,
// C], seen by ATen as channels-last views); conv_backward's then whether it computes the
// input's gradient (else the kernel's alone).
struct conv_params { std::vector<int64_t> stride, padding, dilation; int64_t groups;
                     bool channels_last; };
static conv_params conv_of(const int64_t*& p) {
  auto stride = take(p), padding = take(p), dilation = take(p);
  int64_t groups = *p++;
  return {stride, padding, dilation, groups, *p++ != 0};
}

static at::Tensor activation(const plait_view* v, const conv_params& c) {
  auto x = tensor(v);
  return c.channels_last ? x.movedim(-1, 1) : x;
}

extern "C" int plait_conv(const plait_view* v, const int64_t* p, const double*) {
  return guarded([&] {
    auto c = conv_of(p);
    std::vector<int64_t> zeros(c.stride.size(), 0);
    activation(&v[2], c).copy_(at::convolution(activation(&v[0], c), tensor(&v[1]), {},
                                               c.stride, c.padding, c.dilation, false, zeros,
                                               c.groups));
  });
}

extern "C" int plait_conv_backward(const plait_view* v, const int64_t* p, const double*) {
  return guarded([&] {
    auto c = conv_of(p);
    std::vector<int64_t> zeros(c.stride.size(), 0);
    bool lhs_grad = *p;
    auto grads = at::convolution_backward(activation(&v[0], c), activation(&v[1], c),
                                          tensor(&v[2]), c10::nullopt, c.stride, c.padding,
                                          c.dilation, false, zeros, c.groups,
                                          {lhs_grad, true, false});
    if (lhs_grad) activation(&v[3], c).copy_(std::get<0>(grads));
    tensor(&v[3 + lhs_grad]).copy_(std::get<1>(grads));
  });
}

// scatter without a reduction or with sum over its operand (an embedding's gradient): the
// output is the operand with src written or added at index's positions along dim, in
// place (the Python implementation's out-of-place scatter copies the operand twice and the
// Python step a third time). ints: dim, whether it adds.
extern "C" int plait_scatter(const plait_view* v, const int64_t* p, const double*) {
  return guarded([&] {
    auto out = tensor(&v[3]);
    out.copy_(tensor(&v[0]));
    if (p[1]) out.scatter_add_(p[0], tensor(&v[1]), tensor(&v[2]));
    else out.scatter_(p[0], tensor(&v[1]), tensor(&v[2]));
  });
}

// cumsum and cumprod along dim (ints: dim), in the result's dtype (an integer operand's own).
extern "C" int plait_cumsum(const plait_view* v, const int64_t* p, const double*) {
  return guarded([&] {
    auto out = tensor(&v[1]);
    at::cumsum_out(out, tensor(&v[0]), p[0], out.scalar_type());
  });
}

extern "C" int plait_cumprod(const plait_view* v, const int64_t* p, const double*) {
  return guarded([&] {
    auto out = tensor(&v[1]);
    at::cumprod_out(out, tensor(&v[0]), p[0], out.scalar_type());
  });
}

// attention and attention_backward: torch's fused attention on 4-D operands (other ranks
// folded into batch and heads, as the Python implementation does). attention writes the
// output and each row's log-sum-exp, which the backward reads (tracer/nn.py). Where torch
// would not pick its fused CPU kernel, the statistics come from the scores and the backward
// is autograd's. ints: causal, whether an additive bias follows the operands (after v; after
// the statistics for the backward); doubles: scale.
static at::Tensor four_d(const at::Tensor& x) {
  return x.dim() == 4 ? x : x.reshape({-1, 1, x.size(-2), x.size(-1)});
}

static std::optional<at::Tensor> four_d_bias(bool biased, const plait_view* view,
                                             const at::Tensor& q, const at::Tensor& k) {
  if (!biased) return {};
  auto bias = tensor(view);
  if (q.dim() == 4) return bias;
  auto scores = q.sizes().vec();
  scores.back() = k.size(-2);
  return bias.expand(scores).reshape({-1, 1, q.size(-2), k.size(-2)});
}

static bool fused_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& bias, bool causal, double scale) {
  constexpr int64_t flash = 1;  // sdp::SDPBackend::flash_attention
  return at::_fused_sdp_choice(q, k, v, bias, 0.0, causal, scale) == flash;
}

extern "C" int plait_attention(const plait_view* v, const int64_t* p, const double* f) {
  return guarded([&] {
    auto q = four_d(tensor(&v[0])), k = four_d(tensor(&v[1])), val = four_d(tensor(&v[2]));
    auto bias = four_d_bias(p[1], &v[3], tensor(&v[0]), tensor(&v[1]));
    const plait_view* results = &v[3 + p[1]];
    at::Tensor out, lse;
    if (fused_kernel(q, k, val, bias, p[0], f[0])) {
      std::tie(out, lse) = at::_scaled_dot_product_flash_attention_for_cpu(q, k, val, 0.0, p[0],
                                                                           bias, f[0]);
    } else {
      out = at::scaled_dot_product_attention(q, k, val, bias, 0.0, p[0], f[0]);
      auto wide = tensor(&results[1]).scalar_type();
      auto s = at::matmul(q.to(wide), k.to(wide).transpose(-2, -1)) * f[0];
      if (bias) s = s + bias->to(wide);
      if (p[0]) {  // causal: each row's later keys masked
        auto later = at::ones({s.size(-2), s.size(-1)}, s.options().dtype(at::kBool)).triu(1);
        s = s.masked_fill(later, -std::numeric_limits<double>::infinity());
      }
      lse = s.logsumexp(-1);
    }
    tensor(&results[0]).copy_(out.reshape(tensor(&results[0]).sizes()));
    tensor(&results[1]).copy_(lse.reshape(tensor(&results[1]).sizes()));
  });
}

extern "C" int plait_attention_backward(const plait_view* v, const int64_t* p, const double* f) {
  return guarded([&] {
    auto ct = four_d(tensor(&v[0])), q = four_d(tensor(&v[1])), k = four_d(tensor(&v[2])),
         val = four_d(tensor(&v[3])), out = four_d(tensor(&v[4]));
    auto bias = four_d_bias(p[1], &v[6], tensor(&v[1]), tensor(&v[2]));
    const plait_view* results = &v[6 + p[1]];
    std::vector<at::Tensor> grads;
    if (fused_kernel(q, k, val, bias, p[0], f[0])) {
      auto lse = tensor(&v[5]).reshape({q.size(0), q.size(1), q.size(2)});
      auto g = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          ct, q, k, val, out, lse, 0.0, p[0], bias, f[0]);
      grads = {std::get<0>(g), std::get<1>(g), std::get<2>(g)};
    } else {
      c10::AutoGradMode grad_mode(true);  // (at:: has no alias for it in torch 2.11)
      std::vector<at::Tensor> leaves;
      for (auto& x : {q, k, val}) leaves.push_back(x.detach().requires_grad_(true));
      auto again = at::scaled_dot_product_attention(leaves[0], leaves[1], leaves[2], bias, 0.0,
                                                    p[0], f[0]);
      grads = torch::autograd::grad({again}, leaves, {ct});
    }
    for (int j = 0; j < 3; ++j) {
      tensor(&results[j]).copy_(grads[j].reshape(tensor(&results[j]).sizes()));
    }
  });
}
"""

# torch dtype -> (DLPack's type code, bits) (dlpack.h: kDLInt 0, kDLUInt 1, kDLFloat 2,
# kDLBfloat 4, kDLComplex 5, kDLBool 6); a result of any other dtype (complex32, uint64, the
# float8s, which DLPack or torch's reading of it may lack) is handed over as bytes
_DLPACK = {torch.uint8: (1, 8), torch.int8: (0, 8), torch.int16: (0, 16), torch.int32: (0, 32),
           torch.int64: (0, 64), torch.float16: (2, 16), torch.float32: (2, 32),
           torch.float64: (2, 64), torch.complex64: (5, 64), torch.complex128: (5, 128),
           torch.bool: (6, 8), torch.bfloat16: (4, 16)}

# torch dtype -> ATen's ScalarType number (c10/core/ScalarType.h)
_SCALAR_TYPES = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
                 torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.complex64: 9,
                 torch.complex128: 10, torch.bool: 11, torch.bfloat16: 15}


def _build(source: str, symbols: list, libraries: list, only_cached: bool = False):
    """A library against torch's headers and ``libraries``, built once per torch version and
    compiler (NOTE [C++ build cache]); None where ``only_cached`` and it was not built."""
    root = os.path.dirname(torch.__file__)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = [f"-I{root}/include", f"-I{root}/include/torch/csrc/api/include",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w", f"-L{root}/lib",
             *(f"-l{name}" for name in libraries), f"-Wl,-rpath,{root}/lib"]
    source = f"// for torch {torch.__version__}\n{source}"  # its headers: part of the key
    return build(source, symbols, flags, only_cached)


@functools.cache
def memory():
    """The wrapper's allocation functions (0.5 s to build)."""
    return _build(MEMORY, list(_RESERVED), ["c10"])


@functools.cache
def runtime():
    """The externs through ATen (8 s to build on 2 cores), where a program has one."""
    return _runtime()


def _runtime(only_cached: bool = False):
    library = _build(RUNTIME, [*(f"plait_{prim}" for prim in NATIVE), "plait_runtime_error"],
                     ["torch_cpu", "c10"], only_cached)
    if library is not None:
        library.cdll.plait_runtime_error.restype = ctypes.c_char_p
    return library


# The runtime's build runs only on cores nothing else wants (SCHED_IDLE; the lowest nice
# value where that policy is missing). Niced by 10 only, its compiler took the cores from
# the threads of plait's and torch's parallel loops, which wait for each other at every
# barrier: a 2-core machine ran a small GPT's training step back to back at 571 ms a call
# while the runtime built, against 54 ms with SCHED_IDLE (12 ms once it is built).
_IDLE = ("os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)) "
         "if hasattr(os, 'SCHED_IDLE') else os.nice(19)")
_building: list = []  # the Future of the runtime, once a program needed it
_building_lock = threading.Lock()


def runtime_future() -> concurrent.futures.Future:
    """``runtime()``, started on first need: a program calls its Python wrapper meanwhile, so
    a cold compile never waits for it (NOTE [C++ wrapper]). A process of its own builds it
    into the disk cache, which outlives a short program that exits first (a thread's build
    would die with it, and every run would start over); then this one loads it (or, where
    that build failed, builds it here, for the compiler's message). Found in the cache, it is
    loaded at once."""
    with _building_lock:
        if not _building:
            future = concurrent.futures.Future()
            _building.append(future)
            try:  # built before: loaded here, with no process (whose start-up would take
                # the cores from the calls it runs beside, for seconds)
                if _runtime(only_cached=True) is not None:
                    future.set_result(runtime())
                    return future
            except BackendError as e:  # no compiler
                future.set_exception(e)
                return future

            def build():
                try:
                    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                               PLAIT_CACHE_DIR=config.cache_dir,
                               PLAIT_CPP_COMPILER=config.cpp_compiler,
                               PLAIT_CPP_FLAGS=config.cpp_flags,
                               PLAIT_CPP_SANITIZE=str(int(config.cpp_sanitize)))
                    code = f"import os; {_IDLE}; import {__name__} as w; w.runtime()"
                    subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                   start_new_session=True)
                    future.set_result(runtime())
                except BaseException as e:  # noqa: BLE001 - reported where it is used
                    future.set_exception(e)

            threading.Thread(target=build, name="plait-runtime", daemon=True).start()
        return _building[0]


_warned: list = []


def warn_off(error: Exception) -> None:
    """Once per process: the C++ wrapper is off because a library it needs does not build."""
    if not _warned:
        _warned.append(error)
        warnings.warn(f"plait's C++ wrapper is off: {error}\nPrograms step through their "
                      "kernels from Python instead (slower per call); set "
                      "plait.config.cpp_wrapper = False to silence this.")


# The runtime's functions every wrapper calls, at these positions of its table.
_RESERVED = ("plait_alloc", "plait_free", "plait_alloc_result", "plait_drop_result")


def _prim(k) -> str | None:
    """The primitive an extern runs (None for anything but a primitive's implementation)."""
    return k.fn.prim if isinstance(k, Extern) and isinstance(k.fn, Impl) else None


def _lists(*lists) -> list[int]:
    """Integer lists as the runtime's ``take`` reads them: each its length, then its items."""
    return [n for xs in lists for n in (len(xs), *xs)]


def _conv_ints(p: dict) -> list[int] | None:
    if any(lo != hi for lo, hi in p["padding"]) or max(p["lhs_dilation"]) > 1:
        return None  # the Python implementation pads, crops or dilates
    return _lists(p["window_strides"], [lo for lo, _ in p["padding"]], p["rhs_dilation"]) + \
        [p["feature_group_count"], int(p.get("channels_last", False))]


# primitive -> (params, number of operands) -> (ints, doubles) the runtime's
# ``plait_<primitive>`` takes, or None where it does not compute it (NOTE [C++ wrapper])
NATIVE = {
    "dot_general": lambda p, _: (_lists(*p["contracting"], *p["batch"]), ()),
    "conv": lambda p, _: None if (ints := _conv_ints(p)) is None else (ints, ()),
    "conv_backward": lambda p, _: None if (ints := _conv_ints(p)) is None else (
        ints + [int(p.get("lhs_grad", True))], ()),
    "cumsum": lambda p, _: ([p["dim"]], ()),
    "cumprod": lambda p, _: ([p["dim"]], ()),
    "scatter": lambda p, _: ([p["dim"], int(p["reduce"] == "sum")], ())
    if p["reduce"] is None or (p["reduce"] == "sum" and p["include_self"]) else None,
    # (attention with dropout: CUDA's flash kernel alone, NOTE [attention dropout]; stored
    # as CUDA's kernels store it: a Python step, NOTE [attention in the kernels' layout])
    "attention": lambda p, operands: None if p.get("dropout") or p.get("bshd") else (
        [int(p.get("causal", False)), operands - 3], [float(p["scale"])]),
    "attention_backward": lambda p, operands: None if p.get("dropout") or p.get("bshd") else (
        [int(p.get("causal", False)), operands - 6], [float(p["scale"])]),
}


def _native_params(k) -> tuple | None:
    """The runtime's params for extern ``k``, or None: a Python step."""
    if k.fenced or (prim := _prim(k)) not in NATIVE or is_symbolic(tuple(v for _, v in k.params)):
        return None
    return NATIVE[prim](dict(k.params), len(k.inputs))


# control-flow primitive -> the params holding its sub-programs (NOTE [native loops])
BODIES = {"scan": ("body",), "while_loop": ("cond_graph", "body_graph"),
          "cond": ("true_branch", "false_branch")}


def _sub_programs(k, buffers, compile_body) -> list | None:
    """NOTE [native loops]: the sub-programs of a control-flow extern, each a ``codegen.Runner``
    whose wrapper is native and writes every output into memory of its caller's; or None.
    ``compile_body(graph)``: a body compiled by this backend (None: none is)."""
    if compile_body is None or _prim(k) not in BODIES or k.fenced or any(
            m != "reshape" for v in k.fn.views for m, *_ in v):
        return None
    runners = [compile_body(dict(k.params)[name]).runner for name in BODIES[_prim(k)]]
    if not all(isinstance(r.wrapper, NativeWrapper) and r.wrapper.loopable for r in runners):
        return None
    pred = {"cond": lambda: buffers[k.inputs[0]].type,
            "while_loop": lambda: runners[0].wrapper.output_types[0]}.get(_prim(k))
    return runners if pred is None or pred().dtype in CPP_DTYPES else None


def applies(program, plan) -> bool:
    """Is ``program`` run by the C++ wrapper (NOTE [C++ wrapper])? Not one with symbolic
    sizes and control flow (NOTE [native loops] call sub-programs of concrete sizes)."""
    symbolic = any(is_symbolic(b.type) for b in program.buffers.values())
    return config.cpp_wrapper and not plan.comm_pools and not any(
        isinstance(k, Wait) or isinstance(k, Extern) and (
            k.collective or symbolic and _prim(k) in BODIES) for k in program.kernels)


SIZE_ARRAYS = 256  # a symbolic program's ``S`` kept, by the sizes of its calls

# ---------------------------------------------------------------------------------------
# Generating the wrapper
# ---------------------------------------------------------------------------------------
class _Table:
    """What the wrapper calls, by position in ``table``: (kind, what) -> index."""

    def __init__(self):
        self.entries: dict = {("runtime", name): j for j, name in enumerate(_RESERVED)}

    def __call__(self, kind: str, what) -> int:
        return self.entries.setdefault((kind, what), len(self.entries))


def _view_of(k: Extern, j: int | None, t, sizes: dict | None = None) -> tuple[tuple, tuple, int]:
    """The sizes, strides and element offset of extern ``k``'s operand ``j`` (a buffer of type
    ``t``) as its implementation views it (``Impl.views``); of an output (``j`` None), its
    buffer's. ``sizes``: the size symbols' values, for a symbolic type or view."""
    steps = k.fn.views[j] if j is not None and k.fn.views else ()
    if sizes is None and is_symbolic((t.shape, steps)):  # its structure: at the hints
        sizes = hints((t.shape, steps))
    shape, steps = (t.shape, steps) if sizes is None else concrete((t.shape, steps), sizes)
    x = torch.empty(tuple(shape), dtype=t.dtype, device="meta")
    for method, *args in steps:
        x = getattr(x, method)(*args)
    return tuple(x.shape), tuple(x.stride()), x.storage_offset()


class _SizeArgs:
    """NOTE [symbolic sizes]: the numbers a symbolic program's wrapper reads at each call,
    ``S[k]``: size expressions, and the sizes, strides and element offsets of native externs'
    operand views (``("view", step, operand, field, dim)``), evaluated in Python once per
    distinct sizes (``NativeWrapper._size_array``)."""

    def __init__(self):
        self.items: dict = {}

    def __call__(self, v) -> str:
        """``v`` as C++: a number as itself, a size expression (or a view's item) as
        ``S[k]``."""
        if isinstance(v, int) or isinstance(v, sympy.Basic) and not v.free_symbols:
            return str(int(v))
        return f"S[{self.items.setdefault(v, len(self.items))}]"


def _array(lines: list, name: str, values, size=None) -> str:
    """A named int64 array; of ``size`` items (a symbolic program's), read from ``S``."""
    values = [size(v) if size else str(v) for v in values] or ["0"]
    static = "" if any(v.startswith("S[") for v in values) else "static "  # per call
    lines.append(f"    {static}const int64_t {name}[] = {{{', '.join(values)}}};")
    return name


@attrs.frozen
class Generated:
    """A program's C++ wrapper: its ``source``; what ``table`` holds, in order (``(kind,
    what)``); the storages holding outputs (handed to Python in ``results``); the Python
    steps; the control-flow sub-programs' runners (``body`` entries index them); how many
    inputs and constants ``args`` holds."""

    source: str   # compiled
    listing: str  # the source with each step's provenance, for reading
    entries: tuple
    handed: tuple
    python_steps: tuple
    bodies: tuple
    n_entry: int
    sizes: tuple = ()  # what ``S`` holds, in order (_SizeArgs)
    views: tuple = ()  # ((step, operand), (extern, its operand or None, buffer type))

    @property
    def uses_runtime(self) -> bool:
        return any(kind == "runtime" and what not in _RESERVED for kind, what in self.entries)


def generate(program, plan, writers: dict, compile_body=None) -> Generated:
    """The C++ wrapper of ``program`` under ``plan`` (NOTE [C++ wrapper]); ``writers``: step ->
    its kernel's writer (``name``, ``buffers``, ``checks_error``); ``compile_body``: as
    ``_sub_programs`` takes it."""
    lv, kernels, buffers = plan.liveness, program.kernels, program.buffers
    table, lines, python_steps, bodies = _Table(), [], [], []
    size, views = _SizeArgs(), {}
    shapes: list[str] = []  # each result's shape, for its DLPack tensor
    var = {b: f"{b}_" if b.isidentifier() else f"b{i}_" for i, b in enumerate(buffers)}
    entry = [*program.inputs, *program.constants]
    outputs = {lv.storage[b] for b in program.outputs}
    handed = tuple(s for s in dict.fromkeys(lv.storage[b] for b in program.outputs)
                   if s not in entry and s in lv.uses)  # Python allocates these
    args = {b: i for i, b in enumerate(entry)}
    owned = [s for s, (f, _) in lv.span.items() if f >= 0 and s not in plan.slot_of
             and s not in outputs and s not in args]
    head = [f"    char* {var[b]} = (char*)args[{i}];" for b, i in args.items()]
    head += [f"    char* {var[b]} = nullptr;" for b in buffers if b not in args]
    head += [f"    char* pool{j} = nullptr;" for j in range(len(plan.slots))]
    frees: dict = {}  # step -> pointers freed after it
    for s in owned:
        frees.setdefault(lv.span[s][1], []).append(var[s])
    for j, slot in enumerate(plan.slots):
        frees.setdefault(slot.last, []).append(f"pool{j}")
    for i, k in enumerate(kernels):
        lines += [(f"    // {line}",) for line in program.describe(k)]  # listing only
        lines.append(f"    // {i}: " + (f"{writers[i].name}({', '.join(writers[i].buffers)})"
                                         if isinstance(k, Kernel) else extern_text(k)))
        for j, slot in enumerate(plan.slots):
            if slot.first == i:
                lines.append(f"    if (!(pool{j} = alloc({size(slot.nbytes)}))) "
                             "{ rc = -3; goto done; }")
        for b in dict.fromkeys((*k.reads, *k.writes)):
            if lv.uses[b][0] != i or b in args:
                continue
            s = lv.storage[b]
            if b in program.aliases:
                lines.append(f"    {var[b]} = {var[program.aliases[b]]};")
            elif s in plan.slot_of:
                lines.append(f"    {var[b]} = pool{plan.slot_of[s]};")
            elif s in handed:  # a result: Python takes it over (a loop's body: the caller's)
                h, t = handed.index(s), buffers[s].type
                # (a dtype outside _DLPACK goes as bytes, which Python views as its dtype)
                dims, (code, bits) = (t.shape, _DLPACK[t.dtype]) if t.dtype in _DLPACK else \
                    ((lv.nbytes[s],), (1, 8))
                dims = [size(n) for n in dims]
                declared = f"const int64_t shape{h}[] = {{{', '.join(dims)}}};" \
                    if dims else f"const int64_t* const shape{h} = nullptr;"
                symbolic = any(n.startswith("S[") for n in dims)  # (a block: goto skips it)
                if not symbolic:
                    shapes.append("static " + declared)
                lines.append(("    { " + declared if symbolic else "") +
                             f"    if (!({var[b]} = results ? alloc_result("
                             f"{size(lv.nbytes[s])}, &results[{h}], {len(dims)}, shape{h}, "
                             f"{code}, {bits}) : (char*)args[{len(entry) + h}])) "
                             "{ rc = -3; goto done; }" + (" }" if symbolic else ""))
            else:  # a storage of its own
                lines.append(f"    if (!({var[b]} = alloc({size(lv.nbytes[s])}))) "
                             "{ rc = -3; goto done; }")
        lines.append("    {")
        if isinstance(k, Kernel):
            w = writers[i]
            symbols = getattr(w, "symbols", ())  # its size parameters, after the buffers
            sig = ", ".join(["void*"] * len(w.buffers) + ["int64_t"] * len(symbols))
            lines.append(f"    ((void (*)({sig}))table[{table('kernel', w.name)}])"
                         f"({', '.join([var[b] for b in w.buffers] + list(map(size, symbols)))});")
            if w.checks_error:
                lines.append(f"    if ((rc = ((int (*)())table[{table('error', w.name)}])())) "
                             "goto done;")
        elif (params := _native_params(k)) is not None and all(
                buffers[b].type.dtype in _SCALAR_TYPES for b in (*k.inputs, *k.outputs)):
            _native_call(i, k, params, buffers, var, table, lines, size, views)
        elif (runners := _sub_programs(k, buffers, compile_body)) is not None:
            calls = [_Call(f"a{j}", len(bodies) + j, r, table, lines)
                     for j, r in enumerate(runners)]
            bodies += runners
            CONTROL[_prim(k)](k, calls, buffers, var, lines)
        else:
            python_steps.append(i)
            ptrs = ", ".join(var[b] for b in (*k.inputs, *k.outputs)) or "nullptr"
            lines.append(f"    void* ptrs[] = {{{ptrs}}};")
            lines.append(f"    if ((rc = ((int (*)(int64_t, void**))table[{table('python', None)}])"
                         f"({i}, ptrs))) goto done;")
        lines.append("    }")
        for p in frees.get(i, ()):
            lines.append(f"    release({p}); {p} = nullptr;")
    cleanup = [f"    release({p});" for ps in frees.values() for p in ps]
    if handed:
        cleanup.append(f"    if (rc && results) for (int j = 0; j < {len(handed)}; ++j) "
                       "if (results[j]) drop_result(results[j]);")
    text = lambda lines: "\n".join([  # noqa: E731
        "// The C++ wrapper (backends/cpp_wrapper.py, NOTE [C++ wrapper])",
        "#include <cstdint>", "#include <cstring>", "",
        "struct plait_view { void* data; int64_t ndim; const int64_t* sizes; "
        "const int64_t* strides; int64_t dtype; };", "",
        "// Compiled unoptimized: it only calls, and -O3 on one function of a few thousand",
        "// steps takes seconds (a 12-block training step: 12.9 s at -O3, 0.3 s at -O0).",
        "#pragma GCC push_options", '#pragma GCC optimize ("O0")', *shapes,
        'extern "C" int plait_program(void** args, void** table, void** results, '
        'const int64_t* S) {',
        "    int rc = 0;",
        "    auto alloc = (char* (*)(int64_t))table[0];",
        "    auto release = (void (*)(void*))table[1];",
        "    auto alloc_result = (char* (*)(int64_t, void**, int64_t, const int64_t*, int64_t, "
        "int64_t))table[2];",
        "    auto drop_result = (void (*)(void*))table[3];",
        *head, *lines, "done:", *cleanup, "    return rc;", "}", "#pragma GCC pop_options"])
    # provenance (the user's lines) stays out of the compiled source: a program traced from
    # other lines builds the same library
    return Generated(text([x for x in lines if isinstance(x, str)]),
                     text([x if isinstance(x, str) else x[0] for x in lines]),
                     tuple(table.entries), handed, tuple(python_steps), tuple(bodies),
                     len(entry), tuple(size.items), tuple(views.items()))


def _native_call(i: int, k: Extern, params: tuple, buffers, var: dict, table: _Table,
                 lines: list, size: _SizeArgs, views: dict) -> None:
    """An extern through the runtime, on views of its buffers; a symbolic operand's view is
    read from ``S`` (``views``: (step, operand) -> what computes it at a call's sizes)."""
    described = []
    for j, b in enumerate((*k.inputs, *k.outputs)):
        t, operand = buffers[b].type, j if j < len(k.inputs) else None
        shape, strides, offset = _view_of(k, operand, t)
        if is_symbolic((t, k.fn.views[operand] if operand is not None and k.fn.views else ())):
            views[i, j] = (k, operand, t)
            shape, strides = (tuple(("view", i, j, f, d) for d in range(len(shape)))
                              for f in (0, 1))
            offset = ("view", i, j, 2, 0)
        sz = _array(lines, f"sizes{j}", shape, size)
        st = _array(lines, f"strides{j}", strides, size)
        described.append(f"{{{var[b]} + {size(offset)} * {t.dtype.itemsize}, {len(shape)}, "
                         f"{sz}, {st}, {_SCALAR_TYPES[t.dtype]}}}")
    lines.append(f"    const plait_view views[] = {{{', '.join(described)}}};")
    _array(lines, "ints", params[0], size)
    lines.append(f"    static const double floats[] = {{{', '.join(map(repr, params[1])) or 0}}};")
    lines.append(f"    if ((rc = ((int (*)(const plait_view*, const int64_t*, const double*))"
                 f"table[{table('runtime', f'plait_{_prim(k)}')}])(views, ints, floats))) "
                 "goto done;")


# NOTE [native loops]
# A scan, while_loop or cond whose sub-programs all compile to native wrappers (cpp) runs in
# the C++ wrapper: each step (each branch) calls its sub-program's ``plait_program`` on
# pointers, with no Python per step. A loop's carry in and out alternate between two buffers
# of the step's own (the first step reads the initial carry; a scan's last writes the carry
# outputs, a while_loop's final carry is copied there); a scan reads each x and writes each y
# in place at the step's offset of the stacked buffer; loop-invariant operands and the
# sub-program's constants are passed as they are; a while_loop's condition writes its
# predicate into a buffer of the step's, read as its dtype. A sub-program's buffers live inside
# the step (its wrapper allocates and frees them). An output a sub-program returns that is
# not memory of its own (an input returned as it is, an output twice) is copied into place
# after the call. A sub-program whose wrapper is not native, or a control-flow operand that
# is a view other than a reshape, makes the extern a Python step, as before.
class _Call:
    """How the wrapper calls one sub-program (a ``codegen.Runner``) through array ``name`` of
    its arguments: its constants bound once, ``lines`` gain its declaration."""

    def __init__(self, name: str, index: int, runner, table: _Table, lines: list):
        self.name, self.wrapper = name, runner.wrapper
        self.n_in = self.wrapper.n_entry - len(runner.constants)
        self.fn = f"((int (*)(void**, void**, void**, const int64_t*))" \
            f"table[{table('body', index)}])"
        self.table = f"(void**)table[{table('body_table', index)}]"
        lines.append(f"    void* {name}[{self.wrapper.n_entry + len(self.wrapper.handed_types)}];")
        for c in range(len(runner.constants)):
            lines.append(f"    {name}[{self.n_in + c}] = "
                         f"table[{table('body_constant', (index, c))}];")

    def __call__(self, inputs: list[str], targets: list[str], indent: str) -> list[str]:
        """Lines calling it on ``inputs`` (pointer expressions), writing its outputs to
        ``targets``, leaving ``rc`` nonzero where it failed."""
        lines = [f"{indent}{self.name}[{j}] = {x};" for j, x in enumerate(inputs)]
        copies, placed = [], set()
        for target, p, t in zip(targets, self.wrapper.handed_of, self.wrapper.output_types):
            if p is None or not t.nbytes:
                continue
            if p >= self.wrapper.n_entry and p not in placed:  # it writes the output there
                placed.add(p)
                lines.append(f"{indent}{self.name}[{p}] = {target};")
            else:  # an input, a constant or an output again: copied there
                copies.append(f"{indent}if (!rc) std::memcpy({target}, {self.name}[{p}], "
                              f"{t.nbytes});")
        return [*lines, f"{indent}rc = {self.fn}({self.name}, {self.table}, nullptr, nullptr);",
                *copies]


def _carries(outs, buffers, lines: list) -> list[int]:
    """Two buffers of each carry's size (``carry[0][c]``, ``carry[1][c]``); their sizes."""
    sizes = [buffers[b].type.nbytes for b in outs]
    lines.append(f"    char* carry[2][{max(len(sizes), 1)}] = {{}};")
    for c, n in enumerate(sizes):
        lines.append(f"    carry[0][{c}] = alloc({n}); carry[1][{c}] = alloc({n});")
        lines.append(f"    if (!carry[0][{c}] || !carry[1][{c}]) rc = -3;")
    return sizes


def _release_carries(n: int, lines: list) -> None:
    lines.append(f"    for (int c = 0; c < {n}; ++c) {{ release(carry[0][c]); "
                 "release(carry[1][c]); }")
    lines.append("    if (rc) goto done;")


def _scan(k: Extern, calls: list, buffers, var: dict, lines: list) -> None:
    p = dict(k.params)
    nc, nx, length, reverse = p["n_carry"], p["n_xs"], p["length"], p["reverse"]
    ins, outs = k.inputs, k.outputs
    step = [buffers[b].type.nbytes // max(length, 1) for b in (*ins[nc:nc + nx], *outs[nc:])]
    sizes = _carries(outs[:nc], buffers, lines)
    lines.append(f"    for (int64_t n = 0; n < {length} && !rc; ++n) {{")
    lines.append(f"        int64_t t = {f'{length - 1} - n' if reverse else 'n'};")
    inputs = [f"(n ? carry[(n - 1) % 2][{c}] : {var[ins[c]]})" for c in range(nc)] + \
        [f"({var[ins[nc + j]]} + t * {step[j]})" for j in range(nx)] + \
        [var[b] for b in ins[nc + nx:]]
    targets = [f"(n == {length - 1} ? {var[b]} : carry[n % 2][{j}])" if j < nc else
               f"({var[b]} + t * {step[nx + j - nc]})" for j, b in enumerate(outs)]
    lines += calls[0](inputs, targets, "        ")
    lines.append("    }")
    if length == 0:
        for c, b in enumerate(outs[:nc]):
            lines.append(f"    std::memcpy({var[b]}, {var[ins[c]]}, {sizes[c]});")
    _release_carries(nc, lines)


def _while_loop(k: Extern, calls: list, buffers, var: dict, lines: list) -> None:
    nc, ins, outs = dict(k.params)["n_carry"], k.inputs, k.outputs
    cond, body = calls
    pred = cond.wrapper.output_types[0]
    sizes = _carries(outs, buffers, lines)
    lines.append(f"    char* pred = alloc({pred.nbytes});")
    lines.append("    if (!pred) rc = -3;")
    lines.append("    int64_t n = 0;")
    lines.append("    for (; !rc; ++n) {")
    inputs = [f"(n ? carry[(n - 1) % 2][{c}] : {var[ins[c]]})" for c in range(nc)] + \
        [var[b] for b in ins[nc:]]
    lines += cond(inputs, ["pred"], "        ")
    lines.append(f"        if (rc || !*({ctype(pred.dtype)}*)pred) break;")
    lines += body(inputs, [f"carry[n % 2][{c}]" for c in range(nc)], "        ")
    lines.append("    }")
    for c, b in enumerate(outs):
        lines.append(f"    if (!rc) std::memcpy({var[b]}, n ? carry[(n - 1) % 2][{c}] : "
                     f"{var[ins[c]]}, {sizes[c]});")
    lines.append("    release(pred);")
    _release_carries(nc, lines)


def _cond(k: Extern, calls: list, buffers, var: dict, lines: list) -> None:
    pred, args = k.inputs[0], [var[b] for b in k.inputs[1:]]
    targets = [var[b] for b in k.outputs]
    lines.append(f"    if (*({ctype(buffers[pred].type.dtype)}*){var[pred]}) {{")
    lines += calls[0](args, targets, "        ")
    lines.append("    } else {")
    lines += calls[1](args, targets, "        ")
    lines.append("    }")
    lines.append("    if (rc) goto done;")


CONTROL = {"scan": _scan, "while_loop": _while_loop, "cond": _cond}


# ---------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p))
_raised = threading.local()  # a Python step's exception, for the call that made it
_DLTENSOR = b"dltensor"  # a DLPack capsule's name (the capsule keeps a pointer to it)
_capsule = ctypes.pythonapi.PyCapsule_New
_capsule.restype, _capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                         ctypes.c_void_p]
# what torch.from_dlpack calls for a capsule, past checks that cost a third of a result's time
_from_capsule = getattr(torch._C, "_from_dlpack", torch.from_dlpack)


def _at(pointer: int, t) -> torch.Tensor:
    """The tensor of type ``t`` over the memory at ``pointer`` (not owning it)."""
    if not t.nbytes:
        return torch.empty(tuple(t.shape), dtype=t.dtype)
    memory = (ctypes.c_char * t.nbytes).from_address(pointer)
    return torch.frombuffer(memory, dtype=torch.uint8).view(t.dtype).view(tuple(t.shape))


class NativeWrapper:
    """``run(inputs, device, constants) -> outputs`` of a program through its C++ wrapper
    (NOTE [C++ wrapper]); ``fallback``, the Python wrapper, runs calls that check the memory
    plan. It pickles as what it was built from (NOTE [program cache])."""

    def __init__(self, library, entries: tuple, steps: dict, bodies: tuple, layout: tuple,
                 fallback, sizes: tuple = ()):
        self._state = (library, entries, steps, bodies, layout, fallback, sizes)
        # NOTE [symbolic sizes]: what S holds, the views it reads, and S by the call's sizes
        self._size_items, self._views = sizes[0] if sizes else (), dict(sizes[1]) if sizes else {}
        self._bindings = fallback.bindings if sizes else ()  # the inputs' dims -> symbols
        self._size_arrays: dict = {}
        self._steps_at: dict = {}  # (Python step, sizes) -> its extern and types there
        self._calling = threading.local()  # ``values``: the sizes of this thread's call
        self.source = None
        self.fallback, self._steps, self._bodies = fallback, steps, bodies
        self.n_entry, self.handed_types, self._outputs, self._order = layout
        # each output's position in ``args`` (None: allocated by the call) and type
        self.handed_of = [self._outputs[u][0] for u in self._order]
        self.output_types = [TensorType(self._outputs[u][2], self._outputs[u][3])
                             for u in self._order]
        self._callback = _CALLBACK(self._python_step)
        self._entries, self._table, self._off = entries, None, False
        memory()  # built with the kernels; a failure here turns the wrapper off at once
        self._run = library.cdll.plait_program
        self._run.argtypes = [ctypes.c_void_p] * 4
        self._run.restype = ctypes.c_int

    def _ready(self) -> bool:
        """Are its table and its sub-programs' resolved? Not while the runtime it needs is
        still building; never where that build failed (one warning)."""
        if self._table is not None:
            return True
        if self._off:
            return False
        if any(kind == "runtime" and what not in _RESERVED for kind, what in self._entries):
            future = runtime_future()
            if not future.done():
                return False
            if future.exception() is not None:
                self._off = True
                warn_off(future.exception())
                return False
        if not all(body.wrapper._ready() for body in self._bodies):
            return False
        self._table = (ctypes.c_void_p * max(1, len(self._entries)))(
            *[self._resolve(kind, what) for kind, what in self._entries])
        return True

    def _resolve(self, kind: str, what) -> int:
        """The address a table entry holds."""
        if kind in ("kernel", "error"):
            return ctypes.cast(getattr(what[0].cdll, what[1]), ctypes.c_void_p).value
        if kind == "runtime":
            library = memory() if what in _RESERVED else runtime()
            return ctypes.cast(getattr(library.cdll, what), ctypes.c_void_p).value
        if kind == "python":
            return ctypes.cast(self._callback, ctypes.c_void_p).value
        if kind == "body_constant":
            return self._bodies[what[0]].constants[what[1]][1].data_ptr()
        wrapper = self._bodies[what].wrapper
        return ctypes.cast(wrapper._run, ctypes.c_void_p).value if kind == "body" else \
            ctypes.addressof(wrapper._table)

    @classmethod
    def of(cls, program, plan, generated: Generated, library_of: dict,
           fallback) -> "NativeWrapper":
        """The wrapper ``generated`` for ``program`` under ``plan``, built into
        ``library_of["plait_program"]`` with its kernels' libraries (``library_of``: kernel
        name -> Library)."""
        entries = []
        for kind, what in generated.entries:
            if kind == "kernel":
                what = (library_of[what], what)
            elif kind == "error":
                what = (library_of[what], "plait_take_error")
            entries.append((kind, what))
        buffers, storage = program.buffers, plan.liveness.storage
        steps = {i: (program.kernels[i], tuple(buffers[b].type for b in program.kernels[i].inputs),
                     tuple(buffers[b].type for b in program.kernels[i].outputs))
                 for i in generated.python_steps}
        entry = [*program.inputs, *program.constants]
        position = {b: j for j, b in enumerate([*entry, *generated.handed])}
        unique = list(dict.fromkeys(program.outputs))
        # an output on a storage of its own shape is that tensor itself, not a view of it
        outputs = tuple((position.get(storage[b]),
                         buffers[b].type.shape == buffers[storage[b]].type.shape,
                         tuple(buffers[b].type.shape), buffers[b].type.dtype) for b in unique)
        handed = tuple((tuple(buffers[s].type.shape), buffers[s].type.dtype)
                       for s in generated.handed)
        layout = (generated.n_entry, handed, outputs,
                  tuple(unique.index(b) for b in program.outputs))
        symbolic = any(is_symbolic(b.type) for b in buffers.values())
        wrapper = cls(library_of["plait_program"], tuple(entries), steps, generated.bodies,
                      layout, fallback, (generated.sizes, generated.views) if symbolic else ())
        wrapper.source = generated.listing  # for reading; not pickled
        return wrapper

    def __reduce__(self):
        return NativeWrapper, self._state

    @property
    def loopable(self) -> bool:
        """Does every output of some bytes come from memory the caller passes (NOTE [native
        loops])?"""
        return all(j is not None or not t.nbytes
                   for j, t in zip(self.handed_of, self.output_types))

    @property
    def slot(self) -> dict:
        return self.fallback.slot

    @property
    def measured_peak_bytes(self):
        return self.fallback.measured_peak_bytes

    def _python_step(self, step: int, pointers) -> int:
        """A Python step: the extern on tensors over its buffers, its results copied into its
        outputs. An exception is kept for the caller (ctypes would only print it)."""
        try:
            values = getattr(self._calling, "values", None)
            k, in_types, out_types = self._steps[step] if values is None else \
                self._step_at(step, values)
            args = [_at(pointers[j], t) for j, t in enumerate(in_types)]
            results = extern_results(k, args, out_types)
            for j, (t, r) in enumerate(zip(out_types, results)):
                if t.nbytes:
                    _at(pointers[len(in_types) + j], t).copy_(r)
            return 0
        except BaseException as e:  # noqa: BLE001 - raised again by the call
            _raised.error = e
            return -2

    def __call__(self, inputs: Sequence[torch.Tensor], device: torch.device,
                 constants: Sequence[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        if config.check_memory_plan or not self._ready():
            return self.fallback(inputs, device, constants)
        tensors = [*map(torch.Tensor.contiguous, inputs), *(t for _, t in constants)]
        # NOTE [entry checks]
        addresses = entry_pointers(tensors[:len(inputs)], self.fallback.n_inputs,
                                   self.fallback.unread) + \
            [t.data_ptr() for _, t in constants]
        pointers = (ctypes.c_void_p * max(1, len(tensors)))(*addresses)
        results = (ctypes.c_void_p * max(1, len(self.handed_types)))()
        if self._bindings:  # NOTE [symbolic sizes]: S, and the types at these sizes
            values = size_values(self._bindings, inputs)
            self._calling.values = values
            sized, handed, outputs = self._size_array(values)
            try:
                rc = self._run(pointers, self._table, results, sized)
            finally:
                self._calling.values = None
        else:
            rc = self._run(pointers, self._table, results, None)
            handed, outputs = self.handed_types, self._outputs
        if rc:
            _fail(rc)
        for (shape, dtype), handle in zip(handed, results):
            data = _from_capsule(_capsule(handle, _DLTENSOR, None))
            tensors.append(data if dtype in _DLPACK else data.view(dtype).view(shape))
        unique = [torch.empty(shape, dtype=dtype) if j is None else
                  tensors[j] if same else tensors[j].view(shape)
                  for j, same, shape, dtype in outputs]
        return [unique[u] for u in self._order]

    def _step_at(self, step: int, values: dict) -> tuple:
        """Python step ``step``'s extern and types at a call's sizes (NOTE [symbolic
        sizes]): evaluated once per distinct sizes, those of SIZE_ARRAYS sizes kept."""
        key = step, tuple(values.values())
        found = self._steps_at.get(key)
        if found is None:
            k, in_types, out_types = self._steps[step]
            found = (extern_at(k, values), *([TensorType(concrete(t.shape, values), t.dtype,
                                                         t.device) for t in ts]
                                             for ts in (in_types, out_types)))
            if len(self._steps_at) >= SIZE_ARRAYS * len(self._steps):
                self._steps_at.clear()
            self._steps_at[key] = found
        return found

    def _size_array(self, values: dict) -> tuple:
        """``S`` at a call's sizes (NOTE [symbolic sizes]), and the types of the results
        there (handed over, and output): evaluated once per distinct sizes, the last
        SIZE_ARRAYS kept."""
        key = tuple(values.values())
        found = self._size_arrays.get(key)
        if found is None:
            views: dict = {}

            def value(item) -> int:
                if not isinstance(item, tuple):
                    return concrete(item, values)
                _, i, j, field, d = item
                if (i, j) not in views:
                    views[i, j] = _view_of(*self._views[i, j], values)
                return views[i, j][field] if field == 2 else views[i, j][field][d]

            found = ((ctypes.c_int64 * max(1, len(self._size_items)))(
                *map(value, self._size_items)),
                *concrete((self.handed_types, self._outputs), values))
            if len(self._size_arrays) >= SIZE_ARRAYS:
                self._size_arrays.clear()
            self._size_arrays[key] = found
        return found


def _fail(rc: int):
    if rc == -1:
        raise BackendError("an ATen operator called by the C++ wrapper failed: " +
                           runtime().cdll.plait_runtime_error().decode())
    if rc == -2:
        raised, _raised.error = _raised.error, None
        raise raised
    if rc == -3:
        raise MemoryError("the C++ wrapper could not allocate a buffer")
    raise kernel_error(rc)
