"""A request for ``Fleet.snapshot`` in tests that only read load or models: no keys, no prompt
(nothing matched, nothing evicted)."""

from __future__ import annotations

from router_policies.policy import RequestFeatures

NO_REQUEST = RequestFeatures(model="m", block_keys=(), prompt_tokens=0, block_size=16)
