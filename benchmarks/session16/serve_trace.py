"""serve16: where the copy engine's idle time goes, from serve_ab.py's raw traces (JSON_NAME-trace.json).

For each onboarding after the first, the copy engine's idle time before it (from the end of the copies before it to
its first copy's start) is cut at: the arrival of the first of its host-hit requests (before it: no work had arrived,
the load's share), the start of its batch's prepare (before it: the request waited for the scheduler), its issue on
the copy thread (the prepare and the thread), its start on the device. The scheduler's wait is split further by the
step the scheduler was in. Also per run: the head (first arrival to the first copy), the tail (the last copy's end to
the last answer, and the batches launched in it), GPU-only batches, and the hottest user's backlog.

Usage: serve_trace.py TRACE_JSON [VARIANT ...]
"""
import bisect
import json
import statistics
import sys
from collections import defaultdict

MIN_GAP_S = 20e-6


def phase_shares(intervals: list, lo: float, hi: float) -> dict:
    """Seconds of [lo, hi] per innermost scheduler step (the latest-started interval containing each instant)."""
    out = defaultdict(float)
    starts = [iv[1] for iv in intervals]
    t, step = lo, 20e-6
    while t < hi:
        dt = min(step, hi - t)
        mid = t + dt / 2
        name = "between steps"
        i = bisect.bisect_right(starts, mid) - 1
        for j in range(i, max(-1, i - 8), -1):
            if intervals[j][2] >= mid:
                name = intervals[j][0]
                break
        out[name] += dt
        t += dt
    return out


def analyse(run: dict) -> dict:
    t0 = run["t0"]
    spans = sorted(run.get("spans", []), key=lambda s: s["start"])
    intervals = sorted(run["intervals"], key=lambda iv: iv[1])
    prepared = [(b[1], b[3], b[5]) for b in run["batches"] if b[0] == "prepared"]
    launches = [(b[1], b[2], b[3], b[4]) for b in run["batches"] if b[0] == "launch"]
    reqs = [dict(arrival=t0 + r[0], answered=t0 + r[1], tier=r[2], user=r[4]) for r in run["requests"]]
    # each onboarding's batch: the last batch prepared with bytes whose prepare started before the span's issue
    pieces = defaultdict(float)
    waiting = defaultdict(float)
    gaps = 0
    host = sorted((r for r in reqs if r["tier"] in ("host", "ssd")), key=lambda r: r["arrival"])
    reach = spans[0]["end"] if spans else 0.0
    interval_starts = {iv[1]: iv for iv in intervals}
    prep_starts = sorted(iv[1] for iv in intervals if iv[0] in ("prepare", "prepare ahead"))
    for span in spans[1:]:
        gap_lo, gap_hi = reach, span["start"]
        reach = max(reach, span["end"])
        if gap_hi - gap_lo < MIN_GAP_S:
            continue
        gaps += 1
        owner = max((p for p in prepared if p[1] and p[0] <= span["issue_end"] + 1e-6), default=None,
                    key=lambda p: p[0])
        users = set(owner[2]) if owner else set()
        # the batch's host-hit requests: its users' requests queued at its prepare (arrived, answered after it)
        at = owner[0] if owner else 0.0
        arrivals = [r["arrival"] for r in host if r["user"] in users and r["arrival"] <= at <= r["answered"]]
        first = min(arrivals) if arrivals else gap_lo
        i = bisect.bisect_right(prep_starts, span["issued"]) - 1
        prep_start = prep_starts[i] if i >= 0 else span["issued"]
        cuts = [gap_lo, min(max(first, gap_lo), gap_hi), min(max(prep_start, gap_lo), gap_hi),
                min(max(span["issued"], gap_lo), gap_hi), gap_hi]
        for k in range(1, 5):
            cuts[k] = max(cuts[k], cuts[k - 1])
        for name, lo, hi in zip(("no work", "scheduler", "prepare+thread", "device"), cuts, cuts[1:]):
            pieces[name] += hi - lo
        for name, s in phase_shares(intervals, cuts[1], cuts[2]).items():
            waiting[name] += s
    first_arrival = min(r["arrival"] for r in reqs)
    last_answer = max(r["answered"] for r in reqs)
    out = dict(wall=last_answer - first_arrival, gaps=gaps, pieces=dict(pieces), waiting=dict(waiting),
               busy=sum(s["end"] - s["start"] for s in spans))
    if spans:
        out["head"] = spans[0]["start"] - first_arrival
        out["tail"] = last_answer - max(s["end"] for s in spans)
        out["tail_batches"] = sum(1 for t, *_ in launches if t > max(s["end"] for s in spans))
    out["batches"] = len(launches)
    out["gpu_only"] = sum(1 for l in launches if not l[2])
    out["gpu_only_small"] = sum(1 for l in launches if not l[2] and l[1] <= 2)
    out["with_hot"] = sum(1 for l in launches if l[3])
    hot = sorted((r for r in reqs if r["user"] == run["hot_user"]), key=lambda r: r["arrival"])
    out["hot"] = len(hot)
    out["hot_last_wait"] = hot[-1]["answered"] - hot[-1]["arrival"] if hot else 0.0
    steps = defaultdict(float)
    for name, lo, hi in run.get("engine", []):
        steps[name] += hi - lo
    n = max(1, len(launches))
    out["steps_ms"] = {k: v * 1e3 / n for k, v in steps.items()}
    sm = out["steps_ms"]
    sm["offload wait"] = (sm.get("kv.offload_early", 0.0) - sm.get("below.offload", 0.0)
                          - sm.get("deferred.release", 0.0))
    sizes = [l[1] for l in launches]
    out["mean_batch"] = statistics.mean(sizes) if sizes else 0.0
    return out


