"""The model names the server answers to: the base model's and one per LoRA adapter.

`--lora-modules name=path ...` (with `--enable-lora`) loads each adapter at startup and
serves it under its name: it is listed on /v1/models (with the base model as its parent) and
a request with `model` set to it runs under the adapter. With
`--allow-runtime-lora-updating` (off by default, as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)
the routes POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove adapters
while the server runs, from folders under `--allowed-lora-dirs` only (links followed: the
engine checks where the files it opened are, see executors/lora_adapter.py). Every adapter gets a
fresh engine id, so an adapter loaded again under an old name never shares cached KV with
the old one. Unloading lets the adapter's requests in flight finish.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from raylm.deploy.errors import OpenAIError
from raylm.deploy.protocol import ModelCard, ModelList
from raylm.deploy.server_args import LoRAServerSettings
from raylm.engine.lora_request import LoRARequest

logger = logging.getLogger(__name__)


@dataclass
class LoRAModulePath:
    """One adapter of --lora-modules: `name=path`, or vLLM's JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}`."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, value: Any) -> "LoRAModulePath":
        if isinstance(value, LoRAModulePath):
            return value
        if isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"lora_modules: {value!r} is not valid JSON ({exc}).") from None
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"name", "path", "base_model_name"})
            if unknown or not value.get("name") or not value.get("path"):
                raise ValueError(f"lora_modules: a JSON entry needs 'name' and 'path' (and may have "
                                 f"'base_model_name'), got {value!r}.")
            return cls(str(value["name"]), str(value["path"]), value.get("base_model_name"))
        if isinstance(value, str) and "=" in value:
            name, path = value.split("=", 1)
            if name and path:
                return cls(name, path)
        raise ValueError(f"lora_modules entries are name=path or JSON {{\"name\": ..., \"path\": ...}}, got {value!r}.")


# A name is kept for as long as the adapter is served (and listed on every /v1/models); a
# path longer than Linux's PATH_MAX names no file.
MAX_LORA_NAME_CHARS = 1024
MAX_LORA_PATH_CHARS = 4096


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=MAX_LORA_PATH_CHARS)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def adapter_unavailable(exc: Exception, lora_name: str) -> OpenAIError:
    """The answer to a request whose adapter the engine could not read any more (its folder
    gone: 404, as vLLM answers for an adapter it cannot find; changed or unreadable: 400).
    The message names the adapter, not its folder (the server log has the engine's error)."""
    from raylm.executors.lora_adapter import LoRAAdapterNotFoundError

    logger.warning("A request under LoRA adapter %r failed: %s", lora_name, exc)
    if isinstance(exc, LoRAAdapterNotFoundError):
        return OpenAIError(f"The LoRA adapter `{lora_name}` cannot be served: its files are no longer where it was "
                           f"loaded from.", HTTPStatus.NOT_FOUND, "model")
    return OpenAIError(f"The LoRA adapter `{lora_name}` cannot be served: its files changed since it was loaded or "
                       f"cannot be read.", HTTPStatus.BAD_REQUEST, "model")


