"""An engine's prefix cache as BlockIndex.snapshot spells it: hash -> (parent hash, tokens, media)."""

from jaxserve.sched.kv_events import MEDIUM_DEVICE, MEDIUM_HOST


def cache_snapshot(cache) -> dict:
    out = {}
    for n in cache.all_nodes():
        first = n.parent is cache._root
        out[n.hash] = (None if first else n.parent.hash, n.tokens,
                       frozenset({MEDIUM_DEVICE if n.on_device else MEDIUM_HOST}))
    return out
