#!/bin/bash
# gluon3b (issue 18 part 1, round 2): Gluon attention, the new D=256 default 64x2:ws:tma against the old 64x2:ws and
# the new options: ov (next tile's Q K^T during this tile's SiLU, asynchronous wgmma, >= 3 stages) and tanh (SiLU by
# one tanh.approx per score), then ncu of the default's two 16K launches. A: GPU correctness (parallel pytest, PASS/FAIL per test). B: timing, one process, BS=1, D=256, H=4,
# bf16, L2 rotated, the attention kernel alone (reduce=False, what the engine runs: the gate sums the partials),
# with DRAM traffic counting the fp32 partials written. C: ncu of 64x2:ws:tma at 16K x 256 / 0 candidates.
set -u
OUT=${OUT:-/tmp/out}
W=$OUT/gluon3b
mkdir -p "$W"
export PYTHONPATH=.
START=$(date +%s)
PY=${PY:-python3}
left() { echo $(( $1 - ($(date +%s) - START) )); }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader 2>/dev/null | head -1

# ---- A: correctness -----------------------------------------------------------------------------------------------
timeout 15 $PY -m pytest --collect-only -q -m gpu tests/kernels/test_gluon_attention_gpu.py \
    tests/kernels/test_gluon_smoke_gpu.py -p no:cacheprovider 2>/dev/null | grep "::" > "$W/all_ids.txt"
KEEP='benchmark_shapes\[(64x2:ws:tma|32x4:ws:tma:ov|64x3:ws:m64:tma:ov|64x2:ws:tma:tanh|32x4:ws:tma:ov:tanh)-(0|256)-bs1\]|benchmark_shapes\[64x2:ws:tma-(0|256)-bs8\]'
{ grep -v "benchmark_shapes" "$W/all_ids.txt"; grep -E "$KEEP" "$W/all_ids.txt"; } > "$W/ids.txt"
echo "# A: $(wc -l < "$W/ids.txt") GPU tests in 13 processes"
for g in $(seq 10 22); do
    awk -v g=$g 'NR % 13 == g - 10' "$W/ids.txt" > "$W/ids$g.txt"
    [ -s "$W/ids$g.txt" ] || continue
    ( timeout 28 $PY -m pytest -q -rA -p no:cacheprovider $(cat "$W/ids$g.txt") > "$W/tests$g.log" 2>&1;
      echo "rc=$?" >> "$W/tests$g.log" ) &
done
wait
cat "$W"/tests??.log > "$W/tests.log"
grep -h "^PASSED\|^FAILED\|^ERROR" "$W/tests.log" | sed 's/ - .*//' | sort > "$W/results.txt"
while read -r id; do
    grep -qxF "PASSED $id" "$W/results.txt" && continue
    if grep -qxF "FAILED $id" "$W/results.txt" || grep -qxF "ERROR $id" "$W/results.txt"; then
        echo "FAIL $id"; else echo "MISSING $id"; fi
done < "$W/ids.txt" > "$W/not_passed.txt"
cp "$W/not_passed.txt" "$W/failed.txt"     # failed or missing (a hang): B skips its variant
echo "# A: PASS $(grep -c ^PASSED "$W/results.txt") / $(wc -l < "$W/ids.txt"); not passed: $(wc -l < "$W/not_passed.txt")"
sed 's/tests\/kernels\/test_gluon_attention_gpu.py:://' "$W/not_passed.txt" | head -20
grep -h "^E  " "$W/tests.log" | sort | uniq -c | sort -rn | head -6 | cut -c1-240
echo "# A took $(( $(date +%s) - START )) s"

# ---- B: timing ----------------------------------------------------------------------------------------------------
cat > "$W/bench.py" <<'EOF'
import json, os, sys, threading
from dataclasses import asdict, replace
import torch
from benchmarks.kernels import Case, attention_row, copy_bandwidth, gluon_label, graph_of, median_ms
from layerflow.kernels import default_tiling
from layerflow.kernels.gluon_attention import GluonTiling as G

failed = open(sys.argv[1]).read()
out, hung_file = sys.argv[2], sys.argv[3]
hung = open(hung_file).read().split() if os.path.exists(hung_file) else []
def passed(label):
    return f"[{label}-" not in failed and f"[{label}]" not in failed and label not in hung
