"""Shared fixtures and helpers of plait's unit tests."""
from __future__ import annotations

import attrs
import pytest
import torch

import plait


@pytest.fixture(autouse=True)
def _seed_and_clean_config():
    """Every test starts from a fixed RNG seed and leaves plait.config as it found it."""
    torch.manual_seed(0)
    saved = {f.name: getattr(plait.config, f.name) for f in attrs.fields(type(plait.config))}
    yield
    for name, value in saved.items():
        setattr(plait.config, name, value)
