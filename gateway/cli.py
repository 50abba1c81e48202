"""The ``kvgate`` command: one entry point, a subcommand per tool.

Each subcommand lives in its own module exposing ``configure(parser)`` and ``run(args) -> int``;
modules are imported only when their subcommand runs, so ``kvgate compare`` never pays for
aiohttp or grpc imports, and ``kvgate serve`` runs without the optional extras (pyproject.toml):
a subcommand that needs one it lacks says which to install.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from router_policies.errors import UserInputError

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.serve_cli", "run the gateway"),
    "agent": ("replica_agent.agent_cli", "run a replica agent beside an engine"),
    "sim-engine": ("replica_agent.sim_engine_cli", "run a simulated vLLM engine"),
    "compare": ("router_policies.sim.compare_cli", "compare policies on a trace in the simulator"),
    "demo": ("kvgate_tools.demo", "live demo: simulated fleet, agents, gateway, four policies"),
    "report": ("gateway.report_cli", "what the cache saved and how long it keeps things (GET /admin/report)"),
    "whatif": (
        "router_policies.sim.whatif",
        "replay a recorded trace against fleet variations in the simulator",
    ),
}

# top-level modules only the optional extras install (pyproject.toml) -> the extra that does
OPTIONAL_MODULES = {"transformers": "sim", "matplotlib": "plots"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except ModuleNotFoundError as exc:
        extra = OPTIONAL_MODULES.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"kvgate {argv[0]}: needs {exc.name}: pip install 'kvgate[{extra}]'", file=sys.stderr)
        return 2


def _dispatch(argv: list[str]) -> int:
    parser = _Parser(prog="kvgate", description="KV-aware routing gateway for LLM-serving fleets")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    modules = {}
    for name, (mod_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:
            modules[name] = importlib.import_module(mod_name)
            modules[name].configure(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        rc: int = modules[args.command].run(args)
    except UserInputError as exc:
        print(f"kvgate {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
