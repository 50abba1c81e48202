"""A per-replica model of time to first token in milliseconds, learned online (the gateway
fits it for every policy; kv_aware routes on it with its default ``rule: ms``).

``params`` (the immutable per-replica value on ``ReplicaState.ttft``), ``features`` (the model
and its prediction), ``estimator`` (robust recursive least squares), ``model`` (the owner that
fits it from first tokens), ``snapshot`` (a ``ReplicaState`` to the model's inputs).
Kept free of imports so that ``router_policies.policy`` can import ``params``.
"""
