"""What the vision-language models (LLaVA, `models/llava.py`; Gemma 3 with images,
`models/gemma3_mm.py`) share around the transformers vision tower each runs as it is: the
tower's config checked and rebuilt from the checkpoint's `vision_config`, the checkpoint's
tensors sorted between the decoder's loader and the tower's and projector's parameters, and
the decoder half of the model interface (`VisionLanguageModel`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from raylm.models.weight_utils import default_weight_loader
from raylm.parallel.pipeline import IntermediateTensors

# Checkpoint name prefixes -> ours. Saves before transformers 4.52 (and what 5.x still writes
# in its legacy layout, and Google's Gemma 3 checkpoints) hold language_model.model.* /
# language_model.lm_head.* / vision_tower.* / multi_modal_projector.*; the module tree of
# transformers >= 4.52 names model.language_model.* / lm_head.* / model.vision_tower.* /
# model.multi_modal_projector.*.
_CHECKPOINT_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


class VisionLanguageModel(nn.Module):
    """A vision tower (`vision_tower`), a projector (`multi_modal_projector`) and a raylm decoder
    (`language_model`) whose image tokens take the projected features as input embeddings.
    A subclass builds the three and answers `get_multimodal_embeddings(pixel_values)`; the
    decoder's half of vLLM V1's multi-modal interface is here."""

    supports_multimodal = True
    supports_pipeline_parallel = False
    # The tower's tensors a checkpoint may hold that nothing reads (skipped at load).
    unused_tower_prefixes: tuple[str, ...] = ()

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's token embeddings of input_ids (scaled where its own are, as Gemma's),
        image tokens included: the runner overwrites those rows with the image features (not
        scaled, as in Hugging Face's)."""
        return self.language_model.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model.model(input_ids, positions, intermediate_tensors, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """See `load_vision_language_weights`."""
        return load_vision_language_weights(self, weights, self.unused_tower_prefixes)


def vision_tower_config(config: Any, architecture: str, tower: str, config_class: type) -> Any:
    """`config.vision_config` as a `config_class` (transformers' `CLIPVisionConfig`,
    `SiglipVisionConfig`), after checking that it is the one kind of tower (`tower`, as a
    reader names it) that `architecture` runs; raises ValueError naming the checkpoint's."""
    vision_config = config.vision_config
    kind = getattr(vision_config, "model_type", type(vision_config).__name__)
    if kind != config_class.model_type:
        raise ValueError(f"{architecture}: raylm runs {tower} vision towers; this checkpoint's "
                         f"vision_config is {kind!r}.")
    if not isinstance(vision_config, config_class):
        # Ray workers get the config as a plain snapshot (executors/ray_worker.py).
        vision_config = config_class.from_dict(vision_config.to_dict())
    return vision_config


def load_vision_language_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                                 unused_tower_prefixes: tuple[str, ...] = ()) -> set[str]:
    """Loads a vision-language checkpoint into `model` (which holds `language_model`,
    `vision_tower` and `multi_modal_projector`): the decoder's tensors go through its own
    loader (stacked q/k/v, gate/up, tied head); the vision tower's and the projector's are
    copied as they are. Tower tensors under `unused_tower_prefixes` (a pooling head nothing
    reads) and the position_ids buffer older checkpoints saved are skipped. Returns the names
    of the parameters loaded; a tensor that matches none is an error naming it."""
    own = dict(model.named_parameters())
    # transformers before 5 nests the tower's modules under vision_model.
    tower_prefix = "vision_model." if any(n.startswith("vision_tower.vision_model.") for n in own) else ""
    loaded: set[str] = set()

    def language_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = _our_name(name)
            if name.startswith("language_model."):
                yield name.removeprefix("language_model."), tensor
                continue
            if name.startswith("vision_tower."):
                rest = name.removeprefix("vision_tower.").removeprefix("vision_model.")
                if rest.endswith("position_ids") or rest.startswith(unused_tower_prefixes):
                    continue
                name = "vision_tower." + tower_prefix + rest
            if name not in own:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}.")
            default_weight_loader(own[name], tensor)
            loaded.add(name)

    loaded |= {"language_model." + name for name in model.language_model.load_weights(language_tensors())}
    # Counted as `weight_utils.load_stacked_weights` counts (the model runner reruns the
    # after-loading hooks when it changes).
    model.num_weight_loads = model.__dict__.get("num_weight_loads", 0) + 1
    return loaded


def _our_name(name: str) -> str:
    for theirs, ours in _CHECKPOINT_PREFIXES:
        if name.startswith(theirs):
            return ours + name.removeprefix(theirs)
    return name
