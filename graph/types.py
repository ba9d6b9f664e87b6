"""The tiny value types every stage shares: tensor types, values, node payloads."""
from __future__ import annotations

import hashlib
import math
from typing import Any

import attrs
import torch

_DTYPE_NAMES = {
    torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPE_NAMES[getattr(torch, _name)] = _name.replace("float", "f").replace("uint", "u")


# the kinds of a graph's edges: a value flows, or a node must run after another
DATA, CONTROL = "data", "control"


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def normalize_device(device) -> str:
    """'cuda' and 'cuda:0' name one device; types must compare equal for both."""
    d = torch.device(device)
    if d.index is None and d.type == "cuda" and torch.cuda.is_available():
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def contiguous_strides(shape) -> tuple[int, ...]:
    """Row-major element strides of ``shape`` (the layout of every graph value)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


@attrs.frozen
class TensorType:
    """Static type of a traced tensor: shape, dtype and device (always dense and contiguous)."""

    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(d) for d in s))
    dtype: torch.dtype
    device: str = attrs.field(default="cpu", converter=lambda d: normalize_device(d))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{dtype_name(self.dtype)}[{','.join(map(str, self.shape))}]"

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorType":
        return cls(tuple(tensor.shape), tensor.dtype, str(tensor.device))


@attrs.frozen
class Value:
    """One output of one node: the thing an operand refers to."""

    node: int
    index: int = 0


@attrs.frozen
class Provenance:
    """Where a node came from: the ATen op the user's code called, and the user's source line."""

    aten: str | None = None
    source: str | None = None


class Constant:
    """A tensor baked into a graph (one made while tracing, or a folded result).

    Equality and hashing go by content, so equal constants hash equally across processes.
    """

    __slots__ = ("tensor", "_digest")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor.detach()
        self._digest: str | None = None

    @property
    def digest(self) -> str:
        if self._digest is None:
            t = self.tensor
            h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}{t.device}".encode())
            if t.numel():  # a fresh dense copy: views and 1-element tensors have odd strides
                flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1).cpu())
                h.update(flat.view(torch.uint8).numpy().tobytes())
            self._digest = h.hexdigest()
        return self._digest

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Constant) and self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        t = self.tensor
        if t.numel() <= 6:
            return f"const({t.tolist()})"
        return f"const<{self.digest[:8]}>"


@attrs.frozen
class Node:
    """Payload of one graph node: a primitive applied with static params.

    ``params`` is a tuple of (name, value) pairs sorted by name, so nodes are hashable and
    print the same everywhere.
    """

    prim: str
    params: tuple[tuple[str, Any], ...]
    out_types: tuple[TensorType, ...]
    provenance: Provenance = Provenance()

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)

    @staticmethod
    def make_params(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
        return tuple(sorted((k, _freeze(v)) for k, v in params.items()))


def _freeze(value: Any) -> Any:
    """Make a param value hashable: lists become tuples, tensors become Constants."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, torch.Tensor):
        return Constant(value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value
