"""The engine with a transfer server as the tier below the GPU: the same scores as in-process, bitwise; a server that
dies fails the waiting batch at once and the engine serves the next one."""

import logging
import os
import random
import signal
import threading
import time

import pytest
import torch

from layerflow.model import HSTUConfig, HSTUWeights, full_forward
from layerflow.runtime.engine import Engine
from layerflow.runtime.kv_manager import Tier
from layerflow.server.remote_tier import RemoteTier
from layerflow.tier.in_process import InProcessTier
from layerflow.runtime.request import Request
from layerflow.config import Config
from layerflow.transfer.errors import TransferError
from layerflow.tier.gpu_pool import GpuKVPool
from layerflow.tier.layout import KVLayout
from layerflow.server import NotResident, spawn_server

CONFIG = HSTUConfig(num_layers=3, num_heads=2, dqk=16, dv=16, embedding_dim=32, max_seq_len=1024,
                    dtype=torch.float32, item_vocab_size=500, position_table_size=1024)
CUDA_CONFIG = HSTUConfig(num_layers=3, num_heads=2, dqk=64, dv=64, embedding_dim=128, max_seq_len=1024,
                         dtype=torch.float32, item_vocab_size=500, position_table_size=1024)
PAGE = 16
HISTORY = 300                        # 19 blocks per user
TIGHT = 45    # host blocks: two such users, not three, so the oldest spills to SSD
ROOMY = 200


@pytest.fixture(scope="module")
def weights():
    return HSTUWeights.init(CONFIG, seed=3)


def make_config(tmp_path, name: str, host_blocks: int = ROOMY, model: HSTUConfig = CONFIG,
                **overrides) -> Config:
    block_bytes = KVLayout.for_hstu(model, PAGE).page_bytes
    values = dict(cpu_cache_gb=host_blocks * block_bytes / 2**30, gpu_cache_gb=200 * block_bytes / 2**30, page_size=PAGE, transfer_timeout_s=5.0,
                  ssd_cache_gb=0.05, ssd_cache_dir=str(tmp_path / f"ssd-{name}"))
    values.update(overrides)
    return Config(**values)


def items(rng, n):
    return [rng.randrange(CONFIG.item_vocab_size) for _ in range(n)]


def visit(engine, histories: dict, placement: dict, tol: float) -> list[torch.Tensor]:
    """First visits one user at a time, then place each user (GPU stays; HOST: off the GPU; SSD: spilled by the host's
    own pressure when a third user arrived), then one batch of return visits, checked against a full recompute."""
    rng = random.Random(0)
    for u, h in histories.items():
        engine.score([Request(u, h, [])])
        engine.kv.wait_offloads()
    for u, tier in placement.items():
        if tier in (Tier.HOST, Tier.SSD):
            engine.kv.evict_from_gpu(u)
        assert engine.kv.tier(u) is tier, (u, engine.kv.tier(u))
    requests = [Request(u, items(rng, 1 + u % 3), items(rng, 4)) for u in placement]
    out = engine.score(requests)
    for r, scores in zip(requests, out):
        ref = full_forward(engine.weights, [histories.get(r.user_id, []) + r.items], [r.candidates]).scores
        assert torch.allclose(scores.cpu(), ref.cpu().float(), atol=tol, rtol=tol)
    return out


SCENARIOS = {  # the return batch's users and where they are before it, layerwise, host blocks
    "gpu_hit": ({1: Tier.GPU}, True, ROOMY),
    "host_hit": ({1: Tier.HOST}, True, ROOMY),
    "host_hit_not_layerwise": ({1: Tier.HOST}, False, ROOMY),
    "ssd_hit": ({1: Tier.SSD, 3: Tier.GPU}, True, TIGHT),
    "several_host_hits": ({1: Tier.GPU, 2: Tier.HOST, 3: Tier.HOST, 4: Tier.HOST}, True, ROOMY),
    "mixed_ssd_host_miss": ({1: Tier.SSD, 2: Tier.HOST, 9: Tier.NONE}, True, TIGHT),
}


def histories_for(placement: dict) -> dict:
    rng = random.Random(11)
    users = sorted(set(placement) | {1, 2, 3}) if Tier.SSD in placement.values() else sorted(placement)
    return {u: items(rng, HISTORY) for u in users if placement.get(u) is not Tier.NONE}


