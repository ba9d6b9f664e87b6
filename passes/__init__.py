"""Pure graph -> graph passes (simplification, attention fusion, layout, differentiation) and
loop-program passes (lowering, indexing, fusion, split reductions, memory). The driver
(compiler/pipeline.py) runs them in order."""
from .attention import fuse_attention
from .layout import channels_last
from .padding import pad_products
from .simplify import (algebra, cse, dce, erase_markers, fold_constants, rewrite,
                       unread_input_grads, unread_ys)

__all__ = ["algebra", "channels_last", "cse", "dce", "erase_markers", "fold_constants",
           "fuse_attention", "pad_products", "rewrite", "unread_input_grads", "unread_ys"]
