"""The processes of one `cluster/smoke_ray_up.sh` run: stop them, or check that none is left.

    python smoke_run_processes.py WORK RUN_ID ray-stop|cleanup|check [ROOT_PID ...]

A process belongs to the run if one of its threads has RAYLM_SMOKE_ID=RUN_ID in its
environment (every process `ray start` starts inherits it) or works in WORK (the run's
folder: the head's home is there), if its arguments name the run's Ray directory
(WORK/ray/), if it is a ROOT_PID (the run's sshd), or if it descends from one that does.

The environment alone misses some. Ray's agents (ray::DashboardAgent, ray::RuntimeEnvAgent)
overwrite theirs with their process title, and an agent whose main thread has exited while
other threads still run (a zombie that keeps a core busy) shows no environment, arguments
or working directory for the process: only its threads do. The process tree is read before
anything is killed, since a killed parent's children are handed to init.

Modes:
- ray-stop: what `ray stop` does on the head for this run (`ray down` runs it over SSH):
  TERM, then KILL what is left after 10 s. It spares itself and its callers, and the
  launching side's ray and ssh clients, which name WORK (the config, the key) but not
  WORK/ray/.
- cleanup: the same for every process of the run, those clients included.
- check: prints each process of the run still running; exit status 1 if there is one.
"""

from __future__ import annotations

import os
import signal
import sys
import time

TERM_GRACE_S = 10.0
KILL_WAIT_S = 10.0


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _parent_and_state(proc_path: str) -> tuple[int, str]:
    """(parent pid, state letter) of /proc/<proc_path> (a process or one of its threads)."""
    stat = _read(f"/proc/{proc_path}/stat").decode(errors="replace")
    fields = stat[stat.rfind(")") + 2:].split()
    return (int(fields[1]), fields[0]) if len(fields) > 1 else (0, "?")


def _threads(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def is_running(pid: int) -> bool:
    """Whether any thread of `pid` still runs (a zombie without one waits to be reaped)."""
    return any(_parent_and_state(f"{pid}/task/{tid}")[1] != "Z" for tid in _threads(pid))


class RunProcesses:
    def __init__(self, work: str, run_id: str, mode: str, roots: set[int]) -> None:
        self.work = work.rstrip("/")
        self.marker = f"RAYLM_SMOKE_ID={run_id}".encode()
        self.named = f"{self.work}/ray/" if mode == "ray-stop" else self.work
        self.roots = roots

    def _belongs(self, pid: int) -> bool:
        if pid in self.roots or self.named.encode() in _read(f"/proc/{pid}/cmdline"):
            return True
        for tid in _threads(pid):
            task = f"/proc/{pid}/task/{tid}"
            try:
                cwd = os.readlink(f"{task}/cwd")
            except OSError:
                cwd = ""
            if cwd == self.work or cwd.startswith(self.work + "/"):
                return True
            if self.marker in _read(f"{task}/environ").split(b"\0"):
                return True
        return False

    def find(self) -> set[int]:
        """The run's processes now, except this one and its ancestors."""
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
        parent = {pid: _parent_and_state(str(pid))[0] for pid in pids}
        spared, pid = set(), os.getpid()
        while pid > 1:
            spared.add(pid)
            pid = parent.get(pid, 0)
        found = {pid for pid in pids if pid not in spared and self._belongs(pid)}
        while True:
            children = {pid for pid, pp in parent.items() if pp in found and pid not in found | spared}
            if not children:
                return found
            found |= children

    def stop(self) -> list[str]:
        """TERM, then KILL; returns a description of each process found at first."""
        left = self.find()
        first = [describe(pid) for pid in sorted(left)]
        _signal(left, signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        while time.monotonic() < deadline:
            left = {pid for pid in left | self.find() if is_running(pid)}
            if not left:
                return first
            time.sleep(0.5)
        _signal(left, signal.SIGKILL)
        deadline = time.monotonic() + KILL_WAIT_S
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = {pid for pid in left if is_running(pid)}
        return first


def describe(pid: int) -> str:
    name = _read(f"/proc/{pid}/comm").decode(errors="replace").strip()
    args = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    parent, state = _parent_and_state(str(pid))
    return f"pid {pid} ({name}, state {state}, parent {parent}): {args}"


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:  # gone already
            pass


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[2] not in ("ray-stop", "cleanup", "check"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    work, run_id, mode = argv[:3]
    processes = RunProcesses(work, run_id, mode, {int(pid) for pid in argv[3:] if pid.isdigit()})
    if mode == "check":
        left = sorted(pid for pid in processes.find() if is_running(pid))
        for pid in left:
            print("left running:", describe(pid))
        return 1 if left else 0
    for description in processes.stop():
        print("stopped:", description)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
