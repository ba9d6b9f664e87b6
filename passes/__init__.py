"""Pure graph -> graph passes, each registered by name in ``PASSES``."""
from .simplify import PASSES, cse, dce, fold_constants, rewrite, simplify

__all__ = ["PASSES", "cse", "dce", "fold_constants", "rewrite", "simplify"]
