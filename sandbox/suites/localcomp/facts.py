"""The structured facts behind the corpus, extracted once from data shipped in PyPI packages.

Sources: mendeleev (elements, isotopes, phase transitions), pycountry (ISO 3166 countries and
subdivisions, ISO 4217 currencies, ISO 639 languages) and babel (CLDR: which currency a
territory used from which year, which languages are official where and by what share of the
population). mendeleev takes seconds to load, so `extract_facts` runs at build time only and
the result is kept as JSON in the data folder.
"""
from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import asdict, dataclass
from typing import Any

# mendeleev names producers and discovery places loosely; these map to ISO 3166 alpha-2.
_PLACE_ALIASES = {
    "USA": "US", "United States": "US", "DRC": "CD", "Russia": "RU", "USSR": "RU",
    "England": "GB", "Scotland": "GB", "Great Britain": "GB", "Republic of Korea": "KR",
    "Kyrgzstan": "KG", "Germany (likely)": "DE", "Turkey": "TR", "Bolivia": "BO",
}
_OFFICIAL = ("official", "de_facto_official")
_SOURCES = ("mendeleev", "pycountry", "babel")
FACTS_VERSION = 2  # bump when the extracted fields change: the JSON file name carries it


@dataclass(frozen=True)
class Element:
    number: int
    symbol: str
    name: str
    atomic_weight: float
    group: int | None
    period: int
    block: str
    series: str
    discovery_year: int | None
    discoverers: str
    discovery_location: str | None
    discovery_country: str | None  # alpha-2, only for a single-country discovery
    melting_point: float | None  # kelvin
    boiling_point: float | None  # kelvin
    density: float | None
    cas: str
    configuration: str
    electronegativity: float | None
    producers: tuple[str, ...]  # alpha-2 of the top producers, in rank order
    description: str
    name_origin: str
    sources: str
    uses: str
    isotopes: tuple[tuple[int, float | None, str], ...]  # mass number, abundance %, half-life
    properties: tuple[tuple[str, str], ...]  # (label, value with unit), already formatted
    ionization: tuple[float, ...]  # eV, first ionization energy first
    oxidation_states: tuple[int, ...]


@dataclass(frozen=True)
class Subdivision:
    code: str
    name: str
    type: str
    country: str  # alpha-2
    parent: str | None


@dataclass(frozen=True)
class Country:
    alpha_2: str
    alpha_3: str
    numeric: str
    name: str
    official_name: str | None
    common_name: str | None
    currency: str | None  # ISO 4217 code of the current legal tender
    currency_history: tuple[tuple[str, int | None, int | None], ...]  # code, from, to
    languages: tuple[tuple[str, float, str], ...]  # CLDR code, population %, status


@dataclass(frozen=True)
class Currency:
    code: str
    numeric: str
    name: str
    symbol: str
    adoptions: tuple[tuple[str, int | None, int | None], ...]  # country alpha-2, from, to


@dataclass(frozen=True)
class Language:
    code: str  # CLDR code (may carry a script, e.g. zh_Hant)
    name: str
    alpha_2: str | None
    alpha_3: str | None
    bibliographic: str | None


