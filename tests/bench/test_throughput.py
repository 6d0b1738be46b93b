"""Throughput mode's stream and batching, on known inputs."""

import pytest

from layerflow.bench.throughput import ThroughputSettings, stream, take_batch


def test_stream_is_open_loop_poisson_with_zipf_users():
    s = ThroughputSettings(preset="tiny", history_len=64, append_len=4, num_candidates=8, num_users=20, gpu_users=4,
                           num_requests=4000, rate=100.0, zipf=1.0, batch_size=2)
    arrivals = stream(s)
    times = [t for t, _ in arrivals]
    assert times == sorted(times) and times[0] > 0
    assert len(arrivals) / times[-1] == pytest.approx(100.0, rel=0.1)
    counts = [sum(1 for _, u in arrivals if u == k) for k in range(20)]
    assert counts[0] > 3 * counts[9] > 0
    with pytest.raises(ValueError, match="gpu_users=20"):
        ThroughputSettings(preset="tiny", history_len=64, append_len=4, num_candidates=8, num_users=20,
                           gpu_users=20, num_requests=10, rate=1.0, zipf=1.0, batch_size=1)


def test_take_batch_keeps_one_request_per_user():
    users = [5, 5, 7, 8, 7, 9]
    assert take_batch([0, 1, 2, 3, 4, 5], users, 3) == [0, 2, 3]
    assert take_batch([1, 4, 5], users, 4) == [1, 4, 5]


def test_batch_buckets_are_powers_of_two_up_to_the_batch_size():
    s = ThroughputSettings(preset="tiny", history_len=64, append_len=4, num_candidates=8, num_users=20, gpu_users=4,
                           num_requests=10, rate=1.0, zipf=1.0, batch_size=6)
    assert s.batch_buckets == (1, 2, 4, 6)
    assert s.query_tokens(3) == 64
