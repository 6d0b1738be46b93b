"""On the H200: bucket buffers refilled visit after visit (rows keeping their pages, a user's pages moved by an
eviction, a smaller batch in the same bucket) give a graph replay the scores an eager run computes from scratch
buffers, and a model whose caller brings the embeddings gets its token rows up and every row's output back."""

from dataclasses import replace

import pytest
import torch

from layerflow.config import Config
from layerflow.model import HSTUWeights
from layerflow.model.config import PRESETS
from layerflow.runtime.engine import Engine
from layerflow.runtime.request import EmbeddingRequest, Request

pytestmark = pytest.mark.gpu

# The benchmark model's shapes (its kernels are compiled once for both), two layers.
BF16 = replace(PRESETS["hstu-bench"], num_layers=2)
HISTORY = {1: 900, 2: 333, 3: 64}


def _visits(graph: bool) -> list[list[torch.Tensor]]:
    config = Config(cpu_cache_gb=0.2, gpu_cache_gb=0.2, page_size=32)
    gen = torch.Generator().manual_seed(0)
    out = []
    with Engine(HSTUWeights.init(BF16, seed=0), config, use_cuda_graph=graph, batch_buckets=(1, 4),
                token_buckets=(64, 256)) as engine:
        engine.warmup()
        engine.score([Request(u, torch.randint(0, 50_000, (n,), generator=gen).tolist(), [])
                      for u, n in HISTORY.items()])
        for visit in range(4):
            if visit == 2:
                engine.kv.evict_from_gpu(1)
            users = list(HISTORY) if visit % 2 == 0 else [2, 3]
            out.append(engine.score(
                [Request(u, torch.randint(0, 50_000, (3 + u,), generator=gen).tolist(),
                         torch.randint(0, 50_000, (20 * u,), generator=gen).tolist()) for u in users]))
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-2, atol=1e-2)


def test_refilled_buffers_replay_the_eager_scores():
    for a, b in zip(_visits(graph=True), _visits(graph=False)):
        assert len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
        assert all(x.device.type == "cpu" and x.is_contiguous() for x in a)


def test_refilled_buffers_with_embeddings_in():
    model = replace(BF16, item_vocab_size=0, position_table_size=0)
    weights = HSTUWeights.init(model, seed=0)
    gen = torch.Generator().manual_seed(1)
    e = model.embedding_dim
    history, new, candidates = (torch.randn(n, e, generator=gen).to(torch.bfloat16) for n in (200, 5, 7))
    outs = []
    for graph in (True, False):
        with Engine(weights, Config(cpu_cache_gb=0.2, gpu_cache_gb=0.2, page_size=32), batch_buckets=(1,),
                    token_buckets=(64, 256), use_cuda_graph=graph) as engine:
            engine.warmup()
            engine.score([EmbeddingRequest(0, history, history[:0])])
            outs.append(engine.score([EmbeddingRequest(0, new, candidates)])[0])
    assert outs[0].new.shape == (5, e) and outs[0].candidates.shape == (7, e)
    assert _close(outs[0].new.float(), outs[1].new.float())
    assert _close(outs[0].candidates.float(), outs[1].candidates.float())
