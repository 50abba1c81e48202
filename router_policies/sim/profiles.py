"""Cost presets for the replica model: step costs, KV capacity and scheduler limits.

``small-cpu`` reproduces the seed's small model (docs/architecture.md, "Measuring ourselves"): a 2,000-token prompt costs
about 2,100 ms TTFT on a miss and about 190 ms on a full hit. With a block size of 32 (vLLM's CPU
build) a full hit caches floor(1,999 / 32) = 62 blocks = 1,984 tokens and 16 tokens are computed,
so with the linear model ``TTFT = overhead + prefill_per_token x uncached``:

    overhead + 2000 p = 2.100 s,  overhead + 16 p = 0.190 s
    => p = 1.910 / 1984 = 0.963 ms/token,  overhead = 0.190 - 16 p = 174.6 ms

Two figures cannot separate an attention term, so it is 0 here. On a CPU every token through the
weights costs the same compute whether it is prefilled or decoded, so a decode token costs ``p`` as
well. The KV budget (65,536 tokens) is an assumption: the seed does not state it.

``llama3-8b-h100`` is Llama-3-8B in BF16 on one H100 SXM 80 GB, derived from public datasheet
figures (H100 SXM: 989 TFLOPS dense BF16, 3.35 TB/s HBM3, NVIDIA H100 datasheet) and the model's
shape (Llama-3-8B config.json: 8.03 B parameters, 32 layers, hidden 4096, 8 KV heads of 128):
  * prefill linear part: 2 x 8.03e9 = 16.1 GFLOP/token at 40 % MFU (a common figure for vLLM
    prefill; it gives ~24,600 tokens/s, in the range public vLLM H100 runs report for 8B models)
    -> 40.6 us/token;
  * causal attention: 4 x layers x hidden = 524,288 FLOP per (token, context token) pair at the
    same MFU -> 1.33 ns per pair (a 12k-token prompt spends ~16 % of its prefill in attention);
  * decode: each step streams the 16.1 GB of weights at ~70 % of peak bandwidth (2.35 TB/s) ->
    6.8 ms, plus ~1.2 ms of scheduler/launch overhead -> 8 ms per step; each decoding sequence
    reads its KV (128 KiB per token: 2 x 32 layers x 8 heads x 128 dims x 2 bytes) at the same
    bandwidth -> 55.8 ns per context token; plus one token through the GEMMs (40.6 us);
  * KV capacity: 0.9 x 80 GB - 16.1 GB weights - ~4 GB activations ~= 52 GB / 128 KiB = ~400k
    tokens (781 blocks of 512 tokens);
  * scheduler limits: vLLM's defaults for an OpenAI server (max_num_seqs 256,
    max_num_batched_tokens 8192).

``llama3-8b-a100`` is the same model on one A100 SXM 80 GB, derived the same way from its
datasheet (312 TFLOPS dense BF16, 2.039 TB/s HBM2e; NVIDIA A100 datasheet): 128.7 us per prefill
token, 11.3 + 1.2 ms per step, 91.8 ns per KV token read; the same 80 GB, hence the same KV
capacity. It is about 3.2x slower to prefill and 1.5x slower to decode than the H100.

Fleets (``fleet_profiles``): a profile name gives N identical replicas; ``NAME*K,NAME*K`` lists
the replicas of each profile; ``h100+a100`` is half H100s and half A100s, interleaved (r0 H100,
r1 A100, ...), a fleet of two GPU generations as operators run them.
"""

from __future__ import annotations

from dataclasses import dataclass

from router_policies.errors import UserInputError
from router_policies.sim.replica_model import EngineConfig, StepCosts
from router_policies.ttft.params import TtftParams, params_from_step_costs


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    costs: StepCosts
    kv_cache_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    description: str

    def default_blocks(self, block_size: int) -> int:
        return max(1, self.kv_cache_tokens // block_size)

    def engine_config(self, block_size: int, num_blocks: int | None = None) -> EngineConfig:
        return EngineConfig(
            num_blocks=num_blocks if num_blocks is not None else self.default_blocks(block_size),
            block_size=block_size,
            costs=self.costs,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )

    def ttft_prior(self) -> TtftParams:
        """The TTFT model of an engine of this profile (router_policies.ttft), as a cold-start prior."""
        return params_from_step_costs(
            self.costs, self.max_num_batched_tokens, self.max_num_seqs, self.kv_cache_tokens
        )


_SMALL_P = 1.910 / 1984  # s per prefill token (see the module docstring)

_L3_PARAMS = 8.03e9
_L3_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2


def _llama3_8b(name: str, dense_tflops: float, hbm_tb_per_s: float, description: str) -> Profile:
    """Llama-3-8B BF16 on one 80 GB GPU: 40 % MFU, 70 % of peak memory bandwidth (docstring)."""
    flops = dense_tflops * 1e12 * 0.40
    bw = hbm_tb_per_s * 1e12 * 0.70
    return Profile(
        name=name,
        costs=StepCosts(
            step_overhead_s=2 * _L3_PARAMS / bw + 0.0012,
            prefill_s_per_token=2 * _L3_PARAMS / flops,
            prefill_s_per_token_ctx=4 * 32 * 4096 / flops,
            decode_s_per_seq=2 * _L3_PARAMS / flops,
            decode_s_per_ctx_token=_L3_KV_BYTES_PER_TOKEN / bw,
        ),
        kv_cache_tokens=400_000,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        description=description,
    )


PROFILES: dict[str, Profile] = {
    "small-cpu": Profile(
        name="small-cpu",
        costs=StepCosts(
            step_overhead_s=0.190 - 16 * _SMALL_P,
            prefill_s_per_token=_SMALL_P,
            decode_s_per_seq=_SMALL_P,
        ),
        kv_cache_tokens=65_536,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        description="the seed's small model on CPU: 2,000-token prompt ~2,100 ms miss / ~190 ms hit",
    ),
    "llama3-8b-h100": _llama3_8b(
        "llama3-8b-h100", 989, 3.35, "Llama-3-8B BF16 on one H100 SXM 80 GB (datasheet-derived)"
    ),
    "llama3-8b-a100": _llama3_8b(
        "llama3-8b-a100", 312, 2.039, "Llama-3-8B BF16 on one A100 SXM 80 GB (datasheet-derived)"
    ),
}

DEFAULT_PROFILE = "llama3-8b-h100"


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise UserInputError(f"--profile: unknown profile {name!r} (known: {known})") from None


FLEETS: dict[str, tuple[str, ...]] = {"h100+a100": ("llama3-8b-h100", "llama3-8b-a100")}


def fleet_profiles(spec: str, replicas: int) -> list[Profile]:
    """The profile of each of ``replicas`` replicas: a profile name (all alike), a fleet name of
    ``FLEETS`` (its profiles interleaved), or ``NAME*K,NAME*K,...`` whose counts sum to ``replicas``."""
    if spec in PROFILES:
        return [PROFILES[spec]] * replicas
    if spec in FLEETS:
        names = FLEETS[spec]
        return [PROFILES[names[i % len(names)]] for i in range(replicas)]
    out: list[Profile] = []
    for part in spec.split(","):
        name, _, count = part.strip().partition("*")
        try:
            k = int(count) if count else 1
        except ValueError:
            raise UserInputError(f"--fleet: {part!r}: expected NAME*COUNT") from None
        out.extend([get_profile(name)] * k)
    if len(out) != replicas:
        raise UserInputError(f"--fleet: {spec!r} lists {len(out)} replicas, not {replicas}")
    return out
