"""Compare: the held-out table against the baselines, and a self-contained report.html.

The HTML page has no external resources at all (no scripts, fonts or images from a
network): the Pareto front and the lineage tree are inline SVG, styles are inline.
"""
from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Any, Sequence

from evolve.cascade import train_points
from evolve.context import TRAIN
from evolve.export import chosen_validation
from evolve.pareto import Point, pareto_front
from evolve.validation import HELDOUT, REFERENCE
from sandbox.cost import cents
from sandbox.stats import gap_closed
from store import PolicyInfo, RunInfo, Store, ValidationRecord


COLUMNS = (("expert", "vs expert"), ("standard", "vs Std"), ("text_engineering", "vs TE"), ("full", "vs full"))


@dataclass(frozen=True)
class Versus:
    """One policy against one baseline on the same held-out tasks."""

    cost_change_pct: float
    cost_p: float  # two-sided paired
    score_change: float  # points (score is 0..1, shown x100)
    score_p: float


@dataclass(frozen=True)
class Row:
    label: str
    role: str
    score: float
    score_ci: tuple[float, float]
    cost: float
    cost_ci: tuple[float, float]
    versus: dict[str, Versus]  # by baseline role; the policy's own role is absent
    rule: dict[str, Any] | None  # the champion rule's numbers vs the expert (candidates only)
    verdict: str
    champion: bool


def comparison_rows(validations: Sequence[ValidationRecord]) -> list[Row]:
    rows = []
    for v in validations:
        # Records of older versions compared with Standard only, under "cost" and "score".
        shown = v.stats.get("vs") or ({"standard": v.stats} if "cost" in v.stats else {})
        versus = {role: Versus(c["cost"].get("percent", 0.0), c["cost"].get("p_value", 1.0),
                               100.0 * c["score"].get("mean_delta", 0.0), c["score"].get("p_value", 1.0))
                  for role, c in shown.items()}
        rows.append(Row(v.label, v.role, v.score_mean, tuple(v.stats.get("score_ci", (v.score_mean,) * 2)),
                        v.cost_mean, tuple(v.stats.get("cost_ci", (v.cost_mean,) * 2)), versus,
                        v.stats.get("rule"), v.verdict, v.champion))
    return rows


def _pm(low: float, high: float, scale: float = 1.0, digits: int = 3) -> str:
    return f"±{(high - low) / 2 * scale:.{digits}f}"


def _p(p: float) -> str:
    return "p<.001" if p < 0.001 else f"p={p:.3f}".replace("0.", ".", 1)


def _versus_cell(row: Row, role: str) -> str:
    """Cost change and score change vs one baseline; vs the expert a candidate shows the rule's numbers:
    the Holm-adjusted one-sided p of the cost and the score difference's lower bound."""
    if role == "expert" and row.rule:
        r = row.rule
        return (f"{r['cost_percent']:+.1f}% {_p(r['cost_p_holm'])}\n"
                f"{100 * r['score_delta']:+.1f}pt ≥{100 * r['score_low']:+.1f}")
    v = row.versus.get(role)
    if v is None:
        return "-"
    return f"{v.cost_change_pct:+.1f}%\n{v.score_change:+.1f}pt"


def text_table(rows: Sequence[Row]) -> list[list[str]]:
    """Header plus one line per policy, the same cells the CLI and the HTML show.

    Every cell holds two lines (name over verdict, score over cost, cost change over score change),
    which keeps the four comparisons inside 80 columns.
    """
    table = [["policy\nverdict", "score %\n¢/task", *(title for _, title in COLUMNS)]]
    for r in rows:
        table.append([
            ("★ " if r.champion else "") + r.label + "\n" + short_verdict(r.verdict),
            f"{100 * r.score:.1f}{_pm(*r.score_ci, scale=100, digits=1)}%\n"
            f"{100 * r.cost:.3f}{_pm(*r.cost_ci, scale=100, digits=3)}¢",
            *(_versus_cell(r, role) for role, _ in COLUMNS),
        ])
    return table


