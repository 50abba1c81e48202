"""A subcommand whose optional extra is missing says which one to install (gateway/cli.py), instead
of a traceback; ``kvgate serve`` and ``kvgate agent`` need none (tests/deploy/test_dockerfile.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Runs the CLI with ``module`` unimportable, as on an install without its extra.
_WITHOUT = (
    "import sys; sys.modules[{module!r}] = None; from gateway.cli import main; sys.exit(main({argv!r}))"
)


@pytest.mark.parametrize(
    ("module", "argv", "extra"),
    [
        (
            "transformers",
            [
                "sim-engine",
                "--port",
                "0",
                "--events-port",
                "0",
                "--tokenizer",
                "assets/tokenizers/kvgate-tiny",
            ],
            "sim",
        ),
        ("matplotlib", ["demo", "--help"], None),
    ],
)
def test_a_missing_extra_is_named(module: str, argv: list[str], extra: str | None) -> None:
    code = _WITHOUT.format(module=module, argv=argv)
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    if extra is None:  # the demo imports matplotlib only to draw its chart: --help still works
        assert res.returncode == 0, res.stderr
        return
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert f"pip install 'kvgate[{extra}]'" in res.stderr
