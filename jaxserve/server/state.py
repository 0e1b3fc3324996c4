"""What both fronts share with the server process: its phase, the engine once built, the count of
streams in flight, and the scheduler's "waiting queue full" error they both turn into a refusal.
Neither front imports the other; each imports this."""

from __future__ import annotations

import asyncio
import enum

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.sched.errors import Overloaded

__all__ = ["Overloaded", "Phase", "ServerState"]


class Phase(enum.Enum):
    WARMING_UP = "warming_up"
    SERVING = "serving"
    DRAINING = "draining"
    FAILED = "failed"


class ServerState:
    """The phase and, once built, the engine; the stream count, which shutdown waits to drain."""

    def __init__(self) -> None:
        self.phase = Phase.WARMING_UP
        self.aengine: AsyncEngine | None = None
        self.active_streams = 0
        self.streams_changed = asyncio.Event()
