"""The engine on the CPU path: every tier gives the full-recompute scores, faults fail fast, bad input is refused."""

import random
import time

import pytest
import torch

from layerflow.model import HSTUConfig, HSTUWeights, full_forward
from layerflow.runtime.engine import Engine
from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.request import Request
from layerflow.config import Config
from layerflow.transfer.errors import TransferError
from tests.faults import FaultyThreadCopyEngine

CONFIG = HSTUConfig(num_layers=3, num_heads=2, dqk=16, dv=16, embedding_dim=32, max_seq_len=1024,
                    dtype=torch.float32, item_vocab_size=500, position_table_size=1024)
TOL = 1e-5


@pytest.fixture(scope="module")
def weights():
    return HSTUWeights.init(CONFIG, seed=1)


def make_engine(weights, tmp_path=None, **overrides):
    values = dict(cpu_cache_gb=0.02, gpu_cache_gb=0.01, page_size=16, transfer_timeout_s=2.0)
    if tmp_path is not None:
        values.update(ssd_cache_gb=0.05, ssd_cache_dir=str(tmp_path / "ssd"))
    copy_engine = overrides.pop("copy_engine", None)
    values.update(overrides)
    return Engine(weights, Config(**values), copy_engine=copy_engine)


def items(rng, n):
    return [rng.randrange(CONFIG.item_vocab_size) for _ in range(n)]


def reference(weights, history, candidates):
    return full_forward(weights, [history], [candidates]).scores


def place(engine, user, tier):
    """Move a resident user to `tier` (GPU stays; HOST: evict from GPU; SSD/NONE: evict from GPU and host)."""
    kv = engine.kv
    if tier is Tier.GPU:
        return
    kv.evict_from_gpu(user)
    if tier is Tier.HOST:
        return
    if tier is Tier.SSD:
        kv.evict_from_host(user)
    else:
        kv.below.drop(user)


@pytest.mark.parametrize("tier,layerwise", [(Tier.GPU, True), (Tier.HOST, True), (Tier.HOST, False),
                                            (Tier.SSD, True), (Tier.NONE, True)])
def test_every_tier_scores_like_a_full_recompute(weights, tmp_path, tier, layerwise):
    rng = random.Random(0)
    histories = {u: items(rng, n) for u, n in ((1, 0), (2, 37), (3, 300))}
    with make_engine(weights, tmp_path, enable_layerwise=layerwise) as engine:
        engine.score([Request(u, h, []) for u, h in histories.items() if h])
        for u, h in histories.items():
            if h:
                place(engine, u, tier)
                assert engine.kv.tier(u) is tier
        appended = {u: items(rng, n) for u, n in ((1, 5), (2, 1), (3, 0))}
        cands = {u: items(rng, n) for u, n in ((1, 4), (2, 0), (3, 7))}
        out = engine.score([Request(u, appended[u], cands[u]) for u in histories])
        for (u, h), scores in zip(histories.items(), out):
            ref = reference(weights, h + appended[u], cands[u])
            assert scores.shape == ref.shape
            assert torch.allclose(scores, ref, atol=TOL, rtol=TOL), (tier, u)
            assert engine.kv.tier(u) is Tier.GPU


def test_host_hit_is_bitwise_the_gpu_hit(weights):
    rng = random.Random(1)
    history, more, cands = items(rng, 100), items(rng, 3), items(rng, 9)
    results = []
    for evict in (False, True):
        with make_engine(weights) as engine:
            engine.score([Request(7, history, [])])
            if evict:
                engine.kv.evict_from_gpu(7)
            results.append(engine.score([Request(7, more, cands)])[0])
    assert torch.equal(results[0], results[1])


def test_mixed_batch_and_several_visits(weights, tmp_path):
    rng = random.Random(2)
    with make_engine(weights, tmp_path) as engine:
        history = {u: items(rng, 20 + 13 * u) for u in range(4)}
        engine.score([Request(u, h, []) for u, h in history.items()])
        place(engine, 1, Tier.HOST)
        place(engine, 2, Tier.SSD)
        for visit in range(3):
            reqs = [Request(u, items(rng, visit + u), items(rng, 3)) for u in (0, 1, 2, 3, 10 + visit)]
            out = engine.score(reqs)
            for r, scores in zip(reqs, out):
                history[r.user_id] = history.get(r.user_id, []) + r.items
                assert torch.allclose(scores, reference(weights, history[r.user_id], r.candidates), atol=TOL)


def test_lru_eviction_under_gpu_pressure_stays_exact(weights):
    rng = random.Random(3)
    # 12 users x 200 tokens need 13 pages each; the GPU pool holds far fewer than 12 x 13 pages.
    with make_engine(weights, gpu_cache_gb=60 * 16 * 3 * 2 * 2 * 16 * 4 / 2**30) as engine:
        pages = engine.kv.gpu.total
        history = {u: items(rng, 200) for u in range(12)}
        for u, h in history.items():
            engine.score([Request(u, h, [])])
        assert len(engine.kv.gpu.users()) * 13 <= pages < 12 * 13
        for u in rng.sample(list(history), 6):
            r = Request(u, items(rng, 2), items(rng, 3))
            history[u] += r.items
            assert torch.allclose(engine.score([r])[0], reference(weights, history[u], r.candidates), atol=TOL)


