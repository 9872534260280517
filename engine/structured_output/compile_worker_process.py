"""The grammar compile worker's program (``python -m raylm.engine.structured_output.compile_worker_process``).

xgrammar cannot interrupt a compile once it has started, and some grammars take seconds
(an EBNF grammar of a few thousand chained rules, a JSON schema nested hundreds deep). So
every compile starts here, not in the engine: this program imports xgrammar and indexes the
model's vocabulary once, then forks one child per compile. A fork shares the loaded library
and the vocabulary index, so a child pays for its grammar alone, and the engine has it
killed when its request's deadline passes: a hostile grammar holds a CPU no longer than the
deadline. The children run side by side (up to `max_children`; the OS shares the cores
among them), so a slow grammar makes an ordinary one wait only when `max_children` slow
ones run at once.

A child answers in one of two ways: "recompile" (the engine compiles the grammar again
itself, which costs it about the compile's time once more: xgrammar does the same work on
the same input) or "compiled" with xgrammar's JSON of the grammar, which the engine reads
instead. Which is cheaper for the engine depends on the grammar: the JSON holds the token
mask cache, so it can be 10-80x larger than the grammar's size in memory, and take 2-10x
the compile to write and about 0.33-0.5x that to read (a 40-field schema: compiles in
0.01 s, 3.6 MB; 900 chained rules: 0.4 s, 89 MB written in 3.9 s and read in 1.9 s; 512-
token vocabulary). So a grammar that compiled within `fast_compile_s` is only reported;
for a slower one the child writes the JSON for up to `MAX_WRITE_PER_COMPILE` times the
compile, and sends it if it is done by then and within `MAX_GRAMMAR_JSON_BYTES`, and
otherwise reports "recompile". The engine thus spends about the lesser of the compile and
the read on each grammar, never more than about the compile. A child that crashes (a bug
in the compiler met by some grammar) fails its compile alone.

This process is single-threaded (its environment pins OpenMP and BLAS to one thread):
a fork copies only the calling thread, so no lock can be held by a thread the child lacks.
It and the engine exchange frames on its stdin and stdout (`encode_frame`): a small JSON
header and a byte payload. Its stdin closing (the engine shut down, or died) ends it and
its children.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import math
import os
import selectors
import signal
import struct
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from raylm.engine.structured_output.constraint_compiler import allows_any_token, compile_constraint, error_message

# A frame: the lengths of its JSON header and of its payload, then both.
_FRAME_LENGTHS = struct.Struct("!II")
_READ_SIZE = 1 << 20
# Reading a grammar's JSON takes the engine about 0.33-0.5x the time writing it took here
# (see the module's docstring): a grammar whose JSON is not written within this many times its
# compile is cheaper for the engine to compile again.
MAX_WRITE_PER_COMPILE = 1.0
# The largest grammar JSON sent to the engine (it is held whole here, in the server and in the
# engine); a grammar with a larger one is compiled again in the engine.
MAX_GRAMMAR_JSON_BYTES = 16 * 1024**2
# Compiled once at start (a cache key: kind, value, whitespace options), so that what
# xgrammar and torch set up on first use is set up once, in the memory the children share.
_WARM_UP_KEY = json.dumps(["json", {"type": "object", "properties": {"a": {"type": "integer"}}}, False, 20])


# ---------------------------------------------------------------------------------- frames
def encode_frame(header: dict[str, Any], payload: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return _FRAME_LENGTHS.pack(len(head), len(payload)) + head + payload


def read_frame(stream: Any) -> tuple[dict[str, Any], bytes] | None:
    """The next frame of a blocking binary stream; None at its end."""
    lengths = stream.read(_FRAME_LENGTHS.size)
    if len(lengths) < _FRAME_LENGTHS.size:
        return None
    head_size, payload_size = _FRAME_LENGTHS.unpack(lengths)
    head, payload = stream.read(head_size), stream.read(payload_size)
    if len(head) < head_size or len(payload) < payload_size:
        return None
    return json.loads(head), payload


class FrameReader:
    """Cuts the bytes of a non-blocking stream into frames as they arrive."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[dict[str, Any], bytes]]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= _FRAME_LENGTHS.size:
            head_size, payload_size = _FRAME_LENGTHS.unpack_from(self._buffer)
            end = _FRAME_LENGTHS.size + head_size + payload_size
            if len(self._buffer) < end:
                break
            head = bytes(self._buffer[_FRAME_LENGTHS.size:_FRAME_LENGTHS.size + head_size])
            frames.append((json.loads(head), bytes(self._buffer[_FRAME_LENGTHS.size + head_size:end])))
            del self._buffer[:end]
        return frames


