"""Python function -> primitive graph: tracer tensors, primitives, ATen handlers."""
from .function import Static, TracedFunction, trace_function
from .registry import PRIMITIVES, Primitive, get_primitive
from .trace import Trace, TracerTensor, bind, current_trace

__all__ = ["PRIMITIVES", "Primitive", "Static", "Trace", "TracedFunction", "TracerTensor",
           "bind", "current_trace", "get_primitive", "trace_function"]
