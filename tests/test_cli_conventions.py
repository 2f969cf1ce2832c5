"""What every command shares: help rows that show defaults and no `<bool>` after flags, and errors
that start with `error: ` and exit 2 (could not do it) or 1 (ran, and the answer is no)."""
from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from akv_cli.main import app
from evolve.config import EvolveConfig, LLMProposerConfig

runner = CliRunner()


def commands(group=None, path=("akv",)):
    """Every leaf command of the app as (words, click command)."""
    group = group or typer.main.get_command(app)
    for name, sub in sorted(group.commands.items()):
        if hasattr(sub, "commands"):
            yield from commands(sub, (*path, name))
        else:
            yield (*path, name), sub


COMMANDS = dict(commands())


@pytest.mark.parametrize("words", sorted(COMMANDS), ids=" ".join)
def test_help_at_80_columns_shows_no_value_type_after_a_flag(words) -> None:
    shown = runner.invoke(app, [*words[1:], "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert shown.exit_code == 0, shown.output
    assert "<bool>" not in shown.output
    assert max(len(line) for line in shown.output.splitlines()) <= 80


@pytest.mark.parametrize("words", sorted(COMMANDS), ids=" ".join)
def test_every_option_without_a_shown_default_states_it(words) -> None:
    """Typer prints `[default: X]` for a set default; an option defaulting to None must say it in words."""
    silent = [p.opts[0] for p in COMMANDS[words].params
              if type(p).__name__ == "TyperOption" and not p.is_flag and not p.required and p.default is None
              and not re.search(r"\b(default|required)\b", p.help or "")]
    assert not silent, f"{' '.join(words)}: {silent} do not state their default"


@pytest.mark.parametrize(("option", "value"), [
    ("--agent", EvolveConfig.model_fields["agent"].default),
    ("--backend", EvolveConfig.model_fields["backend"].default),
    ("--max-candidates", EvolveConfig.model_fields["max_candidates"].default),
    ("--seed", EvolveConfig.model_fields["seed"].default),
    ("--proposer-model", LLMProposerConfig.model_fields["model"].default),
])
def test_evolve_help_states_the_config_s_own_defaults(option: str, value) -> None:
    param = next(p for p in COMMANDS[("akv", "evolve")].params if option in p.opts)
    assert f"(default {value})" in param.help


@pytest.mark.parametrize(("args", "code", "words"), [
    (["policy", "show", "nosuch"], 2, "error: unknown built-in policy 'nosuch'; expected one of"),
    (["policy", "decide", "expert", "--history", "no-such-history.json"], 2, "error: no-such-history.json: cannot read"),
    (["tasks", "list"], 2, "error: --suite: expected a suite name"),
    (["run", "--suite", "nosuch", "--policy", "expert"], 2, "error: unknown suite 'nosuch'"),
    (["bench", "cost", "--suites", ","], 2, "error: --suites expects at least one name"),
    (["bench", "serving", "--context", "16384"], 2, "error: --context: expected one of 32768"),
    (["serve", "--context", "32768"], 2, "error: --context: 32768 is beyond the model's trained context of 8192"),
    (["serve", "--context", "32768", "--rope-scaling", "yarn:2"], 2, "error: --rope-scaling: yarn:2 stretches"),
])
def test_errors_start_with_error_and_exit_2_when_the_command_cannot_do_it(args, code, words) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == code and result.output.startswith(words), result.output
    assert "Traceback" not in result.output


def test_a_policy_check_that_finds_an_error_exits_1_with_the_located_error(tmp_path) -> None:
    bad = tmp_path / "bad.akvp"
    bad.write_text("mode kv\non every 2 tool_response: drop role tool keep last 4\n")
    fine = runner.invoke(app, ["policy", "check", str(bad)])
    assert fine.exit_code == 0, fine.output
    bad.write_text("mode kv\non every 2 widgets: drop role tool keep last 4\n")
    found = runner.invoke(app, ["policy", "check", str(bad)])
    assert found.exit_code == 1
    assert found.output.splitlines()[0] == (f"error: {bad}:2:12: unknown unit 'widgets'; expected one of tool_call, "
                                            "tool_calls, tool_response, tool_responses, turn, turns")
