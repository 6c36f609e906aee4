"""The sizes that say whether a room of the code has grown past what a newcomer can hold.

Prints the largest classes (lines from ``class`` to their last line, and methods), the largest functions,
the classes past the ~300 lines the style guide allows, and the escapes from typing at the boundary
(``type: ignore`` comments, ``get("metadata") or {}`` chains that core.shared.bodies' accessors replace).
Generated gRPC stubs are left out. Run it on another tree to compare:

    .venv/bin/python scripts/code_sizes.py [TREE]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

CLASS_LIMIT = 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tree", nargs="?", type=Path, default=Path(), help="a checkout of gpushared (default: .)")
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args()
    classes: list[tuple[int, int, str]] = []
    functions: list[tuple[int, str]] = []
    ignores = chains = 0
    for path in sorted((args.tree / "gpushared").rglob("*.py")):
        if "_pb2" in path.name:
            continue
        text = path.read_text()
        ignores += text.count("type: ignore")
        chains += text.count('get("metadata") or {}')
        where = path.relative_to(args.tree)
        for node in ast.walk(ast.parse(text)):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1 if isinstance(node, ast.stmt) else 0
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) for b in node.body)
                classes.append((lines, methods, f"{where}:{node.name}"))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.append((lines, f"{where}:{node.name}"))
    classes.sort(reverse=True)
    functions.sort(reverse=True)
    print("largest classes (lines, methods):")
    for lines, methods, name in classes[: args.top]:
        print(f"  {lines:5d} {methods:3d}  {name}")
    print("largest functions (lines):")
    for lines, name in functions[: args.top]:
        print(f"  {lines:5d}  {name}")
    print(f"classes past {CLASS_LIMIT} lines: {sum(lines > CLASS_LIMIT for lines, _, _ in classes)}")
    print(f"type: ignore comments: {ignores}")
    print(f'get("metadata") or {{}} chains: {chains}')


if __name__ == "__main__":
    main()
