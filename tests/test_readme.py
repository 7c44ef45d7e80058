"""Every code block in README.md and docs/*.md runs as written and prints what it says; every link resolves.

How the blocks are treated (also said in docs/testing.md):

- a fenced ```` ```python ```` block runs in a fresh Python process, a ```` ```bash ```` (or ``sh``) block
  in ``bash -e`` with the ``wsync`` command on PATH; each must exit 0. Background jobs a bash block
  leaves running are stopped when it ends.
- a comment ``# -> TEXT`` on a line of a run block says what that line prints: the block's standard
  output must have, in the order of those comments, a line that contains TEXT, where ``...`` in TEXT
  stands for anything. A second comment after two spaces (``# -> True  # why``) is not part of TEXT.
- a ```` ```text ```` fence (or json, yaml, toml, diff) is output or a listing: not run;
- a block right after the line ``<!-- readme-test: skip (reason) -->`` is not run (say why in the
  parentheses: it installs packages, runs the suite itself, ...);
- a fence without a language, or an indented code block, fails the check: say which of the above it is.

Blocks run one by one in their own processes, in a temporary working folder with a fresh system temp
folder (``TMPDIR``: what an earlier run left there does not change what a block prints), page by page
(README.md first), in each page's order. The pages' relative links, and the repository files and tests
they name in backticks, must exist.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
PAGES = [README, *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]
README_MAX_LINES = 250  # the front door (issue 34); each topic has its page in docs/

RUN = {"python": [sys.executable, "-"], "bash": ["bash", "-e", "-s"], "sh": ["bash", "-e", "-s"]}
NOT_RUN = {"text", "json", "yaml", "toml", "diff"}
SKIP_MARKER = re.compile(r"^<!--\s*readme-test:\s*skip\s*\((?P<why>[^)]+)\)\s*-->\s*$")
PRINTS = re.compile(r"(?:^|\s)#\s->\s(?P<text>.*)$")
# A bash block's background jobs (a server, a watcher) must not outlive it.
BASH_PROLOGUE = "trap 'kill $(jobs -p) 2>/dev/null || true; wait' EXIT\n"


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # the marker's reason, when marked
    page: str = "README.md"

    def prints(self) -> list[tuple[int, str]]:
        """(line in the page, TEXT) of each ``# -> TEXT`` comment, in order."""
        found = []
        for n, line in enumerate(self.code.splitlines(), start=self.line + 1):
            m = PRINTS.search(line)
            if m:
                found.append((n, re.split(r"\s{2,}#\s", m["text"].strip(), maxsplit=1)[0].rstrip()))
        return found


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """The fenced blocks of ``text``, in order. Raises AssertionError on a block the rules above do not cover."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^(```+)\s*(\S*)\s*$", line)
        if fence is None:
            if line.startswith("    ") and i > 0 and not lines[i - 1].strip() and _outside_list(lines, i):
                raise AssertionError(f"{page} line {i + 1} is an indented code block; fence it as ```bash, "
                                     f"```python or ```text (see tests/test_readme.py)")
            i += 1
            continue
        ticks, lang = fence.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks), None)
        assert end is not None, f"{page} line {i + 1}: the fence is never closed"
        assert lang, (f"{page} line {i + 1}: a fence without a language; use ```python or ```bash (run), "
                      f"```text (not run), or mark it with <!-- readme-test: skip (reason) -->")
        assert lang in RUN or lang in NOT_RUN, f"{page} line {i + 1}: unknown fence language {lang!r}"
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = SKIP_MARKER.match(before.strip())
        blocks.append(Block(i + 1, lang, "\n".join(lines[i + 1:end]) + "\n", marker and marker["why"], page))
        i = end + 1
    return blocks


def check_prints(block: Block, stdout: str) -> None:
    """Raises AssertionError unless ``stdout`` has, in order, a line containing each ``# -> TEXT`` of ``block``."""
    out = stdout.splitlines()
    at = 0
    for line, text in block.prints():
        pattern = re.compile(".*?".join(re.escape(piece) for piece in text.split("...")))
        hit = next((k for k in range(at, len(out)) if pattern.search(out[k])), None)
        where = f"after output line {at} (the previous `# ->`'s)" if at else "of the block's output"
        assert hit is not None, (f"{block.page} line {line} says it prints {text!r}, but no line {where} contains "
                                 f"it; the output:\n" + "\n".join(out[-60:]))
        at = hit + 1


def _outside_list(lines: list[str], i: int) -> bool:
    """False when line ``i`` continues a list item (indented text under ``- item`` or ``1. item``)."""
    for j in range(i - 1, -1, -1):
        if lines[j].strip() and not lines[j].startswith(" "):
            return not re.match(r"^(\s*[-*+]|\s*\d+\.)\s", lines[j])
    return True


