"""The stated invariants of the upstream's HTTP client, its response framing and its first-byte
watch that no other test enforced, or only in part, each over seeded random operation sequences
(tests/unit/test_invariants_features.py says more)."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest
from multidict import CIMultiDict

from gateway.replica_identity import ReplicaIdentity
from gateway.replica_record import ReplicaRecord
from gateway.upstream_client import BadResponse, UpstreamClient, UpstreamResponse, _Conn
from gateway.upstream_response import HIGH_WATER, MAX_HEAD
from gateway.upstream_watch import WATCH_INTERVAL_S, EjectionWatch, FirstByteWait

SEEDS = [0, 1, 2]


# --- gateway/upstream_client.py, gateway/upstream_response.py ----------------------------------
# Connections over fake transports: the pool is filled by hand, so nothing connects.

URL = "http://replica:8000/v1/completions"
ORIGIN = ("replica", 8000, False)


class FakeTransport:
    """A connection's transport: what was written, whether it closed, whether it reads."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.closing = False
        self.reading = True

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


def _pooled(client: UpstreamClient) -> _Conn:
    """A new idle connection in ``client``'s pool (as if it had answered a request before)."""
    conn = _Conn(ORIGIN)
    conn.connection_made(FakeTransport())  # type: ignore[arg-type]
    client.put(conn)
    return conn


def _transport(conn: _Conn) -> FakeTransport:
    assert isinstance(conn.transport, FakeTransport)
    return conn.transport


