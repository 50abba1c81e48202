"""A simulated vLLM engine: vLLM's HTTP API and KV-event stream in front of the simulator's replica model.

Modules:
- ``options``: the engine's settings (CLI flags), validated once.
- ``tokenization``: prompt and chat tokenization done the way vLLM does it (``transformers``).
- ``protocol``: OpenAI/vLLM request parsing and response shapes, and API errors.
- ``engine_hashes``: the engine's own block hashes (not kvgate's keys), as vLLM publishes them.
- ``kv_events``: msgpack encoding of BlockStored/BlockRemoved/AllBlocksCleared and the ZMQ publisher
  with its replay socket and fault switch.
- ``core``: the single asyncio task that owns the replica model and drives it in real time.
- ``metrics``: Prometheus metrics under vLLM's names.
- ``http_api``: the aiohttp routes.
- ``server``: composition and shutdown order.
"""
