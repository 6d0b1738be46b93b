"""TritonKernels' selectable paths: the SiLU's place and the split workspace, by argument or environment."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from layerflow.model import HSTUWeights  # noqa: E402
from layerflow.runtime.pipeline import SILU_ENV, WORKSPACE_ENV, TritonKernels  # noqa: E402


def test_defaults_are_the_measured_paths(small_config, monkeypatch):
    monkeypatch.delenv(SILU_ENV, raising=False)
    monkeypatch.delenv(WORKSPACE_ENV, raising=False)
    kernels = TritonKernels(HSTUWeights.init(small_config, seed=0), page_size=16, max_pages=4)
    assert not kernels.silu_in_append and not kernels.shared_workspace


def test_environment_and_arguments_choose(small_config, monkeypatch):
    weights = HSTUWeights.init(small_config, seed=0)
    monkeypatch.setenv(SILU_ENV, "append")
    monkeypatch.setenv(WORKSPACE_ENV, "shared")
    kernels = TritonKernels(weights, page_size=16, max_pages=4)
    assert kernels.silu_in_append and kernels.shared_workspace
    kernels = TritonKernels(weights, page_size=16, max_pages=4, silu="separate", split_workspace="bucket")
    assert not kernels.silu_in_append and not kernels.shared_workspace


def test_project_leaves_the_activation_to_the_append(small_config):
    weights = HSTUWeights.init(small_config, seed=0)
    layer = weights.layers[0]
    normed = torch.randn(5, small_config.embedding_dim)
    raw = torch.addmm(layer.uvqk_bias, normed, layer.uvqk_weight)
    u, v, q, k = TritonKernels(weights, 16, 4, silu="append").project(layer, normed)
    assert torch.equal(torch.cat([u, v.flatten(1), q.flatten(1), k.flatten(1)], dim=1), raw)
    u, _, _, _ = TritonKernels(weights, 16, 4, silu="separate").project(layer, normed)
    assert torch.equal(u, torch.nn.functional.silu(raw[:, :u.shape[1]]))


@pytest.mark.parametrize("env, value, name", [(SILU_ENV, "fused", "silu"), (WORKSPACE_ENV, "one", "split_workspace")])
def test_an_unknown_choice_is_named(small_config, monkeypatch, env, value, name):
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=f"{name}='{value}'"):
        TritonKernels(HSTUWeights.init(small_config, seed=0), page_size=16, max_pages=4)
