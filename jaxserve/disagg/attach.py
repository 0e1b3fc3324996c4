"""Wiring an engine for its role: `--role prefill` holds finished prompts' KV for decode engines,
`--role decode` loads it; `both` (the default) is the colocated engine, untouched."""

from __future__ import annotations

import logging
import time

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


def attach_disagg(engine, role: str, *, lease_s: float, load_timeout_s: float, failure_policy: str,
                  client_metadata: tuple = ()) -> DisaggConnector | None:
    """Give `engine` the KV connector of `role` (None for "both"), its transfers compiled now."""
    if role not in ROLES:
        raise ValueError(f"role={role!r} must be one of {ROLES}")
    if role == "both":
        return None
    scheduler = engine.scheduler
    t = time.perf_counter()
    transfer = KVTransfer(engine.runner, cdiv(engine.max_model_len, scheduler.config.block_size))
    transfer.compile_all()
    log.info("%s role: KV transfer buckets %s compiled in %.1f s", role, transfer.buckets, time.perf_counter() - t)
    metrics = TransferMetrics()
    sender = receiver = None
    if role == "prefill":
        sender = KVSender(transfer, scheduler.free_held_blocks, lease_s)
    else:
        receiver = KVReceiver(transfer, local_layout(engine, role), KVClient(client_metadata),
                              timeout_s=load_timeout_s, lease_s=lease_s, on_transfer=metrics.observe)
    connector = DisaggConnector(sender, receiver, metrics)
    scheduler.kv_connector = connector
    scheduler.kv_load_failure_policy = failure_policy
    engine.kv_connector = connector
    engine.role = role
    return connector
