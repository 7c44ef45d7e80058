"""Every code block in README.md runs as written.

How the README's blocks are treated (also said at the end of README.md):

- a fenced ```` ```python ```` block runs in a fresh Python process, a ```` ```bash ```` (or ``sh``) block
  in ``bash -e`` with the ``wsync`` command on PATH; each must exit 0. Background jobs a bash block
  leaves running are stopped when it ends.
- a ```` ```text ```` fence (or json, yaml, toml, diff) is output or a listing: not run;
- a block right after the line ``<!-- readme-test: skip (reason) -->`` is not run (say why in the
  parentheses: it installs packages, runs the suite itself, ...);
- a fence without a language, or an indented code block, fails the check: say which of the above it is.

Blocks run one by one in their own processes, in a temporary working folder, in the README's order.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")

RUN = {"python": [sys.executable, "-"], "bash": ["bash", "-e", "-s"], "sh": ["bash", "-e", "-s"]}
NOT_RUN = {"text", "json", "yaml", "toml", "diff"}
SKIP_MARKER = re.compile(r"^<!--\s*readme-test:\s*skip\s*\((?P<why>[^)]+)\)\s*-->\s*$")
# A bash block's background jobs (a server, a watcher) must not outlive it.
BASH_PROLOGUE = "trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\n"


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # the marker's reason, when marked


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks of ``text``, in order. Raises AssertionError on a block the rules above do not cover."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^(```+)\s*(\S*)\s*$", line)
        if fence is None:
            if line.startswith("    ") and i > 0 and not lines[i - 1].strip() and _outside_list(lines, i):
                raise AssertionError(f"README.md line {i + 1} is an indented code block; fence it as ```bash, "
                                     f"```python or ```text (see tests/test_readme.py)")
            i += 1
            continue
        ticks, lang = fence.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks), None)
        assert end is not None, f"README.md line {i + 1}: the fence is never closed"
        assert lang, (f"README.md line {i + 1}: a fence without a language; use ```python or ```bash (run), "
                      f"```text (not run), or mark it with <!-- readme-test: skip (reason) -->")
        assert lang in RUN or lang in NOT_RUN, f"README.md line {i + 1}: unknown fence language {lang!r}"
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = SKIP_MARKER.match(before.strip())
        blocks.append(Block(i + 1, lang, "\n".join(lines[i + 1:end]) + "\n", marker and marker["why"]))
        i = end + 1
    return blocks


def _outside_list(lines: list[str], i: int) -> bool:
    """False when line ``i`` continues a list item (indented text under ``- item`` or ``1. item``)."""
    for j in range(i - 1, -1, -1):
        if lines[j].strip() and not lines[j].startswith(" "):
            return not re.match(r"^(\s*[-*+]|\s*\d+\.)\s", lines[j])
    return True


def _runnable() -> list:
    with open(README) as f:
        blocks = readme_blocks(f.read())
    return [pytest.param(b, id=f"line{b.line}-{b.lang}") for b in blocks if b.lang in RUN and b.skip is None]


def test_the_rules_find_the_readme_blocks():
    text = ("Prose.\n\n```python\nprint(1)\n```\n\n<!-- readme-test: skip (installs) -->\n"
            "```bash\npip install x\n```\n\n```text\n$ out\n```\n\n- a list item\n\n    its continuation\n")
    got = [(b.line, b.lang, b.skip) for b in readme_blocks(text)]
    assert got == [(3, "python", None), (8, "bash", "installs"), (12, "text", None)]
    with pytest.raises(AssertionError, match="indented code block"):
        readme_blocks("Prose.\n\n    wsync demo\n")
    with pytest.raises(AssertionError, match="without a language"):
        readme_blocks("```\nx\n```\n")
    assert _runnable(), "README.md has no runnable block"


@pytest.mark.slow
@pytest.mark.parametrize("block", _runnable())
def test_readme_block_runs_as_written(block: Block, tmp_path):
    code = BASH_PROLOGUE + block.code if block.lang != "python" else block.code
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    out = subprocess.run(RUN[block.lang], input=code, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=400)
    assert out.returncode == 0, (f"README.md block at line {block.line} ({block.lang}) exited {out.returncode}:\n"
                                 f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
