set -u
ROOT=$(pwd); SHIM=$(mktemp -d); python3 scripts/raylm_shim.py "$ROOT" "$SHIM"; export PYTHONPATH="$SHIM"
export TRITON_DEFAULT_FP_FUSION=1
timeout 100 python3 scratch_fusedops/bench.py 2>&1 | tail -60
timeout 80 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_triton_elementwise.py tests/test_cuda_graphs.py -x 2>&1 | tail -15
timeout 170 python3 -m raylm.cluster.benchmarks.gpu_model_check --out /tmp/b.json > /tmp/b.log 2>&1; echo "b rc $?"; tail -3 /tmp/b.log
python3 - <<'PY'
import json
try:
    r = json.load(open("/tmp/b.json"))
except Exception as e:
    print("no b.json", e); raise SystemExit
for m in r.get("architectures", []):
    print(m.get("architecture"), {k: {x: m[k].get(x) for x in ("tokens_equal", "tokens_compared", "compiles_after_warm_up", "cuda_graphs")} for k in ("fp32", "bf16") if isinstance(m.get(k), dict)})
PY
