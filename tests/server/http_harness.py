"""An OpenAI-compatible HTTP server on loopback for the HTTP tests: the real app and uvicorn
listener in a thread of their own (their event loop), on an engine sharing the tiny compiled
runner, with a StepGate on it so a test can hold requests in flight without racing the clock.
References computed with that LLM go through `HTTPServer.reference` (one arena, two prefix caches)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jaxserve import LLM
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.server.request_caps import RequestCaps
from jaxserve.server.http.app import create_app
from jaxserve.server.http.listener import HTTPListener
from tests.server.server_process import wait_until  # noqa: F401  (the HTTP tests import it from here)
from jaxserve.server.http.openai_front import OpenAIFront
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.vllm_metrics import serve_vllm_names
from jaxserve.server.state import Phase, ServerState
from tests.server.step_gate import StepGate

API_KEY = "test-key"
HANG_GUARD_S = 120   # turns a hang into a failure; never a bound on how fast anything is


class HTTPServer:
    # create_app's and HTTPListener's keyword options (timeouts, lenient_api): a subclass sets them
    app_options: dict = {}
    listener_options: dict = {}

    def __init__(self, tiny_llm, *, api_key: str | None = API_KEY, max_n: int = 4, max_body_bytes: int = 1 << 20,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None, share_runner: bool = True,
                 metrics_names: str = "both", **engine_overrides):
        """share_runner=False: serve `tiny_llm`'s own engine (one that cannot share its runner, e.g.
        with LoRA slots); the LLM must then not be used while the server runs, and `reference` is off."""
        self.max_body_bytes = max_body_bytes
        self._shared = tiny_llm if share_runner else None
        self.engine = LLM.sharing_runner(tiny_llm, **engine_overrides).engine if share_runner else tiny_llm.engine
        self.gate = StepGate(self.engine, closed=False)
        self.state = ServerState()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="http-test-loop", daemon=True)
        self._thread.start()
        self.metrics = ServerMetrics(lambda: self.state.aengine.snapshot if self.state.aengine else None)
        serve_vllm_names(self.metrics.registry, metrics_names, lambda: self.state.aengine)   # as the server does
        self.front = OpenAIFront(self.state, limits=RequestCaps(max_n=max_n), metrics=self.metrics,
                                 max_concurrent_streams=64, tool_call_parser=tool_call_parser,
                                 reasoning_parser=reasoning_parser)
        self.api_key = api_key
        self.listener = self.run(self._start())
        self.base_url = f"http://127.0.0.1:{self.listener.port}/v1"
        self.model = self.engine.model_name

    async def _start(self) -> HTTPListener:
        self.state.aengine = AsyncEngine(self.engine)
        self.state.aengine.start()
        self.state.phase = Phase.SERVING
        listener = HTTPListener(create_app(self.front, api_key=self.api_key, max_body_bytes=self.max_body_bytes,
                                           **self.app_options), "127.0.0.1", 0, **self.listener_options)
        await listener.start()
        return listener

    def run(self, coro):
        """Run a coroutine on the server's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(HANG_GUARD_S)

    def stats(self):
        return self.run(self.state.aengine.stats())

    def reference(self, fn):
        """fn(the LLM whose runner this server shares): the two engines write one KV arena, so each
        one's prefix cache is forgotten around the other's work (a hit would read overwritten K/V).
        fn runs on the server's step thread once its engine has nothing left to do (a stream the
        client already has may still have its last step to run), so the two engines never step
        at once: each would find the other's requests in the arena."""
        self.wait_idle()

        def between_steps(engine):
            self._shared.engine.reset_prefix_cache()
            try:
                return fn(self._shared)
            finally:
                self._shared.engine.reset_prefix_cache()
                engine.reset_prefix_cache()

        return self.run(self.state.aengine.call(between_steps))

    def wait_idle(self) -> None:
        """Until the server's engine has no request and no step in flight (polled on its step
        thread; HANG_GUARD_S turns a request that never ends into a failure)."""
        deadline = time.monotonic() + HANG_GUARD_S
        while self.run(self.state.aengine.call(lambda engine: engine.has_unfinished_requests())):
            if time.monotonic() > deadline:
                raise AssertionError(f"the server's engine still has requests after {HANG_GUARD_S} s")
            time.sleep(0.01)

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=kw.pop("api_key", self.api_key or "none"),
                             max_retries=0, timeout=HANG_GUARD_S, **kw)

    def anthropic_client(self, **kw):
        """The official `anthropic` client for this server (it sends the key as Authorization: Bearer)."""
        import anthropic

        if "auth_token" not in kw:
            kw.setdefault("api_key", self.api_key or "none")
        return anthropic.Anthropic(base_url=self.base_url.removesuffix("/v1"), max_retries=0, timeout=HANG_GUARD_S,
                                   **kw)

    def close(self) -> None:
        self.gate.open()
        self.run(self.listener.stop())
        self.run(self.state.aengine.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(HANG_GUARD_S)
        if self._shared is not None:
            self._shared.engine.reset_prefix_cache()   # this server wrote into blocks it may index


def blocks_all_free(stats) -> bool:
    """Nothing holds a KV block: every block is free or an evictable cached prefix."""
    return stats.scheduler.num_kv_blocks_free + stats.scheduler.num_kv_blocks_cached == stats.scheduler.num_kv_blocks_total


def serving(llm: str = "tiny_llm", **engine_kwargs):
    """A test module's `server` and `client` fixtures (module scope): an HTTPServer over the shared
    engine of the fixture named `llm` (engine_kwargs: HTTPServer's options and its own scheduler's)
    and an `openai` client for it. Use as `server, client = serving()`."""
    @pytest.fixture(scope="module")
    def server(request):
        s = HTTPServer(request.getfixturevalue(llm), **engine_kwargs)
        yield s
        s.close()

    @pytest.fixture(scope="module")
    def client(server):
        with server.client() as c:
            yield c

    return server, client
