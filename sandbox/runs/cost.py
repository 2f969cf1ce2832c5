"""The cost model: API-equivalent USD from per-request usage and a public price table.

Billing follows the paper: uncached (prefilled) input at the input price, cached and
repositioned tokens at the cache-hit price (repositioning is billed as a hit, a
deliberately conservative choice), output at the output price. Dropped tokens that the
request did not compute are not billed. Summaries are their own calls and are billed
like any other request.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Mapping

PRICES_FILE = Path(__file__).with_name("prices.json")
_PER_TOKEN = 1e-6  # tables are in USD per million tokens


@dataclass(frozen=True)
class ReportedUsage:
    """Usage of one request as a backend reported it (replay, embedded or any server), classified as in
    the architecture's usage accounting; what the cost model bills and trajectories record.

    `prompt_tokens == prefilled + cached + repos + drop_skipped` always holds. Not
    `akv_core.cache.usage.Usage`, the engine's own record: this one is read from any server's reply
    (`from_fields`, tolerant of missing fields) and carries no total.
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    drop_skipped_tokens: int
    repos_tokens: int
    prefilled_tokens: int

    @classmethod
    def from_fields(cls, source: object) -> ReportedUsage:
        """Read the fields from an object or a mapping; `prefilled` is derived when absent."""
        get = source.get if isinstance(source, Mapping) else lambda k, d=None: getattr(source, k, d)
        prompt = int(get("prompt_tokens", 0) or 0)
        cached = int(get("cached_tokens", 0) or 0)
        dropped = int(get("drop_skipped_tokens", 0) or 0)
        repos = int(get("repos_tokens", 0) or 0)
        prefilled = get("prefilled_tokens", None)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=int(get("completion_tokens", 0) or 0),
            cached_tokens=cached,
            drop_skipped_tokens=dropped,
            repos_tokens=repos,
            prefilled_tokens=int(prefilled) if prefilled is not None else prompt - cached - dropped - repos,
        )

    def with_completion(self, completion_tokens: int) -> ReportedUsage:
        return ReportedUsage(self.prompt_tokens, completion_tokens, self.cached_tokens,
                     self.drop_skipped_tokens, self.repos_tokens, self.prefilled_tokens)

    def to_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "drop_skipped_tokens": self.drop_skipped_tokens,
            "repos_tokens": self.repos_tokens,
            "prefilled_tokens": self.prefilled_tokens,
        }


@dataclass(frozen=True)
class PriceTable:
    name: str
    input: float  # USD per million uncached input tokens
    cached_input: float
    output: float

    def cost(self, usage: ReportedUsage) -> float:
        """USD for one request."""
        billed = (usage.prefilled_tokens * self.input
                  + (usage.cached_tokens + usage.repos_tokens) * self.cached_input
                  + usage.completion_tokens * self.output)
        return billed * _PER_TOKEN


@dataclass(frozen=True)
class TokenTotals:
    """Tokens of a task run as results report them; `input` is the uncached (prefilled) input."""

    input: int = 0
    cached: int = 0
    output: int = 0
    drop_skipped: int = 0
    repos: int = 0

    def add(self, usage: ReportedUsage) -> TokenTotals:
        return TokenTotals(self.input + usage.prefilled_tokens, self.cached + usage.cached_tokens,
                           self.output + usage.completion_tokens,
                           self.drop_skipped + usage.drop_skipped_tokens, self.repos + usage.repos_tokens)

    def __add__(self, other: TokenTotals) -> TokenTotals:
        return TokenTotals(self.input + other.input, self.cached + other.cached, self.output + other.output,
                           self.drop_skipped + other.drop_skipped, self.repos + other.repos)

    def to_dict(self) -> dict[str, int]:
        return {"input": self.input, "cached": self.cached, "output": self.output,
                "drop_skipped": self.drop_skipped, "repos": self.repos}


@lru_cache(maxsize=1)
def cents(usd: float, digits: int = 3) -> str:
    """A cost in US cents, the one unit of every cost a person reads (headers and lines say `¢/task`);
    JSON output keeps US dollars in fields named `*_usd`."""
    return f"{100 * usd:.{digits}f}"


def _price_file() -> Mapping[str, object]:
    return json.loads(PRICES_FILE.read_text())


def table_names() -> list[str]:
    return sorted(_price_file()["tables"])  # type: ignore[index]


def default_table_name() -> str:
    return str(_price_file()["default"])


def price_table(name: str | None = None) -> PriceTable:
    """The table called `name` (case-insensitive); the default table when None.

    Raises ValueError naming the known tables for an unknown name.
    """
    tables: Mapping[str, Mapping[str, float]] = _price_file()["tables"]  # type: ignore[assignment]
    key = (name or default_table_name()).lower()
    if key not in tables:
        raise ValueError(f"unknown price table {name!r}: expected one of {', '.join(table_names())}")
    row = tables[key]
    return PriceTable(key, float(row["input"]), float(row["cached_input"]), float(row["output"]))
