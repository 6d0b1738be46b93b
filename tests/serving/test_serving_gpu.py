"""The serving layer on the H200: batches prepared while another computes (their KV onboarded under CUDA graphs with
layer waits, beside the batch in flight) score like a full recompute, prefetch off and on (chained on the batch in
flight); a chained batch scores bitwise as if prepared after the collect of the batch it was chained on; host hits
whose copies a copy thread issued score bitwise as when the calling thread issued them."""

import random
from dataclasses import replace

import pytest
import torch

from layerflow.config import Config
from layerflow.model import HSTUConfig, HSTUWeights, full_forward
from layerflow.runtime.engine import Engine
from layerflow.runtime.request import Request
from layerflow.serving.async_engine import AsyncEngine
from layerflow.tier.base import Tier

pytestmark = pytest.mark.gpu

FP32 = HSTUConfig(num_layers=4, num_heads=2, dqk=128, dv=128, embedding_dim=256, max_seq_len=4096,
                  dtype=torch.float32, item_vocab_size=5000, position_table_size=4096)


# ~200 pages of 32 tokens: about four users fit, so most visits are host hits onboarded while a batch computes.
CONFIG = Config(cpu_cache_gb=1.0, gpu_cache_gb=0.05, page_size=32, transfer_timeout_s=5.0, serve_max_batch_size=2,
                serve_deadline_ms=0.0)


@pytest.mark.parametrize("policies", [("off",), ("guarded",)], ids="+".join)
def test_prefetched_batches_on_the_gpu_score_like_a_full_recompute(policies):
    """Each policy in turn serves every user's visits (from the host) on one engine; histories grow across them."""
    weights = HSTUWeights.init(FP32, seed=0)
    rng = random.Random(0)
    histories = {u: [rng.randrange(5000) for _ in range(rng.randrange(600, 1500))] for u in range(8)}
    visits = [Request(u, [rng.randrange(5000) for _ in range(5)], [rng.randrange(5000) for _ in range(20)])
              for _ in range(3) for u in histories]
    with Engine(weights, CONFIG, token_buckets=(64, 256), batch_buckets=(1, 2)) as engine:
        engine.warmup()
        for u, h in histories.items():
            engine.score([Request(u, h, [])])
        for policy in policies:
            engine.kv.wait_offloads()
            for u in histories:
                if u in engine.kv.gpu:
                    engine.kv.evict_from_gpu(u)
            with AsyncEngine(engine, policy=policy) as serving:
                results = [f.result(60) for f in [serving.submit(r) for r in visits]]
            assert sum(r.tier is Tier.HOST for r in results) >= len(histories), policy
            metrics = serving.metrics   # a guarded prefetch may be deferred every time: it was tried, though
            tried = metrics.prefetched._value.get() + metrics.prefetch_deferred._value.get()
            assert (tried > 0) == (policy != "off"), policy
            for r, served in zip(visits, results):
                histories[r.user_id] = histories[r.user_id] + r.items
                ref = full_forward(weights, [histories[r.user_id]], [r.candidates]).scores
                assert torch.allclose(served.scores, ref, rtol=2e-3, atol=2e-3), (policy, r.user_id)


def test_a_batch_chained_on_the_one_in_flight_scores_bitwise_as_if_prepared_after_its_collect():
    """User 0 in both batches (a GPU hit, then chained on its appended tokens), user 1 onboarded from the host."""
    weights = HSTUWeights.init(FP32, seed=1)
    rng = random.Random(1)
    histories = {u: [rng.randrange(5000) for _ in range(900)] for u in range(3)}

    def visit(user: int) -> Request:
        return Request(user, [rng.randrange(5000) for _ in range(5)], [rng.randrange(5000) for _ in range(20)])

    first, second = [visit(0), visit(1)], [visit(0), visit(2)]
    scores = []
    for chain in (True, False):
        with Engine(weights, CONFIG, token_buckets=(64, 256), batch_buckets=(1, 2)) as engine:
            engine.warmup()
            for u, h in histories.items():
                engine.score([Request(u, h, [])])
            engine.kv.wait_offloads()
            engine.kv.evict_from_gpu(1)
            if chain:
                flight = engine.launch(engine.prepare(first))
                plan = engine.prepare(second, chain=True)
                assert plan.tiers[0] is Tier.GPU and plan.batch.cached_lens[0] == 905
                scores.append(engine.collect(flight) + engine.collect(engine.launch(plan)))
            else:
                scores.append(engine.score(first) + engine.score(second))
            assert engine.kv.gpu.num_pinned == 0
    assert all(torch.equal(c, a) for c, a in zip(*scores))


def test_host_hits_issued_by_the_copy_thread_score_bitwise_as_issued_by_the_caller():
    """Batches of host hits, each next one prepared (its onboarding queued) while the last computes, and offloads
    of the appended tokens in between: the same scores, bit for bit, with and without `copy_thread`."""
    weights = HSTUWeights.init(FP32, seed=2)
    rng = random.Random(2)
    histories = {u: [rng.randrange(5000) for _ in range(rng.randrange(1250, 1450))] for u in range(6)}
    batches = [[Request(u, [rng.randrange(5000) for _ in range(5)], [rng.randrange(5000) for _ in range(20)])
                for u in pair] for pair in ((0, 1), (2, 3), (4, 5), (1, 2), (3, 0), (5, 4))]
    scores = []
    for copy_thread in (False, True):
        with Engine(weights, replace(CONFIG, copy_thread=copy_thread), token_buckets=(64, 256),
                    batch_buckets=(1, 2)) as engine:
            engine.warmup()
            for u, h in histories.items():
                engine.score([Request(u, h, [])])
            engine.kv.wait_offloads()
            for u in histories:
                if u in engine.kv.gpu:
                    engine.kv.evict_from_gpu(u)
            got = []
            flight = engine.launch(engine.prepare(batches[0]))
            for batch in batches[1:]:
                plan = engine.prepare(batch)
                got += engine.collect(flight)
                flight = engine.launch(plan)
            got += engine.collect(flight)
            engine.kv.wait_offloads()
            assert engine.kv.gpu.num_pinned == 0
            scores.append(got)
    assert all(torch.equal(a, b) for a, b in zip(*scores))
