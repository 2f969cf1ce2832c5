"""`akv proxy policies|rollback|status NAME`: a refining proxy's live policy, its lineage and what it saved."""
from __future__ import annotations

import json
from typing import Any, Mapping, Optional, Sequence

import typer

from akv_cli.errors import fail
from akv_cli.options import DB_HELP

NAME_HELP = "The trace set a refining proxy records (akv proxy --record NAME --refine)."
SAVINGS_HEADER = ("policy", "conver-\nsations", "¢/conv", "expert\n¢/conv", "full\n¢/conv", "vs\nexpert",
                  "vs\nfull", "lost reuses\n/conv", "drops", "repo-\nsitions", "skipped")


def register(group: typer.Typer) -> None:
    group.command("policies")(policies)
    group.command("rollback")(rollback)
    group.command("status")(status)


def policies(name: str = typer.Argument(..., help=NAME_HELP),
             db: Optional[str] = typer.Option(None, "--db", envvar="AKV_DB", help=DB_HELP),
             as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout.")) -> None:
    """Every live policy the trace set had: its start, each promotion with its verdicts, each rollback."""
    def body(store: Any) -> None:
        entries = store.live.lineage(name)
        if not entries:
            fail(f"NAME: trace set {name!r} has no live policy in {store.display_url} (no refining proxy has "
                 "served it: akv proxy --record NAME --refine)")
        if as_json:
            typer.echo(json.dumps({"trace_set": name, "live": entries[-1].id, "entries": [
                {"id": e.id, "kind": e.kind, "policy": e.name, "run": e.run_name, "policy_id": e.policy_id,
                 "restores": e.restores, "figures": dict(e.figures), "note": e.note, "text": e.text,
                 "created_at": e.created_at.isoformat()} for e in entries]}))
            return
        _print_table([_entry_row(e, e is entries[-1]) for e in entries], ENTRY_HEADER, ENTRY_NUMBERS,
                     f"live policies of trace set {name} (the last is live)")
    _with_store(db, body)


def rollback(name: str = typer.Argument(..., help=NAME_HELP),
             to: Optional[int] = typer.Option(None, "--to", help="The lineage entry whose policy comes back "
                                              "(default: the one live before the current policy first went live)."),
             db: Optional[str] = typer.Option(None, "--db", envvar="AKV_DB", help=DB_HELP)) -> None:
    """Make an earlier policy live again; a refining proxy gives it to new conversations at its next poll."""
    def body(store: Any) -> None:
        entry = store.live.rollback(name, to)
        typer.echo(f"{name}: the live policy is now {entry.name} (entry #{entry.id}, restoring #{entry.restores}); "
                   "a refining proxy gives it to new conversations within a second, conversations under way keep "
                   "theirs, and its refiner never promotes the policy rolled back from again")
    _with_store(db, body)


def status(name: str = typer.Argument(..., help=NAME_HELP),
           db: Optional[str] = typer.Option(None, "--db", envvar="AKV_DB", help=DB_HELP),
           as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout.")) -> None:
    """The live policy, the refinement rounds, and per served policy what its conversations cost against
    the expert and full (replayed)."""
    def body(store: Any) -> None:
        live = store.live.live(name)
        if live is None:
            fail(f"NAME: trace set {name!r} has no live policy in {store.display_url} (no refining proxy has "
                 "served it: akv proxy --record NAME --refine)")
        rounds, totals, skipped = store.live.rounds(name), store.live.totals(name), store.live.skipped(name)
        if as_json:
            since = live.created_at.isoformat()
            typer.echo(json.dumps({"trace_set": name, "live": {"entry": live.id, "policy": live.name,
                                                                "kind": live.kind, "since": since},
                                   "rounds": [_round_json(r) for r in rounds],
                                   "policies": [_totals_json(t) for t in totals],
                                   "skipped": [{"trace": c.trace_id, "reason": c.skipped} for c in skipped]}))
            return
        typer.echo(f"trace set {name} in {store.display_url}: live policy {live.name} (entry #{live.id}, {live.kind}, "
                   f"since {live.created_at:%Y-%m-%d %H:%M:%S} UTC)")
        typer.echo(_rounds_line(rounds))
        _print_table(savings_rows(totals), SAVINGS_HEADER, set(range(1, len(SAVINGS_HEADER))),
                     "what each served policy's finished conversations cost, replayed (replay backend)")
        for cost in skipped[:5]:
            typer.echo(f"skipped {cost.trace_id}: {cost.skipped}")
        if len(skipped) > 5:
            typer.echo(f"... and {len(skipped) - 5} more skipped (--json lists them)")
    _with_store(db, body)


# ---- rows ----------------------------------------------------------------------------------------------

def savings_rows(totals: Sequence[Any]) -> list[list[str]]:
    """One row per served policy (SAVINGS_HEADER): costs per conversation and the saving against each."""
    from sandbox.runs.cost import cents

    rows = []
    for t in totals:
        n = t.conversations
        per = (lambda usd: cents(usd / n)) if n else (lambda usd: "-")
        rows.append([t.policy, str(n), per(t.cost_usd), per(t.expert_cost_usd), per(t.full_cost_usd),
                     _change(t.cost_usd, t.expert_cost_usd), _change(t.cost_usd, t.full_cost_usd),
                     f"{t.lost_reuses / n:.2f}" if n else "-", str(t.drops), str(t.repositions), str(t.skipped)])
    return rows


def savings_text(totals: Sequence[Any]) -> str:
    """The savings table as plain text (the refinement report beside a run's evolution report)."""
    from sandbox.tables import plain_table

    if not totals:
        return "no finished conversation measured yet"
    header = [h.replace("-\n", "").replace("\n", " ") for h in SAVINGS_HEADER]
    return "what each served policy's finished conversations cost, replayed:\n" + plain_table(header,
                                                                                            savings_rows(totals))


ENTRY_HEADER = ("#", "when (UTC)", "change", "policy", "run", "vs live\ncost, p", "vs expert\ncost, p",
                "held-\nout", "note")
ENTRY_NUMBERS = {0, 1, 5, 6, 7}  # columns shown whole or not at all


def _entry_row(entry: Any, live: bool) -> list[str]:
    figures = entry.figures
    return [str(entry.id), f"{entry.created_at:%Y-%m-%d %H:%M:%S}", entry.kind + ("\n★ live" if live else ""),
            entry.name, entry.run_name or "-", _verdict(figures.get("vs_live")), _verdict(figures.get("vs_expert")),
            str(figures.get("heldout", "-")), entry.note]


def _verdict(verdict: Mapping[str, Any] | None) -> str:
    if not verdict:
        return "-"
    return f"{verdict.get('cost_percent', 0):+.1f}%\np={verdict.get('cost_p_holm', 1):.2g}"


def _change(cost: float, other: float) -> str:
    return f"{100 * (cost - other) / other:+.1f}%" if other else "-"


def _rounds_line(rounds: Sequence[Any]) -> str:
    if not rounds:
        return "refinement: no round yet"
    counts: dict[str, int] = {}
    for r in rounds:
        counts[r.status] = counts.get(r.status, 0) + 1
    last = rounds[-1]
    return (f"refinement: {len(rounds)} round{'s' if len(rounds) != 1 else ''} ("
            + ", ".join(f"{n} {status.replace('_', ' ')}" for status, n in sorted(counts.items()))
            + f"); last: round {last.number} ({last.run_name}, {last.traces} conversations) "
            f"{last.status.replace('_', ' ')} at {last.started_at:%Y-%m-%d %H:%M:%S} UTC"
            + (f": {last.detail}" if last.detail else ""))


def _round_json(r: Any) -> dict[str, Any]:
    return {"number": r.number, "run": r.run_name, "status": r.status, "detail": r.detail, "traces": r.traces,
            "live_entry": r.live_id, "figures": dict(r.figures), "started_at": r.started_at.isoformat(),
            "finished_at": r.finished_at.isoformat() if r.finished_at else None}


def _totals_json(t: Any) -> dict[str, Any]:
    return {"policy": t.policy, "conversations": t.conversations, "requests": t.requests, "cost_usd": t.cost_usd,
            "expert_cost_usd": t.expert_cost_usd, "full_cost_usd": t.full_cost_usd, "lost_reuses": t.lost_reuses,
            "reuses": t.reuses, "drops": t.drops, "repositions": t.repositions, "skipped": t.skipped}


# ---- printing ------------------------------------------------------------------------------------------

def _print_table(rows: list[list[str]], header: Sequence[str], numbers: set[int], title: str) -> None:
    """The one table printer; at a narrow width the right-most columns are left out first."""
    from rich.console import Console

    from sandbox.tables import Column, fitted_table

    columns = [Column(h, number=i in numbers, keep=len(header) - i) for i, h in enumerate(header)]
    console = Console()
    console.print(fitted_table(columns, rows, console.width, title=title, compact=True))


def _with_store(db: Optional[str], body: Any) -> None:
    from akv_cli.runs import _with_store as with_store

    with_store(db, body)
