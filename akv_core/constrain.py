"""Grammar-constrained decoding: what a request's output must match, and its per-request matcher.

A `Grammar` is a Lark grammar, a regex, a GBNF/EBNF grammar, a JSON schema or "any JSON object".
`Constrainer.start(grammar)` compiles it with llguidance (on the submitting thread, so a bad
grammar is refused before the request is queued) into a `TokenConstraint`: before each sample the
engine calls `mask(logits_row)`, which sets every token the grammar forbids to -inf (EOS is
allowed only where the grammar accepts), and after it `advance(token)`, which says whether the
grammar can go no further (the request then ends with finish reason "stop"). A request without a
grammar runs no code of this module.

A forced tool call (`tool_call_grammar`, a `CallGrammar`) also knows how many tokens are left:
before each sampled token is taken, `keep_within(token, left)` checks that the call could still be
closed after it (`akv_core.call_closing`); where it could not, the constraint writes the shortest
closing instead, one token per step, and the request ends with finish reason "length" and a
complete call whose arguments are valid JSON cut short.
"""
from __future__ import annotations

import codecs
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import torch

from akv_core.call_closing import CallCloser

# JSON output on one line with the usual separators: a flexible whitespace pattern lets a small
# model emit blank lines forever instead of closing the object.
JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("lark", "regex", "ebnf", "json_schema")
# Compiled matchers kept per grammar: compiling a large grammar takes up to ~0.5 s, a copy 0.1 ms.
CACHED_GRAMMARS = 16
# The values a forced call's closing tries where its arguments are due one, shortest first (`CallConstraint`).
CLOSING_VALUES = ('""', "0", "false", "[]", "{}", "null")


class GrammarError(ValueError):
    """llguidance refused the grammar, regex or schema; the message says where and why."""


