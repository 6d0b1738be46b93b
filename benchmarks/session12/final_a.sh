#!/usr/bin/env bash
# Session 12, final call A on merged main: the GPU suite, verbose (every outcome by name, so a timeout kill loses
# nothing), in two steps: the five largest files apart (-n 8 --dist load), then the rest (--dist loadfile); then the
# helpers' final scripts named on the command line (.session/<name>.sh of this tree).
set -u
out=/tmp/fa; log=${OUT:-/tmp/out}/final-a.log
source benchmarks/session12/lib.sh
nvidia-smi -L | tee -a "$log"; git log --oneline -1 2>/dev/null | tee -a "$log"
LARGEST="tests/kernels/test_gluon_attention_gpu.py tests/kernels/test_gluon_fp8_gpu.py
  tests/runtime/test_engine_fp8_gpu.py tests/kernels/test_fp8_gpu.py tests/runtime/test_kernel_choices_gpu.py"
ignores=$(for f in $LARGEST; do printf -- "--ignore=%s " "$f"; done)
suite() { step "$1" python3 -m pytest -m gpu -v -rfE --tb=short -p no:cacheprovider --timeout 90 -n 8 -W ignore "${@:2}"; }
suite ${LARGEST_S:-170} --dist load $LARGEST
suite ${REST_S:-250} --dist loadfile $ignores
grep -E "(PASSED|FAILED|ERROR|SKIPPED) tests" "$log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | awk '{print $1}' | sort | uniq -c
grep -E "(FAILED|ERROR) tests" "$log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | cut -c1-200 | sort -u | head -20
python3 - "$log" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
started = set(re.findall(r"(tests/\S+::\S+)", text))
done = set(re.findall(r"(?:PASSED|FAILED|SKIPPED|ERROR) (tests/\S+::\S+)", text))
print("unfinished:", sorted(started - done)[:12])
PY
grep -E "^E  " "$log" | cut -c1-200 | sort | uniq -c | sort -rn | head -12
grep -E "passed|failed" "$log" | grep -E "^=+ " | tail -3
helpers . "$@"
tar czf "$final/final-a.tgz" -C "$out" .
