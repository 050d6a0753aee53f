"""Every ```python block of the README and of the tutorial pages runs, so the examples cannot rot.

Each block is one test and runs in a fresh interpreter (``sys.executable``) in a temporary
working directory holding the files the page's earlier blocks define. A marker comment on the
line just above a block changes what happens to it:

* ``<!-- docs-test: skip -->`` — not run (kept rare: fragments that need a GPU or a vLLM engine);
* ``<!-- docs-test: file NAME.py -->`` — written to ``NAME.py`` in the page's directory (later
  blocks of the page import it), then imported once to prove it loads;
* ``<!-- docs-test: pytest NAME.py -->`` — written to ``NAME.py`` and run with pytest.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    "README.md",
    "docs/quickstart.md",
    "docs/kv_engine.md",
    "docs/hidden_states.md",
    "docs/encoder_cache.md",
    "docs/own_tier.md",
]
BLOCK_TIMEOUT_S = 300

_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|file|pytest)\s*([\w.]*)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    code: str
    action: str  # run, skip, file, pytest
    filename: str


def extract_blocks(page: str, text: str) -> list[Block]:
    """The ```python blocks of ``text`` in order, with the action their marker asks for."""
    blocks: list[Block] = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(before)
        action, filename = ("run", "") if marker is None else (marker.group(1), marker.group(2))
        if action in ("file", "pytest") and not filename.endswith(".py"):
            raise ValueError(f"{page}:{line}: docs-test {action} needs a NAME.py")
        blocks.append(Block(page, line, m.group(1), action, filename))
    return blocks


def _page_blocks() -> list[tuple[str, list[Block]]]:
    return [(p, extract_blocks(p, (ROOT / p).read_text(encoding="utf-8"))) for p in PAGES if (ROOT / p).is_file()]


def test_every_page_is_present_and_has_a_runnable_block() -> None:
    for page in PAGES:
        assert (ROOT / page).is_file(), page
    for page, blocks in _page_blocks():
        assert any(b.action != "skip" for b in blocks), f"{page} has no executed python block"


def test_skipped_blocks_stay_rare() -> None:
    blocks = [b for _, bs in _page_blocks() for b in bs]
    skipped = [f"{b.page}:{b.line}" for b in blocks if b.action == "skip"]
    assert len(skipped) * 5 <= len(blocks), f"too many skipped blocks: {skipped}"


def test_extract_blocks_reads_markers() -> None:
    text = "a\n```python\nx = 1\n```\n<!-- docs-test: skip -->\n```python\ny\n```\n"
    text += "<!-- docs-test: file mod.py -->\n```python\nz = 2\n```\n```bash\nls\n```\n"
    got = [(b.action, b.filename, b.code) for b in extract_blocks("t.md", text)]
    assert got == [("run", "", "x = 1\n"), ("skip", "", "y\n"), ("file", "mod.py", "z = 2\n")]


def _run(args: list[str], cwd: Path, what: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(cwd), env.get("PYTHONPATH", "")) if p)
    for var in [v for v in env if v.startswith("LMCACHE_")]:
        del env[var]  # the examples show the defaults, not this shell's settings
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, check=False)
    assert proc.returncode == 0, f"{what} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"


def _cases() -> list[tuple[str, int]]:
    return [(page, i) for page, blocks in _page_blocks() for i, b in enumerate(blocks) if b.action != "skip"]


@pytest.mark.parametrize(("page", "index"), _cases(), ids=[f"{p}#{i}" for p, i in _cases()])
def test_example_runs(page: str, index: int, tmp_path: Path) -> None:
    """Block ``index`` of ``page`` runs, after the files earlier blocks of the page define are written."""
    blocks = extract_blocks(page, (ROOT / page).read_text(encoding="utf-8"))
    for earlier in blocks[:index]:
        if earlier.action in ("file", "pytest"):
            (tmp_path / earlier.filename).write_text(earlier.code, encoding="utf-8")
    block = blocks[index]
    where = f"{page}:{block.line}"
    if block.action == "run":
        script = tmp_path / f"_block_{index}.py"
        script.write_text(block.code, encoding="utf-8")
        _run([sys.executable, str(script)], tmp_path, where)
        return
    target = tmp_path / block.filename
    target.write_text(block.code, encoding="utf-8")
    if block.action == "file":
        _run([sys.executable, "-c", f"import {target.stem}"], tmp_path, where)
    else:
        _run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "asyncio_mode=auto",
             "-o", "asyncio_default_fixture_loop_scope=function", str(target)],
            tmp_path,
            where,
        )  # fmt: skip
