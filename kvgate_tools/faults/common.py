"""What every fault scenario shares (docs/faults.md, docs/architecture.md "Measuring ourselves"):
the result record, client load that classifies every answer, RSS and fd sampling of a real
process, and the index-equals-engine check.

Classification of one request (the issue's table): ``ok`` a 200 whose body is whole (a non-stream
JSON with ``choices``, or an SSE stream ending in ``[DONE]`` without an error event);
``clear_error`` an OpenAI-shaped ``{"error": {message, type, param, code}}`` answer, or a stream that
ends with such an error event then ``[DONE]``; ``broken`` anything else that came back (plain text,
a connection reset, a stream cut without an error event); ``lost`` no answer within the client's
own bound. Invariant: ``sent == ok + clear_error + broken + lost``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from kvgate_tools.local_fleet import LocalFleet, http_json

JSON_HEADERS = {"content-type": "application/json"}
KINDS = ("ok", "clear_error", "broken", "lost")


@dataclass
class Tally:
    """Counts of answers by kind; one lock, written by the load threads."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    max_latency_s: float = 0.0
    served: Counter[str] = field(default_factory=Counter)  # 200s by the replica that answered
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, latency_s: float = 0.0, replica: str | None = None) -> None:
        assert kind in KINDS, kind
        with self.lock:
            self.counts[kind] += 1
            self.max_latency_s = max(self.max_latency_s, latency_s)
            if replica:
                self.served[replica] += 1

    @property
    def sent(self) -> int:
        return sum(self.counts.values())


@dataclass
class Result:
    """One row of out/faults.json."""

    name: str
    tally: Tally
    reconverge_s: float | None
    peak_rss_mb: float
    passed: bool
    notes: str = ""

    def row(self) -> dict[str, Any]:
        c = self.tally.counts
        return {
            "name": self.name,
            "sent": self.tally.sent,
            **{k: c[k] for k in KINDS},
            "reconverge_s": None if self.reconverge_s is None else round(self.reconverge_s, 2),
            "peak_rss_mb": round(self.peak_rss_mb, 1),
            "pass": self.passed,
            "max_latency_s": round(self.tally.max_latency_s, 2),
            "notes": self.notes,
        }


def is_openai_error(doc: Any) -> bool:
    err = doc.get("error") if isinstance(doc, dict) else None
    return isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err)


def classify_body(status: int, body: bytes, stream: bool) -> str:
    """The kind of one whole answer (module docstring)."""
    if stream and status == 200:
        events = [
            ln[5:].strip() for ln in body.decode(errors="replace").splitlines() if ln.startswith("data:")
        ]
        if not events or events[-1] != "[DONE]":
            return "broken"
        for ev in events[:-1]:
            try:
                doc = json.loads(ev)
            except ValueError:
                return "broken"
            if is_openai_error(doc):
                return "clear_error"
        return "ok"
    try:
        doc = json.loads(body)
    except ValueError:
        return "broken"
    if status == 200:
        return "ok" if isinstance(doc, dict) and "choices" in doc else "broken"
    return "clear_error" if is_openai_error(doc) else "broken"


def chat_body(text: str, stream: bool, max_tokens: int = 8, model: str = "kvgate-tiny") -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    return body


