"""Shared fixtures and helpers of plait's unit tests."""
from __future__ import annotations

import os

import attrs
import pytest
import torch

import plait

# The tests use CPU tensors: the triton backend runs its kernels in Triton's interpreter
# (read when a kernel launches). On a machine with a GPU, leave it to the caller.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed_and_clean_config():
    """Every test starts from a fixed RNG seed and leaves plait.config as it found it."""
    torch.manual_seed(0)
    saved = {f.name: getattr(plait.config, f.name) for f in attrs.fields(type(plait.config))}
    yield
    for name, value in saved.items():
        setattr(plait.config, name, value)
