"""What the model itself used: the attention mass a reply put on each message of its history.

For every token of a reply, the query that produced it (the last prompt token for the first
token, the previous reply token for each later one) spreads one unit of attention per layer
and head over the KV entries it can see. Averaged over layers and heads, that is one unit per
reply token; averaged over the reply's tokens, one unit in all, split into:

- each history message's share: its visible KV entries (the template's glue before a message,
  such as `<|im_start|>user\\n` and a default system prompt, belongs to the message it precedes,
  as in the chat renderer's spans); a message whose entries a drop hides has `visible_tokens`
  0 and mass 0.0 (it is listed, never left out);
- `generation_header`: the generation prompt after the last message (`<|im_start|>assistant\\n`);
- `reply`: the reply's own earlier tokens (and each token's own query row).

The shares add up to 1 (up to float rounding). The engine adds each query's weights up as it runs
(the prompt's last row, then each decode row: the C decode kernels as they attend, other passes by
computing that row's softmax again; a continued message's rows in its teacher-forced pass,
`akv_core.forcing`); a request that does not ask pays nothing.

This module holds no torch: the sandbox harness reads `USED_MASS` and `Attribution` from it.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# A message is *used* by a reply when its attribution mass reaches this (`Attribution.used`).
# One value for the engine, the server's clients and the harness's attention use records.
# Calibrated on the 20 seeded needle histories of tests/test_attribution.py (`vault_history`, seeds
# 0-19, the right answer teacher-forced), not on recorded traces: the tool message holding the
# answer took 0.034-0.062 of the reply's mass (median 0.038), its 100 distractor tool messages
# 0.006-0.049 (median 0.012; 5 of them reach 0.03). The mass grows with a message's length and
# recency as well as its use, so a long or recent message passes more easily; the agreement with
# use records inferred from recorded traces is in docs/benchmarks.md ("Attribution and teacher-forced
# scoring").
USED_MASS = 0.03


@dataclass(frozen=True)
class MessageMass:
    """One history message's share of the reply's attention, and how many of its tokens it could see."""

    message: int
    mass: float
    visible_tokens: int


@dataclass(frozen=True)
class Attribution:
    """A reply's attention over its history: per message, the generation header, the reply itself."""

    messages: tuple[MessageMass, ...]
    generation_header: float
    reply: float
    tokens: int   # reply tokens averaged over

    def used(self, threshold: float = USED_MASS) -> tuple[int, ...]:
        """The messages whose mass reaches `threshold`, ascending (the attention use record)."""
        return tuple(m.message for m in self.messages if m.mass >= threshold)

    def to_dict(self) -> dict[str, Any]:
        """The HTTP shape: `{"messages": [{"message", "mass", "visible_tokens"}], "generation_header",
        "reply", "tokens"}`."""
        return {"messages": [{"message": m.message, "mass": m.mass, "visible_tokens": m.visible_tokens}
                             for m in self.messages],
                "generation_header": self.generation_header, "reply": self.reply, "tokens": self.tokens}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Attribution:
        """The inverse of `to_dict` (what a client reads back from a response)."""
        messages = tuple(MessageMass(int(m["message"]), float(m["mass"]), int(m["visible_tokens"]))
                         for m in data["messages"])
        return cls(messages, float(data["generation_header"]), float(data["reply"]), int(data["tokens"]))


@dataclass(frozen=True)
class KeyProvenance:
    """Which message each prompt token belongs to: the renderer's spans and where the header starts."""

    spans: tuple[tuple[int, int], ...]
    header_start: int

    def message_of(self, offset: int) -> int | None:
        """The message index of prompt token `offset`, None for the generation header."""
        if offset >= self.header_start:
            return None
        return bisect_right([start for start, _ in self.spans], offset) - 1


def attribute(provenance: KeyProvenance, visible_offsets: Sequence[int], visible_mass: Sequence[float],
              header_mass: float, reply_mass: float, tokens: int) -> Attribution:
    """An Attribution from masses already averaged per reply token: `visible_mass[i]` is the mass on
    prompt token `visible_offsets[i]` (visible prompt tokens only), `header_mass` the mass on the
    header's recomputed last token, `reply_mass` the mass on the reply's tokens."""
    mass = [0.0] * len(provenance.spans)
    seen = [0] * len(provenance.spans)
    header = header_mass
    for offset, value in zip(visible_offsets, visible_mass, strict=True):
        message = provenance.message_of(offset)
        if message is None:
            header += value
        else:
            mass[message] += value
            seen[message] += 1
    messages = tuple(MessageMass(i, mass[i], seen[i]) for i in range(len(mass)))
    return Attribution(messages, header, reply_mass, tokens)
