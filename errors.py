"""Every error plait raises at a user: one class per kind of problem, each message says the fix."""
import torch


class PlaitError(Exception):
    """Base class of every user-facing plait error."""


class ConcretizationError(PlaitError):
    """A traced value was needed as a concrete Python value (bool(), .item(), a Python branch)."""


class UnsupportedOpError(PlaitError, NotImplementedError):
    """An operator plait cannot trace (data-dependent output shape, no shape rule, ...). A
    NotImplementedError, as torch's error for an op a backend lacks is."""


class UnsupportedDtypeError(PlaitError):
    """A dtype or tensor layout plait does not handle (sparse, quantized)."""


class OpError(PlaitError, RuntimeError):
    """An operator failed while tracing: its arguments are invalid, or plait mishandles it."""


class ShapeError(OpError):
    """An operator got operands whose shapes (or dtypes) do not fit together."""


class TraceError(PlaitError):
    """The traced function or its arguments break a rule of tracing (unhashable static, ...)."""


class TransformError(TraceError, RuntimeError, ValueError):
    """A transform's arguments, or the transformed function's results, break the transform's
    contract (argnums, has_aux, primals, tangents, cotangents, chunk_size). With torch.func's
    wording, and a RuntimeError or ValueError as torch.func's errors are, so code catching
    those keeps working."""


class GraphError(PlaitError):
    """A graph is malformed: a cycle, a dangling operand, inconsistent types."""


class CheckError(PlaitError, RuntimeError):
    """A run-time check failed where eager PyTorch raises too (e.g. a non-finite range).
    It is a RuntimeError, as eager's error is, so code catching that keeps working."""


class LinAlgError(CheckError, torch.linalg.LinAlgError):
    """A singular or non-positive-definite matrix, where eager raises torch's LinAlgError."""


class DebugError(PlaitError, ValueError):
    """A drawing or debug request failed: an unknown stage or engine, an unwritable debug
    folder, Graphviz's dot failing."""


class BackendError(PlaitError):
    """A backend is unknown, unavailable, or failed to run a graph."""


class DistributedError(PlaitError, ValueError):
    """A collective cannot run as asked: no process group, an unknown group or reduce op, a
    size the group does not divide, an in-place collective on a traced tensor; or a trace
    reached a torch.distributed wrapper or a DTensor (NOTE [distributed wrappers])."""
