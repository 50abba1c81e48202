"""From a parsed request body to the policy's ``RequestFeatures`` (ARCHITECTURE.md §3, §10).

One ``Featurizer`` is built per config by the composition root and passed to the proxy; it holds
every model's tokenizer, compiled chat templates, the one bounded segment cache
(``proxy.tokenize_cache_entries``), the worker threads for long encodes and the remote-tokenize
client. Nothing here is module state. ``close()`` shuts the threads and the HTTP session; call it
after the HTTP server stopped taking requests.

Per model, ``tokenizer`` chooses the mode:
- a folder: exact tokens, rendered and encoded as vLLM + transformers do (``mode="local"``);
- ``remote``: the ids from a replica's ``/tokenize`` (``mode="remote"``), falling back to
  character blocks when that fails;
- null: approximate keys on character blocks (``mode="chars"``, ``approximate=True``).
A completions prompt given as token ids is exact in every mode (the ids are the tokens).

New text is routed before it is encoded (``proxy.tokenize_defer_chars``): when at least that
many characters of a prompt are not in the segment cache, ``SeenTexts`` tells how much of the
text from the first uncached segment on reached this gateway before after the same prefix (in
256-character blocks). Text never seen is in no replica's cache through us, so ``features`` keys
the exact cached prefix plus the exact tokens of the seen head of the first uncached segment,
estimates the rest's token count from this tokenizer's characters per token so far, and leaves
the encoding of the rest to ``DeferredEncodes`` (off the request path). Text seen whole is
encoded before routing, as are truncated prompts. ``features_sync`` never defers.

Key namespace: the ``model`` field may name a configured model or one of its ``lora_adapters``;
keys are then ``block_keys(tokens, block_size, base_model, lora=adapter, cache_salt=body's
cache_salt)``. ``RequestFeatures.model`` is the base model (replicas are listed by base model).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from gateway.config import GatewayConfig, ModelConfig
from gateway.features.char_blocks import CHARS_PER_TOKEN, char_block_keys, estimated_tokens
from gateway.features.chat_request import (
    Unrepresentable,
    chat_prompt_of,
    completion_prompt_of,
    conversation_of,
    plain_text_of_chat,
    tools_of,
    truncation_of,
)
from gateway.features.chat_template import ChatTemplate, TemplateRenderError, make_environment
from gateway.features.deferred import DeferredEncodes, DeferredJob
from gateway.features.novelty import PROBE_CHARS, SeenTexts
from gateway.features.remote_tokenizer import RemoteTokenizeError, RemoteTokenizer, UrlChooser
from gateway.features.segment_encoder import BoundedLRU, EncodePlan, SegmentEncoder, TokenArray
from gateway.features.tokenizer_files import FeatureConfigError, TokenizerFiles, load_tokenizer_files
from gateway.request_errors import InvalidRequestError, UnknownModelError
from router_policies.block_keys import block_keys
from router_policies.policy import RequestFeatures

Kind = Literal["completions", "chat"]
Mode = Literal["local", "remote", "token_ids", "chars"]


@dataclass(frozen=True, slots=True)
class FeatureInfo:
    """What the proxy logs and exports about how the features were made."""

    model: str  # as the request named it
    base_model: str
    lora: str | None
    mode: Mode  # how the tokens were obtained: encoded here, by a replica, given as ids, or chars
    approximate: bool  # keys are character blocks, not engine tokens
    fallback_reason: str | None  # why an exact mode fell back to characters
    prompt_tokens: int
    segments: int  # segments the prompt was encoded in (0: not encoded here)
    segments_cached: int
    encoded_chars: int  # characters actually encoded for this request
    offloaded: bool  # the encode ran on a worker thread
    token_ids: TokenArray | None  # the prompt's tokens (None when approximate or deferred)
    deferred_chars: int = 0  # trailing characters routed on an estimate, encoded later
    deferred: DeferredJob | None = None  # that later encode (the proxy sets its ``on_keys``)

    @property
    def exact(self) -> bool:
        """Keys and token count are the engine's: the prediction can be audited."""
        return not self.approximate and self.deferred_chars == 0

    @property
    def cache_hit(self) -> bool:
        """Every segment came from the cache (nothing was encoded)."""
        return self.segments > 0 and self.segments_cached == self.segments