@dataclass(frozen=True)
class Grammar:
    """What the generated text must match. `text` is the grammar, the regex or the schema's JSON."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if not isinstance(self.text, str) or not self.text.strip():
            raise GrammarError(f"the {self.kind} grammar is empty")

    @classmethod
    def lark(cls, text: str) -> Grammar:
        return cls("lark", text)

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        return cls("regex", pattern)

    @classmethod
    def ebnf(cls, text: str) -> Grammar:
        """GBNF (llama.cpp's EBNF), as SGLang's `ebnf` field takes it; Lark text is accepted too."""
        return cls("ebnf", text)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool) -> Grammar:
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls.json_schema({"type": "object"})

    def compile(self) -> str:
        """The llguidance grammar text; GrammarError for text llguidance cannot even read."""
        try:
            if self.kind == "lark":
                return llguidance.LLMatcher.grammar_from_lark(self.text)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.text)
            if self.kind == "ebnf":
                return llguidance.grammar_from("ebnf", self.text)
            return llguidance.LLMatcher.grammar_from_json_schema(_schema(self.text), defaults=JSON_LAYOUT)
        except (ValueError, TypeError) as error:
            raise GrammarError(str(error).strip() or f"invalid {self.kind} grammar") from None


@dataclass(frozen=True)
class CallGrammar(Grammar):
    """The grammar of a forced tool call, with the names it may call (in the order declared): the
    engine closes such a call before its tokens run out (`CallConstraint`)."""

    names: tuple[str, ...] = ()


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], name: str | None = None) -> CallGrammar:
    """One tool call in the chat renderer's format (`akv_core.chat`): `<tool_call>`, a line with
    `{"name": ..., "arguments": {...}}`, `</tool_call>`, nothing after it.

    `tools` are OpenAI tool declarations (`{"type": "function", "function": {"name", "parameters"}}`);
    the call names one of them (`name`: that one) and its arguments follow that tool's parameter
    schema (any object where it declares none). This is how a request's `tool_choice` of
    `required` or a named function is kept: the model cannot answer in text instead. Objects
    with declared properties take no others unless their schema says so (as OpenAI's strict
    mode): a small model otherwise invents arguments until it runs out of tokens.
    """
    calls: list[dict[str, Any]] = []
    definitions: dict[str, Any] = {}
    for index, tool in enumerate(tools):
        function = tool.get("function", tool)
        if name is not None and function.get("name") != name:
            continue
        try:
            arguments = _arguments_schema(function.get("parameters"), f"tool{index}.", definitions)
        except RecursionError:
            raise GrammarError(f"the parameters of tool {index} are nested too deeply") from None
        calls.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                      "properties": {"name": {"const": function.get("name")}, "arguments": arguments}})
    if not calls:
        raise GrammarError(f"no tool named {name!r}" if name is not None else "no tools to call")
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_LAYOUT}
    if definitions:
        schema["$defs"] = definitions
    text = 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(schema)
    return CallGrammar("lark", text, tuple(call["properties"]["name"]["const"] for call in calls))


def _arguments_schema(parameters: Any, prefix: str, definitions: dict[str, Any]) -> Any:
    """A tool's parameter schema placed inside the call schema: its `$defs` (or `definitions`) move
    to the call schema's root under `prefix`, and its `$ref`s follow them (pydantic writes nested
    models so, and a `#/...` reference means the root of the document it is in)."""
    if not isinstance(parameters, dict) or not parameters:
        return {"type": "object"}
    parameters = _closed(parameters)
    local: dict[str, Any] = {}
    for key in ("definitions", "$defs"):
        if isinstance(parameters.get(key), dict):
            local.update(parameters[key])
    if not local:
        return parameters
    body = {key: value for key, value in parameters.items() if key not in ("definitions", "$defs")}
    for key, value in local.items():
        definitions[prefix + key] = _rebased(value, prefix)
    return _rebased(body, prefix)


def _closed(value: Any) -> Any:
    """`value` with `additionalProperties: false` on every object schema that declares properties
    and says nothing about others."""
    if isinstance(value, list):
        return [_closed(item) for item in value]
    if not isinstance(value, dict):
        return value
    out = {key: _closed(item) for key, item in value.items()}
    if value.get("type") == "object" and isinstance(value.get("properties"), dict) \
            and "additionalProperties" not in value:
        out["additionalProperties"] = False
    return out


def _rebased(value: Any, prefix: str) -> Any:
    """`value` with every local `$ref` pointing under `#/$defs/PREFIX`."""
    if isinstance(value, list):
        return [_rebased(item, prefix) for item in value]
    if not isinstance(value, dict):
        return value
    out = {key: _rebased(item, prefix) for key, item in value.items()}
    ref = value.get("$ref")
    for root in ("#/$defs/", "#/definitions/"):
        if isinstance(ref, str) and ref.startswith(root):
            out["$ref"] = f"#/$defs/{prefix}{ref[len(root):]}"
    return out


class TokenConstraint:
    """One request's matcher: masks logits rows and advances by the sampled tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._bits = np.empty((vocab_size + 31) // 32, dtype=np.int32)

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits of every token the grammar forbids next to -inf (in place, fp32 CPU row).

        GrammarError if the matcher has failed or allows no token at all: a failed llguidance
        matcher would allow EOS alone, and the request would end as "stop" with text outside
        its grammar, so the engine fails this request instead (its neighbours are not touched).
        """
        if self._matcher.is_error():
            raise GrammarError(f"grammar: the matcher failed earlier: {self.error}")
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._vocab_size]
        if not allowed.any():
            raise GrammarError(f"grammar: no token is allowed next ({self.error or 'a dead end'})")
        row = logits.numpy()
        np.copyto(row[: len(allowed)], -np.inf, where=allowed == 0)
        row[len(allowed):] = -np.inf

    def advance(self, token: int) -> bool:
        """Consume the sampled token; True when the grammar allows nothing more after it.

        GrammarError if the matcher fails (a token outside its mask, a resource limit): the
        engine then fails this request alone.
        """
        if not self._matcher.consume_token(token):
            raise GrammarError(f"grammar: the matcher failed at token {token}: {self.error}")
        return self._matcher.is_stopped()

    def keep_within(self, token: int, left: int) -> int:
        """The token to take, given the sampled `token` and the tokens `left` to the request (this
        one included): `token` itself, but for a forced call (`CallConstraint`)."""
        return token

    @property
    def cut_short(self) -> bool:
        """Whether the output was closed early because the tokens were running out."""
        return False

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a token outside the grammar, a resource limit), or None."""
        if not self._matcher.is_error():
            return None
        return _one_line(self._matcher.get_error() or "the matcher failed")

    @property
    def accepting(self) -> bool:
        return self._matcher.is_accepting()


