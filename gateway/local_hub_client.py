"""A worker's side of the local channel to the inventory owner (``kvgate serve --workers N``;
docs/architecture.md, "Workers"): the worker's copy of the index and fleet, fed by the parent.

``HubClient`` is the app's link (``gateway.app.AppLink``) in a worker: it connects to the parent's
unix socket, applies the whole state the parent sends first (``start`` returns once it is
applied, so the worker listens only with a complete index), then the live frames, each applied
synchronously by the one reader task (the one writer of this worker's index and of the fleet's
agent-fed parts). ``WorkerFleet`` sends the speculative entries this worker's routing records to
the parent (which relays them to the other workers); a load task sends this worker's in-flight
load every ``LOAD_INTERVAL_S`` when it changed.

Invariants
* Index mutations never await: each frame is decoded whole, then applied without an await.
* A frame that cannot apply (malformed, or over an index bound the parent did not hit) means this
  copy diverged: the channel ends, and with it the worker, which the parent restarts and resyncs.
* The parent gone (EOF), ``lost`` is set and the worker shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import generate_latest

from gateway.asyncio_tasks import cancel_and_wait
from gateway.config import GatewayConfig
from gateway.fleet import Fleet, ReplicaRecord
from gateway.inventory_ops import IndexReplica, apply_ops
from gateway.inventory_sink import AgentEngine, AgentLoad
from gateway.inventory_stream import InventoryObserver
from gateway.local_hub import MAX_PENDING_BYTES, frame_bound
from gateway.local_hub_codec import (
    FrameWriter,
    decode_json,
    decode_replica,
    decode_stamps,
    decode_tagged,
    decode_touch,
    encode_json,
    encode_tagged,
    encode_touch,
    frame,
    read_frame,
)
from gateway.local_hub_load import LoadReporter, remote_loads
from gateway.local_hub_touch import Touch, TouchBatcher
from gateway.replica_load import NO_REMOTE_LOAD, RemoteLoad
from gateway.shared_state_codec import CodecError, decode_hello, decode_ops, decode_snapshot
from gateway.workers_metrics import merge_expositions
from gateway.workers_shared_load import LOAD_TABLE, SharedLoad, own_figures, with_decided, with_figures
from gateway.workers_ttft import RelayedTtftModel
from router_policies import placement
from router_policies.flights import Dispatch, Flight
from router_policies.placement import TtftFeed
from router_policies.prefix_index import IndexBoundError, PrefixIndex
from router_policies.ttft.params import TtftParams
from router_policies.ttft_feed import FIT_BURST, FITS_PER_S, FitBudget

if TYPE_CHECKING:
    from gateway.app import GatewayApp

log = logging.getLogger("kvgate.workers")

# in-flight load sent to the other workers at most this often: what decisions read comes from the
# shared table (workers_shared_load.py); the relay's own use is the blocks two workers hold
LOAD_INTERVAL_S = 0.1
# a worker's frames to the parent (a first token's observation per request, touches, load) go out
# together within this window: one write and one wake-up of the parent for all of them rather
# than one a request (measured: the parent's loop woken per first token took ~1/5 of the gateway's
# CPU at 3,500 warm req/s); 2 ms is the parent's own gathering of touches (TOUCH_WINDOW_S)
SEND_WINDOW_S = 0.002
SYNC_TIMEOUT_S = 60.0  # the parent's whole state must arrive within this long
METRICS_TIMEOUT_S = 5.0
WORKER_HEADER = "x-kvgate-worker"


class WorkerFleet(Fleet):
    """A worker's fleet: the speculative entries its routing records also go to the parent."""

    def __init__(self, config: GatewayConfig, index: PrefixIndex, link: HubClient) -> None:
        self._link = link  # before the fleet's TTFT feed is made (_new_ttft)
        super().__init__(config, index)
        self._relayed: dict[str, RemoteLoad] = {}  # the parent's last relay (frame R)
        self._in_turn = config.server.workers_decide_in_turn  # read at start, as server.*

    def apply_remote_load(self, loads: Mapping[str, RemoteLoad]) -> None:
        """The parent's relay: its overlap of held blocks is kept with the table's figures, and
        it is routed on whole where the table cannot say (``_with_remote_now``)."""
        self._relayed = dict(loads)
        super().apply_remote_load(loads)

    def _with_remote_now(self, candidates: Iterable[ReplicaRecord]) -> Iterable[ReplicaRecord]:
        """Each candidate's ``remote`` with the other workers' figures read from the shared table
        now, under its lock until the dispatch that follows is published: no other worker
        decides in between (gateway/workers_shared_load.py)."""
        table = self._link.shared_load
        if table is None:
            return candidates
        records = list(candidates)
        table.begin_decision()  # until this decision's load is published (``flights_changed``)
        for rec, figures in zip(records, table.others([r.id for r in records]), strict=True):
            relayed = self._relayed.get(rec.id, NO_REMOTE_LOAD)
            rec.remote = relayed if figures is None else with_figures(relayed, figures)
        return records

    def decision_turn(self) -> Awaitable[None] | None:
        table = self._link.shared_load
        return table.decision_turn() if table is not None and self._in_turn else None

    def dispatch(self, record: ReplicaRecord, dispatch: Dispatch, start: float | None = None) -> Flight:
        flight = super().dispatch(record, dispatch, start)
        self.flights_changed(record)  # its exact figures replace those published at the decision
        return flight

    def flights_changed(self, record: ReplicaRecord, adding: Dispatch | None = None) -> None:
        """This worker's figures for ``record`` into the shared table (with ``adding``'s load, an
        attempt decided whose flight is not open yet), and the decision's turn ends: the others
        see what it decided (gateway/workers_shared_load.py)."""
        table = self._link.shared_load
        if table is not None:
            figures = own_figures(record.flights)
            table.publish(
                record.id, figures if adding is None else with_decided(figures, adding, self._clock())
            )
            table.end_decision()

    def _new_ttft(self, prior: TtftParams) -> TtftFeed:
        """First tokens are fitted by the parent, which publishes the fits (gateway/workers_ttft.py).
        Each worker's fit budget is its share of one process's: a replica's model is fitted as
        often whatever the workers, and the parent does not fit N times as many first tokens."""
        n = max(1, self._link.workers)
        budget = FitBudget(FITS_PER_S / n, max(1.0, FIT_BURST / n))
        model = RelayedTtftModel(prior, self._link.send)
        return TtftFeed(model, self._clock, self._ttft_sample, budget=budget)

    def publish_ttft(self, payload: bytes) -> None:
        """The parent's fit of a replica (frame ``U``): routed on from now."""
        model = self.ttft.model
        assert isinstance(model, RelayedTtftModel)
        rec = self.get(model.publish(payload))
        if rec is not None:
            rec.ttft_model = model.params(rec.id)

    def touch(self, replica: str, keys: Sequence[int]) -> tuple[Sequence[int], float] | None:
        """As the fleet's, and what was touched goes to the parent for the other workers."""
        touched = super().touch(replica, keys)
        if touched is not None:
            self._link.send(encode_touch(replica, *touched))
        return touched


