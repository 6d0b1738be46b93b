"""The benchmark's outputs: markdown tables (with the seed's published figures beside ours), JSON, a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from layerflow.bench.environment import device_name, results_header
from layerflow.bench.measure import Results
from layerflow.bench.phases import PHASES, row_names
from layerflow.bench.scenarios import SCENARIOS
from layerflow.tier.layout import KVLayout

SEED_GPU = "RTX Pro 6000 Blackwell"
# The seed's published medians (ms) on its GPU: BS=1, 64 appended, 256 candidates, the seed model.
SEED_RESULTS: dict[int, dict[str, float]] = {
    2048: {"gpu_hit": 3.35, "cpu_hit": 4.43, "cpu_hit_layerwise": 3.94},
    4096: {"gpu_hit": 3.81, "cpu_hit": 6.28, "cpu_hit_layerwise": 4.80},
    8192: {"gpu_hit": 4.98, "cpu_hit": 10.28, "cpu_hit_layerwise": 7.55},
    16384: {"gpu_hit": 7.31, "cpu_hit": 18.48, "cpu_hit_layerwise": 13.42},
}
SEED_SHAPE = dict(preset="hstu-bench", append_len=64, num_candidates=256, batch_size=1)

Column = tuple[str, Callable[[int], str]]


def _seed_comparable(results: Results) -> bool:
    s = results.settings
    return all(getattr(s, k) == v for k, v in SEED_SHAPE.items())


def _table(rows: list[int], columns: list[Column]) -> str:
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fn(r) for _, fn in columns) + " |" for r in rows]
    return "\n".join(lines)


def _latency(results: Results, scenario: str) -> Callable[[int], str]:
    def cell(seq_len: int) -> str:
        m = results.get(scenario, seq_len)
        return "-" if m is None else f"{m.wall.median:.2f} ({m.wall.p90:.2f})"
    return cell


def _users_per_s(results: Results, scenario: str) -> Callable[[int], str]:
    """Throughput of back-to-back batches: the batch's users over its median latency."""
    def cell(seq_len: int) -> str:
        m = results.get(scenario, seq_len)
        return "-" if m is None else f"{results.settings.batch_size / m.wall.median * 1e3:.0f}"
    return cell


def _bound(results: Results, figure: Callable, fmt: str = "{:.2f}") -> Callable[[int], str]:
    def cell(seq_len: int) -> str:
        b = results.bounds.get(seq_len)
        return "-" if b is None else fmt.format(figure(b))
    return cell


def kv_bytes_per_token(results: Results) -> float:
    """Bytes one cached token takes over all layers in the run's KV cache (fp8: codes and scale rows)."""
    config = results.transfer_config
    return KVLayout.for_hstu(results.settings.model, config.page_size, config.kv_cache_dtype).page_bytes \
        / config.page_size


def _length(seq_len: int) -> str:
    return f"{seq_len // 1024}K" if seq_len % 1024 == 0 else str(seq_len)


