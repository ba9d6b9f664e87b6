"""The immutable primitive graph: types, builder, printer."""
from .graph import CONTROL, DATA, Graph, GraphBuilder, extract, input_marks, rewrite
from .types import Constant, Node, Provenance, TensorType, Value, dtype_name

__all__ = ["CONTROL", "DATA", "Constant", "Graph", "GraphBuilder", "Node", "Provenance",
           "TensorType", "Value", "dtype_name", "extract", "input_marks",
           "rewrite"]
