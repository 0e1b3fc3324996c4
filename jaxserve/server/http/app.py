"""The FastAPI application of the OpenAI-compatible API.

Routes: POST /v1/completions, POST /v1/chat/completions, the /v1/responses routes (http/responses.py),
Anthropic's POST /v1/messages and /v1/messages/count_tokens (http/messages.py, errors in Anthropic's shape),
GET /v1/models and /v1/models/{id}, vLLM's tokenizer routes
(POST /tokenize, POST /detokenize, GET /tokenizer_info: http/tokenization.py) and the control
routes of http/control.py (pause, resume, weight updates), all behind the API key when the server
has one; GET (and HEAD) /health, GET /metrics and GET /openapi.json (open, as gRPC health and the
metrics port are: probes and scrapers carry no key). Every error, FastAPI's own included (a body
that does not parse, a field of the wrong type, an unknown route, a bug), answers in OpenAI's
error shape.
"""

from __future__ import annotations

import hmac
import logging

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.server.bearer import bearer_token
from jaxserve.server.http import errors
from jaxserve.server.http.body_limit import BodyLimit
from jaxserve.server.http.request_checks import LenientAPI
from jaxserve.server.http.control import add_control_routes
from jaxserve.server.http.embeddings import add_embeddings_route
from jaxserve.server.http.lora_routes import add_lora_routes
from jaxserve.server.http.messages import add_messages_routes
from jaxserve.server.http.json_numbers import JSONNumberRoute
from jaxserve.server.http.openai_front import OpenAIFront, as_response
from jaxserve.server.http.openapi import describe_server
from jaxserve.server.http.responses import add_responses_routes
from jaxserve.server.http.responses_store import ResponseStore
from jaxserve.server.http import tokenization
from jaxserve.server.http.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                          DetokenizeResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse)
from jaxserve.server.state import Phase

log = logging.getLogger("jaxserve.server.http")


def create_app(front: OpenAIFront, *, api_key: str | None = None, max_body_bytes: int | None = None,
               responses_store: ResponseStore | None = None, body_timeout_s: float | None = None,
               lenient_api: bool = False) -> FastAPI:
    """`body_timeout_s`: the most seconds a request body may take to arrive (408 after);
    `lenient_api`: unknown request fields are dropped with a warning instead of a 400."""
    # the OpenAPI schema is served open, as vLLM's is (it describes the API, it grants nothing)
    app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.router.route_class = JSONNumberRoute   # 16.0 is the integer 16, as the OpenAPI document says
    if max_body_bytes is not None or body_timeout_s is not None:
        app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout_s=body_timeout_s)
    if lenient_api:
        app.add_middleware(LenientAPI)
    key = api_key.encode() if api_key else None

    def authorized(request: Request) -> None:
        if key is None:
            return
        given = request.headers.get("authorization", "").encode()
        token = bearer_token(given)
        if token is None or not hmac.compare_digest(token, key):
            raise errors.unauthorized("missing bearer token" if not given else
                                      "wrong bearer token" if token is not None else
                                      "the authorization scheme is not Bearer")

    @app.exception_handler(errors.APIError)
    async def api_error(request: Request, e: errors.APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _union_member_tag(x)]
        if first.get("type") == "json_invalid":
            return errors.bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                                      "body").response()
        param = ".".join(loc) or None
        kind = first.get("type")
        if param is None and kind in _NOT_AN_OBJECT:   # about the body itself: none, or not an object
            message = ("the request body is missing: send a JSON object" if kind == "missing"
                       else f"the request body must be a JSON object: {first['msg']}")
            return errors.bad_request(message, "body").response()
        return errors.bad_request(f"{param}: {first['msg']}" if param else first["msg"], param).response()

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, e: Exception):
        # a bug: logged with its traceback here, never sent (the client gets OpenAI's shape)
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return errors.internal(f"internal error ({type(e).__name__})").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        headers = dict(getattr(e, "headers", None) or {})
        if e.status_code == 405:
            # Starlette's Allow names the first route of the path only; a path served by several
            # (GET and DELETE /v1/responses/{id}) allows every method any of them takes
            headers["Allow"] = ", ".join(allowed_methods(request.app, request.scope))
        return errors.error_response(e.status_code, str(e.detail), type="invalid_request_error",
                                     headers=headers or None)

    @app.get("/health")
    async def health():
        if front.state.phase is Phase.SERVING and front.state.aengine is not None and front.state.aengine.healthy:
            return Response(status_code=200)
        return errors.unavailable(f"the server is {front.state.phase.value}").response()

    app.head("/health", operation_id="health_head")(health)   # probes that only HEAD

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if front.metrics is None:
            return errors.error_response(404, "metrics are off", type="invalid_request_error")
        return Response(generate_latest(front.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorized)], response_model=ModelList)
    async def models():
        return await front.models()

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorized)], response_model=ModelCard)
    async def model(model_id: str):
        return await front.model_card(model_id)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(req: CompletionRequest, request: Request):
        return as_response(await front.completions(req, request))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return as_response(await front.chat_completions(req, request))

    # vLLM's tokenizer routes (http/tokenization.py), behind the key as generation is
    @app.post("/tokenize", dependencies=[Depends(authorized)], response_model=TokenizeResponse)
    async def tokenize(req: TokenizeRequest):
        aengine = front.engine()
        front.check_model(req.model, aengine)
        return await tokenization.tokenize(aengine, req, content_special_tokens=front.content_special_tokens)

    @app.post("/detokenize", dependencies=[Depends(authorized)], response_model=DetokenizeResponse)
    async def detokenize(req: DetokenizeRequest):
        aengine = front.engine()
        front.check_model(req.model, aengine)
        return await tokenization.detokenize(aengine, req)

    @app.get("/tokenizer_info", dependencies=[Depends(authorized)])
    async def tokenizer_info():
        return JSONResponse(tokenization.tokenizer_info(front.engine()))

    add_control_routes(app, front, authorized)   # /pause, /resume, /update_weights_from_disk (docs/rl.md)
    add_embeddings_route(app, front, authorized)   # POST /v1/embeddings (http/embeddings.py)
    add_lora_routes(app, front, authorized)   # POST /v1/load_lora_adapter, /v1/unload_lora_adapter (http/lora_routes.py)
    # /v1/responses (http/responses.py); stored responses kept in memory, the store's size a server setting
    add_responses_routes(app, front, authorized, responses_store if responses_store is not None else ResponseStore())
    add_messages_routes(app, front, authorized, api_key=key)   # Anthropic's /v1/messages (http/messages.py)
    describe_server(app, front, api_key=key is not None)   # /openapi.json: every status, this server's limits
    return app


_SCALAR_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _union_member_tag(part) -> bool:
    """pydantic names the member of a union a value failed (`str`, `list[str]`, `literal[...]`,
    a model's class name) in the error's location; the 400's param is the field's path alone."""
    return isinstance(part, str) and (part in _SCALAR_TAGS or "[" in part or "-" in part or part[:1].isupper())


# pydantic's error types for a body that is absent or no JSON object (loc: just "body")
_NOT_AN_OBJECT = frozenset({"missing", "model_attributes_type", "model_type", "dict_type"})


def allowed_methods(app, scope) -> list[str]:
    """Every HTTP method some route of the app takes for the request's path (a route whose path
    matches answers FULL or, for another method, PARTIAL)."""
    from starlette.routing import Match

    methods = set()
    for route in app.router.routes:
        if getattr(route, "methods", None) and route.matches(scope)[0] is not Match.NONE:
            methods |= set(route.methods)
    return sorted(methods)
