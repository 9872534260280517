#!/usr/bin/env bash
# Creates .venv and installs raylm with its test dependencies. torch is pinned here, not in
# pyproject.toml, to the 2.13.0 CPU build (an unpinned torch would pull a multi-GB CUDA
# build), and installed first, so that raylm's `torch>=2.5` finds it satisfied; likewise
# triton 3.9.0 for the interpreter tests. On a CUDA machine, skip this script: keep its
# torch and run `pip install -e ".[test]"`.
# One line per step; a step's own output (pip's) shows only when it fails.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH="torch==2.13.0"
TRITON="triton==3.9.0"
START=$SECONDS

# step LABEL COMMAND...: runs COMMAND quietly, prints LABEL with its time; on failure
# prints the command's output and exits with its status.
step() {
  local label=$1 start=$SECONDS log status
  shift
  log=$(mktemp)
  printf '%s ... ' "$label"
  if "$@" >"$log" 2>&1; then
    printf 'done (%ds)\n' $((SECONDS - start))
    rm -f "$log"
    return 0
  else
    status=$?
  fi
  printf 'FAILED (%ds, exit status %d): %s\n' $((SECONDS - start)) "$status" "$*"
  cat "$log" >&2
  rm -f "$log"
  exit "$status"
}

if [ -x .venv/bin/python ]; then
  echo "using the existing .venv"
else
  step "creating .venv" python3 -m venv .venv
fi
step "upgrading pip" .venv/bin/python -m pip install --upgrade pip
step "installing $TORCH (CPU) and $TRITON" .venv/bin/python -m pip install "$TORCH" "$TRITON"
step "installing raylm[test] (editable)" .venv/bin/python -m pip install -e ".[test]"
# Compiled now rather than by the first request (or test) that needs them; a machine with
# no compiler still serves, on PyTorch ops, so this step reports and never fails setup.
step "building the native CPU kernels" .venv/bin/python -m raylm.kernels.native_build
# Bytecode for raylm's own modules, written once: where PYTHONDONTWRITEBYTECODE is set (as
# on CI's image), every process would otherwise compile them again from source as it imports
# them: some 1.2 s of CPU for each server or subprocess that loads the server stack.
step "compiling raylm's bytecode" ./scripts/compile_bytecode.sh
echo "ready in $((SECONDS - START))s: .venv/bin/raylm serve, ./scripts/test.sh"
