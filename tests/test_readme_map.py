"""The README's module map stays true: every module of the library packages has its line,
and every path the map names exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "frontend", "kvstore", "kernels")
_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*(\S.*?)\s*\|\s*$")


def map_rows(readme: str) -> dict[str, str]:
    """`path` -> what it does, one row of the '## Module map' table each."""
    section = readme.split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = _ROW.match(line)
        if match:
            assert match.group(1) not in rows, f"{match.group(1)} is listed twice"
            rows[match.group(1)] = match.group(2)
    return rows


def library_modules() -> set[str]:
    return {str(path.relative_to(ROOT)) for package in PACKAGES
            for path in (ROOT / package).rglob("*.py") if path.name != "__init__.py"}


def test_parser_reads_one_path_per_row():
    readme = ("# x\n\n## Module map\n\n| module | what it owns |\n|---|---|\n"
              "| `engine/core.py` | the engine |\n| `web/` | the demo |\n\n## Next\n"
              "| `engine/not_in_the_map.py` | elsewhere |\n")
    assert map_rows(readme) == {"engine/core.py": "the engine", "web/": "the demo"}


def test_every_module_is_in_the_map_and_every_listed_path_exists():
    rows = map_rows((ROOT / "README.md").read_text())
    missing = sorted(library_modules() - set(rows))
    assert not missing, f"modules missing from the README's module map: {missing}"
    absent = sorted(path for path in rows if not (ROOT / path).exists())
    assert not absent, f"the README's module map lists paths that do not exist: {absent}"
