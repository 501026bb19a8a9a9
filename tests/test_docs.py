"""Every ```python block of README.md and docs/*.md runs as written on a CPU.

Convention (for whoever writes docs):

* Each ```python block is one pytest item, named after its file and the line of its opening
  fence (``docs/guide.md:42``), so a failure names the block.
* The blocks of one file run in order, in one namespace: a block may use what an earlier block
  of the same file defined (a model, a tensor). Keep sizes small: the whole file runs in CI.
  README.md is the exception: readers copy its blocks one at a time, so each runs alone, in a
  namespace of its own (``SELF_CONTAINED``).
* A block that cannot run on a CPU in one process is marked by an HTML comment on the line
  directly above its opening fence, which GitHub does not render, with the reason:

      <!-- skip: multi-process (torchrun, a DeviceMesh over several ranks) -->
      ```python
      ...

  The reason is shown by ``pytest -rs``. Honest reasons only: GPU-only, multi-process, needs a
  download. Anything a CPU can run, runs.
* Blocks in other languages (```bash, ```text, a bare ```) are not run.

Each block runs in a fresh temporary working directory (files it writes land there), with
warnings as errors like the rest of the suite.
"""

from __future__ import annotations

import pathlib
import re
import sys
import types
from dataclasses import dataclass

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"^<!--\s*skip:\s*(?P<reason>\S.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```")


@dataclass(frozen=True)
class Block:
    path: str      # relative to the repository root
    line: int      # 1-based line of the opening fence
    source: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def parse(path: pathlib.Path) -> list[Block]:
    """The ```python blocks of a markdown file, with their skip reasons."""
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang = lines[i][m.end():].strip()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        if lang == "python":
            prev = lines[i - 1].strip() if i else ""
            skip = SKIP.match(prev)
            body = [ln[len(m["indent"]):] for ln in lines[i + 1:end]]
            blocks.append(Block(rel, i + 1, "\n".join(body) + "\n", skip["reason"] if skip else None))
        i = end + 1
    return blocks


BLOCKS = [b for path in DOCS for b in parse(path)]
SELF_CONTAINED = {"README.md"}  # files whose blocks each run alone, from their own imports
_NAMESPACES: dict[str, types.ModuleType] = {}   # file -> the module whose namespace its blocks share
_RAN: dict[str, set[int]] = {}      # file -> lines of the blocks that ran without error


def _run(block: Block, ns: dict) -> None:
    # Leading newlines put the block at its own line numbers in tracebacks.
    code = compile("\n" * block.line + block.source, block.id, "exec")
    exec(code, ns)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block_runs(block: Block, tmp_path, monkeypatch):
    if block.skip:
        pytest.skip(f"{block.id}: {block.skip}")
    monkeypatch.chdir(tmp_path)
    if block.path in SELF_CONTAINED:
        torch.manual_seed(0)
        module = types.ModuleType("__docs__")
        monkeypatch.setitem(sys.modules, "__docs__", module)
        _run_reporting(block, module.__dict__)
        return
    if block.path not in _NAMESPACES:
        torch.manual_seed(0)
        # a real module: torch.compile looks up the module of the functions it traces
        _NAMESPACES[block.path] = types.ModuleType("__docs__")
        _RAN[block.path] = set()
    monkeypatch.setitem(sys.modules, "__docs__", _NAMESPACES[block.path])
    ns = _NAMESPACES[block.path].__dict__
    # Run any earlier block of the file that has not run yet (the test was selected with -k).
    for earlier in BLOCKS:
        if earlier.path == block.path and earlier.line < block.line and not earlier.skip:
            if earlier.line not in _RAN[block.path]:
                try:
                    _run(earlier, ns)
                except Exception as e:  # the earlier block's own item reports it
                    pytest.skip(f"needs {earlier.id}, which failed: {type(e).__name__}: {e}")
                _RAN[block.path].add(earlier.line)
    _run_reporting(block, ns)
    _RAN[block.path].add(block.line)


def _run_reporting(block: Block, ns: dict) -> None:
    try:
        _run(block, ns)
    except Exception as e:
        alone = " alone, from its own imports," if block.path in SELF_CONTAINED else ""
        raise AssertionError(f"the Python block at {block.id} raised {type(e).__name__}: {e}. Make it run{alone} "
                             f"on a CPU as written, or mark it '<!-- skip: reason -->' (see tests/test_docs.py)") from e


def test_skip_markers_sit_on_python_blocks():
    """A skip marker anywhere but directly above a ```python fence would silently do nothing."""
    misplaced = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith("<!-- skip"):
                nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
                if not SKIP.match(line.strip()) or nxt != "```python":
                    misplaced.append(f"{path.relative_to(ROOT)}:{i + 1}")
    assert not misplaced, (f"skip markers not of the form '<!-- skip: reason -->' directly above a "
                           f"```python fence: {misplaced}")


def test_the_docs_have_python_blocks():
    assert len(BLOCKS) >= 10, [b.id for b in BLOCKS]
