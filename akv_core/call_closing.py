"""Closing a forced tool call before its tokens run out.

A forced call (`tool_choice: "required"` or a named function, `constrain.tool_call_grammar`) is
written in one layout: `<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>`. At any
point of it, `CallCloser.closing()` is the shortest text that completes it: the rest of the tag,
the name (the first declared one the name so far begins), `"arguments": {}` if they were not
reached, and the arguments closed where they stand (`JsonPrefix`: a string cut short ends with a
quote, a key without its value gets one, `null` unless the caller names another, a number or
literal is completed, open objects and arrays are closed). The result is always valid JSON; the
properties a schema requires past the cut are not made up.

The engine asks before taking each sampled token whether the call could still be closed within the
tokens left after it (`constrain.CallConstraint`); where it could not, it writes the closing instead.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Sequence

CALL_OPEN = '<tool_call>\n{"name": "'
CALL_MIDDLE = '", "arguments": '    # from the quote that ends the name
CALL_END = "}\n</tool_call>"
EMPTY_ARGUMENTS = "{}"
WHITESPACE = " \t\r\n"
LITERALS = ("true", "false", "null")
NUMBER_CHARS = frozenset("0123456789+-.eE")


class JsonPrefix:
    """A JSON value read one character at a time: whether it is complete, and the shortest text that
    would complete it (`closing`). `failed` once a character could not continue any JSON value."""

    def __init__(self) -> None:
        self.stack: list[str] = []   # open containers, "{" or "["
        self.state = "value"         # what the next character may be (see `feed`)
        self.token = ""              # a number or literal in progress
        self.escape: str | None = None   # in a string: "" after a backslash, "u" and hex digits after \u
        self.in_key = False          # the string in progress is an object key
        self.last = ""               # the last character read outside strings
        self.complete = False
        self.failed = False

    def copy(self) -> JsonPrefix:
        twin = copy.copy(self)
        twin.stack = list(self.stack)
        return twin

    def feed(self, text: str) -> int:
        """Read `text` up to the end of the value; returns how many of its characters belong to the value."""
        for index, char in enumerate(text):
            if self.failed or self.complete or not self._char(char):
                return index
        return len(text)

    def closing(self, value: str = "null") -> str | None:
        """The shortest text after which the value is complete JSON, with `value` where one is due (after
        a key, or after a comma in an array); None if it cannot be JSON."""
        if self.failed:
            return None
        if self.complete:
            return ""
        return self._finish_token(value) + "".join("}" if c == "{" else "]" for c in reversed(self.stack))

    def _finish_token(self, value: str) -> str:
        """What completes the item in progress inside the innermost container (a separator just read
        gets its space, as the grammar's layout writes one)."""
        if self.state == "string":
            if self.escape == "":
                tail = "\\"   # a lone backslash becomes an escaped one
            elif self.escape is not None:
                tail = "0" * (5 - len(self.escape))   # \uXX -> \uXX00
            else:
                tail = ""
            return tail + '"' + (": " + value if self.in_key else "")
        if self.state == "number":
            return "0" if self.token[-1] in "+-.eE" else ""
        if self.state == "literal":
            return next(word[len(self.token):] for word in LITERALS if word.startswith(self.token))
        space = " " if self.last in (":", ",") else ""
        return {"value": space + value, "key": space + '"": ' + value, "colon": ": " + value}.get(self.state, "")

    def _char(self, char: str) -> bool:
        """Take one character; False when it is not part of the value (it follows a top-level number)."""
        state = self.state
        if state == "string":
            self._string_char(char)
            return True
        if state in ("number", "literal"):
            if (char in NUMBER_CHARS) if state == "number" else char.isalpha():
                self.token += char
                if state == "literal" and not any(word.startswith(self.token) for word in LITERALS):
                    self.failed = True
                return True
            if state == "literal" and self.token not in LITERALS:
                self.failed = True
                return True
            self._value_done()
            if self.complete:
                return False
            state = self.state
        self.last = char
        if char in WHITESPACE:
            return True
        if state in ("value", "first_value"):
            self._value_start(char, state)
        elif state in ("first_key", "key"):
            if state == "first_key" and char == "}":
                self._close()
            elif char == '"':
                self.state, self.in_key = "string", True
            else:
                self.failed = True
        elif state == "colon":
            if char == ":":
                self.state = "value"
            else:
                self.failed = True
        else:   # "after": a value ended inside a container
            self._after_value(char)
        return True

    def _string_char(self, char: str) -> None:
        if self.escape is not None:
            if self.escape == "":
                self.escape = "u" if char == "u" else None
            else:
                self.escape = self.escape + char if len(self.escape) < 4 else None
            return
        if char == "\\":
            self.escape = ""
        elif char == '"':
            if self.in_key:
                self.state, self.in_key = "colon", False
            else:
                self._value_done()

    def _value_start(self, char: str, state: str) -> None:
        if state == "first_value" and char == "]":
            self._close()
        elif char in "{[":
            self.stack.append(char)
            self.state = "first_key" if char == "{" else "first_value"
        elif char == '"':
            self.state, self.in_key = "string", False
        elif char == "-" or char.isdigit():
            self.state, self.token = "number", char
        elif any(word.startswith(char) for word in LITERALS):
            self.state, self.token = "literal", char
        else:
            self.failed = True

    def _after_value(self, char: str) -> None:
        top = self.stack[-1]
        if char == ",":
            self.state = "key" if top == "{" else "value"
        elif (char, top) in (("}", "{"), ("]", "[")):
            self._close()
        else:
            self.failed = True

    def _close(self) -> None:
        self.stack.pop()
        self._value_done()

    def _value_done(self) -> None:
        self.token = ""
        self.state = "after"
        self.complete = not self.stack


class CallCloser:
    """A forced call's text so far (`feed`) and the shortest text that completes the call (`closing`)."""

    def __init__(self, names: Sequence[str]) -> None:
        if not names:
            raise ValueError("a forced call needs at least one tool name")
        self.encoded = [json.dumps(name, ensure_ascii=False)[1:-1] for name in names]
        self.text = ""
        self.arguments: JsonPrefix | None = None   # once the arguments began
        self.arguments_start = 0                   # where they begin in `text`
        self.arguments_end = 0                     # where they end, once complete

    def copy(self) -> CallCloser:
        twin = copy.copy(self)
        twin.arguments = None if self.arguments is None else self.arguments.copy()
        return twin

    def feed(self, text: str) -> None:
        start = len(self.text)
        self.text += text
        if self.arguments is None:
            self.arguments_start = self._arguments_start()
            if self.arguments_start < 0:
                return
            self.arguments, start = JsonPrefix(), self.arguments_start
        if not self.arguments.complete:
            used = self.arguments.feed(self.text[start:])
            self.arguments_end = start + used

    def closing(self, value: str = "null") -> str | None:
        """The shortest completion of the call (`value` where the arguments are due one: JsonPrefix);
        None where the text left the call's layout."""
        text = self.text
        if len(text) < len(CALL_OPEN):
            return CALL_OPEN[len(text):] + self.encoded[0] + CALL_MIDDLE + EMPTY_ARGUMENTS + CALL_END \
                if CALL_OPEN.startswith(text) else None
        if self.arguments is None:
            return self._name_closing(text[len(CALL_OPEN):])
        if self.arguments.state == "value" and not self.arguments.stack:
            return EMPTY_ARGUMENTS + CALL_END   # the arguments are next: an empty object
        if not self.arguments.complete:
            rest = self.arguments.closing(value)
            return None if rest is None else rest + CALL_END
        after = text[self.arguments_end:]
        return CALL_END[len(after):] if CALL_END.startswith(after) else None

    def _name_closing(self, written: str) -> str | None:
        """Closing while the name or the text between it and the arguments is being written."""
        end = written.find('"')
        if end < 0:
            name = next((name for name in self.encoded if name.startswith(written)), None)
            return None if name is None else name[len(written):] + CALL_MIDDLE + EMPTY_ARGUMENTS + CALL_END
        between = written[end:]
        return CALL_MIDDLE[len(between):] + EMPTY_ARGUMENTS + CALL_END if CALL_MIDDLE.startswith(between) else None

    def _arguments_start(self) -> int:
        """Where the arguments begin in the text: after the name and `", "arguments": `; -1 before that."""
        end = self.text.find('"', len(CALL_OPEN))
        if end < 0 or not self.text.startswith(CALL_MIDDLE, end):
            return -1
        return end + len(CALL_MIDDLE)