@dataclass(frozen=True)
class Facts:
    elements: tuple[Element, ...]
    countries: tuple[Country, ...]
    subdivisions: tuple[Subdivision, ...]
    currencies: tuple[Currency, ...]
    languages: tuple[Language, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Facts:
        return cls(
            elements=tuple(Element(**_tuples(e)) for e in data["elements"]),
            countries=tuple(Country(**_tuples(c)) for c in data["countries"]),
            subdivisions=tuple(Subdivision(**s) for s in data["subdivisions"]),
            currencies=tuple(Currency(**_tuples(c)) for c in data["currencies"]),
            languages=tuple(Language(**lang) for lang in data["languages"]),
        )


def _tuples(record: dict[str, Any]) -> dict[str, Any]:
    """JSON turns tuples into lists; frozen dataclasses want them back (hashable, immutable)."""
    return {k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
            for k, v in record.items()}


def _num(value: Any) -> float | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return float(value)


def _text(value: Any) -> str:
    return value.strip() if isinstance(value, str) else ""


def _alpha2(place: str) -> str | None:
    import pycountry

    place = place.strip()
    if place in _PLACE_ALIASES:
        return _PLACE_ALIASES[place]
    country = pycountry.countries.get(name=place) or pycountry.countries.get(common_name=place)
    return country.alpha_2 if country else None


def extract_facts() -> Facts:
    """Read the facts from the installed packages; ValueError names any that are missing."""
    missing = [name for name in _SOURCES if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"localcomp is built from {', '.join(_SOURCES)}; missing: {', '.join(missing)} "
                         f"(pip install {' '.join(missing)})")
    return Facts(
        elements=_elements(),
        countries=_countries(),
        subdivisions=_subdivisions(),
        currencies=_currencies(),
        languages=_languages(),
    )


# (column, label, unit): the physical and supply data shown in an element's property table
_PROPERTIES = (
    ("atomic_radius", "Atomic radius", "pm"), ("covalent_radius_pyykko", "Covalent radius", "pm"),
    ("vdw_radius", "Van der Waals radius", "pm"), ("electron_affinity", "Electron affinity", "eV"),
    ("dipole_polarizability", "Dipole polarizability", "a.u."), ("fusion_heat", "Heat of fusion", "kJ/mol"),
    ("evaporation_heat", "Heat of vaporization", "kJ/mol"),
    ("heat_of_formation", "Heat of formation", "kJ/mol"),
    ("thermal_conductivity", "Thermal conductivity", "W/(m K)"),
    ("specific_heat_capacity", "Specific heat capacity", "J/(g K)"),
    ("molar_heat_capacity", "Molar heat capacity", "J/(mol K)"),
    ("lattice_structure", "Lattice structure", ""), ("lattice_constant", "Lattice constant", "angstrom"),
    ("abundance_crust", "Abundance in the crust", "mg/kg"),
    ("abundance_sea", "Abundance in sea water", "mg/L"), ("goldschmidt_class", "Goldschmidt class", ""),
    ("geochemical_class", "Geochemical class", ""), ("mendeleev_number", "Mendeleev number", ""),
    ("pettifor_number", "Pettifor number", ""), ("price_per_kg", "Price", "USD/kg"),
    ("relative_supply_risk", "Relative supply risk", ""), ("recycling_rate", "Recycling rate", "%"),
    ("substitutability", "Substitutability", ""), ("top_3_reserve_holders", "Largest reserves", ""),
)


def _properties(r: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    out = []
    for column, label, unit in _PROPERTIES:
        value = r.get(column)
        text = f"{_num(value):g}" if not isinstance(value, str) and _num(value) is not None else _text(value)
        if text:
            out.append((label, f"{text} {unit}".strip()))
    return tuple(out)


def _elements() -> tuple[Element, ...]:
    from mendeleev.fetch import fetch_table

    table = fetch_table("elements")
    series = {r["id"]: r["name"] for r in fetch_table("series").to_dict("records")}
    phases: dict[int, dict[str, Any]] = {}
    for row in fetch_table("phasetransitions").sort_values("id").to_dict("records"):
        phases.setdefault(int(row["atomic_number"]), row)  # the first allotrope listed
    isotopes: dict[int, list[tuple[int, float | None, str]]] = {}
    for row in fetch_table("isotopes").sort_values(["atomic_number", "mass_number"]).to_dict("records"):
        half, abundance = _num(row["half_life"]), _num(row["abundance"])
        life = (f"{half:.4g} {_text(row['half_life_unit'])}".strip() if half is not None
                else "stable" if abundance else "not measured")
        isotopes.setdefault(int(row["atomic_number"]), []).append(
            (int(row["mass_number"]), abundance, life))
    ionization: dict[int, list[float]] = {}
    energies = fetch_table("ionizationenergies").sort_values(["atomic_number", "ion_charge"])
    for row in energies.to_dict("records"):
        if _num(row["ionization_energy"]) is not None:
            ionization.setdefault(int(row["atomic_number"]), []).append(float(row["ionization_energy"]))
    oxidation: dict[int, list[int]] = {}
    states = fetch_table("oxidationstates").sort_values(["atomic_number", "oxidation_state"])
    for row in states.to_dict("records"):
        oxidation.setdefault(int(row["atomic_number"]), []).append(int(row["oxidation_state"]))
    out = []
    for r in table.to_dict("records"):
        z = int(r["atomic_number"])
        out.append(Element(**_element(r, series, phases.get(z, {}), isotopes.get(z, [])),
                           ionization=tuple(ionization.get(z, [])[:8]),
                           oxidation_states=tuple(oxidation.get(z, []))))
    return tuple(out)


def _element(r: dict[str, Any], series: dict[int, str], phase: dict[str, Any],
             isotopes: list[tuple[int, float | None, str]]) -> dict[str, Any]:
    location = _text(r["discovery_location"]) or None
    single = location if location and "/" not in location else None
    producers = [p for p in re.split(r"\s*\d\)\s*", _text(r["top_3_producers"])) if p.strip()]
    year = _num(r["discovery_year"])
    group = _num(r["group_id"])
    return dict(
        number=int(r["atomic_number"]), symbol=r["symbol"], name=r["name"],
        atomic_weight=float(r["atomic_weight"]), group=int(group) if group else None,
        period=int(r["period"]), block=r["block"], series=series.get(r["series_id"], ""),
        discovery_year=int(year) if year else None,
        discoverers=_text(r["discoverers"]).rstrip("."),
        discovery_location=location, discovery_country=_alpha2(single) if single else None,
        melting_point=_num(phase.get("melting_point")), boiling_point=_num(phase.get("boiling_point")),
        density=_num(r["density"]), cas=_text(r["cas"]),
        configuration=_text(r["electronic_configuration"]), electronegativity=_num(r["en_pauling"]),
        producers=tuple(a for a in (_alpha2(p) for p in producers) if a),
        description=_text(r["description"]), name_origin=_text(r["name_origin"]),
        sources=_text(r["sources"]), uses=_text(r["uses"]),
        isotopes=tuple(isotopes[:14]), properties=_properties(r),
    )


def _countries() -> tuple[Country, ...]:
    import pycountry
    from babel.core import get_global

    tender = get_global("territory_currencies")
    official = get_global("territory_languages")
    out = []
    for c in pycountry.countries:
        history = tuple((code, start[0] if start else None, end[0] if end else None)
                        for code, start, end, legal in tender.get(c.alpha_2, ()) if legal)
        current = [code for code, _, end in history if end is None]
        langs = sorted(((code, float(v["population_percent"]), v["official_status"] or "spoken")
                        for code, v in official.get(c.alpha_2, {}).items()),
                       key=lambda x: (-x[1], x[0]))
        out.append(Country(
            alpha_2=c.alpha_2, alpha_3=c.alpha_3, numeric=c.numeric, name=c.name,
            official_name=getattr(c, "official_name", None), common_name=getattr(c, "common_name", None),
            currency=current[-1] if current else None, currency_history=history,
            languages=tuple(langs[:12]),
        ))
    return tuple(out)


def _subdivisions() -> tuple[Subdivision, ...]:
    import pycountry

    return tuple(sorted((Subdivision(code=s.code, name=s.name, type=s.type, country=s.country_code,
                                     parent=getattr(s, "parent_code", None))
                         for s in pycountry.subdivisions), key=lambda s: s.code))


def _currencies() -> tuple[Currency, ...]:
    import pycountry
    from babel import Locale
    from babel.core import get_global
    from babel.numbers import get_currency_symbol

    english = Locale("en")
    adoptions: dict[str, list[tuple[str, int | None, int | None]]] = {}
    for territory, rows in sorted(get_global("territory_currencies").items()):
        if pycountry.countries.get(alpha_2=territory) is None:
            continue  # CLDR regions such as EU or ZZ are not countries
        for code, start, end, legal in rows:
            if legal:
                adoptions.setdefault(code, []).append(
                    (territory, start[0] if start else None, end[0] if end else None))
    return tuple(Currency(code=c.alpha_3, numeric=c.numeric,
                          name=english.currencies.get(c.alpha_3, c.name),
                          symbol=get_currency_symbol(c.alpha_3, "en"),
                          adoptions=tuple(adoptions.get(c.alpha_3, ())))
                 for c in sorted(pycountry.currencies, key=lambda c: c.alpha_3))


def _languages() -> tuple[Language, ...]:
    """Languages with an official status somewhere: the ones a question can route through."""
    import pycountry
    from babel import Locale
    from babel.core import get_global

    english = Locale("en")
    codes = sorted({code for langs in get_global("territory_languages").values()
                    for code, v in langs.items() if v["official_status"] in _OFFICIAL})
    out = []
    for code in codes:
        base = code.split("_")[0]
        iso = (pycountry.languages.get(alpha_2=base) if len(base) == 2
               else pycountry.languages.get(alpha_3=base))
        name = english.languages.get(code) or english.languages.get(base) or (iso.name if iso else code)
        out.append(Language(code=code, name=name, alpha_2=getattr(iso, "alpha_2", None),
                            alpha_3=getattr(iso, "alpha_3", None),
                            bibliographic=getattr(iso, "bibliographic", None)))
    return tuple(out)


def is_official(status: str) -> bool:
    return status in _OFFICIAL
