"""`LoRARequest`: which LoRA adapter a request runs under (vLLM's class and fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter in PEFT's format (a folder with adapter_config.json and
    adapter_model.safetensors), named for the engine.

    lora_name: the adapter's name (the server's model name for it).
    lora_int_id: a positive integer that identifies the adapter inside the engine; one id
        names one adapter (the same name and path) for as long as the engine knows it.
    lora_path: the adapter's folder.
    base_model_name: the base model the adapter was trained for, informational (the
        server's /v1/models shows it as the adapter's parent).

    Pass one to `LLM.generate(..., lora_request=...)` (one for every prompt, or a list with
    one per prompt, None for the base model) or to `AsyncLLMEngine.generate`.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}.")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be the path of the adapter's folder, got {self.lora_path!r}.")

    # vLLM's aliases.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def cache_key(self) -> bytes:
        """What the prefix cache keys this adapter's KV by: its id, name and path (the KV-cache
        manager adds the digest of its files)."""
        return f"{self.lora_int_id}\x00{self.lora_name}\x00{self.lora_path}".encode()
