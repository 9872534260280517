"""`EncoderCache`: a worker's images of the running requests and their computed embeddings
(vLLM V1's encoder cache).

A request's images arrive with its first step since (re)admission (`ScheduledRequest.mm_features`).
An image's embeddings are computed once, by the step whose chunk first reaches its placeholder
tokens, and kept until the chunk that takes their last slice (or the request's end or
preemption); each step takes the slice its chunk covers. So chunked prefill may cut an
image's placeholders anywhere, and a prefix-cache hit that ends inside an image starts from
the right slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from raylm.engine.multimodal.inputs import MultiModalFeature
from raylm.engine.step import ScheduledRequest
from raylm.kernels.image_attention import ImageSpan


def profile_num_images(tokens_per_image: int, image_limit: int, max_num_seqs: int,
                       max_num_batched_tokens: int) -> int:
    """How many images' embeddings the KV-cache profile run holds at once (vLLM V1's profile
    rule): the images one step's encoder budget covers (max_num_batched_tokens, at least one
    image's tokens, in whole images rounded up), but no more than max_num_seqs prompts of
    limit_mm_per_prompt images each; none when the limit takes no images."""
    if image_limit <= 0:
        return 0
    encoder_budget = max(max_num_batched_tokens, tokens_per_image)
    by_budget = -(-encoder_budget // tokens_per_image)
    return max(1, min(by_budget, max_num_seqs * image_limit))


@dataclass
class StepImages:
    """A step's image inputs: the rows that hold image placeholders [rows], their embeddings
    [rows, hidden], and (Gemma 3) the images whose tokens attend to each other both ways."""

    rows: torch.Tensor
    embeddings: torch.Tensor
    spans: list[ImageSpan] | None = None


class EncoderCache:
    def __init__(self) -> None:
        self._features: dict[int, list[MultiModalFeature]] = {}
        # (req_id, index of the image in its request) -> embeddings [tokens, hidden].
        self._embeddings: dict[tuple[int, int], torch.Tensor] = {}
        # How many times the vision encoder ran (one image each): tests check it runs once per image.
        self.num_encoder_runs = 0

    def __len__(self) -> int:
        return len(self._embeddings)

    def is_empty(self) -> bool:
        """Whether it holds no request's images nor embeddings (all ended or past them)."""
        return not self._features and not self._embeddings

    def release(self, req_ids: list[int]) -> None:
        """Forgets finished or preempted requests (a readmitted one sends its images again)."""
        for req_id in req_ids:
            features = self._features.pop(req_id, None)
            if features is not None:
                for index in range(len(features)):
                    self._embeddings.pop((req_id, index), None)

    def step_embeddings(self, model: nn.Module, requests: list[ScheduledRequest], device: torch.device
                        ) -> StepImages | None:
        """The step's rows that hold image placeholders and their embeddings, in the step's row
        order, and for a model whose image tokens attend to each other both ways, the step's
        image spans; None when no chunk of the step reaches an image."""
        rows: list[int] = []
        pieces: list[torch.Tensor] = []
        spans: list[ImageSpan] = []
        bidirectional = getattr(model, "bidirectional_image_attention", False)
        row = 0
        for scheduled in requests:
            if scheduled.mm_features is not None:
                self.release([scheduled.req_id])
                self._features[scheduled.req_id] = scheduled.mm_features
            features = self._features.get(scheduled.req_id)
            start = scheduled.num_computed_tokens
            end = start + len(scheduled.token_ids)
            if features:
                for index, feature in enumerate(features):
                    span = feature.overlap(start, end)
                    if span is None:
                        continue
                    embeddings = self._encode(model, scheduled.req_id, index, feature, device)
                    offset = feature.mm_position.offset
                    pieces.append(embeddings[span[0] - offset:span[1] - offset])
                    rows.extend(range(row + span[0] - start, row + span[1] - start))
                    if bidirectional:
                        spans.append(ImageSpan(row + span[0] - start, span[0], offset, feature.mm_position.end))
                    if span[1] == feature.mm_position.end:
                        # Its last slice is taken: only a recompute after preemption, which
                        # encodes again, could need it.
                        del self._embeddings[scheduled.req_id, index]
                if end >= features[-1].mm_position.end:
                    # Past its last image: nothing more to hold for it (a preempted request
                    # sends its images again when it resumes).
                    del self._features[scheduled.req_id]
            row += len(scheduled.token_ids) + len(scheduled.spec_token_ids or ())
        if not rows:
            return None
        return StepImages(torch.tensor(rows, dtype=torch.long, device=device), torch.cat(pieces), spans or None)

    def _encode(self, model: nn.Module, req_id: int, index: int, feature: MultiModalFeature,
                device: torch.device) -> torch.Tensor:
        key = (req_id, index)
        embeddings = self._embeddings.get(key)
        if embeddings is None:
            # A copy: arrays unpickled on Ray workers are read-only views of the object store.
            pixel_values = torch.tensor(feature.pixel_values, device=device)
            embeddings = model.get_multimodal_embeddings(pixel_values)[0]
            if embeddings.shape[0] != feature.mm_position.length:
                raise ValueError(f"The vision encoder made {embeddings.shape[0]} embeddings for an image of "
                                 f"{feature.mm_position.length} placeholder tokens.")
            self._embeddings[key] = embeddings
            self.num_encoder_runs += 1
        return embeddings
