"""Reflection: what happened in a policy's train trajectories, as a compact digest per task.

GEPA's reflective mutation reads the parent's execution traces before rewriting it; a cache
policy's traces are its message timelines. `timeline_of` reduces one task's trajectory to what a
proposer needs (kept in the store with the train result, a few KB per task): for each message
its role, tool, size, when it arrived, when the policy dropped it, which agent steps read it
(the scripted agents' use records, `used`), the start of what the agent wrote (`said`, on its
own messages: the words the reflect proposer mines), and whether it is a re-fetch of an earlier result
(the same tool called with the same arguments); for a result read at most once, the start of
the agent's next message (its verdict on a dead end, which `next_turn contains` can match); for
a tool result, the call behind it (`call`, what `call contains` reads: a command, a path); for a
message with distinctive content, the steps at which later messages had said 50, 60, ... 100
percent of it again (`covered`, what `covered >= P percent` reads, with everything visible).
Where use records are inferred from copied strings (recorded traces), `reuses` lists per step the
messages holding each string the agent copied there: a copy is lost only when all of them are
hidden, which is what hindsight distillation scores.
`digest` renders that as text within a token budget: the failure reason, the re-fetches each
drop caused, the visible tokens paid for and never used again, the costliest results read once
and then kept (with that next message), then the message lines that matter most. A digest over its budget is
shortened, line by line, never sent whole.

Only train trajectories are kept (the evaluator keeps none for held-out), and they reach a
proposer only through `evolve.context.build_context`, which refuses anything else.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from policy_dsl.history import call_texts, coverage_index
from sandbox.runs.trajectory import Trajectory, step_ranges

Timeline = dict[str, Any]  # JSON-ready: see timeline_of
NEXT_TURN_CHARS = 100  # of the agent's next message, kept for a tool result read at most once
SAID_CHARS = 240  # of each assistant message's text, kept as it is (lines and all): what the reflect proposer mines
ONCE_LINES = 3  # results read once and then kept idle, quoted with that next message
CALL_CHARS = 160  # of the call behind a tool result (a command, a path): what `call contains` reads
COVER_SHARES = (50, 60, 70, 80, 90, 100)  # the shares of `covered >= P percent` a timeline records
Count = Callable[[str], int]  # tokens of a text, with the proposer's model's tokenizer or an estimate


def timeline_of(trajectory: Trajectory, count: Callable[[Mapping[str, Any]], int]) -> Timeline:
    """The message timeline of one task run (kv or text mode), with its result and failure reason.

    Steps are agent requests, numbered from 0. In text mode a summary rewrites the history; the
    timeline then covers the steps after the last rewrite, and says where the rewrites were.
    """
    agent = [e for e in trajectory.exchanges if e.purpose == "agent"]
    rewrites = [k for k in range(1, len(agent)) if not _extends(agent[k - 1].request.messages,
                                                                   agent[k].request.messages)]
    first = rewrites[-1] if rewrites else 0
    steps = agent[first:]
    messages = list(steps[-1].request.messages) if steps else []
    calls = _calls(messages)
    arrivals = [next(k for k, e in enumerate(steps, first) if index < len(e.request.messages))
                for index in range(len(messages))]
    covered = _covered_steps(messages, arrivals, first + len(steps))
    said_by_calls = call_texts(messages)
    hidden = [_dropped(e.request) for e in steps]
    lines, seen_calls = [], {}
    for index, message in enumerate(messages):
        arrived = arrivals[index]
        dropped = next((k for k, gone in enumerate(hidden, first) if index in gone), None)
        uses = [k for k, e in enumerate(steps, first) if e.used is not None and index in e.used]
        call = calls.get(message.get("tool_call_id")) if message.get("role") == "tool" else None
        refetch_of = seen_calls.get(call) if call else None  # the latest earlier answer to the same call
        if call:
            seen_calls[call] = index
        # Visible from its arrival until its drop: the requests after its last read paid for it in vain.
        last_read = max(uses, default=arrived - 1)
        end = dropped if dropped is not None else first + len(steps)
        line = {"i": index, "role": message.get("role", "?"), "tool": _tool(message, call),
                "tokens": count(message), "arrived": arrived, "dropped": dropped, "uses": uses,
                "refetch_of": refetch_of, "idle": max(0, end - last_read - 1) if uses or steps[0].used is not None else 0}
        if said_by_calls[index] and message.get("role") == "tool":
            line["call"] = said_by_calls[index][:CALL_CHARS]
        if covered[index] is not None:
            line["covered"] = covered[index]
        if call and len(uses) <= 1:   # read once at most: what the agent said next is the verdict on it
            line["next_turn"] = _next_turn(messages, index)
        if message.get("role") == "assistant" and message.get("content"):
            line["said"] = str(message["content"])[:SAID_CHARS]
        lines.append(line)
    result = next((n for n in reversed(trajectory.notes) if n.get("type") == "result"), {})
    grade = next((n for n in reversed(trajectory.notes) if n.get("type") == "grade"), {})
    return {"task_id": trajectory.header.get("task_id"), "split": trajectory.header.get("split"),
            **({"group": trajectory.header["group"]} if trajectory.header.get("group") else {}),
            "status": result.get("status"), "score": result.get("score"), "cost_usd": result.get("cost_usd"),
            "requests": result.get("n_requests", len(agent)), "steps": len(agent), "rewrites": rewrites,
            "uses_recorded": bool(steps) and all(e.used is not None for e in steps),
            "reason": result.get("reason") or grade.get("detail"), "messages": lines,
            **({"reuses": [[k, [list(h) for h in e.holders]] for k, e in enumerate(steps, first) if e.holders]}
               if steps and all(e.holders is not None for e in steps) else {})}


def _covered_steps(messages: Sequence[Mapping[str, Any]], arrivals: Sequence[int],
                   end: int) -> list[list[int | None] | None]:
    """Per message with distinctive content, per share of COVER_SHARES: the first step at which a rule
    `on each turn: drop covered >= P percent` would have dropped it with everything visible (the first
    turn after the message that says the P-th percent of its items again), None if never; None for
    a message without distinctive content. A history that is not a well-formed one gives nothing."""
    try:
        index = coverage_index(messages)
    except (ValueError, TypeError, KeyError):
        return [None] * len(messages)
    turn_steps = [end] * (len(messages) + 1)  # the step showing the first assistant message at or after i
    for i in range(len(messages) - 1, -1, -1):
        turn_steps[i] = arrivals[i] if messages[i].get("role") == "assistant" else turn_steps[i + 1]
    out: list[list[int | None] | None] = []
    for j in range(len(messages)):
        firsts = index.first_said_again(j)
        if not firsts:
            out.append(None)
            continue
        steps = []
        for share in COVER_SHARES:
            k = firsts[max(0, math.ceil(share * len(firsts) / 100) - 1)]
            # a turn at the coverer itself fires there; a message never drops at its own boundary
            step = None if k is None else turn_steps[k] if k > j else turn_steps[j + 1]
            steps.append(None if step is None or step >= end else step)
        out.append(steps)
    return out


def _next_turn(messages: Sequence[Mapping[str, Any]], index: int) -> str | None:
    """The start of the first assistant message after `index` (what `next_turn contains` matches)."""
    following = next((m for m in messages[index + 1:] if m.get("role") == "assistant"), None)
    text = " ".join(str((following or {}).get("content") or "").split())
    return _short(text, NEXT_TURN_CHARS) if text else None


def _extends(before: Sequence[Any], now: Sequence[Any]) -> bool:
    return len(now) >= len(before) and all(a is b or a == b for a, b in zip(before, now))


def _dropped(request: Any) -> set[int]:
    """Indices a request hides (every drop it carries), as the harness's agent view counts them."""
    operations = request.cache_operations()
    return {int(i) for indices in (operations.drop_message or {}).values() for i in indices}