class OpenAIServingModels:
    """The base model's names and the LoRA adapters being served, by name."""

    def __init__(self, engine: Any, base_model_names: list[str], settings: LoRAServerSettings,
                 model_aliases: list[str] | tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.base_model_names = base_model_names
        # Every `model` value that means the base model (the routes take the aliases, the
        # model's path, before they look for an adapter): no adapter may be named one of them.
        self.taken_by_base_model = frozenset([*base_model_names, *model_aliases])
        self.settings = settings
        model_config = engine.model_config
        self.max_model_len = model_config.max_model_len
        self.lora_requests: dict[str, LoRARequest] = {}
        self._next_lora_id = 1
        # Loads and unloads one at a time, so that a name is never taken twice.
        self._lock = asyncio.Lock()
        if settings.lora_modules and engine.engine.engine_core.lora_loader is None:
            raise ValueError("lora_modules (--lora-modules) needs the engine argument enable_lora (--enable-lora).")
        if settings.allow_runtime_lora_updating and engine.engine.engine_core.lora_loader is None:
            raise ValueError("allow_runtime_lora_updating needs the engine argument enable_lora (--enable-lora).")

    def load_static_loras(self) -> None:
        """Loads the --lora-modules adapters before the server starts; a bad one stops it."""
        for module in (LoRAModulePath.parse(value) for value in self.settings.lora_modules or ()):
            if module.name in self.taken_by_base_model or module.name in self.lora_requests:
                raise ValueError(f"lora_modules: the name {module.name!r} is already taken.")
            lora_request = LoRARequest(module.name, self._new_lora_id(), module.path,
                                       module.base_model_name or self.base_model_names[0])
            self.engine.engine.add_lora(lora_request)
            self.lora_requests[module.name] = lora_request
            logger.info("Serving LoRA adapter %r from %s.", module.name, module.path)

    def _new_lora_id(self) -> int:
        lora_id, self._next_lora_id = self._next_lora_id, self._next_lora_id + 1
        return lora_id

    # ---- requests --------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        """The name responses report for the request's `model`; 404 if the server does not
        serve it (vLLM's message)."""
        if not model:
            return self.base_model_names[0]
        if model in self.base_model_names or model in self.lora_requests:
            return model if model in self.lora_requests else self.base_model_names[0]
        raise OpenAIError(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, "model")

    def lora_request(self, model_name: str) -> LoRARequest | None:
        """The adapter a request for `model_name` (from check_model) runs under; None for the
        base model; 404 if the adapter was unloaded meanwhile."""
        if model_name in self.base_model_names:
            return None
        lora_request = self.lora_requests.get(model_name)
        if lora_request is None:
            raise OpenAIError(f"The model `{model_name}` does not exist.", HTTPStatus.NOT_FOUND, "model")
        return lora_request

    def model_list(self) -> ModelList:
        # root: the served names, not folders (where the weights live is the server's business).
        cards = [ModelCard(id=name, root=self.base_model_names[0], max_model_len=self.max_model_len)
                 for name in self.base_model_names]
        cards += [ModelCard(id=lora.lora_name, root=lora.lora_name, parent=lora.base_model_name,
                            max_model_len=self.max_model_len) for lora in self.lora_requests.values()]
        return ModelList(data=cards)

    # ---- runtime updates -------------------------------------------------------------------
    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        from raylm.executors.lora_adapter import LoRAAdapterNotFoundError

        async with self._lock:
            if request.lora_name in self.lora_requests or request.lora_name in self.taken_by_base_model:
                raise OpenAIError(f"The lora adapter '{request.lora_name}' has already been loaded.",
                                  param="lora_name")
            limit = self.settings.max_served_loras
            if len(self.lora_requests) >= limit:
                raise OpenAIError(f"The server serves {len(self.lora_requests)} LoRA adapters, its limit "
                                  f"(--max-served-loras {limit}); unload one before loading "
                                  f"'{request.lora_name}'.", param="lora_name")
            lora_request = LoRARequest(request.lora_name, self._new_lora_id(), request.lora_path,
                                       self.base_model_names[0])
            try:
                # The engine checks where the files it opens really are, on the descriptors
                # it then reads (a link swapped in later changes nothing it serves).
                await self.engine.add_lora(lora_request, allowed_dirs=self.settings.allowed_lora_dirs)
            except LoRAAdapterNotFoundError as exc:
                raise OpenAIError(str(exc), HTTPStatus.NOT_FOUND, "lora_path") from None
            except ValueError as exc:
                raise OpenAIError(str(exc), param=getattr(exc, "param", None) or "lora_path") from None
            self.lora_requests[request.lora_name] = lora_request
        logger.info("Loaded LoRA adapter %r from %s.", request.lora_name, request.lora_path)
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        async with self._lock:
            lora_request = self.lora_requests.get(request.lora_name)
            if lora_request is None or (request.lora_int_id is not None
                                        and request.lora_int_id != lora_request.lora_int_id):
                raise OpenAIError(f"The lora adapter '{request.lora_name}' cannot be found.", HTTPStatus.NOT_FOUND,
                                  "lora_name")
            del self.lora_requests[request.lora_name]
            await self.engine.remove_lora(lora_request.lora_int_id)
        logger.info("Unloaded LoRA adapter %r.", request.lora_name)
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

    def add_routes(self, app: FastAPI) -> None:
        """The runtime routes, only with allow_runtime_lora_updating."""
        if not self.settings.allow_runtime_lora_updating:
            return

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
            return PlainTextResponse(await self.load_lora_adapter(request))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
            return PlainTextResponse(await self.unload_lora_adapter(request))
