#!/usr/bin/env bash
# Session 14, an early call: one helper round's scripts (benchmarks/session13/round1.sh's way: each named branch's
# archive under .session/wt/<branch>), then the fp8 engine and fp8 Gluon GPU tests under LAYERFLOW_FP8_QK=fp8x2 (the
# condition for making fp8x2 the default).
set -u
out=/tmp/r0; log=${OUT:-/tmp/out}/early.log
source benchmarks/session12/lib.sh
nvidia-smi -L; git log --oneline -1 2>/dev/null
helpers .session/wt "$@"
LAYERFLOW_FP8_QK=fp8x2 step 110 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider --timeout 90 -n 8 \
  -W ignore tests/runtime/test_engine_fp8_gpu.py tests/kernels/test_gluon_fp8_gpu.py tests/kernels/test_fp8_gpu.py
grep -E "passed|failed|error" "$log" | tail -3; grep -E "^(FAILED|ERROR)" "$log" | cut -c1-200 | head -8
tar czf "$final/round.tgz" -C "$out" .
