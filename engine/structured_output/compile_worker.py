"""`CompileWorker`: the engine's side of the grammar compile worker, a process that runs
every compile first, each in a child it can kill (`compile_worker_process`).

`submit` returns a future of the compiled grammar; cancelling the future kills its compile
wherever it runs in the worker: queued, or running for seconds. What comes back is either
the grammar (as xgrammar's JSON, deserialised on one of the engine's compile threads
against the engine's own copy of the vocabulary index) or word that the engine should
compile it again itself, on one of those threads: a grammar compiled within
`fast_compile_s`, or one whose JSON would cost the engine more to read than compiling it
again (see compile_worker_process).

Threads: a writer (starts the process on first use, and again if it dies, and writes to
it), a reader (resolves the futures) and `compile_threads` engine compile threads
(compiling again, deserialising). None is the caller's, so `submit` never blocks the event
loop or the engine step.

A worker that dies is started again by the next compile (or `start`), and its compiles in
flight fail with GrammarCompilerUnavailableError. One that dies before it is ready (it
cannot start at all: a broken install, no memory) fails its `start` future and every
compile waiting, and is tried again only after a pause that doubles with each such death
(1 s up to a minute); and the worker starts at most `_MAX_STARTS_PER_MINUTE` times a
minute. Compiles asked for while it may not start fail at once, so that nothing waits
forever on a worker that cannot run, and nothing starts one in a loop.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

from raylm.engine.structured_output.compile_worker_process import MAX_WRITE_PER_COMPILE, encode_frame, read_frame
from raylm.engine.structured_output.constraint_compiler import compile_constraint
from raylm.engine.structured_output.params import (CompileCrashedError, GrammarCompilerUnavailableError,
                                                   StructuredOutputsError, StructuredOutputsParams)

logger = logging.getLogger(__name__)

KIND_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
              "json_object": "json_object", "structural_tag": "structural tag"}
# How long shutdown waits for the process to end once its stdin is closed, before killing it.
_EXIT_WAIT_S = 5.0
# After a worker dies before it is ready, the pause before the next start: this, doubled with
# each such death in a row, up to _MAX_START_PAUSE_S.
_FIRST_START_PAUSE_S = 1.0
_MAX_START_PAUSE_S = 60.0
# Starts in any minute, whatever killed the worker (the first start counts).
_MAX_STARTS_PER_MINUTE = 5


@dataclass
class _Pending:
    future: Future
    params: StructuredOutputsParams
    # The process the compile was sent to (its pid); None while it waits to be sent.
    sent_to: int | None = None
    # The grammar's JSON, once it came back, for an engine compile thread to deserialise.
    payload: bytes | None = None


class CompileWorker:
    """Compiles constraints through the worker process.

    Args:
        tokenizer_info: builds xgrammar's index of the model's vocabulary (called once, on
            the writer thread); the process gets a copy.
        max_concurrent: compiles running at once in the worker, each in a process of its
            own (the others wait in order).
        fast_compile_s: a grammar a child compiled within this many seconds is compiled
            again in the engine rather than sent (see the module's docstring).
        compile_threads: the engine's threads for those compiles (and for deserialising).
        max_write_per_compile: a slower grammar comes back as xgrammar's JSON if that is
            written within this many times its compile, else it is compiled again in the
            engine (see compile_worker_process; inf always sends the JSON, up to its size bound).
    """

    def __init__(self, tokenizer_info: Callable[[], Any], max_concurrent: int, fast_compile_s: float,
                 compile_threads: int, max_write_per_compile: float = MAX_WRITE_PER_COMPILE) -> None:
        if max_concurrent < 1 or compile_threads < 1:
            raise ValueError(f"the compile worker needs at least one process and one engine compile thread, got "
                             f"{max_concurrent} and {compile_threads}")
        self._make_tokenizer_info = tokenizer_info
        self.max_concurrent = max_concurrent
        self.fast_compile_s = fast_compile_s
        self.max_write_per_compile = max_write_per_compile
        self.tokenizer_info: Any = None
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, _Pending] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        # Work for the engine's compile threads: compiles to run again, grammars to deserialise;
        # the shortest compile first (either takes about its compile's time or less), so that
        # an ordinary grammar does not wait behind slow ones. Items: (seconds, order, pending).
        self._engine_work: queue.PriorityQueue = queue.PriorityQueue()
        self._engine_order = itertools.count()
        self._num_compile_threads = compile_threads
        self._threads: list[threading.Thread] = []
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        # The pid of the process being started (or running), once it is ready; replaced when
        # a new process is to start after this one's start failed or it died.
        self._ready: Future = Future()
        self._shutdown = False
        # Starting again (see the module's docstring): when the last starts were, how many
        # processes in a row died before they were ready, and no start before _next_start_at.
        self._start_times: list[float] = []
        self._failed_starts = 0
        self._next_start_at = 0.0
        self._last_failure = ""
        # Seconds each compile took in its child, newest last (the last 1024).
        self.compile_times: deque[float] = deque(maxlen=1024)

    @property
    def pid(self) -> int | None:
        """The worker process's pid while it runs."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    @property
    def num_starts(self) -> int:
        """Processes started in the last minute (the first start included)."""
        with self._lock:
            return len(self._recent_starts())

    def start(self) -> Future:
        """Starts the process unless it runs; the future (of its pid) is done once it is ready
        to compile (xgrammar imported and the vocabulary indexed: seconds, so the server
        starts it early), and fails with GrammarCompilerUnavailableError if it cannot start."""
        with self._lock:
            if self._shutdown:
                raise RuntimeError("the grammar compile worker is shut down")
            wake = not self._threads
            if wake:
                self._threads = [threading.Thread(target=self._write, name="raylm-grammar-writer", daemon=True)]
                self._threads += [threading.Thread(target=self._run_engine_work, name=f"raylm-grammar-{i}",
                                                   daemon=True) for i in range(self._num_compile_threads)]
                for thread in self._threads:
                    thread.start()
            elif self._ready.done() and not self._is_running():  # it failed to start, or died since
                self._ready = Future()
                wake = True
            ready = self._ready
        if wake:
            self._outbox.put(None)  # wakes the writer, which starts the process
        return ready

    def _is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The future of the constraint's compiled grammar (or of a StructuredOutputsError
        naming `params.source`). Cancelling it kills the compile."""
        future: Future = Future()
        with self._lock:
            if self._shutdown:
                future.cancel()
                return future
            compile_id = next(self._ids)
            self._pending[compile_id] = _Pending(future, params)
        self.start()
        future.add_done_callback(lambda done: self._on_done(compile_id, done))
        self._outbox.put(("compile", compile_id))
        return future

    def _on_done(self, compile_id: int, future: Future) -> None:
        if future.cancelled():
            with self._lock:
                pending = self._pending.pop(compile_id, None)
            if pending is not None and pending.sent_to is not None:
                self._outbox.put(("cancel", compile_id))

    # ------------------------------------------------------------------ the writer thread
    def _write(self) -> None:
        while True:
            item = self._outbox.get()
            if self._shutdown:
                self._stop_process()
                return
            try:
                if not self._is_running():
                    if self._reader is not None:
                        # The last process's reader fails what it was sent (and notes a death
                        # before ready) before another process may start.
                        self._reader.join()
                    refusal = self._start_refusal()
                    if refusal is not None:
                        self._refuse(refusal)
                        continue
                    self._start_process()
                if item is not None:
                    self._send(*item)
            except OSError as exc:
                # The process died between our check and the write: its reader fails what
                # it was sent, and a compile not sent yet goes to the next process.
                logger.warning("The grammar compile worker stopped (%s).", exc)
                if item is not None and item[0] == "compile":
                    self._outbox.put(item)
            except Exception as exc:  # noqa: BLE001 - e.g. the vocabulary cannot be indexed
                logger.exception("The grammar compile worker cannot start.")
                self._start_failed(f"cannot start: {exc}", self._ready)

    def _recent_starts(self) -> list[float]:
        now = time.monotonic()
        self._start_times = [started for started in self._start_times if now - started < 60.0]
        return self._start_times

    def _start_refusal(self) -> str | None:
        """Why the process may not start now (None if it may)."""
        with self._lock:
            wait_s = self._next_start_at - time.monotonic()
            if wait_s > 0:
                return f"{self._last_failure}; it is started again in {wait_s:.0f} s"
            if len(self._recent_starts()) >= _MAX_STARTS_PER_MINUTE:
                return (f"{self._last_failure}; it was started {_MAX_STARTS_PER_MINUTE} times in the last minute, "
                        f"and is started again in {60.0 - (time.monotonic() - self._start_times[0]):.0f} s")
        return None

    def _refuse(self, reason: str) -> None:
        """Fails the start and every compile waiting: none is sent while the process may not start."""
        error = GrammarCompilerUnavailableError(f"the grammar compile worker is not running: {reason}")
        _resolve(self._ready, exception=error)
        self._fail_all(error, None)

    def _start_failed(self, reason: str, ready: Future) -> None:
        """A process that could not start, or died before it was ready: the next start waits
        (see the module's docstring); the start and every compile waiting fail."""
        with self._lock:
            self._failed_starts += 1
            pause_s = min(_FIRST_START_PAUSE_S * 2 ** (self._failed_starts - 1), _MAX_START_PAUSE_S)
            self._next_start_at = time.monotonic() + pause_s
            self._last_failure = reason
        logger.error("The grammar compile worker failed (%s); constrained requests fail until it starts again, "
                     "tried in %.0f s.", reason, pause_s)
        error = GrammarCompilerUnavailableError(f"the grammar compile worker {reason}")
        _resolve(ready, exception=error)
        self._fail_all(error, None)

    def _send(self, op: str, compile_id: int) -> None:
        process = self._process
        assert process is not None and process.stdin is not None
        with self._lock:
            pending = self._pending.get(compile_id)
            if op == "compile":
                if pending is None:  # cancelled before it was sent
                    return
                pending.sent_to = process.pid
                payload = pending.params.cache_key().encode()
            else:
                payload = b""
        process.stdin.write(encode_frame({"op": op, "id": compile_id}, payload))
        process.stdin.flush()

    def _start_process(self) -> None:
        with self._lock:
            self._recent_starts().append(time.monotonic())
            if self._ready.done():  # of a process that failed to start, or died
                self._ready = Future()
            ready = self._ready
        if self.tokenizer_info is None:
            import xgrammar as xgr

            self.tokenizer_info = self._make_tokenizer_info()
            self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        if self._process is not None and self._process.stdin is not None:
            try:
                self._process.stdin.close()  # of a process that died (its reader closed its stdout)
            except OSError:
                pass
        # One thread in the process: OpenMP and BLAS would each start a pool at import (see
        # compile_worker_process on why its forks need a single thread). No GPU: compiling
        # needs none, and a CUDA context would cost each process device memory.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "CUDA_VISIBLE_DEVICES": ""}
        try:
            process = subprocess.Popen([sys.executable, "-m", "raylm.engine.structured_output.compile_worker_process"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        except OSError as exc:  # not the OSError of a write to a process that died: it never ran
            raise RuntimeError(f"{sys.executable} did not run: {exc}") from exc
        self._process = process
        self._reader = threading.Thread(target=self._read, args=(process, ready), name="raylm-grammar-reader",
                                        daemon=True)
        self._reader.start()
        assert process.stdin is not None
        process.stdin.write(encode_frame({"op": "init", "max_children": self.max_concurrent,
                                          "fast_compile_s": self.fast_compile_s,
                                          "max_write_per_compile": self.max_write_per_compile},
                                         self.tokenizer_info.serialize_json().encode()))
        process.stdin.flush()

    def _stop_process(self) -> None:
        process = self._process
        if process is None:
            return
        try:
            assert process.stdin is not None
            process.stdin.close()  # the process kills its children and exits
        except OSError:
            pass
        try:
            process.wait(_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    # ------------------------------------------------------------------ the reader thread
    def _read(self, process: subprocess.Popen, ready: Future) -> None:
        assert process.stdout is not None
        while (frame := read_frame(process.stdout)) is not None:
            header, payload = frame
            if header["op"] == "ready":
                with self._lock:
                    self._failed_starts = 0
                _resolve(ready, header["pid"])
                continue
            with self._lock:
                pending = self._pending.pop(header["id"], None)
            if pending is None:  # cancelled meanwhile
                continue
            if header["op"] == "failed":
                _resolve(pending.future, exception=_compile_error(pending.params, header["reason"], header["message"]))
                continue
            self._record(header["seconds"], pending.params)
            # Both compiling again and deserialising take the engine's compile threads,
            # never this one: a large grammar's JSON takes seconds to read.
            if header["op"] == "compiled":
                pending.payload = payload
            self._engine_work.put((header["seconds"], next(self._engine_order), pending))
        process.stdout.close()
        status = process.wait()
        if self._shutdown:
            return
        if not ready.done():
            self._start_failed(f"exited before it was ready (status {status}; its error is in the log above)", ready)
            return
        logger.error("The grammar compile worker (pid %d) exited with status %s.", process.pid, status)
        with self._lock:
            self._last_failure = f"exited with status {status}"
        self._fail_all(GrammarCompilerUnavailableError(f"the grammar compile worker exited while compiling "
                                                       f"(status {status})"), process.pid)

    def _deserialize(self, payload: bytes) -> tuple[Any, BaseException | None]:
        import xgrammar as xgr

        try:
            return xgr.CompiledGrammar.deserialize_json(payload.decode(), self.tokenizer_info), None
        except (RuntimeError, ValueError) as exc:  # not expected: both sides run the same xgrammar
            return None, RuntimeError(f"a compiled grammar did not deserialise: {exc}")

    def _record(self, seconds: float, params: StructuredOutputsParams) -> None:
        with self._lock:
            self.compile_times.append(seconds)
        if seconds > 1.0:
            logger.info("Compiling a %s took %.1f s.", KIND_NAMES[params.kind], seconds)

    def _fail_all(self, error: BaseException, sent_to: int | None) -> None:
        """Fails the compiles sent to the process `sent_to` (all of them if None)."""
        with self._lock:
            failed = [compile_id for compile_id, pending in self._pending.items()
                      if sent_to is None or pending.sent_to == sent_to]
            futures = [self._pending.pop(compile_id).future for compile_id in failed]
        for future in futures:
            _resolve(future, exception=error)

    # --------------------------------------------------------- the engine's compile threads
    def _run_engine_work(self) -> None:
        while (pending := self._engine_work.get()[2]) is not None:
            if pending.future.done():  # cancelled meanwhile
                continue
            if pending.payload is not None:
                _resolve(pending.future, *self._deserialize(pending.payload))
                continue
            try:
                grammar = compile_constraint(self._compiler, pending.params.cache_key())
            except Exception as exc:  # noqa: BLE001 - not expected: the child compiled the same
                _resolve(pending.future, exception=exc)
            else:
                _resolve(pending.future, grammar)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Cancels every compile, ends the process and its children, and waits for them."""
        with self._lock:
            self._shutdown = True
            futures = [pending.future for pending in self._pending.values()]
            threads = list(self._threads)
        for future in futures:
            future.cancel()
        if not threads:
            return
        self._outbox.put(None)
        for _ in range(self._num_compile_threads):
            self._engine_work.put((float("inf"), next(self._engine_order), None))
        writer = threads[0]
        writer.join(_EXIT_WAIT_S + 1.0)
        process = self._process
        if writer.is_alive() and process is not None:
            # Blocked writing to a process that reads no more (stopped or hung): a kill ends both.
            process.kill()
            writer.join()
        for thread in [*threads[1:], self._reader]:
            # An engine compile still running takes at most about its compile in the child.
            if thread is not None:
                thread.join(_EXIT_WAIT_S)


def _resolve(future: Future, result: Any = None, exception: BaseException | None = None) -> None:
    """Settles a future unless it was cancelled meanwhile (a deadline passing races the answer)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def _compile_error(params: StructuredOutputsParams, reason: str, message: str) -> StructuredOutputsError:
    what = f"{params.source}: the {KIND_NAMES[params.kind]}"
    if reason == "invalid":
        return StructuredOutputsError(f"{what} is not valid: {message}", params.source)
    if reason == "empty":
        # A grammar with no finite sentence (`root ::= root "a"`, a schema that is its own
        # $ref): refused here, a 400 naming the field, rather than failing the request after
        # its KV blocks were allocated.
        return StructuredOutputsError(f"{what} allows no output at all (no finite text matches it; is it "
                                      f"infinitely recursive?).", params.source)
    return CompileCrashedError(f"{what} could not be compiled: {message}.", params.source)
