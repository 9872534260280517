#!/usr/bin/env bash
# The test suite; with no arguments, the whole `tests` folder (what CI runs). Arguments go
# to pytest and pick what runs: `./scripts/test.sh tests/test_bench_job.py`, `-k tp2`, ...
# (with no test path among them, pytest takes pyproject's testpaths: `tests`).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout 900 "$@"
