"""models/vision_tower.py: the vision tower's config as the vision-language models take it
(their outputs against Hugging Face are tested in test_llava.py and test_gemma3_vl.py)."""

from types import SimpleNamespace

import pytest
from transformers import CLIPVisionConfig, LlavaConfig, SiglipVisionConfig

from raylm.executors.ray_worker import snapshot_hf_config
from raylm.models.gemma3_mm import Gemma3ForConditionalGeneration
from raylm.models.llava import LlavaForConditionalGeneration
from raylm.models.vision_tower import vision_tower_config

TINY_TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8)


def test_llava_refuses_a_vision_tower_other_than_clip_naming_it():
    config = LlavaConfig(vision_config=SiglipVisionConfig(**TINY_TOWER).to_dict())
    with pytest.raises(ValueError, match="LlavaForConditionalGeneration: raylm runs CLIP vision towers; "
                                         "this checkpoint's vision_config is 'siglip_vision_model'"):
        LlavaForConditionalGeneration(config)


def test_gemma3_refuses_a_vision_tower_other_than_siglip_naming_it():
    config = SimpleNamespace(vision_config=CLIPVisionConfig(**TINY_TOWER))
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration: raylm runs SigLIP vision towers; "
                                         "this checkpoint's vision_config is 'clip_vision_model'"):
        Gemma3ForConditionalGeneration(config)


def test_a_ray_workers_config_snapshot_becomes_the_drivers_tower_config_again():
    tower = CLIPVisionConfig(**TINY_TOWER)
    restored = vision_tower_config(snapshot_hf_config(LlavaConfig(vision_config=tower)),
                                   "LlavaForConditionalGeneration", "CLIP", CLIPVisionConfig)
    assert isinstance(restored, CLIPVisionConfig)
    assert restored.to_dict() == tower.to_dict()
