"""`akv traces import|list|show|export|delete`: recorded agent runs as evaluation data (docs/traces.md)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from akv_cli.errors import fail
from akv_cli.options import DB_HELP
from akv_cli.runs import _with_store

traces_app = typer.Typer(help="Recorded agent runs (traces): import, list, show, export.", no_args_is_help=True)
FORMAT_HELP = ("The format of every FILE (default: detected from each file's content): openai (chat JSON Lines, "
               "gateway logs), messages (one JSON list of messages), swe-agent (.traj), mini-swe-agent (.traj.json, "
               "1.x and 2.x), tau-bench (a results array of runs), openhands (event streams, evaluation "
               "output.jsonl), anthropic (Messages API requests and replies), claude-code (session logs), adp "
               "(Agent Data Protocol trajectories), otel (OpenTelemetry GenAI spans), akv (`akv traces export`, "
               "`akv proxy --record`) or akv-run (a trajectory of `akv run`; kv policies only). docs/traces.md "
               "lists them.")


def register(app: typer.Typer) -> None:
    app.add_typer(traces_app, name="traces")


@traces_app.command("import")
def import_traces(files: list[Path] = typer.Argument(..., help="Files to read, any number; a folder stands for "
                                                    "its trace files (.json, .jsonl, .ndjson, .traj), in order, at "
                                                    "any depth."),
                  name: str = typer.Option(..., "--name", help="The trace set (created, or added to); "
                                           "it is a suite of that name."),
                  format: Optional[str] = typer.Option(None, "--format", help=FORMAT_HELP),
                  actions: Optional[str] = typer.Option(None, "--actions", help="text: the agents act in fenced "
                                                        "blocks answered by user messages (scored in tool-call "
                                                        "form); tools: they do not (default: detected per trace)."),
                  id_from: str = typer.Option("auto", "--id-from", help="field: each trace's own id; path: its "
                                              "file's folder and name; auto: the own id, or the path one when "
                                              "another file's run holds it (docs/traces.md, Ids)."),
                  id_prefix: str = typer.Option("", "--id-prefix", help="Put this before every imported id."),
                  db: Optional[str] = typer.Option(None, "--db", envvar="AKV_DB", help=DB_HELP)) -> None:
    """Add the traces of FILE... to a trace set, all or nothing (one transaction), one file at a time."""
    from sandbox.suites import suite_entries
    from sandbox.traces.importing import IdOptions, TraceImport
    from sandbox.traces.model import TraceError
    from sandbox.traces.reading import trace_files

    try:
        files = trace_files(files)
    except TraceError as err:
        fail(str(err))
    from sandbox.traces.records import check_set_name
    from sandbox.traces.suite import split_of

    try:
        check_set_name(name, {e.name for e in suite_entries() if not e.target.startswith("sandbox.traces.")},
                       "--name")
        for path in files:
            if not path.is_file():
                raise ValueError(f"{path}:1: no such file: expected a trace file")
    except ValueError as err:
        fail(str(err))

    def body(store: Any) -> None:
        try:
            importing = TraceImport(files, store.traces.held(name), format, actions, IdOptions(id_from, id_prefix))
            added, unchanged = store.traces.add(name, importing.records())
        except (TraceError, ValueError) as err:
            fail(str(err))
        report = importing.report
        for line in report.notes:
            typer.echo(f"note: {line}", err=True)
        for line in report.warnings:
            typer.echo(f"warning: {line}", err=True)
        splits = [split_of(key) for key in report.split_keys]
        typer.echo(f"{name}: {added} traces added, {unchanged} unchanged; {report.requests} requests; "
                   f"{splits.count('train')} train, {splits.count('heldout')} heldout (use it as --suite {name})")
    _with_store(db, body)


@traces_app.command("list")
def list_sets(db: Optional[str] = typer.Option(None, "--db", envvar="AKV_DB", help=DB_HELP),
              json_out: bool = typer.Option(False, "--json", help="One JSON object on stdout.")) -> None:
    """Every trace set: traces, messages, recorded requests, last change."""
    from rich.console import Console

    from sandbox.tables import Column, fitted_table

    def body(store: Any) -> None:
        sets = store.traces.sets()
        if json_out:
            typer.echo(json.dumps({"trace_sets": [{"name": s.name, "traces": s.n_traces, "messages": s.n_messages,
                                                   "requests": s.n_requests, "updated": s.updated_at.isoformat()}
                                                  for s in sets]}))
            return
        columns = [Column("name", keep=9), Column("traces", True, 8), Column("messages", True, 5),
                   Column("requests", True, 6), Column("updated", True, 2)]
        rows = [[s.name, str(s.n_traces), str(s.n_messages), str(s.n_requests),
                 s.updated_at.strftime("%Y-%m-%d %H:%M:%S")] for s in sets]
        console = Console()
        console.print(fitted_table(columns, rows, console.width, title=f"trace sets in {store.display_url}"))
    _with_store(db, body)


@traces_app.command("show")
def show_set(name: str = typer.Argument(..., help="The trace set."),
             trace: Optional[str] = typer.Option(None, "--trace", help="One trace's messages instead (default: "
                                            "the table of every trace)."),
             db: Optional[str] = typer.Option(None, "--db", envvar="AKV_DB", help=DB_HELP),
             json_out: bool = typer.Option(False, "--json", help="One JSON object on stdout.")) -> None:
    """A set's traces (id, split, messages, requests, tool results as scored, characters, format, model,
    outcome), or one trace."""
    from sandbox.traces.records import trace_of

    def body(store: Any) -> None:
        traces = [trace_of(t) for t in store.traces.get(name)]
        if trace is None:
            _print_set(name, traces, json_out)
            return
        found = next((t for t in traces if t.id == trace), None)
        if found is None:
            fail(f"--trace: no trace {trace!r} in {name!r} (ids: `akv traces show {name}`)")
        _print_trace(found, json_out)
    _with_store(db, body)


def _summary(trace: Any) -> dict[str, Any]:
    """A trace's row: what is scored (tool results counted in tool-call form, as the suite replays
    it), where it came from and its metadata."""
    from akv_core.chat import content_text

    from sandbox.traces.actions import as_tool_calls
    from sandbox.traces.suite import split_key, split_of

    scored = as_tool_calls(trace)
    return {"id": trace.id, "split": split_of(split_key(trace)), "messages": len(trace.messages),
            "requests": len(trace.requests), "tool_results": sum(m.get("role") == "tool" for m in scored.messages),
            "chars": sum(len(content_text(m)) for m in trace.messages), "actions": trace.actions,
            "format": trace.provenance.get("format", ""),
            "model": trace.metadata.get("model") or trace.provenance.get("model") or "",  # the proxy's: provenance
            "outcome": _outcome(trace.metadata), "metadata": dict(trace.metadata),
            "provenance": dict(trace.provenance)}


def _outcome(metadata: Any) -> str:
    """How the run ended, as short as the metadata says it: resolved, reward, else exit status."""
    parts = []
    if "resolved" in metadata:
        parts.append("resolved" if metadata["resolved"] else "unresolved")
    if "reward" in metadata:
        parts.append(f"reward {metadata['reward']:g}" if isinstance(metadata["reward"], (int, float))
                     else f"reward {metadata['reward']}")
    if not parts and metadata.get("exit_status"):
        parts.append(str(metadata["exit_status"]))
    return ", ".join(parts)


def _print_set(name: str, traces: list, json_out: bool) -> None:
    from rich.console import Console

    from sandbox.tables import Column, fitted_table

    rows = [_summary(t) for t in traces]
    if json_out:
        typer.echo(json.dumps({"name": name, "traces": rows}))
        return
    columns = [Column("id", keep=9), Column("split", keep=8), Column("messages", True, 7),
               Column("requests", True, 6), Column("tool results", True, 5), Column("chars", True, 4),
               Column("actions", keep=2), Column("format", keep=3), Column("model", keep=1),
               Column("outcome", keep=1)]
    cells = [[r["id"], r["split"], str(r["messages"]), str(r["requests"]), str(r["tool_results"]),
              str(r["chars"]), r["actions"], r["format"], r["model"], r["outcome"]] for r in rows]
    console = Console()
    console.print(fitted_table(columns, cells, console.width, title=f"{name}: {len(rows)} traces"))


def _print_trace(trace: Any, json_out: bool) -> None:
    from akv_core.chat import content_text

    if json_out:
        typer.echo(json.dumps(trace.to_dict(), ensure_ascii=False))
        return
    typer.echo(json.dumps(_summary(trace), ensure_ascii=False))
    for i, message in enumerate(trace.messages):
        text = " ".join(content_text(message).split())
        calls = [c.get("function", {}).get("name", "?") for c in message.get("tool_calls") or ()]
        extra = f" calls {', '.join(calls)}" if calls else ""
        typer.echo(f"{i:4d} {message.get('role', '?'):9s} {len(content_text(message)):7d} chars{extra}  "
                   f"{text[:90]}")


@traces_app.command("export")
def export_set(name: str = typer.Argument(..., help="The trace set."),
               out: Path = typer.Option(..., "--out", help="JSON Lines file to write (akv format)."),
               db: Optional[str] = typer.Option(None, "--db", envvar="AKV_DB", help=DB_HELP)) -> None:
    """Write a set as JSON Lines, one trace a line, as `akv traces import --format akv` reads it."""
    from sandbox.traces.records import trace_of

    def body(store: Any) -> None:
        traces = [trace_of(t) for t in store.traces.get(name)]
        try:
            with out.open("w", encoding="utf-8") as handle:
                for trace in traces:
                    handle.write(json.dumps(trace.to_dict(), ensure_ascii=False) + "\n")
        except OSError as err:
            fail(f"--out: cannot write {out}: {err.strerror}")
        typer.echo(f"{name}: {len(traces)} traces written to {out}")
    _with_store(db, body)


@traces_app.command("delete")
def delete_set(name: str = typer.Argument(..., help="The trace set."),
               db: Optional[str] = typer.Option(None, "--db", envvar="AKV_DB", help=DB_HELP)) -> None:
    """Remove a trace set and its traces (runs scored on it keep their results)."""
    def body(store: Any) -> None:
        typer.echo(f"{name}: {store.traces.delete(name)} traces deleted")
    _with_store(db, body)
