"""The ```python blocks of README.md and docs/*.md run as written (CPU, tiny sizes).

The README's first block, the quick start, is self-contained and runs alone. Every other
block runs in a fresh namespace after it, as the docs say ("the snippets assume `model`,
`optimizer`, `loss_fn`, `batches` and a batch `x, y` as in the quick start"). A block
preceded by ``<!-- no-test: reason -->`` (say, one that needs CUDA) is skipped.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A fence at the start of a line; the comment directly above it (blank lines aside) may skip it.
FENCE = re.compile(r"(?:<!--[ \t]*no-test:[ \t]*(?P<skip>[^\n]*?)[ \t]*-->\s*\n)?"
                   r"^```python[ \t]*\n(?P<code>.*?)^```", re.MULTILINE | re.DOTALL)


class Snippet(NamedTuple):
    path: Path
    line: int
    code: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def snippets(path: Path) -> list[Snippet]:
    text = path.read_text()
    return [Snippet(path, text.count("\n", 0, m.start("code")) + 1, m["code"], m["skip"])
            for m in FENCE.finditer(text)]


ALL = [s for path in DOCS for s in snippets(path)]
QUICK_START = ALL[0]


def _run(snippet: Snippet, namespace: dict) -> dict:
    """Exec the block; padding keeps tracebacks at the doc's own file and line."""
    code = "\n" * (snippet.line - 1) + snippet.code
    exec(compile(code, str(snippet.path), "exec"), namespace)  # noqa: S102 - the docs' own code
    return namespace


def test_the_quick_start_is_first_and_runs_on_its_own(tmp_path, monkeypatch):
    assert QUICK_START.path.name == "README.md" and "ampkit.GradScaler()" in QUICK_START.code
    monkeypatch.chdir(tmp_path)
    names = _run(QUICK_START, {})
    assert {"model", "optimizer", "loss_fn", "batches", "x", "y"} <= names.keys()


def test_every_doc_with_code_has_a_block_found():
    for path in DOCS:
        assert path.read_text().count("```python") == len(snippets(path)), path


def test_only_a_block_right_after_a_no_test_comment_is_skipped(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- no-test: other -->\ntext\n\n<!-- no-test: needs CUDA -->\n\n"
                   "```python\nx = 1\n```\n<!-- no-test: far -->\ntext\n```python\ny = 2\n```\n")
    assert [(s.line, s.code, s.skip) for s in snippets(doc)] == [
        (7, "x = 1\n", "needs CUDA"), (12, "y = 2\n", None)]


@pytest.mark.parametrize("snippet", ALL[1:], ids=lambda s: s.id)
def test_snippet_runs(snippet, tmp_path, monkeypatch):
    if snippet.skip:
        pytest.skip(snippet.skip)
    monkeypatch.chdir(tmp_path)  # snippets may save checkpoints
    _run(snippet, _run(QUICK_START, {}))
