"""Every ```python block of README.md and docs/*.md runs as written; the README's quick start is
what the CI runs; the install requirements admit what torch's own wheels bring.

A page's blocks run in order in one namespace (a reader goes top to bottom), each in a fresh
temporary working directory. A block may be marked on the line before its fence:

- ``<!-- snippet: skip REASON -->``: not run (the reason is in the test id);
- ``<!-- snippet: needs cuda -->``: run only where a CUDA GPU is available.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"<!--\s*snippet:\s*(skip|needs cuda)\s*(.*?)\s*-->")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    code: str
    mark: str | None  # "skip", "needs cuda" or None
    reason: str

    @property
    def id(self) -> str:
        name = f"{self.page.relative_to(ROOT)}:{self.line}"
        if self.mark == "skip":
            return f"{name}[skip: {self.reason}]"
        return f"{name}[needs cuda]" if self.mark else name


def blocks(page: Path, language: str = "python") -> list[Block]:
    """The fenced blocks of ``language`` in ``page``, with the mark on the line before each."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].strip() == f"```{language}":
            start = i
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            mark = MARK.search(lines[start - 1]) if start else None
            found.append(
                Block(
                    page,
                    start + 1,
                    "\n".join(body) + "\n",
                    mark.group(1) if mark else None,
                    mark.group(2) if mark else "",
                )
            )
        i += 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]


def test_the_docs_have_snippets_and_few_skips():
    assert len(ALL) >= 8
    assert sum(b.mark == "skip" for b in ALL) <= 2
    for page in PAGES:  # a mark not followed by a block is a typo
        text = page.read_text()
        for m in MARK.finditer(text):
            after = text[m.end() :].lstrip("\n")
            assert after.startswith("```python"), f"{page.name}: {m.group(0)} before no block"


@pytest.mark.parametrize("block", ALL, ids=[b.id for b in ALL])
def test_snippet_runs_as_written(block, tmp_path, monkeypatch):
    if block.mark == "skip":
        pytest.skip(block.reason)
    if block.mark == "needs cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace: dict = {"__name__": "__snippet__"}
    page = blocks(block.page)
    for earlier in page[: page.index(block)]:  # the page's blocks before this one, in order
        if earlier.mark is None:
            exec(compile(earlier.code, f"{earlier.id}", "exec"), namespace)  # noqa: S102
    exec(compile(block.code, block.id, "exec"), namespace)  # noqa: S102


def _quick_start() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start") :]
    body = section[section.index("```bash\n") + len("```bash\n") :]
    return body[: body.index("```")].strip().splitlines()


def test_ci_runs_the_readme_quick_start_as_written():
    commands = _quick_start()
    # two commands: install (the torch wheel pinned in the same resolution as the project, so
    # nothing resolves a different one) and run the demo; then the tests
    assert len(commands) == 2
    assert 'pip install torch==2.13.0 -e ".[test]"' in commands[0]
    assert commands[0].endswith("moerunner demo")
    assert commands[-1].endswith("-m pytest -n 2 -q tests")
    ci = (ROOT / ".ci" / "run").read_text()
    extract = re.search(r'commands="\$\((awk .*README\.md)\)"', ci)
    assert extract, ".ci/run no longer reads the quick start from README.md"
    ran = subprocess.run(
        ["bash", "-c", extract.group(1)], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert ran.stdout.strip().splitlines() == commands
    assert 'bash -euxo pipefail -c "$commands"' in ci


def _extra(name: str) -> list[str]:
    text = re.sub(r"#.*", "", (ROOT / "pyproject.toml").read_text())  # comments out
    body = re.search(rf"^{name} = \[(.*?)\]", text, re.S | re.M).group(1)
    return re.findall(r'"([^"]+)"', body)


def _admits(requirements: list[str], package: str, version: str) -> bool:
    from packaging.requirements import Requirement

    for text in requirements:
        req = Requirement(text)
        if req.name == package:
            return req.specifier.contains(version, prereleases=True)
    raise AssertionError(f"{package} is not required")


def test_extras_admit_what_torch_brings_and_carry_their_documented_needs():
    # torch 2.13.0's Linux wheel requires triton==3.7.1, torch 2.11's 3.6.0; triton 3.9 removed
    # tl.make_block_ptr and the range's top is the newest version tested
    for extra in ("test", "triton"):
        assert _admits(_extra(extra), "triton", "3.6.0"), extra
        assert _admits(_extra(extra), "triton", "3.7.1"), extra
        assert not _admits(_extra(extra), "triton", "3.9.0"), extra
    # device_map= (docs/transformers.md, examples/generate.py --model) needs accelerate
    assert "device_map=" in (ROOT / "docs" / "transformers.md").read_text()
    for extra in ("hf", "test"):
        assert any(r.startswith("accelerate") for r in _extra(extra)), extra
    assert any(r.startswith("matplotlib") for r in _extra("bench"))  # bench --png


CUDA_LOADS = [
    b for b in ALL if b.mark == "needs cuda" and re.search(r"from_pretrained\(\s*path\b", b.code)
]


@pytest.mark.parametrize("block", CUDA_LOADS, ids=[b.id for b in CUDA_LOADS])
def test_cuda_snippet_finds_the_checkpoint_folder_the_page_made(block, tmp_path, monkeypatch):
    # Off the GPU too: the blocks before a GPU-only block that loads ``path`` must leave
    # ``path`` naming the tiny checkpoint folder (an earlier block once rebound it to a
    # safetensors file, and from_pretrained failed on it before reaching CUDA).
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace: dict = {"__name__": "__snippet__"}
    page = blocks(block.page)
    for earlier in page[: page.index(block)]:
        if earlier.mark is None:
            exec(compile(earlier.code, f"{earlier.id}", "exec"), namespace)  # noqa: S102
    folder = Path(namespace["path"])
    assert (folder / "config.json").is_file(), f"{block.id}: path is {folder}"
