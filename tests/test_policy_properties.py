"""Properties over random histories and random policies: cumulative decisions, safety, round trips."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_policy_support import CharCounter, histories

from policy_dsl import PolicyError, builtin_names, compile_policy, format_policy, load_policy, parse, validate
from policy_dsl import nodes as n

KV_BUILTINS = [name for name in builtin_names() if load_policy(name).mode == "kv"]
SMALL = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def nums(lo: int, hi: int) -> st.SearchStrategy[n.Num]:
    plain = st.integers(lo, hi).map(n.Num)
    ranged = st.tuples(st.integers(lo, hi), st.integers(lo, hi), st.integers(lo, hi)).map(
        lambda t: n.Num(sorted(t)[1], sorted(t)[0], sorted(t)[2]))
    return st.one_of(plain, ranged)


UNITS = st.sampled_from(n.COUNT_UNITS)
TRIGGER_ATOMS = st.one_of(
    st.builds(n.Every, nums(1, 5), UNITS),
    st.builds(n.After, nums(1, 8), UNITS),
    st.builds(n.After, nums(1, 8), UNITS, nums(1, 4)),
    st.builds(n.VisibleToolResponses, nums(1, 6)),
    st.builds(n.TokensAbove, st.sampled_from(["visible", "history"]), nums(1, 3000)),
    st.builds(n.TokensAbove, st.sampled_from(["visible", "history"]), nums(1, 3000)),
    st.just(n.DropContextCalled()),
)
TRIGGERS = st.recursive(TRIGGER_ATOMS, lambda inner: st.one_of(
    st.lists(inner, min_size=2, max_size=3).map(lambda ps: n.AnyOf(tuple(ps))),
    st.lists(inner, min_size=2, max_size=3).map(lambda ps: n.AllOf(tuple(ps))),
), max_leaves=4)
OPS = st.sampled_from(n.COMPARISONS)
SELECTOR_ATOMS = st.one_of(
    st.just(n.AllMessages()), st.sampled_from(n.ROLES).map(n.Role),
    st.sampled_from(["search", "open", "drop_context"]).map(n.ToolName),
    st.builds(n.Age, OPS, nums(0, 6), UNITS), st.builds(n.Size, OPS, nums(0, 300)),
    st.builds(n.Age, OPS, nums(0, 6), st.just("turns"), st.sampled_from(["a", "x"])),  # milestones
    st.sampled_from(["error", "ok"]).map(n.Contains), st.text(min_size=1, max_size=12).map(n.Contains),
    st.sampled_from(["a", "aa", "x"]).map(n.NextTurnContains), st.just(n.Requested()), st.just(n.Superseded()),
    st.builds(n.CallersOutside, nums(1, 4)), st.builds(n.Idle, OPS, nums(0, 6), UNITS),
    st.builds(n.Covered, nums(1, 100)), st.sampled_from(["cat ", "parse_config", "q", "search", "1"]).map(n.CallContains),
)
SIMPLE_SELECTORS = st.one_of(st.just(n.AllMessages()), st.sampled_from(["tool", "assistant"]).map(n.Role),
                             st.builds(n.Age, st.just(">="), nums(0, 4), UNITS))
SELECTORS = SIMPLE_SELECTORS | st.recursive(SELECTOR_ATOMS, lambda inner: st.one_of(
    inner.map(n.Not),
    st.lists(inner, min_size=2, max_size=3).map(lambda ps: n.And(tuple(ps))),
    st.lists(inner, min_size=2, max_size=3).map(lambda ps: n.Or(tuple(ps))),
), max_leaves=5)
MESSAGE_TARGETS = st.builds(n.Messages, SELECTORS, st.none() | nums(0, 6), st.none() | nums(0, 2000))
# In mode kv a drop down to a target may take its trigger too (`trigger included`).
KV_TARGETS = st.builds(n.Messages, SELECTORS, st.none() | nums(0, 6), st.none() | nums(0, 2000), st.booleans())
KV_RULES = st.builds(n.Rule, TRIGGERS, st.builds(n.Drop, KV_TARGETS))
REPOSITIONS = st.one_of(st.just(n.RepositionNever()), st.just(n.RepositionEachDrop()),
                        st.builds(n.RepositionEvery, nums(1, 4), st.sampled_from(n.REPOSITION_UNITS)),
                        st.builds(n.RepositionAfter, nums(1, 6), st.none() | nums(1, 3)),
                        st.builds(n.RepositionGap, nums(1, 500)), st.builds(n.RepositionPositions, nums(1, 3000)))
KV_POLICIES = st.builds(n.Policy, st.just("kv"), st.lists(KV_RULES, max_size=3).map(tuple), REPOSITIONS,
                        st.booleans(), st.booleans())  # user observations, controller prompts
# Policies sure to read what a message says again (`covered`) or the call behind it (`call contains`),
# alone, beside a selector of another kind, or negated, in a rule among others.
READING_ATOMS = st.one_of(st.builds(n.Covered, nums(1, 100)), st.just(n.Covered(n.Num(100))),
                          st.sampled_from(["cat ", "parse_config", "q", "search", "1"]).map(n.CallContains))
READING_SELECTORS = st.one_of(
    READING_ATOMS, READING_ATOMS.map(n.Not),
    st.tuples(SELECTOR_ATOMS | st.sampled_from(n.ROLES).map(n.Role), READING_ATOMS).map(lambda ps: n.And(ps)),
    st.tuples(READING_ATOMS, SELECTOR_ATOMS).map(lambda ps: n.Or(ps)))
READING_RULES = st.builds(n.Rule, TRIGGERS, st.builds(n.Drop, st.builds(
    n.Messages, READING_SELECTORS, st.none() | nums(0, 6), st.none() | nums(0, 2000), st.booleans())))
READING_POLICIES = st.builds(
    lambda rule, others, at, reposition, observations, prompts: n.Policy(
        "kv", (*others[:at], rule, *others[at:]), reposition, observations, prompts),
    READING_RULES, st.lists(KV_RULES, max_size=2), st.integers(0, 2), REPOSITIONS, st.booleans(), st.booleans())
TEXT_RULES = st.builds(n.Rule, TRIGGERS, st.one_of(
    st.builds(n.Omit, MESSAGE_TARGETS), st.builds(n.Omit, st.builds(n.Thinking, st.none() | SELECTORS)),
    st.builds(n.Remove, MESSAGE_TARGETS),
    st.builds(n.Summarize, st.builds(n.Messages, SELECTORS, st.none() | nums(0, 6)), nums(16, 500)),
))
CUT_RULES = st.builds(n.Rule, TRIGGERS, st.builds(n.Cut, st.sampled_from(n.CUT_SIDES),
                                                   st.sampled_from(["a", "ok", " ", "\n"]), MESSAGE_TARGETS))
CUT_POLICIES = st.builds(n.Policy, st.just("kv"), st.lists(CUT_RULES, min_size=1, max_size=2).map(tuple),
                         st.just(n.RepositionNever()), st.booleans())
ANY_POLICIES = st.one_of(KV_POLICIES, st.builds(n.Policy, st.just("text"), st.lists(TEXT_RULES, max_size=3).map(tuple)),
                         CUT_POLICIES)
# Cut rules beside drop rules, or with repositions: refused, and the printer test checks that parse refuses them.
MIXED_POLICIES = st.builds(n.Policy, st.just("kv"), st.lists(st.one_of(KV_RULES, CUT_RULES), max_size=3).map(tuple),
                           REPOSITIONS)


def valid(ast: n.Policy) -> bool:
    try:
        validate(ast)
    except PolicyError:
        return False
    return True


class ScaledCounter(CharCounter):
    """Thirty tokens per character: small histories reach the built-ins' real thresholds."""

    def count(self, message) -> int:
        return 30 * super().count(message)


