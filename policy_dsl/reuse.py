"""Use records without a model: which earlier messages each step of a recorded agent run reused.

A recorded run never says what the model looked at; what it wrote does. A message is *used* at a
later step when the agent's message there (its text and its tool calls' arguments, not its
reasoning) repeats *distinctive* content the message holds: a path, an identifier, an id with
digits, a number of 3+ digits, a URL, a quoted phrase. Such strings rarely recur by chance, so a
copy is evidence of use; words, small numbers, years, line ranges and the task's own strings are
not. `docs/traces.md` (Use records) defines it with examples and says its limits.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from policy_dsl.counter import message_text as content_of

MAX_SEGMENTS = 16  # an item spans at most this many word segments (`src/a.py` has 3) ...
MAX_ITEM = 200  # ... and characters: longer copies are blocks, found by their parts
PROMPT_ROLES = ("system", "developer")

_RUN = re.compile(r"[\w./\-~@:]+")  # what a path, dotted name, id, URL or email is made of
_SEG, _WORD, _SPACE = re.compile(r"\w+"), re.compile(r"\w"), re.compile(r"\s")
_SHAPE = re.compile(r"/?\w(?:[\w./\-~@:]*\w)?")
_THOUSANDS = re.compile(r"(?<![\w.])(?<!\d,)\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\w|,\d)")
_NUMBER_LIST = re.compile(r"(?<![\w.])(?<!\d,)\d+(?:,\d+)+[a-z]?(?![\w/]|[.,]\d)")  # 380,400p; 1,2,3
_SPAN = re.compile(r"""(?<!\w)(["'`])([^"'`\n]{3,120})\1(?!\w)""")
_SCHEME = re.compile(r"[a-zA-Z][a-zA-Z0-9+.\-]*://")
_REL_PREFIX = re.compile(r"^(?:(?:~|\.{1,2})/)+")
_NUMBER, _DATE = re.compile(r"\d+(?:\.\d+)*"), re.compile(r"\d{4}-\d{2}-\d{2}")
_DATETIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}(?::\d{2})?(?:\.\d+)?Z?")
_EMAIL = re.compile(r"[\w.\-]+@\w[\w\-]*(?:\.[\w\-]+)+")
_CAMEL = re.compile(r"[a-z][A-Z]")
_GENERIC_DIRS = ("/dev/", "/proc/", "/sys/", "/bin/", "/sbin/", "/usr/bin/", "/usr/sbin/", "/usr/local/bin/",
                 "/etc/")
# Strings whose shape passes but that recur in any shell session, log or type list (lowercased).
_STOP = frozenset("""
python2 python3 pip3 pythonpath virtualenv error errors warning warnings failed failure failures passed
success successful traceback exception true false none null note todo fixme readme debug info fatal
critical stdout stderr stdin ascii unicode total skipped xfail xpass important utf8 utf16 utf32 sha1
sha224 sha256 sha384 sha512 md5 base64 base32 int8 int16 int32 int64 uint16 uint32 uint64 float16
float32 float64 bfloat16 complex64 complex128 x86_64 amd64 arm64 aarch64 ipv4 ipv6 i386 i686
""".split())


@dataclass(frozen=True)
class Reuse:
    """One distinctive string a step reused, and the earlier messages that held it."""

    item: str  # the distinctive string reused
    holders: tuple[int, ...]  # indices of earlier messages (before the step's message) that hold it, ascending
    at_risk: bool  # every holder is a tool result (role "tool"): only tool messages held it


def _normalize(text: str) -> str:
    """Thousands separators dropped (`$1,818` is the `1818.0` a calculator returned). Step and
    holder texts both pass here, so holding stays one relation."""
    return _THOUSANDS.sub(lambda m: m.group().replace(",", ""), text)


def _strings(node: Any, keys: bool = False) -> list[str]:
    """The strings of decoded JSON, one-word strings quoted (`"LAS"` reads as a quoted code); keys
    only if asked: in arguments they are the schema's words, not the agent's."""
    if isinstance(node, Mapping):
        return [s for k, v in node.items() for s in [str(k)] * keys + _strings(v, keys)]
    if isinstance(node, (list, tuple)):
        return [s for v in node for s in _strings(v, keys)]
    if isinstance(node, str):
        return [node if _SPACE.search(node) else f'"{node}"']
    return [] if node is None else [json.dumps(node)]


def _raw_calls(message: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, arguments as recorded) of each tool call."""
    out = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call.get("function"), Mapping) else call
        raw = function.get("arguments")
        out.append((str(function.get("name") or ""), raw if isinstance(raw, str) else json.dumps(raw, default=str)))
    return out


def message_text(message: Mapping[str, Any], names: bool = True) -> str:
    """What a message holds: its content, its tool calls' names (not for a step's own calls: `names`
    false) and arguments (decoded: their values; else as recorded). Never reasoning_content."""
    parts = [content_of(message)]
    for name, raw in _raw_calls(message):
        try:
            values = "\n".join(_strings(json.loads(raw)))
        except ValueError:
            values = raw
        parts += [name, values] if names else [values]
    return "\n".join(parts)


def _number_ok(number: str) -> bool:
    """3+ digits (4+ with a point: `3.10` is a version), not a year alone, not round (100, 2000:
    chosen more often than copied)."""
    digits = number.replace(".", "")
    if "." not in number and len(number) == 4 and 1900 <= int(number) <= 2099:
        return False
    significant = digits.lstrip("0")
    return len(digits) >= 3 + ("." in number) and len(significant) >= 3 and len(significant.rstrip("0")) >= 2


def _token_ok(token: str) -> bool:
    """Whether one word segment (letters, digits, `_`) is distinctive by its shape alone."""
    if len(token) < 3 or token.lower() in _STOP:
        return False
    if token.isdigit():
        return _number_ok(token)
    core = token.strip("_")
    if not core or token.startswith("__") and token.endswith("__") or not any(c.isalpha() for c in core):
        return False  # dunders are Python's, not the task's
    digits = sum(c.isdigit() for c in core)
    if "_" in core or core != token:  # snake_case, CONSTANT_CASE, _private
        return len(token) >= 5
    if digits:  # ids: HAT136, NO6JO3, 4NQLHD; not sigma3 or test1
        return len(token) >= 5 and (digits >= 2 or not token.islower())
    if token.isupper():  # AJVCTQ; shouted words are in _STOP
        return len(token) >= 5
    return len(token) >= 6 and bool(_CAMEL.search(token))  # CamelCase, camelCase


def _path_ok(path: str) -> bool:
    """Absolute with 2+ segments, or relative with 3+ or a file-like segment (not `and/or`, `05/23`)."""
    segments = path.strip("/").split("/")
    if len(path) < 5 or "" in segments or all(s.isdigit() for s in segments):
        return False
    return len(segments) >= 2 if path.startswith("/") else len(segments) >= 3 or not all(map(str.isalpha, segments))


def _dotted_ok(name: str) -> bool:
    segments = name.split(".")
    return len(name) >= 5 and "" not in segments and any(len(s) >= 3 and not s.isdigit() for s in segments)


def _windows(pieces: list[str], sep: str, ok: Any, lead: str = "") -> list[str]:
    """The prefixes and suffixes of 2+ pieces joined by `sep` that `ok` accepts (`lead` before a
    prefix; the whole also without it): the directory or module, and the path or name relative to
    an outer one."""
    n = len(pieces)
    joined = [lead + sep.join(pieces[:j]) for j in range(2, min(n, MAX_SEGMENTS) + 1)]
    joined += [sep.join(pieces[i:]) for i in range(max(0 if lead else 1, n - MAX_SEGMENTS), n - 1)]
    return [w for w in joined if ok(w)]


def _part_items(part: str) -> list[str]:
    """Candidates of a colon-free piece of a run: the piece and its meaningful sub-pieces."""
    part = _REL_PREFIX.sub("", part).lstrip(".-~@").rstrip(".-~@/")
    if "/" in part:
        if any((part + "/").startswith(d) for d in _GENERIC_DIRS):
            return []
        segments = part.strip("/").split("/")
        lead = "/" if part.startswith("/") else ""
        return [x for s in segments for x in _part_items(s)] + _windows(segments, "/", _path_ok, lead)
    if "@" in part:
        return [part] * bool(_EMAIL.fullmatch(part)) + [x for p in part.split("@") for x in _part_items(p)]
    if "." in part:
        if _NUMBER.fullmatch(part):
            return [part] if _number_ok(part) else []
        segments = part.split(".")
        return [x for s in segments for x in _part_items(s)] + _windows(segments, ".", _dotted_ok)
    if "-" in part:
        pieces = part.split("-")
        if _DATE.fullmatch(part):
            return [part]
        if all(p.isdigit() for p in pieces if p):  # ranges 10-20, 380-400
            return []
        kebab = "" not in pieces and (len(part) >= 5 and any(c.isdigit() for c in part) or
                                      len(pieces) >= 3 and len(part) >= 12)
        return [part] * kebab + [p for p in pieces if _token_ok(p)]
    return [part] if _token_ok(part) else []


def _run_items(run: str) -> list[str]:
    """Candidates of one run: a URL whole and its host and path, a timestamp whole; else the pieces
    between colons, less the numbers beside a colon (`a.py:12`, `287:295`, `15:30:00`)."""
    run = run.rstrip(".:-~@/")
    scheme = _SCHEME.match(run)
    if scheme:
        return [run] + [x for p in run[scheme.end():].split(":") for x in _part_items(p)]
    if _DATETIME.fullmatch(run):
        return [run]
    parts = run.split(":")
    return [x for p in parts if len(parts) == 1 or not p.isdigit() for x in _part_items(p)]


def _spans(text: str) -> Iterable[str]:
    """Quoted phrases (2-12 words, 8+ characters) and quoted upper-case codes (`"LAS"`)."""
    for match in _SPAN.finditer(text):
        span = match.group(2).strip(" \t.,:;!?")
        if not (span and _WORD.match(span[0]) and _WORD.match(span[-1])):
            continue
        words = span.split()
        if 1 < len(words) <= 12 and len(span) >= 8 and sum(any(map(str.isalpha, w)) for w in words) >= 2 \
                or len(words) == 1 and span.isalpha() and span.isupper() and span.lower() not in _STOP:
            yield span


def _families(text: str) -> list[tuple[str, ...]]:
    """A normalized text's candidates by the run (or span) they come from, longest first:
    `/testbed/src/a.py` gives itself, `testbed/src/a.py`, `src/a.py` and `a.py`, one family."""
    out = []
    for run in _RUN.finditer(_NUMBER_LIST.sub(" ", text)):
        s = run.group()
        if len(s) < 3 or s.isalpha() and s.islower():  # plain words: never an item
            continue
        items = {i for i in _run_items(s) if len(i) <= MAX_ITEM and _SHAPE.fullmatch(i)
                 and len(_SEG.findall(i)) <= MAX_SEGMENTS}  # the shape `_held_forms` finds
        if items:
            out.append(tuple(sorted(items, key=lambda i: (-len(i), i))))
    return out + [(span,) for span in dict.fromkeys(_spans(text))]


def distinctive_items(text: str) -> frozenset[str]:
    """The candidate items of a text (before the exclusions of a history: task, tools, common)."""
    return frozenset(item for family in _families(_normalize(text)) for item in family)


def _held_forms(text: str) -> set[str]:
    """Every string a normalized text holds as a whole token that could be an item: each window of
    consecutive word segments of a run, also with its leading `/` when no word character precedes
    that. Whole token: no word character right before or after, so `1234` is not in `123456` and
    `src/a.py` is in `./src/a.py:12`."""
    forms: set[str] = set()
    for run in _RUN.finditer(text):
        s = run.group()
        if _SEG.fullmatch(s):
            if len(s) >= 3 and not (s.isalpha() and s.islower()):
                forms.add(s)
            continue
        bounds = [(m.start(), m.end()) for m in _SEG.finditer(s)]
        for i, (start, _) in enumerate(bounds):
            slash = start > 0 and s[start - 1] == "/" and (start == 1 or not _WORD.match(s[start - 2]))
            for _, end in bounds[i:i + MAX_SEGMENTS]:
                if end - start > MAX_ITEM:
                    break
                forms.add(s[start:end])
                if slash:
                    forms.add(s[start - 1:end])
    return forms


def _contains(text: str, item: str) -> bool:
    """Whether `text` holds `item` as a whole token (for phrases, which no form index covers)."""
    return item in text and re.search(rf"(?<!\w){re.escape(item)}(?!\w)", text) is not None


class _Entry:
    """What one message holds, read once: role, normalized text, held forms, call names."""

    __slots__ = ("refs", "role", "text", "forms", "names", "_families", "_items")

    def __init__(self, message: Mapping[str, Any]) -> None:
        self.refs = _refs(message)
        self.role = str(message.get("role") or "")
        self.text = _normalize(message_text(message))
        self.forms = _held_forms(self.text)
        self.names = frozenset(name for name, _ in _raw_calls(message) if name)
        self._families: list[tuple[str, ...]] | None = None
        self._items: frozenset[str] | None = None

    def items(self) -> frozenset[str]:
        if self._items is None:
            self._items = frozenset(item for family in self.families() for item in family)
        return self._items

    def families(self) -> list[tuple[str, ...]]:
        if self._families is None:  # only asked of assistant messages
            self._families = _families(_normalize(message_text(self.refs[0], names=False)))
        return self._families


def _refs(message: Mapping[str, Any]) -> tuple:
    """The message, its role, content and calls: unchanged (compared identity first) means read."""
    return message, message.get("role"), message.get("content"), message.get("tool_calls")


def _fingerprint(message: Mapping[str, Any]) -> int:
    content = message.get("content")
    if isinstance(content, (list, tuple)):
        content = tuple(str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content)
    elif content is not None and not isinstance(content, str):
        content = repr(content)
    return hash((message.get("role"), content, tuple(_raw_calls(message))))


class ReuseFinder:
    """Reuses of a history's assistant messages; memoizes per message so a growing history
    (the same list extended step by step, or a fixed trace queried at every step) costs linear time.

    Each message is read once (memo keyed by a hash of its content, so a copy is not read again) into the forms
    it holds, indexed form -> messages; a query then costs a look-up per earlier message and one per
    candidate. Histories may differ between calls (a policy's view next to the trace): what they
    share is read once. A message changed in place must get a new content or tool_calls object.
    """

    LIMIT = 50_000  # messages remembered; beyond, the memo starts afresh

    def __init__(self, common: frozenset[str] = frozenset(), tools: Sequence[Mapping] = ()) -> None:
        self.common = frozenset(common)
        functions = [t.get("function", t) for t in tools if isinstance(t, Mapping)]
        self._tool_names = frozenset(str(f["name"]) for f in functions if isinstance(f, Mapping) and f.get("name"))
        self._schema = _normalize("\n".join(s.strip('"') for s in _strings(list(tools), keys=True)))
        self._schema_forms = _held_forms(self._schema)
        self._reset()

    def _reset(self) -> None:
        self._by_id: dict[int, int] = {}  # id(message) -> entry, valid while its `refs` are unchanged
        self._memo: dict[int, int] = {}  # fingerprint (role, content, calls) -> entry
        self._entries: list[_Entry] = []
        self._holding: dict[str, list[int]] = {}  # form -> entries holding it
        self._span_held: dict[tuple[str, int], bool] = {}
        self._found: dict[tuple[int, ...], tuple[Reuse, ...]] = {}  # the entries of a history -> its reuses

    def _entry(self, message: Mapping[str, Any]) -> int:
        found = self._by_id.get(id(message))
        if found is not None and self._entries[found].refs == _refs(message):
            return found
        key = _fingerprint(message)   # a copy of a message read before is read no more
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = len(self._entries)
            self._entries.append(_Entry(message))
            for form in self._entries[found].forms:
                self._holding.setdefault(form, []).append(found)
        self._entries[found].refs = _refs(message)  # the latest object of that content: the fast path's check
        self._by_id[id(message)] = found
        return found

    def reuses(self, messages: Sequence[Mapping[str, Any]], index: int) -> list[Reuse]:
        """What messages[index] (an assistant message) reuses from messages[:index]: in the order its
        text names them, quoted phrases last. Excluded: items held by the prompt (system and developer messages, and the
        user messages before the first assistant message: the task), tool names and schema text,
        `common`. Of one run's candidates (`src/a.py`, `a.py`) the longest held is reported, a shorter
        one only when more messages hold it."""
        if not 0 <= index < len(messages) or messages[index].get("role") != "assistant":
            raise ValueError(f"message {index} is not an assistant message of the history")
        if len(self._entries) > self.LIMIT:
            self._reset()
        order = tuple(self._entry(message) for message in messages[:index + 1])
        known = self._found.get(order)
        if known is not None:   # the same history read before (another policy's run of the same trace)
            return list(known)
        at: dict[int, list[int]] = {}  # entry -> its positions in the history
        for position, entry in enumerate(order[:-1]):
            at.setdefault(entry, []).append(position)
        roles = [self._entries[entry].role for entry in order[:-1]]
        first = next((p for p, role in enumerate(roles) if role == "assistant"), index)
        prompt = {p for p, role in enumerate(roles) if role in PROMPT_ROLES or role == "user" and p < first}
        step = self._entries[self._entry(messages[index])]
        names = self._tool_names.union(step.names, *(self._entries[e].names for e in at))
        out, seen = [], set()
        for family in step.families():
            covered: set[int] = set()
            for item in family:
                if item in seen or item in self.common or item in names or self._in_schema(item):
                    continue
                seen.add(item)
                holders = self._holders(item, at)
                if holders and prompt.isdisjoint(holders) and not covered.issuperset(holders):
                    covered.update(holders)
                    out.append(Reuse(item, holders, all(roles[h] == "tool" for h in holders)))
        if len(self._found) >= self.LIMIT:
            self._found.clear()
        self._found[order] = tuple(out)
        return out

    def items_of(self, messages: Sequence[Mapping[str, Any]]) -> list[frozenset[str]]:
        """Per message, the distinctive items its text holds (its candidates, found as a step's are;
        before the exclusions of a history): what `covered` compares across messages."""
        return [self._entries[self._entry(message)].items() for message in messages]

    def _holders(self, item: str, at: Mapping[int, list[int]]) -> tuple[int, ...]:
        if not _SPACE.search(item):
            holding = self._holding.get(item, ())
            if len(holding) > len(at):   # a form many messages of other histories hold: look at this one's
                return tuple(sorted(p for e, ps in at.items() if item in self._entries[e].forms for p in ps))
            return tuple(sorted(p for e in holding for p in at.get(e, ())))
        found = []
        for entry, positions in at.items():
            if (item, entry) not in self._span_held:
                self._span_held[item, entry] = _contains(self._entries[entry].text, item)
            found += positions if self._span_held[item, entry] else []
        return tuple(sorted(found))

    def _in_schema(self, item: str) -> bool:
        return _contains(self._schema, item) if _SPACE.search(item) else item in self._schema_forms


def used_indices(reuses: Sequence[Reuse], visible: Sequence[bool]) -> tuple[int, ...]:
    """The use record of a step under a visibility: for each reuse its latest *visible* holder (the
    copy the model most plausibly read), sorted and unique."""
    used = {max(shown) for r in reuses if (shown := [h for h in r.holders if visible[h]])}
    return tuple(sorted(used))


def lost_reuses(reuses: Sequence[Reuse], visible: Sequence[bool]) -> list[Reuse]:
    """Reuses whose every holder is hidden, whatever their roles: no visible message held the content."""
    return [r for r in reuses if not any(visible[h] for h in r.holders)]


def common_items(histories: Sequence[Sequence[Mapping[str, Any]]], share: float = 0.5,
                 min_histories: int = 4) -> frozenset[str]:
    """Items that appear in more than `share` of the histories (only when there are >= min_histories
    of them): a trace set's boilerplate (`__init__.py`, a harness's paths) recurs without use."""
    if len(histories) < min_histories:
        return frozenset()
    counts: Counter[str] = Counter()
    for history in histories:
        counts.update(set().union(*(distinctive_items(message_text(m)) for m in history)))
    return frozenset(item for item, count in counts.items() if count > share * len(histories))
