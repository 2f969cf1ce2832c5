"""Compare: the held-out table against the baselines, and a self-contained report.html.

The HTML page has no external resources at all (no scripts, fonts or images from a
network): the Pareto front and the lineage tree are inline SVG, styles are inline.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, fields
from html import escape
from typing import Any, Mapping, Sequence

from akv_stats.champion import NATS_PER_TOKEN
from akv_stats.paired import gap_closed
from evolve.cascade import train_points
from evolve.context import TRAIN
from evolve.export import chosen_validation, lineage_of
from evolve.loop import PROPOSED_BY
from evolve.pareto import Point, pareto_front
from evolve.scoring import build_of
from evolve.validation import HELDOUT, REFERENCE
from sandbox.runs.cost import cents
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
        if r.get("score_unit") == NATS_PER_TOKEN:   # validation.fidelity: likelihood
            return (f"{r['cost_percent']:+.1f}% {_p(r['cost_p_holm'])}\n"
                    f"{r['score_delta']:+.3f}nat ≥{r['score_low']:+.3f}")
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


def describe_selection(validations: Sequence[ValidationRecord]) -> str | None:
    """One line: which train points were validated and why the others were not (a round stored before
    finalists were chosen against the expert says nothing)."""
    selection = next((v.stats["train_selection"] for v in validations if "train_selection" in v.stats), None)
    if selection is None:
        return None
    chosen = ", ".join(f"#{pid}" for pid in selection.get("finalists", ())) or "none"
    outside = selection.get("left_out") or []
    line = (f"finalists: {chosen}; {selection.get('beat_expert', 0)} of {selection.get('candidates', 0)} candidates "
            f"scored on the whole train split beat the expert there")
    if selection.get("near"):
        line += " (so the finalists are the cheaper there on average at a mean score within the margin)"
    if outside:
        line += "; left out, cheapest first: " + "; ".join(f"#{o['policy_id']} {o['why']}" for o in outside[:3])
    return line


def summary_line(validations: Sequence[ValidationRecord]) -> str:
    """The verdict in one paragraph: the champion and why, or why nothing was crowned."""
    champion = next((v for v in validations if v.champion), None)
    if champion is not None:
        return f"Champion: {champion.label} — {champion.verdict.removeprefix('champion: ')}."
    finalists = [v for v in validations if v.role == "candidate"]
    expert = next((v.label for v in validations if v.role == "baseline" and v.verdict == "baseline (expert)"),
                  "the expert")
    if not finalists:
        selection = next((v.stats["train_selection"] for v in validations if "train_selection" in v.stats), None)
        if selection is None:
            return "No champion: no candidate reached held-out validation."
        cheapest = (selection.get("left_out") or [{}])[0]
        nearest = f" The cheapest: #{cheapest['policy_id']} {cheapest['why']}." if cheapest else ""
        return (f"No champion: no candidate beat the expert ({expert}) on train, so none was validated "
                f"({selection.get('candidates', 0)} scored on the whole train split).{nearest}")
    n = finalists[0].n_tasks
    why = "; ".join(f"{v.label} {v.verdict}" for v in finalists)
    if not any("rule" in v.stats for v in finalists):  # stored by an older version, whose rule compared with Standard
        return f"No champion under the rule of the version that validated this run (against Standard): {why}."
    return (f"No champion: no finalist beat the expert ({expert}) on the {n} held-out tasks under the champion "
            f"rule. {why}.")


# ---- per-proposer accounting and the chosen policy's lineage -----------------------------------

@dataclass(frozen=True)
class ProposerTally:
    """What became of one proposer's policies. The fates partition them: proposed = rejected +
    duplicate + pruned + evaluated + pending. Seeds and baselines (`given`) are given, not proposed."""

    proposer: str
    given: bool
    proposed: int
    rejected: int  # invalid, or nothing new to propose
    duplicate: int
    pruned: int  # by the cascade, on the train subset
    evaluated: int  # on the whole train split
    pending: int  # proposed but not yet judged (a stopped run)
    front: int  # on the train Pareto front
    finalists: int  # validated on held-out as candidates
    champion: int


@dataclass(frozen=True)
class LineageNode:
    policy_id: int
    label: str
    proposer: str
    generation: int
    parent_ids: tuple[int, ...]
    note: str  # its edit in one line ("" for seeds and baselines)


@dataclass(frozen=True)
class Accounting:
    """A run's per-proposer tallies, and the champion (else the best validated candidate) with its lineage."""

    tallies: list[ProposerTally]
    chosen: ValidationRecord | None
    chosen_text: str | None
    lineage: list[LineageNode]  # the chosen policy first, then its ancestors, nearest first

    def as_dict(self) -> dict[str, Any]:
        chosen = None if self.chosen is None else {
            "policy_id": self.chosen.policy_id, "label": self.chosen.label, "champion": self.chosen.champion,
            "text": self.chosen_text}
        return {"proposers": [asdict(t) for t in self.tallies],
                "lineage": {"policy": chosen, "nodes": [asdict(n) | {"parent_ids": list(n.parent_ids)}
                                                        for n in self.lineage]}}


