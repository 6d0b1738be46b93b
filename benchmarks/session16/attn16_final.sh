#!/bin/bash
# attn final (issues 18, 20), on merged main, at most 90 s, no GPU tests (the lead's suite runs them, the fp8
# quality gate test included):
#  1. bf16 attention A/B in one process, 3 alternated blocks: the fifteenth session's default (pv, the whole wave at
#     64-row blocks) against the new default (pv2, 64-row blocks on 2/3 of a wave), 16K and 2K, 256 and 0 candidates.
#  2. fp8 attention A/B: bf16 / fp8 default (the tanh SiLU now) / fp8 exact (the old default), 16K/256 and 2K/256.
#  3. the fp8 quality gate's figures under the tanh default, on a cut workload (8 users per length, 2K-16K).
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/attn_out}; mkdir -p "$OUT"
t0=$SECONDS
timeout -k 2 27 python3 benchmarks/kernels.py --batch 1 --history 16384 2048 --candidates 256 0 \
  --head-dim 256 --no-sweep --no-gate --no-reference --iters 20 --kernel gluon --blocks 3 \
  --gluon-tiling 64x2:pv:tma:tanh:wt:sl 64x2:pv2:tma:tanh:wt:sl:f67 \
  --out "$OUT/kernels-attn16-final-h200.json" > "$OUT/kernels-attn16-final.log" 2>&1
echo "attn final bf16 A/B rc=$? $((SECONDS - t0)) s; $(grep -m1 'device-to-device' "$OUT/kernels-attn16-final.log" | cut -c3-100)"
grep -A10 "^| kernel | BS | history | cand | D | blocks" "$OUT/kernels-attn16-final.log" | tail -n +3 | cut -d'|' -f2,4,5,8,11,12
t1=$SECONDS
timeout -k 2 29 python3 benchmarks/fp8_ab.py attention --variants "bf16,fp8 main,fp8 exact" \
  --shapes 16K/256,2K/256 --blocks 3 --seconds 20 --out "$OUT/kernels-fp8-tanh-final-h200.json" \
  > "$OUT/fp8-ab-final.log" 2>&1
echo "attn final fp8 A/B rc=$? $((SECONDS - t1)) s (fp8 main: the tanh SiLU now; exact: the old default)"
grep -E "^\| (bf16|fp8)|deadline|ERROR" "$OUT/fp8-ab-final.log" | cut -c1-160
t2=$SECONDS
timeout -k 2 $((87 - t2)) python3 benchmarks/fp8_quality.py --users-per-length 8 \
  --out "$OUT/fp8-quality-tanh-h200.json" > "$OUT/fp8-quality-tanh.log" 2>&1
echo "attn final fp8 quality (tanh default, 8 users x 2K-16K) rc=$? $((SECONDS - t2)) s (0: the gate passes)"
grep -E "^\| (all|2048|4096|8192|16384) |Gate" "$OUT/fp8-quality-tanh.log" | cut -c1-160
echo "attn final total $((SECONDS - t0)) s"
