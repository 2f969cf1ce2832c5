"""The reply fields over HTTP (a real server, the real SmolLM2): `return_attribution`, and a final
assistant message scored with `continue_final_message` + `prompt_logprobs` (vLLM's shape)."""
from __future__ import annotations

import json

import pytest

from akv_core.attribution import Attribution
from test_server_support import LiveServer, live_server

pytestmark = [pytest.mark.server, pytest.mark.model]

SECRET = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "The secret code of the blue door is 4721."},
    {"role": "user", "content": "I had pasta for lunch today."},
    {"role": "user", "content": "What is the secret code of the blue door?"},
]
ANSWER = {"role": "assistant", "content": "The secret code of the blue door is 4721."}
SCORE = {"continue_final_message": True, "add_generation_prompt": False, "prompt_logprobs": 0, "max_tokens": 1,
         "temperature": 0}


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> LiveServer:
    return live_server(request.config)


def test_attribution_is_returned_only_when_asked(server: LiveServer) -> None:
    plain = server.chat({"messages": SECRET, "max_tokens": 4, "temperature": 0}).json()
    assert "attribution" not in plain["choices"][0]
    body = server.chat({"messages": SECRET, "max_tokens": 12, "temperature": 0, "return_attribution": True,
                        "drop_message": {"3": [2]}, "n": 2}).json()
    for choice in body["choices"]:
        attribution = Attribution.from_dict(choice["attribution"])
        assert [m.message for m in attribution.messages] == [0, 1, 2, 3]
        assert attribution.messages[2].mass == 0.0 and attribution.messages[2].visible_tokens == 0
        shares = sum(m.mass for m in attribution.messages) + attribution.generation_header + attribution.reply
        assert shares == pytest.approx(1.0, abs=1e-6)
        assert attribution.tokens == choice_tokens(body, choice)
    assert server.client.get("/server_info").json()["akv"]["return_attribution"] is True
    server.check_idle_and_intact()


def choice_tokens(body: dict, choice: dict) -> int:
    """A choice's generated tokens (n choices of equal greedy length split completion_tokens evenly)."""
    return body["usage"]["completion_tokens"] // len(body["choices"])


def test_streamed_attribution_comes_with_the_finish_chunk(server: LiveServer) -> None:
    with server.client.stream("POST", "/v1/chat/completions", json={
            "model": "smollm2", "messages": SECRET, "max_tokens": 6, "stream": True,
            "return_attribution": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["attribution"]["tokens"] >= 1
    assert all("attribution" not in c["choices"][0] for c in chunks if c not in finish and c["choices"])


def test_prompt_logprobs_score_the_final_message(server: LiveServer) -> None:
    response = server.chat({"messages": [*SECRET, ANSWER], **SCORE, "prompt_logprobs": 2,
                            "return_attribution": True})
    assert response.status_code == 200, response.text
    body = response.json()
    scored = body["prompt_logprobs"]
    assert len(scored) == body["usage"]["prompt_tokens"]   # aligned with the prompt's tokens
    engine = server.engine
    reference = engine.score_continuation(SECRET, ANSWER)   # the same tokens, closed by the end-of-turn token
    tail = scored[-(len(reference.token_ids) - 1):]
    assert all(entry is None for entry in scored[:-len(tail)])
    for entry, token, logprob in zip(tail, reference.token_ids, reference.logprobs):
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(logprob, abs=1e-4) and own["rank"] >= 1
        assert 1 <= len(entry) <= 3 and isinstance(own["decoded_token"], str)
    assert body["usage"]["completion_tokens"] == 1
    assert body["choices"][0]["attribution"]["tokens"] == len(tail) + 1
    # Under a drop of the message that holds the code, the answer is less likely.
    dropped = server.chat({"messages": [*SECRET, ANSWER], **SCORE, "drop_message": {"3": [1]}}).json()
    own = [next(iter(entry.values()))["logprob"] for entry in dropped["prompt_logprobs"][-len(tail):]]
    kept = [entry[str(token)]["logprob"] for entry, token in zip(tail, reference.token_ids)]
    assert sum(own) < sum(kept)
    server.check_idle_and_intact()


def test_a_kept_history_scores_the_reply_after_its_drops(server: LiveServer) -> None:
    """keep_text_drop: the reply ends both the kept and the full history; what the kept one leaves out
    is hidden from the reply (the drop takes effect right before it)."""
    kept = [SECRET[0], SECRET[3], ANSWER]
    rule = {"type": "keep_text_drop", "full_messages": [*SECRET, ANSWER], "force": False}
    dropped = server.chat({"messages": kept, **SCORE, "drop_rule": rule})
    assert dropped.status_code == 200, dropped.text
    whole = server.chat({"messages": [*SECRET, ANSWER], **SCORE}).json()
    logprob = lambda body: sum(next(iter(e.values()))["logprob"] for e in body["prompt_logprobs"] if e)
    assert logprob(dropped.json()) < logprob(whole)
    server.check_idle_and_intact()


BAD_REPLY_FIELDS = [
    # (body changes, param)
    ({"return_attribution": "yes"}, "return_attribution"),
    ({"return_attribution": 1}, "return_attribution"),
    ({"prompt_logprobs": 0}, "prompt_logprobs"),
    ({"prompt_logprobs": "0", "continue_final_message": True}, "prompt_logprobs"),
    ({"continue_final_message": True}, "messages[3].role"),
    ({"continue_final_message": "true"}, "continue_final_message"),
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"messages": [*SECRET, ANSWER], **SCORE, "add_generation_prompt": True}, "add_generation_prompt"),
    ({"messages": [*SECRET, ANSWER], **SCORE, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"messages": [*SECRET, ANSWER], **SCORE, "stream": True}, "stream"),
    ({"messages": [*SECRET, ANSWER], **SCORE, "n": 2}, "n"),
    ({"messages": [*SECRET, ANSWER], **SCORE, "regex": "[0-9]+"}, "continue_final_message"),
    ({"messages": [ANSWER], **SCORE}, "messages"),
    ({"messages": [*SECRET, {"role": "assistant", "content": "code " * 9000}], **SCORE}, "messages[4]"),
]


@pytest.mark.parametrize(("changes", "param"), BAD_REPLY_FIELDS)
def test_bad_reply_fields_are_400s_naming_the_field(server: LiveServer, changes: dict, param: str) -> None:
    response = server.chat({"messages": SECRET, "max_tokens": 1, **changes})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    if param == "messages[4]":   # OpenAI's words for an overflow, which clients recognize
        assert error["code"] == "context_length_exceeded"
    else:
        assert error["message"].startswith(param), error
    server.check_idle_and_intact()