def markdown(results: Results) -> str:
    """The main table (the seed's columns, the bound and efficiencies, the seed's figures), then the details."""
    s, lens = results.settings, list(results.settings.seq_lens)
    ran = {m.scenario for m in results.measured}
    where = device_name(results.device)
    main: list[Column] = [("seq_len", _length)]
    main += [(f"{SCENARIOS[n].label} ms", _latency(results, n))
             for n in ("gpu_hit", "cpu_hit", "cpu_hit_layerwise") if n in ran]
    if s.batch_size > 1:
        main += [(f"{SCENARIOS[n].label} users/s", _users_per_s(results, n))
                 for n in ("gpu_hit", "cpu_hit_layerwise") if n in ran]
    if results.bounds:
        main += [("LB ms", _bound(results, lambda b: b.lower_bound)),
                 ("pipeline eff", _bound(results, lambda b: b.pipeline_efficiency, "{:.3f}")),
                 ("transfer eff", _bound(results, lambda b: b.transfer_efficiency, "{:.3f}"))]
    if _seed_comparable(results):
        main += [(f"seed {SCENARIOS[n].label} ms", _seed(n)) for n in ("gpu_hit", "cpu_hit", "cpu_hit_layerwise")]
    parts = [f"### {where}: {s.preset} model, BS={s.batch_size}, {s.append_len} appended, {s.num_candidates} "
             f"candidates, {s.query_tokens}-token bucket, "
             f"CUDA graphs {'on' if s.use_cuda_graph and not results.cpu_path else 'off'}"
             f"{', only onboarding (no offload)' if s.only_onboard else ''}",
             f"Latency request in -> scores on the host, median (p90) over {s.timed_iters} timed iterations."
             + (f" Seed columns: the seed's published medians on its {SEED_GPU}." if _seed_comparable(results)
                else ""),
             "", _table(lens, main)]
    if results.bounds:
        detail: list[Column] = [
            ("seq_len", _length),
            ("T_transfer ms", _bound(results, lambda b: b.t_transfer)),
            ("T_compute ms", _bound(results, lambda b: b.t_compute)),
            ("first-layer transfer ms", _bound(results, lambda b: b.transfer_layers[0], "{:.3f}")),
            ("last-layer compute ms", _bound(results, lambda b: b.compute_layers[-1], "{:.3f}")),
            ("onboarded MiB", _bound(results, lambda b: b.transfer_bytes / 2**20, "{:.1f}")),
            ("onboard GB/s", _bound(results, lambda b: b.transfer_bytes / 1e6 / b.t_transfer, "{:.1f}")),
            ("bulk memcpy GB/s", _bound(results, lambda b: b.transfer_bytes / 1e6 / b.bulk_memcpy, "{:.1f}")),
        ]
        parts += ["", "LB = max(T_transfer + last-layer compute, T_compute + first-layer transfer); T_transfer: the "
                  "same pages onboarded alone; T_compute: the GPU hit; bulk memcpy: one pinned copy of the same bytes. "
                  f"KV cache {results.transfer_config.kv_cache_dtype}: {kv_bytes_per_token(results) / 1024:.2f} KiB "
                  "per token over all layers.", "", _table(lens, detail)]
    timed = [m for m in results.measured if m.timeline() is not None]
    if timed:
        def part(name: str, fmt: str = "{:.2f}") -> Callable[[int], str]:
            def cell(seq_len: int) -> str:
                m = next((m for m in timed if m.seq_len == seq_len), None)
                value = None if m is None else m.timeline().get(name)
                return "-" if value is None else fmt.format(value)
            return cell
        parts += ["", "Timeline of the layerwise request (medians, device clock): score entry -> first copy issued, "
                  "first copy -> last layer landed, last layer landed -> scores returned.", "",
                  _table(lens, [("seq_len", _length), ("issue ms", part("issue_ms")),
                                ("transfer in pipeline ms", part("transfer_ms")),
                                ("T_transfer alone ms", _bound(results, lambda b: b.t_transfer)),
                                ("tail ms", part("tail_ms")),
                                ("measured ms", _latency(results, "cpu_hit_layerwise"))])]
        if "signal_lag" in timed[0].timeline():
            parts += ["", "The tail and the issue at their marks (medians, ms): last copy landed -> its wait released "
                      "(signal lag) -> graph done (last layer + scores) -> host at the fetch (host late) -> host back "
                      "(wake) -> call returned (post); first wait: layer 0 released less landed; host columns: host "
                      "clock from score entry.", "",
                      _table(lens, [("seq_len", _length)] + [(label, part(name, "{:.3f}")) for label, name in TAIL_COLUMNS])]
    others = [n for n in ("no_cache", "ssd_hit", "ssd_hit_layerwise", "torch_eager") if n in ran]
    if others:
        parts += ["", _table(lens, [("seq_len", _length)]
                             + [(f"{SCENARIOS[n].label} ms", _latency(results, n)) for n in others])]
    return "\n".join(parts + _phase_tables(results))


TAIL_COLUMNS = (("signal lag", "signal_lag"), ("last compute", "last_compute"), ("host late", "host_late"),
                ("wake", "wake"), ("post", "post"), ("first wait", "first_wait"), ("replay (dev)", "replay_call"),
                ("host: acquired", "host.signal_acquired"), ("host: copy 0", "host.copy0_issued"),
                ("host: all issued", "host.all_issued"), ("host: prepared", "host.prepare_end"),
                ("host: filled", "host.fill_end"),
                ("host: replay", "host.replay_call"), ("host: fetch", "host.fetch_call"),
                ("host: collected", "host.collect_end"))


def _phase_label(name: str) -> str:
    step, _, part = name.partition(".")
    return f"{step}: {part}" if part else name