def _answer(rng: random.Random) -> tuple[list[bytes], str, int]:
    """A replica's answer in random pieces, its kind and its body's length. The kind tells whether
    its connection may be reused ("length", "chunked") or not ("close": Connection: close;
    "extra": bytes beyond its end, with its last bytes; "eof": delimited by the connection's close,
    after the last piece)."""
    body = rng.randbytes(rng.randrange(0, 300))
    kind = rng.choice(["length", "chunked", "close", "extra", "eof"])
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    if kind == "chunked":
        cut = rng.randrange(len(body) + 1)
        chunks = [c for c in (body[:cut], body[cut:]) if c]
        raw = head + b"transfer-encoding: chunked\r\n\r\n"
        raw += b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    elif kind == "eof":
        raw = head + b"\r\n" + body
    else:
        close = b"connection: close\r\n" if kind == "close" else b""
        raw = head + close + b"content-length: %d\r\n\r\n" % len(body) + body
    cuts = sorted(rng.sample(range(1, len(raw)), min(rng.randrange(0, 5), len(raw) - 1)))
    pieces = [raw[i:j] for i, j in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    if kind == "extra":
        pieces[-1] += b"HTTP/1.1 200 OK\r\n"  # an answer to no request
    return pieces, kind, len(body)


class _Request:
    """One POST through the client, and what the test expects of its connection."""

    def __init__(self, client: UpstreamClient, rng: random.Random) -> None:
        self.out = client.start(URL, b'{"prompt": "x"}', CIMultiDict())
        assert self.out.sent is not None  # written on the idle connection the test pooled
        self.conn = self.out.sent[0]
        self.pieces, self.kind, self.length = _answer(rng)
        self.finish: asyncio.Task[UpstreamResponse] | None = None
        self.resp: UpstreamResponse | None = None
        self.read = 0  # body bytes read

    def whole(self) -> bool:
        """Every byte of the answer arrived and its body was read."""
        arrived = not self.pieces and (self.kind != "eof" or self.conn.closed)
        return arrived and self.read == self.length


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_connection_belongs_to_at_most_one_response_and_is_reused_only_when_read_whole(
    seed: int,
) -> None:
    """upstream_client.py: "a connection belongs to at most one response at a time; a response
    not read to its end closes its connection (``release`` and ``close`` both do); a cancelled
    ``finish`` closes the connection it was using, and so does an ``Outgoing`` abandoned before
    ``finish``"; upstream_response.py: bytes beyond the response: never reuse; and a
    connection goes back to the pool only when its response was read to its end and neither
    side asked to close."""
    rng = random.Random(seed)
    client = UpstreamClient()
    live: list[_Request] = []

    def check() -> None:
        pooled = list(client._idle.get(ORIGIN, ()))
        for conn in pooled:
            assert conn.response is None and not conn.closed
        owners = [r.resp._conn for r in live if r.resp is not None]
        assert len(set(map(id, owners))) == len(owners)  # no connection shared by two responses
        for r in live:
            if r.resp is not None:
                assert r.resp._conn.response is r.resp and all(r.resp._conn is not c for c in pooled)

    def ended(r: _Request, reused: bool) -> None:
        live.remove(r)
        pooled = client._idle.get(ORIGIN, ())
        assert any(c is r.conn for c in pooled) is reused and r.conn.closed is not reused
        assert _transport(r.conn).closing is not reused

    for _ in range(400):
        if len(live) < 3 and rng.random() < 0.3:
            if not client._idle.get(ORIGIN):
                _pooled(client)
            live.append(_Request(client, rng))
        elif live:
            r = rng.choice(live)
            if r.finish is None and r.resp is None:
                if rng.random() < 0.2:
                    r.out.abandon()  # its caller failed before finish
                    ended(r, reused=False)
                else:
                    r.finish = asyncio.get_running_loop().create_task(client.finish(r.out, 1.0))
                    await asyncio.sleep(0)  # waiting for the answer's head
            elif r.finish is not None:
                if rng.random() < 0.2:
                    r.finish.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await r.finish
                    ended(r, reused=False)
                    continue
                while r.pieces and not r.finish.done():  # until the head is in
                    r.conn.data_received(r.pieces.pop(0))
                    await asyncio.sleep(0)
                if not r.pieces and r.kind == "eof" and not r.finish.done():
                    r.conn.connection_lost(None)
                r.resp, r.finish = await r.finish, None
            else:
                assert r.resp is not None
                op = rng.random()
                if op < 0.4 and (r.pieces or (r.kind == "eof" and not r.conn.closed)):
                    if r.pieces:
                        r.conn.data_received(r.pieces.pop(0))
                    else:
                        r.conn.connection_lost(None)  # the end of an answer delimited by it
                elif op < 0.7 and (r.resp._body or r.resp.done):
                    r.read += len(await r.resp.readany())
                elif op < 0.9:
                    whole = r.whole()
                    r.resp.release()
                    ended(r, reused=whole and r.kind in ("length", "chunked"))
                else:
                    r.resp.close()
                    ended(r, reused=False)
        check()
    client.close()


async def _posted() -> tuple[_Conn, asyncio.Task[UpstreamResponse]]:
    """A POST written on a pooled connection, its answer awaited by a task (not yet given)."""
    client = UpstreamClient()
    _pooled(client)
    out = client.start(URL, b"{}", CIMultiDict())
    assert out.sent is not None
    conn = out.sent[0]  # before ``finish`` takes the attempt over
    finish = asyncio.get_running_loop().create_task(client.finish(out, 1.0))
    await asyncio.sleep(0)
    return conn, finish


@pytest.mark.parametrize("seed", SEEDS)
async def test_reading_pauses_while_more_than_high_water_bytes_wait(seed: int) -> None:
    """upstream_client.py: "reading pauses while more than ``HIGH_WATER`` bytes of body wait to be
    read" (and resumes once they were)."""
    rng = random.Random(seed)
    conn, finish = await _posted()
    conn.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    resp = await finish
    transport = _transport(conn)
    for _ in range(200):
        if rng.random() < 0.7:
            data = b"x" * rng.randrange(1, HIGH_WATER // 3)
            conn.data_received(b"%x\r\n%b\r\n" % (len(data), data))
        elif resp._body:
            await resp.readany()
        assert transport.reading is (resp._queued <= HIGH_WATER)
    resp.close()


async def test_a_response_head_longer_than_max_head_fails_and_closes_its_connection() -> None:
    """upstream_client.py: the response's "status line and headers (at most ``MAX_HEAD``
    bytes)"."""
    conn, finish = await _posted()
    conn.data_received(b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"p" * MAX_HEAD)
    with pytest.raises(BadResponse, match="head too long"):
        async with asyncio.timeout(1.0):
            await finish
    assert conn.closed and _transport(conn).closing


class _RefusingTransport(FakeTransport):
    """A transport already closing under the pool: writes fail as uvloop's do."""

    def write(self, data: bytes) -> None:
        raise RuntimeError(f"unable to write {len(data)} bytes: <TCPTransport closed=True>")


async def test_start_never_raises_for_the_connection_and_a_connection_speaking_while_idle_is_dropped() -> (
    None
):
    """upstream_client.py, ``start``: "Never raises for the connection (a write refused here is
    retried by ``finish`` on a new one)"; a connection sending bytes while idle "cannot be
    trusted": it is closed and never reused."""
    client = UpstreamClient()
    refusing = _Conn(ORIGIN)
    refusing.connection_made(_RefusingTransport())  # type: ignore[arg-type]
    client.put(refusing)
    out = client.start(URL, b"{}", CIMultiDict())
    assert out.sent is None and refusing.closed and not client._idle.get(ORIGIN)
    older, newer = _pooled(client), _pooled(client)
    newer.data_received(b"HTTP/1.1 200 OK\r\n")  # nothing was asked of it
    assert newer.closed and _transport(newer).closing
    out = client.start(URL, b"{}", CIMultiDict())
    assert out.sent is not None and out.sent[0] is older and not client._idle.get(ORIGIN)
    assert not _transport(newer).written
    out.abandon()


# --- gateway/upstream_watch.py -----------------------------------------------------------------


def _replica(healthy: bool = True) -> ReplicaRecord:
    rec = ReplicaRecord(ReplicaIdentity("r0", "http://127.0.0.1:1", frozenset(), True))
    rec.health.healthy = healthy
    return rec


async def test_a_wait_is_watched_exactly_while_its_block_runs_and_the_watch_runs_meanwhile() -> None:
    """upstream_watch.py: "a wait is in ``EjectionWatch`` exactly while its block runs; [...] the
    watch task runs while a wait is registered", over concurrent waits that end in time, expire
    at their deadline (the watch's or their own timer's) or raise, and again once the watch task
    has ended for want of waits."""
    rng = random.Random(0)
    watch, rec = EjectionWatch(), _replica()
    outcomes: list[str] = []

    def running() -> bool:
        return watch._task is not None and not watch._task.done()

    async def one(timeout_s: float, work_s: float, fail: bool) -> None:
        wait = None
        try:
            async with watch.first_byte(rec, timeout_s, lambda: True) as wait:
                assert wait in watch._waiting and running()
                await asyncio.sleep(work_s)
                assert wait in watch._waiting and running()
                if fail:
                    raise ConnectionResetError("the replica closed")
            outcomes.append("done")
        except TimeoutError:
            outcomes.append("expired")
        except ConnectionResetError:
            outcomes.append("failed")
        assert wait is not None and wait not in watch._waiting

    for works in ([0.0, 0.02, 0.1, 0.26], [0.0, 0.02]):  # the second after the watch task ended
        waits = [one(rng.choice([0.05, 0.21, 0.23]), rng.choice(works), rng.random() < 0.2) for _ in range(8)]
        await asyncio.gather(*waits)
        assert not watch._waiting
        await asyncio.sleep(WATCH_INTERVAL_S + 0.05)
        assert watch._task is None  # it ended with the last wait
    assert {"done", "expired", "failed"} <= set(outcomes)


async def test_a_wait_is_expired_at_most_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """upstream_watch.py: "it is expired at most once", even when its block outlives a watch
    interval after it was expired (a task that takes its time to end once cancelled), so an
    ejection stays an ejection."""
    expiries: list[FirstByteWait] = []
    expire = FirstByteWait.expire

    def counted(self: FirstByteWait, now: float) -> None:
        expiries.append(self)
        expire(self, now)

    monkeypatch.setattr(FirstByteWait, "expire", counted)
    watch, rec = EjectionWatch(), _replica(healthy=False)  # ejected: the wait fails over
    async with watch.first_byte(rec, 5.0, lambda: True) as wait:
        try:
            await asyncio.sleep(5.0)
        except asyncio.CancelledError:  # expired by the watch (after up to an interval)
            await asyncio.sleep(WATCH_INTERVAL_S * 1.75)  # still in the block at its next check
    assert expiries == [wait] and wait.ejected and wait.expired
