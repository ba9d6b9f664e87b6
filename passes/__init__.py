"""Pure graph -> graph passes, each registered by name in ``PASSES``."""
from .attention import fuse_attention
from .layout import channels_last
from .simplify import (PASSES, algebra, cse, dce, erase_markers, fold_constants, rewrite,
                       simplify, unread_input_grads, unread_ys)

__all__ = ["PASSES", "algebra", "channels_last", "cse", "dce", "erase_markers",
           "fold_constants", "fuse_attention", "rewrite", "simplify", "unread_input_grads",
           "unread_ys"]
