"""`LoRALoader`: the driver's account of the LoRA adapters in the workers' host memory.

An adapter is checked on the driver when the engine first meets it (`check`: its
adapter_config.json and safetensors header against the base model; a bad adapter is a
ValueError before any request is queued). Its weights are then loaded into every worker's
host memory by a thread of the loader's own (`Executor.add_lora`), off the engine step: the
scheduler admits the adapter's requests once it is loaded (`is_ready`). At most
max_cpu_loras adapters stay loaded; to load another, the least recently used one that no
running request uses is dropped (`Executor.remove_lora`), and read again if it is needed
again. A load that fails is reported (`take_failures`) so that the engine fails the
adapter's waiting requests instead of leaving them waiting.

The check records the digest of the adapter's files (`AdapterDigest`); each request carries
it, and every read of the adapter on the workers, however much later, must find those bytes
(see executors/lora_adapter.py). An adapter whose load failed stays known under its id, so
that the next check reads its files again against that digest, never afresh.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raylm.engine.config import LoRAConfig
from raylm.engine.lora_request import LoRARequest

if TYPE_CHECKING:
    from raylm.executors.lora_adapter import AdapterDigest, LoRAAdapterError

logger = logging.getLogger(__name__)

# How often a load waiting for room in host memory (every loaded adapter in use) looks again.
_ROOM_POLL_S = 0.05


@dataclass
class _KnownAdapter:
    lora_request: LoRARequest
    # What the check read: every read of the adapter must find these bytes.
    digest: AdapterDigest
    # Its last load failed: the next check reads its files again (against the digest).
    recheck: bool = False
    # The last re-check's failure, with what the folder's files looked like then (`_stat_key`)
    # and the allowed folders: a request naming the adapter gets the same error without its
    # weights hashed again on the step thread, until the files change or it is added again.
    failed_check: tuple[tuple, LoRAAdapterError] | None = None


def _stat_key(lora_path: str) -> tuple:
    """What the adapter's folder and files look like to lstat (device, inode, size, change
    times; None for one missing): any write, rename, deletion or replacement changes it."""
    from raylm.executors.lora_adapter import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE

    key = []
    for path in (lora_path, os.path.join(lora_path, ADAPTER_CONFIG_FILE),
                 os.path.join(lora_path, ADAPTER_WEIGHTS_FILE)):
        try:
            st = os.lstat(path)
        except (OSError, ValueError):
            key.append(None)
        else:
            key.append((st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(key)


class LoRALoader:
    def __init__(self, lora_config: LoRAConfig, hf_config: Any, executor: Any) -> None:
        self.lora_config = lora_config
        self.hf_config = hf_config
        self.executor = executor
        # Whether a running request uses the adapter (set by the engine: the slots know).
        self.in_use: Callable[[int], bool] = lambda lora_int_id: False
        self._cond = threading.Condition()
        # Adapters checked by `check`, by id, until `remove`.
        self._known: dict[int, _KnownAdapter] = {}
        # Loaded in the workers' host memory (with the digest read), least recently used first.
        self._loaded: OrderedDict[int, tuple[LoRARequest, AdapterDigest]] = OrderedDict()
        # Queued or being loaded, with the future a synchronous `load` waits on.
        self._loading: dict[int, concurrent.futures.Future] = {}
        self._queue: deque[tuple[LoRARequest, AdapterDigest]] = deque()
        self._failures: dict[int, BaseException] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- what the engine asks ------------------------------------------------------------------
    def check(self, lora_request: LoRARequest, allowed_dirs: Sequence[str] | None = None,
              fresh: bool = False) -> AdapterDigest:
        """Raises ValueError (LoRAAdapterError for the adapter itself) unless the engine can
        serve the adapter: read from its config and files once per adapter (again after a
        failed load). Returns the digest its reads must match. `allowed_dirs`: folders the
        adapter's files must really be in (the server's runtime loads). A re-check that
        failed is answered from memory while the files' stat is unchanged, unless `fresh`
        (the adapter added again)."""
        from raylm.executors.lora_adapter import LoRAAdapterError, inspect_adapter

        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}.")
        known = self._known_as(lora_request)
        if known is not None and not known.recheck:
            return known.digest
        verdict_key = (_stat_key(lora_request.lora_path), tuple(allowed_dirs or ()))
        failed = known.failed_check if known is not None else None
        if failed is not None and not fresh and failed[0] == verdict_key:
            raise failed[1].with_traceback(None)
        try:
            summary = inspect_adapter(lora_request.lora_name, lora_request.lora_path, self.hf_config,
                                      self.lora_config.max_lora_rank, expected=known.digest if known else None,
                                      allowed_dirs=allowed_dirs)
        except LoRAAdapterError as exc:
            if known is not None:
                with self._cond:
                    known.failed_check = (verdict_key, exc)
            raise
        with self._cond:
            known = self._known.setdefault(lora_request.lora_int_id, _KnownAdapter(lora_request, summary.digest))
            if known.lora_request == lora_request and known.digest == summary.digest:
                known.recheck = False
                known.failed_check = None
        return self._known_as(lora_request).digest

    def _known_as(self, lora_request: LoRARequest) -> _KnownAdapter | None:
        """What the engine knows under the request's id: None, or this adapter (one id names
        one adapter)."""
        with self._cond:
            known = self._known.get(lora_request.lora_int_id)
        if known is not None and known.lora_request != lora_request:
            other = known.lora_request
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} already names LoRA adapter {other.lora_name!r} "
                             f"at {other.lora_path!r}; got {lora_request.lora_name!r} at {lora_request.lora_path!r}. "
                             f"Give each adapter its own lora_int_id (or remove_lora the other first).")
        return known

    def is_ready(self, lora_request: LoRARequest, digest: AdapterDigest) -> bool:
        """Whether the adapter (as `check` read it) is loaded on the workers; if not, its load
        is queued."""
        lora_int_id = lora_request.lora_int_id
        with self._cond:
            if self._loaded.get(lora_int_id) == (lora_request, digest):
                return True
            if lora_int_id not in self._loading:
                self._enqueue(lora_request, digest)
            return False

    def touch(self, lora_int_id: int) -> None:
        """Marks the adapter as just used (a request of it was admitted)."""
        with self._cond:
            if lora_int_id in self._loaded:
                self._loaded.move_to_end(lora_int_id)

    def load(self, lora_request: LoRARequest, timeout: float | None = None,
             allowed_dirs: Sequence[str] | None = None) -> None:
        """Checks and loads the adapter now (from any thread but the step's); raises what a
        load raises. vLLM's `add_lora`."""
        digest = self.check(lora_request, allowed_dirs)
        with self._cond:
            if self._loaded.get(lora_request.lora_int_id) == (lora_request, digest):
                self._loaded.move_to_end(lora_request.lora_int_id)
                return
            future = self._loading.get(lora_request.lora_int_id) or self._enqueue(lora_request, digest)
        future.result(timeout)

    def unreadable(self, lora_int_id: int, digest: AdapterDigest | None = None) -> None:
        """A step could not read the adapter (with these files' digest) into a slot (the
        workers dropped it): it is not loaded any more, and the next check reads its files
        again, unless the engine now knows the id with other files."""
        with self._cond:
            self._loaded.pop(lora_int_id, None)
            known = self._known.get(lora_int_id)
            if known is not None and (digest is None or known.digest == digest):
                known.recheck = True

    def remove(self, lora_int_id: int) -> bool:
        """Forgets the adapter and drops it from the workers' host memory (a running request of
        it keeps its slot until it ends). Returns whether the engine knew it."""
        with self._cond:
            known = self._known.pop(lora_int_id, None) is not None
            loaded = self._loaded.pop(lora_int_id, None) is not None
        if loaded:
            self.executor.remove_lora(lora_int_id)
        return known or loaded

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded in host memory, least recently used first."""
        with self._cond:
            return [lora_request for lora_request, _ in self._loaded.values()]

    def take_failures(self) -> dict[int, BaseException]:
        """The adapters whose background load failed since the last call, with the error."""
        with self._cond:
            failures, self._failures = self._failures, {}
        return failures

    def wait_for_progress(self, timeout: float) -> None:
        """Waits up to `timeout` seconds for a load to end (the engine has nothing else to run)."""
        with self._cond:
            if self._loading:
                self._cond.wait(timeout)

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            for future in self._loading.values():
                future.cancel()
            self._cond.notify_all()

    # ---- the loading thread --------------------------------------------------------------------
    def _enqueue(self, lora_request: LoRARequest, digest: AdapterDigest) -> concurrent.futures.Future:
        """Queues a load (the lock is held)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._loading[lora_request.lora_int_id] = future
        self._queue.append((lora_request, digest))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="raylm-lora-loader", daemon=True)
            self._thread.start()
        self._cond.notify_all()
        return future

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                lora_request, digest = self._queue.popleft()
            try:
                self._make_room()
                self.executor.add_lora(lora_request, digest)
            except BaseException as exc:  # noqa: BLE001 - reported to the requests waiting for it
                self._finish(lora_request, digest, exc)
            else:
                self._finish(lora_request, digest, None)

    def _make_room(self) -> None:
        """Drops least recently used adapters nobody runs until one more fits in host memory;
        waits while every loaded adapter is in use."""
        while True:
            with self._cond:
                if self._stopping:
                    raise RuntimeError("The engine is shutting down.")
                if len(self._loaded) < self.lora_config.max_cpu_loras:
                    return
                victim = next((i for i in self._loaded if not self.in_use(i)), None)
                if victim is None:
                    self._cond.wait(_ROOM_POLL_S)
                    continue
                del self._loaded[victim]
            logger.info("LoRA: dropping adapter %d from host memory (max_cpu_loras=%d).", victim,
                        self.lora_config.max_cpu_loras)
            self.executor.remove_lora(victim)

    def _finish(self, lora_request: LoRARequest, digest: AdapterDigest, error: BaseException | None) -> None:
        with self._cond:
            future = self._loading.pop(lora_request.lora_int_id)
            if error is None:
                self._loaded[lora_request.lora_int_id] = (lora_request, digest)
            else:
                logger.warning("LoRA adapter %r failed to load: %s", lora_request.lora_name, error)
                self._failures[lora_request.lora_int_id] = error
                known = self._known.get(lora_request.lora_int_id)
                if known is not None:
                    known.recheck = True
            self._cond.notify_all()
        if error is None:
            future.set_result(None)
        elif not future.cancelled():
            future.set_exception(error)
