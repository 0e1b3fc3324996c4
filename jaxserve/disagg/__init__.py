"""Disaggregated prefill and decode: a prefill engine computes a prompt's KV and holds its blocks
under a lease; a decode engine pulls them into its own blocks and streams the rest.

One concept per module: handshake.py (the two sides' KV layouts must match), lease.py (the
sending side's leases), sender.py (held blocks, gathered for a pull), receiver.py (loads with
receiver-owned deadlines and the generation check), transport.py (the gRPC client of the pull and
lease calls), service.py (their server side), connector.py (the scheduler's KVConnector built from
them), attach.py (wiring an engine by its role). The scheduler's part is sched/kv_connector.py,
the device's runner/kv_transfer.py; docs/design.md has the whole story.
"""