class CallConstraint(TokenConstraint):
    """A forced tool call's matcher that closes the call before the request's tokens run out.

    Once a sampled token would leave too few tokens to close the call after it, the shortest closing
    (`CallCloser.closing`, tokenized) is written instead, one token per step: the mask then allows
    only its next token. The matcher follows the closing as far as the schema allows it (a closing
    may skip a required property the model had not reached); past that point the JSON layout alone
    decides, so the call stays valid JSON.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, tokenizer: llguidance.LLTokenizer,
                 names: Sequence[str]) -> None:
        super().__init__(matcher, vocab_size)
        self._tokenizer = tokenizer
        self._closer = CallCloser(names)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._closing: list[int] | None = None   # the closing's tokens still to write, once it began
        self._following = True                   # the matcher took every closing token so far

    def mask(self, logits: torch.Tensor) -> None:
        if self._closing is None:
            super().mask(logits)
            return
        row = logits.numpy()
        row[:] = -np.inf
        if self._closing:
            row[self._closing[0]] = 0.0

    def keep_within(self, token: int, left: int) -> int:
        if self._closing is not None:
            return token
        after = self._closer.copy()
        after.feed(self._text(token, self._decoder.getstate()))
        closing = after.closing()
        if closing is None or len(self._tokenizer.tokenize_str(closing)) <= left - 1:
            return token
        if not self._closer.closing():   # out of the call's layout, or already complete: nothing to close
            return token
        self._closing = self._closing_tokens(left)
        return self._closing[0]

    def advance(self, token: int) -> bool:
        self._closer.feed(self._text(token))
        if self._closing is None:
            return super().advance(token)
        if self._closing and token == self._closing[0]:
            self._closing.pop(0)
        if self._following and self._matcher.validate_tokens([token]) == 1:
            self._matcher.consume_token(token)
        else:
            self._following = False
        return not self._closing

    @property
    def cut_short(self) -> bool:
        return self._closing is not None

    def _closing_tokens(self, left: int) -> list[int]:
        """The closing to write: with the first due value of CLOSING_VALUES that the grammar takes and
        whose closing fits in `left` tokens (an empty string for a string property, a number for a
        number...), else with `null`, which any JSON value may be."""
        fallback = self._tokenizer.tokenize_str(self._closer.closing())
        for value in CLOSING_VALUES:
            tokens = self._tokenizer.tokenize_str(self._closer.closing(value))
            if len(tokens) <= max(left, len(fallback)) and self._matcher.validate_tokens(tokens) == len(tokens):
                return tokens
        return fallback

    def _text(self, token: int, state: tuple[bytes, int] | None = None) -> str:
        """The token's text, decoded after the output so far (its state `state`: a decoder of its
        own that leaves the output's decoder as it is)."""
        decoder = self._decoder
        if state is not None:
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            decoder.setstate(state)
        return decoder.decode(self._tokenizer.decode_bytes([token]))


class Constrainer:
    """Compiles grammars against one model's tokenizer (built on first use, about half a second).

    The last CACHED_GRAMMARS compiled grammars are kept as fresh matchers; a request gets a copy.
    """

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer_json = tokenizer_json   # called once, on first use
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[Grammar, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                                         eos_token=self._eos)
            return self._tokenizer

    def check(self, grammar: Grammar) -> str:
        """The compiled grammar, or GrammarError with llguidance's message (first line first)."""
        compiled = grammar.compile()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled, self.tokenizer)
        if failed:
            raise GrammarError(_one_line(messages[0]))
        return compiled

    def start(self, grammar: Grammar) -> TokenConstraint:
        """A fresh matcher for one request."""
        with self._lock:
            template = self._compiled.get(grammar)
            if template is not None:
                self._compiled.move_to_end(grammar)
        if template is None:
            template = llguidance.LLMatcher(self.tokenizer, self.check(grammar), log_level=0)
            if template.is_error():
                raise GrammarError(_one_line(template.get_error()))
            with self._lock:
                self._compiled[grammar] = template
                while len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        if isinstance(grammar, CallGrammar):
            return CallConstraint(template.deep_copy(), self.vocab_size, self.tokenizer, grammar.names)
        return TokenConstraint(template.deep_copy(), self.vocab_size)


def _schema(text: str) -> dict[str, Any] | bool:
    try:
        schema = json.loads(text)
    except ValueError as error:
        raise GrammarError(f"the schema is not valid JSON: {error}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
    return schema


def _one_line(message: str) -> str:
    """llguidance's message without the source excerpt it appends after the first line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    head = lines[0] if lines else "invalid grammar"
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return f"{head} ({detail})" if detail else head
