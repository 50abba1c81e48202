"""The simulated engine tokenizes requests on a thread of their own, as vLLM's OpenAI server does
(``http_api.Deps.tokenize_pool``): the event loop that ends the engine's steps keeps turning
while a long prompt is tokenized."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import aiohttp

from replica_agent.sim_engine.engine_hashes import HashFormat
from replica_agent.sim_engine.kv_events import EventEncoding
from replica_agent.sim_engine.options import EngineOptions
from replica_agent.sim_engine.server import SimEngine
from replica_agent.sim_engine_cli import configure
from router_policies.flags import options_from_flags


def _options() -> EngineOptions:
    p = argparse.ArgumentParser()
    configure(p)
    args = p.parse_args(["--port", "0", "--events-port", "0", "--time-scale", "0.01"])
    return options_from_flags(
        EngineOptions,
        args,
        hash_format=HashFormat(args.hash_format),
        event_encoding=EventEncoding(args.event_encoding),
    )


def test_prompts_are_tokenized_off_the_event_loop_thread() -> None:
    async def main() -> tuple[set[int], list[bool], int]:
        engine = SimEngine(_options())
        threads: set[int] = set()
        ticks = 0
        turned: list[bool] = []  # per encode: did the loop turn while it ran?
        encode = engine.tokenizer.encode_prompt
        loop = asyncio.get_running_loop()
        started = asyncio.Event()  # set from the tokenizing thread

        def slow_encode(prompt: str) -> list[int]:
            threads.add(threading.get_ident())
            loop.call_soon_threadsafe(started.set)
            ids = encode(prompt)
            # hold the thread (not the GIL) until the loop has turned, bounded: a tokenization
            # on the loop's own thread sees no tick before it returns, and records False
            for _ in range(200):
                if ticks >= 3:
                    break
                time.sleep(0.01)
            turned.append(ticks >= 3)
            return ids

        engine.tokenizer.encode_prompt = slow_encode  # type: ignore[method-assign]
        bound = await engine.start()
        try:

            async def ticker() -> None:
                nonlocal ticks
                await started.wait()
                for _ in range(3):
                    await asyncio.sleep(0.001)
                    ticks += 1

            async with aiohttp.ClientSession() as http:
                body = {"model": "kvgate-sim", "prompt": "hello " * 500, "max_tokens": 2}
                t = asyncio.create_task(ticker())
                async with http.post(bound.http + "/v1/completions", json=body) as resp:
                    status = resp.status
                    await resp.read()
                await asyncio.wait_for(t, 5)
        finally:
            await engine.stop()
        return threads, turned, status

    threads, turned, status = asyncio.run(main())
    assert status == 200
    assert threads and threading.get_ident() not in threads  # never the loop's thread
    assert turned == [True]  # the loop turned while the prompt was being tokenized
