"""KV events on the wire: the prefix cache's changes (jaxserve/sched/kv_events.py) published over
ZeroMQ as msgpack in vLLM's format (wire.py), a publisher with a replay buffer (publisher.py), a
subscriber that asks for what it missed (subscriber.py), and the index a consumer rebuilds from
them (block_index.py)."""
