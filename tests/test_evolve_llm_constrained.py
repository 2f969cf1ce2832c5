"""The llm proposer under the policy grammar, against a real AKV server on loopback (SmolLM2).

`constrain: auto` sends the grammar as `lark`; a 400 naming that field turns it off once, with a
note; an answer cut off by max_tokens is rejected as truncated, never adopted.
"""
from __future__ import annotations

import random

import pytest

from evolve.config import LLMProposerConfig
from evolve.context import Candidate, ProposerContext
from evolve.library import library_texts, load_checked
from evolve.proposers.base import ProposerUnavailable
from evolve.proposers.llm import POLICY_TOKENS, LLMProposer, answer_grammar, diagnosis_room
from policy_dsl import parse
from store import TaskResult
from test_grammar_support import accepts
from test_server_support import LiveServer, live_server

REFUSED = "start: undefined_rule"   # a grammar the server's llguidance refuses: a 400 naming `lark`


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> LiveServer:
    return live_server(request.config)


def config(server: LiveServer, **fields) -> LLMProposerConfig:
    return LLMProposerConfig(**{"endpoint": server.url + "/v1", "model": "smollm2", "max_tokens": 160,
                                "temperature": 0.7, "retries": 0, "timeout_s": 600, "inspirations": 0,
                                **fields})


def context(seed: int = 0) -> ProposerContext:
    rows = (TaskResult("train-1", "train", "ok", 0.5, 0.01),)
    parent = Candidate(1, load_checked("expert-8k").text, 0, 0.5, 0.01, rows)
    return ProposerContext((parent,), (parent,), frozenset(), random.Random(seed), seed)


def test_the_answer_grammar_holds_a_fenced_policy_with_or_without_a_diagnosis():
    policy = "mode kv\non each tool_response: drop role tool keep last 3 in 1..12\nreposition after each drop"
    assert accepts(answer_grammar(), f"```akvp\n{policy}\n```")
    assert not accepts(answer_grammar(), f"Here it is:\n```akvp\n{policy}\n```")
    with_diagnosis = answer_grammar(diagnosis_chars=80)
    assert accepts(with_diagnosis, f"Diagnosis: task 3 lost a fact it needed.\n\n```akvp\n{policy}\n```")
    assert not accepts(with_diagnosis, f"Diagnosis: {'x' * 81}\n\n```akvp\n{policy}\n```")
    assert accepts(with_diagnosis, f"Diagnosis: {'x' * 80}\n\n```akvp\n{policy}\n```")
    for empty in ("  ", "...", " - "):   # a diagnosis without a word says nothing
        assert not accepts(with_diagnosis, f"Diagnosis: {empty}\n\n```akvp\n{policy}\n```")
    assert not accepts(with_diagnosis, f"```akvp\n{policy}\n```")


def test_the_diagnosis_gets_what_max_tokens_leaves_beside_the_policy_block():
    fields = {"endpoint": "http://127.0.0.1:9/v1", "diagnosis_chars": 600}
    assert diagnosis_room(LLMProposerConfig(**fields, max_tokens=1024)) == 600
    assert diagnosis_room(LLMProposerConfig(**fields, max_tokens=POLICY_TOKENS + 50)) == 150
    assert diagnosis_room(LLMProposerConfig(**fields, max_tokens=POLICY_TOKENS + 10)) == 0   # under 40: none
    sent = LLMProposer(LLMProposerConfig(**fields, max_tokens=1024), library_texts()).grammar
    assert sent == answer_grammar(600)


@pytest.mark.server
@pytest.mark.model
@pytest.mark.slow
def test_constrained_proposals_are_a_diagnosis_then_a_valid_policy(server):
    proposer = LLMProposer(config(server, max_tokens=POLICY_TOKENS + 40, diagnosis_chars=100), library_texts())
    for seed in range(2):
        proposal = proposer.ask(context(seed))
        assert proposal.meta["constrained"] is True and "note" not in proposal.meta
        assert proposal.rejection_reason is None, proposal.response
        assert proposal.response.startswith("Diagnosis: ") and proposal.response.endswith("\n```")
        diagnosis = proposal.meta["diagnosis"]
        assert diagnosis and len(diagnosis) <= 100 and "```" not in diagnosis
        assert diagnosis in " ".join(proposal.response.split("```akvp")[0].split())
        parse(proposal.text)


@pytest.mark.server
@pytest.mark.model
@pytest.mark.slow
def test_auto_falls_back_once_with_a_note_when_the_endpoint_refuses_the_grammar(server):
    proposer = LLMProposer(config(server, max_tokens=24, repair=False), library_texts(), grammar=REFUSED)
    first = proposer.ask(context())
    assert first.meta["constrained"] is False
    assert "refused the lark grammar" in first.meta["note"] and "proposing unconstrained" in first.meta["note"]
    assert proposer.grammar is None
    second = proposer.ask(context(1))
    assert "note" not in second.meta and second.meta["constrained"] is False


@pytest.mark.server
@pytest.mark.model
def test_lark_mode_stops_when_the_endpoint_refuses_the_grammar(server):
    proposer = LLMProposer(config(server, constrain="lark"), library_texts(), grammar=REFUSED)
    with pytest.raises(ProposerUnavailable, match="HTTP 400 .*lark: invalid grammar"):
        proposer.ask(context())


@pytest.mark.server
@pytest.mark.model
@pytest.mark.slow
def test_an_answer_cut_off_by_max_tokens_is_rejected_as_truncated(server):
    proposer = LLMProposer(config(server, max_tokens=16, temperature=0.0), library_texts())
    proposal = proposer.ask(context())
    assert proposal.rejection_reason.startswith("truncated: the answer was cut off at max_tokens (16)")
    assert proposal.text is None and proposal.hash is None
    assert proposal.meta["repaired"] is False   # a cut-off answer is not sent back for repair