def _page_blocks() -> list[Block]:
    blocks = []
    for path in PAGES:
        with open(path) as f:
            blocks += readme_blocks(f.read(), os.path.relpath(path, REPO))
    return blocks


def _runnable() -> list:
    return [pytest.param(b, id=f"{b.page}:{b.line}-{b.lang}") for b in _page_blocks()
            if b.lang in RUN and b.skip is None]


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


def test_a_block_must_print_what_its_comments_say():
    block = readme_blocks("```python\nprint({'a': '7'})  # -> {...: '7'}\nprint(True)  # -> True  # why\n```\n")[0]
    assert block.prints() == [(2, "{...: '7'}"), (3, "True")]
    check_prints(block, "log line\n{'http://127.0.0.1:4': '7'}\nTrue\n")
    with pytest.raises(AssertionError, match=r"line 2 says it prints \"\{...: '7'\}\""):
        check_prints(block, "{'http://127.0.0.1:4': '4'}\nTrue\n")
    with pytest.raises(AssertionError, match="line 3 says it prints 'True'"):  # in order: not before line 2's
        check_prints(block, "True\n{'a': '7'}\n")
    assert readme_blocks("```bash\ncurl -s x/model_info   # -> \"weight_version\":\"4\"\n```\n")[0].prints() == [
        (2, '"weight_version":"4"')]


def test_every_link_and_named_file_exists():
    """The pages' relative links, the repository paths in backticks, and the tests they name, all exist."""
    tests = set()
    for path in glob.glob(os.path.join(REPO, "tests", "**", "*.py"), recursive=True):
        with open(path) as f:
            tests |= set(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", f.read(), flags=re.M))
        tests.add(os.path.basename(path)[:-3])
    missing = []
    for path in PAGES:
        with open(path) as f:
            text = f.read()
        page = os.path.relpath(path, REPO)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            file, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if not os.path.exists(file):
                missing.append(f"{page}: link {target}")
            elif anchor and anchor not in _anchors(file):
                missing.append(f"{page}: link {target} (no such heading)")
        for named in re.findall(r"`([\w.-]+(?:/[\w.-]+)+\.(?:py|sh|md|json|png|toml))`", text):
            if not os.path.exists(os.path.join(REPO, named)):
                missing.append(f"{page}: file `{named}`")
        for name in re.findall(r"`(test_\w+)`", text):
            if name not in tests:
                missing.append(f"{page}: test `{name}`")
    assert not missing, "not found:\n" + "\n".join(missing)


def _anchors(path: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown page."""
    with open(path) as f:
        headings = re.findall(r"^#+\s+(.*?)\s*$", f.read(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_the_readme_is_a_front_door():
    with open(README) as f:
        lines = f.read().splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: put the "
                                            f"topic on its page in docs/ and link it")
    for path in PAGES:  # the current facts only; how a number changed belongs in the commit messages
        with open(path) as f:
            dated = [n for n, line in enumerate(f, 1) if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
        assert not dated, f"{os.path.relpath(path, REPO)} lines {dated} carry dates"


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` (a block's shell, what it started in the background, and their ranks)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def _run_bounded(cmd: list[str], code: str, *, cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run ``code`` on ``cmd``'s stdin in a session of its own. Past ``timeout``, every process of the session prints
    its threads' stacks (``wsync`` commands dump them on SIGUSR1) and is killed, and the test fails with their
    output: a block that hangs says where, and leaves nothing running."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(code, timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in _session(proc.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(3)
        for pid in _session(proc.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"still running after {timeout:g} s; the stacks of its processes are at the end:\n"
                    f"{stdout[-3000:]}\n{stderr[-12000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.slow
@pytest.mark.parametrize("block", _runnable())
def test_readme_block_runs_as_written(block: Block, tmp_path):
    code = BASH_PROLOGUE + block.code if block.lang != "python" else block.code
    # A temporary folder of its own, as on a fresh machine: the default name resolution and snapshot folders
    # live there, so what an earlier run announced does not change the versions a block prints. Short, for
    # the Unix sockets made under it.
    temp = tempfile.mkdtemp(prefix="wsync-readme-")
    # Run where its files go, as from the checkout: the scripts a block names (examples/) are there.
    os.symlink(os.path.join(REPO, "examples"), tmp_path / "examples")
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
           "TMPDIR": temp}
    try:
        out = _run_bounded(RUN[block.lang], code, cwd=tmp_path, env=env, timeout=400)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert out.returncode == 0, (f"{block.page} block at line {block.line} ({block.lang}) exited {out.returncode}:\n"
                                 f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    check_prints(block, out.stdout)
