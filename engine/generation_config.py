"""The model's `generation_config.json`: its EOS ids and its sampling defaults.

As vLLM's `--generation-config auto`: the sampling fields the file sets (temperature,
top_p, top_k, min_p, repetition_penalty, max_new_tokens) become the defaults of requests
that leave them unset, and every EOS id it lists stops generation. `"vllm"` ignores the
file (vLLM's own defaults); a folder path reads the file from there instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field.
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass
class GenerationDefaults:
    eos_token_ids: list[int] = field(default_factory=list)
    # SamplingParams field -> value, only for what the file sets.
    sampling: dict[str, Any] = field(default_factory=dict)


def load_generation_defaults(model: str, generation_config: str) -> GenerationDefaults:
    """Reads `generation_config.json` from the model folder ("auto"), another folder (a
    path), or nothing ("vllm"). A folder without the file gives no defaults."""
    if generation_config == "vllm":
        return GenerationDefaults()
    folder = Path(model if generation_config == "auto" else generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config != "auto":
            raise ValueError(f"generation_config {generation_config!r} has no generation_config.json.")
        return GenerationDefaults()
    from transformers import GenerationConfig

    config = GenerationConfig.from_pretrained(str(folder))
    # Only what the file sets: transformers fills every other field with its own defaults.
    written = config.to_diff_dict()
    eos = written.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else [int(t) for t in (eos or [])]
    sampling = {name: written[key] for key, name in _SAMPLING_KEYS.items() if written.get(key) is not None}
    if sampling:
        logger.info("Default sampling parameters from %s: %s (set generation_config='vllm' to ignore them).",
                    path, sampling)
    return GenerationDefaults(eos_ids, sampling)
