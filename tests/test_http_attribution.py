"""The HTTP backend against a real AKV server on loopback (the real SmolLM2): a reply's `attribution` read
back as the engine computes it, so `use_records: attention` runs against a server URL; a recorded reply
scored with `prompt_logprobs` as the engine scores it (the likelihood fidelity of a trace set)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from akv_core.attribution import Attribution
from sandbox.backends import BackendRequest
from sandbox.backends.http import HttpBackend
from sandbox.runs.harness import RunLimits, check_use_records, run_tasks
from test_server_support import LiveServer, live_server

pytestmark = [pytest.mark.server, pytest.mark.model]

SECRET = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "The secret code of the blue door is 4721."},
    {"role": "user", "content": "I had pasta for lunch today."},
    {"role": "user", "content": "What is the secret code of the blue door?"},
)
ANSWER = {"role": "assistant", "content": "The secret code of the blue door is 4721."}
HIDE_THE_CODE = {"3": [1]}


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> LiveServer:
    return live_server(request.config)


@pytest.fixture
def backend(server: LiveServer) -> HttpBackend:
    opened = HttpBackend(server.url, "smollm2")
    yield opened
    opened.close()


def test_a_reply_carries_the_attribution_the_engine_computes(server: LiveServer, backend: HttpBackend) -> None:
    request = BackendRequest(SECRET, drop_message={"3": [2]}, max_tokens=6, attribution=True)
    reply = backend.complete(request)
    assert isinstance(reply.attribution, Attribution)
    assert [m.message for m in reply.attribution.messages] == [0, 1, 2, 3]
    assert (reply.attribution.messages[2].mass, reply.attribution.messages[2].visible_tokens) == (0.0, 0)
    engine = server.engine.generate(list(SECRET), drop_message={"3": [2]}, max_tokens=6, temperature=0.0,
                                    attribution=True).attribution
    for sent, computed in zip(reply.attribution.messages, engine.messages, strict=True):
        assert sent.visible_tokens == computed.visible_tokens and sent.mass == pytest.approx(computed.mass, abs=1e-4)
    assert reply.attribution.tokens == engine.tokens
    assert backend.complete(BackendRequest(SECRET, max_tokens=2)).attribution is None   # not asked, not sent
    assert backend.lacks("return_attribution") is None and backend.lacks("prompt_logprobs") is None
    server.check_idle_and_intact()


def test_attention_use_records_run_against_a_server_url(server: LiveServer, backend: HttpBackend,
                                                        tmp_path: Path) -> None:
    check_use_records("attention", backend, "llm")   # the server lists return_attribution: not refused
    report = run_tasks("localcomp", "train", "expert-8k", agent="llm", backend=server.url, limit=1,
                       limits=RunLimits(max_steps=2, max_tokens=8), use_records="attention", out_dir=tmp_path)
    [result] = report.results
    assert result.status != "error", result.reason
    records = [json.loads(line) for line in (tmp_path / "trajectories" / f"{result.task_id}.jsonl").open()]
    assert records[0]["use_records"] == "attention"
    steps = [r for r in records if r["type"] == "exchange" and r["purpose"] == "agent"]
    assert len(steps) == 2 and all("used" in r for r in steps)
    assert not [r for r in records if r["type"] == "no_attribution"]   # every step had its attribution
    server.check_idle_and_intact()


def test_a_server_that_does_not_answer_is_refused_naming_the_setting_and_the_server() -> None:
    nobody = HttpBackend("http://127.0.0.1:9/v1")   # the discard port: no server answers there
    with pytest.raises(ValueError) as err:
        check_use_records("attention", nobody, "llm")
    nobody.close()
    assert str(err.value).startswith("use_records: 'attention' needs a backend with attribution")
    assert "cannot read the model card of http://127.0.0.1:9/v1" in str(err.value)


def test_a_recorded_reply_scores_over_http_as_the_engine_scores_it(server: LiveServer, backend: HttpBackend) -> None:
    for drop in (None, HIDE_THE_CODE):
        request = BackendRequest(SECRET, drop_message=drop or {})
        sent = backend.score_reply(request, ANSWER)
        closed = server.engine.score_continuation(list(SECRET), ANSWER, drop_message=drop)
        assert closed.token_ids[-1] in server.engine.tokenizer.eos_token_ids
        assert sent == pytest.approx(closed.logprobs[:-1], abs=1e-4)   # the end-of-turn token left out
    hidden = sum(backend.score_reply(BackendRequest(SECRET, drop_message=HIDE_THE_CODE), ANSWER))
    assert hidden < sum(backend.score_reply(BackendRequest(SECRET), ANSWER))   # the code was hidden
    server.check_idle_and_intact()
