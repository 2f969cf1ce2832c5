"""The research plan walked against what is visible: the next tool calls, or the final answer.

`Planner.answer` interprets a task's plan (`find`, `pick`, `cell` steps and a `payload` per
leg, see questions.py) on one Context and settles what the visible evidence allows: the final
answer, the tool calls that fetch what is missing (`Need`), or `GiveUp`. Inside, a lookup that
finds its evidence out of view stops the step it serves (`_Missing`, `_Blocked`, `_Stuck`); each
step and each leg's answer turns that back into a value at once, so no exception leaves. Every
fact it takes is recorded in `used` (the indices of the messages it came from), so the agent
can say exactly which messages its action depended on. A fact that decides nothing is not
read: a finished leg is walked on its notes, and a leg's year document is read only when
every leg is done and the answer is due.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from sandbox.suites.localcomp.context import Context, Hit
from sandbox.suites.localcomp.documents import LIST_SEPARATOR
from sandbox.suites.localcomp.reading import Article


@dataclass(frozen=True)
class Need:
    """Evidence the next step depends on is not visible: fetch it with this tool call."""

    tool: str
    arguments: dict[str, str]
    why: str


@dataclass(frozen=True)
class GiveUp:
    """The research cannot go on: no visible document or row fits what the plan asks for."""

    reason: str


class _Missing(Exception):
    """A lookup's evidence is not visible: the step it serves needs `need` first."""

    def __init__(self, need: Need) -> None:
        super().__init__(need.why)
        self.need = need


class _Blocked(Exception):
    """A step depends on a document or value this step of the agent has not settled yet."""


class _Stuck(Exception):
    """No document or row fits: the planner gives up (the message says what is missing)."""


@dataclass
class Binding:
    docid: str
    title: str


# How the agent words a dead end: (var, hit, the article it read, wanted kind, wanted fields, whether it
# was the latest message) -> a line.
RuledOut = Callable[[str, Hit, Article, str, Mapping[str, str], bool], str]


def ruled_out_plainly(var: str, hit: Hit, article: Article, kind: str, where: Mapping[str, str],
                      just_read: bool) -> str:
    return f"Ruled out: {hit['title']} [{hit['docid']}]"


