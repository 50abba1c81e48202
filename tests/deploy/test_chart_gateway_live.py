"""The gateway really starts from the chart: ``kvgate serve`` (a real process on loopback) with the
rendered ConfigMap's config.yaml, the rendered container's arguments and its environment, and it
answers the paths the chart's probes and ServiceMonitor use."""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate_tools.procs import stop_group
from tests.deploy.conftest import RELEASE, Rendered, gateway_container
from tests.deploy.test_chart_render import container_env


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.fixture
def gateway(rendered_cases: dict[str, Rendered], tmp_path: Path) -> Iterator[str]:
    r = rendered_cases["defaults"]
    c = gateway_container(r)
    config_path = Path(c["args"][c["args"].index("--config") + 1])
    local = tmp_path / config_path.name
    local.write_text(r.one("ConfigMap", RELEASE)["data"]["config.yaml"], encoding="utf-8")
    args = [local if a == str(config_path) else a for a in c["args"]]
    kvgate = shutil.which("kvgate", path=str(Path(sys.executable).parent))
    assert kvgate, "the kvgate console script is not installed beside this Python"
    env = {"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path), **container_env(r, c, {})}
    # Loopback and free ports instead of the pod's 0.0.0.0:8000/50051.
    cmd = [kvgate, *map(str, args), "--listen", "127.0.0.1:0", "--inventory", "127.0.0.1:0"]
    log = tmp_path / "gateway.log"  # a file, not a pipe: access logs never block the gateway
    with log.open("w") as err:
        # its own process group, which stop_group ends
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("kvgate serve: http="):
            proc.kill()
            proc.wait(timeout=10)
            pytest.fail(f"gateway did not start: {line!r} {log.read_text()[-2000:]}")
        http = line.split()[2].removeprefix("http=")
        yield f"http://{http}"
    finally:
        stop_group(proc, grace_s=15.0)


@pytest.mark.timeout(120)
def test_rendered_gateway_serves_its_probe_paths(gateway: str, rendered_cases: dict[str, Rendered]) -> None:
    c = gateway_container(rendered_cases["defaults"])
    assert _status(gateway + c["livenessProbe"]["httpGet"]["path"]) == 200
    assert _status(gateway + c["startupProbe"]["httpGet"]["path"]) == 200
    # No replica is configured or registered yet: not ready, and saying so rather than 404.
    assert _status(gateway + c["readinessProbe"]["httpGet"]["path"]) == 503
    assert _status(gateway + "/metrics") == 200
