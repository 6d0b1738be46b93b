#!/usr/bin/env bash
# Session 18: page reuse ordered on the copy engine (the library) against the host waiting for offloads ("host-waits",
# session 17's rule), on one engine, alternated in blocks: the serving benchmark's workload (hstu-bench, 4K cached,
# Zipf 1.0, 64 users, GPU pool for 16, batches up to 8, guarded, copy thread on, paced batches), 1000 Poisson
# requests a run at 2000 and 1400/s offered (past the bound). First the GPU tests of the code it touches.
# -> $OUT/reuse18/{gpu-tests.log, serving-reuse-s18-h200.json}
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; work=$OUT/reuse18; mkdir -p "$work"
t0=$SECONDS
timeout ${TESTS_S:-150} python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider -W ignore \
  tests/transfer/test_issue_thread.py tests/runtime/test_engine_gpu.py tests/serving/test_serving_gpu.py \
  tests/runtime/test_host_paths_gpu.py > "$work/gpu-tests.log" 2>&1
echo "=== GPU tests rc=$? at $((SECONDS - t0))s"; tail -15 "$work/gpu-tests.log"
timeout ${SERVE_S:-330} python3 benchmarks/session16/serve_ab.py "$work" cuda 1000 2 library,host-waits 2000,1400 \
  serving-reuse-s18-h200.json 2>"$work/ab.stderr" | tee "$work/ab.stdout"
echo "=== reuse A/B rc=$? at $((SECONDS - t0))s"
tail -5 "$work/ab.stderr"
exit 0
