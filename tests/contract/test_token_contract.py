"""The gateway's token ids equal the engine's, prompt by prompt, on the committed corpus.

The reference is ``transformers`` used the way vLLM uses it (``PreTrainedTokenizerFast``,
``apply_chat_template(..., tokenize=False)`` then ``encode(add_special_tokens=False)`` for chat,
``tokenizer(prompt)`` for completions), after the one rewrite vLLM applies to messages before
the template sees them: content parts joined with newlines, null content as "". The gateway is
checked on its synchronous path, its asynchronous path with every encode on a worker thread, and
again once its segment cache is warm.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from gateway.config import ModelConfig
from gateway.features import EncodeSettings, Featurizer

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
logging.getLogger("transformers").setLevel(logging.ERROR)

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "assets/tokenizers/kvgate-tiny"
CORPUS = Path(__file__).resolve().parent / "prompt_corpus.jsonl"


def load_corpus() -> list[dict[str, Any]]:
    return [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]


def vllm_view(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        m = dict(m)
        c = m.get("content")
        if c is None:
            m["content"] = ""
        elif isinstance(c, list):
            m["content"] = "\n".join(p["text"] for p in c)
        out.append(m)
    return out


class Reference:
    def __init__(self) -> None:
        from transformers import PreTrainedTokenizerFast

        self.tok: Any = PreTrainedTokenizerFast.from_pretrained(str(TOKENIZER))

    def tokens(self, kind: str, body: dict[str, Any]) -> list[int]:
        if kind == "chat":
            text = self.tok.apply_chat_template(
                vllm_view(body["messages"]),
                tools=body.get("tools"),
                add_generation_prompt=body.get("add_generation_prompt", True),
                tokenize=False,
            )
            return list(self.tok.encode(text, add_special_tokens=False))
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, list):
            return list(prompt)
        return list(self.tok(prompt, add_special_tokens=True)["input_ids"])


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


@pytest.fixture(scope="module")
def corpus() -> list[dict[str, Any]]:
    items = load_corpus()
    assert len(items) >= 200
    return items


def make_featurizer(cache_entries: int = 100_000, offload_chars: int = 16384) -> Featurizer:
    return Featurizer(
        [ModelConfig(name="kvgate-tiny", tokenizer=str(TOKENIZER), block_size=16)],
        EncodeSettings(cache_entries=cache_entries, threads=2, offload_chars=offload_chars),
    )


def test_corpus_is_what_the_script_generates() -> None:
    from tests.contract.make_prompt_corpus import SEED, build

    expected = [json.dumps(item, ensure_ascii=False) for item in build(SEED)]
    assert CORPUS.read_text(encoding="utf-8").splitlines() == expected


def test_corpus_covers_the_required_kinds(corpus: list[dict[str, Any]]) -> None:
    labels = {item["id"].split("-", 1)[1] for item in corpus}
    for label in ("single", "multi", "long", "tools", "unicode", "nullcontent", "specialtext", "text", "ids"):
        assert label in labels
    assert any(
        isinstance(m["content"], list) for i in corpus if i["kind"] == "chat" for m in i["body"]["messages"]
    )
    assert sum(i["kind"] == "chat" for i in corpus) >= 100
    assert sum(i["kind"] == "completions" for i in corpus) >= 50


def test_sync_tokens_equal_transformers(corpus: list[dict[str, Any]], reference: Reference) -> None:
    fz = make_featurizer()
    mismatches = []
    for item in corpus:
        want = reference.tokens(item["kind"], item["body"])
        _, info = fz.features_sync(item["kind"], item["body"])
        assert info.token_ids is not None and not info.approximate
        if info.token_ids.tolist() != want:
            mismatches.append(item["id"])
    assert mismatches == []


def test_warm_cache_gives_the_same_tokens(corpus: list[dict[str, Any]], reference: Reference) -> None:
    fz = make_featurizer()
    for item in corpus:
        fz.features_sync(item["kind"], item["body"])
    hits_before = fz.cache_stats()["hits"]
    for item in corpus:
        _, info = fz.features_sync(item["kind"], item["body"])
        assert info.token_ids is not None
        assert info.token_ids.tolist() == reference.tokens(item["kind"], item["body"]), item["id"]
        if info.segments:
            assert info.cache_hit, item["id"]
            assert info.encoded_chars == 0
    assert fz.cache_stats()["hits"] > hits_before


async def test_async_offloaded_tokens_equal_transformers(
    corpus: list[dict[str, Any]], reference: Reference
) -> None:
    fz = make_featurizer(offload_chars=0)
    try:
        offloaded = 0
        for item in corpus:
            _, info = await fz.features(item["kind"], item["body"])
            assert info.token_ids is not None
            assert info.token_ids.tolist() == reference.tokens(item["kind"], item["body"]), item["id"]
            offloaded += info.offloaded
        assert offloaded > 0
    finally:
        await fz.close()


def test_block_keys_follow_the_tokens(corpus: list[dict[str, Any]], reference: Reference) -> None:
    from router_policies.block_keys import block_keys

    fz = make_featurizer()
    for item in corpus[:40]:
        features, _ = fz.features_sync(item["kind"], item["body"])
        want = reference.tokens(item["kind"], item["body"])
        assert features.prompt_tokens == len(want)
        assert list(features.block_keys) == block_keys(want, 16, "kvgate-tiny")
        assert features.model == "kvgate-tiny" and features.block_size == 16
