"""`layerflow bench --profile` on the CPU path: every timed request split into its phases by the host clock, the
phases nested in their steps, the figures in the tables and the JSON, and the engine's classes left untouched."""

import json

import pytest
import torch

from layerflow.bench import report
from layerflow.bench.measure import run
from layerflow.bench.phases import PHASES, STEPS, PhaseTimer, row_names, rows
from layerflow.config import Config
from layerflow.model import HSTUWeights
from layerflow.model.config import PRESETS
from layerflow.runtime.engine import Engine
from layerflow.runtime.request import Request
from tests.bench.cases import CPU, small_settings

PROFILED = ("gpu_hit", "cpu_hit", "cpu_hit_layerwise")


@pytest.fixture(scope="module")
def profiled():
    return run(small_settings(seq_lens=(64,), scenarios=PROFILED + ("torch_eager",), profile=True), CPU)


def test_every_timed_request_of_a_profiled_run_is_split_into_nested_phases(profiled):
    for name in PROFILED:
        m = profiled.get(name, 64)
        assert list(m.phases) == row_names()
        assert m.phases["wall"].samples == m.wall.samples, name
        for row, summary in m.phases.items():
            assert len(summary.samples) == profiled.settings.timed_iters and min(summary.samples) >= -1e-9, (name, row)
        for i in range(profiled.settings.timed_iters):
            sample = {row: s.samples[i] for row, s in m.phases.items()}
            assert sum(sample[s] for s in STEPS) + sample["outside"] == pytest.approx(sample["wall"])
            for step in STEPS:
                parts = [n for n, parent, _ in PHASES if parent == step] + [f"{step}.other"]
                assert sum(sample[p] for p in parts) == pytest.approx(sample[step]), (name, step)
        for row in ("prepare.tiers", "prepare.pack", "prepare.alloc", "launch.fill", "launch.forward",
                    "collect.fetch", "collect.commit"):
            assert min(m.phases[row].samples) > 0, (name, row)
    # only host hits copy pages in: their onboarding issue is the largest part of preparing them
    onboard = {n: profiled.get(n, 64).phases["prepare.onboard"].median for n in PROFILED}
    assert onboard["cpu_hit"] > onboard["gpu_hit"] and onboard["cpu_hit_layerwise"] > onboard["gpu_hit"]
    assert profiled.get("torch_eager", 64).phases is None  # it does not go through the engine


def test_an_unprofiled_run_has_no_phases(results):
    assert all(m.phases is None for m in results.measured)
    assert "Host time per phase" not in report.markdown(results)


def test_phases_reach_the_tables_and_the_json(profiled, tmp_path):
    table = report.markdown(profiled)
    for name in ("GPU hit", "CPU hit", "CPU hit + layerwise"):
        assert f"| {name}: phase | 64 |" in table
    assert "| launch: forward | " in table and "| collect: other | " in table
    path = tmp_path / "p.json"
    report.write_json(profiled, path)
    data = json.loads(path.read_text())
    assert data["settings"]["profile"] is True
    gpu = next(r for r in data["results"] if r["scenario"] == "gpu_hit")
    assert list(gpu["phases_ms"]) == row_names()
    assert gpu["phases_ms"]["wall"]["samples"] == gpu["wall_ms"]["samples"]
    assert "phases_ms" not in next(r for r in data["results"] if r["scenario"] == "torch_eager")


def test_rows_derive_each_steps_other_and_the_time_outside_the_steps():
    out = rows({"prepare": 1.0, "prepare.pack": 0.25, "launch": 2.0, "collect": 0.5, "collect.fetch": 0.5}, 4.0)
    assert out["prepare.other"] == 0.75 and out["launch.other"] == 2.0 and out["collect.other"] == 0.0
    assert out["prepare.tiers"] == 0.0 and out["outside"] == 0.5 and out["wall"] == 4.0
    assert list(out) == row_names()


def test_the_timer_counts_only_open_requests_and_only_on_its_engine():
    weights = HSTUWeights.init(PRESETS["tiny"], seed=0)
    config = Config(cpu_cache_gb=0.02, gpu_cache_gb=0.02)
    timer = PhaseTimer()
    with pytest.raises(RuntimeError, match="no request"):
        timer.stop()
    with Engine(weights, config, device=CPU) as timed, Engine(weights, config, device=CPU) as plain:
        timer.attach(timed)
        request = Request(1, [3, 4, 5], [6, 7])
        first = timed.score([request])        # not open: nothing recorded
        timer.start()
        second = timed.score([Request(2, [3, 4, 5], [6, 7])])
        phases = timer.stop()
        # every phase but the bucket choice, which the slab staging makes inside prepare's packing
        assert set(phases) == {name for name, _, _ in PHASES} - {"launch.bucket"}
        assert torch.equal(first[0], second[0])   # the wrappers change no result
        timer.start()
        assert torch.equal(plain.score([request])[0], first[0])
        assert timer.stop() == {}                # the other engine and the classes are not wrapped
        assert "prepare" in vars(timed) and "prepare" not in vars(plain)


@pytest.mark.gpu
def test_a_profiled_gpu_run_splits_replayed_requests_into_their_phases():
    s = small_settings(preset="hstu-bench", seq_lens=(256,), append_len=8, num_candidates=16,
                       scenarios=("gpu_hit", "cpu_hit_layerwise"), profile=True)
    r = run(s, torch.device("cuda"))
    for name in ("gpu_hit", "cpu_hit_layerwise"):
        m = r.get(name, 256)
        assert m.max_abs_diff == 0.0 and list(m.phases) == row_names(), name
        for row in ("prepare.pack", "launch.fill", "launch.forward", "collect.fetch"):
            assert min(m.phases[row].samples) > 0, (name, row)
    assert r.get("cpu_hit_layerwise", 256).phases["prepare.onboard"].median > \
        r.get("gpu_hit", 256).phases["prepare.onboard"].median
