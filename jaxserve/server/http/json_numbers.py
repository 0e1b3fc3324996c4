"""Request bodies parsed as JSON Schema reads numbers: `16.0` is an integer.

The request models are strict (schemas._Request: no "16" for 16, no true for 1), and pydantic's
strict int refuses the float 16.0, which JSON Schema, and so the OpenAPI document the models
generate, calls an integer. Parsing a number with a zero fraction as a Python int makes the
server take what its document promises; a float field still takes it (a strict float takes an
int), and a number with a fraction stays a float, refused by an int field as before.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request


def _number(text: str) -> int | float:
    value = float(text)
    return int(value) if math.isfinite(value) and value.is_integer() else value


class _Request(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = json.loads(await self.body(), parse_float=_number)
        return self._json


class JSONNumberRoute(APIRoute):
    """The app's route class (app.router.route_class): every handler reads its body as above."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(_Request(request.scope, request.receive))

        return route
