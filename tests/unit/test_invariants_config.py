"""The stated invariants of the config (gateway/config*.py, operator_config.py), the composition
root (app.py, app_parts.py), the workers' parent (workers.py), the CLI (cli.py, serve_cli.py,
report_cli.py) and the listener (tls.py, http_server.py) that no other test enforced, in process:
fakes for processes and parts. Those found false are ``xfail(strict)``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.server
import itertools
import json
import os
import resource
import signal
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel, ValidationError

from gateway import app as app_module
from gateway import cli, serve_cli, workers
from gateway.app import GatewayApp
from gateway.app_parts import _featurizer_inputs, build_inventory_server
from gateway.asyncio_tasks import cancel_and_wait
from gateway.config import GatewayConfig, ProxyConfig, TlsConfig, load_config, parse_config
from gateway.features.featurizer import encode_settings
from gateway.fleet import Fleet
from gateway.http_server import FD_RESERVE, HardenedRunner, connection_cap
from gateway.inventory_stream import StreamState
from gateway.operator_config import PUBLISHED_PRICES, OperatorConfig, Price
from gateway.report_cli import fetch_report
from gateway.tls import http_ssl_context
from kvgate_tools.stream_agent import hello
from router_policies.errors import UserInputError
from router_policies.prefix_index import PrefixIndex
from tests.unit.test_invariants_gateway_state import _config

Log = list[str]


class _Part:  # the parent's app, inventory server, shared state, health checker or link
    def __init__(self, log: Log, name: str, worker: int | None = None) -> None:
        self.log, self.name, self.worker, self.registry = log, name, worker, CollectorRegistry()
        self.inventory_port = 50051  # as the parent's app has it

    async def start(self, *_a: Any, **_kw: Any) -> int:
        self.log.append(f"{self.name}.start")
        return 1

    async def stop(self) -> None:
        self.log.append(f"{self.name}.stop")

    def make_fleet(self, config: GatewayConfig, index: PrefixIndex) -> Fleet:
        return Fleet(config, index)

    def attach(self, app: GatewayApp) -> None:  # at the end of the app's construction
        self.log.append(f"attach-{app.inventory_port}")

    def setup_web(self, _app: Any) -> None: ...

    def reload(self) -> None: ...


# ---------------------------------------------------------------------- workers.py
class _Proc:  # a worker process: exits on SIGTERM unless stubborn; logs the signals it gets
    def __init__(self, pid: int, log: Log, stubborn: bool = False) -> None:
        self.pid, self.log, self.stubborn, self.done = pid, log, stubborn, asyncio.Event()
        self.returncode: int | None = None

    async def wait(self) -> int | None:
        await self.done.wait()
        return self.returncode

    def send_signal(self, _sig: int, kind: str = "term") -> None:  # after the supervision tasks ended?
        supervised = any(
            t.get_name().startswith("kvgate-worker-") and not t.done() for t in asyncio.all_tasks()
        )
        self.log.append(f"{kind} {self.pid}{' supervised' * supervised}")
        if kind == "kill" or not self.stubborn:
            self.returncode = -9 if kind == "kill" else 0
            self.done.set()

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL, "kill")


def _supervisor(tmp_path: Path, count: int, log: Log, **server: float) -> workers.Supervisor:
    cfg = parse_config({"models": [{"name": "m"}], "server": server})
    args = argparse.Namespace(config="gw.yaml", listen="127.0.0.1:0", inventory="127.0.0.1:0")
    sup = workers.Supervisor(args, cfg, count)
    os.rmdir(sup._dir)
    sup._dir = tmp_path / "workers"  # run removes it at its end
    sup._dir.mkdir()
    sup._procs = {n: _Proc(n, log, stubborn=n == 1) for n in range(count)}  # type: ignore[misc]
    return sup


async def test_the_parent_announces_once_every_worker_listens_and_stops_them_before_its_app(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Shutdown: supervision tasks cancelled and awaited, SIGTERM to each worker, the app, the dir."""
    log, handlers = Log(), dict[int, Callable[[], object]]()
    sup = _supervisor(tmp_path, 2, log)
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(loop, "add_signal_handler", lambda s, cb: handlers.update({s: cb}))
    apps: list[_Part] = []

    def gateway_app(*_a: Any, **_kw: Any) -> _Part:
        apps.append(_Part(log, "app"))
        return apps[-1]

    for name, value in (("GatewayApp", gateway_app), ("freeze_startup_heap", lambda: None)):
        monkeypatch.setattr(workers, name, value)
    monkeypatch.setattr(sup, "_spawn", lambda n: asyncio.sleep(0, sup._procs.setdefault(n, _Proc(n, log))))  # type: ignore[arg-type]
    sup._procs.clear()
    run = asyncio.create_task(sup.run())
    await asyncio.sleep(0.1)
    sup._worker_listening(0)
    await asyncio.sleep(0.3)  # over _wait_ready's 0.2 s poll
    assert len(sup._procs) == 2 and capsys.readouterr().out == ""  # worker 1 does not listen yet
    sup._worker_listening(1)
    await asyncio.sleep(0.3)
    line = capsys.readouterr().out
    assert line.startswith("kvgate serve: http=127.0.0.1:") and line.count("\n") == 1
    with pytest.raises(ConnectionRefusedError):  # the reserved port: bound, never listening
        socket.create_connection(("127.0.0.1", int(line.split(":")[2].split()[0])), 1)
    assert apps[0].registry.get_sample_value("kvgate_workers") == 2
    assert {"kvgate-worker-0", "kvgate-worker-1"} <= {t.get_name() for t in asyncio.all_tasks()}
    handlers[signal.SIGTERM]()
    assert await asyncio.wait_for(run, 5) == 0
    assert log == ["app.start", "term 0", "term 1", "app.stop"]
    assert not sup._dir.exists() and apps[0].registry.get_sample_value("kvgate_workers") == 0
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("kvgate-worker-")]


