"""Offline generation with one worker needs neither Ray nor the HTTP stack: on a machine
without ray, fastapi, uvicorn, pydantic or xgrammar (the GPU device image has none of them),
`LLM(...)` loads, generates and shuts down, importing none of them."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import importlib.abc, json, sys

ABSENT = {"ray", "fastapi", "uvicorn", "starlette", "pydantic", "xgrammar"}


class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r} (absent on this machine)")
        return None


sys.meta_path.insert(0, Absent())
from raylm.engine import LLM, SamplingParams

llm = LLM(model=sys.argv[1], dtype="float32", max_num_seqs=2, max_model_len=64)
out = llm.generate(["Hello, world"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
llm.shutdown()
print(json.dumps({"tokens": len(out[0].outputs[0].token_ids),
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ABSENT)}))
"""


def test_offline_generation_runs_without_ray_fastapi_or_uvicorn(llama_dir):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(llama_dir)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"tokens": 4, "loaded": []}
