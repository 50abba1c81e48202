"""The worker channel's coalescing (docs/architecture.md, "Workers", TTFT fit): a worker's frames
go out together within ``SEND_WINDOW_S``, in order; the parent publishes a replica's fit once per
``FIT_PUBLISH_S`` whatever number of first tokens it fitted in between. Real unix sockets, a
real ``Hub``."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gateway.config import parse_config
from gateway.local_hub import FIT_PUBLISH_S, Hub, HubHooks, OwnerFleet
from gateway.local_hub_codec import FrameWriter, decode_json, encode_json, frame, read_frame
from gateway.workers_ttft import observation_frame
from router_policies.prefix_index import PrefixIndex
from router_policies.ttft.features import TtftInputs

BOUND = 1 << 20


def test_a_window_sends_the_frames_queued_in_it_together_and_in_order() -> None:
    async def main() -> None:
        a, b = socket.socketpair()
        # both streams of each end kept: a dropped writer closes its socket
        reader, reader_side = await asyncio.open_connection(sock=a)
        _writer_side, writer = await asyncio.open_connection(sock=b)
        out = FrameWriter(writer, BOUND, "test", window_s=0.3)
        for i in range(3):
            out.send(frame(b"K", bytes([i])))
        # a timer fires late under load, never early: nothing arrives before the window ends
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 0.1)
        got = [await asyncio.wait_for(read_frame(reader, BOUND), 5) for _ in range(3)]
        assert got == [(b"K", bytes([i])) for i in range(3)]
        out.send(frame(b"K", b"x"))
        out.abort()  # what waits in the window is dropped with the channel
        assert await asyncio.wait_for(reader.read(), 5) == b""
        reader_side.close()

    asyncio.run(main())


def test_the_parent_publishes_one_fit_a_replica_per_window(tmp_path: Path) -> None:
    cfg = parse_config(
        {"models": [{"name": "m", "block_size": 16}], "replicas": [{"id": "a", "url": "http://a:1"}]}
    )
    index = PrefixIndex(cfg.index)
    fleet = OwnerFleet(cfg, index)
    hooks = HubHooks(
        reload=lambda: None,
        ready=lambda _n: None,
        held_prefix=lambda *_a: False,
        registry=CollectorRegistry(),
    )
    inputs = TtftInputs(
        queued_prefill_tokens=0, decoding=0, kv_tokens=0, uncached_tokens=512, cached_tokens=0
    )

    async def main() -> None:
        hub = Hub(index, fleet, hooks)
        path = str(tmp_path / "hub.sock")
        await hub.start(path)
        reader, writer = await asyncio.open_unix_connection(path, limit=BOUND)
        writer.write(encode_json(b"W", [0, 1]))
        while (await asyncio.wait_for(read_frame(reader, BOUND), 5))[0] != b"Y":
            pass  # the state
        writer.write(b"".join(observation_frame("a", inputs, 20.0 + i) for i in range(5)))
        kind, payload = await asyncio.wait_for(read_frame(reader, BOUND), 5)
        assert kind == b"U"
        replica, _coefficients, observations, _error, _prior, _calibration = decode_json(payload)
        assert (replica, observations) == ("a", 5)  # one frame, after all five fits
        with pytest.raises(TimeoutError):  # and no other for them
            await asyncio.wait_for(read_frame(reader, BOUND), 3 * FIT_PUBLISH_S)
        writer.write(observation_frame("a", inputs, 30.0))
        kind, payload = await asyncio.wait_for(read_frame(reader, BOUND), 5)
        assert kind == b"U" and decode_json(payload)[2] == 6
        writer.close()
        await hub.stop()

    asyncio.run(main())
