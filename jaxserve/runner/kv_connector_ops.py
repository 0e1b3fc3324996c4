"""The KV connector's block operations as a step feature: a step's loads written into the arena
and its saves gathered out of it, before the step's forward pass (sched/kv_connector.py says
which; the connector's runner side, `KVConnectorWorker.apply`, does them). They never travel to a
multi-host follower: the connector's buffers are this host's alone."""

from __future__ import annotations

from jaxserve.runner.step_feature import StepFeature


class KVConnectorOps(StepFeature):
    name = "kv_connector"
    mirrored = False

    def __init__(self, worker):
        self.worker = worker          # sched KVConnectorWorker

    def pack(self, sched_out, bucket):
        # a step that only moves blocks carries them too
        return getattr(sched_out, "kv_connector_ops", None) or None

    def before_step(self, ops) -> None:
        self.worker.apply(ops)        # writes or reads the runner's kv_caches
