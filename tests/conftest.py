"""Shared fixtures and helpers of plait's unit tests."""
from __future__ import annotations

import os

import attrs
import pytest
import torch

import plait

# The tests use CPU tensors: the triton backend runs their kernels in Triton's interpreter
# (read when a program is compiled and when a kernel launches), on a machine with a GPU too.
# The tests marked ``cuda`` run CUDA tensors through compiled kernels (skipped without a GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        for item in items:
            if item.get_closest_marker("cuda"):
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(autouse=True)
def _compiled_kernels_on_cuda(request, monkeypatch):
    if request.node.get_closest_marker("cuda"):
        monkeypatch.setenv("TRITON_INTERPRET", "0")

# A test that does not name a backend runs on the reference (eager) one: the compilers are
# tested where a test names them (backend="cpp" / "triton" / "loops"), and the default
# ("auto": cpp on the CPU) by test_jit.py::test_the_default_backend_follows_the_device.
plait.config.backend = "eager"


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """Compiled code goes to a cache of the test session's own (equal programs across tests
    are built once), never to the user's."""
    with plait.config.patch(cache_dir=str(tmp_path_factory.mktemp("plait-cache"))):
        yield


@pytest.fixture(autouse=True)
def _seed_and_clean_config():
    """Every test starts from a fixed RNG seed and leaves plait.config as it found it."""
    torch.manual_seed(0)
    saved = {f.name: getattr(plait.config, f.name) for f in attrs.fields(type(plait.config))}
    yield
    for name, value in saved.items():
        setattr(plait.config, name, value)
