"""The code's shape rules (docs/architecture.md, "Code shape"; the developers' guide): modules
under ``MAX_MODULE_LINES`` lines, and no function of the request path's packages (``gateway/``,
``router_policies/``) with more than ``MAX_PARAMETERS`` parameters (pass a context object).

How parameters count: every parameter a caller can pass, positional or keyword-only (a
keyword-only parameter is still one more thing threaded through the call); ``*args`` and
``**kwargs`` count one each; ``self`` and ``cls`` (the first parameter of a method or a
classmethod) do not. Generated stubs (``*_pb2*``) are not read.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 400
MAX_PARAMETERS = 6
REQUEST_PATH_PACKAGES = ("gateway", "router_policies")
SOURCE_DIRS = (
    "gateway",
    "router_policies",
    "replica_agent",
    "kvgate_tools",
    "bench",
    "e2e",
    "scripts",
    "tests",
)

# Known exceptions, each with its reason. The test fails when an entry no longer exceeds the
# rule too, so that a fixed one leaves the list.
TOO_MANY_PARAMETERS: frozenset[str] = frozenset()


def _modules(dirs: tuple[str, ...]) -> Iterator[Path]:
    for d in dirs:
        for path in sorted((REPO / d).rglob("*.py")):
            if "_pb2" not in path.name and ".venv" not in path.parts:
                yield path


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    if in_class and positional and positional[0].arg in ("self", "cls"):
        positional = positional[1:]
    return len(positional) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(qualified name, parameter count) of every function, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield f"{prefix}{node.name}", _parameters(node, isinstance(tree, ast.ClassDef))
            yield from _functions(node, f"{prefix}{node.name}.")


def test_modules_stay_under_the_line_limit() -> None:
    long = {
        str(p.relative_to(REPO)): n
        for p in _modules(SOURCE_DIRS)
        if (n := p.read_text(encoding="utf-8").count("\n")) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by what they hold): {long}"


def test_request_path_functions_take_at_most_six_parameters() -> None:
    wide = {}
    for path in _modules(REQUEST_PATH_PACKAGES):
        for name, n in _functions(ast.parse(path.read_text(encoding="utf-8"))):
            if n > MAX_PARAMETERS:
                wide[f"{path.relative_to(REPO)}:{name}"] = n
    new = {k: n for k, n in wide.items() if k not in TOO_MANY_PARAMETERS}
    assert not new, f"functions with more than {MAX_PARAMETERS} parameters (pass a context object): {new}"
    fixed = TOO_MANY_PARAMETERS - wide.keys()
    assert not fixed, f"no longer over the limit, remove them from TOO_MANY_PARAMETERS: {fixed}"


def test_the_rules_count_what_they_say() -> None:
    """The counting itself can fail: a method's self, keyword-only parameters, *args/**kwargs."""
    tree = ast.parse(
        "class C:\n"
        "    def m(self, a, b, *, c, d): ...\n"
        "    @classmethod\n"
        "    def k(cls, *args, **kw): ...\n"
        "def f(self, a): ...\n"
        "def g(a, /, b, *c, d, **e):\n"
        "    def inner(x): ...\n"
    )
    assert dict(_functions(tree)) == {"C.m": 4, "C.k": 2, "f": 2, "g": 5, "g.inner": 1}
