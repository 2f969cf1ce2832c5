"""Errors of the policy language: every one carries the place it points at."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Loc:
    """A place in a policy source (1-based line and column)."""

    line: int = 1
    column: int = 1


class PolicyError(Exception):
    """Base of every error the policy language raises on user input.

    str() is "FILE:LINE:COL: message", the form compilers use, so editors can jump to it.
    """

    def __init__(self, message: str, *, filename: str = "<policy>", line: int = 1, column: int = 1) -> None:
        self.message = message
        self.filename = filename
        self.line = line
        self.column = column
        super().__init__(str(self))

    def __str__(self) -> str:
        return f"{self.filename}:{self.line}:{self.column}: {self.message}"

    def at(self, filename: str) -> "PolicyError":
        """The same error attributed to another file name."""
        return type(self)(self.message, filename=filename, line=self.line, column=self.column)


class PolicySyntaxError(PolicyError):
    """The text does not follow the grammar (or is not text at all)."""


class PolicyLimitError(PolicyError):
    """The source exceeds a size or nesting limit that keeps evaluation bounded."""


class PolicyValidationError(PolicyError):
    """The text parses but means nothing sensible: unknown names, numbers out of range, conflicts."""


def located(cls: type[PolicyError], message: str, loc: Loc | None, filename: str) -> PolicyError:
    """Build an error of class `cls` at `loc` (the start of the file when unknown)."""
    loc = loc or Loc()
    return cls(message, filename=filename, line=loc.line, column=loc.column)
