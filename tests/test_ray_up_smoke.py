"""`ray up` for real: cluster/smoke_ray_up.sh launches the on-prem config over SSH to this
machine's loopback, runs the benchmark job and a Serve deployment, and takes it all down.

Opt-in (marker `ray_up_smoke`, skipped unless RAYLM_RAY_UP_SMOKE=1): the script needs root,
installs Debian packages, adds a user and runs an sshd, which no CI runner should do by
default. About 2 minutes a case on a 2-core machine, most of it the package install.

    RAYLM_RAY_UP_SMOKE=1 ./scripts/test.sh tests/test_ray_up_smoke.py
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "cluster" / "smoke_ray_up.sh"
SMOKE_USER = "raylm-smoke"
STEPS = ("sshd", "ray-up", "head-checks", "bench-job", "serve")

pytestmark = [
    pytest.mark.ray_up_smoke,
    pytest.mark.skipif(os.environ.get("RAYLM_RAY_UP_SMOKE") != "1",
                       reason="opt-in: set RAYLM_RAY_UP_SMOKE=1 (installs packages, adds a user, runs sshd; root)"),
]


def _tmp_entries() -> set[str]:
    names = set(os.listdir("/tmp"))
    if os.path.isdir("/tmp/ray"):
        names |= {"ray/" + n for n in os.listdir("/tmp/ray")}
    return names


def _run(**env) -> tuple[subprocess.CompletedProcess, set[str]]:
    before = _tmp_entries()
    full_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYLM_SMOKE_BREAK_SETUP")}
    full_env.update(RAYLM_RAY_UP_SMOKE="1", **env)
    proc = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=900, env=full_env)
    print(proc.stdout)
    return proc, _tmp_entries() - before


def _assert_cleaned_up(new_tmp: set[str]) -> None:
    assert subprocess.run(["id", SMOKE_USER], capture_output=True).returncode != 0, "the run's user is left"
    ours = [line for line in subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
            if "/tmp/rlsmk." in line]
    assert not ours, f"processes of the run are left: {ours}"
    left = {n for n in new_tmp if re.match(r"(rlsmk\.|ray_ssh_|ray-config-|ray-bootstrap-|torchinductor_raylm-smoke"
                                           r"|ray/cluster-raylm-smoke-)", n)}
    assert not left, f"files of the run are left in /tmp: {left}"


def test_ray_up_bench_job_serve_ray_down_end_to_end():
    proc, new_tmp = _run()
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    for number, name in enumerate(STEPS, start=1):
        assert re.search(rf"^step {number} {name}: ok \(\d+\.\d s\)$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^step 6 ray-down: ok \(\d+\.\d s", proc.stdout, re.M), proc.stdout
    _assert_cleaned_up(new_tmp)


def test_failing_setup_command_fails_at_ray_up_with_rays_message_and_still_cleans_up():
    proc, new_tmp = _run(RAYLM_SMOKE_BREAK_SETUP="1")
    assert proc.returncode != 0
    assert re.search(r"^step 1 sshd: ok", proc.stdout, re.M), proc.stdout
    assert re.search(r"^step 2 ray-up: FAILED", proc.stdout, re.M), proc.stdout
    assert "Failed to setup head node" in proc.stdout and "SSH command failed" in proc.stdout, proc.stdout
    assert not re.search(r"^step 3 ", proc.stdout, re.M)
    assert "FAILED at step 2 ray-up" in proc.stdout
    _assert_cleaned_up(new_tmp)


def test_refuses_without_the_opt_in(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAYLM_RAY_UP_SMOKE"}
    proc = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "refusing" in proc.stderr