class HubClient:
    """The worker's link to the parent (see the module docstring)."""

    def __init__(self, path: str, number: int, count: int = 1) -> None:
        self.path = path
        self.worker = number
        self.workers = count  # of the parent, this one included
        self.lost = asyncio.Event()  # the parent went away: the worker stops
        self._synced = asyncio.Event()
        self._app: GatewayApp | None = None
        self._out: FrameWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._load_task: asyncio.Task[None] | None = None
        self._remote_reload = False  # applying a reload the parent relayed: not sent back
        self._tags = itertools.count(1)
        self._metrics: dict[int, asyncio.Future[bytes]] = {}
        self._touches: TouchBatcher | None = None  # the other workers' touches (start)
        self.shared_load: SharedLoad | None = None  # the workers' load table (start; None: none)

    # ------------------------------------------------------------------ AppLink
    def make_fleet(self, config: GatewayConfig, index: PrefixIndex) -> Fleet:
        return WorkerFleet(config, index, self)

    def attach(self, app: GatewayApp) -> None:
        self._app = app
        app.fleet.held_prefix_sink = self.held_prefix

    def setup_web(self, web_app: web.Application) -> None:
        number = str(self.worker)

        async def tag(_request: web.Request, response: web.StreamResponse) -> None:
            response.headers[WORKER_HEADER] = number

        web_app.on_response_prepare.append(tag)

    def reloaded(self) -> None:
        if not self._remote_reload:
            self.send(frame(b"Q"))  # the parent reloads and tells the other workers

    async def exposition(self) -> bytes:
        """Every worker's and the parent's metrics, merged by the parent (gateway/workers_metrics.py)."""
        assert self._app is not None
        tag = next(self._tags)
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._metrics[tag] = future
        try:
            self.send(encode_tagged(b"X", tag, b""))
            return await asyncio.wait_for(future, METRICS_TIMEOUT_S)
        except TimeoutError:
            log.warning("metrics: the parent did not answer; this worker's own figures only")
            return merge_expositions({str(self.worker): generate_latest(self._app.registry)})
        finally:
            self._metrics.pop(tag, None)

    async def start(self) -> None:
        assert self._app is not None
        bound = frame_bound(self._app.index)
        fleet = self._app.fleet
        self._touches = TouchBatcher(self._app.index, lambda r: fleet.get(r) is not None)
        table = Path(self.path).parent / LOAD_TABLE
        if table.exists():
            self.shared_load = SharedLoad(table, self.worker)
        reader, writer = await asyncio.open_unix_connection(self.path, limit=1 << 20)
        self._out = FrameWriter(writer, MAX_PENDING_BYTES, f"worker {self.worker}", SEND_WINDOW_S)
        self.send(encode_json(b"W", [self.worker, os.getpid()]))
        loop = asyncio.get_running_loop()
        self._reader_task = loop.create_task(self._read(reader, bound), name="kvgate-worker-channel")
        synced = loop.create_task(self._synced.wait())
        await asyncio.wait({synced, self._reader_task}, timeout=SYNC_TIMEOUT_S, return_when="FIRST_COMPLETED")
        if not self._synced.is_set():
            await cancel_and_wait(synced)
            raise OSError(f"worker {self.worker}: no state from the parent at {self.path}")
        self._load_task = loop.create_task(self._send_load(), name="kvgate-worker-load")

    def listening(self) -> None:
        self.send(frame(b"K"))

    async def stop(self) -> None:
        await cancel_and_wait(self._load_task)
        await cancel_and_wait(self._reader_task)
        if self._touches is not None:
            self._touches.cancel()
        if self._out is not None:
            self._out.abort()
        if self.shared_load is not None:
            self.shared_load.close()
            self.shared_load = None

    # ------------------------------------------------------------------ to the parent
    def send(self, data: bytes) -> None:
        if self._out is not None:
            self._out.send(data)

    def held_prefix(self, replica: str, keys: Sequence[int], next_tokens: Sequence[int]) -> bool:
        """To the replica's agent through the parent; only while its inventory is degraded (the
        inventory server's own rule, checked here so that healthy replicas cost no frame)."""
        rec = self._app.fleet.get(replica) if self._app is not None else None
        if rec is None or not (rec.link.connected and rec.link.degraded):
            return False
        self.send(encode_json(b"P", [replica, list(keys), list(next_tokens)]))
        return True

    async def _send_load(self) -> None:
        assert self._app is not None
        fleet, last, reporter = self._app.fleet, b"", LoadReporter()
        while True:
            await asyncio.sleep(LOAD_INTERVAL_S)
            doc = reporter.report(fleet.records())
            data = encode_json(b"L", doc)
            if data != last or doc["held"] or doc["freed"]:
                last = data
                self.send(data)

    # ------------------------------------------------------------------ from the parent
    async def _read(self, reader: asyncio.StreamReader, bound: int) -> None:
        try:
            while True:
                kind, payload = await read_frame(reader, bound)
                self._apply(kind, payload)
        except (asyncio.IncompleteReadError, ConnectionError):
            log.warning("worker %d: the parent closed the channel", self.worker)
        except (CodecError, IndexBoundError, ValueError, TypeError, IndexError) as exc:
            log.error(
                "worker %d: cannot apply the parent's frame (%s); restarting to resync", self.worker, exc
            )
        finally:
            self.lost.set()

    def _apply(self, kind: bytes, payload: bytes) -> None:  # one branch a kind
        app = self._app
        assert app is not None
        fleet, index, observer = app.fleet, app.index, app.inventory.observer
        touches = self._touches
        assert touches is not None
        if kind == b"T":
            replica, keys, lifetime = decode_touch(payload)
            touches.add(Touch(replica, keys, lifetime))  # applied with the burst it came in
            return
        touches.flush()  # first the touches the parent applied before this frame
        if kind in (b"S", b"O", b"V"):
            self._apply_index(kind, payload, index, observer)
        elif kind == b"H":
            hello = decode_hello(payload)
            refusal = fleet.agent_hello(hello)
            if refusal is not None:
                log.warning("worker %d: registration refused: %s", self.worker, refusal)
            elif observer is not None:
                observer.inventory_hello(hello)
        elif kind == b"A":
            replica, connected, degraded = decode_json(payload)
            fleet.agent_state(str(replica), connected=bool(connected), degraded=bool(degraded))
        elif kind == b"E":
            replica, hybrid, adapters, known = decode_json(payload)
            fleet.agent_engine(str(replica), AgentEngine(bool(hybrid), frozenset(adapters), bool(known)))
        elif kind == b"N":
            replica, running, waiting, kv, queries, hits = decode_json(payload)
            fleet.agent_load(
                str(replica), AgentLoad(int(running), int(waiting), float(kv), int(queries), int(hits))
            )
        elif kind == b"C":
            replica, ok, error = decode_json(payload)
            fleet.check_result(str(replica), bool(ok), str(error))
        elif kind == b"R":
            fleet.apply_remote_load(remote_loads(decode_json(payload), lambda r: _block_size(fleet, r)))
        elif kind == b"U":
            assert isinstance(fleet, WorkerFleet)
            fleet.publish_ttft(payload)
        elif kind == b"Q":
            self._remote_reload = True
            try:
                app.reload()
            finally:
                self._remote_reload = False
        elif kind == b"G":
            gid, _ = decode_tagged(payload)
            self.send(encode_tagged(b"g", gid, generate_latest(app.registry)))
        elif kind == b"M":
            tag, text = decode_tagged(payload)
            future = self._metrics.get(tag)
            if future is not None and not future.done():
                future.set_result(text)
        elif kind == b"Y":
            self._synced.set()
        else:
            raise CodecError(f"unknown frame kind {kind!r}")

    def _apply_index(
        self, kind: bytes, payload: bytes, index: PrefixIndex, observer: InventoryObserver | None
    ) -> None:
        if kind == b"V":
            replica, keys, expiries = decode_stamps(payload)
            _replay_speculative(index, replica, keys, expiries)
            return
        replica, rest = decode_replica(payload)
        if self._app is None or self._app.fleet.get(replica) is None:
            return  # refused here too (its registration was)
        if kind == b"S":
            entries = decode_snapshot(rest, index.config.max_blocks_per_replica)
            placement.replace_snapshot(index, replica, entries, self._app.fleet.snapshot_keep())
            if observer is not None:
                observer.inventory_snapshot(replica, entries)
        else:
            ops = list(decode_ops(rest))  # whole or nothing: decoded before any is applied
            apply_ops(ops, IndexReplica(index, replica))
            if observer is not None:
                observer.inventory_ops(replica, ops)


def _replay_speculative(index: PrefixIndex, replica: str, keys: list[int], expiries: list[float]) -> None:
    """Rebuild the parent's speculative entries of ``replica`` in the same eviction order: each run
    of entries stamped together is one touch (a touch orders its keys leaf first, so the run goes
    in reversed)."""
    if replica not in index.replicas:  # (stats() would build every replica's counts)
        return
    ttl, start = index.config.approximate_ttl_s, 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or expiries[i] != expiries[start]:
            with contextlib.suppress(IndexBoundError):
                index.touch_approximate(replica, keys[start:i][::-1], expiries[start] - ttl)
            start = i


def _block_size(fleet: Fleet, replica: str) -> int:
    """The tokens of one of ``replica``'s blocks as this gateway keys them (0: not in the fleet)."""
    rec = fleet.get(replica)
    return fleet.key_block_size(rec.models) if rec is not None else 0
