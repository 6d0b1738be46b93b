"""Slab staging: a batch packed straight into a bucket's host slab in prepare equals the JaggedBatch fill, bad ids are
refused by name, and the engine scores the same with either staging and either reap order."""

import random

import pytest
import torch

from layerflow.config import Config
from layerflow.model import HSTUConfig, HSTUWeights
from layerflow.model.batch import JaggedBatch
from layerflow.runtime.buffers import BatchBuffers, Bucket
from layerflow.runtime.engine import REAP_ENV, STAGING_ENV, Engine
from layerflow.tier.base import settle
from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.request import Request
from layerflow.runtime.staging import stage_items

CONFIG = HSTUConfig(num_layers=2, num_heads=2, dqk=16, dv=16, embedding_dim=32, max_seq_len=512,
                    dtype=torch.float32, item_vocab_size=300, position_table_size=512)
BATCH_N = HSTUConfig(**{**CONFIG.to_dict(), "attn_n_rule": "batch"})


def _batches():
    """Batches in an order that shrinks and grows every field: (cached, appended, candidates, page rows)."""
    return [([3, 40, 0], [[1, 2], [3, 4, 5], [6]], [[7, 8], [9], [10, 11, 12]], [(1, 2), (3, 4, 5, 6), (7,)]),
            ([10], [[20]], [[30, 31]], [(5,)]),
            ([0, 7], [[], [2, 3, 4, 5]], [[299, 0], []], [(), (8, 9)]),
            ([64, 1, 2, 3], [[1], [2], [3], [4]], [[5], [6], [7], [8]], [(1, 2, 3), (4,), (5,), (6,)])]


@pytest.mark.parametrize("model", [CONFIG, BATCH_N], ids=["constant_n", "batch_n"])
def test_a_staged_slab_holds_what_fill_writes_for_every_batch_in_turn(model):
    bufs = BatchBuffers(Bucket(4, 64), 8, torch.device("cpu"), model)
    slab = bufs.take_slab()
    for cached, appended, candidates, rows in _batches():
        users = list(range(len(cached)))
        staged = stage_items(slab, model, users, cached, appended, candidates, rows, bufs.bucket)
        bufs.fill(JaggedBatch.from_lists(model, cached, appended, candidates), rows)
        assert torch.equal(slab.host, bufs._slab.host), (cached, appended)
        assert (staged.num_tokens, staged.num_candidates) == (bufs.num_tokens, bufs.num_candidates)
        assert staged.query_lens == [len(a) + len(k) for a, k in zip(appended, candidates)]
        bufs.fill(staged, rows)   # the staged batch's own copy lands the same device slab
        assert torch.equal(bufs._device, bufs._slab.host)


@pytest.mark.parametrize("bad,named", [(300, "300"), (-1, "-1"), (2**64, str(2**64)), (2**40, str(2**40))])
def test_a_bad_id_is_refused_by_name_and_the_slab_serves_the_next_batch(bad, named):
    bufs = BatchBuffers(Bucket(2, 64), 8, torch.device("cpu"), CONFIG)
    slab = bufs.take_slab()
    with pytest.raises(ValueError, match=f"user 17: candidate item id {named}"):
        stage_items(slab, CONFIG, [5, 17], [0, 0], [[1], [2]], [[3], [4, bad]], [(0,), (1,)], bufs.bucket)
    cached, appended, candidates, rows = _batches()[1]
    stage_items(slab, CONFIG, [0], cached, appended, candidates, rows, bufs.bucket)
    bufs.fill(JaggedBatch.from_lists(CONFIG, cached, appended, candidates), rows)
    assert torch.equal(slab.host, bufs._slab.host)


def test_a_batch_staged_for_another_bucket_is_refused():
    small, large = (BatchBuffers(Bucket(1, n), 8, torch.device("cpu"), CONFIG) for n in (64, 128))
    staged = stage_items(small.take_slab(), CONFIG, [0], [0], [[1]], [[2]], [(0,)], small.bucket)
    with pytest.raises(ValueError, match="staged for"):
        large.fill(staged, [(0,)])


