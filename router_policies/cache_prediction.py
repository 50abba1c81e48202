"""What an engine will report as cached for a routed request (``usage.prompt_tokens_details.
cached_tokens``), and the prefill it still has to do: the prediction the prediction audit
checks, the TTFT model's inputs and the pending prefill use (``router_policies.flights``,
``router_policies.placement``).
"""

from __future__ import annotations

from router_policies.policy import FleetSnapshot, ReplicaState, RequestFeatures


def predicted_cached_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """What the engine will report as cached for ``matched_blocks`` leading blocks.

    vLLM always computes at least the prompt's last token (its cache-hit length is capped at
    ``prompt_tokens - 1``), so a fully cached prompt whose length is a multiple of the block size
    reports one block less."""
    if prompt_tokens <= 0:
        return 0
    return min(matched_blocks, (prompt_tokens - 1) // block_size) * block_size


def chosen_prediction(
    snap: FleetSnapshot, replica: str, request: RequestFeatures
) -> tuple[ReplicaState, int]:
    """The chosen ``replica``'s state in the decision's snapshot and the cached tokens predicted
    there: its matched blocks expected still cached at the prefill (``ReplicaState.
    expected_blocks``). The gateway's ``Router.decide`` and the simulator's ``SimGateway.route``
    both predict through here."""
    state = next(r for r in snap.replicas if r.id == replica)
    return state, predicted_cached_tokens(state.expected_blocks, request.prompt_tokens, request.block_size)


def evicted_before_prefill(
    matched_blocks: int, pinned_blocks: int, tokens: tuple[int, int, int], block_size: int
) -> int:
    """Of a request's ``matched_blocks`` leading blocks on a replica, how many its engine is
    expected to evict before the request's prefill starts; ``tokens``: (the uncached prefill
    queued ahead on the replica; the KV its requests in flight hold, at least that queue; its KV
    cache's capacity, 0: unknown). ``placement.IndexView.evicted`` gives the KV in flight as the
    distinct blocks of the flights' prompts, and ``pinned_blocks`` as the prefix's leading
    blocks that a flight's prompt there also leads with.

    Why: an engine looks a request's prefix up when it schedules the request, not when it
    arrives (vLLM's scheduler, SGLang's alike), and until then the prefix's blocks not in use are
    free blocks in its LRU. Only allocations evict them, and before the request is scheduled the
    queue ahead is what allocates (its uncached prefill). Once scheduled, the engine pins the
    cached prefix before it allocates the rest of the prompt (vLLM's ``allocate_slots`` touches
    the computed blocks first), so the request's own prompt never evicts its own prefix.
    Allocations take the least recently used free blocks first, and a prefix waiting for a
    replica is among the most recent: it goes, tail first (a request's blocks are freed tail
    first), once the room beside the KV in use is taken. A block in use is never evicted: the
    prefix's blocks a flight there holds (its cached prefix) or will hold when it runs ahead of
    this request (a prefix it computes itself, which the index already lists as a speculative
    entry) are pinned. So

        free    = (matched - pinned) x block_size
        evicted = min(matched - pinned,
                      ceil(max(0, min(queued, in_use + free - capacity)) / block_size))

    Measured (docs/performance.md, "A prefix evicted while it waits" and "The room a waiting
    prefix has"): the first form, ``queued + prompt - capacity`` with pinned the flights'
    predicted cached blocks, took the cached-token predictions' total absolute error on the
    held-out mixed trace from 27,552 / 33,040 tokens to 18,144 / 18,864 (two windows). This one,
    kvgate alone on five windows of each held-out trace against the first form: agents 75,200 ->
    66,080 tokens, mixed 45,424 -> 37,152, RAG 4,800 -> 2,672; the bench's kv_pressure 7,344 ->
    7,328 and decode_heavy 19,344 -> 22,080 (seeds 5-7). What it still misses is mostly free
    blocks newer than the prefix in the LRU (freed after its last use: they outlast it, where
    the formula takes every other free block as going first), a decode's growth and
    preemptions."""
    queued_tokens, in_use_tokens, capacity_tokens = tokens
    if capacity_tokens <= 0 or matched_blocks <= pinned_blocks or block_size <= 0:
        return 0
    free_prefix = (matched_blocks - pinned_blocks) * block_size
    over = min(queued_tokens, in_use_tokens + free_prefix - capacity_tokens)
    if over <= 0:
        return 0
    return min(matched_blocks - pinned_blocks, -(-over // block_size))


def uncached_prompt_tokens(prompt_tokens: int, predicted: int) -> int:
    """The prefill a request adds to its replica: its prompt minus the predicted cached tokens."""
    return max(0, prompt_tokens - predicted)
