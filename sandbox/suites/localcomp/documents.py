"""Encyclopedia-style articles rendered from the facts.

Every article opens with a header line naming its docid and title, then a lead paragraph,
an infobox table (`| Field | Value |`, the entity's own facts) and prose sections. The prose
deliberately repeats look-alike facts about neighbours (the next element, the country next
in the alphabet, currencies with nearby codes): hard negatives for retrieval and reading.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from sandbox.suites.localcomp.atlas import Atlas
from sandbox.suites.localcomp.facts import Country, Currency, Element, Language, Subdivision, is_official


LIST_SEPARATOR = "; "  # between items of an infobox list: names such as "Korea, Republic of" hold commas


@dataclass(frozen=True)
class Document:
    docid: str
    key: str  # entity key: "element:17", "country:FR", "currency:EUR", "language:fr", "subdivision:FR-75"
    kind: str
    title: str
    text: str


def infobox(rows: list[tuple[str, str]]) -> str:
    lines = ["Infobox", "| Field | Value |", "| --- | --- |"]
    lines += [f"| {field} | {value} |" for field, value in rows if value not in ("", None)]
    return "\n".join(lines)


def header(docid: str, title: str, kind: str) -> str:
    return f"[{docid}] {title}\n{kind}"


def kelvin(value: float | None) -> str:
    return "" if value is None else f"{value:.2f} K"


def element_rows(e: Element, atlas: Atlas) -> list[tuple[str, str]]:
    return [
        ("Name", e.name), ("Symbol", e.symbol), ("Atomic number", str(e.number)),
        ("Standard atomic weight", f"{e.atomic_weight:g}"),
        ("Group", str(e.group or "none")), ("Period", str(e.period)), ("Block", e.block),
        ("Category", e.series), ("Electron configuration", e.configuration),
        ("Melting point", kelvin(e.melting_point)), ("Boiling point", kelvin(e.boiling_point)),
        ("Density", "" if e.density is None else f"{e.density:g} g/cm3"),
        ("Electronegativity (Pauling)", "" if e.electronegativity is None else f"{e.electronegativity:g}"),
        ("CAS number", e.cas), ("Discovered by", e.discoverers),
        ("Discovery year", str(e.discovery_year or "antiquity")),
        ("Discovery location", e.discovery_location or "unknown"),
        ("Top producers", LIST_SEPARATOR.join(atlas.country_name(p) for p in e.producers)),
    ]


def element_doc(docid: str, e: Element, atlas: Atlas) -> str:
    found = (f"It was discovered in {e.discovery_year} by {e.discoverers}"
             + (f" in {e.discovery_location}." if e.discovery_location else ".")
             if e.discovery_year else "It has been known since antiquity.")
    lead = (f"{e.name} is a chemical element with the symbol {e.symbol} and atomic number {e.number}. "
            f"It belongs to the {e.series.lower() or 'elements'}, in group {e.group or 'none'} "
            f"in period {e.period} "
            f"of the periodic table ({e.block}-block). {found}")
    iso = "\n".join(f"| {e.symbol}-{m} | {'' if a is None else f'{a:g} %'} | {life} |"
                    for m, a, life in e.isotopes)
    production = ("The leading producers are " + ", ".join(
        f"{i + 1}) {atlas.country_name(p)}" for i, p in enumerate(e.producers)) + "."
        if e.producers else "No production figures are recorded for it.")
    parts = [
        header(docid, e.name, "Chemical element"), lead, infobox(element_rows(e, atlas)),
        "== Description ==\n" + (e.description or f"{e.name} is little studied outside the laboratory."),
        "== Name ==\n" + (e.name_origin or "The origin of the name is not recorded."),
        "== Occurrence and production ==\n" + (e.sources or "It does not occur in nature in useful amounts.")
        + " " + production,
        "== Applications ==\n" + (e.uses or "It has no applications outside research."),
        "== Physical and atomic properties ==\n| Property | Value |\n| --- | --- |\n"
        + "\n".join(f"| {label} | {value} |" for label, value in e.properties),
        "== Ionization energies ==\n" + element_ionization(e),
        "== Isotopes ==\n| Isotope | Natural abundance | Half-life |\n| --- | --- | --- |\n" + iso,
        "== Neighbours in the periodic table ==\n" + element_neighbours(e, atlas),
    ]
    return "\n\n".join(parts)


def element_ionization(e: Element) -> str:
    states = ", ".join(f"{x:+d}" for x in e.oxidation_states) or "none recorded"
    if not e.ionization:
        return f"No ionization energies are recorded. Oxidation states: {states}."
    rows = "\n".join(f"| {i + 1} | {energy:.4f} eV |" for i, energy in enumerate(e.ionization))
    return f"Oxidation states: {states}.\n\n| Ionization | Energy |\n| --- | --- |\n" + rows


def element_neighbours(e: Element, atlas: Atlas) -> str:
    """Look-alike facts about nearby elements: the kind of text a careless reader confuses."""
    out = []
    for delta, where in ((-1, "precedes"), (1, "follows"), (-2, "comes two places before"),
                         (2, "comes two places after")):
        n = atlas.elements.get(e.number + delta)
        if n is None:
            continue
        found = (f"was discovered in {n.discovery_year} by {n.discoverers}" if n.discovery_year
                 else "has been known since antiquity")
        out.append(f"{n.name} ({n.symbol}, atomic number {n.number}) {where} {e.name.lower()}; it {found}, "
                   f"melts at {kelvin(n.melting_point) or 'an unmeasured temperature'} and boils at "
                   f"{kelvin(n.boiling_point) or 'an unmeasured temperature'}.")
    return " ".join(out)


def country_rows(c: Country, atlas: Atlas) -> list[tuple[str, str]]:
    main = atlas.main_language(c)
    official = [atlas.languages[code].name for code, _, status in c.languages
                if is_official(status) and code in atlas.languages]
    currency = atlas.currencies.get(c.currency or "")
    types: dict[str, int] = {}
    for s in atlas.subdivisions_of.get(c.alpha_2, ()):
        types[s.type] = types.get(s.type, 0) + 1
    return [
        ("Name", c.name), ("Official name", c.official_name or c.name),
        ("ISO 3166-1 alpha-2", c.alpha_2), ("ISO 3166-1 alpha-3", c.alpha_3),
        ("ISO 3166-1 numeric", c.numeric),
        ("Currency", currency.name if currency else "none"),
        ("Currency code", currency.code if currency else ""),
        ("Main official language", main.name if main else ""),
        ("Official languages", LIST_SEPARATOR.join(official)),
        ("ISO 3166-2 subdivisions", str(atlas.subdivision_count(c))),
        ("Subdivision types", ", ".join(f"{t.lower()}: {n}" for t, n in sorted(types.items()))),
    ]


def country_doc(docid: str, c: Country, atlas: Atlas) -> str:
    parts = [header(docid, c.name, "Country"), country_lead(c, atlas), infobox(country_rows(c, atlas))]
    langs = [f"| {atlas.languages[code].name if code in atlas.languages else code} | {share:g} % | "
             f"{status.replace('_', ' ')} |" for code, share, status in c.languages]
    if langs:
        parts.append("== Languages ==\n| Language | Share of population | Status |\n| --- | --- | --- |\n"
                     + "\n".join(langs))
    history = [f"{atlas.currencies[code].name} ({code})" + (" (current)" if end is None else " (former)")
               for code, _, end in c.currency_history if code in atlas.currencies]
    if history:
        parts.append("== Currency ==\n" + f"Legal tenders of {c.name}, oldest first: " + "; ".join(history)
                     + ". The years of adoption are given in the article on each currency.")
    subs = atlas.subdivisions_of.get(c.alpha_2, ())
    if subs:
        rows = "\n".join(f"| {s.code} | {s.name} | {s.type} |" for s in subs[:40])
        more = f"\n({len(subs) - 40} further entries are listed in ISO 3166-2.)" if len(subs) > 40 else ""
        parts.append("== Administrative divisions ==\n| Code | Name | Type |\n| --- | --- | --- |\n"
                     + rows + more)
    parts.append("== Elements ==\n" + country_elements(c, atlas))
    parts.append("== Not to be confused with ==\n" + country_neighbours(c, atlas))
    return "\n\n".join(parts)


def country_lead(c: Country, atlas: Atlas) -> str:
    currency = atlas.currencies.get(c.currency or "")
    main = atlas.main_language(c)
    return (f"{c.name}" + (f", officially the {c.official_name}," if c.official_name else "")
            + f" is a country or territory with the ISO 3166-1 code {c.alpha_2} ({c.alpha_3}, numeric "
            f"{c.numeric}). " + (f"Its legal tender is the {currency.name}. " if currency else "")
            + (f"Most of its people speak {main.name}, an official language. " if main else "")
            + f"ISO 3166-2 lists {atlas.subdivision_count(c)} subdivisions for it.")


def country_elements(c: Country, atlas: Atlas) -> str:
    found = ", ".join(e.name for e in atlas.discovered_in(c.alpha_2))
    made = ", ".join(e.name for e in atlas.produced_in(c.alpha_2))
    return ((f"Elements first identified in {c.name}: {found}. " if found else
             f"No chemical element was first identified in {c.name}. ")
            + (f"{c.name} ranks among the top three producers of: {made}." if made else ""))


def country_neighbours(c: Country, atlas: Atlas) -> str:
    ordered = sorted(atlas.countries.values(), key=lambda x: x.name)
    i = ordered.index(c)
    out = []
    for n in ordered[max(0, i - 2):i] + ordered[i + 1:i + 3]:
        cur = atlas.currencies.get(n.currency or "")
        out.append(f"{n.name} ({n.alpha_3}, numeric {n.numeric}) has {atlas.subdivision_count(n)} "
                   f"ISO 3166-2 subdivisions" + (f" and uses the {cur.name}." if cur else "."))
    return " ".join(out)


def currency_doc(docid: str, cur: Currency, atlas: Atlas) -> str:
    users = atlas.users_of(cur)
    rows = [("Name", cur.name), ("ISO 4217 code", cur.code), ("ISO 4217 numeric", cur.numeric),
            ("Symbol", cur.symbol), ("Countries using it", str(len(users)))]
    lead = (f"The {cur.name} ({cur.code}, numeric {cur.numeric}) is a currency"
            + (f" in use in {len(users)} countries or territories." if users else " no longer in use."))
    table = "\n".join(f"| {atlas.country_name(t)} | {start or 'unknown'} | {end or 'in use'} |"
                      for t, start, end in cur.adoptions)
    parts = [header(docid, cur.name, "Currency"), lead, infobox(rows)]
    if table:
        parts.append("== Adoption as legal tender ==\n| Country | Adopted | Until |\n| --- | --- | --- |\n"
                     + table)
    parts.append("== Not to be confused with ==\n" + currency_neighbours(cur, atlas))
    return "\n\n".join(parts)


def currency_neighbours(cur: Currency, atlas: Atlas) -> str:
    codes = sorted(atlas.currencies)
    i = codes.index(cur.code)
    out = []
    for code in codes[max(0, i - 2):i] + codes[i + 1:i + 3]:
        n = atlas.currencies[code]
        first = next(((t, s) for t, s, _ in n.adoptions if s), None)
        out.append(f"The {n.name} ({code}, numeric {n.numeric})"
                   + (f" was adopted by {atlas.country_name(first[0])} in {first[1]}." if first else "."))
    return " ".join(out)


def language_doc(docid: str, lang: Language, atlas: Atlas) -> str:
    rows = [("Name", lang.name), ("ISO 639-1", lang.alpha_2 or ""), ("ISO 639-2/T", lang.alpha_3 or ""),
            ("ISO 639-2/B", lang.bibliographic or ""), ("CLDR code", lang.code)]
    official = atlas.official_in.get(lang.code, ())
    spoken = atlas.spoken_in(lang.code)
    lead = (f"{lang.name} is a language with official status in {len(official)} countries or territories "
            f"and speakers recorded in {len(spoken)}.")
    table = "\n".join(f"| {atlas.country_name(t)} | {share:g} % | {status.replace('_', ' ')} |"
                      for t, share, status in spoken)
    return "\n\n".join([
        header(docid, lang.name, "Language"), lead, infobox(rows),
        "== Status by country ==\n| Country | Share of population | Status |\n| --- | --- | --- |\n" + table,
    ])


def subdivision_doc(docid: str, s: Subdivision, atlas: Atlas) -> str:
    country = atlas.countries.get(s.country)
    siblings = [x for x in atlas.subdivisions_of.get(s.country, ()) if x.code != s.code]
    pick = random.Random(s.code).sample(siblings, min(6, len(siblings)))
    rows = [("Name", s.name), ("ISO 3166-2 code", s.code), ("Type", s.type),
            ("Country", country.name if country else s.country), ("Parent", s.parent or "")]
    lead = (f"{s.name} ({s.code}) is a {s.type.lower()} of {country.name if country else s.country}"
            + (f", part of {s.parent}." if s.parent else "."))
    see = " ".join(f"{x.name} ({x.code}) is a {x.type.lower()} of the same country." for x in pick)
    return "\n\n".join([header(docid, s.name, "Administrative division"), lead, infobox(rows),
                        "== See also ==\n" + see])
