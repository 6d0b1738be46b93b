"""The engine's host paths (runtime/host_paths.py) on the CPU path: an onboarding issued by the issue thread
(`issue="thread"`) or released as soon as its copies landed (`finish="early"`) gives the default paths' scores bit for
bit, the copies issued off the engine's thread, and every failure fails its request alone."""

import logging
import random
import threading

import pytest
import torch

from layerflow.config import Config
from layerflow.model import HSTUConfig, HSTUWeights, full_forward
from layerflow.runtime.engine import Engine
from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.request import Request
from layerflow.transfer.copy_engine import CopyJob, Transfer
from layerflow.transfer.errors import TransferError
from tests.faults import FaultyThreadCopyEngine

CONFIG = HSTUConfig(num_layers=3, num_heads=2, dqk=16, dv=16, embedding_dim=32, max_seq_len=1024,
                    dtype=torch.float32, item_vocab_size=500, position_table_size=1024)
TOL = 1e-5


class IssuingThreads(FaultyThreadCopyEngine):
    """Records the thread each onboarding is issued from."""

    def __init__(self) -> None:
        super().__init__()
        self.issuers: list[str] = []

    def _onboard(self, job: CopyJob) -> Transfer:
        self.issuers.append(threading.current_thread().name)
        return super()._onboard(job)


@pytest.fixture(scope="module")
def weights():
    return HSTUWeights.init(CONFIG, seed=5)


def make_engine(weights, issue, tmp_path=None, copy_engine=None, fetch=None, finish=None, **overrides):
    values = dict(cpu_cache_gb=0.02, gpu_cache_gb=0.01, page_size=16, transfer_timeout_s=5.0)
    if tmp_path is not None:
        values.update(ssd_cache_gb=0.05, ssd_cache_dir=str(tmp_path / "ssd"))
    values.update(overrides)
    return Engine(weights, Config(**values), copy_engine=copy_engine, issue=issue, fetch=fetch, finish=finish)


def reference(weights, history, candidates):
    return full_forward(weights, [history], [candidates]).scores


def items(rng, n):
    return [rng.randrange(CONFIG.item_vocab_size) for _ in range(n)]


