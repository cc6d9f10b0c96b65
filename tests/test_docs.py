"""The README and docs/*.md: a short front door, links that resolve, and every code block run as its fence says.

The convention (docs/development.md, "The docs' code is tested"): the words after a fence's
language say what is done with the block. ```python: a complete program, run here as __main__;
```python fragment: compiled only; ```python pytest: a test file, run by pytest here;
```bash: commands run by bash from the repository root (whole processes: marked `processes`);
```LANG notest: REASON: never run, for the reason given; ```text: output, never run.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 200
# what a fence may say after its language; anything else fails test_every_fence_says_what_is_done_with_it
KINDS = {
    ("python", ""): "run",
    ("python", "fragment"): "compile",
    ("python", "pytest"): "pytest",
    ("bash", ""): "shell",
}
# a path of this repository in backticks: it must exist (stale paths after a move are the usual rot)
REPO_PATH = re.compile(r"`((?:accel|harness|tests|benchmarks|examples|docs)/[^`\s]*)`")
MODULE_NAME = re.compile(r"`(accel(?:\.\w+)+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page: where it opens, its fence's words after the language, its text."""

    page: Path
    line: int
    language: str
    words: str
    code: str

    @property
    def kind(self) -> str:
        """What the test does with it: run, compile, pytest, shell, show (notest, text) or unknown."""
        if self.words.startswith("notest:") and self.words[len("notest:") :].strip():
            return "show"
        if self.language == "text" and not self.words:
            return "show"
        return KINDS.get((self.language, self.words), "unknown")

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _split(page: Path) -> tuple[list[Block], list[str]]:
    """A page's fenced blocks, and its prose lines (the lines outside any block)."""
    blocks, prose = [], []
    lines = page.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = re.match(r"^(\s*)(`{3,})(.*)$", lines[index])
        if not opening:
            prose.append(lines[index])
            index += 1
            continue
        indent, fence, info = opening.groups()
        language, _, words = info.strip().partition(" ")
        body, index = [], index + 1
        start = index
        while index < len(lines) and lines[index].strip() != fence:
            body.append(lines[index][len(indent) :] if lines[index].startswith(indent) else lines[index])
            index += 1
        assert index < len(lines), f"{page.relative_to(ROOT)}:{start}: a code block is never closed"
        blocks.append(Block(page, start, language, words.strip(), "\n".join(body) + "\n"))
        index += 1
    return blocks, prose


BLOCKS = [block for page in PAGES for block in _split(page)[0]]


def _of_kind(kind: str) -> list:
    return [pytest.param(block, id=str(block)) for block in BLOCKS if block.kind == kind]


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """A page's heading anchors; a repeated heading gets -1, -2, ... as on GitHub."""
    anchors, seen = set(), dict[str, int]()
    for line in _split(page)[1]:
        heading = re.match(r"^#{1,6}\s+(.*)$", line)
        if heading:
            slug = _slug(heading.group(1))
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_the_readme_is_a_short_front_door_opening_with_make_demo_and_make_test():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines: move detail to a page of docs/"
    first_bash = next(block for block in BLOCKS if block.page == README and block.language == "bash")
    commands = [line.split("#")[0].strip() for line in first_bash.code.splitlines() if line.split("#")[0].strip()]
    assert commands == ["make demo", "make test"], f"{first_bash}: the README's first commands are {commands}"


def test_every_fence_says_what_is_done_with_it():
    unknown = [f"{block}: ```{block.language} {block.words}" for block in BLOCKS if block.kind == "unknown"]
    assert not unknown, "fences outside the convention of docs/development.md:\n" + "\n".join(unknown)


def test_relative_links_reach_a_file_and_a_heading():
    broken = []
    for page in PAGES:
        for target in LINK.findall("\n".join(_split(page)[1])):  # joined: a link's text may wrap
            if re.match(r"^[a-z]+:", target):  # https:, mailto: (not checked: no network here)
                continue
            path, _, anchor = target.partition("#")
            found = (page.parent / path).resolve() if path else page
            if not found.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and found.suffix == ".md" and anchor not in _anchors(found):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def _names_a_module_or_what_one_defines(name: str) -> bool:
    try:
        if importlib.util.find_spec(name) is not None:
            return True
    except (ImportError, ValueError):  # the parent is a module, not a package: `name` is what it defines
        pass
    parent, _, attribute = name.rpartition(".")
    spec = importlib.util.find_spec(parent)
    if spec is None or spec.origin is None:
        return False
    return re.search(rf"\b{re.escape(attribute)}\b", Path(spec.origin).read_text()) is not None


def test_paths_and_modules_named_in_backticks_exist():
    missing = []
    for page in PAGES:
        prose = "\n".join(_split(page)[1])
        # compat.md names Accelerate's own test files (`tests/fsdp/test_fsdp.py`), whose paths look like ours
        for path in REPO_PATH.findall(prose) if page.name != "compat.md" else ():
            if not glob.glob(str(ROOT / path)):
                missing.append(f"{page.relative_to(ROOT)}: {path}")
        for name in MODULE_NAME.findall(prose):
            if not _names_a_module_or_what_one_defines(name):
                missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert not missing, "named in the docs but not in the tree:\n" + "\n".join(missing)


@pytest.mark.parametrize("block", _of_kind("run"))
def test_python_block_runs(block, monkeypatch):
    monkeypatch.chdir(ROOT)
    # run as __main__, but not installed as sys.modules["__main__"] (runpy would): the block's functions
    # then cannot be pickled by reference to a module the ranks lack, and go to the ranks by value
    exec(compile(block.code, str(block), "exec"), {"__name__": "__main__", "__file__": str(block)})


def test_every_python_block_compiles():
    # fragments are only compiled; programs and test files compile here before they run below
    for block in BLOCKS:
        if block.language == "python" and block.kind != "show":
            compile(block.code, str(block), "exec")


@pytest.mark.parametrize("block", _of_kind("pytest"))
def test_python_test_file_passes(block, pytester):
    pytester.makepyfile(**{f"test_{block.page.stem}_{block.line}": block.code})
    # hypothesis' plugin re-imports hypothesis in every inner run: seconds for nothing here
    outcome = pytester.runpytest("-p", "no:hypothesispytest", "-q")
    counts = outcome.parseoutcomes()
    assert outcome.ret == 0 and counts.get("passed", 0) > 0, str(outcome.stdout)


def _shell_environment() -> dict[str, str]:
    """This environment with the venv's commands first, less what a launcher or pytest set for this process."""
    inherited = ("ACCEL_", "PYTEST_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_")
    env = {name: value for name, value in os.environ.items() if not name.startswith(inherited)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.processes
@pytest.mark.parametrize("block", _of_kind("shell"))
def test_bash_block_runs(block):
    done = subprocess.run(
        ["bash", "-e", "-c", block.code],
        cwd=ROOT,
        env=_shell_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{block} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
