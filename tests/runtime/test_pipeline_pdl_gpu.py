"""The pipeline's early launches (LAYERFLOW_PDL=on) and the attention's history cap (LAYERFLOW_SPLIT_MIN_TILES) in
the engine on an H200, over hstu-bench's seed model and request (BS=1, 2K history, 64 appended + 256 candidates, the
320-token bucket: the kernels the benchmark runs): early launches change no bit of a GPU hit's or a host hit's
scores, with or without graphs, behind each wait node; the cap's scores are the table's within bf16 roundings."""

import pytest
import torch

from layerflow.bench.settings import GPU_DEFAULTS, Settings
from layerflow.bench.workload import Workload
from layerflow.config import Config, SignalMode
from layerflow.model import HSTUWeights
from layerflow.runtime.engine import Engine
from layerflow.runtime.pipeline import MIN_TILES_ENV, PDL_ENV

pytestmark = pytest.mark.gpu

MODEL = Settings(**GPU_DEFAULTS, batch_size=1, scenarios=("gpu_hit",)).model


@pytest.fixture(scope="module")
def weights():
    return HSTUWeights.init(MODEL, seed=0)


def scores(weights: HSTUWeights, host_hit: bool, signal: SignalMode = SignalMode.EVENTFD,
           graph: bool = True) -> list[torch.Tensor]:
    """One request's scores: its user's 2K history computed first (then evicted to the host for a host hit)."""
    config = Config(cpu_cache_gb=1.0, gpu_cache_gb=1.0, page_size=32, signal=signal, enable_layerwise=True,
                    transfer_timeout_s=5.0)
    with Engine(weights, config, device="cuda", use_cuda_graph=graph, batch_buckets=(1,),
                token_buckets=(320,)) as engine:
        engine.warmup()
        workload = Workload.build([0], 2048, 64, 256, MODEL, 0)
        workload.load(engine)
        if host_hit:
            engine.kv.evict_from_gpu(0)
        return [s.clone() for s in engine.score(workload.requests)]


@pytest.mark.parametrize("host_hit,signal,graph", [(False, SignalMode.EVENTFD, True),
                                                   (False, SignalMode.EVENTFD, False),
                                                   (True, SignalMode.EVENTFD, True),
                                                   (True, SignalMode.WAITVALUE, True),
                                                   (True, SignalMode.EVENT, True)],
                         ids=["gpu-graph", "gpu-eager", "host-eventfd", "host-waitvalue", "host-event"])
def test_early_launches_change_no_bit(weights, monkeypatch, host_hit, signal, graph):
    monkeypatch.setenv(PDL_ENV, "off")
    want = scores(weights, host_hit, signal, graph)
    monkeypatch.setenv(PDL_ENV, "on")
    got = scores(weights, host_hit, signal, graph)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("pdl", ["off", "on"])
def test_history_cap_scores_like_the_table(weights, monkeypatch, pdl):
    """At 2K the cap of 4 tiles per split takes 8 splits where the table takes 11: another order of the same sums."""
    monkeypatch.setenv(PDL_ENV, pdl)
    monkeypatch.setenv(MIN_TILES_ENV, "0")
    want = scores(weights, host_hit=False)
    monkeypatch.setenv(MIN_TILES_ENV, "4")
    got = scores(weights, host_hit=False)
    for a, b in zip(got, want):
        assert float((a.double() - b.double()).abs().max() / b.double().abs().max()) < 1e-2
