"""On the H200: the buffers' copies through ctypes ("cudart") give the scores torch's copies give, bit for bit, for
graph replays and eager runs, GPU and host hits, across visits (buffers refilled, a user's pages moved by an eviction),
and for a model whose caller brings the embeddings (its token rows go up and every row's output comes back)."""

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


def _visits(staging: str, graph: bool) -> list[list[torch.Tensor]]:
    config = Config(cpu_cache_gb=0.2, gpu_cache_gb=0.2, page_size=32)
    gen = torch.Generator().manual_seed(0)
    out = []
    with Engine(HSTUWeights.init(BF16, seed=0), config, use_cuda_graph=graph, batch_buckets=(1, 4),
                token_buckets=(64, 256), staging=staging) as engine:
        engine.warmup()
        engine.score([Request(u, torch.randint(0, 50_000, (n,), generator=gen).tolist(), [])
                      for u, n in HISTORY.items()])
        for visit in range(3):
            if visit == 2:
                engine.kv.evict_from_gpu(1)
            users = list(HISTORY) if visit != 1 else [2]
            out.append([s.clone() for s in engine.score(
                [Request(u, torch.randint(0, 50_000, (3 + u,), generator=gen).tolist(),
                         torch.randint(0, 50_000, (20 * u,), generator=gen).tolist()) for u in users])])
    return out


@pytest.mark.parametrize("graph", [True, False])
def test_cudart_staging_scores_like_torch_staging(graph):
    for a, b in zip(_visits("torch", graph), _visits("cudart", graph)):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_cudart_staging_with_embeddings_in():
    model = replace(BF16, item_vocab_size=0, position_table_size=0)
    weights = HSTUWeights.init(model, seed=0)
    gen = torch.Generator().manual_seed(1)
    e = model.embedding_dim
    history, new, candidates = (torch.randn(n, e, generator=gen).to(torch.bfloat16) for n in (200, 5, 7))
    outs = []
    for staging in ("torch", "cudart"):
        with Engine(weights, Config(cpu_cache_gb=0.2, gpu_cache_gb=0.2, page_size=32), batch_buckets=(1,),
                    token_buckets=(64, 256), staging=staging) as engine:
            engine.warmup()
            engine.score([EmbeddingRequest(0, history, history[:0])])
            outs.append(engine.score([EmbeddingRequest(0, new, candidates)])[0])
    assert torch.equal(outs[0].new, outs[1].new) and torch.equal(outs[0].candidates, outs[1].candidates)
