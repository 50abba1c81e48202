"""Build assets/corpus/stdlib_docstrings.txt: docstrings of the Python standard library, a
plain-English technical text that needs no download. Run once; the output is committed, so the
tokenizer script below never depends on which Python is installed."""

from __future__ import annotations

import ast
import sys
import sysconfig
from pathlib import Path

LIMIT = 600_000


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "assets/corpus/stdlib_docstrings.txt")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[str] = []
    size = 0
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    chunks.append(doc.strip())
                    size += len(doc)
        if size > LIMIT:
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(chunks) + "\n", encoding="utf-8")
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
