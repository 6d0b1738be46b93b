#!/usr/bin/env bash
# serve16 final (<= 90 s, no GPU tests: the lead runs the GPU suite), on merged main: the A/B that proves the change.
# The serving benchmark's workload (hstu-bench, 4K cached, Zipf 1.0, 64 users, GPU pool for 16, batches up to 8, 300
# Poisson requests a run, guarded, copy thread on, copy timeline), one engine, variants s15 (session 15's batches:
# the oldest requests up to the cap) and library (paced batches: a queue deeper than a batch goes out in shares of its
# longest per-user backlog), 4 alternated blocks, 960/s and 1400/s offered (past the bound), the ideal server's rate
# on each run's arrivals -> $OUT/serve16/serving-s16-final-h200.json
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; work=$OUT/serve16; mkdir -p "$work"
t0=$SECONDS
echo "=== serving A/B (limit 85s)"
timeout 85 python3 benchmarks/session16/serve_ab.py "$work" cuda 300 4 s15,library 960,1400 \
  serving-s16-final-h200.json 2>"$work/ab.stderr"
rc=$?; echo "=== A/B rc=$rc at $((SECONDS - t0))s"
if [ $rc -ne 0 ]; then grep "req/s" "$work/ab.stderr" | sed 's/policy guarded, //' | cut -c1-110 | tail -16; grep -v "^\s*$" "$work/ab.stderr" | grep -v "req/s" | tail -3; fi
exit 0
