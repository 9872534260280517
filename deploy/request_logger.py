"""`RequestLogger`: one log line per engine request as it arrives (`--enable-log-requests`).

As vLLM's request logger: the request's id, its prompt and prompt token ids (each cut to
`--max-log-len` characters / ids), its sampling parameters and its LoRA adapter. Nothing
from the HTTP request beyond that is logged (no headers, so never an API key). The server
builds one only when the setting is on, so a server that does not log pays one `is None`
test per request.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class RequestLogger:
    """Logs requests at INFO, their prompts cut to `max_log_len` (None: whole)."""

    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len

    def log_inputs(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None, params: Any,
                   lora_request: Any = None) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        if self.max_log_len is not None:
            prompt = prompt[:self.max_log_len] if prompt is not None else None
            prompt_token_ids = prompt_token_ids[:self.max_log_len] if prompt_token_ids is not None else None
        lora = getattr(lora_request, "lora_name", None)
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora_request: %s.",
                    request_id, prompt, params, prompt_token_ids, lora)
