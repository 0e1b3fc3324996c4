"""Scheduling policy: the order of the waiting queue, and who is evicted when blocks run out.

Queue order. Under "fcfs" a request's key is its arrival number. Under "priority" the classes
(priority values, lower = more urgent) share the scheduler by weighted fair queuing: a request gets
a start tag, the later of the system's virtual time and the finish tag of the previous request of
its class, and its class's finish tag advances by the request's cost (prompt + max_tokens) over
the class weight (`priority_weight_base ** -priority`). Requests are admitted in start-tag order,
so an urgent class gets `base` times the share of the next one, and a background request's tag is
reached in bounded time however many urgent ones arrive: slowed, never starved. Keys are fixed at
arrival, so a preempted request goes back in front of everything that arrived after it.

Victims. When a running request needs a block and none is left, the victim is the least urgent
running request (highest priority value), then the one whose eviction loses the least computed
work, then the most recently admitted.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.sched.request import Request


class FairShare:
    """Start-time fair queuing over priority classes."""

    def __init__(self, weight_base: float) -> None:
        self.weight_base = float(weight_base)
        self.virtual_time = 0.0  # start tag of the request admitted last
        self._finish: dict[int, float] = {}  # class -> finish tag of its latest request

    def weight(self, priority: int) -> float:
        return max(self.weight_base ** -max(min(priority, 60), -60), 1e-30)

    def start_tag(self, req: Request) -> float:
        start = max(self.virtual_time, self._finish.get(req.priority, 0.0))
        cost = req.num_prompt_tokens + req.max_tokens
        self._finish[req.priority] = start + cost / self.weight(req.priority)
        return start

    def admitted(self, start_tag: float) -> None:
        self.virtual_time = max(self.virtual_time, start_tag)


def pick_victim(running: Sequence[Request]) -> Request:
    """Least urgent first, then least computed work lost, then most recently admitted."""
    best_i = max(
        range(len(running)),
        key=lambda i: (running[i].priority, -running[i].num_computed_tokens, i),
    )
    return running[best_i]
