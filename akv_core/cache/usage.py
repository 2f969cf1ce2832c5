"""Per-request token accounting, shared by the engine and the replay simulator.

Every prompt token falls in exactly one class (docs/architecture.md, "Usage
accounting"): prompt = prefilled + cached + repos + drop_skipped.
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

    def __post_init__(self) -> None:
        classes = self.prefilled_tokens + self.cached_tokens + self.repos_tokens + self.drop_skipped_tokens
        if classes != self.prompt_tokens or self.total_tokens != self.prompt_tokens + self.completion_tokens:
            raise ValueError(f"inconsistent usage: {self}")

    @classmethod
    def of_prompt(cls, prefilled: int, cached: int, repos: int, drop_skipped: int) -> Usage:
        prompt = prefilled + cached + repos + drop_skipped
        return cls(prompt, 0, prompt, cached, drop_skipped, repos, prefilled)

    def with_completion(self, completion_tokens: int) -> Usage:
        return Usage(self.prompt_tokens, completion_tokens, self.prompt_tokens + completion_tokens,
                     self.cached_tokens, self.drop_skipped_tokens, self.repos_tokens, self.prefilled_tokens)
