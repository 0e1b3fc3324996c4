"""ExpertLoad: running totals and the window of a MoE model's routed tokens per expert, and the
Prometheus series the server derives from them."""

import types

import numpy as np
from prometheus_client import generate_latest

from jaxserve.engine.expert_load import ExpertLoad
from jaxserve.engine.stats import EngineStats, ExpertLoadStats
from tests.engine.idle_stats import idle_scheduler_stats


def test_the_window_forgets_old_steps_and_the_totals_do_not():
    load = ExpertLoad(window_steps=2)
    assert load.window_per_expert == () and load.imbalance == 0.0
    load.add(np.array([[4, 0, 0, 0], [1, 1, 1, 1]]))       # 2 MoE layers, 4 experts
    assert load.imbalance == 4.0                           # layer 0: one expert took all
    load.add(np.array([[1, 1, 1, 1], [1, 1, 1, 1]]))
    load.add(np.array([[1, 1, 1, 1], [2, 2, 0, 0]]))
    assert load.window_per_expert == (5, 5, 3, 3)          # the first step left the window
    assert load.total_per_expert == (10, 6, 4, 4)
    assert load.imbalance == 1.5                           # layer 1 over the window: 3 / 2


def test_prometheus_reports_each_experts_tokens_and_the_imbalance():
    from jaxserve.server.metrics import ServerMetrics

    stats = EngineStats(idle_scheduler_stats(),
                        experts=ExpertLoadStats(tokens_window=(3, 1), tokens_total=(7, 2), imbalance=1.5))
    snap = types.SimpleNamespace(stats=stats, taken_at=0.0, finished_by_reason={})
    text = generate_latest(ServerMetrics(lambda: snap).registry).decode()
    assert 'jaxserve_expert_routed_tokens_total{expert="0"} 7.0' in text
    assert 'jaxserve_expert_routed_tokens_total{expert="1"} 2.0' in text
    assert "jaxserve_expert_load_imbalance 1.5" in text
