"""What the vision-language tests (test_llava.py, test_gemma3_vl.py) share: prompts with
random images, Hugging Face's model and processor on the same tiny checkpoint as the
reference, its greedy continuation, images as data URLs, and the checkpoint names of
transformers' other layout."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import torch

from tiny_models import random_image


def image_prompt(prompt: str, seeds: tuple[int, ...]) -> dict:
    """An engine prompt with one random image (`random_image`) per seed."""
    return {"prompt": prompt, "multi_modal_data": {"image": [random_image(seed) for seed in seeds]}}


def hf_processor_and_model(model_dir: Path, architecture: str, device: str = "cpu"):
    """Hugging Face's processor and `architecture` (a transformers class name) in fp32 on the
    checkpoint: the reference the engine is held to."""
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(str(model_dir))
    model_class = getattr(transformers, architecture)
    model = model_class.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    return processor, model


def hf_image_inputs(processor, prompt: str, seeds: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """The processor's tensors for `prompt` with `image_prompt`'s images of `seeds`."""
    images = [random_image(seed) for seed in seeds] or None
    return dict(processor(text=prompt, images=images, return_tensors="pt"))


def hf_greedy_tokens(model, inputs: dict[str, torch.Tensor], max_tokens: int) -> list[int]:
    """Hugging Face's greedy continuation of the processor's inputs (the new tokens only)."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def png_data_url(image) -> str:
    """A PIL image as a `data:image/png;base64,...` URL (an OpenAI image_url part's)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def module_tree_name(name: str) -> str:
    """A tensor name of the layout this transformers saves (language_model.model.*,
    language_model.lm_head.*, vision_tower.*, multi_modal_projector.*) in the layout of
    transformers' module tree since 4.52 (model.language_model.*, lm_head.*,
    model.vision_tower.vision_model.*, model.multi_modal_projector.*)."""
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith("vision_tower."):
        return "model.vision_tower.vision_model." + name.removeprefix("vision_tower.").removeprefix("vision_model.")
    return "model." + name
