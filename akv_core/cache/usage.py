"""Per-request token accounting, shared by the engine and the replay simulator.

Every prompt token falls in exactly one class (docs/architecture.md, "Usage
accounting"): prompt = prefilled + cached + repos + drop_skipped.
`retained_tokens` is no class of its own: it counts the reused tokens (cached,
repos or drop_skipped) whose KV came back from retained entries, the KV of an
earlier state (before a drop or a reposition) that the cache kept after no path
read it any more (docs/engine-cache.md, "Retained KV").
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    drop_skipped_tokens: int
    repos_tokens: int
    prefilled_tokens: int
    retained_tokens: int = 0

    def __post_init__(self) -> None:
        classes = self.prefilled_tokens + self.cached_tokens + self.repos_tokens + self.drop_skipped_tokens
        if classes != self.prompt_tokens or self.total_tokens != self.prompt_tokens + self.completion_tokens:
            raise ValueError(f"inconsistent usage: {self}")
        if not 0 <= self.retained_tokens <= self.prompt_tokens - self.prefilled_tokens:
            raise ValueError(f"inconsistent usage: retained tokens are not reused tokens: {self}")

    @classmethod
    def of_prompt(cls, prefilled: int, cached: int, repos: int, drop_skipped: int, retained: int = 0) -> Usage:
        prompt = prefilled + cached + repos + drop_skipped
        return cls(prompt, 0, prompt, cached, drop_skipped, repos, prefilled, retained)

    def with_completion(self, completion_tokens: int) -> Usage:
        return Usage(self.prompt_tokens, completion_tokens, self.prompt_tokens + completion_tokens,
                     self.cached_tokens, self.drop_skipped_tokens, self.repos_tokens, self.prefilled_tokens,
                     self.retained_tokens)
