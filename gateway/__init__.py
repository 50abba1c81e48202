"""kvgate gateway: the OpenAI-compatible KV-aware proxy, its config, fleet state and servers."""
