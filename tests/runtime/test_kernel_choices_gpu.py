"""The engine on the H200 with the other side of each kernel choice: the SiLU as its own kernel (the default applies
it inside the KV append) gives the same scores bit for bit, GPU hit and CPU hit, bf16 and fp8 pages; the one split
workspace every bucket shares (the default) serves graphs captured in any order."""

import pytest
import torch

from layerflow.runtime.graphs import GraphRunner
from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.pipeline import SILU_ENV, WORKSPACE_ENV
from layerflow.runtime.request import Request
from tests.runtime.test_engine_gpu import HISTORY, _engine, _requests, _serve, bf16_weights, gpu_hit  # noqa: F401

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tier, graph", [(Tier.GPU, True), (Tier.HOST, False)])
def test_the_silu_kernel_scores_bitwise_like_the_silu_in_the_append(bf16_weights, gpu_hit, monkeypatch, tier, graph):
    monkeypatch.setenv(SILU_ENV, "separate")
    for a, b in zip(_serve(bf16_weights, tier, graph=graph), gpu_hit):
        assert torch.equal(a, b)


def test_the_silu_kernel_over_fp8_pages(bf16_weights, monkeypatch):
    in_append = _serve(bf16_weights, Tier.HOST, kv_cache_dtype="fp8_e4m3")
    monkeypatch.setenv(SILU_ENV, "separate")
    for a, b in zip(_serve(bf16_weights, Tier.HOST, kv_cache_dtype="fp8_e4m3"), in_append):
        assert torch.equal(a, b)


@pytest.mark.parametrize("order", [1, -1])
def test_one_shared_split_workspace_in_either_capture_order(bf16_weights, gpu_hit, monkeypatch, order):
    """Every bucket's graphs captured smallest first or largest first, then one visit served from them: the
    engine reserved one buffer of the largest need for them all."""
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
        captured = {(b.max_batch, b.max_tokens) for b in engine.buckets}   # the first visit also ran eagerly
        partials = [a.partials for key, a in engine.pipeline.kernels._attention.items()
                    if key in captured and a.partials is not None]
        buffers = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in partials}
        assert len(partials) > 1 and list(buffers.values()) == [max(p.nbytes for p in partials)]   # reserved once
    for a, b in zip(got, gpu_hit):
        assert torch.equal(a, b)
