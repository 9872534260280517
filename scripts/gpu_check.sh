#!/usr/bin/env bash
# The GPU check of issue 31, in one command, from a plain copy of the repository on a CUDA
# machine (the device image: python3 with torch, triton, transformers, safetensors; no ray,
# fastapi or uvicorn needed). raylm is not installed: a folder of symlinks makes the
# repository's folders importable as raylm.* (pyproject's package-dir), first on PYTHONPATH.
#
#   scripts/gpu_check.sh                 # stages a, b, t, c; the record at $OUT/gpu_check.json
#   scripts/gpu_check.sh --cpu-dry-run   # every stage on the CPU, tiny sizes (tests/test_gpu_check.py)
#   scripts/gpu_check.sh --stages c      # one stage
#
# PYTHON picks the interpreter (default python3). What the figures mean and how to read
# them: docs/benchmarks/gpu/README.md.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
SHIM="$(mktemp -d "${TMPDIR:-/tmp}/raylm-shim.XXXXXX")"
trap 'rm -rf "$SHIM"' EXIT
"$PYTHON" "$ROOT/scripts/raylm_shim.py" "$ROOT" "$SHIM"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
# The device's copy of the repository has no git history: RAYLM_COMMIT names the commit.
COMMIT="${RAYLM_COMMIT:-$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || true)}"
# Triton 3.9 warns unless the (unchanged) default is stated; older versions ignore it.
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
cd "$ROOT"
"$PYTHON" -m raylm.cluster.benchmarks.gpu_check ${COMMIT:+--commit "$COMMIT"} "$@"
