"""The engine's control plane, what RL frameworks and operators call between steps (docs/rl.md):
new weights (`update_weights`, engine/weight_update.py), `pause` / `resume`, and `sleep` /
`wake_up` (runner/sleep.py). A part of `Engine` (engine.py), on the step thread like every
Engine call; it uses the engine's scheduler, runner, output processor and held requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from jaxserve.engine import weight_update
from jaxserve.outputs import RequestOutput
from jaxserve.runner import compile_counter
from jaxserve.runner import sleep as runner_sleep

PAUSE_MODES = ("abort", "wait", "keep")


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """What one update_weights call did."""

    version: int | str | None
    seconds: float                   # checks, placement and the swap, on the calling thread
    num_requests_recomputed: int     # requests that held KV and will recompute it
    num_prefix_blocks_flushed: int   # cached prefix blocks forgotten


class EngineControl:
    """Engine's control methods (a base of Engine: the state they change is the engine's own)."""

    # -- weights and pause (docs/rl.md) ------------------------------------------------------
    def update_weights(self, update: Any, *, version: int | str | None = None) -> WeightUpdate:
        """Serve new weights from the next step on (engine/weight_update.py: a params pytree, or
        (checkpoint name, array) pairs). Nothing compiles: the steps take the params as an
        argument. KV computed under the old weights is never read again: requests holding KV go
        back to the waiting queue and recompute theirs (they keep their outputs), and the prefix
        cache is flushed. Every check runs first: a bad update raises ValueError, changes nothing."""
        if version is not None and (isinstance(version, bool) or not isinstance(version, (int, str))):
            raise ValueError(f"version must be an int, a str or None, got {version!r}")
        if self.runner.step_mirror is not None:
            raise RuntimeError("update_weights is not built for an engine on several hosts (the followers would "
                               "keep the old weights)")
        if self.kv_connector is not None:
            raise RuntimeError("update_weights is not built for disaggregated prefill/decode roles (a KV transfer "
                               "between two weight versions is not guarded)")
        t0 = time.perf_counter()
        new = weight_update.new_params(self.runner, update, requantize=self.requantize)
        self._drain()
        recomputed = self.scheduler.recompute_all()
        flushed = self.scheduler.stats().num_kv_blocks_cached
        if not self.scheduler.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be flushed: blocks are still held")  # a bug
        self.runner.params = new
        self.weights_version = version
        self.num_weight_updates += 1
        return WeightUpdate(version=version, seconds=time.perf_counter() - t0,
                            num_requests_recomputed=recomputed, num_prefix_blocks_flushed=flushed)

    def pause(self, mode: str = "abort") -> list[str]:
        """Stop stepping. mode: "abort" ends every request in flight or held (finish_reason
        "abort"; returns their ids); "wait" lets the requests in flight run to their end first
        (paused once they have: `paused`, meanwhile `pausing`); "keep" holds them where they are,
        to continue after resume() (under new weights if update_weights ran meanwhile). Requests
        added while paused or pausing are accepted and held until resume()."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        aborted: list[str] = []
        if mode == "wait":
            self.pausing = not self.paused and self.has_unfinished_requests()
            self.paused = not self.pausing
            return aborted
        self._drain()
        if mode == "abort":
            aborted = self.outputs.request_ids() + [h[0] for h in self._held]
            self.abort(aborted)
        self.pausing, self.paused = False, True
        return aborted

    def resume(self) -> list[tuple[str, Exception]]:
        """Step again; the requests held while paused are queued now, in the order they came.
        Returns those that could not be (their id and the error, e.g. the queue is full)."""
        self.paused = self.pausing = False
        held, self._held = self._held, []
        failed = []
        for request_id, req, arrival_time, kv_transfer in held:
            try:
                self.add_processed(request_id, req, arrival_time=arrival_time,
                                   **({"kv_transfer": kv_transfer} if kv_transfer is not None else {}))
            except Exception as e:  # noqa: BLE001 - each held request fails alone, as at the door
                failed.append((request_id, e))
        return failed

    def take_drained(self) -> list[RequestOutput]:
        """Outputs of a step collected outside step() (by pause or update_weights), not yet returned."""
        out, self._drained = self._drained, []
        return out

    def _drain(self) -> None:
        """Collect the step in flight (the one-step-ahead loop's), keeping its outputs for the caller."""
        behind, self._in_flight = self._in_flight, None
        if behind is not None:
            with compile_counter.attributed_to(self._compilations):
                self._drained += self._finish(behind)

    # -- sleep and wake up (runner/sleep.py, docs/rl.md) ---------------------------------------
    @property
    def asleep(self) -> bool:
        """Between sleep() and wake_up(): no step runs (the runner's, so engines sharing it agree)."""
        return self.runner.sleep_state is not None

    def sleep(self, level: int = 1) -> runner_sleep.SleepReport:
        """Give the device memory back until wake_up(): level 0 frees the KV arena, 1 also moves the
        weights to host memory, 2 drops them (update_weights must bring new ones before wake_up).
        Refused while requests run unless the engine is paused: then requests kept ("keep") lose
        their KV and recompute it after wake_up and resume, as after update_weights. The prefix
        cache is flushed (the arena's contents are gone). Requests added while asleep wait for
        wake_up. Returns the bytes released (runner/sleep.py)."""
        if level not in runner_sleep.LEVELS:
            raise ValueError(f"sleep level must be one of {runner_sleep.LEVELS}, got {level!r}")
        if self.asleep:
            raise RuntimeError(f"the engine is asleep already (level {self.runner.sleep_state.level}): wake_up() first")
        if self.pausing or (not self.paused and self.has_unfinished_requests()):
            raise RuntimeError("cannot sleep while requests are running: let them finish, or pause() first "
                               "(\"abort\" ends them; \"keep\" holds them to recompute after wake_up and resume)")
        if self.runner.step_mirror is not None:
            raise RuntimeError("sleep is not built for an engine on several hosts (the followers would keep "
                               "their memory)")
        if self.kv_connector is not None:
            raise RuntimeError("sleep is not built for disaggregated prefill/decode roles (leases hold arena blocks)")
        if self.background_warm_up is not None:
            self.background_warm_up.join()    # its first runs read the weights that sleep lets go
        t0 = time.perf_counter()
        self._drain()
        self.scheduler.recompute_all()
        if not self.scheduler.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be flushed: blocks are still held")  # a bug
        runners = [self.runner] + ([self.draft_runner] if self.draft_runner is not None else [])
        with compile_counter.attributed_to(self._compilations):
            released = [r.sleep(level) for r in runners]
        return runner_sleep.report(level, released, time.perf_counter() - t0)

    def wake_up(self) -> runner_sleep.WakeUpReport:
        """Take the arena (zeroed) and the weights back; nothing compiles. After sleep(level=2)
        every weight must have come with update_weights first (else ValueError, still asleep).
        Awake already: nothing to do."""
        t0 = time.perf_counter()
        runners = [r for r in [self.runner, self.draft_runner] if r is not None and r.sleep_state is not None]
        for r in runners:
            r.check_can_wake()
        kv = weights = 0
        with compile_counter.attributed_to(self._compilations):
            for r in runners:
                a, w = r.wake_up()
                kv, weights = kv + a, weights + w
        return runner_sleep.WakeUpReport(kv_cache_bytes=kv, weight_bytes=weights, seconds=time.perf_counter() - t0)
