"""Statistics of the benchmark on known inputs: percentiles, the layerwise lower bound, per-layer times."""

import numpy as np
import pytest

from layerflow.bench.stats import Bound, Summary, layer_times, lower_bound, percentile


def test_percentiles_interpolate_between_ranks():
    samples = [float(x) for x in (10, 1, 9, 2, 8, 3, 7, 4, 6, 5)]
    assert percentile(samples, 50) == pytest.approx(5.5)
    assert percentile(samples, 90) == pytest.approx(9.1)
    assert percentile(samples, 0) == 1.0 and percentile(samples, 100) == 10.0
    assert percentile([3.0], 90) == 3.0
    assert percentile((2.0, 4.0), 25) == pytest.approx(2.5)
    s = Summary.of([4.0, 1.0, 2.0, 3.0])
    assert (s.median, s.p90) == (pytest.approx(2.5), pytest.approx(3.7))
    assert s.to_dict() == {"median": s.median, "p90": s.p90, "samples": [4.0, 1.0, 2.0, 3.0]}


def test_percentiles_refuse_an_empty_sample_and_a_q_out_of_range():
    with pytest.raises(ValueError, match="samples"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q=101"):
        percentile([1.0], 101)
    with pytest.raises(ValueError, match="q=-1"):
        percentile(np.array([1.0, 2.0]), -1)


def test_lower_bound_takes_the_slower_of_its_two_paths():
    # transfer-bound: the whole transfer, then the last layer's compute
    assert lower_bound(t_transfer=10.0, t_compute=5.0, t_first_layer_transfer=2.0, t_last_layer_compute=1.0) == 11.0
    # compute-bound: the whole compute, after the first layer landed
    assert lower_bound(t_transfer=4.0, t_compute=7.0, t_first_layer_transfer=0.5, t_last_layer_compute=1.0) == 7.5
    with pytest.raises(ValueError, match="t_transfer"):
        lower_bound(-1.0, 1.0, 1.0, 1.0)


def test_bound_efficiencies():
    b = Bound(measured=12.5, t_transfer=10.0, t_compute=5.0, transfer_layers=(2.0, 8.0),
              compute_layers=(4.0, 1.0), bulk_memcpy=9.5, transfer_bytes=10**9)
    assert b.lower_bound == 11.0
    assert b.pipeline_efficiency == pytest.approx(11.0 / 12.5)
    assert b.transfer_efficiency == pytest.approx(0.95)
    d = b.to_dict()
    assert d["onboard_gb_per_s"] == pytest.approx(100.0) and d["bulk_gb_per_s"] == pytest.approx(1e3 / 9.5)
    assert d["t_first_layer_transfer"] == 2.0 and d["t_last_layer_compute"] == 1.0


def test_layer_times():
    assert layer_times([0.0, 1.5, 4.0], 4.5) == [1.5, 2.5, 0.5]
    with pytest.raises(ValueError, match="decrease"):
        layer_times([0.0, 2.0], 1.0)
