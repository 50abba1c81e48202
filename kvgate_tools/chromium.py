"""Headless Chromium for the status page's test and screenshot (docs/operators.md, "Status page").

Which binary: ``$KVGATE_CHROMIUM`` if set, else ``chromium`` / ``chromium-browser`` on ``PATH``;
when there is none and this runs as root on a Debian-like machine, Debian's ``chromium`` package
is installed with apt-get (what CI and a fresh developer machine need). None found after that is
an error naming the fix, never a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

NAMES = ("chromium", "chromium-browser")
INSTALL_TIMEOUT_S = 900.0


def _on_path() -> str | None:
    explicit = os.environ.get("KVGATE_CHROMIUM")
    if explicit:
        return explicit
    for name in NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def find_or_install_chromium() -> str:
    found = _on_path()
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=False, timeout=INSTALL_TIMEOUT_S,
                       capture_output=True)  # fmt: skip
        res = subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], env=env, check=False,
                             timeout=INSTALL_TIMEOUT_S, capture_output=True, text=True)  # fmt: skip
        found = _on_path()
        if found:
            return found
        raise RuntimeError(f"apt-get install chromium failed ({res.returncode}): {res.stderr[-500:]}")
    raise RuntimeError(
        "no headless Chromium: none on PATH (chromium, chromium-browser) and not root with apt-get to "
        "install it; run `apt-get install -y chromium` or set KVGATE_CHROMIUM"
    )


def _headless(chromium: str, url: str, extra: list[str], budget_ms: int) -> subprocess.CompletedProcess[str]:
    args = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--hide-scrollbars", f"--virtual-time-budget={budget_ms}", *extra, url]  # fmt: skip
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


def dump_dom(url: str, budget_ms: int = 4000) -> str:
    """The page's DOM after its scripts ran for ``budget_ms`` of virtual time."""
    res = _headless(find_or_install_chromium(), url, ["--dump-dom"], budget_ms)
    if res.returncode != 0:
        raise RuntimeError(f"chromium --dump-dom failed ({res.returncode}): {res.stderr[-800:]}")
    return res.stdout


def screenshot(url: str, out: Path, size: tuple[int, int] = (1400, 1500), budget_ms: int = 4000) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    extra = [f"--screenshot={out}", f"--window-size={size[0]},{size[1]}"]
    res = _headless(find_or_install_chromium(), url, extra, budget_ms)
    if res.returncode != 0 or not out.exists():
        raise RuntimeError(f"chromium --screenshot failed ({res.returncode}): {res.stderr[-800:]}")
    return out
