"""Every command of README.md and docs/*.md runs as written, and the output a page quotes is
what it prints (`make test-docs`; tests/test_readme.py composes them in `make test`).

A page is run as a reader would run it: its ```bash blocks in order, each as one bash script
(`set -e`), in a scratch folder of its own (also $HOME), so that a block may use what an
earlier block made. A ```text block right after a ```bash block is that block's output: each
of its lines must be found in the output, in order, other lines between them allowed; a number
stands for any number (a loss differs from one CPU to another), `…` for any text and a run of
spaces for any (a table's columns).
`outputs/DAY/TIME` and `outputs/multirun/DAY/TIME` are the newest training run and sweep the
page made.

Directives, HTML comments that a rendered page hides, on the lines before a ```bash block:
  <!-- test: add OVERRIDES -->   appended to each `-m app` command (a shorter training)
  <!-- test: exit N -->          the block's expected exit status (default 0)
  <!-- test: skip REASON -->     not run here (REASON: what this machine lacks); still composed
  <!-- test: checkout -->        run in the repository (a developer's command), not a scratch folder
`<!-- test-page: add OVERRIDES -->` anywhere applies to every block of the page. `make`
commands are not run (CI runs `make test`, `make test-slow` and this).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"((?:<!-- test: .*? -->\n)*)```bash\n(.*?)```\n(?:\n?```text\n(.*?)```)?",
                   re.S)
# A `-m app` command: its arguments, then what is the shell's (`&`, `> log`, `||`, a comment).
APP = re.compile(r"^([^#\n]*?-m app)(?=[ \t]|$)(?:[ \t]+([^#\s&|;<>][^#\n&|;<>]*?))?"
                 r"([ \t]*(?:[&|;<>]|\d>|#[ \t]).*)?$", re.M)
NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*(?:e[+-]?\d+)?")


@dataclass
class Block:
    script: str
    expected: list[str] = field(default_factory=list)
    add: str = ""
    exit: int = 0
    skip: str | None = None
    checkout: bool = False


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    page_add = " ".join(re.findall(r"<!-- test-page: add (.*?) -->", text))
    found = []
    for directives, script, expected in BLOCK.findall(text):
        block = Block(script.replace("\\\n", " "), [
            line.strip() for line in (expected or "").splitlines()
            if line.strip() and line.strip() not in ("...", "…")], page_add)
        for key, value in re.findall(r"<!-- test: (\w+) ?(.*?) -->", directives):
            if key == "add":
                block.add = f"{block.add} {value}".strip()
            elif key == "exit":
                block.exit = int(value)
            elif key == "skip":
                block.skip = value
            elif key == "checkout":
                block.checkout = True
            else:
                raise AssertionError(f"{page.name}: unknown directive `test: {key}`")
        found.append(block)
    return found


def _pattern(line: str) -> re.Pattern:
    """A quoted output line as a pattern: numbers stand for any number, `…` for any text, a
run of spaces for any."""
    parts = []
    for piece in re.split(r"(…|" + NUMBER.pattern + ")", line):
        if piece == "…":
            parts.append(".*")
        elif piece and NUMBER.fullmatch(piece):
            parts.append(NUMBER.pattern)
        elif piece:  # (a table's columns are as wide as their widest cell: any spaces)
            parts.append(r"\s+".join(re.escape(word) for word in re.split(r"\s+", piece)))
    return re.compile("".join(parts))


def missing_lines(expected: list[str], output: str) -> list[str]:
    """The expected lines not found in the output in their order (the first and after it)."""
    lines, at = output.splitlines(), 0
    for i, line in enumerate(expected):
        pattern = _pattern(line)
        at = next((j + 1 for j in range(at, len(lines)) if pattern.search(lines[j])), None)
        if at is None:
            return expected[i:]
    return []


# Defined before each block: the newest training run (one with checkpoints: not an
# evaluation's) or sweep under a folder, when the command that names it runs.
NEWEST = """newest() {
python -c 'import sys, pathlib
runs = [p for p in pathlib.Path(sys.argv[1]).glob("*/*")
        if (p / "checkpoints").is_dir() or (p / "multirun.yaml").is_file()]
print(max(runs, key=lambda p: p.stat().st_mtime) if runs else
      sys.exit(f"{sys.argv[1]}/DAY/TIME: no earlier block of the page made one"))' "$1"
}
"""


def _added(command: re.Match, add: str) -> str:
    """The `-m app` command with `add` after its arguments, before the shell's part."""
    shell = command[3] or ""
    shell = shell if shell[:1] in ("", " ", "\t") else f" {shell}"
    return f"{command[1]}{f' {command[2]}' if command[2] else ''} {add}{shell}"


