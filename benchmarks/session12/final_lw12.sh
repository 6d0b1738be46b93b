#!/usr/bin/env bash
# lw12 final (<= 60 s, on merged main): GPU tests of what changed (the early release now the only release of an
# in-process onboarding, on every signal kind, graph and eager, and under a failing transfer; the cudart fill copy now
# the only CUDA fill; the layout's cached addresses under every copy path), then ONE bench --timeline of the defaults
# (bf16, 2K and 16K, GPU hit + CPU hit layerwise): wall, LB, efficiency, issue / transfer / tail and the host stamps
# (copier_built - job_checked is what the cached addresses cut; call 2 had 0.047 ms at 2K, 0.066 at 16K).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.
START=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - START) )); }
timeout 5 nvidia-smi -L 2>&1 | head -1

echo "=== GPU tests"
E=tests/runtime/test_engine_gpu.py
F="$E::test_failing_transfer_fails_within_a_second_and_next_batch_succeeds"
P=tests/transfer/test_copy_paths.py
timeout 28 python3 -m pytest -m gpu -q -p no:cacheprovider tests/runtime/test_host_paths_gpu.py \
    "$E::test_cpu_hit_equals_gpu_hit_bitwise[True-SignalMode.WAITVALUE]" "$F[SignalMode.WAITVALUE]" \
    "$F[SignalMode.EVENTFD]" tests/transfer/test_copy_engine.py \
    "$P::test_run_batch_transfers_refilling_one_op_table_are_byte_exact" \
    "$P::test_run_batch_writes_the_same_bytes_as_the_page_batch" \
    --junitxml="$OUT/lw12-gpu-tests.xml" > "$OUT/lw12-gpu-tests.log" 2>&1
rc=$?
tail -1 "$OUT/lw12-gpu-tests.log"
if [ $rc -eq 0 ]; then echo "GPU tests: PASS"; else echo "GPU tests: FAIL (rc=$rc)"; grep -E "^(FAILED|ERROR|E  )" "$OUT/lw12-gpu-tests.log" | head -10; fi
echo "elapsed $(( $(date +%s) - START )) s"

T=$(left 55)
if [ $T -ge 8 ]; then
  echo "=== bench --timeline, defaults (early release, cudart fill), bf16 2K,16K"
  timeout $T python3 -m layerflow.cli bench --seq-lens 2K,16K --scenarios gpu_hit,cpu_hit_layerwise --timeline \
      --timed-iters 10 --warmup-iters 3 --out "$OUT/lw12-timeline.json" > "$OUT/lw12-timeline.stdout" 2>&1
  echo "rc=$?"
  python3 - "$OUT/lw12-timeline.json" <<'PY' 2>&1 | tail -12
import json, sys
d = json.load(open(sys.argv[1]))
keys = ("issue_ms", "transfer_ms", "tail_ms", "signal_lag", "last_compute", "host_late", "wake", "post", "first_wait")
host = ("onboard_call", "host_pinned", "signal_acquired", "job_checked", "copier_built", "copy0_issued", "all_issued",
        "onboard_end", "prepare_end", "replay_call", "fetch_call", "fetch_end", "collect_end")
for r in d["results"]:
    line = f"{r['scenario']} {r['seq_len']} wall {r['wall_ms']['median']:.3f} (p90 {r['wall_ms']['p90']:.3f})"
    bound = d.get("bounds", {}).get(str(r["seq_len"]), {})
    if r["scenario"] == "cpu_hit_layerwise" and "lower_bound" in bound:
        line += f" LB {bound['lower_bound']:.3f} eff {bound['pipeline_efficiency']:.3f}"
    line += f" diff {r.get('max_abs_diff_vs_gpu_hit', float('nan')):.0e}"
    print(line)
    t = r.get("timeline_ms")
    if t:
        print("  " + " ".join(f"{k}={t[k]:.3f}" for k in keys if k in t))
        print("  host:", " ".join(f"{k}={t['host.' + k]:.3f}" for k in host if "host." + k in t))
PY
fi

tar -czf "$OUT/lw12.tgz" -C "$OUT" $(cd "$OUT" && ls lw12-* 2>/dev/null) 2>/dev/null
echo "total $(( $(date +%s) - START )) s"
