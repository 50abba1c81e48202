"""A subcommand whose optional extra is missing says which one to install (gateway/cli.py), instead
of a traceback; ``kvgate serve`` and ``kvgate agent`` need none (tests/deploy/test_dockerfile.py)."""

from __future__ import annotations

import subprocess
import sys

from kvgate_tools.procs import REPO_ROOT

# The CLI with ``transformers`` unimportable, as on an install without the ``sim`` extra.
_WITHOUT_TRANSFORMERS = (
    "import sys; sys.modules['transformers'] = None; from gateway.cli import main; sys.exit(main({argv!r}))"
)


def test_the_simulated_engine_without_the_sim_extra_names_it() -> None:
    tokenizer = REPO_ROOT / "assets" / "tokenizers" / "kvgate-tiny"
    argv = ["sim-engine", "--port", "0", "--events-port", "0", "--tokenizer", str(tokenizer)]
    code = _WITHOUT_TRANSFORMERS.format(argv=argv)
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert res.stderr.strip() == "kvgate sim-engine: needs transformers: pip install 'kvgate[sim]'"
