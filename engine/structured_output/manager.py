"""`StructuredOutputManager`: compiles grammars off the engine step, caches them, and fills
each step's token bitmask.

Compiling a grammar takes from microseconds to seconds (a JSON schema's size and nesting
decide), so it never runs on the engine step or the event loop: `compile` hands it to a
small thread pool (xgrammar releases the GIL while it compiles) and returns a future. A
request whose grammar is not ready waits (`RequestStatus.WAITING_FOR_FSM`) while the batch
runs on; the server awaits the future, with a deadline, before it adds the request, so a
schema that does not compile, or compiles too slowly, is a 400.

Compiled grammars are kept in an LRU cache keyed by the constraint (`cache_key`), bounded
in bytes (xgrammar reports each grammar's size) and in entries; a compile in flight is
shared by every request that asks for the same constraint, and a failed one is
remembered, so a bad schema sent again fails at once.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any

import numpy as np

from raylm.engine.structured_output.params import StructuredOutputsError, StructuredOutputsParams, \
    is_legacy_structural_tag
from raylm.engine.structured_output.request import StructuredOutputRequest

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse. A JSON schema's grammar over a 128k vocabulary is a few
# MB (most of it the token-mask cache), over 4k tokens some tens of KB.
DEFAULT_CACHE_BYTES = 512 * 1024**2
DEFAULT_CACHE_ENTRIES = 4096
# Grammars compiling at once. Each holds a thread until it is done (a compile cannot be
# interrupted): the server's deadline answers the request, not the thread.
DEFAULT_COMPILE_THREADS = 2

# xgrammar's errors begin with a timestamp and a C++ source location; the rest is the message.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_KIND_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
               "json_object": "json_object", "structural_tag": "structural tag"}


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
                 compile_threads: int = DEFAULT_COMPILE_THREADS) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_bytes = cache_bytes
        self.cache_entries = cache_entries
        self._pool = CompilePool(compile_threads)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, _CacheEntry] = OrderedDict()
        self._cached_bytes = 0
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._batch_matcher: Any = None
        # Matchers held by live requests (released on finish or abort).
        self.num_active_matchers = 0
        # Seconds each compile took, newest last (the last 1024): for logs and benchmarks.
        self.compile_times: list[float] = []

    # ------------------------------------------------------------------ compiling
    def compile(self, params: StructuredOutputsParams) -> Future:
        """The future of the constraint's compiled grammar: cached, in flight, or submitted now."""
        key = params.cache_key()
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                return entry.future
            future = self._pool.submit(self._compile, params)
            self._cache[key] = _CacheEntry(future, time.monotonic())
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
        """The error of a constraint not compiled by its deadline. A compile still queued is
        cancelled and forgotten: every waiter's deadline counts from the same first ask, so
        nobody is left to use it, and run later it would only delay the compiles queued
        behind it (a flood of slow schemas, each answered 400, must not keep both threads
        busy long after). One already running cannot be stopped; it finishes and is cached."""
        key = params.cache_key()
        with self._lock:
            entry = self._cache.get(key)
        # Outside the lock: cancelling runs the future's callbacks (_on_compiled takes it).
        if entry is not None and entry.future.cancel():
            with self._lock:
                if self._cache.get(key) is entry:
                    del self._cache[key]
        return StructuredOutputsError(
            f"{params.source}: the {_KIND_NAMES[params.kind]} did not compile within {timeout_s:g} s "
            f"(the server's --max-grammar-compile-seconds); simplify it.", params.source)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler = self._get_compiler()
        start = time.perf_counter()
        try:
            grammar = _compile_with(compiler, params)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _XGRAMMAR_PREFIX.sub("", str(exc).strip())
            raise StructuredOutputsError(f"{params.source}: the {_KIND_NAMES[params.kind]} is not valid: {message}",
                                         params.source) from None
        elapsed = time.perf_counter() - start
        if not _allows_any_token(grammar, self.vocab_size):
            # A grammar with no finite sentence (`root ::= root "a"`, a schema that is its own
            # $ref): refused here, a 400 naming the field, rather than failing the request
            # after its KV blocks were allocated.
            raise StructuredOutputsError(f"{params.source}: the {_KIND_NAMES[params.kind]} allows no output at all "
                                         f"(no finite text matches it; is it infinitely recursive?).", params.source)
        with self._lock:
            self.compile_times.append(elapsed)
            del self.compile_times[:-1024]
        if elapsed > 1.0:
            logger.info("Compiling a %s took %.1f s.", _KIND_NAMES[params.kind], elapsed)
        return grammar

    def start_warm_up(self) -> Future:
        """Imports xgrammar and indexes the vocabulary now, in a compile thread, so that the
        first request's compile deadline does not pay for them (the server calls this)."""
        return self._pool.submit(self._get_compiler)

    def _get_compiler(self) -> Any:
        """xgrammar's compiler over the model's vocabulary, built on first use (importing
        xgrammar and indexing a large vocabulary take a while)."""
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_token_ids or None)
                # The cache is ours (bounded, shared futures); xgrammar's would hold a second copy.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _on_compiled(self, key: str, future: Future) -> None:
        grammar = None if future.cancelled() or future.exception() is not None else future.result()
        with self._lock:
            entry = self._cache.get(key)
            if entry is None or entry.future is not future:
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
    def new_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """The per-request state: the grammar's future now, a matcher once it is ready."""
        return StructuredOutputRequest(self, params, self.compile(params))

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
        dead = np.flatnonzero(~words.any(axis=1))
        for row in dead.tolist():
            # No token allowed: a row of -inf would sample NaN. EOS is let through, which the
            # matcher then refuses, and the engine fails the request alone.
            requests[row].dead_end = True
            for token in self.eos_token_ids:
                words[row, token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))
        return words

    def shutdown(self) -> None:
        self._pool.shutdown()


