#!/usr/bin/env bash
# Session 12's device calls share this: the environment (fixtures, the carried redis-server and redis-py wheels),
# `step LIMIT CMD...` (a bounded command logged with its rc and seconds), `table JSON...` (a results file's table)
# and `helpers DIR BRANCH...` (each helper's .session/<branch>.sh run from DIR/<branch>, or from the root when DIR is ., bounded, its stdout's tail
# printed). Source it from the repo root; set `log` and `out` first.
ROOT=$PWD
export PYTHONUNBUFFERED=1 LAYERFLOW_FIXTURES=$ROOT/.fixtures/stu_golden
export LD_LIBRARY_PATH=$ROOT/.redis/lib:${LD_LIBRARY_PATH:-} PATH=$ROOT/.redis/bin:$PATH
pip install --no-index --no-deps --target /tmp/site "$ROOT"/.whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
final=${OUT:-/tmp/out}; mkdir -p "$final" "$out"

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

helpers() { local dir=$1; shift
  for b in "$@"; do
    echo "##### $b"
    local tree=$ROOT; [ "$dir" = . ] || tree=$dir/$b
    ( cd "$tree" && { [ -e .fixtures ] || ln -s "$ROOT/.fixtures" .fixtures; } && mkdir -p "$out/$b" && \
      OUT="$out/$b" timeout "${LIMIT:-95}" bash ".session/$b.sh" ) > "$out/$b.stdout" 2>&1
    echo "rc=$?"; tail -c "${TAILC:-2800}" "$out/$b.stdout"
  done
}