@pytest.mark.parametrize("tier,layerwise", [(Tier.HOST, True), (Tier.HOST, False), (Tier.SSD, True)])
def test_thread_issue_scores_bitwise_like_the_inline_issue(weights, tmp_path, tier, layerwise):
    rng = random.Random(4)
    histories = {u: items(rng, n) for u, n in ((1, 37), (2, 300))}
    visit = [Request(u, items(rng, 2), items(rng, 5)) for u in histories]
    results = {}
    for issue in ("inline", "thread"):
        copier = IssuingThreads()
        with make_engine(weights, issue, tmp_path / issue, copier, enable_layerwise=layerwise) as engine:
            assert engine.paths.issue == issue
            engine.score([Request(u, h, []) for u, h in histories.items()])
            for u in histories:
                engine.kv.evict_from_gpu(u)
                if tier is Tier.SSD:
                    engine.kv.evict_from_host(u)
                assert engine.kv.tier(u) is tier
            copier.issuers.clear()
            results[issue] = engine.score(visit)
            assert copier.issuers and all((name == "layerflow-onboard-issue") == (issue == "thread")
                                          for name in copier.issuers), copier.issuers
            assert engine.kv.gpu.num_pinned == 0
    for u, inline, threaded in zip(histories, results["inline"], results["thread"]):
        assert torch.equal(inline, threaded), u
        assert torch.allclose(threaded, reference(weights, histories[u] + visit[u - 1].items,
                                                  visit[u - 1].candidates), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("issue,finish", [("thread", "after"), ("inline", "early"), ("thread", "early")])
def test_a_failed_onboarding_on_the_new_paths_fails_its_request_alone_then_the_engine_serves(weights, issue, finish):
    copier = FaultyThreadCopyEngine()
    history = list(range(60))
    with make_engine(weights, issue, copy_engine=copier, finish=finish) as engine:
        engine.score([Request(5, history, []), Request(6, history, [])])
        engine.kv.evict_from_gpu(5)
        copier.fail_at_layer = 1
        with pytest.raises(TransferError, match="injected failure at layer 1"):
            engine.score([Request(5, [1], [2, 3])])
        assert engine.kv.tier(5) is Tier.HOST and engine.kv.gpu.num_pinned == 0
        engine.kv.wait_offloads()
        assert engine.kv.below.usage().pinned_users == 0   # the failed onboarding's host pins went back
        assert engine.kv.users[5].history == history
        copier.fail_at_layer = None
        hit = engine.score([Request(6, [1], [2, 3])])[0]   # a GPU hit between: nothing of the failure is left
        assert torch.allclose(hit, reference(weights, history + [1], [2, 3]), atol=TOL)
        scores = engine.score([Request(5, [1], [2, 3])])[0]
        assert torch.equal(scores, hit)


def test_a_damaged_ssd_copy_found_by_the_issue_thread_is_recomputed_in_the_same_call(weights, tmp_path, caplog):
    """The SSD read-back runs on the issue thread: its miss reaches the block through the poisoned signal, and the
    engine recomputes the user within the call, as it does when the inline issue raises."""
    caplog.set_level(logging.WARNING)
    history = list(range(70))
    with make_engine(weights, "thread", tmp_path) as engine:
        engine.score([Request(1, history, [])])
        engine.kv.evict_from_gpu(1)
        engine.kv.evict_from_host(1)
        assert engine.kv.tier(1) is Tier.SSD
        (path,) = [p for p in (tmp_path / "ssd").iterdir() if p.suffix == ".kv"]
        path.unlink()
        scores = engine.score([Request(1, [5], [6, 7])])[0]
        assert torch.allclose(scores, reference(weights, history + [5], [6, 7]), atol=TOL, rtol=TOL)
        assert len([r for r in caplog.records if "recomputing" in r.getMessage()]) == 1
        assert engine.kv.gpu.num_pinned == 0


def test_a_bad_id_found_while_the_thread_issues_gives_everything_back(weights):
    with make_engine(weights, "thread") as engine:
        history = list(range(40))
        engine.score([Request(5, history, [])])
        engine.kv.evict_from_gpu(5)
        free = engine.kv.gpu.num_free
        with pytest.raises(ValueError, match="user 5: candidate item id 500"):
            engine.score([Request(5, [7], [CONFIG.item_vocab_size])])
        assert engine.kv.tier(5) is Tier.HOST and engine.kv.gpu.num_free == free and engine.kv.gpu.num_pinned == 0
        scores = engine.score([Request(5, [7], [1, 2])])[0]
        assert torch.allclose(scores, reference(weights, history + [7], [1, 2]), atol=TOL)


@pytest.mark.parametrize("layerwise", [True, False])
def test_an_early_finish_scores_bitwise_like_the_finish_after_the_block(weights, layerwise):
    rng = random.Random(6)
    history, visit = items(rng, 200), Request(4, items(rng, 3), items(rng, 6))
    results = []
    for finish in ("after", "early"):
        with make_engine(weights, "inline", finish=finish, enable_layerwise=layerwise) as engine:
            engine.score([Request(4, history, [])])
            engine.kv.evict_from_gpu(4)
            results.append(engine.score([visit])[0])
            engine.kv.wait_offloads()
            assert engine.kv.below.usage().pinned_users == 0 and engine.kv.gpu.num_pinned == 0
            assert all(engine.kv.below.signals._released)   # the counter went back with the host pins
    assert torch.equal(results[0], results[1])


def test_the_issue_mode_can_change_between_batches(weights, monkeypatch):
    monkeypatch.delenv("LAYERFLOW_ONBOARD_ISSUE", raising=False)
    with make_engine(weights, None) as engine:
        assert engine.paths.issue == "inline" and engine.kv.below.issue is None
        engine.paths.issue = "thread"
        assert engine.kv.below.issue is not None
        engine.score([Request(3, list(range(20)), [])])
        engine.kv.evict_from_gpu(3)
        threaded = engine.score([Request(3, [1], [2])])[0]
        engine.kv.truncate(3, 20)
        engine.kv.evict_from_gpu(3)
        engine.paths.issue = "inline"
        assert engine.kv.below.issue is None
        assert torch.equal(engine.score([Request(3, [1], [2])])[0], threaded)


@pytest.mark.parametrize("name,value", [("issue", "later"), ("fetch", "poll"), ("finish", "soon")])
def test_an_unknown_mode_is_refused_by_name(weights, name, value):
    with pytest.raises(ValueError, match=f"{name}='{value}'"):
        make_engine(weights, **{"issue": None, name: value})


def test_the_env_var_picks_the_issue_mode(weights, monkeypatch):
    monkeypatch.setenv("LAYERFLOW_ONBOARD_ISSUE", "thread")
    with make_engine(weights, None) as engine:
        assert engine.paths.issue == "thread"
