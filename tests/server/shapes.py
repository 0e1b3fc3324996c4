"""The tiny engine shapes shared by the in-process engine and the server processes."""

from tests.conftest import TINY_ENGINE

# max_prefill_seqs = max_num_seqs: the runner then compiles tiles for every seat mid-prefill, so a
# step never outgrows its buckets whatever the scheduler's partial-prefill policy admits
# (with TINY_ENGINE's 2, four short prompts finishing prefill together overflowed the buckets).
SERVER_ENGINE = dict(TINY_ENGINE, max_prefill_seqs=TINY_ENGINE["max_num_seqs"])


def tiny_engine_flags(compilation_cache_dir: str = "") -> list[str]:
    """SERVER_ENGINE as `jaxserve serve` flags (the same EngineConfig fields, so the same model)."""
    flags = []
    for name, value in SERVER_ENGINE.items():
        if name in ("progress", "compilation_cache_dir"):
            continue
        flags += ["--" + name.replace("_", "-"), str(value)]
    return flags + ["--compilation-cache-dir", compilation_cache_dir]
