"""Processes below a process, from Linux's /proc: for tests that a server or an engine
leaves none behind, or that a given one was stopped."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first); None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def descendants(pid: int) -> dict[int, str]:
    """Command lines of the processes below `pid`."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        try:
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if fields is not None:
            parents[int(entry.name)] = int(fields[1])
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                found[child] = commands.get(child, "")
                frontier.append(child)
    return found


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    return [int(entry.name) for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) is not None
            and int(fields[1]) == pid]


def cpu_seconds(pid: int) -> float:
    """User and system CPU time the process has used (0 if it is gone)."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def is_gone(pid: int) -> bool:
    """Whether the process no longer exists: exited and reaped (a zombie still counts)."""
    return _stat_fields(pid) is None


def has_exited(pid: int) -> bool:
    """Whether the process has stopped running: gone, or a zombie. A zombie whose parent died
    waits for init to reap it, which no process of ours decides (init here took 1-2.5 s)."""
    fields = _stat_fields(pid)
    return fields is None or fields[0] in ("Z", "X")


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Waits up to `timeout` seconds for the processes to be gone; returns those left."""
    return _wait(pids, is_gone, timeout)


def wait_exited(pids: list[int], timeout: float) -> list[int]:
    """Waits up to `timeout` seconds for the processes to have exited (`has_exited`); returns
    those still running."""
    return _wait(pids, has_exited, timeout)


def _wait(pids: list[int], done: Callable[[int], bool], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [pid for pid in pids if not done(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left
