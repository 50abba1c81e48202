"""Offline simulation of a replica fleet: a vLLM-like replica model (``replica_model``), cost
presets (``profiles``), trace loading and workload generators (``traces``, ``workloads``), the
discrete-event simulator (``simulator``) and ``kvgate compare`` (``compare_cli``).

Pure code: no aiohttp, grpc or asyncio; time is always passed in by the caller."""
