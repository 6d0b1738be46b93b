"""The pipeline's launch options on the CPU: early launch and the attention's history cap, from the constructor or the
environment, each bad value named."""

import pytest

from layerflow.model import HSTUConfig, HSTUWeights
from layerflow.runtime.pipeline import MIN_TILES_ENV, PDL_ENV, TritonKernels

CONFIG = HSTUConfig(num_layers=1, num_heads=2, dqk=16, dv=16, embedding_dim=32, max_seq_len=64, item_vocab_size=10,
                    position_table_size=64)


def kernels(**options) -> TritonKernels:
    return TritonKernels(HSTUWeights.init(CONFIG, seed=0), page_size=16, max_pages=4, **options)


def test_defaults_are_main_s_launches(monkeypatch):
    monkeypatch.delenv(PDL_ENV, raising=False)
    monkeypatch.delenv(MIN_TILES_ENV, raising=False)
    k = kernels()
    assert (k.pdl, k.split_min_tiles) == (False, 0)


def test_the_environment_and_the_constructor_choose(monkeypatch):
    monkeypatch.setenv(PDL_ENV, "on")
    monkeypatch.setenv(MIN_TILES_ENV, "4")
    assert (kernels().pdl, kernels().split_min_tiles) == (True, 4)
    assert (kernels(pdl="off", split_min_tiles=0).pdl, kernels(split_min_tiles=2).split_min_tiles) == (False, 2)


def test_bad_values_are_named(monkeypatch):
    with pytest.raises(ValueError, match="pdl='yes'"):
        kernels(pdl="yes")
    monkeypatch.setenv(MIN_TILES_ENV, "four")
    with pytest.raises(ValueError, match="LAYERFLOW_SPLIT_MIN_TILES='four'"):
        kernels()
