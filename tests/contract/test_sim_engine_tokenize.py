"""The gateway's token ids equal a real ``kvgate sim-engine`` process's ``/tokenize`` over HTTP, for
every prompt of the committed corpus the endpoint accepts (chat, and completions given as text).

The simulated engine tokenizes independently with ``transformers`` as vLLM does; the process runs
on ports it picks itself and is killed (its whole process group) when the module's tests end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.config import ModelConfig
from gateway.features import EncodeSettings, Featurizer
from tests.contract.test_token_contract import TOKENIZER, load_corpus

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("replica_agent.sim_engine_cli") is None,
    reason="kvgate sim-engine is not installed",
)

KVGATE = Path(sys.executable).parent / "kvgate"
READY = re.compile(r"sim-engine ready http=(\S+)")
MODEL = "kvgate-tiny"


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    err_path = tmp_path_factory.mktemp("sim") / "stderr.txt"
    cmd = [str(KVGATE), "sim-engine", "--port", "0", "--events-port", "0", "--model", MODEL]
    cmd += ["--tokenizer", str(TOKENIZER), "--time-scale", "0.01"]
    with err_path.open("wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, start_new_session=True)
    try:
        assert proc.stdout is not None
        buf = b""
        deadline = time.monotonic() + 60
        url = None
        while url is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sim-engine did not start: {err_path.read_text()}")
            ready, _, _ = select.select([proc.stdout], [], [], 0.1)
            if ready:
                buf += os.read(proc.stdout.fileno(), 4096)
                m = READY.search(buf.decode(errors="replace"))
                url = m.group(1) if m else None
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def engine_tokens(url: str, kind: str, body: dict[str, Any]) -> list[int] | None:
    """The engine's ids for ``body``, or None when /tokenize does not take this prompt form."""
    if kind == "chat":
        req: dict[str, Any] = {"model": MODEL, "messages": body["messages"]}
        for k in ("tools", "add_generation_prompt"):
            if k in body:
                req[k] = body[k]
    else:
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None
        req = {"model": MODEL, "prompt": prompt}
    data = json.dumps(req).encode()
    r = urllib.request.Request(url + "/tokenize", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=30) as resp:
        answer = json.loads(resp.read())
    tokens = answer["tokens"]
    assert answer["count"] == len(tokens)
    return list(tokens)


def test_gateway_tokens_equal_sim_engine_tokenize(engine_url: str) -> None:
    fz = Featurizer([ModelConfig(name=MODEL, tokenizer=str(TOKENIZER))], EncodeSettings(cache_entries=10_000))
    compared = 0
    mismatches = []
    for item in load_corpus():
        want = engine_tokens(engine_url, item["kind"], item["body"])
        if want is None:
            continue
        _, info = fz.features_sync(item["kind"], item["body"])
        assert info.token_ids is not None
        compared += 1
        if info.token_ids.tolist() != want:
            mismatches.append(item["id"])
    assert mismatches == []
    assert compared >= 200
