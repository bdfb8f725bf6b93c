"""The commands the README and docs/ show a user, extracted from their Markdown: every line of a
fenced sh/bash/shell block (continuations joined, a for ... done loop as one command, comments
dropped) and the `run` column of the README's "Use it from…" table."""
from __future__ import annotations

import re
from pathlib import Path

SHELL_FENCES = {"sh", "bash", "shell"}
FENCE = re.compile(r"^\s*```(\S*)\s*$")
TRAILING_COMMENT = re.compile(r"\s+#\s.*$")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    blocks, language, lines = [], "", None
    for line in text.splitlines():
        match = FENCE.match(line)
        if match and lines is None:
            language, lines = match.group(1), []
        elif match:
            blocks.append((language, "\n".join(lines)))
            lines = None
        elif lines is not None:
            lines.append(line)
    return blocks


def _strip_comment(line: str) -> str:
    match = TRAILING_COMMENT.search(line)
    if match and line[:match.start()].count("'") % 2 == 0 \
            and line[:match.start()].count('"') % 2 == 0:
        return line[:match.start()].rstrip()
    return line.rstrip()


def block_commands(body: str) -> list[str]:
    """A shell block's commands: `\\` continuations joined, `for ... done` kept whole."""
    commands: list[str] = []
    pending = ""
    for raw in body.splitlines():
        line = _strip_comment(raw)
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        pending = f"{pending} {line.strip()}" if pending else line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        if pending.startswith("for ") and not re.search(r"\bdone$", pending):
            pending += ";"
            continue
        commands.append(pending.replace("; ;", ";").replace("do;", "do"))
        pending = ""
    return commands


def table_commands(readme: str) -> list[str]:
    """The `run` column of the README's "Use it from…" table."""
    section = readme.split("## Use it from", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    return [re.search(r"`(.+?)`", row.split(" | ")[1]).group(1).replace("\\|", "|")
            for row in rows]


def documented_commands(root: Path) -> dict[str, str]:
    """Every command a user is shown -> the file that shows it."""
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    found: dict[str, str] = {}
    for doc in docs:
        text = doc.read_text()
        for language, body in fenced_blocks(text):
            if language in SHELL_FENCES:
                for command in block_commands(body):
                    found.setdefault(command, doc.name)
        if doc.name == "README.md":
            for command in table_commands(text):
                found.setdefault(command, doc.name)
    return found


PLACEHOLDER = re.compile(r"[\[\]|…]|\.\.\.| / |\b[A-Z]{1,5}\b")


def inline_commands(root: Path) -> dict[str, str]:
    """`duplex ... --flag ...` spans in the prose of the README and docs/ that are whole
    commands: at least one flag, no placeholder (`[--x]`, `a|b`, `FILE`, `N`, `...`)."""
    found: dict[str, str] = {}
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for span in re.findall(r"`(duplex [^`]+)`", doc.read_text()):
            span = " ".join(span.split())  # a span wrapped over lines
            if " --" in span and not PLACEHOLDER.search(span):
                found.setdefault(span, doc.name)
    return found
