"""Every ```python block of README.md and docs/*.md runs, so the docs cannot drift from the code.

Each block runs on its own in a fresh namespace (``exec``), after ``torch.manual_seed(0)``, with
its file's folder as the working directory's stand-in for relative paths. Blocks that need
torch.distributed call ``dist.init_process_group("gloo")`` as a torchrun script would: the test
sets the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and a free
MASTER_PORT) for a one-process job, so the collectives run for real. A block that leaves a
process group behind is cleaned up and fails the test. Code that cannot run on a CPU-only machine
is fenced as ```text or ```bash in the docs and is not executed here.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def _blocks() -> list:
    out = []
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 2  # first line of code
            rel = path.relative_to(ROOT).as_posix()
            out.append(pytest.param(rel, line, m.group(1), id=f"{rel}:{line}"))
    return out


BLOCKS = _blocks()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def torchrun_env(monkeypatch, tmp_path):
    """The environment torchrun gives a one-process job; a temp working directory."""
    for name, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "GLOO_SOCKET_IFNAME": "lo",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(
            "the example left a process group initialised: end it with dist.destroy_process_group()"
        )


def test_docs_have_python_examples():
    files = {b.values[0] for b in BLOCKS}
    assert "README.md" in files, "README.md lost its python examples"
    assert len(BLOCKS) >= 10, f"only {len(BLOCKS)} python blocks found in {DOC_FILES}"


@pytest.mark.parametrize("path,line,code", BLOCKS)
def test_doc_example_runs(path, line, code, torchrun_env):
    torch.manual_seed(0)
    namespace = {"__name__": "__doc_example__"}
    compiled = compile("\n" * (line - 1) + code, str(ROOT / path), "exec")
    exec(compiled, namespace)
