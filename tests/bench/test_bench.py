"""The inference benchmark on the CPU path: every scenario measured on the tier it claims, well-formed outputs, and
the statistics (percentiles, the layerwise lower bound) on known inputs."""

import argparse
import json

import pytest
import torch

from layerflow.bench import report as bench_report
from layerflow.bench.inference import (DEFAULT_SCENARIOS, SCENARIOS, Settings, add_arguments, main, parse_length,
                                     parse_lengths, run)
from layerflow.bench.stats import Bound, Summary, layer_times, lower_bound, percentile
from layerflow.bench.throughput import ThroughputSettings, stream, take_batch

CPU = torch.device("cpu")
LENGTHS = (64, 96)


def settings(**overrides) -> Settings:
    values = dict(preset="tiny", seq_lens=LENGTHS, append_len=4, num_candidates=8, batch_size=1, timed_iters=2,
                  warmup_iters=1, scenarios=DEFAULT_SCENARIOS)
    values.update(overrides)
    return Settings(**values)


@pytest.fixture(scope="module")
def results():
    return run(settings(), CPU)


# ---- statistics -------------------------------------------------------------------------------------


def test_percentiles_interpolate_between_ranks():
    samples = [float(x) for x in (10, 1, 9, 2, 8, 3, 7, 4, 6, 5)]
    assert percentile(samples, 50) == pytest.approx(5.5)
    assert percentile(samples, 90) == pytest.approx(9.1)
    assert percentile(samples, 0) == 1.0 and percentile(samples, 100) == 10.0
    assert percentile([3.0], 90) == 3.0
    s = Summary.of([4.0, 1.0, 2.0, 3.0])
    assert (s.median, s.p90) == (pytest.approx(2.5), pytest.approx(3.7))
    with pytest.raises(ValueError, match="samples"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q=101"):
        percentile([1.0], 101)


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


def test_layer_times_and_lengths():
    assert layer_times([0.0, 1.5, 4.0], 4.5) == [1.5, 2.5, 0.5]
    with pytest.raises(ValueError, match="decrease"):
        layer_times([0.0, 2.0], 1.0)
    assert parse_lengths("2K, 4k,512") == (2048, 4096, 512)
    with pytest.raises(ValueError, match="'2M'"):
        parse_length("2M")


def test_settings_refuse_bad_values():
    with pytest.raises(ValueError, match="warm_hit"):
        settings(scenarios=("warm_hit",))
    with pytest.raises(ValueError, match="max_seq_len"):
        settings(seq_lens=(4096,))
    with pytest.raises(ValueError, match="timed_iters=0"):
        settings(timed_iters=0)


def test_layerwise_scenarios_bring_the_gpu_hit_they_are_bounded_by():
    names = [s.name for s in settings(scenarios=("cpu_hit_layerwise",)).scenario_list()]
    assert names == ["gpu_hit", "cpu_hit_layerwise"]


# ---- the CPU run ------------------------------------------------------------------------------------


def test_every_scenario_is_measured_on_the_tier_it_names(results):
    expected = {"no_cache": "none", "gpu_hit": "gpu", "cpu_hit": "host", "cpu_hit_layerwise": "host",
                "ssd_hit": "ssd", "ssd_hit_layerwise": "ssd", "torch_eager": "gpu"}
    assert set(expected) == set(SCENARIOS)
    for seq_len in LENGTHS:
        for name, tier in expected.items():
            m = results.get(name, seq_len)
            assert m is not None, (name, seq_len)
            assert m.tiers == {tier: 2}, (name, seq_len, m.tiers)
            assert len(m.wall.samples) == 2 and 0 < m.wall.median <= m.wall.p90


def test_cached_scenarios_score_exactly_like_the_gpu_hit(results):
    for m in results.measured:
        if m.scenario in ("gpu_hit", "cpu_hit", "cpu_hit_layerwise", "ssd_hit", "ssd_hit_layerwise"):
            assert m.max_abs_diff == 0.0, m.scenario
        else:  # a full recompute, the eager block: same math, other summation order
            assert m.max_abs_diff < 1e-4, m.scenario


def test_bounds_use_the_probes_of_the_same_run(results):
    for seq_len in LENGTHS:
        b = results.bounds[seq_len]
        model = results.settings.model
        assert len(b.transfer_layers) == len(b.compute_layers) == model.num_layers
        pages = -(-seq_len // results.transfer_config.page_size)
        layer_page = 2 * results.transfer_config.page_size * model.num_heads * model.dqk * model.dtype.itemsize
        assert b.transfer_bytes == pages * model.num_layers * layer_page
        assert b.t_compute == results.get("gpu_hit", seq_len).wall.median
        assert b.measured == results.get("cpu_hit_layerwise", seq_len).wall.median
        assert b.lower_bound > 0 and b.pipeline_efficiency > 0 and b.transfer_efficiency > 0


def test_report_table_json_and_plot(results, tmp_path):
    table = bench_report.markdown(results)
    assert "CPU path" in table
    rows = [line for line in table.splitlines() if line.startswith("| 64 ") or line.startswith("| 96 ")]
    assert len(rows) == 3 * len(LENGTHS)  # main, bound detail, other scenarios
    assert "| seq_len | GPU hit ms | CPU hit ms | CPU hit + layerwise ms | LB ms | pipeline eff | transfer eff |" \
        in table
    path = tmp_path / "r.json"
    bench_report.write_json(results, path, "layerflow bench")
    data = json.loads(path.read_text())
    assert data["command"] == "layerflow bench"
    assert data["environment"]["cpu_path"] is True and data["environment"]["torch"] == torch.__version__
    assert data["model"]["num_layers"] == 2 and data["transfer_config"]["page_size"] == 32
    assert {(r["scenario"], r["seq_len"]) for r in data["results"]} == \
        {(n, s) for n in SCENARIOS for s in LENGTHS}
    assert set(data["bounds"]) == {str(s) for s in LENGTHS}
    assert data["seed_reference"]["median_ms"]["16384"]["cpu_hit_layerwise"] == 13.42
    png = tmp_path / "r.png"
    bench_report.plot(results, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_only_onboard_still_hits_the_host_with_the_same_scores():
    r = run(settings(seq_lens=(64,), scenarios=("cpu_hit", "cpu_hit_layerwise"), only_onboard=True), CPU)
    for name in ("cpu_hit", "cpu_hit_layerwise"):
        m = r.get(name, 64)
        assert m.tiers == {"host": 2} and m.max_abs_diff == 0.0


def test_bench_command_on_cpu_says_it_ran_the_cpu_path(capsys, tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--seq-lens", "64", "--timed-iters", "1", "--warmup-iters", "0",
                                      "--scenarios", "gpu_hit,cpu_hit", "--device", "cpu",
                                      "--out", str(tmp_path / "b.json")])
    main(args)
    out = capsys.readouterr().out
    assert "ran the CPU path" in out and "| 64 |" in out
    assert json.loads((tmp_path / "b.json").read_text())["settings"]["preset"] == "tiny"


# ---- throughput helpers -----------------------------------------------------------------------------


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


@pytest.mark.gpu
def test_gpu_run_with_timeline_splits_the_layerwise_request():
    s = settings(preset="hstu-bench", seq_lens=(256,), append_len=8, num_candidates=16,
                 scenarios=("gpu_hit", "cpu_hit", "cpu_hit_layerwise", "torch_eager"), timeline=True)
    r = run(s, torch.device("cuda"))
    for name, tier in (("gpu_hit", "gpu"), ("cpu_hit", "host"), ("cpu_hit_layerwise", "host")):
        m = r.get(name, 256)
        assert m.tiers == {tier: 2} and m.max_abs_diff == 0.0, name
    lw = r.get("cpu_hit_layerwise", 256)
    t = lw.timeline()
    assert min(t.values()) >= 0 and len(lw.probes.timelines[0].layer_ms) == s.model.num_layers
    assert t["issue_ms"] + t["transfer_ms"] + t["tail_ms"] <= max(lw.wall.samples) * 1.01
    eager = r.get("torch_eager", 256)
    assert r.bounds[256].transfer_efficiency > 0 and eager.max_abs_diff < 0.05 * eager.reference_scale
