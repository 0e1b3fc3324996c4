"""An OpenAI-compatible HTTP server (jaxserve's, llama.cpp's llama-server, vLLM, ...) as a
`jaxserve bench serve` target: `--target NAME=http://HOST:PORT`.

Each request is one streamed `POST /v1/completions` carrying the token ids the gRPC targets get
(`prompt` as a list of ints, which OpenAI's API, jaxserve, llama-server and vLLM accept), or with
`--http-prompt text` their detokenized text, for a server that takes only strings. The body asks
for exactly what the gRPC targets ask: greedy (`temperature: 0`), `max_tokens` output tokens with
`ignore_eos: true` (jaxserve, vLLM and llama-server read it; llama-server reads `max_tokens` as its
`n_predict`; no `min_tokens`, which llama-server does not know), and `stream_options:
{"include_usage": true}` for the server's own token count. Fields only one server knows are never
sent: jaxserve refuses unknown fields.

Times are stamped as SSE chunks arrive (sse_completions.py). A chunk's text may hold several
tokens and carries no ids, so the stream yields a `TextChunk` per non-empty chunk and ends with a
`TokenCount` from `usage.completion_tokens` (loadgen.py): TTFT is the first non-empty chunk, ITL
the gaps between chunks, token totals the server's. A stream that fails (a non-200 answer, an
error event, a body closed before `[DONE]`, no usage, nothing for `read_timeout_s`) raises, and the
load generator counts the request failed with that reason. There is no checkpoint identity over
HTTP: `GET /v1/models` names the model, and that id is recorded, not checked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable
from urllib.parse import urlparse

from jaxserve.bench.loadgen import StreamFn, StreamItem, TextChunk, TokenCount
from jaxserve.bench.sse_completions import StreamFailed, completion_events

PROMPT_MODES = ("ids", "text")


def is_http_address(address: str) -> bool:
    return address.startswith(("http://", "https://"))


def base_url(address: str) -> str:
    """`http://host:port[/prefix][/v1][/]` -> `http://host:port[/prefix]` (the paths add /v1)."""
    u = urlparse(address)
    if u.scheme not in ("http", "https") or not u.netloc:
        raise ValueError(f"{address!r} is not an http:// or https:// URL")
    path = u.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return f"{u.scheme}://{u.netloc}{path}"


@dataclass(frozen=True, slots=True)
class HTTPTarget:
    url: str                             # base_url(): no /v1
    api_key: str | None = None
    prompt: str = "ids"                  # "ids": token ids; "text": their detokenized text
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0        # the longest silence a stream may keep (queued, or a stalled server)

    def __post_init__(self) -> None:
        if self.prompt not in PROMPT_MODES:
            raise ValueError(f"prompt must be one of {PROMPT_MODES}, got {self.prompt!r}")
        if self.read_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def timeout(self):
        import httpx2

        # pool=None: requests never queue for a connection in the client (the limits are none
        # either): what waits, waits at the server, where the benchmark means to measure it
        return httpx2.Timeout(connect=self.connect_timeout_s, read=self.read_timeout_s, write=30.0, pool=None)

    def async_client(self):
        import httpx2

        # trust_env=False: no proxy from the environment between the benchmark and the server
        return httpx2.AsyncClient(timeout=self.timeout(), trust_env=False,
                                  limits=httpx2.Limits(max_connections=None, max_keepalive_connections=None))


class TargetUnreachable(RuntimeError):
    pass


def served_model(target: HTTPTarget) -> str:
    """The first model id of GET /v1/models: the `model` of every request, and the run's record."""
    import httpx2

    try:
        with httpx2.Client(timeout=target.timeout(), trust_env=False) as c:
            resp = c.get(f"{target.url}/v1/models", headers=target.headers)
    except httpx2.HTTPError as e:
        raise TargetUnreachable(f"GET {target.url}/v1/models: {type(e).__name__}: {e}") from e
    if resp.status_code != 200:
        raise TargetUnreachable(f"GET {target.url}/v1/models answered {resp.status_code}: {resp.text[:300]}")
    try:
        models = resp.json()["data"]
        return str(models[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise TargetUnreachable(f"GET {target.url}/v1/models: no model id in {resp.text[:300]!r}") from e


def completion_body(model: str, prompt: list[int] | str, params: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": params["max_tokens"],
                            "temperature": params.get("temperature", 0.0), "stream": True,
                            "stream_options": {"include_usage": True}}
    if params.get("ignore_eos"):
        body["ignore_eos"] = True
    if params.get("cache_salt"):
        body["cache_salt"] = params["cache_salt"]   # --salt-per-target (jaxserve and vLLM read it)
    return body


def completion_stream(client, target: HTTPTarget, model: str,
                      detokenize: Callable[[list[int]], str] | None = None) -> StreamFn:
    """The load generator's stream over one httpx2.AsyncClient (of the running event loop)."""
    if target.prompt == "text" and detokenize is None:
        raise ValueError("--http-prompt text needs a tokenizer to detokenize the prompts")

    async def stream(prompt_token_ids: list[int], params: dict[str, Any]) -> AsyncIterator[StreamItem]:
        prompt = detokenize(prompt_token_ids) if target.prompt == "text" else list(prompt_token_ids)
        body = completion_body(model, prompt, params)
        async with client.stream("POST", f"{target.url}/v1/completions", json=body, headers=target.headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                raise StreamFailed(f"HTTP {resp.status_code}: {text[:300]}")
            counted, any_text, last = None, False, None
            async for ev in completion_events(resp.aiter_lines()):
                last = time.perf_counter()
                if ev.text:
                    any_text = True
                    yield TextChunk(last)
                if ev.completion_tokens is not None:
                    counted = ev.completion_tokens
        if counted is None:
            raise StreamFailed("the stream ended without usage.completion_tokens")
        if counted and not any_text and last is not None:
            yield TextChunk(last)   # every token decoded to no text: the last chunk is the first output seen
        yield TokenCount(counted)

    return stream


async def run_http_load(target: HTTPTarget, model: str, requests, max_concurrency: int | None, progress: bool,
                        failures: dict[str, str], detokenize: Callable[[list[int]], str] | None = None,
                        wrap: Callable[[StreamFn], StreamFn] | None = None):
    """run_load (loadgen.py) through one client opened and closed on this event loop."""
    from jaxserve.bench.loadgen import run_load

    async with target.async_client() as client:
        stream = completion_stream(client, target, model, detokenize)
        return await run_load(wrap(stream) if wrap else stream, requests, max_concurrency, progress, failures)
