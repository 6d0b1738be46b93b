"""The offload issue choice of the CUDA copy engine: per layer (the default) or every layer's pages in one batched
call. Names and addresses are checked on any machine; on the H200 an engine offloading that way reads its host copies
back into the same scores (the byte-exact copy test of every placement takes both choices: test_copy_engine.py)."""

import pytest
import torch

from layerflow.transfer.cuda_copy import OFFLOAD_ENV, offload_copy
from tests.faults import FaultyCudaCopyEngine
from tests.transfer.pages import make_tensors


def test_an_unknown_offload_copy_is_refused_by_name(monkeypatch):
    monkeypatch.delenv(OFFLOAD_ENV, raising=False)
    assert offload_copy() == "layers" and offload_copy("batch") == "batch"
    with pytest.raises(ValueError, match="'pages'"):
        offload_copy("pages")
    monkeypatch.setenv(OFFLOAD_ENV, "all")
    with pytest.raises(ValueError, match="'all'.*LAYERFLOW_OFFLOAD_COPY"):
        offload_copy()
    monkeypatch.setenv(OFFLOAD_ENV, "batch")
    assert offload_copy() == "batch" and offload_copy("layers") == "layers"


def test_the_batched_offload_addresses_every_page_of_every_layer():
    from layerflow.transfer.copy_engine import make_job
    from layerflow.transfer.cuda_copy import _page_addresses

    gpu, host = make_tensors()
    pages, blocks = [7, 8, 2, 23], [1, 2, 9, 0]
    gpu_at, host_at = _page_addresses(make_job(tuple(gpu), host, pages, blocks, None, 0, unique_gpu=False))
    assert gpu_at.shape == host_at.shape == (len(gpu), len(pages)) and gpu_at.flags.c_contiguous
    for layer in range(len(gpu)):
        assert gpu_at[layer].tolist() == [gpu[layer][p].data_ptr() for p in pages]
        assert host_at[layer].tolist() == [host[b, layer].data_ptr() for b in blocks]


@pytest.mark.gpu
def test_an_engine_wrapping_the_per_layer_seam_keeps_per_layer_offloads(monkeypatch):
    monkeypatch.setenv(OFFLOAD_ENV, "batch")
    engine = FaultyCudaCopyEngine(fail_at_layer=1)
    try:
        gpu, host = make_tensors("cuda")
        with pytest.raises(Exception, match="injected failure at layer 1"):
            engine.offload(gpu, host, [0, 1], [5, 6]).wait(5)
    finally:
        engine.close()


@pytest.mark.gpu
def test_host_copies_written_by_batched_offloads_score_like_per_layer_ones(monkeypatch):
    from dataclasses import replace

    from layerflow.config import Config
    from layerflow.model import HSTUWeights
    from layerflow.model.config import PRESETS
    from layerflow.runtime.engine import Engine
    from layerflow.runtime.request import Request

    weights = HSTUWeights.init(replace(PRESETS["hstu-bench"], num_layers=2), seed=0)
    scores = []
    for choice in ("layers", "batch"):
        monkeypatch.setenv(OFFLOAD_ENV, choice)
        gen = torch.Generator().manual_seed(0)
        with Engine(weights, Config(cpu_cache_gb=0.2, gpu_cache_gb=0.2, page_size=32), batch_buckets=(2,),
                    token_buckets=(256,)) as engine:
            engine.warmup()
            engine.score([Request(u, torch.randint(0, 50_000, (n,), generator=gen).tolist(), [])
                          for u, n in ((1, 700), (2, 45))])
            engine.score([Request(u, torch.randint(0, 50_000, (40,), generator=gen).tolist(), [])
                          for u in (1, 2)])   # GPU hits: their new pages reach the host by offload
            for u in (1, 2):
                engine.kv.evict_from_gpu(u)
            scores.append(engine.score([Request(u, [7, 8], torch.randint(0, 50_000, (30,), generator=gen).tolist())
                                        for u in (1, 2)]))
    assert all(torch.equal(a, b) for a, b in zip(*scores))