def test_injected_transfer_failure_fails_fast_then_the_engine_serves(weights):
    copier = FaultyThreadCopyEngine()
    with make_engine(weights, copy_engine=copier, transfer_timeout_s=30.0) as engine:
        engine.score([Request(5, list(range(60)), [])])
        engine.kv.evict_from_gpu(5)
        copier.fail_at_layer = 1
        start = time.monotonic()
        with pytest.raises(TransferError, match="injected failure at layer 1"):
            engine.score([Request(5, [1], [2, 3])])
        assert time.monotonic() - start < 1.0
        # The eager CPU path fails at the layer's wait, before any offload: the host copy is intact.
        assert engine.kv.tier(5) is Tier.HOST
        copier.fail_at_layer = None
        scores = engine.score([Request(5, [1], [2, 3])])[0]
        assert torch.allclose(scores, reference(weights, list(range(60)) + [1], [2, 3]), atol=TOL)


def test_a_failure_seen_after_the_early_offload_drops_the_onboarded_copy(weights):
    """A captured graph reports a failed layer only after the block, when the onboarded user's offload is already
    issued (it may rewrite the host page holding the last onboarded tokens): that copy is dropped, never served."""
    with make_engine(weights) as engine:
        history = list(range(40))
        engine.score([Request(5, history, [])])
        engine.kv.evict_from_gpu(5)
        plan = engine.kv.prepare([Request(5, [7, 8], [1])])
        assert plan.tiers == [Tier.HOST]
        engine.kv.offload_early(plan)
        engine.kv.abort(plan)
        assert engine.kv.tier(5) is Tier.NONE
        assert engine.kv.users[5].history == history
        scores = engine.score([Request(5, [7, 8], [1, 2])])[0]
        assert torch.allclose(scores, reference(weights, history + [7, 8], [1, 2]), atol=TOL)


@pytest.mark.parametrize("request_,match", [
    (Request(1, [CONFIG.item_vocab_size], []), "user 1: appended item id 500"),
    (Request(1, [1], [-4]), "user 1: candidate item id -4"),
    (Request(1, [1] * 1100, []), "user 1: total length 1103"),
])
def test_bad_request_is_a_value_error_and_the_engine_keeps_serving(weights, request_, match):
    with make_engine(weights) as engine:
        engine.score([Request(1, [1, 2, 3], [])])
        with pytest.raises(ValueError, match=match):
            engine.score([request_, Request(2, [4], [5])])
        assert engine.kv.tier(2) is Tier.NONE
        scores = engine.score([Request(1, [4], [5, 6])])[0]
        assert torch.allclose(scores, reference(weights, [1, 2, 3, 4], [5, 6]), atol=TOL)


def test_a_bad_id_found_after_the_onboarding_started_gives_everything_back(weights):
    """The onboarding is issued before the batch is packed (its first copy starts sooner), so a bad id is found with
    the host hit's copies already running: they end, its GPU pages and pins go back, and its host copy still serves."""
    copied = []
    copier = FaultyThreadCopyEngine(before_layer=copied.append)
    with make_engine(weights, copy_engine=copier) as engine:
        history = list(range(40))
        engine.score([Request(5, history, [])])
        engine.kv.evict_from_gpu(5)
        free, copied[:] = engine.kv.gpu.num_free, []
        with pytest.raises(ValueError, match="user 5: candidate item id 500"):
            engine.score([Request(5, [7], [CONFIG.item_vocab_size])])
        assert copied == list(range(CONFIG.num_layers))   # the onboarding ran, every layer
        assert engine.kv.tier(5) is Tier.HOST and 5 not in engine.kv.gpu
        assert engine.kv.gpu.num_free == free and engine.kv.gpu.num_pinned == 0
        assert engine.kv.users[5].history == history
        scores = engine.score([Request(5, [7], [1, 2])])[0]
        assert torch.allclose(scores, reference(weights, history + [7], [1, 2]), atol=TOL)


def test_duplicate_user_in_a_batch_is_refused(weights):
    with make_engine(weights) as engine:
        with pytest.raises(ValueError, match="user 3 appears twice"):
            engine.score([Request(3, [1], []), Request(3, [2], [])])


