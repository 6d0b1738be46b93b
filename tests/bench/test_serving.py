"""Serving mode: its settings and defaults, its figures on known records, and a whole CPU-path run through the
command line (in process and over HTTP, prefetch off and on)."""

import json

import pytest
import torch

from layerflow.bench.cli import main, serving_settings_from_args
from layerflow.bench.serving import Calibration, ServingSettings, bound, run_serving, summarize
from layerflow.bench.serving_load import Record
from layerflow.bench.serving_report import markdown
from layerflow.bench.serving_timeline import TimedAsyncEngine
from layerflow.bench.throughput import ThroughputSettings
from layerflow.cli import build_parser
from layerflow.model import HSTUWeights
from layerflow.model.config import PRESETS
from layerflow.runtime.engine import Engine
from layerflow.runtime.kv_manager import Tier
from layerflow.runtime.request import Request
from layerflow.tier.layout import KVLayout
from tests.serving.helpers import MODEL, WAIT_S, config

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def parse(*argv: str):
    """`layerflow bench ARGV`, parsed by the command line's own parser."""
    return build_parser().parse_args(["bench", *argv])


def test_serving_defaults_put_four_times_the_gpu_pools_users_in_the_stream():
    gpu = serving_settings_from_args(parse("--serve"), CUDA)
    w = gpu.workload
    assert (w.preset, w.history_len, w.zipf, w.num_users, w.gpu_users) == ("hstu-bench", 4096, 1.0, 64, 16)
    assert gpu.rates == (100.0, 200.0, 400.0, 800.0, 1600.0) and gpu.transports == ("inprocess", "http")
    cpu = serving_settings_from_args(parse("--serve", "--gpu-users", "5", "--rates", "5,10", "--transports", "http"),
                                     CPU)
    assert (cpu.workload.preset, cpu.workload.num_users, cpu.rates, cpu.transports) == ("tiny", 20, (5.0, 10.0),
                                                                                        ("http",))


def workload(**overrides) -> ThroughputSettings:
    values = dict(preset="tiny", history_len=64, append_len=4, num_candidates=8, num_users=8, gpu_users=2,
                  num_requests=4, rate=1.0, zipf=1.0, batch_size=2)
    return ThroughputSettings(**(values | overrides))


def test_bad_serving_settings_are_refused():
    with pytest.raises(ValueError, match="rates=()"):
        ServingSettings(workload(), ())
    with pytest.raises(ValueError, match="transports=\\('grpc',\\)"):
        ServingSettings(workload(), (1.0,), ("grpc",))
    with pytest.raises(ValueError, match="policies=\\('eager',\\)"):
        ServingSettings(workload(), (1.0,), policies=("eager",))
    with pytest.raises(ValueError, match="copy_timeline with copy_paths=\\('runs',\\)"):
        ServingSettings(workload(), (1.0,), copy_timeline=True, copy_paths=("runs",))
    with pytest.raises(ValueError, match="gpu_users=2 < batch_size=4"):
        ServingSettings(workload(batch_size=4), (1.0,))


def test_the_scheduler_timeline_counts_each_step_once_within_the_wall_time():
    with Engine(HSTUWeights.init(MODEL, seed=0), config()) as engine, TimedAsyncEngine(engine) as serving:
        serving.submit(Request(1, [2, 3], [4])).result(WAIT_S)
        serving.reset()
        for user in (1, 2, 3):
            serving.submit(Request(user, [5], [6, 7])).result(WAIT_S)
    timeline = serving.timeline()   # read once the scheduler has stopped: a step is recorded after it ends
    phases = timeline["phases"]
    assert {name: phases[name]["calls"] for name in ("prepare", "launch", "collect", "answer")} == \
        {"prepare": 3, "launch": 3, "collect": 3, "answer": 3}
    assert "prepare ahead" not in phases and timeline["mean_prepared"] == 1.0
    assert sum(p["s"] for p in phases.values()) <= timeline["wall_s"]
    assert phases["idle"]["s"] > 0 and timeline["collect_waits"] == 0


