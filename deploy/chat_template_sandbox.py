"""`ChatTemplateSandbox`: renders the chat templates requests send (under
--trust-request-chat-template) in processes of their own.

A template is code. The bounds of deploy/chat_template.py (steps, sizes) stop the usual ways
of burning time or memory, but a thread cannot be interrupted in Python, and one C-level call
(a str.format with a huge padding, a join of a long list) can still run long or ask for
gigabytes. So a request's template renders in a worker process with an address-space limit
(`memory_limit_bytes`: an allocation past it is a MemoryError, reported as the template's
error), and one that has not answered within the deadline is killed; the next render starts
a fresh process. The server's own templates (the model's, --chat-template) render in the
server, where their bounds (steps, sizes, and the time limit, checked as they step)
suffice: what a request sends them is data, not code.

Each render runs on one of `max_processes` threads (the waiting for the process happens
there, never on the event loop), with one worker process each, started on first use (some
0.1 s: Python and Jinja, nothing of the server). At most `max_queued` renders wait for a
thread; one more fails at once with ChatTemplateBusyError (the server answers 429 with
Retry-After), so that a burst of slow templates cannot make every later request wait for
all of them. A render's deadline counts from when it was asked for: the time it waited
counts against it, and one whose time ran out before a process was free fails with
ChatTemplateBusyError without running. Renders take threads in the order they came, and
each ends by its deadline, so a waiting one gets a thread by its own deadline (plus, at
worst, a process start). The worker is given the time left too, and stops a render at it
itself (deploy/chat_template.py counts it), so that it is killed, and a fresh one started,
only when something holds it past the deadline (one long C-level call) by _KILL_GRACE_S.
`close` (the app's shutdown) kills them all, rendering or not; a render asked for after it
fails at once (ChatTemplateUnavailableError).
Should the server end without closing, a worker ends when its stdin closes or, on Linux, when
the server dies.

Protocol: one JSON line each way. To the worker: {"template", "messages",
"add_generation_prompt", "continue_final_message", "variables", "max_chars", "max_steps",
"timeout_s"}; from it: {"text"} or {"error", "limit", "timeout"} (limit: a bound was passed;
timeout: the time limit). The worker first writes
{"ready": true}.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from raylm.deploy.chat_template import (ChatTemplateBusyError, ChatTemplateError, ChatTemplateLimitError,
                                       ChatTemplateRenderer, ChatTemplateTimeoutError, ChatTemplateUnavailableError)

# Processes rendering request templates at once; more renders wait for one.
DEFAULT_MAX_PROCESSES = 2
# Renders that may wait for a process, per process (--max-queued-chat-template-renders'
# default): a burst of ordinary templates (milliseconds each) waits, while slow ones
# (seconds) are refused beyond a few deadlines' worth instead of queueing without end.
QUEUED_RENDERS_PER_PROCESS = 4
DEFAULT_MAX_QUEUED = QUEUED_RENDERS_PER_PROCESS * DEFAULT_MAX_PROCESSES
# The worker stops a render itself at the deadline; the server waits this much longer for
# its answer (the worker reads its clock every few operations, each up to tens of
# milliseconds) before it kills it.
_KILL_GRACE_S = 0.25
# A worker's address space: Python and Jinja take some 25 MB; the rest is room for the
# template's values, a few copies of a prompt of max_chars characters at 4 bytes each.
BASE_MEMORY_BYTES = 512 * 1024 * 1024
MEMORY_BYTES_PER_CHAR = 32
# How long a worker may take to start (Python and Jinja) before its render fails.
_START_TIMEOUT_S = 30.0


def memory_limit_bytes(max_chars: int) -> int:
    return BASE_MEMORY_BYTES + MEMORY_BYTES_PER_CHAR * max_chars


class _WorkerDied(Exception):
    pass


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, memory_bytes: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "raylm.deploy.chat_template_sandbox", str(memory_bytes), str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._buffer = b""
        try:
            if self._read_line(time.monotonic() + _START_TIMEOUT_S, 1024) != {"ready": True}:
                raise _WorkerDied("the chat template worker did not start")
        except BaseException:
            self.kill()  # a start that failed or timed out leaves no process behind
            raise

    def ask(self, job: dict[str, Any], deadline: float, max_reply_bytes: int) -> dict[str, Any]:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(job, ensure_ascii=False).encode() + b"\n")
            self.process.stdin.flush()
        except OSError as exc:
            raise _WorkerDied(f"the chat template worker stopped ({exc})") from None
        return self._read_line(deadline, max_reply_bytes)

    def _read_line(self, deadline: float, max_bytes: int) -> dict[str, Any]:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            wait_s = deadline - time.monotonic()
            if wait_s <= 0:
                raise TimeoutError
            readable, _, _ = select.select([fd], [], [], wait_s)
            if not readable:
                continue
            data = os.read(fd, 1 << 20)
            if not data:
                code = self.process.wait()
                raise _WorkerDied(f"the chat template worker ended ({_describe_exit(code)})")
            self._buffer += data
            if len(self._buffer) > max_bytes:
                raise _WorkerDied("the chat template worker answered more than its limit")
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                pipe.close()  # type: ignore[union-attr]


class ChatTemplateSandbox:
    """Renders request templates in worker processes within `timeout_s` seconds each, counted
    from when the render is asked for, with at most `max_queued` renders waiting for one of
    the `max_processes` processes (see the module's docstring); the renders' other bounds
    are `max_chars` and `max_steps`."""

    def __init__(self, max_chars: int, max_steps: int, timeout_s: float,
                 max_processes: int = DEFAULT_MAX_PROCESSES, max_queued: int = DEFAULT_MAX_QUEUED) -> None:
        self.max_chars = max_chars
        self.max_steps = max_steps
        self.timeout_s = timeout_s
        self.max_processes = max_processes
        self.max_queued = max_queued
        self.memory_bytes = memory_limit_bytes(max_chars)
        self._executor = ThreadPoolExecutor(max_processes, thread_name_prefix="raylm-template-sandbox")
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        # Renders asked for and not yet over (rendering, or waiting for a thread).
        self._admitted = 0
        self._lock = threading.Lock()
        self._closed = False

    @property
    def worker_pids(self) -> list[int]:
        """The pids of the worker processes (idle or rendering)."""
        with self._lock:
            return [worker.process.pid for worker in (*self._idle, *self._busy)]

    @property
    def rendering_pids(self) -> list[int]:
        """The pids of the worker processes rendering now."""
        with self._lock:
            return [worker.process.pid for worker in self._busy]

    @property
    def renders_admitted(self) -> int:
        """Renders rendering or waiting for a process now."""
        with self._lock:
            return self._admitted

    async def render(self, template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     continue_final_message: bool, variables: dict[str, Any]) -> str:
        """As ChatTemplateRenderer.render, in a worker process, without blocking the event loop;
        ChatTemplateBusyError at once when `max_queued` renders wait already."""
        asked_at = time.monotonic()
        job = {"template": template, "messages": messages, "add_generation_prompt": add_generation_prompt,
               "continue_final_message": continue_final_message, "variables": variables,
               "max_chars": self.max_chars, "max_steps": self.max_steps}
        self._admit()
        try:
            future = self._executor.submit(self.render_job, job, asked_at)
        except RuntimeError:  # the executor was shut down: closed
            self._leave()
            if not self._closed:
                raise
            raise _shutting_down() from None
        # Whether it ran or was cancelled before it did (its request went away while it waited).
        future.add_done_callback(lambda _: self._leave())
        return await asyncio.wrap_future(future)

    def _admit(self) -> None:
        with self._lock:
            if self._closed:
                raise _shutting_down()
            if self._admitted >= self.max_processes + self.max_queued:
                raise ChatTemplateBusyError(
                    f"{self.max_queued} request chat templates are waiting for the {self.max_processes} processes "
                    f"that render them, the most that may (--max-queued-chat-template-renders)")
            self._admitted += 1

    def _leave(self) -> None:
        with self._lock:
            self._admitted -= 1

    def render_job(self, job: dict[str, Any], asked_at: float | None = None) -> str:
        """Renders `job` (the protocol's request, less its timeout) in a worker; blocks up to
        the deadline, `timeout_s` after `asked_at` (default: now)."""
        asked_at = time.monotonic() if asked_at is None else asked_at
        deadline = asked_at + self.timeout_s
        self._check_time_left(asked_at, deadline)
        worker = self._take()
        self._check_time_left(asked_at, deadline, worker)  # a process start takes time too
        time_left = deadline - time.monotonic()
        keep = False
        try:
            try:
                reply = worker.ask({**job, "timeout_s": time_left}, deadline + _KILL_GRACE_S,
                                   8 * self.max_chars + (1 << 20))
            except TimeoutError:
                raise self._timed_out(asked_at, deadline - time_left) from None
            except (_WorkerDied, ValueError) as exc:  # ValueError: a reply that is not JSON
                if self._closed:  # close() killed it: not the template's doing
                    raise _shutting_down() from None
                raise ChatTemplateError(f"the chat template's render process failed: {exc}") from None
            keep = True
        finally:
            self._give_back(worker, keep)
        if "error" in reply:
            if reply.get("timeout"):
                raise self._timed_out(asked_at, deadline - time_left)
            raise (ChatTemplateLimitError if reply.get("limit") else ChatTemplateError)(reply["error"])
        return reply["text"]

    def _check_time_left(self, asked_at: float, deadline: float, worker: _Worker | None = None) -> None:
        """ChatTemplateBusyError if the render's time ran out before it could start (`worker`,
        taken meanwhile and not asked anything, goes back to the idle ones)."""
        if time.monotonic() < deadline:
            return
        if worker is not None:
            self._give_back(worker, keep=True)
        raise ChatTemplateBusyError(f"the chat template waited {time.monotonic() - asked_at:.1f} s for a process to "
                                    f"render it, past its {self.timeout_s:g} s (--max-chat-template-render-seconds), "
                                    f"every process rendering others")

    def _timed_out(self, asked_at: float, started_at: float) -> ChatTemplateTimeoutError:
        waited = started_at - asked_at
        return ChatTemplateTimeoutError(
            f"the chat template did not render within {self.timeout_s:g} s (--max-chat-template-render-seconds)"
            + (f", {waited:.1f} s of which it waited for a render process" if waited >= 0.05 else ""))

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise _shutting_down()
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            try:
                worker = _Worker(self.memory_bytes)
            except (OSError, _WorkerDied, TimeoutError) as exc:
                raise ChatTemplateUnavailableError(f"the chat template's render process did not start: "
                                        f"{exc or type(exc).__name__}") from None
        with self._lock:
            closed = self._closed  # close() ran while the worker started
            if not closed:
                self._busy.add(worker)
        if closed:
            worker.kill()
            raise _shutting_down()
        return worker

    def _give_back(self, worker: _Worker, keep: bool) -> None:
        with self._lock:
            self._busy.discard(worker)
            keep = keep and not self._closed
            if keep:
                self._idle.append(worker)
        if not keep:
            worker.kill()

    def close(self) -> None:
        """Kills every worker process and refuses renders from now on (idempotent). A render
        in flight fails with ChatTemplateUnavailableError; its thread reaps its worker."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        for worker in idle:
            worker.kill()
        for worker in busy:
            # Only the signal: the rendering thread reads the worker's pipes, so it closes
            # them and waits for the process (_give_back), once the read sees it end.
            with contextlib.suppress(OSError):
                worker.process.kill()
        self._executor.shutdown(wait=False)


def _shutting_down() -> ChatTemplateUnavailableError:
    return ChatTemplateUnavailableError("the server is shutting down")


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


# ----------------------------------------------------------------- the worker process
def _limit_worker(memory_bytes: int, server_pid: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != server_pid:  # the server died before the call
            os._exit(1)


def _answer(renderers: dict[tuple[int, int], ChatTemplateRenderer], job: dict[str, Any]) -> dict[str, Any]:
    key = (job["max_chars"], job["max_steps"])
    renderer = renderers.get(key)
    if renderer is None:
        renderer = renderers[key] = ChatTemplateRenderer(*key)
    try:
        return {"text": renderer.render(job["template"], job["messages"], job["add_generation_prompt"],
                                        job["continue_final_message"], job["variables"],
                                        timeout_s=job.get("timeout_s"))}
    except ChatTemplateError as exc:
        return {"error": str(exc), "limit": isinstance(exc, ChatTemplateLimitError),
                "timeout": isinstance(exc, ChatTemplateTimeoutError)}
    except MemoryError:  # outside the render (reading the job, writing the answer)
        return {"error": "the chat template ran out of memory", "limit": True}


def main() -> None:
    # Ctrl-C reaches the whole process group; the worker ends with the server, by its stdin closing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _limit_worker(int(sys.argv[1]), int(sys.argv[2]))
    renderers: dict[tuple[int, int], ChatTemplateRenderer] = {}
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        reply = _answer(renderers, json.loads(line))
        out.write(json.dumps(reply, ensure_ascii=False).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
