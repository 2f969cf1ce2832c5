"""Real clients against a real `akv serve` (loopback, the embedded SmolLM2): the calls frameworks make.

The official `openai` SDK (sync, async, streaming, `parse()` with a Pydantic model, tools with a forced
`tool_choice`, `n`, log probabilities, the hints it sends), `litellm` as an OpenAI-compatible provider
(its context-overflow exception included), and an `openai-agents` run that calls a tool, through
`akv proxy`. Nothing leaves the machine: litellm reads its bundled cost map, agents trace nothing.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import httpx
import openai
import pytest
from pydantic import BaseModel

from akv_core.server import serve_in_thread
from test_server_support import MODEL, LiveServer, greeting, live_server

pytestmark = [pytest.mark.server, pytest.mark.model]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}
NOTE = {"type": "function", "function": {
    "name": "write_note", "description": "Write a note.",
    "parameters": {"type": "object", "properties": {"title": {"type": "string"}, "body": {"type": "string"}},
                   "required": ["title", "body"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> LiveServer:
    return live_server(request.config)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def litellm() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # its documented switch: no download at import
        import litellm

        yield litellm


@contextmanager
def proxied(upstream: str) -> Iterator[str]:
    """`akv proxy` with the expert policy in front of `upstream`, on a thread."""
    from akv_proxy import create_proxy_app
    from policy_dsl import load_policy
    from sandbox.backends.tokens import shared_tokenizer

    with serve_in_thread(create_proxy_app(load_policy("expert-8k"), upstream, shared_tokenizer(),
                                          timeout_s=120.0)) as url:
        yield url


def test_models_retrieve_and_an_unknown_model(client: openai.OpenAI) -> None:
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-9")
    assert caught.value.body["code"] == "model_not_found"


def test_n_choices_with_log_probabilities(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model=MODEL, messages=greeting("Name a color."), n=3,
                                                max_tokens=4, temperature=1.0, seed=11, logprobs=True,
                                                top_logprobs=3)
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    counted = 0
    for choice in completion.choices:
        entries = choice.logprobs.content
        counted += len(entries)
        # The entries are the generated tokens: their bytes are the text, exactly.
        if choice.finish_reason == "length":
            assert b"".join(bytes(entry.bytes) for entry in entries).decode() == choice.message.content
        for entry in entries:
            assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
            values = [top.logprob for top in entry.top_logprobs]
            assert values == sorted(values, reverse=True) and entry.logprob <= values[0] + 1e-9
    # Usage counts the prompt once and every choice's tokens (an ended choice's EOS included).
    assert counted <= completion.usage.completion_tokens <= counted + 3
    again = client.chat.completions.create(model=MODEL, messages=greeting("Name a color."), n=3,
                                           max_tokens=4, temperature=1.0, seed=11)
    assert [c.message.content for c in again.choices] == [c.message.content for c in completion.choices]
    assert again.choices[0].logprobs is None


def test_streamed_choices_match_the_plain_ones_sync_and_async(client: openai.OpenAI, server: LiveServer) -> None:
    body = {"model": MODEL, "messages": greeting("Count to three."), "max_tokens": 6, "temperature": 0,
            "n": 2, "logprobs": True}
    plain = client.chat.completions.create(**body)
    texts, entries = ["", ""], [0, 0]
    for chunk in client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            entries[choice.index] += len(choice.logprobs.content) if choice.logprobs else 0
    assert texts == [choice.message.content for choice in plain.choices]
    assert entries == [len(choice.logprobs.content) for choice in plain.choices]
    assert chunk.usage.completion_tokens == plain.usage.completion_tokens

    async def run() -> tuple[str, str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as aclient:
            reply = await aclient.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=6,
                                                          temperature=0)
            stream = await aclient.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=6,
                                                           temperature=0, stream=True)
            streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
            return reply.choices[0].message.content, streamed

    assert asyncio.run(run()) == (texts[0], texts[0])


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A city, as JSON."}],
                                               response_format=City, max_tokens=48, temperature=0)
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and city.name and city.country


def test_forced_tool_calls_required_and_named(client: openai.OpenAI) -> None:
    for choice, name in (("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")):
        completion = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, CLOCK],
                                                    tool_choice=choice, max_tokens=48, temperature=0)
        reply = completion.choices[0]
        assert reply.finish_reason == "tool_calls" and reply.message.content is None
        [call] = reply.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name == (name or call.function.name) in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
        else:
            assert set(arguments) <= {"zone"} and arguments.get("zone", "UTC") in ("UTC", "CET")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert caught.value.body["param"] == "tool_choice"


def test_a_forced_call_that_max_tokens_cuts_is_still_a_call_never_content(client: openai.OpenAI) -> None:
    # The model's note would take more than 40 tokens: the call is closed in time, its strings cut short.
    ask = greeting("Take a note of my shopping list: eggs, milk, bread, butter, cheese, apples.")
    body = {"model": MODEL, "messages": ask, "tools": [NOTE], "tool_choice": "required", "max_tokens": 40,
            "temperature": 0}
    reply = client.chat.completions.create(**body).choices[0]
    assert reply.finish_reason == "length" and reply.message.content is None
    [call] = reply.message.tool_calls
    assert call.function.name == "write_note" and isinstance(json.loads(call.function.arguments), dict)
    streamed = {"content": "", "arguments": "", "names": [], "finish": None}
    for chunk in client.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        streamed["content"] += delta.content or ""
        for part in delta.tool_calls or ():
            streamed["names"].append(part.function.name)
            streamed["arguments"] += part.function.arguments or ""
        streamed["finish"] = chunk.choices[0].finish_reason or streamed["finish"]
    assert streamed == {"content": "", "arguments": call.function.arguments, "names": ["write_note"],
                        "finish": "length"}
    # Too few tokens for the shortest call: it comes back as far as it was written, still in tool_calls.
    cut = client.chat.completions.create(**{**body, "max_tokens": 12}).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None and len(cut.message.tool_calls) == 1


def test_hints_are_ignored_and_named_and_typos_still_fail(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=greeting("Hi."), max_tokens=1, store=False, prompt_cache_key="agent-7",
        safety_identifier="user-1", verbosity="low", metadata={"run": "t"}, service_tier="auto",
        extra_body={"web_search_options": {}})
    assert raw.headers["x-akv-ignored-params"] == \
        "metadata,prompt_cache_key,safety_identifier,service_tier,store,verbosity,web_search_options"
    assert raw.parse().choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=greeting("Hi."), max_tokens=1,
                                       extra_body={"prompt_cache_ky": "agent-7"})
    assert caught.value.body["param"] == "prompt_cache_ky"


def test_generated_whitespace_is_kept(client: openai.OpenAI) -> None:
    for pattern, text in (("    x = 1", "    x = 1"), (" {3}", "   ")):
        body = {"model": MODEL, "messages": greeting("Write code."), "max_tokens": 8, "extra_body": {"regex": pattern}}
        assert client.chat.completions.create(**body).choices[0].message.content == text
        streamed = "".join(chunk.choices[0].delta.content or ""
                           for chunk in client.chat.completions.create(**body, stream=True) if chunk.choices)
        assert streamed == text


def test_litellm_completion_tools_and_context_overflow(litellm: ModuleType, server: LiveServer) -> None:
    target = {"model": f"openai/{MODEL}", "api_base": server.url + "/v1", "api_key": "unused"}
    reply = litellm.completion(**target, messages=greeting("Say hi."), max_tokens=4, temperature=0)
    assert reply.choices[0].message.content and reply.usage.prompt_tokens > 0
    called = litellm.completion(**target, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
                                max_tokens=48, temperature=0)
    assert called.choices[0].message.tool_calls[0].function.name == "get_weather"
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(**target, messages=greeting("word " * 9000), max_tokens=4, num_retries=0)


def test_an_agent_calls_its_tool_through_the_proxy(server: LiveServer) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city today."""
        cities.append(city)
        return f"Sunny in {city}."

    with proxied(server.url) as url:
        # The proxy's own server writes Date and Server; the upstream's copies are not passed on.
        response = httpx.get(url + "/v1/models")
        assert [len(response.headers.get_list(name)) for name in ("date", "server")] == [1, 1]
        model = OpenAIChatCompletionsModel(model=MODEL, openai_client=openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=0))
        # The settings an agent framework sends: hints, log probabilities, a forced tool call.
        settings = ModelSettings(tool_choice="required", temperature=0, max_tokens=48, metadata={"run": "test"},
                                 parallel_tool_calls=False, store=False, verbosity="low", top_logprobs=2)
        agent = Agent(name="forecaster", instructions="Answer with the tool.", tools=[get_weather], model=model,
                      model_settings=settings, tool_use_behavior="stop_on_first_tool")
        result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert len(cities) == 1 and result.final_output == f"Sunny in {cities[0]}."


def test_an_agent_whose_forced_call_is_cut_by_max_tokens_still_calls_its_tool(server: LiveServer) -> None:
    # The call takes 30 tokens; at 28 it is closed early (the city left empty), and the agent runs the tool
    # instead of taking the unfinished call's text for its final answer.
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city today."""
        cities.append(city)
        return f"Sunny in {city}."

    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0))
    agent = Agent(name="forecaster", instructions="Answer with the tool.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=28),
                  tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert len(cities) == 1 and result.final_output == f"Sunny in {cities[0]}."
