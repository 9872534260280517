"""`StructuredOutputManager`: compiles grammars off the engine step, caches them, and fills
each step's token bitmask.

Compiling a grammar takes from microseconds to seconds (a JSON schema's size and nesting
decide, or an EBNF grammar's rules), and xgrammar cannot interrupt a compile once it has
started. So every compile starts in a process of its own: `compile` hands it to the compile
worker (`compile_worker.py`) and returns a future. A grammar that compiles there fast, or
whose xgrammar JSON would cost more to move than compiling it again, is compiled again on
one of the engine's compile threads; another comes back whole. A
request whose grammar is not ready waits (`RequestStatus.WAITING_FOR_FSM`) while the batch
runs on; the server awaits the future, with a deadline, before it adds the request, so a
schema that does not compile, or compiles too slowly, is a 400, and its compile is killed:
no request holds a CPU, or a slot another request's compile waits for, past its deadline.

Compiled grammars are kept in an LRU cache keyed by the constraint (`cache_key`), bounded
in bytes (xgrammar reports each grammar's size) and in entries; a compile in flight is
shared by every request that asks for the same constraint, and a constraint the compiler
refused is remembered, so a bad schema sent again fails at once. A failure that may not be
the constraint's fault (its compile's process killed, the compile worker down, a deadline
passed) is forgotten as it happens: sent again, the constraint compiles again.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any

import numpy as np

from raylm.engine.structured_output.compile_worker import KIND_NAMES, CompileWorker
from raylm.engine.structured_output.params import CompileCrashedError, StructuredOutputsError, StructuredOutputsParams
from raylm.engine.structured_output.request import StructuredOutputRequest

# Compiled grammars kept for reuse. A JSON schema's grammar over a 128k vocabulary is a few
# MB (most of it the token-mask cache), over 4k tokens some tens of KB.
DEFAULT_CACHE_BYTES = 512 * 1024**2
DEFAULT_CACHE_ENTRIES = 4096
# Grammars compiling at once in the compile worker, each in a process of its own (the OS
# shares the cores among them; more wait in order). A compile lives at most until its
# request's deadline, so an ordinary grammar waits only while this many slow ones run at once.
DEFAULT_COMPILE_PROCESSES = 8
# A grammar the worker compiled within this many seconds is compiled again in the engine
# (cheaper than moving it: see compile_worker_process), on one of its compile threads; so no
# engine thread compiles for much longer than this. Schemas of tens of fields take 30-75 ms
# over a 128k vocabulary (2 cores of a Zen 5).
FAST_COMPILE_S = 0.25
DEFAULT_COMPILE_THREADS = 2


@dataclass
class _CacheEntry:
    future: Future
    submitted: float
    nbytes: int = 0


class StructuredOutputManager:
    """The driver's grammars and matchers for one model's tokenizer.

    Args:
        tokenizer: the model's Hugging Face tokenizer (its vocabulary is what the grammar's
            token masks are built over).
        vocab_size: the model's vocabulary size (the logits' width; may exceed the
            tokenizer's, and ids past it are never allowed).
        eos_token_ids: the ids that end a grammar once it is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                 cache_bytes: int = DEFAULT_CACHE_BYTES, cache_entries: int = DEFAULT_CACHE_ENTRIES,
                 compile_processes: int = DEFAULT_COMPILE_PROCESSES, fast_compile_s: float = FAST_COMPILE_S,
                 compile_threads: int = DEFAULT_COMPILE_THREADS) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_bytes = cache_bytes
        self.cache_entries = cache_entries
        self.compile_worker = CompileWorker(self._tokenizer_info, compile_processes, fast_compile_s, compile_threads)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, _CacheEntry] = OrderedDict()
        self._cached_bytes = 0
        self._batch_matcher: Any = None
        # Matchers held by live requests (released on finish or abort).
        self.num_active_matchers = 0

    @property
    def compile_times(self) -> Sequence[float]:
        """Seconds each compile took, newest last (the last 1024): for logs and benchmarks."""
        return self.compile_worker.compile_times

    # ------------------------------------------------------------------ compiling
    def compile(self, params: StructuredOutputsParams) -> Future:
        """The future of the constraint's compiled grammar: cached, in flight, or submitted now."""
        key = params.cache_key()
        with self._lock:
            entry = self._cache.get(key)
            # A failure to forget may still be here: a future wakes its waiters before it runs
            # its callbacks (_on_compiled, which drops the entry), so whoever saw it fail can
            # ask again first. It compiles again all the same.
            if entry is not None and not _is_forgotten(entry.future):
                self._cache.move_to_end(key)
                return entry.future
            future = self.compile_worker.submit(params)
            self._cache[key] = _CacheEntry(future, time.monotonic())
            self._cache.move_to_end(key)  # in place of a failure not dropped yet
            self._evict()
        # Outside the lock: a compile already done runs the callback here, at once.
        future.add_done_callback(lambda done: self._on_compiled(key, done))
        return future

    def wait_compiled(self, params: StructuredOutputsParams, timeout_s: float | None = None) -> Any:
        """Blocks until the constraint's grammar is compiled; raises StructuredOutputsError
        if it does not compile, or is not compiled `timeout_s` seconds after it was first
        asked for."""
        future = self.compile(params)
        if future.done():
            return future.result()
        try:
            return future.result(self.remaining_s(params, timeout_s))
        except FutureTimeoutError:
            raise self.deadline_passed(params, timeout_s) from None

    def remaining_s(self, params: StructuredOutputsParams, timeout_s: float | None) -> float | None:
        """What is left of `timeout_s` for the constraint's compile, counted from when it was
        first submitted (a second request for a stuck schema waits no longer than the first)."""
        if timeout_s is None:
            return None
        with self._lock:
            entry = self._cache.get(params.cache_key())
        started = entry.submitted if entry is not None else time.monotonic()
        return max(0.0, timeout_s - (time.monotonic() - started))

    def deadline_passed(self, params: StructuredOutputsParams, timeout_s: float | None) -> StructuredOutputsError:
        """The error of a constraint not compiled by its deadline. Its compile is cancelled,
        queued or running (its process is killed), and forgotten: every waiter's deadline
        counts from the same first ask, so nobody is left to use it, and a flood of slow
        grammars, each answered 400, holds no CPU past its deadline. Sent again, the
        constraint compiles again, and is refused again at its deadline."""
        key = params.cache_key()
        with self._lock:
            entry = self._cache.get(key)
        # Outside the lock: cancelling runs the future's callbacks (_on_compiled takes it).
        if entry is not None and entry.future.cancel():
            with self._lock:
                if self._cache.get(key) is entry:
                    del self._cache[key]
        return StructuredOutputsError(
            f"{params.source}: the {KIND_NAMES[params.kind]} did not compile within {timeout_s:g} s "
            f"(the server's --max-grammar-compile-seconds); simplify it.", params.source)

    def start_warm_up(self) -> Future:
        """Starts the compile worker now (it imports xgrammar and indexes the vocabulary), so
        that the first request's compile deadline does not pay for it (the server calls this)."""
        return self.compile_worker.start()

    def _tokenizer_info(self) -> Any:
        """xgrammar's index of the model's vocabulary (the compile worker builds it on first use)."""
        import xgrammar as xgr

        return xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.eos_token_ids or None)

    def _on_compiled(self, key: str, future: Future) -> None:
        forgotten = _is_forgotten(future)
        grammar = None if forgotten or future.exception() is not None else future.result()
        with self._lock:
            entry = self._cache.get(key)
            if entry is None or entry.future is not future:
                return
            if forgotten:
                del self._cache[key]  # its waiters have the future; later requests compile again
                return
            entry.nbytes = grammar.memory_size_bytes if grammar is not None else 0
            self._cached_bytes += entry.nbytes
            self._evict()

    def _evict(self) -> None:
        """Drops the least recently used finished entries while the cache is over its bounds
        (entries in flight stay: requests wait on them)."""
        for key in list(self._cache):
            if self._cached_bytes <= self.cache_bytes and len(self._cache) <= self.cache_entries:
                return
            entry = self._cache[key]
            if entry.future.done():
                del self._cache[key]
                self._cached_bytes -= entry.nbytes

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    # ------------------------------------------------------------------ requests
    def new_request(self, params: StructuredOutputsParams,
                    allowed_token_ids: list[int] | None = None) -> StructuredOutputRequest:
        """The per-request state: the grammar's future now, a matcher once it is ready.
        allowed_token_ids: the request's own mask, which the bitmask must meet."""
        return StructuredOutputRequest(self, params, self.compile(params), allowed_token_ids)

    def grammar_bitmask(self, requests: list[StructuredOutputRequest]) -> np.ndarray:
        """The next-token bitmask of each request, one row each: int32 [len, ceil(V / 32)],
        bit j of a row set where token j is allowed (xgrammar's layout)."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(requests), self.vocab_size)
        if self._batch_matcher is None:
            self._batch_matcher = xgr.BatchGrammarMatcher()
        # One call for the batch: its rows are filled in C++ (on several threads where the
        # machine has the cores), not a Python call each.
        self._batch_matcher.batch_fill_next_token_bitmask([request.matcher for request in requests], bitmask)
        words = bitmask.numpy()
        dead = ~words.any(axis=1)
        for row, request in enumerate(requests):
            allowed = request.allowed_token_ids
            if not dead[row] and (allowed is None or _any_bit_set(words[row], allowed)):
                continue
            # No token to sample: a row of -inf would sample NaN (or token 0 on a GPU). A
            # token the matcher refuses is let through instead (EOS, or with
            # allowed_token_ids, which the sampler applies after the bitmask, the first of
            # them), and the engine fails the request alone, naming the cause.
            request.dead_end = "grammar" if dead[row] else "allowed_token_ids"
            for token in self.eos_token_ids if allowed is None else (*self.eos_token_ids, allowed[0]):
                words[row, token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))
        return words

    def shutdown(self) -> None:
        """Cancels the compiles in flight and ends the compile worker and its processes."""
        self.compile_worker.shutdown()


def _is_forgotten(future: Future) -> bool:
    """Whether a compile settled in a way the cache forgets: cancelled (a deadline passed), or
    failed by its process's fate rather than the constraint's own fault."""
    if not future.done():
        return False
    return future.cancelled() or (future.exception() is not None
                                  and not _is_the_constraints_fault(future.exception()))


def _is_the_constraints_fault(error: BaseException | None) -> bool:
    """Whether a failed compile's error is the constraint's own (the compiler refused it), to
    be remembered, rather than its process's fate (a signal, the worker down, a cancel)."""
    return isinstance(error, StructuredOutputsError) and not isinstance(error, CompileCrashedError)


def _any_bit_set(words: np.ndarray, token_ids: list[int]) -> bool:
    """Whether a bitmask row (int32 words, xgrammar's layout) allows any of the token ids."""
    ids = np.asarray(token_ids, dtype=np.int64)
    ids = ids[ids < words.shape[0] * 32]
    return bool(((words.view(np.uint32)[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).any())
