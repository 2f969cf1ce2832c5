"""Multi-hop questions generated from the facts, each with its research plan and gold data.

A question joins three *legs* (tasks.py). A leg walks a chain of documents to one year: the
discovery of an element, or the adoption of a country's current currency. The task asks how
many years lie between the earliest and the latest (or which came first), so the first leg's
evidence is read early and needed again at the very end, after the long legs.

A leg's plan is data the scripted agent interprets (see agent.py): `find` a document by search
and check its infobox against `where`, `pick` the maximum over found documents, take a `cell`
from a table, then read the `payload`. Templates like "{name}" are filled from `refs`, each a
field of an earlier document (or a noted value), so the agent must still see that evidence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from sandbox.suites.localcomp.atlas import Atlas
from sandbox.suites.localcomp.facts import Country, Element

Step = dict[str, Any]


@dataclass(frozen=True)
class Leg:
    label: str
    clue: str  # the question's description of the leg's year
    steps: tuple[Step, ...]
    payload: Step
    year: int
    entity: str  # the element or country the year belongs to
    aliases: tuple[str, ...]
    hinge: str  # the fact the year is read from: splits never share one
    anchor: str  # the entity the clue names: splits never share one either
    evidence: tuple[tuple[str, str, str], ...]  # (entity key, field, value) along the chain


def ref(var: str, field: str, item: int | None = None) -> dict[str, Any]:
    return {"var": var, "field": field} | ({"item": item} if item is not None else {})


def element_clue(e: Element, atlas: Atlas, v: str) -> tuple[str, Step] | None:
    """Name an element without naming it: by its CAS number, or by its discoverers and group."""
    same = [x for x in atlas.facts.elements if x.discoverers == e.discoverers]
    if e.number % 2 == 0 or len(same) == 1:
        if not e.cas or sum(x.cas == e.cas for x in atlas.facts.elements) > 1:
            return None
        return (f"the element with CAS registry number {e.cas}",
                {"op": "find", "var": v, "kind": "Chemical element", "queries": [f"CAS number {e.cas}"],
                 "where": {"CAS number": e.cas}})
    if e.group is None or sum(x.group == e.group for x in same) > 1:
        return None
    return (f"the element in group {e.group} that was discovered by {e.discoverers}",
            {"op": "find", "var": v, "kind": "Chemical element",
             "queries": [f"discovered by {e.discoverers}", f"{e.discoverers} group {e.group}"],
             "where": {"Discovered by": e.discoverers, "Group": str(e.group)}})


def discoverer_clue(e: Element, atlas: Atlas, v: str) -> tuple[str, Step] | None:
    """Name an element by its discoverers and group, where they discovered several elements:
    the search surfaces all of them, and the ones in other groups are dead ends."""
    same = [x for x in atlas.facts.elements if x.discoverers == e.discoverers]
    if len(same) < 2 or e.group is None or sum(x.group == e.group for x in same) > 1:
        return None
    return (f"the element in group {e.group} that was discovered by {e.discoverers}",
            {"op": "find", "var": v, "kind": "Chemical element",
             "queries": [f"discovered by {e.discoverers}", f"{e.discoverers} group {e.group}"],
             "where": {"Discovered by": e.discoverers, "Group": str(e.group)}})


Clue = tuple[str, Step]  # the question's words for an entity, and the plan step that finds it


def element_clues(e: Element, atlas: Atlas, v: str, edition: int, producing: bool = False) -> list[Clue]:
    """Edition 1: one clue (the CAS number, or discoverers and group; for a producer leg every
    third element by place and year of discovery). Edition 2: every clue several elements half
    fit (same discoverers, same place or year of discovery), so the research opens look-alikes;
    the CAS number only where there is none."""
    if edition == 1:
        first = (producing and e.number % 3 == 0 and discovery_clue(e, atlas, v)) or element_clue(e, atlas, v)
        return [first] if first else []
    found = [c for c in (discoverer_clue(e, atlas, v), discovery_clue(e, atlas, v),
                         discovery_year_clue(e, atlas, v)) if c]
    direct = element_clue(e, atlas, v)
    return found or ([direct] if direct else [])


def discovery_year_clue(e: Element, atlas: Atlas, v: str) -> tuple[str, Step] | None:
    """Name an element by its block and discovery year. The year also appears in the articles
    of its neighbours in the periodic table (their prose mentions it), and they rank too."""
    year = e.discovery_year
    if not year or sum((x.block, x.discovery_year) == (e.block, year) for x in atlas.facts.elements) > 1:
        return None
    return (f"the {e.block}-block element discovered in {year}",
            {"op": "find", "var": v, "kind": "Chemical element",
             "queries": [f"element discovered in {year}", f"{e.block}-block discovered {year}"],
             "where": {"Discovery year": str(year), "Block": e.block}})


def discovery_clue(e: Element, atlas: Atlas, v: str) -> tuple[str, Step] | None:
    """Name an element by where and when it was discovered. Searching for that also surfaces the
    elements found in the same place or year, which must be opened and ruled out."""
    place, year = e.discovery_location, e.discovery_year
    if not place or not year or sum((x.discovery_location, x.discovery_year) == (place, year)
                                    for x in atlas.facts.elements) > 1:
        return None
    return (f"the element discovered in {place} in {year}",
            {"op": "find", "var": v, "kind": "Chemical element",
             "queries": [f"discovered {year} {place}", f"element discovered in {place}"],
             "where": {"Discovery year": str(year), "Discovery location": place}})


def country_clue(c: Country, v: str) -> tuple[str, Step]:
    if int(c.numeric) % 2:
        return (f"the country or territory whose ISO 3166-1 numeric code is {c.numeric}",
                {"op": "find", "var": v, "kind": "Country", "queries": [f"ISO 3166-1 numeric {c.numeric}"],
                 "where": {"ISO 3166-1 numeric": c.numeric}})
    return (f"the country or territory whose ISO 3166-1 alpha-3 code is {c.alpha_3}",
            {"op": "find", "var": v, "kind": "Country", "queries": [f"ISO 3166-1 alpha-3 {c.alpha_3}"],
             "where": {"ISO 3166-1 alpha-3": c.alpha_3}})


def currency_users_clue(c: Country, atlas: Atlas, v: str) -> tuple[str, Step] | None:
    """Name a country by its currency and its subdivision count. A search for the currency
    surfaces its other users (and its own article): look-alikes to open and rule out."""
    cur = atlas.currencies.get(c.currency or "")
    users = [atlas.countries[t] for t in atlas.users_of(cur) if t in atlas.countries] if cur else []
    n = atlas.subdivision_count(c)
    if len(users) < 3 or sum(atlas.subdivision_count(u) == n for u in users) > 1:
        return None
    return (f"the country or territory that uses the {cur.name} and has {n} ISO 3166-2 subdivisions",
            {"op": "find", "var": v, "kind": "Country",
             "queries": [f"{cur.name} legal tender", f"{cur.name} {n} subdivisions"],
             "where": {"Currency": cur.name, "ISO 3166-2 subdivisions": str(n)}, "not_titles": [cur.name]})


def language_users_clue(c: Country, atlas: Atlas, v: str) -> tuple[str, Step] | None:
    """Name a country by its main official language and its subdivision count: the other
    countries that speak it are the look-alikes."""
    lang = atlas.main_language(c)
    users = [x for x in atlas.facts.countries if atlas.main_language(x) == lang] if lang else []
    n = atlas.subdivision_count(c)
    if len(users) < 3 or sum(atlas.subdivision_count(u) == n for u in users) > 1:
        return None
    return (f"the country or territory whose main official language is {lang.name} and which has {n} "
            "ISO 3166-2 subdivisions",
            {"op": "find", "var": v, "kind": "Country",
             "queries": [f"{lang.name} official language", f"{lang.name} {n} subdivisions"],
             "where": {"Main official language": lang.name, "ISO 3166-2 subdivisions": str(n)},
             "not_titles": [lang.name]})


def country_clues(c: Country, atlas: Atlas, v: str, edition: int, by_language: bool = True) -> list[Clue]:
    """Edition 1: the ISO code. Edition 2: every clue other countries half fit (currency, main
    language, each with the subdivision count); the ISO code only where there is none."""
    if edition == 1:
        return [country_clue(c, v)]
    found = [x for x in (currency_users_clue(c, atlas, v), by_language and language_users_clue(c, atlas, v)) if x]
    return found or [country_clue(c, v)]


def find_by_name(v: str, kind: str, source: dict[str, Any], suffix: str) -> Step:
    return {"op": "find", "var": v, "kind": kind, "queries": ["{name} " + suffix, "{name}"],
            "where": {"Name": "{name}"}, "refs": {"name": source}}


def currency_steps(label: str, country_var: str) -> tuple[list[Step], Step]:
    """From a found country to the year its current currency was adopted there."""
    cur = f"{label}.cur"
    find = {"op": "find", "var": cur, "kind": "Currency", "queries": ["{name} {code}", "{code} currency"],
            "where": {"Name": "{name}", "ISO 4217 code": "{code}"},
            "refs": {"name": ref(country_var, "Currency"), "code": ref(country_var, "Currency code")}}
    payload = {"var": cur, "table": "Adoption as legal tender", "row": {"Country": "{country}"},
               "column": "Adopted", "refs": {"country": ref(country_var, "Name")}}
    return [find], payload


def country_aliases(c: Country) -> tuple[str, ...]:
    return tuple(dict.fromkeys(x for x in (c.name, c.common_name, c.official_name, c.alpha_3) if x))


def element_leg(e: Element, atlas: Atlas, label: str, clue: Clue) -> Leg | None:
    if e.discovery_year is None:
        return None
    text, find = clue
    return Leg(label=label, clue=f"the year {text} was discovered", steps=(find,),
               payload={"var": f"{label}.e", "field": "Discovery year"}, year=e.discovery_year,
               entity=e.name, aliases=(e.name, e.symbol), hinge=f"element:{e.number}:discovery_year",
               anchor=f"element:{e.number}",
               evidence=((f"element:{e.number}", "Discovery year", str(e.discovery_year)),))


def country_leg(c: Country, atlas: Atlas, label: str, clue: Clue) -> Leg | None:
    year = atlas.currency_adopted(c)
    if year is None:
        return None
    text, find = clue
    steps, payload = currency_steps(label, f"{label}.c")
    return Leg(label=label, clue=f"the year {text} adopted its current currency", steps=(find, *steps),
               payload=payload, year=year, entity=c.name, aliases=country_aliases(c),
               hinge=f"adoption:{c.alpha_2}:{c.currency}", anchor=f"country:{c.alpha_2}",
               evidence=((f"country:{c.alpha_2}", "Currency code", str(c.currency)),
                         (f"currency:{c.currency}", f"Adopted ({c.name})", str(year))))


def producer_leg(e: Element, atlas: Atlas, label: str, clue: Clue) -> Leg | None:
    """Element -> its three top producers -> the one with most subdivisions -> its currency's year."""
    if len(e.producers) != 3:
        return None
    counts = [atlas.subdivision_count(atlas.countries[p]) for p in e.producers]
    if counts.count(max(counts)) > 1:
        return None
    top = atlas.countries[e.producers[counts.index(max(counts))]]
    year = atlas.currency_adopted(top)
    if year is None:
        return None
    text, find = clue
    finds = [find_by_name(f"{label}.p{i}", "Country", ref(f"{label}.e", "Top producers", i), "country")
             for i in range(3)]
    pick = {"op": "pick", "var": f"{label}.top", "among": [f"{label}.p{i}" for i in range(3)],
            "field": "ISO 3166-2 subdivisions"}
    steps, payload = currency_steps(label, f"{label}.top")
    return Leg(label=label, clue=(f"the year in which, among the three leading producers of {text}, the one "
                                  "with the most ISO 3166-2 subdivisions adopted its current currency"),
               steps=(find, *finds, pick, *steps), payload=payload, year=year, entity=top.name,
               aliases=country_aliases(top), hinge=f"adoption:{top.alpha_2}:{top.currency}",
               anchor=f"element:{e.number}",
               evidence=((f"element:{e.number}", "Top producers", ", ".join(e.producers)),
                         *((f"country:{p}", "ISO 3166-2 subdivisions", str(n))
                           for p, n in zip(e.producers, counts)),
                         (f"currency:{top.currency}", f"Adopted ({top.name})", str(year))))


