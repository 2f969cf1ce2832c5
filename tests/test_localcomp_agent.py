"""The scripted agent: solves tasks from what it sees, re-fetches what it lost, gives up on budget,
and records exactly which messages each step used."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from sandbox.suites.base import AgentAction, AgentView, Message
from sandbox.suites.localcomp import EDITIONS, LocalComp
from sandbox.suites.localcomp.walkthrough import trajectory_tokens, walk
from test_sandbox_support import small_localcomp


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> LocalComp:
    built = small_localcomp(tmp_path_factory.getbasetemp() / "localcomp-home")
    yield built
    built.close()


@pytest.fixture(scope="module")
def first_edition(tmp_path_factory: pytest.TempPathFactory) -> LocalComp:
    built = small_localcomp(tmp_path_factory.getbasetemp() / "localcomp-e1", edition=1)
    yield built
    built.close()


class Recording:
    """The suite's scripted agent, keeping every view it got and every action it took."""

    def __init__(self, agent) -> None:
        self.agent, self.name = agent, agent.name
        self.steps: list[tuple[AgentView, AgentAction]] = []

    def act(self, view: AgentView) -> AgentAction:
        action = self.agent.act(view)
        self.steps.append((view, action))
        return action

    def last_uses(self) -> dict[int, int]:
        """Message index -> the last step that used it."""
        return {i: k for k, (_, action) in enumerate(self.steps) for i in action.used}


def _tool_indices(history: list[Message]) -> list[int]:
    return [i for i, m in enumerate(history) if m["role"] == "tool"]


def keep_last_tool_responses(k: int):
    """A rolling window over tool responses, like the expert policy with a small window."""
    return lambda step, history: set(_tool_indices(history)[:-k])


@pytest.mark.parametrize("edition", [1, 2])
def test_sees_everything_reaches_gold_on_every_train_task(suite: LocalComp, first_edition: LocalComp,
                                                          edition: int) -> None:
    built = first_edition if edition == 1 else suite
    low, high = EDITIONS[edition].trajectory_tokens
    for task in built.tasks("train"):
        run = walk(task, built.open(task), built.scripted_agent(task))
        assert built.open(task).grade(run.answer).score == 1.0, task.id
        assert low <= trajectory_tokens(task, run.messages) <= high, task.id


def _calls(run) -> tuple[list[Message], list[dict]]:
    assistant = [m for m in run.messages if m["role"] == "assistant"]
    calls = [c for m in assistant[:-1] for c in m["tool_calls"]]
    assert len({c["id"] for c in calls}) == len(calls) == len(run.tool_calls)
    for call in calls:
        assert call["type"] == "function" and isinstance(json.loads(call["function"]["arguments"]), dict)
    assert "tool_calls" not in assistant[-1]
    assert assistant[-1]["content"].endswith(f"Answer: {run.answer}")
    return assistant, calls


def test_edition_1_batches_the_independent_calls_of_a_leg(first_edition: LocalComp) -> None:
    task = next(t for t in first_edition.tasks("train") if '"op": "pick"' in json.dumps(t.meta["plan"]))
    run = walk(task, first_edition.open(task), first_edition.scripted_agent(task))
    assistant, _ = _calls(run)
    # the three producers of an element are searched, then opened, in one batch each
    assert max(len(m["tool_calls"]) for m in assistant[:-1]) == 3


def test_edition_2_makes_one_call_per_step_and_judges_each_dead_end_in_words(suite: LocalComp) -> None:
    judged = 0
    for task in suite.tasks("train")[:6]:
        run = walk(task, suite.open(task), suite.scripted_agent(task))
        assistant, _ = _calls(run)
        assert all(len(m["tool_calls"]) == 1 for m in assistant[:-1])
        for i, m in enumerate(run.messages):
            verdicts = re.findall(r"^(.+) \[(lc-\d{5})\] is not relevant to \S+: (.+)$", m.get("content") or "",
                                  re.MULTILINE) if m["role"] == "assistant" else []
            for _, docid, why in verdicts:
                # the verdict comes in the turn right after the agent read the document, with its reason
                assert run.messages[i - 1]["role"] == "tool" and run.messages[i - 1]["content"].startswith(f"[{docid}]")
                assert why.startswith(("its ", "it is the article on"))
                assert docid not in task.meta["gold_docs"]
                judged += 1
    assert judged