def _phase_tables(results: Results) -> list[str]:
    """Per scenario that was profiled (`--profile`): host ms per phase and history length, median (p90)."""
    profiled = [n for n in SCENARIOS if any(m.scenario == n and m.phases for m in results.measured)]
    if not profiled:
        return []
    lens = list(results.settings.seq_lens)

    def cell(scenario: str, seq_len: int) -> Callable[[str], str]:
        def text(name: str) -> str:
            m = results.get(scenario, seq_len)
            if m is None or m.phases is None:
                return "-"
            return f"{m.phases[name].median:.3f} ({m.phases[name].p90:.3f})"
        return text

    parts = ["", "Host time per phase (`--profile`, host clock), ms, median (p90): "
             + "; ".join(f"{_phase_label(n)} = {what}" for n, _, what in PHASES)
             + "; other: the step less its parts; outside: the timed call less its three steps."]
    for scenario in profiled:
        columns: list[Column] = [(f"{SCENARIOS[scenario].label}: phase", _phase_label)]
        columns += [(_length(n), cell(scenario, n)) for n in lens]
        parts += ["", _table(row_names(), columns)]
    return parts


def _seed(scenario: str) -> Callable[[int], str]:
    def cell(seq_len: int) -> str:
        value = SEED_RESULTS.get(seq_len, {}).get(scenario)
        return "-" if value is None else f"{value:.2f}"
    return cell


def to_dict(results: Results) -> dict:
    """Every figure of the run, after the command line and the environment (`results_header`)."""
    s = results.settings
    settings = {k: getattr(s, k) for k in ("preset", "append_len", "num_candidates", "batch_size", "timed_iters",
                                           "warmup_iters", "use_cuda_graph", "only_onboard", "profile", "seed")}
    settings |= {"seq_lens": list(s.seq_lens), "scenarios": [sc.name for sc in s.scenario_list()],
                 "query_bucket_tokens": s.query_tokens, "kv_cache_dtype": results.transfer_config.kv_cache_dtype,
                 "kv_bytes_per_token": kv_bytes_per_token(results)}
    return {
        **results_header(results.device),
        "settings": settings,
        "model": s.model.to_dict(),
        "transfer_config": results.transfer_config.to_dict(),
        "results": [m.to_dict() for m in results.measured],
        "bounds": {str(k): b.to_dict() for k, b in results.bounds.items()},
        "seed_reference": {"gpu": SEED_GPU, "shape": SEED_SHAPE,
                           "median_ms": {str(k): v for k, v in SEED_RESULTS.items()}},
        "table": markdown(results),
    }


def write_json(results: Results, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_dict(results), indent=1) + "\n")


def plot(results: Results, path: Path) -> None:
    """Median latency vs seq_len per scenario, the lower bound dashed, the seed's figures faint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = list(results.settings.seq_lens)
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {}
    for name, scenario in SCENARIOS.items():
        points = [(n, results.get(name, n)) for n in lens]
        points = [(n, m.wall.median) for n, m in points if m is not None]
        if points:
            colors[name] = ax.plot(*zip(*points), marker="o", label=scenario.label)[0].get_color()
    if results.bounds:
        bound = sorted((n, b.lower_bound) for n, b in results.bounds.items())
        ax.plot(*zip(*bound), linestyle="--", color="black", label="lower bound of layerwise")
    if _seed_comparable(results):
        for name in ("gpu_hit", "cpu_hit", "cpu_hit_layerwise"):
            seed = [(n, SEED_RESULTS[n][name]) for n in lens if n in SEED_RESULTS]
            if seed:
                ax.plot(*zip(*seed), linestyle=":", alpha=0.6, color=colors.get(name),
                        label=f"seed {SCENARIOS[name].label} ({SEED_GPU})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lens, [_length(n) for n in lens])
    ax.set_yscale("log")
    ax.set_xlabel("cached history tokens")
    ax.set_ylabel("latency, median ms (request in -> scores on host)")
    s = results.settings
    ax.set_title(f"{device_name(results.device)}: BS={s.batch_size}, {s.append_len} appended, "
                 f"{s.num_candidates} candidates")
    save_figure(fig, ax, path)


def save_figure(fig, ax, path: Path) -> None:
    """Grid and legend on `ax`, then the figure as a PNG at `path` (its folder made), closed."""
    import matplotlib.pyplot as plt

    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
