#!/usr/bin/env bash
# Session 14, a helper round: each BRANCH:SCRIPT argument runs .session/SCRIPT of the branch's archive under
# .session/wt/BRANCH (benchmarks/session12/lib.sh: environment, bounded steps), its stdout's tail printed.
set -u
out=/tmp/r; log=/dev/null
source benchmarks/session12/lib.sh
nvidia-smi -L; git log --oneline -1 2>/dev/null
for arg in "$@"; do
  b=${arg%%:*}; s=${arg#*:}
  echo "##### $b $s"
  ( cd ".session/wt/$b" && { [ -e .fixtures ] || ln -s "$ROOT/.fixtures" .fixtures; } && mkdir -p "$out/$b" && \
    OUT="$out/$b" timeout "${LIMIT:-95}" bash ".session/$s" ) > "$out/$b.stdout" 2>&1
  echo "rc=$?"; tail -c "${TAILC:-2800}" "$out/$b.stdout"
done
tar czf "$final/round.tgz" -C "$out" .