def compare(weights, tmp_path, scenario: str, device: str, tol: float) -> None:
    """The same visits on an in-process engine and on one with its own server: bitwise the same scores, and the
    server engine onboards the return batch's host and SSD hits in ONE request."""
    placement, layerwise, host_blocks = SCENARIOS[scenario]
    histories = histories_for(placement)
    results = {}
    for name, extra in (("local", {}), ("server", {"spawn_server": True})):
        config = make_config(tmp_path, name, host_blocks, weights.config, enable_layerwise=layerwise, **extra)
        with Engine(weights, config, device=device, batch_buckets=(1, 4), token_buckets=(64, 512)) as engine:
            engine.warmup()
            assert isinstance(engine.kv.below, RemoteTier if extra else InProcessTier)
            if extra:
                client, onboarded = engine.kv.below.client, []
                send = client.onboard_many
                client.onboard_many = lambda loads, lw: onboarded.append([load[0] for load in loads]) or send(loads, lw)
            results[name] = visit(engine, histories, placement, tol)
    hits = [u for u, tier in placement.items() if tier in (Tier.HOST, Tier.SSD)]
    assert onboarded == ([hits] if hits else [])
    for a, b in zip(results["local"], results["server"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_server_tier_scores_bitwise_like_in_process(weights, tmp_path, scenario):
    compare(weights, tmp_path, scenario, "cpu", 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_server_tier_scores_bitwise_like_in_process_on_cuda(tmp_path, scenario):
    """Triton kernels, CUDA IPC pool, the server's CUDA copies and the graphs' eventfd host nodes."""
    compare(HSTUWeights.init(CUDA_CONFIG, seed=3), tmp_path, scenario, "cuda", 2e-2)


def _wait_stopped(pid: int) -> None:
    """SIGSTOP is asynchronous: wait until the kernel reports the process stopped ('T'), or the server could still
    answer the next request."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop")


def test_server_killed_while_a_batch_waits_recomputes_it_at_once_then_falls_back(weights, tmp_path, caplog):
    """The batch waiting on a killed server is released by the hang-up (not the 30 s timeout), its users' KV is gone
    with the server, so the same call recomputes them in-process: right scores, nothing raised."""
    rng = random.Random(5)
    history = {4: items(rng, 120), 5: items(rng, 80)}
    config = make_config(tmp_path, "kill", spawn_server=True, transfer_timeout_s=30.0)
    caplog.set_level(logging.WARNING, logger="layerflow.runtime.engine")
    with Engine(weights, config, device="cpu") as engine:
        below = engine.kv.below
        pid = below.server.pid
        for u, h in history.items():
            engine.score([Request(u, h, [])])
        engine.kv.wait_offloads()
        for u in history:
            engine.kv.evict_from_gpu(u)
        send = below.client.onboard_many
        killer = threading.Thread(target=lambda: (time.sleep(0.3), below.server.kill()))

        def stop_then_send(*args, **kwargs):
            os.kill(pid, signal.SIGSTOP)  # the onboarding is sent and never answered; the batch waits on layer 0
            _wait_stopped(pid)
            sent = send(*args, **kwargs)
            killer.start()
            return sent

        below.client.onboard_many = stop_then_send
        start = time.monotonic()
        reqs = [Request(4, [1], [2, 3]), Request(5, [4], [5])]
        out = engine.score(reqs)
        killer.join()
        assert time.monotonic() - start < 5.0   # released by the hang-up, not by the 30 s timeout
        lost = [r for r in caplog.records if "had no usable KV" in r.getMessage()]
        assert len(lost) == 1 and "[4, 5]" in lost[0].getMessage()
        for r, scores in zip(reqs, out):
            history[r.user_id] = history[r.user_id] + r.items
            ref = full_forward(weights, [history[r.user_id]], [r.candidates]).scores
            assert torch.allclose(scores, ref, atol=1e-5, rtol=1e-5)
        assert isinstance(engine.kv.below, InProcessTier)

        more = {4: [1], 5: [4]}
        engine.kv.wait_offloads()
        for u in history:
            engine.kv.evict_from_gpu(u)
            assert engine.kv.tier(u) is Tier.HOST     # offloaded to the in-process tier that took over
        reqs = [Request(u, more[u], [7, 8]) for u in history]
        for r, scores in zip(reqs, engine.score(reqs)):
            history[r.user_id] = history[r.user_id] + r.items
            ref = full_forward(weights, [history[r.user_id]], [r.candidates]).scores
            assert torch.allclose(scores, ref, atol=1e-5, rtol=1e-5)
        falls = [r for r in caplog.records if "serving from an in-process host tier" in r.getMessage()]
        assert len(falls) == 1


class Restartable:
    """A transfer server in one run directory that a test kills and starts again; `config` points an engine at it."""

    def __init__(self, tmp_path) -> None:
        self.run_dir = tmp_path / "run"
        self.server_config = make_config(tmp_path, "srv", ssd_cache_gb=0.0, ssd_cache_dir=None)
        self.servers = [spawn_server(self.server_config, self.run_dir)]
        self.config = make_config(tmp_path, "eng", server_socket=str(self.servers[0].socket_path), ssd_cache_gb=0.0,
                                  ssd_cache_dir=None)

    def kill(self) -> None:
        self.servers[-1].kill()

    def restart(self) -> None:
        self.servers.append(spawn_server(self.server_config, self.run_dir))

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture
def restartable(tmp_path):
    servers = Restartable(tmp_path)
    yield servers
    servers.stop()


def test_engine_reconnects_to_a_restarted_server(weights, restartable):
    with Engine(weights, restartable.config, device="cpu") as engine:
        engine.score([Request(1, list(range(40)), [])])
        engine.kv.wait_offloads()
        restartable.kill()
        deadline = time.monotonic() + 5
        while engine.kv.below.client.connected and time.monotonic() < deadline:
            time.sleep(0.01)
        restartable.restart()
        engine.kv.evict_from_gpu(1)
        scores = engine.score([Request(1, [3], [4, 5])])[0]  # reconnected; the new server holds nothing: a miss
        assert isinstance(engine.kv.below, RemoteTier) and engine.kv.below.client.connected
        ref = full_forward(weights, [list(range(40)) + [3]], [[4, 5]]).scores
        assert torch.allclose(scores, ref, atol=1e-5, rtol=1e-5)
        engine.kv.wait_offloads()
        engine.kv.evict_from_gpu(1)
        assert engine.kv.tier(1) is Tier.HOST  # and the next visit is a host hit on the new server
        engine.kv.drop(1)
        assert engine.kv.tier(1) is Tier.NONE and engine.kv.below.client.lookup(1) == ("none", 0)


def test_config_and_pool_checks():
    with pytest.raises(ValueError, match="spawn_server=True and server_socket"):
        Config(spawn_server=True, server_socket="/tmp/x.sock")
    layout = KVLayout.for_hstu(CONFIG, PAGE)
    pool = GpuKVPool(layout, 4)
    assert GpuKVPool(layout, 4, layers=pool.kv).kv[0] is pool.kv[0]
    with pytest.raises(ValueError, match=r"layers\[0\]"):
        GpuKVPool(layout, 5, layers=pool.kv)
    with pytest.raises(ValueError, match="signal='event' with a transfer server"):
        Engine(HSTUWeights.init(CONFIG, seed=0), Config(spawn_server=True, signal="event"), device="cuda")


def test_drop_forgets_a_user_in_every_tier_in_process(weights, tmp_path):
    with Engine(weights, make_config(tmp_path, "drop"), device="cpu") as engine:
        engine.score([Request(1, list(range(40)), [])])
        engine.kv.evict_from_gpu(1)
        engine.kv.evict_from_host(1)
        assert engine.kv.tier(1) is Tier.SSD and engine.kv.below.usage().ssd_users == 1
        engine.kv.drop(1)
        usage = engine.kv.below.usage()
        assert engine.kv.tier(1) is Tier.NONE and usage.host_users == 0 and usage.ssd_users == 0
        scores = engine.score([Request(1, [5], [6])])[0]  # a new user now: only the appended item is its history
        assert torch.allclose(scores, full_forward(weights, [[5]], [[6]]).scores, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_hung_server_never_writes_into_pages_another_user_was_given(weights, tmp_path, device):
    """Issue 16.1: a SIGSTOPped server fails the waiting batch after ONE timeout; the pages it may still write stay
    quarantined, so a new user gets other pages and its scores stay right after the server resumes and writes late.
    While it hangs, a lookup fails fast: a cached user is served as a miss instead of waiting a timeout. On CUDA the
    server's copy engine writes through CUDA IPC, the engine waits in native eventfd host nodes."""
    timeout = 3.0 if device == "cpu" else 10.0   # room for the first Triton compiles of a shape on the GPU
    model = CONFIG if device == "cpu" else CUDA_CONFIG
    if device == "cuda":
        weights = HSTUWeights.init(CUDA_CONFIG, seed=3)
    tol = 1e-5 if device == "cpu" else 2e-2
    config = make_config(tmp_path, "hung", model=model, spawn_server=True, transfer_timeout_s=timeout,
                         gpu_cache_gb=60 * KVLayout.for_hstu(model, PAGE).page_bytes / 2**30)
    rng = random.Random(11)
    history = {1: items(rng, 300), 2: items(rng, 200), 3: items(rng, 250)}
    with Engine(weights, config, device=device) as engine:
        below = engine.kv.below
        pid = below.server.pid
        for u in (1, 3):
            engine.score([Request(u, history[u], [])])
        engine.kv.wait_offloads()
        for u in (1, 3):
            engine.kv.evict_from_gpu(u)
        send = below.client.onboard_many

        def stop_then_send(*args, **kwargs):
            os.kill(pid, signal.SIGSTOP)
            _wait_stopped(pid)
            return send(*args, **kwargs)

        below.client.onboard_many = stop_then_send
        try:
            start = time.monotonic()
            with pytest.raises(TransferError):
                engine.score([Request(1, [5], [6])])
            assert time.monotonic() - start < 2 * timeout          # one timeout for the batch, not one per layer
            below.client.onboard_many = send
            assert engine.kv.quarantined_pages == 19               # user 1's 300 tokens in pages of 16
            start = time.monotonic()
            scores = engine.score([Request(2, history[2], [7, 8])])[0]   # a new user, its pages are not user 1's
            hit3 = engine.score([Request(3, [9], [10])])[0]               # cached below, the server hung: a miss
            assert time.monotonic() - start < timeout
            history[3] = history[3] + [9]
            ref3 = full_forward(weights, [history[3]], [[10]]).scores.cpu()
            assert torch.allclose(hit3.cpu(), ref3, atol=tol, rtol=tol)
        finally:
            os.kill(pid, signal.SIGCONT)                           # it resumes and copies user 1's KV, late
        deadline = time.monotonic() + 10
        while below.client.in_flight() and time.monotonic() < deadline:   # the late answers arrive
            time.sleep(0.05)
        engine.kv.wait_offloads()
        again = engine.score([Request(2, [], [7, 8])])[0].cpu()     # a GPU hit on pages the late copy must not touch
        assert torch.allclose(again, scores.cpu(), atol=tol, rtol=tol)
        ref2 = full_forward(weights, [history[2]], [[7, 8]]).scores.cpu()
        assert torch.allclose(again, ref2, atol=tol, rtol=tol)
        assert engine.kv.quarantined_pages == 0                    # given back once the server answered


def test_the_engine_switches_back_to_a_server_that_returns_after_a_fallback(weights, restartable, caplog):
    """Issue 16.11: after falling back to an in-process tier, the engine retries the server's socket with backoff
    and, once it answers, serves from it again (both logged)."""
    caplog.set_level(logging.WARNING, logger="layerflow.runtime")
    with Engine(weights, restartable.config, device="cpu") as engine:
        engine.score([Request(1, list(range(40)), [])])
        restartable.kill()
        engine.score([Request(2, list(range(30)), [])])          # the server is gone: in-process from now on
        assert isinstance(engine.kv.below, InProcessTier)
        restartable.restart()
        time.sleep(1.1)                                           # the first retry comes after a second
        scores = engine.score([Request(1, [3], [4, 5])])[0]
        assert isinstance(engine.kv.below, RemoteTier) and engine.kv.below.client.connected
        ref = full_forward(weights, [list(range(40)) + [3]], [[4, 5]]).scores
        assert torch.allclose(scores, ref, atol=1e-5, rtol=1e-5)
    messages = [r.getMessage() for r in caplog.records]
    assert any("serving from an in-process host tier" in m for m in messages)
    assert any("transfer server is back" in m for m in messages)
