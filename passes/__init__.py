"""Pure graph -> graph passes, each registered by name in ``PASSES``."""
from .simplify import PASSES, algebra, cse, dce, fold_constants, rewrite, simplify

__all__ = ["PASSES", "algebra", "cse", "dce", "fold_constants", "rewrite", "simplify"]
