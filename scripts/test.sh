#!/usr/bin/env bash
# Set up if needed (idempotent, seconds when ready), then run the whole test suite.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup.sh
py="${EDGERUN_PYTHON:-.venv/bin/python}"
if [ "${EDGERUN_SKIP_MODELS:-0}" != 1 ]; then
  "$py" -m edgerun.cli pull gemma-3-270m >/dev/null  # the other-vocab model some tests need
fi
exec "$py" -m pytest "$@"
