"""The HTTP side of the gateway's config tree (docs/architecture.md; gateway/config.py holds the
rest and the loader): ``proxy`` (limits, timeouts, retries, tokenization and its byte budgets)
and ``server`` (the listener's client timeouts, connection cap and drain).

``_Strict`` is the base of every section: unknown keys are refused, values are frozen.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from pydantic.types import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ProxyConfig(_Strict):
    """The HTTP proxy: limits, timeouts, retries, debug headers, tokenization."""

    max_body_bytes: PositiveInt = Field(8 * 1024 * 1024, description="Larger request bodies get 413.")
    max_buffered_response_bytes: PositiveInt = Field(
        64 * 1024 * 1024,
        description="A non-streaming response is held until complete (so a failure before it is retried) "
        "up to this size; a larger one is passed through as it arrives.",
    )
    connect_timeout_s: PositiveFloat = Field(2.0, description="Upstream connect timeout.")
    first_byte_timeout_s: PositiveFloat = Field(
        120.0,
        description="A streaming request whose replica sent no byte of its stream this long is "
        "abandoned and, as nothing reached the client, retried on another replica (504 when no retry "
        "is left). An attempt on a replica ejected meanwhile is failed over at once.",
    )
    stream_idle_timeout_s: PositiveFloat = Field(
        300.0,
        description="After the first byte, a response with no byte for this long is cut (an SSE "
        "stream ends with an error event). Streams have no total timeout.",
    )
    request_timeout_s: PositiveFloat = Field(
        600.0,
        description="A non-streaming request's answer (it arrives whole) not received in this long: "
        "the attempt is abandoned and retried on another replica (504 when no retry is left).",
    )
    body_timeout_s: PositiveFloat = Field(
        30.0, description="A request body not received whole in this long gets 408."
    )
    retries: NonNegativeInt = Field(2, description="Retries on other replicas before the first byte.")
    session_header: str = Field("x-session-id", description="Request header carrying the session id.")
    debug_headers: bool = Field(True, description="Send x-kvgate-replica and x-kvgate-matched-tokens.")
    speculative_ttl_s: PositiveFloat = Field(
        10.0,
        description="TTL of the index entry each routed request adds (with an agent), and of the "
        "entries a replica's snapshot drops (kept as guesses: an agent restarted beside a busy engine).",
    )
    tokenize_cache_entries: NonNegativeInt = Field(
        4096, description="Bound of the cache of tokenized messages."
    )
    tokenize_cache_bytes: NonNegativeInt = Field(
        256 * 1024 * 1024,
        description="Bytes the cache of tokenized messages may hold (texts and token ids); least "
        "recently used first out.",
    )
    tokenize_checkpoint_bytes: NonNegativeInt = Field(
        16 * 1024 * 1024,
        description="Bytes the exact leading tokens of texts encoded whole may hold, one entry per "
        "256 characters, so that a text starting the same way is encoded from where they end (0: "
        "off); least recently used first out.",
    )
    memo_cache_bytes: NonNegativeInt = Field(
        32 * 1024 * 1024,
        description="Bytes the cache of chat-template outputs, texts' token ids and block keys of "
        "prompts seen before may hold (0: off); least recently used first out.",
    )
    max_prompt_chars: PositiveInt = Field(
        2_000_000,
        description="A prompt tokenized here longer than this many characters (after the chat "
        "template) gets 400 prompt_too_long: encoding takes about 100 bytes of transient memory "
        "a character.",
    )
    tokenize_inflight_bytes: PositiveInt = Field(
        4 * 1024 * 1024,
        description="Bytes of prompt text being encoded on worker threads at once; more requests "
        "wait their turn (one encode larger than this runs alone).",
    )
    tokenize_threads: int = Field(2, ge=1, description="Worker threads for long tokenizations.")
    tokenize_offload_chars: NonNegativeInt = Field(
        16384, description="Uncached prompt characters above which encoding leaves the event loop."
    )
    tokenize_defer_chars: NonNegativeInt = Field(
        1024,
        description="Uncached prompt characters from which text this gateway never saw after the same "
        "prefix is routed on the cached prefix and encoded after routing (0: always encode first).",
    )
    tokenize_seen_entries: NonNegativeInt = Field(
        262144,
        description="Bound of the record of new texts seen (one fingerprint per 256 characters; "
        "at most 80 bytes each; the most recent half are always remembered).",
    )
    tokenize_defer_backlog_chars: NonNegativeInt = Field(
        4_000_000,
        description="Characters waiting to be encoded after routing; beyond it the oldest are dropped.",
    )
    tokenize_defer_quiet_s: NonNegativeFloat = Field(
        0.01,
        description="A text encoded after routing waits until no request has arrived for this long "
        "(a burst's requests first; 0: at once), and is not encoded after tokenize_defer_max_wait_s.",
    )
    tokenize_defer_max_wait_s: NonNegativeFloat = Field(
        0.1,
        description="The longest a text encoded after routing waits for arrivals to pause; past it "
        "the text is not encoded (it is encoded on its request's path if it comes back).",
    )
    tokenize_defer_backlog_bytes: NonNegativeInt = Field(
        32 * 1024 * 1024,
        description="Bytes of text (as Python holds it: 1, 2 or 4 a character) waiting to be encoded "
        "after routing; beyond it the oldest are dropped.",
    )


class ServerConfig(_Strict):
    """The HTTP listener's protection against slow, idle and too many clients (as Envoy's and
    HAProxy's timeouts and connection limits), and its drain on shutdown."""

    header_timeout_s: PositiveFloat = Field(
        10.0,
        description="A request's headers not received whole this long after its first byte get 408.",
    )
    idle_timeout_s: PositiveFloat = Field(
        60.0, description="A connection with no request in progress is closed after this long."
    )
    max_connections: PositiveInt = Field(
        4096,
        description="Client connections open at once; beyond it (or beyond the open-file limit less "
        "a reserve) a new one gets 503 and is closed.",
    )
    max_headers: PositiveInt = Field(128, description="Request headers beyond this many get 400.")
    max_header_bytes: PositiveInt = Field(
        8190, description="A request line or header field longer than this gets 400 (431 for headers)."
    )
    max_inflight_body_bytes: PositiveInt = Field(
        256 * 1024 * 1024,
        description="Bytes of request bodies held at once (each from its read to its answer's end; "
        "a body of unknown length counts as proxy.max_body_bytes). A request that cannot fit within "
        "proxy.body_timeout_s gets 503 overloaded.",
    )
    workers: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="HTTP worker processes serving the API on the one port (SO_REUSEPORT), fed one "
        "index by the parent process, which holds the agents' streams (docs/architecture.md, "
        "Workers). Unset: the cores the process may use (1 with shared_state.redis_url, which "
        "workers refuse); 1: one process, as before. "
        "`kvgate serve --workers N` overrides it.",
    )
    workers_decide_in_turn: bool = Field(
        True,
        description="With several workers, a decision waits while another worker decides (its "
        "loop running meanwhile, the lock tried once a turn of the loop, no longer after 2 ms; "
        "under load a wait outlasts that turn: 2-6 ms at the median at c=32, for a fifth of the "
        "decisions), so that it sees every attempt decided before it: a burst is placed as one "
        "process places it. Off: it never waits and sees the attempts already published (less "
        "CPU at thousands of requests a second, bursts placed worse; "
        "docs/performance.md, 'Why two workers place a burst worse').",
    )
    drain_delay_s: NonNegativeFloat = Field(
        0.0,
        description="On SIGTERM, /ready answers 503 this long before the listener closes (so load "
        "balancers stop sending first); requests are served meanwhile.",
    )
    shutdown_grace_s: NonNegativeFloat = Field(
        50.0,
        description="Then in-flight requests get this long to finish (drain_delay_s + shutdown_grace_s "
        "must stay under the pod's terminationGracePeriodSeconds).",
    )
