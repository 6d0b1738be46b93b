#!/usr/bin/env bash
# Session 12, call A: the waitvalue host-post fix (8db890c) on the H200: the signals' GPU tests and the engine-server
# GPU tests (ssd_hit hung before the fix), verbose, each test bounded.
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 LAYERFLOW_FIXTURES=$ROOT/.fixtures/stu_golden
export LD_LIBRARY_PATH=$ROOT/.redis/lib:${LD_LIBRARY_PATH:-} PATH=$ROOT/.redis/bin:$PATH
final=${OUT:-/tmp/out}; mkdir -p "$final"; log=$final/s12a.log
pip install --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
nvidia-smi -L; git log --oneline -1
timeout 200 python3 -m pytest -m gpu -v -rfE --tb=short -p no:cacheprovider --timeout 90 -n 6 --dist load -W ignore \
  tests/transfer/test_signals.py tests/server/test_engine_server.py > "$log" 2>&1
echo "rc=$?"
grep -E "(PASSED|FAILED|ERROR|SKIPPED) tests" "$log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | awk '{print $1}' | sort | uniq -c
grep -E "(FAILED|ERROR) tests|Timeout" "$log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | cut -c1-200 | sort -u | head
grep -E "ssd_hit|host_posted|posted_from_the_host" "$log" | cut -c1-200 | head
grep -E "^E  " "$log" | cut -c1-200 | sort | uniq -c | sort -rn | head -12
tail -3 "$log"
