"""docs/gateway.md carries the generated config reference, and it is current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import GatewayConfig

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "config_reference.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_reference_lists_every_leaf_field() -> None:
    out = _run().stdout
    for section in GatewayConfig.model_fields:
        assert f"| `{section}" in out, section
    for needle in [
        "`proxy.retries`",
        "`models[].tokenizer`",
        "`policy.kv_aware.balance_abs`",
        "`index.approximate_ttl_s`",
    ]:
        assert needle in out


@pytest.mark.parametrize("doc", ["docs/gateway.md", "README.md"])
def test_docs_reference_is_current(doc: str) -> None:
    res = _run("--check", str(ROOT / doc))
    assert res.returncode == 0, res.stderr


def test_check_detects_a_stale_doc(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("# x\n<!-- config-reference:start -->\n| old |\n<!-- config-reference:end -->\n")
    assert _run("--check", str(doc)).returncode == 1
    assert _run("--write", str(doc)).returncode == 0
    assert _run("--check", str(doc)).returncode == 0
    assert "`listen.http`" in doc.read_text()
