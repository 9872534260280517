"""The one GPU check (`scripts/gpu_check.sh`): three stages, each in its own process under
its own timeout, merged into one JSON record and a short summary.

- a: the Triton kernels compiled natively against the fp32 PyTorch reference
  (`gpu_kernel_check`, three processes over the configurations; one in a dry run);
- b: greedy tokens against Hugging Face on tiny models of every architecture
  (`gpu_model_check`);
- c: speed on a Llama-3-8B shape against the device's ceilings (`gpu_speed_check`);
- t: the test suite's `cuda`-marked tests of the engine (CUDA graphs, memory, compiles).

a, b and t check correctness only, so they run side by side; c runs alone, as it times.
A stage that fails or runs out of time still leaves what it measured (each stage rewrites
its JSON after every item) and the others run. `--cpu-dry-run` runs every stage on the
CPU with tiny sizes (stage a under Triton's interpreter), to find mistakes before a device
minute is spent on them.

    python -m raylm.cluster.benchmarks.gpu_check [--out FILE] [--cpu-dry-run] [--stages abtc]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Seconds per stage on the device: a, b and t side by side (t's engine tests may take as long
# as b, which bounds the group), then c; 7.5 minutes in all at most.
TIMEOUTS = {"a": 150, "b": 180, "t": 180, "c": 270}
DRY_TIMEOUTS = {"a": 240, "b": 300, "t": 240, "c": 300}
# The cuda-marked tests stage t runs (the kernels' own are stage a's).
CUDA_TEST_FILES = ("tests/test_cuda_graphs.py", "tests/test_engine_shutdown.py", "tests/test_sampler_host_reads.py",
                   "tests/test_step_host_reads.py", "tests/test_triton_elementwise.py", "tests/test_cuda_features.py",
                   "tests/test_sleep_mode_cuda.py", "tests/test_kv_cache_fp8.py", "tests/test_llava.py",
                   "tests/test_fp8_linear.py", "tests/test_fp8_weights.py", "tests/test_int4_weights.py",
                   "tests/test_lora_quantized.py", "tests/test_fp8_moe.py", "tests/test_int4_moe.py",
                   "tests/test_gemma3_vl.py", "tests/test_compressed_tensors_int.py",
                   "tests/test_spec_decode_eagle.py")
KERNEL_PARTS = 3
RECORD_KEYS = ("device", "commit", "date", "kernels_pass", "hf_tokens_equal", "cuda_graphs", "tpot_bs1_ms", "floor_ms",
               "tpot_over_floor", "throughput_tok_s", "hf_throughput_tok_s", "ttft_4k_ms",
               "decode_attention_bw_fraction")


@dataclass
class Job:
    """One process of a stage."""

    stage: str
    args: list[str]
    out: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    log: Path | None = None
    started: float = 0.0
    status: str = "not started"
    seconds: float = 0.0

    def start(self, work: Path) -> None:
        self.log = work / f"{self.out.stem}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        out = [] if self.stage == "t" else ["--out", str(self.out)]
        # Each process is its own session, so a timeout ends its children (compilers) too.
        self.process = subprocess.Popen([sys.executable, "-m", *self.args, *out], env=env, cwd=REPO,
                                        stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.started = time.monotonic()

    def poll(self, deadline: float) -> bool:
        """Whether the job is over: it exited, or it ran past `deadline` and was ended.
        Its seconds run from its start to the moment it is seen over (within a poll)."""
        code = self.process.poll()
        if code is None and time.monotonic() < deadline:
            return False
        if code is None:
            os.killpg(self.process.pid, 9)
            self.process.wait()
            self.status = "timed out"
        else:
            self.status = "ok" if code == 0 else f"exit status {code}"
        self.seconds = round(time.monotonic() - self.started, 1)
        return True

    def result(self) -> dict:
        try:
            return json.loads(self.out.read_text())
        except (OSError, ValueError):
            return {}

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def stage_jobs(stage: str, work: Path, dry_run: bool) -> list[Job]:
    dry = ["--dry-run"] if dry_run else []
    if stage == "a":
        # The interpreter must be on before the kernels are decorated: in the environment.
        env = {"TRITON_INTERPRET": "1"} if dry_run else {}
        # The dry run's kernels are cheap next to a process's imports (torch): one process.
        parts = 1 if dry_run else KERNEL_PARTS
        return [Job("a", ["raylm.cluster.benchmarks.gpu_kernel_check", "--part", f"{i}/{parts}", *dry],
                    work / f"a{i}.json", env) for i in range(parts)]
    if stage == "t":
        # pytest's JUnit XML names each test's outcome and seconds (`cuda_test_results`).
        return [Job("t", ["pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", f"--junitxml={work / 't.xml'}",
                          *CUDA_TEST_FILES], work / "t.xml")]
    module = {"b": "gpu_model_check", "c": "gpu_speed_check"}[stage]
    return [Job(stage, [f"raylm.cluster.benchmarks.{module}", *dry], work / f"{stage}.json")]


def run_stages(stages: str, work: Path, dry_run: bool) -> dict[str, list[Job]]:
    jobs = {stage: stage_jobs(stage, work, dry_run) for stage in stages}
    run_jobs(jobs, work, DRY_TIMEOUTS if dry_run else TIMEOUTS)
    return jobs


def run_jobs(jobs: dict[str, list[Job]], work: Path, timeouts: dict[str, float]) -> None:
    """Correctness side by side, then timing alone. Every job is polled, so that each
    one's seconds are its own (a stage that ends early is not timed to the end of a slower
    one beside it)."""
    for group in (["a", "b", "t"], ["c"]):
        started = [stage for stage in group if stage in jobs]
        for stage in started:
            for job in jobs[stage]:
                job.start(work)
        running = [(job, jobs[stage][0].started + timeouts[stage]) for stage in started for job in jobs[stage]]
        while running:
            running = [(job, deadline) for job, deadline in running if not job.poll(deadline)]
            if running:
                time.sleep(0.1)


def merge(jobs: dict[str, list[Job]], dry_run: bool, commit: str | None = None) -> dict:
    """The record: the summary keys (issue 31, item 8) first, then each stage's details."""
    record: dict = {key: None for key in RECORD_KEYS}
    record.update(device=_device_name(dry_run), commit=commit or _commit(), date=datetime.date.today().isoformat(),
                  dry_run=dry_run, stages={})
    for stage, stage_jobs_ in jobs.items():
        record["stages"][stage] = [dict(status=job.status, seconds=job.seconds,
                                        **({} if job.status == "ok" else {"log_tail": job.log_tail()}))
                                   for job in stage_jobs_]
    if "a" in jobs:
        parts = [job.result() for job in jobs["a"]]
        records = [r for part in parts for r in part.get("records", [])]
        record["kernels"] = dict(checks=len(records), failed=[r for r in records if not r["passed"]],
                                 largest_error={dtype: max((r["rel_error"] for r in records if r["dtype"] == dtype),
                                                           default=None) for dtype in ("fp32", "fp16", "bf16")},
                                 resources=_resource_summary([row for part in parts
                                                              for row in part.get("resources", [])]),
                                 records=records)
        complete = all(job.status == "ok" for job in jobs["a"]) and records
        record["kernels_pass"] = bool(complete and not record["kernels"]["failed"])
    if "b" in jobs:
        stage_b = jobs["b"][0].result()
        models = stage_b.get("architectures", [])
        record["tiny_configs"] = stage_b.get("tiny_configs")
        equal = sum(bool(m.get("fp32", {}).get("tokens_equal")) for m in models)
        record["hf_tokens_equal"] = f"{equal}/{len(models)}" if models else None
        record["models"] = models
    if "t" in jobs:
        # pytest's last line: "N passed, M skipped in S s" (or the failures).
        record["cuda_tests"] = jobs["t"][0].log_tail(1)
        record["cuda_test_results"] = junit_results(jobs["t"][0].out)
    if "c" in jobs:
        speed = jobs["c"][0].result()
        record["speed"] = speed
        tpot, ttft = speed.get("tpot", {}), speed.get("ttft", {})
        attention = {row["context"]: row for row in speed.get("decode_attention", [])}
        middle = attention.get(8192) or (attention[sorted(attention)[len(attention) // 2]] if attention else {})
        record.update(
            cuda_graphs=speed.get("engine", {}).get("cuda_graphs"),
            tpot_bs1_ms=tpot.get("ms"), floor_ms=tpot.get("floor_ms"), tpot_over_floor=tpot.get("over_floor"),
            throughput_tok_s=speed.get("throughput", {}).get("output_tok_s"),
            throughput_over_floor=speed.get("throughput", {}).get("over_floor"),
            throughput_floor_tok_s=speed.get("throughput", {}).get("floor_output_tok_s"),
            hf_throughput_tok_s=speed.get("hf_throughput", {}).get("output_tok_s"),
            ttft_4k_ms=ttft.get("ms"), ttft_floor_ms=ttft.get("floor_ms"),
            decode_attention_bw_fraction=middle.get("fraction_of_copy"),
            layers=speed.get("shape", {}).get("num_layers"),
            launches_per_step=speed.get("profile_batch_1", {}).get("launches_per_step"))
        penalised = speed.get("penalties", {})
        record.update(tpot_bs1_penalised_ms=penalised.get("tpot_ms"),
                      penalised_step_over_plain=penalised.get("step_over_plain"))
    return record


def junit_results(path: Path) -> list[dict]:
    """Each test of a pytest JUnit XML report: its id (module::name), outcome (passed, failed,
    error, skipped) and seconds; none when the report is missing or cut short."""
    import xml.etree.ElementTree as ElementTree

    try:
        cases = ElementTree.parse(path).getroot().iter("testcase")
    except (OSError, ElementTree.ParseError):
        return []
    results = []
    for case in cases:
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        results.append({"test": f"{case.get('classname')}::{case.get('name')}",
                        "outcome": {"failure": "failed"}.get(outcome, outcome),
                        "seconds": round(float(case.get("time") or 0.0), 1)})
    return results


def _resource_summary(rows: list[dict]) -> list[dict]:
    """Per kernel: most registers, most spilled bytes, most shared memory over its variants."""
    summary: dict[str, dict] = {}
    for row in rows:
        entry = summary.setdefault(row["kernel"], dict(kernel=row["kernel"], variants=0, max_registers=None,
                                                       max_spills=None, max_shared_bytes=None))
        entry["variants"] += 1
        for key, source in (("max_registers", "registers"), ("max_spills", "spills"),
                            ("max_shared_bytes", "shared_bytes")):
            if row.get(source) is not None:
                entry[key] = max(entry[key] or 0, row[source])
    return list(summary.values())


def _device_name(dry_run: bool) -> str:
    if dry_run:
        return "cpu (dry run)"
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _commit() -> str | None:
    """The checkout's commit, where it is a git checkout (the device's copy is not: the
    script passes --commit)."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=30)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def number(value, digits: int = 2) -> str:
    """A record's value for the summary: floats rounded, None as "-"."""
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def summary_lines(record: dict) -> list[str]:
    lines = [f"device {record['device']}, commit {str(record['commit'])[:12]}, {record['date']}"]
    for stage, jobs in record["stages"].items():
        lines.append(f"stage {stage}: " + ", ".join(f"{j['status']} ({j['seconds']} s)" for j in jobs))
    kernels = record.get("kernels")
    if kernels:
        lines.append(f"kernels: {kernels['checks']} checks, {len(kernels['failed'])} failed; largest error "
                     + ", ".join(f"{k} {number(v, 6)}" for k, v in kernels["largest_error"].items()))
        for row in kernels["resources"]:
            lines.append(f"  {row['kernel']}: {row['variants']} variants, registers <= {row['max_registers']}, "
                         f"spills <= {row['max_spills']}, shared <= {row['max_shared_bytes']} B")
    lines.append(f"tokens equal to HF (fp32): {record['hf_tokens_equal']}; cuda graphs: {record['cuda_graphs']}")
    if "cuda_tests" in record:
        lines.append(f"cuda tests: {record['cuda_tests']}")
        for result in record.get("cuda_test_results", []):
            if result["outcome"] in ("failed", "error"):
                lines.append(f"  {result['outcome']}: {result['test']} ({result['seconds']} s)")
    lines.append(f"TPOT bs1 {number(record['tpot_bs1_ms'])} ms, floor {number(record['floor_ms'])} ms "
                 f"({number(record['tpot_over_floor'])}x); TTFT 4k {number(record['ttft_4k_ms'], 1)} ms, floor "
                 f"{number(record.get('ttft_floor_ms'), 1)} ms")
    profile = (record.get("speed") or {}).get("profile_batch_1") or {}
    lines.append(f"decode step bs1: {number(record.get('launches_per_step'), 0)} kernel launches per step "
                 f"({record.get('layers')} layers), kernels {number(profile.get('kernel_fraction'))} of wall time")
    penalised = (record.get("speed") or {}).get("penalties")
    if penalised:
        lines.append(f"repetition_penalty {penalised['repetition_penalty']}: TPOT bs1 {number(penalised['tpot_ms'])} ms "
                     f"({number(penalised['tpot_over_plain'])}x plain); decode step at batch {penalised['batch']} x "
                     f"{penalised['prompt_len']} {number(penalised['step_ms'])} ms "
                     f"({number(penalised['step_over_plain'])}x plain {number(penalised['step_plain_ms'])} ms)")
    lines.append(f"throughput {number(record['throughput_tok_s'], 0)} tok/s vs HF {number(record['hf_throughput_tok_s'], 0)}"
                 f" (floor {number(record.get('throughput_floor_tok_s'), 0)} tok/s, run"
                 f" {number(record.get('throughput_over_floor'))}x its time);"
                 f" decode attention at 8k: {number(record['decode_attention_bw_fraction'])} of copy bandwidth")
    speed = record.get("speed") or {}
    for case in speed.get("decode_attention_sweep", {}).get("cases", []):
        lines.append(f"decode attention, {case['case']}: chosen {_decode_row(case['chosen'])}; "
                     f"fastest {_decode_row(case['best'])}")
    fp8_rows = speed.get("decode_attention_fp8")
    for row in fp8_rows if isinstance(fp8_rows, list) else []:
        lines.append(f"decode attention over an fp8 cache, batch {row['batch']}, context {row['context']}: "
                     f"{number(row['fp8_ms'])} ms ({number(row['fp8_over_model_dtype'])}x the bf16 cache's "
                     f"{number(row['model_dtype_ms'])} ms, {number(row.get('fp8_fraction_of_copy'))} of copy"
                     f"); 64-key tiles {number(row.get('fp8_block_n_64_ms'))} ms")
    if isinstance(fp8_rows, dict):
        lines.append(f"decode attention over an fp8 cache: {fp8_rows.get('error')}")
    for case in speed.get("prefill_attention", {}).get("cases", []):
        lines.append(f"prefill attention, {case['case']} ({case['query_len']} new, {case['context_len']} cached): "
                     f"chosen {_prefill_row(case['chosen'])}; fastest {_prefill_row(case['best'])}")
    for m, step in (speed.get("gemm_layouts") or {}).get("step", {}).items():
        lines.append(f"weight GEMMs of a decode step at batch {m}: as stored {number(step['linear_ms'])} ms, "
                     f"transposed {number(step['transposed_ms'])} ms, floor {number(step['floor_ms'])} ms")
    return lines


def _tile_shape(row: dict) -> str:
    """A sweep row's launch options as BLOCKxBLOCKxwarpsxstages ("backend" without tiles)."""
    return "x".join(str(v) for v in row["tiles"].values()) if row["tiles"] else "backend"


def _decode_row(row: dict | None) -> str:
    if not row or "ms" not in row:
        return "-"
    fraction = row.get("fraction_of_copy")
    splits = f" {row['num_splits']} split(s)" if row.get("num_splits") else ""
    return (f"{_tile_shape(row)}{splits} {number(row['ms'] * 1e3, 0)} us"
            + (f" ({number(fraction)} of copy)" if fraction is not None else ""))


def _prefill_row(row: dict | None) -> str:
    if not row or "ms" not in row:
        return "-"
    return f"{_tile_shape(row)} {number(row['tflop_s'], 1)} TFLOP/s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else Path("gpu_check.json")
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--cpu-dry-run", action="store_true", help="every stage on the CPU, tiny sizes")
    parser.add_argument("--stages", default="abtc", help="which stages to run (default: abtc)")
    parser.add_argument("--commit", default=None, help="the commit the record names (default: git's HEAD here)")
    args = parser.parse_args(argv)
    if set(args.stages) - set("abtc"):
        parser.error(f"--stages takes letters of 'abtc', got {args.stages!r}")
    with tempfile.TemporaryDirectory(prefix="raylm-gpu-check-") as work:
        jobs = run_stages(args.stages, Path(work), args.cpu_dry_run)
        record = merge(jobs, args.cpu_dry_run, args.commit)
        for stage_jobs_ in jobs.values():  # keep the logs of what failed beside the record
            for job in stage_jobs_:
                if job.status != "ok" and job.log is not None and job.log.exists():
                    record.setdefault("logs", {})[job.log.name] = job.log_tail(60)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print("\n".join(summary_lines(record)))
    print(f"record: {args.out}")
    return 0 if all(job.status == "ok" for stage_jobs_ in jobs.values() for job in stage_jobs_) else 1


if __name__ == "__main__":
    sys.exit(main())
