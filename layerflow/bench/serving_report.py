"""The serving benchmark's outputs: a markdown table per run, the results JSON and a plot of latency vs offered rate."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from layerflow.bench.environment import device_name, results_header
from layerflow.bench.report import save_figure
from layerflow.bench.serving import ServingSettings


def _tiers(run: dict) -> str:
    return "/".join(str(run["tiers"].get(t, 0)) for t in ("gpu", "host", "ssd", "none"))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _errors(run: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(run["errors"].items())) or "-"


def _policy(run: dict) -> str:
    """The run's policy, its copy path where runs compare them, whether a copy thread issued its copies and its
    scheduler variant other than the library's (layerflow.bench.serving_variants)."""
    return run["policy"] + (f" / {run['copy_path']}" if "copy_path" in run else "") \
        + (" / copy thread" if run.get("copy_thread") else "") \
        + (f" / {run['variant']}" if run.get("variant", "library") != "library" else "")


PHASES = ("idle", "take", "prepare", "prepare ahead", "launch", "poll", "collect", "answer", "retry")


def scheduler_table(runs: list[dict]) -> list[str]:
    """Per run: the share of its wall time the scheduler thread spent in each phase (layerflow.bench.serving_timeline),
    the rest, the collects that waited for the device, and the mean batch prepared idle / ahead."""
    rows = ["| transport | policy | offered/s | " + " | ".join(PHASES) + " | other | collect waits | "
            "mean prepared (idle / ahead) |", "|---" * (len(PHASES) + 6) + "|"]
    for r in runs:
        t = r.get("scheduler")
        if t is None or t["wall_s"] <= 0:
            continue
        shares = [t["phases"].get(p, {"s": 0.0})["s"] / t["wall_s"] for p in PHASES]
        rows.append(f"| {r['transport']} | {_policy(r)} | {r['offered_rate']:g} | "
                    + " | ".join(f"{x:.2f}" for x in shares) + f" | {max(0.0, 1 - sum(shares)):.2f} | "
                    f"{t['collect_waits']} | {t['mean_prepared']:.2f} / {t['mean_prepared_ahead']:.2f} |")
    return rows


ENGINE_PHASES = ("prepare", "prepare.tiers", "prepare.pack", "prepare.alloc", "prepare.onboard", "launch",
                 "launch.fill", "launch.forward", "launch.offload", "collect", "collect.fetch", "collect.commit")


def engine_phase_table(runs: list[dict]) -> list[str]:
    """Per profiled run: the engine's host time per launched batch in each phase (layerflow.bench.phases), ms."""
    rows = ["| transport | policy | offered/s | batches | " + " | ".join(ENGINE_PHASES) + " |",
            "|---" * (len(ENGINE_PHASES) + 4) + "|"]
    for r in runs:
        phases, launched = r.get("engine_phases_ms"), r["scheduler"]["phases"].get("launch", {"calls": 0})["calls"]
        if phases is None or not launched:
            continue
        rows.append(f"| {r['transport']} | {_policy(r)} | {r['offered_rate']:g} | {launched} | "
                    + " | ".join(f"{phases.get(p, 0.0) / launched:.3f}" for p in ENGINE_PHASES) + " |")
    return rows


def issue_table(runs: list[dict]) -> list[str]:
    """Per run that compared copy paths: its onboardings' and offloads' host issue (layerflow.bench.serving_issue):
    transfers, mean runs per transfer, ms per transfer (median) in the whole call / the copy calls, and the
    histogram of runs per onboarded user's placement."""
    rows = ["| policy / path | block | onboards | runs | onboard ms (all / calls) | offloads | runs | "
            "offload ms (all / calls) | runs per user placement |", "|---" * 9 + "|"]
    for r in runs:
        if "issue" not in r:
            continue
        cells = []
        for name in ("onboard", "offload"):
            i = r["issue"].get(name)
            cells += ["0", "-", "-"] if i is None else [
                str(i["transfers"]), f"{i['runs']:.1f}",
                f"{i['total_ms']['median']:.3f} / {i['calls_ms']['median']:.3f}"]
        placed = ", ".join(f"{k}: {v}" for k, v in r["scheduler"]["user_runs"].items() if v)
        rows.append(f"| {_policy(r)} | {r['block']} | " + " | ".join(cells) + f" | {placed or '-'} |")
    return rows


