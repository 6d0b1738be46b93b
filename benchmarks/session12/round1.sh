#!/usr/bin/env bash
# Session 12, round 1: each named helper's script from its archived branch (.session/wt/<branch>), in turn.
set -u
out=/tmp/r1; log=/dev/null
source benchmarks/session12/lib.sh
nvidia-smi -L; git log --oneline -1 2>/dev/null
helpers .session/wt "$@"
tar czf "$final/round1.tgz" -C "$out" .
