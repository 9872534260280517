"""`POST /pooling`: vLLM's pooling route, each input's raw pooling output for a task.

Each input (a text or token ids) is one pooling request of the request's `task` (None: the
model's own): "embed" an embedding model's vector, "classify" a classifier's class
probabilities, "token_classify" a classifier's head at every prompt token (what
`LLM.reward` returns: a reward model's per-token rewards), each as vLLM's `data` of
`{"index", "object": "pooling", "data"}`. A task the model does not serve is a 400 naming
`task`; the bounds are every pooling route's (deploy/serving_pooling.py).
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from raylm.deploy.errors import OpenAIError
from raylm.deploy.protocol import PoolingRequest, PoolingResponse, PoolingResponseData, UsageInfo, random_id
from raylm.deploy.serving_pooling import PoolingServing


class OpenAIServingPooling(PoolingServing):
    async def create_pooling(self, request: PoolingRequest, raw_request: Request) -> Response:
        model_name = self.check_model(request.model)
        model_config = self.engine.model_config
        task = request.task or model_config.pooling_task or "embed"
        if not model_config.is_pooling:
            self.check_task(task)  # a 400: the model generates
        if task not in model_config.supported_pooling_tasks:
            served = ", ".join(map(repr, model_config.supported_pooling_tasks))
            raise OpenAIError(f"task {task!r} is not served by this model; it serves {served}.", param="task")
        self.check_priority(request)
        inputs = request.inputs()
        self.check_limits(inputs)
        fields = dict(truncate_prompt_tokens=request.truncate_prompt_tokens, task=task)
        for name in ("use_activation", "dimensions", "normalize"):
            if getattr(request, name) is not None:
                fields[name] = getattr(request, name)
        params = self.pooling_params(**fields)
        try:
            params.clone().resolve_task(task, self.engine.model_config.supported_pooling_tasks)
        except ValueError as exc:  # a field the task does not read
            raise OpenAIError(str(exc), param=getattr(exc, "param", None)) from None
        prompts = await self.prompts_of(inputs, params, request.add_special_tokens)
        request_id = random_id("pool")
        created = int(time.time())
        finals = await self.run_pooling(request_id, prompts, params, model_name, request.priority, raw_request)
        data = [PoolingResponseData(index=index, data=output.outputs.data.tolist())
                for index, output in enumerate(finals)]
        prompt_tokens = sum(len(output.prompt_token_ids) for output in finals)
        usage = UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens, completion_tokens=0)
        return JSONResponse(PoolingResponse(id=request_id, created=created, model=model_name, data=data,
                                            usage=usage).model_dump())
