"""`akv policy` end to end through the real command app."""
from __future__ import annotations

import json

import pytest
from test_policy_support import agent_history, tool_indices
from typer.testing import CliRunner

from akv_cli.main import app
from policy_dsl import builtin_names, format_policy, load_policy

runner = CliRunner()


def akv(*args: str):
    return runner.invoke(app, ["policy", *args])


def test_list_names_every_builtin_with_its_description_wrapped_at_80_columns() -> None:
    result = runner.invoke(app, ["policy", "list"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert [line.split()[0] for line in lines if not line.startswith(" ")] == builtin_names()
    assert max(map(len, lines)) <= 80 and all(line.startswith(" " * 23) for line in lines if line.startswith(" "))
    assert "keep the 12 most recent tool responses" in " ".join(result.output.split())


def test_show_prints_the_shipped_source() -> None:
    result = akv("show", "expert")
    assert result.exit_code == 0 and result.output.startswith("# Expert policy")
    nope = akv("show", "nope")
    assert nope.exit_code == 2 and nope.output.startswith("error: unknown built-in policy 'nope'; expected one of")


@pytest.mark.parametrize("name", builtin_names())
def test_check_prints_the_canonical_text_of_every_builtin(name: str) -> None:
    result = akv("check", name)
    assert result.exit_code == 0
    assert result.output == format_policy(load_policy(name).ast)


def test_check_prints_location_source_line_and_caret(tmp_path) -> None:
    bad = tmp_path / "bad.akvp"
    bad.write_text("mode kv\non each tool_response: drop role tool keepx last 3\n")
    result = akv("check", str(bad))
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert lines[0] == f"error: {bad}:2:39: unknown keyword 'keepx'; expected ')', 'and', 'keep', 'on', 'or', " \
                       "'reposition', 'trigger', 'until', 'within', end of file"
    assert lines[1] == "on each tool_response: drop role tool keepx last 3"
    assert lines[2] == " " * 38 + "^"
    assert "Traceback" not in result.output


@pytest.mark.parametrize("content,words", [
    (b"", "empty policy"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "not UTF-8 text"),
    (b"mode kv\n" + b"#" * (1 << 20), "the limit is 65536"),
])
def test_check_rejects_empty_binary_and_huge_files_in_one_located_line(tmp_path, content: bytes, words: str) -> None:
    path = tmp_path / "p.akvp"
    path.write_bytes(content)
    result = akv("check", str(path))
    assert result.exit_code == 1
    assert result.output.startswith(f"error: {path}:1:") and words in result.output.splitlines()[0]
    assert "Traceback" not in result.output


def test_decide_prints_the_api_fields(tmp_path) -> None:
    history = agent_history(14)
    path = tmp_path / "h.json"
    path.write_text(json.dumps({"messages": history}))
    result = akv("decide", "expert", "--history", str(path))
    assert result.exit_code == 0, result.output
    tools = tool_indices(history)
    assert json.loads(result.output) == {
        "drop_message": {str(tools[12]): [tools[0]], str(tools[13]): [tools[1]]},
        "reposition": [tools[12], tools[13]],
    }


def test_decide_in_text_mode_prints_the_edits_and_takes_a_bare_list(tmp_path) -> None:
    path = tmp_path / "h.json"
    path.write_text(json.dumps(agent_history(4, response="r" * 100_000)))  # ~100K tokens: over 96K
    result = akv("decide", "standard", "--history", str(path))
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {"text_edits": [
        {"kind": "summarize", "start": 2, "end": 7, "budget_tokens": 4000}]}


@pytest.mark.parametrize("content,words", [
    ("{not json", "not JSON"),
    ('{"messages": 3}', 'expected {"messages": [...]}'),
    ('[{"role": "user"}, 7]', "message 1: expected an object"),
])
def test_decide_reports_a_bad_history_in_one_line(tmp_path, content: str, words: str) -> None:
    path = tmp_path / "h.json"
    path.write_text(content)
    result = akv("decide", "expert", "--history", str(path))
    assert result.exit_code == 2 and result.output.startswith("error: ")
    assert words in result.output and "Traceback" not in result.output
