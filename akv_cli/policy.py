"""`akv policy`: list, show, check and try out cache policies."""
from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any

import typer

from akv_cli.errors import VERDICT, fail, fail_located, raw_text

policy_app = typer.Typer(help="Cache policies: the built-in library, checking and trying them.",
                         no_args_is_help=True)


class TokenizerChoice(str, Enum):
    approx = "approx"
    smollm2 = "smollm2"


def register(app: typer.Typer) -> None:
    """Add the `policy` group to the root app."""
    app.add_typer(policy_app, name="policy")


@policy_app.command("list")
def list_policies() -> None:
    """Print the built-in policies with their one-line description."""
    import shutil
    import textwrap

    from policy_dsl import builtin_names, builtin_source

    indent = 23  # descriptions wrap under themselves at the terminal's width (80 columns in a pipe)
    width = max(shutil.get_terminal_size().columns - indent, 20)
    for name in builtin_names():
        lines = textwrap.wrap(_description(builtin_source(name)), width, break_on_hyphens=False) or [""]
        typer.echo(f"{name:<{indent - 1}} " + f"\n{' ' * indent}".join(lines))


@policy_app.command("show")
def show(name: str = typer.Argument(..., help="A built-in policy name (see `akv policy list`).")) -> None:
    """Print a built-in policy's source, comments included."""
    from policy_dsl import PolicyError, builtin_source

    try:
        typer.echo(builtin_source(name), nl=False)
    except PolicyError as error:
        fail(error.message)


@policy_app.command("check")
def check(file: str = typer.Argument(..., help="A .akvp file or a built-in name.")) -> None:
    """Parse and validate a policy; print its canonical form, or a located error (exit 1)."""
    from policy_dsl import PolicyError, format_policy, parse
    from policy_dsl.library import read_source

    text = None
    try:
        filename, text = read_source(file)
        typer.echo(format_policy(parse(text, filename=filename)), nl=False)
    except PolicyError as error:
        fail_located(error, text if text is not None else raw_text(file), VERDICT)


@policy_app.command("decide")
def decide(
    policy: str = typer.Argument(..., help="A .akvp file or a built-in name."),
    history: Path = typer.Option(..., "--history", help='JSON: {"messages": [...]} or a bare list of messages.'),
    tokenizer: TokenizerChoice = typer.Option(TokenizerChoice.approx, help="Token counter: approximate, or the "
                                              "embedded model's chat template (smollm2)."),
) -> None:
    """Print the API fields a policy sends for a history (and, in text mode, its edits)."""
    from policy_dsl import HistoryError, PolicyError, compile_policy, parse
    from policy_dsl.library import read_source

    text = None
    try:
        filename, text = read_source(policy)
        compiled = compile_policy(parse(text, filename=filename), name=Path(filename).stem)
    except PolicyError as error:
        fail_located(error, text if text is not None else raw_text(policy))
    messages = _read_history(history)
    try:
        decision = compiled.decide(messages, _counter(tokenizer))
    except HistoryError as error:
        fail(f"{history}: {error}")
    out: dict[str, Any] = decision.api_fields()
    if compiled.mode == "text":  # text policies send no cache fields; the harness applies these edits
        out["text_edits"] = [_edit_json(e) for e in decision.text_edits]
    typer.echo(json.dumps(out, indent=2))


@policy_app.command("akvalgo")
def akvalgo(policy: str = typer.Argument(..., help="A .akvp file or a built-in name.")) -> None:
    """Print the policy as upstream akvalgo AKVPolicy keyword arguments (JSON), or why it has none (exit 1)."""
    from policy_dsl import PolicyError, parse
    from policy_dsl.akvalgo import to_akvalgo
    from policy_dsl.library import read_source

    text = None
    try:
        filename, text = read_source(policy)
        options = to_akvalgo(parse(text, filename=filename), filename)
    except PolicyError as error:
        fail_located(error, text if text is not None else raw_text(policy), VERDICT)
    typer.echo(json.dumps(options.kwargs(), indent=2))
    for condition in options.conditions():  # what upstream's harness must supply for the same decisions
        typer.echo(f"condition: {condition}", err=True)


def _description(source: str) -> str:
    """The first sentence of the policy's leading comment."""
    words = []
    for line in source.splitlines():
        if not line.startswith("#"):
            break
        words.append(line.lstrip("# ").strip())
    text = " ".join(words)
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def _read_history(path: Path) -> list[Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        fail(f"{path}: cannot read: {error.strerror}")
    except (ValueError, RecursionError) as error:
        fail(f"{path}: not JSON: {error}")
    messages = data.get("messages") if isinstance(data, dict) else data
    if not isinstance(messages, list):
        fail(f'{path}: expected {{"messages": [...]}} or a list of messages')
    return messages


def _counter(choice: TokenizerChoice) -> Any:
    from policy_dsl import ApproxTokenCounter

    if choice is TokenizerChoice.approx:
        return ApproxTokenCounter()
    try:
        from akv_core.chat import ChatTokenizer
    except ImportError:
        fail("--tokenizer smollm2 needs akv_core's chat tokenizer, which is not installed")
    try:
        return ChatTokenizer.from_model("smollm2")
    except (OSError, ValueError) as error:
        fail(f"--tokenizer smollm2: {error}")


def _edit_json(edit: Any) -> dict[str, Any]:
    out = {"kind": edit.kind, "start": edit.start, "end": edit.end}
    if edit.budget_tokens is not None:
        out["budget_tokens"] = edit.budget_tokens
    if edit.placeholder is not None:
        out["placeholder"] = edit.placeholder
    return out
