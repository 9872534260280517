"""`POST /v1/embeddings`: OpenAI's embeddings route over a pooling engine (runner="pooling").

Each input (a string, token ids, or a list of either) is one pooling request; the response
lists their embeddings in input order, as floats or (encoding_format "base64") their
little-endian float32 bytes in base64, with the prompt tokens in usage. Sizes are bounded
as on every pooling route (deploy/serving_pooling.py).
"""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from raylm.deploy.protocol import (EmbeddingRequest, EmbeddingResponse, EmbeddingResponseData, UsageInfo,
                                   random_id)
from raylm.deploy.serving_pooling import PoolingServing
from raylm.engine.outputs import PoolingRequestOutput


class OpenAIServingEmbedding(PoolingServing):
    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        model_name = self.check_model(request.model)
        self.check_task("embed")
        self.check_priority(request)
        inputs = request.inputs()
        self.check_limits(inputs)
        params = self.pooling_params(truncate_prompt_tokens=request.truncate_prompt_tokens,
                                     dimensions=request.dimensions, normalize=request.normalize, task="embed")
        prompts = await self.prompts_of(inputs, params, request.add_special_tokens)
        request_id = random_id("embd")
        created = int(time.time())
        finals = await self.run_pooling(request_id, prompts, params, model_name, request.priority, raw_request)
        return JSONResponse(_response(request, request_id, created, model_name, finals).model_dump())


def _response(request: EmbeddingRequest, request_id: str, created: int, model_name: str,
              finals: list[PoolingRequestOutput | None]) -> EmbeddingResponse:
    data = []
    prompt_tokens = 0
    for index, output in enumerate(finals):
        assert output is not None and output.finished
        prompt_tokens += len(output.prompt_token_ids)
        data.append(EmbeddingResponseData(index=index, embedding=encode_embedding(output.outputs.data,
                                                                                  request.encoding_format)))
    usage = UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens, completion_tokens=0)
    return EmbeddingResponse(id=request_id, created=created, model=model_name, data=data, usage=usage)


def encode_embedding(embedding, encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: a list of floats, or "base64" of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding.tolist()
