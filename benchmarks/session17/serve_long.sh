#!/usr/bin/env bash
# Session 17: is session 16's 0.79 of the bound a short-run figure? The serving benchmark's workload (hstu-bench, 4K
# cached, Zipf 1.0, 64 users, GPU pool for 16, batches up to 8, guarded, copy thread on, paced batches), 1000 Poisson
# requests a run instead of 300, 2 alternated blocks at 1400/s and 2000/s offered (past the bound), the ideal server's
# rate on each run's arrivals -> $OUT/serve17/serving-long-s17-h200.json
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; work=$OUT/serve17; mkdir -p "$work"
t0=$SECONDS
timeout ${SERVE_S:-110} python3 benchmarks/session16/serve_ab.py "$work" cuda 1000 2 library 1400,2000 \
  serving-long-s17-h200.json 2>"$work/ab.stderr"
rc=$?; echo "=== long serving rc=$rc at $((SECONDS - t0))s"
grep "req/s" "$work/ab.stderr" | sed 's/policy guarded, //' | cut -c1-140 | tail -8
exit 0
