"""Teacher forcing: a reply's tokens fed in one pass against a request's visible KV.

One forward over `[last prompt token] + reply[:k]` (the queries that produced each reply token)
gives, per reply token, its log probability under the request's visible KV and, with the
attention probe on, the attention every query put on each KV slot. It is the work of a short
prefill. The engine runs it for a continued message (`continue_final_message`: its scores and,
when asked, its attribution; a generated reply's attribution is added up as it decodes); a request
that asks for neither pays nothing.

Where its rows go: the reply tokens' K/V into the request's reserved decode slots (exactly
where decoding would write them), and the last prompt token, whose query is needed again, into
the first reserved slot after them (a scratch slot), so that the prompt's cached KV is never
rewritten.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from akv_core.attribution import Attribution, KeyProvenance, attribute
from akv_core.cache.key import CacheKey, DropRecord
from akv_core.continuation import TokenScore
from akv_core.model.batch import ForwardBatch, SeqAttention

# Query rows per forward of a teacher-forced pass: the probed attention holds [heads, rows, keys]
# probabilities, 256 rows of an 8K context about 75 MB per layer in fp32.
FORCED_ROWS = 256


@dataclass(frozen=True)
class ForcedRows:
    """One teacher-forced pass: `tokens` fed at `positions` into `out_slots`, each row seeing
    `context_slots` (the visible prompt without its last token) and the rows up to its own."""

    tokens: list[int]
    positions: list[int]
    out_slots: list[int]
    context_slots: list[int]


@dataclass(frozen=True)
class ForcedResult:
    """Per targeted row its TokenScore; the last row's logits; the attention mass per pool slot
    (summed over rows, layers and heads; None unless asked)."""

    scores: list[TokenScore]
    last_logits: Tensor | None
    slot_mass: Tensor | None


class SlotMass:
    """An attention probe that sums the weights every query put on each pool slot."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.mass = torch.zeros(num_slots, dtype=torch.float64, device=device)

    def __call__(self, layer: int, seq_index: int, slots: Tensor, probs: Tensor) -> None:
        self.mass.index_add_(0, slots, probs.sum(dim=(0, 1)).to(torch.float64))


def forced_pass(model: Any, kv: Any, rows: ForcedRows, targets: Sequence[int], top: int | None = None,
                attention: bool = False, last_logits: bool = True) -> ForcedResult:
    """Run `rows` in chunks of FORCED_ROWS; row i is scored against `targets[i]` (fewer targets than
    rows: the last rows are not scored), with its rank and `top` alternatives when `top` is an int.
    With `attention`, the probe sums each slot's weights. Logits are computed for the scored rows and,
    with `last_logits`, the last row (none: no LM head at all)."""
    probe = SlotMass(kv.num_slots, kv.device) if attention else None
    previous, scores, last = model.attention_probe, [], None
    model.attention_probe = probe
    try:
        for start in range(0, len(rows.tokens), FORCED_ROWS):
            stop = min(start + FORCED_ROWS, len(rows.tokens))
            scored = max(0, min(stop, len(targets)) - start)
            wanted = stop - start if last_logits and stop == len(rows.tokens) else scored
            logits = model.forward(_chunk_batch(rows, start, stop, wanted, kv.device), kv).float()
            scores += _scores(logits[:scored], targets[start:stop], top)
            last = logits[-1] if last_logits and stop == len(rows.tokens) else None
    finally:
        model.attention_probe = previous
    return ForcedResult(scores, None if last is None else last.cpu(), None if probe is None else probe.mass)


def _chunk_batch(rows: ForcedRows, start: int, stop: int, logits_rows: int, device: torch.device) -> ForwardBatch:
    """Rows [start, stop) as one sequence: the context, the rows before them, then themselves (causal);
    logits for the first `logits_rows` of them."""
    slots = torch.tensor(rows.context_slots + rows.out_slots[:stop], dtype=torch.long, device=device)
    return ForwardBatch(torch.tensor(rows.tokens[start:stop], dtype=torch.long, device=device),
                        torch.tensor(rows.positions[start:stop], dtype=torch.long, device=device),
                        slots[len(rows.context_slots) + start:], [SeqAttention(0, stop - start, slots)],
                        torch.arange(logits_rows, device=device))


def _scores(logits: Tensor, targets: Sequence[int], top: int | None) -> list[TokenScore]:
    """Each row's target's log probability; with `top` (an int), also its rank and the `top` most likely."""
    if logits.shape[0] == 0:
        return []
    chosen = torch.tensor(list(targets[:logits.shape[0]]), dtype=torch.long, device=logits.device)
    own_logit = logits.gather(1, chosen[:, None])
    normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
    own = (own_logit - normalizer)[:, 0].tolist()
    ranks = [None] * len(own) if top is None else ((logits > own_logit).sum(dim=1) + 1).tolist()
    best = torch.topk(logits, top, dim=-1) if top else None
    out = []
    for i, (token, value, rank) in enumerate(zip(chosen.tolist(), own, ranks)):
        pairs = () if best is None else tuple(zip(best.indices[i].tolist(),
                                                  (best.values[i] - normalizer[i]).tolist()))
        out.append(TokenScore(token, value, rank, pairs))
    return out


def visible_offsets(key: CacheKey) -> list[int]:
    """The key's token offsets that the first reply token sees, in key order: every token no drop
    record hides (a hidden token never comes back). Aligned with `PromptLayout.view_slots`."""
    hidden = sorted(span for _, record in key.records if isinstance(record, DropRecord) for span in record.hidden)
    out, cursor = [], 0
    for start, end in hidden:
        out.extend(range(cursor, max(cursor, start)))
        cursor = max(cursor, end)
    out.extend(range(cursor, len(key)))
    return out


def fold_scratch(mass: Tensor, rows: ForcedRows, prompt_last_slot: int) -> Tensor:
    """`mass` (per pool slot) with the scratch slot's share (the pass's copy of the last prompt token, rows.out_slots[0])
    moved onto the prompt's own slot of that token, so the scratch slot can take a reply token after the pass."""
    scratch = rows.out_slots[0]
    mass[prompt_last_slot] += mass[scratch]
    mass[scratch] = 0.0
    return mass


def reply_attribution(mass: Tensor, prompt_slots: Sequence[int], reply_slots: Sequence[int], rows: int,
                      provenance: KeyProvenance, offsets: Sequence[int], layers: int, heads: int) -> Attribution:
    """The Attribution of `rows` reply-token queries whose attention weights (summed over rows, layers and heads)
    are `mass`, per pool slot: split by the visible prompt's slots (aligned with `offsets`) and the reply's own."""
    if len(offsets) != len(prompt_slots):
        raise RuntimeError(f"{len(offsets)} visible offsets for {len(prompt_slots)} visible slots")
    scale, device = 1.0 / (rows * layers * heads), mass.device
    prompt = (mass[torch.tensor(list(prompt_slots), dtype=torch.long, device=device)] * scale).tolist()
    reply = float(mass[torch.tensor(list(reply_slots), dtype=torch.long, device=device)].sum()) * scale
    return attribute(provenance, offsets, prompt, 0.0, reply, rows)
