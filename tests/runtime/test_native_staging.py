"""The native slab packer writes the numpy packer's bytes byte for byte (ragged batches, 0-history users, shrinking and
growing fields, returning hits' page rows, either N rule), refuses the same bad ids with the same errors, and an
engine packs with it (where it builds) and scores like the JaggedBatch staging."""

import random

import pytest
import torch

from layerflow.model import HSTUWeights
from layerflow.runtime.buffers import BatchBuffers, Bucket
from layerflow.runtime.native_staging import native_available, stage_items_native
from layerflow.runtime.request import Request
from layerflow.runtime.staging import stage_items
from tests.runtime.test_staging import BATCH_N, CONFIG, _batches, _engine, _visits

pytestmark = pytest.mark.skipif(not native_available(), reason="no C compiler or Python headers")


def _slab_pair(model, bucket=Bucket(4, 64), max_pages=8):
    bufs = BatchBuffers(bucket, max_pages, torch.device("cpu"), model)
    return bufs, bufs.take_slab(), bufs.take_slab()


def _random_batches(rng, count):
    """Ragged batches of 1-4 users (some with no history, no appended ids or no candidates); a returning user's page
    row grows from the same int objects, as the GPU pool's rows do."""
    rows = {u: [] for u in range(4)}
    out = []
    for _ in range(count):
        users = rng.sample(range(4), rng.randrange(1, 5))
        cached, appended, candidates, page_rows = [], [], [], []
        budget = 64
        for u in users:
            a, k = rng.randrange(0, 8), rng.randrange(0, 8)
            if rng.random() < 0.2:
                rows[u] = []
            rows[u] = (rows[u] + [rng.randrange(1000) for _ in range(rng.randrange(0, 3))])[:8]
            cached.append(rng.choice([0, rng.randrange(300)]))
            appended.append([rng.randrange(300) for _ in range(min(a, budget))])
            budget -= len(appended[-1])
            candidates.append([rng.randrange(300) for _ in range(min(k, budget))])
            budget -= len(candidates[-1])
            page_rows.append(tuple(rows[u]))
        out.append((users, cached, appended, candidates, page_rows))
    return out


@pytest.mark.parametrize("model", [CONFIG, BATCH_N], ids=["constant_n", "batch_n"])
def test_the_native_slab_is_the_numpy_slab_byte_for_byte_for_every_batch_in_turn(model):
    bufs, numpy_slab, native_slab = _slab_pair(model)
    batches = [(list(range(len(c))), c, a, k, r) for c, a, k, r in _batches()] + \
        _random_batches(random.Random(1), 60)
    for users, cached, appended, candidates, rows in batches:
        expected = stage_items(numpy_slab, model, users, cached, appended, candidates, rows, bufs.bucket)
        staged = stage_items_native(native_slab, model, users, cached, appended, candidates, rows, bufs.bucket)
        assert numpy_slab.host.numpy().tobytes() == native_slab.host.numpy().tobytes(), (cached, appended, rows)
        assert staged == expected and staged.slab is native_slab
        assert (staged.num_tokens, staged.num_candidates) == (expected.num_tokens, expected.num_candidates)
        assert native_slab.held == numpy_slab.held


@pytest.mark.parametrize("bad", [300, -1, 2**64, 2**40, "7"])
@pytest.mark.parametrize("where", ["appended", "candidate"])
def test_a_bad_id_raises_the_numpy_packers_error_and_the_slab_serves_the_next_batch(bad, where):
    bufs, numpy_slab, native_slab = _slab_pair(CONFIG, Bucket(2, 64))
    appended, candidates = [[1], [2, 9]], [[3], [4]]
    (appended if where == "appended" else candidates)[1].insert(1, bad)
    big = ([0], [[5] * 30], [[6] * 30], [(1, 2)])   # wider than the failed batch: its clearing is checked too
    for slab, stage in ((numpy_slab, stage_items), (native_slab, stage_items_native)):
        stage(slab, CONFIG, [0], *big, bufs.bucket)
    errors = []
    for slab, stage in ((numpy_slab, stage_items), (native_slab, stage_items_native)):
        with pytest.raises(ValueError) as error:
            stage(slab, CONFIG, [5, 17], [0, 3], appended, candidates, [(0,), (1,)], bufs.bucket)
        errors.append(str(error.value))
    assert errors[0] == errors[1] and "user 17" in errors[1]
    for slab, stage in ((numpy_slab, stage_items), (native_slab, stage_items_native)):
        stage(slab, CONFIG, [0], [10], [[20]], [[30, 31]], [(5,)], bufs.bucket)
    assert numpy_slab.host.numpy().tobytes() == native_slab.host.numpy().tobytes()


def test_a_float_id_is_refused_by_name_where_the_numpy_packer_would_truncate_it():
    bufs, _, slab = _slab_pair(CONFIG, Bucket(1, 64))
    with pytest.raises(ValueError, match=r"user 4: appended item id 1.0 is not an integer \(float\)"):
        stage_items_native(slab, CONFIG, [4], [0], [[1.0]], [[2]], [(1,)], bufs.bucket)


def test_a_batch_past_the_slab_or_of_the_wrong_types_is_refused_by_name():
    bufs, _, slab = _slab_pair(CONFIG, Bucket(1, 64), max_pages=2)
    with pytest.raises(ValueError, match="past the slab's 1 users, 64 tokens, 2 pages"):
        stage_items_native(slab, CONFIG, [0], [0], [[1] * 40], [[2] * 30], [(1,)], bufs.bucket)
    with pytest.raises(ValueError, match="past the slab's"):
        stage_items_native(slab, CONFIG, [0], [0], [[1]], [[2]], [(1, 2, 3)], bufs.bucket)
    with pytest.raises(ValueError, match="past the slab's"):
        stage_items_native(slab, CONFIG, [0, 1], [0, 0], [[1], [1]], [[2], [2]], [(1,), (2,)], bufs.bucket)
    with pytest.raises(ValueError, match="tuples of page ids"):
        stage_items_native(slab, CONFIG, [0], [0], [[1]], [[2]], [[1]], bufs.bucket)
    with pytest.raises(ValueError, match="cached lengths >= 0"):
        stage_items_native(slab, CONFIG, [0], [-1], [[1]], [[2]], [(1,)], bufs.bucket)
    with pytest.raises(ValueError, match="N of the batch rule is 0"):
        stage_items_native(_slab_pair(BATCH_N)[2], BATCH_N, [0], [0], [[]], [[]], [()], bufs.bucket)


def test_the_engine_packs_natively_and_scores_bitwise_like_the_jagged_batch_staging():
    weights = HSTUWeights.init(CONFIG, seed=3)
    visits = _visits(random.Random(2))
    results = {}
    for staging in ("slab", "batch"):
        with _engine(weights, staging) as engine:
            assert engine.pack == "native"
            results[staging] = [[s.clone() for s in engine.score(visit)] for visit in visits]
            with pytest.raises(ValueError, match="user 3: candidate item id 300"):
                engine.score([Request(3, [1], [300])])
    for a, b in zip(results["slab"], results["batch"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
