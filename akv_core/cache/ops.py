"""The AKV request fields `drop_message`, `reposition` and `thinking_drop`, checked against a history.

The fields are cumulative: a request carries every operation since the start of
its history (`thinking_drop` applies to every earlier message with reasoning).
Checking happens once, here, so the server (400 naming the field), the engine
and the replay simulator reject exactly the same inputs. The drop rules that cut
parts of messages (`text_drop`, `keep_text_drop`) are read in `akv_core.cache.text_drop`
and join the operations as a `TextDrop` (defined here, with the other operations, so that
`text_drop` imports this module and not the other way round).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
import re
from dataclasses import dataclass
from typing import Any

_DECIMAL = re.compile(r"-?[0-9]+")   # fullmatch, so no surrounding whitespace either


class OperationError(ValueError):
    """A user-caused error in the cache operation fields; `field` names where it is."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class TextCut:
    """Characters [start, end) of message `message`'s content to drop, or (`whole`) the message."""

    message: int
    chars: tuple[tuple[int, int], ...]
    whole: bool = False


@dataclass(frozen=True)
class TextDrop:
    """Right after message `trigger`, the cut parts leave attention (positions unchanged); read from
    the API by `akv_core.cache.text_drop`."""

    trigger: int
    cuts: tuple[TextCut, ...]


@dataclass(frozen=True)
class Operations:
    """Validated operations: per trigger message the messages it drops, the reposition triggers,
    whether each message's reasoning is dropped right after it (`thinking_drop`), and the
    parts of messages a `text_drop` / `keep_text_drop` cuts."""

    drops: tuple[tuple[int, tuple[int, ...]], ...]  # (trigger, dropped messages), trigger order
    repositions: tuple[int, ...]                    # sorted triggers
    thinking_drop: bool = False
    text_drop: TextDrop | None = None

    @property
    def empty(self) -> bool:
        return not self.drops and not self.repositions and not self.thinking_drop and self.text_drop is None


NO_OPERATIONS = Operations((), ())


def validate_operations(n_messages: int, drop_message: Mapping[Any, Any] | None,
                        reposition: Sequence[Any] | None, thinking_drop: bool = False,
                        text_drop: TextDrop | None = None) -> Operations:
    """Check the operation fields of a history of `n_messages` messages; raise OperationError.

    `thinking_drop` is the API's `drop_rule: {"type": "thinking_drop"}` and `text_drop` a
    parsed `text_drop` / `keep_text_drop` rule; each takes the place of `drop_message`, and
    a request has at most one of the three.
    """
    if not isinstance(thinking_drop, bool):
        raise OperationError("drop_rule", f"thinking_drop must be true or false, got {thinking_drop!r}")
    if sum((thinking_drop, drop_message is not None, text_drop is not None)) > 1:
        raise OperationError("drop_rule", "send either drop_message or drop_rule, not both")
    if text_drop is not None and not 0 <= text_drop.trigger < n_messages:
        raise OperationError("drop_rule", f"the text drop's trigger {text_drop.trigger} is not a message "
                                          f"of the history (0..{n_messages - 1})")
    drops = _validate_drops(n_messages, drop_message)
    repositions = _validate_repositions(n_messages, reposition)
    if not drops and not repositions and not thinking_drop and text_drop is None:
        return NO_OPERATIONS
    return Operations(drops, repositions, thinking_drop, text_drop)


def _validate_drops(n_messages: int, drop_message: Mapping[Any, Any] | None) -> tuple:
    if drop_message is None:
        return ()
    if not isinstance(drop_message, Mapping):
        raise OperationError("drop_message", "expected an object mapping a message index to a list of indices")
    seen_triggers: set[int] = set()
    dropped_by: dict[int, int] = {}
    drops = []
    for raw_key, raw_indices in drop_message.items():
        field = f"drop_message.{raw_key}"
        trigger = _index(raw_key, field, n_messages, allow_string=True)
        if trigger in seen_triggers:
            raise OperationError(field, f"message {trigger} appears twice as a trigger")
        seen_triggers.add(trigger)
        if isinstance(raw_indices, (str, bytes)) or not isinstance(raw_indices, Sequence):
            raise OperationError(field, "expected a list of message indices")
        indices = []
        for position, raw in enumerate(raw_indices):
            # A plain in-range int is the usual case; anything else gets _index's checks and message.
            valid = type(raw) is int and 0 <= raw < n_messages
            index = raw if valid else _index(raw, f"{field}[{position}]", n_messages, allow_string=False)
            if index > trigger:
                raise OperationError(f"{field}[{position}]", f"message {index} is after its trigger {trigger}; "
                                     "a trigger drops itself or earlier messages, never a future one")
            if index in dropped_by:
                raise OperationError(f"{field}[{position}]", f"message {index} is already dropped "
                                                             f"(by trigger {dropped_by[index]})")
            dropped_by[index] = trigger
            indices.append(index)
        if indices:
            drops.append((trigger, tuple(sorted(indices))))
    return tuple(sorted(drops))


def _validate_repositions(n_messages: int, reposition: Sequence[Any] | None) -> tuple[int, ...]:
    if reposition is None:
        return ()
    if isinstance(reposition, (str, bytes, Mapping)) or not isinstance(reposition, Sequence):
        raise OperationError("reposition", "expected a list of message indices")
    triggers: set[int] = set()
    for position, raw in enumerate(reposition):
        field = f"reposition[{position}]"
        index = _index(raw, field, n_messages, allow_string=False)
        if index in triggers:
            raise OperationError(field, f"message {index} appears twice")
        triggers.add(index)
    return tuple(sorted(triggers))


def _index(raw: Any, field: str, n_messages: int, allow_string: bool) -> int:
    """A message index: an int (or, for object keys, a decimal string) in [0, n_messages).

    A key is ASCII digits with an optional minus sign: `str.isdigit` and `int` also take
    other scripts' digits ("٣" is 3, "³" passes isdigit and then fails int).
    """
    if isinstance(raw, bool):
        raise OperationError(field, f"expected a message index (an integer), got {raw!r}")
    if isinstance(raw, int):
        index = raw
    elif allow_string and isinstance(raw, str) and _DECIMAL.fullmatch(raw):
        index = int(raw)
    else:
        raise OperationError(field, f"expected a message index (an integer), got {raw!r}")
    if not 0 <= index < n_messages:
        raise OperationError(field, f"message index {index} is out of range: the history has "
                                    f"{n_messages} messages (0..{n_messages - 1})")
    return index