def language_leg(c: Country, atlas: Atlas, label: str, clue: Clue) -> Leg | None:
    """Country -> main official language -> the other country where it is official by the largest
    share -> that country's currency's year."""
    lang = atlas.main_language(c)
    if lang is None:
        return None
    others = [(t, share) for t, share in atlas.official_in.get(lang.code, ()) if t != c.alpha_2]
    if not others or (len(others) > 1 and others[0][1] == others[1][1]):
        return None
    other = atlas.countries[others[0][0]]
    year = atlas.currency_adopted(other)
    if year is None:
        return None
    text, find = clue
    find_language = find_by_name(f"{label}.lang", "Language", ref(f"{label}.c", "Main official language"),
                                 "language")
    # the language's table lists countries by share, largest first: the first official row not home
    cell = {"op": "cell", "var": f"{label}.x", "doc": f"{label}.lang", "table": "Status by country",
            "match": {"Status": "official"}, "exclude": {"Country": "{home}"}, "column": "Country",
            "refs": {"home": ref(f"{label}.c", "Name")}}
    find_other = find_by_name(f"{label}.o", "Country", {"var": f"{label}.x"}, "country")
    steps, payload = currency_steps(label, f"{label}.o")
    return Leg(label=label, clue=(f"the year in which the other country where the main official language of "
                                  f"{text} is official by the largest share of the population adopted "
                                  "its current currency"),
               steps=(find, find_language, cell, find_other, *steps), payload=payload, year=year,
               entity=other.name, aliases=country_aliases(other),
               hinge=f"adoption:{other.alpha_2}:{other.currency}", anchor=f"country:{c.alpha_2}",
               evidence=((f"country:{c.alpha_2}", "Main official language", lang.name),
                         (f"language:{lang.code}", f"Official share ({other.name})", f"{others[0][1]:g} %"),
                         (f"country:{other.alpha_2}", "Currency code", str(other.currency)),
                         (f"currency:{other.currency}", f"Adopted ({other.name})", str(year))))


def all_legs(atlas: Atlas, label: str, edition: int = 1) -> dict[str, list[Leg]]:
    """Every leg the facts support, by leg type: one per entity and clue of the edition (legs of
    one entity share its keys, so the splits stay disjoint)."""
    def clues(kind: str, x: Any) -> list[Clue]:
        if kind in ("element", "producer"):
            return element_clues(x, atlas, f"{label}.e", edition, producing=kind == "producer")
        # naming a language leg's country by its language would give away the leg's next hop
        return country_clues(x, atlas, f"{label}.c", edition, by_language=kind == "country")

    makers: dict[str, tuple[Callable[..., Leg | None], list[Any]]] = {
        "element": (element_leg, list(atlas.facts.elements)),
        "country": (country_leg, list(atlas.facts.countries)),
        "producer": (producer_leg, list(atlas.facts.elements)),
        "language": (language_leg, list(atlas.facts.countries)),
    }
    out = {}
    for kind, (make, entities) in makers.items():
        legs = (make(x, atlas, label, clue) for x in entities for clue in clues(kind, x))
        out[kind] = [leg for leg in legs if leg is not None]
    return out
