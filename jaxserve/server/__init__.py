"""The gRPC front door: `jaxserve.v1.Generation` (servicer.py) over an AsyncEngine, with health,
reflection, auth, TLS, limits, metrics and graceful shutdown (server.py); `jaxserve serve` in cli.py."""
