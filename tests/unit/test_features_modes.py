"""Key namespaces (model, LoRA adapter, cache salt), the three tokenizer modes and their
fallbacks, truncation, the proxy's call interface, and the worker threads' lifecycle."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gateway.app_parts import build_state
from gateway.config import ModelConfig, parse_config
from gateway.features import EncodeSettings, Featurizer
from gateway.features.char_blocks import char_block_keys
from gateway.request import request_of
from router_policies.block_keys import block_keys
from tests.loopback_app import serving

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "assets/tokenizers/kvgate-tiny")
LONG = "The quick brown fox jumps over the lazy dog. " * 40
CHAT = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": LONG}]}


def make(**kw: Any) -> Featurizer:
    models = [
        ModelConfig(name="tiny", tokenizer=TINY, block_size=16, lora_adapters=["sql-lora", "chat-lora"]),
        ModelConfig(name="plain", tokenizer=None, char_block_size=64, block_size=16),
    ]
    return Featurizer(models, EncodeSettings(cache_entries=kw.pop("cache_entries", 1000), **kw))


def test_lora_adapter_and_cache_salt_make_their_own_namespaces() -> None:
    fz = make()
    base, base_info = fz.features_sync("completions", {"model": "tiny", "prompt": LONG})
    lora, lora_info = fz.features_sync("completions", {"model": "sql-lora", "prompt": LONG})
    salted, _ = fz.features_sync(
        "completions", {"model": "sql-lora", "prompt": LONG, "cache_salt": "tenant-1"}
    )
    assert base_info.token_ids is not None and lora_info.token_ids is not None
    tokens = base_info.token_ids.tolist()
    assert lora_info.token_ids.tolist() == tokens  # same tokens, other keys
    assert list(base.block_keys) == block_keys(tokens, 16, "tiny")
    assert list(lora.block_keys) == block_keys(tokens, 16, "tiny", lora="sql-lora")
    assert list(salted.block_keys) == block_keys(tokens, 16, "tiny", lora="sql-lora", cache_salt="tenant-1")
    assert len({base.block_keys[0], lora.block_keys[0], salted.block_keys[0]}) == 3
    # routing is by base model; the adapter is reported
    assert lora.model == "tiny" and lora_info.lora == "sql-lora" and lora_info.model == "sql-lora"
    assert sorted(fz.model_names()) == ["chat-lora", "plain", "sql-lora", "tiny"]


def test_char_mode_is_approximate_and_namespaced() -> None:
    fz = make()
    f1, info = fz.features_sync("chat", {"model": "plain", **CHAT})
    f2, _ = fz.features_sync("chat", {"model": "plain", **CHAT})
    f3, _ = fz.features_sync("chat", {"model": "plain", **CHAT, "cache_salt": "s"})
    assert (
        info.approximate and info.mode == "chars" and info.token_ids is None and info.fallback_reason is None
    )
    assert list(f1.block_keys) == list(f2.block_keys) and f1.block_keys
    assert f1.block_keys[0] != f3.block_keys[0]
    assert f1.block_size == 16  # 64 characters ~ 16 tokens
    text = "system\nS\nuser\n" + LONG + "\n"
    assert list(f1.block_keys) == char_block_keys(text, 64, "plain")
    # character keys never collide with token keys of the same namespace
    assert not set(char_block_keys(LONG, 16, "tiny")) & set(
        fz.features_sync("completions", {"model": "tiny", "prompt": LONG})[0].block_keys
    )
    assert fz.mode_counts["chars"] == 3


def test_token_id_prompts_are_exact_in_every_mode() -> None:
    fz = make()
    ids = list(range(3, 300))
    for model in ("tiny", "plain"):
        features, info = fz.features_sync("completions", {"model": model, "prompt": ids})
        assert info.mode == "token_ids" and not info.approximate
        assert list(features.block_keys) == block_keys(ids, 16, model)
    features, _ = fz.features_sync("completions", {"model": "tiny", "prompt": [ids]})  # a batch of one
    assert list(features.block_keys) == block_keys(ids, 16, "tiny")


def test_truncation_keeps_the_end_by_default() -> None:
    fz = make()
    _, full = fz.features_sync("completions", {"model": "tiny", "prompt": LONG})
    assert full.token_ids is not None
    f, info = fz.features_sync("completions", {"model": "tiny", "prompt": LONG, "truncate_prompt_tokens": 40})
    assert info.token_ids is not None and info.token_ids.tolist() == full.token_ids.tolist()[-40:]
    assert f.prompt_tokens == 40
    _, right = fz.features_sync(
        "completions",
        {"model": "tiny", "prompt": LONG, "truncate_prompt_tokens": 40, "truncation_side": "right"},
    )
    assert right.token_ids is not None and right.token_ids.tolist() == full.token_ids.tolist()[:40]
    _, minus = fz.features_sync(
        "completions", {"model": "tiny", "prompt": LONG, "truncate_prompt_tokens": -1}
    )
    assert minus.token_ids is not None and len(minus.token_ids) == len(full.token_ids)


def test_media_parts_fall_back_to_characters() -> None:
    fz = make()
    body = {
        "model": "tiny",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "x"}},
                ],
            }
        ],
    }
    _, info = fz.features_sync("chat", body)
    assert info.approximate and info.fallback_reason is not None and "unrepresentable" in info.fallback_reason
    assert fz.fallback_counts == {"unrepresentable": 1}


async def test_offloaded_encodes_equal_inline_ones_and_close_stops_threads() -> None:
    inline = make(offload_chars=10**9)
    threaded = make(offload_chars=0, threads=2)
    try:
        bodies = [
            {"model": "tiny", "messages": [{"role": "user", "content": f"{i} {LONG}"}]} for i in range(12)
        ]
        results = await asyncio.gather(*(threaded.features("chat", b) for b in bodies))
        for body, (features, info) in zip(bodies, results, strict=True):
            assert info.offloaded
            want, want_info = await inline.features("chat", body)
            assert not want_info.offloaded
            assert list(features.block_keys) == list(want.block_keys)
    finally:
        await threaded.close()
        await inline.close()
    assert threaded.executor.threads == 2 and threaded.executor._executor is None


async def test_offload_queue_is_bounded_by_the_thread_count() -> None:
    fz = Featurizer(
        [ModelConfig(name="tiny", tokenizer=TINY)],
        EncodeSettings(cache_entries=0, threads=1, offload_chars=0),
    )
    try:
        bodies = [{"model": "tiny", "prompt": f"{i} " + LONG * 20} for i in range(24)]
        results = await asyncio.gather(*(fz.features("completions", b) for b in bodies))
        assert all(info.offloaded for _, info in results)
        assert fz.executor.offload_bound == 4
        assert fz.executor.offload_queued_max == 4  # reached under load, never exceeded
        assert fz.executor.offload_queued == 0
    finally:
        await fz.close()


async def test_the_session_id_comes_with_the_request_and_a_new_header_keeps_the_warm_cache() -> None:
    """The session id is part of the parsed request (read from the configured header by the
    proxy), not of the featurizer: a reload that only renames the header keeps the featurizer."""
    cfg = parse_config({"models": [{"name": "tiny", "tokenizer": TINY}], "proxy": {"session_header": "x-a"}})
    state = build_state(cfg)
    fz = state.featurizer
    try:
        features, _ = await fz.featurize(request_of("chat", {"model": "tiny", **CHAT}, "run-7"))
        assert features.session_id == "run-7" and features.model == "tiny"
        features, _ = await fz.features("completions", {"model": "tiny", "prompt": "hi"})
        assert features.session_id is None
        renamed = parse_config(
            {"models": [{"name": "tiny", "tokenizer": TINY}], "proxy": {"session_header": "x-b"}}
        )
        assert build_state(renamed, previous=state).featurizer is fz
    finally:
        await fz.close()


# --- remote mode against a loopback /tokenize server ----------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def tokenize_server() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A stand-in engine answering /tokenize with ids derived from the request (recording it)."""
    seen: list[dict[str, Any]] = []

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if body.get("prompt") == "fail":
            return web.json_response({"error": "boom"}, status=500)
        n = len(str(body.get("prompt", body.get("messages"))))
        return web.json_response({"count": n, "tokens": [i % 2000 for i in range(n)], "max_model_len": 4096})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    async with serving(app) as port:
        yield f"http://127.0.0.1:{port}", seen