def test_lost_evidence_is_fetched_again(suite: LocalComp) -> None:
    rereads = 0
    for task in suite.tasks("train")[:4]:
        full = walk(task, suite.open(task), suite.scripted_agent(task))
        windowed = walk(task, suite.open(task), suite.scripted_agent(task), hidden=keep_last_tool_responses(4))
        opened = [arg for tool, arg in windowed.tool_calls if tool == "get_document"]
        assert len(opened) > len(set(opened)), task.id  # some document was read twice
        assert len(windowed.tool_calls) > len(full.tool_calls)
        assert suite.open(task).grade(windowed.answer).score == 1.0
        rereads += sum("no longer in view" in m["content"] for m in windowed.messages if m["role"] == "assistant")
    assert rereads  # by the docid it noted, not by searching again


def test_text_mode_placeholders_count_as_lost(suite: LocalComp) -> None:
    task = suite.tasks("train")[1]

    def omit_old_tool_responses(step: int, history: list[Message]) -> list[Message]:
        old = set(_tool_indices(history)[:-4])
        return [{**m, "content": "[tool output omitted]"} if i in old else m for i, m in enumerate(history)]

    run = walk(task, suite.open(task), suite.scripted_agent(task), edit=omit_old_tool_responses)
    opened = [arg for tool, arg in run.tool_calls if tool == "get_document"]
    assert len(opened) > len(set(opened))
    assert suite.open(task).grade(run.answer).score == 1.0


def test_without_memory_it_gives_up_at_the_step_budget(suite: LocalComp) -> None:
    task = suite.tasks("train")[2]

    def only_the_last_two(step: int, history: list[Message]) -> set[int]:
        return set(range(2, len(history) - 2))  # its own notes scroll away too

    agent = Recording(suite.scripted_agent(task))
    run = walk(task, suite.open(task), agent, hidden=only_the_last_two, max_steps=200)
    assert run.answer == "" and run.steps == agent.agent.max_steps + 1
    assert "step budget" in run.messages[-1]["content"]
    assert agent.steps[-1][1].gave_up and not any(a.gave_up for _, a in agent.steps[:-1])


def _year_document(task) -> tuple[str, int, str] | None:
    """(leg label, year, docid) of a leg whose year sits in a document no other leg's year uses."""
    holders = {label: next(e["docid"] for e in task.meta["evidence"] if e["value"] == str(year))
               for label, year in task.meta["years"].items()}
    for label, docid in holders.items():
        if list(holders.values()).count(docid) == 1:
            return label, task.meta["years"][label], docid
    return None


def test_answer_comes_from_the_documents_it_read(suite: LocalComp) -> None:
    task = next(t for t in suite.tasks("train") if t.meta["gold"]["type"] == "number" and _year_document(t))
    label, year, docid = _year_document(task)

    class AlteredCorpus:
        """The real environment, with one leg's year changed in the document that holds it."""

        def __init__(self, env):
            self.env = env

        def call_tool(self, name, arguments):
            text = self.env.call_tool(name, arguments)
            if name == "get_document" and arguments["docid"] == docid:
                text = re.sub(rf"\| {year} \|", f"| {year - 1000} |", text)
            return text

    run = walk(task, AlteredCorpus(suite.open(task)), suite.scripted_agent(task))
    years = dict(task.meta["years"], **{label: year - 1000})
    assert run.answer == str(max(years.values()) - min(years.values()))
    assert run.answer != task.meta["gold"]["answer"]