def _calls(messages: Sequence[Mapping[str, Any]]) -> dict[str, tuple[str, str]]:
    """Tool call id -> (tool, canonical arguments), from the assistant messages."""
    out = {}
    for message in messages:
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            raw = function.get("arguments")
            try:
                args = json.dumps(json.loads(raw) if isinstance(raw, str) else raw, sort_keys=True)
            except (TypeError, ValueError):
                args = str(raw)
            out[call.get("id")] = (str(function.get("name") or ""), args)
    return out


def _tool(message: Mapping[str, Any], call: tuple[str, str] | None) -> str | None:
    if call is not None:
        return f"{call[0]} {_short(call[1], 48)}"
    names = [(c.get("function") or {}).get("name") for c in message.get("tool_calls") or ()]
    return "calls " + ",".join(n for n in names if n) if names else None


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True)
class Digest:
    task_id: str
    text: str
    tokens: int
    shortened: bool  # lines were left out to fit the budget


def digest(timeline: Timeline, budget: int, count: Count) -> Digest:
    """One task's digest in at most `budget` tokens: essentials first, then the costliest messages.

    Returns an empty digest when not even the task's header line fits.
    """
    head = _header(timeline)
    body = _refetch_lines(timeline) + _waste_lines(timeline) + _read_once_lines(timeline)
    table = _message_lines(timeline)
    out, used, shortened = [], 0, False
    for kind, lines in (("head", head), ("body", body), ("table", table)):
        for line in lines:
            cost = count(line + "\n")
            if used + cost > budget:
                shortened = True
                if kind == "head" and not out:
                    return Digest(str(timeline["task_id"]), "", 0, True)
                continue
            out.append(line)
            used += cost
    if shortened and table and used + count(" (some lines left out to fit)\n") <= budget:
        out.append(" (some lines left out to fit)")
    text = "\n".join(out)
    return Digest(str(timeline["task_id"]), text, count(text) if text else 0, shortened)


