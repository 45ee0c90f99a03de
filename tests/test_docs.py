"""README.md and ARCHITECTURE.md stay true to the repository a user clones.

- No development history in them: no "session N", no commit hashes.
- No link outside the repository: no ``../`` path, no web link but the index of PyTorch's
  CPU wheels (a command the README gives).
- Every repository path they name exists (in backticks, in markdown links, and the repo
  paths of their commands), and every ``file.py:Name.attr`` names what the file defines.
- The README's quick start is exactly two commands, and its test command is the one CI
  runs (``.ci/run``).
- Its Python snippets run as written (one whose first line is a ``# torchrun ...`` comment
  under torchrun with 2 processes).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "ARCHITECTURE.md")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TOP_DIRS = ("ep_moe/", "launch/", "benchmarks/", "configs/", "tests/", "examples/", ".ci/")

SESSION = re.compile(r"\bsessions?\s+\d", re.IGNORECASE)
# 7 to 40 hex digits with at least one letter and one digit: a commit, not a number or a word
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
WEB_LINK = re.compile(r"https?://[^\s)`'\"<>]+")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")


def _text(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def _lines_matching(text: str, pattern: re.Pattern) -> list[str]:
    return [f"line {i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1) if pattern.search(line)]


def _is_repo_path(token: str) -> bool:
    """A path a reader would open: ``dir/file.ext`` or ``dir/`` (no globs, placeholders, URLs)."""
    if "/" not in token or token.startswith(("~", "$", "/")) or not PATH.fullmatch(token):
        return False
    return token.endswith("/") or re.search(r"\.[A-Za-z]\w*$", token) is not None


def _named_paths(text: str) -> list[str]:
    """Paths named in inline code, markdown links and the repo paths inside fenced commands."""
    fenced = FENCE.findall(text)
    prose = FENCE.sub("", text)
    named = []
    for token in INLINE_CODE.findall(prose):
        path = token.split(":", 1)[0]
        if _is_repo_path(path):
            named.append(token)
    for target in MD_LINK.findall(prose):
        if "://" not in target and not target.startswith("#"):
            named.append(target.split("#", 1)[0])
    for block in fenced:
        for word in re.split(r"[\s\"'=]+", block):
            word = word.rstrip(",;)")
            if word.startswith(TOP_DIRS) and _is_repo_path(word.split(":", 1)[0]):
                named.append(word)
    return named


def _defines(source: str, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b|^\s*{re.escape(name)}\s*[:=]",
                     source, re.MULTILINE) is not None


@pytest.mark.parametrize("name", DOCS)
def test_no_link_outside_the_repository(name):
    text = _text(name)
    assert not _lines_matching(text, re.compile(re.escape("../"))), \
        f"{name} names a path outside the repository (a clone has nothing there)"
    foreign = sorted({link for link in WEB_LINK.findall(text) if link != TORCH_CPU_INDEX})
    assert not foreign, f"{name} links outside the repository: {foreign}; only {TORCH_CPU_INDEX} may appear"


@pytest.mark.parametrize("name", DOCS)
def test_no_development_history(name):
    text = _text(name)
    sessions = _lines_matching(text, SESSION)
    assert not sessions, f"{name} names development sessions (history goes to benchmarks/PERFORMANCE_LOG.md): " \
                         f"{sessions}"
    commits = _lines_matching(text, COMMIT)
    assert not commits, f"{name} names commit-like hashes: {commits}"


@pytest.mark.parametrize("name", DOCS)
def test_named_paths_exist(name):
    missing, undefined = [], []
    for token in _named_paths(_text(name)):
        path, _, qualname = token.partition(":")
        if not (ROOT / path).exists():
            missing.append(token)
        elif qualname and path.endswith(".py"):
            source = (ROOT / path).read_text(encoding="utf-8")
            names = re.findall(r"[A-Za-z_]\w*", qualname.split("(")[0])
            undefined += [f"{token} ({n})" for n in names if not _defines(source, n)]
    assert not missing, f"{name} names paths that do not exist in the repository: {missing}"
    assert not undefined, f"{name} names functions or classes their file does not define: {undefined}"


def test_architecture_names_file_and_function_in_its_data_flow():
    text = _text("ARCHITECTURE.md")
    steps = [line for line in text.splitlines() if re.match(r"\d+\. ", line)]
    assert len(steps) >= 20
    bare = [step for step in steps if not re.search(r"`[\w./-]+\.py:\w", step)]
    assert not bare, f"data-flow steps that name no file:function: {bare}"


def _quick_start_commands() -> list[str]:
    text = _text("README.md")
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert section, "README.md has no '## Quick start' section"
    block = FENCE.search(section.group(1))
    assert block, "the quick start has no fenced block of commands"
    return [line.strip() for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_quick_start_is_two_commands():
    commands = _quick_start_commands()
    assert len(commands) == 2, f"the quick start must be exactly two commands, got {commands}"
    assert "torchrun --nproc-per-node 2 launch/train.py" in commands[0]
    assert "pytest" in commands[1]


def test_quick_start_test_command_is_what_ci_runs():
    test_command = _quick_start_commands()[1]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    assert test_command in ci, f"the README's test command {test_command!r} is not a line of .ci/run; " \
                               "keep them byte-identical"


def _python_snippets() -> list[str]:
    text = _text("README.md")
    return re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def _snippet_params():
    params = []
    for i, code in enumerate(_python_snippets()):
        under_torchrun = code.startswith("# torchrun")
        marks = [pytest.mark.distributed] if under_torchrun else []
        params.append(pytest.param(code, under_torchrun, id=f"snippet{i}", marks=marks))
    return params


def test_readme_has_python_snippets():
    assert len(_python_snippets()) >= 2


@pytest.mark.parametrize("code, under_torchrun", _snippet_params())
def test_readme_snippet_runs(code, under_torchrun, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    cmd = [sys.executable, str(script)]
    if under_torchrun:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"README snippet failed:\n{code}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
