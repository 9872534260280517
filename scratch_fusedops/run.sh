set -u
ROOT=$(pwd); SHIM=$(mktemp -d); python3 scripts/raylm_shim.py "$ROOT" "$SHIM"; export PYTHONPATH="$SHIM"
export TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import triton, torch; print(triton.__version__, torch.__version__)"
timeout 150 python3 scratch_fusedops/bench.py 2>&1 | tail -60
timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_triton_elementwise.py tests/test_cuda_graphs.py -x 2>&1 | tail -25
