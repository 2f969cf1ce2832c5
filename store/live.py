"""What a refining proxy deploys (`akv proxy --refine`): the live policy of each trace set and its
lineage, the evolutions tried on its traffic, and what each served conversation cost.

The live policy of a set is its latest lineage entry. Every change is one inserted row in one
transaction, checked against the entry it replaces where it matters (a promotion judged against
a live policy that a rollback replaced meanwhile is refused), so a process killed at any moment
leaves the live policy as it was or wholly changed, never half.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any, Callable, Mapping, Sequence

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from store.errors import StoreError
from store.records import ConversationCost, LiveEntry, PolicyTotals, RoundInfo
from store.schema import ConversationSavings, LivePolicyEntry, RefineRound, utcnow

FINISHED_ROUND = ("promoted", "kept", "dry_run", "failed", "timed_out", "interrupted")


class LiveChanged(StoreError):
    """The live policy is no longer the one a change was decided against."""


class NoSuchEntry(StoreError):
    """A lineage entry that the set does not have, or nothing to roll back to."""


class LivePolicies:
    """The store's door to live policies, refinement rounds and conversation savings (`Store.live`);
    `tx()` opens one transaction of the store at `display_url`."""

    def __init__(self, tx: Callable[[], AbstractContextManager[Session]], display_url: str) -> None:
        self._tx, self._display_url = tx, display_url

    # ---- the live policy and its lineage -----------------------------------------------------------
    def live(self, set_name: str) -> LiveEntry | None:
        """The set's live policy: its latest entry (None before a refining proxy started on it)."""
        with self._tx() as s:
            row = s.scalar(select(LivePolicyEntry).where(LivePolicyEntry.set_name == set_name)
                           .order_by(LivePolicyEntry.id.desc()).limit(1))
            return None if row is None else _entry(row)

    def lineage(self, set_name: str) -> list[LiveEntry]:
        """Every entry of the set, oldest first."""
        with self._tx() as s:
            rows = s.scalars(select(LivePolicyEntry).where(LivePolicyEntry.set_name == set_name)
                             .order_by(LivePolicyEntry.id))
            return [_entry(r) for r in rows]

    def start(self, set_name: str, name: str, text: str) -> tuple[LiveEntry, bool]:
        """(the live entry, whether it is a new start) for a proxy started with policy `text`.

        The same policy as the set's last start is a restart: the live policy goes on, whatever it
        was promoted or rolled back to since. Another policy is a new start and becomes live; its
        label gets a `-vN` suffix when an earlier entry used it for another text.
        """
        with self._tx() as s:
            rows = list(s.scalars(select(LivePolicyEntry).where(LivePolicyEntry.set_name == set_name)
                                  .order_by(LivePolicyEntry.id)))
            starts = [r for r in rows if r.kind == "start"]
            if starts and starts[-1].text == text:
                return _entry(rows[-1]), False
            row = LivePolicyEntry(set_name=set_name, kind="start", name=_free_label(rows, name, text), text=text,
                                  figures={}, note="the proxy started with it")
            s.add(row)
            s.flush()
            return _entry(row), True

    def promote(self, set_name: str, judged_against: int, name: str, text: str, run_name: str, policy_id: int,
                figures: Mapping[str, Any], note: str) -> LiveEntry:
        """Make a candidate live, if the live policy is still the entry it was judged against (LiveChanged)."""
        with self._tx() as s:
            current = self._current(s, set_name)
            if current is None or current.id != judged_against:
                raise LiveChanged(f"the live policy of {set_name!r} changed while the candidate was judged "
                                  f"(judged against entry #{judged_against}, live is "
                                  f"#{current.id if current is not None else 'none'}): nothing promoted")
            row = LivePolicyEntry(set_name=set_name, kind="promotion", name=name, text=text, run_name=run_name,
                                  policy_id=policy_id, figures=dict(figures), note=note)
            s.add(row)
            s.flush()
            return _entry(row)

    def rollback(self, set_name: str, to: int | None = None) -> LiveEntry:
        """Make entry `to`'s policy live again; by default the one that was live before the current
        policy first went live. NoSuchEntry when there is none, or `to` is not an entry of the set."""
        with self._tx() as s:
            rows = {r.id: r for r in s.scalars(select(LivePolicyEntry).where(LivePolicyEntry.set_name == set_name))}
            if not rows:
                raise NoSuchEntry(f"NAME: trace set {set_name!r} has no live policy in {self._display_url} "
                                  "(no refining proxy has served it)")
            current = rows[max(rows)]
            origin = current.restores if current.restores is not None else current.id
            if to is None:
                earlier = [i for i in rows if i < origin]
                if not earlier:
                    raise NoSuchEntry(f"{set_name!r}: nothing to roll back to: its live policy {current.name} "
                                      f"(#{origin}) is the first it had; --to ID restores a later one")
                to = max(earlier)
            if to not in rows:
                raise NoSuchEntry(f"--to: {set_name!r} has no entry #{to} (`akv proxy policies {set_name}` lists them)")
            target = rows[to]
            restores = target.restores if target.restores is not None else target.id
            if restores == origin:
                raise NoSuchEntry(f"--to: entry #{to} holds {target.name}, which is already live")
            row = LivePolicyEntry(set_name=set_name, kind="rollback", name=target.name, text=target.text,
                                  run_name=target.run_name, policy_id=target.policy_id, restores=restores,
                                  figures={}, note=f"rolled back from {current.name} (#{origin})")
            s.add(row)
            s.flush()
            return _entry(row)

    def rolled_back(self, set_name: str) -> set[str]:
        """The texts of every policy a rollback replaced: a refiner never promotes them again."""
        entries = self.lineage(set_name)
        return {replaced.text for replaced, entry in zip(entries, entries[1:]) if entry.kind == "rollback"}

    @staticmethod
    def _current(s: Session, set_name: str) -> LivePolicyEntry | None:
        return s.scalar(select(LivePolicyEntry).where(LivePolicyEntry.set_name == set_name)
                        .order_by(LivePolicyEntry.id.desc()).limit(1))

    # ---- refinement rounds -------------------------------------------------------------------------
    def begin_round(self, set_name: str, run_name: Callable[[int], str], traces: int, through: datetime | None,
                    live_id: int | None) -> RoundInfo:
        """A new running round, numbered after the set's last; `run_name(number)` names its run."""
        with self._tx() as s:
            number = (s.scalar(select(func.max(RefineRound.number)).where(RefineRound.set_name == set_name)) or 0) + 1
            row = RefineRound(set_name=set_name, number=number, run_name=run_name(number), traces=traces,
                              through=through, live_id=live_id, figures={}, status="running", detail="")
            s.add(row)
            s.flush()
            return _round(row)

    def finish_round(self, round_id: int, status: str, detail: str, figures: Mapping[str, Any] | None = None) -> None:
        if status not in FINISHED_ROUND:
            raise ValueError(f"a round ends as one of {', '.join(FINISHED_ROUND)}, not {status!r}")
        with self._tx() as s:
            row = s.get(RefineRound, round_id)
            row.status, row.detail, row.finished_at = status, detail, utcnow()
            if figures is not None:
                row.figures = dict(figures)

    def interrupt_running(self, set_name: str, detail: str) -> list[RoundInfo]:
        """End the set's running rounds as interrupted (their refiner died); returns them."""
        with self._tx() as s:
            rows = list(s.scalars(select(RefineRound).where(RefineRound.set_name == set_name,
                                                            RefineRound.status == "running")))
            for row in rows:
                row.status, row.detail, row.finished_at = "interrupted", detail, utcnow()
            return [_round(r) for r in rows]

    def rounds(self, set_name: str) -> list[RoundInfo]:
        """Every round of the set, first to latest."""
        with self._tx() as s:
            rows = s.scalars(select(RefineRound).where(RefineRound.set_name == set_name).order_by(RefineRound.number))
            return [_round(r) for r in rows]

    def round_outcomes(self, set_name: str) -> dict[str, int]:
        """status -> rounds of the set."""
        with self._tx() as s:
            return dict(s.execute(select(RefineRound.status, func.count(RefineRound.id))
                                  .where(RefineRound.set_name == set_name).group_by(RefineRound.status)).all())

    # ---- what served conversations cost ------------------------------------------------------------
    def measured(self, set_name: str) -> dict[str, str]:
        """trace id -> the digest it was measured at."""
        with self._tx() as s:
            return dict(s.execute(select(ConversationSavings.trace_id, ConversationSavings.digest)
                                  .where(ConversationSavings.set_name == set_name)).all())

    def save_costs(self, set_name: str, costs: Sequence[ConversationCost]) -> None:
        """Store (or replace) the measurements of these conversations, in one transaction."""
        with self._tx() as s:
            known = {r.trace_id: r for r in s.scalars(select(ConversationSavings).where(
                ConversationSavings.set_name == set_name,
                ConversationSavings.trace_id.in_([c.trace_id for c in costs])))}
            for cost in costs:
                row = known.get(cost.trace_id) or ConversationSavings(set_name=set_name, trace_id=cost.trace_id)
                for field in ("digest", "policy", "requests", "cost_usd", "expert_cost_usd", "full_cost_usd",
                              "lost_reuses", "reuses", "drops", "repositions", "skipped"):
                    setattr(row, field, getattr(cost, field))
                row.measured_at = utcnow()
                s.add(row)

    def totals(self, set_name: str) -> list[PolicyTotals]:
        """Per served policy, its measured conversations summed (skipped ones counted apart), by name."""
        c = ConversationSavings
        measured = c.skipped.is_(None)
        with self._tx() as s:
            rows = s.execute(select(
                c.policy, func.count(c.id).filter(measured), func.coalesce(func.sum(c.requests), 0),
                func.coalesce(func.sum(c.cost_usd), 0.0), func.coalesce(func.sum(c.expert_cost_usd), 0.0),
                func.coalesce(func.sum(c.full_cost_usd), 0.0), func.coalesce(func.sum(c.lost_reuses), 0),
                func.coalesce(func.sum(c.reuses), 0), func.coalesce(func.sum(c.drops), 0),
                func.coalesce(func.sum(c.repositions), 0), func.count(c.id).filter(c.skipped.is_not(None)),
            ).where(c.set_name == set_name).group_by(c.policy).order_by(c.policy)).all()
        return [PolicyTotals(r[0], int(r[1]), int(r[2]), float(r[3]), float(r[4]), float(r[5]), int(r[6]), int(r[7]),
                             int(r[8]), int(r[9]), int(r[10])) for r in rows]

    def skipped(self, set_name: str) -> list[ConversationCost]:
        """The conversations that could not be measured, with why."""
        with self._tx() as s:
            rows = s.scalars(select(ConversationSavings).where(ConversationSavings.set_name == set_name,
                                                               ConversationSavings.skipped.is_not(None))
                             .order_by(ConversationSavings.trace_id))
            return [ConversationCost(r.trace_id, r.digest, r.policy, skipped=r.skipped) for r in rows]


def _free_label(rows: Sequence[LivePolicyEntry], name: str, text: str) -> str:
    """`name`, or `name-vN` when an entry of the set already uses it for another text."""
    taken = {r.name: r.text for r in rows}
    label, n = name, 1
    while label in taken and taken[label] != text:
        n += 1
        label = f"{name}-v{n}"
    return label


def _entry(row: LivePolicyEntry) -> LiveEntry:
    return LiveEntry(row.id, row.set_name, row.kind, row.name, row.text, row.run_name, row.policy_id, row.restores,
                     dict(row.figures or {}), row.note or "", row.created_at)


def _round(row: RefineRound) -> RoundInfo:
    return RoundInfo(row.id, row.set_name, row.number, row.run_name, row.status, row.detail or "", row.traces,
                     row.through, row.live_id, dict(row.figures or {}), row.started_at, row.finished_at)
