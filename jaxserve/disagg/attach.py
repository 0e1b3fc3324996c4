"""Wiring an engine for its role, from its EngineConfig: `role="prefill"` holds finished prompts'
KV for decode engines, `role="decode"` loads it; "both" (the default) is the colocated engine,
untouched. Called by the engine builder (engine/builder.py), so `jaxserve serve --role ...` and
`LLM(role=...)` get the same connector."""

from __future__ import annotations

import logging
import time

from jaxserve.config import EngineConfig
from jaxserve.disagg.connector import DisaggConnector, TransferMetrics
from jaxserve.disagg.handshake import KVLayout
from jaxserve.disagg.receiver import KVReceiver
from jaxserve.disagg.sender import KVSender
from jaxserve.disagg.transport import KVClient
from jaxserve.runner.kv_transfer import BlockLayout, KVTransfer
from jaxserve.sched.kv_cache_manager import cdiv

log = logging.getLogger(__name__)
ROLES = ("both", "prefill", "decode")


def local_layout(engine, role: str) -> KVLayout:
    return KVLayout(BlockLayout.of(engine.runner.arena_spec), engine.checkpoint_identity, role)


def build_connector(engine, config: EngineConfig, *, client_metadata: tuple = ()) -> DisaggConnector | None:
    """The KV connector of `config.disagg.role` for `engine` (None for "both"), its transfers compiled now.
    `client_metadata`: sent with a decode engine's calls to its prefill peers."""
    role = config.disagg.role
    if role not in ROLES:
        raise ValueError(f"role={role!r} must be one of {ROLES}")
    if role == "both":
        return None
    t = time.perf_counter()
    transfer = KVTransfer(engine.runner, cdiv(engine.max_model_len, engine.scheduler.config.block_size))
    transfer.compile_all()
    log.info("%s role: KV transfer buckets %s compiled in %.1f s", role, transfer.buckets, time.perf_counter() - t)
    metrics = TransferMetrics()
    sender = receiver = None
    if role == "prefill":
        sender = KVSender(transfer, engine.scheduler.free_held_blocks, config.disagg.kv_lease_s)
    else:
        receiver = KVReceiver(transfer, local_layout(engine, role), KVClient(client_metadata),
                              timeout_s=config.disagg.kv_load_timeout_s, lease_s=config.disagg.kv_lease_s,
                              on_transfer=metrics.observe)
    return DisaggConnector(sender, receiver, metrics)


def attach_connector(engine, config: EngineConfig, *, client_metadata: tuple = ()) -> DisaggConnector | None:
    """Give `engine` (and its scheduler) the connector of `config.disagg.role`, with the load failure
    policy; a colocated engine ("both") is left as it is. The scheduler and the engine then call
    its scheduler side through sched/kv_connector.py's KVConnector protocol, the runner its
    runner side (KVConnectorWorker.apply) at each step's dispatch."""
    connector = build_connector(engine, config, client_metadata=client_metadata)
    if connector is None:
        return None
    engine.attach_kv_connector(connector, config.disagg.role, config.disagg.kv_load_failure_policy)
    return connector
