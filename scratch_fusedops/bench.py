"""Device-only: GPU time of a layer's pointwise ops, fused Triton vs the PyTorch path (each
captured 50 times in one CUDA graph, replays alternated), Llama-3-8B shapes; plus stage a's
pointwise records at GPU sizes."""
import json, time, torch
from raylm.kernels import cuda_ops
from raylm.models.activation import SiluAndMul
from raylm.models.rmsnorm import RMSNorm
from raylm.models.rotary_embedding import RotaryEmbedding
from raylm.cluster.benchmarks.gpu_elementwise_check import check_elementwise

dev = torch.device("cuda")
t0 = time.time()
summary = {}
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    recs = check_elementwise(dtype, dev, dry_run=False)
    bad = [r for r in recs if not r["passed"]]
    summary[str(dtype)] = dict(n=len(recs), failed=bad, max_rel=max(r["rel_error"] for r in recs),
                               min_torch_equal={k: min(r["torch_path_equal"] for r in recs if r["kernel"] == k)
                                                for k in {r["kernel"] for r in recs}})
print(json.dumps(summary, indent=1)); print("check s", round(time.time() - t0, 1))

dt = torch.bfloat16
norm = RMSNorm(4096, 1e-5).to(dev, dt)
rope = RotaryEmbedding(128, 128, 8192, {"rope_type": "default", "rope_theta": 500000.0}).to(dev, dt)
act = SiluAndMul()

def layer_ops(x, res, gate_up, qkv, pos):
    h, r = norm(x, res)
    rope.rotate(pos, qkv[:, :6144])
    a = act(gate_up)
    h2, r2 = norm(h, r)
    return a

def graph_time(fn, reps=50, rounds=5):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): fn()
    g.replay(); torch.cuda.synchronize()
    return g, reps

results = {}
for rows in (1, 64, 4096):
    x = torch.randn(rows, 4096, device=dev, dtype=dt); res = torch.randn_like(x)
    gate_up = torch.randn(rows, 2 * 14336, device=dev, dtype=dt)
    qkv = torch.randn(rows, 6144 + 1024, device=dev, dtype=dt)
    pos = torch.randint(0, 8192, (rows,), device=dev)
    graphs = {}
    for name, module in (("fused", None), ("torch", False)):
        cuda_ops._module = None if module is None else False
        graphs[name] = graph_time(lambda: layer_ops(x, res, gate_up, qkv, pos))
    cuda_ops._module = None
    times = {k: [] for k in graphs}
    for _ in range(5):
        for k, (g, reps) in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); g.replay(); b.record(); b.synchronize()
            times[k].append(a.elapsed_time(b) * 1000 / reps)
    results[rows] = {k: round(min(v), 2) for k, v in times.items()}
print("us per layer's pointwise ops (2 norms+residual, rotary, silu_and_mul), bf16, min of 5:", json.dumps(results))
