#!/usr/bin/env bash
# att11 round 2 (issue 18), on merged main: the attention's split count from each launch's real query blocks
# ("rows") and the candidates' self tiles on the last split are the defaults, and the token ladder has 4 steps per
# power of two (a 320-token request in a 320 bucket). 1. GPU correctness of what changed, four pytest processes at
# once (they also fill the Triton cache). 2. One process, three engines, alternated blocks of GPU hits at 16K and 2K:
# main's default before (512 bucket, bucket/first) against the new defaults in the 512 and the 320 bucket, with each
# one's scores against the float64 recompute; then the warm-up of default engines over the 1- and 4-step ladders.
# Runs from the repo root with PYTHONPATH=.; everything else under $OUT (att11.tgz).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
P="python3 -m pytest -m gpu -q -p no:cacheprovider"
E=tests/runtime/test_engine_gpu.py
S=tests/kernels/test_attention_splits_gpu.py
G=tests/kernels/test_gluon_attention_gpu.py::test_one_graph_replays_any_lengths_like_eager
timeout 40 $P $S -k "bucket-first or rows-last" > "$OUT/t_splits.log" 2>&1 &
pa=$!
timeout 40 $P "$G" > "$OUT/t_graph.log" 2>&1 &
pb=$!
timeout 40 $P "$E::test_cpu_hit_equals_gpu_hit_bitwise[True-SignalMode.EVENTFD]" \
    "$E::test_graph_replays_across_lengths_like_eager" > "$OUT/t_engine.log" 2>&1 &
pc=$!
timeout 40 $P "$E::test_gpu_path_matches_full_recompute" > "$OUT/t_recompute.log" 2>&1 &
pd=$!
for job in "splits:$pa" "graph:$pb" "engine:$pc" "recompute:$pd"; do
    name=${job%%:*}
    wait "${job#*:}"; rc=$?
    [ "$rc" = 0 ] && verdict=PASS || verdict="FAIL rc=$rc"
    echo "gpu tests $name: $verdict: $(tail -1 "$OUT/t_$name.log")"
    [ "$rc" = 0 ] || grep -E "^(FAILED|ERROR)|Error" "$OUT/t_$name.log" | head -5
done
echo "tests done at $(( $(date +%s) - start )) s"
left=$(( 78 - ($(date +%s) - start) ))
timeout "$left" python3 benchmarks/gpu_hit_ab.py --seq-lens 16K,2K --blocks 6 --requests 20 --profiled 5 \
    --variant main512=512:bucket:first --variant new512=512 --variant new320=320 --ladders 1,4,4 \
    --out "$OUT/gpu-hit-ab.json" > "$OUT/ab.log" 2>&1
echo "A/B rc=$? at $(( $(date +%s) - start )) s"
grep -E "^(#|\||###)|Error|error" "$OUT/ab.log" | grep -v "^# *$" | cut -c1-400 | tail -30
tar czf "$OUT/att11.tgz" -C "$OUT" $(cd "$OUT" && ls | grep -v att11.tgz)
