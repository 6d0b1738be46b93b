"""The staging-copy choice of the bucket buffers: names checked, the environment's default, the CPU path unchanged."""

import pytest
import torch

from layerflow.config import Config
from layerflow.runtime.buffers import STAGING_ENV, staging_copy
from layerflow.runtime.engine import Engine
from layerflow.runtime.request import Request


def test_an_unknown_staging_copy_is_refused_by_name(monkeypatch):
    monkeypatch.delenv(STAGING_ENV, raising=False)
    with pytest.raises(ValueError, match="'memcpy'"):
        staging_copy("memcpy")
    monkeypatch.setenv(STAGING_ENV, "fast")
    with pytest.raises(ValueError, match="'fast'.*LAYERFLOW_STAGING_COPY"):
        staging_copy()


def test_the_argument_wins_over_the_environment_and_torch_is_the_default(monkeypatch):
    monkeypatch.delenv(STAGING_ENV, raising=False)
    assert staging_copy() == "torch"
    monkeypatch.setenv(STAGING_ENV, "cudart")
    assert staging_copy() == "cudart"
    assert staging_copy("torch") == "torch"


def test_the_cpu_path_scores_alike_under_either_choice(small_weights):
    """Without CUDA "cudart" falls back to torch's copies: the same scores, bit for bit."""
    scores = []
    for staging in ("torch", "cudart"):
        with Engine(small_weights, Config(cpu_cache_gb=0.01, gpu_cache_gb=0.01), device="cpu",
                    batch_buckets=(2,), token_buckets=(64,), staging=staging) as engine:
            assert engine.staging == staging
            engine.score([Request(1, list(range(40)), []), Request(2, list(range(9)), [])])
            scores.append(engine.score([Request(1, [3, 4], [5, 6, 7]), Request(2, [8], [9])]))
    for a, b in zip(*scores):
        assert torch.equal(a, b)