def prepared(block: Block) -> str:
    """The block's script as run here: its overrides added, its run directories filled in."""
    script = block.script
    if block.add:
        script = APP.sub(lambda m: _added(m, block.add), script)
    script = script.replace("outputs/multirun/DAY/TIME", "$(newest outputs/multirun)")
    return script.replace("outputs/DAY/TIME", "$(newest outputs)")


def run_page(page: Path, scratch: Path) -> list[str]:
    """Run the page's blocks in order; the reasons of the blocks not run."""
    skipped = []
    env = {**os.environ, "HOME": str(scratch)}
    env.pop("PYTHONPATH", None)  # (as a user has it: the installed app only)
    for number, block in enumerate(blocks(page), 1):
        if block.skip is not None:
            skipped.append(f"block {number}: {block.skip}")
            continue
        script = "\n".join(line for line in prepared(block).splitlines()
                            if not re.match(r"\s*make\s", line))
        done = subprocess.run(["bash", "-ec", NEWEST + script], text=True, env=env,
                              cwd=REPO if block.checkout else scratch,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
        where = f"{page.relative_to(REPO)}, block {number}:\n{script}\n--- output:\n"
        assert done.returncode == block.exit, \
            f"{where}{done.stdout[-4000:]}\n--- exit {done.returncode}, not {block.exit}"
        missing = missing_lines(block.expected, done.stdout)
        assert not missing, f"{where}{done.stdout[-4000:]}\n--- not printed: {missing[0]!r}"
    return skipped


@pytest.mark.docs
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_page_runs_as_written(page: Path, tmp_path: Path) -> None:
    skipped = run_page(page, tmp_path)
    if skipped:
        print(f"{page.name}: not run here: " + "; ".join(skipped))


# The driver itself (in `make test`).

def test_quoted_output_matches_in_order_with_any_numbers() -> None:
    output = ("[2026-12-07 05:02:03,522][app.training.loop][INFO] - step 20/22: loss 1.74\n"
              "[2026-12-07 05:02:03,600][app][INFO] - done: step 22, best val/acc 0.7409\n")
    assert missing_lines(["step 10/44: loss 2.1", "done: step 440, best val/acc 0.99"],
                         output) == []
    assert missing_lines(["done: … val/acc 0.9"], output) == []
    assert missing_lines(["done:   step 22,  best"], output) == []
    assert missing_lines(["done: step 22", "step 20/22"], output) == ["step 20/22"]  # order
    assert missing_lines(["done: step 22, best val/loss 0.1"], output) == \
        ["done: step 22, best val/loss 0.1"]  # words are exact


def test_a_page_is_read_into_blocks_with_their_directives(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- test-page: add trainer.max_epochs=1 -->\n# A page\n\n"
                    "<!-- test: exit 2 -->\n```bash\npython -m app nope=1   # a typo\n```\n\n"
                    "```text\nnope: did you mean …?\n...\n```\n\n"
                    "<!-- test: skip needs two machines -->\n```bash\npython -m app \\\n"
                    "  nodes=2\n```\n<!-- test: checkout -->\n```bash\nmake lint\n```\n")
    first, second, third = blocks(page)
    assert (first.checkout, second.checkout, third.checkout) == (False, False, True)
    assert prepared(Block("python -m app\nls\n", add="a=1")) == "python -m app a=1\nls\n"
    assert prepared(Block("torchrun -m app  # two\npython -m app.report x\n", add="a=1")) == \
        "torchrun -m app a=1  # two\npython -m app.report x\n"
    assert prepared(Block("python -m app b=2 > log 2>&1 &\npython -m app x || echo no\n",
                          add="a=1")) == \
        "python -m app b=2 a=1 > log 2>&1 &\npython -m app x a=1 || echo no\n"
    assert (first.exit, first.expected, first.skip) == (2, ["nope: did you mean …?"], None)
    assert prepared(first) == \
        "python -m app nope=1 trainer.max_epochs=1   # a typo\n"
    assert second.skip == "needs two machines" and second.expected == []
    assert prepared(second).split() == \
        ["python", "-m", "app", "nodes=2", "trainer.max_epochs=1"]
    # A run directory is the newest training run when the command runs (an evaluation's is not).
    for name in ("05-02-03", "05-02-04"):
        (tmp_path / "outputs" / "2026-12-07" / name / ".hydra").mkdir(parents=True)
        os.utime(tmp_path / "outputs" / "2026-12-07" / name, (0, 1000 + int(name[-1])))
    (tmp_path / "outputs" / "2026-12-07" / "05-02-03" / "checkpoints").mkdir()
    script = NEWEST + prepared(Block("echo run=outputs/DAY/TIME/checkpoints\n"))
    done = subprocess.run(["bash", "-ec", script], cwd=tmp_path, capture_output=True, text=True)
    assert done.stdout == "run=outputs/2026-12-07/05-02-03/checkpoints\n"  # (as a reader types it)
