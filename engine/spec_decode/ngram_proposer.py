"""The n-gram proposer (vLLM's "ngram", prompt lookup decoding), run on the driver.

For a request whose tokens end in t[L-n:L], find the latest earlier place where the same n
tokens occur and propose the tokens that followed them there, trying n from
prompt_lookup_max down to prompt_lookup_min. Code, documents quoted back and structured
output repeat themselves, so the continuation of an earlier occurrence is often right.

Each request's tokens are kept as bytes (4 per token) that grow with its output, so a
lookup is `bytearray.rfind`, a C substring search, instead of a Python loop over the
history: O(history) at C speed, a few microseconds for a 2k-token request.
"""

from __future__ import annotations

from array import array

_TOKEN_BYTES = 4


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        # request id -> the request's tokens so far, as int32 bytes.
        self._buffers: dict[str, bytearray] = {}

    def propose(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens that followed the longest (then latest) earlier match of
        the request's last tokens; [] when there is none. `token_ids` is the request's whole
        sequence (prompt then output), which only ever grows."""
        if num_tokens <= 0:
            return []
        buffer = self._buffer(request_id, token_ids)
        length = len(token_ids)
        for n in range(min(self.prompt_lookup_max, length - 1), self.prompt_lookup_min - 1, -1):
            start = _latest_match(buffer, length, n)
            if start is not None:
                follow = start + n  # the first token after the match, always < length
                return token_ids[follow:follow + num_tokens]
        return []

    def _buffer(self, request_id: str, token_ids: list[int]) -> bytearray:
        buffer = self._buffers.get(request_id)
        if buffer is None:
            buffer = self._buffers[request_id] = bytearray()
        known = len(buffer) // _TOKEN_BYTES
        if known < len(token_ids):
            buffer += array("i", token_ids[known:]).tobytes()
        return buffer

    def free(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)


def _latest_match(buffer: bytearray, length: int, n: int) -> int | None:
    """The token index of the latest occurrence of the last n tokens that ends before the
    last token (so that at least one token follows it), or None."""
    pattern = bytes(buffer[(length - n) * _TOKEN_BYTES:])
    end = (length - 1) * _TOKEN_BYTES
    while True:
        index = buffer.rfind(pattern, 0, end)
        if index < 0:
            return None
        if index % _TOKEN_BYTES == 0:
            return index // _TOKEN_BYTES
        # A match straddling token boundaries: look again to its left.
        end = index + len(pattern) - 1