@dataclass(frozen=True)
class Call:
    """One request: where, what, and the client's bound (beyond it the request counts as lost)."""

    base_url: str
    body: Mapping[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 30.0


def send(call: Call, tally: Tally) -> str:
    """Send one chat completion and record its kind."""
    stream = bool(call.body.get("stream"))
    req = urllib.request.Request(
        call.base_url + "/v1/chat/completions",
        data=json.dumps(call.body).encode(),
        method="POST",
        headers={**JSON_HEADERS, **call.headers},
    )
    start = time.monotonic()
    replica = None
    try:
        with urllib.request.urlopen(req, timeout=call.timeout_s) as resp:
            kind = classify_body(resp.status, resp.read(), stream)
            replica = resp.headers.get("x-kvgate-replica")
    except urllib.error.HTTPError as exc:
        kind = classify_body(exc.code, exc.read(), stream=False)
    except TimeoutError:
        kind = "lost"
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        timed_out = isinstance(getattr(exc, "reason", None), TimeoutError)
        kind = "lost" if timed_out else "broken"
    tally.add(kind, time.monotonic() - start, replica)
    return kind


class Load:
    """``workers`` threads sending ``make(i)`` calls back to back until ``stop()``."""

    def __init__(self, make: Callable[[int], Call], workers: int, tally: Tally | None = None) -> None:
        self.make = make
        self.tally = tally or Tally()
        self._stop = threading.Event()
        self._n = 0
        self._n_lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def _next(self) -> int:
        with self._n_lock:
            self._n += 1
            return self._n

    def _run(self) -> None:
        while not self._stop.is_set():
            send(self.make(self._next()), self.tally)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> Tally:
        self._stop.set()
        for t in self._threads:
            t.join()
        return self.tally

    def __exit__(self, *exc: object) -> None:
        self.stop()


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


class Background:
    """A thread running ``_run`` from ``with`` until its end; ``_run`` returns once ``_stop`` is set."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class Sampler(Background):
    """RSS and open fds of one process every ``interval_s``, on a thread (peak, series)."""

    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        super().__init__()
        self.pid = pid
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, int]] = []  # (monotonic s, rss MB, fds)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), rss_mb(self.pid), fd_count(self.pid)))
            self._stop.wait(self.interval_s)

    @property
    def peak_rss_mb(self) -> float:
        return max((s[1] for s in self.samples), default=rss_mb(self.pid))

    @property
    def peak_fds(self) -> int:
        return max((s[2] for s in self.samples), default=fd_count(self.pid))


def index_keys(fleet: LocalFleet, replica: str, base_url: str | None = None) -> list[int] | None:
    url = f"{base_url or fleet.gateway_url}/admin/index?replica={replica}"
    try:
        return sorted(http_json(url, headers=fleet.admin_headers)["keys"])
    except (urllib.error.URLError, OSError, KeyError, ValueError):
        return None


def engine_keys(fleet: LocalFleet, i: int) -> list[int] | None:
    try:
        return sorted(http_json(fleet.engines[i].url + "/debug/blocks")["keys"])
    except (urllib.error.URLError, OSError, KeyError, ValueError):
        return None


def exact(fleet: LocalFleet, replicas: list[int], gateways: list[str] | None = None) -> bool:
    """Every listed replica's precise index entries equal its engine's cache, on every gateway."""
    for i in replicas:
        want = engine_keys(fleet, i)
        if want is None:
            return False
        for gw in gateways or [fleet.gateway_url]:
            if index_keys(fleet, fleet.engines[i].replica_id, gw) != want:
                return False
    return True


def wait_exact(
    fleet: LocalFleet, replicas: list[int], timeout_s: float, gateways: list[str] | None = None
) -> float | None:
    """Seconds until ``exact`` holds (None: not within ``timeout_s``)."""
    return wait_until(lambda: exact(fleet, replicas, gateways), timeout_s)


def replica_flag(fleet: LocalFleet, replica: str, flag: str) -> bool | None:
    """A boolean field of the replica in the gateway's /admin/replicas (None: not answered)."""
    with contextlib.suppress(urllib.error.URLError, OSError, ValueError):
        for r in fleet.replicas():
            if r.get("id") == replica:
                return bool(r.get(flag))
    return None


def replica_healthy(fleet: LocalFleet, replica: str) -> bool | None:
    return replica_flag(fleet, replica, "healthy")


def metric_sum(fleet: LocalFleet, name: str) -> float:
    """The sum of a gateway metric's samples over all its labels."""
    with urllib.request.urlopen(fleet.gateway_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def wait_until(pred: Callable[[], bool], timeout_s: float, step_s: float = 0.1) -> float | None:
    """Seconds until ``pred()`` holds (None: not within ``timeout_s``)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if pred():
            return time.monotonic() - start
        time.sleep(step_s)
    return None


def rows(results: list[Result]) -> list[dict[str, Any]]:
    return [r.row() for r in results]
