"""KV events: where the engine publishes its prefix cache's changes (vLLM's KVEventsConfig, the
same keys, so a deployment written for vLLM's `--kv-events-config` works unchanged)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from jaxserve.config.options import check_positive_int


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"            # zmq, or null (recorded, published nowhere: for tests)
    # PUB socket: an address with * (tcp://*:5557), ipc:// or inproc:// is bound, any other is connected
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None   # ROUTER socket a subscriber asks for missed batches
    buffer_steps: int = 10_000        # batches kept for replay
    hwm: int = 100_000                # the PUB socket's high-water mark (messages)
    max_queue_size: int = 100_000     # batches waiting for the publisher thread; beyond, the oldest go
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config: publisher={self.publisher!r} must be 'zmq' or 'null'")
        check_positive_int(self, "buffer_steps", "hwm", "max_queue_size")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(f"kv_events_config: endpoint={self.endpoint!r} must be a ZeroMQ address like "
                             "tcp://*:5557")
        if self.replay_endpoint is not None and "://" not in str(self.replay_endpoint):
            raise ValueError(f"kv_events_config: replay_endpoint={self.replay_endpoint!r} must be a ZeroMQ "
                             "address like tcp://*:5558")

    @classmethod
    def parse(cls, value: "KVEventsConfig | dict | str | None") -> "KVEventsConfig | None":
        """From a dict (LLM(kv_events_config={...})), a JSON string (the CLI flag), or None; a config
        with enable_kv_cache_events false is None (off)."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_events_config is not valid JSON ({e}): {value!r}") from None
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"kv_events_config: unknown key(s) {unknown}; known: {sorted(known)}")
            value = cls(**value)
        if value is not None and not isinstance(value, KVEventsConfig):
            raise ValueError(f"kv_events_config must be a dict or a JSON object, got {value!r}")
        return value if value is not None and value.enable_kv_cache_events else None
