"""The HTTP API on a real server (loopback, the real SmolLM2): endpoints, errors, AKV usage."""
from __future__ import annotations

import json
import logging
import math
import re
import time

import pytest

from test_server_support import MODEL, LiveServer, greeting, live_server

pytestmark = [pytest.mark.server, pytest.mark.model]

# Upstream's README history: message 3 triggers a drop of messages 1 and 2, then a reposition.
README_HISTORY = [
    {"role": "system", "content": "You are a helpful research assistant."},
    {"role": "user", "content": "Find the capital of Australia and its population."},
    {"role": "assistant", "content": "The capital of Australia is Canberra."},
    {"role": "user", "content": "Now tell me about its climate in one sentence."},
]


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> LiveServer:
    return live_server(request.config)


def details(body: dict) -> dict:
    return body["usage"]["prompt_tokens_details"]


def assert_usage_adds_up(body: dict) -> None:
    usage, d = body["usage"], details(body)
    assert set(d) >= {"cached_tokens", "drop_skipped_tokens", "repos_tokens", "prefilled_tokens"}
    assert usage["prompt_tokens"] == (d["prefilled_tokens"] + d["cached_tokens"]
                                      + d["repos_tokens"] + d["drop_skipped_tokens"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_health_models_and_metrics(server: LiveServer) -> None:
    assert server.client.get("/health").json()["status"] == "ok"
    models = server.client.get("/v1/models").json()
    assert [card["id"] for card in models["data"]] == [MODEL]
    info = server.client.get("/server_info").json()
    assert info["model"] == MODEL and models["data"][0]["akv"] == info["akv"]
    # The report is what the server accepts: each listed rule type passes validation, others do not.
    assert info["akv"]["drop_rule_types"] == ["message_drop", "thinking_drop", "text_drop", "keep_text_drop"]
    assert set(info["akv"]["usage_details"]) == {"cached_tokens", "drop_skipped_tokens", "repos_tokens",
                                                 "prefilled_tokens", "retained_tokens"}
    hi = greeting("Hi.")
    valid = {"thinking_drop": {}, "text_drop": {"drop_messages": [None] * len(hi)},
             "keep_text_drop": {"full_messages": hi}, "forget": {}}
    for kind, fields in valid.items():
        answer = server.chat({"messages": hi, "max_tokens": 1, "drop_rule": {"type": kind, **fields}})
        assert (answer.status_code == 200) == (kind in info["akv"]["drop_rule_types"]), answer.text
    # OpenAI fields that change nothing here are accepted (clients send them by default).
    assert server.chat({"messages": greeting("Say hi."), "max_tokens": 1, "store": False,
                        "metadata": {"run": "t"}, "n": 1}).status_code == 200
    metrics = server.client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    values = {line.split(" ")[0]: float(line.split(" ")[1])
              for line in metrics.text.splitlines() if line and not line.startswith("#")}
    assert values['akv_requests_total{endpoint="chat",outcome="ok"}'] >= 1
    assert values['akv_tokens_total{kind="prefilled"}'] > 0
    assert values["akv_kv_slots_used"] + values["akv_kv_slots_free"] == values["akv_kv_slots"]
    assert values["akv_request_latency_seconds_count"] >= 1
    assert values["akv_kv_slots_cached"] > 0
    assert "akv_queue_length" in values and "akv_time_to_first_token_seconds_count" in values
    assert values['akv_forward_passes_total{kind="prefill"}'] >= 1
    assert values['akv_forward_seconds_total{kind="prefill"}'] > 0
    assert 'akv_forward_passes_total{kind="decode"}' in values and 'akv_forward_seconds_total{kind="decode"}' in values


BAD_REQUESTS = [
    # (body changes, status, param)
    ({"drop_message": {"9": [1]}}, 400, "drop_message.9"),
    ({"drop_message": {"3": [7]}}, 400, "drop_message.3[0]"),
    ({"drop_message": {"1": [3]}}, 400, "drop_message.1[0]"),  # a drop after its trigger
    ({"drop_message": {"one": [0]}}, 400, "drop_message.one"),
    ({"drop_message": {"3": ["1"]}}, 400, "drop_message.3[0]"),
    ({"reposition": [4]}, 400, "reposition[0]"),
    ({"drop_message": {"3": [1]}, "drop_rule": {"type": "message_drop", "drop_messages": {}}},
     400, "drop_rule"),
    ({"drop_rule": {"type": "forget_everything"}}, 400, "drop_rule.type"),
    ({"drop_rule": {"type": "thinking"}}, 400, "drop_rule.type"),
    ({"drop_rule": {"type": "thinking_drop"}, "drop_message": {}}, 400, "drop_rule"),
    ({"drop_rule": {"type": "thinking_drop", "drop_messages": {"3": [1]}}}, 400, "drop_rule.drop_messages"),
    ({"drop_rule": {"type": "thinking_drop"}, "reposition": [4]}, 400, "reposition[0]"),
    ({"drop_rule": {"type": "message_drop", "drop_messages": {"3": [5]}}},
     400, "drop_rule.drop_messages.3[0]"),
    # text_drop entries are aligned with messages; keep_text_drop's kept messages project full_messages
    ({"drop_rule": {"type": "text_drop", "drop_messages": [None, None]}}, 400, "drop_rule.drop_messages"),
    ({"drop_rule": {"type": "text_drop", "drop_messages": [None, {"role": "user", "content": "Canberra"}, None, None]}},
     400, "drop_rule.drop_messages[1].content"),
    ({"drop_rule": {"type": "text_drop", "drop_messages": [
        None, {"role": "user", "content": "the", "occurrence": 2}, None, None]}},
     400, "drop_rule.drop_messages[1].occurrence"),
    ({"drop_rule": {"type": "text_drop", "drop_messages": [
        None, {"role": "user", "content": "capital", "colour": "red"}, None, None]}},
     400, "drop_rule.drop_messages[1].colour"),
    ({"drop_rule": {"type": "text_drop", "drop_messages": [None] * 4, "force": True}}, 400, "drop_rule.force"),
    ({"drop_rule": {"type": "text_drop", "drop_messages": [None, {"role": "user", "content": ["x"] * 1025},
                                                           None, None]}}, 400, "drop_rule.drop_messages[1].content"),
    ({"drop_rule": {"type": "keep_text_drop", "full_messages": README_HISTORY[:2]}}, 400, "drop_rule.full_messages"),
    ({"drop_rule": {"type": "keep_text_drop", "full_messages": README_HISTORY[::-1]}}, 400, "drop_rule.full_messages"),
    ({"drop_rule": {"type": "keep_text_drop", "full_messages": README_HISTORY, "force": "yes"}},
     400, "drop_rule.force"),
    ({"drop_rule": {"type": "keep_text_drop", "full_messages": README_HISTORY, "kept": []}}, 400, "drop_rule.kept"),
    ({"drop_rule": {"type": "keep_text_drop", "full_messages": [{"role": "wizard", "content": "x"}]}},
     400, "drop_rule.full_messages[0].role"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ({"temperature": 7}, 400, "temperature"),
    ({"drop_messages": {"3": [1]}}, 400, "drop_messages"),
    ({"n": 9}, 400, "n"),
    ({"n": 0}, 400, "n"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),   # OpenAI asks for logprobs: true with it
    ({"tool_choice": "required"}, 400, "tool_choice"),   # no tools to call
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"}, 400, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "regex": "x"},
     400, "regex"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                                {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     400, "messages[0].content[1]"),
    ({"moderation": {"model": "omni-moderation-latest"}}, 400, "moderation"),
    ({"modalities": ["text", "audio"]}, 400, "modalities"),
    ({"prompt_cache_ky": "agent-7"}, 400, "prompt_cache_ky"),   # hints are accepted by name, typos are not
    ({"model": "gpt-9"}, 404, "model"),
    # Found by a campaign of hostile requests: each was a 500, a silent guess or a 400 naming nothing.
    ({"drop_message": {"³": [1]}}, 400, "drop_message.³"),       # passes isdigit(), then int() fails
    ({"drop_message": {"٣": [1]}}, 400, "drop_message.٣"),       # Arabic-Indic 3 was taken as 3
    ({"drop_message": {" 3": [1]}}, 400, "drop_message. 3"),
    ({"messages": [README_HISTORY[0], {"role": "user", "content": "x\ud800y"}]}, 400, "messages[1].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, 400, "messages[0].content"),
    ({"tools": [{"type": "function", "function": {"name": "f\ud800"}}]}, 400, "tools[0].function.name"),
    ({"seed": 2**64}, 400, "seed"),
    ({"seed": -2**63 - 1}, 400, "seed"),
    ({"stream": "yes"}, 400, "stream"),
    ({"stream": 1}, 400, "stream"),
    ({"stream_options": {"include_usage": "true"}}, 400, "stream_options.include_usage"),
    ({"temperature": "1"}, 400, "temperature"),
    ({"top_p": 1.01}, 400, "top_p"),
    ({"logprobs": "no"}, 400, "logprobs"),
]


@pytest.mark.parametrize("change,status,param", BAD_REQUESTS)
def test_bad_requests_get_an_openai_error_naming_the_field(server: LiveServer, change: dict,
                                                           status: int, param: str) -> None:
    body = {"model": MODEL, "messages": README_HISTORY, "max_tokens": 2, **change}
    # json.dumps escapes lone surrogates as "\ud800", as a client's JSON encoder may send them.
    response = server.client.post("/v1/chat/completions", content=json.dumps(body),
                                  headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error" and error["message"]
    if status == 404:
        assert error["code"] == "model_not_found"


def test_invalid_json_and_a_prompt_longer_than_the_context(server: LiveServer) -> None:
    for raw in (b'{"model": "smollm2", "messages": [', b"", b"\xff\xfe"):
        response = server.client.post("/v1/chat/completions", content=raw,
                                       headers={"content-type": "application/json"})
        assert response.status_code == 400, raw
        assert response.json()["error"]["type"] == "invalid_request_error"
    too_long = greeting("word " * 20_000)
    response = server.chat({"messages": too_long, "max_tokens": 2})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
    # OpenAI's words, which litellm and LangChain match to recognize an overflow.
    assert re.fullmatch(r"This model's maximum context length is 8192 tokens\. However, your messages resulted "
                        r"in \d+ tokens\. Please reduce the length of the messages\.", error["message"])
    server.check_idle_and_intact()


def test_images_405_and_model_routes_answer_as_openai_does(server: LiveServer) -> None:
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    error = server.chat({**image, "max_tokens": 1}).json()["error"]
    assert error["message"] == "messages[0].content[0]: images are not supported by this model"
    wrong_method = server.client.get("/v1/chat/completions")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    assert server.client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    unknown = server.client.get("/v1/models/gpt-9")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_readme_example_reports_drop_skipped_and_repositioned_tokens(server: LiveServer) -> None:
    # An agent's earlier turn put the history in the cache; this turn drops and repositions.
    earlier = server.chat({"messages": README_HISTORY, "max_tokens": 1, "temperature": 0})
    assert earlier.status_code == 200
    history = README_HISTORY + [
        {"role": "assistant", "content": "Canberra has a mild oceanic climate."},
        {"role": "user", "content": "Thanks. Summarize in three words."},
    ]
    response = server.chat({"messages": history, "max_tokens": 1, "temperature": 0,
                            "drop_message": {"3": [1, 2]}, "reposition": [3]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert_usage_adds_up(body)
    assert details(body)["drop_skipped_tokens"] > 0
    assert details(body)["repos_tokens"] > 0
    choice = body["choices"][0]
    assert choice["finish_reason"] in {"stop", "length"}
    assert list(choice) == ["index", "message", "logprobs", "finish_reason"]
    assert choice["message"]["role"] == "assistant" and "content" in choice["message"]
    server.check_idle_and_intact()


def test_thinking_drop_skips_earlier_reasoning_and_repeats_as_a_full_hit(server: LiveServer) -> None:
    history = [*README_HISTORY[:2],
               {"role": "assistant", "content": "The capital of Australia is Canberra.",
                "reasoning_content": "Sydney is larger, but the capital is Canberra."},
               README_HISTORY[3]]
    start, end = server.engine.tokenizer.render(history).reasoning_spans[2]
    body = {"messages": history, "max_tokens": 1, "temperature": 0,
            "drop_rule": {"type": "thinking_drop"}, "reposition": [3]}
    first = server.chat(body)
    assert first.status_code == 200, first.text
    assert_usage_adds_up(first.json())
    assert details(first.json())["drop_skipped_tokens"] == 0   # the reasoning was computed here
    again = server.chat(body).json()
    assert_usage_adds_up(again)
    assert details(again)["drop_skipped_tokens"] == end - start > 0
    assert details(again)["prefilled_tokens"] == 1 and details(again)["repos_tokens"] == 0
    assert again["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    server.check_idle_and_intact()


def test_streaming_returns_the_same_text_with_usage_in_the_final_chunk(server: LiveServer) -> None:
    body = {"messages": greeting("Name three colors."), "max_tokens": 6, "temperature": 0}
    plain = server.chat(body).json()
    with server.client.stream("POST", "/v1/chat/completions",
                              json={"model": MODEL, **body, "stream": True,
                                    "stream_options": {"include_usage": True}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == plain["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and "usage" in chunks[-1]
    assert chunks[-1]["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert_usage_adds_up(chunks[-1])
    # The second, identical prompt was served from the cache.
    assert details(chunks[-1])["cached_tokens"] > 0


def test_openai_client_round_trip_with_extra_body(server: LiveServer) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    server.chat({"messages": README_HISTORY, "max_tokens": 1, "temperature": 0})
    completion = client.chat.completions.create(
        model=MODEL, messages=README_HISTORY, max_tokens=1, temperature=0,
        extra_body={"drop_message": {3: [1, 2]}, "reposition": [3]},
    )
    assert completion.choices[0].message.role == "assistant"
    prompt_details = completion.usage.prompt_tokens_details
    assert prompt_details.cached_tokens is not None
    assert prompt_details.model_extra["drop_skipped_tokens"] >= 0
    assert "repos_tokens" in prompt_details.model_extra
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=README_HISTORY, max_tokens=4,
                                       extra_body={"reposition": [99]})
    assert caught.value.body["param"] == "reposition[0]"
    stream = client.chat.completions.create(model=MODEL, messages=README_HISTORY, max_tokens=2,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_a_request_the_pool_can_never_hold_is_refused_cleanly(server: LiveServer) -> None:
    # Dropping message 1 and repositioning moves ~5K keys (5 tokens a repeat): prompt plus re-rotated copies
    # exceed the 8K-slot pool, which the engine finds only when it plans the admission.
    history = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "Short note."},
               {"role": "user", "content": "lorem ipsum " * 1_000},
               {"role": "user", "content": "Done?"}]
    body = {"messages": history, "max_tokens": 1, "drop_message": {"3": [1]}, "reposition": [3]}
    response = server.chat(body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages"
    assert response.json()["error"]["code"] == "kv_capacity_exceeded"
    with server.client.stream("POST", "/v1/chat/completions",
                              json={"model": MODEL, **body, "stream": True}) as streamed:
        events = [line[len("data: "):] for line in streamed.iter_lines() if line]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "kv_capacity_exceeded"
    server.check_idle_and_intact()


def test_every_request_gets_one_access_log_line(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    body = {"messages": greeting("Say hi."), "max_tokens": 2, "temperature": 0}
    with caplog.at_level(logging.INFO, logger="akv.access"):
        ok = server.chat(body).json()
        server.chat({**body, "max_tokens": 0})
        with server.client.stream("POST", "/v1/chat/completions",
                                  json={"model": MODEL, **body, "stream": True}) as streamed:
            list(streamed.iter_lines())
        usage = ok["usage"]
        served = (f"POST /v1/chat/completions 200 prompt={usage['prompt_tokens']} "
                  f"completion={usage['completion_tokens']} cached=")
        for _ in range(200):   # a line is written once its response has gone; an earlier test's may come late
            lines = [r.getMessage() for r in caplog.records if r.name == "akv.access"]
            lines = [line for line in lines if line.startswith(served) or " 400 " in line]
            if len(lines) >= 3:
                break
            time.sleep(0.01)
    assert len(lines) == 3, lines
    assert lines[0].startswith(served) and lines[2].startswith(served), lines
    assert lines[1].startswith("POST /v1/chat/completions 400 prompt=- completion=- cached=- latency=")
    assert all(line.endswith("s") and "latency=" in line for line in lines)


def test_text_drops_skip_the_cut_tokens_and_bad_ones_change_nothing(server: LiveServer) -> None:
    text_drop = {"type": "text_drop", "drop_messages": [
        None, {"role": "user", "content": " and its population"}, {"role": "assistant", "content": "Canberra"}, None]}
    kept = [README_HISTORY[0], {"role": "user", "content": "Find the capital of Australia"}, README_HISTORY[3]]
    keep_text_drop = {"type": "keep_text_drop", "full_messages": README_HISTORY}
    for rule, messages in ((text_drop, README_HISTORY), (keep_text_drop, kept)):
        body = {"messages": messages, "max_tokens": 1, "temperature": 0, "drop_rule": rule}
        first = server.chat(body)
        assert first.status_code == 200, first.text
        bad = server.chat({**body, "drop_rule": {**rule, "force": 1}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "drop_rule.force"
        again = server.chat(body).json()
        assert_usage_adds_up(again)
        # a full hit: the cut tokens were matched and not read (upstream's drop_skipped_tokens)
        assert details(again)["prefilled_tokens"] == 1 and details(again)["drop_skipped_tokens"] > 0, again
        assert again["usage"]["prompt_tokens"] == first.json()["usage"]["prompt_tokens"]
    server.check_idle_and_intact()


def test_greedy_log_probabilities_put_the_sampled_token_first(server: LiveServer) -> None:
    body = {"messages": greeting("Name three colors."), "max_tokens": 5, "temperature": 0}
    plain = server.chat(body).json()["choices"][0]
    scored = server.chat({**body, "logprobs": True, "top_logprobs": 5}).json()["choices"][0]
    assert scored["message"] == plain["message"] and plain["logprobs"] is None   # asking changes nothing else
    for entry in scored["logprobs"]["content"]:
        best = entry["top_logprobs"][0]
        assert (entry["token"], entry["logprob"]) == (best["token"], best["logprob"])
        assert sum(math.exp(top["logprob"]) for top in entry["top_logprobs"]) <= 1 + 1e-9
    assert "".join(entry["token"] for entry in scored["logprobs"]["content"]) == plain["message"]["content"]
    server.check_idle_and_intact()
