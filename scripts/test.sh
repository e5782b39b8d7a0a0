#!/usr/bin/env bash
# Set up if needed (idempotent, seconds when ready), then run the whole test suite.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
scripts/setup.sh
.venv/bin/edgerun pull gemma-3-270m >/dev/null  # the other-vocab model some tests need
exec .venv/bin/python -m pytest "$@"
