"""Engine behaviour under misuse and faults (issue 16): concurrent callers, damaged SSD copies, a GPU pool short
while offloads are in flight, a closed engine."""

import logging
import random
import threading
import time

import pytest
import torch

from layerflow.config import Config
from layerflow.model import HSTUConfig, HSTUWeights, full_forward
from layerflow.runtime.engine import Engine
from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.request import Request
from layerflow.tier.allocator import PoolExhausted
from layerflow.tier.layout import KVLayout
from tests.faults import FaultyThreadCopyEngine

CONFIG = HSTUConfig(num_layers=2, num_heads=2, dqk=16, dv=16, embedding_dim=32, max_seq_len=1024,
                    dtype=torch.float32, item_vocab_size=500, position_table_size=1024)
PAGE = 16
PAGE_GB = KVLayout.for_hstu(CONFIG, PAGE).page_bytes / 2**30
TOL = 1e-5


@pytest.fixture(scope="module")
def weights():
    return HSTUWeights.init(CONFIG, seed=4)


def engine_with(weights, gpu_pages: int = 400, **overrides) -> Engine:
    values = dict(cpu_cache_gb=400 * PAGE_GB, gpu_cache_gb=gpu_pages * PAGE_GB, page_size=PAGE, transfer_timeout_s=5.0)
    copy_engine = overrides.pop("copy_engine", None)
    values.update(overrides)
    return Engine(weights, Config(**values), copy_engine=copy_engine)


def reference(weights, history, candidates):
    return full_forward(weights, [history], [candidates]).scores


def test_score_from_two_threads_gives_the_sequential_scores(weights):
    """Issue 16.2: the engine serialises concurrent callers; every score equals a full recompute."""
    rng = random.Random(2)
    histories = {u: [rng.randrange(500) for _ in range(rng.randrange(20, 60))] for u in range(8)}
    visits = {u: [([rng.randrange(500)], [rng.randrange(500) for _ in range(3)]) for _ in range(4)] for u in histories}
    results: dict[tuple[int, int], torch.Tensor] = {}
    errors = []
    with engine_with(weights) as engine:
        for u, h in histories.items():
            engine.score([Request(u, h, [])])

        def client(users):
            try:
                for v in range(4):
                    for u in users:
                        items, candidates = visits[u][v]
                        results[(u, v)] = engine.score([Request(u, items, candidates)])[0]
            except BaseException as e:  # noqa: BLE001 - reported by the test thread
                errors.append(e)

        threads = [threading.Thread(target=client, args=(users,)) for users in ([0, 2, 4, 6], [1, 3, 5, 7])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    for u, h in histories.items():
        for v in range(4):
            items, candidates = visits[u][v]
            h = h + items
            assert torch.allclose(results[(u, v)], reference(weights, h, candidates), atol=TOL, rtol=TOL), (u, v)


def test_a_damaged_ssd_copy_is_recomputed_in_the_same_call(weights, tmp_path, caplog):
    """Issue 16.8: a flipped byte, a truncated or a deleted SSD file is a miss recomputed from the stored history
    with one warning, never an exception to the caller and never a served corrupt copy."""
    caplog.set_level(logging.WARNING)
    history = list(range(70))
    ssd = tmp_path / "ssd"
    with engine_with(weights, ssd_cache_gb=0.01, ssd_cache_dir=str(ssd)) as engine:
        for damage, user in (("flip", 1), ("truncate", 2), ("delete", 3)):
            engine.score([Request(user, history, [])])
            engine.kv.evict_from_gpu(user)
            engine.kv.evict_from_host(user)
            assert engine.kv.tier(user) is Tier.SSD
            (path,) = [p for p in ssd.iterdir() if p.suffix == ".kv"]
            if damage == "flip":
                data = bytearray(path.read_bytes())
                data[len(data) // 3] ^= 0x40
                path.write_bytes(bytes(data))
            elif damage == "truncate":
                path.write_bytes(path.read_bytes()[:PAGE * 10])
            else:
                path.unlink()
            caplog.clear()
            scores = engine.score([Request(user, [5], [6, 7])])[0]
            assert torch.allclose(scores, reference(weights, history + [5], [6, 7]), atol=TOL, rtol=TOL), damage
            warnings = [r for r in caplog.records if "recomputing" in r.getMessage()]
            assert len(warnings) == 1, damage
            engine.kv.drop(user)


def slow_offloads() -> FaultyThreadCopyEngine:
    """Offload copies that take a while, so offloads are still in flight when the next batch needs pages."""
    return FaultyThreadCopyEngine(
        before_layer=lambda layer: time.sleep(0.05) if threading.current_thread().name == "layerflow-d2h" else None)


def test_a_pool_short_only_while_offloads_land_waits_for_them(weights):
    """Issue 16.9: a batch that fits once in-flight offloads land is served (it waits for them); one that can never
    fit raises PoolExhausted naming the sizes, and the engine keeps serving."""
    with engine_with(weights, gpu_pages=10, copy_engine=slow_offloads()) as engine:
        engine.score([Request(1, list(range(60)), [])])        # 4 pages, offload in flight
        engine.score([Request(2, list(range(60, 120)), [])])   # 4 pages, offload in flight
        scores = engine.score([Request(3, list(range(100)), [1])])[0]   # 7 pages: needs user 1's
        assert torch.allclose(scores, reference(weights, list(range(100)), [1]), atol=TOL, rtol=TOL)
        with pytest.raises(PoolExhausted, match="need"):
            engine.score([Request(4, list(range(90)), []), Request(5, list(range(90)), [])])
        scores = engine.score([Request(2, [7], [8])])[0]
        assert torch.allclose(scores, reference(weights, list(range(60, 120)) + [7], [8]), atol=TOL, rtol=TOL)


def test_a_prepare_ahead_never_waits_for_the_offload_of_the_batch_in_flight(weights):
    """Issue 19: the pages of the batch in flight stay pinned until its collect, so a batch prepared behind it that
    needs them gets PoolExhausted at once (the scheduler prepares it after the collect) instead of waiting for that
    batch's offload, which on the GPU lands only after the batch computes."""
    release = threading.Event()

    def hold_offloads(layer: int) -> None:
        if threading.current_thread().name == "layerflow-d2h" and not release.wait(5.0):
            raise RuntimeError("the held offload was never released")

    with engine_with(weights, gpu_pages=10, copy_engine=FaultyThreadCopyEngine(before_layer=hold_offloads)) as engine:
        release.set()
        engine.score([Request(2, list(range(60, 120)), [])])   # 4 pages, evictable once its offload lands
        engine.kv.wait_offloads()
        release.clear()
        flight = engine.launch(engine.prepare([Request(1, list(range(60)), [])]))   # 4 pinned pages, offload held
        with pytest.raises(PoolExhausted, match="need"):
            engine.prepare([Request(3, list(range(100)), [1])])   # 7 pages: user 2's and 1 more of user 1's
        assert engine.kv.users[1].offloading()
        release.set()
        engine.collect(flight)
        scores = engine.score([Request(3, list(range(100)), [1])])[0]
        assert torch.allclose(scores, reference(weights, list(range(100)), [1]), atol=TOL, rtol=TOL)


def test_a_closed_engine_says_so(weights):
    """Issue 16.14: using an engine after close() is a clear error; closing twice is fine."""
    engine = engine_with(weights)
    engine.score([Request(1, [1, 2], [3])])
    engine.close()
    engine.close()
    with pytest.raises(RuntimeError, match="engine is closed"):
        engine.score([Request(1, [4], [5])])
    with pytest.raises(RuntimeError, match="engine is closed"):
        engine.warmup()
