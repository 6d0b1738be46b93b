#!/usr/bin/env bash
# Session 10, final H200 call A on merged main: the whole GPU suite, then the per-kernel breakdown and the inference
# benchmark (bf16 and fp8) with the host-phase profile. Expects the git-ignored folders .fixtures/stu_golden (a copy
# of ../shared/fixtures), .redis (a redis-server build and its libs) and .whl (redis-py/hiredis wheels).
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 LAYERFLOW_FIXTURES=$ROOT/.fixtures/stu_golden
export LD_LIBRARY_PATH=$ROOT/.redis/lib:${LD_LIBRARY_PATH:-} PATH=$ROOT/.redis/bin:$PATH
final=${OUT:-/tmp/out}; out=/tmp/fa; mkdir -p "$out" "$final"; log=$final/final-a.log
pip install --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)" | tee -a "$log"; local t0=$SECONDS
         timeout "$limit" "$@" >>"$log" 2>&1; echo "=== rc=$? in $((SECONDS - t0))s" | tee -a "$log"; }
table() { python3 - "$@" <<'PY'
import json, sys
for f in sys.argv[1:]:
    try:
        print(f); print(json.load(open(f))["table"])
    except Exception as error:
        print(f, error)
PY
}
nvidia-smi -L | tee -a "$log"; cat .session/HEAD 2>/dev/null | tee -a "$log"
step 310 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 -n 8 --dist loadfile --durations=10 \
  -o junit_family=xunit2 --junitxml="$out/gpu-tests.xml"
grep -E "passed|failed|FAILED|ERROR|Timeout" "$log" | tail -16
step 35 python3 benchmarks/kernel_breakdown.py --seq-lens 2K,16K --out "$out/kernel-breakdown-h200.json"
grep -E "^\| (attention|GEMM|copy|other|LayerNorm|split|direct|KV|SiLU|\*\*all)|device span" "$log" | tail -22
bench() { step "$1" python3 -m layerflow.cli bench "${@:2}"; }
bench 45 --seq-lens 2K,4K,8K,16K --timed-iters 10 --warmup-iters 3 --scenarios gpu_hit,cpu_hit,cpu_hit_layerwise \
  --out "$out/inference-h200.json"
bench 40 --seq-lens 2K,4K,8K,16K --timed-iters 10 --warmup-iters 3 --scenarios gpu_hit,cpu_hit,cpu_hit_layerwise \
  --kv-cache-dtype fp8_e4m3 --out "$out/inference-fp8_e4m3-h200.json"
bench 25 --seq-lens 2K,16K --timed-iters 10 --warmup-iters 3 --scenarios gpu_hit --profile \
  --out "$out/inference-profile-h200.json"
table "$out"/inference-h200.json "$out"/inference-fp8_e4m3-h200.json "$out"/inference-profile-h200.json | \
  grep -v "^$" | head -80
tar czf "$final/final-a.tgz" -C "$out" .
tail -2 "$log"
