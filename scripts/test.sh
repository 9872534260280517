#!/usr/bin/env bash
# The test suite. With no arguments (what CI runs): the whole `tests` folder in two parts,
# first every test not marked `serial` on two pytest-xdist workers (whole files per worker:
# module fixtures such as a running server stay in one process), then the `serial` ones
# (they assert wall-clock time or machine speed, or crawl beside other tests) alone. The
# tests run one OpenMP thread each, so on CI's 2 cores two workers take about half the time
# of one.
# With arguments, they go to one plain pytest and pick what runs:
# `./scripts/test.sh tests/test_bench_job.py`, `-k tp2`, ... (with no test path among them,
# pytest takes pyproject's testpaths: `tests`).
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Bytecode for what changed since setup (the suite starts hundreds of processes that import
# raylm; see scripts/compile_bytecode.sh).
./scripts/compile_bytecode.sh
# A hung test fails after 600 s (300 s in the parallel part, below); after an hour (for the
# whole run) pytest stops starting tests and prints its summary, so even a run with several
# hangs ends with the names of what failed (CI's own limit would cut it off with none). The
# 30 slowest tests are listed at the end, so that a CI log says where the suite's time goes
# on that machine.
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider -rfE --timeout 600 --durations=30 --durations-min=5)

if [ $# -gt 0 ]; then
  exec "${PYTEST[@]}" --session-timeout 3600 "$@"
fi

START=$SECONDS
# In the parallel part a test fails after 300 s (its slowest, the fuzz test, takes some
# 100 s on CI): a hung tensor-parallel engine (Ray's compiled-graph set-up has hung under
# load, its two workers spinning) then starves the other worker's tests for 5 minutes, not 10.
"${PYTEST[@]}" --session-timeout 3300 --timeout 300 -n 2 --dist loadfile -m "not serial"
parallel_status=$?
echo "parallel part: exit status $parallel_status after $((SECONDS - START)) s"
"${PYTEST[@]}" --session-timeout 900 -m serial
serial_status=$?
echo "serial part: exit status $serial_status; the whole suite took $((SECONDS - START)) s"
if [ "$parallel_status" -ne 0 ]; then
  exit "$parallel_status"
fi
exit "$serial_status"
