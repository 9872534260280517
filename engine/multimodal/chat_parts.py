"""The images of an offline chat conversation (`LLM.chat`), as vLLM's LLM.chat takes them:
`image_url` parts holding a data URL, or `image_pil` parts holding a PIL image. Each becomes an
`{"type": "image"}` part, where Hugging Face chat templates put the model's placeholder."""

from __future__ import annotations

from typing import Any

from raylm.engine.multimodal.image import load_image_url
from raylm.engine.sampling_params import ParameterError


def split_chat_images(conversation: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """The conversation as the template reads it, and its images in order."""
    from PIL import Image

    images: list[Any] = []
    rendered = []
    for i, message in enumerate(conversation):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                image_url = part.get("image_url")
                url = image_url.get("url") if isinstance(image_url, dict) else image_url
                images.append(load_image_url(url, f"messages[{i}].content[{j}].image_url.url"))
            elif kind == "image_pil":
                image = part.get("image_pil")
                if not isinstance(image, Image.Image):
                    raise ParameterError(f"messages[{i}].content[{j}].image_pil must be a PIL.Image.Image, got "
                                         f"{type(image).__name__}.", "messages")
                images.append(image)
            else:
                parts.append(part)
                continue
            parts.append({"type": "image"})
        rendered.append({**message, "content": parts})
    return rendered, images
