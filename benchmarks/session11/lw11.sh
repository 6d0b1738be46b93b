#!/usr/bin/env bash
# (Record of the final call: the early release and layerflow/bench/paths.py were reverted after it: see docs/performance.md.)
# lw11 final: the GPU tests of the engine's host paths (the early release of an onboarding is now the only path; the
# spin fetch selectable), then ONE process A/B'ing, in alternated blocks, "after" (main's path: the onboarding
# released in commit, after the block), "early" (the new default) and "spin" (early + collect spinning on an event):
# CPU hit + layerwise and GPU hit at 16K and 2K, bf16 then fp8_e4m3; layerwise ms, LB, efficiency and host phases per
# variant; then a --timeline run of the new default (issue / transfer / tail split and host stamps) at 2K and 16K.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.
unset LAYERFLOW_FETCH
START=$(date +%s)
timeout 5 nvidia-smi -L 2>&1 | head -1

echo "=== GPU tests (test_layerwise_paths_gpu.py; test_engine_gpu.py failing-transfer and cpu-hit-bitwise)"
timeout 34 python3 -m pytest -m gpu -q -p no:cacheprovider tests/runtime/test_layerwise_paths_gpu.py \
    tests/runtime/test_engine_gpu.py -k "paths or spin or failing or (cpu_hit_equals_gpu_hit_bitwise and not native and not False-)" \
    --junitxml="$OUT/lw11-gpu-tests.xml" > "$OUT/lw11-gpu-tests.log" 2>&1
rc=$?
tail -2 "$OUT/lw11-gpu-tests.log"
if [ $rc -eq 0 ]; then echo "GPU tests: PASS"; else echo "GPU tests: FAIL (rc=$rc)"; grep -E "^(FAILED|ERROR)|Error" "$OUT/lw11-gpu-tests.log" | head -8; fi
echo "elapsed $(( $(date +%s) - START )) s"

echo "=== A/B after (main) / early (new default) / spin (early + spin), one process"
LEFT=$(( 68 - ($(date +%s) - START) ))
[ $LEFT -gt 36 ] && LEFT=36
timeout $LEFT python3 -m layerflow.bench.paths --seq-lens 16K,2K --kv-cache-dtypes auto,fp8_e4m3 \
    --variants after,early,spin --blocks 4 --iters 4 --profile --out "$OUT/lw11-paths.json" \
    > "$OUT/lw11-paths.stdout" 2> "$OUT/lw11-paths.stderr"
echo "rc=$? elapsed $(( $(date +%s) - START )) s"
python3 - "$OUT/lw11-paths.json" <<'PY' 2>&1 | tail -20
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
cols = ("prepare", "prepare.onboard", "collect.fetch", "collect.commit", "collect.other")
print("| dtype | hist | variant | layerwise ms (p90) | LB | eff | GPU hit | diff | " + " | ".join(cols) + " |")
for r in rows:
    for n, v in r["variants"].items():
        lw, ph = v["layerwise_ms"], v.get("layerwise_phases_ms", {})
        print(f"| {r['kv_cache_dtype']} | {r['seq_len']} | {n} | {lw['median']:.3f} ({lw['p90']:.3f}) | "
              f"{r['lower_bound_ms']:.3f} | {v['pipeline_efficiency']:.3f} | {v['gpu_hit_ms']['median']:.3f} | "
              f"{v['max_abs_diff_vs_gpu_hit']:.0e} | " + " | ".join(f"{ph.get(c, float('nan')):.3f}" for c in cols) + " |")
PY
grep -vE "paths (auto|fp8)" "$OUT/lw11-paths.stderr" | tail -4

LEFT=$(( 79 - ($(date +%s) - START) ))
if [ $LEFT -ge 10 ]; then
  echo "=== timeline of the new default (early release, sync fetch), bf16, 2K,16K (bench --timeline)"
  timeout $LEFT python3 -m layerflow.cli bench --seq-lens 2K,16K --scenarios gpu_hit,cpu_hit_layerwise --timeline \
      --timed-iters 8 --warmup-iters 2 --out "$OUT/lw11-timeline.json" > "$OUT/lw11-timeline.stdout" 2>&1
  echo "rc=$?"
  python3 - "$OUT/lw11-timeline.json" <<'PY' 2>&1 | tail -6
import json, sys
keys = ("issue_ms", "transfer_ms", "tail_ms", "signal_lag", "last_compute", "host_late", "wake", "post", "first_wait")
host = ("onboard_call", "host_pinned", "signal_acquired", "job_checked", "copier_built", "copy0_issued", "all_issued",
        "onboard_end", "prepare_end", "replay_call", "fetch_call", "fetch_end", "collect_end")
for r in json.load(open(sys.argv[1]))["results"]:
    t = r.get("timeline_ms")
    if t:
        print(r["seq_len"], "wall %.3f" % r["wall_ms"]["median"], " ".join(f"{k}={t[k]:.3f}" for k in keys if k in t))
        print("  host:", " ".join(f"{k}={t['host.' + k]:.3f}" for k in host if "host." + k in t))
PY
fi

tar -czf "$OUT/lw11.tgz" -C "$OUT" $(cd "$OUT" && ls lw11-* 2>/dev/null) 2>/dev/null
echo "total $(( $(date +%s) - START )) s"
