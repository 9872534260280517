"""The cluster benchmark job, submitted through Ray's job client to a two-node cluster.

The cluster (`ray.cluster_utils.Cluster`: a head and a second node on one address, one
CPU each) lives in a child process, this file run as a script, because the test session
already holds a Ray of its own. The job sweeps tensor parallel 2 at pipeline-parallel sizes 1
and 2, batch sizes 1 and 2 on one engine per layout, with half a CPU per worker bundle: under
PACK (`--ray-span-nodes`) the 2 workers of PP 1 share a node, and the 4 of PP 2 take both,
one stage a node.
Token authentication is on, as on a `ray up` cluster: the child sets RAY_AUTH_MODE=token
and one RAY_AUTH_TOKEN that the cluster's processes and the JobSubmissionClient share.
The cluster takes free ports: the job runs while Ray's default ports are held, as they
are when the user already runs a Ray of their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raylm.cluster.benchmarks.bench_job import (LATENCY_PLOT, RESULT_FILE, SUMMARY_PREFIX, THROUGHPUT_PLOT, plot_latency,
                                                plot_throughput)

# Alone, after the parallel part (scripts/test.sh): beside other files on 2 cores, its
# two-node cluster's job ran past its deadline in two fresh CI runs of three.
pytestmark = pytest.mark.serial

RESULT_PREFIX = "BENCH_JOB_RESULT "
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BATCH_SIZES = (1, 2)
PP_SIZES = (1, 2)
JOB_TIMEOUT_S = 240
# What `ray start --head` binds by default: GCS, dashboard, Ray client server, dashboard agent.
RAY_DEFAULT_PORTS = (6379, 8265, 10001, 52365)


def submit_on_two_nodes(model_dir: str, out_dir: str) -> dict:
    """Starts the two-node cluster, submits the job, waits; returns status and logs."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.job_submission import JobStatus, JobSubmissionClient

    # Ray's defaults (dashboard 8265, dashboard agent 52365) belong to whatever Ray the
    # user already runs: take a free dashboard port and let the agent pick its own.
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": free_port(),
        "dashboard_agent_listen_port": 0})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes(timeout=60)
        context = ray.init(address=cluster.address)
        dashboard = "http://" + context.dashboard_url
        ray.shutdown()
        client = _job_client(dashboard, JobSubmissionClient)
        entrypoint = " ".join([
            sys.executable, "-m", "raylm.cluster.benchmarks.bench_job", "--model", model_dir, "--tp-sizes", "2",
            "--pp-sizes", ",".join(map(str, PP_SIZES)), "--batch-sizes", ",".join(map(str, BATCH_SIZES)),
            "--input-len", "8", "--output-len", "4",
            "--out", out_dir, "--", "--ray-span-nodes", "--ray-cpus-per-worker", "0.5",
            "--num-gpu-blocks-override", "64", "--placement-group-timeout-s", "60"])
        job_id = client.submit_job(entrypoint=entrypoint, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        deadline = time.monotonic() + JOB_TIMEOUT_S
        status = client.get_job_status(job_id)
        while not status.is_terminal() and time.monotonic() < deadline:
            time.sleep(1)
            status = client.get_job_status(job_id)
        if not status.is_terminal():
            client.stop_job(job_id)
        return {"status": str(status.value if isinstance(status, JobStatus) else status),
                "logs": client.get_job_logs(job_id), "num_nodes": len([n for n in _nodes(cluster) if n])}
    finally:
        cluster.shutdown()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _job_client(address: str, client_class):
    # The dashboard's job endpoint comes up a little after the head node on a busy machine.
    deadline = time.monotonic() + 60
    while True:
        try:
            return client_class(address)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def _nodes(cluster) -> list:
    return [cluster.head_node, *cluster.worker_nodes]


@contextlib.contextmanager
def ray_default_ports_taken():
    """Listens on those of Ray's default ports that are free, as another Ray would."""
    held = []
    try:
        for port in RAY_DEFAULT_PORTS:
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
                sock.listen()
                held.append(sock)
            except OSError:  # taken already: just as good
                sock.close()
        yield
    finally:
        for sock in held:
            sock.close()


@pytest.fixture(scope="module")
def job_run(llama_dir, tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("bench_job_out")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), OMP_NUM_THREADS="1")
    with ray_default_ports_taken():
        proc = subprocess.run([sys.executable, __file__, str(llama_dir), str(out_dir)], capture_output=True,
                              text=True, timeout=JOB_TIMEOUT_S + 90, env=env, cwd=str(Path(__file__).parent))
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert proc.returncode == 0 and lines, f"cluster run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    run = json.loads(lines[-1][len(RESULT_PREFIX):])
    assert run["status"] == "SUCCEEDED", f"job {run['status']}:\n{run['logs'][-5000:]}"
    return dict(run, out_dir=out_dir)


