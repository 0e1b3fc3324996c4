"""How a mixture-of-experts model's tokens spread over its experts: the load an operator asks about
first (one hot expert sets the pace of every step under expert parallelism).

Each MoE step returns its routed tokens per (MoE layer, expert) from the device (runner/step.py's
`routed_counts`, read with the sampled tokens); this keeps their running totals and the sum over
the last `window_steps` steps."""

from __future__ import annotations

from collections import deque

import numpy as np

WINDOW_STEPS = 256


class ExpertLoad:
    def __init__(self, window_steps: int = WINDOW_STEPS) -> None:
        self._steps: deque[np.ndarray] = deque(maxlen=window_steps)
        self._window: np.ndarray | None = None     # [L_moe, E] over the steps in the deque
        self._total: np.ndarray | None = None      # [L_moe, E] since start

    def add(self, routed: np.ndarray) -> None:
        routed = np.asarray(routed, np.int64)
        if self._window is None:
            self._window, self._total = np.zeros_like(routed), np.zeros_like(routed)
        if len(self._steps) == self._steps.maxlen:
            self._window -= self._steps[0]        # the deque drops it on append
        self._steps.append(routed)
        self._window += routed
        self._total += routed

    @property
    def window_per_expert(self) -> tuple[int, ...]:
        """Tokens routed to each expert over the window, summed over the MoE layers."""
        return () if self._window is None else tuple(int(x) for x in self._window.sum(axis=0))

    @property
    def total_per_expert(self) -> tuple[int, ...]:
        return () if self._total is None else tuple(int(x) for x in self._total.sum(axis=0))

    @property
    def imbalance(self) -> float:
        """The worst layer's busiest expert over its mean, over the window: 1.0 is perfectly even,
        E means one expert took every token; 0.0 before any MoE token."""
        if self._window is None or not self._window.any():
            return 0.0
        mean = self._window.mean(axis=1)
        busy = mean > 0
        return float((self._window.max(axis=1)[busy] / mean[busy]).max())