async def test_stubborn_workers_are_killed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(workers, "STOP_SLACK_S", 0.05)
    log = Log()
    await _supervisor(tmp_path, 2, log, drain_delay_s=0.0, shutdown_grace_s=0.0)._stop_workers()
    assert log == ["term 0", "term 1", "kill 1"]  # worker 1 ignores SIGTERM


async def test_restart_backoff_doubles_to_a_cap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lives = [1, 1, 1, 1, 1, 1, 1, workers.RESTART_RESET_S + 1, 1]  # seconds each run lived
    sup, delays, log = _supervisor(tmp_path, 1, Log()), list[float](), Log()
    clock = itertools.accumulate(x for life in lives for x in (0, life))  # each run's start, end

    async def sleep(delay: float) -> None:
        delays.append(delay)

    async def spawn(number: int) -> None:
        sup._stopping = len(delays) == len(lives)  # the last start: stop once it exits
        sup._procs[number] = proc = _Proc(number, log)  # type: ignore[assignment]
        proc.send_signal(0)

    monkeypatch.setattr(workers, "time", SimpleNamespace(monotonic=lambda: next(clock, 0)))
    monkeypatch.setattr(workers, "asyncio", SimpleNamespace(sleep=sleep))
    monkeypatch.setattr(sup, "_spawn", spawn)
    sup._procs[0].send_signal(0)
    restarts = Counter("restarts", "r", registry=CollectorRegistry())
    await sup._supervise(0, restarts)
    assert delays == [0.5, 1, 2, 4, 8, 10, 10, 0.5, 1] and restarts._value.get() == len(lives)


async def test_workers_must_listen_in_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(workers, "START_TIMEOUT_S", 0.05)
    sup = _supervisor(tmp_path, 2, Log())
    sup._worker_listening(0)
    with pytest.raises(UserInputError, match=r"workers \[1\] not listening after"):
        await sup._wait_ready(asyncio.Event())
    sup._procs[1].kill()
    with pytest.raises(UserInputError, match="worker 1 exited while starting"):
        await sup._wait_ready(asyncio.Event())


def test_the_worker_count_and_the_cores_rounded_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)))
    (tmp_path / "cpu.max").write_text("250000 100000\n")  # 2.5 cores: 3
    assert workers.usable_cores(tmp_path) == 3
    monkeypatch.setattr(workers, "usable_cores", lambda: 5)
    plain, shared = parse_config({}), parse_config({"shared_state": {"redis_url": "redis://x"}})
    assert [workers.worker_count(None, plain), workers.worker_count(None, shared)] == [5, 1]
    assert workers.worker_count(1, shared) == 1 and workers.worker_count(3, plain) == 3
    for n, cfg in ((0, plain), (2, shared)):
        with pytest.raises(UserInputError):
            workers.worker_count(n, cfg)


