"""Terminal views of a stored run: `akv runs show`, `akv lineage` and `akv compare`'s accounting."""
from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.markup import escape
from rich.tree import Tree

from evolve.cascade import train_points
from evolve.pareto import pareto_front
from evolve.report import (Accounting, chosen_title, edit_note, lineage_table, run_train_ids, summary_line,
                           tally_table)
from sandbox.runs.cost import cents
from sandbox.tables import Column, fitted_table
from store import PolicyInfo, Store


def _line(p: PolicyInfo) -> str:
    colours = {"evaluated": "green", "pruned": "yellow", "rejected": "red", "duplicate": "magenta"}
    colour = colours.get(p.status, "white")
    why = f" — {p.rejection_reason}" if p.rejection_reason else ""
    diagnosis = p.meta.get("diagnosis")
    note = "" if diagnosis else edit_note(p.meta)  # a diagnosis has its own line
    detail = f" {escape(note)}" if note else ""
    said = f"\n  [italic]diagnosis: {escape(_short(diagnosis, 240))}[/]" if diagnosis else ""
    return f"{p.label} gen {p.generation} {p.proposer} [{colour}]{p.status}[/]{detail}{escape(why)}{said}"


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def lineage_tree(store: Store, run_ref: str) -> Tree:
    run = store.run(run_ref)
    policies = store.policies(run.id)
    children: dict[int, list[PolicyInfo]] = {}
    roots = []
    for p in policies:
        if p.parent_ids:
            children.setdefault(p.parent_ids[0], []).append(p)
        else:
            roots.append(p)
    tree = Tree(f"run {run.name}")

    def add(node: Tree, p: PolicyInfo) -> None:
        also = f" (also child of {', '.join(f'#{i}' for i in p.parent_ids[1:])})" if len(p.parent_ids) > 1 else ""
        branch = node.add(_line(p) + also)
        for child in children.get(p.id, []):
            add(branch, child)
    for root in roots:
        add(tree, root)
    return tree


def show_run(store: Store, run_ref: str, console: Console) -> None:
    run = store.run(run_ref)
    cfg = run.config
    console.print(f"[bold]{run.name}[/] (#{run.id}) status {run.status}"
                  + (f" — {run.status_detail}" if run.status_detail else ""))
    console.print(f"suite {cfg.get('suite')} · agent {cfg.get('agent')} · backend {cfg.get('backend')} · "
                  f"proposers {', '.join(cfg.get('proposers', []))} · seed {run.seed} · "
                  f"{cfg.get('max_candidates')} candidates")
    console.print(f"code {run.code_version} · suite {run.suite_version} · created {run.created_at:%Y-%m-%d %H:%M:%S}")
    policies = store.policies(run.id)
    counts = Counter(p.status for p in policies)
    console.print("policies: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    by_id = {p.id: p for p in policies}
    front = pareto_front(train_points(store, run.id, run_train_ids(store, run.id)))
    console.print("train front:")
    for point in front:
        console.print(f"  {by_id[point.policy_id].label}: score {point.score:.3f}, cost {cents(point.cost)}¢/task")
    workers = store.work.workers(run.id)
    if workers:
        console.print("workers:")
        for w in workers:
            console.print(f"  {w.name} ({w.role}, concurrency {w.concurrency}, backend {w.backend}): "
                          f"{w.n_evaluations} tasks, {w.started_at:%Y-%m-%d %H:%M:%S} to {w.last_seen:%H:%M:%S}",
                          markup=False, highlight=False)
    reasons = Counter((p.rejection_reason or "").split(":")[0] for p in policies if p.status == "rejected")
    if reasons:
        console.print("rejections: " + "; ".join(f"{n}× {r}" for r, n in reasons.most_common(5)))
    validations = store.validations(run.id)
    rounds = store.validation_rounds(run.id)
    if validations:
        latest = rounds[-1] if rounds else None
        when = (f" (round {latest.round} of {len(rounds)}, {latest.created_at:%Y-%m-%d %H:%M:%S}, code "
                f"{latest.code_version}, suite {latest.suite_version})") if latest else ""
        console.print(f"held-out validation{when}:")
        for v in validations:
            console.print(f"  {v.label}: score {v.score_mean:.3f}, cost {cents(v.cost_mean)}¢/task — {v.verdict}")
        console.print(summary_line(validations))


def print_accounting(console: Console, acc: Accounting) -> None:
    """`akv compare`'s per-proposer table, then the chosen policy's lineage, nearest first."""
    rows = tally_table(acc.tallies)
    columns = [Column(rows[0][0], keep=9)] + [Column(h, True, 1 if h == "pending" else 5) for h in rows[0][1:]]
    table = fitted_table(columns, rows[1:], console.width, compact=True, complete="--json has every column",
                         title="policies by proposer (★ the champion's; seeds and baselines, given, last)")
    given = [t.given for t in acc.tallies]
    if any(given) and not all(given):
        table.rows[given.index(True) - 1].end_section = True
    console.print(table)
    if acc.chosen is None:
        return
    rows = lineage_table(acc.lineage)
    columns = [Column(rows[0][0], keep=5), Column(rows[0][1], keep=4), Column(rows[0][2], True, 2),
               Column(rows[0][3], keep=1), Column(rows[0][4], keep=3)]
    console.print(fitted_table(columns, rows[1:], console.width, compact=True, complete="--json has every column",
                               title=f"lineage of the {chosen_title(acc)}"))
