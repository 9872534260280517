"""`RequestLogger`: one log line per engine request as it arrives (`--enable-log-requests`)
and, with `--enable-log-outputs` too, one per choice as it finishes.

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
    """Logs requests at INFO, their prompts cut to `max_log_len` (None: whole), and with
    `log_outputs` their choices' generated text and token ids (cut the same way)."""

    def __init__(self, max_log_len: int | None = None, log_outputs: bool = False) -> None:
        self.max_log_len = max_log_len
        self.log_outputs = log_outputs

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

    def log_output(self, request_id: str, index: int, text: str, token_ids: list[int], finish_reason: str | None,
                   streamed: bool) -> None:
        """One finished choice: the text as the model wrote it (reasoning and tool-call markup
        included), its token ids and finish reason. A streamed choice is logged once, whole,
        when it finishes (vLLM's line marked "streaming complete"; vLLM also logs every delta)."""
        if not logger.isEnabledFor(logging.INFO):
            return
        if self.max_log_len is not None:
            text, token_ids = text[:self.max_log_len], token_ids[:self.max_log_len]
        logger.info("Generated response %s, choice %d%s: output: %r, output_token_ids: %s, finish_reason: %s.",
                    request_id, index, " (streaming complete)" if streamed else "", text, token_ids, finish_reason)
