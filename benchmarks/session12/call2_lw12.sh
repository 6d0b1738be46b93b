#!/usr/bin/env bash
# lw12 round 2 (<= 75 s): GPU tests of what changed first (the host pins after wait_offloads, the early release on
# every signal kind, the cudart fill now the default under the engine's bitwise tests, RUN_BATCH's reused op tables),
# then ONE process A/B'ing in alternated blocks main's paths (release=after, fill_copy=torch) against fillc (the new
# default: cudart fill) and new (fillc + release=early): CPU hit + layerwise and GPU hit at 16K and 2K, bf16 then
# fp8_e4m3: median ms, LB, efficiency, host phases; then a --timeline of the defaults with release=early.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.
unset LAYERFLOW_RELEASE LAYERFLOW_FILL_COPY LAYERFLOW_COPY_PATH
START=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - START) )); }
timeout 5 nvidia-smi -L 2>&1 | head -1

echo "=== GPU tests"
E=tests/runtime/test_engine_gpu.py
timeout 28 python3 -m pytest -m gpu -q -p no:cacheprovider tests/runtime/test_host_paths_gpu.py \
    "$E::test_cpu_hit_equals_gpu_hit_bitwise[True-SignalMode.WAITVALUE]" \
    "$E::test_failing_transfer_fails_within_a_second_and_next_batch_succeeds[waitvalue-early]" \
    "$E::test_failing_transfer_fails_within_a_second_and_next_batch_succeeds[eventfd-early]" \
    tests/transfer/test_copy_paths.py::test_run_batch_transfers_refilling_one_op_table_are_byte_exact \
    --junitxml="$OUT/lw12-gpu-tests.xml" > "$OUT/lw12-gpu-tests.log" 2>&1
rc=$?
tail -1 "$OUT/lw12-gpu-tests.log"
if [ $rc -eq 0 ]; then echo "GPU tests: PASS"; else echo "GPU tests: FAIL (rc=$rc)"; grep -E "^(FAILED|ERROR|E  )" "$OUT/lw12-gpu-tests.log" | head -10; fi
echo "elapsed $(( $(date +%s) - START )) s"

echo "=== A/B main (after+torch) / fillc (cudart fill, the default) / new (cudart + early), alternated blocks"
T=$(left 60); [ $T -gt 34 ] && T=34
timeout $T python3 -m layerflow.bench.paths --seq-lens 16K,2K --kv-cache-dtypes auto,fp8_e4m3 \
    --variants main,fillc,new --blocks 6 --iters 4 --profile --out "$OUT/lw12-paths.json" \
    > "$OUT/lw12-paths.stdout" 2> "$OUT/lw12-paths.stderr"
echo "rc=$? elapsed $(( $(date +%s) - START )) s"
python3 - "$OUT/lw12-paths.json" <<'PY' 2>&1 | tail -50
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
cols = ("prepare", "prepare.pack", "prepare.onboard", "launch.fill", "launch.fill.copy", "launch.offload",
        "collect.fetch", "collect.commit", "collect.other")
print("| dtype | hist | variant | layerwise (p90) | LB | eff | GPU hit (p90) | diff |")
for r in rows:
    for n, v in r["variants"].items():
        lw, hit = v["layerwise_ms"], v["gpu_hit_ms"]
        print(f"| {r['kv_cache_dtype']} | {r['seq_len']} | {n} | {lw['median']:.3f} ({lw['p90']:.3f}) | "
              f"{r['lower_bound_ms']:.3f} | {v['pipeline_efficiency']:.3f} | {hit['median']:.3f} ({hit['p90']:.3f}) | "
              f"{v['max_abs_diff_vs_gpu_hit']:.0e} |")
print("phases ms: " + " ".join(c.replace("launch.", "l.").replace("collect.", "c.").replace("prepare.", "p.")
                              for c in cols))
for r in rows:
    for n, v in r["variants"].items():
        for sc, key in (("hit", "gpu_hit_phases_ms"), ("lw", "layerwise_phases_ms")):
            ph = v.get(key, {})
            print(f"{r['kv_cache_dtype'][:4]} {r['seq_len']:5d} {n:5s} {sc:3s} "
                  + " ".join(f"{ph.get(c, float('nan')):.3f}" for c in cols))
PY
grep -vE "paths (auto|fp8)" "$OUT/lw12-paths.stderr" | tail -3

T=$(left 73)
if [ $T -ge 8 ]; then
  echo "=== timeline, defaults (cudart fill) + release=early, bf16 2K,16K (bench --timeline)"
  LAYERFLOW_RELEASE=early timeout $T python3 -m layerflow.cli bench --seq-lens 2K,16K --scenarios gpu_hit,cpu_hit_layerwise \
      --timeline --timed-iters 6 --warmup-iters 2 --out "$OUT/lw12-timeline.json" > "$OUT/lw12-timeline.stdout" 2>&1
  echo "rc=$?"
  python3 - "$OUT/lw12-timeline.json" <<'PY' 2>&1 | tail -6
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

tar -czf "$OUT/lw12.tgz" -C "$OUT" $(cd "$OUT" && ls lw12-* 2>/dev/null) 2>/dev/null
echo "total $(( $(date +%s) - START )) s"
