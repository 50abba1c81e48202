"""deploy/docker/Dockerfile, checked without a Docker engine: its stages, user, entrypoint and
ports, the build context .dockerignore leaves, and a wheel built from exactly the files the build
stage copies."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from gateway.cli import OPTIONAL_MODULES
from gateway.config import ListenConfig
from tests.deploy.conftest import CHART, REPO

DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
# packages the distribution installs from a checkout that the image leaves out (they read the
# repository's assets; the image runs `kvgate serve`, `kvgate agent`, `kvgate sim-engine`)
IMAGE_LEAVES_OUT = ("kvgate_tools",)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, instr: str) -> list[str]:
        return [arg for i, arg in self.instructions if i == instr]


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARGs and the stages, each instruction with its continuation lines joined.

    As Docker does: a line ending in a backslash continues; comment lines are dropped, also
    inside a continuation.
    """
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#"):
            continue
        if not line and not pending:
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continuation"
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for entry in logical:
        instr, _, rest = entry.partition(" ")
        instr, rest = instr.upper(), rest.strip()
        if instr == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert m, f"unreadable FROM {rest!r}"
            base = re.sub(r"\$\{(\w+)\}", lambda v: args[v[1]], m[1])
            stages.append(Stage(base, m[2]))
        elif not stages:
            assert instr == "ARG", f"{instr} before the first FROM"
            name, _, default = rest.partition("=")
            args[name] = default
        else:
            stages[-1].instructions.append((instr, rest))
    return args, stages


ARGS, STAGES = parse_dockerfile(DOCKERFILE.read_text(encoding="utf-8"))
FINAL = STAGES[-1]


def _copy_sources(stage: Stage) -> list[tuple[list[str], str]]:
    """(sources, destination) of the stage's COPY instructions that read the build context."""
    out = []
    for arg in stage.all("COPY"):
        if "--from=" in arg:
            continue
        parts = [p for p in arg.split() if not p.startswith("--")]
        out.append((parts[:-1], parts[-1]))
    return out


def _dockerignore() -> list[tuple[re.Pattern[str], bool]]:
    rules = []
    for raw in (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = "".join(
            ".*" if tok == "**" else "[^/]*" if tok == "*" else "[^/]" if tok == "?" else re.escape(tok)
            for tok in re.split(r"(\*\*|\*|\?)", pattern)
        )
        rules.append((re.compile(regex.replace(".*/", "(.*/)?")), negate))
    return rules


def excluded(rel: str, rules: list[tuple[re.Pattern[str], bool]]) -> bool:
    """Docker's rule: the last matching pattern decides; a pattern also covers what is under it."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    verdict = False
    for regex, negate in rules:
        if any(regex.fullmatch(p) for p in prefixes):
            verdict = not negate
    return verdict


def test_multi_stage_on_slim_python_311() -> None:
    assert len(STAGES) >= 2
    assert [s.name for s in STAGES] == ["build", "runtime"]
    for s in STAGES:
        assert re.fullmatch(r"python:3\.11-slim(-\w+)?", s.base), s.base
    # The runtime stage takes only the built virtualenv from the build stage.
    froms = [a for a in FINAL.all("COPY") if "--from=" in a]
    assert froms == ["--from=build /opt/kvgate/venv /opt/kvgate/venv"]
    assert not FINAL.all("RUN") or all("pip" not in r for r in FINAL.all("RUN"))


def test_runs_as_a_numeric_non_root_user_that_the_chart_expects() -> None:
    users = FINAL.all("USER")
    assert len(users) == 1
    uid, _, gid = users[0].partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    # The user exists in the image (useradd with the same uid), and the chart runs pods as it.
    assert any(f"--uid {uid}" in r for r in FINAL.all("RUN"))
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    assert values["gateway"]["podSecurityContext"]["runAsUser"] == int(uid)
    assert values["agent"]["securityContext"]["runAsUser"] == int(uid)
    # USER comes after the last RUN: nothing runs as root in the final image.
    order = [i for i, _ in FINAL.instructions]
    assert max(i for i, x in enumerate(order) if x == "RUN") < order.index("USER")


def test_entrypoint_is_the_kvgate_console_script() -> None:
    (entry,) = FINAL.all("ENTRYPOINT")
    assert json.loads(entry) == ["kvgate"]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["project"]["scripts"]["kvgate"] == "gateway.cli:main"
    env = " ".join(FINAL.all("ENV"))
    assert "PATH=/opt/kvgate/venv/bin:$PATH" in env


def test_exposes_the_gateway_ports() -> None:
    exposed = {int(p) for e in FINAL.all("EXPOSE") for p in e.split()}
    listen = ListenConfig()
    defaults = {int(listen.http.rsplit(":", 1)[1]), int(listen.inventory.rsplit(":", 1)[1])}
    assert exposed == defaults == {8000, 50051}
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    assert set(values["gateway"]["ports"].values()) == exposed


def test_installs_runtime_dependencies_only() -> None:
    runs = " ".join(r for s in STAGES for r in s.all("RUN"))
    assert "[dev]" not in runs and "requirements-dev" not in runs
    assert "pip install --only-binary=:all: /wheels/kvgate-*.whl" in runs


def test_dockerignore_keeps_the_context_small_and_the_sources_in() -> None:
    rules = _dockerignore()
    for heavy in (
        ".git/HEAD",
        ".venv/bin/python",
        "tests/unit/__init__.py",
        "gateway/__pycache__/cli.cpython-311.pyc",
    ):
        assert excluded(heavy, rules), heavy
    for stage in STAGES:
        for sources, _ in _copy_sources(stage):
            for src in sources:
                assert (REPO / src).exists(), f"COPY {src}: not in the repository"
                assert not excluded(src, rules), f"COPY {src}: excluded by .dockerignore"


def _stage_context(stage: Stage, dest_root: Path) -> None:
    """Lay out what the stage's COPY instructions put in its WORKDIR, honouring .dockerignore."""
    rules = _dockerignore()
    for sources, dest in _copy_sources(stage):
        for src in sources:
            target = dest_root / dest if dest != "./" else dest_root / Path(src).name
            source = REPO / src
            files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
            for f in files:
                rel = f.relative_to(REPO).as_posix()
                if excluded(rel, rules):
                    continue
                out = target / f.relative_to(source) if source.is_dir() else target
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, out)


