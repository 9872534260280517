"""`PoolingServing`: what the routes of a pooling engine share (/v1/embeddings, /classify,
/score, /rerank, /pooling): the model-kind check, bounds on inputs before they are tokenized, the
checks on token ids, and running a batch of pooling requests to their outputs.

Every size a request can ask for is bounded before anything is allocated: the number of
inputs (--max-prompts-per-request) and each text's characters (--max-prompt-chars) before
tokenizing; each prompt's tokens (max_model_len, or cut by truncate_prompt_tokens) before
it reaches the engine. The body itself is bounded by the app (--max-request-body-bytes).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from raylm.deploy.errors import OpenAIError
from raylm.deploy.serving_engine import OpenAIServing, merge_async_iterators
from raylm.engine.outputs import PoolingRequestOutput
from raylm.engine.pooling_params import PoolingParams

# What each pooling task's routes are called in messages.
_TASK_APIS = {"embed": "Embeddings API (/v1/embeddings)", "classify": "Classification API (/classify)",
              "score": "Score API (/score, /rerank)", "token_classify": "Pooling API (/pooling)"}


class PoolingServing(OpenAIServing):
    def check_task(self, task: str) -> None:
        """A 400 naming `model` unless this server's model serves the pooling task `task`
        (vLLM's statuses: the route exists, the model does not support it)."""
        model_config = self.engine.model_config
        if not model_config.is_pooling:
            raise OpenAIError(f"This model does not serve the {_TASK_APIS[task]}: it generates. Start the server on a "
                              f"pooling model (--runner pooling, or a sequence classifier with --runner auto).",
                              param="model")
        if task not in model_config.supported_pooling_tasks:
            served = ", ".join(_TASK_APIS[t] for t in model_config.supported_pooling_tasks)
            extra = (" (it is only enabled for classifiers with num_labels == 1, and for embedding models)"
                     if task == "score" and model_config.pooling_task == "classify" else "")
            raise OpenAIError(f"This model does not serve the {_TASK_APIS[task]}{extra}; it serves the {served}.",
                              param="model")

    def check_limits(self, inputs: list[str | list[int]], param: str = "input") -> None:
        """The number of inputs and each text's size, before anything is tokenized."""
        self.limits.check_num_prompts(len(inputs), param=param)
        for item in inputs:
            if isinstance(item, str):
                self.limits.check_prompt_chars(len(item), self.max_model_len, param=param)

    def pooling_params(self, **fields: Any) -> PoolingParams:
        """PoolingParams of `fields`; a value out of range (or truncate_prompt_tokens past
        the context, or dimensions the model cannot give) is a 400 naming its field."""
        try:
            params = PoolingParams(**fields)
            params.truncate([], self.max_model_len)  # truncate_prompt_tokens within the context
            hf_config = self.engine.model_config.hf_config
            params.verify(hf_config, hf_config.hidden_size)
        except ValueError as exc:
            raise OpenAIError(str(exc), param=getattr(exc, "param", None)) from None
        return params

    def check_tokens(self, token_ids: list[int], param: str = "input") -> list[int]:
        """An input's tokens as pooled: within the context and the vocabulary."""
        if len(token_ids) > self.max_model_len:
            raise OpenAIError(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                              f"input has {len(token_ids)} tokens. Please reduce the length of the input, or set "
                              f"truncate_prompt_tokens.", param=param)
        if not token_ids:
            raise OpenAIError("An input has no tokens: each must have at least one.", param=param)
        vocab_size = self.engine.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise OpenAIError(f"{param} token id {bad} is outside the vocabulary [0, {vocab_size}).", param=param)
        return token_ids

    def tokenize_all(self, inputs: list[str | list[int]], add_special_tokens: bool,
                     param: str = "input") -> list[list[int]]:
        """Each input's token ids (call on the tokenizer thread)."""
        return [self.tokenize(item, add_special_tokens, param=param) if isinstance(item, str) else list(item)
                for item in inputs]

    async def prompts_of(self, inputs: list[str | list[int]], params: PoolingParams, add_special_tokens: bool,
                         param: str = "input") -> list[dict[str, Any]]:
        """The engine prompts of `inputs`: tokenized (off the event loop), cut as `params`
        say, checked."""
        token_ids_list = await self.off_loop(self.tokenize_all, inputs, add_special_tokens, param)
        prompts = []
        for item, token_ids in zip(inputs, token_ids_list):
            token_ids = self.check_tokens(params.truncate(token_ids, self.max_model_len), param)
            prompts.append({"prompt": item, "prompt_token_ids": token_ids} if isinstance(item, str)
                           else {"prompt_token_ids": token_ids})
        return prompts

    async def run_pooling(self, request_id: str, prompts: list[dict[str, Any]], params: PoolingParams,
                          model_name: str, priority: int, raw_request: Request) -> list[PoolingRequestOutput]:
        """Each prompt's finished output, in order; the client leaving aborts them all."""
        streams = await self.add_requests(request_id, prompts, [params] * len(prompts),
                                          self.lora_request(model_name), priority)
        finals: list[PoolingRequestOutput | None] = [None] * len(streams)
        async for index, output in merge_async_iterators(streams, raw_request.is_disconnected):
            finals[index] = output
        assert all(output is not None and output.finished for output in finals)
        return finals  # type: ignore[return-value]
