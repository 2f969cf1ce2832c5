"""The README's command list, run top to bottom as a newcomer runs it in a fresh checkout.

Every line of the sh block under "The command line" runs in order in an empty folder (with the
checkout's `examples/` and a copy of the built localcomp suite, so that only the commands' own
work is paid for), with the data folder's default (`.akv/` in that folder), through the real
command app in this process (`;` separates commands, `> FILE` takes stdout): a separate process
per command would add a second of start-up to each of some thirty commands. The README's markers (an HTML comment above the block explains them):
`# [needs ...]` commands need what the test does not have (a terminal of their own, a server,
minutes of the model); they are checked for their options with `--help` instead, so a stale flag
still fails. `# [exit N ...]` commands are documented errors and must exit N with an `error: ` line.

Slow (about half a minute on two cores): it runs some thirty commands, among them a short
evolution and its revalidation; a newcomer runs no fewer.
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from akv_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
TAG = re.compile(r"^\[(needs [^\]]+|exit (\d+)[^\]]*)\]")
DOLLARS = re.compile(r"\$\d")
# The data folder is the default `.akv/` of the working folder; nothing of the caller's leaks in.
ENV = {"AKV_HOME": None, "AKV_DB": None, "AKV_PROPOSER_ENDPOINT": None, "OPENAI_BASE_URL": None, "COLUMNS": "80"}


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


def newcomer_folder(folder: Path) -> None:
    """An empty working folder as a checkout has it (`examples/`), with localcomp built."""
    from akv_core.home import akv_home

    shutil.copytree(ROOT / "examples", folder / "examples")
    shutil.copytree(akv_home() / "localcomp", folder / ".akv" / "localcomp")


def run(line: str) -> tuple[int, str, str]:
    """One README command through the real command app (exit code, stdout, stderr); `> FILE` writes stdout."""
    words = shlex.split(line)
    target = None
    if ">" in words:
        words, target = words[:words.index(">")], words[words.index(">") + 1]
    assert words[0] == "akv", line
    result = CliRunner().invoke(app, words[1:], env=ENV, terminal_width=80)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    if target is not None:
        Path(target).write_text(result.stdout, encoding="utf-8")
    return result.exit_code, result.stdout, result.stderr


def test_the_readme_block_has_the_markers_it_documents() -> None:
    commands = readme_commands()
    assert len(commands) >= 30 and all(c.text.startswith("akv ") for c in commands), commands
    assert {c.exit_code for c in commands} == {0, 2} and sum(c.needs is not None for c in commands) >= 6


@pytest.mark.slow
def test_the_readme_command_list_runs_top_to_bottom_in_a_fresh_folder(tmp_path, monkeypatch) -> None:
    newcomer_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    took = []
    for command in readme_commands():
        started = time.monotonic()
        line = f"{command.text} --help" if command.needs else command.text
        code, out, err = run(line)
        said = f"$ {line}\n{out[-2000:]}\n{err[-2000:]}"
        expected = 0 if command.needs else command.exit_code
        assert code == expected, said
        if expected:
            assert err.startswith("error: ") and len(err.splitlines()) == 1, said
        if "--json" in line.split():
            assert all(isinstance(json.loads(row), dict) for row in out.splitlines()), said  # a line each
        else:
            assert not DOLLARS.search(out + err), f"a cost in dollars, not cents:\n{said}"
        took.append((time.monotonic() - started, line))
    print("\n".join(f"{seconds:6.1f} s  {line}" for seconds, line in took))
    assert (tmp_path / "my.akvp").read_text().startswith("# The expert policy")
    assert (tmp_path / "best.akvp").is_file() and (tmp_path / "p1.akvp").is_file()
