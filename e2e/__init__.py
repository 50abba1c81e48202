"""The real-vLLM end-to-end harness (``make e2e-vllm``) and the KV-event capture tool.

Runs in the main virtualenv (it drives processes over HTTP and ZMQ); the vLLM replicas run from
``.venv-vllm``. See docs/e2e-vllm.md.
"""