@pytest.mark.timeout(180)
def test_the_build_stage_context_builds_a_complete_wheel(tmp_path: Path) -> None:
    build = STAGES[0]
    assert build.all("WORKDIR") == ["/src"]
    context = tmp_path / "src"
    _stage_context(build, context)
    out = tmp_path / "wheels"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(context),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("kvgate-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert "kvgate = gateway.cli:main" in entry_points
    # Every module of every package pyproject.toml ships is in the wheel, but for the tools (the
    # demo, the supervisor of the tests and benchmarks), which read the repository's assets.
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    packages = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    assert set(IMAGE_LEAVES_OUT) < set(packages)
    expected = {
        p.relative_to(REPO).as_posix()
        for pkg in packages
        if pkg not in IMAGE_LEAVES_OUT
        for p in (REPO / pkg).rglob("*.py")
        if "__pycache__" not in p.parts and (p.parent / "__init__.py").exists()
    }
    assert expected and expected <= names, sorted(expected - names)[:10]
    assert not [n for n in names if n.split("/")[0] in IMAGE_LEAVES_OUT]


def test_the_default_image_installs_no_optional_extra() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    base = " ".join(pyproject["project"]["dependencies"])
    extras = pyproject["project"]["optional-dependencies"]
    for module, extra in OPTIONAL_MODULES.items():
        assert module not in base and any(d.startswith(f"{module}==") for d in extras[extra]), module
    build = STAGES[0]
    assert 'KVGATE_EXTRAS=""' in build.all("ARG")
    (run,) = build.all("RUN")
    assert 'if [ -n "$KVGATE_EXTRAS" ]' in run and '"$(ls /wheels/kvgate-*.whl)[$KVGATE_EXTRAS]"' in run


def test_the_gateway_and_the_agent_import_no_optional_extra() -> None:
    """``kvgate serve`` and ``kvgate agent``, every module they can load (all of ``gateway`` and
    ``replica_agent`` but the simulated engine), without ``transformers`` or ``matplotlib``."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import gateway, replica_agent\n"
        "for pkg in (gateway, replica_agent):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        if 'sim_engine' not in m.name:\n"
        "            importlib.import_module(m.name)\n"
        f"print(sorted(m for m in {sorted(OPTIONAL_MODULES)!r} if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


def test_the_image_carries_the_tokenizer_the_simulated_fleet_uses() -> None:
    copies = [a for a in FINAL.all("COPY") if "--from" not in a]
    assert "assets/tokenizers /opt/kvgate/assets/tokenizers" in copies
    assert FINAL.all("WORKDIR") == ["/opt/kvgate"]
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (REPO / "assets/tokenizers/kvgate-tiny" / f).is_file()