def _is_one_frame(data: bytes) -> bool:
    if len(data) < _FRAME_LENGTHS.size:
        return False
    head_size, payload_size = _FRAME_LENGTHS.unpack_from(data)
    return len(data) == _FRAME_LENGTHS.size + head_size + payload_size


# ------------------------------------------------------------------------------ a compile
def compile_result(tokenizer_info: Any, compile_id: int, key: str, fast_compile_s: float,
                   max_write_per_compile: float = MAX_WRITE_PER_COMPILE) -> bytes:
    """The frame that answers one compile (see the module's docstring): "recompile",
    "compiled" with the grammar's JSON, or "failed" with the reason ("invalid": xgrammar
    refused it; "empty": no finite text matches it)."""
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
    start = time.perf_counter()
    try:
        grammar = compile_constraint(compiler, key)
    except (RuntimeError, ValueError, TypeError) as exc:
        return encode_frame({"op": "failed", "id": compile_id, "reason": "invalid", "message": error_message(exc)})
    seconds = time.perf_counter() - start
    if not allows_any_token(grammar):
        return encode_frame({"op": "failed", "id": compile_id, "reason": "empty", "message": ""})
    if seconds <= fast_compile_s:
        return encode_frame({"op": "recompile", "id": compile_id, "seconds": seconds})
    payload = _grammar_json(grammar, max_write_per_compile * seconds)
    if payload is None or len(payload) > MAX_GRAMMAR_JSON_BYTES:
        return encode_frame({"op": "recompile", "id": compile_id, "seconds": seconds})
    return encode_frame({"op": "compiled", "id": compile_id, "seconds": seconds}, payload)


def _grammar_json(grammar: Any, within_s: float) -> bytes | None:
    """xgrammar's JSON of the grammar, or None if writing it takes longer than `within_s`.
    Written on a thread (xgrammar lets go of the GIL meanwhile), which a child, given up
    on, leaves running: the child exits once it has answered. Only children call this: the
    server, which forks, must keep to one thread."""
    written: list[str] = []
    thread = threading.Thread(target=lambda: written.append(grammar.serialize_json()), daemon=True)
    thread.start()
    thread.join(within_s if math.isfinite(within_s) else None)
    return written[0].encode() if written else None


# ------------------------------------------------------------------------------- the server
@dataclass
class _Child:
    pid: int
    request_fd: int  # the child's one compile request is written here
    answer_fd: int
    compile_id: int | None = None  # None while it is a spare
    answer: bytearray = field(default_factory=bytearray)
    answered: bool = False


