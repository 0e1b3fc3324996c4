"""LoRA adapters loaded and unloaded at run time, by vLLM's routes and bodies (behind the API key,
like every route that changes what the server serves):

    POST /v1/load_lora_adapter   {"lora_name": str, "lora_path": str}  -> 200, a line of text
    POST /v1/unload_lora_adapter {"lora_name": str}                    -> 200, a line of text

400 for a server without --enable-lora, a name in use, a path that is not a PEFT adapter or an
adapter that does not fit the model (rank, target modules, shapes); 404 for unloading an unknown
name; 400 for unloading an adapter whose requests are still running. A loaded adapter is served
as the `model` of the generation routes and listed by GET /v1/models.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from jaxserve.server import lora_adapters
from jaxserve.server.http import errors
from jaxserve.server.http.openai_front import OpenAIFront, engine_error


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(json_schema_extra={"minLength": 1})
    lora_path: str = Field(json_schema_extra={"minLength": 1})


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None   # vLLM's body carries it; the name decides here


def add_lora_routes(app: FastAPI, front: OpenAIFront, authorized) -> None:
    @app.post("/v1/load_lora_adapter", dependencies=[Depends(authorized)], response_class=PlainTextResponse)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        try:
            await lora_adapters.load_adapter(front.engine(), req.lora_name, req.lora_path)
        except FileNotFoundError as e:    # no adapter at that path: what it names is not found
            raise errors.APIError(404, str(e), type="invalid_request_error", param="lora_path",
                                  code="adapter_not_found") from e
        except lora_adapters.AdapterConflict as e:
            raise errors.APIError(409, str(e), type="invalid_request_error", param="lora_name",
                                  code="adapter_conflict") from e
        except Exception as e:  # noqa: BLE001 - mapped when known, raised as it is otherwise
            raise _mapped(e) from e
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(authorized)], response_class=PlainTextResponse)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        try:
            await lora_adapters.unload_adapter(front.engine(), req.lora_name)
        except lora_adapters.AdapterNotFound as e:
            raise errors.APIError(404, str(e), type="invalid_request_error", param="lora_name",
                                  code="model_not_found") from e
        except Exception as e:  # noqa: BLE001
            raise _mapped(e) from e
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def _mapped(e: Exception) -> Exception:
    mapped = engine_error(e)
    return e if mapped is None else mapped
