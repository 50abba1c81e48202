"""The featurizer's output (docs/architecture.md, "Request path": features): the policy's
``RequestFeatures`` and the ``FeatureInfo`` the proxy logs and exports, built from engine tokens
(``exact_features``) or from character blocks (``char_features``).

Key namespace: keys are ``block_keys(tokens, block_size, base_model, lora=adapter,
cache_salt=body's cache_salt)``; ``RequestFeatures.model`` is the base model (replicas are listed
by base model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import xxhash

from gateway.features.char_blocks import CHARS_PER_TOKEN, char_block_keys, estimated_tokens
from gateway.features.deferred_job import DeferredJob
from gateway.features.prompt import Chars, PromptSpec
from gateway.features.segment_encoder import TokenArray
from router_policies.block_keys import block_keys, chain_keys, token_bytes
from router_policies.policy import RequestFeatures

Mode = Literal["local", "remote", "token_ids", "chars"]


@dataclass(frozen=True, slots=True)
class FeatureInfo:
    """What the proxy logs and exports about how the features were made."""

    model: str  # as the request named it
    base_model: str
    lora: str | None
    mode: Mode  # how the tokens were obtained: encoded here, by a replica, given as ids, or chars
    approximate: bool  # keys are character blocks, not engine tokens
    prompt_tokens: int
    fallback_reason: str | None = None  # why an exact mode fell back to characters
    segments: int = 0  # segments the prompt was encoded in (0: not encoded here)
    segments_cached: int = 0
    encoded_chars: int = 0  # characters actually encoded for this request
    offloaded: bool = False  # the encode ran on a worker thread
    token_ids: TokenArray | None = None  # the prompt's tokens (None when approximate or deferred)
    deferred_chars: int = 0  # trailing characters routed on an estimate, encoded later
    deferred: DeferredJob | None = None  # that later encode (its keys go to the router's commit)

    @property
    def exact(self) -> bool:
        """Keys and token count are the engine's: the prediction can be audited."""
        return not self.approximate and self.deferred_chars == 0

    @property
    def cache_hit(self) -> bool:
        """Every segment came from the cache (nothing was encoded)."""
        return self.segments > 0 and self.segments_cached == self.segments


@dataclass(frozen=True, slots=True)
class Encoded:
    """How a prompt's exact tokens were obtained."""

    mode: Mode
    prompt_tokens: int  # the tokens' count, plus the estimated deferred rest
    segments: int = 0
    segments_cached: int = 0
    encoded_chars: int = 0
    offloaded: bool = False
    deferred_chars: int = 0
    deferred: DeferredJob | None = None


def keys_of(spec: PromptSpec) -> Callable[[TokenArray], list[int]]:
    """The block keys of a token sequence in ``spec``'s namespace."""
    mc = spec.resolved.model.config
    block_size, base, lora, salt = mc.block_size, mc.name, spec.resolved.lora, spec.salt
    return lambda tokens: block_keys(tokens, block_size, base, lora, salt)


def keys_after(spec: PromptSpec, head: TokenArray, head_keys: list[int]) -> Callable[[TokenArray], list[int]]:
    """``keys_of(spec)`` for a prompt whose leading tokens were keyed already (``head``, keyed
    ``head_keys`` when its request was routed): a sequence starting with the same full blocks
    (the same digest of their ids) keeps their keys and chains only the rest (keys name their
    whole prefix), any other is keyed from its start. Saves a deferred encode's completion
    re-keying what was routed on; holds the keys (the routed features' own list), not the ids."""
    whole = keys_of(spec)
    size = spec.resolved.model.config.block_size
    n = len(head_keys) * size
    digest = _digest(head[:n])

    def keys(tokens: TokenArray) -> list[int]:
        if not head_keys or len(tokens) < n or _digest(tokens[:n]) != digest:
            return whole(tokens)
        return head_keys + chain_keys(head_keys[-1], tokens[n:], size)

    return keys


def _digest(tokens: TokenArray) -> int:
    return xxhash.xxh3_64_intdigest(token_bytes(tokens))


def truncated(spec: PromptSpec, tokens: TokenArray) -> TokenArray:
    """The tokens the engine keeps under ``truncate_prompt_tokens``."""
    n = spec.truncate
    if n is None or n >= len(tokens):
        return tokens
    return tokens[len(tokens) - n :] if spec.truncation_side == "left" else tokens[:n]


def namespace_of(spec: PromptSpec) -> tuple[str, str | None, str | None, int]:
    """What a prompt's keys depend on besides its tokens: model, adapter, salt, block size."""
    mc = spec.resolved.model.config
    return mc.name, spec.resolved.lora, spec.salt, mc.block_size


def _features(
    spec: PromptSpec, keys: Sequence[int], prompt_tokens: int, block_size: int, session_id: str | None
) -> RequestFeatures:
    r = spec.resolved
    return RequestFeatures(
        model=r.model.config.name,
        block_keys=keys,
        prompt_tokens=prompt_tokens,
        block_size=block_size,
        session_id=session_id,
        lora=r.lora,
    )


def exact_features(
    spec: PromptSpec,
    tokens: TokenArray,
    how: Encoded,
    session_id: str | None,
    keys: list[int] | None = None,
) -> tuple[RequestFeatures, FeatureInfo]:
    """Features keyed on engine tokens: all of the prompt's, or its exact prefix when the rest
    is deferred (``how.prompt_tokens`` then counts the estimated rest too). ``keys``: the
    tokens' keys when the caller has them (``memo_cache``)."""
    r = spec.resolved
    mc = r.model.config
    if keys is None:
        keys = keys_of(spec)(tokens)
    features = _features(spec, keys, how.prompt_tokens, mc.block_size, session_id)
    info = FeatureInfo(
        model=r.requested,
        base_model=mc.name,
        lora=r.lora,
        mode=how.mode,
        approximate=False,
        prompt_tokens=how.prompt_tokens,
        segments=how.segments,
        segments_cached=how.segments_cached,
        encoded_chars=how.encoded_chars,
        offloaded=how.offloaded,
        token_ids=None if how.deferred_chars else tokens,
        deferred_chars=how.deferred_chars,
        deferred=how.deferred,
    )
    return features, info


def char_features(
    spec: PromptSpec, prompt: Chars, session_id: str | None
) -> tuple[RequestFeatures, FeatureInfo]:
    """Approximate features on character blocks (no engine tokens)."""
    r = spec.resolved
    mc = r.model.config
    n = estimated_tokens(prompt.text)
    keys = char_block_keys(prompt.text, mc.char_block_size, mc.name, r.lora, spec.salt)
    block_size = max(1, round(mc.char_block_size / CHARS_PER_TOKEN))
    features = _features(spec, keys, n, block_size, session_id)
    info = FeatureInfo(r.requested, mc.name, r.lora, "chars", True, n, fallback_reason=prompt.fallback_reason)
    return features, info