class CompileServer:
    """Runs each compile in a child, up to `max_children` at once (the rest wait in order),
    relays each child's answer, and kills a child whose compile is cancelled. A few children
    are forked ahead (`spare_children`), so that forking (10-20 ms for a process this size)
    is not on a compile's path."""

    def __init__(self, tokenizer_info: Any, max_children: int, fast_compile_s: float,
                 max_write_per_compile: float = MAX_WRITE_PER_COMPILE, spare_children: int = 2) -> None:
        self.tokenizer_info = tokenizer_info
        self.max_children = max_children
        self.fast_compile_s = fast_compile_s
        self.max_write_per_compile = max_write_per_compile
        self.spare_children = spare_children
        self._queue: deque[tuple[int, bytes]] = deque()
        self._running: dict[int, _Child] = {}
        self._spares: deque[_Child] = deque()
        self._selector = selectors.DefaultSelector()
        self._pid = os.getpid()

    def serve(self, requests: FrameReader, pending: list[tuple[dict[str, Any], bytes]]) -> None:
        """Runs until stdin closes. `requests` is what has been reading stdin, `pending` the
        frames it cut that are not handled yet."""
        stdin = sys.stdin.fileno()
        self._selector.register(stdin, selectors.EVENT_READ)
        self._handle(pending)
        while True:
            while self._queue and len(self._running) < self.max_children:
                self._start(*self._queue.popleft())
            # Spares are forked only while no compile runs: a fork takes the server 10-20 ms,
            # during which it relays nothing.
            wants_spare = not self._queue and not self._running and len(self._spares) < self.spare_children
            events = self._selector.select(0 if wants_spare else None)
            if not events and wants_spare:
                self._spares.append(self._fork())
                continue
            for key, _ in events:
                if key.fd != stdin:
                    if self._selector.get_map().get(key.fd) is key:  # not killed by a cancel just read
                        self._read_child(key.data)
                    continue
                data = os.read(stdin, _READ_SIZE)
                if not data:
                    self.kill_all()
                    return
                self._handle(requests.feed(data))

    def _handle(self, frames: list[tuple[dict[str, Any], bytes]]) -> None:
        """Compiles are only queued here (and started once the whole read is handled), so a
        compile cancelled in the same read never starts."""
        for header, payload in frames:
            if header["op"] == "compile":
                self._queue.append((header["id"], payload))
            elif header["op"] == "cancel":
                self._cancel(header["id"])

    def _start(self, compile_id: int, key: bytes) -> None:
        child = self._spares.popleft() if self._spares else self._fork()
        child.compile_id = compile_id
        try:
            _write_all(child.request_fd, encode_frame({"id": compile_id}, key))
        except OSError:  # a spare that died idle (killed from outside): its compile fails
            self._kill(child)
            _write_all(sys.stdout.fileno(), encode_frame({"op": "failed", "id": compile_id, "reason": "crashed",
                                                          "message": "the compiler's process was gone"}))
            return
        finally:
            os.close(child.request_fd)
        self._running[compile_id] = child

    def _fork(self) -> _Child:
        request_read, request_write = os.pipe()
        answer_read, answer_write = os.pipe()
        pid = os.fork()
        if pid == 0:  # no interpreter clean-up on exit: it would flush buffers the child inherited
            status = 1
            try:
                gc.disable()
                os.close(request_write)
                os.close(answer_read)
                _detach_from_engine(self._pid)
                _compile_one(self.tokenizer_info, request_read, answer_write, self.fast_compile_s,
                             self.max_write_per_compile)
                status = 0
            except BaseException:  # noqa: BLE001 - a bug here: to the engine's log, and the compile fails
                traceback.print_exc()
            finally:
                os._exit(status)
        os.close(request_read)
        os.close(answer_write)
        child = _Child(pid, request_write, answer_read)
        self._selector.register(answer_read, selectors.EVENT_READ, child)
        return child

    def _read_child(self, child: _Child) -> None:
        data = os.read(child.answer_fd, _READ_SIZE)
        if data:
            child.answer += data
            if child.compile_id is not None and _is_one_frame(child.answer):
                # Relayed before the child has exited: its exit (freeing what it used) is
                # not on the compile's path.
                _write_all(sys.stdout.fileno(), child.answer)
                child.answered = True
                self._running.pop(child.compile_id, None)
            return
        # The child's end: it exited (answered or not), or was killed.
        self._selector.unregister(child.answer_fd)
        os.close(child.answer_fd)
        _, status = os.waitpid(child.pid, 0)
        if child.compile_id is None:  # a spare that died idle
            self._spares.remove(child)
            os.close(child.request_fd)
        elif not child.answered:
            self._running.pop(child.compile_id, None)
            _write_all(sys.stdout.fileno(), encode_frame({"op": "failed", "id": child.compile_id, "reason": "crashed",
                                                          "message": _describe_exit(status)}))

    def _cancel(self, compile_id: int) -> None:
        child = self._running.pop(compile_id, None)
        if child is None:
            self._queue = deque(item for item in self._queue if item[0] != compile_id)
            return
        self._kill(child)

    def _kill(self, child: _Child) -> None:
        self._selector.unregister(child.answer_fd)
        os.close(child.answer_fd)
        os.kill(child.pid, signal.SIGKILL)
        os.waitpid(child.pid, 0)

    def kill_all(self) -> None:
        """Ends every child: running, answered and exiting, and spare."""
        children = [key.data for key in self._selector.get_map().values() if isinstance(key.data, _Child)]
        for child in children:
            self._kill(child)
            if child.compile_id is None:
                os.close(child.request_fd)
        self._running.clear()
        self._spares.clear()


