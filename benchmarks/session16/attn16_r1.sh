#!/bin/bash
# attn round 1 (issue 18 levers 1 and 2, issue 20's tanh SiLU), at most 110 s, on branch attn at 16e0e8a:
#  1. GPU tests of the new "pv2" variant (two 64-row consumer partitions, the empty upper half skipping its dots)
#     and of "pv2:s55" (short blocks take their own split count): ragged/partial/empty halves, BS=1 256 candidates,
#     graph replay; these compile the kernels the A/B times.
#  2. 256 candidates, 16K and 2K: pv (default) / pv2 / pv2:s55 (13/7 splits) / s65 (12/8) / s45 (13/6), 3 blocks.
#  3. fp8: exact vs tanh SiLU over the fp8 default, beside bf16, 16K/256, 2K/256, 16K/0.
#  4. 0 candidates: split counts 33 (the rule's) 16 22 26 30, 64x2 and 64x3 (TMA depth), 16K and 2K.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/attn_out}; mkdir -p "$OUT"
t0=$SECONDS
T=tests/kernels/test_gluon_attention_gpu.py
timeout -k 2 36 python3 -m pytest -m gpu -v -x -p no:cacheprovider \
  "$T::test_variants_match_tl_at_the_benchmark_shapes[64x2:pv2:tma:tanh:wt:sl-256-bs1]" \
  "$T::test_variants_match_tl_at_the_benchmark_shapes[64x2:pv2:m128:tma:tanh:wt:sl:s55-256-bs1]" \
  "$T::test_two_consumer_halves_match_tl_and_reference_where_the_upper_half_is_partial_or_empty" \
  "$T::test_one_graph_replays_any_lengths_like_eager[rows-last-pv2-s55]" > "$OUT/gpu-tests.log" 2>&1
echo "attn r1 GPU tests rc=$? $((SECONDS - t0)) s: $(grep -E ' passed| failed| error' "$OUT/gpu-tests.log" | tail -1)"
grep -oE "::[a-z_]+(\[[^]]*\])? (PASSED|FAILED|ERROR)" "$OUT/gpu-tests.log" | sed 's/::test_//' | cut -c1-120
grep -E "^E  " "$OUT/gpu-tests.log" | head -4 | cut -c1-220
t1=$SECONDS
timeout -k 2 22 python3 benchmarks/kernels.py --batch 1 --history 16384 2048 --candidates 256 \
  --head-dim 256 --no-sweep --no-gate --no-reference --iters 20 --kernel gluon --blocks 3 \
  --gluon-tiling 64x2:pv:tma:tanh:wt:sl 64x2:pv2:tma:tanh:wt:sl 64x2:pv2:tma:tanh:wt:sl:s55 \
  64x2:pv2:tma:tanh:wt:sl:s65 64x2:pv2:tma:tanh:wt:sl:s45 --out "$OUT/kernels-pv2-r1-h200.json" > "$OUT/kernels-pv2.log" 2>&1
echo "attn r1 256-cand A/B rc=$? $((SECONDS - t1)) s; $(grep -m1 'device-to-device' "$OUT/kernels-pv2.log" | cut -c3-100)"
summary() {
python3 - "$1" <<'PY'
import json, statistics, sys
sys.path.insert(0, ".")
from benchmarks.kernels import gluon_label
try:
    rows = [r for r in json.load(open(sys.argv[1]))["rows"] if "error" not in r]
except Exception as error:
    rows = []; print("no JSON:", error)
groups = {}
for r in rows:
    key = (-r["history"], r["candidates"], gluon_label(r["gluon_tiling"]).removeprefix("gluon "), r["num_splits"])
    groups.setdefault(key, []).append((r["time_us"], r["tflops"], r["kv_tb_s"]))
for (h, c, label, s), t in sorted(groups.items()):
    us = statistics.median(x[0] for x in t); k = [x[0] for x in t].index(us) if us in [x[0] for x in t] else 0
    print(f"{-h // 1024}K/{c} {label} splits {s}: {us:.1f} us ({t[k][1]:.0f} TFLOP/s, {t[k][2]:.2f} TB/s; blocks "
          + " ".join(f"{x[0]:.1f}" for x in t) + ")")
PY
}
summary "$OUT/kernels-pv2-r1-h200.json"
grep -m2 -E "Error" "$OUT/kernels-pv2.log" | cut -c1-200
t2=$SECONDS
timeout -k 2 30 python3 benchmarks/fp8_ab.py attention --variants "bf16,fp8 main,fp8 tanh" \
  --shapes 16K/256,2K/256,16K/0 --blocks 3 --seconds 22 --out "$OUT/kernels-fp8-tanh-r1-h200.json" \
  > "$OUT/fp8-ab.log" 2>&1
echo "attn r1 fp8 A/B rc=$? $((SECONDS - t2)) s"
grep -E "^\| (bf16|fp8)|deadline|ERROR" "$OUT/fp8-ab.log" | cut -c1-160
t3=$SECONDS
timeout -k 2 $((107 - t3)) python3 benchmarks/kernels.py --batch 1 --history 16384 2048 --candidates 0 \
  --head-dim 256 --no-sweep --no-gate --no-reference --iters 20 --kernel gluon --blocks 3 \
  --gluon-tiling 64x2:pv:tma:tanh:wt:sl 64x3:pv:tma:tanh:wt:sl --num-splits 33 16 22 26 30 \
  --out "$OUT/kernels-splits0-r1-h200.json" > "$OUT/kernels-splits0.log" 2>&1
echo "attn r1 0-cand splits rc=$? $((SECONDS - t3)) s"
summary "$OUT/kernels-splits0-r1-h200.json"
echo "attn r1 total $((SECONDS - t0)) s"