# ---------------------------------------------------------------------- app.py
def _logged(log: Log, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:  # logged when called
    def called(*a: Any, **kw: Any) -> Any:
        log.append(name)
        return fn(*a, **kw)

    return called


TAIL = "inventory.stop operator.stop shared.stop retiring.stop proxy.stop featurizer.close client.close session.close tracing.shutdown"


@pytest.mark.parametrize(
    ("worker", "started", "stopped"),
    [
        ("none", "session inventory.start shared.start health.start expiry listener",
         f"listener.close-503-True health.stop expiry.stop {TAIL}"),
        ("parent", "attach-0 session inventory.start shared.start health.start link.start expiry",
         f"health.stop expiry.stop link.stop {TAIL}"),
        ("worker", "attach-0 session link.start expiry listener", f"listener.close-503-True expiry.stop link.stop {TAIL}"),
    ],
)  # fmt: skip
async def test_the_app_starts_and_stops_its_parts_in_the_stated_order(
    monkeypatch: pytest.MonkeyPatch, worker: str, started: str, stopped: str
) -> None:
    """/ready answers 503 draining before the listener closes; the link after the parts it has."""
    log = Log()
    link = None if worker == "none" else _Part(log, "link", 0 if worker == "worker" else None)
    app = GatewayApp(parse_config({"models": [{"name": "m"}]}), env={}, link=link)  # type: ignore[arg-type]

    class Runner(HardenedRunner):
        async def setup(self) -> None:
            log.append("listener")
            await super().setup()

        async def cleanup(self) -> None:
            ready: Any = await app._ready(None)  # type: ignore[arg-type]
            log.append(f"listener.close-{ready.status}-{b'draining' in ready.body}")
            await super().cleanup()

    for name, value in [("HardenedRunner", Runner), ("configure_logging", lambda *_a: None),
                        ("raise_fd_limit", lambda: None), ("HealthChecker", lambda *_a: _Part(log, "health")),
                        ("cancel_and_wait", _logged(log, "expiry.stop", cancel_and_wait))]:  # fmt: skip
        monkeypatch.setattr(app_module, name, value)
    monkeypatch.setattr(aiohttp, "ClientSession", _logged(log, "session", aiohttp.ClientSession))
    monkeypatch.setattr(app, "_expire_loop", _logged(log, "expiry", app._expire_loop))
    app.inventory, app.shared_state = _Part(log, "inventory"), _Part(log, "shared")  # type: ignore[assignment]
    await app.start(http="127.0.0.1:0", inventory="127.0.0.1:0")
    assert log == started.split() and (app.http_port > 0) == (worker != "parent")
    log.clear()
    parts = [app.operator, app._retiring, app._proxy, app.state.featurizer]
    parts += [app._client, app._session, app.tracing]
    for obj, name in zip(parts, TAIL.replace("shared.stop", "").split()[1:], strict=True):  # the app's own
        monkeypatch.setattr(obj, name.split(".")[1], _logged(log, name, getattr(obj, name.split(".")[1])))
    await app.stop()
    assert log == stopped.split()


def test_a_reload_reports_the_changes_needing_a_restart_and_applies_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(app_module, "configure_logging", lambda *_a: None)
    path, tree = tmp_path / "gw.yaml", {"models": [{"name": "m"}], "index": {"max_blocks_per_replica": 100}}
    path.write_text(json.dumps(tree))  # YAML reads JSON
    app = GatewayApp(load_config(path, {}), config_path=path, env={})
    path.write_text(json.dumps({**tree, "index": {"max_blocks_per_replica": 200}, "listen": {"http": "h:1"}}))
    assert app.reload() is None and app.index.config.max_blocks_per_replica == 100
    assert "changes to listen, index apply after a restart" in caplog.text


# ---------------------------------------------------------------------- config and its builders
def _sections(model: BaseModel, path: str = "") -> Iterator[tuple[str, BaseModel]]:
    yield path, model
    for name in type(model).model_fields:
        value = getattr(model, name)
        for v in value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]:
            if isinstance(v, BaseModel):
                yield from _sections(v, f"{path}.{name}")


def test_every_section_refuses_unknown_keys_and_is_frozen() -> None:
    cfg = parse_config({"models": [{"name": "m"}], "replicas": [{"id": "a", "url": "http://a"}],
                        "operator": {"prices": {"m": {"input": 1, "cached_input": 0}}}})  # fmt: skip
    sections = list(_sections(cfg))
    assert len(sections) >= 20
    for path, section in sections:
        with pytest.raises(ValidationError):  # a token in the file, say, is refused
            type(section).model_validate({**section.model_dump(), "token": "secret"})
        with pytest.raises(ValidationError):
            setattr(section, next(iter(type(section).model_fields)), None)
        assert type(section).model_validate(section.model_dump()) == section, path


