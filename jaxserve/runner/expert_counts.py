"""Expert counts: a mixture-of-experts step's routed tokens per (MoE layer, expert), read every step.

Every MoE step returns them (runner/step.py `routed_counts`: one small bincount per layer over the
step's real rows); this feature starts their copy to the host at dispatch and hands the [L_moe, E]
int32 array to the engine at collect (engine/expert_load.py adds them up for /metrics).
"""

from __future__ import annotations

import numpy as np

from jaxserve.runner.step_feature import StepFeature


class ExpertCounts(StepFeature):
    name = "expert_counts"
    step_outputs = frozenset({"routed"})
    runs_every_step = True

    def run(self, outputs, rows):
        routed = outputs["routed"]
        routed.copy_to_host_async()
        return routed

    def read(self, routed) -> np.ndarray:
        return np.asarray(routed)
