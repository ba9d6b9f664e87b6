"""Neural-network ops: convolution as a primitive, and pooling, normalization and friends
composed from primitives."""
