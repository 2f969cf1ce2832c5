"""Tasks: three legs joined into one question, split into train and heldout without shared facts.

Splits are disjoint in their questions and in the facts the answers hinge on: every leg owns
two keys (the fact its year is read from, and the entity its clue names), a key belongs to one
split only, and a task joins legs of one split.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from sandbox.suites.base import Task
from sandbox.suites.localcomp.atlas import Atlas
from sandbox.suites.localcomp.env import TOOLS
from sandbox.suites.localcomp.questions import Leg, all_legs

SPLITS = ("train", "heldout")
QUOTA = {"train": 48, "heldout": 170}  # the issue asks for at least 40 and 150
SYSTEM = (
    "You are a research agent working offline over a local encyclopedia of chemical elements, countries, "
    "currencies, languages and administrative divisions. Use the search tool to find documents and "
    "get_document to read them. Questions take several hops; read carefully, since articles also mention "
    "look-alike facts about their neighbours. When you are done, reply without tool calls and end with "
    "'Answer: <answer>'."
)


SHORT_KINDS = ("element", "country")  # one document or two per leg
LONG_KINDS = ("producer", "language")  # four to six documents per leg


@dataclass(frozen=True)
class Draft:
    """A composed question before its split's quota and the walkthrough check decide on it."""

    split: str
    legs: tuple[Leg, ...]
    combine: str  # "span" (years between the earliest and the latest) or "earlier" (whose year is earliest)


def assign_legs(legs: list[Leg], seed: int) -> dict[str, list[Leg]]:
    """Give each leg a split so that no hinge or anchor key appears in both."""
    owner: dict[str, str] = {}
    pools: dict[str, list[Leg]] = {s: [] for s in SPLITS}
    order = sorted(legs, key=lambda leg: (leg.hinge, leg.anchor, leg.clue))
    random.Random(seed).shuffle(order)
    for i, leg in enumerate(order):
        keys = (leg.hinge, leg.anchor)
        # about one leg in four goes to train; a leg whose key is owned follows that owner
        wanted = next((owner[k] for k in keys if k in owner), "train" if i % 4 == 0 else "heldout")
        if any(owner.get(k, wanted) != wanted for k in keys):
            continue  # its two keys already belong to different splits
        owner.update({k: wanted for k in keys})
        pools[wanted].append(leg)
    return pools


def drafts(atlas: Atlas, seed: int, edition: int = 1) -> Iterator[Draft]:
    """Candidate questions in a seeded order. A question has three legs: it opens with any leg
    and continues with a long one; a short opening is followed by another long leg, a long
    opening by a short one. The opening leg's evidence is read first and needed again only for
    the final answer, some twenty tool calls later."""
    labelled = {label: all_legs(atlas, label, edition) for label in ("A", "B", "C")}
    pools = assign_legs([leg for legs in labelled["A"].values() for leg in legs], seed)
    split_of = {(leg.hinge, leg.anchor): s for s, legs in pools.items() for leg in legs}

    def pool(label: str, kinds: tuple[str, ...], split: str) -> list[Leg]:
        return [leg for kind in kinds for leg in labelled[label][kind]
                if split_of.get((leg.hinge, leg.anchor)) == split]

    rng = random.Random(seed + 1)
    for split in SPLITS:
        firsts, seconds = pool("A", SHORT_KINDS + LONG_KINDS, split), pool("B", LONG_KINDS, split)
        long_thirds, short_thirds = pool("C", LONG_KINDS, split), pool("C", SHORT_KINDS, split)
        for legs in (firsts, seconds, long_thirds, short_thirds):
            rng.shuffle(legs)
        for i, first in enumerate(firsts):
            chosen = [first]
            for candidates in (seconds, short_thirds if _is_long(first) else long_thirds):
                leg = _next_compatible(candidates, i, chosen)
                if leg is None:
                    break
                chosen.append(leg)
            years = sorted(leg.year for leg in chosen)
            combine = "earlier" if i % 3 == 2 and years[0] != years[1] else "span"
            if len(chosen) == 3:
                yield Draft(split, tuple(chosen), combine)


def _is_long(leg: Leg) -> bool:
    return len(leg.steps) > 2


def _next_compatible(candidates: list[Leg], start: int, chosen: list[Leg]) -> Leg | None:
    """The first candidate from a rotating start that shares no anchor, hinge or entity."""
    n = len(candidates)
    for j in range(n):
        leg = candidates[(start + j) % n]
        if all(leg.anchor != c.anchor and leg.hinge != c.hinge and leg.entity != c.entity for c in chosen):
            return leg
    return None


def make_task(draft: Draft, number: int, docid_of: Callable[[str], str],
              tools: tuple[Mapping[str, Any], ...] = TOOLS) -> Task:
    legs = draft.legs
    names = " and ".join([", ".join(leg.label for leg in legs[:-1]), legs[-1].label])
    earliest = min(legs, key=lambda leg: leg.year)
    if draft.combine == "earlier":
        ask = (f"Which of {names} is the earliest year? Answer with the name of the element or country "
               "that year belongs to.")
        gold = {"type": "name", "answer": earliest.entity, "aliases": list(earliest.aliases)}
    else:
        between = f"{names}" if len(legs) == 2 else f"the earliest and the latest of {names}"
        ask = f"How many years lie between {between}? Answer with a single whole number."
        years = [leg.year for leg in legs]
        gold = {"type": "number", "answer": str(max(years) - min(years)), "tolerance": 0}
    prompt = "\n".join([*(f"Let {leg.label} be {leg.clue}." for leg in legs), ask])
    evidence = [e for leg in legs for e in leg.evidence]
    meta: dict[str, Any] = {
        "plan": {"combine": draft.combine, "legs": [_leg_plan(leg) for leg in legs]},
        "gold": gold,
        "years": {leg.label: leg.year for leg in legs},
        "hinges": [leg.hinge for leg in legs],
        "anchors": [leg.anchor for leg in legs],
        "evidence": [{"docid": docid_of(key), "key": key, "field": f, "value": v} for key, f, v in evidence],
        "gold_docs": sorted({docid_of(key) for key, _, _ in evidence}),
    }
    return Task(id=f"localcomp-{draft.split}-{number:03d}", suite="localcomp", split=draft.split,
                system=SYSTEM, prompt=prompt, tools=tools, meta=meta)


def _leg_plan(leg: Leg) -> dict[str, Any]:
    entity = leg.payload.get("refs", {}).get("country") or {"var": leg.payload["var"], "field": "Name"}
    return {"label": leg.label, "steps": list(leg.steps), "payload": leg.payload, "entity": entity}
