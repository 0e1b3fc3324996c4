"""LoRASlots: which adapter each device slot holds, who uses it, and which slot to give up next.

The engine serves LoRA adapters from N fixed slots on the device (slot 0 is the base model and
holds nothing). A waiting request under an adapter is admitted only with a slot for it: the one
its adapter already occupies, else a free one, else the least recently used slot no running
request holds (its adapter is evicted: the host registry keeps its weights, so loading it again
reads no file). When every slot is held by running requests, the request waits, and others
(the base model, resident adapters) go past it until it has waited `starvation_steps`; then
nothing is admitted behind it, so the slots drain and it gets one. It never fails for want of a
slot.

A slot is held from admission to the request's end or preemption; a step already dispatched
keeps the slot arrays it was given, so a slot freed while such a step is in flight may be
written at once. What to write is the `loads` of the step (SchedulerOutput.lora_loads): the
runner writes them before the step runs. A component of the scheduler, like admission.py: pure
Python, no jax.
"""

from __future__ import annotations

import itertools

from jaxserve.sched.request import Request


class LoRASlots:
    def __init__(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots={num_slots!r} must be a positive integer")
        self.num_slots = num_slots
        n = num_slots + 1                                   # index 0: the base model, never used
        self._resident: list[str | None] = [None] * n        # slot -> adapter key
        self._slot_of: dict[str, int] = {}                   # adapter key -> slot
        self._users: list[set[str]] = [set() for _ in range(n)]   # slot -> request ids holding it
        self._held: dict[str, int] = {}                      # request id -> its slot
        self._last_used: list[int] = [0] * n
        self._clock = itertools.count(1)
        self._loads: list[tuple[int, str]] = []
        self.num_loads = 0
        self.num_evictions = 0

    # ---- admission ----------------------------------------------------------------------------
    def can_admit(self, req: Request) -> bool:
        """Whether req could take a slot now (the base model always can)."""
        return req.lora_key is None or req.lora_key in self._slot_of or self._victim() is not None

    def acquire(self, req: Request) -> int:
        """Give req its adapter's slot (loading the adapter into a free or evicted slot if it is
        not resident); call only after can_admit and a successful admission. Returns the slot."""
        key = req.lora_key
        if key is None:
            return 0
        if req.request_id in self._held:
            return self._held[req.request_id]
        slot = self._slot_of.get(key)
        if slot is None:
            slot = self._victim()
            if slot is None:
                raise RuntimeError(f"request {req.request_id!r}: no LoRA slot is free (check can_admit first)")
            old = self._resident[slot]
            if old is not None:
                del self._slot_of[old]
                self.num_evictions += 1
            self._resident[slot] = key
            self._slot_of[key] = slot
            self._loads.append((slot, key))
            self.num_loads += 1
        self._users[slot].add(req.request_id)
        self._held[req.request_id] = slot
        self._last_used[slot] = next(self._clock)
        return slot

    def release(self, req: Request) -> None:
        """req ended or was preempted: it no longer holds its slot (idempotent)."""
        slot = self._held.pop(req.request_id, None)
        if slot is not None:
            self._users[slot].discard(req.request_id)
            self._last_used[slot] = next(self._clock)

    def slot_of(self, req: Request) -> int:
        return self._held.get(req.request_id, 0)

    def _victim(self) -> int | None:
        """An empty slot, else the least recently used one nobody holds, else None."""
        best = None
        for s in range(1, self.num_slots + 1):
            if self._users[s]:
                continue
            if self._resident[s] is None:
                return s
            if best is None or self._last_used[s] < self._last_used[best]:
                best = s
        return best

    # ---- the step and the registry ------------------------------------------------------------
    def take_loads(self) -> tuple[tuple[int, str], ...]:
        """(slot, adapter key) pairs assigned since the last call: the runner writes them."""
        loads, self._loads = tuple(self._loads), []
        return loads

    def forget(self, key: str) -> None:
        """An adapter left the registry: its slot is free once its running requests end."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._resident[slot] = None

    def resident(self) -> dict[int, str]:
        """slot -> adapter key, for the slots holding one."""
        return {s: k for s, k in enumerate(self._resident) if k is not None}

    def num_held(self) -> int:
        return sum(1 for s in range(1, self.num_slots + 1) if self._users[s])