def test_a_runs_figures_on_known_records():
    layout = KVLayout.for_hstu(PRESETS["tiny"], 32)
    page = layout.page_bytes
    calibration = Calibration(gpu_hit_ms={1: 2.0, 2: 3.0}, bulk_bytes_per_s=1000.0 * page, bulk_bytes=page)
    records = [Record(0.0, 0.010, "gpu", 2, 64), Record(0.0, 0.020, "gpu", 2, 64),
               Record(0.5, 0.530, "host", 1, 64), Record(0.9, 1.000, "host", 1, 33),
               Record(0.95, 0.96, error="deadline")]
    run = summarize(records, 5.0, "inprocess", "mixed", layout, calibration)
    assert run["answered"] == 4 and run["throughput"] == pytest.approx(4.0)
    assert run["p50_ms"] == pytest.approx(25.0) and run["tiers"] == {"gpu": 2, "host": 2}
    assert run["errors"] == {"deadline": 1}
    assert run["mean_batch"] == pytest.approx(4 / 3)
    assert run["onboard_bytes"] == 4 * page                      # 64 tokens = 2 pages, 33 tokens = 2 pages
    assert run["copy_busy"] == pytest.approx(4 / 1000)           # 4 pages at 1000 pages/s over 1 s
    assert run["sm_busy"] == pytest.approx((3.0 + 2.0 + 2.0) / 1e3)   # one batch of 2, two of 1
    limit = bound([run], calibration, batch_size=2)
    assert limit["copy_engine_rate"] == pytest.approx(1000.0)    # 1 page per answered request
    assert limit["gpu_rate"] == pytest.approx(2 / 3e-3)
    assert (limit["rate"], limit["limited_by"]) == (pytest.approx(666.67, rel=1e-3), "GPU")


def test_serve_command_on_cpu_runs_both_transports_with_prefetch_off_and_on(capsys, tmp_path):
    main(parse("--serve", "--history-len", "32", "--num-requests", "8", "--gpu-users", "2", "--rates", "200,400",
               "--max-batch-size", "2", "--device", "cpu", "--out", str(tmp_path / "s.json"),
               "--plot", str(tmp_path / "s.png")))
    out = capsys.readouterr().out
    assert "ran the CPU path" in out and "### Serving on CPU" in out and "Bound:" in out
    data = json.loads((tmp_path / "s.json").read_text())
    runs = data["runs"]
    assert [(r["policy"], r["prefetch"], r["transport"], r["offered_rate"]) for r in runs] == [
        (p, p != "off", t, rate) for p in ("off", "guarded") for t in ("inprocess", "http") for rate in (200.0, 400.0)]
    assert all(r["answered"] == 8 and sum(r["tiers"].values()) == 8 and not r["errors"] for r in runs)
    assert data["environment"]["cpu_path"] is True and data["command"]
    assert data["settings"]["workload"]["num_users"] == 8
    assert data["bound"]["limited_by"] in ("GPU", "copy engine") and data["bound"]["rate"] > 0
    assert set(data["calibration"]["gpu_hit_ms"]) == {"1", "2"}
    assert (tmp_path / "s.png").stat().st_size > 0


def test_every_policy_serves_the_whole_stream_on_one_engine_and_its_engine_phases_are_summed():
    settings = ServingSettings(workload(num_requests=12, rate=400.0, gpu_users=2, batch_size=2), (400.0,),
                               ("inprocess",), policies=("off", "guarded"), profile=True)
    data = run_serving(settings, CPU)
    assert [r["policy"] for r in data["runs"]] == ["off", "guarded"]
    assert all(r["answered"] == 12 and not r["errors"] and r["tiers"].get("host", 0) > 0 for r in data["runs"])
    for r in data["runs"]:   # the engine's phases of the run's batches, each within the scheduler's own steps
        phases, steps = r["engine_phases_ms"], r["scheduler"]["phases"]
        prepared = sum(steps.get(p, {"s": 0.0})["s"] for p in ("prepare", "prepare ahead")) * 1e3
        assert 0 < phases["prepare.onboard"] < phases["prepare"] <= prepared
        assert 0 < phases["launch"] <= steps["launch"]["s"] * 1e3
        assert sum(r["scheduler"]["user_runs"].values()) == r["tiers"]["host"]   # a placement per host hit


def test_policies_alternate_in_blocks_and_serve_the_whole_stream_after_the_unloaded_requests():
    settings = ServingSettings(workload(num_requests=12, rate=400.0, gpu_users=2, batch_size=2), (400.0,),
                               ("inprocess",), policies=("off", "guarded"), blocks=2, unloaded=6)
    data = run_serving(settings, CPU)
    assert data["unloaded"]["requests"] == 6 and 0 < data["unloaded"]["p50_ms"] <= data["unloaded"]["p99_ms"]
    assert [(r["block"], r["policy"]) for r in data["runs"]] == [(0, "off"), (0, "guarded"), (1, "off"), (1, "guarded")]
    assert all(r["answered"] == 12 and not r["errors"] for r in data["runs"])
    assert "p99 " in markdown(settings, data, "cpu").split("Unloaded")[1]


