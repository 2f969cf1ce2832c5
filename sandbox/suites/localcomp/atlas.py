"""Lookups and derived relations over the facts: the links a multi-hop question walks along."""
from __future__ import annotations

from functools import cached_property

from sandbox.suites.localcomp.facts import (Country, Currency, Element, Facts, Language, Subdivision,
                                            is_official)


class Atlas:
    def __init__(self, facts: Facts):
        self.facts = facts
        self.elements = {e.number: e for e in facts.elements}
        self.countries = {c.alpha_2: c for c in facts.countries}
        self.currencies = {c.code: c for c in facts.currencies}
        self.languages = {lang.code: lang for lang in facts.languages}

    @cached_property
    def subdivisions_of(self) -> dict[str, tuple[Subdivision, ...]]:
        out: dict[str, list[Subdivision]] = {}
        for s in self.facts.subdivisions:
            out.setdefault(s.country, []).append(s)
        return {k: tuple(v) for k, v in out.items()}

    def subdivision_count(self, country: Country) -> int:
        return len(self.subdivisions_of.get(country.alpha_2, ()))

    def country_name(self, alpha_2: str) -> str:
        return self.countries[alpha_2].name

    def currency_adopted(self, country: Country) -> int | None:
        """The year the country's current currency became its legal tender."""
        if country.currency is None:
            return None
        for territory, start, end in self.currencies[country.currency].adoptions:
            if territory == country.alpha_2 and end is None:
                return start
        return None

    def main_language(self, country: Country) -> Language | None:
        """The official language spoken by the largest share of the population (None on a tie)."""
        official = [(share, code) for code, share, status in country.languages
                    if is_official(status) and code in self.languages]
        if not official:
            return None
        official.sort(reverse=True)
        if len(official) > 1 and official[0][0] == official[1][0]:
            return None
        return self.languages[official[0][1]]

    @cached_property
    def official_in(self) -> dict[str, tuple[tuple[str, float], ...]]:
        """Language code -> (country alpha-2, population share) where it is official, largest first."""
        out: dict[str, list[tuple[str, float]]] = {}
        for c in self.facts.countries:
            for code, share, status in c.languages:
                if is_official(status):
                    out.setdefault(code, []).append((c.alpha_2, share))
        return {k: tuple(sorted(v, key=lambda x: (-x[1], x[0]))) for k, v in out.items()}

    def spoken_in(self, code: str) -> tuple[tuple[str, float, str], ...]:
        rows = [(c.alpha_2, share, status) for c in self.facts.countries
                for lc, share, status in c.languages if lc == code]
        return tuple(sorted(rows, key=lambda x: (-x[1], x[0])))

    def discovered_in(self, alpha_2: str) -> tuple[Element, ...]:
        return tuple(e for e in self.facts.elements if e.discovery_country == alpha_2)

    def produced_in(self, alpha_2: str) -> tuple[Element, ...]:
        return tuple(e for e in self.facts.elements if alpha_2 in e.producers)

    def users_of(self, currency: Currency) -> tuple[str, ...]:
        return tuple(t for t, _, end in currency.adoptions if end is None)
