"""`SpeculativeConfig`: vLLM's `speculative_config`, validated once where it is built.

Two methods propose tokens for the target model to verify in one forward:

- ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
  "prompt_lookup_min": m}``: the driver looks up the request's last n..m tokens earlier in
  its own prompt and output and proposes the k tokens that followed them.
- ``{"model": DIR, "num_speculative_tokens": k}`` (method "draft_model"): a smaller model
  with the same vocabulary runs on the workers beside the target, with its own KV cache
  under the same block ids, and proposes k tokens autoregressively.
- ``{"method": "eagle", "model": DIR, "num_speculative_tokens": k}``: an EAGLE-1 head (one
  or a few decoder layers over the target's hidden states, `models/llama_eagle.py`) for a
  Llama-family target, run on the workers like a draft model (`executors/eagle_runner.py`).

raylm's own keys (not in vLLM): ``adaptive`` (per-request draft lengths from each
request's acceptance rate) and ``draft_token_cost`` (what one proposed token costs in a
verification step, as a fraction of a decode step: a request proposes the j-th token only
while its estimated chance of reaching and accepting it is above this). vLLM's
``disable_by_batch_size`` turns speculation off while more requests than that are running.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from raylm.engine.arg_fields import json_object

# Bounds on what a request can make the engine allocate or loop over per step.
MAX_NUM_SPECULATIVE_TOKENS = 32
MAX_PROMPT_LOOKUP = 64

# Measured with cluster/benchmarks/bench_spec_decode.py on the bundled demo model (CPU; see
# docs/speculative_decoding.md): one proposed token added 0.02-0.15 of a decode step's time
# to a batch-1 step (step cost table), and less than that of a whole engine step once the
# driver's share is counted.
DEFAULT_DRAFT_TOKEN_COST = 0.1
# The measured break-even in batch size (demo model, CPU, two runs): n-gram proposals with
# adaptive lengths gained 1.69-1.81x at batch 1, 1.17-1.39x at 8, 1.10x at 32, and 0.89-1.08x
# at 64; beyond 32 running requests speculation is off unless asked for.
DEFAULT_DISABLE_BY_BATCH_SIZE = 32

METHODS = ("ngram", "draft_model", "eagle")
# The `architectures` EAGLE-1 head checkpoints carry: the original repository's heads say
# plain LlamaForCausalLM (or nothing); vLLM's converted ones LlamaForCausalLMEagle.
EAGLE_HEAD_ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM", "LlamaForCausalLM")


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # The draft model's folder (method "draft_model").
    model: str | None = None
    # The draft's ModelConfig, built by EngineArgs from `model` (same dtype and context
    # length as the target).
    draft_model_config: Any = None
    # Speculation is off for a step while more requests than this are running (None: never).
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    adaptive: bool = True
    draft_token_cost: float = DEFAULT_DRAFT_TOKEN_COST

    @property
    def uses_draft_model(self) -> bool:
        """Whether a model on the workers proposes (a draft model or an EAGLE head)."""
        return self.method in ("draft_model", "eagle")

    @property
    def is_eagle(self) -> bool:
        return self.method == "eagle"


_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
         "disable_by_batch_size", "adaptive", "draft_token_cost")


def parse_speculative_config(value: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """The speculative_config argument as a dict: a dict as given, a JSON object string
    (`--speculative-config '{"method": "ngram", ...}'`) parsed, None or "" as None."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json_object(value)
        except ValueError as error:
            # The wording of the Serve key's error (arg_fields.parse_value) for the same mistake.
            raise ValueError(f"speculative_config: {error}.") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a dict (a JSON object), got {value!r}.")
    return value


def build_speculative_config(raw: dict[str, Any]) -> SpeculativeConfig:
    """Validates the user's dict (vLLM's keys, plus raylm's `adaptive` and
    `draft_token_cost`) and fills vLLM's defaults. The draft's ModelConfig is built by the
    caller, which knows the target."""
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, _KEYS, n=1)
            hints.append(repr(key) + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"speculative_config has unknown key(s) {', '.join(hints)}; allowed: {', '.join(_KEYS)}.")
    method = raw.get("method")
    model = raw.get("model")
    if method is None:
        # vLLM's inference: a model means a draft model; "[ngram]" was the old spelling.
        method = "ngram" if model in ("ngram", "[ngram]") else ("draft_model" if model else None)
    if method == "[ngram]":
        method = "ngram"
    if method not in METHODS:
        raise ValueError(f"speculative_config method must be one of {METHODS} (or omitted with a draft 'model'), "
                         f"got {method!r}.")
    k = raw.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
        raise ValueError(f"speculative_config num_speculative_tokens must be an integer from 1 to "
                         f"{MAX_NUM_SPECULATIVE_TOKENS}, got {k!r}.")
    config = SpeculativeConfig(method=method, num_speculative_tokens=k)
    if method == "ngram":
        _fill_lookup_window(config, raw)
        if model not in (None, "ngram", "[ngram]"):
            raise ValueError(f"speculative_config model must be left out with method 'ngram', got {model!r}.")
    else:
        if not isinstance(model, str) or not model:
            what = "the EAGLE head's" if method == "eagle" else "the draft model's"
            raise ValueError(f"speculative_config method {method!r} needs 'model', {what} folder; got {model!r}.")
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            if raw.get(key) is not None:
                raise ValueError(f"speculative_config {key} applies to method 'ngram' only, not {method!r}.")
        config.model = model
    batch = raw.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
    if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool) or batch < 1):
        raise ValueError(f"speculative_config disable_by_batch_size must be a positive integer or null, "
                         f"got {batch!r}.")
    config.disable_by_batch_size = batch
    adaptive = raw.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise ValueError(f"speculative_config adaptive must be true or false, got {adaptive!r}.")
    config.adaptive = adaptive
    cost = raw.get("draft_token_cost", DEFAULT_DRAFT_TOKEN_COST)
    if not isinstance(cost, (int, float)) or isinstance(cost, bool) or not 0.0 <= cost < 1.0:
        raise ValueError(f"speculative_config draft_token_cost must be a number in [0, 1), got {cost!r}.")
    config.draft_token_cost = float(cost)
    return config


def _fill_lookup_window(config: SpeculativeConfig, raw: dict[str, Any]) -> None:
    """vLLM's defaults: both unset is 5..5; one unset takes the other's value."""
    low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = 5
    elif low is None:
        low = high
    elif high is None:
        high = low
    for key, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_PROMPT_LOOKUP:
            raise ValueError(f"speculative_config {key} must be an integer from 1 to {MAX_PROMPT_LOOKUP}, "
                             f"got {value!r}.")
    if low > high:
        raise ValueError(f"speculative_config prompt_lookup_min ({low}) must be at most prompt_lookup_max ({high}).")
    config.prompt_lookup_min, config.prompt_lookup_max = low, high
