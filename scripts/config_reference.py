"""Print the reference of every gateway config field (path, type, default, description), generated
from the typed config tree itself, or keep ``docs/gateway.md`` in step with it.

    python scripts/config_reference.py                         # print the Markdown table
    python scripts/config_reference.py --write docs/gateway.md # replace the marked section
    python scripts/config_reference.py --check docs/gateway.md # exit 1 if that section is stale

The section sits between ``<!-- config-reference:start -->`` and ``<!-- config-reference:end -->``.
Policy parameters (``policy.<name>.<param>``) come from each built-in policy's parameter model.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from gateway.config import GatewayConfig, PolicyConfig
from router_policies.registry import BUILTIN_POLICIES

START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    if origin is dict:
        return f"map[{_type_name(args[0])}, {_type_name(args[1])}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    return "`" + json.dumps(value) + "`"


def _model_of(tp: Any) -> tuple[type[BaseModel] | None, str]:
    """The nested model of a field's type and the path suffix (``[]`` for lists of models)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp, ""
    if typing.get_origin(tp) is list:
        (arg,) = typing.get_args(tp)
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg, "[]"
    return None, ""


def fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        nested, suffix = _model_of(field.annotation)
        if nested is not None:
            doc = (field.description or (nested.__doc__ or "").strip().split("\n")[0]).strip()
            yield path + suffix, "list of objects" if suffix else "object", "", doc
            yield from fields(nested, f"{path}{suffix}.")
            if nested is PolicyConfig:
                for pname, entry in BUILTIN_POLICIES.items():
                    yield f"{path}.{pname}", "object", "", f"Parameters of the {pname} policy."
                    yield from fields(entry.params, f"{path}.{pname}.")
            continue
        yield path, _type_name(field.annotation), _default(field), (field.description or "").strip()


def reference() -> str:
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for path, tp, default, desc in fields(GatewayConfig):
        cells = [f"`{path}`", tp, default, desc]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def _splice(text: str, table: str) -> str:
    head, sep, rest = text.partition(START)
    _old, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"config_reference: markers {START} ... {END} not found")
    return f"{head}{START}\n{table}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", type=Path, help="replace the marked section of this file")
    g.add_argument("--check", type=Path, help="exit 1 when the marked section of this file is stale")
    args = p.parse_args(argv)
    table = reference()
    if args.write:
        args.write.write_text(_splice(args.write.read_text(encoding="utf-8"), table), encoding="utf-8")
        return 0
    if args.check:
        text = args.check.read_text(encoding="utf-8")
        if _splice(text, table) != text:
            print(
                f"config_reference: {args.check} is stale; run `python scripts/config_reference.py "
                f"--write {args.check}`",
                file=sys.stderr,
            )
            return 1
        return 0
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