class Planner:
    """Walks the plan against one Context.

    `answer` returns the final answer, GiveUp, or the tool calls to make next:
    every independent need of the first unfinished leg (`batch`), or only the first of them;
    once every leg is done, the year documents to read again. A leg's year is only needed for
    the final answer, so a lost one does not hold up later legs. With `judge_at_once`, the
    document just read is judged against the hop it was opened for before anything else (even
    when the search page that listed it is gone), as a reader does.
    """

    def __init__(self, plan: Mapping[str, Any], ctx: Context, batch: bool = True,
                 ruled_out: RuledOut = ruled_out_plainly, judge_at_once: bool = False):
        self.plan, self.ctx, self.batch, self.ruled_out = plan, ctx, batch, ruled_out
        self.judge_at_once = judge_at_once
        self.bound: dict[str, Binding] = {}
        self.values: dict[str, str] = {}
        self.notes: list[str] = []
        self.ruled: list[str] = []  # docids this step found to be dead ends
        self.used: set[int] = set()

    def answer(self) -> tuple[str, str] | list[Need] | GiveUp:
        """(final answer, explanation), the tool calls to make next, or GiveUp."""
        try:
            return self._answer()
        except _Stuck as stuck:
            return GiveUp(str(stuck))

    def _answer(self) -> tuple[str, str] | list[Need]:
        for leg in self.plan["legs"]:
            needs = self._walk_steps(leg["steps"])
            if needs:
                return needs
        years: list[tuple[int, str, str]] = []
        rereads: list[Need] = []
        for leg in self.plan["legs"]:
            found = self._leg_year(leg)
            if isinstance(found, Need):
                rereads.append(found)
                if not self.batch:
                    break
            else:
                years.append(found)
        if rereads:
            return distinct(rereads)
        said = "; ".join(f"{label} = {year} ({entity})" for year, entity, label in years)
        if self.plan["combine"] == "earlier":
            return min(years)[1], said
        return str(max(years)[0] - min(years)[0]), said

    def _leg_year(self, leg: Mapping[str, Any]) -> tuple[int, str, str] | Need:
        """(year, entity, label) of a leg whose steps are all settled, or the call that re-reads its evidence."""
        try:
            return int(self._payload(leg["payload"])), self._value(leg["entity"]), leg["label"]
        except _Missing as missing:
            return missing.need

    def _walk_steps(self, steps: list[Mapping[str, Any]]) -> list[Need]:
        needs = []
        for step in steps:
            need = self._step(step)
            if need is not None:
                needs.append(need)
                if not self.batch:
                    break
        return distinct(needs)

    def _step(self, step: Mapping[str, Any]) -> Need | None:
        """Settle one step of a leg: None when it is settled or waits for a step above, else its need."""
        try:
            match step["op"]:
                case "find":
                    self._find(step)
                case "pick":
                    self._pick(step)
                case "cell":
                    self._cell(step)
                case op:
                    raise ValueError(f"plan step op {op!r}: expected find, pick or cell")
        except _Missing as missing:
            return missing.need
        except _Blocked:
            return None  # it waits for a step above
        return None

    def _use(self, *indices: int) -> None:
        self.used.update(i for i in indices if i >= 0)

    def _bind_noted(self, var: str) -> None:
        self.bound[var] = Binding(*self.ctx.found[var])
        self._use(self.ctx.found_src[var])

    def doc(self, var: str) -> Article:
        if var not in self.bound:
            raise _Blocked(var)
        b = self.bound[var]
        if b.docid not in self.ctx.docs:
            raise _reread(b, "it is")
        self._use(*self.ctx.doc_src[b.docid])
        return self.ctx.docs[b.docid]

    def _value(self, ref: Mapping[str, Any]) -> str:
        var = ref["var"]
        if "field" not in ref:
            if var not in self.values:
                raise _Blocked(var)
            return self.values[var]
        if ref["field"] == "Name" and var in self.bound:
            return self.bound[var].title
        article = self.doc(var)
        if ref["field"] not in article.fields:
            b = self.bound[var]
            raise _reread(b, f"its {ref['field']} is")
        value = article.fields[ref["field"]]
        return value.split(LIST_SEPARATOR)[ref["item"]] if "item" in ref else value

    def _fill(self, template: str, refs: Mapping[str, Any]) -> str:
        return template.format(**{k: self._value(r) for k, r in refs.items()}) if refs else template

    def _find(self, step: Mapping[str, Any]) -> None:
        var, kind = step["var"], step["kind"]
        if var in self.ctx.found:
            self._bind_noted(var)
            return
        refs = step.get("refs", {})
        where = {k: self._fill(v, refs) for k, v in step["where"].items()}
        for docid, article in self.ctx.docs.items():
            if _judge(article, kind, where):
                self._use(*self.ctx.doc_src[docid])
                self.bound[var] = Binding(article.docid, article.title)
                self.notes.append(f"Found {var}: {article.title} [{article.docid}]")
                return
        if self.judge_at_once:
            self._judge_just_read(var, kind, where)
        for query in (self._fill(q, refs) for q in step["queries"]):
            if query not in self.ctx.searches:
                raise _Missing(Need("search", {"query": query}, f"Searching for {var}."))
            self._use(*self.ctx.search_src[query])
            not_titles = {self._fill(t, refs) for t in step.get("not_titles", ())}
            for hit in self.ctx.searches[query]:
                if ("Name" in where and hit["title"] != where["Name"]) or hit["title"] in not_titles:
                    continue  # the title says it is another document
                ruled_at = self.ctx.ruled_out_as(var, hit["docid"])
                if ruled_at is not None:
                    self._use(ruled_at)
                    continue
                seen = self.ctx.docs.get(hit["docid"])
                if seen is not None and _judge(seen, kind, where) is False:
                    self._use(*self.ctx.doc_src[hit["docid"]])
                    just_read = self.ctx.doc_src[hit["docid"]][-1] == self.ctx.latest
                    self.notes.append(self.ruled_out(var, hit, seen, kind, where, just_read))
                    self.ruled.append(hit["docid"])
                    continue
                raise _Missing(Need("get_document", {"docid": hit["docid"]},
                                    f"Checking whether {hit['title']} [{hit['docid']}] is {var}."))
        raise _Stuck(f"no document found for {var}")

    def _judge_just_read(self, var: str, kind: str, where: Mapping[str, str]) -> None:
        """Rule out the document just read when it is opened for this hop and does not fit it."""
        docid = self.ctx.just_read
        if docid is None or any(b.docid == docid for b in self.bound.values()) or \
                self.ctx.ruled_out_as(var, docid) is not None:
            return
        article = self.ctx.docs[docid]
        if _judge(article, kind, where) is False:
            self._use(*self.ctx.doc_src[docid])
            hit = {"docid": docid, "title": article.title, "snippet": ""}
            self.notes.append(self.ruled_out(var, hit, article, kind, where, True))
            self.ruled.append(docid)
            self.ctx.ruled_out[(var, docid)] = self.ctx.latest  # settled for the rest of this step

    def _pick(self, step: Mapping[str, Any]) -> None:
        var = step["var"]
        if var in self.ctx.found:
            self._bind_noted(var)
            return
        scores = [(int(self._value({"var": v, "field": step["field"]})), v) for v in step["among"]]
        best = max(scores)[1]
        self.bound[var] = self.bound[best]
        self.notes.append(f"Found {var}: {self.bound[best].title} [{self.bound[best].docid}]")

    def _cell(self, step: Mapping[str, Any]) -> None:
        var = step["var"]
        if var in self.ctx.noted:
            self.values[var] = self.ctx.noted[var]
            self._use(self.ctx.noted_src[var])
            return
        exclude = {k: self._fill(v, step.get("refs", {})) for k, v in step.get("exclude", {}).items()}
        for row in self._table(step["doc"], step["table"]):
            if all(row.get(k, "").endswith(v) for k, v in step["match"].items()) and \
                    not any(row.get(k) == v for k, v in exclude.items()):
                self.values[var] = row[step["column"]]
                self.notes.append(f"Noted {var}: {self.values[var]}")
                return
        raise _Stuck(f"no row for {var}")

    def _table(self, var: str, table: str) -> list[dict[str, str]]:
        rows = self.doc(var).tables.get(table)
        if rows is None:
            b = self.bound[var]
            raise _reread(b, f"its {table} table is")
        return rows

    def _payload(self, payload: Mapping[str, Any]) -> str:
        if "field" in payload:
            return self._value(payload)
        refs = payload.get("refs", {})
        want = {k: self._fill(v, refs) for k, v in payload["row"].items()}
        for row in self._table(payload["var"], payload["table"]):
            if all(row.get(k) == v for k, v in want.items()):
                return row[payload["column"]]
        raise _Stuck(f"no {payload['column']} for {want}")


def _reread(b: Binding, what: str) -> _Missing:
    """The document bound to a variable must be read again: `what` ("its X is") went out of view."""
    return _Missing(Need("get_document", {"docid": b.docid},
                         f"Re-reading {b.title} [{b.docid}]: {what} no longer in view."))


def _judge(article: Article, kind: str, where: Mapping[str, str]) -> bool | None:
    """Does the article satisfy the constraints? None when what is visible of it cannot tell."""
    if article.kind != kind:
        return False
    if any(k not in article.fields for k in where):
        return None
    return all(article.fields[k] == v for k, v in where.items())


def distinct(needs: list[Need]) -> list[Need]:
    """One call per distinct tool and arguments (two steps may need the same document)."""
    seen: dict[str, Need] = {}
    for need in needs:
        seen.setdefault(need.tool + json.dumps(need.arguments, sort_keys=True), need)
    return list(seen.values())
