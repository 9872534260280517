"""`CompileWorker`: the engine's side of the grammar compile worker, a process that runs
every compile first, each in a child it can kill (`compile_worker_process`).

`submit` returns a future of the compiled grammar; cancelling the future kills its compile
wherever it runs in the worker: queued, or running for seconds. What comes back is either
the grammar (as xgrammar's JSON, deserialised here against the engine's own copy of the
vocabulary index) or, for a grammar that compiled within `fast_compile_s`, word that it
did: the engine then compiles it again itself, on one of its compile threads, which is
cheaper than moving it and holds that thread no longer than `fast_compile_s` (the same
work on the same input; more only as far as the engine's process is busier).

Threads: a writer (starts the process on first use, and again if it dies, and writes to
it), a reader (resolves the futures; deserialising runs off the GIL) and `compile_threads`
engine compile threads. None is the caller's, so `submit` never blocks the event loop or
the engine step.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

from raylm.engine.structured_output.compile_worker_process import encode_frame, read_frame
from raylm.engine.structured_output.constraint_compiler import compile_constraint
from raylm.engine.structured_output.params import StructuredOutputsError, StructuredOutputsParams

logger = logging.getLogger(__name__)

KIND_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
              "json_object": "json_object", "structural_tag": "structural tag"}
# How long shutdown waits for the process to end once its stdin is closed, before killing it.
_EXIT_WAIT_S = 5.0


@dataclass
class _Pending:
    future: Future
    params: StructuredOutputsParams
    # The process the compile was sent to (its pid); None while it waits to be sent.
    sent_to: int | None = None


class CompileWorker:
    """Compiles constraints through the worker process.

    Args:
        tokenizer_info: builds xgrammar's index of the model's vocabulary (called once, on
            the writer thread); the process gets a copy.
        max_concurrent: compiles running at once in the worker, each in a process of its
            own (the others wait in order).
        fast_compile_s: a grammar a child compiled within this many seconds is compiled
            again in the engine rather than sent (see the module's docstring).
        compile_threads: the engine's threads for those compiles.
    """

    def __init__(self, tokenizer_info: Callable[[], Any], max_concurrent: int, fast_compile_s: float,
                 compile_threads: int) -> None:
        if max_concurrent < 1 or compile_threads < 1:
            raise ValueError(f"the compile worker needs at least one process and one engine compile thread, got "
                             f"{max_concurrent} and {compile_threads}")
        self._make_tokenizer_info = tokenizer_info
        self.max_concurrent = max_concurrent
        self.fast_compile_s = fast_compile_s
        self.tokenizer_info: Any = None
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, _Pending] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._fast: queue.SimpleQueue = queue.SimpleQueue()
        self._num_compile_threads = compile_threads
        self._threads: list[threading.Thread] = []
        self._process: subprocess.Popen | None = None
        self._ready: Future = Future()
        self._shutdown = False
        # Seconds each compile took in its child, newest last (the last 1024).
        self.compile_times: list[float] = []

    @property
    def pid(self) -> int | None:
        """The worker process's pid while it runs."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def start(self) -> Future:
        """Starts the process unless it runs; the future (of its pid) is done once it is ready
        to compile (xgrammar imported and the vocabulary indexed: seconds, so the server
        starts it early)."""
        with self._lock:
            if self._shutdown:
                raise RuntimeError("the grammar compile worker is shut down")
            if not self._threads:
                self._threads = [threading.Thread(target=self._write, name="raylm-grammar-writer", daemon=True)]
                self._threads += [threading.Thread(target=self._compile_fast, name=f"raylm-grammar-{i}", daemon=True)
                                  for i in range(self._num_compile_threads)]
                for thread in self._threads:
                    thread.start()
                self._outbox.put(None)  # wakes the writer, which starts the process
        return self._ready

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
                if self._process is None or self._process.poll() is not None:
                    self._start_process()
                if item is not None:
                    self._send(*item)
            except OSError as exc:
                # The process died between our check and the write: its reader fails what
                # it was sent, and this compile goes to the next process.
                logger.warning("The grammar compile worker stopped (%s); restarting it.", exc)
                if item is not None and item[0] == "compile":
                    self._outbox.put(item)
            except Exception as exc:  # noqa: BLE001 - e.g. the vocabulary cannot be indexed
                logger.exception("The grammar compile worker cannot start.")
                self._fail_all(RuntimeError(f"the grammar compile worker cannot start: {exc}"), None)
                _resolve(self._ready, exception=exc)

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
        process = subprocess.Popen([sys.executable, "-m", "raylm.engine.structured_output.compile_worker_process"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._process = process
        reader = threading.Thread(target=self._read, args=(process,), name="raylm-grammar-reader", daemon=True)
        reader.start()
        self._threads.append(reader)
        assert process.stdin is not None
        process.stdin.write(encode_frame({"op": "init", "max_children": self.max_concurrent,
                                          "fast_compile_s": self.fast_compile_s},
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
    def _read(self, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        while (frame := read_frame(process.stdout)) is not None:
            header, payload = frame
            if header["op"] == "ready":
                _resolve(self._ready, header["pid"])
                continue
            with self._lock:
                pending = self._pending.pop(header["id"], None)
            if pending is None:  # cancelled meanwhile
                continue
            if header["op"] == "failed":
                _resolve(pending.future, exception=_compile_error(pending.params, header["reason"], header["message"]))
                continue
            self._record(header["seconds"], pending.params)
            if header["op"] == "fast":
                self._fast.put(pending)
            else:
                _resolve(pending.future, *self._deserialize(payload))
        process.stdout.close()
        if not self._shutdown:
            logger.error("The grammar compile worker (pid %d) exited with status %s.", process.pid, process.wait())
            self._fail_all(RuntimeError("the grammar compile worker exited while compiling"), process.pid)

    def _deserialize(self, payload: bytes) -> tuple[Any, BaseException | None]:
        import xgrammar as xgr

        try:
            return xgr.CompiledGrammar.deserialize_json(payload.decode(), self.tokenizer_info), None
        except (RuntimeError, ValueError) as exc:  # not expected: both sides run the same xgrammar
            return None, RuntimeError(f"a compiled grammar did not deserialise: {exc}")

    def _record(self, seconds: float, params: StructuredOutputsParams) -> None:
        with self._lock:
            self.compile_times.append(seconds)
            del self.compile_times[:-1024]
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
    def _compile_fast(self) -> None:
        while (pending := self._fast.get()) is not None:
            if pending.future.done():  # cancelled meanwhile
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
            self._fast.put(None)
        writer = threads[0]
        writer.join(_EXIT_WAIT_S + 1.0)
        process = self._process
        if writer.is_alive() and process is not None:
            # Blocked writing to a process that reads no more (stopped or hung): a kill ends both.
            process.kill()
            writer.join()
        for thread in threads[1:]:
            # An engine compile still running takes at most about fast_compile_s.
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
    return StructuredOutputsError(f"{what} could not be compiled: {message}.", params.source)
