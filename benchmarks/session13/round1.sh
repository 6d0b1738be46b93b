#!/usr/bin/env bash
# Session 13, a helper round: each named branch's .session/<branch>.sh, from its archive under .session/wt/<branch>,
# in turn (benchmarks/session12/lib.sh: environment, bounded steps, tails of each script's stdout).
set -u
out=/tmp/r1; log=/dev/null
source benchmarks/session12/lib.sh
nvidia-smi -L; git log --oneline -1 2>/dev/null
helpers .session/wt "$@"
tar czf "$final/round.tgz" -C "$out" .