def test_job_reports_tp2_throughput_for_every_pp_and_batch_size_on_two_nodes(job_run):
    report = json.loads((job_run["out_dir"] / RESULT_FILE).read_text())
    assert report["cluster"]["num_nodes"] == 2
    assert [(p["tensor_parallel_size"], p["pipeline_parallel_size"], p["batch_size"]) for p in report["throughput"]] \
        == [(2, pp, b) for pp in PP_SIZES for b in BATCH_SIZES]
    for point in report["throughput"]:
        assert point["settings"]["engine_args"]["ray_span_nodes"] is True
        assert point["settings"]["num_prompts"] == point["batch_size"]
        assert point["settings"]["max_num_seqs"] == max(BATCH_SIZES)  # the layout's one engine takes every batch
        assert point["output_tokens_per_s"] > 0
    assert report["model"]["architectures"] and report["machine"]["python"]


def test_job_starts_one_engine_per_layout_not_per_batch_size(job_run):
    # Each engine start logs its workers (P x T of them) once, in the driver: one TP2 engine
    # at PP 1, then one at PP 2, each timing every batch size.
    started = re.findall(r"Ray executor: (\d+) workers on", job_run["logs"])
    assert [int(n) for n in started] == [2 * pp for pp in PP_SIZES]
    assert job_run["logs"].count("Workers ready, model loaded in") == len(PP_SIZES)


def test_job_writes_the_throughput_plot_as_png(job_run):
    data = (job_run["out_dir"] / THROUGHPUT_PLOT).read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_job_logs_end_with_a_parseable_summary_line(job_run):
    lines = [line for line in job_run["logs"].splitlines() if line.startswith(SUMMARY_PREFIX)]
    assert len(lines) == 1
    summary = json.loads(lines[0][len(SUMMARY_PREFIX):])
    assert set(summary["output_tokens_per_s"]) == {f"tp2_bs{b}" for b in BATCH_SIZES} | {
        f"tp2_pp2_bs{b}" for b in BATCH_SIZES}
    assert summary["result_json"] == str(job_run["out_dir"] / RESULT_FILE)
    assert summary["num_nodes"] == 2


def test_latency_plot_is_a_png_with_infinite_rate_last(tmp_path):
    keys = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")
    points = [dict({k: 10.0 * rate for k in keys}, request_rate=rate) for rate in (4.0, 1.0)]
    points.append(dict({k: 100.0 for k in keys}, request_rate="inf"))
    data = plot_latency(points, tmp_path / LATENCY_PLOT).read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_a_plot_without_matplotlib_is_an_import_error_naming_the_bench_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"pip install 'raylm\[bench\]'"):
        plot_throughput([dict(tensor_parallel_size=1, batch_size=1, output_tokens_per_s=1.0)], tmp_path / THROUGHPUT_PLOT)


if __name__ == "__main__":
    print(RESULT_PREFIX + json.dumps(submit_on_two_nodes(sys.argv[1], sys.argv[2])), flush=True)
