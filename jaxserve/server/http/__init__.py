"""The OpenAI-compatible HTTP front (FastAPI on uvicorn), beside or instead of the gRPC service,
on the same AsyncEngine: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