def test_after_a_summary_it_keeps_its_notes_and_rereads_documents(suite: LocalComp) -> None:
    from policy_dsl.decision import SUMMARY_PREFIX
    from sandbox.runs.summarize import extractive_summary

    task = suite.tasks("train")[3]

    def summarize_once(step: int, history: list[Message]) -> list[Message]:
        if step != 12:
            return history
        body = extractive_summary(history[2:], 512, lambda text: len(text) // 4)
        return history[:2] + [{"role": "user", "content": SUMMARY_PREFIX + body}]

    run = walk(task, suite.open(task), suite.scripted_agent(task), edit=summarize_once)
    assert suite.open(task).grade(run.answer).score == 1.0
    after = [m for m in run.messages[3:] if m["role"] == "assistant"]
    rereads = [m for m in after if "no longer in view" in m["content"]]
    assert rereads  # documents were summarized away and fetched again by their noted docids


def test_a_summary_that_keeps_the_facts_saves_the_rereads_and_stray_rows_are_not_read(suite: LocalComp) -> None:
    from policy_dsl.decision import SUMMARY_PREFIX
    from sandbox.runs.summarize import extractive_summary, fact_summary
    from sandbox.suites.localcomp.context import read_context

    task = suite.tasks("train")[3]
    count = lambda text: len(text) // 4  # noqa: E731

    def rereads(summarize) -> int:
        def summarize_once(step: int, history: list[Message]) -> list[Message]:
            return history if step != 12 else history[:2] + [{"role": "user", "content": SUMMARY_PREFIX + summarize(
                history[2:])}]
        run = walk(task, suite.open(task), suite.scripted_agent(task), edit=summarize_once)
        assert suite.open(task).grade(run.answer).score == 1.0
        return sum("no longer in view" in m["content"] for m in run.messages[3:] if m["role"] == "assistant")

    kept = rereads(lambda span: fact_summary(suite.summary_facts(span), 1024, count))
    assert kept < rereads(lambda span: extractive_summary(span, 1024, count))
    # a table row with its title but not its table's heading is not tied to a document, nor a page short of hits
    stray = SUMMARY_PREFIX + '[lc-00001] Avaland\nCountry\n| Currency | Euro |\n\nSearch results for "x": 2 hits\n' \
        "1. [lc-00001] Avaland"
    ctx = read_context([{"role": "user", "content": stray}], [True])
    assert not ctx.docs and not ctx.searches


def _hide_unused(agent: Recording, base=None):
    """The hindsight schedule of a recorded run: each message hidden once no later step uses it."""
    last = agent.last_uses()
    return lambda step, history: (base(step, history) if base else set()) | \
        {i for i in range(len(history)) if last.get(i, -1) < step}


@pytest.mark.parametrize("edition", [1, 2])
@pytest.mark.parametrize("policy", ["everything visible", "a window of 3 tool responses"])
def test_use_records_are_enough_hiding_everything_else_changes_nothing(
        suite: LocalComp, first_edition: LocalComp, edition: int, policy: str) -> None:
    built = first_edition if edition == 1 else suite
    base = keep_last_tool_responses(3) if policy.startswith("a window") else None
    for task in built.tasks("train")[:8]:
        agent = Recording(built.scripted_agent(task))
        reference = walk(task, built.open(task), agent, hidden=base)
        hindsight = walk(task, built.open(task), built.scripted_agent(task), hidden=_hide_unused(agent, base))
        assert hindsight.messages == reference.messages, task.id
        # what a step used it could see, and the hindsight schedule hides most of the history at the end
        assert all(view.visible[i] for view, action in agent.steps for i in action.used)
        final = len(agent.steps) - 1
        needed_at_the_end = [i for i, k in agent.last_uses().items() if k == final and i > 1]
        assert 0 < len(needed_at_the_end) < len(reference.messages) // 3


def test_use_records_are_exact_hiding_a_used_message_changes_the_step(suite: LocalComp) -> None:
    checked = 0
    for task in suite.tasks("train")[:3]:
        agent = Recording(suite.scripted_agent(task))
        walk(task, suite.open(task), agent)
        for view, action in agent.steps:
            for i in action.used:
                if view.messages[i]["role"] == "user" and i == 1:
                    continue  # the question: the agent works from its plan of it, so it never goes missing
                hidden = dataclasses.replace(view, visible=[v and j != i for j, v in enumerate(view.visible)])
                assert suite.scripted_agent(task).act(hidden).message != action.message, (task.id, view.step, i)
                checked += 1
    assert checked > 50
