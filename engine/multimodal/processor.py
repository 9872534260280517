"""`MultiModalProcessor`: a prompt with images -> token ids and `MultiModalFeature`s, made by the
checkpoint's own Hugging Face processor (transformers' AutoProcessor), as vLLM's processors do.

Each `<image>` placeholder token of the prompt expands into the number of image tokens the
vision tower yields, as the processor expands it (LlavaProcessor: one per patch, less CLS under
the "default" feature strategy), and the processor turns the images into pixel_values; the
workers' model fills those positions with the projected image features. Text prompts are
tokenized first, so a prompt's token ids (a chat prompt's, tokenized without special tokens)
and its text take the same path."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from raylm.engine.multimodal.inputs import MultiModalFeature, PlaceholderRange
from raylm.engine.sampling_params import ParameterError

# vLLM's default limit_mm_per_prompt: one image a prompt.
DEFAULT_LIMIT_PER_PROMPT = 1
# The most images a prompt may be allowed (limit_mm_per_prompt's bound): each one is a vision
# tower forward and its pixel_values travel with the request to every worker.
MAX_LIMIT_PER_PROMPT = 16
SUPPORTED_MODALITIES = ("image",)


def check_limit_mm_per_prompt(value: dict[str, int] | None) -> dict[str, int]:
    """vLLM's limit_mm_per_prompt ({"image": n}), checked: modalities this engine takes, each an
    int in [0, MAX_LIMIT_PER_PROMPT]; default one image."""
    limits = {"image": DEFAULT_LIMIT_PER_PROMPT}
    if value is None:
        return limits
    if not isinstance(value, dict):
        raise ValueError(f"limit_mm_per_prompt must be a dict such as {{\"image\": 2}}, got {value!r}.")
    for modality, count in value.items():
        if modality not in SUPPORTED_MODALITIES:
            raise ValueError(f"limit_mm_per_prompt names modality {modality!r}; supported: "
                             f"{', '.join(SUPPORTED_MODALITIES)}.")
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_LIMIT_PER_PROMPT:
            raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be an integer in [0, {MAX_LIMIT_PER_PROMPT}], "
                             f"got {count!r}.")
        limits[modality] = count
    return limits


def image_token_id(hf_config: Any) -> int:
    """The id of the placeholder token a multi-modal config names (LlavaConfig's image_token_index)."""
    for key in ("image_token_id", "image_token_index"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int):
            return value
    raise ValueError("The model's config.json names no image_token_index: raylm cannot place its images.")


def feature_identifier(modality: str, pixel_values: np.ndarray) -> bytes:
    """The content hash of one processed item (what its KV depends on besides token ids)."""
    digest = hashlib.sha256(modality.encode())
    digest.update(str(pixel_values.dtype).encode())
    digest.update(repr(pixel_values.shape).encode())
    digest.update(np.ascontiguousarray(pixel_values).tobytes())
    return digest.digest()


class MultiModalProcessor:
    """The driver's processing of multi-modal prompts for one model."""

    def __init__(self, model: str, hf_config: Any, limits: dict[str, int], trust_remote_code: bool = False,
                 revision: str | None = None) -> None:
        self.model = model
        self.limits = limits
        self.image_token_id = image_token_id(hf_config)
        # The token a prompt writes once per image: LLaVA's is the image token itself, repeated
        # in place; Gemma 3's is `<start_of_image>` (boi_token_index), which its processor
        # replaces with its `full_image_sequence` ("\n\n<start_of_image>", the image tokens,
        # "<end_of_image>\n\n").
        boi_token_id = getattr(hf_config, "boi_token_index", None)
        self.placeholder_token_id = boi_token_id if isinstance(boi_token_id, int) else self.image_token_id
        # One processed image's pixel_values (LLaVA: [1, 3, image_size, image_size]), which
        # processed prompts (`check_processed`) must match: the vision tower takes nothing else.
        image_size = getattr(getattr(hf_config, "vision_config", None), "image_size", None)
        self.pixel_values_shape = (1, 3, image_size, image_size) if isinstance(image_size, int) else None
        # How many embeddings the vision tower makes of such pixels: each processed image's
        # placeholder run must be that long, or the workers could not fill it.
        self.tokens_per_image = image_feature_size(hf_config)
        self._trust_remote_code = trust_remote_code
        self._revision = revision
        self._hf_processor: Any = None

    @property
    def hf_processor(self) -> Any:
        if self._hf_processor is None:
            from transformers import AutoProcessor

            self._hf_processor = AutoProcessor.from_pretrained(self.model, trust_remote_code=self._trust_remote_code,
                                                               revision=self._revision)
        return self._hf_processor

    def check_no_placeholders(self, prompt_token_ids: Sequence[int]) -> None:
        """A prompt without images must not hold the image token: its positions would have no image."""
        if self.image_token_id in prompt_token_ids:
            raise ParameterError(f"The prompt holds the image placeholder token (id {self.image_token_id}) but "
                                 f"multi_modal_data gives no image.", "multi_modal_data")

    def process(self, prompt: str, multi_modal_data: Any) -> tuple[list[int], list[MultiModalFeature]]:
        """The text prompt's token ids (the tokenizer's special tokens added) with each image
        placeholder expanded, and one feature per image (`process_tokens`)."""
        full_image_sequence = getattr(self.hf_processor, "full_image_sequence", None)
        if full_image_sequence is not None:
            # Gemma 3: expanded in the text, then tokenized whole, as its processor does (the
            # newlines around each image tokenize with the text beside them).
            placeholder = self.hf_processor.tokenizer.convert_ids_to_tokens(self.placeholder_token_id)
            images = self._images(multi_modal_data)
            if prompt.count(placeholder) != len(images):
                raise ParameterError(f"The prompt must hold one image placeholder ({placeholder}) per image of "
                                     f"multi_modal_data: {len(images)} images, {prompt.count(placeholder)} "
                                     f"placeholders in the prompt.", "multi_modal_data")
            prompt = prompt.replace(placeholder, full_image_sequence)
        return self.process_tokens(self.hf_processor.tokenizer.encode(prompt), multi_modal_data)

    def process_tokens(self, prompt_token_ids: Sequence[int], multi_modal_data: Any
                       ) -> tuple[list[int], list[MultiModalFeature]]:
        """The token ids with each image's placeholders expanded to the image's tokens, and one
        feature per image in the order of their placeholders. The model's processor makes the
        pixels and says how many tokens an image takes (LlavaProcessor: patches, less CLS under
        the "default" strategy).

        The ids hold either one placeholder token per image, as the text tokenizes, which is
        expanded here, or each image's placeholders already expanded, as the model's processor
        writes them (a prompt tokenized with the processor): vLLM's prompt update detection
        finds those and does not expand them again. ParameterError naming multi_modal_data for
        anything else, or anything the engine cannot take."""
        images = self._images(multi_modal_data)
        token_ids = [int(t) for t in prompt_token_ids]
        image_tokens = token_ids.count(self.image_token_id)
        if self.placeholder_token_id == self.image_token_id:
            placeholders, expands = image_tokens, image_tokens == len(images)
        else:  # Gemma 3: its image tokens are there already, or one `<start_of_image>` per image
            expands = image_tokens == 0
            placeholders = token_ids.count(self.placeholder_token_id) if expands else image_tokens
        if (expands and placeholders != len(images)) or (
                not expands and (not images or not placeholders or placeholders % len(images))):
            raise ParameterError(f"The prompt must hold one image placeholder per image of multi_modal_data: "
                                 f"{len(images)} images, {placeholders} placeholders in the prompt.",
                                 "multi_modal_data")
        if not images:
            return token_ids, []
        pixel_values, per_image = self._process_images(images)
        as_text = self._expanded_as_text(token_ids) if expands else None
        if as_text is not None:
            token_ids, ranges = as_text, self._expanded_ranges(as_text, per_image, len(images))
        elif expands:
            token_ids, ranges = self._expanded(token_ids, per_image)
        else:
            ranges = self._expanded_ranges(token_ids, per_image, len(images))
        self._check_apart(ranges, "multi_modal_data")
        features = []
        for index, position in enumerate(ranges):
            pixels = np.ascontiguousarray(pixel_values[index:index + 1])
            features.append(MultiModalFeature("image", pixels, position, feature_identifier("image", pixels)))
        return token_ids, features

    def _check_apart(self, ranges: list[PlaceholderRange], field: str) -> None:
        """Gemma 3's images must have a token between them: Hugging Face makes one
        bidirectional block of each run of image tokens, so two images side by side would
        attend to each other, which the engine's per-image blocks (and the prefix cache's
        per-image keys) do not do. Its processor always puts `<end_of_image>` and
        `<start_of_image>` between."""
        if self.placeholder_token_id == self.image_token_id:
            return
        for previous, position in zip(ranges, ranges[1:]):
            if previous.end == position.offset:
                raise ParameterError(f"The prompt holds two images' tokens side by side at {position.offset}; this "
                                     f"model's images must be apart, as its processor writes them (one "
                                     f"<start_of_image> per image).", field)

    def _process_images(self, images: list[Any]) -> tuple[np.ndarray, int]:
        """The images' pixel_values (one row each) and how many tokens one image takes, by
        the model's processor (one call for all the prompt's images)."""
        processor = self.hf_processor
        placeholder_text = getattr(processor, "image_token", None) or processor.tokenizer.convert_ids_to_tokens(
            self.image_token_id)
        try:
            processed = processor(text=placeholder_text * len(images), images=images, return_tensors="np")
        except (ValueError, TypeError, OSError) as error:
            raise ParameterError(f"multi_modal_data could not be processed with the model's processor: {error}",
                                 "multi_modal_data") from error
        expanded = [int(t) for t in processed["input_ids"][0]].count(self.image_token_id)
        per_image = expanded // len(images)
        if per_image < 1 or expanded % len(images):
            raise ParameterError(f"The model's processor gave {expanded} image tokens for {len(images)} images.",
                                 "multi_modal_data")
        pixel_values = np.asarray(processed["pixel_values"], dtype=np.float32)
        # A checkpoint whose processor_config.json disagrees with its config.json would have
        # the workers fail on the images (which ends the engine for every request): refused
        # here, request by request.
        if self.pixel_values_shape is not None and pixel_values.shape[1:] != self.pixel_values_shape[1:]:
            raise ParameterError(f"The model's processor makes pixel_values of shape {pixel_values.shape[1:]} an "
                                 f"image, but its vision tower takes {self.pixel_values_shape[1:]}: the checkpoint's "
                                 f"processor_config.json and config.json disagree.", "multi_modal_data")
        if self.tokens_per_image is not None and per_image != self.tokens_per_image:
            raise ParameterError(f"The model's processor expands an image to {per_image} tokens, but its vision tower "
                                 f"makes {self.tokens_per_image} embeddings of one: the checkpoint's "
                                 f"processor_config.json and config.json disagree.", "multi_modal_data")
        return pixel_values, per_image

    def _expanded(self, token_ids: list[int], per_image: int) -> tuple[list[int], list[PlaceholderRange]]:
        """The ids with each placeholder token replaced by an image's ids, and where each
        image's tokens went."""
        image_ids, lead = self._image_ids(per_image)
        expanded_ids: list[int] = []
        ranges: list[PlaceholderRange] = []
        for token in token_ids:
            if token == self.placeholder_token_id:
                ranges.append(PlaceholderRange(len(expanded_ids) + lead, per_image))
                expanded_ids.extend(image_ids)
            else:
                expanded_ids.append(token)
        return expanded_ids, ranges

    def _expanded_as_text(self, token_ids: list[int]) -> list[int] | None:
        """Gemma 3's token prompt expanded as its processor expands text: the ids' text with
        each placeholder replaced by full_image_sequence, tokenized again, where the ids are
        what their text tokenizes to (a chat prompt's are), so that the newlines around each
        image tokenize with their neighbours as in Hugging Face's; None for LLaVA, or ids that
        are not their text's tokens (expanded token by token then, as vLLM does)."""
        full_image_sequence = getattr(self.hf_processor, "full_image_sequence", None)
        if full_image_sequence is None:
            return None
        tokenizer = self.hf_processor.tokenizer
        text = tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if tokenizer.encode(text, add_special_tokens=False) != token_ids:
            return None
        placeholder = tokenizer.convert_ids_to_tokens(self.placeholder_token_id)
        return tokenizer.encode(text.replace(placeholder, full_image_sequence), add_special_tokens=False)

    def _image_ids(self, per_image: int) -> tuple[list[int], int]:
        """The ids one placeholder token becomes, and where the image's tokens start in them:
        LLaVA's image token per_image times; Gemma 3's full_image_sequence tokenized alone, as
        vLLM replaces token prompts' placeholders (a text prompt expands in its text, `process`)."""
        if self.placeholder_token_id == self.image_token_id:
            return [self.image_token_id] * per_image, 0
        tokenizer = self.hf_processor.tokenizer
        image_ids = tokenizer.encode(self.hf_processor.full_image_sequence, add_special_tokens=False)
        lead = image_ids.index(self.image_token_id)
        assert image_ids[lead:lead + per_image] == [self.image_token_id] * per_image == [
            t for t in image_ids if t == self.image_token_id], "full_image_sequence holds one run of image tokens"
        return image_ids, lead

    def _expanded_ranges(self, token_ids: list[int], per_image: int, num_images: int) -> list[PlaceholderRange]:
        """Where each image's tokens sit in ids that hold them already expanded: every run of
        placeholder tokens is a whole number of images (images side by side make one run)."""
        ranges: list[PlaceholderRange] = []
        runs = _runs(token_ids, self.image_token_id)
        if sum(length for _, length in runs) == per_image * num_images and all(
                length % per_image == 0 for _, length in runs):
            ranges = [PlaceholderRange(start + k * per_image, per_image)
                      for start, length in runs for k in range(length // per_image)]
        if len(ranges) != num_images:
            raise ParameterError(f"The prompt must hold one image placeholder per image of multi_modal_data, or "
                                 f"each image's {per_image} placeholder tokens as the model's processor expands "
                                 f"them: {num_images} images, runs of {[length for _, length in runs]} placeholder "
                                 f"tokens in the prompt.", "multi_modal_data")
        return ranges

    def check_processed(self, prompt_token_ids: Sequence[int], mm_features: Any) -> list[MultiModalFeature]:
        """`mm_features` of a prompt this engine's processor already processed (the chat
        route's, which needs the expanded ids to count the prompt), checked against the ids:
        within limit_mm_per_prompt, each an image of the vision tower's pixel shape whose
        identifier is its content hash and whose placeholder tokens (as many as the tower
        makes embeddings), and only those, are the image token, in order and apart."""
        features = list(mm_features) if isinstance(mm_features, (list, tuple)) else None
        if features is None or not all(isinstance(f, MultiModalFeature) and f.modality == "image"
                                       and isinstance(f.pixel_values, np.ndarray) for f in features):
            raise ParameterError("mm_features must be a list of MultiModalFeature images made by the model's "
                                 "processor.", "mm_features")
        limit = self.limits.get("image", 0)
        if len(features) > limit:
            raise ParameterError(f"The prompt has {len(features)} images, more than limit_mm_per_prompt allows "
                                 f"({{'image': {limit}}}).", "mm_features")
        for feature in features:
            if feature.pixel_values.dtype != np.float32 or (
                    self.pixel_values_shape is not None and feature.pixel_values.shape != self.pixel_values_shape):
                raise ParameterError(f"mm_features holds pixel_values of shape {feature.pixel_values.shape} "
                                     f"({feature.pixel_values.dtype}); the model's processor makes float32 "
                                     f"{self.pixel_values_shape}.", "mm_features")
            if feature.identifier != feature_identifier(feature.modality, feature.pixel_values):
                # The prefix cache keys the image's blocks on it: another image's would let
                # these pixels' KV serve that image's prompts.
                raise ParameterError("mm_features holds an identifier that is not the content hash of its "
                                     "pixel_values (feature_identifier).", "mm_features")
        end = 0
        for feature in features:
            position = feature.mm_position
            if not (isinstance(position, PlaceholderRange) and _is_int(position.offset)
                    and _is_int(position.length)):
                raise ParameterError(f"mm_features places an image at {position!r}; a PlaceholderRange of integer "
                                     f"offset and length is expected.", "mm_features")
            if self.tokens_per_image is not None and position.length != self.tokens_per_image:
                raise ParameterError(f"mm_features places an image on {position.length} placeholder tokens; the "
                                     f"model's vision tower makes {self.tokens_per_image} embeddings of an image.",
                                     "mm_features")
            if position.offset < end or position.length < 1 or position.end > len(prompt_token_ids) or any(
                    prompt_token_ids[i] != self.image_token_id for i in range(position.offset, position.end)):
                raise ParameterError(f"mm_features places an image at {position}, which is not a run of image "
                                     f"placeholder tokens of the prompt after the previous image.", "mm_features")
            end = position.end
        self._check_apart([feature.mm_position for feature in features], "mm_features")
        if sum(f.mm_position.length for f in features) != list(prompt_token_ids).count(self.image_token_id):
            raise ParameterError("The prompt holds image placeholder tokens that no image of mm_features fills.",
                                 "mm_features")
        return features

    def _images(self, multi_modal_data: Any) -> list[Any]:
        from PIL import Image

        if not isinstance(multi_modal_data, dict):
            raise ParameterError(f"multi_modal_data must be a dict such as {{\"image\": image}}, got "
                                 f"{type(multi_modal_data).__name__}.", "multi_modal_data")
        unknown = sorted(set(multi_modal_data) - set(SUPPORTED_MODALITIES))
        if unknown:
            raise ParameterError(f"multi_modal_data names modality {unknown[0]!r}; this model takes "
                                 f"{', '.join(SUPPORTED_MODALITIES)}.", "multi_modal_data")
        value = multi_modal_data.get("image", [])
        images = list(value) if isinstance(value, (list, tuple)) else [value]
        limit = self.limits.get("image", 0)
        if len(images) > limit:
            raise ParameterError(f"The prompt has {len(images)} images, more than limit_mm_per_prompt allows "
                                 f"({{'image': {limit}}}); start the engine with a larger limit_mm_per_prompt "
                                 f"to take more.", "multi_modal_data")
        for image in images:
            if not isinstance(image, Image.Image):
                raise ParameterError(f"multi_modal_data['image'] must be a PIL.Image.Image or a list of them, got "
                                     f"{type(image).__name__}.", "multi_modal_data")
        return images


def image_feature_size(hf_config: Any) -> int | None:
    """How many embeddings a LLaVA-style vision tower makes of one image: a CLIP patch grid of
    (image_size / patch_size)^2, with the CLS embedding under the "full" feature strategy
    (`models/llava.py`); None for a config that does not say."""
    mm_tokens_per_image = getattr(hf_config, "mm_tokens_per_image", None)
    if isinstance(mm_tokens_per_image, int):
        return mm_tokens_per_image  # Gemma 3: the patch grid average-pooled to this many
    vision_config = getattr(hf_config, "vision_config", None)
    image_size = getattr(vision_config, "image_size", None)
    patch_size = getattr(vision_config, "patch_size", None)
    if not (isinstance(image_size, int) and isinstance(patch_size, int) and patch_size > 0):
        return None
    keeps_cls = getattr(hf_config, "vision_feature_select_strategy", "default") == "full"
    return (image_size // patch_size) ** 2 + int(keeps_cls)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _runs(token_ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token` in the ids."""
    runs: list[tuple[int, int]] = []
    for index, value in enumerate(token_ids):
        if value != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == index:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    return runs
