"""``kvgate sim-engine`` over HTTP, as a real subprocess: vLLM's API shapes, streaming, /tokenize
against transformers itself, /metrics names, cached_tokens, bounds, aborts and bad input."""

from __future__ import annotations

import json
import socket
import subprocess
from typing import Any

from transformers import PreTrainedTokenizerFast

from replica_agent.sim_engine.options import default_tokenizer_dir
from tests.integration.test_sim_engine_harness import (
    KVGATE,
    SseStream,
    assert_error,
    engines,
    get,
    launch,
    post,
    read_sse,
    request,
    tokens_for,
    wait_for,
)

__all__ = ["engines", "launch"]

MODEL = "sim-model"


def test_models_health_and_completion_shapes(launch: Any) -> None:
    e = launch(model=MODEL, block_size=16)
    status, _ = get(e.http + "/health")
    assert status == 200
    status, models = get(e.http + "/v1/models")
    assert status == 200 and models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "vllm"
    assert card["max_model_len"] == 8192

    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    status, r = post(e.http + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 7})
    assert status == 200, r
    assert r["id"].startswith("cmpl-") and r["object"] == "text_completion" and r["model"] == MODEL
    assert isinstance(r["created"], int)
    (choice,) = r["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert isinstance(choice["text"], str) and choice["text"]
    u = r["usage"]
    assert u["completion_tokens"] == 7 and u["total_tokens"] == u["prompt_tokens"] + 7
    assert u["prompt_tokens_details"] == {"cached_tokens": 0}

    # The same prompt again hits the prefix cache: every full block but the one holding the last
    # prompt token (vLLM always computes at least one token).
    status, r2 = post(e.http + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 7})
    assert status == 200
    p = u["prompt_tokens"]
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == min(p // 16, (p - 1) // 16) * 16 > 0
    # Deterministic output for the same prompt and seed.
    assert r2["choices"][0]["text"] == choice["text"]
    assert r2["id"] != r["id"]


def test_completion_streaming_matches_non_streaming(launch: Any) -> None:
    e = launch(model=MODEL)
    body = {"model": MODEL, "prompt": tokens_for(1, 40), "max_tokens": 9}
    status, full = post(e.http + "/v1/completions", body)
    assert status == 200
    assert full["usage"]["prompt_tokens"] == 40  # a token-id prompt is used as it is

    events = read_sse(
        e.http, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(x) for x in events[:-1]]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 9
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # second time: a hit
    token_chunks = chunks[:-1]
    assert len(token_chunks) == 9
    assert all(c["object"] == "text_completion" and c["id"] == token_chunks[0]["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in token_chunks] == [None] * 8 + ["length"]
    assert "usage" not in token_chunks[0]
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == full["choices"][0]["text"]

    # Without stream_options no usage chunk.
    events = read_sse(e.http, "/v1/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]" and len(events) == 10
    # Continuous usage stats: every chunk carries usage.
    events = read_sse(
        e.http,
        "/v1/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    chunks = [json.loads(x) for x in events[:-1]]
    assert [c["usage"]["completion_tokens"] for c in chunks[:-1]] == list(range(1, 10))


def test_chat_completions_streaming_and_not(launch: Any) -> None:
    e = launch(model=MODEL)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    status, r = post(e.http + "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 5})
    assert status == 200, r
    assert r["id"].startswith("chatcmpl-") and r["object"] == "chat.completion"
    (choice,) = r["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 5

    events = read_sse(
        e.http,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": messages,
            "max_completion_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(x) for x in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-1]
    assert len(content) == 5 and content[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == choice["message"]["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == r["usage"]["prompt_tokens"]


def test_tokenize_is_transformers_tokenization(launch: Any) -> None:
    e = launch(model=MODEL)
    ref = PreTrainedTokenizerFast.from_pretrained(str(default_tokenizer_dir()))
    prompt = "Hello <|im_start|> world, ünïcødé too"
    status, r = post(e.http + "/tokenize", {"model": MODEL, "prompt": prompt})
    assert status == 200
    assert set(r) == {"count", "max_model_len", "tokens", "token_strs"}
    assert r["tokens"] == ref(prompt, add_special_tokens=True)["input_ids"]
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 8192 and r["token_strs"] is None

    status, r = post(e.http + "/tokenize", {"prompt": prompt, "return_token_strs": True})
    assert r["token_strs"] == ref.convert_ids_to_tokens(r["tokens"])

    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "question?"}]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    for agp in (True, False):
        for t in (None, tools):
            body: dict[str, Any] = {"model": MODEL, "messages": messages, "add_generation_prompt": agp}
            if t is not None:
                body["tools"] = t
            status, r = post(e.http + "/tokenize", body)
            assert status == 200, r
            text = ref.apply_chat_template(messages, tools=t, add_generation_prompt=agp, tokenize=False)
            assert r["tokens"] == ref.encode(text, add_special_tokens=False)
    # The chat endpoint sees the same prompt tokens as /tokenize.
    status, r = post(e.http + "/tokenize", {"messages": messages})
    status, c = post(e.http + "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert c["usage"]["prompt_tokens"] == r["count"]


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            assert 'model_name="sim-model"' in line and 'engine="0"' in line, line
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_use_vllm_names(launch: Any) -> None:
    e = launch(model=MODEL)
    _, text = get(e.http + "/metrics")
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count",
    ):
        assert _metric(text, name) == 0.0
    prompt = tokens_for(3, 50)
    for _ in range(2):
        assert post(e.http + "/v1/completions", {"prompt": prompt, "max_tokens": 2})[0] == 200
    _, text = get(e.http + "/metrics")
    assert _metric(text, "vllm:prefix_cache_queries_total") == 100
    assert _metric(text, "vllm:prefix_cache_hits_total") == 48  # 3 of the 3 full blocks of 16
    assert _metric(text, "vllm:time_to_first_token_seconds_count") == 2
    assert _metric(text, "vllm:num_requests_running") == 0
    info = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and 'block_size="16"' in info[0] and 'num_gpu_blocks="25000"' in info[0]
    assert 'engine="0"' in info[0] and info[0].endswith(" 1.0")
    assert "vllm:num_preemptions_total{" in text
    status, version = get(e.http + "/version")
    assert status == 200 and isinstance(version["version"], str)


def test_bad_input_gets_openai_errors(launch: Any) -> None:
    e = launch(model=MODEL, max_model_len=256, cache_blocks=64)
    url = e.http + "/v1/completions"
    assert_error(*request("POST", url, raw=b"{not json"), 400)
    assert_error(*post(url, ["a list"]), 400)
    err = assert_error(*post(url, {"model": "other", "prompt": "x"}), 404)
    assert err["type"] == "NotFoundError" and err["param"] == "model"
    assert assert_error(*post(url, {"prompt": 5}), 400)["param"] == "prompt"
    assert_error(*post(url, {"prompt": ""}), 400)
    assert_error(*post(url, {"prompt": [1, 2, 99999]}), 400)
    assert_error(*post(url, {"prompt": "x", "max_tokens": 0}), 400)
    assert_error(*post(url, {"prompt": "x", "max_tokens": "ten"}), 400)
    assert_error(*post(url, {"prompt": "x", "n": 2}), 400)
    assert_error(*post(url, {"prompt": ["a", "b"]}), 400)
    assert assert_error(*post(url, {"prompt": "x", "cache_salt": "tenant"}), 400)["param"] == "cache_salt"
    assert_error(*post(url, {"prompt": "x", "stream_options": {"include_usage": True}}), 400)
    err = assert_error(*post(url, {"prompt": tokens_for(1, 200), "max_tokens": 100}), 400)
    assert "maximum context length is 256" in err["message"]
    chat = e.http + "/v1/chat/completions"
    assert_error(*post(chat, {"messages": []}), 400)
    assert_error(*post(chat, {"messages": [{"content": "no role"}]}), 400)
    assert_error(*post(chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400)
    assert_error(*post(e.http + "/tokenize", {"prompt": 3}), 400)
    assert_error(*get(e.http + "/no/such/route"), 404)
    assert_error(*get(e.http + "/v1/completions"), 405)
    assert_error(*post(e.http + "/debug/faults", {"drop": -1}), 400)
    assert_error(*post(e.http + "/debug/faults", {"explode": 1}), 400)
    # The engine still serves after all of that.
    assert post(url, {"prompt": "fine", "max_tokens": 1})[0] == 200


def test_request_bigger_than_kv_cache_is_refused(launch: Any) -> None:
    e = launch(cache_blocks=4, block_size=16)
    err = assert_error(
        *post(e.http + "/v1/completions", {"prompt": tokens_for(1, 60), "max_tokens": 10}), 400
    )
    assert "KV cache has 4" in err["message"]


def test_disconnect_aborts_and_frees_slot_and_bounded_queue(launch: Any) -> None:
    # Slow steps and long outputs keep requests in flight until their clients leave.
    e = launch(max_pending=2, time_scale=5.0)
    body = {"prompt": tokens_for(1, 40), "max_tokens": 4000, "stream": True}
    s1 = SseStream(e.http, "/v1/completions", body)
    s2 = SseStream(e.http, "/v1/completions", {**body, "prompt": tokens_for(2, 40)})
    try:
        for s in (s1, s2):
            assert s.resp.status == 200
            next(s.events())  # the first token is out: the request is running
        state = get(e.http + "/debug/state")[1]
        assert state["pending"] == 2 and state["running"] == 2
        # The third request exceeds --max-pending.
        err = assert_error(*post(e.http + "/v1/completions", {"prompt": "x", "max_tokens": 1}), 503)
        assert "queue full" in err["message"]
    finally:
        s1.close()
    wait_for(lambda: get(e.http + "/debug/state")[1]["pending"] == 1, what="abort of the first stream")
    s2.close()
    state = wait_for(
        lambda: (st := get(e.http + "/debug/state")[1])["pending"] == 0 and st["running"] == 0 and st,
        what="abort of the second stream",
    )
    # Aborted requests release their registry entries; only cached blocks remain.
    assert state["registry_entries"] == state["held_blocks"]
    _, text = get(e.http + "/metrics")
    assert (
        _metric(text.replace('model_name="kvgate-sim"', 'model_name="sim-model"'), "vllm:kv_cache_usage_perc")
        == 0.0
    )
    assert post(e.http + "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200


def test_cli_errors_exit_2_with_a_message(tmp_path: Any) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cases = [
            (["--port", "0", "--events-port", "0", "--block-size", "0"], "--block-size"),
            (["--port", "0", "--events-port", "0", "--profile", "nope"], "--profile"),
            (["--port", "0", "--events-port", "0", "--tokenizer", str(tmp_path)], "--tokenizer"),
            (["--port", str(port), "--events-port", "0"], f"--port {port}"),
            (["--port", "0", "--events-port", str(port)], "KV-event sockets"),
        ]
        for args, needle in cases:
            r = subprocess.run(
                [str(KVGATE), "sim-engine", *args], capture_output=True, text=True, timeout=120
            )
            assert r.returncode == 2, (args, r.stderr)
            assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