async def test_remote_mode_uses_the_replicas_tokens(
    tokenize_server: tuple[str, list[dict[str, Any]]],
) -> None:
    url, seen = tokenize_server
    fz = Featurizer(
        [ModelConfig(name="r", tokenizer="remote", block_size=16, lora_adapters=["ad"])],
        EncodeSettings(cache_entries=10),
        remote=lambda model: url if model == "r" else None,
    )
    try:
        features, info = await fz.features(
            "chat", {"model": "ad", **CHAT, "add_generation_prompt": False, "stream": True}
        )
        n = len(str(CHAT["messages"]))
        assert info.mode == "remote" and not info.approximate and info.prompt_tokens == n
        assert list(features.block_keys) == block_keys([i % 2000 for i in range(n)], 16, "r", lora="ad")
        assert seen[-1] == {"model": "ad", "messages": CHAT["messages"], "add_generation_prompt": False}
        _, info = await fz.features("completions", {"model": "r", "prompt": "fail"})
        assert info.approximate and info.fallback_reason is not None and "500" in info.fallback_reason
        _, info = fz.features_sync("completions", {"model": "r", "prompt": "abc"})
        assert info.approximate  # no network from the synchronous path
        assert fz.fallback_counts == {"remote_failed": 1, "sync_call": 1}
    finally:
        await fz.close()


async def test_remote_mode_falls_back_when_unreachable() -> None:
    fz = Featurizer(
        [ModelConfig(name="r", tokenizer="remote", tokenize_timeout_s=0.5)],
        EncodeSettings(cache_entries=10),
        remote=f"http://127.0.0.1:{_free_port()}",
    )
    try:
        _, info = await fz.features("completions", {"model": "r", "prompt": "hello"})
        assert info.approximate and info.mode == "chars" and fz.fallback_counts == {"remote_failed": 1}
    finally:
        await fz.close()
