"""plait: a JAX-style functional tracing compiler for PyTorch tensors."""
from . import backends, distributed, errors
from .api import (Jitted, JittedModule, Lowered, control_dependency, jit, make_graph,
                  mark_dynamic)
from .config import config
from .control import checkpoint, checkpoint_policies, cond, fori_loop, scan, while_loop
from .errors import PlaitError
from .graph import Graph
from .rules import custom_jvp, custom_vjp
from .transforms import (grad, grad_and_value, hessian, jacfwd, jacrev, jvp, linearize, vjp,
                         vmap)

__version__ = "0.1.0"
__all__ = ["Graph", "Jitted", "JittedModule", "Lowered", "PlaitError", "backends",
           "checkpoint", "checkpoint_policies", "cond", "config", "control_dependency",
           "custom_jvp", "custom_vjp", "distributed", "errors", "fori_loop", "grad",
           "grad_and_value", "hessian", "jacfwd", "jacrev", "jit", "jvp", "linearize",
           "make_graph", "mark_dynamic", "scan", "vjp", "vmap", "while_loop"]