def short_verdict(verdict: str) -> str:
    """The verdict's leading clause, for narrow tables."""
    for prefix, short in (("champion", "champion"), ("cheaper than the expert", "eligible"),
                          ("not significantly cheaper", "not cheaper"), ("score may be worse", "score loss"),
                          ("baseline", "baseline"), ("dominated", "dominated"), ("saves", "eligible"),
                          ("significant score loss", "score loss")):
        if verdict.startswith(prefix):
            return short
    return verdict.split(" (")[0].replace("cost saving vs Standard not significant", "saving n.s.")


def summary_line(validations: Sequence[ValidationRecord]) -> str:
    """The verdict in one paragraph: the champion and why, or why nothing was crowned."""
    champion = next((v for v in validations if v.champion), None)
    if champion is not None:
        return f"Champion: {champion.label} — {champion.verdict.removeprefix('champion: ')}."
    finalists = [v for v in validations if v.role == "candidate"]
    expert = next((v.label for v in validations if v.role == "baseline" and v.verdict == "baseline (expert)"),
                  "the expert")
    if not finalists:
        return "No champion: no candidate reached held-out validation."
    n = finalists[0].n_tasks
    why = "; ".join(f"{v.label} {v.verdict}" for v in finalists)
    if not any("rule" in v.stats for v in finalists):  # stored by an older version, whose rule compared with Standard
        return f"No champion under the rule of the version that validated this run (against Standard): {why}."
    return (f"No champion: no finalist beat the expert ({expert}) on the {n} held-out tasks under the champion "
            f"rule. {why}.")


# ---- the expert-to-oracle gap ------------------------------------------------------------------

@dataclass(frozen=True)
class OracleGap:
    """How much of the expert-to-oracle cost gap a validated candidate closed on the run's held-out tasks."""

    candidate: str
    policy_id: int
    champion: bool
    n_tasks: int
    expert_cost: float  # USD per task, means over the same tasks
    candidate_cost: float
    oracle_cost: float
    closed: tuple[float, tuple[float, float]] | None  # the share and its 95% interval; None: no gap to close
    same_actions: int  # tasks whose oracle run took the recorded actions (elsewhere it is no ceiling)
    run_backend: str  # the oracle always runs on the replay backend

    def line(self) -> str:
        """One line, plus a note line for each reason to read it with care."""
        who = f"{'champion' if self.champion else 'best validated candidate'} ({self.candidate})"
        if self.closed is None:
            text = (f"{who}: no expert-to-oracle gap to close on {self.n_tasks} held-out tasks "
                    f"(the oracle is not cheaper than the expert)")
        else:
            share, (low, high) = self.closed
            text = (f"{who} closes {100 * share:.1f}% of the expert-to-oracle gap (95% interval "
                    f"{100 * low:.1f}%..{100 * high:.1f}%) on {self.n_tasks} held-out tasks")
        notes = []
        if self.same_actions < self.n_tasks:
            notes.append(f"the oracle left the recorded actions on {self.n_tasks - self.same_actions} of the tasks: "
                         "it is no ceiling there")
        if self.run_backend != "replay":
            notes.append(f"the oracle ran on the replay backend, the run on {self.run_backend}")
        return text + "".join(f"\n  note: {note}" for note in notes)

    def as_dict(self) -> dict[str, Any]:
        share, interval = self.closed if self.closed is not None else (None, None)
        return {"candidate": self.candidate, "policy_id": self.policy_id, "champion": self.champion,
                "n_tasks": self.n_tasks, "expert_cost_usd": self.expert_cost,
                "candidate_cost_usd": self.candidate_cost, "oracle_cost_usd": self.oracle_cost,
                "closed_percent": None if share is None else 100 * share,
                "interval_percent": None if interval is None else [100 * interval[0], 100 * interval[1]],
                "oracle_same_actions": self.same_actions, "oracle_backend": "replay", "run_backend": self.run_backend}


