"""Chat rendering with provenance: which prompt tokens belong to which message.

The engine and the replay simulator both need, for a whole history, the token
ids and one span per message (drops hide spans; repositions move them). The
model's chat template (jinja2) is rendered one message at a time, so message
k's tokens never depend on later messages (prefix stability), and each
message's ids are memoized by what the template reads of it: re-rendering a
growing history is a few dictionary look-ups per message. The ids travel as a
packed `array("i")`, which the cache compares and the replay backend digests
without making a Python int per token.

Templates without tool support (SmolLM2's) get tools the Hermes/Qwen way:
declarations appended to the system message inside <tools></tools>, assistant
calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call> in the
content, reasoning as <think>...</think> at the start of the content, and tool
results as role "tool" messages. Templates that handle tools render them
themselves.

Only the template makes control tokens. Text that comes from the client (content,
reasoning, tool calls and results, names, tool declarations) is tokenized with
special-token parsing off, so a tool result holding "<|im_end|>" stays text and
cannot open a turn of its own. This module must not import torch.
"""
from __future__ import annotations

import json
import re
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from akv_core.model.locate import EMBEDDED_NAME, locate
from akv_core.tokenizer import TokenizerFiles, load_tokenizer_files

# Token ids the per-message memo keeps before it forgets the least recently used messages:
# 4 bytes each (32 MB, plus the messages' texts in the keys), however long a simulator runs.
MEMO_TOKENS = 8_000_000

# A fixed first message: rendering [ANCHOR, m] minus [ANCHOR] gives m's text as a non-first message.
_ANCHOR = {"role": "system", "content": "."}

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_TOOLS_CLOSING = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>"
)
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


class ChatTemplateError(ValueError):
    """A chat template that cannot be rendered message by message."""