def _header(t: Timeline) -> list[str]:
    status = f"{t['status']}" + (f": {_short(str(t['reason']), 160)}" if t.get("reason") else "")
    lines = [f"task {t['task_id']}: score {t['score']:.2f}, cost ${t['cost_usd']:.5f}, {t['requests']} requests "
             f"({status})"]
    if t["rewrites"]:
        r = t["rewrites"]
        lines.append(f" history rewritten by summaries {len(r)} times (steps {r[0]}..{r[-1]}); the lines below "
                     f"cover the steps after the last rewrite")
    if not t["uses_recorded"]:
        lines.append(" (the agent records no use of messages here: unused tokens cannot be told)")
    return lines


def _refetch_lines(t: Timeline) -> list[str]:
    """One line per call answered more than once: its fetches, the drops before them, the tokens paid again."""
    by_index = {m["i"]: m for m in t["messages"]}
    chains: dict[int, list[Mapping[str, Any]]] = {}  # first fetch -> every fetch of that call
    for m in t["messages"]:
        if m["refetch_of"] is not None:
            first = m["refetch_of"]
            while by_index[first]["refetch_of"] is not None:
                first = by_index[first]["refetch_of"]
            chains.setdefault(first, [by_index[first]]).append(m)
    lines = []
    for first, fetches in sorted(chains.items(), key=lambda c: -sum(m["tokens"] for m in c[1][1:])):
        drops = [m["dropped"] for m in fetches[:-1] if m["dropped"] is not None]
        why = (f"dropped at steps {step_ranges(drops, ',')} then needed again" if drops
               else "fetched again while visible")
        lines.append(f" re-fetch: {fetches[0]['tool']} answered {len(fetches)} times "
                     f"({', '.join('#' + str(m['i']) for m in fetches)}); {why}: "
                     f"{sum(m['tokens'] for m in fetches[1:])} tokens paid again")
    return lines


