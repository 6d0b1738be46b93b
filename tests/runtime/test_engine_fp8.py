"""The engine with an fp8 KV cache on the CPU path: every tier serves the fp8 engine's own full recompute, scores stay
close to the exact cache's, the GPU pool holds about twice the users of bf16, and bad settings are refused."""

import random

import pytest
import torch

from layerflow.config import Config, load_config
from layerflow.model import HSTUConfig, HSTUWeights, full_forward
from layerflow.runtime.engine import Engine
from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.request import Request
from layerflow.tier.layout import KV_CACHE_DTYPES, KVLayout
from tests.runtime.test_engine import place

CONFIG = HSTUConfig(num_layers=3, num_heads=2, dqk=16, dv=16, embedding_dim=32, max_seq_len=1024,
                    dtype=torch.float32, item_vocab_size=500, position_table_size=1024)
FP8 = ("fp8_e4m3", "fp8_e5m2")


@pytest.fixture(scope="module")
def weights():
    return HSTUWeights.init(CONFIG, seed=1)


def engine_of(weights, kv_cache_dtype, tmp_path=None, **overrides):
    values = dict(cpu_cache_gb=0.02, gpu_cache_gb=0.01, page_size=16, transfer_timeout_s=2.0,
                  kv_cache_dtype=kv_cache_dtype)
    if tmp_path is not None:
        values.update(ssd_cache_gb=0.05, ssd_cache_dir=str(tmp_path / "ssd"))
    values.update(overrides)
    return Engine(weights, Config(**values))


def items(rng, n):
    return [rng.randrange(CONFIG.item_vocab_size) for _ in range(n)]


@pytest.mark.parametrize("kv_cache_dtype", FP8)
@pytest.mark.parametrize("tier", [Tier.GPU, Tier.HOST, Tier.SSD])
def test_every_tier_of_an_fp8_engine_serves_its_own_recompute(weights, tmp_path, kv_cache_dtype, tier):
    """The scales travel with their pages: a host or SSD hit gives the GPU hit's scores bit for bit, and since a
    token's codes depend on it alone, the cached step is the fp8 engine's full recompute."""
    rng = random.Random(0)
    histories = {u: items(rng, n) for u, n in ((2, 37), (3, 300))}
    appended = {u: items(rng, n) for u, n in ((2, 1), (3, 6))}
    cands = {u: items(rng, 7) for u in histories}
    requests = [Request(u, appended[u], cands[u]) for u in histories]
    with engine_of(weights, kv_cache_dtype) as engine:
        engine.score([Request(u, h, []) for u, h in histories.items()])
        gpu_hit = engine.score(requests)
    with engine_of(weights, kv_cache_dtype) as engine:
        recompute = engine.score([Request(u, histories[u] + appended[u], cands[u]) for u in histories])
    with engine_of(weights, kv_cache_dtype, tmp_path) as engine:
        engine.score([Request(u, h, []) for u, h in histories.items()])
        for u in histories:
            place(engine, u, tier)
            assert engine.kv.tier(u) is tier
        served = engine.score(requests)
    for u, hit, again, full in zip(histories, gpu_hit, served, recompute):
        assert torch.equal(again, hit), (tier, u)
        torch.testing.assert_close(hit, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype,bound", [("fp8_e4m3", 0.02), ("fp8_e5m2", 0.05)])
def test_fp8_scores_stay_close_to_the_exact_cache(weights, kv_cache_dtype, bound):
    rng = random.Random(1)
    history, more, cands = items(rng, 400), items(rng, 8), items(rng, 50)
    exact = full_forward(weights, [history + more], [cands]).scores
    with engine_of(weights, kv_cache_dtype) as engine:
        engine.score([Request(5, history, [])])
        scores = engine.score([Request(5, more, cands)])[0]
    error = float((scores - exact).abs().max() / exact.abs().max())
    assert 0 < error < bound


def users_before_first_eviction(weights, kv_cache_dtype, gpu_cache_gb) -> int:
    rng = random.Random(2)
    with engine_of(weights, kv_cache_dtype, gpu_cache_gb=gpu_cache_gb, cpu_cache_gb=0.1,
                   page_size=32) as engine:
        for user in range(1000):
            engine.score([Request(user, items(rng, 100), [])])
            engine.kv.wait_offloads()
            if len(engine.kv.gpu.users()) <= user:
                return user
    raise AssertionError("no eviction")


def test_the_gpu_pool_holds_about_twice_the_users_of_bf16():
    """100 tokens per user is 4 pages of 32; an fp8 page (D=64) is 33/64 of a bf16 one: 1.94x the users."""
    model = HSTUConfig(num_layers=2, num_heads=2, dqk=64, dv=64, embedding_dim=64, max_seq_len=1024,
                       dtype=torch.bfloat16, item_vocab_size=500, position_table_size=1024)
    weights = HSTUWeights.init(model, seed=2)
    gb = 60.5 * KVLayout.for_hstu(model, 32).page_bytes / 2**30      # 60 bf16 pages: 15 users
    bf16 = users_before_first_eviction(weights, "auto", gb)
    fp8 = users_before_first_eviction(weights, "fp8_e4m3", gb)
    assert bf16 == 15
    assert fp8 == KVLayout.for_hstu(model, 32, "fp8_e4m3").pages_for_gb(gb) // 4 == 29
    assert fp8 >= 1.9 * bf16


def test_a_bad_kv_cache_dtype_is_an_error_naming_the_key(tmp_path):
    assert sorted(KV_CACHE_DTYPES) == sorted(("auto", *FP8))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp16'"):
        Config(kv_cache_dtype="fp16")
    path = tmp_path / "layerflow.yaml"
    path.write_text("kv_cache_dtype: float8\n")
    with pytest.raises(ValueError, match=r"layerflow.yaml: kv_cache_dtype='float8'"):
        load_config(path, env={})
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        KVLayout.for_hstu(CONFIG, 16, "int8")


def test_an_fp8_cache_with_a_transfer_server_is_refused(weights):
    with pytest.raises(ValueError, match="fp8 KV cache .* transfer server"):
        engine_of(weights, "fp8_e4m3", spawn_server=True)
