"""Control routes for a trainer driving the server (docs/rl.md): pause and resume generation,
update the weights from a checkpoint on disk. Behind the API key like the generation routes: a
caller without it must not be able to stop the server or swap its model.

    POST /pause                    {"mode": "abort" | "wait" | "keep"}  -> {"paused": true, "aborted": [...]}
    POST /resume                                                        -> {"paused": false}
    GET  /is_paused                                                     -> {"is_paused": bool}
    POST /update_weights_from_disk {"model_path": str, "version": ...} -> the WeightUpdate

The names are SGLang's and vLLM's where they have one (RL frameworks call them by those names).
"""

from __future__ import annotations

from typing import Literal

from fastapi import Depends, FastAPI
from pydantic import BaseModel, ConfigDict

from jaxserve.server.http import errors
from jaxserve.server.http.openai_front import OpenAIFront, engine_error


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["abort", "wait", "keep"] = "abort"


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str
    version: int | str | None = None


def add_control_routes(app: FastAPI, front: OpenAIFront, authorized) -> None:
    @app.post("/pause", dependencies=[Depends(authorized)])
    async def pause(req: PauseRequest | None = None):
        aborted = await _run(front.engine().pause((req or PauseRequest()).mode))
        return {"paused": True, "aborted": aborted}

    @app.post("/resume", dependencies=[Depends(authorized)])
    async def resume():
        await _run(front.engine().resume())
        return {"paused": False}

    @app.get("/is_paused", dependencies=[Depends(authorized)])
    async def is_paused():
        return {"is_paused": (await _run(front.engine().stats())).lifecycle.paused}

    @app.post("/update_weights_from_disk", dependencies=[Depends(authorized)])
    async def update_weights_from_disk(req: UpdateWeightsRequest):
        done = await _run(front.engine().update_weights_from_disk(req.model_path, version=req.version))
        return {"version": done.version, "seconds": done.seconds,
                "num_requests_recomputed": done.num_requests_recomputed,
                "num_prefix_blocks_flushed": done.num_prefix_blocks_flushed}


async def _run(call):
    """Await an engine call; its ValueError (a bad path, a tensor that does not fit) answers 400."""
    try:
        return await call
    except FileNotFoundError as e:
        raise errors.bad_request(str(e), "model_path") from e
    except Exception as e:  # noqa: BLE001 - mapped when known, raised as it is otherwise
        mapped = engine_error(e)
        if mapped is None:
            raise
        raise mapped from e