def _waste_lines(t: Timeline) -> list[str]:
    if not t["uses_recorded"]:
        return []
    wasted = sorted(((m["tokens"] * m["idle"], m) for m in t["messages"] if m["idle"] and m["i"] > 1),
                    key=lambda x: -x[0])
    total = sum(w for w, _m in wasted)
    never = [m for m in t["messages"] if not m["uses"] and m["role"] == "tool"]
    top = ", ".join(f"#{m['i']} {w}" for w, m in wasted[:5])
    lines = [f" visible tokens paid for after their last use: {total} over the run's requests" +
             (f" (most: {top})" if top else "")]
    if never:
        lines.append(f" tool results never read after arriving: {', '.join('#' + str(m['i']) for m in never[:12])}"
                     + (" …" if len(never) > 12 else ""))
    return lines


def _read_once_lines(t: Timeline) -> list[str]:
    """The costliest tool results read once and then kept visible, with what the agent said next:
    a verdict there ("... is not relevant") is text a `next_turn contains` selector can match."""
    if not t["uses_recorded"]:
        return []
    once = sorted((m for m in t["messages"] if len(m["uses"]) == 1 and m["idle"] and m.get("next_turn")),
                  key=lambda m: (-m["tokens"] * m["idle"], m["i"]))
    shown, tools = [], set()
    for m in once:   # the costliest of each tool first, so each kind of result is quoted
        if m["tool"].split()[0] not in tools:
            tools.add(m["tool"].split()[0])
            shown.append(m)
    shown = shown[:ONCE_LINES] + [m for m in once if m not in shown][: ONCE_LINES - len(shown)]
    return [f" read once, then idle {m['idle']} requests: #{m['i']} [{m['tool']}] {m['tokens']}t; the agent's "
            f"next turn: {json.dumps(m['next_turn'], ensure_ascii=False)}" for m in shown]


def _message_lines(t: Timeline) -> list[str]:
    """One line per message, the costliest (size times idle requests) first, then kept in index order."""
    legend = " messages: #index role [tool] tokens, +arrival step, reads at steps, -dropped step, idle = " \
             "requests visible after the last read"
    shown = [m for m in t["messages"] if m["i"] > 1]  # the system prompt and the task are always kept
    ranked = sorted(shown, key=lambda m: (-(m["tokens"] * max(m["idle"], 1)), m["i"]))
    rows = [_message_line(m, t["uses_recorded"]) for m in ranked]
    return [legend] + rows if rows else []


def _message_line(m: Mapping[str, Any], uses_recorded: bool) -> str:
    tool = f" [{m['tool']}]" if m["tool"] else ""
    reads = (f" reads {step_ranges(m['uses'], ',')}" if m["uses"] else " never read") if uses_recorded else ""
    drop = f" -{m['dropped']}" if m["dropped"] is not None else " kept"
    idle = f" idle {m['idle']}" if uses_recorded else ""
    again = f" (re-fetch of #{m['refetch_of']})" if m["refetch_of"] is not None else ""
    return f"  #{m['i']} {m['role']}{tool} {m['tokens']}t +{m['arrived']}{reads}{drop}{idle}{again}"


def pick_tasks(timelines: Mapping[str, Timeline], worst: int, expensive: int) -> list[str]:
    """Task ids to digest: the `worst` lowest-scoring (costliest first among equals), then the
    `expensive` costliest of the rest."""
    by_worst = sorted(timelines, key=lambda t: (timelines[t]["score"], -timelines[t]["cost_usd"], t))
    chosen = by_worst[:worst]
    rest = sorted((t for t in timelines if t not in chosen), key=lambda t: (-timelines[t]["cost_usd"], t))
    return chosen + rest[:expensive]


def digests(timelines: Mapping[str, Timeline], task_ids: Sequence[str], budget: int, count: Count) -> list[Digest]:
    """Digests of `task_ids` sharing `budget` tokens; each gets an equal share of what is left."""
    out: list[Digest] = []
    left = budget
    for n, task in enumerate(task_ids):
        share = left // (len(task_ids) - n)
        made = digest(timelines[task], share, count)
        if made.text:
            out.append(made)
            left -= made.tokens + 1
    return out