def oracle_gap(store: Store, run: RunInfo) -> OracleGap:
    """The champion's (else the best validated candidate's) share of the expert-to-oracle cost gap.

    (expert - candidate) / (expert - oracle), mean costs on the held-out tasks both ran, with a
    percentile bootstrap interval over the tasks (`sandbox.stats.gap_closed`). The expert's and the
    candidate's costs are the run's own; the oracle's come from the hindsight oracle
    (`sandbox/oracle.py`) run on each of those tasks with the run's suite build and seed on the
    replay backend. It replays the scripted agent's use records, so a run of another agent, or a
    suite whose agent records no uses, raises ValueError (one line) instead of a meaningless share.
    """
    agent = run.config.get("agent", "scripted")
    if agent != "scripted":
        raise ValueError(f"run {run.name!r} used the {agent} agent; the oracle replays the scripted agent's use "
                         "records, so its costs would not be comparable with the run's")
    chosen = chosen_validation(store, run.id, None, allow_best=True)
    expert_id = store.baselines(run.id).get(REFERENCE)
    if chosen is None or expert_id is None:
        raise ValueError(f"run {run.name!r} has no validated candidate and expert to compare")
    expert, candidate = (_held_out_costs(store, run.id, pid) for pid in (expert_id, chosen.policy_id))
    oracle = _oracle_costs(run, [t for t in expert if t in candidate])
    if not oracle:
        raise ValueError(f"run {run.name!r}: the expert and {chosen.label} ran no held-out task in common")
    ids = list(oracle)
    columns = [[expert[t] for t in ids], [candidate[t] for t in ids], [oracle[t][0] for t in ids]]
    closed = gap_closed(*columns, resamples=int(run.config.get("validation", {}).get("resamples", 2000)),
                        seed=run.seed)
    means = [sum(column) / len(ids) for column in columns]
    return OracleGap(chosen.label, chosen.policy_id, chosen.champion, len(ids), *means, closed,
                     sum(oracle[t][1] for t in ids), str(run.config.get("backend", "replay")))


def _held_out_costs(store: Store, run_id: int, policy_id: int) -> dict[str, float]:
    return {e.result.task_id: e.result.cost_usd for e in store.evaluations(run_id, HELDOUT, [policy_id])}


def _oracle_costs(run: RunInfo, task_ids: Sequence[str]) -> dict[str, tuple[float, bool]]:
    """Per task, in split order: the oracle's cost and whether it took the recorded actions."""
    from evolve.scoring import HarnessEvaluator
    from sandbox.backends.replay import ReplayBackend
    from sandbox.harness import select_tasks
    from sandbox.oracle import run_oracle

    suite = run.config.get("suite")
    if not suite:
        raise ValueError(f"run {run.name!r} records no suite")
    # The evaluator checks that the data folder holds the build the run was scored on.
    evaluator = HarnessEvaluator(suite, "scripted", "replay", run.seed, recorded_version=run.suite_version)
    try:
        out = {}
        for task in select_tasks(evaluator.suite, HELDOUT, list(task_ids)):
            done = run_oracle(task, evaluator.suite, ReplayBackend, seed=run.seed)
            out[task.id] = (done.oracle.cost_usd, done.same_actions)
        return out
    finally:
        evaluator.close()


# ---- HTML ------------------------------------------------------------------------------------------

CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}th{background:#f2f2f2}
.champ{background:#fff6d5}.rej{color:#a33}svg{border:1px solid #ddd;background:#fff}code{font-size:12px}"""


def pareto_svg(train: Sequence[Point], heldout: Sequence[ValidationRecord], w: int = 640, h: int = 380) -> str:
    pts = [(p.cost, p.score) for p in train] + [(v.cost_mean, v.score_mean) for v in heldout]
    if not pts:
        return '<svg id="pareto" width="10" height="10"></svg>'
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1 = min(xs), max(xs) or 1.0
    y0, y1 = min(min(ys), 0.0), max(max(ys), 1e-9)
    x1 = x1 if x1 > x0 else x0 + 1e-9
    pad, right = 50, 150  # the right margin leaves room for the labels of the dearest points

    def sx(x: float) -> float:
        return pad + (x - x0) / (x1 - x0) * (w - pad - right)

    def sy(y: float) -> float:
        return h - pad - (y - y0) / (y1 - y0 if y1 > y0 else 1) * (h - 2 * pad)

    out = [f'<svg id="pareto" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img">',
           f'<line x1="{pad}" y1="{h - pad}" x2="{w - right}" y2="{h - pad}" stroke="#444"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="#444"/>',
           f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle" font-size="12">cost per task (¢)</text>',
           f'<text x="14" y="{h / 2}" font-size="12" transform="rotate(-90 14 {h / 2})" text-anchor="middle">'
           'score</text>']
    for frac in (0.0, 0.5, 1.0):  # three ticks per axis are enough to read the scale
        xv, yv = x0 + frac * (x1 - x0), y0 + frac * (y1 - y0)
        out.append(f'<text x="{sx(xv):.1f}" y="{h - pad + 16}" font-size="10" text-anchor="middle">{cents(xv)}</text>'
                   f'<text x="{pad - 6}" y="{sy(yv) + 3:.1f}" font-size="10" text-anchor="end">{yv:.2f}</text>')
    front = pareto_front(train)
    line = " ".join(f"{sx(p.cost):.1f},{sy(p.score):.1f}" for p in sorted(front, key=lambda p: p.cost))
    if line:
        out.append(f'<polyline points="{line}" fill="none" stroke="#4a7" stroke-width="1.5"/>')
    for p in train:
        out.append(f'<circle class="train" cx="{sx(p.cost):.1f}" cy="{sy(p.score):.1f}" r="3" fill="#9bc">'
                   f'<title>#{p.policy_id} train: score {p.score:.3f}, cost {cents(p.cost)}¢/task</title></circle>')
    for v in sorted(heldout, key=lambda v: v.champion):  # the champion is drawn last, on top
        colour = "#d80" if v.champion else ("#555" if v.role == "baseline" else "#c44")
        out.append(f'<rect class="heldout" x="{sx(v.cost_mean) - 4:.1f}" y="{sy(v.score_mean) - 4:.1f}" width="8" '
                   f'height="8" fill="{colour}"><title>{escape(v.label)} held-out</title></rect>')
    for text, (x, y) in point_labels([((sx(v.cost_mean), sy(v.score_mean)), v.label, v.champion)
                                      for v in heldout], w, h):
        out.append(f'<text class="label" x="{x:.1f}" y="{y:.1f}" font-size="{LABEL_FONT}">{escape(text)}</text>')
    out.append("</svg>")
    return "".join(out)


LABEL_FONT = 11
LABEL_CHAR_W = 0.62 * LABEL_FONT  # generous for a proportional font: an estimate must not undercut the glyphs
LABEL_H = LABEL_FONT + 3


def point_labels(points: Sequence[tuple[tuple[float, float], str, bool]], w: float,
                 h: float) -> list[tuple[str, tuple[float, float]]]:
    """One label per spot, placed where it overlaps no other label: (text, baseline position) each.

    Points drawn within 4 px of each other share one label (champion first, names joined by commas);
    each label tries right-above, right-below, left-above and left-below of its spot, then steps
    further up and down, and keeps the first box that meets no label placed before it.
    """
    spots: list[tuple[tuple[float, float], list[str]]] = []
    for (x, y), name, champion in sorted(points, key=lambda p: not p[2]):
        near = next((s for s in spots if abs(s[0][0] - x) <= 4 and abs(s[0][1] - y) <= 4), None)
        if near is None:
            spots.append(((x, y), [name]))
        else:
            near[1].append(name)
    placed: list[tuple[float, float, float, float]] = []
    out = []
    for (x, y), names in sorted(spots, key=lambda s: (s[0][1], s[0][0])):
        text = ", ".join(names)
        width = LABEL_CHAR_W * len(text)
        box = _free_box(x, y, width, placed, w, h)
        placed.append(box)
        out.append((text, (box[0], box[3] - 3)))
    return out


def _free_box(x: float, y: float, width: float, placed: Sequence[tuple[float, float, float, float]],
              w: float, h: float) -> tuple[float, float, float, float]:
    """The first candidate box (left, top, right, bottom) next to (x, y) that meets no placed box."""
    def meets(a, b) -> bool:
        return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]

    candidates = []
    for step in range(0, 40):
        for dy in ((-6 - LABEL_H - step * LABEL_H, 6 + step * LABEL_H) if step else (-6 - LABEL_H, 6)):
            for left in (x + 6, x - 6 - width):
                candidates.append((left, y + dy, left + width, y + dy + LABEL_H))
    inside = [c for c in candidates if c[0] >= 0 and c[2] <= w and c[1] >= 0 and c[3] <= h] or candidates
    return next((c for c in inside if not any(meets(c, p) for p in placed)), inside[-1])


def lineage_svg(policies: Sequence[PolicyInfo], highlight: set[int], w_step: int = 34, h_step: int = 60) -> str:
    by_gen: dict[int, list[PolicyInfo]] = {}
    for p in policies:
        by_gen.setdefault(max(p.generation, 0), []).append(p)
    pos = {}
    for gen, items in sorted(by_gen.items()):
        for i, p in enumerate(items):
            pos[p.id] = (30 + i * w_step, 30 + gen * h_step)
    reach = 0.6 * 9 * max((len(p.label) for p in policies), default=0)  # a label's length, rotated by 40 degrees
    width = max((x for x, _ in pos.values()), default=0) + 60 + 0.77 * reach
    height = max((y for _, y in pos.values()), default=0) + 50 + 0.65 * reach
    colours = {"evaluated": "#4a7", "pruned": "#db3", "rejected": "#c44", "duplicate": "#c9c", "proposed": "#999"}
    out = [f'<svg id="lineage" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">']
    for p in policies:
        for parent in p.parent_ids:
            if parent in pos:
                (x0, y0), (x1, y1) = pos[parent], pos[p.id]
                out.append(f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y1}" stroke="#bbb"/>')
    for p in policies:
        x, y = pos[p.id]
        ring = ' stroke="#000" stroke-width="2"' if p.id in highlight else ""
        why = f" — {p.rejection_reason}" if p.rejection_reason else ""
        out.append(f'<circle cx="{x}" cy="{y}" r="7" fill="{colours.get(p.status, "#999")}"{ring}>'
                   f'<title>{escape(p.label)} gen {p.generation} {p.proposer} {p.status}{escape(why)}</title>'
                   f'</circle><text class="node" x="{x}" y="{y + 15}" font-size="9" '
                   f'transform="rotate(40 {x} {y + 15})">{escape(p.label)}</text>')
    out.append("</svg>")
    return "".join(out)


def run_train_ids(store: Store, run_id: int) -> list[str]:
    """The run's train tasks: those the Standard baseline ran (every baseline runs them all)."""
    standard = store.baselines(run_id).get("standard")
    if standard is None:
        return []
    return sorted({e.result.task_id for e in store.evaluations(run_id, TRAIN, [standard])})


def render_html(store: Store, run: RunInfo) -> str:
    train_ids = run_train_ids(store, run.id)
    validations = store.validations(run.id)
    policies = store.policies(run.id)
    points = train_points(store, run.id, train_ids)
    rows = comparison_rows(validations)
    table = text_table(rows)
    head = "".join(f"<th>{escape(c)}</th>" for c in table[0])
    body = "".join(f'<tr class="{"champ" if r.champion else ""}">' + "".join(f"<td>{escape(c)}</td>" for c in cells)
                   + "</tr>" for r, cells in zip(rows, table[1:]))
    verdicts = "".join(f"<li><b>{escape(r.label)}</b>: {escape(r.verdict)}</li>" for r in rows if r.role == "candidate")
    return "".join([
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>AKV run {escape(run.name)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>Evolution run {escape(run.name)}</h1><p>{escape(summary_line(validations))}</p>",
        f"<p>status {escape(run.status)} · seed {run.seed} · code {escape(run.code_version)} · "
        f"suite {escape(run.suite_version)} · {len(policies)} policies</p>",
        _rounds(store, run.id),
        f'<h2>Held-out comparison</h2><p>{escape(TABLE_NOTE)}</p><table id="comparison"><tr>{head}</tr>{body}</table>',
        f"<ul id='verdicts'>{verdicts}</ul>" if verdicts else "",
        "<h2>Pareto front</h2><p>Circles: train means of every fully evaluated policy (line: the train front); "
        "squares: held-out means of the validated policies.</p>",
        pareto_svg(points, validations),
        "<h2>Lineage</h2><p>One row per generation; green evaluated, yellow pruned, red rejected, violet "
        "duplicate; hover for details.</p>",
        lineage_svg(policies, {v.policy_id for v in validations}),
        _per_task_table(store, run.id, validations),
        _diagnoses(policies),
        _rejections(policies),
        "</body></html>",
    ])


TABLE_NOTE = ("Each 'vs' cell: cost change in % (line 1) and score change in points (line 2) against that baseline "
              "on the same tasks. Against the expert a finalist shows the champion rule: the Holm-adjusted "
              "one-sided p of its saving, and (≥) the one-sided lower bound of its score difference.")


def _rounds(store: Store, run_id: int) -> str:
    rounds = store.validation_rounds(run_id)
    if not rounds:
        return "<p>Not validated yet.</p>"
    items = "".join(f"<li>round {r.round}: {r.created_at:%Y-%m-%d %H:%M:%S} · code {escape(r.code_version)} · "
                    f"suite {escape(r.suite_version)} · {r.n_policies} policies</li>" for r in rounds)
    return f"<p>Validation rounds (the table shows the latest):</p><ul id='rounds'>{items}</ul>"


def _per_task_table(store: Store, run_id: int, validations: Sequence[ValidationRecord]) -> str:
    ids = [v.policy_id for v in validations]
    cells: dict[str, dict[int, str]] = {}
    for e in store.evaluations(run_id, HELDOUT, ids):
        r = e.result
        cells.setdefault(r.task_id, {})[e.policy_id] = f"{r.score:.2f} / {cents(r.cost_usd)}" + (
            f" ({r.status})" if r.status != "ok" else "")
    head = "".join(f"<th>{escape(v.label)}</th>" for v in validations)
    rows = "".join(f"<tr><td>{escape(t)}</td>" + "".join(f"<td>{escape(c.get(i, '-'))}</td>" for i in ids) + "</tr>"
                   for t, c in sorted(cells.items()))
    return (f'<h2>Per-task held-out results (score / cost ¢)</h2><table id="per-task"><tr><th>task</th>{head}</tr>'
            f"{rows}</table>")


def _diagnoses(policies: Sequence[PolicyInfo]) -> str:
    """The model's proposals: what it diagnosed in the parent's trajectories, and how its policy fared."""
    rows = "".join(f"<tr><td>{escape(p.label)}</td><td>{', '.join(f'#{i}' for i in p.parent_ids)}</td>"
                   f"<td>{escape(p.status)}</td><td>{escape(p.meta.get('diagnosis') or '(none)')}</td>"
                   f"<td>{escape(', '.join(p.meta.get('digests') or []))}</td></tr>"
                   for p in policies if p.proposer == "llm")
    if not rows:
        return ""
    return ("<h2>Model proposals and their diagnoses</h2><table id='diagnoses'><tr><th>policy</th><th>parent</th>"
            f"<th>status</th><th>diagnosis</th><th>digested train tasks</th></tr>{rows}</table>")


def _rejections(policies: Sequence[PolicyInfo]) -> str:
    rows = "".join(f'<tr class="rej"><td>{escape(p.label)}</td><td>{escape(p.proposer)}</td><td>{escape(p.status)}'
                   f"</td><td>{escape(p.rejection_reason or '')}</td></tr>"
                   for p in policies if p.status in ("rejected", "duplicate", "pruned"))
    if not rows:
        return "<h2>Rejected, duplicate and pruned candidates</h2><p>None.</p>"
    return ("<h2>Rejected, duplicate and pruned candidates</h2><table id='rejections'><tr><th>policy</th>"
            f"<th>proposer</th><th>status</th><th>reason</th></tr>{rows}</table>")
