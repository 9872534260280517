"""`POST /v1/embeddings`: OpenAI's embeddings route over a pooling engine (runner="pooling").

Each input (a string, token ids, or a list of either) is one pooling request; the response
lists their embeddings in input order, as floats or (encoding_format "base64") their
little-endian float32 bytes in base64, with the prompt tokens in usage. Sizes are bounded
like completions' prompts (deploy/limits.py) before anything is tokenized, and each
input's length is checked against max_model_len (or cut to its last
truncate_prompt_tokens) before it reaches the engine.
"""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from raylm.deploy.errors import OpenAIError
from raylm.deploy.protocol import (EmbeddingRequest, EmbeddingResponse, EmbeddingResponseData, UsageInfo,
                                   random_id)
from raylm.deploy.serving_engine import OpenAIServing, merge_async_iterators
from raylm.engine.outputs import PoolingRequestOutput
from raylm.engine.pooling_params import PoolingParams


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        model_name = self.check_model(request.model)
        if not self.engine.model_config.is_pooling:
            raise OpenAIError("This model does not serve the Embeddings API: start the server with --runner pooling "
                              "(vLLM's flag) to serve /v1/embeddings.", param="model")
        self.check_priority(request)
        inputs = request.inputs()
        self.check_limits(inputs)
        params = self.pooling_params(request)
        token_ids_list = await self.off_loop(self._tokenize_all, inputs, request.add_special_tokens)
        prompts = []
        for item, token_ids in zip(inputs, token_ids_list):
            token_ids = self.check_tokens(params.truncate(token_ids, self.max_model_len))
            prompts.append({"prompt": item, "prompt_token_ids": token_ids} if isinstance(item, str)
                           else {"prompt_token_ids": token_ids})
        request_id = random_id("embd")
        created = int(time.time())
        streams = await self.add_requests(request_id, prompts, [params] * len(prompts),
                                          self.lora_request(model_name), request.priority)
        finals: list[PoolingRequestOutput | None] = [None] * len(streams)
        async for index, output in merge_async_iterators(streams, raw_request.is_disconnected):
            finals[index] = output
        return JSONResponse(_response(request, request_id, created, model_name, finals).model_dump())

    def check_limits(self, inputs: list[str | list[int]]) -> None:
        """The number of inputs and each text's size, before anything is tokenized."""
        self.limits.check_num_prompts(len(inputs), param="input")
        for item in inputs:
            if isinstance(item, str):
                self.limits.check_prompt_chars(len(item), self.max_model_len, param="input")

    def pooling_params(self, request: EmbeddingRequest) -> PoolingParams:
        """The request's PoolingParams; a value the model cannot honour is a 400 naming it."""
        try:
            params = PoolingParams(truncate_prompt_tokens=request.truncate_prompt_tokens,
                                   dimensions=request.dimensions, normalize=request.normalize)
            params.truncate([], self.max_model_len)  # truncate_prompt_tokens within the context
            hf_config = self.engine.model_config.hf_config
            params.verify(hf_config, hf_config.hidden_size)
        except ValueError as exc:
            raise OpenAIError(str(exc), param=getattr(exc, "param", None)) from None
        return params

    def check_tokens(self, token_ids: list[int]) -> list[int]:
        """An input's tokens as pooled: within the context and the vocabulary."""
        if len(token_ids) > self.max_model_len:
            raise OpenAIError(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                              f"input has {len(token_ids)} tokens. Please reduce the length of the input, or set "
                              f"truncate_prompt_tokens.", param="input")
        if not token_ids:
            raise OpenAIError("An input has no tokens: each must have at least one.", param="input")
        vocab_size = self.engine.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise OpenAIError(f"input token id {bad} is outside the vocabulary [0, {vocab_size}).", param="input")
        return token_ids

    def _tokenize_all(self, inputs: list[str | list[int]], add_special_tokens: bool) -> list[list[int]]:
        """Each input's token ids (on the tokenizer thread)."""
        return [self.tokenize(item, add_special_tokens, param="input") if isinstance(item, str) else list(item)
                for item in inputs]


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