def proposer_tallies(policies: Sequence[PolicyInfo], front_ids: set[int], validations: Sequence[ValidationRecord],
                     order: Sequence[str] = ()) -> list[ProposerTally]:
    """One tally per proposer of the run's policies: the proposers in `order` (then by name), then seeds
    and baselines. The latest validation round names the finalists and the champion."""
    finalists = {v.policy_id for v in validations if v.role == "candidate"}
    champions = {v.policy_id for v in validations if v.champion}
    groups: dict[str, list[PolicyInfo]] = {}
    for p in policies:
        groups.setdefault(p.proposer, []).append(p)
    ranked = [*order, "seed", "baseline"]

    def rank(name: str) -> tuple[bool, int, str]:
        return name not in PROPOSED_BY, ranked.index(name) if name in ranked else len(ranked), name

    out = []
    for name in sorted(groups, key=rank):
        items, ids = groups[name], {p.id for p in groups[name]}
        fate = Counter(p.status for p in items)
        judged = sum(fate[s] for s in ("rejected", "duplicate", "pruned", "evaluated"))
        out.append(ProposerTally(name, name not in PROPOSED_BY, len(items), fate["rejected"], fate["duplicate"],
                                 fate["pruned"], fate["evaluated"], len(items) - judged, len(ids & front_ids),
                                 len(ids & finalists), len(ids & champions)))
    return out


def edit_note(meta: Mapping[str, Any]) -> str:
    """A proposal's edit in one line, from what its proposer stored with it ("" if nothing)."""
    if meta.get("edits"):
        source = f" (reflected on #{meta['reflected_on']}'s timelines)" if meta.get("reflected_on") else ""
        return "; ".join(map(str, meta["edits"])) + source
    if meta.get("params"):
        return "tuned " + ", ".join(f"{_short_path(k)}={v}" for k, v in meta["params"].items())
    if meta.get("diagnosis"):
        return f"diagnosis: {meta['diagnosis']}"
    if "draws" in meta:
        return f"random draw ({meta['draws']} tries)"
    return ""


def _short_path(path: str) -> str:
    """A tunable's path, its middle left out: rules[2].action.target.selector.parts[1].n -> rules[2]..parts[1].n"""
    parts = path.split(".")
    return path if len(parts) <= 3 else f"{parts[0]}..{'.'.join(parts[-2:])}"


def run_accounting(store: Store, run: RunInfo) -> Accounting:
    """The tallies of every proposer of the run and the chosen policy's lineage (`akv compare`, the report)."""
    policies = store.policies(run.id)
    front = {p.policy_id for p in pareto_front(train_points(store, run.id, run_train_ids(store, run.id)))}
    tallies = proposer_tallies(policies, front, store.validations(run.id), run.config.get("proposers", ()))
    chosen = chosen_validation(store, run.id, None, allow_best=True)
    if chosen is None:
        return Accounting(tallies, None, None, [])
    by_id = {p.id: p for p in policies}
    lineage = [LineageNode(n["id"], by_id[n["id"]].label, n["proposer"], n["generation"], tuple(n["parents"]),
                           edit_note(n["meta"])) for n in lineage_of(store, run.id, chosen.policy_id)]
    return Accounting(tallies, chosen, by_id[chosen.policy_id].text, lineage)


