#!/bin/bash
# host10r, final call: the staging GPU test (new default slab+after against the proven batch+before, bitwise), then
# the two paths A/B'd in ONE process at 2K and 16K (GPU hit BS=1, alternated blocks), walls and phases to stdout.
# Runs from the repo root; everything under $OUT/host10r (tarred to $OUT/host10r.tgz). Whole script <= 60 s.
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
D=$OUT/host10r
mkdir -p "$D"
T0=$(date +%s)
echo "=== host10r $(git rev-parse --short HEAD 2>/dev/null) $(date -u +%H:%M:%S)"
echo "=== GPU test: tests/runtime/test_staging_gpu.py (limit 20 s)"
timeout 20 python3 -m pytest -m gpu -q -p no:cacheprovider tests/runtime/test_staging_gpu.py > "$D/gpu-staging.txt" 2>&1
rc=$?; tail -2 "$D/gpu-staging.txt" | cut -c1-300
if [ $rc -eq 0 ]; then echo "staging GPU test: PASS"; elif [ $rc -eq 124 ]; then echo "staging GPU test: TIMEOUT"; else echo "staging GPU test: FAIL (rc $rc)"; fi
LEFT=$((56 - $(date +%s) + T0)); [ $LEFT -lt 5 ] && LEFT=5
echo "=== A/B in one process, batch+before vs slab+after, GPU hit 2K,16K (limit $LEFT s)"
timeout $LEFT python3 -u benchmarks/session10/host10r_ab.py "$D" 2048,16384 > "$D/ab.txt" 2>&1
echo "rc=$?"; grep -v "^ *$" "$D/ab.txt" | grep -v -i warn | head -80
tar czf "$OUT/host10r.tgz" -C "$OUT" host10r
echo "=== total $(( $(date +%s) - T0 )) s"