copy_bw = copy_bandwidth(1 << 30, 10)
print(f"# copy {copy_bw / 1e12:.2f} TB/s", flush=True)
rows = json.load(open(out)) if os.path.exists(out) else []
done = {(r["label"], r["history"], r["candidates"], r.get("override")) for r in rows}

def kernel_us(case):
    a = case.attn
    def launches():
        for r in range(case.rotations):
            a.run(case.q, case.k, case.v, case.pool, case.tables[r], case.offsets, case.hist_lens, case.app_lens,
                  case.out, reduce=False)
    return median_ms(graph_of(launches).replay, 20) * 1e3 / case.rotations

def time_case(g, hist, cand, splits=None, with_sum=False):
    label = gluon_label(asdict(g))[6:]
    if (label, hist, cand, splits) in done or label in hung:
        return
    def hang():
        print(f"# HANG {label} {hist} {cand}: no result in 12 s", flush=True)
        with open(hung_file, "a") as f:
            f.write(label + "\n")
        os._exit(3)
    watchdog = threading.Timer(12.0, hang)
    watchdog.start()
    tiling = None if splits is None else replace(default_tiling(256, torch.bfloat16, 64 + cand), num_splits=splits)
    row = dict(history=hist, candidates=cand)
    try:
        case = Case(1, hist, cand, 256, 32, tiling, kernel="gluon", gluon_tiling=g)
        a = case.attn
        us = kernel_us(case)
        partial_bytes = (a.num_splits * case.q.shape[0] * a.num_heads * a.head_dim * 4) if a.num_splits > 1 else 0
        row.update(kernel_us=us, splits=a.num_splits, block_m=a.block_m, kv_tb_s=case.kv_bytes / us / 1e6,
                   dram_tb_s=(case.kv_bytes + partial_bytes) / us / 1e6, partial_mb=partial_bytes / 1e6,
                   tflops=case.flops() / us / 1e6)
        if with_sum:
            row["with_sum_us"] = attention_row(case, copy_bw, 20, False)["time_us"]
    except Exception as error:
        row["error"] = f"{type(error).__name__}: {error}"[:300]
    row["label"], row["override"] = label, splits
    watchdog.cancel()
    rows.append(row)
    json.dump(rows, open(out, "w"), indent=1)
    msg = row.get("error") or (f"{row['kernel_us']:6.1f} us  kv {row['kv_tb_s']:.2f} TB/s  dram {row['dram_tb_s']:.2f}"
                               f"  {row['tflops']:4.0f} TFLOP/s  s{row['splits']} m{row['block_m']}"
                               + (f"  with sum {row['with_sum_us']:.1f}" if with_sum else ""))
    print(f"{label:20s} {hist:5d} {cand:3d} {splits or '-':>3}  {msg}", flush=True)

DEFAULT = G(64, 2, "ws", loader="tma")
new = [G(32, 4, "ws", loader="tma", overlap=True), G(64, 3, "ws", block_m=64, loader="tma", overlap=True),
       G(64, 2, "ws", loader="tma", tanh_silu=True), G(32, 4, "ws", loader="tma", overlap=True, tanh_silu=True)]
baselines = [G(32, 4, "ws", loader="tma"), G(64, 3, "ws", block_m=64, loader="tma"), G(64, 2, "ws")]
shapes = [(16384, 256), (16384, 0), (2048, 256), (2048, 0)]
def time_all(g):
    label = gluon_label(asdict(g))[6:]
    if not passed(label):
        print(f"# skipped {label}: a correctness test failed or it hung", flush=True)
        return
    for hist, cand in shapes:
        time_case(g, hist, cand)
for hist, cand in shapes:
    time_case(DEFAULT, hist, cand, with_sum=hist == 16384)
for g in new:
    time_all(g)
for hist, cand, splits in [(16384, 0, 44), (16384, 0, 66), (16384, 0, 22), (2048, 0, 16), (2048, 0, 8)]:
    time_case(DEFAULT, hist, cand, splits)
for g in baselines:
    time_all(g)

print("\n| schedule | splits | 16K 256 cand us (TFLOP/s) | 16K 0 cand us (KV / DRAM TB/s) | 2K 256 cand us (TFLOP/s) "
      "| 2K 0 cand us (KV / DRAM TB/s) |")
print("|---|---|---|---|---|---|")
groups = {}
for r in rows:
    groups.setdefault((r["label"], r.get("override")), {})[(r["history"], r["candidates"])] = r
