"""Shared test fixtures: a small fp32 model, and the `gpu` marker (skipped without CUDA).

Without CUDA, Triton kernels run in its interpreter; the switch must be set before any module imports triton.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from layerflow.model import HSTUConfig, HSTUWeights


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def small_config() -> HSTUConfig:
    return HSTUConfig(num_layers=2, num_heads=2, dqk=16, dv=16, embedding_dim=32, max_seq_len=512,
                      dtype=torch.float32, item_vocab_size=1000, position_table_size=512)


@pytest.fixture(scope="session")
def small_weights(small_config) -> HSTUWeights:
    return HSTUWeights.init(small_config, seed=0)
