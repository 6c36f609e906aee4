"""Move what every interpreter's tree holds identically into common/ (run by debian/rules).

    python3 share-common.py LIB cp310 cp311 cp312 cp313

A top-level entry of LIB/cp3XX (a package, a module, a .dist-info) that is byte-for-byte the same in all
of them is one entry in LIB/common instead: the pure-Python dependencies, most of the package, are
shipped once. What differs (compiled extensions, pins that differ per interpreter) stays per tree.
"""

from __future__ import annotations

import filecmp
import shutil
import sys
from pathlib import Path


def same(a: Path, b: Path) -> bool:
    if a.is_dir() != b.is_dir():
        return False
    if not a.is_dir():
        return filecmp.cmp(a, b, shallow=False)
    compared = filecmp.dircmp(a, b)
    if compared.left_only or compared.right_only or compared.funny_files:
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, compared.common_files, shallow=False)
    return not mismatch and not errors and all(same(a / d, b / d) for d in compared.common_dirs)


def forget_sources(tree: Path) -> None:
    """pip records where each wheel was installed from (direct_url.json): a build path, not for shipping."""
    for record in tree.glob("*.dist-info/direct_url.json"):
        listed = record.parent / "RECORD"
        if listed.exists():
            lines = listed.read_text().splitlines(keepends=True)
            listed.write_text(
                "".join(line for line in lines if not line.startswith(f"{record.parent.name}/direct_url.json,"))
            )
        record.unlink()


def main(lib: Path, tags: list[str]) -> None:
    for tree in [lib / "common", *(lib / tag for tag in tags)]:
        forget_sources(tree)
    first, *others = (lib / tag for tag in tags)
    common = lib / "common"
    moved = 0
    for entry in sorted(first.iterdir()):
        if (common / entry.name).exists():
            continue
        if all((tree / entry.name).exists() and same(entry, tree / entry.name) for tree in others):
            shutil.move(entry, common / entry.name)
            for tree in others:
                target = tree / entry.name
                shutil.rmtree(target) if target.is_dir() else target.unlink()
            moved += 1
    kept = {tag: len(list((lib / tag).iterdir())) for tag in tags}
    print(f"share-common: {moved} entries shared in common/, per interpreter: {kept}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
