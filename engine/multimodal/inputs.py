"""`MultiModalFeature`: one image of a prompt as the engine and the workers see it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PlaceholderRange:
    """The prompt positions [offset, offset + length) that an item's embeddings fill (vLLM's name)."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(eq=False)
class MultiModalFeature:
    """One image of a request (vLLM V1's MultiModalFeatureSpec): what the processor made of it,
    where its placeholder tokens sit, and a content hash.

    `identifier` is the SHA-256 of the processed pixels (dtype, shape and bytes): two prompts
    whose placeholder tokens are the same ids differ in their KV when their images differ, so
    the blocks that hold an image's tokens are hashed with it (`KVCacheManager`). The
    workers also key their cache of computed image embeddings on the request and this
    feature's index."""

    modality: str
    # The vision tower's input for this one image, e.g. pixel_values float32 [1, 3, H, W].
    pixel_values: np.ndarray
    mm_position: PlaceholderRange
    identifier: bytes

    def overlap(self, start: int, end: int) -> tuple[int, int] | None:
        """The part of the prompt span [start, end) this item's placeholders cover, or None."""
        lo, hi = max(start, self.mm_position.offset), min(end, self.mm_position.end)
        return (lo, hi) if lo < hi else None
