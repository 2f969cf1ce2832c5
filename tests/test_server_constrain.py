"""Constrained decoding through a real `akv serve` on loopback with the real SmolLM2.

The policy grammar (`policy_dsl.constrained_grammar`) at temperature 1: every sample parses and
validates; a JSON-schema request returns JSON matching the schema; streaming works under a
grammar; a bad grammar, or two constraints at once, is a 400 naming the field.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from policy_dsl import builtin_source, compile_policy, constrained_grammar, parse
from test_server_support import MODEL, interrupt, ready_url

pytestmark = [pytest.mark.server, pytest.mark.model]

SAMPLES = 100
RUNNING = 50   # the server batches this many samples per decode step
POLICY_PROMPT = [
    {"role": "system", "content": "You write KV-cache policies in the AKV policy language. An example:\n"
                                  + builtin_source("expert-8k")},
    {"role": "user", "content": "Write a new policy."},
]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 3, "items": {"enum": ["cat", "dog", "owl"]}}}}


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    from akv_core.home import akv_home

    env = {**os.environ, "AKV_HOME": str(akv_home().resolve()), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "akv_cli.main", "serve", "--port", "0", "--device", "cpu",
         "--max-running", str(RUNNING), "--kv-tokens", "16384", "--precision", "fp16"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        with httpx.Client(base_url=ready_url(process), timeout=900) as http:
            yield http
    finally:
        interrupt(process)


def chat(client: httpx.Client, body: dict) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": MODEL, **body})


@pytest.mark.slow
def test_policy_grammar_samples_at_temperature_1_all_parse_and_validate(client):
    body = {"messages": POLICY_PROMPT, "lark": constrained_grammar(), "temperature": 1.0, "max_tokens": 256}
    assert chat(client, {**body, "max_tokens": 1}).status_code == 200   # the prompt is cached once
    with ThreadPoolExecutor(SAMPLES) as pool:
        replies = list(pool.map(lambda seed: chat(client, {**body, "seed": seed}), range(SAMPLES)))
    texts = []
    for reply in replies:
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice   # the grammar ended it, not max_tokens
        texts.append(choice["message"]["content"])
    for text in texts:
        compile_policy(parse(text, filename="sample.akvp"), name="sample")
    assert len(set(texts)) > SAMPLES // 4   # temperature 1 explores, it does not repeat one policy


def test_json_schema_and_json_object_requests_return_json_that_matches(client):
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    bodies = [{"messages": [{"role": "user", "content": "Describe a person as JSON."}], "seed": seed,
               "temperature": 1.0, "max_tokens": 60, "response_format": schema_format} for seed in range(6)]
    bodies.append({**bodies[0], "response_format": {"type": "json_object"}, "max_tokens": 40})
    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda body: chat(client, body), bodies))
    for reply in replies[:-1]:
        assert reply.status_code == 200, reply.text
        value = json.loads(reply.json()["choices"][0]["message"]["content"])
        assert set(value) == {"name", "age", "pets"}
        assert isinstance(value["name"], str) and len(value["name"]) <= 16
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
        assert len(value["pets"]) <= 3 and set(value["pets"]) <= {"cat", "dog", "owl"}
    free = replies[-1].json()["choices"][0]
    if free["finish_reason"] == "stop":
        assert isinstance(json.loads(free["message"]["content"]), dict)
    else:   # cut off by max_tokens: still the start of an object
        assert free["message"]["content"].startswith("{")


def test_a_streamed_constrained_completion_matches_and_ends_by_the_grammar(client):
    body = {"messages": [{"role": "user", "content": "Pick a number."}], "stream": True,
            "regex": "[0-9]{3}-[a-z]{2}", "temperature": 1.0, "max_tokens": 30, "seed": 1}
    deltas, finish = [], None
    with client.stream("POST", "/v1/chat/completions", json={"model": MODEL, **body}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            deltas.append(choice["delta"].get("content") or "")
            finish = choice["finish_reason"] or finish
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", "".join(deltas)) and finish == "stop"


BAD_CONSTRAINTS = [
    ({"lark": "start: foo"}, "lark", "unknown name"),
    ({"lark": "   "}, "lark", "empty"),
    ({"regex": "a(b"}, "regex", "unclosed group"),
    ({"ebnf": "root ::= (("}, "ebnf", "grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema", "objekt"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", "object"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_object"),
    ({"regex": "[0-9]+", "lark": 'start: "a"'}, "lark", "regex and lark"),
    ({"response_format": {"type": "json_object"}, "ebnf": 'root ::= "a"'}, "ebnf", "response_format and ebnf"),
]


@pytest.mark.parametrize("change, param, words", BAD_CONSTRAINTS)
def test_a_bad_constraint_is_a_400_naming_the_field(client, change, param, words):
    reply = chat(client, {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2, **change})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert words in error["message"] and error["message"].startswith(param + ":")
    # The server still serves: a text response_format is the default and needs no grammar.
    assert chat(client, {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 1,
                         "response_format": {"type": "text"}}).status_code == 200