COUNTERS = st.sampled_from([CharCounter(), ScaledCounter()])


def check_cumulative_and_safe(policy, history, counter) -> None:
    full = policy.decide(history, counter)
    protected = {0} if history[0]["role"] == "system" else set()
    protected.add(next(i for i, m in enumerate(history) if m["role"] == "user"))
    seen: set[int] = set()
    self_drops = any(getattr(r.action.target, "trigger_included", False) for r in policy.ast.rules)
    for key, dropped in full.drop_message.items():
        trigger = int(key)
        assert 0 <= trigger < len(history)
        assert dropped == sorted(dropped) and dropped, key
        assert all(0 <= j < trigger or (j == trigger and self_drops) for j in dropped), key
        assert not protected & set(dropped)
        assert not seen & set(dropped), "dropped twice"
        seen |= set(dropped)
    assert list(full.drop_message) == sorted(full.drop_message, key=int)
    assert full.reposition == sorted(set(full.reposition))
    assert all(0 <= r < len(history) for r in full.reposition)
    assert all(r + 1 == len(history) or history[r + 1]["role"] != "tool" for r in full.reposition)
    for k in range(1, len(history)):
        prefix = policy.decide(history[:k], counter)
        assert prefix.drop_message == {key: v for key, v in full.drop_message.items() if int(key) < k}
        expected = [r for r in full.reposition if r < k]
        if policy.ast.controller_prompts and history[k]["role"] == "user" and expected[-1:] == [k - 1]:
            # the documented exception: call k - 1 counts its controller prompt k, which this prefix lacks
            assert prefix.reposition in (expected, expected[:-1])
            continue
        assert prefix.reposition == expected
        assert not prefix.thinking_drop or full.thinking_drop


@pytest.mark.parametrize("name", KV_BUILTINS)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=histories(), counter=COUNTERS)
def test_builtin_kv_decisions_are_cumulative_and_safe(name, history, counter) -> None:
    check_cumulative_and_safe(load_policy(name), history, counter)


@SMALL
@given(history=histories(max_rounds=8), ast=KV_POLICIES.filter(valid), counter=COUNTERS)
def test_random_kv_policies_are_cumulative_and_safe(history, ast, counter) -> None:
    check_cumulative_and_safe(compile_policy(ast), history, counter)


