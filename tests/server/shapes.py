"""The tiny engine shapes shared by the in-process engine and the server processes."""

from tests.conftest import TINY_ENGINE

# The scheduler charges prefill chunks whole tiles (chunk_granularity = prefill_tile), so a step
# never outgrows the runner's buckets whatever the partial-prefill policy admits.
SERVER_ENGINE = dict(TINY_ENGINE)


def tiny_engine_flags(compilation_cache_dir: str = "") -> list[str]:
    """SERVER_ENGINE as `jaxserve serve` flags (the same EngineConfig fields, so the same model)."""
    flags = []
    for name, value in SERVER_ENGINE.items():
        if name in ("progress", "compilation_cache_dir"):
            continue
        flags += ["--" + name.replace("_", "-"), str(value)]
    return flags + ["--compilation-cache-dir", compilation_cache_dir]