def test_layer_runs_only_after_its_copy_landed(weights):
    """With a slowed transfer thread, layer l's KV append sees layer l's history already in its pages (the pool is
    poisoned before the onboarding), and layer 0 runs before the last layer's copy: the pipeline overlaps."""
    from layerflow.kernels.reference import gather_history

    events = []
    copier = FaultyThreadCopyEngine(before_layer=lambda l: time.sleep(0.03))
    with make_engine(weights, copy_engine=copier) as engine:
        engine.score([Request(9, list(range(80)), [])])
        kv_layers = engine.pipeline.kv_layers
        row = torch.tensor(engine.kv.gpu.pages(9))
        expected = [gather_history(kv, row, 80) for kv in kv_layers]
        engine.kv.evict_from_gpu(9)
        for kv in kv_layers:
            kv.fill_(float("nan"))
        copier.before_layer = lambda l: (time.sleep(0.03), events.append(("copy", l)))
        kernels = engine.pipeline.kernels
        real_append = kernels.append

        def checking_append(u, v, q, k, kv_cache, bufs):
            layer = next(i for i, kv in enumerate(kv_layers) if kv is kv_cache)
            events.append(("compute", layer))
            got_k, got_v = gather_history(kv_cache, bufs.page_table[0], 80)
            assert torch.equal(got_k, expected[layer][0]) and torch.equal(got_v, expected[layer][1]), layer
            real_append(u, v, q, k, kv_cache, bufs)

        kernels.append = checking_append
        scores = engine.score([Request(9, [1], [2])])[0]
    assert torch.allclose(scores, reference(weights, list(range(80)) + [1], [2]), atol=TOL)
    computes = [i for i, e in enumerate(events) if e[0] == "compute"]
    last_copy = events.index(("copy", CONFIG.num_layers - 1))
    assert len(computes) == CONFIG.num_layers and computes[0] < last_copy, events


def test_ssd_copy_serves_a_truncated_prefix_and_never_a_stale_tail(weights, tmp_path):
    copier = FaultyThreadCopyEngine()
    with make_engine(weights, tmp_path, copy_engine=copier) as engine:
        history = list(range(100))
        engine.score([Request(1, history, [])])
        place(engine, 1, Tier.SSD)
        engine.kv.truncate(1, 60)                 # the SSD copy still holds 100 tokens: its first 60 are valid
        assert engine.kv.tier(1) is Tier.SSD
        scores = engine.score([Request(1, [7, 8], [9])])[0]
        assert torch.allclose(scores, reference(weights, history[:60] + [7, 8], [9]), atol=TOL)
        copier.fail_at_layer = 0                  # the offload of the next visit fails: no host copy of it
        engine.score([Request(1, [3], [])])
        engine.kv.wait_offloads()
        copier.fail_at_layer = None
        engine.kv.evict_from_gpu(1)
        assert engine.kv.tier(1) is Tier.NONE     # the SSD copy's valid prefix (60) is shorter than the history
        scores = engine.score([Request(1, [4], [5])])[0]
        assert torch.allclose(scores, reference(weights, history[:60] + [7, 8, 3, 4], [5]), atol=TOL)


def test_a_user_too_big_for_the_host_stays_served_from_the_gpu(weights):
    """An offload that cannot start (the host pool is smaller than the user) loses nothing: the scores stand, the
    other users of the batch are unpinned and offloaded, and the big user stays a GPU hit."""
    with make_engine(weights, cpu_cache_gb=0.0004) as engine:   # 34 blocks of 16 tokens: the big user needs 50
        big, small = [i % 500 for i in range(800)], list(range(30))
        out = engine.score([Request(1, big, [3]), Request(2, small, [4])])
        assert torch.allclose(out[0], reference(weights, big, [3]), atol=TOL)
        engine.kv.wait_offloads()
        assert engine.kv.gpu.pin_count(1) == engine.kv.gpu.pin_count(2) == 0
        assert engine.kv.tier(1) is Tier.GPU
        engine.kv.evict_from_gpu(2)
        assert engine.kv.tier(2) is Tier.HOST
        scores = engine.score([Request(1, [5], [6])])[0]
        assert torch.allclose(scores, reference(weights, big + [5], [6]), atol=TOL)


def test_batches_beyond_the_buckets_reuse_a_few_buffer_sizes(weights):
    """Long misses run eagerly in power-of-two buckets: a stream of new users of varied lengths creates O(log)
    buffer sets, not one per length."""
    rng = random.Random(4)
    config = Config(cpu_cache_gb=0.02, gpu_cache_gb=0.01, page_size=16)
    with Engine(weights, config, token_buckets=(64,), batch_buckets=(1,)) as engine:
        for u in range(12):
            engine.score([Request(100 + u, items(rng, 300 + 37 * u), items(rng, 3))])
        oversized = [b for b in engine._buffers if b not in engine.buckets]
        assert 0 < len(oversized) <= 3, oversized


def test_a_process_that_never_closes_its_engine_exits_cleanly(tmp_path):
    """The transfer threads stop at interpreter exit: a worker thread alive when torch's OpenMP pool is torn down
    aborted the process (SIGABRT, every time, before the fix)."""
    import subprocess
    import sys

    script = tmp_path / "no_close.py"
    script.write_text(
        "from layerflow.model import HSTUWeights\n"
        "from layerflow.model.config import PRESETS\n"
        "from layerflow.runtime.engine import Engine\n"
        "from layerflow.runtime.request import Request\n"
        "from layerflow.config import Config\n"
        "engine = Engine(HSTUWeights.init(PRESETS['tiny'], 0), Config(cpu_cache_gb=0.1, gpu_cache_gb=0.1))\n"
        "engine.score([Request(1, list(range(1500)), [])])\n"
        "engine.kv.evict_from_gpu(1)\n"
        "engine.score([Request(1, [1, 2], [3, 4])])\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
