"""A bound on the time a client takes to send a request's headers (uvicorn has none: a connection
that sends half a request line and waits is held forever, and twenty of them hold twenty
sockets). The clock starts when the connection opens, or when the first byte of a next request
arrives on a kept-alive one (uvicorn's timeout_keep_alive bounds the idle time between); a request
whose headers are not complete within `header_timeout_s` has its connection closed.

uvicorn's h11 protocol (pure Python, always installed) is used, whatever else is installed, so
the request-start signal this relies on (`cycle`, set when h11 parsed a whole request head) is
the one tested; h11's own bound on an incomplete head (h11_max_incomplete_event_size) caps the
headers' size.
"""

from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol


def h11_with_header_timeout(header_timeout_s: float) -> type[H11Protocol]:
    class H11WithHeaderTimeout(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = None
            self._arm()     # a client that connects and sends nothing is closed too

        def _arm(self) -> None:
            self._cycle_when_armed = self.cycle
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.cycle is self._cycle_when_armed and not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()     # the first bytes of a next request on a kept-alive connection
            super().data_received(data)
            if self.cycle is not self._cycle_when_armed:
                self._disarm()  # h11 parsed a whole request head

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return H11WithHeaderTimeout