class CompilePool:
    """A few daemon threads that run compiles. Daemon, unlike ThreadPoolExecutor's, which
    the interpreter joins at exit: a server shutting down must not wait for a compile it
    has already answered 400."""

    def __init__(self, num_threads: int) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"raylm-grammar-{i}", daemon=True)
                         for i in range(num_threads)]
        self._started = False
        self._lock = threading.Lock()
        self._shutdown = False

    @property
    def num_threads(self) -> int:
        return len(self._threads)

    def submit(self, function: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._shutdown:
                future.cancel()
                future.set_running_or_notify_cancel()
                return future
            if not self._started:
                for thread in self._threads:
                    thread.start()
                self._started = True
        self._queue.put((future, function, args))
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, function, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Cancels the compiles not started; running ones finish in their daemon threads."""
        with self._lock:
            self._shutdown = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._queue.put(None)


def _allows_any_token(grammar: Any, vocab_size: int) -> bool:
    """Whether the grammar's first token may be anything at all (EOS counts)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(grammar).fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


def _compile_with(compiler: Any, params: StructuredOutputsParams) -> Any:
    kind = params.kind
    any_whitespace = not params.disable_any_whitespace
    whitespace = dict(any_whitespace=any_whitespace,
                      max_whitespace_cnt=params.max_whitespace if any_whitespace else None)
    if kind == "json":
        return _compile_json_schema(compiler, params.json, **whitespace)
    if kind == "json_object":
        # Any object: not strict, or the schema's lack of properties would allow only {}.
        return _compile_json_schema(compiler, {"type": "object"}, strict_mode=False, **whitespace)
    if kind == "regex":
        return compiler.compile_regex(params.regex)
    if kind == "choice":
        # Each choice as an EBNF string literal: JSON's escapes are EBNF's.
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                 for c in params.choice))
    if kind == "grammar":
        # vLLM takes EBNF (GBNF) or Lark; EBNF rules are written `name ::= ...`.
        if "::=" in params.grammar:
            return compiler.compile_grammar(params.grammar)
        return compiler.compile_lark(params.grammar)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(_structural_tag(params))
    raise AssertionError(kind)


def _structural_tag(params: StructuredOutputsParams) -> Any:
    """The structural tag as xgrammar compiles it. The legacy form (vLLM's `structures` and
    `triggers`) goes through xgrammar's own conversion, and its schemas get the request's
    whitespace bound, as every other JSON schema does (the conversion sets none; a tag's
    content has no counterpart of disable_any_whitespace)."""
    if not is_legacy_structural_tag(params.structural_tag):
        return json.dumps(params.structural_tag)
    import xgrammar as xgr

    items = [xgr.StructuralTagItem(begin=structure["begin"], schema=json.dumps(structure["schema"]),
                                   end=structure["end"]) for structure in params.structural_tag["structures"]]
    tag = xgr.StructuralTag.from_legacy_structural_tag(items, params.structural_tag["triggers"])
    for tag_format in tag.format.tags:
        tag_format.content.max_whitespace_cnt = params.max_whitespace
    return tag


# How xgrammar 0.2.8 writes a character of a string with minLength or maxLength (printed
# EBNF), and JSON's string character: it leaves U+0000-U+001F in, which JSON allows only
# escaped, so a length-bounded string could hold a raw control character (invalid JSON;
# strings without a length bound, and patterns, exclude them).
_LENGTH_BOUNDED_CHARACTER = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHARACTER = '[^\\0-\\x1f\\"\\\\]'


def _compile_json_schema(compiler: Any, schema: Any, **options: Any) -> Any:
    """A JSON schema's grammar; one with length-bounded strings goes through its EBNF with
    their character class mended (see _LENGTH_BOUNDED_CHARACTER)."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), **options)
    ebnf = str(grammar)
    if _LENGTH_BOUNDED_CHARACTER not in ebnf:
        return compiler.compile_grammar(grammar)
    return compiler.compile_grammar(ebnf.replace(_LENGTH_BOUNDED_CHARACTER, _JSON_STRING_CHARACTER))
