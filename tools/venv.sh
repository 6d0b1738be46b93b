#!/usr/bin/env bash
# Create or reuse the project's virtual environment.
# A machine whose python3 already has a CUDA build of torch keeps it (the venv sees the system packages, so nothing
# is downgraded); elsewhere the CPU wheel torch==2.13.0 is installed.
set -euo pipefail
venv=${1:-.venv}
py=${PYTHON:-python3}
stamp="$venv/.layerflow-installed"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then exit 0; fi
if [ ! -x "$venv/bin/python" ]; then
  if "$py" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
    echo "venv: reusing the system's CUDA torch"
    "$py" -m venv --system-site-packages "$venv"
  else
    "$py" -m venv "$venv"
  fi
fi
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  "$venv/bin/python" -m pip install -q torch==2.13.0
fi
"$venv/bin/python" -m pip install -q -e '.[test,plot]'
touch "$stamp"
