#!/usr/bin/env bash
# Session 11, final H200 call A on merged main: the GPU suite in two steps (the five largest files apart, so both fit
# the call), then the helpers' A/B scripts named on the command line (.session/<name>.sh, <= 80 s each). Expects the
# git-ignored folders .fixtures/stu_golden (a copy of ../shared/fixtures), .redis (redis-server and its libs) and
# .whl (redis-py/hiredis wheels).
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 LAYERFLOW_FIXTURES=$ROOT/.fixtures/stu_golden
export LD_LIBRARY_PATH=$ROOT/.redis/lib:${LD_LIBRARY_PATH:-} PATH=$ROOT/.redis/bin:$PATH
final=${OUT:-/tmp/out}; out=/tmp/fa; mkdir -p "$out" "$final"; log=$final/final-a.log
pip install --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)" | tee -a "$log"; local t0=$SECONDS
         timeout "$limit" "$@" >>"$log" 2>&1; echo "=== rc=$? in $((SECONDS - t0))s" | tee -a "$log"; }
nvidia-smi -L | tee -a "$log"; git log --oneline -1 2>/dev/null | tee -a "$log"
LARGEST="tests/kernels/test_gluon_attention_gpu.py tests/kernels/test_gluon_fp8_gpu.py
  tests/runtime/test_engine_fp8_gpu.py tests/kernels/test_fp8_gpu.py tests/runtime/test_kernel_choices_gpu.py"
ignores=$(for f in $LARGEST; do printf -- "--ignore=%s " "$f"; done)
step ${SUITE_S:-250} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 -n 8 --dist loadfile \
  $ignores -o junit_family=xunit2 --junitxml="$out/gpu-tests-rest.xml"
grep -E "passed|failed|FAILED|ERROR|Timeout" "$log" | tail -12
step ${LARGEST_S:-170} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 -n 8 --dist load $LARGEST \
  -o junit_family=xunit2 --junitxml="$out/gpu-tests-largest.xml"
grep -E "passed|failed|FAILED|ERROR|Timeout" "$log" | tail -12
tar czf "$final/final-a.tgz" -C "$out" .
for b in "$@"; do
  echo "##### $b"
  ( mkdir -p "$out/$b" && OUT="$out/$b" timeout 85 bash ".session/$b.sh" ) > "$out/$b.stdout" 2>&1
  echo "rc=$?"; tail -c ${TAILC:-2500} "$out/$b.stdout"
done
tar czf "$final/final-a.tgz" -C "$out" .
