"""The scripted agent: a deterministic navigator that follows a task's research plan.

It keeps no memory between steps. Each step it re-reads what it can still see (the messages
marked visible) and works out the next action from the plan in `Task.meta`:

- Its own assistant messages carry short notes of *identity* ("Found A.e: Chlorine [lc-01690]",
  "Ruled out: Manganese [lc-03126]"), as a careful human researcher would write down.
- The *values* it needs (a year, a subdivision count, a producer's name) it reads only from
  documents that are visible now. When one is gone (kv-dropped, summarized, replaced by a
  placeholder) it fetches the document again and pays for those tokens again.
- The final answer is computed from visible documents only, never from the gold data.

So its accuracy measures how well a cache policy retains evidence, not how good a model is.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from sandbox.suite import AgentAction, AgentView, Task
from sandbox.suites.localcomp.documents import LIST_SEPARATOR
from sandbox.suites.localcomp.reading import Article, read_articles

MAX_STEPS = 60
_FOUND = re.compile(r"^Found (\S+): (.+) \[(lc-\d{5})\]$", re.MULTILINE)
_NOTED = re.compile(r"^Noted (\S+): (.+)$", re.MULTILINE)
_RULED_OUT = re.compile(r"^Ruled out: .+ \[(lc-\d{5})\]$", re.MULTILINE)
_UNPAIRED_RESULT = "[result of get_document]"  # a tool result whose call was summarized away


@dataclass
class Context:
    """What the agent can see now."""

    docs: dict[str, Article] = field(default_factory=dict)
    searches: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    found: dict[str, tuple[str, str]] = field(default_factory=dict)  # var -> (docid, title)
    noted: dict[str, str] = field(default_factory=dict)  # value var -> value
    ruled_out: set[str] = field(default_factory=set)


def read_context(messages: list[Mapping[str, Any]], visible: list[bool]) -> Context:
    """Notes come from the agent's own messages and from summaries of them (the extractive
    summarizer keeps the agent's lines whole). Documents come only from whole tool results:
    a summary's stray infobox row cannot be tied to its article for sure, so a summarized
    document counts as lost and is fetched again."""
    ctx = Context()
    calls: dict[str, tuple[str, dict[str, Any]]] = {}
    for message, seen in zip(messages, visible):
        content = message.get("content") or ""
        if not seen or not isinstance(content, str):
            continue
        role = message.get("role")
        if role != "tool":
            ctx.found.update({v: (d, t) for v, t, d in _FOUND.findall(content)})
            ctx.noted.update(dict(_NOTED.findall(content)))
            ctx.ruled_out.update(_RULED_OUT.findall(content))
        for call in message.get("tool_calls") or ():
            fn = call.get("function", {})
            calls[call.get("id", "")] = (fn.get("name", ""), _arguments(fn.get("arguments")))
        if role == "tool":
            name, args = calls.get(message.get("tool_call_id", ""), ("", {}))
            if name == "search" and _is_hit_list(content):
                ctx.searches[args.get("query", "")] = json.loads(content)
                continue
        if role == "tool" or (role == "user" and content.startswith(_UNPAIRED_RESULT)):
            for article in read_articles(content):
                ctx.docs[article.docid] = _merge(ctx.docs.get(article.docid), article)
    return ctx


def _arguments(raw: Any) -> dict[str, Any]:
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _is_hit_list(content: str) -> bool:
    try:
        value = json.loads(content)
    except json.JSONDecodeError:
        return False
    return isinstance(value, list) and all(isinstance(h, dict) and "docid" in h for h in value)


def _merge(old: Article | None, new: Article) -> Article:
    """Two visible copies (or fragments) of one document: the union of what they show."""
    if old is None:
        return new
    return Article(new.docid, new.title, new.kind or old.kind, {**old.fields, **new.fields},
                   {**old.tables, **new.tables})


def _judge(article: Article, kind: str, where: Mapping[str, str]) -> bool | None:
    """Does the article satisfy the constraints? None when what is visible of it cannot tell."""
    if article.kind != kind:
        return False
    if any(k not in article.fields for k in where):
        return None
    return all(article.fields[k] == v for k, v in where.items())


class _Need(Exception):
    """Evidence the next step depends on is not visible: fetch it with this tool call."""

    def __init__(self, tool: str, arguments: dict[str, str], why: str):
        super().__init__(why)
        self.tool, self.arguments, self.why = tool, arguments, why


class _Blocked(Exception):
    """A step depends on a document or value this step of the agent has not settled yet."""


class _GiveUp(Exception):
    pass


@dataclass
class Binding:
    docid: str
    title: str


class Planner:
    """Walks the plan against one Context and settles what the visible evidence allows.

    `answer` returns the final answer, or raises _GiveUp, or returns the tool calls to make next:
    every independent need of the first unfinished leg at once (the three producers are
    searched in one batch), or, once every leg is done, every year document to read again.
    A leg's year is only needed for the final answer, so a lost one does not hold up later legs.
    """

    def __init__(self, plan: Mapping[str, Any], ctx: Context):
        self.plan, self.ctx = plan, ctx
        self.bound: dict[str, Binding] = {}
        self.values: dict[str, str] = {}
        self.notes: list[str] = []

    def answer(self) -> tuple[str, str] | list[_Need]:
        """(final answer, explanation), or the tool calls to make next."""
        years: list[tuple[int, str, str]] = []
        rereads: list[_Need] = []
        for leg in self.plan["legs"]:
            needs = self._walk_steps(leg["steps"])
            if needs:
                return needs
            try:
                years.append((int(self._payload(leg["payload"])), self._value(leg["entity"]), leg["label"]))
            except _Need as need:
                rereads.append(need)
        if rereads:
            return _distinct(rereads)
        said = "; ".join(f"{label} = {year} ({entity})" for year, entity, label in years)
        if self.plan["combine"] == "earlier":
            return min(years)[1], said
        return str(max(years)[0] - min(years)[0]), said

    def _walk_steps(self, steps: list[Mapping[str, Any]]) -> list[_Need]:
        needs = []
        for step in steps:
            try:
                getattr(self, "_" + step["op"])(step)
            except _Need as need:
                needs.append(need)
            except _Blocked:
                continue  # it waits for a step above
        return _distinct(needs)

    def doc(self, var: str) -> Article:
        if var not in self.bound:
            raise _Blocked(var)
        b = self.bound[var]
        if b.docid not in self.ctx.docs:
            raise _Need("get_document", {"docid": b.docid},
                        f"Re-reading {b.title} [{b.docid}]: it is no longer in view.")
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
            raise _Need("get_document", {"docid": b.docid},
                        f"Re-reading {b.title} [{b.docid}]: its {ref['field']} is no longer in view.")
        value = article.fields[ref["field"]]
        return value.split(LIST_SEPARATOR)[ref["item"]] if "item" in ref else value

    def _fill(self, template: str, refs: Mapping[str, Any]) -> str:
        return template.format(**{k: self._value(r) for k, r in refs.items()}) if refs else template

    def _find(self, step: Mapping[str, Any]) -> None:
        var = step["var"]
        if var in self.ctx.found:
            self.bound[var] = Binding(*self.ctx.found[var])
            return
        refs = step.get("refs", {})
        where = {k: self._fill(v, refs) for k, v in step["where"].items()}
        for article in self.ctx.docs.values():
            if _judge(article, step["kind"], where):
                self.bound[var] = Binding(article.docid, article.title)
                self.notes.append(f"Found {var}: {article.title} [{article.docid}]")
                return
        for query in (self._fill(q, refs) for q in step["queries"]):
            if query not in self.ctx.searches:
                raise _Need("search", {"query": query}, f"Searching for {var}.")
            for hit in self.ctx.searches[query]:
                if hit["docid"] in self.ctx.ruled_out or ("Name" in where and hit["title"] != where["Name"]):
                    continue
                seen = self.ctx.docs.get(hit["docid"])
                if seen is not None and _judge(seen, step["kind"], where) is False:
                    self.notes.append(f"Ruled out: {hit['title']} [{hit['docid']}]")
                    continue
                raise _Need("get_document", {"docid": hit["docid"]},
                            f"Checking whether {hit['title']} [{hit['docid']}] is {var}.")
        raise _GiveUp(f"no document found for {var}")

    def _pick(self, step: Mapping[str, Any]) -> None:
        var = step["var"]
        if var in self.ctx.found:
            self.bound[var] = Binding(*self.ctx.found[var])
            return
        scores = [(int(self._value({"var": v, "field": step["field"]})), v) for v in step["among"]]
        best = max(scores)[1]
        self.bound[var] = self.bound[best]
        self.notes.append(f"Found {var}: {self.bound[best].title} [{self.bound[best].docid}]")

    def _cell(self, step: Mapping[str, Any]) -> None:
        var = step["var"]
        if var in self.ctx.noted:
            self.values[var] = self.ctx.noted[var]
            return
        exclude = {k: self._fill(v, step.get("refs", {})) for k, v in step.get("exclude", {}).items()}
        for row in self._table(step["doc"], step["table"]):
            if all(row.get(k, "").endswith(v) for k, v in step["match"].items()) and \
                    not any(row.get(k) == v for k, v in exclude.items()):
                self.values[var] = row[step["column"]]
                self.notes.append(f"Noted {var}: {self.values[var]}")
                return
        raise _GiveUp(f"no row for {var}")

    def _table(self, var: str, table: str) -> list[dict[str, str]]:
        rows = self.doc(var).tables.get(table)
        if rows is None:
            b = self.bound[var]
            raise _Need("get_document", {"docid": b.docid},
                        f"Re-reading {b.title} [{b.docid}]: its {table} table is no longer in view.")
        return rows

    def _payload(self, payload: Mapping[str, Any]) -> str:
        if "field" in payload:
            return self._value(payload)
        refs = payload.get("refs", {})
        want = {k: self._fill(v, refs) for k, v in payload["row"].items()}
        for row in self._table(payload["var"], payload["table"]):
            if all(row.get(k) == v for k, v in want.items()):
                return row[payload["column"]]
        raise _GiveUp(f"no {payload['column']} for {want}")


class ScriptedAgent:
    name = "scripted"

    def __init__(self, task: Task, max_steps: int = MAX_STEPS):
        self.task, self.max_steps = task, max_steps

    def act(self, view: AgentView) -> AgentAction:
        if view.step >= self.max_steps:
            return _give_up(f"I stop here: the step budget of {self.max_steps} is spent.")
        planner = Planner(self.task.meta["plan"], read_context(list(view.messages), list(view.visible)))
        try:
            outcome = planner.answer()
        except _GiveUp as stop:
            return _give_up(f"I could not finish the research: {stop}.")
        notes = list(dict.fromkeys(planner.notes))
        if isinstance(outcome, list):
            return _tool_calls(view.step, outcome, notes)
        answer, said = outcome
        return _final(answer, "\n".join([*notes, f"{said}.", f"Answer: {answer}"]))


def _distinct(needs: list[_Need]) -> list[_Need]:
    """One call per distinct tool and arguments (two steps may need the same document)."""
    seen: dict[str, _Need] = {}
    for need in needs:
        seen.setdefault(need.tool + json.dumps(need.arguments, sort_keys=True), need)
    return list(seen.values())


def _tool_calls(step: int, needs: list[_Need], notes: list[str]) -> AgentAction:
    calls = [{"id": f"call_{step:03d}_{i}", "type": "function",
              "function": {"name": n.tool, "arguments": json.dumps(n.arguments, ensure_ascii=False)}}
             for i, n in enumerate(needs)]
    content = "\n".join([*notes, *(n.why for n in needs)])
    return AgentAction(message={"role": "assistant", "content": content, "tool_calls": calls})


def _final(answer: str, content: str) -> AgentAction:
    return AgentAction(message={"role": "assistant", "content": content}, final_answer=answer)


def _give_up(content: str) -> AgentAction:
    """A final message without an answer: the task could not be finished (status gave_up)."""
    return AgentAction(message={"role": "assistant", "content": content}, final_answer="", gave_up=True)