def tally_table(tallies: Sequence[ProposerTally]) -> list[list[str]]:
    """Header plus one line per proposer, the cells the CLI and the HTML show; seeds and baselines last.
    A ★ marks the champion's proposer (as in the comparison table); the pending column appears only
    where some policy is pending."""
    counts = [f.name for f in fields(ProposerTally)[2:-1] if f.name != "pending" or any(t.pending for t in tallies)]
    return [["proposer", *counts]] + [[t.proposer + (" ★" if t.champion else ""),
                                       *(str(getattr(t, c)) for c in counts)] for t in tallies]


def lineage_table(lineage: Sequence[LineageNode]) -> list[list[str]]:
    """Header plus one line per node of the chosen policy's lineage, nearest first."""
    return [["policy", "proposer", "gen", "parents", "edit"]] + [
        [n.label, n.proposer, str(n.generation), " ".join(f"#{i}" for i in n.parent_ids) or "-", n.note or "-"]
        for n in lineage]


def chosen_title(acc: Accounting) -> str:
    """Whose lineage and text the accounting shows."""
    if acc.chosen is None:
        return "no validated candidate"
    return f"{'champion' if acc.chosen.champion else 'best validated candidate (not a champion)'} {acc.chosen.label}"


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
    percentile bootstrap interval over the tasks (`akv_stats.paired.gap_closed`). The expert's and the
    candidate's costs are the run's own; the oracle's come from the hindsight oracle
    (`sandbox/runs/oracle.py`) run on each of those tasks with the run's suite build and seed on the
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
    build = (chosen.stats.get("heldout") or {}).get("seed")   # a fresh round's build, None for the run's own
    oracle = _oracle_costs(run, [t for t in expert if t in candidate and build_of(t)[1] == build])
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
    from sandbox.runs.harness import select_tasks
    from sandbox.runs.oracle import run_oracle

    suite = run.config.get("suite")
    if not suite:
        raise ValueError(f"run {run.name!r} records no suite")
    # The evaluator checks that the data folder holds the build the run was scored on.
    evaluator = HarnessEvaluator(suite, "scripted", "replay", run.seed, recorded_version=run.suite_version)
    try:
        by_build: dict[int | None, dict[str, str]] = {}   # a fresh round's ids are tagged with their build's seed
        for task_id in task_ids:
            own, build = build_of(task_id)
            by_build.setdefault(build, {})[own] = task_id
        found: dict[str, tuple[float, bool]] = {}
        for build, ids in by_build.items():
            suite = evaluator.suite if build is None else evaluator.fresh_suite(build)
            for task in select_tasks(suite, HELDOUT, list(ids)):
                done = run_oracle(task, suite, ReplayBackend, seed=run.seed)
                found[ids[task.id]] = (done.oracle.cost_usd, done.same_actions)
        return {t: found[t] for t in task_ids if t in found}
    finally:
        evaluator.close()


# ---- HTML ------------------------------------------------------------------------------------------

CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}th{background:#f2f2f2}
td{white-space:pre-line}.champ{background:#fff6d5}.given td{color:#666}#proposers td+td{text-align:right}
.rej{color:#a33}code{font-size:12px}
pre{background:#f7f7f7;border:1px solid #ddd;padding:8px;font-size:12px}svg{border:1px solid #ddd;background:#fff}"""


def cost_range(focus: Sequence[float], others: Sequence[float] = (), reach: float = 1.0) -> tuple[float, float]:
    """The Pareto plot's cost axis: the range of the `focus` costs (candidates, the expert, `full`),
    widened to take in the `others` within `reach` focus spans of it, plus 5% on either side.

    A far costlier (or cheaper) policy, such as Text Engineering, is left out of the range so that it
    does not squeeze the candidates into one corner; the plot draws it at the axis' edge with its cost.
    """
    if not focus:
        focus, others = others, ()
    lo, hi = min(focus), max(focus)
    span = hi - lo or abs(hi) / 10 or 1e-9
    kept = [x for x in others if lo - reach * span <= x <= hi + reach * span]
    lo, hi = min([lo, *kept]), max([hi, *kept])
    pad = (hi - lo or span) / 20
    return (max(lo - pad, 0.0) if lo >= 0 else lo - pad), hi + pad


def pareto_svg(train: Sequence[Point], heldout: Sequence[ValidationRecord], w: int = 800, h: int = 420,
               focus: set[int] | None = None) -> str:
    """Train means (circles, the train front as a line) and held-out means (squares), with the cost axis
    fitted to the policies in `focus` (ids; None: all); the others beyond it are drawn just past its end,
    under "beyond", with an arrowhead and their cost in the label."""
    pts = [(p.policy_id, p.cost, p.score) for p in train]
    pts += [(v.policy_id, v.cost_mean, v.score_mean) for v in heldout]
    if not pts:
        return '<svg id="pareto" width="10" height="10"></svg>'
    x0, x1 = cost_range([c for i, c, _ in pts if focus is None or i in focus],
                        [c for i, c, _ in pts if focus is not None and i not in focus])
    ys = [s for _, _, s in pts]
    y0, y1 = min(min(ys), 0.0), max(max(ys), 1e-9)
    pad, right = 50, 230  # the right margin leaves room for the labels of the dearest points
    plot = _Plot(x0, x1, y0, y1, pad, w - right, h - pad, pad)
    out = [f'<svg id="pareto" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img">',
           *_axes(plot, w, h)]
    for side in sorted({plot.x(c)[1] for _, c, _ in pts} - {0}):
        out.append(f'<text class="beyond" x="{plot.x(x1 if side > 0 else x0, side)[0]:.1f}" y="{plot.bottom + 28}" '
                   'font-size="10" text-anchor="middle" fill="#666">beyond</text>')
    line = " ".join(f"{plot.x(p.cost)[0]:.1f},{plot.y(p.score):.1f}"
                    for p in sorted(pareto_front(train), key=lambda p: p.cost))
    if line:
        out.append(f'<polyline points="{line}" fill="none" stroke="#4a7" stroke-width="1.5"/>')
    for p in train:
        (x, side), y = plot.x(p.cost), plot.y(p.score)
        out.append(f'<circle class="train" cx="{x:.1f}" cy="{y:.1f}" r="3" fill="#9bc">'
                   f'<title>#{p.policy_id} train: score {p.score:.3f}, cost {cents(p.cost)}¢/task</title></circle>'
                   + _beyond(x, y, side))
    spots = []
    for v in sorted(heldout, key=lambda v: v.champion):  # the champion is drawn last, on top
        (x, side), y = plot.x(v.cost_mean), plot.y(v.score_mean)
        colour = "#d80" if v.champion else ("#555" if v.role == "baseline" else "#c44")
        out.append(f'<rect class="heldout" x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" height="8" fill="{colour}">'
                   f'<title>{escape(v.label)} held-out: score {v.score_mean:.3f}, cost {cents(v.cost_mean)}¢/task'
                   f'</title></rect>' + _beyond(x, y, side))
        name = f"{v.label} {cents(v.cost_mean)}¢" if side else v.label  # beyond the axis: its real cost
        spots.append(((x + 8 * max(side, 0), y), name, v.champion))
    for text, (x, y) in point_labels(spots, w, h):
        out.append(f'<text class="label" x="{x:.1f}" y="{y:.1f}" font-size="{LABEL_FONT}">{escape(text)}</text>')
    out.append("</svg>")
    return "".join(out)


@dataclass(frozen=True)
class _Plot:
    """The plot area in data units (x0..x1, y0..y1) and pixels (left..right, bottom..top)."""

    x0: float
    x1: float
    y0: float
    y1: float
    left: float
    right: float
    bottom: float
    top: float

    def x(self, cost: float, side: int | None = None) -> tuple[float, int]:
        """The pixel of a cost and which side of the axis it lies (-1 cheaper, 0 on it, 1 dearer): a cost
        beyond the axis is drawn 20 px past that end, whatever its value."""
        if side is None:
            side = -1 if cost < self.x0 else (1 if cost > self.x1 else 0)
        if side:
            return (self.right + 20 if side > 0 else self.left - 20), side
        return self.left + (cost - self.x0) / (self.x1 - self.x0 or 1e-9) * (self.right - self.left), 0

    def y(self, score: float) -> float:
        return self.bottom - (score - self.y0) / (self.y1 - self.y0 or 1) * (self.bottom - self.top)


def _axes(plot: _Plot, w: int, h: int) -> list[str]:
    """The axes, their titles and three ticks each (enough to read the scale)."""
    out = [f'<line x1="{plot.left}" y1="{plot.bottom}" x2="{plot.right}" y2="{plot.bottom}" stroke="#444"/>',
           f'<line x1="{plot.left}" y1="{plot.top}" x2="{plot.left}" y2="{plot.bottom}" stroke="#444"/>',
           f'<text x="{(plot.left + plot.right) / 2}" y="{h - 12}" text-anchor="middle" font-size="12">'
           'cost per task (¢)</text>',
           f'<text x="14" y="{h / 2}" font-size="12" transform="rotate(-90 14 {h / 2})" text-anchor="middle">'
           'score</text>']
    for frac in (0.0, 0.5, 1.0):
        xv, yv = plot.x0 + frac * (plot.x1 - plot.x0), plot.y0 + frac * (plot.y1 - plot.y0)
        out.append(f'<text x="{plot.x(xv, 0)[0]:.1f}" y="{plot.bottom + 16}" font-size="10" text-anchor="middle">'
                   f'{cents(xv)}</text><text x="{plot.left - 6}" y="{plot.y(yv) + 3:.1f}" font-size="10" '
                   f'text-anchor="end">{yv:.2f}</text>')
    return out


def _beyond(x: float, y: float, side: int) -> str:
    """An arrowhead beside a point held at the axis' edge, pointing where its cost really lies."""
    if not side:
        return ""
    tip = x + 11 * side
    return (f'<polygon class="beyond" points="{x + 5 * side:.1f},{y - 4:.1f} {tip:.1f},{y:.1f} '
            f'{x + 5 * side:.1f},{y + 4:.1f}" fill="#444"/>')


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


def lineage_svg(policies: Sequence[PolicyInfo], highlight: set[int], chain: Sequence[int] = (), w_step: int = 34,
                h_step: int = 60) -> str:
    """Every policy, one row per generation, coloured by fate and named with its proposer; a ring marks
    the validated ones (`highlight`), a thick orange line the chosen policy's lineage (`chain`)."""
    by_gen: dict[int, list[PolicyInfo]] = {}
    for p in policies:
        by_gen.setdefault(max(p.generation, 0), []).append(p)
    pos = {}
    for gen, items in sorted(by_gen.items()):
        for i, p in enumerate(items):
            pos[p.id] = (30 + i * w_step, 30 + gen * h_step)
    reach = 0.6 * 9 * max((len(p.label) + 1 + len(p.proposer) for p in policies), default=0)  # rotated 40 degrees
    width = max((x for x, _ in pos.values()), default=0) + 60 + 0.77 * reach
    height = max((y for _, y in pos.values()), default=0) + 50 + 0.65 * reach
    colours = {"evaluated": "#4a7", "pruned": "#db3", "rejected": "#c44", "duplicate": "#c9c", "proposed": "#999"}
    out = [f'<svg id="lineage" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">']
    for p in policies:
        for parent in p.parent_ids:
            if parent in pos:
                (x0, y0), (x1, y1) = pos[parent], pos[p.id]
                on = p.id in chain and parent in chain
                stroke = 'stroke="#d80" stroke-width="3" class="chain"' if on else 'stroke="#bbb"'
                out.append(f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y1}" {stroke}/>')
    for p in policies:
        x, y = pos[p.id]
        ring = ' stroke="#000" stroke-width="2"' if p.id in highlight else ""
        why = f" — {p.rejection_reason}" if p.rejection_reason else ""
        note = edit_note(p.meta)
        out.append(f'<circle cx="{x}" cy="{y}" r="7" fill="{colours.get(p.status, "#999")}"{ring}>'
                   f'<title>{escape(p.label)} gen {p.generation} {escape(p.proposer)} {p.status}{escape(why)}'
                   f'{escape(chr(10) + note if note else "")}</title></circle>'
                   f'<text class="node" x="{x}" y="{y + 15}" font-size="9" transform="rotate(40 {x} {y + 15})">'
                   f'{escape(p.label)}<tspan class="by" fill="#777"> {escape(p.proposer)}</tspan></text>')
    out.append("</svg>")
    return "".join(out)


def run_train_ids(store: Store, run_id: int) -> list[str]:
    """The run's train tasks: those the Standard baseline ran (every baseline runs them all)."""
    standard = store.baselines(run_id).get("standard")
    if standard is None:
        return []
    return sorted({e.result.task_id for e in store.evaluations(run_id, TRAIN, [standard])})


def render_html(store: Store, run: RunInfo, accounting: Accounting | None = None) -> str:
    validations = store.validations(run.id)
    policies = store.policies(run.id)
    points = train_points(store, run.id, run_train_ids(store, run.id))
    acc = accounting or run_accounting(store, run)
    rows = comparison_rows(validations)
    verdicts = "".join(f"<li><b>{escape(r.label)}</b>: {escape(r.verdict)}</li>" for r in rows if r.role == "candidate")
    baselines = store.baselines(run.id)
    focus = {p.id for p in policies if p.proposer in PROPOSED_BY} | {baselines[r] for r in (REFERENCE, "full")
                                                                      if r in baselines}
    return "".join([
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>AKV run {escape(run.name)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>Evolution run {escape(run.name)}</h1><p>{escape(summary_line(validations))}</p>",
        f"<p>status {escape(run.status)} · seed {run.seed} · code {escape(run.code_version)} · "
        f"suite {escape(run.suite_version)} · {len(policies)} policies</p>",
        _rounds(store, run.id),
        f"<h2>Held-out comparison</h2><p>{escape(TABLE_NOTE)}</p>",
        html_table(text_table(rows), "comparison", ["champ" if r.champion else "" for r in rows]),
        f"<ul id='verdicts'>{verdicts}</ul>" if verdicts else "",
        _chosen(acc),
        "<h2>Policies by proposer</h2><p>Every stored policy once, by its fate: rejected (invalid, or nothing new), "
        "duplicate, pruned by the cascade, evaluated on the whole train split (or pending); then how many are on "
        "the train front and were validated as finalists; ★ marks the champion's proposer. Seeds and baselines "
        "are given to the run, not proposed.</p>",
        html_table(tally_table(acc.tallies), "proposers", ["given" if t.given else "" for t in acc.tallies]),
        f"<h2>Pareto front</h2><p>{escape(PARETO_NOTE)}</p>",
        pareto_svg(points, validations, focus=focus),
        "<h2>Lineage</h2><p>One row per generation, each policy named with its proposer; green evaluated, "
        "yellow pruned, red rejected, violet duplicate; a black ring: validated; orange: the lineage of the "
        f"{escape(chosen_title(acc))}; hover for the edit and the fate.</p>",
        lineage_svg(policies, {v.policy_id for v in validations}, [n.policy_id for n in acc.lineage]),
        _per_task_table(store, run.id, validations),
        _diagnoses(policies),
        _rejections(policies),
        "</body></html>",
    ])


PARETO_NOTE = ("Circles: train means of every fully evaluated policy (line: the train front); squares: held-out "
               "means of the validated policies. The cost axis spans the candidates, the expert and full; a policy "
               "far beyond it (often Text Engineering) is drawn just past the axis' end, under 'beyond', with an "
               "arrowhead, and its label gives its real cost.")


def html_table(cells: Sequence[Sequence[str]], table_id: str, classes: Sequence[str] = ()) -> str:
    """A header row and body rows of text cells (a cell's lines stay lines), with a class per body row."""
    head = "".join(f"<th>{escape(c)}</th>" for c in cells[0])
    body = "".join(f'<tr class="{cls}">' + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>"
                   for row, cls in zip(cells[1:], [*classes, *[""] * len(cells)]))
    return f'<table id="{table_id}"><tr>{head}</tr>{body}</table>'


def _chosen(acc: Accounting) -> str:
    """The champion's (else the best validated candidate's) policy text and lineage."""
    if acc.chosen is None:
        return ""
    title = chosen_title(acc)
    return (f"<h2>The {escape(title)}</h2><pre id='chosen-policy'>{escape(acc.chosen_text or '')}</pre>"
            f"<p>Its lineage, nearest first: each policy, the proposer that made it, and its edit.</p>"
            + html_table(lineage_table(acc.lineage), "chosen-lineage"))


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
