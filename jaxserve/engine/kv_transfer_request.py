"""A request's part in disaggregated serving, checked and marked at the door: "send" (a prefill
engine keeps its prompt's KV for a decode engine when it ends) or a sched RemoteKV to load
(a decode engine), each only where the engine's role has the connector for it."""

from __future__ import annotations

from jaxserve.sched.request import Request


def mark_kv_transfer(sched_req: Request, kv_transfer, n: int, connector, role: str) -> None:
    side = "send" if kv_transfer == "send" else "load"
    have = connector is not None and (connector.can_send if side == "send" else connector.can_load)
    if not have:
        raise ValueError(f"kv_transfer {side}: this engine's role is {role!r} (a KV {side} needs "
                         f"--role {'prefill' if side == 'send' else 'decode'})")
    if n != 1:
        raise ValueError(f"kv_transfer needs n=1, got n={n}")
    if side == "load" and sched_req.sampling.num_prompt_logprobs is not None:
        raise ValueError("prompt_logprobs need the prompt computed here, not loaded with kv_transfer")
    if side == "load" and sched_req.sampling.pooling is not None:
        raise ValueError("an embedding needs the prompt computed here, not loaded with kv_transfer")
    if side == "send":
        sched_req.kv_send = True
    else:
        sched_req.remote_kv = kv_transfer
