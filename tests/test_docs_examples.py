"""The code blocks of README.md and docs/*.md run, as a reader pasting them would.

Rules for a page (one test per page, parametrised by file name):

- Every ```python block runs, in page order, in one fresh namespace per page (`exec`), with the repository
  root as the working directory.
- An HTML comment on the line right before a fence, `<!-- skip: REASON -->`, keeps that block from running
  (for blocks that need a CUDA GPU or the `bench` extras); it shows up as a skipped test with REASON. The
  page's other blocks still run, so a later block must not need what a skipped one defines.
- A ```text block right after a python block (nothing but blank lines and its marker between) is that
  block's expected stdout, compared as doctest compares: `...` matches any text (doctest's ELLIPSIS) and
  trailing whitespace is ignored. `<!-- output: not checked -->` right before the text fence shows output
  without checking it (timings, machine-dependent figures).
- ```bash, ```sh, ```console and every other fence are never run.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_MARK = re.compile(r"<!--\s*(skip|output)\s*:\s*(.*?)\s*-->\s*\Z")


@dataclass(frozen=True)
class Block:
    """One fenced block: its language, source, first line number and the marker comment before it."""

    lang: str
    source: str
    line: int
    mark: tuple[str, str] | None  # ("skip", reason) or ("output", "not checked")
    gap: str  # the text between the previous block's fence and this one's


def blocks(text: str) -> list[Block]:
    out, end = [], 0
    for m in _FENCE.finditer(text):
        before = text[end : m.start()]
        last_line = before.rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(last_line)
        line = text.count("\n", 0, m.start()) + 1
        out.append(Block(m.group(1), m.group(2), line, mark.groups() if mark else None, before))
        end = m.end()
    return out


def expected_output(page: list[Block], i: int) -> str | None:
    """The text block right after python block `i` (nothing but blank lines and a marker between)."""
    if i + 1 >= len(page) or page[i + 1].lang != "text":
        return None
    nxt = page[i + 1]
    if _MARK.sub("", nxt.gap).strip():
        return None  # prose between: the text block belongs to something else
    return None if nxt.mark == ("output", "not checked") else nxt.source


def _page_id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


SKIPPED = [
    pytest.param(b.mark[1], id=f"{_page_id(p)}:{b.line}")
    for p in PAGES
    for b in blocks(p.read_text(encoding="utf-8"))
    if b.lang == "python" and b.mark and b.mark[0] == "skip"
]


def _check(want: str, got: str, where: str) -> None:
    checker = doctest.OutputChecker()
    want, got = want.rstrip() + "\n", "\n".join(s.rstrip() for s in got.rstrip().splitlines()) + "\n"
    if not checker.check_output(want, got, doctest.ELLIPSIS):
        raise AssertionError(f"{where}: printed output differs from the page's text block\n{got}")


CODE_PAGES = [p for p in PAGES if any(b.lang == "python" for b in blocks(p.read_text(encoding="utf-8")))]


@pytest.mark.parametrize("page", CODE_PAGES, ids=_page_id)
def test_the_python_blocks_of_a_page_run(page: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    page_blocks = blocks(page.read_text(encoding="utf-8"))
    namespace: dict = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for i, block in enumerate(page_blocks):
        if block.lang != "python" or (block.mark and block.mark[0] == "skip"):
            continue
        where = f"{_page_id(page)}:{block.line}"
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            exec(compile(block.source, where, "exec"), namespace)
        want = expected_output(page_blocks, i)
        if want is not None:
            _check(want, stdout.getvalue(), where)


if SKIPPED:  # one skipped test per marked block, so the report lists each with its reason

    @pytest.mark.parametrize("reason", SKIPPED)
    def test_a_block_marked_skip_says_why(reason: str) -> None:
        pytest.skip(reason)


def test_the_block_parser_reads_markers_and_outputs() -> None:
    page = (
        "<!-- skip: needs a CUDA GPU -->\n```python\nimport cuda_thing\n```\n\n"
        "```python\nprint('hi')\n```\n\n```text\nhi\n```\n\n"
        "```python\nprint(1)\n```\n<!-- output: not checked -->\n```text\n2\n```\n"
        "```bash\nmake test\n```\n"
    )
    got = blocks(page)
    assert [(b.lang, b.mark) for b in got] == [
        ("python", ("skip", "needs a CUDA GPU")),
        ("python", None),
        ("text", None),
        ("python", None),
        ("text", ("output", "not checked")),
        ("bash", None),
    ]
    assert expected_output(got, 1) == "hi\n" and expected_output(got, 3) is None
    _check("a ... z", "a b c z\n", "here")
    with pytest.raises(AssertionError, match="differs"):
        _check("a\n", "b\n", "here")
