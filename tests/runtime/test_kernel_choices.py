"""TritonKernels' selectable paths: the SiLU's place and the split workspace, by argument or environment."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from layerflow.model import HSTUConfig, HSTUWeights  # noqa: E402
from layerflow.runtime.buffers import Bucket  # noqa: E402
from layerflow.runtime.pipeline import SILU_ENV, WORKSPACE_ENV, TritonKernels  # noqa: E402


def test_defaults_are_the_measured_paths(small_config, monkeypatch):
    monkeypatch.delenv(SILU_ENV, raising=False)
    monkeypatch.delenv(WORKSPACE_ENV, raising=False)
    kernels = TritonKernels(HSTUWeights.init(small_config, seed=0), page_size=16, max_pages=4)
    assert kernels.silu_in_append and kernels.shared_workspace


def test_environment_and_arguments_choose(small_config, monkeypatch):
    weights = HSTUWeights.init(small_config, seed=0)
    monkeypatch.setenv(SILU_ENV, "separate")
    monkeypatch.setenv(WORKSPACE_ENV, "bucket")
    kernels = TritonKernels(weights, page_size=16, max_pages=4)
    assert not kernels.silu_in_append and not kernels.shared_workspace
    kernels = TritonKernels(weights, page_size=16, max_pages=4, silu="append", split_workspace="shared")
    assert kernels.silu_in_append and kernels.shared_workspace


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


def _attention_config() -> HSTUConfig:
    return HSTUConfig(num_layers=1, num_heads=2, dqk=64, dv=64, embedding_dim=128, max_seq_len=512,
                      dtype=torch.float32, item_vocab_size=100, position_table_size=512)


def test_reserve_builds_every_bucket_over_one_buffer_of_the_largest_need():
    kernels = TritonKernels(HSTUWeights.init(_attention_config(), seed=0), page_size=16, max_pages=32,
                            split_workspace="shared")
    # (1, 16) and (1, 32) split in two on the interpreter's 4 SMs; built in that order a growing buffer is replaced
    kernels.reserve([Bucket(1, 32), Bucket(1, 16), Bucket(2, 64)], torch.device("cpu"))
    partials = [a.partials for a in kernels._attention.values() if a.partials is not None]
    assert len(kernels._attention) == 3 and len(partials) == 2
    assert len({p.untyped_storage().data_ptr() for p in partials}) == 1
    assert kernels.workspace.nbytes == max(p.nbytes for p in partials)
    with pytest.raises(RuntimeError, match="reserve after 3 attentions"):
        kernels.reserve([Bucket(1, 64)], torch.device("cpu"))


def test_reserve_leaves_per_bucket_workspaces_lazy():
    kernels = TritonKernels(HSTUWeights.init(_attention_config(), seed=0), page_size=16, max_pages=32,
                            split_workspace="bucket")
    kernels.reserve([Bucket(1, 64), Bucket(4, 256)], torch.device("cpu"))
    assert not kernels._attention and kernels.workspace is None
