"""From a parsed request to the policy's ``RequestFeatures`` (docs/architecture.md, "Request
path": features). A pipeline of small parts, each in its module:

1. ``ModelRegistry`` (model_registry.py): the request's model, tokenizer and chat templates;
2. ``read_prompt`` (prompt.py): the prompt as ``TokenIds | Text | Chars | Remote``;
3. a ``Remote`` prompt is tokenized by a replica (remote_tokenizer.py), or falls back to ``Chars``;
4. ``EncodePlanner`` (encode_planner.py): a ``Text`` is encoded now or routed first (``Defer``);
5. ``EncodeExecutor`` (encode_executor.py): where encodes run (worker threads, background thread);
6. ``exact_features`` / ``char_features`` (feature_info.py): keys and what the proxy logs.

One ``Featurizer`` is built per config by the composition root; nothing here is module state.
``close()`` shuts the deferred encodes, the threads and the HTTP session; call it after the HTTP
server stopped taking requests.

Per model, ``tokenizer`` chooses the mode:
- a folder: exact tokens, rendered and encoded as vLLM + transformers do (``mode="local"``);
- ``remote``: the ids from a replica's ``/tokenize`` (``mode="remote"``), falling back to
  character blocks when that fails;
- null: approximate keys on character blocks (``mode="chars"``, ``approximate=True``).
A completions prompt given as token ids is exact in every mode (the ids are the tokens).

``featurize`` is the request path's call; ``featurize(explain=True)`` changes nothing (no segment
cached, no text recorded as seen, no encode deferred or taken over, no counter moved);
``featurize_sync`` runs on the calling thread and never defers nor asks a replica.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from gateway.config import GatewayConfig, ModelConfig
from gateway.config_http import ProxyConfig
from gateway.features.budgets import SEEN_ENTRY_BYTES, Budgets, DeferredLimits, EncodeSettings, text_bytes
from gateway.features.deferred import DeferredEncodes
from gateway.features.deferred_job import DeferredJob
from gateway.features.encode_executor import BACKGROUND_THREAD_NAME, EncodeExecutor, mark_background_thread
from gateway.features.encode_planner import HEAD_MARGIN_CHARS, Defer, EncodePlanner
from gateway.features.feature_info import (
    Encoded,
    FeatureInfo,
    Mode,
    char_features,
    exact_features,
    keys_after,
    keys_of,
    namespace_of,
    truncated,
)
from gateway.features.memo_cache import MemoCache, TextTokens
from gateway.features.model_registry import ModelRegistry
from gateway.features.prefix_checkpoints import MAX_TEXT_CHARS, Known, PrefixCheckpoints, continue_head
from gateway.features.prompt import Chars, Prompt, PromptSpec, Remote, Text, TokenIds, chars_of, read_prompt
from gateway.features.remote_tokenizer import RemoteTokenizeError, RemoteTokenizer, UrlChooser
from gateway.features.segment_encoder import BoundedLRU, EncodePlan, SegmentEncoder, TokenArray
from gateway.openai_errors import RequestError
from gateway.request import Endpoint, ParsedRequest, request_of
from router_policies.policy import RequestFeatures

__all__ = [
    "BACKGROUND_THREAD_NAME",
    "HEAD_MARGIN_CHARS",
    "FeatureInfo",
    "Featurizer",
    "Mode",
    "mark_background_thread",
]

Result = tuple[RequestFeatures, FeatureInfo]


class EncodeStats(NamedTuple):
    """How a prompt encoded here was encoded (``Encoded``'s fields after its token count)."""

    segments: int
    segments_cached: int
    encoded_chars: int = 0
    offloaded: bool = False


def _bytes_of(text: str, chars: int) -> int:
    """The bytes of ``chars`` characters of ``text`` (its width: 1, 2 or 4 bytes a character)."""
    return chars * max(1, (text_bytes(text) - text_bytes("")) // max(1, len(text)))


def encode_settings(proxy: ProxyConfig) -> EncodeSettings:
    """The featurizer's settings from the proxy's config."""
    return EncodeSettings(
        **_mirrored(EncodeSettings, proxy, skip="budgets"), budgets=Budgets(**_mirrored(Budgets, proxy))
    )


def _mirrored(cls: Any, proxy: ProxyConfig, skip: str = "") -> dict[str, Any]:
    """The fields of the dataclass ``cls`` read from ``proxy``: each is ``proxy.tokenize_<name>``,
    or ``proxy.<name>`` where the config has no ``tokenize_`` field of that name (the settings
    mirror the config's names, so a field missing from the config fails here, at start-up)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name != skip:
            prefixed = f"tokenize_{f.name}"
            out[f.name] = getattr(proxy, prefixed if prefixed in type(proxy).model_fields else f.name)
    return out


class Featurizer:
    def __init__(
        self,
        models: Sequence[ModelConfig],
        settings: EncodeSettings,
        *,
        remote: UrlChooser | None = None,
        base_dir: Path | None = None,
    ) -> None:
        b = settings.budgets
        self.memo = MemoCache(b.memo_cache_bytes)
        self.budgets = b
        # requests featurized per mode, and fallbacks to characters per reason class: for metrics
        self.mode_counts: dict[str, int] = {"local": 0, "remote": 0, "token_ids": 0, "chars": 0}
        self.fallback_counts: dict[str, int] = {}
        self._cache = BoundedLRU(settings.cache_entries, b.cache_bytes)
        self.executor = EncodeExecutor(settings.threads, settings.offload_chars, b.inflight_bytes)
        self.checkpoints = PrefixCheckpoints(b.checkpoint_bytes)
        limits = DeferredLimits(
            settings.defer_backlog_chars,
            b.defer_backlog_bytes,
            settings.defer_quiet_s,
            settings.defer_max_wait_s,
        )
        self.deferred = DeferredEncodes(
            limits,
            self.executor.background_pool,
            self.executor.pool,
            after_encode=self.executor.releaser.after_encode,
            checkpoints=self.checkpoints,
        )
        self.planner = EncodePlanner(settings.defer_chars, settings.seen_entries, self.deferred)
        self._remote = RemoteTokenizer(remote) if remote is not None else None
        self.models = ModelRegistry(
            models, self._cache, remote_available=remote is not None, base_dir=base_dir, memo=self.memo
        )

    @classmethod
    def from_config(
        cls, config: GatewayConfig, *, remote: UrlChooser | None = None, base_dir: Path | None = None
    ) -> Featurizer:
        return cls(config.models, encode_settings(config.proxy), remote=remote, base_dir=base_dir)

    # -- public ----------------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        return self.models.names()

    def cache_stats(self) -> dict[str, int]:
        c, d = self._cache, self.deferred
        return {
            "entries": len(c),
            "capacity": c.capacity,
            "hits": c.hits,
            "misses": c.misses,
            "evictions": c.evictions,
            "deferred": d.submitted,
            "deferred_encoded": d.encoded,
            "deferred_expedited": d.expedited,
            "deferred_expedited_heads": d.expedited_heads,
            "deferred_heads_first": d.heads_first,
            "deferred_lulls": d.lulls,
            "deferred_dropped": d.dropped,
            "deferred_expired": d.expired,
            "deferred_resumed": d.resumed,
            "deferred_backlog_chars": d.queued_chars,
            "seen_entries": len(self.planner.seen),
            "checkpoint_heads": self.checkpoints.composed,
            "checkpoint_refused": self.checkpoints.refused,
            "checkpoint_mismatches": self.checkpoints.mismatches,
            "memo_cache_hits": self.memo.hits,
            "memo_cache_misses": self.memo.misses,
        }

    def memory_stats(self) -> dict[str, tuple[int, int]]:
        """Per holder clients can fill: (bytes held, bound in bytes; 0: unbounded)."""
        b, d, seen = self.budgets, self.deferred, self.planner.seen
        return {
            "segment_cache": (self._cache.bytes, b.cache_bytes or 0),
            "memo_cache": (self.memo.bytes, b.memo_cache_bytes),
            "prefix_checkpoints": (self.checkpoints.bytes, b.checkpoint_bytes),
            "seen_texts": (len(seen) * SEEN_ENTRY_BYTES, seen.capacity * SEEN_ENTRY_BYTES),
            "deferred_backlog": (d.queued_bytes, b.defer_backlog_bytes or 0),
            "encodes_in_flight": (self.executor.inflight.held, b.inflight_bytes),
        }

    def _read(self, req: ParsedRequest) -> tuple[PromptSpec, Prompt]:
        """``read_prompt``, refusing a text longer than ``max_prompt_chars`` before it is encoded."""
        spec, prompt = read_prompt(req, self.models)
        cap = self.budgets.max_prompt_chars
        if cap is not None and isinstance(prompt, Text) and len(prompt.text) > cap:
            raise RequestError(
                f"the prompt has {len(prompt.text)} characters, more than the {cap} this gateway "
                "tokenizes (proxy.max_prompt_chars)",
                param=req.prompt_field,
                code="prompt_too_long",
            )
        return spec, prompt

    async def featurize(self, req: ParsedRequest, *, explain: bool = False) -> Result:
        """The request path's features (raises ``RequestError``); ``explain``: no side effect."""
        if explain:
            with self.memo.read_only():  # the chat template's memo, used while reading
                spec, prompt = self._read(req)
        else:
            self.deferred.arrival()
            spec, prompt = self._read(req)
        if isinstance(prompt, Remote):
            prompt = await self._tokenize_remotely(req, spec)
        if isinstance(prompt, Text):
            return await self._encode(req, spec, prompt, explain)
        return self._count(self._keyed(req, spec, prompt), prompt, explain)

    def featurize_sync(self, req: ParsedRequest) -> Result:
        """Everything on the calling thread. A ``remote`` model routes on characters here (no
        network from a synchronous call); use ``featurize`` for its exact tokens."""
        spec, prompt = self._read(req)
        if isinstance(prompt, Remote):
            prompt = Chars(chars_of(req), "remote tokenizer in a synchronous call", "sync_call")
        if isinstance(prompt, Text):
            enc, ast = self._encoder(spec), prompt.add_special_tokens
            plan = enc.plan(prompt.text, add_special_tokens=ast)
            tokens = enc.finish(
                plan, enc.encode_missing(plan, add_special_tokens=ast), add_special_tokens=ast
            )
            stats = EncodeStats(plan.segments, plan.cached_segments, plan.missing_chars)
            return self._count(self._encoded(req, spec, tokens, stats), prompt, False)
        return self._count(self._keyed(req, spec, prompt), prompt, False)

    async def features(
        self, kind: Endpoint, body: Mapping[str, Any], session_id: str | None = None
    ) -> Result:
        """``featurize`` of a request given as its parsed body."""
        return await self.featurize(request_of(kind, body, session_id))

    def features_sync(self, kind: Endpoint, body: Mapping[str, Any], session_id: str | None = None) -> Result:
        """``featurize_sync`` of a request given as its parsed body."""
        return self.featurize_sync(request_of(kind, body, session_id))

    async def close(self) -> None:
        """Stop the deferred encodes, then the threads (waiting for running encodes), then close
        the HTTP session."""
        await self.deferred.close()
        await self.executor.close()
        if self._remote is not None:
            await self._remote.close()

    # -- steps -----------------------------------------------------------------------------------

    @staticmethod
    def _encoder(spec: PromptSpec) -> SegmentEncoder:
        local = spec.resolved.model.local
        assert local is not None  # a Text prompt is only read for a model tokenized here
        return local.encoder

    async def _tokenize_remotely(self, req: ParsedRequest, spec: PromptSpec) -> TokenIds | Chars:
        assert self._remote is not None  # the registry refuses remote models without replicas
        mc = spec.resolved.model.config
        try:
            ids = await self._remote.tokenize(
                req.endpoint, mc.name, spec.resolved.requested, req.body, mc.tokenize_timeout_s
            )
        except RemoteTokenizeError as exc:
            return Chars(chars_of(req), str(exc), "remote_failed")
        return TokenIds(np.asarray(ids, dtype=np.uint32), "remote")

    async def _encode(self, req: ParsedRequest, spec: PromptSpec, prompt: Text, explain: bool) -> Result:
        enc = self._encoder(spec)
        memo = self.memo.text_tokens(enc.namespace, prompt) if not explain else None
        if memo is not None and memo.found is not None:
            tokens, segments = memo.found
            stats = EncodeStats(segments, segments)
            return self._count(self._encoded(req, spec, tokens, stats, memo), prompt, explain)
        step = await self.planner.plan(enc, prompt, spec.truncate is not None, explain)
        if isinstance(step, Defer):
            return self._count(await self._defer(req, spec, prompt, step, explain), prompt, explain)
        plan, ast = step.plan, prompt.add_special_tokens
        done, offloaded = await self.executor.run(
            plan.missing_chars,
            lambda: enc.encode_missing(plan, add_special_tokens=ast),
            nbytes=_bytes_of(prompt.text, plan.missing_chars),
        )
        tokens = enc.finish(plan, done, add_special_tokens=ast, record=not explain)
        if memo is not None:
            memo.keep(tokens, plan.segments)
        stats = EncodeStats(plan.segments, plan.cached_segments, plan.missing_chars, offloaded)
        return self._count(self._encoded(req, spec, tokens, stats, memo, explain), prompt, explain)

    def _encoded(
        self,
        req: ParsedRequest,
        spec: PromptSpec,
        tokens: TokenArray,
        stats: EncodeStats,
        text: TextTokens | None = None,
        explain: bool = False,
    ) -> Result:
        """Features of a prompt encoded here (``tokens``: all of them; ``stats``: how); the keys
        come from the memo cache (found by ``text``'s memo entry, the text the tokens are of,
        when there is one), which ``explain`` leaves as it is."""
        tokens = truncated(spec, tokens)
        how = Encoded("local", len(tokens), *stats)
        compute = keys_of(spec)
        if explain:
            keys = compute(tokens)
        else:
            # the tokens are a pure function of the text's entry and the truncation
            source = (text.key, spec.truncate, spec.truncation_side) if text is not None else None
            keys = self.memo.keys(namespace_of(spec), tokens, compute, source)
        return exact_features(spec, tokens, how, req.session_id, keys)

    async def _composed_head(
        self, enc: SegmentEncoder, plan: EncodePlan, step: Defer, explain: bool
    ) -> tuple[TokenArray, int, int, Known] | None:
        """The head of a text to encode (the whole prompt, or its first new segment) from the
        checkpoints of its blocks seen before, encoding only what follows them
        (prefix_checkpoints.py): its tokens, the characters they cover and those encoded, and the
        checkpoints' part; None: encode it from the start. ``explain``: no checkpoint refreshed,
        nothing counted."""
        known = self.checkpoints.known(step.fingerprints[: step.seen], peek=explain)
        if known is None:
            return None
        text = plan.first_text()
        start, end = known.span(step.head_chars)
        chars = end - start
        out, _ = await self.executor.run(
            chars, lambda: continue_head(enc.tokenizer, text, step.head_chars, known)
        )
        if not explain:
            if out is None:
                self.checkpoints.refused += 1
            else:
                self.checkpoints.composed += 1
        return None if out is None else (out[0], out[1], chars, known)

    async def _defer(
        self, req: ParsedRequest, spec: PromptSpec, prompt: Text, step: Defer, explain: bool
    ) -> Result:
        """Key the exact cached prefix plus the exact tokens of the new text's first
        ``step.head_chars`` characters (within its first segment); estimate the rest and encode
        it all in the background (not for ``explain``)."""
        enc, plan, ast = self._encoder(spec), step.plan, prompt.add_special_tokens
        tokens = enc.prefix_tokens(plan, add_special_tokens=ast)
        covered = encoded = 0
        composed = None
        if step.head_chars and (plan.whole is None or enc.can_cut_whole(ast)):
            composed = await self._composed_head(enc, plan, step, explain)
            if composed is None:
                # a long head leaves the event loop like any long encode
                (head, covered), _ = await self.executor.run(
                    step.head_chars, lambda: enc.head_tokens(plan, step.head_chars)
                )
                encoded = covered
            else:
                head, covered, encoded, _ = composed
            tokens = np.concatenate([tokens, head])
        rest = len(prompt.text) - step.start - covered
        keys = keys_of(spec)(tokens)
        job = None if explain else DeferredJob(enc, plan, ast, step.anchor, keys_after(spec, tokens, keys))
        if job is not None:
            if len(plan.first_text()) <= MAX_TEXT_CHARS:
                job.fingerprints = step.fingerprints  # its encode records checkpoints
            if composed is not None:  # its encode resumes after the checkpoints (deferred.py)
                job.composed_from(composed[0], composed[3])
            self.deferred.submit(job)
        how = Encoded(
            "local",
            len(tokens) + enc.estimate_tokens(rest),
            segments=plan.segments,
            segments_cached=plan.cached_segments,
            encoded_chars=encoded,
            deferred_chars=rest,
            deferred=job,
        )
        return exact_features(spec, tokens, how, req.session_id, keys)

    @staticmethod
    def _keyed(req: ParsedRequest, spec: PromptSpec, prompt: TokenIds | Chars) -> Result:
        if isinstance(prompt, TokenIds):
            tokens = truncated(spec, prompt.tokens)
            return exact_features(spec, tokens, Encoded(prompt.source, len(tokens)), req.session_id)
        return char_features(spec, prompt, req.session_id)

    def _count(self, result: Result, prompt: Prompt, explain: bool) -> Result:
        """Count the request per mode and fallback (metrics); not for ``explain``."""
        if not explain:
            self.mode_counts[result[1].mode] += 1
            if isinstance(prompt, Chars) and prompt.fallback_kind is not None:
                kind = prompt.fallback_kind
                self.fallback_counts[kind] = self.fallback_counts.get(kind, 0) + 1
        return result
