"""The serving baseline: Hugging Face transformers behind a plain FastAPI server.

What a team writes before adopting an engine: one model, one lock, one request at a
time, greedy decoding with the KV cache, tokens streamed as they come. It speaks enough
of the completions API (token-id or text prompts, max_tokens, ignore_eos, stream,
stream_options.include_usage) for `raylm bench serving` to measure it like raylm.

    python -m raylm.cluster.benchmarks.hf_server MODEL_DIR --port 8001
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def build_app(model_dir: str, dtype: torch.dtype = torch.float32, model_name: str | None = None) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    eos_token_id = model.config.eos_token_id
    name = model_name or model_dir
    lock = asyncio.Lock()
    app = FastAPI()

    @torch.inference_mode()
    def generate(prompt_ids: list[int], max_tokens: int, ignore_eos: bool, emit: Any, cancelled: threading.Event
                 ) -> None:
        """Greedy decoding with the KV cache; `emit(token_id)` per token, `emit(None)` at the end."""
        try:
            input_ids = torch.tensor([prompt_ids])
            past = None
            for _ in range(max_tokens):
                if cancelled.is_set():
                    break
                out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = int(out.logits[0, -1].argmax())
                emit(token)
                if token == eos_token_id and not ignore_eos:
                    break
                input_ids = torch.tensor([[token]])
        finally:
            emit(None)

    # The first forward pass pays one-off initialisation (seconds): keep it out of the
    # first request's timings.
    generate([1, 2, 3], 2, True, lambda token: None, threading.Event())

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "hf"}]})

    @app.post("/v1/completions")
    async def completions(raw_request: Request) -> Any:
        body = await raw_request.json()
        prompt = body["prompt"]
        prompt_ids = list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)
        max_tokens = int(body.get("max_tokens") or 16)
        ignore_eos = bool(body.get("ignore_eos", False))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        loop = asyncio.get_running_loop()

        async def tokens():
            """Holds the lock for the whole request: one generation at a time."""
            async with lock:
                queue: asyncio.Queue = asyncio.Queue()
                cancelled = threading.Event()
                worker = loop.run_in_executor(None, generate, prompt_ids, max_tokens, ignore_eos,
                                              lambda t: loop.call_soon_threadsafe(queue.put_nowait, t), cancelled)
                try:
                    while (token := await queue.get()) is not None:
                        yield token
                finally:
                    cancelled.set()
                    await worker

        def chunk(text: str, finish_reason: str | None) -> str:
            return "data: " + json.dumps({"id": request_id, "object": "text_completion", "created": created,
                                          "model": name, "choices": [{"index": 0, "text": text,
                                                                      "finish_reason": finish_reason}]}) + "\n\n"

        if not body.get("stream"):
            ids = [t async for t in tokens()]
            return JSONResponse({"id": request_id, "object": "text_completion", "created": created, "model": name,
                                 "choices": [{"index": 0, "text": tokenizer.decode(ids),
                                              "finish_reason": "length" if len(ids) == max_tokens else "stop"}],
                                 "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                                           "total_tokens": len(prompt_ids) + len(ids)}})

        async def stream():
            count = 0
            async for token in tokens():
                count += 1
                finish = None if count < max_tokens and (token != eos_token_id or ignore_eos) else (
                    "length" if count == max_tokens else "stop")
                yield chunk(tokenizer.decode([token]), finish)
            if include_usage:
                yield "data: " + json.dumps({"id": request_id, "object": "text_completion", "created": created,
                                             "model": name, "choices": [],
                                             "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": count,
                                                       "total_tokens": len(prompt_ids) + count}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--served-model-name", default=None)
    args = parser.parse_args(argv)
    uvicorn.run(build_app(args.model, model_name=args.served_model_name), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
