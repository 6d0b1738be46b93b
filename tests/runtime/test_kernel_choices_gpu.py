"""The engine on the H200 with the SiLU inside the KV append and with one split workspace for every bucket: the same
scores bit for bit as the default kernels, GPU hit and CPU hit, bf16 and fp8 pages, graphs captured in any order."""

import pytest
import torch

from layerflow.runtime.graphs import GraphRunner
from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.pipeline import SILU_ENV, WORKSPACE_ENV
from layerflow.runtime.request import Request
from tests.runtime.test_engine_gpu import HISTORY, _engine, _requests, _serve, bf16_weights, gpu_hit  # noqa: F401

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tier, graph", [(Tier.GPU, True), (Tier.HOST, False)])
def test_silu_in_the_append_scores_bitwise_like_the_silu_kernel(bf16_weights, gpu_hit, monkeypatch, tier, graph):
    monkeypatch.setenv(SILU_ENV, "append")
    for a, b in zip(_serve(bf16_weights, tier, graph=graph), gpu_hit):
        assert torch.equal(a, b)


def test_silu_in_the_append_over_fp8_pages(bf16_weights, monkeypatch):
    separate = _serve(bf16_weights, Tier.HOST, kv_cache_dtype="fp8_e4m3")
    monkeypatch.setenv(SILU_ENV, "append")
    for a, b in zip(_serve(bf16_weights, Tier.HOST, kv_cache_dtype="fp8_e4m3"), separate):
        assert torch.equal(a, b)


@pytest.mark.parametrize("order", [1, -1])
def test_one_shared_split_workspace_in_either_capture_order(bf16_weights, gpu_hit, monkeypatch, order):
    """Every bucket's graphs captured smallest first or largest first, then one visit served from them."""
    monkeypatch.setenv(WORKSPACE_ENV, "shared")
    with _engine(bf16_weights, graph=False) as engine:
        engine.graphs = GraphRunner(engine.pipeline, engine.device)
        for bucket in engine.buckets[::order]:
            for wait in (engine.no_wait, engine.layer_wait):
                engine.graphs.capture(engine._bufs(bucket), wait)
        gen = torch.Generator().manual_seed(0)
        engine.score([Request(u, torch.randint(0, 5000, (n,), generator=gen).tolist(), [])
                      for u, n in HISTORY.items() if n])
        got = [s.clone() for s in engine.score(_requests(1))]
        partials = [a.partials for a in engine.pipeline.kernels._attention.values() if a.partials is not None]
        buffers = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in partials}
        assert len(partials) > 1 and sum(buffers.values()) <= 4 * max(p.nbytes for p in partials)
    for a, b in zip(got, gpu_hit):
        assert torch.equal(a, b)
