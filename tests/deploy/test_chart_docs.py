"""The chart README's values table and the generated part of values.schema.json are up to date,
and the generator refuses an undocumented value."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from types import ModuleType

import pytest

from tests.deploy.conftest import CHART, REPO

SCRIPT = REPO / "deploy" / "helm" / "sync_chart.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvgate_deploy_sync_chart", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    # dataclasses resolve the module's annotations through sys.modules.
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_generated_files_are_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, check=False, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr


def test_readme_lists_every_value() -> None:
    sync = _module()
    docs = sync.value_docs((CHART / "values.yaml").read_text(encoding="utf-8"))
    readme = (CHART / "README.md").read_text(encoding="utf-8")
    assert len(docs) > 80
    for d in docs:
        assert f"| `{d.path}` |" in readme, d.path
    assert "gateway.config" in {d.path for d in docs}


def test_undocumented_value_is_refused() -> None:
    sync = _module()
    text = "image:\n  # -- The repository.\n  repository: kvgate\n  tag: ''\n"
    with pytest.raises(sync.ChartDocError, match=re.escape("values.yaml:4: image.tag has no `# --` comment")):
        sync.value_docs(text)


def test_comment_continuation_and_documented_maps() -> None:
    sync = _module()
    text = (
        "# -- Resources of the pod,\n"
        "# as Kubernetes takes them.\n"
        "resources:\n"
        "  limits:\n"
        "    memory: 1Gi\n"
        "ports:\n"
        "  # -- HTTP port.\n"
        "  http: 8000\n"
    )
    docs = sync.value_docs(text)
    assert [(d.path, d.description, d.default) for d in docs] == [
        ("resources", "Resources of the pod, as Kubernetes takes them.", {"limits": {"memory": "1Gi"}}),
        ("ports.http", "HTTP port.", 8000),
    ]
    both = "# -- A map.\nm:\n  # -- And its key.\n  k: 1\n"
    with pytest.raises(sync.ChartDocError, match="document either the map or each of its keys"):
        sync.value_docs(both)


def test_values_and_schema_must_name_the_same_keys() -> None:
    sync = _module()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    docs = sync.value_docs("# -- A.\na: 1\n")
    with pytest.raises(
        sync.ChartDocError, match=re.escape("values.schema.json: b has no default in values.yaml")
    ):
        sync.check_values_match_schema(docs, schema, {"a": 1})
    docs = sync.value_docs("# -- A.\na: 1\n# -- C.\nc: 2\n")
    with pytest.raises(sync.ChartDocError, match=re.escape("c is missing from values.schema.json")):
        sync.check_values_match_schema(docs, schema, {"a": 1, "b": "", "c": 2})
