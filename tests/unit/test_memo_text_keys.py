"""The memo cache's block keys found by the text they are of (gateway/features/memo_cache.py): a
resent prompt's keys without digesting its tokens, equal to the keys computed without the memo
under every truncation and key namespace."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from gateway.config import ModelConfig
from gateway.features import EncodeSettings, Featurizer
from gateway.features.budgets import Budgets
from gateway.features.memo_cache import MemoCache
from gateway.request import request_of
from router_policies.block_keys import block_keys

TINY = str(Path(__file__).resolve().parents[2] / "assets/tokenizers/kvgate-tiny")


def _featurizer(memo_cache_bytes: int) -> Featurizer:
    return Featurizer(
        [ModelConfig(name="tiny", tokenizer=TINY, block_size=16)],
        EncodeSettings(
            cache_entries=1000,
            threads=1,
            offload_chars=1000,
            budgets=Budgets(memo_cache_bytes=memo_cache_bytes),
        ),
    )


def _counted(calls: list[int], tokens: np.ndarray) -> list[int]:
    calls.append(len(tokens))
    return block_keys(tokens, 4, "m")


def test_keys_found_by_their_source_skip_the_tokens() -> None:
    calls: list[int] = []
    cache, a = MemoCache(1 << 20), np.arange(32, dtype=np.uint32)
    want = block_keys(a, 4, "m")
    by_text = functools.partial(cache.keys, ("m", None, None, 4), compute=functools.partial(_counted, calls))
    assert by_text(a, source=("text", 1)) == want
    # found by the source alone: the tokens passed are not read again
    assert by_text(a[:4], source=("text", 1)) == want and calls == [32]
    assert by_text(a) == want and calls == [32, 32]  # found by tokens: a separate entry
    assert by_text(a[:8], source=("text", 2)) == block_keys(a[:8], 4, "m") and calls == [32, 32, 8]


async def test_resent_chats_keep_exact_keys_under_every_truncation() -> None:
    on, off = _featurizer(32 << 20), _featurizer(0)
    base: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "system", "content": "s " * 200}, {"role": "user", "content": "hi there"}],
    }
    variants = [
        base,
        {**base, "truncate_prompt_tokens": 100},
        {**base, "truncate_prompt_tokens": 100, "truncation_side": "right"},
        {**base, "truncate_prompt_tokens": 50},
        {**base, "cache_salt": "tenant-a"},
    ]
    try:
        seen = set()
        for _ in range(2):  # the second round is served by the memo
            for body in variants:
                got, _ = await on.featurize(request_of("chat", body))
                want, _ = await off.featurize(request_of("chat", body))
                assert got.block_keys == want.block_keys and got.prompt_tokens == want.prompt_tokens
                seen.add(tuple(got.block_keys))
        assert len(seen) == len(variants)  # the variants' keys differ, none was served another's
        assert on.memo.hits >= 3 * len(variants)  # rendering, tokens and keys of each
    finally:
        await on.close()
        await off.close()