def cell(r, compute):
    if r is None:
        return "-"
    if "error" in r:
        return "error"
    figure = f"{r['tflops']:.0f}" if compute else f"{r['kv_tb_s']:.2f} / {r['dram_tb_s']:.2f}"
    return f"{r['kernel_us']:.1f} ({figure}) s{r['splits']}"
for (label, override), cells in groups.items():
    print(f"| {label} | {override or 'auto'} | " + " | ".join(cell(cells.get(s), s[1] > 0) for s in shapes) + " |")
EOF
for attempt in 1 2 3; do
    LEFT=$(left 66)
    [ $LEFT -lt 8 ] && break
    echo "# B run $attempt: limit $LEFT s"
    timeout $LEFT $PY "$W/bench.py" "$W/failed.txt" "$W/rows.json" "$W/hung.txt" 2>>"$W/bench.err"
    RC=$?
    echo "# B rc=$RC ($(( $(date +%s) - START )) s in all)"
    [ $RC -ne 3 ] && break
done
tail -3 "$W/bench.err" | cut -c1-300

# ---- C: ncu of the default's 16K launches (256 then 0 candidates) -------------------------------------------------
cat > "$W/ncu_case.py" <<'EOF'
import torch
from benchmarks.kernels import Case
from layerflow.kernels.gluon_attention import GluonTiling as G
for cand in (256, 0):
    case = Case(1, 16384, cand, 256, 32, None, kernel="gluon", gluon_tiling=G(64, 2, "ws", loader="tma"))
    case.attn.run(case.q, case.k, case.v, case.pool, case.tables[0], case.offsets, case.hist_lens, case.app_lens,
                  case.out, reduce=False)
    torch.cuda.synchronize()
EOF
cat > "$W/ncu_read.py" <<'EOF'
import csv, re, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
names, units, data = rows[head], rows[head + 1], rows[head + 2:]
want = [r"^gpu__time_duration.sum$", r"^dram__throughput.avg.pct_of_peak_sustained_elapsed$", r"^dram__bytes_read.sum$",
        r"^dram__bytes_write.sum$", r"^sm__throughput.avg.pct_of_peak_sustained_elapsed$", r"gmma|tensor_op",
        r"^launch__registers_per_thread$", r"^launch__grid_size$", r"^sm__warps_active.avg.pct_of_peak",
        r"^smsp__cycles_active.avg$", r"local", r"^lts__t_sector_hit_rate.pct$", r"^smsp__issue_active.avg.pct",
        r"^l1tex__data_bank_conflicts", r"^smsp__average_warp_latency_per_inst_issued", r"pipe_.*fma.*pct|pipe_xu.*pct|pipe_alu.*pct"]
for row in data:
    if len(row) != len(names):
        continue
    get = lambda name: row[names.index(name)] if name in names else "?"
    print(f"## ncu kernel {get('Kernel Name')[:40]} grid {get('Grid Size')} block {get('Block Size')}")
    stalls = []
    for n, u, v in zip(names, units, row):
        if re.search(r"issue_stalled_.*per_issue_active.ratio$", n):
            try:
                stalls.append((float(v.replace(",", "")), n))
            except ValueError:
                pass
        elif any(re.search(p, n) for p in want) and v not in ("", "0", "0.00"):
            print(f"  {n} = {v} {u}")
    stalls.sort(reverse=True)
    print("  stalls per issue: " + ", ".join(f"{re.sub(r'.*stalled_|_per_issue.*', '', n)} {s:.2f}"
                                             for s, n in stalls[:9]))
EOF
LEFT=$(left 88)
if [ $LEFT -ge 12 ] && command -v ncu >/dev/null; then
    echo "# C: ncu, limit $LEFT s"
    timeout $LEFT ncu --target-processes all -k regex:_gluon_attention_kernel -c 2 --section SpeedOfLight \
        --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --section LaunchStats --csv --page raw $PY "$W/ncu_case.py" > "$W/ncu.csv" 2> "$W/ncu.err"
    echo "# C rc=$? ($(( $(date +%s) - START )) s in all)"
    timeout 5 $PY "$W/ncu_read.py" "$W/ncu.csv" 2>&1 | cut -c1-200 | head -60
    tail -3 "$W/ncu.err" | cut -c1-300
else
    echo "# C skipped: $LEFT s left or no ncu"
fi
tar czf "$OUT/gluon3b.tgz" -C "$OUT" gluon3b 2>/dev/null
echo "# done in $(( $(date +%s) - START )) s"
