"""Multi-modal inputs (vLLM's `vllm.multimodal`): images given with a prompt, processed by the
checkpoint's own Hugging Face processor on the driver, carried to the workers with the
request, and hashed into the prefix cache's block hashes. Importing this package imports
no torch (the engine's import-time rule)."""

from raylm.engine.multimodal.inputs import MultiModalFeature, PlaceholderRange

__all__ = ["MultiModalFeature", "PlaceholderRange"]