def _compile_one(tokenizer_info: Any, request_fd: int, answer_fd: int, fast_compile_s: float,
                 max_write_per_compile: float) -> None:
    """A child's life: waits for its one compile request, compiles, answers."""
    requests = FrameReader()
    frames: list[tuple[dict[str, Any], bytes]] = []
    while not frames:
        data = os.read(request_fd, _READ_SIZE)
        if not data:  # the server is gone
            return
        frames = requests.feed(data)
    header, key = frames[0]
    _write_all(answer_fd, compile_result(tokenizer_info, header["id"], key.decode(), fast_compile_s,
                                         max_write_per_compile))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _describe_exit(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        return f"the compiler's process was killed by {signal.Signals(-code).name}"
    return f"the compiler's process exited with status {code}"


def _detach_from_engine(server_pid: int) -> None:
    """In a child: lets go of the engine's pipes (an engine reading the server's stdout must
    see its end when the server ends, whatever its children do) and has the kernel kill the
    child if the server dies (Linux), so that no compile outlives the engine."""
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != server_pid:  # the server died before the call
            os._exit(1)


def main() -> None:
    # Ctrl-C, or a supervisor's SIGTERM, may reach the whole process group: this process (and
    # its children, which inherit this) ends when the engine does, by its stdin closing, so
    # that the compiles of requests a draining server still answers go on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # stdin is read raw (a buffered reader could hold frames that select() then never sees).
    requests = FrameReader()
    frames: list[tuple[dict[str, Any], bytes]] = []
    while not frames:
        data = os.read(sys.stdin.fileno(), _READ_SIZE)
        if not data:
            return
        frames = requests.feed(data)
    (header, payload), pending = frames[0], frames[1:]
    import xgrammar as xgr

    tokenizer_info = xgr.TokenizerInfo.deserialize_json(payload.decode())
    compile_result(tokenizer_info, -1, _WARM_UP_KEY, fast_compile_s=float("inf"))  # no thread: see _grammar_json
    # Everything loaded so far is shared with the children; a collection in a child would
    # touch (and so copy) every page of it. Children do not collect at all (they live for one compile).
    gc.freeze()
    _write_all(sys.stdout.fileno(), encode_frame({"op": "ready", "pid": os.getpid()}))
    server = CompileServer(tokenizer_info, header["max_children"], header["fast_compile_s"],
                           header["max_write_per_compile"])
    try:
        server.serve(requests, pending)
    except BrokenPipeError:  # the engine died: nobody is left to answer
        server.kill_all()
    # Its children are reaped and its frames went out unbuffered: the interpreter's clean-up
    # (unloading torch, which xgrammar imports) would only hold the engine's shutdown, about
    # 2 s on a loaded 2-core machine.
    with contextlib.suppress(OSError):
        sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
