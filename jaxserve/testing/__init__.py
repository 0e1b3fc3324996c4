"""Helpers for tests and benchmarks: tiny random-weight models built locally (never downloaded)."""
