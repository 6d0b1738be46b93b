"""The inference benchmark's run on the CPU path: every scenario measured on the tier it claims, exact scores, and
bounds built from the probes of the same run; the GPU run with a timeline."""

import pytest
import torch

from layerflow.bench.measure import engine_groups, run
from layerflow.bench.scenarios import SCENARIOS
from tests.bench.cases import CPU, LENGTHS, small_settings


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
        probes = results.get("cpu_hit_layerwise", seq_len).probes
        assert len(probes.transfers) == len(probes.bulk_ms) == results.settings.timed_iters


def test_scenarios_share_an_engine_per_layerwise_setting():
    groups = engine_groups([SCENARIOS[n] for n in ("no_cache", "gpu_hit", "cpu_hit", "cpu_hit_layerwise")])
    assert [(layerwise, [s.name for s in group]) for layerwise, group in groups] == [
        (False, ["no_cache", "gpu_hit", "cpu_hit"]), (True, ["cpu_hit_layerwise"])]
    assert [(k, [s.name for s in g]) for k, g in engine_groups([SCENARIOS["gpu_hit"]])] == [(False, ["gpu_hit"])]


def test_only_onboard_still_hits_the_host_with_the_same_scores():
    r = run(small_settings(seq_lens=(64,), scenarios=("cpu_hit", "cpu_hit_layerwise"), only_onboard=True), CPU)
    for name in ("cpu_hit", "cpu_hit_layerwise"):
        m = r.get(name, 64)
        assert m.tiers == {"host": 2} and m.max_abs_diff == 0.0


@pytest.mark.gpu
def test_gpu_run_with_timeline_splits_the_layerwise_request():
    s = small_settings(preset="hstu-bench", seq_lens=(256,), append_len=8, num_candidates=16,
                       scenarios=("gpu_hit", "cpu_hit", "cpu_hit_layerwise", "torch_eager"), timeline=True)
    r = run(s, torch.device("cuda"))
    for name, tier in (("gpu_hit", "gpu"), ("cpu_hit", "host"), ("cpu_hit_layerwise", "host")):
        m = r.get(name, 256)
        assert m.tiers == {tier: 2} and m.max_abs_diff == 0.0, name
    lw = r.get("cpu_hit_layerwise", 256)
    t = lw.timeline()
    assert min(t[k] for k in ("issue_ms", "transfer_ms", "tail_ms")) >= 0
    assert len(lw.probes.timelines[0].layer_ms) == s.model.num_layers
    # The tail marks: every layer's release, and the host stamps in the order a request passes them.
    assert len(lw.probes.timelines[0].release_lags()) == s.model.num_layers
    order = ["host.signal_acquired", "host.copy0_issued", "host.all_issued", "host.prepare_end", "host.fill_end",
             "host.replay_call",
             "host.fetch_call", "host.collect_end"]
    assert [t[k] for k in order] == sorted(t[k] for k in order)
    assert t["issue_ms"] + t["transfer_ms"] + t["tail_ms"] <= max(lw.wall.samples) * 1.01
    eager = r.get("torch_eager", 256)
    assert r.bounds[256].transfer_efficiency > 0 and eager.max_abs_diff < 0.05 * eager.reference_scale


def test_the_run_config_takes_the_environments_fallbacks_but_no_config_file(monkeypatch, tmp_path):
    from layerflow.bench.measure import transfer_config
    from layerflow.bench.settings import Settings

    settings = Settings(preset="tiny", seq_lens=(256,), append_len=8, num_candidates=4, batch_size=1, timed_iters=1,
                        warmup_iters=0, scenarios=("gpu_hit",))
    monkeypatch.setenv("LAYERFLOW_COPY_THREAD", "0")
    monkeypatch.setenv("LAYERFLOW_CONFIG", str(tmp_path / "absent.yaml"))
    assert transfer_config(settings, None).copy_thread is False
    monkeypatch.setenv("LAYERFLOW_COPY_THREAD", "1")
    assert transfer_config(settings, None).copy_thread is True
