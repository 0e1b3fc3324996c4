"""Disaggregated serving: an engine's role, and how KV moves between prefill and decode engines."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config.options import check_choice, check_positive_number, choices, option


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    role: str = option("both", "disaggregated serving: prefill (compute prompts, hold their KV for decode engines "
                               "under a lease), decode (load prompts' KV from prefill engines, stream the rest), or "
                               "both (a colocated engine)", choices=("both", "prefill", "decode"))
    kv_lease_s: float = option(30.0, "prefill role: seconds a finished prompt's KV blocks are held for a decode "
                                     "engine after its last heartbeat, then freed")
    kv_load_timeout_s: float = option(10.0, "decode role: seconds a KV load may take, on this engine's clock; then "
                                            "it is cancelled and --kv-load-failure-policy applies")
    kv_load_failure_policy: str = option(
        "recompute", "decode role: a KV load that failed or timed out is recomputed here (recompute) or ends the "
                     "request with UNAVAILABLE (fail)", choices=("recompute", "fail"))

    def __post_init__(self) -> None:
        for name in ("role", "kv_load_failure_policy"):
            check_choice(self, name, choices(self, name))
        check_positive_number(self, "kv_lease_s", "kv_load_timeout_s")