@dataclass(frozen=True)
class Rendered:
    """A rendered history: ids, one [start, end) span per message, and the generation header.

    `reasoning_spans` holds, per message, the [start, end) tokens of its rendered reasoning
    (inside the message's span), or None where the message renders none.
    `content_tokens` maps characters of a message's content to its tokens (sub-message drops).
    """

    token_array: array            # the token ids, packed as C ints (typecode "i")
    spans: tuple[tuple[int, int], ...]
    header_start: int
    reasoning_spans: tuple[tuple[int, int] | None, ...]
    # (tokenizer, messages, tools) it was rendered from, for content_tokens
    source: tuple[Any, Sequence[Mapping], Sequence[Mapping] | None] | None = field(
        default=None, compare=False, repr=False)

    @cached_property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self.token_array)

    def content_tokens(self, index: int, chars: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Absolute [start, end) token ranges of message `index` lying wholly inside the [start, end)
        characters `chars` of its content (a token that straddles a boundary is left out)."""
        if self.source is None:
            raise ValueError("this rendering keeps no provenance for content characters")
        tokenizer, messages, tools = self.source
        base = self.spans[index][0]
        return [(base + start, base + end)
                for start, end in tokenizer.content_tokens(messages[index], index == 0, tools, chars)]


@dataclass(frozen=True)
class _Piece:
    """One message's ids as rendered after the messages before it, and its reasoning tokens."""

    ids: array                          # token ids, typecode "i"
    reasoning: tuple[int, int] | None   # relative to the message's first token


@dataclass(frozen=True)
class AssistantReply:
    """Generated text split back into the OpenAI message fields."""

    content: str
    reasoning_content: str | None
    tool_calls: tuple[dict, ...]


class ChatTokenizer:
    """The model's tokenizer plus its chat template, rendering with per-message spans."""

    def __init__(self, files: TokenizerFiles, memo_tokens: int = MEMO_TOKENS) -> None:
        if not files.chat_template:
            raise ChatTemplateError("the model has no chat template")
        self._tokenizer = files.tokenizer
        # The same tokenizer with special-token strings encoded as plain text (client text).
        self._text_tokenizer = Tokenizer.from_str(files.tokenizer.to_str())
        self._text_tokenizer.encode_special_tokens = True
        specials = sorted((t.content for t in files.tokenizer.get_added_tokens_decoder().values() if t.special),
                          key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, specials))) if specials else None
        self.eos_token_ids: tuple[int, ...] = files.eos_token_ids
        self.native_tools = "tools" in files.chat_template
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise_template_error
        self._template = env.from_string(files.chat_template)
        self._bos = files.bos_token or ""
        self._memo: OrderedDict[tuple, _Piece] = OrderedDict()   # least recently used first
        self._memo_limit = memo_tokens
        self._memo_tokens = 0
        self._header = array("i", self.encode(self._after_anchor([], None, add_generation_prompt=True)))

    @classmethod
    def from_model(cls, name_or_path: str = EMBEDDED_NAME, memo_tokens: int = MEMO_TOKENS) -> ChatTokenizer:
        """The tokenizer and template of `smollm2`, a GGUF file or a Hugging Face folder."""
        return cls(load_tokenizer_files(locate(name_or_path)), memo_tokens)

    @property
    def memo_size(self) -> tuple[int, int]:
        """(messages, token ids) the per-message memo holds now."""
        return len(self._memo), self._memo_tokens

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer in `tokenizers`' JSON format (what llguidance builds its token trie from)."""
        return self._tokenizer.to_str()

    def encode(self, text: str) -> list[int]:
        """Ids of template text: special-token strings in it are matched whole (as templates need)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Ids of client text: special-token strings in it are plain text, as in a rendered message."""
        return self._text_tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render(self, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None,
               add_generation_prompt: bool = True) -> Rendered:
        """Render a whole history; glue before a message belongs to that message's span."""
        tools_key = json.dumps(tools, ensure_ascii=False) if tools else None   # key order is rendered too
        ids = array("i")
        spans: list[tuple[int, int]] = []
        reasoning_spans: list[tuple[int, int] | None] = []
        if tools:
            _check_text(tools, "tools")
        for index, message in enumerate(messages):
            try:
                piece = self._piece(message, index == 0, tools, tools_key)
            except InvalidText as error:
                raise InvalidText(f"messages[{index}].{error.path}", error.reason) from None
            start = len(ids)
            spans.append((start, start + len(piece.ids)))
            reasoning_spans.append(None if piece.reasoning is None
                                   else (start + piece.reasoning[0], start + piece.reasoning[1]))
            ids.extend(piece.ids)
        header_start = len(ids)
        if add_generation_prompt:
            ids.extend(self._header)
        return Rendered(ids, tuple(spans), header_start, tuple(reasoning_spans), (self, tuple(messages), tools))

    def content_tokens(self, message: Mapping, first: bool, tools: Sequence[Mapping] | None,
                       chars: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """[start, end) ranges of the tokens of `message` (rendered as in `render`, first or not)
        that lie wholly inside the characters `chars` of its content, relative to its first token.

        The message is rendered and encoded again with character offsets (what its memoized
        ids were made from, so the two agree token for token); its content is located in
        the rendered text by rendering it once more with the content replaced by a marker.
        """
        text = self._message_text(message, first, tools)
        ids, offsets = self._encode_message(message, first, tools, text)
        at = self._content_start(message, first, tools, text)
        spans = [(at + start, at + end) for start, end in chars]
        picked = [index for index, (lo, hi) in enumerate(offsets)
                  if lo < hi and any(start <= lo and hi <= end for start, end in spans)]
        ranges: list[list[int]] = []
        for index in picked:
            if ranges and ranges[-1][1] == index:
                ranges[-1][1] = index + 1
            else:
                ranges.append([index, index + 1])
        return [(start, end) for start, end in ranges]

    def _content_start(self, message: Mapping, first: bool, tools: Sequence[Mapping] | None, text: str) -> int:
        """Where `message`'s content starts in `text`, its rendering; ValueError if the template
        does not render the content verbatim (one that trims or escapes it)."""
        content = content_text(message)
        marker = _unused_chars(text + content, 1)[0]
        marked = self._message_text({**message, "content": marker}, first, tools)
        at = marked.find(marker)
        if at >= 0 and text[at:at + len(content)] == content:
            return at
        raise ChatTemplateError("the chat template does not render this message's content verbatim, so "
                                "characters of it cannot be mapped to tokens")

    def count(self, message: Mapping) -> int:
        """Tokens of one message as rendered after other messages (the policy TokenCounter protocol)."""
        return len(self._piece(message, False, None, None).ids)

    def _piece(self, message: Mapping, first: bool, tools: Sequence[Mapping] | None,
               tools_key: str | None) -> _Piece:
        """One message's ids (and reasoning tokens) from the memo, rendered and remembered on a miss."""
        key = _message_key(message, first, tools_key, self.native_tools)
        piece = self._memo.get(key)
        if piece is not None:
            self._memo.move_to_end(key)
            return piece
        piece = self._message_piece(message, first, tools)
        self._memo[key] = piece
        self._memo_tokens += len(piece.ids)
        while self._memo_tokens > self._memo_limit and len(self._memo) > 1:   # the newest always stays
            self._memo_tokens -= len(self._memo.popitem(last=False)[1].ids)
        return piece

    def render_text(self, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """The whole history through the template in one go (the reference for per-message rendering)."""
        return self._apply(self._prepare(messages, tools), tools, add_generation_prompt)

    def parse_reply(self, text: str) -> AssistantReply:
        """Split generated text into content, reasoning and tool calls (the inverse of rendering them)."""
        reasoning = None
        think = _THINK.match(text)
        if think:
            reasoning, text = think.group(1).strip(), text[think.end():]
        calls = []
        for number, match in enumerate(_TOOL_CALL.finditer(text)):
            try:
                call = json.loads(match.group(1))
            except json.JSONDecodeError:
                continue  # not a call the model finished; it stays in the content
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                arguments = call.get("arguments", {})
                calls.append({"id": f"call_{number}", "type": "function",
                              "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)
                                           if not isinstance(arguments, str) else arguments}})
        content = _TOOL_CALL.sub("", text).strip() if calls else text
        return AssistantReply(content, reasoning, tuple(calls))

    # -- rendering one message ---------------------------------------------------------------

    def _message_piece(self, message: Mapping, first: bool, tools: Sequence[Mapping] | None) -> _Piece:
        _check_text(message, "")
        text = self._message_text(message, first, tools)
        ids, offsets = self._encode_message(message, first, tools, text)
        reasoning = None
        if message.get("reasoning_content"):
            chars = self._reasoning_chars(message, first, tools, text)
            reasoning = None if chars is None else _covering_tokens(offsets, chars)
        return _Piece(array("i", ids), reasoning)

    def _encode_message(self, message: Mapping, first: bool, tools: Sequence[Mapping] | None,
                        text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character offsets of a rendered message whose special tokens are the template's alone.

        Client text without special-token strings tokenizes as the whole text does (the
        tokenizer splits at special tokens first, then encodes each piece alone). Otherwise the
        message is rendered again with each such string replaced by a character found nowhere
        in it; the special tokens left are the template's, and the pieces between them are
        encoded as client text with the strings put back.
        """
        found = self._found_specials((message, tools if first else None))
        if not found:
            encoding = self._tokenizer.encode(text, add_special_tokens=False)
            return encoding.ids, encoding.offsets
        stand_ins = dict(zip(found, _unused_chars(text, len(found))))
        escaped = _replace_text(message, self._specials, stand_ins)
        escaped_tools = _replace_text(tools, self._specials, stand_ins) if tools else tools
        skeleton = self._message_text(escaped, first, escaped_tools)
        back = {char: special for special, char in stand_ins.items()}
        put_back = re.compile("|".join(map(re.escape, back)))
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        restored = ""
        cursor = 0
        for control in [*self._specials.finditer(skeleton), None]:
            piece = put_back.sub(lambda m: back[m.group()], skeleton[cursor:control.start() if control else None])
            encoding = self._text_tokenizer.encode(piece, add_special_tokens=False)
            ids += encoding.ids
            offsets += [(len(restored) + lo, len(restored) + hi) for lo, hi in encoding.offsets]
            restored += piece
            if control is None:
                break
            ids.append(self._tokenizer.token_to_id(control.group()))
            offsets.append((len(restored), len(restored) + len(control.group())))
            restored += control.group()
            cursor = control.end()
        if restored != text:
            raise ChatTemplateError("the chat template changes client text that holds special-token strings")
        return ids, offsets

    def _found_specials(self, values: Any) -> list[str]:
        """The distinct special-token strings inside the client's text."""
        if self._specials is None:
            return []
        found: dict[str, None] = {}
        for text in _strings(values):
            for match in self._specials.finditer(text):
                found[match.group()] = None
        return list(found)

    def _reasoning_chars(self, message: Mapping, first: bool, tools: Sequence[Mapping] | None,
                         text: str) -> tuple[int, int] | None:
        """The [start, end) characters of `text` (the message rendered) that its reasoning added.

        Our own rendering puts a known think block at the start of the content. A template
        that renders reasoning itself is asked twice, with and without it, and the
        characters that differ are the reasoning with whatever the template wraps it in.
        """
        if not self.native_tools:
            block = _think_block(message["reasoning_content"])
            at = text.find(block)
            return None if at < 0 else (at, at + len(block))
        bare = {name: value for name, value in message.items() if name != "reasoning_content"}
        return _inserted(self._message_text(bare, first, tools), text)

    def _message_text(self, message: Mapping, first: bool, tools: Sequence[Mapping] | None) -> str:
        if first:
            return self._apply(self._prepare([message], tools), tools, False)
        return self._after_anchor([message], tools, add_generation_prompt=False)

    def _after_anchor(self, messages: list[Mapping], tools: Sequence[Mapping] | None,
                      add_generation_prompt: bool) -> str:
        """The text the template adds after a fixed first message for `messages` (and the header)."""
        base = self._apply([_ANCHOR], tools, False)
        shaped = [dict(m) if self.native_tools else _plain(m) for m in messages]
        full = self._apply([_ANCHOR, *shaped], tools, add_generation_prompt)
        if not full.startswith(base):
            raise ChatTemplateError("the chat template is not prefix-stable: a message changes the text before it")
        return full[len(base):]

    def _prepare(self, messages: Sequence[Mapping], tools: Sequence[Mapping] | None) -> list[Mapping]:
        """Messages as the template gets them: tools folded into the system text when it cannot take them."""
        if self.native_tools:
            return [dict(m) for m in messages]
        plain = [_plain(m) for m in messages]
        if tools:
            declared = _TOOLS_PREAMBLE + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + _TOOLS_CLOSING
            if plain and plain[0]["role"] == "system":
                plain[0] = {**plain[0], "content": plain[0]["content"] + "\n\n" + declared}
            else:
                plain.insert(0, {"role": "system", "content": declared})
        return plain

    def _apply(self, messages: list[Mapping], tools: Sequence[Mapping] | None, add_generation_prompt: bool) -> str:
        extra: dict[str, Any] = {"tools": tools} if self.native_tools and tools else {}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self._bos, **extra)


@lru_cache(maxsize=4)
def shared_tokenizer(model: str = EMBEDDED_NAME) -> ChatTokenizer:
    """The one chat tokenizer of `model` for the whole process: its per-message memo is what makes
    repeated rendering cheap. The harness counts and renders with it on every backend, and the proxy
    counts with it, so a policy decides the same wherever it runs."""
    return ChatTokenizer.from_model(model)


class InvalidText(ValueError):
    """Client text the tokenizer cannot take (a lone surrogate); `path` names where it is."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _check_text(value: Any, path: str) -> None:
    """Raise InvalidText naming the first string under `value` that is not valid Unicode text."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise InvalidText(path or "content", f"the text holds a lone surrogate (U+{ord(value[error.start]):04X} "
                                                 f"at character {error.start}), which is not valid Unicode") from None
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_text(key, path)
            _check_text(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_text(item, f"{path}[{index}]")


def _replace_text(value: Any, pattern: re.Pattern, table: Mapping[str, str]) -> Any:
    """`value` with every match of `pattern` in its strings replaced through `table`."""
    if isinstance(value, str):
        return pattern.sub(lambda m: table[m.group()], value)
    if isinstance(value, Mapping):
        return {key: _replace_text(item, pattern, table) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_replace_text(item, pattern, table) for item in value]
    return value


def _unused_chars(text: str, n: int) -> list[str]:
    """`n` private-use characters that do not occur in `text`."""
    present = set(text)
    chars = [chr(c) for c in range(0xE000, 0xF900) if chr(c) not in present][:n]
    if len(chars) < n:
        raise ChatTemplateError("a message uses every private-use character")
    return chars


def _raise_template_error(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def content_text(message: Mapping[str, Any]) -> str:
    """A message's OpenAI content as one string: a string, None, or a list of parts whose text parts are
    joined (as the renderer joins them); InvalidText for any other type."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    raise InvalidText("content", f"a message's content must be a string, a list of parts or null, "
                                 f"got {type(content).__name__}")


def _think_block(reasoning: Any) -> str:
    """Reasoning as our rendering writes it before the content (Hermes/Qwen style)."""
    return f"<think>\n{reasoning}\n</think>\n\n"


def _inserted(without: str, with_: str) -> tuple[int, int] | None:
    """The characters of `with_` that differ from `without` (common prefix and suffix taken away)."""
    limit = min(len(without), len(with_))
    prefix = 0
    while prefix < limit and without[prefix] == with_[prefix]:
        prefix += 1
    suffix = 0
    while suffix < limit - prefix and without[-1 - suffix] == with_[-1 - suffix]:
        suffix += 1
    end = len(with_) - suffix
    return (prefix, end) if prefix < end else None


def _covering_tokens(offsets: Sequence[tuple[int, int]], chars: tuple[int, int]) -> tuple[int, int] | None:
    """The [first, last + 1) tokens holding any of the characters in `chars`."""
    start, end = chars
    covered = [index for index, (lo, hi) in enumerate(offsets) if lo < end and hi > start]
    return (covered[0], covered[-1] + 1) if covered else None


def _message_key(message: Mapping, first: bool, tools_key: str | None, native_tools: bool) -> tuple:
    """What the template reads of a message (with `_plain`'s shaping when the template has no tools)."""
    calls = message.get("tool_calls")
    key = (first, message.get("role"), content_text(message), message.get("reasoning_content"),
           tools_key if first else None)
    if native_tools:
        return key + (json.dumps(calls, ensure_ascii=False) if calls else None, message.get("name"),
                      message.get("tool_call_id"))
    return key + (_calls_key(calls) if calls else None,)


def _calls_key(calls: Sequence[Mapping]) -> tuple:
    """What `_plain` writes of tool calls: each function's name and arguments (ids are not rendered)."""
    key = []
    for call in calls:
        function = call.get("function", call)
        name, arguments = function.get("name"), function.get("arguments", {})
        key.append((name if isinstance(name, str) else json.dumps(name),
                    arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)))
    return tuple(key)


def _plain(message: Mapping) -> dict:
    """One message with reasoning and tool calls written into its content (Hermes/Qwen style)."""
    content = content_text(message)
    reasoning = message.get("reasoning_content")
    if reasoning:
        content = _think_block(reasoning) + content
    for call in message.get("tool_calls") or ():
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (json.JSONDecodeError, RecursionError):
                pass  # arguments that are not JSON are shown as the string the client sent
        block = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
        content = f"{content}\n<tool_call>\n{block}\n</tool_call>" if content else f"<tool_call>\n{block}\n</tool_call>"
    return {"role": message.get("role", "user"), "content": content}
