"""A user's offload while its previous one is in flight: owed, not waited for at the launch; issued once that one
landed; never lost to eviction, truncation or a failed batch (the host copy stays complete, so the user stays a hit)."""

import threading

import pytest
import torch

from layerflow.config import Config
from layerflow.model import HSTUConfig, HSTUWeights, full_forward
from layerflow.runtime.engine import Engine
from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.request import Request
from layerflow.tier.layout import KVLayout
from tests.faults import FaultyThreadCopyEngine

MODEL = HSTUConfig(num_layers=2, num_heads=2, dqk=16, dv=16, embedding_dim=32, max_seq_len=1024,
                   dtype=torch.float32, item_vocab_size=500, position_table_size=1024)
PAGE = 16
PAGE_GB = KVLayout.for_hstu(MODEL, PAGE).page_bytes / 2**30
TOL = 1e-5


@pytest.fixture(scope="module")
def weights():
    return HSTUWeights.init(MODEL, seed=11)


class HeldOffloads:
    """A copy engine whose offload copies wait until `release` is set (onboardings run freely)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.release.set()
        self.engine = FaultyThreadCopyEngine(before_layer=self._hold)

    def _hold(self, layer: int) -> None:
        if threading.current_thread().name == "layerflow-d2h" and not self.release.wait(10.0):
            raise RuntimeError("a held offload was never released")


def engine_with(weights, copies: HeldOffloads) -> Engine:
    config = Config(cpu_cache_gb=400 * PAGE_GB, gpu_cache_gb=400 * PAGE_GB, page_size=PAGE, transfer_timeout_s=5.0)
    return Engine(weights, config, copy_engine=copies.engine)


def reference(weights, history, candidates):
    return full_forward(weights, [history], [candidates]).scores


def test_the_launch_owes_an_offload_behind_one_in_flight_and_the_next_reap_issues_it(weights):
    copies = HeldOffloads()
    with engine_with(weights, copies) as engine:
        first = list(range(40))
        engine.score([Request(1, first, [])])
        engine.kv.wait_offloads()
        copies.release.clear()
        engine.score([Request(1, [41], [2])])        # its offload held in flight
        engine.score([Request(1, [42], [3])])        # launched without waiting for it: owed
        assert engine.kv.users[1].offloading() and 1 in engine.kv._owed
        copies.release.set()
        engine.kv.wait_offloads()                      # lands, then the owed one is issued and lands
        assert not engine.kv._owed and not engine.kv.users[1].offloading()
        engine.kv.evict_from_gpu(1)
        assert engine.kv.tier(1) is Tier.HOST          # the host copy holds every token, the owed ones included
        scores = engine.score([Request(1, [43], [4, 5])])[0]
        assert torch.allclose(scores, reference(weights, first + [41, 42, 43], [4, 5]), atol=TOL, rtol=TOL)


def test_an_owed_user_is_not_evicted_and_its_owed_offload_lands_first(weights):
    copies = HeldOffloads()
    with engine_with(weights, copies) as engine:
        engine.score([Request(1, list(range(40)), [])])
        engine.kv.wait_offloads()
        copies.release.clear()
        engine.score([Request(1, [41], [2])])
        engine.score([Request(1, [42], [3])])
        assert not engine.kv._gpu_can_drop(1)
        copies.release.set()
        engine.kv.evict_from_host(1)                   # waits for both offloads, then moves the copy down
        assert not engine.kv._owed


def test_truncating_an_owed_user_owes_only_what_stays(weights):
    copies = HeldOffloads()
    with engine_with(weights, copies) as engine:
        first = list(range(40))
        engine.score([Request(1, first, [])])
        engine.kv.wait_offloads()
        copies.release.clear()
        engine.score([Request(1, [41], [2])])
        engine.score([Request(1, [42], [3])])
        copies.release.set()
        engine.kv.truncate(1, 41)                      # the second visit's item is retracted
        engine.kv.wait_offloads()
        engine.kv.evict_from_gpu(1)
        assert engine.kv.tier(1) is Tier.HOST
        scores = engine.score([Request(1, [44], [4])])[0]
        assert torch.allclose(scores, reference(weights, first + [41, 44], [4]), atol=TOL, rtol=TOL)
