"""The README's command list, run top to bottom as a newcomer runs it in a fresh checkout.

Every line of the sh block under "The command line" runs in order in an empty folder (with the
checkout's `examples/` and a copy of the built localcomp suite, so that only the commands' own
work is paid for), through bash, with the `akv` of this environment and the data folder's default
(`.akv/` in that folder). The README's markers (an HTML comment above the block explains them):
`# [needs ...]` commands need what the test does not have (a terminal of their own, a server,
minutes of the model); they are checked for their options with `--help` instead, so a stale flag
still fails. `# [exit N ...]` commands are documented errors and must exit N with an `error: ` line.

Slow (about a minute on two cores) because it runs some thirty commands as separate processes,
a short evolution, its revalidation and a suite build; a newcomer runs no fewer.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TAG = re.compile(r"^\[(needs [^\]]+|exit (\d+)[^\]]*)\]")
DOLLARS = re.compile(r"\$\d")


@dataclass(frozen=True)
class Command:
    text: str
    needs: str | None  # run only with --help: what the test does not have
    exit_code: int


def readme_commands() -> list[Command]:
    """The commands of the sh block under "## The command line", in order, with their markers."""
    section = (ROOT / "README.md").read_text(encoding="utf-8").split("\n## The command line\n", 1)[1]
    block = section.split("\n## ", 1)[0].split("```sh\n", 1)[1].split("\n```", 1)[0]
    commands = []
    for line in block.splitlines():
        if not line.strip():
            continue
        text, _, comment = line.partition(" # ")
        tag = TAG.match(comment.strip())
        needs = tag.group(1) if tag and tag.group(1).startswith("needs ") else None
        exit_code = int(tag.group(2)) if tag and tag.group(2) else 0
        commands += [Command(part.strip(), needs, exit_code) for part in text.split(" ; ")]
    return commands


def newcomer_folder(folder: Path) -> dict[str, str]:
    """An empty working folder as a checkout has it (`examples/`), localcomp built; its environment."""
    from akv_core.home import akv_home

    shutil.copytree(ROOT / "examples", folder / "examples")
    shutil.copytree(akv_home() / "localcomp", folder / ".akv" / "localcomp")
    env = {k: v for k, v in os.environ.items()
           if k not in ("AKV_HOME", "AKV_DB", "AKV_PROPOSER_ENDPOINT", "OPENAI_BASE_URL", "OPENAI_API_KEY")}
    return {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", "COLUMNS": "80",
            "OMP_NUM_THREADS": "1"}


def test_the_readme_block_has_the_markers_it_documents() -> None:
    commands = readme_commands()
    assert len(commands) >= 30 and all(c.text.startswith("akv ") for c in commands), commands
    assert {c.exit_code for c in commands} == {0, 2} and sum(c.needs is not None for c in commands) >= 6


@pytest.mark.slow
def test_the_readme_command_list_runs_top_to_bottom_in_a_fresh_folder(tmp_path) -> None:
    env = newcomer_folder(tmp_path)
    took = []
    for command in readme_commands():
        started = time.monotonic()
        line = f"{command.text} --help" if command.needs else command.text
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        said = f"$ {line}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        expected = 0 if command.needs else command.exit_code
        assert done.returncode == expected, said
        if expected:
            assert done.stderr.startswith("error: ") and len(done.stderr.splitlines()) == 1, said
        if "--json" in line.split():
            assert all(isinstance(json.loads(row), dict) for row in done.stdout.splitlines()), said  # a line each
        else:
            assert not DOLLARS.search(done.stdout + done.stderr), f"a cost in dollars, not cents:\n{said}"
        took.append((round(time.monotonic() - started, 1), line))
    print("\n".join(f"{s:6.1f} s  {line}" for s, line in took))
    assert (tmp_path / "best.akvp").is_file() and (tmp_path / "p1.akvp").is_file()
