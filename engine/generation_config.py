"""The model's `generation_config.json`: its EOS ids and its sampling defaults.

As vLLM's `--generation-config`: with "auto" the sampling fields the file sets
(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) become the defaults
of requests that leave them unset; "vllm" keeps vLLM's own defaults instead; a folder path
reads the file from there. Either way every EOS id the file lists stops generation ("vllm"
reads them from the model folder's file, as vLLM does). `--override-generation-config`
(a JSON object of those same keys) is merged over the file's fields, or, under "vllm",
over nothing.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raylm.engine.sampling_params import SamplingParams

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
_INTEGER_KEYS = frozenset({"top_k", "max_new_tokens"})


@dataclass
class GenerationDefaults:
    eos_token_ids: list[int] = field(default_factory=list)
    # SamplingParams field -> value, only for what the file sets.
    sampling: dict[str, Any] = field(default_factory=dict)


def check_override_generation_config(override: dict[str, Any] | None) -> dict[str, Any]:
    """`override_generation_config`, checked: only the sampling keys of generation_config.json
    (`max_new_tokens`, not `max_tokens`), each a number (top_k and max_new_tokens an integer);
    a ValueError names the key, its value and what is allowed. vLLM silently drops keys it
    does not use; a typo here would silently change nothing, so it is an error."""
    if override is None:
        return {}
    if not isinstance(override, dict):
        raise ValueError(f"override_generation_config must be a JSON object, got {override!r}.")
    unknown = [key for key in override if key not in _SAMPLING_KEYS]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), list(_SAMPLING_KEYS), n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"override_generation_config: unknown key(s) {', '.join(hints)}; allowed: "
                         f"{', '.join(_SAMPLING_KEYS)}.")
    for key, value in override.items():
        integer = key in _INTEGER_KEYS
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise ValueError(f"override_generation_config: {key} must be {'an integer' if integer else 'a number'}, "
                             f"got {value!r}.")
    try:  # the ranges SamplingParams allows (temperature >= 0, 0 < top_p <= 1, ...)
        SamplingParams(**{_SAMPLING_KEYS[key]: value for key, value in override.items()})
    except ValueError as exc:
        raise ValueError(f"override_generation_config: {exc}") from None
    return dict(override)


def load_generation_defaults(model: str, generation_config: str,
                             override: dict[str, Any] | None = None) -> GenerationDefaults:
    """Reads `generation_config.json` from the model folder ("auto" and "vllm") or another
    folder (a path): its EOS ids, and, unless "vllm", its sampling fields, with `override`
    (generation_config.json keys) merged over them. A model folder without the file gives
    no EOS ids and no defaults but the override's."""
    override = check_override_generation_config(override)
    folder = Path(model if generation_config in ("auto", "vllm") else generation_config)
    path = folder / "generation_config.json"
    written: dict[str, Any] = {}
    if path.is_file():
        from transformers import GenerationConfig

        # Only what the file sets: transformers fills every other field with its own defaults.
        written = GenerationConfig.from_pretrained(str(folder)).to_diff_dict()
    elif generation_config not in ("auto", "vllm"):
        raise ValueError(f"generation_config {generation_config!r} has no generation_config.json.")
    eos = written.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else [int(t) for t in (eos or [])]
    fields = {} if generation_config == "vllm" else written
    fields = {**{key: fields[key] for key in _SAMPLING_KEYS if fields.get(key) is not None}, **override}
    sampling = {_SAMPLING_KEYS[key]: value for key, value in fields.items()}
    if sampling:
        logger.info("Default sampling parameters%s: %s (set generation_config='vllm' to ignore the file's).",
                    f" from {path}" if generation_config != "vllm" and written else "", sampling)
    return GenerationDefaults(eos_ids, sampling)