def markdown(settings: ServingSettings, results: dict, where: str) -> str:
    w, cal, b = settings.workload, results["calibration"], results["bound"]
    head = (f"### Serving on {where}: {w.preset} model, {w.num_users} users (Zipf {w.zipf}), GPU pool for "
            f"{w.gpu_users}, {w.history_len} cached + {w.append_len} appended per visit, {w.num_candidates} "
            f"candidates, batches up to {w.batch_size}, {w.num_requests} Poisson arrivals per rate")
    rows = ["| transport | policy | offered/s | req/s | of bound | sustained | ideal | p50 ms | p99 ms | "
            "gpu/host/ssd/none | errors | mean batch | copy busy | GPU busy | batches/s | hot-user cap |",
            "|---" * 16 + "|"]
    for r in results["runs"]:
        rows.append(f"| {r['transport']} | {_policy(r)} | {r['offered_rate']:g} | "
                    f"{r['throughput']:.1f} | {r['throughput'] / b['rate']:.3f} | {r['sustained_rate']:.1f} | "
                    f"{r['ideal_throughput']:.1f} | {_ms(r['p50_ms'])} | {_ms(r['p99_ms'])} | {_tiers(r)} | "
                    f"{_errors(r)} | "
                    f"{r['mean_batch']:.2f} | {r['copy_busy']:.2f} | {r['sm_busy']:.2f} | {r['batches_per_s']:.1f} | "
                    f"{r['hot_user_cap']:.1f} |")
    gpu_ms = ", ".join(f"{size}: {ms:.2f}" for size, ms in sorted(cal.gpu_hit_ms.items()))
    copy = "-" if b["copy_engine_rate"] is None else f"{b['copy_engine_rate']:.1f}"
    foot = (f"Bound: {b['rate']:.1f} req/s, set by the {b['limited_by']} (copy engine: "
            f"{b['onboard_bytes_per_request'] / 1e6:.2f} MB onboarded per request at {cal.bulk_bytes_per_s / 1e9:.2f} "
            f"GB/s bulk = {copy} req/s; GPU: batches of {b['full_batch']} GPU hits = "
            f"{b['gpu_rate']:.1f} req/s). GPU-hit batch ms by size: {gpu_ms}. Busy fractions are estimates from "
            f"these measured figures, not hardware counters. Hot-user cap: the hottest user (share "
            f"{max(r['hot_user_share'] for r in results['runs']):.3f} of a run's requests) has one request per batch, "
            f"so req/s <= batches/s / its share. Sustained: answers between the 10th and 90th percentile answer "
            f"over their time. Ideal: the ideal server (layerflow/bench/serving_ideal.py, no host costs) on the same "
            f"arrivals and measured costs; an open loop serves at most what it is offered, so below the bound compare "
            f"req/s with it, and read a fraction of the bound as the server's only at offered rates past it.")
    unloaded = results.get("unloaded")
    if unloaded:
        foot += (f" Unloaded ({unloaded['requests']} requests one at a time): p50 {unloaded['p50_ms']:.2f} ms, "
                 f"p99 {unloaded['p99_ms']:.2f} ms.")
    scheduler = ("Scheduler thread, share of each run's wall time per phase (host clock; see "
                 "layerflow/bench/serving_timeline.py for the phases):")
    lines = [head, "", *rows, "", foot, "", scheduler, "", *scheduler_table(results["runs"])]
    if settings.profile:
        lines += ["", "Engine host time per launched batch (ms, host clock; layerflow/bench/phases.py):", "",
                  *engine_phase_table(results["runs"])]
    if settings.copy_paths:
        lines += ["", "Copy issue per transfer (host clock; layerflow/bench/serving_issue.py):", "",
                  *issue_table(results["runs"])]
    return "\n".join(lines)


def to_dict(settings: ServingSettings, results: dict, device: torch.device) -> dict:
    """The results JSON: command line, environment, settings, calibration, bound, every run and the table."""
    return {**results_header(device), "settings": settings.to_dict(),
            "calibration": results["calibration"].to_dict(), "bound": results["bound"],
            "unloaded": results.get("unloaded"), "runs": results["runs"],
            "table": markdown(settings, results, device_name(device))}


def write_json(settings: ServingSettings, results: dict, device: torch.device, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_dict(settings, results, device), indent=1) + "\n")


def plot(settings: ServingSettings, results: dict, device: torch.device, path: Path) -> None:
    """p50 (solid) and p99 (dashed) latency vs offered rate per transport and scheduler policy, the bound dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for transport in settings.transports:
        for policy in settings.policies:
            runs = [r for r in results["runs"] if r["transport"] == transport and r["policy"] == policy
                    and r["p50_ms"] is not None]
            label = f"{transport}, policy {policy}"
            rates = [r["offered_rate"] for r in runs]
            color = ax.plot(rates, [r["p50_ms"] for r in runs], marker="o", label=f"{label}: p50")[0].get_color()
            ax.plot(rates, [r["p99_ms"] for r in runs], marker="x", linestyle="--", color=color, label=f"{label}: p99")
    b = results["bound"]
    ax.axvline(b["rate"], color="black", linestyle=":", label=f"bound ({b['limited_by']}): {b['rate']:.0f}/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered rate, requests/s (Poisson)")
    ax.set_ylabel("latency, ms (arrival -> answer at the client)")
    w = settings.workload
    ax.set_title(f"{device_name(device)}: serving {w.preset}, {w.history_len} cached, {w.num_users} users "
                 f"(Zipf {w.zipf}), GPU pool for {w.gpu_users}")
    save_figure(fig, ax, path)