def main() -> None:
    runs = json.load(open(sys.argv[1]))
    pick = set(sys.argv[2:])
    rows = defaultdict(list)
    for run in runs:
        if pick and run["variant"] not in pick:
            continue
        rows[(run["rate"], run["variant"])].append(analyse(run))
    ms = lambda x: f"{x * 1e3:.1f}"
    print("| off. | variant | wall | busy | head | tail (batches) | gaps | no work | sched | prep+thr | device | "
          "batches gpu-only (<=2) hot | hot last wait | sched wait by step |")
    for (rate, variant), got in sorted(rows.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        m = lambda k: statistics.median(g.get(k, 0.0) for g in got)
        p = lambda k: statistics.median(g["pieces"].get(k, 0.0) for g in got)
        steps = defaultdict(float)
        for g in got:
            for k, v in g["waiting"].items():
                steps[k] += v / len(got)
        top = ", ".join(f"{k} {ms(v)}" for k, v in sorted(steps.items(), key=lambda kv: -kv[1])[:4])
        print(f"| {rate:g} | {variant} | {ms(m('wall'))} | {ms(m('busy'))} | {ms(m('head'))} | {ms(m('tail'))} "
              f"({m('tail_batches'):.0f}) | {m('gaps'):.0f} | {ms(p('no work'))} | {ms(p('scheduler'))} | "
              f"{ms(p('prepare+thread'))} | {ms(p('device'))} | {m('batches'):.0f} {m('gpu_only'):.0f} "
              f"({m('gpu_only_small'):.0f}) {m('with_hot'):.0f} | {ms(m('hot_last_wait'))} | {top} |")
    print("| off. | variant | engine ms per batch (median of runs) |")
    for (rate, variant), got in sorted(rows.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        names = sorted({k for g in got for k in g["steps_ms"]})
        each = ", ".join(f"{k} {statistics.median(g['steps_ms'].get(k, 0.0) for g in got):.2f}" for k in names)
        print(f"| {rate:g} | {variant} | {each} |")


if __name__ == "__main__":
    main()
