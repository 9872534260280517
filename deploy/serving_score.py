"""`POST /score` (`/v1/score`) and `/rerank` (`/v1/rerank`, `/v2/rerank`): vLLM's scoring
routes over a cross-encoder (a sequence classifier with one label) or an embedding model.

A cross-encoder reads each pair as one prompt (engine/scoring.py: the server's
--chat-template as vLLM's score template where given, else the tokenizer's text pair; cut
by truncate_prompt_tokens with the tokenizer's truncation) and scores it with its
activated logit; an embedding model embeds each text once (cut as /v1/embeddings cuts it)
and scores each pair with the cosine of its embeddings. /rerank scores the query against
each document and answers the documents best first, the top_n of them (0: all), with
their text unless return_documents is false. Bounds as on every pooling route
(deploy/serving_pooling.py): the texts on each side count as inputs.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from raylm.deploy.chat_template import ChatTemplateError, ChatTemplateRenderer
from raylm.deploy.errors import OpenAIError
from raylm.deploy.protocol import (RerankDocument, RerankRequest, RerankResponse, RerankResult, RerankUsage,
                                   ScoreRequest, ScoreResponse, ScoreResponseData, UsageInfo, random_id)
from raylm.deploy.serving_pooling import PoolingServing
from raylm.engine.scoring import cross_encoder_token_ids, embedding_scores, score_template_messages


class OpenAIServingScores(PoolingServing):
    def __init__(self, *args: Any, score_template: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # vLLM's score template: the server's --chat-template, which renders a cross-encoder's
        # pair (roles "query" and "document") into its prompt; None: the pair tokenized as is.
        self.score_template = score_template
        # Request texts are rendered within the bounds of the chat route's server template.
        self.renderer = ChatTemplateRenderer(self.limits.prompt_chars(self.max_model_len),
                                             self.limits.max_chat_template_steps,
                                             self.limits.max_chat_template_render_seconds)

    async def create_score(self, request: ScoreRequest, raw_request: Request) -> Response:
        texts_1, texts_2 = request.texts()
        model_name, scores, prompt_tokens = await self._score(request, texts_1, texts_2, ("text_1", "text_2"),
                                                              raw_request, "score")
        data = [ScoreResponseData(index=index, score=score) for index, score in enumerate(scores)]
        usage = UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens, completion_tokens=0)
        return JSONResponse(ScoreResponse(id=random_id("score"), created=int(time.time()), model=model_name,
                                          data=data, usage=usage).model_dump())

    async def create_rerank(self, request: RerankRequest, raw_request: Request) -> Response:
        model_name, scores, prompt_tokens = await self._score(request, [request.query], request.documents,
                                                              ("query", "documents"), raw_request, "rerank")
        results = [RerankResult(index=index, relevance_score=score,
                                document=RerankDocument(text=request.documents[index])
                                if request.return_documents else None)
                   for index, score in enumerate(scores)]
        results.sort(key=lambda result: result.relevance_score, reverse=True)
        if 0 < request.top_n < len(results):
            results = results[:request.top_n]
        response = RerankResponse(id=random_id("rerank"), model=model_name, results=results,
                                  usage=RerankUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens))
        return JSONResponse(response.model_dump(exclude_none=True))

    async def _score(self, request: ScoreRequest | RerankRequest, texts_1: list[str], texts_2: list[str],
                     field_names: tuple[str, str], raw_request: Request, id_prefix: str
                     ) -> tuple[str, list[float], int]:
        """(model name, one score per pair, prompt tokens) of the pairs of texts_1 (one, or
        one per text) and texts_2; `field_names` name the two fields in errors."""
        model_name = self.check_model(request.model)
        model_config = self.engine.model_config
        # An embedding model scores with cosines; any other is refused as the Score API's
        # (a classifier with several labels: the message says why).
        cross_encoder = model_config.pooling_task != "embed"
        self.check_task("score" if cross_encoder else "embed")
        self.check_priority(request)
        self.check_limits(texts_1, field_names[0])
        self.check_limits(texts_2, field_names[1])
        request_id = random_id(id_prefix)
        if cross_encoder:
            return model_name, *await self._cross_encoding_scores(request, texts_1, texts_2, request_id, model_name,
                                                                  raw_request, field_names[1])
        pooling_params = self.pooling_params(truncate_prompt_tokens=request.truncate_prompt_tokens, task="embed")
        if request.use_activation is not None:
            raise OpenAIError("use_activation applies to a cross-encoder's scores; this model scores with the cosine "
                              "of embeddings: leave it unset.", param="use_activation")
        prompts = (await self.prompts_of(texts_1, pooling_params, True, field_names[0])
                   + await self.prompts_of(texts_2, pooling_params, True, field_names[1]))
        outputs = await self.run_pooling(request_id, prompts, pooling_params, model_name, request.priority,
                                         raw_request)
        scores = embedding_scores(outputs[:len(texts_1)], outputs[len(texts_1):], self.tokenizer)
        return model_name, [score.outputs.score for score in scores], sum(len(p["prompt_token_ids"]) for p in prompts)

    async def _cross_encoding_scores(self, request: ScoreRequest | RerankRequest, texts_1: list[str],
                                     texts_2: list[str], request_id: str, model_name: str, raw_request: Request,
                                     param: str) -> tuple[list[float], int]:
        # truncate_prompt_tokens is the tokenizer's here (the pair's first tokens are kept),
        # so the engine's PoolingParams hold none; checked as everywhere all the same.
        self.pooling_params(truncate_prompt_tokens=request.truncate_prompt_tokens)
        pooling_params = self.pooling_params(use_activation=request.use_activation, task="score")
        if len(texts_1) == 1:
            texts_1 = texts_1 * len(texts_2)
        token_ids_list = await self.off_loop(self._tokenize_pairs, texts_1, texts_2, request.truncate_prompt_tokens)
        prompts = [{"prompt": text_1 + text_2, "prompt_token_ids": self.check_tokens(token_ids, param)}
                   for text_1, text_2, token_ids in zip(texts_1, texts_2, token_ids_list)]
        outputs = await self.run_pooling(request_id, prompts, pooling_params, model_name, request.priority,
                                         raw_request)
        return ([float(output.outputs.data.reshape(-1)[0]) for output in outputs],
                sum(len(output.prompt_token_ids) for output in outputs))

    def _tokenize_pairs(self, texts_1: list[str], texts_2: list[str], truncate_prompt_tokens: int | None
                        ) -> list[list[int]]:
        """Each pair's token ids as the cross-encoder reads them (on the tokenizer thread)."""
        if self.tokenizer is None:
            raise OpenAIError("This server runs without a tokenizer, which scoring text pairs needs.",
                              param="text_1")
        hf_config: Any = self.engine.model_config.hf_config
        return [cross_encoder_token_ids(self.tokenizer, hf_config, text_1, text_2, truncate_prompt_tokens,
                                        self.max_model_len, self.score_template, self._render)
                for text_1, text_2 in zip(texts_1, texts_2)]

    def _render(self, text_1: str, text_2: str) -> str:
        """A pair's prompt under the score template (a 400 naming text_1 when it fails)."""
        assert self.score_template is not None
        try:
            return self.renderer.render(self.score_template, score_template_messages(text_1, text_2),
                                        variables=dict(self.tokenizer.special_tokens_map))
        except ChatTemplateError as exc:
            raise OpenAIError(f"The score template (--chat-template) failed on this pair: {exc}",
                              param="text_1") from None