@dataclass
class _Local:
    files: TokenizerFiles
    encoder: SegmentEncoder
    templates: dict[str, ChatTemplate]
    vocab_size: int

    def template(self, has_tools: bool) -> ChatTemplate:
        source = self.files.template_for(has_tools)
        if source is None:
            raise InvalidRequestError(
                "this model has no chat template; use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        return self.templates[source]


@dataclass
class _Model:
    config: ModelConfig
    local: _Local | None  # set in local mode


@dataclass
class _Prepared:
    """A request read and rendered, waiting for its text to be encoded."""

    model: _Model
    lora: str | None
    salt: str | None
    requested: str
    text: str | None = None  # text to encode locally
    add_special_tokens: bool = False
    tokens: TokenArray | None = None  # tokens known without encoding
    chars: str | None = None  # approximate text (chars mode or fallback)
    fallback_reason: str | None = None
    fallback_kind: str | None = None  # "unrepresentable" | "remote_failed" | "sync_call"
    remote: bool = False  # ask /tokenize
    source: Mode = "chars"  # where ``tokens`` came from
    truncate: int | None = None
    truncation_side: str = "left"


HEAD_MARGIN_CHARS = 64  # encoded past the last block of new text seen before (see features())
BACKGROUND_THREAD_NAME = b"kvgate-deferred"  # the OS thread name (``/proc/PID/task/*/comm``)


def mark_background_thread() -> None:
    """Give the calling thread the lowest scheduling priority (Linux: per-thread nice 19) and an
    OS-visible name, so that tools (``top -H``, the overhead benchmark) can tell its CPU apart."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None, use_errno=True).prctl(15, BACKGROUND_THREAD_NAME, 0, 0, 0)  # PR_SET_NAME


class Featurizer:
    def __init__(
        self,
        models: Sequence[ModelConfig],
        *,
        cache_entries: int,
        threads: int = 2,
        offload_chars: int = 16384,
        defer_chars: int = 0,
        seen_entries: int = 262144,
        defer_backlog_chars: int = 4_000_000,
        remote: UrlChooser | None = None,
        base_dir: Path | None = None,
        session_header: str = "x-session-id",
    ) -> None:
        self._session_header = session_header
        # requests featurized per mode, and fallbacks to characters per reason class: for metrics
        self.mode_counts: dict[str, int] = {"local": 0, "remote": 0, "token_ids": 0, "chars": 0}
        self.fallback_counts: dict[str, int] = {}
        self._cache = BoundedLRU(cache_entries)
        self._offload_chars = offload_chars
        self._threads = threads
        self._executor: ThreadPoolExecutor | None = None
        # at most 4 encodes queued per thread: beyond that requests wait their turn here
        self.offload_bound = threads * 4
        self._slots = asyncio.Semaphore(self.offload_bound) if threads > 0 else None
        self.offload_queued = 0  # encodes handed to the pool and not finished (<= offload_bound)
        self.offload_queued_max = 0
        self._defer_chars = defer_chars
        # a request sharing this many blocks of new text with a waiting deferred encode takes
        # it over (a burst); one sharing less (a common head) does not
        self._anchor_blocks = max(1, -(-defer_chars // PROBE_CHARS))
        self._seen = SeenTexts(seen_entries)
        self._background: ThreadPoolExecutor | None = None
        self.deferred = DeferredEncodes(defer_backlog_chars, self._background_pool, self._pool)
        self._remote = RemoteTokenizer(remote) if remote is not None else None
        env = make_environment()
        loaded: dict[Path, _Local] = {}
        self._models: dict[str, tuple[_Model, str | None]] = {}
        for i, mc in enumerate(models):
            where = f"models[{i}]"
            local: _Local | None = None
            if mc.tokenizer == "remote":
                if remote is None:
                    raise FeatureConfigError(
                        f"{where}.tokenizer: 'remote' needs a replica to ask (none given)"
                    )
            elif mc.tokenizer is not None:
                folder = Path(mc.tokenizer)
                if not folder.is_absolute() and base_dir is not None:
                    folder = base_dir / folder
                override = None
                if mc.chat_template is not None:
                    tpath = Path(mc.chat_template)
                    if not tpath.is_absolute() and base_dir is not None:
                        tpath = base_dir / tpath
                    try:
                        override = tpath.read_text(encoding="utf-8")
                    except OSError as exc:
                        raise FeatureConfigError(
                            f"{where}.chat_template: cannot read {tpath}: {exc.strerror}"
                        ) from None
                key = folder.resolve()
                if override is None and key in loaded:
                    local = loaded[key]
                else:
                    files = load_tokenizer_files(
                        folder, where=f"{where}.tokenizer", chat_template_override=override
                    )
                    templates: dict[str, ChatTemplate] = {}
                    for source in {files.chat_template, *files.named_templates.values()}:
                        if source is None:
                            continue
                        try:
                            templates[source] = ChatTemplate(source, files.special_tokens, env)
                        except ValueError as exc:
                            raise FeatureConfigError(f"{where}.tokenizer: {exc}") from None
                    local = _Local(
                        files=files,
                        encoder=SegmentEncoder(files.tokenizer, self._cache, f"{key}#{len(loaded)}"),
                        templates=templates,
                        vocab_size=files.tokenizer.get_vocab_size(with_added_tokens=True),
                    )
                    if override is None:
                        loaded[key] = local
            model = _Model(config=mc, local=local)
            for name, lora in [(mc.name, None), *((a, a) for a in mc.lora_adapters)]:
                if name in self._models:
                    raise FeatureConfigError(
                        f"{where}.lora_adapters: name {name!r} is already a model or adapter"
                    )
                self._models[name] = (model, lora)

    @classmethod
    def from_config(
        cls, config: GatewayConfig, *, remote: UrlChooser | None = None, base_dir: Path | None = None
    ) -> Featurizer:
        return cls(
            config.models,
            cache_entries=config.proxy.tokenize_cache_entries,
            threads=config.proxy.tokenize_threads,
            offload_chars=config.proxy.tokenize_offload_chars,
            defer_chars=config.proxy.tokenize_defer_chars,
            seen_entries=config.proxy.tokenize_seen_entries,
            defer_backlog_chars=config.proxy.tokenize_defer_backlog_chars,
            remote=remote,
            base_dir=base_dir,
            session_header=config.proxy.session_header,
        )

    # -- public ----------------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        return list(self._models)

    def cache_stats(self) -> dict[str, int]:
        c = self._cache
        return {
            "entries": len(c),
            "capacity": c.capacity,
            "hits": c.hits,
            "misses": c.misses,
            "evictions": c.evictions,
            "deferred": self.deferred.submitted,
            "deferred_encoded": self.deferred.encoded,
            "deferred_expedited": self.deferred.expedited,
            "deferred_dropped": self.deferred.dropped,
            "deferred_backlog_chars": self.deferred.queued_chars,
            "seen_entries": len(self._seen),
        }

    def features_sync(
        self, kind: Kind, body: Mapping[str, Any], session_id: str | None = None
    ) -> tuple[RequestFeatures, FeatureInfo]:
        """Everything on the calling thread. A ``remote`` model routes on characters here (no
        network from a synchronous call); use ``features`` for its exact tokens."""
        prep = self._prepare(kind, body)
        if prep.remote:
            prep.chars, prep.fallback_reason = (
                self._chars_of(kind, body),
                "remote tokenizer in a synchronous call",
            )
            prep.fallback_kind = "sync_call"
        if prep.text is not None and prep.model.local is not None:
            enc = prep.model.local.encoder
            plan = enc.plan(prep.text, add_special_tokens=prep.add_special_tokens)
            done = enc.encode_missing(plan, add_special_tokens=prep.add_special_tokens)
            return self._finish(prep, plan, done, False, session_id)
        return self._finish(prep, None, None, False, session_id)

    async def features(
        self, kind: Kind, body: Mapping[str, Any], session_id: str | None = None
    ) -> tuple[RequestFeatures, FeatureInfo]:
        prep = self._prepare(kind, body)
        if prep.remote:
            assert self._remote is not None
            try:
                ids = await self._remote.tokenize(
                    kind, prep.model.config.name, prep.requested, body, prep.model.config.tokenize_timeout_s
                )
                prep.tokens, prep.source = np.asarray(ids, dtype=np.uint32), "remote"
            except RemoteTokenizeError as exc:
                prep.chars, prep.fallback_reason = self._chars_of(kind, body), str(exc)
                prep.fallback_kind = "remote_failed"
        if prep.text is not None and prep.model.local is not None:
            enc = prep.model.local.encoder
            plan = enc.plan(prep.text, add_special_tokens=prep.add_special_tokens)
            probe = self._deferrable(prep, enc, plan)
            if probe is not None:
                start, fingerprints = probe
                seen = self._seen.seen_run(fingerprints)
                a = min(len(fingerprints), self._anchor_blocks) - 1
                if seen > a and self.deferred.pending(fingerprints[a]):
                    # a burst on the same new text: the earlier request's encode records its
                    # replica's entries first, then this one is encoded and matched exactly
                    await self.deferred.expedite(fingerprints[a])
                    plan = enc.plan(prep.text, add_special_tokens=prep.add_special_tokens)
                elif seen < len(fingerprints):
                    # the text stops matching what came before somewhere in the first block not
                    # seen: encoding through it (and a margin for the words dropped at the cut)
                    # keys every block another request can share
                    head = (seen + 1) * PROBE_CHARS + HEAD_MARGIN_CHARS if seen else 0
                    return await self._finish_deferred(
                        prep, enc, plan, start, head, fingerprints[a], session_id
                    )
                # else all of it came before, so a replica may hold all of it: encode it now
            offload = plan.missing_chars >= self._offload_chars and self._slots is not None
            if offload:
                assert self._slots is not None
                async with self._slots:
                    pool = self._pool()
                    assert pool is not None
                    self.offload_queued += 1
                    self.offload_queued_max = max(self.offload_queued_max, self.offload_queued)
                    try:
                        done = await asyncio.get_running_loop().run_in_executor(
                            pool,
                            lambda: enc.encode_missing(plan, add_special_tokens=prep.add_special_tokens),
                        )
                    finally:
                        self.offload_queued -= 1
            else:
                done = enc.encode_missing(plan, add_special_tokens=prep.add_special_tokens)
            return self._finish(prep, plan, done, offload, session_id)
        return self._finish(prep, None, None, False, session_id)

    async def __call__(
        self, endpoint: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> RequestFeatures:
        """The proxy's featurizer interface: ``endpoint`` is "chat" or "completions", the session
        id comes from the configured header."""
        kind: Kind = "chat" if endpoint == "chat" else "completions"
        features, _ = await self.features(kind, body, headers.get(self._session_header))
        return features

    async def close(self) -> None:
        """Stop the deferred encodes, then the worker threads (waiting for running encodes), then
        close the HTTP session."""
        await self.deferred.close()
        if self._background is not None:
            background, self._background = self._background, None
            await asyncio.get_running_loop().run_in_executor(None, background.shutdown)
        if self._remote is not None:
            await self._remote.close()
        if self._executor is not None:
            executor, self._executor = self._executor, None
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown)

    # -- steps -----------------------------------------------------------------------------------

    def _background_pool(self) -> ThreadPoolExecutor:
        """One worker thread at the lowest CPU priority for deferred encodes: they are work for a
        later request, so they yield the CPU to requests being routed and to co-located engines."""
        if self._background is None:
            self._background = ThreadPoolExecutor(
                1, thread_name_prefix="kvgate-deferred", initializer=mark_background_thread
            )
        return self._background

    def _pool(self) -> ThreadPoolExecutor | None:
        """The worker threads, started on first use (None when configured with none)."""
        if self._executor is None and self._threads > 0:
            self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix="kvgate-tokenize")
        return self._executor

    def _deferrable(
        self, prep: _Prepared, enc: SegmentEncoder, plan: EncodePlan
    ) -> tuple[int, list[int]] | None:
        """(character offset of the first uncached segment, fingerprints of the text from there)
        when enough of ``prep.text`` is uncached to route it before encoding it all, else None.
        Truncated prompts are always encoded first (their kept tokens depend on the count)."""
        if not self._defer_chars or prep.truncate is not None or plan.missing_chars < self._defer_chars:
            return None
        assert prep.text is not None
        start = 0 if plan.whole is not None else plan.start_of(plan.missing[0])
        return start, SeenTexts.fingerprints(enc.seed, prep.text, start)

    async def _finish_deferred(
        self,
        prep: _Prepared,
        enc: SegmentEncoder,
        plan: EncodePlan,
        start: int,
        head_chars: int,
        anchor: int,
        session_id: str | None,
    ) -> tuple[RequestFeatures, FeatureInfo]:
        """Key the exact cached prefix plus the exact tokens of the new text's first
        ``head_chars`` characters (within its first segment); estimate the rest and encode it all
        in the background."""
        assert prep.text is not None
        tokens = enc.prefix_tokens(plan, add_special_tokens=prep.add_special_tokens)
        covered = 0
        if head_chars and (plan.whole is None or enc.can_cut_whole(prep.add_special_tokens)):
            pool = self._pool() if head_chars >= self._offload_chars else None
            if pool is None:
                head, covered = enc.head_tokens(plan, head_chars)
            else:  # a long head leaves the event loop like any long encode
                head, covered = await asyncio.get_running_loop().run_in_executor(
                    pool, enc.head_tokens, plan, head_chars
                )
            tokens = np.concatenate([tokens, head])
        rest = len(prep.text) - start - covered
        block_size, base, lora, salt = (
            prep.model.config.block_size,
            prep.model.config.name,
            prep.lora,
            prep.salt,
        )
        job = DeferredJob(
            enc,
            plan,
            prep.add_special_tokens,
            anchor,
            lambda t: block_keys(t, block_size, base, lora, salt),
        )
        self.deferred.submit(job)
        prep.source = "local"
        return self._exact(
            prep,
            tokens,
            len(tokens) + enc.estimate_tokens(rest),
            segments=plan.segments,
            cached=plan.cached_segments,
            encoded_chars=covered,
            offloaded=False,
            deferred=job,
            deferred_chars=rest,
            session_id=session_id,
        )

    def _resolve(self, body: Mapping[str, Any]) -> tuple[_Model, str | None, str]:
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("'model' must be a non-empty string", param="model")
        found = self._models.get(name)
        if found is None:
            raise UnknownModelError(name)
        return found[0], found[1], name

    @staticmethod
    def _salt(body: Mapping[str, Any]) -> str | None:
        salt = body.get("cache_salt")
        if salt is None:
            return None
        if not isinstance(salt, str) or not 1 <= len(salt) <= 1024:
            raise InvalidRequestError(
                "'cache_salt' must be a string of 1 to 1024 characters", param="cache_salt"
            )
        return salt

    def _chars_of(self, kind: Kind, body: Mapping[str, Any]) -> str:
        if kind == "chat":
            conversation = conversation_of(body.get("messages"), "string", lenient=True)
            return plain_text_of_chat(conversation, tools_of(body.get("tools")))
        prompt = completion_prompt_of(body)
        return prompt if isinstance(prompt, str) else ""

    def _prepare(self, kind: Kind, body: Mapping[str, Any]) -> _Prepared:
        if not isinstance(body, Mapping):
            raise InvalidRequestError("the request body must be a JSON object")
        model, lora, requested = self._resolve(body)
        prep = _Prepared(model=model, lora=lora, salt=self._salt(body), requested=requested)
        prep.truncate, prep.truncation_side = truncation_of(body)
        try:
            if kind == "completions":
                self._prepare_completion(prep, body)
            else:
                self._prepare_chat(prep, body)
        except Unrepresentable as exc:
            prep.text, prep.tokens, prep.remote = None, None, False
            prep.chars, prep.fallback_reason = self._chars_of(kind, body), f"unrepresentable input: {exc}"
            prep.fallback_kind = "unrepresentable"
        return prep

    def _prepare_completion(self, prep: _Prepared, body: Mapping[str, Any]) -> None:
        prompt = completion_prompt_of(body)
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise InvalidRequestError("'add_special_tokens' must be a boolean", param="add_special_tokens")
        local = prep.model.local
        if isinstance(prompt, list):
            if local is not None and max(prompt) >= local.vocab_size:
                raise InvalidRequestError(
                    f"token id {max(prompt)} is out of vocabulary (size {local.vocab_size})", param="prompt"
                )
            prep.tokens, prep.source = np.asarray(prompt, dtype=np.uint32), "token_ids"
        elif local is not None:
            prep.text, prep.add_special_tokens = prompt, add_special
        elif prep.model.config.tokenizer == "remote":
            prep.remote = True
        else:
            prep.chars = prompt

    def _prepare_chat(self, prep: _Prepared, body: Mapping[str, Any]) -> None:
        local = prep.model.local
        if local is None:
            conversation = conversation_of(body.get("messages"), "string")  # validates the messages
            tools = tools_of(body.get("tools"))
            if prep.model.config.tokenizer == "remote":
                prep.remote = True
            else:
                prep.chars = plain_text_of_chat(conversation, tools)
            return
        template = local.template(body.get("tools") is not None)
        chat = chat_prompt_of(body, template.content_format, template.variables)
        try:
            prep.text = template.render(
                chat.conversation,
                tools=chat.tools,
                documents=chat.documents,
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                kwargs=chat.template_kwargs,
            )
        except TemplateRenderError as exc:
            raise InvalidRequestError(
                f"chat template error: {exc}", param="messages", code="template_error"
            ) from None
        prep.add_special_tokens = chat.add_special_tokens

    def _finish(
        self,
        prep: _Prepared,
        plan: EncodePlan | None,
        encoded: list[TokenArray] | None,
        offloaded: bool,
        session_id: str | None,
    ) -> tuple[RequestFeatures, FeatureInfo]:
        mc = prep.model.config
        base = mc.name
        segments = cached = encoded_chars = 0
        tokens = prep.tokens
        if plan is not None and encoded is not None and prep.model.local is not None:
            segments, cached, encoded_chars = plan.segments, plan.cached_segments, plan.missing_chars
            tokens = prep.model.local.encoder.finish(
                plan, encoded, add_special_tokens=prep.add_special_tokens
            )
            prep.source = "local"
        if tokens is not None:
            if prep.truncate is not None and prep.truncate < len(tokens):
                tokens = (
                    tokens[len(tokens) - prep.truncate :]
                    if prep.truncation_side == "left"
                    else tokens[: prep.truncate]
                )
            return self._exact(
                prep,
                tokens,
                len(tokens),
                segments=segments,
                cached=cached,
                encoded_chars=encoded_chars,
                offloaded=offloaded,
                deferred=None,
                deferred_chars=0,
                session_id=session_id,
            )
        text = prep.chars or ""
        keys = char_block_keys(text, mc.char_block_size, base, prep.lora, prep.salt)
        n = estimated_tokens(text)
        features = RequestFeatures(
            model=base,
            block_keys=keys,
            prompt_tokens=n,
            block_size=max(1, round(mc.char_block_size / CHARS_PER_TOKEN)),
            session_id=session_id,
        )
        info = FeatureInfo(
            model=prep.requested,
            base_model=base,
            lora=prep.lora,
            mode="chars",
            approximate=True,
            fallback_reason=prep.fallback_reason,
            prompt_tokens=n,
            segments=0,
            segments_cached=0,
            encoded_chars=0,
            offloaded=False,
            token_ids=None,
        )
        self.mode_counts["chars"] += 1
        if prep.fallback_kind is not None:
            self.fallback_counts[prep.fallback_kind] = self.fallback_counts.get(prep.fallback_kind, 0) + 1
        return features, info

    def _exact(
        self,
        prep: _Prepared,
        tokens: TokenArray,
        prompt_tokens: int,
        *,
        segments: int,
        cached: int,
        encoded_chars: int,
        offloaded: bool,
        deferred: DeferredJob | None,
        deferred_chars: int,
        session_id: str | None,
    ) -> tuple[RequestFeatures, FeatureInfo]:
        """Features keyed on engine tokens: all of the prompt's, or its exact prefix when the
        rest is deferred (``prompt_tokens`` then counts the estimated rest too)."""
        base = prep.model.config.name
        block_size = prep.model.config.block_size
        features = RequestFeatures(
            model=base,
            block_keys=block_keys(tokens, block_size, base, prep.lora, prep.salt),
            prompt_tokens=prompt_tokens,
            block_size=block_size,
            session_id=session_id,
        )
        info = FeatureInfo(
            model=prep.requested,
            base_model=base,
            lora=prep.lora,
            mode=prep.source,
            approximate=False,
            fallback_reason=None,
            prompt_tokens=prompt_tokens,
            segments=segments,
            segments_cached=cached,
            encoded_chars=encoded_chars,
            offloaded=offloaded,
            token_ids=None if deferred_chars else tokens,
            deferred_chars=deferred_chars,
            deferred=deferred,
        )
        self.mode_counts[prep.source] += 1
        return features, info
