#!/usr/bin/env bash
# Session 9, final H200 call on merged main (ea31e71): the whole GPU suite, then every benchmark the README, docs and
# issues quote. It expects git-ignored folders beside the tree: .fixtures/stu_golden (a copy of ../shared/fixtures),
# .redis (a redis-server build and its libs) and .whl (redis-py/hiredis wheels for the image's Python).
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 LAYERFLOW_FIXTURES=$ROOT/.fixtures/stu_golden
export LD_LIBRARY_PATH=$ROOT/.redis/lib:${LD_LIBRARY_PATH:-} PATH=$ROOT/.redis/bin:$PATH
final=${OUT:-/tmp/out}; out=/tmp/wf; mkdir -p "$out" "$final"; log=$final/final.log
pip install --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)" | tee -a "$log"; local t0=$SECONDS
         timeout "$limit" "$@" >>"$log" 2>&1; echo "=== rc=$? in $((SECONDS - t0))s" | tee -a "$log"; }
table() { python3 - "$@" <<'PY'
import json, sys
for f in sys.argv[1:]:
    try:
        t = json.load(open(f))["table"]
    except Exception as error:
        print(f, error); continue
    print(f); print(t)
PY
}
nvidia-smi -L | tee -a "$log"; git log --oneline -1 2>/dev/null | tee -a "$log"
step 230 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 -n 6 --dist loadfile --durations=8 \
  -o junit_family=xunit2 --junitxml="$out/gpu-tests.xml"
grep -E "passed|failed|FAILED|Error" "$log" | tail -14
step 30 python3 benchmarks/kernel_breakdown.py --seq-lens 2K,16K --out "$out/kernel-breakdown-h200.json"
grep -E "^\| (attention|GEMM|copy|other|LayerNorm|split|direct|KV|\*\*all)|device span" "$log" | tail -22
bench() { step "$1" python3 -m layerflow.cli bench "${@:2}"; }
bench 40 --seq-lens 2K,4K,8K,16K --timed-iters 10 --warmup-iters 3 --scenarios gpu_hit,cpu_hit,cpu_hit_layerwise \
  --out "$out/inference-h200.json"
bench 35 --seq-lens 2K,4K,8K,16K --timed-iters 10 --warmup-iters 3 --scenarios gpu_hit,cpu_hit,cpu_hit_layerwise \
  --kv-cache-dtype fp8_e4m3 --out "$out/inference-fp8_e4m3-h200.json"
bench 20 --seq-lens 2K,16K --timed-iters 10 --warmup-iters 3 --scenarios gpu_hit --profile \
  --out "$out/inference-profile-h200.json"
table "$out"/inference-h200.json "$out"/inference-fp8_e4m3-h200.json "$out"/inference-profile-h200.json | \
  grep -v "^$" | head -90
bench 85 --serve --rates 200,400,800,1000 --num-requests 400 --transports inprocess \
  --out "$out/serving-h200.json" --plot "$out/serving-h200.png"
python3 -c "import json; print(json.load(open('$out/serving-h200.json')).get('table',''))" 2>/dev/null | head -40
step 25 python3 benchmarks/kernels.py --batch 1 --history 2048 16384 --candidates 0 256 --head-dim 256 --no-sweep \
  --no-gate --no-reference --iters 20 --kernel triton auto --out "$out/kernels-bs1-h200.json"
step 25 python3 benchmarks/kernels.py --batch 1 --history 2048 16384 --candidates 0 256 --head-dim 256 --no-sweep \
  --no-gate --no-reference --iters 20 --kernel triton auto --kv-cache-dtype fp8_e4m3 --fp8-scale-copy load async --out "$out/kernels-fp8-h200.json"
grep -E "^\| (triton|gluon|auto)" "$log" | tail -16
tar czf "$final/final.tgz" -C "$out" .
mkdir -p "$out/pipe2"; ( OUT="$out/pipe2" timeout 92 bash benchmarks/session9/signals.sh ) 2>&1 | tail -45
tar czf "$final/final.tgz" -C "$out" .
tail -2 "$log"
