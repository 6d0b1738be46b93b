#!/usr/bin/env bash
# gap12 round 2 (issue 18, the GPU side of a GPU hit). 1. GPU correctness, two pytest processes at once (they also
# fill the Triton cache with the Gluon variants the A/B builds): the history cap (m = 4, 8) against the fp32
# reference, and the early launch (pdl, table and m = 8) bit for bit in a captured graph (attention + gate).
# 2. One process, GPU hits at 16K then 2K (BS=1, 64 + 256, 320 bucket), 4 alternated blocks x 20, five engines:
# main's path, pdl, cap m=4, cap m=8, pdl + cap m=8: wall median, attention and LayerNorm+gate us/layer, kernels
# and device span per request, the split count launched, scores vs float64; THEN attention + gate alone per fixed
# split count (2/3/4/6/8/11) at 2K/4K/16K (round 1's crash there: the sweep let each count's attention be freed
# before its graph replayed; fixed). Runs from the repo root with PYTHONPATH=.; everything under $OUT (gap12.tgz).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
git log --oneline -1 2>/dev/null | cut -c1-80
P="python3 -m pytest -m gpu -q -p no:cacheprovider"
S=tests/kernels/test_attention_splits_gpu.py
timeout 24 $P $S -k "early_launch" > "$OUT/t_graph.log" 2>&1 &
pa=$!
timeout 24 $P $S -k "history_cap" > "$OUT/t_cap.log" 2>&1 &
pb=$!
for job in "graph:$pa" "cap:$pb"; do
    name=${job%%:*}
    wait "${job#*:}"; rc=$?
    [ "$rc" = 0 ] && verdict=PASS || verdict="FAIL rc=$rc"
    echo "gpu tests $name: $verdict: $(tail -1 "$OUT/t_$name.log")"
    [ "$rc" = 0 ] || grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/t_$name.log" | head -6 | cut -c1-300
done
echo "tests done at $(( $(date +%s) - start )) s"
left=$(( 73 - ($(date +%s) - start) ))
timeout "$left" python3 benchmarks/gpu_hit_ab.py --seq-lens 16K,2K --blocks 4 --requests 20 --profiled 5 \
    --variant main=320 --variant pdl=320:pdl --variant t4=320:t4 --variant t8=320:t8 --variant both=320:pdl:t8 \
    --sweep-splits 2,3,4,6,8,11 --sweep-lens 2K,4K,16K --out "$OUT/gpu-hit-ab.json" > "$OUT/ab.log" 2>&1
echo "ab rc=$? at $(( $(date +%s) - start )) s"
grep -E "^# .*(built in|FAILED)" "$OUT/ab.log" | sed -E 's/, grid.*gluon/ gluon/' | cut -c1-200 | head -6
grep -vE "^#|Warning|warn" "$OUT/ab.log" | tail -40 | cut -c1-250
grep -E "Error|Traceback" "$OUT/ab.log" | tail -3 | cut -c1-300
tar czf "$OUT/gap12.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.json 2>/dev/null) 2>/dev/null
