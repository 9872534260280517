"""Model classes, the architecture registry and checkpoint loading."""

from raylm.models.loader import get_model, release_model
from raylm.models.registry import resolve_model_class, supported_architectures

__all__ = ["get_model", "release_model", "resolve_model_class", "supported_architectures"]
