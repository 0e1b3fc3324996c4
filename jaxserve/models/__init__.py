"""Flax definitions of the Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3)."""
