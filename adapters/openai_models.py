"""The served models (vLLM's OpenAIServingModels): the base model under its names and the LoRA adapters
the engine holds; /v1/models lists them, a request's `model` picks one, and vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter change the adapters at run time, only when the
door allows it (reading any path the server can see is not for every client), else 403."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pagedcore.adapters.openai_errors import OpenAIError, model_not_found
from pagedcore.adapters.openai_request import check_fields, get_field
from pagedcore.lora.request import LoRARequest


class OpenAIServingModels:
    def __init__(self, engine, model_name: str, aliases: tuple[str, ...] = (), allow_lora_updates: bool = False):
        self.engine = engine
        self.model_name = model_name
        self.accepted_names = {model_name, *aliases}
        self.allow_lora_updates = allow_lora_updates
        self.created = int(time.time())

    def models(self) -> dict:
        base = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pagedcore"}
        loras = [{"id": a.name, "object": "model", "created": self.created, "owned_by": "pagedcore",
                  "root": a.path, "parent": self.model_name} for a in self.engine.list_loras()]
        return {"object": "list", "data": [base, *loras]}

    def check_model(self, body: dict, options: dict) -> str:
        """The model name the response carries; an adapter's name sets options["lora_request"]."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise OpenAIError("'model' must be a string", "model")
        if model is None or model in self.accepted_names:
            return self.model_name
        loras = [a.name for a in self.engine.list_loras()]
        if model not in loras:
            raise model_not_found(model, [self.model_name, *loras])
        options["lora_request"] = model
        return model

    def not_found(self, name: str) -> OpenAIError:
        return model_not_found(name, [self.model_name, *(a.name for a in self.engine.list_loras())])

    # ---- LoRA adapters at run time (vLLM's routes) -------------------------------------------------
    async def load_lora_adapter(self, body: Any) -> dict:
        self._check_lora_updates(body, {"lora_name", "lora_path", "lora_int_id"})
        name = get_field(body, "lora_name", str, "a string")
        path = get_field(body, "lora_path", str, "a string")
        int_id = get_field(body, "lora_int_id", int, "an integer") or self.engine.engine.next_lora_int_id()
        if not name or not path:
            raise OpenAIError("'lora_name' and 'lora_path' are required", "lora_name" if not name else "lora_path")
        if name in self.accepted_names:
            raise OpenAIError(f"'lora_name' {name!r} is the base model's name", "lora_name")
        try:  # reads the adapter's files: off the event loop
            await asyncio.to_thread(self.engine.add_lora, LoRARequest(name, int_id, path))
        except ValueError as e:  # LoRALoadError (an InvalidRequestError), or LoRARequest's own checks
            raise OpenAIError(str(e), "lora_path") from e
        return {"object": "lora_adapter", "id": name, "loaded": True}

    async def unload_lora_adapter(self, body: Any) -> dict:
        self._check_lora_updates(body, {"lora_name", "lora_int_id"})
        name = get_field(body, "lora_name", str, "a string")
        if not self.engine.remove_lora(name or ""):
            raise OpenAIError(f"LoRA adapter {name!r} is not loaded", "lora_name", status=404, code="model_not_found")
        return {"object": "lora_adapter", "id": name, "loaded": False}

    def _check_lora_updates(self, body: Any, fields: set[str]) -> None:
        if not self.allow_lora_updates:
            raise OpenAIError("loading and unloading LoRA adapters at run time is off on this server (start it "
                              "with PAGEDCORE_ALLOW_RUNTIME_LORA_UPDATING=true)", status=403, type="permission_error")
        if not self.engine.config.enable_lora:
            raise OpenAIError("this server runs without LoRA (start it with PAGEDCORE_ENABLE_LORA=true)")
        check_fields(body, fields)
