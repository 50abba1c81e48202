"""The engine event subscriber: ZMQ SUB on the engine's KV-event endpoint, in order, gap-free
(docs/architecture.md, the agent).

Sequence rules (``seq`` is the engine publisher's per-batch counter, restarting at 0 with it):

* ``seq == expected``: apply.
* ``seq > expected``: a gap. Ask the replay endpoint (a DEALER sends ``["", start_seq]``; the engine
  answers one ``["", (topic,) seq, payload]`` per buffered batch, then a seq of -1: vLLM and
  SGLang >= 0.5.22 send the topic, older SGLang does not) for ``[expected, seq)``. If it returns
  them all, apply them, then this batch. If not (no replay endpoint, a timeout, or the buffer no
  longer reaches back), the gap is unrecoverable: the inventory is cleared and marked degraded
  until fresh events have rebuilt it.
* ``seq < expected``: either a stale copy (a duplicate, or a batch that arrived after its
  successor and was already recovered through replay), whose engine timestamp is not newer than
  the newest batch applied, and which is dropped; or the engine restarted (its seq went back and its
  timestamp moved forward): its cache is empty, so the inventory is cleared and the batches the
  restarted engine sent before this one are recovered from replay as for a gap from 0.
* On start the agent asks replay for everything from seq 0, so that it learns the engine's cache
  without waiting for its next batch; if the buffer no longer reaches back to 0 the inventory is
  marked degraded. (Without a replay endpoint, the first batch is a gap from 0 unless its seq is 0.)
* A lost batch shows as a gap only when a later one arrives, and the engine may go quiet (batches
  published after the start's replay, before our subscription reached the PUB socket, which drops
  them). So ``tail_probe_s`` after the last batch applied (or a catch-up), replay is asked once for
  what follows, handled as live frames: one round trip per quiet period.
* The engine's PUB socket disconnecting means its process went away (the agent runs beside it), and
  its cache with it: the frames already received are applied, then the inventory is cleared at
  once rather than when the restarted engine's first batch shows its seq going back (an empty
  engine sends nothing until it caches something). The next batch is treated as the first.

* Re-keying (``request_rekey``): the gateway keys at a multiple of the engine's block size (an
  SGLang page of 1 token under a gateway block of 16): between two frames the inventory is
  cleared, set to the new key size and rebuilt from the replay buffer; it stays degraded unless the
  buffer reached back to seq 0 and up to every batch seen before.

A payload that does not decode is counted and skipped, like a single bad event inside a batch;
nothing a publisher sends can stop the subscriber.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field

import zmq
import zmq.asyncio
import zmq.utils.monitor

from replica_agent.engine_events import EventBatch, MalformedEvent, decode_payload, parse_seq
from replica_agent.engine_replay import ReplayAsk
from replica_agent.event_sockets import EventSockets
from replica_agent.inventory import AgentInventory

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SubscriberStats:
    frames: int = 0
    batches_applied: int = 0
    malformed_frames: int = 0  # wrong frame count, bad seq, undecodable payload
    malformed_events: int = 0  # single events of a batch that did not decode
    stale: int = 0  # duplicates and late batches already applied
    gaps: int = 0
    recovered_gaps: int = 0
    unrecovered_gaps: int = 0
    engine_restarts: int = 0
    engine_disconnects: int = 0
    internal_errors: int = 0  # frames whose handling raised unexpectedly (inventory then cleared)
    replayed_batches: int = 0
    tail_probes: int = 0  # replay asked after a quiet period (a lost tail shows no gap otherwise)


@dataclass(eq=False, repr=False)  # identity equality and repr, as a service object
class EventSubscriber:
    """Feeds the engine's events to ``inventory`` in order; ``on_applied(ts)`` after each batch."""

    ctx: zmq.asyncio.Context
    events_endpoint: str
    replay_endpoint: str | None
    inventory: AgentInventory
    _: KW_ONLY
    topic: bytes = b""
    replay_timeout_s: float = 1.0
    max_replay_batches: int = 100_000
    on_applied: Callable[[float], None] | None = None
    tail_probe_s: float = 0.5  # quiet time after the last batch before replay is asked for more
    stats: SubscriberStats = field(default_factory=SubscriberStats, init=False)
    expected: int | None = field(default=None, init=False)  # next seq; None until the first batch
    last_ts: float = field(default=float("-inf"), init=False)  # engine time of the newest batch applied
    # the engine went away: catch up from replay when it is back
    _rejoin: bool = field(default=False, init=False)
    # a new key block size to rebuild the inventory at (set by request_rekey, applied by run)
    _rekey: int | None = field(default=None, init=False)
    # monotonic time at which to ask replay for batches after the last one applied; None: no
    # probe owed (none since the last probe, or the engine is gone)
    _probe_due: float | None = field(default=None, init=False)
    _sockets: EventSockets | None = field(default=None, init=False)  # run's
    _replay: ReplayAsk | None = field(default=None, init=False)  # run's, kept between asks

    async def run(self) -> None:
        """Subscribe and apply until cancelled."""
        socks = self._sockets = EventSockets(self.ctx, self.events_endpoint, self.topic)
        try:
            if self.replay_endpoint is not None:
                self._replay = self._ask(keep=True)
                await self._guarded(self.catch_up())
            while True:
                if self._probe_due is not None and time.monotonic() >= self._probe_due:
                    await self._guarded(self.probe_tail())
                # a re-key request (from the gateway stream's task) is applied here, between
                # frames, never in the middle of a batch
                if self._rekey is not None:
                    await self._guarded(self.rekey(self._rekey))
                    self._rekey = None
                frames, monitored = socks.pending()
                if frames:
                    await self._drain(socks.sub)
                if monitored:
                    await self._monitored(socks)
                if not (frames or monitored or self._rekey is not None):
                    # nothing to read: sleep until a socket or a re-key wakes us, or the tail
                    # probe is due (no probe owed: no timeout)
                    due = self._probe_due
                    await socks.wait(None if due is None else max(0.0, due - time.monotonic()))
        finally:
            self._sockets = None
            if self._replay is not None:
                self._replay.close()
                self._replay = None
            socks.close()

    async def _monitored(self, socks: EventSockets) -> None:
        """The events socket's monitor: the engine's publisher went away, or came back."""
        event = socks.monitor_event()
        log.debug("event socket monitor: event %d", event)
        if event == zmq.EVENT_DISCONNECTED:
            await self._drain(socks.sub)  # everything the engine sent before it went away
            self.engine_gone()
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self._rejoin:
            # Connected to the engine that came back. What it published before our
            # subscription reached it was dropped by its PUB socket (and if it then
            # went quiet, no later seq would reveal the gap): take it from replay.
            self._rejoin = False
            if self.replay_endpoint is not None:
                await self._guarded(self.catch_up())

    async def _guarded(self, step: Awaitable[object]) -> None:
        """Run one step of the loop (a catch-up, a probe, a re-key): nothing an engine sends
        may stop the subscriber (``_internal_error``)."""
        try:
            await step
        except Exception as exc:
            self._internal_error(exc)

    def _ask(self, *, keep: bool) -> ReplayAsk:
        assert self.replay_endpoint is not None
        return ReplayAsk(
            self.ctx, self.replay_endpoint, self.replay_timeout_s, self.max_replay_batches, keep=keep
        )

    @property
    def rekey_pending(self) -> bool:
        return self._rekey is not None

    def request_rekey(self, key_block_size: int) -> None:
        """Rebuild the inventory with keys of ``key_block_size`` tokens (the gateway's block size),
        from the engine's replay buffer, at the run loop's next turn."""
        self._rekey = key_block_size
        if self._sockets is not None:
            self._sockets.poke()

    async def rekey(self, key_block_size: int) -> None:
        """Forget the keys (they cover the old block size) and key the engine's cache again from
        replay. Complete when the replay reaches back to seq 0 and up to every batch already seen;
        otherwise degraded, like an unrecoverable gap, until the inventory's rebuild rule clears it."""
        seen = self.expected
        inv = self.inventory
        inv.clear()
        inv.key_block_size = key_block_size
        inv.mark_degraded(f"re-keying at the gateway's block size {key_block_size}")
        self.expected = None
        self.last_ts = float("-inf")
        if self.replay_endpoint is not None and await self.catch_up() and (self.expected or 0) >= (seen or 0):
            inv.mark_complete()
        log.info("re-keyed at %d tokens per key (degraded: %s)", key_block_size, inv.degraded)

    async def catch_up(self) -> bool:
        """Apply the engine's whole replay buffer (called once the SUB socket is connected, so that
        nothing published meanwhile is lost: later duplicates are recognised as stale). True when
        the buffer reached back to seq 0 and was applied whole (or the engine published nothing)."""
        self._owe_probe()  # whatever is published before our subscription takes effect
        replayed = await self.replay(0)
        if not replayed:
            # nothing published yet, or no answer: the first live batch decides
            return replayed is not None
        first = replayed[0][0]
        if first > 0:
            self.inventory.mark_degraded(f"joined at engine seq {first}: replay no longer reaches seq 0")
        prev = first - 1
        whole = first == 0
        for s, payload in replayed:
            if s != prev + 1:
                whole = False
                break  # not contiguous: the live stream's gap handling takes over
            prev = s
            batch = self._decode(payload)
            if batch is not None:
                self._apply(s, batch)
            else:  # unreadable in the engine's own copy too: its effects are unknown
                self._unreadable(s)
                whole = False
            self.stats.replayed_batches += 1
        return whole

    def _owe_probe(self) -> None:
        if self.replay_endpoint is not None:
            self._probe_due = time.monotonic() + self.tail_probe_s

    async def probe_tail(self) -> None:
        """Ask replay for the batches after the last one applied and handle them as live frames:
        a tail the SUB socket never received is then a recovered gap (or, if replay no longer has
        its start, an unrecoverable one). Nothing else runs on the subscriber meanwhile, so
        ``expected`` holds across the await."""
        self._probe_due = None
        self.stats.tail_probes += 1
        start = self.expected or 0
        tail = [(s, p) for s, p in await self.replay(start) or [] if s >= start]
        if tail and tail[0][0] == start:
            self.stats.gaps += 1
            self.stats.recovered_gaps += 1
            self.stats.replayed_batches += len(tail)
            log.info(
                "replay had %d batch(es) from seq %d the live stream had not delivered", len(tail), start
            )
        for seq, payload in tail:
            batch = self._decode(payload)
            if batch is not None:
                await self._handle(seq, batch)

    async def _drain(self, sub: zmq.Socket[bytes]) -> None:
        """Handle every frame already queued on ``sub``, without waiting for more (yielding to the
        event loop every 256 frames, so that a flood cannot starve the gateway stream)."""
        handled = 0
        while True:
            try:
                frames = sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            handled += 1
            if handled % 256 == 0:
                await asyncio.sleep(0)
            try:
                await self.handle_frames(frames)
            except Exception as exc:
                self._internal_error(exc)

    def _internal_error(self, exc: Exception) -> None:
        """Nothing an engine sends may stop the agent; a frame applied half-way leaves the
        inventory unknown, so start over as after an unrecoverable gap."""
        self.stats.internal_errors += 1
        log.error("error handling engine events: clearing the inventory", exc_info=exc)
        self.inventory.clear()
        self.inventory.mark_degraded("internal error while applying events")

    def engine_gone(self) -> None:
        """The engine's publisher disconnected: its process (and cache) is gone."""
        self.stats.engine_disconnects += 1
        log.info("engine event publisher disconnected: clearing the inventory")
        self.inventory.clear()
        self.inventory.mark_complete()
        self.expected = None
        self._rejoin = True
        self._probe_due = None  # its replay endpoint went with it: the rejoin's catch-up owes one

    def _seq(self, frames: list[bytes], count: int) -> int | None:
        """The seq of a message of ``count`` frames ending ``[seq, payload]``; None, counted as a
        malformed frame, when the count or the seq frame is wrong."""
        if len(frames) == count:
            with contextlib.suppress(MalformedEvent):
                return parse_seq(frames[-2])
        self.stats.malformed_frames += 1
        return None

    async def handle_frames(self, frames: list[bytes]) -> None:
        self.stats.frames += 1
        seq = self._seq(frames, 3)  # topic, seq, payload
        if seq is None:
            return
        batch = self._decode(frames[2])
        if log.isEnabledFor(logging.DEBUG):
            log.debug("frame seq=%d expected=%s ts=%s", seq, self.expected, batch.ts if batch else None)
        if batch is None:
            # undecodable (counted): not received. The next batch shows the gap, and the engine's
            # replay buffer supplies the batch whole, or (no replay, or its copy unreadable too:
            # ``_unreadable``) the inventory is cleared and marked degraded: a batch we could not
            # read may have removed blocks, so skipping it would leave the index claiming blocks
            # the engine no longer holds.
            return
        await self._handle(seq, batch)

    async def _handle(self, seq: int, batch: EventBatch) -> None:
        """Apply one decoded batch by the sequence rules (module docstring)."""
        expected = self.expected
        if expected is None:
            expected = 0
            self.expected = 0
            if seq > 0:
                # joined late: whatever the engine cached before may be missing unless replay has it
                await self._recover(0, seq, joined=True)
        elif seq > expected:
            await self._recover(expected, seq)
        elif seq < expected:
            if batch.ts <= self.last_ts:
                self.stats.stale += 1
                return
            self.stats.engine_restarts += 1
            log.info("engine restarted (seq %d after %d): clearing the inventory", seq, expected - 1)
            self.inventory.clear()
            self.inventory.mark_complete()
            self.expected = 0
            self.last_ts = float("-inf")
            if seq > 0:
                await self._recover(0, seq)
        self._apply(seq, batch)

    def _decode(self, payload: bytes) -> EventBatch | None:
        try:
            batch = decode_payload(payload)
        except MalformedEvent as exc:
            self.stats.malformed_frames += 1
            log.warning("skipping an undecodable event payload: %s", exc)
            return None
        if batch.malformed:
            self.stats.malformed_events += batch.malformed
        return batch

    def _apply(self, seq: int, batch: EventBatch) -> None:
        self.inventory.apply(batch.events)
        self.stats.batches_applied += 1
        self.expected = seq + 1
        self._owe_probe()
        if batch.ts > self.last_ts:
            self.last_ts = batch.ts
        if self.on_applied is not None:
            self.on_applied(batch.ts)

    async def _recover(self, start: int, upto: int, *, joined: bool = False) -> None:
        """Apply batches ``[start, upto)`` from replay, or clear and degrade."""
        if not joined:
            self.stats.gaps += 1
        replayed = await self.replay(start) if self.replay_endpoint else None
        wanted = [(s, p) for s, p in (replayed or []) if start <= s < upto]
        if [s for s, _ in wanted] == list(range(start, upto)):
            for s, payload in wanted:
                batch = self._decode(payload)
                if batch is not None:
                    self._apply(s, batch)
                else:  # unreadable in the engine's own copy too: its effects are unknown
                    self._unreadable(s)
                self.stats.replayed_batches += 1
            self.expected = upto
            if not joined:
                self.stats.recovered_gaps += 1
            return
        if joined:
            log.info("joined the engine at seq %d with no replay of the start: inventory incomplete", upto)
            self.inventory.mark_degraded(f"joined at engine seq {upto} without replay from 0")
        else:
            self.stats.unrecovered_gaps += 1
            log.warning("event gap [%d, %d) not covered by replay: clearing the inventory", start, upto)
            self.inventory.clear()
            self.inventory.mark_degraded(f"unrecoverable event gap [{start}, {upto})")
        self.expected = upto

    def _unreadable(self, seq: int) -> None:
        """Batch ``seq`` cannot be read, not even from the engine's replay buffer: it may have
        removed blocks, so the inventory is cleared and marked degraded, as after an
        unrecoverable gap (keeping it would leave the index claiming blocks the engine dropped)."""
        self.stats.unrecovered_gaps += 1
        log.warning("event batch %d unreadable, also from replay: clearing the inventory", seq)
        self.inventory.clear()
        self.inventory.mark_degraded(f"event batch {seq} unreadable")
        self.expected = seq + 1

    async def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The engine's buffered batches from ``start`` on; None when replay did not answer."""
        assert self.replay_endpoint is not None
        ask = self._replay or self._ask(keep=False)  # outside run (a test): a socket per ask
        return await ask.batches(start, self._seq)
