"""`ResponseBudget`: the tokens the responses in flight may hold together.

--max-response-tokens bounds what one request's response holds (its tokens, logprobs and
prompt copies, `RequestLimits.check_response_size`), and up to --max-concurrent-requests
requests are in flight: 1024 x 2^22 tokens at some 512 bytes each is 2 TiB, which no
process holds. Each request reserves its count before it reaches the engine and gives it
back once its response is sent, it fails, or its client leaves; a request that does not
fit beside the others is answered 429 with Retry-After, as overload is, and may succeed
once some finish. A streamed response holds as much when its client reads slowly (the
outputs wait in its queue), so streams reserve too.

The default budget, where --max-response-tokens-in-flight is not given, is a quarter of
the memory the process may use (the machine's, or its cgroup's limit where lower) at
RESPONSE_TOKEN_BYTES a token, and never less than one request's --max-response-tokens.
"""

from __future__ import annotations

import os
from http import HTTPStatus
from pathlib import Path

from raylm.deploy.errors import OpenAIError
from raylm.deploy.limits import RESPONSE_TOKEN_BYTES

# The share of the process's memory the responses in flight may take by default: the rest
# is the model's (on CPU), the engine's, the KV cache's and Python's own.
MEMORY_SHARE = 0.25
# What a refused request's client is told to wait (Retry-After, seconds): a response ends
# and gives its tokens back every few seconds on a busy server.
RETRY_AFTER_S = 1


def memory_limit_bytes() -> int:
    """The memory this process may use: the machine's, or its memory cgroup's limit where
    lower (a container's; cgroup v2's memory.max, v1's memory.limit_in_bytes)."""
    limits = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    for path in _cgroup_limit_files():
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # v2 writes "max" for none; v1 a number near 2^63
            limits.append(int(text))
    return min(limits)


def _cgroup_limit_files() -> list[Path]:
    """The memory limit files of this process's cgroup (as /proc/self/cgroup names it) and
    of the cgroup root a container sees."""
    root = Path("/sys/fs/cgroup")
    files = [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return files
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "" and relative:
            files.append(root / relative / "memory.max")
        elif "memory" in controllers.split(",") and relative:
            files.append(root / "memory" / relative / "memory.limit_in_bytes")
    return files


def default_response_tokens_in_flight(max_response_tokens: int) -> int:
    """MEMORY_SHARE of the process's memory at RESPONSE_TOKEN_BYTES a token, and at least
    one request's worth."""
    return max(max_response_tokens, int(memory_limit_bytes() * MEMORY_SHARE) // RESPONSE_TOKEN_BYTES)


class ResponseBudget:
    """The tokens the responses in flight hold, against `limit`. One event loop updates it,
    so it needs no lock."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def reserve(self, tokens: int) -> "Reservation":
        """Takes `tokens` for a request, or answers it 429 if they do not fit beside the
        responses in flight (a request larger than the whole budget was refused before, by
        --max-response-tokens, which is never more)."""
        if self.held + tokens > self.limit:
            raise OpenAIError(f"The server is busy: the responses in flight hold {self.held:,} of the {self.limit:,} "
                              f"tokens they may hold together (--max-response-tokens-in-flight), and this request "
                              f"asks for {tokens:,}. Retry later.", HTTPStatus.TOO_MANY_REQUESTS,
                              headers={"Retry-After": str(RETRY_AFTER_S)})
        self.held += tokens
        return Reservation(self, tokens)


class Reservation:
    """A request's share of the budget, given back once by `release`; as a context manager,
    at the end of the block unless `keep` handed it on (to a stream, which releases it when
    it ends)."""

    def __init__(self, budget: ResponseBudget, tokens: int) -> None:
        self._budget = budget
        self.tokens = tokens
        self._released = False
        self._kept = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._budget.held -= self.tokens

    def keep(self) -> "Reservation":
        self._kept = True
        return self

    def __enter__(self) -> "Reservation":
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._kept or exc_info[0] is not None:
            self.release()
