"""Fixtures of the router tests: xla_cache_dir, the compilation cache the replicas share, is in
tests/conftest.py (the disagg tests start the same tiny servers)."""