def test_the_block_bound_is_the_factor_times_the_capacity_never_over_the_index_bound() -> None:
    for factor, capacity, bound in ((0.0, 10, 60), (4.0, 10, 40), (4.0, 100, 60), (4.0, 0, 60), (0.1, 1, 1)):
        cfg = _config(index={"max_blocks_per_replica": 60}, inventory={"block_bound_factor": factor})
        index = PrefixIndex(cfg.index)
        server = build_inventory_server(cfg, {}, index, Fleet(cfg, index), CollectorRegistry(), set)
        stream = StreamState(peer="p", task=None)
        server._handle(stream, hello("r0", capacity=capacity).SerializeToString())
        assert stream.bound == bound, (factor, capacity)


def test_a_configured_price_always_wins_over_a_published_one() -> None:
    name, mine = next(iter(PUBLISHED_PRICES)), Price(input=9.0, cached_input=1.0)
    assert OperatorConfig(prices={name: mine}).price_of(name) is mine
    assert OperatorConfig().price_of(name) is PUBLISHED_PRICES[name]


# (found false before app_parts took proxy.tokenize_checkpoint_bytes in: a reload changing only it
# kept the old featurizer, the change neither applied nor reported)


@pytest.mark.parametrize(
    "field",
    list(ProxyConfig.model_fields),
)  # fmt: skip
def test_a_reload_keeps_the_featurizer_only_if_none_of_its_settings_changed(field: str) -> None:
    cfg = parse_config({"models": [{"name": "m"}]})
    value = getattr(cfg.proxy, field)
    bumped = (not value) if isinstance(value, bool) else value + "x" if isinstance(value, str) else value + 1
    new = cfg.model_copy(update={"proxy": cfg.proxy.model_copy(update={field: bumped})})
    if encode_settings(new.proxy) != encode_settings(cfg.proxy):
        assert _featurizer_inputs(new) != _featurizer_inputs(cfg)


# ---------------------------------------------------------------------- the CLI
def test_a_subcommand_imports_its_module_only_when_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    imported: list[str] = []
    module = SimpleNamespace(configure=lambda p: p.add_argument("x"), run=lambda _a: 7)

    def import_module(name: str) -> SimpleNamespace:
        imported.append(name)
        return module

    monkeypatch.setattr(cli, "importlib", SimpleNamespace(import_module=import_module))
    assert cli.main(["report", "y"]) == 7 and imported == ["gateway.report_cli"]


async def test_first_returns_once_one_is_done_and_cancels_the_others() -> None:
    await asyncio.wait_for(serve_cli._first(asyncio.Event().wait(), asyncio.sleep(0)), 1)
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == {asyncio.current_task()}


def test_an_operators_tokenizers_parallelism_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    args = argparse.Namespace(listen="nowhere", inventory=None, worker_of=None, config="gw.yaml")
    for preset, want in ((None, "false"), ("true", "true")):
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
        if preset is not None:
            monkeypatch.setenv("TOKENIZERS_PARALLELISM", preset)
        with pytest.raises(UserInputError, match="--listen"):
            serve_cli.run(args)
        assert os.environ["TOKENIZERS_PARALLELISM"] == want


@contextlib.contextmanager
def _server(status: int) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.end_headers()
            self.wfile.write(b"<html>not the gateway</html>")

    with http.server.HTTPServer(("127.0.0.1", 0), Handler) as srv, socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
        threading.Thread(target=srv.serve_forever, args=(0.01,), daemon=True).start()
        try:
            yield f"http://127.0.0.1:{(srv.socket if status else closed).getsockname()[1]}"
        finally:
            srv.shutdown()


# (found false with a 200 answer that is not JSON: json.JSONDecodeError, printed as a traceback)


@pytest.mark.parametrize("status", [403, 0, 200])
def test_fetching_a_report_fails_with_user_input_error(status: int) -> None:
    with _server(status) as url, pytest.raises(UserInputError):  # 0: nothing listens
        fetch_report(url, None, timeout_s=2)


# ---------------------------------------------------------------------- the listener
def test_tls_offers_1_2_at_the_oldest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ssl.SSLContext, "load_cert_chain", lambda *_a: None)
    ctx = http_ssl_context(TlsConfig(cert="c.pem", key="k.pem"))
    assert ctx is not None and ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert ctx.protocol == ssl.PROTOCOL_TLS_SERVER


def test_the_connection_cap_follows_the_file_limit_less_the_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    for soft, want in ((resource.RLIM_INFINITY, 4096), (10**6, 4096), (1024, 1024 - FD_RESERVE), (130, 16)):
        monkeypatch.setattr(resource, "getrlimit", lambda _r, s=soft: (s, s))
        assert connection_cap(4096) == want
