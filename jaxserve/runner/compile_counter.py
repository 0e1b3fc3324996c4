"""Counts XLA backend compilations anywhere in the process (steps, sampling, copies).

"Nothing compiles while serving" is measured, not assumed: the engine snapshots this counter when
warmup ends, and `stats().num_compilations_after_warmup` is the difference.
"""

from __future__ import annotations

import threading

import jax
from jax._src import dispatch as _dispatch  # the event name is defined there

_lock = threading.Lock()
_count = 0
_registered = False


def _on_event(event: str, duration_secs: float, **kwargs) -> None:
    global _count
    if event == _dispatch.BACKEND_COMPILE_EVENT:
        with _lock:
            _count += 1


def install() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _registered = True


def compilations() -> int:
    install()
    return _count
