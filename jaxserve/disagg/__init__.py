"""Disaggregated prefill and decode: a prefill engine computes a prompt's KV and holds its blocks
under a lease; a decode engine pulls them into its own blocks and streams the rest.

One concept per module: handshake.py (the two sides' KV layouts must match), lease.py (the
sending side's leases), sender.py (held blocks, gathered for a pull), receiver.py (loads with
receiver-owned deadlines and the generation check), transport.py (the gRPC client of the pull and
lease calls), service.py (their server side: the internal jaxserve.kv.v1.KVTransfer service of
proto/kv_transfer.proto), connector.py (the scheduler's KVConnector built from them), attach.py
(an engine's connector from its EngineConfig role settings, called by the engine builder). The
scheduler's part is sched/kv_connector.py, the device's runner/kv_transfer.py; docs/design.md has
the whole story. Nothing here imports jaxserve.server: the server registers service.py's servicer.
"""
