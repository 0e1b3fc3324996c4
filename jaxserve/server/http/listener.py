"""uvicorn serving the HTTP app inside the server's own event loop, beside gRPC.

The socket is bound before the engine is built, like the gRPC port, so /health answers 503 during
warm-up. uvicorn would install its own SIGTERM/SIGINT handlers; the server owns those signals (they
start its drain, which then stops this listener), so uvicorn's are turned off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn

from jaxserve.server.http.slow_headers import h11_with_header_timeout

log = logging.getLogger("jaxserve.server")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
KEEP_ALIVE_S = 5


class _InLoopServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HTTPListener:
    def __init__(self, app, host: str, port: int, *, shutdown_timeout_s: float = 5.0,
                 header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S):
        # a slow client is bounded at every stage: its headers (header_timeout_s), its body (the
        # app's BodyLimit), the idle time between its requests (timeout_keep_alive) and the size
        # of a request head (h11's 16 KiB bound on an incomplete event)
        config = uvicorn.Config(app, host=host, port=port, lifespan="off", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=shutdown_timeout_s, timeout_keep_alive=KEEP_ALIVE_S,
                                http=h11_with_header_timeout(header_timeout_s))
        self._server = _InLoopServer(config)
        try:
            self._socket = config.bind_socket()
        except (OSError, SystemExit) as e:   # uvicorn exits on a port in use; the CLI reports ValueErrors
            raise ValueError(f"cannot listen on {host}:{port} (HTTP): {e}") from e
        self.host = host
        self.port = self._socket.getsockname()[1]
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():        # failed to start: raise its error
                self._task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        log.info("HTTP (OpenAI-compatible API) on http://%s:%d/v1", self.host, self.port)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
