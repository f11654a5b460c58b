"""Every ```python block in README.md and docs/*.md runs, in order, one namespace per file.

Documentation that does not run is documentation that lies. A block fenced as ```python no-run is
shown but skipped (for fragments that need a cluster or a network); use it sparingly.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.process import ROOT

DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

_LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclass(frozen=True)
class Block:
    """One fenced code block: its info string, first code line (1-based) and source."""

    info: str
    line: int
    source: str

    @property
    def runnable(self) -> bool:
        words = self.info.split()
        return bool(words) and words[0] in ("python", "py") and "no-run" not in words[1:]


def extract_blocks(text: str) -> list[Block]:
    """Fenced blocks of a Markdown text (CommonMark fences; a closing fence matches the opener)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, indent, info = match["fence"], len(match["indent"]), match["info"].strip()
        body: list[str] = []
        start = i + 2
        i += 1
        while i < len(lines):
            closing = _FENCE.match(lines[i])
            if closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence) \
                    and not closing["info"].strip():
                break
            line = lines[i]
            body.append(line[indent:] if line[:indent].strip() == "" else line)
            i += 1
        else:
            raise ValueError(f"unclosed code fence opened on line {start - 1}")
        blocks.append(Block(info, start, "\n".join(body) + "\n"))
        i += 1
    return blocks


def test_extract_blocks_finds_fences_and_no_run() -> None:
    text = "# t\n```python\nx = 1\n```\n\n  ```python no-run\n  boom()\n  ```\n````py\ny = '```'\n````\n```text\nz\n```\n"
    blocks = extract_blocks(text)
    assert [(b.info, b.line, b.source, b.runnable) for b in blocks] == [
        ("python", 3, "x = 1\n", True),
        ("python no-run", 7, "boom()\n", False),
        ("py", 10, "y = '```'\n", True),
        ("text", 13, "z\n", False),
    ]
    with pytest.raises(ValueError, match="unclosed code fence opened on line 1"):
        extract_blocks("```python\nx = 1\n")


def test_doc_files_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in DOC_FILES}
    assert {"README.md", "docs/index.md", "docs/quickstart.md"} <= names


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_to_existing_files(doc: Path) -> None:
    """A page links only pages that exist (code blocks are not searched for links)."""
    text = doc.read_text(encoding="utf-8")
    for block in extract_blocks(text):
        text = text.replace(block.source.rstrip("\n"), "")
    broken = []
    for match in _LINK.finditer(text):
        target = match["target"].split("#", 1)[0]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):  # anchors and URLs
            continue
        if not (doc.parent / target).exists():
            broken.append(target)
    assert broken == [], f"{doc.relative_to(ROOT)} links to missing files: {broken}"


RUNNABLE_DOCS = [
    d for d in DOC_FILES if any(b.runnable for b in extract_blocks(d.read_text(encoding="utf-8")))
]


@pytest.mark.parametrize("doc", RUNNABLE_DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_python_blocks_run(doc: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the file's blocks top to bottom in one namespace, in a fresh temporary working directory."""
    blocks = [b for b in extract_blocks(doc.read_text(encoding="utf-8")) if b.runnable]
    monkeypatch.chdir(tmp_path)
    rel = doc.relative_to(ROOT).as_posix()
    namespace: dict[str, Any] = {"__name__": f"docs_{doc.stem.replace('-', '_')}"}
    for block in blocks:
        # Pad with newlines so tracebacks show the line number inside the Markdown file itself.
        code = compile("\n" * (block.line - 1) + block.source, str(doc), "exec")
        try:
            exec(code, namespace)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            tb = "".join(traceback.format_exception(exc))
            pytest.fail(f"{rel}: the python block starting at line {block.line} failed:\n{tb}", pytrace=False)
