#!/usr/bin/env bash
# The test suite (what CI runs). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider --timeout 900 "$@"
