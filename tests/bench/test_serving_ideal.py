"""The ideal-server simulation: unloaded requests cost exactly one compute (plus a copy for a host hit), an
overloaded ideal server stays within the copy engine's bound and the hottest user's cap, and the FIFO copy queue's
mean wait is Pollaczek-Khinchine's."""

import pytest

from layerflow.bench.serving_ideal import IdealServer, fifo_copy_queue
from layerflow.bench.throughput import ThroughputSettings, stream

GPU_HIT_MS = {1: 0.5, 2: 0.7, 3: 0.8, 4: 1.0}
SERVER = IdealServer(copy_ms=2.0, gpu_hit_ms=GPU_HIT_MS, num_layers=4)


def workload(**overrides) -> ThroughputSettings:
    values = dict(preset="tiny", history_len=64, append_len=4, num_candidates=8, num_users=32, gpu_users=8,
                  num_requests=3000, rate=1.0, zipf=1.0, batch_size=4)
    return ThroughputSettings(**(values | overrides))


def test_an_unloaded_request_takes_one_compute_and_a_host_hit_its_copy_first():
    run = SERVER.unloaded(workload(num_requests=400))
    assert run["mean_batch"] == 1.0 and 0 < run["host_share"] < 1
    assert run["p50_ms"] in (pytest.approx(0.5), pytest.approx(2.0 + 0.5 / 4))
    assert run["p99_ms"] == pytest.approx(2.0 + 0.5 / 4)


def test_an_overloaded_ideal_server_stays_within_the_copy_bound_and_the_hot_users_cap():
    w = workload(rate=5000.0)
    run = SERVER.serve(w)
    users = [u for _, u in stream(w)]
    hot = max(users.count(u) for u in set(users)) / len(users)
    assert run["throughput"] <= SERVER.bound(run["host_share"]) * 1.001
    assert run["throughput"] <= run["batches_per_s"] / hot * 1.001
    assert 0.9 < run["copy_busy"] <= 1.0 and 1 < run["mean_batch"] <= 4


def test_the_latency_grows_with_the_load():
    low, high = (SERVER.serve(workload(rate=r)) for r in (100.0, 400.0))
    assert low["p99_ms"] < high["p99_ms"] and low["mean_batch"] < high["mean_batch"]


def test_the_fifo_copy_queues_mean_wait_is_pollaczek_khinchines():
    run = fifo_copy_queue(copy_ms=2.0, host_share=0.4, fraction=0.7, requests=300_000)
    assert run["mean_wait_ms"] == pytest.approx(run["pk_mean_wait_ms"], rel=0.08)
    assert run["p50_ms"] < run["p99_ms"]


@pytest.mark.parametrize("kwargs, match", [(dict(copy_ms=0.0), "copy_ms=0.0"),
                                           (dict(gpu_hit_ms={1: 0.5, 3: 0.9}), "gpu_hit_ms="),
                                           (dict(num_layers=0), "num_layers=0")])
def test_bad_costs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        IdealServer(**(dict(copy_ms=2.0, gpu_hit_ms=GPU_HIT_MS, num_layers=4) | kwargs))


def test_a_batch_beyond_the_measured_sizes_and_a_bad_fraction_are_refused():
    with pytest.raises(ValueError, match="batch_size=8"):
        SERVER.serve(workload(batch_size=8, gpu_users=8))
    with pytest.raises(ValueError, match="fraction=1.0"):
        fifo_copy_queue(2.0, 0.4, 1.0, 10)