def _engine(weights, staging, reap=None):
    config = Config(cpu_cache_gb=0.02, gpu_cache_gb=0.01, page_size=16, transfer_timeout_s=2.0)
    return Engine(weights, config, device="cpu", staging=staging, reap=reap, batch_buckets=(1, 4),
                  token_buckets=(64, 128))


def _visits(rng):
    """Three visits of four users: first visits (misses), then returning users."""
    return [[Request(u, [rng.randrange(300) for _ in range(rng.randrange(1, 30))],
                     [rng.randrange(300) for _ in range(rng.randrange(0, 20))]) for u in range(4)]
            for _ in range(3)]


def test_the_engine_scores_the_same_with_either_staging_and_reap_order():
    weights = HSTUWeights.init(CONFIG, seed=3)
    visits = _visits(random.Random(0))
    results = {}
    for staging, reap in (("batch", "before"), ("slab", "before"), ("slab", "after")):
        with _engine(weights, staging, reap) as engine:
            out = []
            for v, visit in enumerate(visits):
                if v == 2:   # the last visit onboards users 1 and 2 from the host
                    for u in (1, 2):
                        engine.kv.evict_from_gpu(u)
                    assert engine.kv.tier(1) is Tier.HOST
                out.append([s.clone() for s in engine.score(visit)])
                out.append([s.clone() for s in engine.score(visit[:1])])
            results[staging, reap] = out
            engine.kv.wait_offloads()
            assert not engine.kv.below.cache.host.num_pinned   # every offload's host pin was given back
    first = results["batch", "before"]
    for other in list(results.values())[1:]:
        for a, b in zip(first, other):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("reap", ["before", "after"])
def test_a_batch_of_gpu_hits_reaps_finished_offloads_before_or_after_its_launch(reap):
    weights = HSTUWeights.init(CONFIG, seed=3)
    with _engine(weights, "slab", reap) as engine:
        kv = engine.kv
        engine.score([Request(0, [1, 2], [3]), Request(1, [4], [5])])
        settle(kv.users[0].offload)
        plan = engine.prepare([Request(1, [6], [7])])   # user 1: a GPU hit
        assert (0 in kv._offloading) == (reap == "after")   # user 0's finished offload, not reaped yet
        engine.collect(engine.launch(plan))
        assert 0 not in kv._offloading and kv.below.cache.host.pin_count(0) == 0
        settle(kv.users[1].offload)
        plan = engine.prepare([Request(5, [8], [9])])   # a new user: its batch reaps first in either order
        assert 1 not in kv._offloading
        engine.cancel(plan)


def test_slab_staging_gives_each_slab_back_after_its_batch():
    weights = HSTUWeights.init(CONFIG, seed=3)
    with _engine(weights, "slab") as engine:
        requests = [Request(0, [1, 2, 3], [4, 5])]
        engine.score(requests)
        plan = engine.prepare([Request(1, [1], [2])])
        engine.cancel(plan)
        with pytest.raises(ValueError, match="candidate item id 300"):
            engine.score([Request(2, [1], [300])])
        engine.score(requests)
        bufs = engine._buffers[Bucket(1, 64)]
        assert len(bufs._spare) == 1   # one slab served every batch: each came back before the next took one
        assert 2 not in engine.kv.gpu


def test_staging_and_reap_default_to_slab_and_after_and_an_unknown_one_is_refused_by_name(monkeypatch):
    weights = HSTUWeights.init(CONFIG, seed=3)
    monkeypatch.delenv(STAGING_ENV, raising=False)
    monkeypatch.delenv(REAP_ENV, raising=False)
    with _engine(weights, None) as engine:   # the defaults: slab staging, reap after the launch
        assert (engine.staging, engine.reap, engine.kv.reap_after_launch) == ("slab", "after", True)
    with pytest.raises(ValueError, match="staging='ring'"):
        _engine(weights, "ring")
    monkeypatch.setenv(REAP_ENV, "never")
    with pytest.raises(ValueError, match=f"reap='never' \\({REAP_ENV}\\)"):
        _engine(weights, "batch")
    monkeypatch.setenv(REAP_ENV, "before")
    monkeypatch.setenv(STAGING_ENV, "batch")
    with _engine(weights, None) as engine:
        assert (engine.staging, engine.reap, engine.kv.reap_after_launch) == ("batch", "before", False)
