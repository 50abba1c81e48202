"""Regenerate the Python stubs of proto/kvgate/v1/*.proto, or check that the committed ones are current.

    python scripts/gen_proto.py          # rewrite the stubs next to the .proto files
    python scripts/gen_proto.py --check  # exit 1 naming the stale files, change nothing

Uses grpcio-tools (protoc + the gRPC plugin) and mypy-protobuf (the .pyi files), both pinned in the
``dev`` extra, so that the output depends only on those versions. The repository root is the include
path, so the generated modules import each other as ``proto.kvgate.v1.*``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "kvgate" / "v1"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def _protoc(out: Path, protos: list[Path]) -> None:
    try:
        from grpc_tools import protoc  # type: ignore[import-untyped]
    except ImportError:
        sys.exit("gen_proto: grpcio-tools is not installed; run `pip install -e '.[dev]'`")
    plugin_dir = Path(sys.executable).parent
    if not (plugin_dir / "protoc-gen-mypy").exists():
        sys.exit("gen_proto: mypy-protobuf (protoc-gen-mypy) is not installed; run `pip install -e '.[dev]'`")
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--plugin=protoc-gen-mypy={plugin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={plugin_dir / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *(str(p.relative_to(ROOT)) for p in protos),
    ]
    rc = protoc.main(args)
    if rc != 0:
        sys.exit(f"gen_proto: protoc failed with exit code {rc}")


def _outputs(protos: list[Path]) -> list[Path]:
    return [p.with_name(p.stem + s) for p in protos for s in SUFFIXES]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    args = parser.parse_args(argv)
    protos = sorted(PROTO_DIR.glob("*.proto"))
    if not protos:
        sys.exit(f"gen_proto: no .proto files in {PROTO_DIR}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        _protoc(out, protos)
        stale: list[str] = []
        for target in _outputs(protos):
            fresh = out / target.relative_to(ROOT)
            if not fresh.exists():
                sys.exit(f"gen_proto: protoc did not produce {fresh.name}")
            if args.check:
                if not target.exists() or target.read_bytes() != fresh.read_bytes():
                    stale.append(str(target.relative_to(ROOT)))
            else:
                shutil.copyfile(fresh, target)
        if stale:
            print(
                "gen_proto: generated stubs are stale or missing: "
                + ", ".join(stale)
                + "\n  run `make proto` and commit the result",
                file=sys.stderr,
            )
            return 1
    if args.check:
        print(f"gen_proto: {len(protos)} proto file(s), stubs up to date")
    else:
        print(f"gen_proto: regenerated stubs of {', '.join(p.name for p in protos)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
