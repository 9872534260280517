"""`raylm serve` as a real subprocess for the HTTP tests: a free port, a log file, a wait
for `/health`, and a stop that never leaves the process behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(base_url: str, process: subprocess.Popen | None = None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{base_url} did not become healthy in {timeout} s")


def rss_kib(pid: int) -> int:
    """The process's resident set size (VmRSS), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a server process: one OpenMP thread, no RAY_ADDRESS (a private
    Ray), no RAYLM_API_KEY unless `extra` sets it."""
    drop = ("RAY_ADDRESS", "RAYLM_API_KEY")
    return {k: v for k, v in os.environ.items() if k not in drop} | {"OMP_NUM_THREADS": "1"} | (extra or {})


def start_server(args: list[str], log: Path | None = None,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Starts `raylm serve ARGS` on a free port with one OpenMP thread and a private Ray
    (never the test session's); returns (process, base_url) once /health answers. Its
    output goes to `log` (shown if it fails to come up), or nowhere; `env` adds to its
    environment."""
    (started,) = start_servers([(args, log, env)])
    return started


# What `start_server` takes, for each of several servers: (args, log) or (args, log, env).
ServerConfig = tuple[list[str], Path | None] | tuple[list[str], Path | None, dict[str, str] | None]


def start_servers(configs: list[ServerConfig]) -> list[tuple[subprocess.Popen, str]]:
    """`start_server` for several servers, started side by side: returns once all answer."""
    launched = [_launch(*config) for config in configs]
    for (process, base_url), (_, log, *_) in zip(launched, configs):
        try:
            wait_healthy(base_url, process)
        except BaseException:
            for other, _ in launched:
                stop_server(other)
            if log is not None:
                print(log.read_text()[-5000:])
            raise
    return launched


def _launch(args: list[str], log: Path | None,
            env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "raylm.deploy.cli", "serve", *args, "--port", str(port)]
    env = server_env(env)
    output = open(log, "w") if log is not None else subprocess.DEVNULL
    try:
        # Its own process group: the processes of its private Ray (raylet, agents, workers)
        # join it, so a stop that must kill can take them all (killed alone, the server
        # leaves Ray's dashboard and runtime-env agents running, orphaned).
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    finally:
        if log is not None:
            output.close()
    return process, f"http://127.0.0.1:{port}"


def stop_server(process: subprocess.Popen, timeout: float = 30.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_process_group(process)


def kill_process_group(process: subprocess.Popen) -> None:
    """Kills a server started by `start_server` and every process of its group (its Ray)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


@contextmanager
def running_server(args: list[str], log: Path | None = None,
                   env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """`start_server` for the length of a with-block (or a yield fixture)."""
    process, base_url = start_server(args, log, env)
    try:
        yield process, base_url
    except BaseException:
        if log is not None:
            print(log.read_text()[-5000:])
        raise
    finally:
        stop_server(process)


class InProcessServer:
    """The real app on a real port, served by uvicorn in a thread of this process, so that the
    test can reach its engine and its app (`app`, for instance `app.state.chat`). Leaving the
    with-block stops uvicorn as a signal would (its lifespan shutdown included); the engine is
    the test's."""

    def __init__(self, engine, server_args) -> None:
        import uvicorn

        from raylm.deploy.api_server import build_app

        self.port = free_port()
        self.app = build_app(engine, server_args)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        base_url = f"http://127.0.0.1:{self.port}"
        wait_healthy(base_url, timeout=60)
        return base_url

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self.thread.join(30)