@SMALL
@given(history=histories(max_rounds=8), ast=READING_POLICIES.filter(valid), counter=COUNTERS)
def test_random_policies_reading_coverage_and_calls_are_cumulative_and_safe(history, ast, counter) -> None:
    check_cumulative_and_safe(compile_policy(ast), history, counter)


@SMALL
@given(history=histories(max_rounds=8), ast=ANY_POLICIES.filter(valid))
def test_text_edits_are_in_range_and_never_touch_protected_messages(history, ast) -> None:
    decision = compile_policy(ast).decide(history, CharCounter())
    latest = len(history) - 1
    first_user = next(i for i, m in enumerate(history) if m["role"] == "user")
    covered: list[int] = []
    for edit in decision.text_edits:
        assert 0 <= edit.start <= edit.end < latest
        covered += range(edit.start, edit.end + 1)
        if edit.kind == "summarize":
            assert history[edit.end + 1]["role"] != "tool"  # tool batches stay whole
    assert len(covered) == len(set(covered)) and first_user not in covered


@SMALL
@given(history=histories(max_rounds=8), ast=CUT_POLICIES.filter(valid), counter=COUNTERS)
def test_random_cut_policies_are_cumulative_and_what_they_send_projects_back(history, ast, counter) -> None:
    from akv_core.cache.text_drop import project_kept

    policy = compile_policy(ast)
    full = policy.decide(history, counter)
    protected = {i for i, m in enumerate(history) if m["role"] == "system"}
    protected.add(next(i for i, m in enumerate(history) if m["role"] == "user"))
    assert not protected & set(full.kept) and len(history) - 1 not in full.kept
    for k in range(1, len(history)):
        assert policy.decide(history[:k], counter).kept.items() <= full.kept.items()
    if full.kept:   # the server accepts what the policy sends, and cuts exactly the text it took away
        sent = full.sent_messages(history)
        drop = project_kept(full.api_fields()["drop_rule"]["full_messages"], sent).drop
        assert {cut.message for cut in drop.cuts} == set(full.kept) and not any(cut.whole for cut in drop.cuts)


@settings(max_examples=150, deadline=None)
@given(ast=st.one_of(ANY_POLICIES, MIXED_POLICIES))
def test_printer_round_trips_every_valid_ast_and_parse_rejects_the_rest(ast) -> None:
    text = format_policy(ast)
    if valid(ast):
        assert parse(text) == ast
        assert format_policy(parse(text)) == text
    else:
        try:
            parse(text)
        except PolicyError:
            return
        raise AssertionError("parse accepted the text of an invalid policy")


def decide_fresh(ast: n.Policy, history, counter):
    """The decision of a policy object that has decided nothing before (no walk to resume)."""
    return compile_policy(ast).decide(history, counter)


@SMALL
@given(conversations=st.lists(histories(max_rounds=6), min_size=2, max_size=3),
       ast=(KV_POLICIES | READING_POLICIES).filter(valid), data=st.data())
def test_one_policy_object_decides_growing_conversations_as_a_fresh_one_decides_each_request(conversations, ast,
                                                                                             data) -> None:
    """A kv decision resumes the walk of a history it decided before (policy_dsl/kv_walk.py): request by
    request, conversations interleaved, each counter apart, after a history diverges, from threads."""
    policy = compile_policy(ast)
    counters = [CharCounter(), ScaledCounter()]
    longest = max(map(len, conversations))
    requests = [(c[:k], counters[i % 2]) for k in range(1, longest + 1) for i, c in enumerate(conversations)
                if k <= len(c)]
    for history, counter in requests:  # interleaved, one counter per conversation
        assert policy.decide(history, counter) == decide_fresh(ast, history, counter)
    first = conversations[0]
    for k in range(1, len(first) + 1):  # the same requests, counted by the other counter
        assert policy.decide(first[:k], counters[1]) == decide_fresh(ast, first[:k], counters[1])
    at = data.draw(st.integers(0, len(first) - 1))  # an earlier message edited: the history diverges there
    edited = first[:at] + [{**first[at], "content": f"{first[at].get('content') or ''} see src/app/main.py"}] + \
        first[at + 1:]
    for k in range(at + 1, len(edited) + 1):
        assert policy.decide(edited[:k], counters[0]) == decide_fresh(ast, edited[:k], counters[0])
    check_in_threads(ast, conversations, counters[0])


def check_in_threads(ast: n.Policy, conversations, counter) -> None:
    """Each conversation decided request by request in a thread of its own, all on one policy object."""
    import sys
    import threading

    policy, start = compile_policy(ast), threading.Barrier(len(conversations))
    decided: list[list] = [[] for _ in conversations]

    def converse(i: int) -> None:
        start.wait()
        decided[i] = [policy.decide(conversations[i][:k], counter) for k in range(1, len(conversations[i]) + 1)]

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so that their decisions interleave
    try:
        threads = [threading.Thread(target=converse, args=(i,)) for i in range(len(conversations))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    for conversation, got in zip(conversations, decided):
        assert got == [decide_fresh(ast, conversation[:k], counter) for k in range(1, len(conversation) + 1)]
