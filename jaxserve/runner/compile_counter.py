"""Counts XLA backend compilations: in the whole process, and per engine.

"Nothing compiles while serving" is measured, not assumed. JAX reports every backend compilation
as a monitoring event in the thread that triggered it, so an engine counts the compilations of
its own calls by marking its thread while it works (`attributed_to`); a second engine built in the
same process compiles in calls that carry no mark (or its own), and never shows up in the first
engine's `stats().steps.num_compilations_after_warmup`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax
from jax._src import dispatch as _dispatch  # the event name is defined there

_lock = threading.Lock()
_count = 0
_registered = False
_current = threading.local()  # .counter: the CompileCounter the thread's work belongs to


class CompileCounter:
    """Compilations attributed to one owner (an engine)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


def _on_event(event: str, duration_secs: float, **kwargs) -> None:
    global _count
    if event == _dispatch.BACKEND_COMPILE_EVENT:
        owner = getattr(_current, "counter", None)
        with _lock:
            _count += 1
            if owner is not None:
                owner.count += 1


def install() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _registered = True


def compilations() -> int:
    """Compilations anywhere in the process since the counter was installed."""
    install()
    return _count


def current() -> CompileCounter | None:
    """The counter this thread's compilations are attributed to now (None: none), for work the
    thread hands to a pool: the pool's threads carry the mark on (executables.py)."""
    return getattr(_current, "counter", None)


@contextlib.contextmanager
def attributed_to(counter: CompileCounter | None) -> Iterator[None]:
    """Count the compilations this thread triggers inside the block in `counter` too (None: in no
    owner's count)."""
    install()
    outer = getattr(_current, "counter", None)
    _current.counter = counter
    try:
        yield
    finally:
        _current.counter = outer