def test_each_run_reports_its_batches_per_second_and_the_hot_users_cap():
    settings = ServingSettings(workload(num_requests=12, rate=400.0, gpu_users=2, batch_size=2), (400.0,),
                               ("inprocess",), policies=("guarded",), blocks=2)
    data = run_serving(settings, CPU)
    assert len(data["runs"]) == 2
    for r in data["runs"]:
        assert r["answered"] == 12 and not r["errors"]
        assert 1 / 8 <= r["hot_user_share"] <= 1 and r["batches_per_s"] > 0
        assert r["hot_user_cap"] == pytest.approx(r["batches_per_s"] / r["hot_user_share"])
        assert r["batches_per_s"] * r["mean_batch"] == pytest.approx(r["throughput"])
    table = markdown(settings, data, "cpu")
    assert "| batches/s | hot-user cap |" in table and "Hot-user cap: the hottest user (share" in table


def test_each_copy_thread_mode_has_its_engine_and_the_blocks_alternate_their_order():
    settings = ServingSettings(workload(num_requests=12, rate=400.0, gpu_users=2, batch_size=2), (400.0,),
                               ("inprocess",), policies=("guarded",), blocks=2, copy_threads=(False, True))
    data = run_serving(settings, CPU)
    assert [(r["block"], r["copy_thread"]) for r in data["runs"]] == [(0, False), (0, True), (1, True), (1, False)]
    assert all(r["answered"] == 12 and not r["errors"] and r["tiers"].get("host", 0) > 0 for r in data["runs"])
    assert markdown(settings, data, "cpu").count("| guarded / copy thread |") == 4   # runs and scheduler tables


@pytest.mark.parametrize("copy_threads", [(), (True, True), (1,)])
def test_bad_copy_thread_modes_are_refused(copy_threads):
    with pytest.raises(ValueError, match="copy_threads="):
        ServingSettings(workload(), (1.0,), copy_threads=copy_threads)
    with pytest.raises(ValueError, match="with a copy thread"):
        ServingSettings(workload(), (1.0,), copy_paths=("runs",), copy_threads=(False, True))


def test_variants_alternate_on_one_engine_and_each_run_has_its_trace_sustained_and_ideal_rates():
    settings = ServingSettings(workload(num_requests=24, rate=400.0, gpu_users=2, batch_size=2), (400.0,),
                               ("inprocess",), policies=("guarded",), blocks=2, variants=("s15", "library"),
                               trace=True)
    data = run_serving(settings, CPU)
    assert [(r["block"], r["variant"]) for r in data["runs"]] == [(0, "s15"), (0, "library"), (1, "library"),
                                                                    (1, "s15")]
    for r in data["runs"]:
        assert r["answered"] == 24 and r["sustained_rate"] > 0 and r["ideal_throughput"] > 0
        trace = r["trace"]
        assert len(trace["requests"]) == 24 and trace["batches"] and trace["intervals"] and trace["engine"]
        assert set(r["thread_cpu_s"]) >= {"MainThread", "layerflow-scheduler"}
    with pytest.raises(ValueError, match="variants="):
        ServingSettings(workload(), (1.0,), variants=("eager",))


def test_the_host_waits_variant_turns_ordered_reuse_off_on_its_engines_tier_only_and_serves_the_same_scores():
    from layerflow.bench.serving_variants import scheduler

    requests = [Request(u % 5, list(range(16 * u, 16 * u + 16)), [3, 4]) for u in range(15)]   # a page a visit
    scores = {}
    with Engine(HSTUWeights.init(MODEL, seed=0), config(gpu_pages=7, serve_max_batch_size=2)) as engine:
        tier = engine.kv.below
        for name in ("host-waits", "library"):
            with scheduler(name, engine, "guarded") as serving:
                assert tier.orders_reuse is (name == "library") and type(tier).orders_reuse
                scores[name] = [f.result(WAIT_S) for f in [serving.submit(r) for r in requests]]
            for u in range(5):
                engine.kv.truncate(u, 0)
    assert {s.tier for s in scores["library"]} >= {Tier.HOST}   # users were evicted and came back from the host
    for a, b in zip(scores["host-waits"], scores["library"]):
        assert torch.allclose(a.scores, b.scores, atol=1e-5, rtol=1e-5)
