"""Holding the engine still, so that what a test sees cannot depend on the machine's speed.

The tiny model decodes a token in a millisecond on a fast machine and in a second on a loaded one,
so a test that needs a request in flight (to abort it, to fill every seat or stream slot, to drain
it) must not race a wall-clock window against it. `StepGate` wraps an engine's `step()`: while the
gate is closed the engine runs only the steps that bring a new request to its first output (admit
it to a free seat, prefill it and, one step ahead, the step that returns that output); a request
that has returned something stays where it is until the gate opens. A closed gate's idle turn
returns no outputs, so the step loop still takes commands (adds, aborts, stats) between turns.

`serve_gated()` runs `jaxserve serve` with its warm-up held and a StepGate on its engine, driven by
lines on stdin; `ServerProcess(..., gated=True)` starts it and sends them. This file imports nothing
from tests/: the server process loads it by path.
"""

from __future__ import annotations

import sys
import threading

IDLE_TURN_S = 0.005   # a closed gate's idle turn: a polling interval, never a bound on speed


class StepGate:
    def __init__(self, engine, *, closed: bool = True) -> None:
        self._engine = engine
        self._max_num_seqs = engine.scheduler.config.max_num_seqs
        self._open = threading.Event()
        if not closed:
            self._open.set()
        self._silent: set[str] = set()   # added, accepted, nothing returned yet
        # add_processed: where every request enters, through add_request or the AsyncEngine's door
        self._step, self._add, self._abort = engine.step, engine.add_processed, engine.abort
        engine.step, engine.add_processed, engine.abort = self._gated_step, self._add_processed, self._abort_requests

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._open.clear()

    # the engine's own calls, all on its step thread
    def _add_processed(self, *args, **kwargs):
        request_id = self._add(*args, **kwargs)
        self._silent.add(request_id)
        return request_id

    def _abort_requests(self, request_ids) -> None:
        self._silent.difference_update([request_ids] if isinstance(request_ids, str) else list(request_ids))
        self._abort(request_ids)

    def _gated_step(self):
        if not (self._open.is_set() or self._a_new_request_needs_a_step()):
            self._open.wait(IDLE_TURN_S)
            return []
        outputs = self._step()
        for out in outputs:
            self._silent.discard(out.request_id)
        return outputs

    def _a_new_request_needs_a_step(self) -> bool:
        s = self._engine.stats()
        waiting, running = s.scheduler.num_waiting, s.scheduler.num_running
        admitted_but_silent = len(self._silent) > waiting   # every waiting request is still silent
        # seats: max_num_seqs, or fewer while buckets still warm in the background (sched/step_cap.py)
        cap = getattr(self._engine.scheduler, "step_cap", None)
        seats = self._max_num_seqs if cap is None else min(cap.seats, self._max_num_seqs)
        a_seat_for_a_waiter = waiting > 0 and running < seats
        return admitted_but_silent or a_seat_for_a_waiter


def serve_gated() -> int:
    """`jaxserve serve` (arguments from sys.argv) whose warm-up starts on `warm-up` and whose
    StepGate closes on `hold` and opens on `release`, each a line on stdin. Every command is
    acknowledged on stdout (the server's log) as `step gate: <line>` once it took effect."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")   # as jaxserve.cli.main does, before anything loads
    import jaxserve.engine.builder as builder
    from jaxserve.cli import main

    warm_up, gates = threading.Event(), []
    build_engine = builder.build_engine

    def held_build_engine(*args, **kwargs):
        warm_up.wait()
        engine = build_engine(*args, **kwargs)
        gates.append(StepGate(engine, closed=False))
        return engine

    def obey() -> None:
        for line in sys.stdin:
            command = line.split()[0]
            if command == "warm-up":
                warm_up.set()
            elif command == "hold":
                gates[0].close()
            elif command == "release":
                gates[0].open()
            print(f"step gate: {line.strip()}", flush=True)

    builder.build_engine = held_build_engine   # run_server looks it up when it starts building
    threading.Thread(target=obey, name="step-gate-commands", daemon=True).start()
    return main()
