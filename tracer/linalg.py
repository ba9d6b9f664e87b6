"""Linear algebra: a few library-call primitives (as jax.lax.linalg) and the ATen linalg ops
composed from them."""
