#!/usr/bin/env bash
# Writes the bytecode (__pycache__) of raylm's packages and the test helpers, even where
# PYTHONDONTWRITEBYTECODE is set: Python still reads bytecode there, it only never writes it,
# so without this step every process compiles every raylm module it imports from source.
# Up-to-date files are skipped (a second run takes a fraction of a second); a file edited
# later is compiled in memory by whichever process imports it, as usual.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m compileall -q -j 0 engine executors parallel kernels models deploy cluster tests
