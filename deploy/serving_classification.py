"""`POST /classify`: vLLM's classification route over a sequence classifier.

Each input (a text or token ids) is one pooling request of task "classify"; the response
lists, in input order, its class probabilities (the classifier's logits through its
activation, or the logits with use_activation false), their count, and the label
config.json's id2label gives the most probable class. Bounds as on every pooling route
(deploy/serving_pooling.py).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from raylm.deploy.protocol import (ClassificationData, ClassificationRequest, ClassificationResponse, UsageInfo,
                                   random_id)
from raylm.deploy.serving_pooling import PoolingServing


class OpenAIServingClassification(PoolingServing):
    async def create_classify(self, request: ClassificationRequest, raw_request: Request) -> Response:
        model_name = self.check_model(request.model)
        self.check_task("classify")
        self.check_priority(request)
        inputs = request.inputs()
        self.check_limits(inputs)
        params = self.pooling_params(truncate_prompt_tokens=request.truncate_prompt_tokens,
                                     use_activation=request.use_activation, task="classify")
        prompts = await self.prompts_of(inputs, params, request.add_special_tokens)
        request_id = random_id("classify")
        created = int(time.time())
        finals = await self.run_pooling(request_id, prompts, params, model_name, request.priority, raw_request)
        id2label = getattr(self.engine.model_config.hf_config, "id2label", None) or {}
        data = []
        for index, output in enumerate(finals):
            probs = output.outputs.data.tolist()
            data.append(ClassificationData(index=index, label=_label(id2label, probs), probs=probs,
                                           num_classes=len(probs)))
        prompt_tokens = sum(len(output.prompt_token_ids) for output in finals)
        usage = UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens, completion_tokens=0)
        return JSONResponse(ClassificationResponse(id=request_id, created=created, model=model_name, data=data,
                                                   usage=usage).model_dump())


def _label(id2label: dict[Any, str], probs: list[float]) -> str | None:
    """The name config.json's id2label gives the most probable class (keys may be ints or,
    as JSON leaves them, strings)."""
    best = max(range(len(probs)), key=probs.__getitem__)
    return id2label.get(best, id2label.get(str(best)))
