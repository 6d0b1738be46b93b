#!/usr/bin/env bash
# gap12 final (issue 18, the GPU side of a GPU hit). Programmatic dependent launch and the split count's history cap
# were removed (call 2: no gain), so the kernels are main's. 1. GPU correctness of those kernels: the bf16 Gluon
# attention's defaults (the "rows" split table, self tiles last) against the fp32 reference at 2K/16K
# (test_attention_splits_gpu.py) and one captured graph replayed across lengths equal to eager
# (test_gluon_attention_gpu.py). 2. One process (benchmarks/gpu_hit_ab.py): the default engine's GPU hit at 16K then
# 2K (BS=1, 64 + 256, 320 bucket), 3 blocks x 20: wall median, attention and LayerNorm + gate us/layer, kernels and
# device span per request, the split count launched, scores vs float64 (printed as each finishes); then attention +
# gate alone at 4/8/11 splits at 2K (cut by the timeout if the machine was cold: the GPU-hit rows come first).
# Runs from the repo root with PYTHONPATH=.; everything under $OUT (gap12.tgz). <= 60 s wall.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
git log --oneline -1 2>/dev/null | cut -c1-80
P="python3 -m pytest -m gpu -q -p no:cacheprovider"
timeout 22 $P tests/kernels/test_attention_splits_gpu.py -k rows-last > "$OUT/t_splits.log" 2>&1 &
pa=$!
timeout 22 $P tests/kernels/test_gluon_attention_gpu.py -k "one_graph and rows-last" > "$OUT/t_graph.log" 2>&1 &
pb=$!
for job in "splits:$pa" "graph:$pb"; do
    name=${job%%:*}
    wait "${job#*:}"; rc=$?
    [ "$rc" = 0 ] && verdict=PASS || verdict="FAIL rc=$rc"
    echo "gpu tests $name: $verdict: $(tail -1 "$OUT/t_$name.log")"
    [ "$rc" = 0 ] || grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/t_$name.log" | head -6 | cut -c1-300
done
echo "tests done at $(( $(date +%s) - start )) s"
left=$(( 57 - ($(date +%s) - start) ))
timeout "$left" python3 benchmarks/gpu_hit_ab.py --seq-lens 16K,2K --blocks 3 --requests 20 --profiled 5 \
    --variant default=320 --sweep-splits 4,8,11 --sweep-lens 2K --out "$OUT/gpu-hit.json" > "$OUT/ab.log" 2>&1
echo "ab rc=$? at $(( $(date +%s) - start )) s"
grep -vE "^#|Warning|warn" "$OUT/ab.log" | tail -16 | cut -c1-250
grep -E "Error|Traceback" "$OUT/ab.log" | tail -3 | cut -c1-300
tar czf "$OUT/gap12.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.json 2>/dev/null) 2>/dev/null
