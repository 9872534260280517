"""cluster/smoke_run_processes.py finds and stops every process of a smoke run (issue: a
`ray::RuntimeEnvAgent` and a zombie `ray::DashboardAgent` outlived "cleanup ... done"),
on real processes shaped like the ones Ray leaves: started with the run's marker in their
environment, working in the run's folder without it (an agent that rewrote its
environment with its title), a zombie whose main thread exited while another runs on, and
a child that has nothing of the run but its parent. Needs no root and no Ray."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "cluster" / "smoke_run_processes.py"
RUN_ID = "rlsmktest"
SLEEP = "import time; time.sleep(600)"
# The main thread ends (pthread_exit) while another thread runs on: /proc/PID then shows a
# zombie with no environment and no working directory; only the live thread has them.
ZOMBIE_LEADER = ("import ctypes, threading, time\n"
                 "threading.Thread(target=time.sleep, args=(600,)).start()\n"
                 "ctypes.CDLL(None).pthread_exit(None)\n")


def running(proc: subprocess.Popen) -> bool:
    tasks = Path(f"/proc/{proc.pid}/task")
    try:
        return any((task / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z" for task in tasks.iterdir())
    except OSError:
        return False


def wait_until(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def run(work: Path, mode: str) -> subprocess.CompletedProcess:
    # `ray stop` of the run took over 60 s once on CI's loaded 2 cores.
    return subprocess.run([sys.executable, str(SCRIPT), str(work), RUN_ID, mode], capture_output=True, text=True,
                          timeout=180)


@pytest.fixture
def smoke_run(tmp_path):
    """The processes of a run in `tmp_path` (the run's folder), and two that are not."""
    work = tmp_path / "rlsmk.test"
    home = work / "rhome"
    home.mkdir(parents=True)
    plain_env = {k: v for k, v in os.environ.items() if not k.startswith("RAYLM_SMOKE")}
    marked_env = dict(plain_env, RAYLM_SMOKE_ID=RUN_ID)
    python = sys.executable
    procs = {
        # raylet, gcs_server: `ray start`'s environment
        "marked": subprocess.Popen(
            ["sh", "-c", f"env -i sh -c 'cd / && exec sleep 600' & exec {python} -c '{SLEEP}'"],
            env=marked_env, cwd="/"),
        # an agent that rewrote its environment with its title: only its working directory
        "retitled": subprocess.Popen([python, "-c", SLEEP], env=plain_env, cwd=home),
        # a zombie agent whose other threads run on
        "zombie leader": subprocess.Popen([python, "-c", ZOMBIE_LEADER], env=plain_env, cwd=home),
        # the launching side's ssh client: names the run's key, must outlive `ray stop`
        "client": subprocess.Popen([python, "-c", SLEEP, f"{work}/id_ed25519"], env=plain_env, cwd="/"),
        "bystander": subprocess.Popen(["sleep", "600"], env=plain_env, cwd="/"),
    }
    assert wait_until(lambda: len(list(Path(f"/proc/{procs['zombie leader'].pid}/task").iterdir())) == 2
                      and not os.path.exists(f"/proc/{procs['zombie leader'].pid}/cwd/.")), "no zombie leader"
    assert wait_until(lambda: len(descendants(procs["marked"].pid)) == 1)
    procs["child of marked"] = descendants(procs["marked"].pid)[0]
    yield work, procs
    for proc in procs.values():
        if isinstance(proc, subprocess.Popen):
            proc.kill()
            proc.wait()
        else:
            try:
                os.kill(proc, 9)
            except OSError:
                pass


def descendants(pid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()
            and Path(f"/proc/{p}/stat").exists() and _parent(int(p)) == pid]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return -1


def pid_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ray_stop_ends_the_runs_processes_and_spares_its_clients_and_others(smoke_run):
    work, procs = smoke_run
    child = procs.pop("child of marked")
    assert run(work, "ray-stop").returncode == 0
    for name in ("marked", "retitled", "zombie leader"):
        assert wait_until(lambda: not running(procs[name]), 5), f"{name} is still running"
    assert wait_until(lambda: not pid_running(child), 5), "the marked process's child is still running"
    assert running(procs["client"]) and running(procs["bystander"])


def test_check_names_what_is_left_and_cleanup_ends_it_all(smoke_run):
    work, procs = smoke_run
    check = run(work, "check")
    assert check.returncode == 1
    for name in ("marked", "retitled", "zombie leader", "client"):
        assert f"pid {procs[name].pid} " in check.stdout, (name, check.stdout)
    assert f"pid {procs['child of marked']} " in check.stdout
    assert f"pid {procs['bystander'].pid} " not in check.stdout

    cleanup = run(work, "cleanup")
    assert cleanup.returncode == 0 and f"stopped: pid {procs['zombie leader'].pid} " in cleanup.stdout
    after = run(work, "check")
    assert after.returncode == 0, after.stdout
    assert running(procs["bystander"])
