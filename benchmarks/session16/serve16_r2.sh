#!/usr/bin/env bash
# serve16 round 2 (<= 110 s; ran on commit f7d49c4, whose variants were: s15 = session 15's scheduler, paced = paced
# batches, owe = owed offloads (a launch owes a user's offload instead of waiting for its previous one,
# runtime/kv_manager.py), library = paced + owe; owed offloads were removed after this call). 1) the serving GPU test
# under prefetch. 2) the A/B at the benchmark's workload (hstu-bench, 4K cached, Zipf 1.0, 64 users, GPU pool for 16,
# batches up to 8, 300 Poisson requests a run, guarded, copy thread on, copy timeline), one engine, 3 alternated
# blocks, 960/s and 1400/s offered, raw traces (benchmarks/session16/serve_trace.py), CPU time, the ideal server's rate.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; work=$OUT/serve16; mkdir -p "$work"
t0=$SECONDS
echo "=== GPU test (limit 34s)"
timeout 34 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/serving/test_serving_gpu.py -k guarded \
  >"$work/gpu-tests.log" 2>&1
rc=$?; grep -E "[0-9]+ (passed|failed)" "$work/gpu-tests.log" | tail -1
if [ $rc -eq 0 ]; then echo "GPU TESTS PASS"; else echo "GPU TESTS FAIL rc=$rc"; grep -E "^(FAILED|ERROR)" "$work/gpu-tests.log" | head -3; fi
left=$((107 - (SECONDS - t0))); [ $left -lt 66 ] && left=66
echo "=== serving A/B (at $((SECONDS - t0))s, limit ${left}s)"
timeout $left python3 benchmarks/session16/serve_ab.py "$work" cuda 300 3 s15,paced,owe,library 960,1400 \
  serving-owe-r2-h200.json --trace 2>"$work/ab.stderr"
rc=$?; echo "=== A/B rc=$rc at $((SECONDS - t0))s"
if [ $rc -ne 0 ]; then grep "req/s" "$work/ab.stderr" | sed 's/policy guarded, //' | cut -c1-110 | tail -18; grep -v "^\s*$" "$work/ab.stderr" | grep -v "req/s" | tail -3; fi
exit 0
