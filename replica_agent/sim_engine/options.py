"""The simulated engine's settings, validated once at start-up (``kvgate sim-engine`` flags)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from replica_agent.sim_engine.engine_hashes import HashFormat
from replica_agent.sim_engine.kv_events import EventEncoding
from router_policies.errors import UserInputError


def default_tokenizer_dir() -> Path:
    """``assets/tokenizers/kvgate-tiny`` of the checkout this package runs from, else the same
    relative path from the working directory (an installed wheel, as in the container image)."""
    in_repo = Path(__file__).resolve().parents[2] / "assets" / "tokenizers" / "kvgate-tiny"
    if in_repo.is_dir():
        return in_repo
    return Path("assets") / "tokenizers" / "kvgate-tiny"


@dataclass(frozen=True, slots=True)
class EngineOptions:
    host: str
    port: int  # 0: any free port (the ready line names it)
    events_port: int  # 0: any free port
    replay_port: int | None  # None: no replay socket; 0: any free port
    model: str
    tokenizer: Path
    block_size: int
    cache_blocks: int | None  # None: the profile's KV budget
    profile: str
    time_scale: float  # multiplies every step cost of the profile (0.01 = 100x faster)
    seed: int
    hash_format: HashFormat
    event_encoding: EventEncoding
    topic: str
    replay_buffer: int  # batches kept for replay (vLLM's buffer_steps)
    max_pending: int  # requests in the engine (running + waiting); more get 503
    max_model_len: int
    default_max_tokens: int
    max_num_seqs: int | None  # None: the profile's
    max_num_batched_tokens: int | None
    request_log: Path | None = None  # each generation request's arrival and parse (request_log.py)

    def __post_init__(self) -> None:
        def port_ok(name: str, value: int | None) -> None:
            if value is not None and not 0 <= value <= 65535:
                raise UserInputError(f"{name}: must be a port number in [0, 65535], got {value}")

        port_ok("--port", self.port)
        port_ok("--events-port", self.events_port)
        port_ok("--replay-port", self.replay_port)
        positive = {
            "--block-size": self.block_size,
            "--replay-buffer": self.replay_buffer,
            "--max-pending": self.max_pending,
            "--max-model-len": self.max_model_len,
            "--default-max-tokens": self.default_max_tokens,
        }
        for flag, value in (
            ("--cache-blocks", self.cache_blocks),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
        ):
            if value is not None:
                positive[flag] = value
        for flag, value in positive.items():
            if value <= 0:
                raise UserInputError(f"{flag}: must be a positive integer, got {value}")
        if not self.time_scale > 0:
            raise UserInputError(f"--time-scale: must be > 0, got {self.time_scale}")
        if not self.model:
            raise UserInputError("--model: must not be empty")
        if not (self.tokenizer / "tokenizer.json").is_file():
            raise UserInputError(f"--tokenizer: no tokenizer.json in {self.tokenizer}")
